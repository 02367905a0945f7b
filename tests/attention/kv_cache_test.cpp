#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>

#include <gtest/gtest.h>

#include "posenc/error.hpp"
#include "posenc/kv_cache.hpp"
#include "posenc/scaling.hpp"

namespace POSENC_UNITY_ID {  // this file's own namespace in the tests' unity build (CMakeLists.txt)

using namespace posenc;

namespace {

KvCache make(int block = 4, int64_t max_blocks = 0) {
  KvCache::Config c;
  c.n_layers = 2;
  c.kv_heads = 2;
  c.head_dim = 8;
  c.block_size = block;
  c.max_blocks = max_blocks;
  return KvCache(c);
}

// Appends tokens whose key/value at layer l, head h, dim d encode (position, l, h, d).
void append(KvCache& c, KvCache::SeqId s, std::vector<int64_t> pos) {
  const auto slots = c.append(s, pos);
  for (std::size_t i = 0; i < slots.size(); ++i)
    for (int l = 0; l < 2; ++l)
      for (int j = 0; j < 16; ++j) {
        c.key(l, slots[i])[j] = static_cast<float>(pos[i] * 1000 + l * 100 + j);
        c.value(l, slots[i])[j] = -static_cast<float>(pos[i] * 1000 + l * 100 + j);
      }
}

std::vector<int64_t> iota(int64_t a, int64_t n) {
  std::vector<int64_t> v(static_cast<std::size_t>(n));
  std::iota(v.begin(), v.end(), a);
  return v;
}

// Every (position, key) pair visible to attention at layer l.
std::vector<std::pair<int64_t, float>> visible(const KvCache& c, KvCache::SeqId s, int l) {
  std::vector<KvBlock> blocks;
  c.blocks(l, s, blocks);
  std::vector<std::pair<int64_t, float>> out;
  for (const auto& b : blocks)
    for (int64_t i = 0; i < b.n_tokens; ++i)
      if (b.position_ids[i] >= 0) out.emplace_back(b.position_ids[i], b.k[i * 16]);
  std::sort(out.begin(), out.end());
  return out;
}

}  // namespace

TEST(KvCache, AppendKeepsPositionsAndBlocks) {
  KvCache c = make(4);
  const auto s = c.create();
  append(c, s, iota(0, 10));
  EXPECT_EQ(c.size(s), 10);
  EXPECT_EQ(c.next_position(s), 10);
  EXPECT_EQ(c.blocks_in_use(), 3);
  const auto v = visible(c, s, 1);
  ASSERT_EQ(v.size(), 10u);
  for (int64_t p = 0; p < 10; ++p) EXPECT_EQ(v[static_cast<std::size_t>(p)], (std::pair<int64_t, float>{p, p * 1000.0f + 100.0f}));
  EXPECT_THROW(c.append(s, std::vector<int64_t>{-1}), InvalidArgument);
  EXPECT_THROW(c.size(99), InvalidArgument);
}

TEST(KvCache, ForkSharesPrefixAndCopiesOnWrite) {
  KvCache c = make(4);
  const auto parent = c.create();
  append(c, parent, iota(0, 6));  // blocks: [0..3] full, [4,5] partial
  const auto child = c.fork(parent);
  EXPECT_EQ(c.blocks_in_use(), 2);  // shared
  append(c, child, {6, 7});         // writes into the shared partial block -> copied
  EXPECT_EQ(c.blocks_in_use(), 3);
  append(c, parent, {6});           // parent's partial block is its own again
  EXPECT_EQ(visible(c, parent, 0).size(), 7u);
  EXPECT_EQ(visible(c, child, 0).size(), 8u);
  c.free(parent);
  EXPECT_EQ(visible(c, child, 0).size(), 8u);
  EXPECT_EQ(c.next_position(child), 8);
  c.free(child);
  EXPECT_EQ(c.blocks_in_use(), 0);
}

TEST(KvCache, EvictAndWindowKeepPositions) {
  KvCache c = make(4);
  const auto s = c.create();
  append(c, s, iota(0, 20));
  EXPECT_EQ(c.keep_window(s, 8, /*sinks=*/2), 10);  // keeps 0,1 and 12..19
  auto v = visible(c, s, 0);
  ASSERT_EQ(v.size(), 10u);
  EXPECT_EQ(v[0].first, 0);
  EXPECT_EQ(v[1].first, 1);
  EXPECT_EQ(v[2].first, 12);
  EXPECT_EQ(v[2].second, 12000.0f);  // the key stored for position 12 is still there
  EXPECT_EQ(c.next_position(s), 20);  // appends continue after the last position
  EXPECT_LE(c.blocks_in_use(), 4);     // fully evicted blocks were released
  append(c, s, {20});
  EXPECT_EQ(c.positions(s).back(), 20);
}

TEST(KvCache, ShiftRenumbersAndRejectsCollisions) {
  KvCache c = make(4);
  const auto s = c.create();
  append(c, s, iota(0, 12));
  c.evict(s, 4, 8);
  c.shift(s, -4, 8);  // 8..11 -> 4..7; no RopeState: keys untouched
  const auto v = visible(c, s, 0);
  ASSERT_EQ(v.size(), 8u);
  EXPECT_EQ(v[4], (std::pair<int64_t, float>{4, 8000.0f}));
  EXPECT_EQ(c.next_position(s), 8);
  EXPECT_THROW(c.shift(s, -5, 4), CacheError);  // 4 -> -1
  EXPECT_THROW(c.shift(s, -1, 4), CacheError);  // 4 -> 3 collides with kept 3
}

TEST(KvCache, ShiftReRotatesKeysByTheDelta) {
  KvCache c = make(4);
  const auto s = c.create();
  RopeParams p;
  p.head_dim = 8;
  KvCache::RopeState st{compute_rope_frequencies(p), RopeLayout::half, AnglePrecision::exact};
  c.set_rope_state(s, st, false);
  std::mt19937 rng(3);
  std::normal_distribution<float> nd;
  std::vector<float> raw(16 * 5);
  for (auto& x : raw) x = nd(rng);
  const auto pos = iota(10, 5);
  const auto slots = c.append(s, pos);
  // Store keys rotated to their positions, as the model does.
  for (std::size_t i = 0; i < 5; ++i) {
    std::vector<float> k(raw.begin() + static_cast<std::ptrdiff_t>(16 * i), raw.begin() + static_cast<std::ptrdiff_t>(16 * (i + 1)));
    const int64_t one[1] = {pos[i]};
    apply_rope(k.data(), 1, 2, st.freqs, one, st.layout, st.precision);
    for (int l = 0; l < 2; ++l) std::copy(k.begin(), k.end(), c.key(l, slots[i]));
  }
  c.shift(s, -7);
  // Each key must now equal the raw key rotated to position p - 7.
  std::vector<KvBlock> blocks;
  c.blocks(1, s, blocks);
  int checked = 0;
  for (const auto& b : blocks)
    for (int64_t i = 0; i < b.n_tokens; ++i) {
      const int64_t p = b.position_ids[i];
      const std::size_t idx = static_cast<std::size_t>(p + 7 - 10);
      std::vector<float> want(raw.begin() + static_cast<std::ptrdiff_t>(16 * idx), raw.begin() + static_cast<std::ptrdiff_t>(16 * (idx + 1)));
      const int64_t one[1] = {p};
      apply_rope(want.data(), 1, 2, st.freqs, one, st.layout, st.precision);
      for (int d = 0; d < 16; ++d) EXPECT_NEAR(b.k[i * 16 + d], want[static_cast<std::size_t>(d)], 2e-6);
      ++checked;
    }
  EXPECT_EQ(checked, 5);
}

TEST(KvCache, ChangedFrequenciesAreRefusedOrReRotatedNeverMixed) {
  RopeParams p;
  p.head_dim = 8;
  p.rope_type = "linear";
  p.factor = 1.0;
  const KvCache::RopeState a{compute_rope_frequencies(p), RopeLayout::interleaved, AnglePrecision::exact};
  p.factor = 4.0;
  const KvCache::RopeState b{compute_rope_frequencies(p), RopeLayout::interleaved, AnglePrecision::exact};
  KvCache c = make(4);
  const auto s = c.create();
  c.set_rope_state(s, a, false);
  std::vector<float> raw(16, 0.0f);
  for (int d = 0; d < 16; ++d) raw[static_cast<std::size_t>(d)] = 0.1f * static_cast<float>(d + 1);
  const int64_t pos[1] = {40};
  const auto slot = c.append(s, pos)[0];
  std::vector<float> ka = raw;
  apply_rope(ka.data(), 1, 2, a.freqs, pos, a.layout, a.precision);
  for (int l = 0; l < 2; ++l) std::copy(ka.begin(), ka.end(), c.key(l, slot));
  EXPECT_THROW(c.set_rope_state(s, b, /*rerotate=*/false), CacheError);
  EXPECT_EQ(*c.rope_state(s), a);  // refused: nothing changed
  const auto child = c.fork(s);     // shares the block; re-rotating s must not touch it
  c.set_rope_state(s, b, /*rerotate=*/true);
  EXPECT_EQ(*c.rope_state(s), b);
  std::vector<float> kb = raw;
  apply_rope(kb.data(), 1, 2, b.freqs, pos, b.layout, b.precision);
  std::vector<KvBlock> blocks;
  c.blocks(0, s, blocks);
  ASSERT_EQ(blocks.size(), 1u);
  for (int d = 0; d < 16; ++d) EXPECT_NEAR(blocks[0].k[d], kb[static_cast<std::size_t>(d)], 2e-6);
  blocks.clear();
  c.blocks(0, child, blocks);
  for (int d = 0; d < 16; ++d) EXPECT_EQ(blocks[0].k[d], ka[static_cast<std::size_t>(d)]);
}

TEST(KvCache, PoolExhaustionIsAnError) {
  KvCache c = make(4, /*max_blocks=*/2);
  const auto s = c.create();
  append(c, s, iota(0, 8));
  EXPECT_THROW(c.append(s, std::vector<int64_t>{8}), CacheError);
}

// An append that runs the pool out part-way appends nothing (its first tokens filled the last block and took the
// free one before): the sequence's size, positions and blocks are as before, and what fits still appends.
TEST(KvCache, AnAppendThatExhaustsThePoolAppendsNothing) {
  KvCache c = make(4, /*max_blocks=*/3);
  const auto s = c.create();
  append(c, s, iota(0, 6));  // blocks: [0..3], [4, 5, _, _]
  const auto before = visible(c, s, 1);
  EXPECT_THROW(c.append(s, iota(6, 7)), CacheError);  // 2 into the partial block, 4 into the last free one, then out
  EXPECT_EQ(c.size(s), 6);
  EXPECT_EQ(c.next_position(s), 6);
  EXPECT_EQ(c.positions(s), iota(0, 6));
  EXPECT_EQ(c.blocks_in_use(), 2);
  EXPECT_EQ(visible(c, s, 1), before);
  append(c, s, iota(6, 6));  // exactly what fits
  EXPECT_EQ(c.positions(s), iota(0, 12));
  EXPECT_EQ(c.blocks_in_use(), 3);
}

// rollback_appends takes back every slot appended since the mark, across blocks and through a copy-on-write of a
// block shared with a fork (the fork keeps its tokens), MRoPE rows included; appends after it continue as if the
// taken-back ones never were.
TEST(KvCache, RollbackAppendsTakesBackWhatWasAppendedSinceTheMark) {
  KvCache c = make(4);
  const auto parent = c.create();
  append(c, parent, iota(0, 6));  // [0..3], [4, 5, _, _]
  const auto child = c.fork(parent);
  const auto parent_before = visible(c, parent, 0);
  const KvCache::AppendMark mark = c.append_mark(child);
  const auto slots = c.append(child, iota(6, 7), std::vector<int32_t>{1, 2, 3, 4, 5, 6, 7});  // copies the shared block
  std::vector<int64_t> rows(3 * slots.size());
  for (std::size_t i = 0; i < rows.size(); ++i) rows[i] = 100 + static_cast<int64_t>(i);
  c.set_mrope_positions(child, slots, rows);
  EXPECT_EQ(c.size(child), 13);
  EXPECT_EQ(c.blocks_in_use(), 5);  // the parent's 2, the copy and 2 new
  c.rollback_appends(child, mark);
  EXPECT_EQ(c.size(child), 6);
  EXPECT_EQ(c.next_position(child), 6);
  EXPECT_EQ(c.positions(child), iota(0, 6));
  EXPECT_EQ(c.token_ids(child), std::vector<int32_t>(6, -1));
  EXPECT_EQ(c.blocks_in_use(), 3);  // the parent's 2 and the child's copy of the partial one
  EXPECT_EQ(visible(c, child, 0), parent_before);
  EXPECT_EQ(visible(c, parent, 0), parent_before);
  EXPECT_EQ(c.mrope_delta(child), 0);
  append(c, child, {6, 7, 8});
  EXPECT_EQ(c.positions(child), iota(0, 9));
  EXPECT_EQ(c.size(parent), 6);
  c.free(parent);
  c.free(child);
  EXPECT_EQ(c.blocks_in_use(), 0);
  c.rollback_appends(child, mark);  // a freed sequence: nothing happens (never throws)
}

}  // namespace POSENC_UNITY_ID
