// Internal dense kernels of the model runtime (compiled with FMA contraction).
#pragma once

#include <cstdint>

namespace posenc::detail {

/// y[n, out] = x[n, in] · wt[in, out] (wt is the weight matrix transposed, row-major).
/// Parallel over row blocks when the product is large enough.
void matmul_t(const float* x, int64_t n, int in, const float* wt, int out, float* y);

/// y[n, out] += x[n, in] · wt[in, out].
void matmul_t_acc(const float* x, int64_t n, int in, const float* wt, int out, float* y);

/// out[r, :] = weight * x[r, :] / sqrt(mean(x[r, :]^2) + eps), for n rows of size d.
void rmsnorm(const float* x, const float* weight, int64_t n, int d, float eps, float* out);

/// h1 = silu(h1) * h3 elementwise (SwiGLU), count elements.
void swiglu(float* h1, const float* h3, int64_t count);

}  // namespace posenc::detail
