// The tiled attention kernel against the materialised double-precision
// oracle (attention_reference.hpp) over a grid of shapes, masks, biases, GQA
// ratios, key layouts (paged blocks with shuffled/gapped positions and empty
// slots) and thread counts.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <gtest/gtest.h>

#include "attention/attention_reference.hpp"
#include "posenc/attention.hpp"
#include "posenc/bias.hpp"
#include "posenc/error.hpp"
#include "posenc/float16.hpp"
#include "posenc/kv_cache.hpp"
#include "posenc/rope.hpp"

namespace POSENC_UNITY_ID {  // this file's own namespace in the tests' unity build (CMakeLists.txt)

using namespace posenc;

namespace {

struct Case {
  int heads, kv_heads, head_dim;
  int q_tokens;
  MaskKind mask = MaskKind::causal;
  int64_t window = 0;
  LogitBias bias = LogitBias::none;
  bool t5_bidirectional = false;
  // keys: block sizes; positions are a shuffled, gapped range; some empty slots
  std::vector<int> blocks;
  bool shuffle = true;
  double empty_fraction = 0.0;
  int gap = 0;  // extra unused positions spread among the keys
  int threads = 0;
  uint32_t seed = 1;

  std::string describe() const {
    return fmt::format("H{}/KVH{} d{} q{} mask {} w{} bias {}{} blocks [{}] empty {} threads {} seed {}",
                       heads, kv_heads, head_dim, q_tokens, to_string(mask), window, to_string(bias),
                       t5_bidirectional ? "(bi)" : "", fmt::join(blocks, " "), empty_fraction, threads,
                       seed);
  }
};

struct Data {
  std::vector<float> q;
  std::vector<int64_t> q_pos;
  std::vector<std::vector<float>> k, v;
  std::vector<std::vector<int64_t>> pos;
  std::vector<KvBlock> blocks;
  std::vector<float> slopes, t5_table;
  AttentionSpec spec;
};

Data make(const Case& c) {
  Data d;
  std::mt19937 rng(c.seed);
  std::normal_distribution<float> nd;
  d.spec.heads = c.heads;
  d.spec.kv_heads = c.kv_heads;
  d.spec.head_dim = c.head_dim;
  d.spec.mask = c.mask;
  d.spec.sliding_window = c.window;
  d.spec.bias = c.bias;
  const int n_keys = std::accumulate(c.blocks.begin(), c.blocks.end(), 0);
  // Key positions: 0 .. n_keys+gap-1 minus `gap` random ones, optionally shuffled
  // across blocks; queries sit at the last q_tokens positions of the sequence
  // (self-attention after a cached prefix), some also before every key.
  std::vector<int64_t> all(static_cast<std::size_t>(n_keys + c.gap));
  std::iota(all.begin(), all.end(), int64_t{0});
  std::shuffle(all.begin(), all.end(), rng);
  all.resize(static_cast<std::size_t>(n_keys));
  std::sort(all.begin(), all.end());
  const int64_t seq_end = n_keys + c.gap;
  if (c.shuffle) std::shuffle(all.begin(), all.end(), rng);
  std::bernoulli_distribution empty(c.empty_fraction);
  for (auto& p : all)
    if (empty(rng)) p = -1 - static_cast<int64_t>(rng() % 5);
  for (int t = 0; t < c.q_tokens; ++t) d.q_pos.push_back(seq_end - c.q_tokens + t);
  if (c.q_tokens > 2) d.q_pos[0] = -3;  // sees nothing under causal/sliding masks
  const int64_t row = static_cast<int64_t>(c.kv_heads) * c.head_dim;
  std::size_t off = 0;
  for (int b : c.blocks) {
    d.k.emplace_back(static_cast<std::size_t>(b * row));
    d.v.emplace_back(static_cast<std::size_t>(b * row));
    for (auto& x : d.k.back()) x = nd(rng);
    for (auto& x : d.v.back()) x = nd(rng);
    d.pos.emplace_back(all.begin() + static_cast<std::ptrdiff_t>(off),
                       all.begin() + static_cast<std::ptrdiff_t>(off + static_cast<std::size_t>(b)));
    off += static_cast<std::size_t>(b);
  }
  for (std::size_t i = 0; i < c.blocks.size(); ++i)
    d.blocks.push_back({d.k[i].data(), d.v[i].data(), d.pos[i].data(), c.blocks[i]});
  d.q.resize(static_cast<std::size_t>(c.q_tokens) * c.heads * c.head_dim);
  for (auto& x : d.q) x = nd(rng);
  if (c.bias == LogitBias::alibi) {
    d.slopes = alibi_slopes(c.heads);
    d.spec.alibi_slopes = d.slopes;
  }
  if (c.bias == LogitBias::t5) {
    d.spec.t5.num_buckets = 32;
    d.spec.t5.max_distance = 128;
    d.spec.t5.bidirectional = c.t5_bidirectional;
    d.t5_table.resize(32 * static_cast<std::size_t>(c.heads));
    for (auto& x : d.t5_table) x = 2.0f * nd(rng);
    d.spec.t5.table = d.t5_table;
  }
  return d;
}

// |fast - ref| <= 1e-5 * (|ref| + 1): relative at the unit scale of v.
void expect_close(const std::vector<float>& got, const std::vector<float>& ref,
                  const std::string& what) {
  ASSERT_EQ(got.size(), ref.size());
  double worst = 0;
  std::size_t at = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    const double e = std::fabs(static_cast<double>(got[i]) - ref[i]) / (std::fabs(ref[i]) + 1.0);
    if (!(e <= worst)) {
      worst = e;
      at = i;
    }
  }
  EXPECT_LE(worst, 1e-5) << what << " at " << at << ": " << got[at] << " vs " << ref[at];
}

void run_case(const Case& c) {
  Data d = make(c);
  std::vector<float> ref(d.q.size()), got(d.q.size(), 12345.0f);
  oracle::reference_attention(d.spec, d.q.data(), d.q_pos, d.blocks, ref.data());
  AttentionOptions opt;
  opt.num_threads = c.threads;
  attention_forward(d.spec, d.q.data(), d.q_pos, d.blocks, got.data(), opt);
  expect_close(got, ref, c.describe());
}

}  // namespace

