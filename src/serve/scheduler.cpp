#include "serve/scheduler.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include <fmt/format.h>
#include <omp.h>

#include "eval/logprob.hpp"
#include "posenc/error.hpp"

namespace posenc::serve::detail {

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

std::size_t common_prefix(const std::vector<int32_t>& a, const std::vector<int32_t>& b) {
  const std::size_t n = std::min(a.size(), b.size());
  std::size_t i = 0;
  while (i < n && a[i] == b[i]) ++i;
  return i;
}

}  // namespace

int32_t sample_token(const float* row, int V, double temperature, double top_p, ::posenc::detail::Rng& rng) {
  double mx = row[0];
  for (int i = 1; i < V; ++i) mx = std::max(mx, static_cast<double>(row[i]));
  std::vector<double> p(static_cast<std::size_t>(V));
  double sum = 0;
  for (int i = 0; i < V; ++i) sum += p[static_cast<std::size_t>(i)] = std::exp((row[i] - mx) / temperature);
  std::vector<int32_t> idx(static_cast<std::size_t>(V));
  std::iota(idx.begin(), idx.end(), 0);
  std::size_t keep = idx.size();
  if (top_p < 1.0) {
    std::sort(idx.begin(), idx.end(), [&](int32_t a, int32_t b) {
      const double pa = p[static_cast<std::size_t>(a)], pb = p[static_cast<std::size_t>(b)];
      return pa > pb || (pa == pb && a < b);
    });
    double cum = 0;
    keep = 0;
    while (keep < idx.size()) {
      cum += p[static_cast<std::size_t>(idx[keep++])];
      if (cum >= top_p * sum) break;
    }
  }
  double total = 0;
  for (std::size_t i = 0; i < keep; ++i) total += p[static_cast<std::size_t>(idx[i])];
  const double r = rng.uniform01() * total;
  double acc = 0;
  for (std::size_t i = 0; i < keep; ++i) {
    acc += p[static_cast<std::size_t>(idx[i])];
    if (r < acc) return idx[i];
  }
  return idx[keep - 1];
}

std::vector<std::pair<int32_t, double>> top_logprobs(const float* row, int V, int k) {
  // detail::log_prob's arithmetic: max and the sum of exp in double, in index order.
  double mx = row[0];
  for (int j = 1; j < V; ++j) mx = std::max(mx, static_cast<double>(row[j]));
  double z = 0.0;
  for (int j = 0; j < V; ++j) z += std::exp(static_cast<double>(row[j]) - mx);
  const double lz = std::log(z);
  k = std::min(k, V);
  std::vector<int32_t> idx(static_cast<std::size_t>(V));
  std::iota(idx.begin(), idx.end(), 0);
  std::partial_sort(idx.begin(), idx.begin() + k, idx.end(),
                    [&](int32_t a, int32_t b) { return row[a] > row[b] || (row[a] == row[b] && a < b); });
  std::vector<std::pair<int32_t, double>> out;
  for (int i = 0; i < k; ++i) {
    const int32_t t = idx[static_cast<std::size_t>(i)];
    out.emplace_back(t, static_cast<double>(row[t]) - mx - lz);
  }
  return out;
}

Scheduler::Scheduler(const Model& model, const Tokenizer& tokenizer, const ServeConfig& config, int64_t max_model_len,
                     Metrics& metrics)
    : model_(model),
      tok_(tokenizer),
      cfg_(config),
      max_model_len_(max_model_len),
      block_size_(config.block_size),
      max_blocks_(0),
      metrics_(metrics),
      eos_(tokenizer.eos_id()),
      V_(model.config().vocab_size),
      cache_(model.make_cache(config.block_size)) {
  const int64_t tokens = config.kv_cache_tokens > 0 ? config.kv_cache_tokens : (config.max_batch + 4) * max_model_len;
  max_blocks_ = (tokens + block_size_ - 1) / block_size_;
  cache_ = model.make_cache(block_size_, max_blocks_);
  thread_ = std::thread([this] { run(); });
}

Scheduler::~Scheduler() { drain(); }

