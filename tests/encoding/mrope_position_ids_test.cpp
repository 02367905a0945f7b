// M-RoPE position ids (Qwen2-VL's get_rope_index) and Qwen3-VL's interleaved
// section mapping.
//
// References (read with the repository's search tool, not copied):
//  - transformers models/qwen2_vl/modeling_qwen2_vl.py, Qwen2VLModel.get_rope_index
//    (its docstring example: a 3 x 2 x 2 video then 5 text tokens -> temporal ids
//    0,0,0,0,1,1,1,1,2,2,2,2 and text 3..7);
//  - transformers models/qwen2_5_vl/modeling_qwen2_5_vl.py, Qwen2_5_VLModel.get_rope_index
//    (docstring: tokens_per_second 25, interval 50 -> temporal ids 0, 50, 100, text 101..105)
//    and Qwen2_5_VLModel.forward (decode: cache_position + rope_deltas);
//  - transformers PR #48669 "Fix Qwen2.5-VL temporal RoPE for fractional video
//    intervals" (0.5 s with tokens_per_second 2 -> [0, 1, 2, 3], not [0, 0, 0, 0]);
//  - transformers models/qwen3_vl/modeling_qwen3_vl.py,
//    Qwen3VLTextRotaryEmbedding.apply_interleaved_mrope (mrope_section [24, 20, 20]).
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
using Ids = std::vector<int64_t>;
Ids row(const MropePositionIds& p, int r) {
  return Ids(p.position_ids.begin() + r * p.tokens, p.position_ids.begin() + (r + 1) * p.tokens);
}
Ids concat(std::initializer_list<Ids> parts) {
  Ids out;
  for (const auto& p : parts) out.insert(out.end(), p.begin(), p.end());
  return out;
}
Ids iota(int64_t from, int64_t n) {
  Ids v(static_cast<std::size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[static_cast<std::size_t>(i)] = from + i;
  return v;
}
}  // namespace

// HF Qwen2-VL get_rope_index docstring: 3 temporal x 2 x 2 (after the merge) video, 5 text.
TEST(MropePositionIds, Qwen2VlDocstringExample) {
  MropeVisionConfig c;
  c.spatial_merge_size = 2;
  c.rule = MropeTemporalRule::qwen2_vl;
  const std::vector<MropeSpan> spans{MropeSpan::video(3, 4, 4), MropeSpan::text(5)};
  const MropePositionIds p = mrope_position_ids(spans, c);
  ASSERT_EQ(p.tokens, 17);
  EXPECT_EQ(row(p, 0), concat({{0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2}, iota(3, 5)}));
  EXPECT_EQ(row(p, 1), concat({{0, 0, 1, 1, 0, 0, 1, 1, 0, 0, 1, 1}, iota(3, 5)}));
  EXPECT_EQ(row(p, 2), concat({{0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1}, iota(3, 5)}));
  EXPECT_EQ(p.rope_delta, 8 - 17);  // max 7, + 1, - n
}

// HF Qwen2.5-VL get_rope_index docstring: interval = tokens_per_second 25 x 2 s = 50.
TEST(MropePositionIds, Qwen25VlDocstringExample) {
  MropeVisionConfig c;
  c.spatial_merge_size = 2;
  c.tokens_per_second = 25;
  c.rule = MropeTemporalRule::qwen2_5_vl;
  const std::vector<MropeSpan> spans{MropeSpan::video(3, 4, 4, 2.0), MropeSpan::text(5)};
  const MropePositionIds p = mrope_position_ids(spans, c);
  ASSERT_EQ(p.tokens, 17);
  EXPECT_EQ(row(p, 0), concat({{0, 0, 0, 0, 50, 50, 50, 50, 100, 100, 100, 100}, iota(101, 5)}));
  EXPECT_EQ(row(p, 1), concat({{0, 0, 1, 1, 0, 0, 1, 1, 0, 0, 1, 1}, iota(101, 5)}));
  EXPECT_EQ(row(p, 2), concat({{0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1}, iota(101, 5)}));
  EXPECT_EQ(p.rope_delta, 106 - 17);
}