TEST(Attention, MatchesReferenceOnFixedCases) {
  const std::vector<Case> cases = {
      // decode: one query, paged blocks, narrow kernel
      {8, 4, 8, 1, MaskKind::causal, 0, LogitBias::none, false, {16, 16, 16, 7}},
      {32, 8, 128, 1, MaskKind::causal, 0, LogitBias::none, false, {256, 100, 37}},
      {32, 32, 64, 1, MaskKind::causal, 0, LogitBias::none, false, {64, 64, 64, 5}},
      {32, 1, 128, 1, MaskKind::causal, 0, LogitBias::none, false, {200, 33}},  // MQA: wide
      // prefill: one block, positions in order
      {4, 4, 128, 300, MaskKind::causal, 0, LogitBias::none, false, {300}, false},
      {8, 2, 64, 130, MaskKind::causal, 0, LogitBias::none, false, {130}, false},
      {4, 1, 80, 65, MaskKind::none, 0, LogitBias::none, false, {65}, false},
      {8, 4, 8, 200, MaskKind::causal, 0, LogitBias::none, false, {200}, false},
      // chunked prefill against a paged, shuffled, gapped cache with empty slots
      {8, 4, 64, 40, MaskKind::causal, 0, LogitBias::none, false, {16, 48, 256, 37}, true, 0.1, 30},
      {4, 2, 128, 17, MaskKind::sliding_window, 37, LogitBias::none, false, {64, 64, 64}, true, 0.05, 10},
      {4, 4, 64, 100, MaskKind::sliding_window, 1, LogitBias::none, false, {100}, false},
      {8, 8, 64, 64, MaskKind::sliding_window, 5, LogitBias::alibi, false, {20, 44, 80}, true, 0.1, 3},
      {8, 2, 80, 33, MaskKind::causal, 0, LogitBias::alibi, false, {128, 77}, true, 0.0, 20},
      {8, 4, 64, 50, MaskKind::none, 0, LogitBias::alibi, false, {50, 31}, true, 0.2, 0},
      {4, 4, 64, 45, MaskKind::none, 0, LogitBias::t5, true, {300, 45}, true, 0.0, 200},
      {8, 2, 128, 20, MaskKind::causal, 0, LogitBias::t5, false, {64, 16, 3}, true, 0.1, 5},
      {4, 4, 8, 1, MaskKind::none, 0, LogitBias::t5, true, {50}, true, 0.1, 0},
      {6, 3, 80, 1, MaskKind::causal, 0, LogitBias::alibi, false, {70, 70}, true, 0.1, 9},
      // long caches: many tiles after the running max settles (no drift)
      {8, 2, 64, 1, MaskKind::causal, 0, LogitBias::none, false, {2048, 1000, 37}, true, 0.01, 50},
      {8, 2, 64, 20, MaskKind::causal, 0, LogitBias::none, false, {1024, 1024, 1024, 17}, true, 0.0, 5},
      // unusual head_dim: below 8, odd, above 128
      {4, 2, 4, 1, MaskKind::causal, 0, LogitBias::none, false, {40, 9}, true, 0.1, 3},
      {4, 2, 4, 30, MaskKind::causal, 0, LogitBias::alibi, false, {40, 9}, true, 0.1, 3},
      {4, 4, 17, 1, MaskKind::none, 0, LogitBias::none, false, {70}, true, 0.0, 0},
      {4, 4, 17, 19, MaskKind::causal, 0, LogitBias::t5, true, {70}, true, 0.0, 0},
      {4, 1, 256, 2, MaskKind::causal, 0, LogitBias::none, false, {100, 20}, true, 0.0, 4},
      {4, 2, 256, 40, MaskKind::sliding_window, 16, LogitBias::none, false, {100, 20}, true, 0.0, 4},
      // every key an empty slot / a query before all keys: zero rows
      {4, 2, 64, 3, MaskKind::causal, 0, LogitBias::none, false, {16}, true, 1.0, 0},
  };
  for (const Case& c : cases) {
    for (int threads : {1, 2}) {
      Case cc = c;
      cc.threads = threads;
      run_case(cc);
    }
  }
}

