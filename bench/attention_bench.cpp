// Attention throughput: prefill (causal, RoPE) next to the naive reference
// and the machine's FP32 FMA peak; decode against a paged cache.
//
// FLOP counts (multiply and add counted separately, QKᵀ and PV):
//  - causal prefill of T tokens: 2 * 2 * T^2 * d * heads / 2 (half the pairs
//    are visible), the usual FlashAttention convention.
//  - BM_AttentionNaive (tests/attention/attention_reference.hpp: materialised
//    scores, double accumulation) runs a smaller problem, T = 512 and 8 heads
//    (d = 128, causal, RoPE applied by the reference too), and is counted with
//    the same formula for ITS size, so the GFLOPs columns compare directly.
//  - decode: 1 query x 4096 cached tokens; GBps = bytes of K and V read
//    (2 * 4096 * kv_heads * d * 4) per call, tokens/s = calls per second.
#include <algorithm>
#include <cstdint>
#include <map>
#include <memory>
#include <numeric>
#include <vector>

#include "../tests/attention/attention_reference.hpp"
#include "bench_util.hpp"
#include "posenc/attention.hpp"
#include "posenc/float16.hpp"
#include "posenc/kv_cache.hpp"
#include "posenc/rope.hpp"

namespace {

using posenc::bench::FloatBuffer;
using posenc::bench::giga_rate;

struct Problem {
  int heads, kv_heads, head_dim;
  int64_t q_tokens, kv_tokens;
  int block;  // KvBlock size (paged cache)
  FloatBuffer q, k, v, out;
  std::vector<int64_t> q_pos, kv_pos;
  std::vector<posenc::KvBlock> blocks;
  posenc::AttentionSpec spec;

  Problem(int h, int kvh, int d, int64_t qt, int64_t kvt, int blk)
      : heads(h), kv_heads(kvh), head_dim(d), q_tokens(qt), kv_tokens(kvt), block(blk),
        q(static_cast<std::size_t>(qt * h * d)), k(static_cast<std::size_t>(kvt * kvh * d)),
        v(static_cast<std::size_t>(kvt * kvh * d)), out(static_cast<std::size_t>(qt * h * d)) {
    q.fill_normal(1);
    k.fill_normal(2);
    v.fill_normal(3);
    kv_pos.resize(static_cast<std::size_t>(kvt));
    std::iota(kv_pos.begin(), kv_pos.end(), int64_t{0});
    for (int64_t t = 0; t < qt; ++t) q_pos.push_back(kvt - qt + t);
    const int64_t row = static_cast<int64_t>(kvh) * d;
    for (int64_t j = 0; j < kvt; j += blk)
      blocks.push_back({k.get() + j * row, v.get() + j * row, kv_pos.data() + j,
                        std::min<int64_t>(blk, kvt - j)});
    spec.heads = h;
    spec.kv_heads = kvh;
    spec.head_dim = d;
    spec.mask = posenc::MaskKind::causal;
  }
  double causal_flops() const {
    return 2.0 * 2.0 * static_cast<double>(q_tokens) * q_tokens * head_dim * heads / 2.0;
  }
};

// Arguments: threads, rope (1 = attention_with_rope, 0 = attention_forward).
void BM_AttentionPrefill(benchmark::State& state) {
  static Problem p(32, 32, 128, 2048, 2048, 2048);
  const auto freqs = posenc::default_rope_frequencies(128, 128, 10000.0);
  posenc::AttentionOptions opt;
  opt.num_threads = static_cast<int>(state.range(0));
  const bool rope = state.range(1) != 0;
  for (auto _ : state) {
    if (rope)
      posenc::attention_with_rope(p.spec, freqs, posenc::RopeLayout::half,
                                  posenc::AnglePrecision::float32, p.q.get(), p.q_pos, p.blocks,
                                  p.out.get(), opt);
    else
      posenc::attention_forward(p.spec, p.q.get(), p.q_pos, p.blocks, p.out.get(), opt);
    benchmark::ClobberMemory();
  }
  state.counters["GFLOPs"] = giga_rate(p.causal_flops(), state);
}
BENCHMARK(BM_AttentionPrefill)
    ->ArgNames({"threads", "rope"})
    ->Args({1, 1})
    ->Args({2, 1})
    ->Args({2, 0})
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);

// GQA prefill (32 heads, 8 KV heads) on a paged cache of 256-token blocks.
void BM_AttentionPrefillGqa(benchmark::State& state) {
  static Problem p(32, 8, 128, 2048, 2048, 256);
  posenc::AttentionOptions opt;
  opt.num_threads = static_cast<int>(state.range(0));
  for (auto _ : state) {
    posenc::attention_forward(p.spec, p.q.get(), p.q_pos, p.blocks, p.out.get(), opt);
    benchmark::ClobberMemory();
  }
  state.counters["GFLOPs"] = giga_rate(p.causal_flops(), state);
}
BENCHMARK(BM_AttentionPrefillGqa)->ArgNames({"threads"})->Arg(2)->UseRealTime()->Unit(benchmark::kMillisecond);