void Scheduler::submit(const std::shared_ptr<Job>& job) {
  {
    std::lock_guard lk(mu_);
    if (draining_)
      throw RequestError(503, "service_unavailable", "", "the server is shutting down (draining); retry elsewhere");
    if (static_cast<int64_t>(queue_.size()) >= cfg_.max_queue)
      throw RequestError(503, "service_unavailable", "",
                         fmt::format("the queue is full ({} requests waiting, max_queue {}); retry after {} s",
                                     queue_.size(), cfg_.max_queue, cfg_.retry_after_seconds));
    queue_.push_back(job);
  }
  cv_.notify_all();
}

void Scheduler::drain() {
  {
    std::lock_guard lk(mu_);
    draining_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void Scheduler::fill_stats(ServerStats& s) const {
  {
    std::lock_guard lk(mu_);
    s.queue_depth = static_cast<int64_t>(queue_.size());
  }
  s.running_sequences = running_count_.load();
  s.kv_blocks_in_use = kv_blocks_in_use_.load();
  s.prefix_cache_sequences = prefix_count_.load();
}

int64_t Scheduler::cache_blocks() const {
  int64_t n = 0;
  for (const auto& p : prefixes_) n += blocks_needed(static_cast<int64_t>(p.tokens.size()));
  return n;
}

void Scheduler::drop_prefix(std::list<CachedPrefix>::iterator it) {
  cache_.free(it->seq);
  prefixes_.erase(it);
}

bool Scheduler::admit_one(const std::shared_ptr<Job>& jp) {
  Job& job = *jp;
  const int64_t P = static_cast<int64_t>(job.prompt.size());
  const int64_t need = blocks_needed(P + job.max_tokens);
  int64_t reserved = 0;
  for (const auto& r : running_) reserved += r->reserved_blocks;
  // The cached sequence with the longest common prefix (at most P - 1 tokens: the last prompt token is always
  // computed, its row gives the first new token). A request that needs prompt logprobs (echo) reuses n tokens only
  // when the prefix kept the rows of targets 1..n (its own prompt rows, with at least as many alternatives): the
  // rows of a position depend on the tokens up to it only (the forward is batch- and chunk-invariant), so the
  // cached entries are the ones a fresh prefill would compute. Target n's token must match too: n <= common - 1.
  auto best = prefixes_.end();
  std::size_t best_len = 0;
  for (auto it = prefixes_.begin(); it != prefixes_.end(); ++it) {
    std::size_t c = std::min(common_prefix(it->tokens, job.prompt), job.prompt.size() - 1);
    if (job.prompt_rows()) {
      if (it->lp.empty() || it->lp_top < *job.logprobs) continue;
      const std::size_t common = common_prefix(it->tokens, job.prompt);
      c = std::min({common > 0 ? common - 1 : 0, job.prompt.size() - 1, it->lp.size() - 1});
    }
    if (c > best_len) {
      best_len = c;
      best = it;
    }
  }
  // Room: evict cached prefixes (least recently used first, the chosen one last).
  while (reserved + need + cache_blocks() > max_blocks_ && !prefixes_.empty()) {
    auto victim = std::prev(prefixes_.end());
    if (victim == best && prefixes_.size() > 1) victim = std::prev(victim);
    if (victim == best) {
      best = prefixes_.end();
      best_len = 0;
    }
    drop_prefix(victim);
  }
  if (reserved + need + cache_blocks() > max_blocks_) return false;
  job.reserved_blocks = need;
  if (best != prefixes_.end()) {
    job.seq = cache_.fork(best->seq);
    const int64_t n = static_cast<int64_t>(best_len);
    if (cache_.next_position(job.seq) > n) cache_.evict(job.seq, n, std::numeric_limits<int64_t>::max());
    job.kv_tokens.assign(job.prompt.begin(), job.prompt.begin() + n);
    job.fed = job.reused = n;
    best->last_used = ++clock_;
    prefixes_.splice(prefixes_.begin(), prefixes_, best);
  } else {
    job.seq = cache_.create();
  }
  job.rng = ::posenc::detail::Rng(job.seed);
  if (job.prompt_rows()) {
    job.prompt_lp.resize(static_cast<std::size_t>(P));
    for (int64_t i = 0; i < P; ++i) job.prompt_lp[static_cast<std::size_t>(i)].id = job.prompt[static_cast<std::size_t>(i)];
    if (best != prefixes_.end())
      for (int64_t t = 1; t <= job.reused; ++t) {
        TokenLogprob& e = job.prompt_lp[static_cast<std::size_t>(t)];
        const TokenLogprob& cached = best->lp[static_cast<std::size_t>(t)];
        e.logprob = cached.logprob;
        e.top.assign(cached.top.begin(), cached.top.begin() + std::min<std::ptrdiff_t>(
                                                                  *job.logprobs, static_cast<std::ptrdiff_t>(cached.top.size())));
      }
  }
  job.text_prev = job.prompt.back();
  metrics_.add_tokens(P, P - job.reused, job.reused > 0);
  running_.push_back(jp);
  return true;
}

void Scheduler::run() {
  if (cfg_.threads > 0) omp_set_num_threads(cfg_.threads);  // this thread's parallel regions (the forward steps)
  for (;;) {
    {
      std::unique_lock lk(mu_);
      // Admission between steps, in arrival order.
      while (static_cast<int>(running_.size()) < cfg_.max_batch && !queue_.empty()) {
        auto job = queue_.front();
        if (job->cancelled.load()) {
          queue_.pop_front();
          metrics_.cancelled();
          publish(*job);
          continue;
        }
        bool admitted = false;
        try {
          admitted = admit_one(job);
        } catch (const std::exception& e) {  // std::bad_alloc: this request is answered, the server keeps serving
          queue_.pop_front();
          fail(job, 500, fmt::format("admitting the request failed: {}", e.what()));
          continue;
        }
        if (!admitted) break;
        queue_.pop_front();
      }
      update_gauges();
      if (running_.empty()) {
        if (draining_ && queue_.empty()) break;
        cv_.wait(lk, [&] { return !queue_.empty() || draining_; });
        continue;
      }
    }
    try {
      step();  // answers a failed forward per request itself
    } catch (const std::exception& e) {
      // Anything else that failed in the step (std::bad_alloc sampling or publishing): the running requests' state
      // is not known, so each is answered 500 and its sequence freed; the server keeps serving.
      const auto jobs = running_;
      for (const auto& j : jobs) fail(j, 500, fmt::format("the step failed: {}", e.what()));
    }
    if (cfg_.step_delay.count() > 0) std::this_thread::sleep_for(cfg_.step_delay);
  }
  running_count_ = 0;
}

void Scheduler::step() {
  // Clients that left: free their sequences now.
  for (std::size_t i = 0; i < running_.size();) {
    if (running_[i]->cancelled.load()) {
      auto job = running_[i];
      running_.erase(running_.begin() + static_cast<std::ptrdiff_t>(i));
      cache_.free(job->seq);
      job->seq = -1;
      update_gauges();  // before the counter: whoever sees the cancellation sees the sequence gone
      metrics_.cancelled();
      publish(*job);
    } else {
      ++i;
    }
  }
  if (running_.empty()) return;
  // The step: every decode first (one token each), then prefill chunks in admission order within the token budget.
  struct Work {
    std::shared_ptr<Job> job;
    std::vector<int32_t> tokens;
    std::vector<int64_t> positions;
    bool prefill = false;
  };
  std::vector<Work> work;
  int64_t budget = cfg_.max_step_tokens;
  for (const auto& j : running_)
    if (j->pending >= 0) {
      work.push_back({j, {j->pending}, {static_cast<int64_t>(j->kv_tokens.size())}, false});
      --budget;
    }
  for (const auto& j : running_) {
    if (j->pending >= 0 || budget <= 0) continue;
    const int64_t P = static_cast<int64_t>(j->prompt.size());
    const int64_t n = std::min(P - j->fed, budget);
    Work w{j, {}, {}, true};
    w.tokens.assign(j->prompt.begin() + j->fed, j->prompt.begin() + j->fed + n);
    for (int64_t i = 0; i < n; ++i) w.positions.push_back(j->fed + i);
    budget -= n;
    work.push_back(std::move(w));
  }
  if (work.empty()) return;
  bool all_rows = false;
  std::vector<Model::SequenceInput> batch;
  for (const auto& w : work) {
    batch.push_back({w.job->seq, w.tokens, w.positions});
    all_rows = all_rows || (w.prefill && w.job->prompt_rows());
  }
  try {
    model_.forward(cache_, batch, all_rows ? Model::LogitsMode::all : Model::LogitsMode::last, logits_);
  } catch (const std::exception& e) {
    for (const auto& w : work) {
      fail(w.job, 500, fmt::format("the forward step failed: {}", e.what()));
    }
    return;
  }
  metrics_.step(static_cast<int64_t>(work.size()));
  std::size_t row = 0;
  for (auto& w : work) {
    Job& j = *w.job;
    const std::size_t n = w.tokens.size();
    const std::size_t last = all_rows ? row + n - 1 : row;
    // The rows this request reads (its prompt rows that predict a prompt token; the row it samples from): a NaN or
    // infinite logit there (float32 overflowed in the model) fails it alone (500 of type numeric_error, naming the
    // position: the same input fails the same way, so clients must not retry it), not the others of the step.
    const int64_t P = static_cast<int64_t>(j.prompt.size());
    const bool samples = !(w.prefill && j.fed + static_cast<int64_t>(n) < P) && j.max_tokens != 0;
    try {
      const auto where = [&](std::size_t i) {
        return [&, i](int64_t) { return fmt::format("position {}", w.positions[i]); };
      };
      if (w.prefill && j.prompt_rows())
        for (std::size_t i = 0; i < n; ++i)
          if (j.fed + static_cast<int64_t>(i) + 1 < P)
            ::posenc::detail::check_logits_finite(logits_.data() + (row + i) * static_cast<std::size_t>(V_), V_, V_,
                                                  where(i));
      if (samples)
        ::posenc::detail::check_logits_finite(logits_.data() + last * static_cast<std::size_t>(V_), V_, V_,
                                              where(n - 1));
    } catch (const NumericError& e) {
      fail(w.job, 500, fmt::format("the model's output is not finite: {}", e.what()), numeric_error_type);
      row = all_rows ? row + n : row + 1;
      continue;
    }
    if (w.prefill && j.prompt_rows())
      for (std::size_t i = 0; i < n; ++i) {
        const int64_t target = j.fed + static_cast<int64_t>(i) + 1;  // the prompt token this row predicts
        if (target < static_cast<int64_t>(j.prompt.size()))
          consume_row(j, logits_.data() + (row + i) * static_cast<std::size_t>(V_), true, target);
      }
    j.kv_tokens.insert(j.kv_tokens.end(), w.tokens.begin(), w.tokens.end());
    if (w.prefill) j.fed += static_cast<int64_t>(n);
    j.pending = -1;
    row = all_rows ? row + n : row + 1;
    if (w.prefill && j.fed < static_cast<int64_t>(j.prompt.size())) continue;  // more prompt to come
    sample_next(j, logits_.data() + last * static_cast<std::size_t>(V_));
  }
  // Finished sequences leave the batch.
  for (std::size_t i = 0; i < running_.size();) {
    if (!running_[i]->finish_reason.empty()) {
      auto job = running_[i];
      running_.erase(running_.begin() + static_cast<std::ptrdiff_t>(i));
      finish(job, true);
    } else {
      ++i;
    }
  }
}

void Scheduler::consume_row(Job& j, const float* row, bool prompt_row, int64_t target) {
  TokenLogprob& e = j.prompt_lp[static_cast<std::size_t>(target)];
  e.logprob = ::posenc::detail::log_prob(row, V_, e.id);
  if (*j.logprobs > 0) e.top = top_logprobs(row, V_, *j.logprobs);
}

void Scheduler::sample_next(Job& j, const float* row) {
  const int64_t P = static_cast<int64_t>(j.prompt.size());
  if (j.max_tokens == 0) {  // echo only
    j.finish_reason = "length";
    return;
  }
  const int32_t next = j.temperature == 0 ? ::posenc::detail::argmax(row, V_)
                                          : sample_token(row, V_, j.temperature, j.top_p, j.rng);
  if (!j.first_token_seconds) j.first_token_seconds = seconds_since(j.enqueued);
  if ((eos_ && next == *eos_) ||
      std::find(j.stop_token_ids.begin(), j.stop_token_ids.end(), next) != j.stop_token_ids.end()) {
    j.finish_reason = "stop";
    return;
  }
  j.generated.push_back(next);
  metrics_.add_generated(1);
  if (j.logprobs) {
    TokenLogprob e;
    e.id = next;
    e.logprob = ::posenc::detail::log_prob(row, V_, next);
    if (*j.logprobs > 0) e.top = top_logprobs(row, V_, *j.logprobs);
    j.gen_lp.push_back(std::move(e));
  }
  const std::size_t before = j.text.size();
  j.text += tok_.decode(j.text_prev, next);
  j.text_prev = next;
  if (!j.stop.empty()) {
    std::size_t longest = 0;
    for (const auto& s : j.stop) longest = std::max(longest, s.size());
    const std::size_t from = before >= longest ? before - longest + 1 : 0;
    std::size_t cut = std::string::npos;
    for (const auto& s : j.stop) cut = std::min(cut, j.text.find(s, from));
    if (cut != std::string::npos) {
      j.text.resize(cut);
      j.finish_reason = "stop";
      return;
    }
  }
  const int64_t G = static_cast<int64_t>(j.generated.size());
  if (G >= j.max_tokens || P + G >= max_model_len_) {
    j.finish_reason = "length";
    return;
  }
  j.pending = next;
}

void Scheduler::donate(Job& j) {
  if (cfg_.prefix_cache_entries <= 0 || j.kv_tokens.empty()) {
    cache_.free(j.seq);
    return;
  }
  // A cached sequence that is a prefix of this one is superseded; one that extends it makes this one useless.
  // Prompt rows (echo requests) go with the sequence that keeps the most of them.
  std::vector<TokenLogprob> lp;
  int lp_top = -1;
  if (j.prompt_rows()) {
    lp = j.prompt_lp;  // a copy: the answer is built from the job's own after this
    lp_top = *j.logprobs;
  }
  auto better = [](const std::vector<TokenLogprob>& a, int a_top, const std::vector<TokenLogprob>& b, int b_top) {
    return a.size() > b.size() || (a.size() == b.size() && a_top > b_top);
  };
  for (auto it = prefixes_.begin(); it != prefixes_.end();) {
    const std::size_t c = common_prefix(it->tokens, j.kv_tokens);
    if (c == j.kv_tokens.size()) {
      cache_.free(j.seq);
      if (better(lp, lp_top, it->lp, it->lp_top)) {
        it->lp = std::move(lp);
        it->lp_top = lp_top;
      }
      it->last_used = ++clock_;
      prefixes_.splice(prefixes_.begin(), prefixes_, it);
      return;
    }
    if (c == it->tokens.size()) {
      if (better(it->lp, it->lp_top, lp, lp_top)) {
        lp = std::move(it->lp);
        lp_top = it->lp_top;
      }
      auto dead = it++;
      drop_prefix(dead);
    } else {
      ++it;
    }
  }
  prefixes_.push_front({j.seq, j.kv_tokens, ++clock_, std::move(lp), lp_top});
  while (static_cast<int>(prefixes_.size()) > cfg_.prefix_cache_entries) drop_prefix(std::prev(prefixes_.end()));
}

void Scheduler::update_gauges() {
  running_count_ = static_cast<int64_t>(running_.size());
  kv_blocks_in_use_ = cache_.blocks_in_use();
  prefix_count_ = static_cast<int64_t>(prefixes_.size());
}

void Scheduler::finish(const std::shared_ptr<Job>& job, bool donate_seq) {
  if (job->seq >= 0) {
    if (donate_seq)
      donate(*job);
    else
      cache_.free(job->seq);
    job->seq = -1;
  }
  update_gauges();
  metrics_.completed(seconds_since(job->enqueued), job->first_token_seconds);
  publish(*job);
}

void Scheduler::fail(const std::shared_ptr<Job>& job, int status, const std::string& message, std::string_view type) {
  auto it = std::find(running_.begin(), running_.end(), job);
  if (it != running_.end()) running_.erase(it);
  if (job->seq >= 0 && cache_.contains(job->seq)) cache_.free(job->seq);
  job->seq = -1;
  job->error_status = status;
  job->error_type = std::string(type);
  job->error_message = message;
  update_gauges();
  publish(*job);
}

void Scheduler::publish(Job& job) {
  {
    std::lock_guard lk(job.m);
    job.done = true;
  }
  job.cv.notify_all();
}

}  // namespace posenc::serve::detail
