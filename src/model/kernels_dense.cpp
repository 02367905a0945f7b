// Products with weights as stored (see kernels_dense.hpp for the arithmetic).
#include "model/kernels_dense.hpp"

#include <cpuid.h>
#include <immintrin.h>
#include <omp.h>
#include <unistd.h>

// GCC 12 flags the undefined pass-through vectors inside its own AVX-512 intrinsics (_mm512_maskz_*, the
// reductions) as uninitialized.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

#include <algorithm>
#include <atomic>
#include <bit>
#include <cmath>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "core/aligned.hpp"
#include "core/parallel.hpp"
#include "core/text.hpp"
#include "model/kernels.hpp"
#include "posenc/float16.hpp"
#include "posenc/threads.hpp"

namespace posenc::detail {

std::string_view to_string(DenseKernel k) {
  switch (k) {
    case DenseKernel::reference: return "reference";
    case DenseKernel::avx2: return "avx2";
    case DenseKernel::avx512: return "avx512";
  }
  return "?";
}

// More than 2M multiply-adds in all (as matmul_t), or a weight matrix of 256K entries or more, which decode
// streams once per token (a 256 x 1024 K or V projection is 512 KiB in F16, 272 KiB in Q8_0: memory-bound, and
// the second core brings its own share of the memory bandwidth; measured on the 487M Q8_0 model at two threads:
// those two projections took 6% of a decode step on one thread).
bool parallel_pays(int64_t n, const RawMatrix& w) {
  return n * w.rows * w.cols > (int64_t{1} << 21) || w.rows * w.cols >= (int64_t{1} << 18);
}

namespace {

constexpr int kLanes = 16;

DenseKernel detect_dense_kernel() {
  const char* env = std::getenv("POSENC_DENSE_KERNEL");
  const std::string want = env != nullptr ? env : "";
  for (DenseKernel k : {DenseKernel::avx512, DenseKernel::avx2, DenseKernel::reference})
    if (dense_kernel_supported(k) && (want.empty() || want == to_string(k))) return k;
  const DenseKernel best = dense_kernel_supported(DenseKernel::avx512) ? DenseKernel::avx512
                           : dense_kernel_supported(DenseKernel::avx2) ? DenseKernel::avx2
                                                                        : DenseKernel::reference;
  std::string runs;
  for (DenseKernel k : {DenseKernel::reference, DenseKernel::avx2, DenseKernel::avx512})
    if (dense_kernel_supported(k)) runs += (runs.empty() ? "" : ", ") + std::string(to_string(k));
  std::fprintf(stderr,
               "posenc: POSENC_DENSE_KERNEL=%s is not a path this CPU runs (it runs %s; the paths are reference, avx2 "
               "and avx512); using %s\n",
               detail::escaped(want).c_str(), runs.c_str(), std::string(to_string(best)).c_str());
  return best;
}

/// The fixed lane tree of kernels_dense.hpp, in scalar code.
float reduce_lanes(float a[kLanes]) {
  float s8[8], s4[4];
  for (int k = 0; k < 8; ++k) s8[k] = a[k] + a[k + 8];
  for (int k = 0; k < 4; ++k) s4[k] = s8[k] + s8[k + 4];
  const float s2a = s4[0] + s4[2], s2b = s4[1] + s4[3];
  return s2a + s2b;
}


/// The last, partial chunk of a float row (f32, f16, bf16: the blocked types have none) widened into a
/// zero-padded buffer of 16.
void widen_tail(WeightType t, const std::byte* row, int64_t c, int64_t cols, float out[kLanes]) {
  for (int k = 0; k < kLanes; ++k) {
    const int64_t i = c * kLanes + k;
    if (i >= cols) {
      out[k] = 0.0f;
      continue;
    }
    if (t == WeightType::f32) {
      std::memcpy(&out[k], row + 4 * i, 4);
    } else {
      uint16_t h;
      std::memcpy(&h, row + 2 * i, 2);
      out[k] = t == WeightType::f16 ? f16_to_f32(h) : bf16_to_f32(h);
    }
  }
}

void pad_tail(const float* x, int64_t c, int64_t cols, float out[kLanes]) {
  for (int k = 0; k < kLanes; ++k) {
    const int64_t i = c * kLanes + k;
    out[k] = i < cols ? x[i] : 0.0f;
  }
}

// ---- the SIMD paths --------------------------------------------------------
// Each ISA is a traits struct: V holds the 16 lanes of one accumulator (one zmm, or two ymm for lanes 0-7 and
// 8-15), with zero, fma, load (16 floats), load_w<T> (chunk c of a stored row, widened) and reduce (the fixed
// tree). POSENC_DENSE_TILES stamps the tile loops out for one ISA with its target attribute, so that the traits'
// intrinsics inline into them (a template cannot take its target from a parameter).

#define POSENC_TARGET_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,f16c,fma")))
#define POSENC_TARGET_AVX2 __attribute__((target("avx2,fma,f16c")))

struct Avx512 {
  using V = __m512;
  static constexpr int64_t kR = 4, kC = 4;  // 16 accumulators of 32 zmm
  POSENC_TARGET_AVX512 static V zero() { return _mm512_setzero_ps(); }
  POSENC_TARGET_AVX512 static V fma(V x, V w, V a) { return _mm512_fmadd_ps(x, w, a); }
  POSENC_TARGET_AVX512 static V load(const float* p) { return _mm512_loadu_ps(p); }
  POSENC_TARGET_AVX512 static V scaled(__m512i q, const std::byte* blk) {
    uint16_t h;
    std::memcpy(&h, blk, 2);
    return _mm512_mul_ps(_mm512_cvtepi32_ps(q), _mm512_set1_ps(_cvtsh_ss(h)));
  }
  template <WeightType T>
  POSENC_TARGET_AVX512 static V load_w(const std::byte* row, int64_t c) {
    if constexpr (T == WeightType::f32) {
      return _mm512_loadu_ps(row + c * 64);
    } else if constexpr (T == WeightType::f16) {
      return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + c * 32)));
    } else if constexpr (T == WeightType::bf16) {
      const __m512i u = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + c * 32)));
      return _mm512_castsi512_ps(_mm512_slli_epi32(u, 16));
    } else if constexpr (T == WeightType::q8_0) {
      const std::byte* blk = row + (c >> 1) * kQ8Bytes;
      return scaled(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 2 + 16 * (c & 1)))),
                    blk);
    } else {
      const std::byte* blk = row + (c >> 1) * kQ4Bytes;
      const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 2)));
      const __m512i nib = (c & 1) ? _mm512_srli_epi32(b, 4) : _mm512_and_si512(b, _mm512_set1_epi32(15));
      return scaled(_mm512_sub_epi32(nib, _mm512_set1_epi32(8)), blk);
    }
  }
  POSENC_TARGET_AVX512 static float reduce(V a) {
    const __m256 lo = _mm512_castps512_ps256(a);
    const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1));
    return reduce8(_mm256_add_ps(lo, hi));  // a_k + a_{k+8}
  }
  POSENC_TARGET_AVX512 static float reduce8(__m256 s8) {
    const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));  // + 4 apart
    const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));                                // + 2 apart
    return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));                       // the last two
  }
};

struct Avx2 {
  struct V {
    __m256 lo, hi;  // lanes 0-7, 8-15
  };
  static constexpr int64_t kR = 2, kC = 3;  // 12 accumulators of 16 ymm
  POSENC_TARGET_AVX2 static V zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
  POSENC_TARGET_AVX2 static V fma(V x, V w, V a) {
    return {_mm256_fmadd_ps(x.lo, w.lo, a.lo), _mm256_fmadd_ps(x.hi, w.hi, a.hi)};
  }
  POSENC_TARGET_AVX2 static V load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
  POSENC_TARGET_AVX2 static V scaled(__m256i q0, __m256i q1, const std::byte* blk) {
    uint16_t h;
    std::memcpy(&h, blk, 2);
    const __m256 d = _mm256_set1_ps(_cvtsh_ss(h));
    return {_mm256_mul_ps(_mm256_cvtepi32_ps(q0), d), _mm256_mul_ps(_mm256_cvtepi32_ps(q1), d)};
  }
  template <WeightType T>
  POSENC_TARGET_AVX2 static V load_w(const std::byte* row, int64_t c) {
    if constexpr (T == WeightType::f32) {
      return load(reinterpret_cast<const float*>(row) + c * 16);
    } else if constexpr (T == WeightType::f16) {
      const std::byte* p = row + c * 32;
      return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
              _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)))};
    } else if constexpr (T == WeightType::bf16) {
      const std::byte* p = row + c * 32;
      const __m256i u0 = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
      const __m256i u1 = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)));
      return {_mm256_castsi256_ps(_mm256_slli_epi32(u0, 16)), _mm256_castsi256_ps(_mm256_slli_epi32(u1, 16))};
    } else if constexpr (T == WeightType::q8_0) {
      const std::byte* blk = row + (c >> 1) * kQ8Bytes;
      const std::byte* q = blk + 2 + 16 * (c & 1);
      return scaled(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q))),
                    _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8))), blk);
    } else {
      const std::byte* blk = row + (c >> 1) * kQ4Bytes;
      const __m256i b0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk + 2)));
      const __m256i b1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk + 10)));
      const __m256i m = _mm256_set1_epi32(15), eight = _mm256_set1_epi32(8);
      const __m256i n0 = (c & 1) ? _mm256_srli_epi32(b0, 4) : _mm256_and_si256(b0, m);
      const __m256i n1 = (c & 1) ? _mm256_srli_epi32(b1, 4) : _mm256_and_si256(b1, m);
      return scaled(_mm256_sub_epi32(n0, eight), _mm256_sub_epi32(n1, eight), blk);
    }
  }
  POSENC_TARGET_AVX2 static float reduce(V a) {
    const __m256 s8 = _mm256_add_ps(a.lo, a.hi);                                             // a_k + a_{k+8}
    const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));  // + 4 apart
    const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));                                // + 2 apart
    return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));                       // the last two
  }
};