TEST(Attention, MatchesReferenceOnRandomGrid) {
  std::mt19937 rng(2024);
  const int head_dims[] = {8, 64, 80, 128};
  const int ratios[] = {1, 2, 4, 0};  // 0: MQA
  const int q_lens[] = {1, 2, 3, 5, 16, 17, 63, 64, 65, 129, 300};
  const int block_sizes[] = {16, 32, 37, 64, 100, 128, 256};
  const MaskKind masks[] = {MaskKind::none, MaskKind::causal, MaskKind::sliding_window};
  const LogitBias biases[] = {LogitBias::none, LogitBias::alibi, LogitBias::t5};
  for (int i = 0; i < 120; ++i) {
    Case c;
    c.seed = 100 + static_cast<uint32_t>(i);
    c.head_dim = head_dims[rng() % 4];
    c.kv_heads = 1 + static_cast<int>(rng() % 4);
    const int ratio = ratios[rng() % 4];
    c.heads = ratio == 0 ? 8 : c.kv_heads * ratio;
    if (ratio == 0) c.kv_heads = 1;
    c.q_tokens = q_lens[rng() % 11];
    c.mask = masks[rng() % 3];
    c.window = 1 + static_cast<int64_t>(rng() % 80);
    c.bias = biases[rng() % 3];
    c.t5_bidirectional = rng() % 2;
    const int n_blocks = 1 + static_cast<int>(rng() % 4);
    for (int b = 0; b < n_blocks; ++b) c.blocks.push_back(block_sizes[rng() % 7]);
    c.shuffle = rng() % 2;
    c.empty_fraction = (rng() % 3) * 0.05;
    c.gap = static_cast<int>(rng() % 40);
    c.threads = 1 + static_cast<int>(rng() % 2);
    // Keep the oracle cheap.
    while (static_cast<int64_t>(c.q_tokens) * c.heads * c.head_dim *
               std::accumulate(c.blocks.begin(), c.blocks.end(), 0) >
           40'000'000)
      c.blocks.pop_back();
    if (c.blocks.empty()) c.blocks.push_back(16);
    run_case(c);
  }
}

TEST(Attention, SoftmaxScaleIsUsedAndZeroMeansInverseSqrtHeadDim) {
  Case c{4, 2, 64, 9, MaskKind::causal, 0, LogitBias::none, false, {40}, false};
  Data d = make(c);
  std::vector<float> a(d.q.size()), b(d.q.size()), ref(d.q.size());
  attention_forward(d.spec, d.q.data(), d.q_pos, d.blocks, a.data());
  d.spec.softmax_scale = 0.125f;  // == 1/sqrt(64)
  attention_forward(d.spec, d.q.data(), d.q_pos, d.blocks, b.data());
  EXPECT_EQ(a, b);
  d.spec.softmax_scale = 0.9f;
  attention_forward(d.spec, d.q.data(), d.q_pos, d.blocks, b.data());
  oracle::reference_attention(d.spec, d.q.data(), d.q_pos, d.blocks, ref.data());
  expect_close(b, ref, "softmax_scale 0.9");
  EXPECT_NE(a, b);
}

TEST(Attention, BlockOrderAndSplittingDoNotMatter) {
  // The same keys as one block, as reversed blocks, and as 1-token blocks.
  Case c{8, 2, 64, 20, MaskKind::causal, 0, LogitBias::alibi, false, {90}, true};
  Data d = make(c);
  std::vector<float> one(d.q.size()), split(d.q.size());
  attention_forward(d.spec, d.q.data(), d.q_pos, d.blocks, one.data());
  std::vector<KvBlock> pieces;
  const int64_t row = 2 * 64;
  for (int64_t j = 89; j >= 0; --j)
    pieces.push_back({d.k[0].data() + j * row, d.v[0].data() + j * row, d.pos[0].data() + j, 1});
  attention_forward(d.spec, d.q.data(), d.q_pos, pieces, split.data());
  expect_close(split, one, "1-token blocks");
}

TEST(Attention, RejectsInconsistentArguments) {
  Case c{4, 2, 64, 2, MaskKind::causal, 0, LogitBias::none, false, {16}};
  Data d = make(c);
  std::vector<float> out(d.q.size());
  AttentionSpec bad = d.spec;
  bad.kv_heads = 3;
  EXPECT_THROW(attention_forward(bad, d.q.data(), d.q_pos, d.blocks, out.data()), InvalidArgument);
  bad = d.spec;
  bad.mask = MaskKind::sliding_window;
  bad.sliding_window = 0;
  EXPECT_THROW(attention_forward(bad, d.q.data(), d.q_pos, d.blocks, out.data()), InvalidArgument);
  bad = d.spec;
  bad.bias = LogitBias::alibi;  // no slopes
  EXPECT_THROW(attention_forward(bad, d.q.data(), d.q_pos, d.blocks, out.data()), InvalidArgument);
  std::vector<KvBlock> null_block{{nullptr, nullptr, nullptr, 4}};
  EXPECT_THROW(attention_forward(d.spec, d.q.data(), d.q_pos, null_block, out.data()),
               InvalidArgument);
  AttentionOptions neg;
  neg.num_threads = -1;
  EXPECT_THROW(attention_forward(d.spec, d.q.data(), d.q_pos, d.blocks, out.data(), neg),
               InvalidArgument);
  // No keys at all: every row is zero.
  std::fill(out.begin(), out.end(), 7.0f);
  attention_forward(d.spec, d.q.data(), d.q_pos, {}, out.data());
  for (float x : out) EXPECT_EQ(x, 0.0f);
}