// Text, an image, text: derived by hand from get_rope_index. The image (grid
// 1 x 4 x 6, merge 2 -> 2 x 3 tokens) starts at the running index 3; the text after
// it at max + 1 = 3 + 2 = 6 (not at 3 + 6 tokens = 9).
TEST(MropePositionIds, TextImageTextByHand) {
  const std::vector<MropeSpan> spans{MropeSpan::text(3), MropeSpan::image(1, 4, 6), MropeSpan::text(2)};
  for (MropeTemporalRule rule : {MropeTemporalRule::qwen2_vl, MropeTemporalRule::qwen2_5_vl}) {
    MropeVisionConfig c;
    c.rule = rule;
    const MropePositionIds p = mrope_position_ids(spans, c);
    ASSERT_EQ(p.tokens, 11);
    EXPECT_EQ(row(p, 0), (Ids{0, 1, 2, 3, 3, 3, 3, 3, 3, 6, 7}));
    EXPECT_EQ(row(p, 1), (Ids{0, 1, 2, 3, 3, 3, 4, 4, 4, 6, 7}));
    EXPECT_EQ(row(p, 2), (Ids{0, 1, 2, 3, 4, 5, 3, 4, 5, 6, 7}));
    EXPECT_EQ(p.rope_delta, -3);
  }
  // Text only: plain positions, delta 0 (get_rope_index's text-only branch).
  const std::vector<MropeSpan> text{MropeSpan::text(4)};
  const MropePositionIds t = mrope_position_ids(text, {});
  EXPECT_EQ(t.position_ids, concat({iota(0, 4), iota(0, 4), iota(0, 4)}));
  EXPECT_EQ(t.rope_delta, 0);
  EXPECT_EQ(mrope_position_ids({}, {}).tokens, 0);
}

// Images with grid_t 2: Qwen2-VL numbers the temporal steps, Qwen2.5-VL gives
// images second_per_grid_t = 0 (all temporal ids equal).
TEST(MropePositionIds, ImageTemporalStepsDifferBetweenQwen2AndQwen25) {
  const std::vector<MropeSpan> spans{MropeSpan::image(2, 2, 2)};
  MropeVisionConfig c;
  c.rule = MropeTemporalRule::qwen2_vl;
  EXPECT_EQ(row(mrope_position_ids(spans, c), 0), (Ids{0, 1}));
  c.rule = MropeTemporalRule::qwen2_5_vl;
  EXPECT_EQ(row(mrope_position_ids(spans, c), 0), (Ids{0, 0}));
  EXPECT_EQ(mrope_position_ids(spans, c).rope_delta, 1 - 2);
}

// PR #48669: the temporal step stays floating point and is truncated per grid
// step, after the multiplication.
TEST(MropePositionIds, FractionalVideoIntervalsFollowTransformersPr48669) {
  MropeVisionConfig c;
  c.spatial_merge_size = 1;
  c.rule = MropeTemporalRule::qwen2_5_vl;
  c.tokens_per_second = 2;
  const std::vector<MropeSpan> half{MropeSpan::video(4, 1, 1, 0.5)};
  EXPECT_EQ(row(mrope_position_ids(half, c), 0), (Ids{0, 1, 2, 3}));  // old code: 0, 0, 0, 0
  c.tokens_per_second = 1;
  const std::vector<MropeSpan> one_and_half{MropeSpan::video(4, 1, 1, 1.5)};
  EXPECT_EQ(row(mrope_position_ids(one_and_half, c), 0), (Ids{0, 1, 3, 4}));  // trunc(1.5 k); old: 0, 1, 2, 3
}

