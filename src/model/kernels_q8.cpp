// Quantized products (ggml's Q8_0 / Q4_0 block formats) with the arithmetic
// of llama.cpp's CPU backend; see kernels.hpp. Compiled with FMA contraction,
// but every rounding that matters is written out (std::fma, explicit casts).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <vector>

#include <immintrin.h>

// GCC 12 flags the undefined pass-through vectors inside its own AVX-512 intrinsics as uninitialized.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

#include "model/kernels.hpp"
#include "model/kernels_dense.hpp"
#include "posenc/safetensors.hpp"

namespace posenc::detail {

namespace {

inline float load_fp16(const std::byte* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return f16_to_f32(h);
}

/// Exact int32 dot product of one block of 32 int8 pairs.
inline int32_t block_dot(const int8_t* a, const int8_t* b) {
  int32_t s = 0;
#pragma omp simd reduction(+ : s)
  for (int j = 0; j < kQBlock; ++j) s += static_cast<int32_t>(a[j]) * static_cast<int32_t>(b[j]);
  return s;
}

inline float dot_row(const std::byte* w, bool q4, const std::byte* xq, int64_t blocks) {
  float acc = 0.0f;
  int8_t wq[kQBlock];
  const int wb = q4 ? kQ4Bytes : kQ8Bytes;
  for (int64_t b = 0; b < blocks; ++b) {
    const std::byte* wblk = w + b * wb;
    const std::byte* xblk = xq + b * kQ8Bytes;
    const float d = load_fp16(wblk) * load_fp16(xblk);  // exact: two fp16 significands fit in float
    const int8_t* wv;
    if (q4) {
      const auto* qs = reinterpret_cast<const uint8_t*>(wblk + 2);
      for (int j = 0; j < 16; ++j) {
        wq[j] = static_cast<int8_t>((qs[j] & 0x0F) - 8);
        wq[j + 16] = static_cast<int8_t>((qs[j] >> 4) - 8);
      }
      wv = wq;
    } else {
      wv = reinterpret_cast<const int8_t*>(wblk + 2);
    }
    acc = std::fma(static_cast<float>(block_dot(wv, reinterpret_cast<const int8_t*>(xblk + 2))), d, acc);
  }
  return acc;
}

}  // namespace

void dequantize_q8_0_row(const std::byte* row, int64_t cols, float* out) {
  for (int64_t b = 0; b < cols / kQBlock; ++b) {
    const std::byte* blk = row + b * kQ8Bytes;
    const float d = load_fp16(blk);
    const auto* qs = reinterpret_cast<const int8_t*>(blk + 2);
    for (int j = 0; j < kQBlock; ++j) out[b * kQBlock + j] = static_cast<float>(qs[j]) * d;
  }
}

void dequantize_q4_0_row(const std::byte* row, int64_t cols, float* out) {
  for (int64_t b = 0; b < cols / kQBlock; ++b) {
    const std::byte* blk = row + b * kQ4Bytes;
    const float d = load_fp16(blk);
    const auto* qs = reinterpret_cast<const uint8_t*>(blk + 2);
    for (int j = 0; j < 16; ++j) {
      out[b * kQBlock + j] = static_cast<float>((qs[j] & 0x0F) - 8) * d;
      out[b * kQBlock + j + 16] = static_cast<float>((qs[j] >> 4) - 8) * d;
    }
  }
}

void quantize_rows_q8_0(const float* x, int64_t n, int64_t in, std::byte* out) {
  const int64_t blocks = in / kQBlock;
  for (int64_t r = 0; r < n; ++r)
    for (int64_t b = 0; b < blocks; ++b) {
      const float* xb = x + r * in + b * kQBlock;
      std::byte* ob = out + (r * blocks + b) * kQ8Bytes;
      float amax = 0.0f;
      bool nan = false;
      for (int j = 0; j < kQBlock; ++j) {
        amax = std::max(amax, std::fabs(xb[j]));
        nan |= std::isnan(xb[j]);
      }
      // A non-finite activation (overflowed float32 arithmetic) is carried by
      // the block's scale (NaN, or inf for an infinite amax); converting it to
      // int8 would be undefined behaviour, so its quant is 0.
      const float d = nan ? std::numeric_limits<float>::quiet_NaN() : amax / 127.0f;
      const uint16_t h = f32_to_f16(d);
      std::memcpy(ob, &h, 2);
      const float id = amax != 0.0f ? 127.0f / amax : 0.0f;
      auto* qs = reinterpret_cast<int8_t*>(ob + 2);
      for (int j = 0; j < kQBlock; ++j) {
        const float v = xb[j] * id;
        qs[j] = std::isfinite(v) ? static_cast<int8_t>(std::nearbyint(v)) : int8_t{0};  // nearest, ties to even
      }
    }
}

void matmul_q8_reference(const std::byte* x_q, int64_t n, int64_t in, const std::byte* w, bool q4, int64_t out,
                         float* y, bool accumulate) {
  const int64_t blocks = in / kQBlock;
  const int64_t wrow = blocks * (q4 ? kQ4Bytes : kQ8Bytes);
  const int64_t work = n * in * out;
#pragma omp parallel for collapse(2) schedule(static) if (work > (1 << 18))
  for (int64_t r = 0; r < n; ++r)
    for (int64_t o = 0; o < out; ++o) {
      const float v = dot_row(w + o * wrow, q4, x_q + r * blocks * kQ8Bytes, blocks);
      if (accumulate)
        y[r * out + o] += v;
      else
        y[r * out + o] = v;
    }
}

// ---- AVX2 on the blocks as stored ----

bool q8_avx2_supported() {
  static const bool ok = dense_kernel_supported(DenseKernel::avx2);  // AVX2 + FMA + F16C
  return ok;
}

namespace {

/// Lane p of the result = the sum of v[p]'s eight int32 lanes (exact).
__attribute__((target("avx2"))) inline __m256i sum_lanes8(const __m256i* v) {
  const __m256i a = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
  const __m256i b = _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));
  // a = [partial sums of v0..v3 over lanes 0-3 | over lanes 4-7], b the same for v4..v7
  return _mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20), _mm256_permute2x128_si256(a, b, 0x31));
}