// tile: y[R rows of x, C weight rows], R * C accumulators over every chunk (the last, partial one through
// zero-padded buffers); matmul: every tile of the product, each thread a contiguous share of the weight rows
// against every row of x, so a weight is read from memory once per call whatever n is (decode: one stream of
// the matrix per token).
#define POSENC_DENSE_TILES(ISA, TARGET)                                                                         \
  template <WeightType T, int R, int C>                                                                          \
  TARGET void tile_##ISA(const float* x, int64_t cols, const std::byte* w, int64_t row_bytes, float* y,          \
                         int64_t ldy, bool accumulate) {                                                         \
    using V = ISA::V;                                                                                            \
    V acc[R][C];                                                                                                 \
    for (int r = 0; r < R; ++r)                                                                                  \
      for (int j = 0; j < C; ++j) acc[r][j] = ISA::zero();                                                       \
    const int64_t full = cols / kLanes;                                                                          \
    for (int64_t c = 0; c < full; ++c) {                                                                         \
      if (R == 1) /* decode, memory-bound: the rows two tiles on, at this column (measured: +66% tokens/s) */    \
        for (int j = 0; j < C; ++j)                                                                              \
          _mm_prefetch(reinterpret_cast<const char*>(w + (2 * C + j) * row_bytes) + c * (row_bytes / (cols / kLanes)), \
                       _MM_HINT_T0);                                                                             \
      V wv[C];                                                                                                   \
      for (int j = 0; j < C; ++j) wv[j] = ISA::template load_w<T>(w + j * row_bytes, c);                         \
      for (int r = 0; r < R; ++r) {                                                                              \
        const V xv = ISA::load(x + r * cols + c * kLanes);                                                       \
        for (int j = 0; j < C; ++j) acc[r][j] = ISA::fma(xv, wv[j], acc[r][j]);                                  \
      }                                                                                                          \
    }                                                                                                            \
    if (full * kLanes < cols) {                                                                                  \
      float wt[C][kLanes], xt[kLanes];                                                                           \
      for (int j = 0; j < C; ++j) widen_tail(T, w + j * row_bytes, full, cols, wt[j]);                           \
      for (int r = 0; r < R; ++r) {                                                                              \
        pad_tail(x + r * cols, full, cols, xt);                                                                  \
        const V xv = ISA::load(xt);                                                                              \
        for (int j = 0; j < C; ++j) acc[r][j] = ISA::fma(xv, ISA::load(wt[j]), acc[r][j]);                       \
      }                                                                                                          \
    }                                                                                                            \
    for (int r = 0; r < R; ++r)                                                                                  \
      for (int j = 0; j < C; ++j) {                                                                              \
        const float s = ISA::reduce(acc[r][j]);                                                                  \
        float& out = y[r * ldy + j];                                                                             \
        out = accumulate ? out + s : s;                                                                          \
      }                                                                                                          \
  }                                                                                                              \
  template <WeightType T>                                                                                        \
  void matmul_##ISA(const float* x, int64_t n, const RawMatrix& w, float* y, bool accumulate) {                  \
    constexpr int64_t kR = ISA::kR, kC = ISA::kC;                                                                \
    const int64_t out = w.rows, in = w.cols, rb = w.row_bytes();                                                 \
    const int64_t col_blocks = (out + kC - 1) / kC;                                                              \
    _Pragma("omp parallel for schedule(static) if (parallel_pays(n, w))")                                        \
    for (int64_t cb = 0; cb < col_blocks; ++cb) {                                                                \
      const int64_t o0 = cb * kC;                                                                                \
      const bool full_c = o0 + kC <= out;                                                                        \
      int64_t r0 = 0;                                                                                            \
      for (; r0 + kR <= n; r0 += kR) {                                                                           \
        if (full_c)                                                                                              \
          tile_##ISA<T, kR, kC>(x + r0 * in, in, w.data + o0 * rb, rb, y + r0 * out + o0, out, accumulate);      \
        else                                                                                                     \
          for (int64_t o = o0; o < out; ++o)                                                                     \
            tile_##ISA<T, kR, 1>(x + r0 * in, in, w.data + o * rb, rb, y + r0 * out + o, out, accumulate);       \
      }                                                                                                          \
      for (; r0 < n; ++r0) {                                                                                     \
        if (full_c)                                                                                              \
          tile_##ISA<T, 1, kC>(x + r0 * in, in, w.data + o0 * rb, rb, y + r0 * out + o0, out, accumulate);       \
        else                                                                                                     \
          for (int64_t o = o0; o < out; ++o)                                                                     \
            tile_##ISA<T, 1, 1>(x + r0 * in, in, w.data + o * rb, rb, y + r0 * out + o, out, accumulate);        \
      }                                                                                                          \
    }                                                                                                            \
  }                                                                                                              \
  void matmul_any_##ISA(const float* x, int64_t n, const RawMatrix& w, float* y, bool accumulate) {              \
    switch (w.type) {                                                                                            \
      case WeightType::f32: matmul_##ISA<WeightType::f32>(x, n, w, y, accumulate); return;                       \
      case WeightType::f16: matmul_##ISA<WeightType::f16>(x, n, w, y, accumulate); return;                       \
      case WeightType::bf16: matmul_##ISA<WeightType::bf16>(x, n, w, y, accumulate); return;                     \
      case WeightType::q8_0: matmul_##ISA<WeightType::q8_0>(x, n, w, y, accumulate); return;                     \
      case WeightType::q4_0: matmul_##ISA<WeightType::q4_0>(x, n, w, y, accumulate); return;                     \
    }                                                                                                            \
  }

POSENC_DENSE_TILES(Avx512, POSENC_TARGET_AVX512)
POSENC_DENSE_TILES(Avx2, POSENC_TARGET_AVX2)

/// A product's work as items, each a block of x rows by a run of `per_item` consecutive panels, handed out in
/// order (block by block) to whichever thread asks next. A static share of the panels per thread left the threads
/// waiting for each other at the region's end whenever one core ran slower than the other (a virtual machine's
/// core sharing its host with others): on an Ice Lake Xeon under KVM, 5% of a two-thread F16 prefill's samples
/// were the two threads waiting in libgomp at the end of the products. Which thread computes an output does not
/// change its bits.
struct PanelItems {
  int64_t panels, per_item, per_block, count;
  std::atomic<int64_t> next{0};
  PanelItems(int64_t panels_, int64_t per_item_, int64_t blocks)
      : panels(panels_), per_item(per_item_), per_block((panels_ + per_item_ - 1) / per_item_),
        count(blocks * per_block) {}
  /// The next item not yet taken, or -1 when all are.
  int64_t claim() {
    const int64_t i = next.fetch_add(1, std::memory_order_relaxed);
    return i < count ? i : -1;
  }
  int64_t block(int64_t i) const { return i / per_block; }
  int64_t first_panel(int64_t i) const { return i % per_block * per_item; }
  int64_t end_panel(int64_t i) const { return std::min(panels, first_panel(i) + per_item); }
};

// ---- AVX2 prefill: weight panels widened once ------------------------------------------------------------
// On AVX2 the tiles above widen each weight once per 2 rows of x, and the widening (vcvtph2ps; the integer
// unpacking of Q8_0/Q4_0) takes the ports the FMAs need; they also stream x whole for each tile of weight
// rows, from L3 once n rows of it outgrow L2 (measured on Zen 3: F16 prefill at 40% of FMA peak). So for
// n >= 4 rows and rows of a multiple of 16 weights, each thread widens a panel of 3 weight rows once per
// block of x rows that fits in half of a 512 KiB L2, laid out in the order the tile reads it, and runs
// tiles of 4 x rows by the panel's 3 rows on it, 32 chunks at a time (the panel's 6 KiB of them stay in L1
// while every tile of the block passes). A tile makes two passes over its chunks, one per half of the 16
// lanes (lanes 0-7, then 8-15; the second finds x in L1): 12 ymm accumulators, 3 for the panel's weights,
// 1 for x. Each lane takes the same fmas in the same order from the same +0, and the halves meet in the
// same tree (a_k + a_{k+8} first): the bits of the tiles above, for every n and thread count.

constexpr int64_t kPanelRows = 3, kPanelTileRows = 4, kPanelChunks = 32;
/// Chunks per segment (1024 weights): rows longer than this are taken a segment at a time, each segment's
/// x block (the rows' 4 KiB there) in L2, so that a block of x holds up to 64 rows for any length of 1024 or more
/// and each weight is widened once per block of up to 64 rows (once per 12 rows for the 4864 weights of an FFN's
/// down projection otherwise; measured: 15% of an F16 prefill in the widening).
constexpr int64_t kPanelSegment = 64;
/// A tile's 16 lanes per output between blocks of chunks: [half][x row][weight row].
struct TileAcc {
  __m256 v[2][kPanelTileRows][kPanelRows];
};
/// The cap of x rows per block (BalancedBlocks evens the blocks out): a multiple of the tile, about 256 KiB of them in
/// a segment (half of Zen 3's 512 KiB L2, the other half for the panel and y), at least one tile. (Measured with 384
/// and 448 KiB: no faster at one thread, slower at two.)
int64_t panel_block_rows(int64_t cols) {
  const int64_t seg = std::min(cols, kPanelSegment * kLanes);
  return std::max<int64_t>(kPanelTileRows, (int64_t{256} * 1024 / (seg * 4)) / kPanelTileRows * kPanelTileRows);
}

/// p[h][c][j][8]: half h (lanes 0-7, 8-15) of chunk c0 + c (c < count) of weight row j of the 3 at w, widened.
template <WeightType T>
POSENC_TARGET_AVX2 void pack_panel_avx2(const std::byte* w, int64_t row_bytes, int64_t c0, int64_t count, float* p) {
  float* lo = p;
  float* hi = p + count * kPanelRows * 8;
  for (int64_t c = 0; c < count; ++c)
    for (int64_t j = 0; j < kPanelRows; ++j) {
      const Avx2::V v = Avx2::load_w<T>(w + j * row_bytes, c0 + c);
      _mm256_storeu_ps(lo + (c * kPanelRows + j) * 8, v.lo);
      _mm256_storeu_ps(hi + (c * kPanelRows + j) * 8, v.hi);
    }
}