// The oracle: RoPE on q and k in double, then materialised double scores.
void BM_AttentionNaive(benchmark::State& state) {
  static Problem p(8, 8, 128, 512, 512, 512);
  const auto freqs = posenc::default_rope_frequencies(128, 128, 10000.0);
  for (auto _ : state) {
    auto q = posenc::oracle::reference_rope(p.q.get(), p.q_tokens, p.heads, freqs, p.q_pos.data(),
                                            posenc::RopeLayout::half);
    auto k = posenc::oracle::reference_rope(p.k.get(), p.kv_tokens, p.kv_heads, freqs,
                                            p.kv_pos.data(), posenc::RopeLayout::half);
    std::vector<posenc::KvBlock> blocks{{k.data(), p.v.get(), p.kv_pos.data(), p.kv_tokens}};
    posenc::oracle::reference_attention(p.spec, q.data(), p.q_pos, blocks, p.out.get());
    benchmark::ClobberMemory();
  }
  state.counters["GFLOPs"] = giga_rate(p.causal_flops(), state);
}
BENCHMARK(BM_AttentionNaive)->UseRealTime()->Unit(benchmark::kMillisecond);

// The fast kernel on the naive benchmark's exact problem (same FLOP count).
void BM_AttentionPrefillSmall(benchmark::State& state) {
  static Problem p(8, 8, 128, 512, 512, 512);
  const auto freqs = posenc::default_rope_frequencies(128, 128, 10000.0);
  posenc::AttentionOptions opt;
  opt.num_threads = static_cast<int>(state.range(0));
  for (auto _ : state) {
    posenc::attention_with_rope(p.spec, freqs, posenc::RopeLayout::half,
                                posenc::AnglePrecision::float32, p.q.get(), p.q_pos, p.blocks,
                                p.out.get(), opt);
    benchmark::ClobberMemory();
  }
  state.counters["GFLOPs"] = giga_rate(p.causal_flops(), state);
}
BENCHMARK(BM_AttentionPrefillSmall)->ArgNames({"threads"})->Arg(1)->UseRealTime()->Unit(benchmark::kMillisecond);

// Arguments: kv_heads, threads. 32 query heads, d = 128, 4096 cached tokens in
// 256-token blocks, keys already rotated (as a KV cache stores them).
void BM_AttentionDecode(benchmark::State& state) {
  const int kv_heads = static_cast<int>(state.range(0));
  static std::map<int, std::unique_ptr<Problem>> problems;  // built once per shape
  auto& slot = problems[kv_heads];
  if (!slot) {
    slot = std::make_unique<Problem>(32, kv_heads, 128, 1, 4096, 256);
    slot->q_pos[0] = 4096;
  }
  Problem& p = *slot;
  posenc::AttentionOptions opt;
  opt.num_threads = static_cast<int>(state.range(1));
  for (auto _ : state) {
    posenc::attention_forward(p.spec, p.q.get(), p.q_pos, p.blocks, p.out.get(), opt);
    benchmark::ClobberMemory();
  }
  state.counters["GBps"] = giga_rate(2.0 * 4096.0 * kv_heads * 128 * sizeof(float), state);
  state.counters["tokens_per_s"] =
      benchmark::Counter(static_cast<double>(state.iterations()), benchmark::Counter::kIsRate);
}
BENCHMARK(BM_AttentionDecode)
    ->ArgNames({"kv_heads", "threads"})
    ->Args({32, 1})
    ->Args({32, 2})
    ->Args({8, 1})
    ->Args({8, 2})
    ->UseRealTime()
    ->Unit(benchmark::kMicrosecond);