TEST(AttentionWithRope, MatchesRotateThenReference) {
  struct R {
    int heads, kv_heads, head_dim, rotary_dim, q_tokens;
    RopeLayout layout;
    double attention_factor;
    std::vector<int> blocks;
  };
  const std::vector<R> cases = {
      {8, 4, 8, 8, 1, RopeLayout::interleaved, 1.0, {16, 16, 3}},
      {4, 4, 128, 128, 70, RopeLayout::half, 1.0, {70}},
      {8, 2, 64, 32, 33, RopeLayout::half, 1.2231435513142097, {40, 25}},  // partial, yarn-like factor
      {4, 1, 80, 80, 20, RopeLayout::interleaved, 1.0, {64, 100}},
      {6, 3, 128, 64, 1, RopeLayout::interleaved, 1.0, {256, 9}},
  };
  for (const R& r : cases) {
    for (int threads : {1, 2}) {
      Case c{r.heads, r.kv_heads, r.head_dim, r.q_tokens, MaskKind::causal, 0, LogitBias::none,
             false, r.blocks, true, 0.05, 7};
      Data d = make(c);
      RopeFrequencies f = default_rope_frequencies(r.head_dim, r.rotary_dim, 10000.0);
      f.attention_factor = r.attention_factor;
      // Oracle: rotate q and k (reference RoPE), then the reference attention.
      auto q_rot = oracle::reference_rope(d.q.data(), r.q_tokens, r.heads, f, d.q_pos.data(), r.layout);
      std::vector<std::vector<float>> k_rot;
      std::vector<KvBlock> rot_blocks = d.blocks;
      for (std::size_t b = 0; b < d.blocks.size(); ++b) {
        k_rot.push_back(oracle::reference_rope(d.k[b].data(), d.blocks[b].n_tokens, r.kv_heads, f,
                                                d.pos[b].data(), r.layout));
        rot_blocks[b].k = k_rot.back().data();
      }
      std::vector<float> ref(d.q.size()), got(d.q.size());
      oracle::reference_attention(d.spec, q_rot.data(), d.q_pos, rot_blocks, ref.data());
      const auto k_before = d.k;
      AttentionOptions opt;
      opt.num_threads = threads;
      attention_with_rope(d.spec, f, r.layout, AnglePrecision::float32, d.q.data(), d.q_pos,
                          d.blocks, got.data(), opt);
      expect_close(got, ref, "rope head_dim " + std::to_string(r.head_dim));
      EXPECT_EQ(d.k, k_before) << "the caller's keys must stay unrotated";
    }
  }
}

TEST(AttentionWithRope, EqualsApplyRopeThenAttentionForward) {
  // Same numerics as rotating with apply_rope (float32 or exact) and calling
  // attention_forward.
  Case c{8, 2, 64, 30, MaskKind::causal, 0, LogitBias::none, false, {64, 30}, true, 0.0, 4};
  Data d = make(c);
  const RopeFrequencies f = default_rope_frequencies(64, 64, 500000.0);
  for (auto precision : {AnglePrecision::float32, AnglePrecision::exact}) {
    auto q = d.q;
    apply_rope(q.data(), 30, 8, f, d.q_pos, RopeLayout::half, precision);
    auto k0 = d.k[0], k1 = d.k[1];
    apply_rope(k0.data(), 64, 2, f, d.pos[0], RopeLayout::half, precision);
    apply_rope(k1.data(), 30, 2, f, d.pos[1], RopeLayout::half, precision);
    std::vector<KvBlock> blocks = d.blocks;
    blocks[0].k = k0.data();
    blocks[1].k = k1.data();
    std::vector<float> a(d.q.size()), b(d.q.size());
    attention_forward(d.spec, q.data(), d.q_pos, blocks, a.data());
    attention_with_rope(d.spec, f, RopeLayout::half, precision, d.q.data(), d.q_pos, d.blocks,
                        b.data());
    expect_close(b, a, "apply_rope + attention_forward");
  }
  std::vector<float> scratch(d.q.size());
  EXPECT_THROW(attention_with_rope(d.spec, default_rope_frequencies(32, 32, 1e4), RopeLayout::half,
                                   AnglePrecision::float32, d.q.data(), d.q_pos, d.blocks, scratch.data()),
               InvalidArgument);
}