/// One block of chunks [c0, c1) of a tile of 4 x rows by the panel's 3 weight rows: both halves' lanes
/// continue from `acc` ([half][row][weight row]; +0 when `first`), and are left there, or (`last`) summed by
/// the tree into y[4 rows, 3] (+)=. The block's x (4 rows of up to 32 chunks, 8 KiB) is read from L2 in the
/// first half's pass and found in L1 by the second's.
POSENC_TARGET_AVX2 void panel_tile_avx2(const float* x, int64_t cols, const float* p, int64_t chunks, int64_t c0,
                                        int64_t c1, TileAcc& acc_io, bool first,
                                        bool last, float* y, int64_t ldy, bool accumulate) {
  constexpr int64_t R = kPanelTileRows, C = kPanelRows;
  for (int h = 0; h < 2; ++h) {
    __m256 acc[R][C];
    for (int64_t r = 0; r < R; ++r)
      for (int64_t j = 0; j < C; ++j) acc[r][j] = first ? _mm256_setzero_ps() : acc_io.v[h][r][j];
    const float* ph = p + h * chunks * C * 8;
    const float* xh = x + h * 8;
    for (int64_t c = c0; c < c1; ++c) {
      __m256 w0 = _mm256_loadu_ps(ph + c * C * 8), w1 = _mm256_loadu_ps(ph + c * C * 8 + 8),
             w2 = _mm256_loadu_ps(ph + c * C * 8 + 16);
      // In registers, each loaded once per chunk (GCC would otherwise fold them into the 4 rows' fmas as
      // memory operands: 15 or 16 loads per 12 fmas instead of 7, the load ports' limit before the FMA ports').
      asm("" : "+x"(w0), "+x"(w1), "+x"(w2));
      for (int64_t r = 0; r < R; ++r) {
        __m256 xv = _mm256_loadu_ps(xh + r * cols + c * kLanes);
        asm("" : "+x"(xv));  // likewise: one load of x per row, not one per fma
        acc[r][0] = _mm256_fmadd_ps(xv, w0, acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(xv, w1, acc[r][1]);
        acc[r][2] = _mm256_fmadd_ps(xv, w2, acc[r][2]);
      }
    }
    for (int64_t r = 0; r < R; ++r)
      for (int64_t j = 0; j < C; ++j) acc_io.v[h][r][j] = acc[r][j];
  }
  if (!last) return;
  for (int64_t r = 0; r < R; ++r)
    for (int64_t j = 0; j < C; ++j) {
      const float s = Avx2::reduce(Avx2::V{acc_io.v[0][r][j], acc_io.v[1][r][j]});
      float& out = y[r * ldy + j];
      out = accumulate ? out + s : s;
    }
}

bool panels_pay(int64_t n, const RawMatrix& w) {
  return n >= kPanelTileRows && w.cols > 0 && w.cols % kLanes == 0 && w.rows >= kPanelRows;
}

template <WeightType T>
void matmul_panels_avx2(const float* x, int64_t n, const RawMatrix& w, float* y, bool accumulate) {
  const int64_t out = w.rows, in = w.cols, rb = w.row_bytes(), chunks = in / kLanes;
  const int64_t panels = out / kPanelRows;
  // No slack: the cap was measured as the best block (384 and 448 KiB of rows: slower at two threads on Zen 3).
  const BalancedBlocks blocks(n, panel_block_rows(in), kPanelTileRows, 0);
  const int64_t segments = (chunks + kPanelSegment - 1) / kPanelSegment;
  const bool parallel = parallel_pays(n, w);
  PanelItems items(panels, panels_per_item(panels, panels, region_threads(parallel)), blocks.count);
  detail::FirstException error;  // std::bad_alloc of a thread's buffers, rethrown after the region
#pragma omp parallel if (parallel)
  {
    error.run([&] {
      std::vector<float> panel(static_cast<std::size_t>(std::min(chunks, kPanelSegment) * kPanelRows * kLanes));
      // Each tile's lanes between blocks of chunks: per tile of a block, and per panel of the item when the rows
      // span several segments (the segment loop is outside the panel loop).
      const int64_t tiles_max = std::min(blocks.max_size(), n) / kPanelTileRows;  // in any block of this call
      const std::size_t acc_count =
          static_cast<std::size_t>(std::max<int64_t>(tiles_max, 1) * (segments > 1 ? items.per_item : 1));
      const std::unique_ptr<TileAcc[]> acc(new TileAcc[acc_count]);
      for (int64_t item = items.claim(); item >= 0; item = items.claim()) {
        const int64_t bi = items.block(item), q0 = items.first_panel(item), q1 = items.end_panel(item);
        const int64_t b0 = blocks.begin(bi), b1 = blocks.begin(bi + 1), tiles = (b1 - b0) / kPanelTileRows;
        for (int64_t s0 = 0; s0 < chunks; s0 += kPanelSegment) {
          const int64_t s1 = std::min(chunks, s0 + kPanelSegment);
          for (int64_t pi = q0; pi < q1; ++pi) {
            const int64_t o0 = pi * kPanelRows;
            TileAcc* pacc = acc.get() + (segments > 1 ? (pi - q0) * tiles_max : 0);
            pack_panel_avx2<T>(w.data + o0 * rb, rb, s0, s1 - s0, panel.data());
            // The next panel's weights of this segment towards L2 while this one's tiles run: widening from
            // DRAM stalls on its loads otherwise (measured: 12% of an F16 prefill in the widening's loads).
            if (pi + 1 < q1) {
              const int64_t bytes_lo = s0 * rb / chunks, bytes_hi = s1 * rb / chunks;
              for (int64_t j = 0; j < kPanelRows; ++j)
                for (int64_t b = bytes_lo; b < bytes_hi; b += 64)
                  _mm_prefetch(reinterpret_cast<const char*>(w.data + (o0 + kPanelRows + j) * rb + b), _MM_HINT_T1);
            }
            // Blocks of 32 chunks: the panel's block (6 KiB) stays in L1 while every tile of x rows passes it.
            for (int64_t c0 = s0; c0 < s1; c0 += kPanelChunks) {
              const int64_t c1 = std::min(s1, c0 + kPanelChunks);
              for (int64_t t = 0; t < tiles; ++t) {
                const int64_t r = b0 + t * kPanelTileRows;
                panel_tile_avx2(x + r * in + s0 * kLanes, in, panel.data(), s1 - s0, c0 - s0, c1 - s0, pacc[t], c0 == 0,
                                c1 == chunks, y + r * out + o0, out, accumulate);
              }
            }
            if (s0 == 0)
              for (int64_t r = b0 + tiles * kPanelTileRows; r < b1; ++r)
                tile_Avx2<T, 1, kPanelRows>(x + r * in, in, w.data + o0 * rb, rb, y + r * out + o0, out, accumulate);
          }
        }
      }
    });
    // The weight rows past the last panel (out % 3 of them), a row at a time (every thread meets the loop).
#pragma omp for schedule(static) nowait
    for (int64_t o = panels * kPanelRows; o < out; ++o)
      for (int64_t r = 0; r < n; ++r)
        tile_Avx2<T, 1, 1>(x + r * in, in, w.data + o * rb, rb, y + r * out + o, out, accumulate);
  }
  error.rethrow();
}

// ---- AVX2 decode: runs of rows read side by side --------------------------------------------------------------
// The AVX-512 decode's layout (below, where the reasons are measured) in 8-lane halves: a thread's rows as R runs of
// consecutive rows read side by side, x's chunk loaded once for the R rows, each row's line `ahead` bytes on
// prefetched once; a Q8_0/Q4_0 block's scale widened once for its two chunks. Each lane takes the same fmas in the
// same order as the reference and the halves meet in its tree (Avx2::reduce): the same bits for every plan. Before,
// decode ran the 1 x 3 tiles above, three adjacent rows at a time with the rows two tiles on prefetched: on Zen 5 in
// AVX2, the 487M F16 model's decode read 30 of 41 GB/s at one thread (74%).

/// y[o_j] (+)= x · row o_j for the R rows o_j = o_0 + j * stride (w: row o_0, rb: bytes per row), cols % 16 == 0.
template <WeightType T, int R, bool Prefetch>
POSENC_TARGET_AVX2 void decode_tile_avx2(const float* x, int64_t cols, const std::byte* w, int64_t rb, int64_t stride,
                                         float* y, bool accumulate, int64_t ahead) {
  static_assert(R >= 1 && R <= 16);
  Avx2::V acc[R];
  for (int j = 0; j < R; ++j) acc[j] = Avx2::zero();
  if constexpr (T == WeightType::q8_0 || T == WeightType::q4_0) {
    constexpr int64_t kBlockBytes = T == WeightType::q8_0 ? kQ8Bytes : kQ4Bytes;
    const int64_t blocks = cols / kQBlock;
    for (int64_t b = 0; b < blocks; ++b) {
      const Avx2::V x0 = Avx2::load(x + b * kQBlock), x1 = Avx2::load(x + b * kQBlock + kLanes);
      const bool prefetch = Prefetch && (b * kBlockBytes) % 64 + kBlockBytes >= 64;  // once per 64 bytes of a row
      for (int j = 0; j < R; ++j) {
        const std::byte* blk = w + j * stride * rb + b * kBlockBytes;
        if (prefetch) prefetch_ahead(blk, ahead + kBlockBytes - 1);
        uint16_t h;
        std::memcpy(&h, blk, 2);
        const __m256 d = _mm256_set1_ps(_cvtsh_ss(h));
        __m256i q[4];  // the block's 32 values, 8 at a time, in order
        if constexpr (T == WeightType::q8_0) {
          for (int k = 0; k < 4; ++k)
            q[k] = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk + 2 + 8 * k)));
        } else {
          const __m256i b0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk + 2)));
          const __m256i b1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk + 10)));
          const __m256i m = _mm256_set1_epi32(15), eight = _mm256_set1_epi32(8);
          q[0] = _mm256_sub_epi32(_mm256_and_si256(b0, m), eight);
          q[1] = _mm256_sub_epi32(_mm256_and_si256(b1, m), eight);
          q[2] = _mm256_sub_epi32(_mm256_srli_epi32(b0, 4), eight);
          q[3] = _mm256_sub_epi32(_mm256_srli_epi32(b1, 4), eight);
        }
        const Avx2::V w0{_mm256_mul_ps(_mm256_cvtepi32_ps(q[0]), d), _mm256_mul_ps(_mm256_cvtepi32_ps(q[1]), d)};
        const Avx2::V w1{_mm256_mul_ps(_mm256_cvtepi32_ps(q[2]), d), _mm256_mul_ps(_mm256_cvtepi32_ps(q[3]), d)};
        acc[j] = Avx2::fma(x0, w0, acc[j]);
        acc[j] = Avx2::fma(x1, w1, acc[j]);
      }
    }
  } else {
    const int64_t chunks = cols / kLanes, chunk_bytes = rb / chunks;
    for (int64_t c = 0; c < chunks; ++c) {
      const Avx2::V xv = Avx2::load(x + c * kLanes);
      for (int j = 0; j < R; ++j) {
        const std::byte* row = w + j * stride * rb;
        if constexpr (Prefetch)
          if (chunk_bytes < 64 ? (c & 1) == 0 : true)  // one prefetch per cache line of the row
            prefetch_ahead(row, ahead + c * chunk_bytes);
        acc[j] = Avx2::fma(xv, Avx2::load_w<T>(row, c), acc[j]);
      }
    }
  }
  for (int j = 0; j < R; ++j) {
    const float v = Avx2::reduce(acc[j]);
    y[j * stride] = accumulate ? y[j * stride] + v : v;
  }
}

