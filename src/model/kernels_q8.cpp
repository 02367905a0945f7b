// Quantized products (ggml's Q8_0 / Q4_0 block formats) with the arithmetic
// of llama.cpp's CPU backend; see kernels.hpp. Compiled with FMA contraction,
// but every rounding that matters is written out (std::fma, explicit casts).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

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

void add_bias(float* y, int64_t n, int64_t d, const float* bias) {
  for (int64_t r = 0; r < n; ++r)
#pragma omp simd
    for (int64_t j = 0; j < d; ++j) y[r * d + j] += bias[j];
}

}  // namespace posenc::detail
