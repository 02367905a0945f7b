#include "model/kernels.hpp"

#include <algorithm>
#include <cmath>

namespace posenc::detail {

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
  // Element by element (glibc's expf each), so threads change no bit; a prefill's 256 x 4864 elements took 5% of a
  // forward on one core and 16% on two before they shared them.
#pragma omp parallel for simd schedule(static) if (count >= (int64_t{1} << 16))
  for (int64_t i = 0; i < count; ++i) {
    const float v = h1[i];
    h1[i] = v / (1.0f + std::exp(-v)) * h3[i];
  }
}

}  // namespace posenc::detail