/// y[r0, r1) (+)= x[cols] W[r0, r1)^T: the rows as R runs of `stride` consecutive rows read side by side, then the
/// rows left over one at a time.
template <WeightType T, int R, bool Prefetch>
void decode_avx2_rows(const float* x, const RawMatrix& w, float* y, bool accumulate, int64_t ahead, int64_t r0,
                      int64_t r1) {
  const int64_t rb = w.row_bytes(), stride = (r1 - r0) / R;
  for (int64_t g = 0; g < stride; ++g)
    decode_tile_avx2<T, R, Prefetch>(x, w.cols, w.data + (r0 + g) * rb, rb, stride, y + r0 + g, accumulate, ahead);
  for (int64_t o = r0 + stride * R; o < r1; ++o)
    tile_Avx2<T, 1, 1>(x, w.cols, w.data + o * rb, rb, y + o, w.rows, accumulate);
}

/// A path's one-row product read as `plan` says, for both paths: Rows<T, R, Prefetch>::run(x, w, y, accumulate,
/// ahead, r0, r1) is the path's rows [r0, r1) as R runs side by side. All of it in its own parallel region, each
/// thread a contiguous share of the rows (rows {-1, -1}); or the rows [rows.first, rows.second) on the calling thread
/// (the decode team's).
template <template <WeightType, int, bool> class Rows, WeightType T, int R, bool Prefetch>
void decode_runs(const float* x, const RawMatrix& w, float* y, bool accumulate, int64_t ahead,
                 std::pair<int64_t, int64_t> rows) {
  if (rows.first >= 0) {
    Rows<T, R, Prefetch>::run(x, w, y, accumulate, ahead, rows.first, rows.second);
    return;
  }
  const int64_t out = w.rows;
#pragma omp parallel if (parallel_pays(1, w))
  {
    const int64_t nt = omp_get_num_threads(), me = omp_get_thread_num();
    Rows<T, R, Prefetch>::run(x, w, y, accumulate, ahead, out * me / nt, out * (me + 1) / nt);
  }
}

template <template <WeightType, int, bool> class Rows, WeightType T>
void decode_plan(DecodeStreams plan, const float* x, const RawMatrix& w, float* y, bool accumulate,
                 std::pair<int64_t, int64_t> rows) {
#define POSENC_DECODE_RUNS(R)                                                               \
  case R:                                                                                   \
    if (plan.prefetch_bytes > 0)                                                            \
      decode_runs<Rows, T, R, true>(x, w, y, accumulate, plan.prefetch_bytes, rows);        \
    else                                                                                    \
      decode_runs<Rows, T, R, false>(x, w, y, accumulate, 0, rows);                         \
    return;
  switch (plan.runs) {
    POSENC_DECODE_RUNS(2)
    POSENC_DECODE_RUNS(4)
    POSENC_DECODE_RUNS(8)
    POSENC_DECODE_RUNS(16)
    default: throw std::logic_error(fmt::format("decode: {} runs is not a plan (2, 4, 8 or 16)", plan.runs));
  }
#undef POSENC_DECODE_RUNS
}

template <template <WeightType, int, bool> class Rows>
void decode_any(DecodeStreams plan, const float* x, const RawMatrix& w, float* y, bool accumulate,
                std::pair<int64_t, int64_t> rows) {
  switch (w.type) {
    case WeightType::f32: decode_plan<Rows, WeightType::f32>(plan, x, w, y, accumulate, rows); return;
    case WeightType::f16: decode_plan<Rows, WeightType::f16>(plan, x, w, y, accumulate, rows); return;
    case WeightType::bf16: decode_plan<Rows, WeightType::bf16>(plan, x, w, y, accumulate, rows); return;
    case WeightType::q8_0: decode_plan<Rows, WeightType::q8_0>(plan, x, w, y, accumulate, rows); return;
    case WeightType::q4_0: decode_plan<Rows, WeightType::q4_0>(plan, x, w, y, accumulate, rows); return;
  }
}

template <WeightType T, int R, bool Prefetch>
struct Avx2Rows {
  static void run(const float* x, const RawMatrix& w, float* y, bool accumulate, int64_t ahead, int64_t r0,
                  int64_t r1) {
    decode_avx2_rows<T, R, Prefetch>(x, w, y, accumulate, ahead, r0, r1);
  }
};

/// The AVX2 one-row product (decode), as decode_any.
void decode_avx2_any(DecodeStreams plan, const float* x, const RawMatrix& w, float* y, bool accumulate,
                     std::pair<int64_t, int64_t> rows) {
  decode_any<Avx2Rows>(plan, x, w, y, accumulate, rows);
}

void matmul_avx2(DecodeStreams plan, const float* x, int64_t n, const RawMatrix& w, float* y, bool accumulate) {
  if (n == 1 && w.cols > 0 && w.cols % kLanes == 0) {
    decode_avx2_any(plan, x, w, y, accumulate, {-1, -1});
    return;
  }
  if (!panels_pay(n, w)) {
    matmul_any_Avx2(x, n, w, y, accumulate);
    return;
  }
  switch (w.type) {
    case WeightType::f32: matmul_panels_avx2<WeightType::f32>(x, n, w, y, accumulate); return;
    case WeightType::f16: matmul_panels_avx2<WeightType::f16>(x, n, w, y, accumulate); return;
    case WeightType::bf16: matmul_panels_avx2<WeightType::bf16>(x, n, w, y, accumulate); return;
    case WeightType::q8_0: matmul_panels_avx2<WeightType::q8_0>(x, n, w, y, accumulate); return;
    case WeightType::q4_0: matmul_panels_avx2<WeightType::q4_0>(x, n, w, y, accumulate); return;
  }
}

// ---- AVX-512 prefill: weight panels widened once ----------------------------------------------------------
// The tiles above widen each weight once per 4 rows of x (vcvtph2ps, or Q8_0/Q4_0's integer unpacking, on the
// ports the FMAs need) and stream x from L2/L3 for every 4 weight rows: the 487M model's F16 prefill at 34% of
// the FMA peak on a Sapphire Rapids core. So, as on AVX2, each thread widens a panel of kZCols weight rows into
// float32 once per block of x rows, a block of kZChunks chunks at a time laid out [chunk][weight row][16] (32 KiB,
// in L1 while every tile of the block passes it), and runs tiles of kZRows x rows by the panel's rows on it: the
// tile holds its 3 x vectors in registers and takes the panel's 8 one at a time (24 accumulators, 4 more zmm;
// 11 loads per 24 fmas), x comes from L2, prefetched a few chunks ahead, and the 24 outputs are summed 16 at a time
// by reduce16. Rows of at most 64 chunks (1024 weights) are one block of chunks: a block of x rows is about the rows
// that fill half of the L2 (255 on a 2 MiB L2; BalancedBlocks, so a 256-token prompt is one block of 256, not 255
// and 1), on AMD at least 2 MiB of rows (x_block_budget_bytes), and a tile runs its row from end to end.
// Longer rows go a block of chunks at a time over a group of panels, each tile's lanes kept in memory between
// blocks (zpanel_block_rows says how the L2 is shared). Every lane takes the fmas of tile_Avx512 in the same order
// from the same +0, and the tree is the same: the reference's bits, for every n and thread count. Measured on the
// 487M model's shapes at one thread (BM_MatmulPrefill, weights in L3): F16 185-189 GFLOP/s (77% of the FMA peak)
// for rows of 1024 weights and 155 (63%) for the down projection's 4864, against 130 and 58 for the tiles above.

/// How many chunks ahead the tiles prefetch x (measured 4, 8, 16: 8 best).
constexpr int64_t kXPrefetch = 8;
constexpr int64_t kZRows = 3, kZCols = 8, kZChunks = 64;

/// The tile's accumulators between blocks of chunks.
struct ZTileAcc {
  __m512 v[kZRows][kZCols];
};

/// Whether cpuid's vendor string (leaf 0) is "AuthenticAMD".
bool cpu_is_amd() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  char vendor[13] = {};
  if (__get_cpuid(0, &a, &b, &c, &d) == 0) return false;
  std::memcpy(vendor, &b, 4);
  std::memcpy(vendor + 4, &d, 4);
  std::memcpy(vendor + 8, &c, 4);
  return std::string_view(vendor) == "AuthenticAMD";
}

