#include "posenc/perplexity.hpp"

#include <algorithm>
#include <chrono>
#include <charconv>
#include <cmath>
#include <tuple>

#include <fmt/format.h>
#include <omp.h>

#include "core/parallel.hpp"
#include "posenc/error.hpp"

#include "eval/logprob.hpp"

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

std::vector<std::pair<int64_t, int64_t>> position_buckets(int64_t trained_context, int64_t context) {
  if (trained_context < 1) fail_field<InvalidArgument>("trained_context", "must be >= 1", trained_context);
  if (context < 1) fail_field<InvalidArgument>("context", "must be >= 1", context);
  std::vector<std::pair<int64_t, int64_t>> b;
  const int64_t half = trained_context / 2;
  int64_t start = 0, end = half > 0 ? half : trained_context;
  while (start < context) {
    b.emplace_back(start, end);
    start = end;
    end = start < trained_context ? trained_context : 2 * start;
  }
  return b;
}

std::vector<std::pair<int64_t, int64_t>> buckets_from_edges(std::span<const int64_t> edges, int64_t context) {
  if (edges.size() < 2)
    fail_field<InvalidArgument>("bucket_edges", "needs at least two edges (0 and the end of the first bucket)",
                                edges.size());
  if (edges[0] != 0) fail_field<InvalidArgument>("bucket_edges[0]", "must be 0", edges[0]);
  for (std::size_t i = 1; i < edges.size(); ++i)
    if (edges[i] <= edges[i - 1])
      fail_field<InvalidArgument>(fmt::format("bucket_edges[{}]", i),
                                  fmt::format("must be above the edge before it ({})", edges[i - 1]), edges[i]);
  if (context < 1) fail_field<InvalidArgument>("context", "must be >= 1", context);
  std::vector<std::pair<int64_t, int64_t>> b;
  for (std::size_t i = 0; i + 1 < edges.size() && edges[i] < context; ++i) b.emplace_back(edges[i], edges[i + 1]);
  if (context > edges.back()) b.emplace_back(edges.back(), context);
  return b;
}

std::vector<int64_t> parse_bucket_edges(std::string_view text, std::string_view flag) {
  std::vector<int64_t> edges;
  std::size_t pos = 0;
  while (true) {
    const std::size_t comma = text.find(',', pos);
    const std::string_view item = strip(text.substr(pos, comma == std::string_view::npos ? std::string_view::npos
                                                                                       : comma - pos));
    if (item.empty())
      throw ConfigError(fmt::format("{}: entry {} is empty (edges are comma-separated integers, e.g. 0,64,128; got "
                                    "'{}')",
                                    flag, edges.size() + 1, text));
    std::string_view num = item;
    int64_t mult = 1;
    if (num.back() == 'K' || num.back() == 'k') mult = 1024;
    if (num.back() == 'M' || num.back() == 'm') mult = int64_t{1} << 20;
    if (mult != 1) num.remove_suffix(1);
    int64_t v = 0;
    const auto [p, ec] = std::from_chars(num.data(), num.data() + num.size(), v);
    if (num.empty() || ec != std::errc() || p != num.data() + num.size() || v < 0 || v > (int64_t{1} << 40) / mult)
      throw ConfigError(fmt::format("{}: '{}' is not an edge (an integer in [0, 2^40], optional K or M suffix)", flag,
                                    item));
    edges.push_back(v * mult);
    if (comma == std::string_view::npos) break;
    pos = comma + 1;
  }
  if (edges.size() < 2)
    throw ConfigError(fmt::format("{}: needs at least two edges, 0 and the end of the first bucket (got '{}')", flag,
                                  text));
  if (edges[0] != 0) throw ConfigError(fmt::format("{}: the first edge must be 0 (got {})", flag, edges[0]));
  for (std::size_t i = 1; i < edges.size(); ++i)
    if (edges[i] <= edges[i - 1])
      throw ConfigError(fmt::format("{}: edges must increase ({} follows {})", flag, edges[i], edges[i - 1]));
  return edges;
}

