#include "serve/metrics.hpp"

#include <algorithm>

#include <fmt/format.h>

namespace posenc::serve::detail {

void Histogram::observe(double seconds) {
  const auto it = std::lower_bound(kBounds.begin(), kBounds.end(), seconds);
  ++counts_[static_cast<std::size_t>(it - kBounds.begin())];
  sum_ += seconds;
  ++count_;
}

std::string Histogram::render(const std::string& name) const {
  std::string out;
  int64_t cum = 0;
  for (std::size_t i = 0; i < kBounds.size(); ++i) {
    cum += counts_[i];
    out += fmt::format("{}_bucket{{le=\"{}\"}} {}\n", name, kBounds[i], cum);
  }
  cum += counts_[kBounds.size()];
  out += fmt::format("{}_bucket{{le=\"+Inf\"}} {}\n{}_sum {}\n{}_count {}\n", name, cum, name, sum_, name, count_);
  return out;
}

void Metrics::count_request(const std::string& endpoint, int status) {
  std::lock_guard lk(mu_);
  ++s_.requests[{endpoint, status}];
}

void Metrics::add_tokens(int64_t prompt, int64_t computed_prompt, bool prefix_hit) {
  std::lock_guard lk(mu_);
  s_.prompt_tokens += prompt;
  s_.computed_prompt_tokens += computed_prompt;
  if (prefix_hit) ++s_.prefix_cache_hits;
}

void Metrics::add_generated(int64_t n) {
  std::lock_guard lk(mu_);
  s_.generation_tokens += n;
}

void Metrics::completed(double seconds, std::optional<double> first_token_seconds) {
  std::lock_guard lk(mu_);
  ++s_.completed;
  s_.request_duration.observe(seconds);
  if (first_token_seconds) s_.time_to_first_token.observe(*first_token_seconds);
}

void Metrics::cancelled() {
  std::lock_guard lk(mu_);
  ++s_.cancelled;
}

void Metrics::step(int64_t sequences) {
  std::lock_guard lk(mu_);
  ++s_.steps;
  s_.max_step_sequences = std::max(s_.max_step_sequences, sequences);
}

MetricsSnapshot Metrics::snapshot() const {
  std::lock_guard lk(mu_);
  return s_;
}

std::string render_metrics(const MetricsSnapshot& s, int64_t queue_depth, int64_t running, int64_t kv_blocks_in_use,
                           int64_t kv_blocks_total, int64_t prefix_cache_sequences) {
  std::string o;
  auto metric = [&](const char* name, const char* type, const char* help) {
    o += fmt::format("# HELP {} {}\n# TYPE {} {}\n", name, help, name, type);
  };
  metric("posenc_requests_total", "counter", "HTTP requests answered, by endpoint and status code.");
  for (const auto& [key, n] : s.requests)
    o += fmt::format("posenc_requests_total{{endpoint=\"{}\",status=\"{}\"}} {}\n", key.first, key.second, n);
  metric("posenc_prompt_tokens_total", "counter", "Prompt tokens of admitted completions.");
  o += fmt::format("posenc_prompt_tokens_total {}\n", s.prompt_tokens);
  metric("posenc_prompt_tokens_computed_total", "counter",
         "Prompt tokens the forward computed (the rest came from the prefix cache).");
  o += fmt::format("posenc_prompt_tokens_computed_total {}\n", s.computed_prompt_tokens);
  metric("posenc_prefix_cache_hits_total", "counter", "Completions that started from a cached prompt prefix.");
  o += fmt::format("posenc_prefix_cache_hits_total {}\n", s.prefix_cache_hits);
  metric("posenc_generation_tokens_total", "counter", "Generated tokens.");
  o += fmt::format("posenc_generation_tokens_total {}\n", s.generation_tokens);
  metric("posenc_cancelled_requests_total", "counter", "Completions whose client disconnected before the answer.");
  o += fmt::format("posenc_cancelled_requests_total {}\n", s.cancelled);
  metric("posenc_steps_total", "counter", "Batched forward steps run.");
  o += fmt::format("posenc_steps_total {}\n", s.steps);
  metric("posenc_max_step_sequences", "gauge", "The most sequences one forward step has carried.");
  o += fmt::format("posenc_max_step_sequences {}\n", s.max_step_sequences);
  metric("posenc_queue_depth", "gauge", "Completions waiting for a batch slot.");
  o += fmt::format("posenc_queue_depth {}\n", queue_depth);
  metric("posenc_running_sequences", "gauge", "Completions in the running batch.");
  o += fmt::format("posenc_running_sequences {}\n", running);
  metric("posenc_kv_cache_blocks_in_use", "gauge", "KV cache blocks in use (running and prefix-cached sequences).");
  o += fmt::format("posenc_kv_cache_blocks_in_use {}\n", kv_blocks_in_use);
  metric("posenc_kv_cache_blocks_total", "gauge", "KV cache block budget.");
  o += fmt::format("posenc_kv_cache_blocks_total {}\n", kv_blocks_total);
  metric("posenc_prefix_cache_sequences", "gauge", "Finished sequences kept for prefix reuse.");
  o += fmt::format("posenc_prefix_cache_sequences {}\n", prefix_cache_sequences);
  metric("posenc_request_duration_seconds", "histogram", "Completion latency, from arrival to answer.");
  o += s.request_duration.render("posenc_request_duration_seconds");
  metric("posenc_time_to_first_token_seconds", "histogram", "From arrival to the first generated token.");
  o += s.time_to_first_token.render("posenc_time_to_first_token_seconds");
  return o;
}

}  // namespace posenc::serve::detail
