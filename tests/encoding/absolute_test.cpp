// Absolute encodings: learned lookup bounds (PositionError, never a silent
// read), NoPE as an explicit identity, sinusoidal encodings of arbitrary
// positions.
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "posenc/absolute.hpp"
#include "posenc/error.hpp"

namespace POSENC_UNITY_ID {  // this file's own namespace in the tests' unity build (CMakeLists.txt)

using namespace posenc;

TEST(LearnedPositions, LookupCopiesRowsAndRejectsOutOfTable) {
  const int64_t max_pos = 4;
  const int d = 3;
  std::vector<float> table(static_cast<std::size_t>(max_pos * d));
  for (std::size_t i = 0; i < table.size(); ++i) table[i] = static_cast<float>(i);
  std::vector<float> out(2 * d, -1.0f);
  learned_position_lookup(table, max_pos, d, std::vector<int64_t>{3, 0}, out);
  EXPECT_EQ(out, (std::vector<float>{9, 10, 11, 0, 1, 2}));

  for (int64_t bad : {int64_t{4}, int64_t{-1}, int64_t{1} << 40}) {
    std::vector<float> o(2 * d, -1.0f);
    try {
      learned_position_lookup(table, max_pos, d, std::vector<int64_t>{0, bad}, o);
      ADD_FAILURE() << "position " << bad << " must throw";
    } catch (const PositionError& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find("position_ids[1]"), std::string::npos) << msg;
      EXPECT_NE(msg.find(std::to_string(bad)), std::string::npos) << msg;
      EXPECT_NE(msg.find("4 rows"), std::string::npos) << msg;
    }
    EXPECT_EQ(o, std::vector<float>(2 * d, -1.0f)) << "nothing is written before the check";
  }
  EXPECT_THROW(learned_position_lookup(std::vector<float>(5), max_pos, d, std::vector<int64_t>{0}, out),
               InvalidArgument);
}

TEST(AbsoluteEncoding, NopeIsTheIdentityAndTableAdds) {
  const int d = 4;
  const std::vector<int64_t> pos{0, 2, 1};
  const std::vector<float> emb{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12};
  const std::vector<float> table = sinusoidal_table(3, d, SinusoidalLayout::interleaved);

  auto nope = emb;
  add_absolute_position_encoding(AbsolutePositionEncoding::none, nope, d, pos, {}, 0);
  EXPECT_EQ(nope, emb);  // bit for bit: no position term at all

  auto added = emb;
  add_absolute_position_encoding(AbsolutePositionEncoding::table, added, d, pos, table, 3);
  for (std::size_t t = 0; t < pos.size(); ++t)
    for (int c = 0; c < d; ++c)
      EXPECT_EQ(added[t * d + static_cast<std::size_t>(c)],
                emb[t * d + static_cast<std::size_t>(c)] + table[static_cast<std::size_t>(pos[t] * d + c)]);

  // Sinusoids need no table: same sums as the table path, and any position works.
  auto direct = emb;
  add_sinusoidal_encoding(direct, d, pos, SinusoidalLayout::interleaved);
  EXPECT_EQ(direct, added);
  auto far = emb;
  add_sinusoidal_encoding(far, d, std::vector<int64_t>{0, 1'000'000, 5}, SinusoidalLayout::interleaved);
  EXPECT_NE(far, emb);
  EXPECT_THROW(add_sinusoidal_encoding(far, d, std::vector<int64_t>{0, 1}, SinusoidalLayout::interleaved),
               InvalidArgument);

  auto past = emb;
  EXPECT_THROW(add_absolute_position_encoding(AbsolutePositionEncoding::table, past, d,
                                              std::vector<int64_t>{0, 3, 1}, table, 3),
               PositionError);
  EXPECT_EQ(past, emb);
  EXPECT_THROW(add_absolute_position_encoding(AbsolutePositionEncoding::none, nope, d,
                                              std::vector<int64_t>{0, 1}, {}, 0),
               InvalidArgument);  // shapes are still checked
}

