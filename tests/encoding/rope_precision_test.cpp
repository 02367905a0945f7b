// Angle precision: AnglePrecision::exact keeps cos/sin within 1e-6 of a
// long-double reference up to position 2^24; float32 angles (the reference
// implementations' numerics) do not, and at position 1e6 the two modes differ
// by ~1e-2 in cos (README "Precision").
#include <cmath>
#include <random>
#include <vector>

#include <gtest/gtest.h>

#include "posenc/rope.hpp"

namespace POSENC_UNITY_ID {  // this file's own namespace in the tests' unity build (CMakeLists.txt)

using namespace posenc;

namespace {

struct Errors {
  double exact = 0, float32 = 0;
};

// Max |cos - ref| and |sin - ref| over all channels of the given positions,
// ref = cosl/sinl of (long double)position * inv_freq (the same float32
// inv_freq, so only the angle/cos evaluation is measured).
Errors max_errors(const RopeFrequencies& f, const std::vector<int64_t>& positions) {
  const RopeTable ex(f, positions, AnglePrecision::exact);
  const RopeTable fl(f, positions, AnglePrecision::float32);
  Errors e;
  for (std::size_t t = 0; t < positions.size(); ++t)
    for (int i = 0; i < f.n_pairs(); ++i) {
      const long double angle = static_cast<long double>(positions[t]) * f.inv_freq[static_cast<std::size_t>(i)];
      const long double c = std::cos(angle), s = std::sin(angle);
      e.exact = std::max({e.exact, static_cast<double>(std::fabs(ex.cos_row(static_cast<int64_t>(t))[i] - c)),
                          static_cast<double>(std::fabs(ex.sin_row(static_cast<int64_t>(t))[i] - s))});
      e.float32 = std::max({e.float32, static_cast<double>(std::fabs(fl.cos_row(static_cast<int64_t>(t))[i] - c)),
                            static_cast<double>(std::fabs(fl.sin_row(static_cast<int64_t>(t))[i] - s))});
    }
  return e;
}

}  // namespace

TEST(RopePrecision, ExactModeWithin1e6UpTo2Pow24) {
  std::mt19937_64 rng(21);
  std::uniform_int_distribution<int64_t> pos(0, int64_t{1} << 24);
  std::vector<int64_t> positions{0, 1, 4095, 65535, 1'000'000, (int64_t{1} << 24) - 1, int64_t{1} << 24};
  for (int i = 0; i < 1000; ++i) positions.push_back(pos(rng));
  for (double theta : {10000.0, 500000.0}) {
    const RopeFrequencies f = default_rope_frequencies(128, 128, theta);
    const Errors e = max_errors(f, positions);
    EXPECT_LT(e.exact, 1e-6) << "theta " << theta;
    // float32 angles miss it by orders of magnitude there.
    EXPECT_GT(e.float32, 1e-2) << "theta " << theta;
  }
}

TEST(RopePrecision, ModesDifferByAbout1e2AtOneMillion) {
  const RopeFrequencies f = default_rope_frequencies(128, 128, 10000.0);
  const std::vector<int64_t> p{1'000'000};
  const RopeTable ex(f, p, AnglePrecision::exact), fl(f, p, AnglePrecision::float32);
  double worst = 0;
  for (int i = 0; i < f.n_pairs(); ++i) worst = std::max(worst, static_cast<double>(std::fabs(ex.cos_row(0)[i] - fl.cos_row(0)[i])));
  EXPECT_GT(worst, 1e-3);
  EXPECT_LT(worst, 1e-1);
  // The float32 error is that of rounding the angle, half an ulp of
  // position*inv_freq: ~1e-7 at position 1, already ~6e-5 at 2047.
  const Errors tiny = max_errors(f, {0, 1, 2});
  EXPECT_LT(tiny.exact, 1e-7);
  EXPECT_LT(tiny.float32, 2e-7);
  const Errors small = max_errors(f, {100, 1000, 2047});
  EXPECT_LT(small.exact, 1e-7);
  EXPECT_LT(small.float32, 1.3e-4);
}

}  // namespace POSENC_UNITY_ID
