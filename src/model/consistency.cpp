#include "posenc/consistency.hpp"

#include <algorithm>
#include <cmath>

#include <fmt/format.h>

#include "posenc/error.hpp"

namespace posenc {

namespace {

using Tokens = std::span<const int32_t>;

double max_diff(std::span<const float> a, std::span<const float> b) {
  if (a.size() != b.size())
    throw InvalidArgument(fmt::format("consistency: {} vs {} logits", a.size(), b.size()));
  double m = 0.0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    const double d = std::abs(static_cast<double>(a[i]) - static_cast<double>(b[i]));
    if (!(d <= m)) m = d;  // NaN propagates as a failure
  }
  return m;
}

void append_rows(std::vector<float>& dst, const std::vector<float>& src) { dst.insert(dst.end(), src.begin(), src.end()); }

/// The reference of a scenario: one full forward of `tokens` under `m`'s setup with a float32 KV cache. For a
/// model whose caches store f16/bf16, the same forward with that cache is run too and its max |Δlogit| against
/// the float32 one (what rounding k/v alone costs on these tokens) is folded into `rounding`.
std::vector<float> reference_forward(const Model& m, Tokens tokens, double& rounding) {
  if (m.kv_cache_dtype() == KvCacheDtype::f32) return m.score_window(tokens);
  Model f32 = m;
  f32.set_kv_cache_dtype(KvCacheDtype::f32);
  std::vector<float> ref = f32.score_window(tokens);
  rounding = std::max(rounding, max_diff(m.score_window(tokens), ref));
  return ref;
}

/// Feeds `tokens` to a fresh sequence in chunks of `chunk`, returning all logits.
std::vector<float> chunked(const Model& m, Tokens tokens, int64_t chunk, int block_size) {
  KvCache cache = m.make_cache(block_size);
  const auto seq = cache.create();
  std::vector<float> all, step;
  for (std::size_t i = 0; i < tokens.size(); i += static_cast<std::size_t>(chunk)) {
    const std::size_t n = std::min(tokens.size() - i, static_cast<std::size_t>(chunk));
    Model::SequenceInput in{seq, tokens.subspan(i, n), {}};
    m.forward(cache, std::span(&in, 1), Model::LogitsMode::all, step);
    append_rows(all, step);
  }
  return all;
}

bool length_dependent(const Model& m) {
  return m.family() == PositionFamily::rope && m.rope().update_with_length &&
         find_rope_scaling(m.rope().params.rope_type).depends_on_seq_len;
}

/// The model with its frequencies frozen at those the forward computes for a
/// window of n tokens (max(position_ids)+1 = n).
Model frozen_at(const Model& model, int64_t n) {
  Model m = model;
  m.set_rope(freeze_rope_for_length(m.rope(), n));
  return m;
}

/// One sequence fed in chunks under a RoPE change policy: the logits of the
/// steps that ran, where each step ended, and what the cache counted.
struct PolicyPath {
  std::vector<float> logits;
  std::vector<int64_t> ends;
  std::string refused;  ///< the refusal, if a step threw CacheError
  bool appended_on_refusal = false;
  KvCache::SequenceStats stats;
};

PolicyPath run_policy(const Model& model, Tokens tokens, int64_t chunk, int block_size, RopeChangePolicy policy,
                      int64_t planned) {
  Model m = model;
  m.set_rope_change_policy(policy);
  KvCache cache = m.make_cache(block_size);
  const auto seq = cache.create();
  cache.set_planned_length(seq, planned);
  PolicyPath out;
  std::vector<float> step;
  for (std::size_t i = 0; i < tokens.size(); i += static_cast<std::size_t>(chunk)) {
    const std::size_t n = std::min(tokens.size() - i, static_cast<std::size_t>(chunk));
    Model::SequenceInput in{seq, tokens.subspan(i, n), {}};
    try {
      m.forward(cache, std::span(&in, 1), Model::LogitsMode::all, step);
    } catch (const CacheError&) {
      out.refused = fmt::format("refused the step to length {} (CacheError); {} tokens cached", i + n, cache.size(seq));
      out.appended_on_refusal = cache.size(seq) != static_cast<int64_t>(i);
      break;
    }
    append_rows(out.logits, step);
    out.ends.push_back(static_cast<int64_t>(i + n));
  }
  out.stats = cache.stats(seq);
  return out;
}

/// Each step's rows [start, e) of one full forward of tokens[0, e): the full
/// forward at the length the step was computed at. Steps ending at or before
/// the switch point share the rows of the forward of tokens[0, S) (the
/// frequencies do not change below it).
std::vector<float> rows_at_their_length(const Model& model, Tokens tokens, std::span<const int64_t> ends, int64_t S,
                                        double& rounding) {
  const std::size_t V = static_cast<std::size_t>(model.config().vocab_size);
  const int64_t n = static_cast<int64_t>(tokens.size());
  const std::vector<float> below =
      reference_forward(model, tokens.first(static_cast<std::size_t>(std::min(S, n))), rounding);
  std::vector<float> out;
  int64_t start = 0;
  for (int64_t e : ends) {
    if (e <= S) {
      out.insert(out.end(), below.begin() + static_cast<std::ptrdiff_t>(start * static_cast<int64_t>(V)),
                 below.begin() + static_cast<std::ptrdiff_t>(e * static_cast<int64_t>(V)));
    } else {
      const auto f = reference_forward(model, tokens.first(static_cast<std::size_t>(e)), rounding);
      out.insert(out.end(), f.begin() + static_cast<std::ptrdiff_t>(start * static_cast<int64_t>(V)), f.end());
    }
    start = e;
  }
  return out;
}

int64_t rope_change_length(int64_t S) { return S + std::max<int64_t>(16, S / 3); }

}  // namespace