TEST(Attention, PrefillChunkedAndDecodeAreBitIdentical) {
  // Batch invariance: the prefill runs the wide kernel (rows in lanes), each
  // decode step the narrow one (keys in lanes), chunked prefill either; every
  // row is computed with the same operations in the same order, so a row's
  // output depends only on its query and the keys (same keys, same order),
  // not on which other rows share the call. The cache is paged (16-token
  // pages), as a KV cache hands it over.
  struct P {
    int heads, kv_heads, head_dim;
    MaskKind mask;
    int64_t window;
    LogitBias bias;
  };
  const P params[] = {{8, 4, 8, MaskKind::causal, 0, LogitBias::none},
                      {8, 2, 64, MaskKind::causal, 0, LogitBias::none},
                      {4, 4, 128, MaskKind::causal, 0, LogitBias::alibi},
                      {8, 8, 80, MaskKind::sliding_window, 21, LogitBias::none},
                      {6, 3, 17, MaskKind::causal, 0, LogitBias::t5},
                      {32, 1, 64, MaskKind::causal, 0, LogitBias::none},   // MQA: decode is wide too
                      {7, 7, 20, MaskKind::causal, 0, LogitBias::none},    // decode 2 heads at a time, 1 left
                      {10, 2, 36, MaskKind::causal, 0, LogitBias::alibi},  // decode groups of 5, 7 and 8 rows
                      {14, 2, 24, MaskKind::sliding_window, 33, LogitBias::none},
                      {32, 4, 128, MaskKind::causal, 0, LogitBias::none}};
  constexpr int64_t T = 150;
  for (const P& pr : params) {
    Case c{pr.heads, pr.kv_heads, pr.head_dim, static_cast<int>(T), pr.mask, pr.window, pr.bias,
           true, {static_cast<int>(T)}, false};
    Data d = make(c);
    std::iota(d.q_pos.begin(), d.q_pos.end(), int64_t{0});
    const int64_t row = static_cast<int64_t>(pr.heads) * pr.head_dim;
    const int64_t kv_row = static_cast<int64_t>(pr.kv_heads) * pr.head_dim;
    bool reversed = false;  // pages handed over last first (sorted by position inside)
    auto pages_up_to = [&](int64_t end) {
      std::vector<KvBlock> pages;
      for (int64_t j = 0; j < end; j += 16)
        pages.push_back({d.k[0].data() + j * kv_row, d.v[0].data() + j * kv_row,
                         d.pos[0].data() + j, std::min<int64_t>(16, end - j)});
      if (reversed) std::reverse(pages.begin(), pages.end());
      return pages;
    };
    std::vector<float> full(d.q.size()), other(d.q.size());
    attention_forward(d.spec, d.q.data(), d.q_pos, pages_up_to(T), full.data());
    for (int threads : {1, 2}) {
      AttentionOptions opt;
      opt.num_threads = threads;
      attention_forward(d.spec, d.q.data(), d.q_pos, pages_up_to(T), other.data(), opt);
      EXPECT_EQ(other, full) << "threads " << threads;
    }
    for (int64_t chunk : {int64_t{1}, int64_t{3}, int64_t{40}}) {
      std::vector<float> inc(d.q.size());
      for (int64_t t0 = 0; t0 < T; t0 += chunk) {
        const int64_t n = std::min(chunk, T - t0);
        attention_forward(d.spec, d.q.data() + t0 * row,
                          std::span(d.q_pos).subspan(static_cast<std::size_t>(t0), static_cast<std::size_t>(n)),
                          pages_up_to(t0 + n), inc.data() + t0 * row);
      }
      EXPECT_EQ(inc, full) << "heads " << pr.heads << "/" << pr.kv_heads << " head_dim "
                           << pr.head_dim << " chunk " << chunk;
    }
    // Pages in reverse order: keys are sorted by position before tiling, for
    // every query count, so decode still matches the in-order prefill.
    if (pr.mask != MaskKind::none) {
      reversed = true;
      std::vector<float> inc(d.q.size());
      for (int64_t t = 0; t < T; ++t)
        attention_forward(d.spec, d.q.data() + t * row, std::span(d.q_pos).subspan(static_cast<std::size_t>(t), 1),
                          pages_up_to(t + 1), inc.data() + t * row);
      EXPECT_EQ(inc, full) << "reversed pages, head_dim " << pr.head_dim;
      reversed = false;
    }
  }
}

