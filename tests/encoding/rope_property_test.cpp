// Algebraic properties of RoPE and sinusoidal encodings that a correct
// implementation cannot violate (and a wrong layout, angle or sign would).
#include <cmath>
#include <iostream>
#include <random>
#include <vector>

#include <gtest/gtest.h>

#include "posenc/absolute.hpp"
#include "posenc/rope.hpp"

namespace POSENC_UNITY_ID {  // this file's own namespace in the tests' unity build (CMakeLists.txt)

using namespace posenc;

namespace {

std::vector<float> randn(std::size_t n, std::mt19937& rng) {
  std::normal_distribution<float> nd;
  std::vector<float> v(n);
  for (auto& x : v) x = nd(rng);
  return v;
}

std::vector<float> rotated(const std::vector<float>& x, const RopeFrequencies& f, int64_t pos,
                           RopeLayout layout, AnglePrecision precision) {
  std::vector<float> y = x;
  const int64_t p[1] = {pos};
  apply_rope(y.data(), 1, 1, f, p, layout, precision);
  return y;
}

double dot(const std::vector<float>& a, const std::vector<float>& b) {
  double s = 0;
  for (std::size_t i = 0; i < a.size(); ++i) s += static_cast<double>(a[i]) * b[i];
  return s;
}

double norm(const std::vector<float>& a) { return std::sqrt(dot(a, a)); }

// Worst |q·k(m+o, n+o) - q·k(m, n)| / (|q| |k|) over random q, k, m, n, o.
double worst_shift_error(AnglePrecision precision, RopeLayout layout, int64_t max_offset,
                         int64_t min_offset, int trials, uint32_t seed) {
  const RopeFrequencies f = default_rope_frequencies(128, 128, 10000.0);
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int64_t> pos(0, 4095), off(min_offset, max_offset);
  double worst = 0;
  for (int t = 0; t < trials; ++t) {
    const auto q = randn(128, rng), k = randn(128, rng);
    const int64_t m = pos(rng), n = pos(rng), o = off(rng);
    const double base = dot(rotated(q, f, m, layout, precision), rotated(k, f, n, layout, precision));
    const double shifted =
        dot(rotated(q, f, m + o, layout, precision), rotated(k, f, n + o, layout, precision));
    worst = std::max(worst, std::fabs(shifted - base) / (norm(q) * norm(k)));
  }
  return worst;
}

}  // namespace

// RoPE's defining property (Su et al. 2021, eq. 16): q·k depends only on m - n.
// Measured relative to |q||k| (q·k itself can be ~0).
TEST(RopeProperty, DotProductDependsOnlyOnRelativePositionExactMode) {
  for (auto layout : {RopeLayout::half, RopeLayout::interleaved}) {
    const double worst = worst_shift_error(AnglePrecision::exact, layout, 1'000'000, 0, 200, 11);
    EXPECT_LT(worst, 1e-5) << to_string(layout);
    std::cout << "[shift invariance, exact, " << to_string(layout) << "] worst relative error " << worst << "\n";
  }
}

// Documented expectation: with float32 angles (what the reference and the
// models do) shift invariance breaks down at offsets ~1e6, because
// position * inv_freq is rounded to a float32 whose ulp there is 1/16-1/32 rad.
TEST(RopeProperty, Float32AnglesLoseShiftInvarianceNearOneMillion) {
  const double worst =
      worst_shift_error(AnglePrecision::float32, RopeLayout::half, 1'000'000, 900'000, 50, 12);
  EXPECT_GT(worst, 1e-3);
  std::cout << "[shift invariance, float32, offsets 9e5..1e6] worst relative error " << worst << "\n";
  // ... while small offsets are fine in float32 too.
  EXPECT_LT(worst_shift_error(AnglePrecision::float32, RopeLayout::half, 64, 0, 50, 13), 1e-5);
}

TEST(RopeProperty, RotationPreservesNorm) {
  std::mt19937 rng(3);
  for (auto precision : {AnglePrecision::float32, AnglePrecision::exact})
    for (auto layout : {RopeLayout::half, RopeLayout::interleaved})
      for (int rotary : {128, 64}) {
        const RopeFrequencies f = default_rope_frequencies(128, rotary, 500000.0);
        for (int64_t pos : {int64_t{0}, int64_t{1}, int64_t{77}, int64_t{4096}, int64_t{123457}, int64_t{1} << 24}) {
          const auto x = randn(128, rng);
          const auto y = rotated(x, f, pos, layout, precision);
          EXPECT_NEAR(norm(y), norm(x), 1e-6 * norm(x))
              << to_string(layout) << " " << to_string(precision) << " pos " << pos;
        }
      }
}

// R(a) R(b) = R(a + b) (ggml test-rope's composition property, which makes
// re-rotating cached keys by a shift valid).
TEST(RopeProperty, RotationsCompose) {
  std::mt19937 rng(5);
  std::uniform_int_distribution<int64_t> pos(-100000, 100000);
  for (auto layout : {RopeLayout::half, RopeLayout::interleaved}) {
    const RopeFrequencies f = default_rope_frequencies(64, 48, 10000.0);
    for (int t = 0; t < 50; ++t) {
      const auto x = randn(64, rng);
      const int64_t a = pos(rng), b = pos(rng);
      const auto ab = rotated(rotated(x, f, a, layout, AnglePrecision::exact), f, b, layout, AnglePrecision::exact);
      const auto direct = rotated(x, f, a + b, layout, AnglePrecision::exact);
      for (std::size_t i = 0; i < x.size(); ++i)
        ASSERT_NEAR(ab[i], direct[i], 2e-6 * (1 + std::fabs(direct[i])))
            << to_string(layout) << " a=" << a << " b=" << b << " channel " << i;
      // and the inverse rotation by b undoes it
      std::vector<float> back = ab;
      const int64_t pb[1] = {b};
      apply_rope(back.data(), 1, 1, f, pb, layout, AnglePrecision::exact, RopeDirection::inverse);
      const auto ra = rotated(x, f, a, layout, AnglePrecision::exact);
      for (std::size_t i = 0; i < x.size(); ++i) ASSERT_NEAR(back[i], ra[i], 2e-6 * (1 + std::fabs(ra[i])));
    }
  }
}

// Vaswani et al. §3.5: for every offset k there is a linear map M_k,
// independent of pos, with PE(pos + k) = M_k PE(pos). For the (sin, cos) pair
// of frequency w: [sin w(p+k), cos w(p+k)] = [[cos wk, sin wk], [-sin wk, cos wk]] [sin wp, cos wp].
TEST(SinusoidalProperty, OffsetIsAFixedLinearMap) {
  const int dim = 64;
  const int64_t n = 1200;
  for (auto layout : {SinusoidalLayout::interleaved, SinusoidalLayout::halves}) {
    const std::vector<float> pe = sinusoidal_table(n, dim, layout);
    for (int64_t k : {1, 7, 100}) {
      // M_k as a dense [dim, dim] matrix, block diagonal on (sin, cos) pairs.
      std::vector<double> M(static_cast<std::size_t>(dim * dim), 0.0);
      for (int i = 0; i < dim / 2; ++i) {
        const double w = 1.0 / std::pow(10000.0, 2.0 * i / dim);
        const int s = layout == SinusoidalLayout::interleaved ? 2 * i : i;            // sin column
        const int c = layout == SinusoidalLayout::interleaved ? 2 * i + 1 : dim / 2 + i;  // cos column
        M[static_cast<std::size_t>(s * dim + s)] = std::cos(w * k);
        M[static_cast<std::size_t>(s * dim + c)] = std::sin(w * k);
        M[static_cast<std::size_t>(c * dim + s)] = -std::sin(w * k);
        M[static_cast<std::size_t>(c * dim + c)] = std::cos(w * k);
      }
      for (int64_t p = 0; p + k < n; p += 3) {
        for (int r = 0; r < dim; ++r) {
          double v = 0;
          for (int j = 0; j < dim; ++j)
            v += M[static_cast<std::size_t>(r * dim + j)] * pe[static_cast<std::size_t>(p * dim + j)];
          ASSERT_NEAR(v, pe[static_cast<std::size_t>((p + k) * dim + r)], 1e-6)
              << to_string(layout) << " k=" << k << " pos=" << p << " column " << r;
        }
      }
    }
  }
}

}  // namespace POSENC_UNITY_ID