/// The cache budget of a block of x rows (and of a group of panels' accumulators, for rows of more than one block
/// of chunks): half of this CPU's L2 (sysconf; 1 MiB when it does not say), where the tiles' x rows are to stay,
/// and on AMD at least 2 MiB: a Zen 5 core's L3 feeds the tiles' x rows (prefetched kXPrefetch chunks ahead) fast
/// enough that fewer, larger blocks pay, each weight being widened once per block. Measured on Zen 5 (1 MiB of L2
/// per core, 32 MiB of L3), the 487M model's 256-token prefill at one thread, tokens/s, two alternations: Q8_0
/// with 512 KiB (a 256-token prompt in 2 blocks, 4 for the down projection) 249-257, 1 MiB 254-266, 2 MiB (one
/// block) 256-264; F16 242-250, 254-258, 259-261; 256 KiB 230-244 for both. At two threads 458-494 -> 483-495.
int64_t x_block_budget_bytes() {
  static const int64_t budget = [] {
    const long l2 = sysconf(_SC_LEVEL2_CACHE_SIZE);
    const int64_t half =
        l2 >= (int64_t{256} << 10) && l2 <= (int64_t{64} << 20) ? int64_t{l2} / 2 : int64_t{1} << 20;
    return cpu_is_amd() ? std::max(half, int64_t{2} << 20) : half;
  }();
  return budget;
}

/// The cap of x rows per block (BalancedBlocks evens the blocks out, a quarter more allowed; each weight is widened
/// once per block of rows): a multiple of the tile whose rows fill the budget (x_block_budget_bytes) when they are
/// one block of chunks, and whose block of chunks (kZChunks of each row) fills half of it otherwise (the
/// accumulators of a group of panels take the other half). Measured on Sapphire Rapids (2 MiB L2), the 4864-weight
/// rows of an FFN's down projection: 130 GFLOP/s with half of the L2 for x and 4 panels a group, 137 with a quarter
/// and 8.
int64_t zpanel_block_rows(int64_t cols) {
  const int64_t budget = cols <= kZChunks * kLanes ? x_block_budget_bytes() : x_block_budget_bytes() / 2;
  return std::max<int64_t>(kZRows, budget / (std::min(cols, kZChunks * kLanes) * 4) / kZRows * kZRows);
}

/// p[c][j][16]: chunk c0 + c (c < count) of weight row j (j < rows) of the panel at w, widened.
template <WeightType T>
POSENC_TARGET_AVX512 void pack_panel_avx512(const std::byte* w, int64_t row_bytes, int64_t rows, int64_t c0,
                                            int64_t count, float* p) {
  for (int64_t j = 0; j < rows; ++j)
    for (int64_t c = 0; c < count; ++c) _mm512_store_ps(p + (c * rows + j) * kLanes, Avx512::load_w<T>(w + j * row_bytes, c0 + c));
}