// f16/bf16 blocks (a 16-bit KV cache handed over as stored) are read as their exact float32 values: the
// output equals, bit for bit, the output over the same blocks widened to float32 — in decode (the AVX2
// narrow kernel reads the 16-bit rows in place, group sizes 1..8), in prefill (wide kernel over a widened
// copy), with masks, biases, empty slots, shuffled pages, head_dims with a partial last vector, both thread
// counts (with a 2 + 3 split of KV heads over the threads), blocks of mixed dtypes, empty blocks and
// attention_with_rope. Some keys and values are binary16 subnormals
// (|x| < 6.1e-5), whose widening F16C does in hardware.
TEST(Attention, SixteenBitBlocksGiveTheBitsOfTheirWidenedCopies) {
  struct P {
    int heads, kv_heads, head_dim;
    MaskKind mask;
    int64_t window;
    LogitBias bias;
    std::vector<int> blocks = {64, 16, 100, 7, 130};
  };
  const P params[] = {{8, 8, 8, MaskKind::causal, 0, LogitBias::none},       // group 1
                      {8, 4, 17, MaskKind::causal, 0, LogitBias::t5},        // 2, tail of 1 channel
                      {12, 4, 64, MaskKind::sliding_window, 90, LogitBias::none},  // 3
                      {8, 2, 80, MaskKind::causal, 0, LogitBias::alibi},     // 4
                      {10, 2, 36, MaskKind::none, 0, LogitBias::none},       // 5, tail of 4
                      {32, 4, 128, MaskKind::causal, 0, LogitBias::none},    // 8: the largest decode group
                      {32, 32, 128, MaskKind::causal, 0, LogitBias::none},   // 1, the 32-KV-head shape
                      {7, 7, 20, MaskKind::causal, 0, LogitBias::alibi},     // 1, odd KV heads: a pair and one left
                      // Enough keys (work >= 2^20) that 2 threads split the 5 KV heads 2 + 3 (a pair and
                      // one left on the second), head_dim 20 ending in a partial vector, 0-token blocks
                      // (given as f32) among the 16-bit ones.
                      {5, 5, 20, MaskKind::causal, 0, LogitBias::none, {4096, 0, 3000, 5000, 0, 77}},
                      {10, 5, 20, MaskKind::sliding_window, 6000, LogitBias::none, {6000, 0, 6100}}};
  for (const P& pr : params)
    for (KvCacheDtype dtype : {KvCacheDtype::f16, KvCacheDtype::bf16})
      for (int q_tokens : {1, 2, 9}) {
        Case c{pr.heads, pr.kv_heads, pr.head_dim, q_tokens, pr.mask, pr.window, pr.bias,
               false, pr.blocks, true, 0.1, 5};
        Data d = make(c);
        const auto to16 = [&](float x) { return dtype == KvCacheDtype::f16 ? f32_to_f16(x) : f32_to_bf16(x); };
        const auto to32 = [&](uint16_t h) { return dtype == KvCacheDtype::f16 ? f16_to_f32(h) : bf16_to_f32(h); };
        std::vector<std::vector<uint16_t>> k16, v16;
        std::vector<std::vector<float>> kw, vw;
        std::size_t subnormal = 0;
        for (std::size_t b = 0; b < d.k.size(); ++b) {
          k16.emplace_back(d.k[b].size());
          v16.emplace_back(d.v[b].size());
          for (std::size_t i = 0; i < d.k[b].size(); ++i) {
            const float scale = i % 29 == 3 ? 1e-6f : 1.0f;  // binary16 subnormals
            k16[b][i] = to16(d.k[b][i] * scale);
            v16[b][i] = to16(d.v[b][i] * scale);
            subnormal += dtype == KvCacheDtype::f16 && (k16[b][i] & 0x7C00u) == 0 && (k16[b][i] & 0x3FFu) != 0;
          }
          kw.emplace_back(k16[b].size());
          vw.emplace_back(v16[b].size());
          std::transform(k16[b].begin(), k16[b].end(), kw[b].begin(), to32);
          std::transform(v16[b].begin(), v16[b].end(), vw[b].begin(), to32);
        }
        if (dtype == KvCacheDtype::f16) {
          ASSERT_GT(subnormal, 0u);
        }
        std::vector<KvBlock> stored, widened, mixed;
        for (std::size_t b = 0; b < d.k.size(); ++b) {
          if (d.blocks[b].n_tokens == 0) {  // an empty f32 block (null data) among the 16-bit ones
            stored.push_back({});
            widened.push_back({});
            mixed.push_back({});
            continue;
          }
          KvBlock s16;
          s16.position_ids = d.pos[b].data();
          s16.n_tokens = d.blocks[b].n_tokens;
          s16.dtype = dtype;
          s16.k16 = k16[b].data();
          s16.v16 = v16[b].data();
          stored.push_back(s16);
          widened.push_back({kw[b].data(), vw[b].data(), d.pos[b].data(), d.blocks[b].n_tokens});
          mixed.push_back(b % 2 ? widened.back() : s16);
        }
        const std::string what = fmt::format("{} {}", to_string(dtype), c.describe());
        const auto same_bits = [&](const std::vector<float>& a, const std::vector<float>& b, const char* path) {
          ASSERT_EQ(a.size(), b.size());
          EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0) << path << ", " << what;
        };
        std::vector<float> want(d.q.size()), got(d.q.size());
        attention_forward(d.spec, d.q.data(), d.q_pos, widened, want.data());
        for (int threads : {1, 2}) {
          AttentionOptions opt;
          opt.num_threads = threads;
          std::fill(got.begin(), got.end(), 7.0f);
          attention_forward(d.spec, d.q.data(), d.q_pos, stored, got.data(), opt);
          same_bits(got, want, threads == 1 ? "16-bit blocks, 1 thread" : "16-bit blocks, 2 threads");
        }
        std::fill(got.begin(), got.end(), 7.0f);
        attention_forward(d.spec, d.q.data(), d.q_pos, mixed, got.data());
        same_bits(got, want, "f32 and 16-bit blocks mixed");
        if (q_tokens == 1 && pr.bias == LogitBias::none) {
          const RopeFrequencies f = default_rope_frequencies(pr.head_dim, pr.head_dim / 2 * 2, 10000.0);
          std::vector<float> rope_want(d.q.size()), rope_got(d.q.size());
          attention_with_rope(d.spec, f, RopeLayout::half, AnglePrecision::float32, d.q.data(), d.q_pos, widened,
                              rope_want.data());
          attention_with_rope(d.spec, f, RopeLayout::half, AnglePrecision::float32, d.q.data(), d.q_pos, stored,
                              rope_got.data());
          same_bits(rope_got, rope_want, "attention_with_rope");
        }
        // The 16-bit rounding is real: the output is not the float32 blocks' output.
        std::vector<float> exact(d.q.size());
        attention_forward(d.spec, d.q.data(), d.q_pos, d.blocks, exact.data());
        EXPECT_NE(exact, want) << what;
      }
}