int64_t default_consistency_length(const Model& model) {
  int64_t n = model.trained_context();
  if (model.family() == PositionFamily::learned_absolute && model.config().max_position_embeddings > 0)
    n = std::min(n, model.config().max_position_embeddings);
  if (length_dependent(model)) {
    const int64_t S = rope_switch_point(model.rope().params);
    if (S > 0 && n <= S) n = rope_change_length(S);
  }
  return std::clamp(n, kMinConsistencyLength, kMaxConsistencyLength);
}

ConsistencyPlan consistency_plan(const ConsistencyOptions& o) {
  const int64_t n = o.length;
  // Every size below is >= 1 and every compared sequence is <= n long from
  // n = 16 on; the fixed sizes of the 512-token era (a prompt of n/2 - 40
  // tokens) went negative below n = 80 (vector::_M_range_insert).
  if (n < kMinConsistencyLength || n > kMaxConsistencyLength)
    fail_field<InvalidArgument>("length",
                                fmt::format("must be in [{}, {}] (the shortest sequence the scenarios fit in is {})",
                                            kMinConsistencyLength, kMaxConsistencyLength, kMinConsistencyLength),
                                n);
  ConsistencyPlan p;
  p.length = n;
  p.block_size = o.block_size != 0 ? o.block_size : static_cast<int>(std::clamp<int64_t>(n / 8, 2, 16));
  if (p.block_size <= 0) fail_field<InvalidArgument>("block_size", "must be positive", p.block_size);
  std::vector<int64_t> chunks = o.chunk_sizes.empty() ? std::vector<int64_t>{7, n / 8, n} : o.chunk_sizes;
  for (int64_t c : chunks)
    if (c <= 0) fail_field<InvalidArgument>("chunk_sizes", "must be positive", c);
  std::sort(chunks.begin(), chunks.end());
  chunks.erase(std::unique(chunks.begin(), chunks.end()), chunks.end());
  for (int64_t c : chunks)
    if (c != 1 && (c <= n || !o.chunk_sizes.empty())) p.chunk_sizes.push_back(c);
  const int64_t q = n / 8 + 3, s = std::max<int64_t>(2, n / 64);
  p.padded_first = {n / 2, n / 3, q, n / 2 - q};
  p.padded_second = {n / 2 - s, q / 2 + 1, n / 2 - s, q + q / 2};
  p.padded_decode_steps = s;
  p.padded_offsets = {0, n, 2 * n, n / 3};
  p.ragged_totals = {n, n / 4, n / 2};
  for (std::size_t i = 0; i < 3; ++i)
    p.ragged_first.push_back(std::min(p.ragged_totals[i], n / 13 + 1 + static_cast<int64_t>(i) * (n / 23 + 1)));
  p.ragged_strides = {5, 1, std::max<int64_t>(3, n / 32 + 1)};
  p.fork_prefix = n / 2 + 3;
  if (p.fork_prefix % p.block_size == 0) ++p.fork_prefix;  // the last prefix block is shared and partial
  p.fork_suffix = n - p.fork_prefix;
  p.fork_suffix_offsets = {p.fork_prefix};
  for (int64_t k = 1; k <= 3; ++k) p.fork_suffix_offsets.push_back(n + k * (n / 3 + 1));
  p.shift_offset = 2 * n;
  p.sliding_window = o.sliding_window != 0 ? o.sliding_window : std::max<int64_t>(2, n / 8);
  if (p.sliding_window <= 0) fail_field<InvalidArgument>("sliding_window", "must be positive", p.sliding_window);
  p.stream_tokens = 3 * n;
  // The invariants the scenarios rely on (a violation is a defect of the rules above).
  int64_t furthest = 0;
  for (std::size_t b = 0; b < 4; ++b) {
    const int64_t total = p.padded_first[b] + p.padded_second[b] + s;
    if (p.padded_first[b] < 1 || p.padded_second[b] < 1 || total > n)
      throw InvalidArgument(fmt::format("consistency plan for length {}: padded prompt {} is {} + {} + {}", n, b,
                                        p.padded_first[b], p.padded_second[b], s));
    furthest = std::max(furthest, p.padded_offsets[b] + total);
  }
  for (std::size_t i = 0; i < 3; ++i)
    if (p.ragged_totals[i] < 1 || p.ragged_first[i] < 1)
      throw InvalidArgument(fmt::format("consistency plan for length {}: ragged sequence {} is empty", n, i));
  if (p.fork_suffix < 1) throw InvalidArgument(fmt::format("consistency plan for length {}: empty fork suffix", n));
  for (int64_t off : p.fork_suffix_offsets) furthest = std::max(furthest, off + p.fork_suffix);
  if (furthest > p.stream_tokens)
    throw InvalidArgument(fmt::format("consistency plan for length {}: reads token {} of {}", n, furthest,
                                      p.stream_tokens));
  return p;
}