// Invariants on random span lists: delta = max + 1 - n; every span starts at the
// previous max + 1; text rows are equal; and HF's decode rule (a continuing text
// token at 1-D position p gets p + delta) equals building the longer sequence.
TEST(MropePositionIds, RandomSpansKeepTheInvariantsAndTheDecodeRule) {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 200; ++trial) {
    std::vector<MropeSpan> spans;
    const int k = 1 + static_cast<int>(rng() % 6);
    for (int i = 0; i < k; ++i) {
      switch (rng() % 3) {
        case 0: spans.push_back(MropeSpan::text(static_cast<int64_t>(rng() % 5))); break;
        case 1: spans.push_back(MropeSpan::image(1, 2 * (1 + rng() % 3), 2 * (1 + rng() % 3))); break;
        default: spans.push_back(MropeSpan::video(1 + rng() % 3, 2 * (1 + rng() % 2), 2, 0.5 * (rng() % 4))); break;
      }
    }
    for (MropeTemporalRule rule : {MropeTemporalRule::qwen2_vl, MropeTemporalRule::qwen2_5_vl}) {
      MropeVisionConfig c;
      c.rule = rule;
      const MropePositionIds p = mrope_position_ids(spans, c);
      const int64_t mx = p.tokens ? *std::max_element(p.position_ids.begin(), p.position_ids.end()) : -1;
      EXPECT_EQ(p.rope_delta, mx + 1 - p.tokens);
      auto longer = spans;
      longer.push_back(MropeSpan::text(3));
      const MropePositionIds q = mrope_position_ids(longer, c);
      ASSERT_EQ(q.tokens, p.tokens + 3);
      for (int64_t i = 0; i < 3; ++i)
        for (int r = 0; r < 3; ++r)
          EXPECT_EQ(q.position_ids[static_cast<std::size_t>(r * q.tokens + p.tokens + i)], p.tokens + i + p.rope_delta);
      EXPECT_EQ(q.rope_delta, p.rope_delta);
      for (int r = 0; r < 3; ++r)  // the prefix is unchanged by what follows
        for (int64_t i = 0; i < p.tokens; ++i)
          EXPECT_EQ(q.position_ids[static_cast<std::size_t>(r * q.tokens + i)],
                    p.position_ids[static_cast<std::size_t>(r * p.tokens + i)]);
    }
  }
}