/// The 32 int8 weights of one block: Q8_0 as stored, Q4_0 unpacked to [-8, 7]
/// (low nibbles are weights 0-15, high nibbles 16-31).
template <bool Q4>
__attribute__((target("avx2"))) inline __m256i load_weights(const std::byte* blk) {
  if constexpr (Q4) {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 2));
    const __m256i nib = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), _mm256_set1_epi8(0x0F));
    return _mm256_sub_epi8(nib, _mm256_set1_epi8(8));
  } else {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2));
  }
}

/// Q8 AVX2 tile: activation rows [r0, r0+R) x weight rows [o0, o0+C), R * C == 8,
/// pair (r, c) in lane c * R + r. dx: the rows' scales as float, [blocks][R];
/// dw: the weight rows' scales, [blocks][C], or nullptr for C == 8 (decode: the
/// 8 rows' scales are read from their blocks in the loop, so the rows are
/// streamed once); dx and dw readable 8 floats past their last block.
/// `next`: weight rows to prefetch (the tile after next), or nullptr.
template <int R, int C, bool Q4>
__attribute__((target("avx2,fma,f16c"))) void q8_tile(const std::byte* x_q, int64_t r0, int64_t blocks, const std::byte* w,
                                                 int64_t wrow, int64_t o0, const float* dx, const float* dw,
                                                 const std::byte* next, float* y, int64_t out, bool accumulate) {
  static_assert(R * C == 8);
  constexpr int wb = Q4 ? kQ4Bytes : kQ8Bytes;
  const std::byte* xr[R];
  for (int r = 0; r < R; ++r) xr[r] = x_q + (r0 + r) * blocks * kQ8Bytes;
  const std::byte* wr[C];
  for (int c = 0; c < C; ++c) wr[c] = w + (o0 + c) * wrow;
  alignas(32) int32_t ir[8], ic[8];
  for (int p = 0; p < 8; ++p) {
    ir[p] = p % R;
    ic[p] = p / R;
  }
  const __m256i idx_r = _mm256_load_si256(reinterpret_cast<const __m256i*>(ir));
  const __m256i idx_c = _mm256_load_si256(reinterpret_cast<const __m256i*>(ic));
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    if (next != nullptr)
      for (int c = 0; c < C; ++c) _mm_prefetch(reinterpret_cast<const char*>(next + c * wrow + b * wb), _MM_HINT_T0);
    __m256i xv[R];
    for (int r = 0; r < R; ++r) xv[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr[r] + b * kQ8Bytes + 2));
    __m256i dots[8];
    for (int c = 0; c < C; ++c) {
      const __m256i wv = load_weights<Q4>(wr[c] + b * wb);
      const __m256i aw = _mm256_sign_epi8(wv, wv);  // |w| as u8 (-128 gives 128)
      for (int r = 0; r < R; ++r)
        dots[c * R + r] = _mm256_madd_epi16(_mm256_maddubs_epi16(aw, _mm256_sign_epi8(xv[r], wv)), ones);
    }
    const __m256 isum = _mm256_cvtepi32_ps(sum_lanes8(dots));  // exact: |isum| <= 32 * 127 * 128 < 2^24
    __m256 dwv;
    if constexpr (C == 8) {
      alignas(16) uint16_t h[8];
      for (int c = 0; c < 8; ++c) std::memcpy(&h[c], wr[c] + b * wb, 2);
      dwv = _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(h)));
    } else {
      dwv = _mm256_permutevar8x32_ps(_mm256_loadu_ps(dw + b * C), idx_c);
    }
    const __m256 d = _mm256_mul_ps(dwv, _mm256_permutevar8x32_ps(_mm256_loadu_ps(dx + b * R), idx_r));
    acc = _mm256_fmadd_ps(isum, d, acc);
  }
  alignas(32) float v[8];
  _mm256_store_ps(v, acc);
  for (int c = 0; c < C; ++c)
    for (int r = 0; r < R; ++r) {
      float& dst = y[(r0 + r) * out + o0 + c];
      dst = accumulate ? dst + v[c * R + r] : v[c * R + r];
    }
}

