// Products with weights as stored (see kernels_dense.hpp for the arithmetic).
#include "model/kernels_dense.hpp"

#include <cpuid.h>
#include <immintrin.h>
#include <omp.h>

// GCC 12 flags the undefined pass-through vectors inside its own AVX-512 intrinsics (_mm512_maskz_*, the
// reductions) as uninitialized.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "model/kernels.hpp"
#include "posenc/float16.hpp"

namespace posenc::detail {

std::string_view to_string(DenseKernel k) {
  switch (k) {
    case DenseKernel::reference: return "reference";
    case DenseKernel::avx2: return "avx2";
    case DenseKernel::avx512: return "avx512";
  }
  return "?";
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
  std::fprintf(stderr, "posenc: POSENC_DENSE_KERNEL=%s is not a path this CPU runs (reference, avx2, avx512); using %s\n",
               want.c_str(), std::string(to_string(best)).c_str());
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

/// Big enough for threads: more than 2M multiply-adds in all (as matmul_t), or a
/// weight matrix of 512K entries or more, which decode streams once per token
/// (a 1024 x 1024 projection is 2 MiB in F16: memory-bound, and the second core
/// brings its own share of the memory bandwidth).
bool parallel_pays(int64_t n, const RawMatrix& w) {
  return n * w.rows * w.cols > (int64_t{1} << 21) || w.rows * w.cols >= (int64_t{1} << 19);
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
/// x block (the rows' 4 KiB there) in L2, so that a block of x holds 64 rows for any length of 1024 or more and each
/// weight is widened once per 64 rows (once per 12 rows for the 4864 weights of an FFN's down projection
/// otherwise; measured: 15% of an F16 prefill in the widening).
constexpr int64_t kPanelSegment = 64;
/// A tile's 16 lanes per output between blocks of chunks: [half][x row][weight row].
struct TileAcc {
  __m256 v[2][kPanelTileRows][kPanelRows];
};
/// Rows of x per block: a multiple of the tile, about 256 KiB of them in a segment (half of Zen 3's 512 KiB L2, the
/// other half for the panel and y), at least one tile. (Measured with 384 and 448 KiB: no faster at one
/// thread, slower at two.)
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
  return n >= kPanelTileRows && w.cols % kLanes == 0 && w.rows >= kPanelRows;
}

template <WeightType T>
void matmul_panels_avx2(const float* x, int64_t n, const RawMatrix& w, float* y, bool accumulate) {
  const int64_t out = w.rows, in = w.cols, rb = w.row_bytes(), chunks = in / kLanes;
  const int64_t panels = out / kPanelRows, block = panel_block_rows(in);
  const int64_t segments = (chunks + kPanelSegment - 1) / kPanelSegment;
#pragma omp parallel if (parallel_pays(n, w))
  {
    // This thread's panels (the same ones for every block of rows: it widens only its own weight rows).
    const int64_t nt = omp_get_num_threads(), me = omp_get_thread_num();
    const int64_t p0 = panels * me / nt, p1 = panels * (me + 1) / nt;
    std::vector<float> panel(static_cast<std::size_t>(std::min(chunks, kPanelSegment) * kPanelRows * kLanes));
    // Each tile's lanes between blocks of chunks: per tile of a block, and per panel when the rows span
    // several segments (the segment loop is outside the panel loop).
    const int64_t tiles_max = std::min(block, n) / kPanelTileRows;  // in any block of this call
    const std::size_t acc_count =
        static_cast<std::size_t>(std::max<int64_t>(tiles_max, 1) * (segments > 1 ? std::max<int64_t>(p1 - p0, 1) : 1));
    const std::unique_ptr<TileAcc[]> acc(new TileAcc[acc_count]);
    for (int64_t b0 = 0; b0 < n; b0 += block) {
      const int64_t b1 = std::min(n, b0 + block), tiles = (b1 - b0) / kPanelTileRows;
      for (int64_t s0 = 0; s0 < chunks; s0 += kPanelSegment) {
        const int64_t s1 = std::min(chunks, s0 + kPanelSegment);
        for (int64_t pi = p0; pi < p1; ++pi) {
          const int64_t o0 = pi * kPanelRows;
          TileAcc* pacc = acc.get() + (segments > 1 ? (pi - p0) * tiles_max : 0);
          pack_panel_avx2<T>(w.data + o0 * rb, rb, s0, s1 - s0, panel.data());
          // The next panel's weights of this segment towards L2 while this one's tiles run: widening from
          // DRAM stalls on its loads otherwise (measured: 12% of an F16 prefill in the widening's loads).
          if (pi + 1 < p1) {
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
    // The weight rows past the last panel (out % 3 of them), a row at a time.
#pragma omp for schedule(static) nowait
    for (int64_t o = panels * kPanelRows; o < out; ++o)
      for (int64_t r = 0; r < n; ++r)
        tile_Avx2<T, 1, 1>(x + r * in, in, w.data + o * rb, rb, y + r * out + o, out, accumulate);
  }
}

void matmul_avx2(const float* x, int64_t n, const RawMatrix& w, float* y, bool accumulate) {
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

}  // namespace

DenseKernel dense_kernel() {
  static const DenseKernel k = detect_dense_kernel();
  return k;
}

namespace {
/// F16C from cpuid leaf 1 (ECX bit 29): clang's __builtin_cpu_supports has no "f16c" (the fuzz build is clang).
bool has_f16c() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  return __get_cpuid(1, &a, &b, &c, &d) != 0 && (c & bit_F16C) != 0;
}
}  // namespace

bool dense_kernel_supported(DenseKernel k) {
  __builtin_cpu_init();
  switch (k) {
    case DenseKernel::reference: return true;
    case DenseKernel::avx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && has_f16c();
    case DenseKernel::avx512:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("fma") && has_f16c();
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
  if (!dense_kernel_supported(k))
    throw std::logic_error(fmt::format("matmul_w_with: this CPU cannot run the {} path", to_string(k)));
  if (n <= 0 || w.rows <= 0) return;
  switch (k) {
    case DenseKernel::reference: matmul_w_reference(x, n, w, y, accumulate); return;
    case DenseKernel::avx2: matmul_avx2(x, n, w, y, accumulate); return;
    case DenseKernel::avx512: matmul_any_Avx512(x, n, w, y, accumulate); return;
  }
}

void matmul_w(const float* x, int64_t n, const RawMatrix& w, float* y, bool accumulate) {
  if (n <= 0 || w.rows <= 0) return;
  switch (dense_kernel()) {
    case DenseKernel::reference: matmul_w_reference(x, n, w, y, accumulate); return;
    case DenseKernel::avx2: matmul_avx2(x, n, w, y, accumulate); return;
    case DenseKernel::avx512: matmul_any_Avx512(x, n, w, y, accumulate); return;
  }
}

}  // namespace posenc::detail