namespace {

// splitmix64 (Steele, Lea, Flood 2014): a fixed, portable generator, so the
// bootstrap draws are the same on every platform and standard library.
uint64_t splitmix64(uint64_t& state) {
  uint64_t z = (state += 0x9e3779b97f4a7c15ULL);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

// Uniform in [0, n) without modulo bias (Lemire's multiply-shift with rejection).
uint64_t below(uint64_t& state, uint64_t n) {
  while (true) {
    const unsigned __int128 m = static_cast<unsigned __int128>(splitmix64(state)) * n;
    const auto low = static_cast<uint64_t>(m);
    if (low >= n || low >= (0 - n) % n) return static_cast<uint64_t>(m >> 64);
  }
}

// numpy.quantile's default (linear interpolation between order statistics).
double quantile_sorted(const std::vector<double>& v, double q) {
  const double h = (static_cast<double>(v.size()) - 1.0) * q;
  const auto lo = static_cast<std::size_t>(std::floor(h));
  const std::size_t hi = std::min(lo + 1, v.size() - 1);
  return v[lo] + (h - static_cast<double>(lo)) * (v[hi] - v[lo]);
}

}  // namespace

std::pair<double, double> bootstrap_mean_interval(std::span<const double> sums, std::span<const int64_t> counts,
                                                  int resamples, uint64_t seed) {
  if (sums.size() != counts.size())
    throw InvalidArgument(fmt::format("bootstrap_mean_interval: {} sums for {} counts", sums.size(), counts.size()));
  if (resamples < 1) fail_field<InvalidArgument>("bootstrap_resamples", "must be >= 1", resamples);
  std::size_t holding = 0;
  double total = 0.0;
  int64_t n = 0;
  for (std::size_t w = 0; w < counts.size(); ++w) {
    if (counts[w] < 0) fail_field<InvalidArgument>(fmt::format("counts[{}]", w), "must be >= 0", counts[w]);
    holding += counts[w] > 0 ? 1 : 0;
    total += sums[w];
    n += counts[w];
  }
  if (holding == 0) return {0.0, 0.0};
  const double mean = total / static_cast<double>(n);
  if (holding == 1) return {mean, mean};
  const uint64_t W = counts.size();
  std::vector<double> means;
  means.reserve(static_cast<std::size_t>(resamples));
  uint64_t state = seed;
  for (int r = 0; r < resamples; ++r) {
    double s = 0.0;
    int64_t c = 0;
    for (uint64_t k = 0; k < W; ++k) {
      const auto w = static_cast<std::size_t>(below(state, W));
      s += sums[w];
      c += counts[w];
    }
    if (c > 0) means.push_back(s / static_cast<double>(c));
  }
  if (means.empty()) return {mean, mean};
  std::sort(means.begin(), means.end());
  return {quantile_sorted(means, 0.025), quantile_sorted(means, 0.975)};
}

int64_t ppl_auto_chunk_tokens(int64_t vocab_size) {
  if (vocab_size < 1) fail_field<InvalidArgument>("vocab_size", "must be >= 1", vocab_size);
  return std::max<int64_t>(16, (int64_t{64} << 20) / (int64_t{4} * vocab_size) / 16 * 16);
}

namespace {

// Protocol steps 3 and 5 (the windows) with the options checked.
struct PplPlan {
  int64_t context = 0;
  int64_t trained = 0;
  std::vector<std::pair<int64_t, int64_t>> edges;
  std::vector<PplWindow> windows;
};

PplPlan plan_perplexity(int64_t trained_context, int64_t stream_size, const PplOptions& o) {
  PplPlan plan;
  const int64_t L = o.context;
  if (L < 2 || L > (int64_t{1} << 20)) fail_field<InvalidArgument>("context", "must be in [2, 1048576]", L);
  if (o.max_tokens < 0) fail_field<InvalidArgument>("max_tokens", "must be >= 0", o.max_tokens);
  if (o.bootstrap_resamples < 1 || o.bootstrap_resamples > 1000000)
    fail_field<InvalidArgument>("bootstrap_resamples", "must be in [1, 1000000]", o.bootstrap_resamples);
  const int64_t trained = trained_context > 0 ? trained_context : L;
  plan.context = L;
  plan.trained = trained;
  plan.edges = o.bucket_edges.empty() ? position_buckets(trained, L) : buckets_from_edges(o.bucket_edges, L);
  const int64_t T = stream_size;
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
  if (o.fine_bins_per_bucket < 0 || o.fine_bins_per_bucket > 64)
    fail_field<InvalidArgument>("fine_bins_per_bucket", "must be in [0, 64]", o.fine_bins_per_bucket);
  if (o.chunk_tokens < 0) fail_field<InvalidArgument>("chunk_tokens", "must be >= 0 (0 = automatic)", o.chunk_tokens);
  if (!(o.progress_interval_seconds >= 0) || !std::isfinite(o.progress_interval_seconds))
    fail_field<InvalidArgument>("progress_interval_seconds", "must be finite and >= 0", o.progress_interval_seconds);
  for (int64_t s : starts) plan.windows.push_back({s, std::min(L, T - s)});
  return plan;
}

// Protocol steps 4 and 6 from every window's per-prediction NLL.
PplResult finish_perplexity(const PplPlan& plan, const std::vector<std::vector<double>>& window_nll,
                            const PplOptions& o, std::chrono::steady_clock::time_point t0) {
  const int64_t L = plan.context;
  const std::size_t W = plan.windows.size();
  PplResult r;
  r.context = L;
  r.trained_context = plan.trained;
  r.windows = static_cast<int64_t>(W);
  // Per bucket: sums in window order, each window's in position order (the
  // result does not depend on the thread count); step 6: one bootstrap per
  // bucket over the windows' (sum, count) pairs, each bucket with its own
  // seed so that adding a bucket changes no other bucket's interval.
  auto make_buckets = [&](const std::vector<std::pair<int64_t, int64_t>>& edges) {
    const std::size_t NB = edges.size();
    std::vector<PplBucket> out(NB);
    std::vector<double> sums(W * NB, 0.0);
    std::vector<int64_t> counts(W * NB, 0);
    for (std::size_t w = 0; w < W; ++w) {
      std::size_t b = 0;
      for (std::size_t p = 0; p < window_nll[w].size(); ++p) {
        while (b + 1 < NB && static_cast<int64_t>(p) >= edges[b].second) ++b;
        sums[w * NB + b] += window_nll[w][p];
        counts[w * NB + b] += 1;
      }
    }
    std::vector<double> ws(W);
    std::vector<int64_t> wc(W);
    for (std::size_t b = 0; b < NB; ++b) {
      out[b].start = edges[b].first;
      out[b].end = edges[b].second;
      for (std::size_t w = 0; w < W; ++w) {
        ws[w] = sums[w * NB + b];
        wc[w] = counts[w * NB + b];
        out[b].nll_sum += ws[w];
        out[b].tokens += wc[w];
        out[b].windows += wc[w] > 0 ? 1 : 0;
      }
      const uint64_t seed = o.bootstrap_seed ^ (static_cast<uint64_t>(out[b].start) * 0xd1b54a32d192ed03ULL);
      std::tie(out[b].nll_ci_low, out[b].nll_ci_high) = bootstrap_mean_interval(ws, wc, o.bootstrap_resamples, seed);
    }
    return out;
  };
  r.buckets = make_buckets(plan.edges);
  if (o.fine_bins_per_bucket > 0) {
    // Each bucket cut into equal bins (as equal as integers allow; none empty),
    // the last bucket only up to L.
    std::vector<std::pair<int64_t, int64_t>> fine;
    for (const auto& [a, b] : plan.edges) {
      const int64_t e = std::min(b, L - 1);  // positions p < L - 1 hold predictions
      const int64_t k = std::min<int64_t>(o.fine_bins_per_bucket, std::max<int64_t>(1, e - a));
      for (int64_t i = 0; i < k; ++i) {
        const int64_t lo = a + (e - a) * i / k, hi = i + 1 == k ? b : a + (e - a) * (i + 1) / k;
        if (hi > lo) fine.emplace_back(lo, hi);
      }
    }
    r.fine_buckets = make_buckets(fine);
  }
  double total = 0.0;
  for (const auto& b : r.buckets) {
    total += b.nll_sum;
    r.tokens += b.tokens;
  }
  r.nll = r.tokens > 0 ? total / static_cast<double>(r.tokens) : 0.0;
  r.ppl = std::exp(r.nll);
  if (o.on_progress)
    o.on_progress({static_cast<int64_t>(W), static_cast<int64_t>(W), r.tokens,
                   std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), r.tokens});
  return r;
}

/// Thrown out of a window's chunk callback to stop it when another window has failed (never rethrown: the first
/// exception is).
struct WindowAbandoned {};

// Protocol steps 3-5 with `model`: every window's per-prediction NLL (position order), windows in parallel.
std::vector<std::vector<double>> score_model_windows(const Model& model, std::span<const int32_t> stream,
                                                     const PplPlan& plan, const PplOptions& o,
                                                     std::chrono::steady_clock::time_point t0) {
  const int64_t L = plan.context, T = static_cast<int64_t>(stream.size());
  const std::size_t W = plan.windows.size();
  std::vector<std::vector<double>> window_nll(W);  // per prediction, in position order
  const int V = model.config().vocab_size;
  if (model.family() == PositionFamily::learned_absolute && model.config().max_position_embeddings > 0 &&
      std::min(L, T) > model.config().max_position_embeddings)
    throw PositionError(fmt::format(
        "context: {} positions are past the learned position table (max_position_embeddings {})", std::min(L, T),
        model.config().max_position_embeddings));
  if (model.max_position() >= 0 && std::min(L, T) - 1 > model.max_position())
    throw PositionError(fmt::format("context: windows of {} tokens: position {} is past the position limit {} "
                                    "(max_position; positions 0 .. {} are allowed)",
                                    std::min(L, T), std::min(L, T) - 1, model.max_position(), model.max_position()));

  const int64_t chunk = o.chunk_tokens > 0 ? o.chunk_tokens : ppl_auto_chunk_tokens(V);
  int64_t tokens_total = 0;
  for (const PplWindow& w : plan.windows) tokens_total += w.tokens - 1;

  auto last_report = t0;
  int64_t done = 0, tokens_done = 0;
  // Reports at most about once per progress_interval_seconds, from the calling thread (thread 0), after one of its
  // windows or chunks; the last window is reported once, by finish_perplexity (reporting it here too printed "W/W"
  // twice). The callback (the CLI's progress line) may throw: kept as the loop's first exception. Callers hold the
  // critical section.
  detail::FirstException error;
  const auto report = [&] {
    if (!o.on_progress || omp_get_thread_num() != 0 || done == static_cast<int64_t>(W)) return;
    const auto now = std::chrono::steady_clock::now();
    if (std::chrono::duration<double>(now - last_report).count() < o.progress_interval_seconds) return;
    last_report = now;
    error.run([&] {
      o.on_progress({done, static_cast<int64_t>(W), tokens_done, std::chrono::duration<double>(now - t0).count(),
                     tokens_total});
    });
  };

#pragma omp parallel for schedule(dynamic, 1)
  for (std::size_t w = 0; w < W; ++w) {
    if (error.failed()) continue;
    const int64_t s = plan.windows[w].start;
    const int64_t n = plan.windows[w].tokens;
    int64_t counted = 0;  // this window's predictions in tokens_done
    error.run([&] {  // std::bad_alloc of the row, rethrown after the region
      window_nll[w].resize(static_cast<std::size_t>(n - 1));
    });
    if (error.failed()) continue;
    error.run([&] {
      model.score_window(
          stream.subspan(static_cast<std::size_t>(s), static_cast<std::size_t>(n)), chunk,
          [&](int64_t first, const float* logits, int64_t rows) {
            if (error.failed()) throw WindowAbandoned{};  // another window failed: its error is the one rethrown
            const int64_t end = std::min(first + rows, n - 1);  // position n - 1 predicts nothing
            detail::check_logits_finite(logits, (end - first) * V, V, [&](int64_t p) {
              return fmt::format("window of tokens [{}, {}), position {}", s, s + n, first + p);
            });
            for (int64_t p = first; p < end; ++p) {
              // -log_softmax, with the very function posenc serve computes prompt logprobs with, so a window
              // scored over HTTP (nll = -logprob) is bit-identical to one scored here.
              const float* row = logits + (p - first) * V;
              const int32_t next = stream[static_cast<std::size_t>(s + p + 1)];
              window_nll[w][static_cast<std::size_t>(p)] = -detail::log_prob(row, V, next);
            }
            if (end < n - 1) {  // not the window's last chunk (its predictions are counted with the window)
#pragma omp critical(posenc_ppl_progress)
              {
                tokens_done += end - first;
                report();
              }
              counted += end - first;
            }
          });
    });
    if (error.failed()) continue;
#pragma omp critical(posenc_ppl_progress)
    {
      ++done;
      tokens_done += (n - 1) - counted;  // the last chunk's predictions
      report();
    }
  }

  error.rethrow();
  return window_nll;
}

}  // namespace

