#include <cmath>
#include <random>
#include <vector>

#include <gtest/gtest.h>

#include "posenc/error.hpp"
#include "posenc/rope.hpp"
#include "posenc/scaling.hpp"

namespace POSENC_UNITY_ID {  // this file's own namespace in the tests' unity build (CMakeLists.txt)

using namespace posenc;

TEST(RopeCore, LayoutsPairDifferentChannels) {
  // head_dim 4: interleaved pairs (0,1),(2,3); half pairs (0,2),(1,3).
  RopeFrequencies f = default_rope_frequencies(4, 4, 10000.0);
  std::vector<int64_t> pos{1};
  std::vector<float> a{1, 0, 0, 0}, b{1, 0, 0, 0};
  apply_rope(a.data(), 1, 1, f, pos, RopeLayout::interleaved, AnglePrecision::float32);
  apply_rope(b.data(), 1, 1, f, pos, RopeLayout::half, AnglePrecision::float32);
  EXPECT_FLOAT_EQ(a[0], std::cos(1.0f));
  EXPECT_FLOAT_EQ(a[1], std::sin(1.0f));
  EXPECT_EQ(a[2], 0.0f);
  EXPECT_FLOAT_EQ(b[0], std::cos(1.0f));
  EXPECT_EQ(b[1], 0.0f);
  EXPECT_FLOAT_EQ(b[2], std::sin(1.0f));
}

TEST(RopeCore, InverseUndoesForward) {
  RopeFrequencies f = default_rope_frequencies(64, 64, 10000.0);
  std::mt19937 rng(1);
  std::normal_distribution<float> nd;
  std::vector<float> x(3 * 2 * 64);
  for (auto& v : x) v = nd(rng);
  auto y = x;
  std::vector<int64_t> pos{5, 900, 77};
  for (auto layout : {RopeLayout::half, RopeLayout::interleaved}) {
    apply_rope(y.data(), 3, 2, f, pos, layout, AnglePrecision::exact);
    apply_rope(y.data(), 3, 2, f, pos, layout, AnglePrecision::exact, RopeDirection::inverse);
    for (std::size_t i = 0; i < x.size(); ++i) EXPECT_NEAR(y[i], x[i], 2e-6);
  }
}

TEST(RopeCore, PartialRotaryPassesTailThrough) {
  RopeFrequencies f = default_rope_frequencies(8, 4, 10000.0);
  std::vector<float> x{1, 2, 3, 4, 5, 6, 7, 8};
  std::vector<int64_t> pos{3};
  apply_rope(x.data(), 1, 1, f, pos, RopeLayout::half, AnglePrecision::float32);
  EXPECT_EQ(x[4], 5.0f);
  EXPECT_EQ(x[7], 8.0f);
  EXPECT_NE(x[0], 1.0f);
}

TEST(RopeCore, BadInputsThrowTypedErrors) {
  EXPECT_THROW(default_rope_frequencies(8, 5, 10000.0), InvalidArgument);
  EXPECT_THROW(default_rope_frequencies(8, 10, 10000.0), InvalidArgument);
  EXPECT_THROW(default_rope_frequencies(8, 8, -1.0), InvalidArgument);
  EXPECT_THROW(parse_rope_layout("neox"), ConfigError);
  RopeParams p;
  p.head_dim = 64;
  p.rope_type = "bogus";
  try {
    compute_rope_frequencies(p);
    FAIL();
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("bogus"), std::string::npos);
  }
  p.rope_type = "linear";
  EXPECT_THROW(compute_rope_frequencies(p), ConfigError);  // factor missing
  p.factor = 0.0;
  EXPECT_THROW(compute_rope_frequencies(p), ConfigError);
}

TEST(RopeCore, LinearIsDefaultDividedByFactor) {
  RopeParams p;
  p.head_dim = 64;
  auto d = compute_rope_frequencies(p);
  p.rope_type = "linear";
  p.factor = 4.0;
  auto l = compute_rope_frequencies(p);
  for (int i = 0; i < 32; ++i) EXPECT_EQ(l.inv_freq[i], d.inv_freq[i] / 4.0f);
  p.factor = 1.0;
  EXPECT_EQ(compute_rope_frequencies(p).inv_freq, d.inv_freq);
}

}  // namespace POSENC_UNITY_ID
