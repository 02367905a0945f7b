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

}  // namespace

ConsistencyReport check_cache_consistency(const Model& model, std::span<const int32_t> stream,
                                          const ConsistencyOptions& o) {
  const int64_t n = o.length;
  // The left-padded scenario's shortest prompt is n/2 - 40 tokens.
  if (n < kMinConsistencyLength || n > (int64_t{1} << 40))
    fail_field<InvalidArgument>("length", fmt::format("must be in [{}, 2^40]", kMinConsistencyLength), n);
  // The furthest token read: the prefix-reuse forks' suffixes start at n + 97k
  // (k <= 3) and are n - (n/2 + 3) long; the other scenarios stay below 3n.
  const int64_t need = std::max(3 * n, n + 97 * 3 + (n - (n / 2 + 3)));
  if (static_cast<int64_t>(stream.size()) < need)
    throw InvalidArgument(fmt::format("text: {} tokens, the checker needs at least {} for length {}", stream.size(),
                                      need, n));
  if (o.block_size <= 0) fail_field<InvalidArgument>("block_size", "must be positive", o.block_size);
  for (int64_t c : o.chunk_sizes)
    if (c <= 0) fail_field<InvalidArgument>("chunk_sizes", "must be positive", c);
  if (o.sliding_window <= 0) fail_field<InvalidArgument>("sliding_window", "must be positive", o.sliding_window);

  const std::size_t V = static_cast<std::size_t>(model.config().vocab_size);
  const std::size_t N = static_cast<std::size_t>(n);
  ConsistencyReport rep;
  rep.tolerance = o.tolerance;
  auto add = [&](std::string name, double diff, int64_t rows, std::string ref = "one full forward") {
    rep.scenarios.push_back({std::move(name), diff, rows, std::move(ref), {}});
  };
  const Tokens base = stream.subspan(0, N);
  const std::vector<float> full = model.score_window(base);

  // 1. token by token, and chunked prefill.
  add("token_by_token", max_diff(chunked(model, base, 1, o.block_size), full), n);
  for (int64_t c : o.chunk_sizes)
    if (c != 1) add(fmt::format("chunked_prefill_{}", c), max_diff(chunked(model, base, c, o.block_size), full), n);

  // 2. left-padded batch: 4 prompts of different lengths, each fed in two
  //    left-padded steps (a first part, then a continuation of a different
  //    length per row), then `steps` decode steps for all of them together.
  {
    const int64_t steps = 8;
    const std::vector<int64_t> len_a{n / 2, n / 3, 19, n / 2 - 40};
    const std::vector<int64_t> len_b{n / 2 - steps, 11, n / 2, 77};
    const std::vector<std::size_t> offs{0, N, 2 * N, N / 3};
    const std::size_t B = offs.size();
    KvCache cache = model.make_cache(o.block_size);
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
      const auto ref = model.score_window(stream.subspan(offs[b], static_cast<std::size_t>(total)));
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
    const std::vector<int64_t> per_step{5, 1, 17};
    const std::vector<int64_t> total{n, n / 4, n / 2};
    KvCache cache = model.make_cache(o.block_size);
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
        const int64_t want = first ? std::min<int64_t>(total[i], 40 + 23 * i) : per_step[i];
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
                               model.score_window(stream.subspan(offs[static_cast<std::size_t>(i)], static_cast<std::size_t>(total[static_cast<std::size_t>(i)])))));
      rows += total[static_cast<std::size_t>(i)];
    }
    add("ragged_batch", d, rows, "each sequence's own full forward");
  }

  // 4. prefix reuse: prefill a prefix once, fork three ways (copy-on-write),
  //    parent and forks continue with different suffixes.
  {
    const std::size_t P = N / 2 + 3;  // not a multiple of the block size: the last block is shared and partial
    const Tokens prefix = stream.subspan(0, P);
    KvCache cache = model.make_cache(o.block_size);
    const auto parent = cache.create();
    std::vector<float> pre, step;
    Model::SequenceInput in{parent, prefix, {}};
    model.forward(cache, std::span(&in, 1), Model::LogitsMode::all, pre);
    std::vector<KvCache::SeqId> seqs{parent};
    for (int i = 0; i < 3; ++i) seqs.push_back(cache.fork(parent));
    double d = max_diff(pre, std::span(full).subspan(0, P * V));
    int64_t rows = static_cast<int64_t>(P);
    const std::size_t S = N - P;
    for (std::size_t k = 0; k < seqs.size(); ++k) {
      // Suffix k comes from a different place of the stream (k = 0: the true continuation).
      const std::size_t so = k == 0 ? P : N + 97 * k;
      const Tokens suffix = stream.subspan(so, S);
      in = {seqs[k], suffix, {}};
      model.forward(cache, std::span(&in, 1), Model::LogitsMode::all, step);
      std::vector<int32_t> joined(prefix.begin(), prefix.end());
      joined.insert(joined.end(), suffix.begin(), suffix.end());
      const auto ref = model.score_window(joined);
      d = std::max(d, max_diff(step, std::span(ref).subspan(P * V)));
      rows += static_cast<int64_t>(S);
    }
    add("prefix_reuse_fork", d, rows, "full forward of prefix + each suffix");
  }

  // 5. context shift: the first half prefilled at positions 1000.., shifted by
  //    -1000 (cached keys re-rotated), then the rest continues at n/2...
  //    Both sides use angle_precision exact: in float32 the angle of position
  //    1000+i is rounded to ulp(1000) = 6e-5 rad, so R(-1000)R(1000+i) differs
  //    from R(i) by ~1e-4 in the logits whatever the cache does.
  {
    const std::size_t H = N / 2;
    Model ex = model;
    RopeSetup rs = ex.rope();
    rs.precision = AnglePrecision::exact;
    ex.set_rope(rs);
    const Model& model = ex;
    const auto full = model.score_window(base);
    KvCache cache = model.make_cache(o.block_size);
    const auto seq = cache.create();
    std::vector<int64_t> pos(H);
    for (std::size_t i = 0; i < H; ++i) pos[i] = 1000 + static_cast<int64_t>(i);
    std::vector<float> got, step;
    Model::SequenceInput in{seq, base.subspan(0, H), pos};
    model.forward(cache, std::span(&in, 1), Model::LogitsMode::all, got);
    cache.shift(seq, -1000);
    in = {seq, base.subspan(H), {}};
    model.forward(cache, std::span(&in, 1), Model::LogitsMode::all, step);
    append_rows(got, step);
    add("context_shift", max_diff(got, full), n, "one full forward (both angle_precision exact)");
  }

  // 6. sliding-window eviction: token by token, evicting what left the window.
  {
    Model sw = model;
    sw.set_sliding_window(o.sliding_window);
    const auto ref = sw.score_window(base);
    KvCache cache = sw.make_cache(o.block_size);
    const auto seq = cache.create();
    std::vector<float> got, step;
    int64_t max_kept = 0;
    for (std::size_t i = 0; i < N; ++i) {
      Model::SequenceInput in{seq, base.subspan(i, 1), {}};
      sw.forward(cache, std::span(&in, 1), Model::LogitsMode::all, step);
      append_rows(got, step);
      cache.keep_window(seq, o.sliding_window);
      max_kept = std::max(max_kept, cache.size(seq));
    }
    add(fmt::format("sliding_window_eviction_{}", o.sliding_window), max_diff(got, ref), n,
        "one full forward with the sliding-window mask");
    if (max_kept > o.sliding_window)
      rep.scenarios.back().failure =
          fmt::format("the cache kept {} tokens for a window of {}", max_kept, o.sliding_window);
  }

  rep.passed = std::all_of(rep.scenarios.begin(), rep.scenarios.end(),
                           [&](const ConsistencyScenario& s) { return s.ok(o.tolerance); });
  return rep;
}

}  // namespace posenc
