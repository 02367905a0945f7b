// ALiBi and T5 bias helpers beyond the golden files: the bias forms, their
// softmax equivalence with BLOOM/MPT's shifted tensors, bfloat16 rounding,
// and the T5 bias gathered from a learned table.
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "posenc/bias.hpp"
#include "posenc/error.hpp"

namespace POSENC_UNITY_ID {  // this file's own namespace in the tests' unity build (CMakeLists.txt)

using namespace posenc;

TEST(Alibi, SlopesForPowersOfTwoAreTheGeometricSequence) {
  for (int n : {1, 2, 4, 8, 16, 32, 64}) {
    const auto s = alibi_slopes(n);
    const auto b = bloom_alibi_slopes(n);
    const auto m = mpt_alibi_slopes(n);
    for (int h = 0; h < n; ++h) {
      const double want = std::pow(2.0, -8.0 * (h + 1) / n);
      EXPECT_EQ(s[static_cast<std::size_t>(h)], static_cast<float>(want)) << n << " " << h;
      EXPECT_NEAR(b[static_cast<std::size_t>(h)], want, 1e-6 * want);
      EXPECT_NEAR(m[static_cast<std::size_t>(h)], want, 1e-6 * want);
    }
  }
  EXPECT_THROW(alibi_slopes(0), InvalidArgument);
  EXPECT_THROW(alibi_slopes(4, -1.0), InvalidArgument);
  EXPECT_THROW(mpt_alibi_slopes(4, 0.0), InvalidArgument);
  EXPECT_THROW(bloom_alibi_slopes(-3), InvalidArgument);
}

TEST(Alibi, BiasRowForms) {
  const std::vector<int64_t> keys{0, 1, 5, 9, 12};
  std::vector<float> row(keys.size());
  alibi_bias_row(0.5f, 9, keys, AlibiForm::causal, row);
  EXPECT_EQ(row, (std::vector<float>{-4.5f, -4.0f, -2.0f, 0.0f, 1.5f}));
  alibi_bias_row(0.5f, 9, keys, AlibiForm::symmetric, row);
  EXPECT_EQ(row, (std::vector<float>{-4.5f, -4.0f, -2.0f, 0.0f, -1.5f}));
  // A query deep into a cache: only distances matter.
  const std::vector<int64_t> far{1'000'000 - 3, 1'000'000};
  std::vector<float> r2(2);
  alibi_bias_row(0.25f, 1'000'000, far, AlibiForm::causal, r2);
  EXPECT_EQ(r2, (std::vector<float>{-0.75f, 0.0f}));
  std::vector<float> small(1);
  EXPECT_THROW(alibi_bias_row(0.5f, 9, keys, AlibiForm::causal, small), InvalidArgument);
}

TEST(Alibi, FullBiasMatchesRowsAtAnOffset) {
  const auto slopes = alibi_slopes(6);
  const int64_t q_len = 3, k_len = 10, offset = 7;
  const auto bias = alibi_bias(slopes, q_len, k_len, offset, AlibiForm::causal);
  ASSERT_EQ(bias.size(), 6u * 3u * 10u);
  for (int h = 0; h < 6; ++h)
    for (int64_t t = 0; t < q_len; ++t)
      for (int64_t j = 0; j < k_len; ++j)
        EXPECT_EQ(bias[static_cast<std::size_t>((h * q_len + t) * k_len + j)],
                  -(slopes[static_cast<std::size_t>(h)] * static_cast<float>(offset + t - j)));
  EXPECT_THROW(alibi_bias({}, 1, 1, 0, AlibiForm::causal), InvalidArgument);
}

// BLOOM adds +m*j, MPT m*(j-(L-1)), the paper -m*(i-j): for every causal row
// they differ by a per-row constant, so softmax probabilities are the same.
TEST(Alibi, ReferenceTensorsAreShiftsOfThePaperBias) {
  const int heads = 8;
  const int64_t L = 7;
  const auto slopes = bloom_alibi_slopes(heads);
  const std::vector<int64_t> mask(static_cast<std::size_t>(L), 1);
  const auto bloom = build_bloom_alibi_tensor(mask, 1, L, heads, AlibiTensorStyle::bloom);
  const auto mpt = build_mpt_alibi_tensor(heads, L);
  const auto paper = alibi_bias(slopes, L, L, 0, AlibiForm::causal);
  for (int h = 0; h < heads; ++h)
    for (int64_t i = 0; i < L; ++i) {
      const float* prow = paper.data() + (h * L + i) * L;
      const double shift = bloom[static_cast<std::size_t>(h * L)] - prow[0];
      for (int64_t j = 0; j <= i; ++j)
        EXPECT_NEAR(bloom[static_cast<std::size_t>(h * L + j)] - prow[j], shift, 1e-6) << h << " " << i << " " << j;
      if (i == L - 1) {  // MPT's single row is the paper's last query row
        for (int64_t j = 0; j < L; ++j) EXPECT_NEAR(mpt[static_cast<std::size_t>(h * L + j)], prow[j], 1e-6);
      }
    }
}

TEST(Alibi, PaddingAwareKeyIndexAndMaskValidation) {
  // Left padding: keys count from the first real token.
  const std::vector<int64_t> mask{0, 0, 1, 1, 1};
  const auto t = build_bloom_alibi_tensor(mask, 1, 5, 1, AlibiTensorStyle::bloom);
  const float m = bloom_alibi_slopes(1)[0];
  EXPECT_EQ(t, (std::vector<float>{0, 0, 0, m, 2 * m}));
  EXPECT_THROW(build_bloom_alibi_tensor(std::vector<int64_t>{1, 2}, 1, 2, 1, AlibiTensorStyle::bloom), InvalidArgument);
  EXPECT_THROW(build_bloom_alibi_tensor(std::vector<int64_t>{1, 1, 1}, 1, 2, 1, AlibiTensorStyle::bloom), InvalidArgument);
}

TEST(Alibi, Bfloat16RoundsHalfToEven) {
  EXPECT_EQ(round_to_bfloat16(1.0f), 1.0f);
  EXPECT_EQ(round_to_bfloat16(0.70710677f), 0.70703125f);
  EXPECT_EQ(round_to_bfloat16(1.0f + std::ldexp(1.0f, -8)), 1.0f);                        // tie -> even
  EXPECT_EQ(round_to_bfloat16(1.0f + 3 * std::ldexp(1.0f, -8)), 1.0f + std::ldexp(1.0f, -6));  // tie -> even (up)
  EXPECT_EQ(round_to_bfloat16(-2.5f), -2.5f);
  EXPECT_TRUE(std::isnan(round_to_bfloat16(std::nanf(""))));
  for (float s : falcon_alibi_slopes(12)) EXPECT_EQ(s, round_to_bfloat16(s));
}

TEST(T5Bias, GathersTheLearnedTableByBucket) {
  const int num_buckets = 32, heads = 3, max_distance = 128;
  std::vector<float> table(static_cast<std::size_t>(num_buckets * heads));
  for (int b = 0; b < num_buckets; ++b)
    for (int h = 0; h < heads; ++h) table[static_cast<std::size_t>(b * heads + h)] = 100.0f * b + h;
  for (bool bidirectional : {true, false}) {
    const int64_t q_len = 4, k_len = 300, past = 200;
    const auto bias = t5_relative_position_bias(table, num_buckets, heads, q_len, k_len, past,
                                                bidirectional, max_distance);
    ASSERT_EQ(bias.size(), static_cast<std::size_t>(heads * q_len * k_len));
    for (int h = 0; h < heads; ++h)
      for (int64_t t = 0; t < q_len; ++t)
        for (int64_t j = 0; j < k_len; ++j) {
          const int b = t5_relative_position_bucket(j - (past + t), bidirectional, num_buckets, max_distance);
          ASSERT_EQ(bias[static_cast<std::size_t>((h * q_len + t) * k_len + j)], 100.0f * b + h);
        }
  }
  // Buckets: causal sends future keys to 0; distances past max_distance share the last bucket.
  EXPECT_EQ(t5_relative_position_bucket(5, false, 32, 128), 0);
  EXPECT_EQ(t5_relative_position_bucket(-1000, false, 32, 128), 31);
  EXPECT_EQ(t5_relative_position_bucket(1000, true, 32, 128), 31);
  EXPECT_EQ(t5_relative_position_bucket(-1000, true, 32, 128), 15);
  EXPECT_THROW(t5_relative_position_bias(std::vector<float>(10), num_buckets, heads, 1, 1, 0, true, 128),
               InvalidArgument);
  EXPECT_THROW(t5_relative_position_buckets(1, 1, 0, true, 32, 8), InvalidArgument);
}

// Sizes whose product wraps in int64 used to allocate a tiny vector and write past it (found from Python:
// t5_relative_buckets(2**62, 4) crashed the interpreter). Each is refused before anything is allocated.
TEST(BiasSizes, ProductsThatOverflowAreRefusedNamingTheAxes) {
  const std::vector<float> slopes = alibi_slopes(4);
  const auto expect_refused = [](auto&& call, const std::string& field) {
    try {
      call();
      FAIL() << "accepted: " << field;
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find(field), std::string::npos) << e.what();
    }
  };
  expect_refused([&] { (void)alibi_bias(slopes, int64_t{1} << 62, 4, 0, AlibiForm::causal); }, "heads x q_len");
  expect_refused([&] { (void)alibi_bias(slopes, int64_t{1} << 30, int64_t{1} << 30, 0, AlibiForm::causal); },
                 "output bytes");
  expect_refused([&] { (void)alibi_bias(slopes, 2, 2, INT64_MAX - 1, AlibiForm::causal); }, "query_offset + q_len");
  expect_refused([&] { (void)t5_relative_position_buckets(int64_t{1} << 40, int64_t{1} << 40, 0, true, 32, 128); },
                 "q_len x k_len");
  expect_refused([&] { (void)t5_relative_position_buckets(2, 2, INT64_MAX - 1, true, 32, 128); },
                 "query_offset + q_len");
  expect_refused([&] { (void)build_mpt_alibi_tensor(16, int64_t{1} << 60); }, "heads x sequence_length");
  expect_refused([&] { (void)build_mpt_alibi_tensor(4, int64_t{1} << 60); }, "output bytes");
  const std::vector<int64_t> mask(4, 1);
  expect_refused([&] { (void)build_bloom_alibi_tensor(mask, int64_t{1} << 62, 4, 8, AlibiTensorStyle::bloom); },
                 "batch x seq_len");
  // Sizes that fit still work: the same call shapes at small sizes give full tensors.
  EXPECT_EQ(alibi_bias(slopes, 3, 5, 2, AlibiForm::causal).size(), 4u * 3u * 5u);
  EXPECT_EQ(t5_relative_position_buckets(3, 5, 2, true, 32, 128).size(), 15u);
}

}  // namespace POSENC_UNITY_ID