PplResult evaluate_perplexity(const Model& model, std::span<const int32_t> stream, const PplOptions& o) {
  const PplPlan plan = plan_perplexity(model.trained_context(), static_cast<int64_t>(stream.size()), o);
  const auto t0 = std::chrono::steady_clock::now();
  const auto window_nll = score_model_windows(model, stream, plan, o, t0);
  PplResult r = finish_perplexity(plan, window_nll, o, t0);
  const bool rope = model.family() == PositionFamily::rope;
  r.rope_scaling = rope ? model.rope().freqs.rope_type : "default";
  r.factor = rope ? model.rope().params.factor.value_or(1.0) : 1.0;
  return r;
}

PplResult evaluate_perplexity(std::span<const int32_t> stream, int64_t trained_context, const PplOptions& o,
                              const PplWindowsScorer& score_windows) {
  const PplPlan plan = plan_perplexity(trained_context, static_cast<int64_t>(stream.size()), o);
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<std::vector<double>> window_nll(plan.windows.size());
  score_windows(plan.windows, window_nll);
  for (std::size_t w = 0; w < plan.windows.size(); ++w)
    if (static_cast<int64_t>(window_nll[w].size()) != plan.windows[w].tokens - 1)
      throw InvalidArgument(fmt::format("window {} (tokens [{}, {})): {} NLL values for {} predictions", w,
                                        plan.windows[w].start, plan.windows[w].start + plan.windows[w].tokens,
                                        window_nll[w].size(), plan.windows[w].tokens - 1));
  PplResult r = finish_perplexity(plan, window_nll, o, t0);
  r.rope_scaling = "default";
  r.factor = 1.0;
  return r;
}

