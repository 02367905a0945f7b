#include "posenc/perplexity.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>

#include <fmt/format.h>
#include <omp.h>

#include "core/parallel.hpp"
#include "posenc/error.hpp"

namespace posenc {

namespace {

bool is_ws(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f'; }

std::string_view strip(std::string_view s) {
  while (!s.empty() && is_ws(s.front())) s.remove_prefix(1);
  while (!s.empty() && is_ws(s.back())) s.remove_suffix(1);
  return s;
}

}  // namespace

std::vector<std::string> split_blocks(std::string_view text) {
  std::vector<std::string> blocks;
  std::string cur;
  bool open = false;
  auto flush = [&] {
    if (open) {
      blocks.emplace_back(strip(cur));
      cur.clear();
      open = false;
    }
  };
  std::size_t pos = 0;
  while (pos <= text.size()) {
    std::size_t nl = text.find('\n', pos);
    const bool last = nl == std::string_view::npos;
    std::string_view line = text.substr(pos, last ? std::string_view::npos : nl - pos);
    if (strip(line).empty()) {
      flush();
    } else {
      if (open) cur += '\n';
      cur += line;
      open = true;
    }
    if (last) break;
    pos = nl + 1;
  }
  flush();
  return blocks;
}

std::vector<int32_t> encode_stream(const Tokenizer& tokenizer, std::string_view text) {
  const auto blocks = split_blocks(text);
  if (blocks.empty()) throw InvalidArgument("text: holds no non-blank line, nothing to score");
  std::vector<std::vector<int32_t>> parts(blocks.size());
  detail::FirstException error;  // e.g. TokenizerError for a piece outside the vocabulary
#pragma omp parallel for schedule(dynamic, 16)
  for (std::size_t i = 0; i < blocks.size(); ++i) error.run([&] { parts[i] = tokenizer.encode(blocks[i], true, false); });
  error.rethrow();
  std::vector<int32_t> stream;
  for (const auto& p : parts) stream.insert(stream.end(), p.begin(), p.end());
  return stream;
}

std::vector<std::pair<int64_t, int64_t>> position_buckets(int64_t context) {
  std::vector<std::pair<int64_t, int64_t>> b;
  int64_t start = 0, end = 256;
  while (start < context) {
    b.emplace_back(start, end);
    start = end;
    end *= 2;
  }
  return b;
}

PplResult evaluate_perplexity(const Model& model, std::span<const int32_t> stream, const PplOptions& o) {
  const int64_t L = o.context;
  if (L < 2 || L > (int64_t{1} << 20)) fail_field<InvalidArgument>("context", "must be in [2, 1048576]", L);
  if (o.max_tokens < 0) fail_field<InvalidArgument>("max_tokens", "must be >= 0", o.max_tokens);
  const int64_t T = static_cast<int64_t>(stream.size());
  if (T < 2) fail_field<InvalidArgument>("text", "needs at least 2 tokens to score (tokens)", T);

  // Window starts; the last shorter window is kept if it has >= 2 tokens.
  std::vector<int64_t> starts;
  for (int64_t s = 0; s < T; s += L)
    if (std::min(L, T - s) >= 2) starts.push_back(s);
  if (o.max_tokens > 0) {
    // ceil(max_tokens / (L - 1)) without overflow: (max_tokens + L - 2) / (L - 1)
    // wrapped for max_tokens near INT64_MAX (a negative count, then resize to 2^64 - n).
    const int64_t keep = o.max_tokens / (L - 1) + (o.max_tokens % (L - 1) != 0 ? 1 : 0);
    if (static_cast<int64_t>(starts.size()) > keep) starts.resize(static_cast<std::size_t>(keep));
  }
  const auto edges = position_buckets(L);
  const std::size_t NB = edges.size();
  const std::size_t W = starts.size();
  std::vector<double> sums(W * NB, 0.0);
  std::vector<int64_t> counts(W * NB, 0);
  const int V = model.config().vocab_size;
  if (model.family() == PositionFamily::learned_absolute && model.config().max_position_embeddings > 0 &&
      std::min(L, T) > model.config().max_position_embeddings)
    throw PositionError(fmt::format(
        "context: {} positions are past the learned position table (max_position_embeddings {})", std::min(L, T),
        model.config().max_position_embeddings));

  const auto t0 = std::chrono::steady_clock::now();
  auto last_report = t0;
  int64_t done = 0, tokens_done = 0;

  detail::FirstException error;
#pragma omp parallel for schedule(dynamic, 1)
  for (std::size_t w = 0; w < W; ++w) {
    if (error.failed()) continue;
    const int64_t s = starts[w];
    const int64_t n = std::min(L, T - s);
    std::vector<float> logits;
    error.run([&] {
      logits = model.score_window(stream.subspan(static_cast<std::size_t>(s), static_cast<std::size_t>(n)));
    });
    if (error.failed()) continue;
    for (int64_t p = 0; p + 1 < n; ++p) {
      const float* row = logits.data() + p * V;
      double mx = row[0];
      for (int j = 1; j < V; ++j) mx = std::max(mx, static_cast<double>(row[j]));
      double z = 0.0;
      for (int j = 0; j < V; ++j) z += std::exp(static_cast<double>(row[j]) - mx);
      const double nll = mx + std::log(z) - static_cast<double>(row[stream[static_cast<std::size_t>(s + p + 1)]]);
      std::size_t b = 0;
      while (b + 1 < NB && p >= edges[b].second) ++b;
      sums[w * NB + b] += nll;
      counts[w * NB + b] += 1;
    }
#pragma omp critical(posenc_ppl_progress)
    {
      ++done;
      tokens_done += n - 1;
      if (o.on_progress && omp_get_thread_num() == 0) {
        const auto now = std::chrono::steady_clock::now();
        if (now - last_report >= std::chrono::seconds(1)) {
          last_report = now;
          o.on_progress({done, static_cast<int64_t>(W), tokens_done,
                         std::chrono::duration<double>(now - t0).count()});
        }
      }
    }
  }

  error.rethrow();

  PplResult r;
  r.context = L;
  const bool rope = model.family() == PositionFamily::rope;
  r.rope_scaling = rope ? model.rope().freqs.rope_type : "default";
  r.factor = rope ? model.rope().params.factor.value_or(1.0) : 1.0;
  r.windows = static_cast<int64_t>(W);
  r.buckets.resize(NB);
  double total = 0.0;
  for (std::size_t b = 0; b < NB; ++b) {
    r.buckets[b].start = edges[b].first;
    r.buckets[b].end = edges[b].second;
  }
  for (std::size_t w = 0; w < W; ++w)
    for (std::size_t b = 0; b < NB; ++b) {
      r.buckets[b].nll_sum += sums[w * NB + b];
      r.buckets[b].tokens += counts[w * NB + b];
    }
  for (const auto& b : r.buckets) {
    total += b.nll_sum;
    r.tokens += b.tokens;
  }
  r.nll = r.tokens > 0 ? total / static_cast<double>(r.tokens) : 0.0;
  r.ppl = std::exp(r.nll);
  if (o.on_progress)
    o.on_progress({static_cast<int64_t>(W), static_cast<int64_t>(W), r.tokens,
                   std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count()});
  return r;
}

bool is_rope_scaling_name(std::string_view name) {
  if (name == "native") return true;
  find_rope_scaling(name);  // throws ConfigError listing the known names
  return true;
}

RopeSetup rope_setup_for_context(const RopeSetup& base, int64_t trained_context, std::string_view rope_type,
                                 int64_t context, std::optional<double> factor) {
  if (trained_context <= 0)
    fail_field<InvalidArgument>("original_max_position_embeddings", "must be positive", trained_context);
  if (context <= 0) fail_field<InvalidArgument>("context", "must be positive", context);
  if (factor && (!std::isfinite(*factor) || *factor <= 0))
    fail_field<ConfigError>("rope_factor", "must be finite and > 0", *factor);
  RopeSetup r = base;
  if (rope_type == "native") {
    // The model's own parameters, exactly as loaded (or as --config set them).
    if (find_rope_scaling(base.params.rope_type).depends_on_seq_len)
      r.freqs = compute_rope_frequencies(base.params, context);
    return r;
  }
  RopeParams p = base.params;
  const bool same = p.rope_type == rope_type && p.rope_type != "default";
  p.rope_type = std::string(rope_type);
  if (same && !factor) {
    // The base already carries this method's real parameters (from the
    // checkpoint's config or --config): keep factor and original context.
    if (!p.original_max_position_embeddings) p.original_max_position_embeddings = trained_context;
    if (!p.max_position_embeddings) p.max_position_embeddings = trained_context;
  } else {
    const double s = factor ? *factor
                            : std::max(1.0, static_cast<double>(context) / static_cast<double>(trained_context));
    p.original_max_position_embeddings = trained_context;
    // HF's dynamic rule reads max_position_embeddings as the trained length.
    p.max_position_embeddings = trained_context;
    p.factor = rope_type == "default" ? std::optional<double>{} : std::optional<double>{s};
  }
  r.params = p;
  // Dynamic methods take the window length as the sequence length.
  r.freqs = compute_rope_frequencies(p, context);
  return r;
}

}  // namespace posenc

namespace posenc {

LayoutEvidence detect_rope_layout(const Model& model, std::span<const int32_t> stream, int64_t context,
                                  int64_t max_tokens) {
  if (model.family() != PositionFamily::rope)
    throw InvalidArgument(fmt::format("detect_rope_layout: the model uses {} positions, not RoPE",
                                      to_string(model.family())));
  LayoutEvidence e;
  e.context = context;
  PplOptions o;
  o.context = context;
  o.max_tokens = max_tokens;
  for (RopeLayout layout : {RopeLayout::half, RopeLayout::interleaved}) {
    Model m = model;
    RopeSetup r = m.rope();
    r.layout = layout;
    m.set_rope(r);
    const PplResult res = evaluate_perplexity(m, stream, o);
    (layout == RopeLayout::half ? e.nll_half : e.nll_interleaved) = res.nll;
    e.tokens = res.tokens;
  }
  e.likely = e.nll_half < e.nll_interleaved ? RopeLayout::half : RopeLayout::interleaved;
  e.margin = std::abs(e.nll_half - e.nll_interleaved);
  return e;
}

}  // namespace posenc