// Decode against a long cache in a 16-bit dtype: 1 query, 32 query heads, 32 KV heads, d = 128, 32768
// cached tokens in 256-token blocks (the shape of the ggml comparison: tools/refs/ggml_fa_decode.cpp
// times ggml_flash_attn_ext on it). Arguments: mode, threads.
//  - mode 0: f32 blocks (1 GiB of K and V);
//  - mode 1: f16 blocks read in place (512 MiB);
//  - mode 2: f16 blocks widened to a float32 copy first, with the scalar f16_to_f32 loop the model ran per
//    layer before the kernel read 16-bit blocks (KvCache::blocks with a widening buffer), then attention.
// GBps counts the bytes of K and V as stored (2 * 32768 * 32 * 128 * 4 or 2), so modes 1 and 2 compare
// directly; BM_DramRead (real_size_bench.cpp) is the machine's read rate in the same process.
void BM_AttentionDecodeLong(benchmark::State& state) {
  constexpr int kHeads = 32, kKvHeads = 32, kDim = 128, kBlock = 256;
  constexpr int64_t kTokens = 32768;
  const int mode = static_cast<int>(state.range(0));
  struct Long {
    std::vector<uint16_t> k16, v16;
    std::vector<float> q, out, wide;
    std::vector<int64_t> pos;
  };
  static Long L = [] {
    Long l;
    const std::size_t n = static_cast<std::size_t>(kTokens) * kKvHeads * kDim;
    FloatBuffer k(n), v(n);
    k.fill_normal(2);
    v.fill_normal(3);
    l.k16.resize(n);
    l.v16.resize(n);
    for (std::size_t i = 0; i < n; ++i) {
      l.k16[i] = posenc::f32_to_f16(k.get()[i]);
      l.v16[i] = posenc::f32_to_f16(v.get()[i]);
    }
    FloatBuffer q(static_cast<std::size_t>(kHeads * kDim));
    q.fill_normal(1);
    l.q.assign(q.get(), q.get() + kHeads * kDim);
    l.out.resize(l.q.size());
    l.pos.resize(static_cast<std::size_t>(kTokens));
    std::iota(l.pos.begin(), l.pos.end(), int64_t{0});
    return l;
  }();
  const std::size_t n = L.k16.size();
  const int64_t row = int64_t{kKvHeads} * kDim;
  std::vector<float> f32;  // mode 0: the widened values, resident
  if (mode == 0) {
    f32.resize(2 * n);
    for (std::size_t i = 0; i < n; ++i) {
      f32[i] = posenc::f16_to_f32(L.k16[i]);
      f32[n + i] = posenc::f16_to_f32(L.v16[i]);
    }
  }
  if (mode == 2) L.wide.resize(2 * n);
  std::vector<posenc::KvBlock> blocks;
  for (int64_t j = 0; j < kTokens; j += kBlock) {
    posenc::KvBlock b;
    b.position_ids = L.pos.data() + j;
    b.n_tokens = std::min<int64_t>(kBlock, kTokens - j);
    if (mode == 1) {
      b.dtype = posenc::KvCacheDtype::f16;
      b.k16 = L.k16.data() + j * row;
      b.v16 = L.v16.data() + j * row;
    } else {
      const float* base = mode == 0 ? f32.data() : L.wide.data();
      b.k = base + j * row;
      b.v = base + n + j * row;
    }
    blocks.push_back(b);
  }
  posenc::AttentionSpec spec;
  spec.heads = kHeads;
  spec.kv_heads = kKvHeads;
  spec.head_dim = kDim;
  spec.mask = posenc::MaskKind::causal;
  const std::vector<int64_t> q_pos{kTokens};
  posenc::AttentionOptions opt;
  opt.num_threads = static_cast<int>(state.range(1));
  for (auto _ : state) {
    if (mode == 2)
      for (std::size_t i = 0; i < n; ++i) {
        L.wide[i] = posenc::f16_to_f32(L.k16[i]);
        L.wide[n + i] = posenc::f16_to_f32(L.v16[i]);
      }
    posenc::attention_forward(spec, L.q.data(), q_pos, blocks, L.out.data(), opt);
    benchmark::ClobberMemory();
  }
  if (mode == 2) std::vector<float>().swap(L.wide);
  state.counters["GBps"] = giga_rate(2.0 * static_cast<double>(n) * (mode == 0 ? 4 : 2), state);
  state.counters["tokens_per_s"] =
      benchmark::Counter(static_cast<double>(state.iterations()), benchmark::Counter::kIsRate);
}
BENCHMARK(BM_AttentionDecodeLong)
    ->ArgNames({"mode", "threads"})
    ->Args({0, 1})
    ->Args({1, 1})
    ->Args({2, 1})
    ->Args({0, 2})
    ->Args({1, 2})
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);

// The lead's tiny model shape (stories260K: 8 heads, 4 KV heads, head_dim 8):
// one decode step at 512 cached tokens; shows the per-call overhead.
void BM_AttentionDecodeTiny(benchmark::State& state) {
  Problem p(8, 4, 8, 1, state.range(0), 16);
  p.q_pos[0] = state.range(0);
  for (auto _ : state) {
    posenc::attention_forward(p.spec, p.q.get(), p.q_pos, p.blocks, p.out.get());
    benchmark::ClobberMemory();
  }
  state.counters["tokens_per_s"] =
      benchmark::Counter(static_cast<double>(state.iterations()), benchmark::Counter::kIsRate);
}
BENCHMARK(BM_AttentionDecodeTiny)->ArgNames({"kv_tokens"})->Arg(1)->Arg(64)->Arg(512)->UseRealTime();

}  // namespace

namespace {

// The tiny model's prefill (8 heads, 4 KV heads, head_dim 8, 512 tokens):
// the wide kernel at its smallest head_dim.
void BM_AttentionPrefillTiny(benchmark::State& state) {
  static Problem p(8, 4, 8, 512, 512, 512);
  posenc::AttentionOptions opt;
  opt.num_threads = static_cast<int>(state.range(0));
  for (auto _ : state) {
    posenc::attention_forward(p.spec, p.q.get(), p.q_pos, p.blocks, p.out.get(), opt);
    benchmark::ClobberMemory();
  }
  state.counters["GFLOPs"] = giga_rate(p.causal_flops(), state);
}
BENCHMARK(BM_AttentionPrefillTiny)->ArgNames({"threads"})->Arg(1)->Arg(2)->UseRealTime()->Unit(benchmark::kMicrosecond);

}  // namespace
