// Quantized products (ggml's Q8_0 / Q4_0 block formats) with the arithmetic
// of llama.cpp's CPU backend; see kernels.hpp. Compiled with FMA contraction,
// but every rounding that matters is written out (std::fma, explicit casts).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include <immintrin.h>

#include "model/kernels.hpp"
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

void matmul_q8(const std::byte* x_q, int64_t n, int64_t in, const std::byte* w, bool q4, int64_t out, float* y,
               bool accumulate) {
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