/// Block scales of `rows` rows of blocks starting at `p` (row stride `stride` bytes) as float (F16C, exact),
/// interleaved: dst[b * rows + i].
__attribute__((target("f16c"))) void scales_interleaved(const std::byte* p, int64_t stride, int rows, int64_t blocks,
                                                       int block_bytes, float* dst) {
  for (int i = 0; i < rows; ++i)
    for (int64_t b = 0; b < blocks; ++b) {
      uint16_t h;
      std::memcpy(&h, p + i * stride + b * block_bytes, 2);
      dst[b * rows + i] = _cvtsh_ss(h);
    }
}

template <bool Q4>
void matmul_q8_avx2_impl(const std::byte* x_q, int64_t n, int64_t in, const std::byte* w, int64_t out, float* y,
                         bool accumulate) {
  constexpr int wb = Q4 ? kQ4Bytes : kQ8Bytes;
  constexpr int64_t kRows = 4, kCols = 2, kDecodeCols = 8;
  const int64_t blocks = in / kQBlock, wrow = blocks * wb, xrow = blocks * kQ8Bytes;
  const int64_t row_tiles = n / kRows, rest = n - row_tiles * kRows;
  // The activation scales, per tile of 4 rows ([tile][block][4]) then per row left over ([row][block]),
  // 8 floats of padding for the kernels' 8-wide loads.
  std::vector<float> dx(static_cast<std::size_t>(n * blocks + 8));
  for (int64_t t = 0; t < row_tiles; ++t)
    scales_interleaved(x_q + t * kRows * xrow, xrow, kRows, blocks, kQ8Bytes, dx.data() + t * kRows * blocks);
  for (int64_t r = row_tiles * kRows; r < n; ++r)
    scales_interleaved(x_q + r * xrow, xrow, 1, blocks, kQ8Bytes, dx.data() + r * blocks);
  // Weight rows one tile at a time: pairs of rows for the 4-row tiles, groups of 8 for the rows left
  // over (all of decode); a weight row outside both (out not a multiple of 2 or 8) takes the reference.
  const int64_t pair_tiles = row_tiles > 0 ? out / kCols : 0;
  const int64_t oct_tiles = rest > 0 ? out / kDecodeCols : 0;
  const bool parallel = n * in * out > (int64_t{1} << 20);
#pragma omp parallel if (parallel)
  {
    std::vector<float> dw(static_cast<std::size_t>(blocks * kCols + 8));
#pragma omp for schedule(static) nowait
    for (int64_t t = 0; t < pair_tiles; ++t) {
      const int64_t o0 = t * kCols;
      scales_interleaved(w + o0 * wrow, wrow, kCols, blocks, wb, dw.data());
      for (int64_t rt = 0; rt < row_tiles; ++rt)
        q8_tile<4, 2, Q4>(x_q, rt * kRows, blocks, w, wrow, o0, dx.data() + rt * kRows * blocks, dw.data(), nullptr, y,
                          out, accumulate);
    }
#pragma omp for schedule(static) nowait
    for (int64_t t = 0; t < oct_tiles; ++t) {
      const int64_t o0 = t * kDecodeCols;
      const std::byte* next = t + 2 < oct_tiles ? w + (o0 + 2 * kDecodeCols) * wrow : nullptr;
      for (int64_t r = row_tiles * kRows; r < n; ++r)
        q8_tile<1, 8, Q4>(x_q, r, blocks, w, wrow, o0, dx.data() + r * blocks, nullptr, next, y, out, accumulate);
    }
  }
  // The weight rows no tile took, for the rows of each kind.
  for (int64_t r = 0; r < n; ++r) {
    const int64_t first = r < row_tiles * kRows ? pair_tiles * kCols : oct_tiles * kDecodeCols;
    for (int64_t o = first; o < out; ++o) {
      const float v = dot_row(w + o * wrow, Q4, x_q + r * xrow, blocks);
      float& dst = y[r * out + o];
      dst = accumulate ? dst + v : v;
    }
  }
}

}  // namespace