/// The tree of kernels_dense.hpp (a_k + a_{k+8}, then + 4 apart, + 2 apart, the last two) for 16 accumulators at
/// once, in shuffles that pair whole vectors: element e of the result is Avx512::reduce(a[e]), bit for bit (the
/// same additions of the same pairs), in 45 + 1 instructions instead of 16 x 8.
POSENC_TARGET_AVX512 inline __m512 reduce16(const __m512* a) {
  __m512 v1[8], v2[4], v3[2];
  for (int i = 0; i < 8; ++i)  // [a_k + a_{k+8} of a[2i] | of a[2i+1]], k < 8
    v1[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                          _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int i = 0; i < 4; ++i)  // 128-bit lane L: + 4 apart, of a[4i + L]
    v2[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v1[2 * i], v1[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                          _mm512_shuffle_f32x4(v1[2 * i], v1[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  for (int i = 0; i < 2; ++i) {  // lane L: [s2a, s2b of a[8i + L], s2a, s2b of a[8i + 4 + L]]
    const __m512d x = _mm512_castps_pd(v2[2 * i]), y = _mm512_castps_pd(v2[2 * i + 1]);
    v3[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  // lane L: the sums of a[L], a[4 + L], a[8 + L], a[12 + L]: element 4L + m holds a[4m + L]'s.
  const __m512 t = _mm512_add_ps(_mm512_shuffle_ps(v3[0], v3[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_ps(v3[0], v3[1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), t);
}

/// Chunks [c0, c1) of a tile of R x rows (stride ldx, from chunk 0 of the panel's segment) by the panel's C
/// weight rows (p: [chunk][C][16] from the segment's chunk 0): the lanes continue from `acc_io` (+0 when
/// `first`) and are left there, or (`last`) summed by the tree into y[R rows, C] (+)=.
template <int R, int C>
POSENC_TARGET_AVX512 void zpanel_tile(const float* x, int64_t ldx, const float* p, int64_t c0, int64_t c1,
                                      ZTileAcc& acc_io, bool first, bool last, float* y, int64_t ldy,
                                      bool accumulate) {
  // Every loop over r and j unrolled before GCC's scalar replacement of aggregates, so that acc stays in
  // registers (otherwise each call zeroes or copies it through the stack: 10-15% of the tile's time).
  __m512 acc[R][C];
  if (first) {
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
      for (int j = 0; j < C; ++j) acc[r][j] = _mm512_setzero_ps();
  } else {
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
      for (int j = 0; j < C; ++j) acc[r][j] = _mm512_load_ps(reinterpret_cast<const float*>(&acc_io.v[r][j]));
  }
  for (int64_t c = c0; c < c1; ++c) {
    __m512 xv[R];
    // x comes from L2: its rows a few chunks ahead into L1 (measured: +5%).
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r)
      _mm_prefetch(reinterpret_cast<const char*>(x + r * ldx + (c + kXPrefetch) * kLanes), _MM_HINT_T0);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      xv[r] = _mm512_loadu_ps(x + r * ldx + c * kLanes);
      // In a register, loaded once per chunk (GCC would otherwise fold x into each of the C fmas as a memory operand).
      asm("" : "+v"(xv[r]));
    }
    const float* pc = p + c * C * kLanes;
#pragma GCC unroll 16
    for (int j = 0; j < C; ++j) {
      __m512 wv = _mm512_load_ps(pc + j * kLanes);
      asm("" : "+v"(wv));  // likewise: one load of each weight vector per chunk, not one per row
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) acc[r][j] = _mm512_fmadd_ps(xv[r], wv, acc[r][j]);
    }
  }
  if (!last) {
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
      for (int j = 0; j < C; ++j) _mm512_store_ps(reinterpret_cast<float*>(&acc_io.v[r][j]), acc[r][j]);
    return;
  }
  if constexpr (C == 8) {
    // Two rows' 8 outputs per reduce16 (the last row of an odd R twice).
#pragma GCC unroll 16
    for (int r = 0; r < R; r += 2) {
      const int r2 = r + 1 < R ? r + 1 : r;
      const __m512 a[16] = {acc[r][0],  acc[r][1],  acc[r][2],  acc[r][3],  acc[r][4],  acc[r][5],
                            acc[r][6],  acc[r][7],  acc[r2][0], acc[r2][1], acc[r2][2], acc[r2][3],
                            acc[r2][4], acc[r2][5], acc[r2][6], acc[r2][7]};
      const __m512 s = reduce16(a);
      float* out0 = y + r * ldy;
      __m256 v0 = _mm512_castps512_ps256(s);
      if (accumulate) v0 = _mm256_add_ps(_mm256_loadu_ps(out0), v0);
      _mm256_storeu_ps(out0, v0);
      if (r + 1 < R) {
        float* out1 = out0 + ldy;
        __m256 v1 = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(s), 1));
        if (accumulate) v1 = _mm256_add_ps(_mm256_loadu_ps(out1), v1);
        _mm256_storeu_ps(out1, v1);
      }
    }
  } else {
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
      for (int j = 0; j < C; ++j) {
        const float s = Avx512::reduce(acc[r][j]);
        float& out = y[r * ldy + j];
        out = accumulate ? out + s : s;
      }
  }
}

/// zpanel_tile for any R <= kZRows, C <= kZCols (the block's last rows, the matrix's last weight rows).
template <int R>
void zpanel_tile_c(int64_t cols_in_panel, const float* x, int64_t ldx, const float* p, int64_t c0, int64_t c1,
                   ZTileAcc& acc, bool first, bool last, float* y, int64_t ldy, bool accumulate) {
  switch (cols_in_panel) {
#define POSENC_ZCASE(CC) \
  case CC: zpanel_tile<R, CC>(x, ldx, p, c0, c1, acc, first, last, y, ldy, accumulate); return;
    POSENC_ZCASE(1) POSENC_ZCASE(2) POSENC_ZCASE(3) POSENC_ZCASE(4) POSENC_ZCASE(5) POSENC_ZCASE(6) POSENC_ZCASE(7)
    POSENC_ZCASE(8)
#undef POSENC_ZCASE
  }
}
static_assert(kZCols == 8 && kZRows == 3, "zpanel_tile_any's cases");
void zpanel_tile_any(int64_t rows, int64_t cols_in_panel, const float* x, int64_t ldx, const float* p, int64_t c0,
                     int64_t c1, ZTileAcc& acc, bool first, bool last, float* y, int64_t ldy, bool accumulate) {
  switch (rows) {
    case 1: zpanel_tile_c<1>(cols_in_panel, x, ldx, p, c0, c1, acc, first, last, y, ldy, accumulate); return;
    case 2: zpanel_tile_c<2>(cols_in_panel, x, ldx, p, c0, c1, acc, first, last, y, ldy, accumulate); return;
    case 3: zpanel_tile_c<3>(cols_in_panel, x, ldx, p, c0, c1, acc, first, last, y, ldy, accumulate); return;
  }
}

/// The lines of a panel's weights (`rows` rows of rb bytes from `first`, row_lines lines of each), prefetched
/// (prefetcht1) a few at a time in order: take(k) prefetches the next k. The last line of a row may reach past the
/// matrix's end: the address is formed as an integer (a prefetch does not fault), as prefetch_ahead's. The cursor
/// advances by additions (an idiv per line, to find its row, showed in the profile beside the widening).
struct PanelLines {
  uintptr_t first = 0;
  int64_t rb = 0, row_lines = 1, rows = 0;
  int64_t row = 0, line = 0;  // the next line to prefetch
  POSENC_TARGET_AVX512 void take(int64_t k) {
    for (; k > 0 && row < rows; --k) {
      _mm_prefetch(reinterpret_cast<const char*>(first + static_cast<uintptr_t>(row * rb + line * 64)), _MM_HINT_T1);
      if (++line == row_lines) {
        line = 0;
        ++row;
      }
    }
  }
};

/// The panel matmul_panels_avx512 widens after panel pi's chunks [c0, c1) (its loop: the panels of group [g0, g1)
/// a block of chunks at a time, then the item's next group up to q1, then the first panel of the thread's next
/// item, `after`, or none when it has none: -1).
PanelLines next_panel_lines(const RawMatrix& w, int64_t pi, int64_t c0, int64_t c1, int64_t g0, int64_t g1,
                            int64_t q1, int64_t after, int64_t chunks) {
  int64_t np = pi + 1, nc0 = c0;
  if (np >= g1) {
    if (c1 < chunks) {
      np = g0;
      nc0 = c1;
    } else if (g1 < q1) {
      np = g1;
      nc0 = 0;
    } else if (after >= 0) {
      np = after;
      nc0 = 0;
    } else {
      return {};
    }
  }
  const int64_t rb = w.row_bytes(), nc1 = std::min(chunks, nc0 + kZChunks);
  const int64_t row0 = np * kZCols, b0 = nc0 * rb / chunks;
  PanelLines p;
  p.first = reinterpret_cast<uintptr_t>(w.data) + static_cast<uintptr_t>(row0 * rb + b0);
  p.rb = rb;
  p.row_lines = std::max<int64_t>(1, (nc1 * rb / chunks - b0 + 63) / 64);
  p.rows = std::min(kZCols, w.rows - row0);
  return p;
}

bool zpanels_pay(int64_t n, const RawMatrix& w) { return n >= 2 * kZRows && w.cols > 0 && w.cols % kLanes == 0; }

template <WeightType T>
void matmul_panels_avx512(const float* x, int64_t n, const RawMatrix& w, float* y, bool accumulate) {
  const int64_t out = w.rows, in = w.cols, rb = w.row_bytes(), chunks = in / kLanes;
  const int64_t panels = (out + kZCols - 1) / kZCols, cblocks = (chunks + kZChunks - 1) / kZChunks;
  // A quarter of the cap as slack: a 256-token prompt is one block of 256 rows against a cap of 255, rather than two
  // blocks each widening every weight.
  const int64_t cap = zpanel_block_rows(in);
  const BalancedBlocks blocks(n, cap, kZRows, cap / 4);
  // Rows of more than one block of chunks go a block of chunks at a time over a group of panels, each tile's
  // lanes kept between blocks: the group's accumulators in a quarter of the L2 (x's block of chunks has another).
  const int64_t tiles_max = (std::min(blocks.max_size(), n) + kZRows - 1) / kZRows;
  const int64_t group =
      cblocks == 1 ? 1
                   : std::max<int64_t>(1, x_block_budget_bytes() / 2 / (tiles_max * static_cast<int64_t>(sizeof(ZTileAcc))));
  const bool parallel = parallel_pays(n, w);
  // An item of rows of more than one block of chunks is at most a group (the tiles' lanes kept between blocks).
  PanelItems items(panels, panels_per_item(panels, cblocks > 1 ? group : panels, region_threads(parallel)), blocks.count);
  detail::FirstException error;  // std::bad_alloc of a thread's buffers, rethrown after the region
#pragma omp parallel if (parallel)
  error.run([&] {
    AlignedFloatVector panel(static_cast<std::size_t>(std::min(chunks, kZChunks) * kZCols * kLanes));
    const std::unique_ptr<ZTileAcc[]> acc(new ZTileAcc[static_cast<std::size_t>(tiles_max * std::min(group, items.per_item))]);
    constexpr int64_t kUnclaimed = -2;
    for (int64_t item = items.claim(); item >= 0;) {
      // The thread's next item, claimed when the prefetch of its first panel is due (the last panel of this one).
      int64_t following = kUnclaimed;
      const auto after = [&] {
        if (following == kUnclaimed) following = items.claim();
        return following < 0 ? int64_t{-1} : items.first_panel(following);
      };
      const int64_t bi = items.block(item), q0 = items.first_panel(item), q1 = items.end_panel(item);
      const int64_t b0 = blocks.begin(bi), b1 = blocks.begin(bi + 1), tiles = (b1 - b0 + kZRows - 1) / kZRows;
      for (int64_t g0 = q0; g0 < q1; g0 += group) {
        const int64_t g1 = std::min(q1, g0 + group);
        for (int64_t c0 = 0; c0 < chunks; c0 += kZChunks) {
          const int64_t c1 = std::min(chunks, c0 + kZChunks);
          for (int64_t pi = g0; pi < g1; ++pi) {
            const int64_t o0 = pi * kZCols, cols_here = std::min(kZCols, out - o0);
            pack_panel_avx512<T>(w.data + o0 * rb, rb, cols_here, c0, c1 - c0, panel.data());
            // The next panel this loop widens, towards L2 while this one's tiles run, its lines spread over them
            // (a few per tile): widened from DRAM it stalled on its loads (7.5% of an F16 prefill's samples in the
            // widening on Sapphire Rapids, 5.6% with the prefetches, these included; the 487M F16 model's 256-token
            // prefill +2-9% at one thread, +4-5% at two, Q8_0 +1-5%, alternated A/B runs). All at once after the
            // widening, or to L1, it did not pay (an earlier session's A/B).
            const bool last = pi + 1 == g1 && c1 == chunks && g1 == q1;
            PanelLines next = next_panel_lines(w, pi, c0, c1, g0, g1, q1, last ? after() : -1, chunks);
            const int64_t per_tile = (next.rows * next.row_lines + tiles - 1) / tiles;
            for (int64_t t = 0; t < tiles; ++t) {
              next.take(per_tile);
              const int64_t r = b0 + t * kZRows, rows = std::min(kZRows, b1 - r);
              const float* xt = x + r * in + c0 * kLanes;
              float* yt = y + r * out + o0;
              ZTileAcc& a = acc[static_cast<std::size_t>((pi - g0) * tiles_max + t)];
              if (rows == kZRows && cols_here == kZCols)
                zpanel_tile<kZRows, kZCols>(xt, in, panel.data(), 0, c1 - c0, a, c0 == 0, c1 == chunks, yt, out,
                                            accumulate);
              else
                zpanel_tile_any(rows, cols_here, xt, in, panel.data(), 0, c1 - c0, a, c0 == 0, c1 == chunks, yt, out,
                                accumulate);
            }
          }
        }
      }
      item = following == kUnclaimed ? items.claim() : following;
    }
  });
  error.rethrow();
}

// ---- AVX-512 decode: runs of rows read side by side -------------------------------------------------------------
// One row of x against the matrix (decode) is memory-bound, but the 1 x 4 tiles above read it badly: four
// adjacent rows at a time, so a page of rows of 1024 weights holds several streams advancing side by side, which the
// hardware prefetcher does not follow (F16 at 12.9 GB/s of a 14.1 GB/s DRAM read rate on one Sapphire Rapids core,
// rows of 1024 weights), and for Q8_0 they spend about 16 vector instructions per block and row (the scale converted
// and broadcast for each of its two chunks). Here a thread splits its rows into R runs of consecutive rows and reads
// the R runs side by side, each a long sequential stream through its own pages (R and the software prefetch: the
// DecodeStreams plan, kernels_dense.hpp); x's chunk is loaded once for the R rows, a Q8_0/Q4_0 block takes 9-10
// instructions per row (its scale widened once), and the outputs are summed by reduce16. Same lanes, same fmas in
// the same order, same tree: the reference's bits, for every plan. Measured on the 487M model's shapes
// (BM_MatmulDecode, from DRAM), Sapphire Rapids, 16 runs prefetched: F16 rows of 1024 weights 12.9 -> 14.5 GB/s at
// 1 thread and 24.5 -> 27.9 at 2, Q8_0 10.0 -> 14.6 and 18.0 -> 29.3 (the DRAM read rate: 14.1 and 26.2). On Zen 5
// the same plan read F16 at 27-29 GB/s of a 42-46 GB/s read rate: its prefetchers follow a few streams, and the
// software prefetches only cost it. In a standalone model of the loop (16 runs 30 GB/s, 8 34-36, 6 38, 4 40-46,
// 3 37-46, 2 37-51, each lower with prefetches) and in the model (BM_RealDecode, the 487M F16 model at one thread:
// 16 prefetched 33 tokens/s, 8 36, 4 39.5, 3 40, 2 41.5) two runs read best. What a Zen 5 core needs in
// addition is distance: its prefetches 1 KiB ahead arrive too late for a loop that spends as many cycles on each
// byte as Q8_0's (about 10 vector instructions per 34-byte block and row, 3.1-3.4 cycles: from L2 or L3 it reads
// 44-48 GB/s, barely over the DRAM rate). In a standalone model of the Q8_0 loop over 340 MB (one thread, of a
// 42.5 GB/s read rate): 8 runs prefetched 1 KiB ahead 28.8 GB/s, 8 runs 1.5 or 2 KiB 29, 4 runs 1 KiB 29.7, 2 KiB
// 38, 3 KiB 40, 4 KiB 39, 2 runs 2-8 KiB 31-35, 16 runs 22-24; prefetcht1 or prefetchnta no better than prefetcht0.
// In the model (BM_RealDecode, the 487M Q8_0 model, warmed up, alternated): 8 runs 1 KiB 69.4-69.5 tokens/s at one
// thread and 123-126 at two, 4 runs 3 KiB 80.1-81.4 and 142-143 (5 KiB 76-79 and 128-138); F16 as 2 runs 3 KiB ahead
// 40.7-41.6 and 73-76 against 39.3-40.1 and 52-72 unprefetched. Q4_0 reads 17-18 GB/s in every plan (its nibble
// unpacking holds it, not the DRAM). With the weights in 2 MiB pages (MappedFile; no TLB walk per 4 KiB) F16's
// distance moved: 2 runs at one thread, two alternations, GB/s: 2 KiB 36.0-36.5, 3 KiB 38.7-39.1, 4 KiB 39.3-40.4,
// 5 KiB 39.2-40.0, 6 KiB 38.0-39.1, 8 KiB 36.5-37.2, unprefetched 37.3-38.2 (4 runs 3 KiB 35.3-36.1); at two threads
// 3 and 4 KiB alike (46-48 of 51 GB/s). Q8_0 stayed: 4 runs 3 KiB 38.7-40.3, 4 KiB 37.4-38.2, 2 KiB 36.7-37.6.

/// A Q8_0/Q4_0 block's fp16 scale h as float32 bits, exactly as vcvtph2ps widens it: a normal h (exponent field 1-30)
/// by integer arithmetic (the sign moved to bit 31, exponent and mantissa shifted up by 13, the exponent rebiased by
/// 127 - 15 = 112), zero, subnormals, inf and NaN by vcvtph2ps. The AVX-512 decode broadcasts it from a general
/// register: one vector instruction per block and row instead of a broadcast and a conversion, where the vector pipes
/// are the float32 decode's limit (per block and row besides: 2 sign-extensions, 2 conversions, 2 multiplies and 2 fmas
/// for Q8_0). From L2 (BM_MatmulDecodeCached, Zen 4, 256 x 1024, alternated): Q8_0 18.2-18.8 -> 19.0-19.5 GB/s in six
/// turns, Q4_0 10.2-10.6 -> 10.4-10.6. The AVX2 decode keeps vcvtph2ps on the scalar and vbroadcastss: a broadcast from
/// a general register is two instructions there (vmovd, vpbroadcastd), and its Q8_0 read 18.4-18.5 against 18.7-18.8
/// GB/s.
__attribute__((target("f16c"))) inline uint32_t scale_bits(uint16_t h) {
  if (((h >> 10) & 31u) - 1u < 30u) [[likely]]
    return (static_cast<uint32_t>(h & 0x8000u) << 16) | ((static_cast<uint32_t>(h & 0x7fffu) << 13) + 0x38000000u);
  return std::bit_cast<uint32_t>(_cvtsh_ss(h));
}

/// y[o_j] (+)= x · row o_j for the R rows o_j = o_0 + j * stride (w: row o_0, rb: bytes per row); the outputs go
/// to y[j * stride]. Prefetch: each row's line `ahead` bytes ahead (a multiple of 64), once per line.
template <WeightType T, int R, bool Prefetch>
POSENC_TARGET_AVX512 void decode_tile(const float* x, int64_t cols, const std::byte* w, int64_t rb, int64_t stride,
                                      float* y, bool accumulate, int64_t ahead) {
  static_assert(R >= 1 && R <= 16);
  __m512 acc[16];
#pragma GCC unroll 16
  for (int j = 0; j < 16; ++j) acc[j] = _mm512_setzero_ps();
  if constexpr (T == WeightType::q8_0 || T == WeightType::q4_0) {
    constexpr int64_t kBlockBytes = T == WeightType::q8_0 ? kQ8Bytes : kQ4Bytes;
    const int64_t blocks = cols / kQBlock;
    for (int64_t b = 0; b < blocks; ++b) {
      const __m512 x0 = _mm512_loadu_ps(x + b * kQBlock), x1 = _mm512_loadu_ps(x + b * kQBlock + kLanes);
      // One prefetch per 64 bytes of a row, not per block: at the blocks that cross a 64-byte boundary of the row,
      // the line of the block's end `ahead` bytes ahead (Q8_0's 34-byte blocks had two a line, Q4_0's 18-byte
      // ones three or four).
      const bool prefetch = Prefetch && (b * kBlockBytes) % 64 + kBlockBytes >= 64;
#pragma GCC unroll 16
      for (int j = 0; j < R; ++j) {
        const std::byte* blk = w + j * stride * rb + b * kBlockBytes;
        if (prefetch)
          prefetch_ahead(blk, ahead + kBlockBytes - 1);
        uint16_t h;
        std::memcpy(&h, blk, 2);
        const __m512 d = _mm512_castsi512_ps(_mm512_set1_epi32(static_cast<int>(scale_bits(h))));
        if constexpr (T == WeightType::q8_0) {
          const __m512i q0 = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 2)));
          const __m512i q1 = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 18)));
          acc[j] = _mm512_fmadd_ps(x0, _mm512_mul_ps(_mm512_cvtepi32_ps(q0), d), acc[j]);
          acc[j] = _mm512_fmadd_ps(x1, _mm512_mul_ps(_mm512_cvtepi32_ps(q1), d), acc[j]);
        } else {
          // The block's 16 weights d * (n - 8), n = 0..15, as a table (each product exact: a 4-bit integer times
          // an fp16), looked up by the nibbles: vpermps reads the low 4 bits of each index lane, so a byte widened
          // to 32 bits indexes by its low nibble, and shifted right by 4 by its high one. The weights' values are
          // the reference's (float(n - 8) * d), with 2 permutes instead of 2 conversions, 2 multiplies, 2
          // subtractions and a mask.
          const __m512 table = _mm512_mul_ps(_mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7), d);
          const __m512i nib = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 2)));
          acc[j] = _mm512_fmadd_ps(x0, _mm512_permutexvar_ps(nib, table), acc[j]);
          acc[j] = _mm512_fmadd_ps(x1, _mm512_permutexvar_ps(_mm512_srli_epi32(nib, 4), table), acc[j]);
        }
      }
    }
  } else {
    const int64_t chunks = cols / kLanes, chunk_bytes = rb / chunks;
    for (int64_t c = 0; c < chunks; ++c) {
      const __m512 xv = _mm512_loadu_ps(x + c * kLanes);
#pragma GCC unroll 16
      for (int j = 0; j < R; ++j) {
        const std::byte* row = w + j * stride * rb;
        if constexpr (Prefetch)
          if (chunk_bytes < 64 ? (c & 1) == 0 : true)  // one prefetch per cache line of the row
            prefetch_ahead(row, ahead + c * chunk_bytes);
        acc[j] = _mm512_fmadd_ps(xv, Avx512::load_w<T>(row, c), acc[j]);
      }
    }
  }
  // The tree for all 16 at once (the accumulators past R are +0 and their sums unused): reduce(acc[j]) for j < R.
  const __m512 s = reduce16(acc);
  alignas(64) float out[16];
  _mm512_store_ps(out, s);
  for (int j = 0; j < R; ++j) y[j * stride] = accumulate ? y[j * stride] + out[j] : out[j];
}

