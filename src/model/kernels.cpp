#include "model/kernels.hpp"

#include <algorithm>
#include <cmath>

namespace posenc::detail {

namespace {

constexpr int kRows = 4;    // rows of x per micro-kernel
constexpr int kCols = 64;   // output columns per micro-kernel (4 AVX-512 vectors)

/// R rows (1..kRows) x kCols columns with the accumulators in registers.
template <bool Acc, int R>
inline void micro_full(const float* x, int in, const float* wt, int out, int c0, float* y) {
  float acc[R][kCols];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < kCols; ++c) acc[r][c] = 0.0f;
  for (int i = 0; i < in; ++i) {
    const float* w = wt + static_cast<int64_t>(i) * out + c0;
    for (int r = 0; r < R; ++r) {
      const float xv = x[r * static_cast<int64_t>(in) + i];
#pragma omp simd
      for (int c = 0; c < kCols; ++c) acc[r][c] += xv * w[c];
    }
  }
  for (int r = 0; r < R; ++r) {
    float* yr = y + static_cast<int64_t>(r) * out + c0;
    for (int c = 0; c < kCols; ++c) {
      if constexpr (Acc)
        yr[c] += acc[r][c];
      else
        yr[c] = acc[r][c];
    }
  }
}

template <bool Acc>
inline void micro(const float* x, int64_t rows, int in, const float* wt, int out, int c0, int cw,
                  float* y) {
  if (cw == kCols) {
    switch (rows) {
      case 4: micro_full<Acc, 4>(x, in, wt, out, c0, y); return;
      case 3: micro_full<Acc, 3>(x, in, wt, out, c0, y); return;
      case 2: micro_full<Acc, 2>(x, in, wt, out, c0, y); return;
      case 1: micro_full<Acc, 1>(x, in, wt, out, c0, y); return;
      default: break;
    }
  }
  float acc[kRows][kCols];
  for (int r = 0; r < kRows; ++r)
    for (int c = 0; c < kCols; ++c) acc[r][c] = 0.0f;
  for (int i = 0; i < in; ++i) {
    const float* w = wt + static_cast<int64_t>(i) * out + c0;
    for (int64_t r = 0; r < rows; ++r) {
      const float xv = x[r * in + i];
#pragma omp simd
      for (int c = 0; c < cw; ++c) acc[r][c] += xv * w[c];
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    float* yr = y + r * out + c0;
    for (int c = 0; c < cw; ++c) {
      if constexpr (Acc)
        yr[c] += acc[r][c];
      else
        yr[c] = acc[r][c];
    }
  }
}

template <bool Acc>
void matmul_impl(const float* x, int64_t n, int in, const float* wt, int out, float* y) {
  const int64_t row_blocks = (n + kRows - 1) / kRows;
  const int col_blocks = (out + kCols - 1) / kCols;
  const int64_t work = n * static_cast<int64_t>(in) * out;
  // Threads only for products of more than 2M multiply-adds (~0.3 ms on one core): below that a parallel region's
  // barrier costs more than it saves, and on a shared machine a descheduled thread makes each barrier cost a time
  // slice (a re-prefill of 150 stories260K tokens, 35 regions each, went from 0.5 s to 36 s under a parallel ctest).
#pragma omp parallel for collapse(2) schedule(static) if (work > (1 << 21))
  for (int64_t rb = 0; rb < row_blocks; ++rb) {
    for (int cb = 0; cb < col_blocks; ++cb) {
      const int64_t r0 = rb * kRows;
      const int64_t rows = std::min<int64_t>(kRows, n - r0);
      const int c0 = cb * kCols;
      const int cw = std::min(kCols, out - c0);
      micro<Acc>(x + r0 * in, rows, in, wt, out, c0, cw, y + r0 * out);
    }
  }
}

}  // namespace

void matmul_t(const float* x, int64_t n, int in, const float* wt, int out, float* y) {
  matmul_impl<false>(x, n, in, wt, out, y);
}

void matmul_t_acc(const float* x, int64_t n, int in, const float* wt, int out, float* y) {
  matmul_impl<true>(x, n, in, wt, out, y);
}

void rmsnorm(const float* x, const float* weight, int64_t n, int d, float eps, float* out) {
  for (int64_t r = 0; r < n; ++r) {
    const float* xr = x + r * d;
    float* o = out + r * d;
    // The sum of squares in double, as llama.cpp's ggml_compute_forward_rms_norm_f32
    // (float32 squares, double sum, float mean). The float32 alternatives
    // (HF's, llama2.c's) differ from it in the last bit, and with Q8_0
    // activations a last-bit difference before the first quantization
    // (frequent exact ties) costs ~3e-3 nats of agreement with llama.cpp.
    double sum = 0.0;
    for (int j = 0; j < d; ++j) sum += static_cast<double>(xr[j] * xr[j]);
    const float mean = static_cast<float>(sum / d);
    const float inv = 1.0f / std::sqrt(mean + eps);
    for (int j = 0; j < d; ++j) o[j] = (xr[j] * inv) * weight[j];
  }
}

void swiglu(float* h1, const float* h3, int64_t count) {
#pragma omp simd
  for (int64_t i = 0; i < count; ++i) {
    const float v = h1[i];
    h1[i] = v / (1.0f + std::exp(-v)) * h3[i];
  }
}

}  // namespace posenc::detail
