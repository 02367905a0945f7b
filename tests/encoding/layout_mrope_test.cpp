// Layout permutations, DeepSeek-V3's interleaved-in/half-out helper, and
// MRoPE's reduction to plain RoPE.
#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "posenc/error.hpp"
#include "posenc/mrope.hpp"
#include "posenc/rope.hpp"

namespace POSENC_UNITY_ID {  // this file's own namespace in the tests' unity build (CMakeLists.txt)

using namespace posenc;

namespace {
std::vector<float> randn(std::size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd;
  std::vector<float> v(n);
  for (auto& x : v) x = nd(rng);
  return v;
}
}  // namespace

TEST(RopeLayoutPermutation, RoundTripsAndLeavesTailAlone) {
  const int head_dim = 12, rotary = 8;
  std::vector<float> x(3 * head_dim);
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(i);
  auto y = x;
  rope_interleaved_to_half(y.data(), 3, head_dim, rotary);
  // row 0: [0 1 2 3 4 5 6 7 | 8..11] -> [0 2 4 6 1 3 5 7 | 8..11]
  EXPECT_EQ(std::vector<float>(y.begin(), y.begin() + head_dim),
            (std::vector<float>{0, 2, 4, 6, 1, 3, 5, 7, 8, 9, 10, 11}));
  rope_half_to_interleaved(y.data(), 3, head_dim, rotary);
  EXPECT_EQ(y, x);
  EXPECT_THROW(rope_interleaved_to_half(y.data(), 3, head_dim, 7), InvalidArgument);
  EXPECT_THROW(rope_interleaved_to_half(y.data(), 3, head_dim, 14), InvalidArgument);
}

// Rotating in one layout then permuting == permuting then rotating in the other.
TEST(RopeLayoutPermutation, CommutesWithRotation) {
  const int tokens = 5, heads = 3, head_dim = 16;
  const RopeFrequencies f = default_rope_frequencies(head_dim, 12, 10000.0);
  const std::vector<int64_t> pos{0, 3, 17, 400, 9999};
  const RopeTable table(f, pos, AnglePrecision::float32);
  const auto x = randn(static_cast<std::size_t>(tokens * heads * head_dim), 1);

  auto a = x;  // interleaved rotation, then to half order
  apply_rope(a.data(), tokens, heads, head_dim, table, RopeLayout::interleaved);
  rope_interleaved_to_half(a.data(), tokens * heads, head_dim, f.rotary_dim);
  auto b = x;  // to half order, then half rotation
  rope_interleaved_to_half(b.data(), tokens * heads, head_dim, f.rotary_dim);
  apply_rope(b.data(), tokens, heads, head_dim, table, RopeLayout::half);
  EXPECT_EQ(a, b);

  auto c = x;  // DeepSeek-V3 helper = the same thing
  apply_rope_interleaved_in_half_out(c.data(), tokens, heads, head_dim, table);
  EXPECT_EQ(c, a);

  // Using the wrong layout is not a small error: the classic silent bug.
  auto wrong = x;
  apply_rope(wrong.data(), tokens, heads, head_dim, table, RopeLayout::half);
  auto right = x;
  apply_rope(right.data(), tokens, heads, head_dim, table, RopeLayout::interleaved);
  double diff = 0;
  for (std::size_t i = 0; i < x.size(); ++i) diff = std::max(diff, static_cast<double>(std::fabs(wrong[i] - right[i])));
  EXPECT_GT(diff, 0.5);
}

TEST(RopeTableFromCosSin, ValidatesSizes) {
  EXPECT_THROW(RopeTable::from_cos_sin(2, 3, std::vector<float>(6), std::vector<float>(5), AnglePrecision::exact),
               InvalidArgument);
  EXPECT_THROW(RopeTable::from_cos_sin(2, 0, {}, {}, AnglePrecision::exact), InvalidArgument);
  const RopeTable t = RopeTable::from_cos_sin(2, 1, {1.0f, 0.0f}, {0.0f, 1.0f}, AnglePrecision::exact);
  std::vector<float> x{1, 0, 1, 0};  // 2 tokens, 1 head, head_dim 2
  apply_rope(x.data(), 2, 1, 2, t, RopeLayout::half);
  EXPECT_EQ(x, (std::vector<float>{1, 0, 0, 1}));  // token 1 rotated by 90 degrees
}

TEST(Mrope, EqualRowsArePlainRope) {
  const int tokens = 6, heads = 2, head_dim = 32;
  const RopeFrequencies f = default_rope_frequencies(head_dim, head_dim, 1e6);
  const std::vector<int> section{4, 6, 6};
  const std::vector<int64_t> pos{0, 1, 2, 50, 51, 1000};
  std::vector<int64_t> thw;
  for (int r = 0; r < 3; ++r) thw.insert(thw.end(), pos.begin(), pos.end());
  const auto x = randn(static_cast<std::size_t>(tokens * heads * head_dim), 2);
  auto a = x, b = x;
  apply_mrope(a.data(), tokens, heads, f, section, thw, AnglePrecision::float32);
  apply_rope(b.data(), tokens, heads, f, pos, RopeLayout::half, AnglePrecision::float32);
  EXPECT_EQ(a, b);
}

TEST(Mrope, EachPairFollowsItsSectionRow) {
  const RopeFrequencies f = default_rope_frequencies(16, 16, 10000.0);
  const std::vector<int> section{2, 3, 3};
  EXPECT_EQ(mrope_pair_rows(section, 8), (std::vector<int>{0, 0, 1, 1, 1, 2, 2, 2}));
  // One token with t = 3, h = 5, w = 7.
  const std::vector<int64_t> thw{3, 5, 7};
  const RopeTable t = mrope_table(f, section, thw, 1, AnglePrecision::exact);
  const int64_t row_pos[3] = {3, 5, 7};
  for (int i = 0; i < 8; ++i) {
    const int64_t p = row_pos[mrope_pair_rows(section, 8)[static_cast<std::size_t>(i)]];
    EXPECT_FLOAT_EQ(t.cos_row(0)[i], static_cast<float>(std::cos(static_cast<double>(p) * f.inv_freq[static_cast<std::size_t>(i)])));
  }
  // Errors: wrong sum, wrong count, wrong position count.
  EXPECT_THROW(mrope_pair_rows(std::vector<int>{2, 3, 2}, 8), ConfigError);
  EXPECT_THROW(mrope_pair_rows(std::vector<int>{4, 4}, 8), ConfigError);
  EXPECT_THROW(mrope_table(f, section, std::vector<int64_t>{1, 2}, 1, AnglePrecision::exact), InvalidArgument);
  try {
    mrope_pair_rows(std::vector<int>{2, 3, 2}, 8);
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("mrope_section"), std::string::npos);
    EXPECT_NE(std::string(e.what()).find("sum to 7"), std::string::npos);
  }
}

}  // namespace POSENC_UNITY_ID