/// y[r0, r1) (+)= x[cols] W[r0, r1)^T, W of any dtype, cols % 16 == 0: the rows as R runs of `stride` consecutive
/// rows read side by side, then the rows left over one at a time.
template <WeightType T, int R, bool Prefetch>
void decode_avx512_rows(const float* x, const RawMatrix& w, float* y, bool accumulate, int64_t ahead, int64_t r0,
                        int64_t r1) {
  const int64_t rb = w.row_bytes(), stride = (r1 - r0) / R;
  for (int64_t g = 0; g < stride; ++g)
    decode_tile<T, R, Prefetch>(x, w.cols, w.data + (r0 + g) * rb, rb, stride, y + r0 + g, accumulate, ahead);
  for (int64_t o = r0 + stride * R; o < r1; ++o)
    tile_Avx512<T, 1, 1>(x, w.cols, w.data + o * rb, rb, y + o, w.rows, accumulate);
}

template <WeightType T, int R, bool Prefetch>
struct Avx512Rows {
  static void run(const float* x, const RawMatrix& w, float* y, bool accumulate, int64_t ahead, int64_t r0,
                  int64_t r1) {
    decode_avx512_rows<T, R, Prefetch>(x, w, y, accumulate, ahead, r0, r1);
  }
};

/// The AVX-512 one-row product (decode), as decode_any: all of it in its own parallel region (rows {-1, -1}) or the
/// rows [rows.first, rows.second) on the calling thread.
void decode_avx512_any(DecodeStreams plan, const float* x, const RawMatrix& w, float* y, bool accumulate,
                       std::pair<int64_t, int64_t> rows) {
  decode_any<Avx512Rows>(plan, x, w, y, accumulate, rows);
}

void matmul_avx512(DecodeStreams plan, const float* x, int64_t n, const RawMatrix& w, float* y, bool accumulate) {
  if (n == 1 && w.cols > 0 && w.cols % kLanes == 0) {
    decode_avx512_any(plan, x, w, y, accumulate, {-1, -1});
    return;
  }
  if (!zpanels_pay(n, w)) {
    matmul_any_Avx512(x, n, w, y, accumulate);
    return;
  }
  switch (w.type) {
    case WeightType::f32: matmul_panels_avx512<WeightType::f32>(x, n, w, y, accumulate); return;
    case WeightType::f16: matmul_panels_avx512<WeightType::f16>(x, n, w, y, accumulate); return;
    case WeightType::bf16: matmul_panels_avx512<WeightType::bf16>(x, n, w, y, accumulate); return;
    case WeightType::q8_0: matmul_panels_avx512<WeightType::q8_0>(x, n, w, y, accumulate); return;
    case WeightType::q4_0: matmul_panels_avx512<WeightType::q4_0>(x, n, w, y, accumulate); return;
  }
}

}  // namespace

int64_t region_threads(bool parallel) { return parallel ? int64_t{region_thread_count()} : int64_t{1}; }

DenseKernel dense_kernel() {
  static const DenseKernel k = detect_dense_kernel();
  return k;
}

std::string describe_invalid(DecodeStreams s) {
  return fmt::format("runs {}, prefetch_bytes {} is not a decode plan (runs 2, 4, 8 or 16; prefetch_bytes 0 or a "
                     "multiple of 64 from 64 to 65536)",
                     s.runs, s.prefetch_bytes);
}

std::string to_string(DecodeStreams s) {
  return std::to_string(s.runs) + (s.prefetch_bytes > 0 ? ":prefetch=" + std::to_string(s.prefetch_bytes) : "");
}

bool decode_streams_valid(DecodeStreams s) {
  return (s.runs == 2 || s.runs == 4 || s.runs == 8 || s.runs == 16) &&
         (s.prefetch_bytes == 0 || (s.prefetch_bytes >= 64 && s.prefetch_bytes <= 65536 && s.prefetch_bytes % 64 == 0));
}