TEST(Attention, SixteenBitBlocksWithoutTheirDataAreRejected) {
  Case c{4, 2, 16, 1, MaskKind::causal, 0, LogitBias::none, false, {8}};
  Data d = make(c);
  std::vector<float> out(d.q.size());
  std::vector<uint16_t> bits(d.k[0].size());
  KvBlock b = d.blocks[0];  // k and v set, but the dtype says the data is in k16/v16
  b.dtype = KvCacheDtype::f16;
  b.k16 = bits.data();
  std::vector<KvBlock> kv{b};
  try {
    attention_forward(d.spec, d.q.data(), d.q_pos, kv, out.data());
    ADD_FAILURE() << "no exception";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("kv[0].v16 is null"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("dtype f16"), std::string::npos) << e.what();
  }
  kv[0].v16 = bits.data();
  kv[0].dtype = static_cast<KvCacheDtype>(7);
  EXPECT_THROW(attention_forward(d.spec, d.q.data(), d.q_pos, kv, out.data()), InvalidArgument);
  EXPECT_THROW(attention_with_rope(d.spec, default_rope_frequencies(16, 16, 1e4), RopeLayout::half,
                                   AnglePrecision::float32, d.q.data(), d.q_pos, kv, out.data()),
               InvalidArgument);
}

