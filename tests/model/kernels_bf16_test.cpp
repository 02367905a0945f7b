// The AMX-BF16 products of F16/BF16 weights (bf16x3, bf16x6): the split into bf16 terms is exact, the kernel is
// within a stated bound of the exact sum of the kept products (and, for bf16x6, of the exact x w), on awkward
// shapes; a row's bits do not depend on the batch, its place in a tile or the thread count (so decode equals
// prefill); the SwiGLU epilogue gives the unfused bits.
#include <cmath>
#include <cstring>
#include <limits>
#include <random>

#include <omp.h>

#include <gtest/gtest.h>

#include "model/kernels.hpp"
#include "model/kernels_dense.hpp"
#include "posenc/float16.hpp"
#include "posenc/gguf.hpp"
#include "stored_matrix.hpp"

namespace POSENC_UNITY_ID {  // this file's own namespace in the tests' unity build (CMakeLists.txt)

using namespace posenc;
using namespace posenc::detail;
using posenc::test::randn;
using posenc::test::StoredMatrix;

namespace {

uint32_t bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

/// Rounding error of float32 sums of `adds` terms, relative to the sum of their magnitudes: the standard bound
/// of recursive summation, adds * 2^-24, doubled for AMX's accumulation (which is not IEEE add by add).
double sum_bound(int64_t adds) { return 2.0 * static_cast<double>(adds) * std::ldexp(1.0, -24); }

/// Float32 additions into one output: a product per k and kept term, padded to whole blocks of 32.
int64_t adds_of(Bf16Split s, WeightType t, int64_t in) {
  const int64_t terms = s == Bf16Split::x6 ? (t == WeightType::f16 ? 6 : 3) : (t == WeightType::f16 ? 3 : 2);
  return (in + 31) / 32 * 32 * terms;
}

#define SKIP_WITHOUT_AMX_BF16() \
  if (!amx_bf16_supported()) GTEST_SKIP() << "this CPU has no AMX-BF16 (or Linux refused the tile permission)"

}  // namespace

TEST(Bf16Split, TermsAreBf16AndSumExactlyToTheValue) {
  std::mt19937 rng(7);
  std::uniform_int_distribution<uint32_t> any;
  int checked = 0;
  for (int i = 0; i < 200000; ++i) {
    float x;
    const uint32_t u = any(rng);
    std::memcpy(&x, &u, 4);
    if (!std::isnormal(x) || std::fabs(x) < 1e-30f) continue;  // the terms of smaller x reach bf16's denormals
    float p[3];
    split_x_bf16(x, p);
    for (float t : p) ASSERT_EQ(bits(t) & 0xFFFFu, 0u) << x;
    ASSERT_EQ(static_cast<double>(p[0]) + p[1] + p[2], static_cast<double>(x)) << x;
    ASSERT_LE(std::fabs(p[1]), std::ldexp(std::fabs(x), -7)) << x;
    ASSERT_LE(std::fabs(p[2]), std::ldexp(std::fabs(x), -15)) << x;
    ++checked;
  }
  EXPECT_GT(checked, 100000);
  for (uint32_t h = 0; h < 0x7C00u; ++h) {  // every finite positive F16 value (the negative ones are its mirror)
    const float w = f16_to_f32(static_cast<uint16_t>(h));
    float p[2];
    split_w_bf16(w, p);
    ASSERT_EQ(bits(p[0]) & 0xFFFFu, 0u) << h;
    ASSERT_EQ(bits(p[1]) & 0xFFFFu, 0u) << h;
    ASSERT_EQ(p[0] + p[1], w) << h;  // exact: w's 11 significand bits in two bf16 terms
  }
}

TEST(Bf16Split, ReferenceOfX6IsTheExactProductSum) {
  // bf16x6 keeps every product of the terms: its reference is sum x w itself (in double).
  const StoredMatrix w(WeightType::f16, 5, 70, 3, 0.3f);
  const auto x = randn(3 * 70, 4, 2.0f);
  std::vector<double> ref(15);
  matmul_bf16_split_reference(Bf16Split::x6, x.data(), 3, w.m, ref.data());
  for (int64_t r = 0; r < 3; ++r)
    for (int64_t o = 0; o < 5; ++o) {
      double exact = 0.0;
      std::vector<float> row(70);
      w.m.row_to_f32(o, row.data());
      for (int64_t i = 0; i < 70; ++i) exact += static_cast<double>(x[r * 70 + i]) * row[i];
      EXPECT_NEAR(ref[r * 5 + o], exact, 1e-12 * std::fabs(exact) + 1e-300) << r << " " << o;
    }
}

TEST(Bf16Split, KernelIsWithinTheBoundOfItsProductsOnAwkwardShapes) {
  SKIP_WITHOUT_AMX_BF16();
  int cases = 0;
  double worst = 0.0;
  for (Bf16Split s : {Bf16Split::x3, Bf16Split::x6})
    for (WeightType t : {WeightType::f16, WeightType::bf16})
      for (int64_t n : {1, 3, 16, 17, 33, 40})
        for (int64_t out : {1, 15, 16, 33, 64})
          for (int64_t in : {1, 31, 32, 100, 1024}) {
            const StoredMatrix w(t, out, in, static_cast<uint32_t>(out * 131 + in), 0.2f);
            const auto x = randn(static_cast<std::size_t>(n * in), static_cast<uint32_t>(n * 7 + in), 3.0f);
            std::vector<float> y(static_cast<std::size_t>(n * out), std::numeric_limits<float>::quiet_NaN());
            std::vector<double> ref(y.size());
            matmul_bf16_split(s, x.data(), n, w.m, y.data(), false);
            matmul_bf16_split_reference(s, x.data(), n, w.m, ref.data());
            std::vector<float> wr(static_cast<std::size_t>(in));
            for (int64_t o = 0; o < out; ++o) {
              w.m.row_to_f32(o, wr.data());
              for (int64_t r = 0; r < n; ++r) {
                double mag = 0.0, exact = 0.0;
                for (int64_t i = 0; i < in; ++i) {
                  mag += std::fabs(static_cast<double>(x[r * in + i]) * wr[i]);
                  exact += static_cast<double>(x[r * in + i]) * wr[i];
                }
                const double got = y[r * out + o], err = std::fabs(got - ref[r * out + o]);
                ASSERT_LE(err, sum_bound(adds_of(s, t, in)) * mag)
                    << to_string(s) << " " << to_string(t) << " n " << n << " out " << out << " in " << in << " r "
                    << r << " o " << o << ": " << got << " vs " << ref[r * out + o];
                worst = std::max(worst, err / (std::ldexp(1.0, -24) * mag + 1e-300));
                // Against the exact product: bf16x6 drops nothing; bf16x3 drops x1 w1, x2 w0 and x2 w1, under
                // 2^-14, 2^-15 and 2^-22 of |x w|: 2^-13 in all.
                const double dropped = s == Bf16Split::x6 ? 0.0 : std::ldexp(1.0, -13);
                ASSERT_LE(std::fabs(got - exact), (sum_bound(adds_of(s, t, in)) + dropped) * mag)
                    << to_string(s) << " " << to_string(t) << " n " << n << " out " << out << " in " << in;
              }
            }
            ++cases;
          }
  EXPECT_EQ(cases, 2 * 2 * 6 * 5 * 5);
  std::printf("worst error: %.2f x 2^-24 x sum |x w|\n", worst);
}

TEST(Bf16Split, ARowsBitsDoNotDependOnTheBatchOrTheThreads) {
  SKIP_WITHOUT_AMX_BF16();
  for (Bf16Split s : {Bf16Split::x3, Bf16Split::x6})
    for (WeightType t : {WeightType::f16, WeightType::bf16})
    for (int64_t in : {int64_t{600}, int64_t{4900}}) {
      // 3 tiles (the last one short), 7 panel pairs (the last short); rows of 4900 weights take more than a block
      // of x tiles in L2, so the batch runs in super-chunks of k with its C tiles kept between them (rows alone
      // do not): the same bits either way.
      const int64_t n = 37, out = 200;
      const StoredMatrix w(t, out, in, 11);
      const auto x = randn(static_cast<std::size_t>(n * in), 12, 1.0f);
      std::vector<float> batch(static_cast<std::size_t>(n * out));
      omp_set_num_threads(2);
      matmul_bf16_split(s, x.data(), n, w.m, batch.data(), false);
      for (int threads : {1, 2}) {
        omp_set_num_threads(threads);
        std::vector<float> again(batch.size());
        matmul_bf16_split(s, x.data(), n, w.m, again.data(), false);
        EXPECT_EQ(std::memcmp(again.data(), batch.data(), batch.size() * 4), 0) << threads << " threads";
        for (int64_t r : {int64_t{0}, int64_t{5}, int64_t{16}, int64_t{36}}) {  // alone (decode), at 1 row
          std::vector<float> alone(static_cast<std::size_t>(out));
          matmul_bf16_split(s, x.data() + r * in, 1, w.m, alone.data(), false);
          EXPECT_EQ(std::memcmp(alone.data(), batch.data() + r * out, out * 4), 0)
              << to_string(s) << " " << to_string(t) << " in " << in << " row " << r << " alone, " << threads
              << " threads";
        }
        // Five rows: one tile of x, which takes the decode path.
        std::vector<float> five(static_cast<std::size_t>(5 * out));
        matmul_bf16_split(s, x.data() + 16 * in, 5, w.m, five.data(), false);
        EXPECT_EQ(std::memcmp(five.data(), batch.data() + 16 * out, five.size() * 4), 0)
            << to_string(s) << " " << to_string(t) << " rows 16..20 as a batch of five, " << threads << " threads";
        // In a shorter batch that puts it at another place of its tile.
        std::vector<float> shifted(static_cast<std::size_t>((n - 3) * out));
        matmul_bf16_split(s, x.data() + 3 * in, n - 3, w.m, shifted.data(), false);
        EXPECT_EQ(std::memcmp(shifted.data(), batch.data() + 3 * out, shifted.size() * 4), 0)
            << to_string(s) << " " << to_string(t) << " rows 3.. as a batch of their own";
      }
      omp_set_num_threads(omp_get_num_procs());
      // Accumulating adds the same values: y0 + (x W^T) in float32.
      auto acc = randn(batch.size(), 13, 1.0f);
      const auto y0 = acc;
      matmul_bf16_split(s, x.data(), n, w.m, acc.data(), true);
      for (std::size_t i = 0; i < acc.size(); ++i) ASSERT_EQ(bits(acc[i]), bits(y0[i] + batch[i])) << i;
    }
}

TEST(Bf16Split, SwigluEpilogueGivesTheUnfusedBits) {
  SKIP_WITHOUT_AMX_BF16();
  for (Bf16Split s : {Bf16Split::x3, Bf16Split::x6})
    for (int64_t n : {1, 17, 40}) {
      const int64_t out = 90, in = 64;
      const StoredMatrix w(WeightType::f16, out, in, 21);
      const auto x = randn(static_cast<std::size_t>(n * in), 22, 1.0f);
      auto gate = randn(static_cast<std::size_t>(n * out), 23, 4.0f);
      gate[0] = -100.0f;  // expf's range ends
      gate[1] = 100.0f;
      auto fused = gate, unfused = gate;
      std::vector<float> h3(gate.size());
      matmul_bf16_split(s, x.data(), n, w.m, h3.data(), false);
      swiglu_reference(unfused.data(), h3.data(), static_cast<int64_t>(h3.size()));
      matmul_bf16_split_swiglu(s, x.data(), n, w.m, fused.data());
      for (std::size_t i = 0; i < fused.size(); ++i)
        ASSERT_EQ(bits(fused[i]), bits(unfused[i])) << to_string(s) << " n " << n << " at " << i;
    }
}

TEST(Bf16Split, RowsOfNoWeightsGiveZero) {
  SKIP_WITHOUT_AMX_BF16();
  StoredMatrix w(WeightType::f16, 5, 32, 1);
  w.m.cols = 0;  // 5 outputs of empty sums (the tiles' blocking divided by the row's size)
  std::vector<float> y(10, 7.0f), x(1, 1.0f);
  matmul_bf16_split(Bf16Split::x6, x.data(), 2, w.m, y.data(), false);
  for (float v : y) EXPECT_EQ(v, 0.0f);
  std::vector<float> acc(10, 7.0f);
  matmul_bf16_split(Bf16Split::x3, x.data(), 2, w.m, acc.data(), true);
  for (float v : acc) EXPECT_EQ(v, 7.0f);
}

TEST(Bf16Split, OtherWeightTypesAreRefused) {
  SKIP_WITHOUT_AMX_BF16();
  const StoredMatrix w(WeightType::f32, 4, 32, 1);
  const auto x = randn(32, 2, 1.0f);
  std::vector<float> y(4);
  EXPECT_THROW(matmul_bf16_split(Bf16Split::x6, x.data(), 1, w.m, y.data(), false), std::logic_error);
}

}  // namespace POSENC_UNITY_ID