std::optional<DecodeStreams> parse_decode_streams(std::string_view text) {
  // Digits only (no sign, space, leading + or leading zero), read whole; a number too long for int is not a plan.
  const auto number = [](std::string_view digits) -> std::optional<int> {
    int v = 0;
    if (digits.empty() || digits.size() > 6 || digits.front() == '0') return std::nullopt;
    for (char c : digits) {
      if (c < '0' || c > '9') return std::nullopt;
      v = v * 10 + (c - '0');
    }
    return v;
  };
  const std::size_t colon = text.find(':');
  const auto runs = number(text.substr(0, colon));
  if (!runs) return std::nullopt;
  DecodeStreams s{*runs, 0};
  if (colon != std::string_view::npos) {
    const std::string_view rest = text.substr(colon + 1);
    constexpr std::string_view kPrefetch = "prefetch";
    if (rest == kPrefetch) {
      s.prefetch_bytes = 1024;
    } else if (rest.size() > kPrefetch.size() + 1 && rest.substr(0, kPrefetch.size() + 1) == "prefetch=") {
      const auto bytes = number(rest.substr(kPrefetch.size() + 1));
      if (!bytes || *bytes == 0) return std::nullopt;
      s.prefetch_bytes = *bytes;
    } else {
      return std::nullopt;
    }
  }
  if (!decode_streams_valid(s)) return std::nullopt;
  return s;
}

namespace {
/// cpuid leaf 1's family: the base family, plus the extended family when the base is 0xF (AMD's and Intel's rule).
unsigned cpu_family() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (__get_cpuid(1, &a, &b, &c, &d) == 0) return 0;
  const unsigned base = (a >> 8) & 0xF;
  return base == 0xF ? base + ((a >> 20) & 0xFF) : base;
}

/// This CPU's plan for dense (F32/F16/BF16) or block (Q8_0/Q4_0) weights.
DecodeStreams vendor_decode_streams(bool blocks, DenseKernel k) {
  static const bool amd = cpu_is_amd();
  // Zen 4: AMD family 25 (0x19) with AVX-512 (Zen 3, also family 25, has none and keeps the plans below it).
  static const bool zen4 = amd && cpu_family() == 0x19 && dense_kernel_supported(DenseKernel::avx512);
  // Intel: measured on Sapphire Rapids-class Xeons (kernels_dense.hpp): 8 runs for F32/F16/BF16, 16 for Q8_0/Q4_0
  // in AVX-512, 8 for both in AVX2.
  if (!amd) return blocks && k != DenseKernel::avx2 ? DecodeStreams{16, 1024} : DecodeStreams{8, 1024};
  // Zen 4 (kernels_dense.hpp): 4 runs prefetched 256 bytes ahead for F32/F16/BF16, 512 for Q8_0/Q4_0, in both paths.
  if (zen4) return blocks ? DecodeStreams{4, 512} : DecodeStreams{4, 256};
  return blocks ? DecodeStreams{4, 3072} : DecodeStreams{2, 4096};
}

/// `text` for a one-line message: detail::escaped (control bytes and malformed UTF-8 as \xNN), cut after 64 bytes.
std::string shown(std::string_view text) {
  return text.size() > 64 ? escaped(text.substr(0, 64)) + "..." : escaped(text);
}

/// The plan POSENC_DECODE_STREAMS asks for; {0, 0} when it is unset or empty (as the other POSENC_* variables) or
/// not a plan (reported once, naming the plans used instead).
DecodeStreams decode_streams_asked() {
  const char* env = std::getenv("POSENC_DECODE_STREAMS");
  if (env == nullptr || *env == '\0') return {0, 0};
  if (const auto plan = parse_decode_streams(env)) return *plan;
  std::fprintf(stderr,
               "posenc: POSENC_DECODE_STREAMS='%s' is not a decode plan (R, R:prefetch or R:prefetch=BYTES; R 2, 4, "
               "8 or 16; BYTES a multiple of 64 from 64 to 65536); using this CPU's: %s for F32/F16/BF16, %s for "
               "Q8_0/Q4_0\n",
               shown(env).c_str(), to_string(vendor_decode_streams(false, dense_kernel())).c_str(),
               to_string(vendor_decode_streams(true, dense_kernel())).c_str());
  return {0, 0};
}
}  // namespace

namespace {
/// set_decode_streams_for_benchmark's plan as runs << 32 | prefetch_bytes; 0 when none is set.
std::atomic<uint64_t> g_benchmark_plan{0};
}  // namespace

void set_decode_streams_for_benchmark(std::optional<DecodeStreams> plan) {
  if (plan && !decode_streams_valid(*plan))
    throw std::logic_error("set_decode_streams_for_benchmark: " + describe_invalid(*plan));
  g_benchmark_plan.store(plan ? uint64_t(plan->runs) << 32 | uint32_t(plan->prefetch_bytes) : 0,
                         std::memory_order_relaxed);
}

DecodeStreams decode_streams(WeightType t, DenseKernel k) {
  if (const uint64_t b = g_benchmark_plan.load(std::memory_order_relaxed); b != 0)
    return DecodeStreams{int(b >> 32), int(b & 0xFFFFFFFFu)};
  static const DecodeStreams asked = decode_streams_asked();
  if (asked.runs != 0) return asked;
  return vendor_decode_streams(t == WeightType::q8_0 || t == WeightType::q4_0, k);
}

namespace {
/// F16C from cpuid leaf 1 (ECX bit 29): clang's __builtin_cpu_supports has no "f16c" (the fuzz build is clang).
bool has_f16c() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  return __get_cpuid(1, &a, &b, &c, &d) != 0 && (c & bit_F16C) != 0;
}
}  // namespace

// Asked once per process: cpuid traps to the hypervisor under a virtual machine (KVM), and matmul_w_with asks on
// every call: on a Zen 4 core under KVM a product of 16 rows by 1024 Q8_0 weights took 13 us, 81% of it in
// cpuid, when asked each time.
bool dense_kernel_supported(DenseKernel k) {
  static const bool avx2 = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && has_f16c();
  }();
  static const bool avx512 = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("fma") && has_f16c();
  }();
  switch (k) {
    case DenseKernel::reference: return true;
    case DenseKernel::avx2: return avx2;
    case DenseKernel::avx512: return avx512;
  }
  return false;
}

void matmul_w_reference(const float* x, int64_t n, const RawMatrix& w, float* y, bool accumulate) {
  const int64_t in = w.cols, out = w.rows;
  const int64_t chunks = (in + kLanes - 1) / kLanes;
  std::vector<float> row(static_cast<std::size_t>(in));
  for (int64_t o = 0; o < out; ++o) {
    w.row_to_f32(o, row.data());
    for (int64_t r = 0; r < n; ++r) {
      const float* xr = x + r * in;
      float acc[kLanes] = {};
      for (int64_t c = 0; c < chunks; ++c)
        for (int k = 0; k < kLanes; ++k) {
          const int64_t i = c * kLanes + k;
          acc[k] = i < in ? std::fma(xr[i], row[static_cast<std::size_t>(i)], acc[k]) : std::fma(0.0f, 0.0f, acc[k]);
        }
      const float s = reduce_lanes(acc);
      float& dst = y[r * out + o];
      dst = accumulate ? dst + s : s;
    }
  }
}

void matmul_w_with(DenseKernel k, const float* x, int64_t n, const RawMatrix& w, float* y, bool accumulate) {
  // Only an AVX-512 or AVX2 decode takes a plan (and only then is a bad POSENC_DECODE_STREAMS reported).
  matmul_w_with(k, k != DenseKernel::reference && n == 1 ? decode_streams(w.type, k) : DecodeStreams{}, x, n, w, y,
                accumulate);
}

void matmul_w_with(DenseKernel k, DecodeStreams plan, const float* x, int64_t n, const RawMatrix& w, float* y,
                   bool accumulate) {
  if (!decode_streams_valid(plan))
    throw std::logic_error("matmul_w_with: " + describe_invalid(plan));
  if (!dense_kernel_supported(k))
    throw std::logic_error(fmt::format("matmul_w_with: this CPU cannot run the {} path", to_string(k)));
  if (n <= 0 || w.rows <= 0) return;
  switch (k) {
    case DenseKernel::reference: matmul_w_reference(x, n, w, y, accumulate); return;
    case DenseKernel::avx2: matmul_avx2(plan, x, n, w, y, accumulate); return;
    case DenseKernel::avx512: matmul_avx512(plan, x, n, w, y, accumulate); return;
  }
}

bool decode_rows_supported(const RawMatrix& w) {
  return dense_kernel() != DenseKernel::reference && w.cols > 0 && w.cols % kLanes == 0;
}

void matmul_w_decode_rows(const float* x, const RawMatrix& w, float* y, bool accumulate, int64_t first,
                          int64_t last) {
  if (!decode_rows_supported(w))
    throw std::logic_error(fmt::format("matmul_w_decode_rows: a {} x {} matrix on the {} path has no row-range decode",
                                       w.rows, w.cols, to_string(dense_kernel())));
  if (first < 0 || first > last || last > w.rows)
    throw std::logic_error(
        fmt::format("matmul_w_decode_rows: rows [{}, {}) are not rows of a matrix of {}", first, last, w.rows));
  if (first == last) return;
  if (dense_kernel() == DenseKernel::avx2)
    decode_avx2_any(decode_streams(w.type, DenseKernel::avx2), x, w, y, accumulate, {first, last});
  else
    decode_avx512_any(decode_streams(w.type, DenseKernel::avx512), x, w, y, accumulate, {first, last});
}

void matmul_w(const float* x, int64_t n, const RawMatrix& w, float* y, bool accumulate) {
  if (n <= 0 || w.rows <= 0) return;
  switch (dense_kernel()) {
    case DenseKernel::reference: matmul_w_reference(x, n, w, y, accumulate); return;
    case DenseKernel::avx2:
      matmul_avx2(n == 1 ? decode_streams(w.type, DenseKernel::avx2) : DecodeStreams{}, x, n, w, y, accumulate);
      return;
    case DenseKernel::avx512:
      matmul_avx512(n == 1 ? decode_streams(w.type, DenseKernel::avx512) : DecodeStreams{}, x, n, w, y, accumulate);
      return;
  }
}

}  // namespace posenc::detail
