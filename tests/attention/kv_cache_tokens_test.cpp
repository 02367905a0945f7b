// The KvCache bookkeeping the recompute and hf policies rely on (issue 16):
// token ids per slot, clear(), eviction counts, the planned length, stats.
#include <vector>

#include <gtest/gtest.h>

#include "posenc/error.hpp"
#include "posenc/kv_cache.hpp"
#include "posenc/scaling.hpp"
#include "test_support.hpp"

namespace posenc {
namespace {

KvCache small_cache() { return KvCache({2, 1, 4, 3, 0}); }

TEST(KvCacheTokens, TokenIdsFollowTheSlotsThroughForkEvictAndClear) {
  KvCache c = small_cache();
  const auto s = c.create();
  const std::vector<int64_t> pos{0, 1, 2, 3, 4};
  const std::vector<int32_t> ids{7, 8, 9, 10, 11};
  c.append(s, pos, ids);
  EXPECT_EQ(c.token_ids(s), ids);
  const auto f = c.fork(s);
  const std::vector<int64_t> p5{5};
  const std::vector<int32_t> t5{42};
  c.append(f, p5, t5);  // copy-on-write of the shared partial block
  EXPECT_EQ(c.token_ids(f), (std::vector<int32_t>{7, 8, 9, 10, 11, 42}));
  EXPECT_EQ(c.token_ids(s), ids);  // the parent is untouched
  EXPECT_EQ(c.evict(s, 1, 3), 2);
  EXPECT_EQ(c.token_ids(s), (std::vector<int32_t>{7, 10, 11}));
  EXPECT_EQ(c.evicted(s), 2);
  EXPECT_EQ(c.evicted(f), 0);
  c.set_planned_length(s, 99);
  c.record_recompute(s, 3);
  c.clear(s);
  EXPECT_EQ(c.size(s), 0);
  EXPECT_EQ(c.next_position(s), 0);
  EXPECT_EQ(c.evicted(s), 0);
  EXPECT_FALSE(c.rope_state(s).has_value());
  EXPECT_EQ(c.planned_length(s), 99);          // kept
  EXPECT_EQ(c.stats(s).rope_recomputes, 1);    // kept
  EXPECT_EQ(c.stats(s).tokens_reprefilled, 3);
  EXPECT_EQ(c.token_ids(f).size(), 6u);        // the fork keeps its blocks
  c.append(s, std::vector<int64_t>{0});        // no ids given: unknown
  EXPECT_EQ(c.token_ids(s), std::vector<int32_t>{-1});
}

TEST(KvCacheTokens, BadSizesAreTypedErrors) {
  KvCache c = small_cache();
  const auto s = c.create();
  EXPECT_THROW(c.append(s, std::vector<int64_t>{0, 1}, std::vector<int32_t>{5}), InvalidArgument);
  EXPECT_EQ(c.size(s), 0);
  EXPECT_THROW(c.set_planned_length(s, -1), InvalidArgument);
}

TEST(KvCacheTokens, MixedRotationsAreRecordedAndRefuseAShift) {
  KvCache c = small_cache();
  const auto s = c.create();
  RopeParams p;
  p.head_dim = 4;
  const KvCache::RopeState a{compute_rope_frequencies(p), RopeLayout::half, AnglePrecision::float32, 10};
  p.rope_theta = 500.0;
  const KvCache::RopeState b{compute_rope_frequencies(p), RopeLayout::half, AnglePrecision::float32, 20};
  c.set_rope_state_mixed(s, a);
  c.append(s, std::vector<int64_t>{0, 1}, std::vector<int32_t>{1, 2});
  KvCache::RopeState a2 = a;
  a2.seq_len = 15;  // the same rotation: bookkeeping only
  c.set_rope_state_mixed(s, a2);
  EXPECT_FALSE(c.rope_mixed(s));
  EXPECT_EQ(c.rope_state(s)->seq_len, 15);
  c.set_rope_state_mixed(s, b);
  EXPECT_TRUE(c.rope_mixed(s));
  EXPECT_EQ(c.stats(s).rope_changes_kept, 1);
  EXPECT_THROW(c.shift(s, 5), CacheError);
  c.set_rope_state(s, a, /*rerotate=*/true);  // re-rotation counts
  EXPECT_EQ(c.stats(s).rope_rerotations, 1);
}

}  // namespace
}  // namespace posenc
