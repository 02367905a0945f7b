// The machine's FP32 FMA peak, measured: each thread runs a loop of
// independent 16-lane fused multiply-adds (AVX-512 when compiled in, else
// AVX2 8-lane) on 24 accumulators, enough to cover the FMA latency (4 cycles)
// on two FMA ports. GFLOPs counts 2 flops per lane per FMA.
// Argument: threads (OpenMP). BM_FmaPeakAvx2 (below): always 8-lane AVX2.
//
// BM_FmaPeakWithLoads/loads:L: the same 24 FMAs per step, their first operands
// L vectors loaded from L1 (each feeding 24/L accumulators, so every load is
// needed and none is folded twice): the ceiling of a kernel that loads L vectors
// per 24 FMAs even when everything it reads is in L1. L = 11 is the AVX-512
// prefill tile's ratio (3 rows of x and 8 weight vectors per 24 FMAs,
// kernels_dense.cpp); 10 is a 4 x 6 or 5 x 5 tile's. On the Sapphire Rapids
// machine of the README's Speed section, over one session: loads:11 at 77-88%
// of BM_FmaPeak, loads:24 at 60-68% (a 16-lane load costing up to about a
// third of an FMA cycle).
#include <cstdint>

#include <immintrin.h>

// GCC 12 flags its own _mm512_reduce_add_ps pass-through vector.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

#include "bench_util.hpp"

namespace {

constexpr int kAcc = 24;
constexpr int64_t kInner = 1 << 19;  // FMAs per accumulator per call (~2 ms)

// BM_FmaPeakAvx2: the same loop in 8-lane AVX2 FMAs, whatever the build targets: the peak the AVX2 paths
// (POSENC_DENSE_KERNEL=avx2, POSENC_Q8_KERNEL=avx2) are measured against, on an AVX-512 machine too (where 256-bit
// FMAs may issue at a different rate from 512-bit ones).
__attribute__((target("avx2,fma"))) double fma_loop_avx2(float seed) {
  __m256 acc[kAcc];
  for (int i = 0; i < kAcc; ++i) acc[i] = _mm256_set1_ps(seed * static_cast<float>(i));
  const __m256 a = _mm256_set1_ps(0.999999f), b = _mm256_set1_ps(1e-7f);
  for (int64_t it = 0; it < kInner; ++it) {
#pragma GCC unroll 24
    for (int i = 0; i < kAcc; ++i) acc[i] = _mm256_fmadd_ps(acc[i], a, b);
  }
  alignas(32) float out[8];
  __m256 s = acc[0];
  for (int i = 1; i < kAcc; ++i) s = _mm256_add_ps(s, acc[i]);
  _mm256_store_ps(out, s);
  double r = 0;
  for (float x : out) r += x;
  return r;
}

#if defined(__AVX512F__)
constexpr int kLanes = 16;
double fma_loop(float seed) {
  __m512 acc[kAcc];
  for (int i = 0; i < kAcc; ++i) acc[i] = _mm512_set1_ps(seed * static_cast<float>(i));
  const __m512 a = _mm512_set1_ps(0.999999f), b = _mm512_set1_ps(1e-7f);
  for (int64_t it = 0; it < kInner; ++it) {
#pragma GCC unroll 24
    for (int i = 0; i < kAcc; ++i) acc[i] = _mm512_fmadd_ps(acc[i], a, b);
  }
  __m512 s = acc[0];
  for (int i = 1; i < kAcc; ++i) s = _mm512_add_ps(s, acc[i]);
  return _mm512_reduce_add_ps(s);
}
#else
constexpr int kLanes = 8;
double fma_loop(float seed) { return fma_loop_avx2(seed); }
#endif

/// Loop (lanes wide) on every thread at once.
template <double (*Loop)(float), int Lanes>
void fma_peak(benchmark::State& state) {
  const int threads = static_cast<int>(state.range(0));
  double sink = 0;
  for (auto _ : state) {
#pragma omp parallel num_threads(threads) reduction(+ : sink)
    sink += Loop(1.0f + static_cast<float>(omp_get_thread_num()));
    benchmark::DoNotOptimize(sink);
  }
  const double flops = 2.0 * Lanes * kAcc * static_cast<double>(kInner) * threads;
  state.counters["GFLOPs"] = posenc::bench::giga_rate(flops, state);
}

void BM_FmaPeak(benchmark::State& state) { fma_peak<fma_loop, kLanes>(state); }
#if defined(__AVX512F__)
/// 24 FMAs per step as fma_loop, their first operands L vectors loaded from a 24 KiB ring (16 steps of 24 vectors)
/// in L1.
template <int L>
double fma_loads_loop(const float* ring, float seed) {
  static_assert(L >= 1 && L <= kAcc);
  __m512 acc[kAcc];
  for (int i = 0; i < kAcc; ++i) acc[i] = _mm512_set1_ps(seed * static_cast<float>(i));
  const __m512 a = _mm512_set1_ps(0.999999f);
  for (int64_t it = 0; it < kInner; ++it) {
    const float* q = ring + (it & 15) * kAcc * kLanes;
#pragma GCC unroll 24
    for (int l = 0; l < L; ++l) {
      __m512 v = _mm512_load_ps(q + l * kLanes);
      asm("" : "+v"(v));  // one load per vector, kept in a register for its accumulators
#pragma GCC unroll 24
      for (int i = l * kAcc / L; i < (l + 1) * kAcc / L; ++i) acc[i] = _mm512_fmadd_ps(v, a, acc[i]);
    }
  }
  __m512 s = acc[0];
  for (int i = 1; i < kAcc; ++i) s = _mm512_add_ps(s, acc[i]);
  return _mm512_reduce_add_ps(s);
}

template <int L>
void BM_FmaPeakWithLoads(benchmark::State& state) {
  posenc::bench::FloatBuffer ring(16 * kAcc * kLanes);
  ring.fill_normal(3, 1e-3f);
  double sink = 0;
  for (auto _ : state) {
    sink += fma_loads_loop<L>(ring.get(), 1.0f);
    benchmark::DoNotOptimize(sink);
  }
  state.counters["GFLOPs"] = posenc::bench::giga_rate(2.0 * kLanes * kAcc * static_cast<double>(kInner), state);
}
BENCHMARK(BM_FmaPeakWithLoads<10>)->Name("BM_FmaPeakWithLoads/loads:10")->UseRealTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_FmaPeakWithLoads<11>)->Name("BM_FmaPeakWithLoads/loads:11")->UseRealTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_FmaPeakWithLoads<24>)->Name("BM_FmaPeakWithLoads/loads:24")->UseRealTime()->Unit(benchmark::kMicrosecond);
#endif

BENCHMARK(BM_FmaPeak)->ArgNames({"threads"})->Arg(1)->Arg(2)->UseRealTime()->Unit(benchmark::kMicrosecond);


void BM_FmaPeakAvx2(benchmark::State& state) {
  if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma")) {
    state.SkipWithError("this CPU has no AVX2 + FMA");
    return;
  }
  fma_peak<fma_loop_avx2, 8>(state);
}
BENCHMARK(BM_FmaPeakAvx2)->ArgNames({"threads"})->Arg(1)->Arg(2)->UseRealTime()->Unit(benchmark::kMicrosecond);

}  // namespace