TEST(Sinusoidal, EncodingOfAnyPositionsMatchesTheTableAndThePaper) {
  const int d = 16;
  const auto table = sinusoidal_table(50, d, SinusoidalLayout::interleaved);
  const std::vector<int64_t> pos{49, 0, 17};
  const auto enc = sinusoidal_encoding(pos, d, SinusoidalLayout::interleaved);
  for (std::size_t t = 0; t < pos.size(); ++t)
    for (int c = 0; c < d; ++c)
      EXPECT_EQ(enc[t * d + static_cast<std::size_t>(c)], table[static_cast<std::size_t>(pos[t] * d + c)]);
  // Vaswani §3.5 directly, at a large position.
  const auto big = sinusoidal_encoding(std::vector<int64_t>{123456}, d, SinusoidalLayout::interleaved);
  for (int i = 0; i < d / 2; ++i) {
    const double w = 1.0 / std::pow(10000.0, 2.0 * i / d);
    EXPECT_NEAR(big[static_cast<std::size_t>(2 * i)], std::sin(123456 * w), 1e-6);
    EXPECT_NEAR(big[static_cast<std::size_t>(2 * i + 1)], std::cos(123456 * w), 1e-6);
  }
  // tensor2tensor: padding row zero, odd dim zero column.
  const auto t2t = sinusoidal_table(4, 7, SinusoidalLayout::tensor2tensor, 10000.0, 1);
  for (int c = 0; c < 7; ++c) EXPECT_EQ(t2t[static_cast<std::size_t>(7 + c)], 0.0f);
  for (int r = 0; r < 4; ++r) EXPECT_EQ(t2t[static_cast<std::size_t>(r * 7 + 6)], 0.0f);
  EXPECT_THROW(sinusoidal_table(4, 3, SinusoidalLayout::tensor2tensor), InvalidArgument);
  EXPECT_THROW(sinusoidal_table(4, 8, SinusoidalLayout::halves, 10000.0, 1), InvalidArgument);
  EXPECT_THROW(sinusoidal_table(4, 8, SinusoidalLayout::interleaved, 1.0), InvalidArgument);
  EXPECT_EQ(parse_sinusoidal_layout("halves"), SinusoidalLayout::halves);
  EXPECT_THROW(parse_sinusoidal_layout("concat"), ConfigError);
}

TEST(Sinusoidal, M2M100PositionIds) {
  // padding_idx 1: real tokens count from 2; padding keeps 1; past length shifts real tokens only.
  const std::vector<int64_t> ids{5, 6, 1, 7, 1, 1, 8, 9};
  EXPECT_EQ(position_ids_from_input_ids(ids, 2, 4, 1), (std::vector<int64_t>{2, 3, 1, 4, 1, 1, 2, 3}));
  EXPECT_EQ(position_ids_from_input_ids(ids, 2, 4, 1, 3), (std::vector<int64_t>{5, 6, 1, 7, 1, 1, 5, 6}));
  EXPECT_THROW(position_ids_from_input_ids(ids, 3, 4, 1), InvalidArgument);
}

// A past_key_values_length near the int64 limit used to wrap into negative position ids without a word
// (found from Python); the largest position is checked before anything is written.
TEST(PositionIdsFromInputIds, APositionPastInt64IsRefused) {
  const std::vector<int64_t> ids = {5, 6, 1, 7};
  try {
    (void)posenc::position_ids_from_input_ids(ids, 1, 4, 1, INT64_MAX - 2);
    FAIL() << "accepted";
  } catch (const posenc::InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("past_key_values_length"), std::string::npos) << e.what();
  }
  // Fairseq's rule at a legal offset: (cumsum(mask) + past) * mask + padding_idx.
  EXPECT_EQ(posenc::position_ids_from_input_ids(ids, 1, 4, 1, 10), (std::vector<int64_t>{12, 13, 1, 14}));
}

}  // namespace POSENC_UNITY_ID
