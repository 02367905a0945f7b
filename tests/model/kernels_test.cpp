// The float32 operations around the matrix products (src/model/kernels.cpp): SwiGLU's AVX-512 path gives the bits of
// h / (1 + std::exp(-h)) * g element by element, over a dense sweep of expf's main range, random activations, the
// inputs where glibc leaves its main path (|x| >= 88, inf, NaN) and odd lengths, on one thread and two.
#include <omp.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include <gtest/gtest.h>

#include "model/kernels.hpp"

namespace POSENC_UNITY_ID {  // this file's own namespace in the tests' unity build (CMakeLists.txt)

using namespace posenc::detail;

namespace {

/// Equal bits, or both NaN.
bool same(float a, float b) { return (std::isnan(a) && std::isnan(b)) || std::bit_cast<uint32_t>(a) == std::bit_cast<uint32_t>(b); }

::testing::AssertionResult swiglu_equals_reference(std::vector<float> h, const std::vector<float>& g) {
  std::vector<float> ref = h;
  swiglu_reference(ref.data(), g.data(), static_cast<int64_t>(ref.size()));
  swiglu(h.data(), g.data(), static_cast<int64_t>(h.size()));
  for (std::size_t i = 0; i < h.size(); ++i)
    if (!same(h[i], ref[i]))
      return ::testing::AssertionFailure() << "element " << i << " of " << h.size() << ": " << h[i] << " vs " << ref[i];
  return ::testing::AssertionSuccess();
}

}  // namespace

TEST(KernelsSwiglu, GivesStdExpsBitsEverywhere) {
  if (!swiglu_uses_avx512()) GTEST_SKIP() << "swiglu runs std::exp itself here (no AVX-512, or a libm whose expf differs)";
  // Every float in [-90, 90] at a step of 2^-11 near 0 growing to 2^-3 (x = k * 2^-11 for |x| < 1, then every
  // 2^17-th bit pattern): exp(-h) takes them all; g = 1 so the product keeps the quotient's bits.
  std::vector<float> h;
  for (int k = -2048; k <= 2048; ++k) h.push_back(static_cast<float>(k) / 2048.0f);
  for (uint32_t b = 0x3f800000u; b < 0x42b80000u; b += 1u << 9) {
    h.push_back(std::bit_cast<float>(b));
    h.push_back(-std::bit_cast<float>(b));
  }
  EXPECT_TRUE(swiglu_equals_reference(h, std::vector<float>(h.size(), 1.0f)));
  // Random activations and gates, the special inputs, and a length that leaves a tail of 5.
  std::mt19937 rng(3);
  std::normal_distribution<float> d(0.0f, 4.0f);
  std::vector<float> a(200005), g(a.size());
  for (auto& v : a) v = d(rng);
  for (auto& v : g) v = d(rng);
  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  const float specials[] = {88.0f, -88.0f, 88.72f, -88.73f, 103.5f, -103.5f, 104.0f, -104.0f, 1e30f, -1e30f,
                            inf,   -inf,   nan,    -nan,    0.0f,   -0.0f,   1e-40f, -1e-40f, 87.99f, -87.99f};
  for (std::size_t i = 0; i < std::size(specials); ++i) a[100 + 7 * i] = specials[i];
  const int threads = omp_get_max_threads();
  for (int t : {1, 2}) {
    omp_set_num_threads(t);
    EXPECT_TRUE(swiglu_equals_reference(a, g)) << t << " threads";
    EXPECT_TRUE(swiglu_equals_reference(std::vector<float>(a.begin(), a.begin() + 13), std::vector<float>(g.begin(), g.begin() + 13)));
  }
  omp_set_num_threads(threads);
}

// glibc 2.28 and later (the expf of ARM's optimized-routines, whose constants posenc carries) on a CPU with AVX-512
// and FMA: the first-use check must accept the 8-lane expf, so that the test above runs rather than skips.
TEST(KernelsSwiglu, VectorExpfIsTakenWithGlibcOnAvx512) {
#if defined(__GLIBC__) && (__GLIBC__ > 2 || (__GLIBC__ == 2 && __GLIBC_MINOR__ >= 28))
  __builtin_cpu_init();
  if (!__builtin_cpu_supports("avx512f") || !__builtin_cpu_supports("avx512dq") || !__builtin_cpu_supports("fma"))
    GTEST_SKIP() << "no AVX-512 / FMA here";
  EXPECT_TRUE(swiglu_uses_avx512()) << "the 8-lane expf differs from this glibc's expf";
#else
  GTEST_SKIP() << "not glibc 2.28+";
#endif
}

// rmsnorm is llama.cpp's ggml_compute_forward_rms_norm_f32 (float32 squares summed in double, in order; the float
// mean; x * (1 / sqrt(mean + eps)) then * weight): the rows that rmsnorm interleaves (8 at a time) and splits
// among threads each give that formula's bits, written out here one row at a time, for every row count around the
// groups of 8 and lengths that are no multiple of any vector. (Squares in double, or x * (inv * weight), fail it;
// the double sum's order hardly can: its rounding is 2^29 times finer than the float mean's.)
TEST(KernelsRmsnorm, EachRowIsGgmlsOrderedDoubleSumBitForBit) {
  std::mt19937 rng(11);
  std::normal_distribution<float> dist(0.0f, 3.0f);
  std::uniform_int_distribution<int> scale_exp(-20, 20);
  const int threads = omp_get_max_threads();
  for (int t : {1, 2})
    for (const int d : {1, 5, 64, 288, 1023, 1024})
      for (const int64_t n : {1, 3, 7, 8, 9, 16, 17, 70, 300}) {
        omp_set_num_threads(t);
        std::vector<float> x(static_cast<std::size_t>(n * d)), w(static_cast<std::size_t>(d)), out(x.size());
        // Magnitudes over 2^-20..2^20, so that the squares' double sum rounds, and rounds differently in another
        // order (the squares of one scale would sum exactly in any order).
        for (auto& v : x) v = std::ldexp(dist(rng), scale_exp(rng));
        for (auto& v : w) v = dist(rng);
        x[static_cast<std::size_t>(n * d / 2)] = 1e-20f;  // a square under float32's normal range
        const float eps = 1e-5f;
        rmsnorm(x.data(), w.data(), n, d, eps, out.data());
        for (int64_t r = 0; r < n; ++r) {
          double sum = 0.0;
          for (int j = 0; j < d; ++j) sum += static_cast<double>(x[r * d + j] * x[r * d + j]);
          const float scale = 1.0f / std::sqrt(static_cast<float>(sum / d) + eps);
          for (int j = 0; j < d; ++j) {
            const float ref = (x[r * d + j] * scale) * w[j];
            ASSERT_TRUE(same(out[r * d + j], ref))
                << "n " << n << " d " << d << " threads " << t << " row " << r << " col " << j << ": "
                << out[r * d + j] << " vs " << ref;
          }
        }
      }
  omp_set_num_threads(threads);
}

}  // namespace POSENC_UNITY_ID