TEST(MropePositionIds, BadSpansAreTypedErrorsNamingTheSpan) {
  auto msg = [](std::vector<MropeSpan> spans, MropeVisionConfig c = {}) {
    try {
      (void)mrope_position_ids(spans, c);
    } catch (const InvalidArgument& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(msg({MropeSpan::text(2), MropeSpan::image(1, 3, 4)}).find("spans[1] (image).grid_h: must be divisible by "
                                                                        "spatial_merge_size 2 (got 3)"),
            std::string::npos);
  EXPECT_NE(msg({MropeSpan::text(-1)}).find("spans[0] (text).tokens: must be >= 0 (got -1)"), std::string::npos);
  EXPECT_NE(msg({MropeSpan::video(0, 2, 2)}).find("spans[0] (video).grid_t"), std::string::npos);
  EXPECT_NE(msg({MropeSpan::video(1, 2, 2, -1.0)}).find("second_per_grid_t"), std::string::npos);
  MropeVisionConfig bad;
  bad.spatial_merge_size = 0;
  EXPECT_NE(msg({MropeSpan::text(1)}, bad).find("spatial_merge_size"), std::string::npos);
  EXPECT_NE(msg({MropeSpan::image(1, int64_t{1} << 40, int64_t{1} << 40)}).find("more than 2^53"), std::string::npos);
}

// Qwen3-VL apply_interleaved_mrope: pairs 1, 4, 7, ... (< 3*s_h) take h, pairs
// 2, 5, 8, ... (< 3*s_w) take w, the rest t.
TEST(MropeInterleaved, PairRowsMatchApplyInterleavedMrope) {
  const std::vector<int> small{3, 2, 2};
  EXPECT_EQ(mrope_pair_rows(small, 7, MropeMapping::interleaved), (std::vector<int>{0, 1, 2, 0, 1, 2, 0}));
  EXPECT_EQ(mrope_pair_rows(small, 7), (std::vector<int>{0, 0, 0, 1, 1, 2, 2}));  // chunked (Qwen2-VL)
  // Qwen3-VL's [24, 20, 20] over 64 pairs: t h w repeated 20 times, then 4 t.
  const std::vector<int> q3{24, 20, 20};
  const std::vector<int> r = mrope_pair_rows(q3, 64, MropeMapping::interleaved);
  for (int i = 0; i < 60; ++i) EXPECT_EQ(r[static_cast<std::size_t>(i)], i % 3) << i;
  for (int i = 60; i < 64; ++i) EXPECT_EQ(r[static_cast<std::size_t>(i)], 0) << i;
  EXPECT_EQ(std::count(r.begin(), r.end(), 0), 24);
  // [11, 11, 10] over 32 pairs (h reaches pair 31, w stops at 29).
  const std::vector<int> b{11, 11, 10};
  const std::vector<int> rb = mrope_pair_rows(b, 32, MropeMapping::interleaved);
  EXPECT_EQ(std::count(rb.begin(), rb.end(), 1), 11);
  EXPECT_EQ(std::count(rb.begin(), rb.end(), 2), 10);
  EXPECT_EQ(rb[31], 1);
  // A width budget the cycle cannot reach within the pairs: HF's slice would
  // silently give w only 10 pairs; posenc refuses.
  const std::vector<int> over{10, 11, 11};
  EXPECT_THROW(mrope_pair_rows(over, 32, MropeMapping::interleaved), ConfigError);
  try {
    mrope_pair_rows(over, 32, MropeMapping::interleaved);
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("width budget 11 needs pair 32"), std::string::npos) << e.what();
  }
  EXPECT_EQ(parse_mrope_mapping("interleaved"), MropeMapping::interleaved);
  EXPECT_THROW(parse_mrope_mapping("thw"), ConfigError);
}

TEST(MropeInterleaved, TableFollowsEachPairsRowAndEqualRowsArePlainRope) {
  const RopeFrequencies f = default_rope_frequencies(14, 14, 10000.0);  // 7 pairs
  const std::vector<int> section{3, 2, 2};
  const std::vector<int64_t> thw{3, 5, 7};
  const RopeTable t = mrope_table(f, section, thw, 1, AnglePrecision::exact, MropeMapping::interleaved);
  const int64_t by_row[3] = {3, 5, 7};
  const int rows[7] = {0, 1, 2, 0, 1, 2, 0};
  for (int i = 0; i < 7; ++i)
    EXPECT_FLOAT_EQ(t.cos_row(0)[i],
                    static_cast<float>(std::cos(static_cast<double>(by_row[rows[i]]) * f.inv_freq[static_cast<std::size_t>(i)])));
  // Equal rows: interleaved MRoPE == plain RoPE, bit for bit.
  const std::vector<int64_t> pos{0, 4, 9};
  std::vector<int64_t> eq;
  for (int r = 0; r < 3; ++r) eq.insert(eq.end(), pos.begin(), pos.end());
  std::mt19937 rng(3);
  std::normal_distribution<float> nd;
  std::vector<float> x(3 * 2 * 14);
  for (auto& v : x) v = nd(rng);
  auto a = x, b = x;
  apply_mrope(a.data(), 3, 2, f, section, eq, AnglePrecision::float32, RopeDirection::forward, MropeMapping::interleaved);
  apply_rope(b.data(), 3, 2, f, pos, RopeLayout::half, AnglePrecision::float32);
  EXPECT_EQ(a, b);
  // Unequal rows: the two mappings rotate differently.
  auto c = x, d = x;
  const std::vector<int64_t> img{3, 3, 3, 3, 4, 4, 3, 4, 5};
  apply_mrope(c.data(), 3, 2, f, section, img, AnglePrecision::float32, RopeDirection::forward, MropeMapping::interleaved);
  apply_mrope(d.data(), 3, 2, f, section, img, AnglePrecision::float32, RopeDirection::forward, MropeMapping::chunked);
  double diff = 0;
  for (std::size_t i = 0; i < c.size(); ++i) diff = std::max(diff, static_cast<double>(std::fabs(c[i] - d[i])));
  EXPECT_GT(diff, 1e-2);
}

}  // namespace POSENC_UNITY_ID
