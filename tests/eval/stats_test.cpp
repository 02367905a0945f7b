// Wilson intervals against published values, edge cases, effective context.
#include <gtest/gtest.h>

#include "posenc/error.hpp"
#include "posenc/stats.hpp"

namespace POSENC_UNITY_ID {  // this file's own namespace in the tests' unity build (CMakeLists.txt)

using posenc::effective_context;
using posenc::LengthAccuracy;
using posenc::wilson_interval;

// R. G. Newcombe, "Two-sided confidence intervals for the single proportion:
// comparison of seven methods", Statistics in Medicine 17 (1998) 857-872,
// Table II, method 3 (Wilson score interval without continuity correction),
// reported to 4 decimals.
TEST(Wilson, NewcombeTableExamples) {
  struct Case {
    int64_t k, n;
    double lo, hi;
  };
  for (const Case& c : {Case{81, 263, 0.2553, 0.3662}, Case{15, 148, 0.0624, 0.1605}, Case{0, 20, 0.0, 0.1611},
                        Case{1, 29, 0.0061, 0.1718}}) {
    const auto ci = wilson_interval(c.k, c.n);
    EXPECT_NEAR(ci.low, c.lo, 0.5e-4) << c.k << "/" << c.n;
    EXPECT_NEAR(ci.high, c.hi, 0.5e-4) << c.k << "/" << c.n;
  }
}

TEST(Wilson, EdgesAndSymmetry) {
  // 0/n: low exactly 0, high = z^2 / (n + z^2) (the closed form at p = 0).
  const double z = posenc::kZ95;
  for (int64_t n : {1, 5, 20, 50, 1000}) {
    const auto a = wilson_interval(0, n);
    EXPECT_EQ(a.low, 0.0);
    EXPECT_NEAR(a.high, z * z / (static_cast<double>(n) + z * z), 1e-12);
    const auto b = wilson_interval(n, n);
    EXPECT_EQ(b.high, 1.0);
    EXPECT_NEAR(b.low, static_cast<double>(n) / (static_cast<double>(n) + z * z), 1e-12);
  }
  // k/n and (n-k)/n mirror each other; the interval holds p and is inside [0, 1].
  for (int64_t n : {7, 50, 263})
    for (int64_t k = 0; k <= n; ++k) {
      const auto a = wilson_interval(k, n), b = wilson_interval(n - k, n);
      EXPECT_NEAR(a.low, 1.0 - b.high, 1e-12);
      EXPECT_NEAR(a.high, 1.0 - b.low, 1e-12);
      const double p = static_cast<double>(k) / static_cast<double>(n);
      EXPECT_LE(a.low, p);
      EXPECT_GE(a.high, p);
      EXPECT_GE(a.low, 0.0);
      EXPECT_LE(a.high, 1.0);
    }
  // Half-way: 25/50 is centred on 0.5.
  const auto h = wilson_interval(25, 50);
  EXPECT_NEAR(h.low + h.high, 1.0, 1e-12);
  EXPECT_NEAR(h.low, 0.366445, 1e-6);
  // No data: uninformative.
  const auto e = wilson_interval(0, 0);
  EXPECT_EQ(e.low, 0.0);
  EXPECT_EQ(e.high, 1.0);
}

TEST(Wilson, RejectsBadArguments) {
  EXPECT_THROW(wilson_interval(-1, 5), posenc::InvalidArgument);
  EXPECT_THROW(wilson_interval(6, 5), posenc::InvalidArgument);
  EXPECT_THROW(wilson_interval(0, -1), posenc::InvalidArgument);
  EXPECT_THROW(wilson_interval(1, 5, 0.0), posenc::InvalidArgument);
}

TEST(EffectiveContext, StaysAboveRelativeThreshold) {
  const std::vector<LengthAccuracy> a{{256, 0.90, 100, 90}, {512, 0.80, 100, 80}, {1024, 0.70, 100, 70}, {2048, 0.85, 100, 85}};
  const auto e = effective_context(a, 0.85, 0.25);
  EXPECT_TRUE(e.solvable);
  EXPECT_DOUBLE_EQ(e.baseline, 0.90);
  EXPECT_DOUBLE_EQ(e.threshold, 0.85 * 0.90);
  ASSERT_TRUE(e.length.has_value());
  EXPECT_EQ(*e.length, 512);  // 1024 falls below 0.765; 2048 recovering does not count ("stays")
}

TEST(EffectiveContext, NotSolvableIsNotALengthFailure) {
  // 4-way choice, 30% of 250 at the shortest length: the Wilson lower bound
  // (0.247) does not clear chance (0.25), so no effective length is claimed.
  const std::vector<LengthAccuracy> a{{256, 0.30, 250, 75}, {512, 0.29, 250, 72}};
  auto e = effective_context(a, 0.85, 0.25);
  EXPECT_FALSE(e.solvable);
  EXPECT_FALSE(e.length.has_value());
  EXPECT_NEAR(e.baseline_ci.low, 0.2470, 1e-3);
  // The same rate on more samples is significantly above chance.
  const std::vector<LengthAccuracy> b{{256, 0.30, 1000, 300}, {512, 0.29, 1000, 290}};
  e = effective_context(b, 0.85, 0.25);
  EXPECT_TRUE(e.solvable);
  EXPECT_EQ(e.length, 512);
  // An explicit minimum baseline can still refuse it; generation (chance 0)
  // with zero successes is never solvable.
  EXPECT_FALSE(effective_context(b, 0.85, 0.25, 0.5).solvable);
  const std::vector<LengthAccuracy> zero{{256, 0.0, 50, 0}};
  EXPECT_FALSE(effective_context(zero, 0.85, 0.0).solvable);
  EXPECT_THROW(effective_context(std::vector<LengthAccuracy>{}, 0.85, 0.25), posenc::InvalidArgument);
  const std::vector<LengthAccuracy> unsorted{{512, 0.9, 10, 9}, {256, 0.9, 10, 9}};
  EXPECT_THROW(effective_context(unsorted, 0.85, 0.25), posenc::InvalidArgument);
  const std::vector<LengthAccuracy> empty_baseline{{256, 0.0, 0, 0}};
  EXPECT_THROW(effective_context(empty_baseline, 0.85, 0.25), posenc::InvalidArgument);
}

}  // namespace POSENC_UNITY_ID