std::string no_interval_reason(const PplBucket& b) {
  return b.windows == 0 ? "no window has a prediction in this bucket: no interval"
                        : "one window holds all of this bucket's predictions: no interval can be estimated from a "
                          "single window (a longer text or a shorter context gives more windows)";
}

nlohmann::json ppl_result_json(const PplResult& r) {
  // exp() of a large NLL overflows to inf, which JSON cannot hold: null then.
  auto ppl_of = [](double nll) { return std::isfinite(std::exp(nll)) ? nlohmann::json(std::exp(nll)) : nlohmann::json(); };
  nlohmann::json j{{"context", r.context}, {"trained_context", r.trained_context}, {"rope_scaling", r.rope_scaling},
                   {"factor", r.factor},   {"ppl", ppl_of(r.nll)},                  {"nll", r.nll},
                   {"tokens", r.tokens},   {"windows", r.windows}};
  auto buckets = [&](const std::vector<PplBucket>& bs) {
    nlohmann::json a = nlohmann::json::array();
    for (const auto& b : bs) {
      nlohmann::json e{{"start", b.start},
                       {"end", b.end},
                       {"tokens", b.tokens},
                       {"windows", b.windows},
                       {"nll", b.nll()},
                       {"ppl", b.tokens > 0 ? ppl_of(b.nll()) : nlohmann::json()},
                       {"nll_ci_low", b.nll_ci_low},
                       {"nll_ci_high", b.nll_ci_high}};
      if (!b.has_interval()) {  // a zero-width interval by construction, not a measured one
        e["nll_ci_low"] = nullptr;
        e["nll_ci_high"] = nullptr;
        e["nll_ci_note"] = no_interval_reason(b);
      }
      a.push_back(std::move(e));
    }
    return a;
  };
  j["buckets"] = buckets(r.buckets);
  if (!r.fine_buckets.empty()) j["fine_buckets"] = buckets(r.fine_buckets);
  return j;
}