// AttentionOptions::kv_head_begin/end (the decode team splits one call so): every KV head range gives, for the
// query heads it covers, the bits of one call over all heads, whether the rows take the narrow (decode) or the
// wide (prefill) kernel, over float32 or 16-bit blocks, at 1 or 2 threads inside the range; the heads outside the
// range keep what the caller left there. Per-head arguments (ALiBi slopes, T5 columns) must follow the head's
// index, not its place in the range.
TEST(Attention, KvHeadRangesGiveTheBitsOfOneCallOverAllHeads) {
  struct P {
    int heads, kv_heads, head_dim;
    MaskKind mask;
    int64_t window;
    LogitBias bias;
    std::vector<int> blocks;
  };
  const P params[] = {{8, 4, 64, MaskKind::causal, 0, LogitBias::none, {64, 16, 100, 7}},
                      {8, 8, 17, MaskKind::causal, 0, LogitBias::alibi, {40, 33}},
                      {12, 3, 32, MaskKind::sliding_window, 50, LogitBias::t5, {64, 64, 10}},
                      {6, 2, 20, MaskKind::none, 0, LogitBias::none, {30, 0, 45}},
                      // Enough keys (work >= 2^20) that 2 threads split a range of several heads.
                      {8, 8, 64, MaskKind::causal, 0, LogitBias::none, {3000, 2000}}};
  for (const P& pr : params)
    for (int q_tokens : {1, 3, 70})
      for (bool sixteen : {false, true}) {
        if (q_tokens == 70 && std::accumulate(pr.blocks.begin(), pr.blocks.end(), 0) > 1000) continue;  // time
        Case c{pr.heads, pr.kv_heads, pr.head_dim, q_tokens, pr.mask, pr.window, pr.bias,
               false, pr.blocks, true, 0.05, 11};
        Data d = make(c);
        std::vector<std::vector<uint16_t>> k16, v16;
        std::vector<KvBlock> blocks = d.blocks;
        if (sixteen)
          for (std::size_t b = 0; b < d.k.size(); ++b) {
            k16.emplace_back(d.k[b].size());
            v16.emplace_back(d.v[b].size());
            std::transform(d.k[b].begin(), d.k[b].end(), k16.back().begin(), f32_to_f16);
            std::transform(d.v[b].begin(), d.v[b].end(), v16.back().begin(), f32_to_f16);
            blocks[b].k = blocks[b].v = nullptr;
            blocks[b].dtype = KvCacheDtype::f16;
            blocks[b].k16 = k16.back().data();
            blocks[b].v16 = v16.back().data();
          }
        // Other keys and values of the same shapes (negated): a call over them before each range call leaves the
        // kernel's per-thread copies of 16-bit blocks holding values a range call must not read.
        std::vector<std::vector<uint16_t>> pk16, pv16;
        std::vector<std::vector<float>> pk, pv;
        std::vector<KvBlock> poison = blocks;
        for (std::size_t b = 0; b < d.k.size(); ++b) {
          pk.emplace_back(d.k[b].size());
          pv.emplace_back(d.v[b].size());
          std::transform(d.k[b].begin(), d.k[b].end(), pk.back().begin(), [](float x) { return -x - 0.5f; });
          std::transform(d.v[b].begin(), d.v[b].end(), pv.back().begin(), [](float x) { return -x + 0.25f; });
          pk16.emplace_back(pk.back().size());
          pv16.emplace_back(pv.back().size());
          std::transform(pk.back().begin(), pk.back().end(), pk16.back().begin(), f32_to_f16);
          std::transform(pv.back().begin(), pv.back().end(), pv16.back().begin(), f32_to_f16);
          if (sixteen) {
            poison[b].k16 = pk16.back().data();
            poison[b].v16 = pv16.back().data();
          } else {
            poison[b].k = pk.back().data();
            poison[b].v = pv.back().data();
          }
        }
        std::vector<float> scratch(d.q.size());
        const auto poison_copies = [&](int threads) {
          AttentionOptions all;
          all.num_threads = threads;
          attention_forward(d.spec, d.q.data(), d.q_pos, poison, scratch.data(), all);
        };
        const std::string what = fmt::format("{}{}", c.describe(), sixteen ? " f16 blocks" : "");
        std::vector<float> want(d.q.size());
        attention_forward(d.spec, d.q.data(), d.q_pos, blocks, want.data());
        const int group = pr.heads / pr.kv_heads;
        const std::size_t per_head = static_cast<std::size_t>(pr.head_dim);
        const float sentinel = -7.25f;
        // Every range [h0, h1) (empty ones included), then two complementary ranges filling one buffer.
        for (int h0 = 0; h0 <= pr.kv_heads; ++h0)
          for (int h1 = h0; h1 <= pr.kv_heads; ++h1)
            for (int threads : {1, 2}) {
              if (threads == 2 && h1 - h0 < 2) continue;
              AttentionOptions opt;
              opt.num_threads = threads;
              opt.kv_head_begin = h0;
              opt.kv_head_end = h1 == pr.kv_heads && h0 % 2 == 1 ? -1 : h1;  // -1: to the last head
              std::vector<float> got(d.q.size(), sentinel);
              poison_copies(threads);
              attention_forward(d.spec, d.q.data(), d.q_pos, blocks, got.data(), opt);
              for (int t = 0; t < q_tokens; ++t)
                for (int h = 0; h < pr.heads; ++h) {
                  const std::size_t at = (static_cast<std::size_t>(t) * pr.heads + h) * per_head;
                  const bool inside = h / group >= h0 && h / group < h1;
                  if (inside)
                    ASSERT_EQ(std::memcmp(got.data() + at, want.data() + at, per_head * sizeof(float)), 0)
                        << what << ": kv heads [" << h0 << ", " << h1 << ") at " << threads
                        << " threads, token " << t << " head " << h;
                  else
                    for (std::size_t i = 0; i < per_head; ++i)
                      ASSERT_EQ(got[at + i], sentinel) << what << ": head " << h << " outside [" << h0 << ", "
                                                       << h1 << ") was written";
                }
            }
        std::vector<float> halves(d.q.size(), sentinel);
        for (int part = 0; part < 2; ++part) {
          AttentionOptions opt;
          opt.num_threads = 1;
          opt.kv_head_begin = part == 0 ? 0 : pr.kv_heads / 2;
          opt.kv_head_end = part == 0 ? pr.kv_heads / 2 : pr.kv_heads;
          poison_copies(1);
          attention_forward(d.spec, d.q.data(), d.q_pos, blocks, halves.data(), opt);
        }
        EXPECT_EQ(std::memcmp(halves.data(), want.data(), want.size() * sizeof(float)), 0) << what;
      }
}

TEST(Attention, KvHeadRangesOutsideTheHeadsAreRejected) {
  Case c{8, 4, 16, 1, MaskKind::causal, 0, LogitBias::none, false, {8}};
  Data d = make(c);
  std::vector<float> out(d.q.size(), 3.0f);
  const std::pair<int, int> bad[] = {{-1, 2}, {3, 2}, {0, 5}, {5, -1}, {0, -2}, {2, 1}};
  for (const auto& [b, e] : bad) {
    AttentionOptions opt;
    opt.kv_head_begin = b;
    opt.kv_head_end = e;
    try {
      attention_forward(d.spec, d.q.data(), d.q_pos, d.blocks, out.data(), opt);
      ADD_FAILURE() << "no exception for [" << b << ", " << e << ")";
    } catch (const InvalidArgument& ex) {
      EXPECT_NE(std::string(ex.what()).find("kv_head_begin " + std::to_string(b)), std::string::npos) << ex.what();
      EXPECT_NE(std::string(ex.what()).find("num_key_value_heads (4"), std::string::npos) << ex.what();
    }
    for (float x : out) ASSERT_EQ(x, 3.0f) << "a rejected call wrote its output";
    // With no query token too (nothing to compute, but the range is still checked).
    EXPECT_THROW(attention_forward(d.spec, d.q.data(), std::span<const int64_t>(), d.blocks, out.data(), opt),
                 InvalidArgument);
  }
}

}  // namespace POSENC_UNITY_ID
