// The quantized products: the packed AVX-512 VNNI kernel gives the scalar
// reference kernel's bits on awkward shapes, and the reference kernel is the
// exact block arithmetic (int8 dot products, fma over blocks in order).
#include <cmath>
#include <cstring>
#include <random>

#include <gtest/gtest.h>

#include "model/kernels.hpp"
#include "posenc/gguf.hpp"

using namespace posenc;
using namespace posenc::detail;

namespace {

std::vector<float> randn(std::size_t n, uint32_t seed, float scale) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

}  // namespace

TEST(KernelsQ8, ReferenceIsExactBlockArithmetic) {
  const int64_t out = 3, in = 64;
  const auto w = randn(static_cast<std::size_t>(out * in), 1, 0.1f), x = randn(static_cast<std::size_t>(in), 2, 1.0f);
  const auto wq = ggml_quantize(GgmlType::q8_0, w);
  std::vector<std::byte> xq(static_cast<std::size_t>(in / 32 * kQ8Bytes));
  quantize_rows_q8_0(x.data(), 1, in, xq.data());
  std::vector<float> y(out);
  matmul_q8(xq.data(), 1, in, wq.data(), false, out, y.data(), false);
  // By hand: per block, the int32 dot product times d_w * d_x, accumulated with fma.
  std::vector<float> wd(static_cast<std::size_t>(out * in)), xd(static_cast<std::size_t>(in));
  ggml_dequantize(GgmlType::q8_0, wq, wd);
  ggml_dequantize(GgmlType::q8_0, xq, xd);
  for (int64_t o = 0; o < out; ++o) {
    float acc = 0.0f;
    for (int64_t b = 0; b < in / 32; ++b) {
      int32_t isum = 0;
      const auto* qw = reinterpret_cast<const int8_t*>(wq.data() + (o * (in / 32) + b) * kQ8Bytes + 2);
      const auto* qx = reinterpret_cast<const int8_t*>(xq.data() + b * kQ8Bytes + 2);
      for (int j = 0; j < 32; ++j) isum += qw[j] * qx[j];
      // d_w * d_x from the dequantized values: x = d * q for any q != 0.
      float dw = 0, dx = 0;
      for (int j = 0; j < 32; ++j)
        if (qw[j] != 0) dw = wd[static_cast<std::size_t>(o * in + b * 32 + j)] / static_cast<float>(qw[j]);
      for (int j = 0; j < 32; ++j)
        if (qx[j] != 0) dx = xd[static_cast<std::size_t>(b * 32 + j)] / static_cast<float>(qx[j]);
      acc = std::fma(static_cast<float>(isum), dw * dx, acc);
    }
    EXPECT_EQ(y[static_cast<std::size_t>(o)], acc) << o;
  }
}

TEST(KernelsQ8, PackedKernelGivesTheReferenceBits) {
  if (!packed_q8_supported()) GTEST_SKIP() << "this CPU has no AVX-512 VNNI";
  for (bool q4 : {false, true})
    for (int64_t out : {1, 15, 16, 17, 48, 2048})
      for (int64_t in : {32, 128, 384})
        for (int64_t n : {1, 2, 3, 4, 5, 9}) {
          const auto w = randn(static_cast<std::size_t>(out * in), static_cast<uint32_t>(out * 7 + in), 0.05f);
          const auto wq = ggml_quantize(q4 ? GgmlType::q4_0 : GgmlType::q8_0, w);
          const auto x = randn(static_cast<std::size_t>(n * in), static_cast<uint32_t>(n + 99), 2.0f);
          std::vector<std::byte> xq(static_cast<std::size_t>(n * (in / 32) * kQ8Bytes));
          quantize_rows_q8_0(x.data(), n, in, xq.data());
          for (bool acc : {false, true}) {
            std::vector<float> a(static_cast<std::size_t>(n * out), 0.5f), b = a;
            matmul_q8(xq.data(), n, in, wq.data(), q4, out, a.data(), acc);
            const PackedQ8 p = pack_q8(wq.data(), q4, out, in);
            matmul_q8_packed(xq.data(), n, p, b.data(), acc);
            ASSERT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0)
                << "q4 " << q4 << " out " << out << " in " << in << " n " << n << " acc " << acc;
          }
        }
}

// Activation quantization as ggml-cpu's x86 quantize_row_q8_0: scale amax/127
// rounded to fp16, multiplier 127/amax (not 1/d), ties to even.
TEST(KernelsQ8, ActivationQuantizationRoundsTiesToEven) {
  std::vector<float> x(32, 0.0f);
  x[0] = 127.0f;  // amax = 127: d = 1, multiplier 1
  x[1] = 2.5f;    // tie: to even 2 (roundf would give 3)
  x[2] = -3.5f;   // tie: to even -4
  x[3] = 1.4999f;
  std::vector<std::byte> q(kQ8Bytes);
  quantize_rows_q8_0(x.data(), 1, 32, q.data());
  const auto* qs = reinterpret_cast<const int8_t*>(q.data() + 2);
  EXPECT_EQ(qs[0], 127);
  EXPECT_EQ(qs[1], 2);
  EXPECT_EQ(qs[2], -4);
  EXPECT_EQ(qs[3], 1);
  uint16_t h;
  std::memcpy(&h, q.data(), 2);
  EXPECT_EQ(h, 0x3C00);  // fp16 1.0
}