std::optional<double> in_range_nll(std::span<const PplResult> results) {
  std::optional<double> best;
  for (const PplResult& r : results) {
    // Windows of a few tokens predict mostly from no context (at L = 2 every
    // prediction follows BOS alone): a model's own tokenizer scores above
    // uniform there (TinyStories-656K: 8.84 nats at L = 2), so they do not judge.
    if (r.context < kTokenizerCheckMinContext) continue;
    double sum = 0.0;
    int64_t n = 0;
    for (const PplBucket& b : r.buckets)
      if (b.end <= r.trained_context) {
        sum += b.nll_sum;
        n += b.tokens;
      }
    std::optional<double> v;
    if (n > 0) v = sum / static_cast<double>(n);
    else if (r.context <= r.trained_context && r.tokens > 0) v = r.nll;
    if (v && (!best || *v < *best)) best = v;
  }
  return best;
}

std::optional<std::string> tokenizer_mismatch_warning(double mean_nll, int64_t model_vocab_size,
                                                      const Tokenizer& tokenizer, std::string_view tokenizer_source) {
  if (model_vocab_size < 2 || tokenizer.is_symbolic()) return std::nullopt;
  const double uniform = std::log(static_cast<double>(model_vocab_size));
  if (!(mean_nll > uniform + kTokenizerMismatchMarginNats)) return std::nullopt;
  const int64_t pieces = tokenizer.vocab_size();
  return fmt::format(
      "mean NLL {:.3f} nats/token inside the trained context is {:.2f} above log({}) = {:.3f}, the NLL of guessing "
      "uniformly over the model's vocabulary: the tokenizer {} ({}, {} pieces{}) likely does not belong to this "
      "model (its ids name other pieces than the model was trained on); pass the model's own tokenizer with "
      "--tokenizer",
      mean_nll, mean_nll - uniform, model_vocab_size, uniform, tokenizer_source, tokenizer.describe(), pieces,
      pieces != model_vocab_size ? fmt::format(" for a model of {}", model_vocab_size) : "");
}