ConsistencyReport check_cache_consistency(const Model& model_in, std::span<const int32_t> stream,
                                          const ConsistencyOptions& opts) {
  ConsistencyOptions o = opts;
  if (o.length == 0) o.length = default_consistency_length(model_in);
  const ConsistencyPlan plan = consistency_plan(o);
  const int64_t n = plan.length;
  // A length-dependent RoPE: the bookkeeping scenarios run at the frequencies
  // of the whole window (frozen); the rope_change scenarios cross the switch point.
  const bool changing = length_dependent(model_in);
  const Model model = changing ? frozen_at(model_in, n) : model_in;
  const std::string frozen_note = changing ? fmt::format(" (frequencies frozen at length {})", n) : "";
  if (model.family() == PositionFamily::learned_absolute && model.config().max_position_embeddings > 0 &&
      n > model.config().max_position_embeddings)
    throw PositionError(fmt::format("length: {} positions are past the learned position table ({} rows); the "
                                    "longest length for this model is {}",
                                    n, model.config().max_position_embeddings, model.config().max_position_embeddings));
  if (static_cast<int64_t>(stream.size()) < plan.stream_tokens)
    throw InvalidArgument(fmt::format("text: {} tokens, the checker needs at least {} (3 x length {})", stream.size(),
                                      plan.stream_tokens, n));
  const int block_size = plan.block_size;

  const std::size_t V = static_cast<std::size_t>(model.config().vocab_size);
  const std::size_t N = static_cast<std::size_t>(n);
  ConsistencyReport rep;
  rep.tolerance = o.tolerance;
  rep.plan = plan;
  rep.family = model.family();
  rep.trained_context = model.trained_context();
  rep.kv_dtype = model.kv_cache_dtype();
  // What rounding k/v to the cache's dtype costs on the references of the scenario being built (0 for f32).
  double rounding = 0.0;
  auto add = [&](std::string name, double diff, int64_t rows, std::string ref = "one full forward") {
    rep.scenarios.push_back({std::move(name), diff, rows, std::move(ref) + frozen_note, {}, {}, false, {}});
    rep.scenarios.back().kv_rounding = rounding;
    rounding = 0.0;
  };
  const Tokens base = stream.subspan(0, N);
  double full_rounding = 0.0;
  const std::vector<float> full = reference_forward(model, base, full_rounding);

  // 1. token by token, and chunked prefill.
  rounding = full_rounding;
  add("token_by_token", max_diff(chunked(model, base, 1, block_size), full), n);
  for (int64_t c : plan.chunk_sizes) {
    rounding = full_rounding;
    add(fmt::format("chunked_prefill_{}", c), max_diff(chunked(model, base, c, block_size), full), n);
  }

  // 2. left-padded batch: 4 prompts of different lengths, each fed in two
  //    left-padded steps (a first part, then a continuation of a different
  //    length per row), then `steps` decode steps for all of them together.
  {
    const int64_t steps = plan.padded_decode_steps;
    const std::vector<int64_t>& len_a = plan.padded_first;
    const std::vector<int64_t>& len_b = plan.padded_second;
    const std::vector<std::size_t> offs(plan.padded_offsets.begin(), plan.padded_offsets.end());
    const std::size_t B = offs.size();
    KvCache cache = model.make_cache(block_size);
    std::vector<KvCache::SeqId> seqs;
    for (std::size_t b = 0; b < B; ++b) seqs.push_back(cache.create());
    std::vector<std::vector<float>> got(B);
    auto padded_step = [&](const std::vector<int64_t>& lens, const std::vector<int64_t>& skip) {
      const int64_t width = *std::max_element(lens.begin(), lens.end());
      std::vector<int32_t> toks(B * static_cast<std::size_t>(width), 0);
      std::vector<uint8_t> mask(toks.size(), 0);
      for (std::size_t b = 0; b < B; ++b) {
        const int64_t pad = width - lens[b];
        for (int64_t i = 0; i < lens[b]; ++i) {
          const std::size_t at = b * static_cast<std::size_t>(width) + static_cast<std::size_t>(pad + i);
          toks[at] = stream[offs[b] + static_cast<std::size_t>(skip[b] + i)];
          mask[at] = 1;
        }
      }
      std::vector<float> padded;
      model.forward_padded(cache, seqs, toks, mask, width, padded);
      for (std::size_t b = 0; b < B; ++b) {
        const int64_t pad = width - lens[b];
        got[b].insert(got[b].end(),
                      padded.begin() + static_cast<std::ptrdiff_t>((b * static_cast<std::size_t>(width) + static_cast<std::size_t>(pad)) * V),
                      padded.begin() + static_cast<std::ptrdiff_t>((b + 1) * static_cast<std::size_t>(width) * V));
      }
    };
    padded_step(len_a, std::vector<int64_t>(B, 0));
    padded_step(len_b, len_a);
    std::vector<float> step;
    for (int64_t s = 0; s < steps; ++s) {
      std::vector<Model::SequenceInput> batch;
      for (std::size_t b = 0; b < B; ++b)
        batch.push_back({seqs[b], stream.subspan(offs[b] + static_cast<std::size_t>(len_a[b] + len_b[b] + s), 1), {}});
      model.forward(cache, batch, Model::LogitsMode::all, step);
      for (std::size_t b = 0; b < B; ++b)
        got[b].insert(got[b].end(), step.begin() + static_cast<std::ptrdiff_t>(b * V), step.begin() + static_cast<std::ptrdiff_t>((b + 1) * V));
    }
    double d = 0;
    int64_t rows = 0;
    std::string failure;
    for (std::size_t b = 0; b < B; ++b) {
      const int64_t total = len_a[b] + len_b[b] + steps;
      const auto ref = reference_forward(model, stream.subspan(offs[b], static_cast<std::size_t>(total)), rounding);
      d = std::max(d, max_diff(got[b], ref));
      rows += total;
      const auto pos = cache.positions(seqs[b]);
      for (int64_t i = 0; i < total && failure.empty(); ++i)
        if (pos[static_cast<std::size_t>(i)] != i)
          failure = fmt::format("sequence {}: token {} is cached at position {}", b, i, pos[static_cast<std::size_t>(i)]);
    }
    add("left_padded_batch", d, rows, "each prompt's own full forward");
    rep.scenarios.back().failure = failure;
  }

  // 3. ragged batch: three sequences advancing by different amounts per step.
  {
    const std::vector<std::size_t> offs{0, N, 2 * N};
    const std::vector<int64_t>& per_step = plan.ragged_strides;
    const std::vector<int64_t>& total = plan.ragged_totals;
    KvCache cache = model.make_cache(block_size);
    std::vector<KvCache::SeqId> seqs;
    std::vector<int64_t> done(3, 0);
    std::vector<std::vector<float>> got(3);
    for (int i = 0; i < 3; ++i) seqs.push_back(cache.create());
    std::vector<float> step;
    bool first = true;
    while (true) {
      std::vector<Model::SequenceInput> batch;
      std::vector<int> who;
      for (int i = 0; i < 3; ++i) {
        // First step: a ragged prefill of different lengths; then different strides.
        const auto ui = static_cast<std::size_t>(i);
        const int64_t want = first ? plan.ragged_first[ui] : per_step[ui];
        const int64_t take = std::min(want, total[i] - done[i]);
        if (take <= 0) continue;
        batch.push_back({seqs[i], stream.subspan(offs[i] + static_cast<std::size_t>(done[i]), static_cast<std::size_t>(take)), {}});
        who.push_back(i);
        done[i] += take;
      }
      first = false;
      if (batch.empty()) break;
      model.forward(cache, batch, Model::LogitsMode::all, step);
      std::size_t r = 0;
      for (std::size_t k = 0; k < batch.size(); ++k) {
        const std::size_t rows = batch[k].tokens.size();
        got[static_cast<std::size_t>(who[k])].insert(got[static_cast<std::size_t>(who[k])].end(),
                                                     step.begin() + static_cast<std::ptrdiff_t>(r * V),
                                                     step.begin() + static_cast<std::ptrdiff_t>((r + rows) * V));
        r += rows;
      }
    }
    double d = 0;
    int64_t rows = 0;
    for (int i = 0; i < 3; ++i) {
      d = std::max(d, max_diff(got[static_cast<std::size_t>(i)],
                               reference_forward(model,
                                                 stream.subspan(offs[static_cast<std::size_t>(i)],
                                                                static_cast<std::size_t>(total[static_cast<std::size_t>(i)])),
                                                 rounding)));
      rows += total[static_cast<std::size_t>(i)];
    }
    add("ragged_batch", d, rows, "each sequence's own full forward");
  }

  // 4. prefix reuse: prefill a prefix once, fork three ways (copy-on-write),
  //    parent and forks continue with different suffixes.
  {
    const std::size_t P = static_cast<std::size_t>(plan.fork_prefix);  // the last block is shared and partial
    const Tokens prefix = stream.subspan(0, P);
    KvCache cache = model.make_cache(block_size);
    const auto parent = cache.create();
    std::vector<float> pre, step;
    Model::SequenceInput in{parent, prefix, {}};
    model.forward(cache, std::span(&in, 1), Model::LogitsMode::all, pre);
    std::vector<KvCache::SeqId> seqs{parent};
    for (int i = 0; i < 3; ++i) seqs.push_back(cache.fork(parent));
    double d = max_diff(pre, std::span(full).subspan(0, P * V));
    rounding = full_rounding;
    int64_t rows = static_cast<int64_t>(P);
    const std::size_t S = N - P;
    for (std::size_t k = 0; k < seqs.size(); ++k) {
      // Suffix k comes from a different place of the stream (k = 0: the true continuation).
      const std::size_t so = static_cast<std::size_t>(plan.fork_suffix_offsets[k]);
      const Tokens suffix = stream.subspan(so, S);
      in = {seqs[k], suffix, {}};
      model.forward(cache, std::span(&in, 1), Model::LogitsMode::all, step);
      std::vector<int32_t> joined(prefix.begin(), prefix.end());
      joined.insert(joined.end(), suffix.begin(), suffix.end());
      const auto ref = reference_forward(model, joined, rounding);
      d = std::max(d, max_diff(step, std::span(ref).subspan(P * V)));
      rows += static_cast<int64_t>(S);
    }
    add("prefix_reuse_fork", d, rows, "full forward of prefix + each suffix");
  }

  // 5. context shift (RoPE): the first half prefilled at positions 2n..,
  //    shifted by -2n (cached keys re-rotated), then the rest continues at n/2...
  //    Both sides use angle_precision exact: in float32 the angle of position
  //    2n+i is rounded to ulp(2n), so R(-2n)R(2n+i) differs from R(i) by ~1e-4
  //    in the logits whatever the cache does; the frequencies are frozen at
  //    the model's (a length-dependent method would otherwise recompute them
  //    for positions past 2n and compare two different encodings).
  if (model.family() != PositionFamily::rope) {
    rep.scenarios.push_back({"context_shift", 0.0, 0, "one full forward (both angle_precision exact)", {},
                             fmt::format("applies to RoPE only (re-rotates cached keys); this model uses {} positions",
                                         to_string(model.family())),
                             false, {}});
  } else {
    const std::size_t H = N / 2;
    const int64_t shift = plan.shift_offset;
    Model ex = model;
    RopeSetup rs = ex.rope();
    rs.precision = AnglePrecision::exact;
    rs.update_with_length = false;
    ex.set_rope(rs);
    const Model& model = ex;
    const auto full = reference_forward(model, base, rounding);
    KvCache cache = model.make_cache(block_size);
    const auto seq = cache.create();
    std::vector<int64_t> pos(H);
    for (std::size_t i = 0; i < H; ++i) pos[i] = shift + static_cast<int64_t>(i);
    std::vector<float> got, step;
    Model::SequenceInput in{seq, base.subspan(0, H), pos};
    model.forward(cache, std::span(&in, 1), Model::LogitsMode::all, got);
    cache.shift(seq, -shift);
    in = {seq, base.subspan(H), {}};
    model.forward(cache, std::span(&in, 1), Model::LogitsMode::all, step);
    append_rows(got, step);
    add("context_shift", max_diff(got, full), n, "one full forward (both angle_precision exact)");
    rep.scenarios.back().kv_roundings = 2;  // rounded when stored, and again after the shift's rotation
  }

  // 6. sliding-window eviction: token by token, evicting what left the window.
  {
    const int64_t window = plan.sliding_window;
    Model sw = model;
    sw.set_sliding_window(window);
    const auto ref = reference_forward(sw, base, rounding);
    KvCache cache = sw.make_cache(block_size);
    const auto seq = cache.create();
    std::vector<float> got, step;
    int64_t max_kept = 0;
    for (std::size_t i = 0; i < N; ++i) {
      Model::SequenceInput in{seq, base.subspan(i, 1), {}};
      sw.forward(cache, std::span(&in, 1), Model::LogitsMode::all, step);
      append_rows(got, step);
      cache.keep_window(seq, window);
      max_kept = std::max(max_kept, cache.size(seq));
    }
    add(fmt::format("sliding_window_eviction_{}", window), max_diff(got, ref), n,
        "one full forward with the sliding-window mask");
    if (max_kept > window)
      rep.scenarios.back().failure = fmt::format("the cache kept {} tokens for a window of {}", max_kept, window);
  }

  // 7. length-dependent RoPE across its switch point, under every policy.
  if (changing) {
    const RopeParams& params = model_in.rope().params;
    const int64_t S = rope_switch_point(params);
    rep.rope_type = params.rope_type;
    rep.rope_switch_point = S;
    rep.rope_change_policy = o.rope_change_policy;
    const int64_t chunk = o.rope_change_chunk > 0 ? o.rope_change_chunk : std::max<int64_t>(2, S / 4);
    if (n <= S) {
      rep.scenarios.push_back({"rope_change", 0.0, 0, "the full forward at each step's length", {},
                               fmt::format("length {} does not pass the switch point {} of rope_type {} (use a "
                                           "length of at least {})",
                                           n, S, params.rope_type, S + 1),
                               false, {}});
    } else {
      for (int64_t c : {int64_t{1}, chunk}) {
        std::vector<int64_t> ends;
        for (int64_t e = c; e < n + c; e += c) ends.push_back(std::min(e, n));
        double ref_rounding = 0.0;
        const std::vector<float> ref = rows_at_their_length(model_in, base, ends, S, ref_rounding);
        const std::string path = c == 1 ? "token_by_token" : fmt::format("chunked_{}", c);
        for (RopeChangePolicy policy : {RopeChangePolicy::recompute, RopeChangePolicy::hf, RopeChangePolicy::rerotate,
                                        RopeChangePolicy::refuse}) {
          const PolicyPath got = run_policy(model_in, base, c, block_size, policy, 0);
          ConsistencyScenario sc;
          sc.name = fmt::format("rope_change_{}_{}", to_string(policy), path);
          sc.reference = "the full forward at each step's length";
          sc.tokens = static_cast<int64_t>(got.logits.size() / V);
          sc.max_abs_logit_diff = max_diff(got.logits, std::span(ref).first(got.logits.size()));
          sc.informational = policy != o.rope_change_policy;
          sc.kv_rounding = ref_rounding;
          const auto& st = got.stats;
          switch (policy) {
            case RopeChangePolicy::recompute:
              sc.note = fmt::format("{} re-prefills, {} tokens re-run", st.rope_recomputes, st.tokens_reprefilled);
              if (st.rope_recomputes == 0) sc.failure = "no re-prefill happened across the switch point";
              break;
            case RopeChangePolicy::hf:
              sc.note = fmt::format("{} frequency changes, cached keys kept as written", st.rope_changes_kept);
              break;
            case RopeChangePolicy::rerotate:
              sc.note = fmt::format("{} re-rotations of every cached key", st.rope_rerotations);
              sc.kv_roundings = 1 + st.rope_rerotations;  // each re-rotation rounds the keys again
              break;
            case RopeChangePolicy::refuse:
              sc.note = got.refused;
              if (got.refused.empty()) sc.failure = "did not refuse past the switch point";
              else if (got.appended_on_refusal) sc.failure = "appended tokens before refusing";
              break;
          }
          if (!got.refused.empty() && policy != RopeChangePolicy::refuse) sc.failure = got.refused;
          rep.scenarios.push_back(std::move(sc));
        }
      }
      if (params.rope_type == "longrope") {
        // The request's total length is known: every chunk uses the long factors.
        const PolicyPath got = run_policy(model_in, base, chunk, block_size, RopeChangePolicy::recompute, n);
        ConsistencyScenario sc;
        sc.name = fmt::format("longrope_planned_chunked_{}", chunk);
        sc.reference = fmt::format("one full forward of {} tokens (planned length {})", n, n);
        sc.tokens = n;
        sc.max_abs_logit_diff = max_diff(got.logits, reference_forward(model_in, base, sc.kv_rounding));
        sc.note = fmt::format("{} re-prefills", got.stats.rope_recomputes);
        if (got.stats.rope_recomputes > 0)
          sc.failure = "a chunk used the short factors although the planned length passes the switch point";
        rep.scenarios.push_back(std::move(sc));
      }
    }
  }

  rep.passed = std::all_of(rep.scenarios.begin(), rep.scenarios.end(),
                           [&](const ConsistencyScenario& s) { return s.ok(o.tolerance); });
  return rep;
}

}  // namespace posenc