void matmul_q8_avx2(const std::byte* x_q, int64_t n, int64_t in, const std::byte* w, bool q4, int64_t out, float* y,
                    bool accumulate) {
  if (!q8_avx2_supported()) throw std::logic_error("matmul_q8_avx2: this CPU has no AVX2 + FMA + F16C");
  if (n <= 0 || out <= 0) return;
  if (q4)
    matmul_q8_avx2_impl<true>(x_q, n, in, w, out, y, accumulate);
  else
    matmul_q8_avx2_impl<false>(x_q, n, in, w, out, y, accumulate);
}

void matmul_q8(const std::byte* x_q, int64_t n, int64_t in, const std::byte* w, bool q4, int64_t out, float* y,
               bool accumulate) {
  if (dense_kernel() != DenseKernel::reference && q8_avx2_supported())
    matmul_q8_avx2(x_q, n, in, w, q4, out, y, accumulate);
  else
    matmul_q8_reference(x_q, n, in, w, q4, out, y, accumulate);
}

// ---- AVX-512 VNNI: 16 output rows per tile, weights repacked at load ----

bool packed_q8_supported() {
  static const bool ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
  return ok;
}

PackedQ8 pack_q8(const std::byte* w, bool q4, int64_t out, int64_t in) {
  PackedQ8 p;
  p.out = out;
  p.in = in;
  const int64_t blocks = in / kQBlock, tiles = (out + PackedQ8::kTile - 1) / PackedQ8::kTile;
  const int64_t wrow = blocks * (q4 ? kQ4Bytes : kQ8Bytes);
  p.data.assign(static_cast<std::size_t>(tiles * blocks * PackedQ8::kPackedBlockBytes), std::byte{0});
  int8_t q[kQBlock];
  for (int64_t t = 0; t < tiles; ++t)
    for (int64_t b = 0; b < blocks; ++b) {
      std::byte* dst = p.data.data() + (t * blocks + b) * PackedQ8::kPackedBlockBytes;
      auto* qs = reinterpret_cast<int8_t*>(dst);
      float d[PackedQ8::kTile] = {};
      int32_t sum[PackedQ8::kTile] = {};
      for (int r = 0; r < PackedQ8::kTile; ++r) {
        const int64_t o = t * PackedQ8::kTile + r;
        if (o >= out) break;  // padding rows stay zero
        const std::byte* blk = w + o * wrow + b * (q4 ? kQ4Bytes : kQ8Bytes);
        d[r] = load_fp16(blk);
        if (q4) {
          const auto* nib = reinterpret_cast<const uint8_t*>(blk + 2);
          for (int j = 0; j < 16; ++j) {
            q[j] = static_cast<int8_t>((nib[j] & 0x0F) - 8);
            q[j + 16] = static_cast<int8_t>((nib[j] >> 4) - 8);
          }
        } else {
          std::memcpy(q, blk + 2, kQBlock);
        }
        for (int g = 0; g < 8; ++g)
          for (int k = 0; k < 4; ++k) {
            qs[(g * PackedQ8::kTile + r) * 4 + k] = q[4 * g + k];
            sum[r] += q[4 * g + k];
          }
      }
      std::memcpy(dst + 512, d, sizeof d);
      std::memcpy(dst + 512 + 64, sum, sizeof sum);
    }
  return p;
}