bool is_rope_scaling_name(std::string_view name) {
  if (name == "native") return true;
  try {
    find_rope_scaling(name);  // throws ConfigError listing the known names
  } catch (const ConfigError& e) {  // which leave out "native", the model's own: said here
    std::string what = e.what();
    if (what.ends_with(")")) what.insert(what.size() - 1, ", and native: the model's own");
    throw ConfigError(what);
  }
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
  const PplPlan plan = plan_perplexity(model.trained_context(), static_cast<int64_t>(stream.size()), o);
  std::vector<std::vector<double>> nll[2];
  for (RopeLayout layout : {RopeLayout::half, RopeLayout::interleaved}) {
    Model m = model;
    RopeSetup r = m.rope();
    r.layout = layout;
    m.set_rope(r);
    const auto t0 = std::chrono::steady_clock::now();
    auto& window_nll = nll[layout == RopeLayout::half ? 0 : 1];
    window_nll = score_model_windows(m, stream, plan, o, t0);
    const PplResult res = finish_perplexity(plan, window_nll, o, t0);
    (layout == RopeLayout::half ? e.nll_half : e.nll_interleaved) = res.nll;
    e.tokens = res.tokens;
  }
  e.likely = e.nll_half < e.nll_interleaved ? RopeLayout::half : RopeLayout::interleaved;
  e.margin = std::abs(e.nll_half - e.nll_interleaved);
  // The noise of the margin: the standard error of the mean paired difference d = nll_interleaved - nll_half over
  // the same predictions, the larger of (a) the predictions taken as independent and (b) the windows as the units
  // (cluster standard error: a window's predictions share their context, so they are not independent). With one
  // window only (a) exists; with fewer than two predictions neither does and nothing is decided.
  const auto N = static_cast<double>(e.tokens);
  if (e.tokens >= 2) {
    const double mean = e.nll_interleaved - e.nll_half;
    double ss_tok = 0.0, ss_win = 0.0;
    for (std::size_t w = 0; w < plan.windows.size(); ++w) {
      double dw = 0.0;
      for (std::size_t p = 0; p < nll[0][w].size(); ++p) {
        const double d = nll[1][w][p] - nll[0][w][p];
        ss_tok += (d - mean) * (d - mean);
        dw += d;
      }
      const double c = dw - mean * static_cast<double>(nll[0][w].size());
      ss_win += c * c;
    }
    double se = std::sqrt(ss_tok / (N - 1.0) / N);
    const auto W = static_cast<double>(plan.windows.size());
    if (plan.windows.size() >= 2) se = std::max(se, std::sqrt(W / (W - 1.0) * ss_win) / N);
    e.margin_se = se;
    e.conclusive = e.margin > kLayoutEvidenceZ * se;
  }
  return e;
}

}  // namespace posenc