namespace {

/// Rows [r0, r0+R) of x_q against tile t; acc[R][16] per (row, tile row), in
/// block order: acc = fma((float) isum, d_w * d_x, acc) — matmul_q8's arithmetic.
template <int R>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni"))) void tile_rows(const std::byte* x_q, int64_t r0,
                                                                               int64_t blocks, const std::byte* tile,
                                                                               float* y, int64_t out, int64_t o0,
                                                                               bool accumulate) {
  __m512 acc[R];
  for (int i = 0; i < R; ++i) acc[i] = _mm512_setzero_ps();
  const __m512i offset = _mm512_set1_epi32(128);
  for (int64_t b = 0; b < blocks; ++b) {
    const std::byte* pb = tile + b * PackedQ8::kPackedBlockBytes;
    const __m512 dw = _mm512_loadu_ps(reinterpret_cast<const float*>(pb + 512));
    const __m512i wsum = _mm512_mullo_epi32(_mm512_loadu_si512(pb + 512 + 64), offset);
    __m512i isum[R];
    for (int i = 0; i < R; ++i) isum[i] = _mm512_setzero_si512();
    for (int g = 0; g < 8; ++g) {
      const __m512i wv = _mm512_loadu_si512(pb + g * 64);
      for (int i = 0; i < R; ++i) {
        const std::byte* xb = x_q + ((r0 + i) * blocks + b) * kQ8Bytes + 2 + 4 * g;
        uint32_t quad;
        std::memcpy(&quad, xb, 4);
        const __m512i xu = _mm512_set1_epi32(static_cast<int32_t>(quad ^ 0x80808080u));  // x + 128 as u8
        isum[i] = _mm512_dpbusd_epi32(isum[i], xu, wv);
      }
    }
    for (int i = 0; i < R; ++i) {
      const float dx = load_fp16(x_q + ((r0 + i) * blocks + b) * kQ8Bytes);
      const __m512 dd = _mm512_mul_ps(dw, _mm512_set1_ps(dx));
      const __m512i exact = _mm512_sub_epi32(isum[i], wsum);  // sum (x+128) w - 128 sum w
      acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(exact), dd, acc[i]);
    }
  }
  const int valid = static_cast<int>(std::min<int64_t>(PackedQ8::kTile, out - o0));
  const __mmask16 m = static_cast<__mmask16>((1u << valid) - 1u);
  for (int i = 0; i < R; ++i) {
    float* yr = y + (r0 + i) * out + o0;
    __m512 v = acc[i];
    if (accumulate) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(m, yr));
    _mm512_mask_storeu_ps(yr, m, v);
  }
}

}  // namespace

void matmul_q8_packed(const std::byte* x_q, int64_t n, const PackedQ8& w, float* y, bool accumulate) {
  const int64_t blocks = w.in / kQBlock, tiles = (w.out + PackedQ8::kTile - 1) / PackedQ8::kTile;
  constexpr int64_t kR = 4;
  const int64_t row_groups = (n + kR - 1) / kR;
  const int64_t work = n * w.in * w.out;
#pragma omp parallel for collapse(2) schedule(static) if (work > (1 << 20))
  for (int64_t rg = 0; rg < row_groups; ++rg)
    for (int64_t t = 0; t < tiles; ++t) {
      const std::byte* tile = w.data.data() + t * blocks * PackedQ8::kPackedBlockBytes;
      const int64_t r0 = rg * kR, rows = std::min(kR, n - r0), o0 = t * PackedQ8::kTile;
      switch (rows) {
        case 4: tile_rows<4>(x_q, r0, blocks, tile, y, w.out, o0, accumulate); break;
        case 3: tile_rows<3>(x_q, r0, blocks, tile, y, w.out, o0, accumulate); break;
        case 2: tile_rows<2>(x_q, r0, blocks, tile, y, w.out, o0, accumulate); break;
        default: tile_rows<1>(x_q, r0, blocks, tile, y, w.out, o0, accumulate); break;
      }
    }
}

void add_bias(float* y, int64_t n, int64_t d, const float* bias) {
  for (int64_t r = 0; r < n; ++r)
#pragma omp simd
    for (int64_t j = 0; j < d; ++j) y[r * d + j] += bias[j];
}

}  // namespace posenc::detail
