// The KV cache in f16 / bf16 (KvCacheDtype): rounding on write, exact widening on read, half the memory, and
// attention over a rounded cache equal bit for bit to attention over float32 keys/values rounded the same way.
#include <malloc.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "posenc/attention.hpp"
#include "posenc/error.hpp"
#include "posenc/float16.hpp"
#include "posenc/kv_cache.hpp"
#include "posenc/scaling.hpp"
#include "sanitizer.hpp"
#include "test_support.hpp"

namespace POSENC_UNITY_ID {  // this file's own namespace in the tests' unity build (CMakeLists.txt)

using namespace posenc;

namespace {

constexpr int kLayers = 2, kHeads = 2, kDim = 8, kKv = kHeads * kDim;

KvCache make(KvCacheDtype dtype, int block = 4) {
  KvCache::Config c;
  c.n_layers = kLayers;
  c.kv_heads = kHeads;
  c.head_dim = kDim;
  c.block_size = block;
  c.dtype = dtype;
  return KvCache(c);
}

uint32_t bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

float round_as(KvCacheDtype d, float x) {
  return d == KvCacheDtype::f16 ? round_to_f16(x) : d == KvCacheDtype::bf16 ? round_to_bf16(x) : x;
}

std::vector<float> random_vector(std::size_t n, uint64_t seed, float scale = 1.0f) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0.0f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = nd(rng);
  return v;
}

// Every (layer, slot) of `slots` gets k/v rows from `k`/`v` ([slots, layers, kKv]).
void fill(KvCache& c, const std::vector<KvCache::Slot>& slots, const std::vector<float>& k, const std::vector<float>& v) {
  for (std::size_t i = 0; i < slots.size(); ++i)
    for (int l = 0; l < kLayers; ++l) {
      const std::size_t at = (i * kLayers + static_cast<std::size_t>(l)) * kKv;
      c.write(l, slots[i], k.data() + at, v.data() + at);
    }
}

const KvCacheDtype kHalfDtypes[] = {KvCacheDtype::f16, KvCacheDtype::bf16};

}  // namespace

TEST(KvCacheDtype, NamesParseAndSizes) {
  EXPECT_EQ(parse_kv_cache_dtype("f32"), KvCacheDtype::f32);
  EXPECT_EQ(parse_kv_cache_dtype("float16"), KvCacheDtype::f16);
  EXPECT_EQ(parse_kv_cache_dtype("bf16"), KvCacheDtype::bf16);
  EXPECT_EQ(to_string(KvCacheDtype::bf16), "bf16");
  const std::string m =
      posenc::test::message_of<InvalidArgument>([] { (void)parse_kv_cache_dtype("q8_0", "--kv-dtype"); });
  EXPECT_NE(m.find("--kv-dtype"), std::string::npos) << m;
  EXPECT_NE(m.find("q8_0"), std::string::npos) << m;
  EXPECT_EQ(kv_cache_dtype_bytes(KvCacheDtype::f32), 4);
  EXPECT_EQ(kv_cache_dtype_bytes(KvCacheDtype::f16), 2);
  EXPECT_EQ(kv_cache_dtype_bytes(KvCacheDtype::bf16), 2);
  EXPECT_EQ(make(KvCacheDtype::f32).kv_bytes_per_token(), 2 * 2 * kKv * 4);
  EXPECT_EQ(make(KvCacheDtype::f16).kv_bytes_per_token(), 2 * 2 * kKv * 2);
}

// Every finite value of the 16-bit format survives a write and a read bit for bit, and so does every f32 value in a
// float32 cache (NaN payloads included).
TEST(KvCacheDtype, RepresentableValuesRoundTripExactly) {
  for (KvCacheDtype d : kHalfDtypes) {
    KvCache c = make(d, 1);
    const auto s = c.create();
    std::vector<float> vals;
    for (uint32_t h = 0; h < 0x10000; ++h) {
      const float f = d == KvCacheDtype::f16 ? f16_to_f32(static_cast<uint16_t>(h)) : bf16_to_f32(static_cast<uint16_t>(h));
      if (std::isfinite(f) || std::isinf(f)) vals.push_back(f);
    }
    const std::size_t tokens = (vals.size() + kKv - 1) / kKv;
    vals.resize(tokens * kKv, 0.0f);
    const auto slots = c.append(s, [&] {
      std::vector<int64_t> p(tokens);
      std::iota(p.begin(), p.end(), 0);
      return p;
    }());
    std::vector<float> neg(vals.size());
    for (std::size_t i = 0; i < vals.size(); ++i) neg[i] = -vals[i];
    for (std::size_t i = 0; i < tokens; ++i) c.write(1, slots[i], vals.data() + i * kKv, neg.data() + i * kKv);
    std::vector<float> k(kKv), v(kKv);
    std::size_t mismatches = 0;
    for (std::size_t i = 0; i < tokens; ++i) {
      c.read_key(1, slots[i], k.data());
      c.read_value(1, slots[i], v.data());
      for (int j = 0; j < kKv; ++j) {
        mismatches += bits(k[static_cast<std::size_t>(j)]) != bits(vals[i * kKv + static_cast<std::size_t>(j)]);
        mismatches += bits(v[static_cast<std::size_t>(j)]) != bits(neg[i * kKv + static_cast<std::size_t>(j)]);
      }
    }
    EXPECT_EQ(mismatches, 0u) << to_string(d);
    EXPECT_GT(tokens * kKv, 60000u);
  }
  KvCache c = make(KvCacheDtype::f32, 1);
  const auto s = c.create();
  const auto slot = c.append(s, std::vector<int64_t>{0})[0];
  std::vector<float> k = random_vector(kKv, 3), v = random_vector(kKv, 4);
  k[0] = std::numeric_limits<float>::denorm_min();
  k[1] = std::nanf("0x1234");
  c.write(0, slot, k.data(), v.data());
  for (int j = 0; j < kKv; ++j) {
    EXPECT_EQ(bits(c.key(0, slot)[j]), bits(k[static_cast<std::size_t>(j)]));
    EXPECT_EQ(bits(c.value(0, slot)[j]), bits(v[static_cast<std::size_t>(j)]));
  }
}

// Values between two 16-bit neighbours round to nearest, ties to even (worked by hand: the f16 ulp at 1 is 2^-10,
// bf16's is 2^-7).
TEST(KvCacheDtype, WritesRoundToNearestEven) {
  const float u16 = std::ldexp(1.0f, -10), ub = std::ldexp(1.0f, -7);
  struct Case {
    KvCacheDtype d;
    float in, want;
  };
  const Case cases[] = {
      {KvCacheDtype::f16, 1.0f + u16 / 2, 1.0f},                 // tie -> even (1.0)
      {KvCacheDtype::f16, 1.0f + 3 * u16 / 2, 1.0f + 2 * u16},   // tie -> even (1 + 2 ulp)
      {KvCacheDtype::f16, 1.0f + u16 * 0.51f, 1.0f + u16},       // above the tie
      {KvCacheDtype::f16, 65519.0f, 65504.0f},                   // below the overflow threshold: max finite
      {KvCacheDtype::f16, 65520.0f, std::numeric_limits<float>::infinity()},
      {KvCacheDtype::bf16, 1.0f + ub / 2, 1.0f},
      {KvCacheDtype::bf16, 1.0f + 3 * ub / 2, 1.0f + 2 * ub},
      {KvCacheDtype::bf16, -(1.0f + ub * 0.75f), -(1.0f + ub)},
  };
  for (const Case& cs : cases) {
    KvCache c = make(cs.d, 1);
    const auto s = c.create();
    const auto slot = c.append(s, std::vector<int64_t>{0})[0];
    std::vector<float> k(kKv, cs.in), v(kKv, -cs.in), out(kKv);
    c.write(0, slot, k.data(), v.data());
    c.read_key(0, slot, out.data());
    EXPECT_EQ(out[5], cs.want) << to_string(cs.d) << " " << cs.in;
    c.read_value(0, slot, out.data());
    EXPECT_EQ(out[5], -cs.want) << to_string(cs.d) << " " << cs.in;
  }
}

TEST(KvCacheDtype, PointersAreFloat32OnlyAndBadSlotsAreTyped) {
  KvCache c = make(KvCacheDtype::f16);
  const auto s = c.create();
  const auto slot = c.append(s, std::vector<int64_t>{0})[0];
  const std::string m = posenc::test::message_of<InvalidArgument>([&] { (void)c.key(0, slot); });
  EXPECT_NE(m.find("f16"), std::string::npos) << m;
  std::vector<KvBlock> blocks;
  EXPECT_THROW(c.blocks(0, s, blocks), InvalidArgument);
  std::vector<float> x(kKv);
  EXPECT_THROW(c.write(2, slot, x.data(), x.data()), InvalidArgument);
  EXPECT_THROW(c.write(0, {7, 0}, x.data(), x.data()), InvalidArgument);
  EXPECT_THROW(c.read_key(0, {0, 4}, x.data()), InvalidArgument);
}

// The bytes the blocks hold halve, counted by the cache and measured on the heap (glibc's mallinfo2).
TEST(KvCacheDtype, MemoryHalves) {
  KvCache::Config cfg;
  cfg.n_layers = 8;
  cfg.kv_heads = 8;
  cfg.head_dim = 64;
  cfg.block_size = 16;
  std::vector<int64_t> pos(4096);
  std::iota(pos.begin(), pos.end(), 0);
  int64_t counted[3] = {}, heap[3] = {};
  // Bytes in use on the heap: arena chunks plus the chunks glibc mmaps (blocks of 512 KiB / 256 KiB are above its
  // mmap threshold).
  auto in_use = [] {
    const struct mallinfo2 mi = mallinfo2();
    return static_cast<int64_t>(mi.uordblks + mi.hblkhd);
  };
  for (KvCacheDtype d : {KvCacheDtype::f32, KvCacheDtype::f16, KvCacheDtype::bf16}) {
    cfg.dtype = d;
    const int64_t before = in_use();
    {
      KvCache c(cfg);
      const auto s = c.create();
      (void)c.append(s, pos);
      counted[static_cast<int>(d)] = c.kv_bytes_allocated();
      heap[static_cast<int>(d)] = in_use() - before;
      EXPECT_EQ(c.kv_bytes_allocated(), c.blocks_allocated() * cfg.block_size * c.kv_bytes_per_token());
    }
  }
  // 4096 tokens x 8 layers x 2 x 8 heads x 64 = 64 MiB of float32 elements.
  EXPECT_EQ(counted[0], int64_t{4096} * 8 * 2 * 8 * 64 * 4);
  EXPECT_EQ(counted[1] * 2, counted[0]);
  EXPECT_EQ(counted[2] * 2, counted[0]);
  if (posenc::test::kAddressSanitizer) GTEST_SKIP() << "ASan's allocator does not report through mallinfo2";
  // The heap grows by the element buffers plus small per-block bookkeeping (positions, token ids: 12 bytes a slot).
  for (int d = 0; d < 3; ++d) {
    EXPECT_GE(heap[d], counted[d]) << d;
    EXPECT_LE(heap[d], counted[d] + counted[d] / 20) << d;
  }
  EXPECT_LT(static_cast<double>(heap[1]) / static_cast<double>(heap[0]), 0.53);
}

// Attention over an f16/bf16 cache equals, bit for bit, attention over float32 blocks holding the same keys/values
// rounded with float16.hpp (the widening is exact and nothing else changes); and it differs from the unrounded one.
TEST(KvCacheDtype, AttentionOverARoundedCacheEqualsAttentionOverRoundedFloat32) {
  const int64_t n = 37;  // several blocks of 4, the last one partial
  std::vector<int64_t> pos(n);
  std::iota(pos.begin(), pos.end(), 0);
  const std::vector<float> k = random_vector(n * kLayers * kKv, 11), v = random_vector(n * kLayers * kKv, 12);
  AttentionSpec spec;
  spec.heads = 4;
  spec.kv_heads = kHeads;
  spec.head_dim = kDim;
  const int64_t q_tokens = 5;
  const std::vector<float> q = random_vector(q_tokens * 4 * kDim, 13, 2.0f);
  const std::vector<int64_t> q_pos{3, 17, 30, 35, 36};
  // as_stored: the blocks in the cache's dtype (16-bit rows read in place), as the model hands them over.
  auto run = [&](const KvCache& c, KvCache::SeqId s, int layer, bool as_stored = false) {
    std::vector<KvBlock> blocks;
    std::vector<float> widened;
    if (as_stored)
      c.blocks_as_stored(layer, s, blocks);
    else
      c.blocks(layer, s, blocks, widened);
    std::vector<float> out(q.size());
    attention_forward(spec, q.data(), q_pos, blocks, out.data());
    if (as_stored && c.config().dtype != KvCacheDtype::f32) {
      for (const KvBlock& b : blocks) EXPECT_TRUE(b.dtype == c.config().dtype && b.k16 && b.v16 && !b.k && !b.v);
    }
    return out;
  };
  KvCache exact = make(KvCacheDtype::f32);
  const auto se = exact.create();
  fill(exact, exact.append(se, pos), k, v);
  for (KvCacheDtype d : kHalfDtypes) {
    KvCache half = make(d);
    const auto sh = half.create();
    fill(half, half.append(sh, pos), k, v);
    std::vector<float> kr(k.size()), vr(v.size());
    std::transform(k.begin(), k.end(), kr.begin(), [&](float x) { return round_as(d, x); });
    std::transform(v.begin(), v.end(), vr.begin(), [&](float x) { return round_as(d, x); });
    KvCache rounded = make(KvCacheDtype::f32);
    const auto sr = rounded.create();
    fill(rounded, rounded.append(sr, pos), kr, vr);
    for (int l = 0; l < kLayers; ++l) {
      const auto a = run(half, sh, l), b = run(rounded, sr, l), e = run(exact, se, l);
      const auto in_place = run(half, sh, l, true);
      std::size_t differ = 0, differ_in_place = 0, from_exact = 0;
      for (std::size_t i = 0; i < a.size(); ++i) {
        differ += bits(a[i]) != bits(b[i]);
        differ_in_place += bits(in_place[i]) != bits(b[i]);
        from_exact += a[i] != e[i];
      }
      EXPECT_EQ(differ, 0u) << to_string(d) << " layer " << l;
      EXPECT_EQ(differ_in_place, 0u) << to_string(d) << " layer " << l << " (blocks_as_stored)";
      // A decode step (1 query token: 2 rows per KV head), where an AVX2 build reads the 16-bit rows in place.
      const std::vector<int64_t> one{36};
      std::vector<KvBlock> stored, widened_blocks;
      std::vector<float> wbuf;
      half.blocks_as_stored(l, sh, stored);
      half.blocks(l, sh, widened_blocks, wbuf);
      std::vector<float> o16(4 * kDim), o32(4 * kDim);
      attention_forward(spec, q.data(), one, stored, o16.data());
      attention_forward(spec, q.data(), one, widened_blocks, o32.data());
      for (std::size_t i = 0; i < o16.size(); ++i)
        EXPECT_EQ(bits(o16[i]), bits(o32[i])) << to_string(d) << " layer " << l << " decode, element " << i;
      EXPECT_GT(from_exact, a.size() / 2) << to_string(d) << " layer " << l;  // the rounding is real
    }
  }
}

// Prefix reuse: a fork shares the rounded blocks, copy-on-write keeps the parent's bits.
TEST(KvCacheDtype, ForkCopyOnWriteKeepsTheParentsBits) {
  for (KvCacheDtype d : kHalfDtypes) {
    KvCache c = make(d);
    const auto p = c.create();
    std::vector<int64_t> pos{0, 1, 2, 3, 4, 5};
    const std::vector<float> k = random_vector(pos.size() * kLayers * kKv, 21), v = random_vector(k.size(), 22);
    fill(c, c.append(p, pos), k, v);
    const int64_t before = c.blocks_in_use();
    const auto f = c.fork(p);
    EXPECT_EQ(c.blocks_in_use(), before);  // shared
    const std::vector<float> k2 = random_vector(kLayers * kKv, 23), v2 = random_vector(kLayers * kKv, 24);
    const auto fs = c.append(f, std::vector<int64_t>{6});  // the shared partial block is copied here
    fill(c, fs, k2, v2);
    EXPECT_EQ(c.blocks_in_use(), before + 1);
    std::vector<KvBlock> bp, bf;
    std::vector<float> wp, wf;
    c.blocks(1, p, bp, wp);
    c.blocks(1, f, bf, wf);
    ASSERT_EQ(bp.size(), 2u);
    ASSERT_EQ(bf.size(), 2u);
    EXPECT_EQ(bp[1].n_tokens, 2);
    EXPECT_EQ(bf[1].n_tokens, 3);
    for (int t = 0; t < 6; ++t) {
      const KvBlock& b = bp[static_cast<std::size_t>(t / 4)];
      const KvBlock& g = bf[static_cast<std::size_t>(t / 4)];
      for (int j = 0; j < kKv; ++j) {
        const float want = round_as(d, k[(static_cast<std::size_t>(t) * kLayers + 1) * kKv + static_cast<std::size_t>(j)]);
        EXPECT_EQ(bits(b.k[(t % 4) * kKv + j]), bits(want));
        EXPECT_EQ(bits(g.k[(t % 4) * kKv + j]), bits(want));
      }
    }
    for (int j = 0; j < kKv; ++j)
      EXPECT_EQ(bits(bf[1].v[2 * kKv + j]), bits(round_as(d, v2[kKv + static_cast<std::size_t>(j)])));
  }
}

// shift() and the rerotate policy work on the widened keys and round them again: the result is exactly
// round(rotate(widen(stored))).
TEST(KvCacheDtype, ShiftAndRerotateRoundTheRotatedKeysAgain) {
  RopeParams p;
  p.head_dim = kDim;
  const RopeFrequencies freqs = compute_rope_frequencies(p);
  RopeParams p2 = p;
  p2.rope_theta = 500.0;
  const RopeFrequencies freqs2 = compute_rope_frequencies(p2);
  for (KvCacheDtype d : kHalfDtypes) {
    for (bool rerotate : {false, true}) {
      KvCache c = make(d);
      const auto s = c.create();
      std::vector<int64_t> pos{10, 11, 12, 13, 14};
      c.set_rope_state(s, {freqs, RopeLayout::half, AnglePrecision::float32}, false);
      const std::vector<float> k = random_vector(pos.size() * kLayers * kKv, 31), v = random_vector(k.size(), 32);
      const auto slots = c.append(s, pos);
      fill(c, slots, k, v);
      // The expectation, from what is stored now.
      std::vector<float> want(pos.size() * kKv);
      for (std::size_t i = 0; i < pos.size(); ++i) c.read_key(1, slots[i], want.data() + i * kKv);
      std::vector<int64_t> after = pos;
      if (rerotate) {
        const RopeTable undo(freqs, pos, AnglePrecision::float32), redo(freqs2, pos, AnglePrecision::float32);
        apply_rope(want.data(), static_cast<int64_t>(pos.size()), kHeads, kDim, undo, RopeLayout::half,
                   RopeDirection::inverse);
        apply_rope(want.data(), static_cast<int64_t>(pos.size()), kHeads, kDim, redo, RopeLayout::half);
        c.set_rope_state(s, {freqs2, RopeLayout::half, AnglePrecision::float32}, true);
      } else {
        const std::vector<int64_t> delta(pos.size(), -10);
        const RopeTable table(freqs, delta, AnglePrecision::float32);
        apply_rope(want.data(), static_cast<int64_t>(pos.size()), kHeads, kDim, table, RopeLayout::half);
        c.shift(s, -10);
        for (auto& x : after) x -= 10;
      }
      for (float& x : want) x = round_as(d, x);
      EXPECT_EQ(c.positions(s), after);
      std::vector<float> got(kKv);
      std::size_t differ = 0;
      for (std::size_t i = 0; i < pos.size(); ++i) {
        c.read_key(1, slots[i], got.data());
        for (int j = 0; j < kKv; ++j) differ += bits(got[static_cast<std::size_t>(j)]) != bits(want[i * kKv + static_cast<std::size_t>(j)]);
        // Values are not rotated: still the first rounding.
        c.read_value(1, slots[i], got.data());
        for (int j = 0; j < kKv; ++j)
          differ += bits(got[static_cast<std::size_t>(j)]) !=
                    bits(round_as(d, v[(i * kLayers + 1) * kKv + static_cast<std::size_t>(j)]));
      }
      EXPECT_EQ(differ, 0u) << to_string(d) << (rerotate ? " rerotate" : " shift");
    }
  }
}

// KvCache::write of a KV head range stores, for those heads, exactly what write() stores, leaves the other heads
// as they were, and two disjoint ranges make the whole row; a range outside [0, kv_heads] is refused by name.
TEST(KvCacheDtype, WritingAHeadRangeStoresWhatWriteStoresForThoseHeads) {
  for (KvCacheDtype dtype : {KvCacheDtype::f32, KvCacheDtype::f16, KvCacheDtype::bf16}) {
    KvCache::Config cfg;
    cfg.n_layers = 2;
    cfg.kv_heads = 4;
    cfg.head_dim = 8;
    cfg.block_size = 4;
    cfg.dtype = dtype;
    const std::size_t row = 32;
    std::vector<float> k(row), v(row), k2(row), v2(row);
    for (std::size_t i = 0; i < row; ++i) {
      k[i] = 0.1f * static_cast<float>(i) - 1.3f;
      v[i] = 1.0f / (1.0f + static_cast<float>(i));
      k2[i] = -7.0f;
      v2[i] = 9.0f;
    }
    KvCache whole(cfg), parts(cfg);
    const auto sw = whole.create(), sp = parts.create();
    const auto slot_w = whole.append(sw, std::vector<int64_t>{0}).at(0);
    const auto slot_p = parts.append(sp, std::vector<int64_t>{0}).at(0);
    whole.write(1, slot_w, k.data(), v.data());
    parts.write(1, slot_p, k2.data(), v2.data());  // something else first: the ranges must overwrite all of it
    parts.write(1, slot_p, k.data(), v.data(), 0, 1);
    std::vector<float> got(row), want(row);
    parts.read_key(1, slot_p, got.data());
    whole.read_key(1, slot_w, want.data());
    EXPECT_EQ(std::memcmp(got.data(), want.data(), 8 * sizeof(float)), 0) << to_string(dtype) << ": head 0";
    std::vector<float> other(row);
    KvCache ref(cfg);
    const auto sr = ref.create();
    const auto slot_r = ref.append(sr, std::vector<int64_t>{0}).at(0);
    ref.write(1, slot_r, k2.data(), v2.data());
    ref.read_key(1, slot_r, other.data());
    EXPECT_EQ(std::memcmp(got.data() + 8, other.data() + 8, 24 * sizeof(float)), 0)
        << to_string(dtype) << ": heads 1-3 were written";
    parts.write(1, slot_p, k.data(), v.data(), 1, 4);
    parts.write(1, slot_p, k.data(), v.data(), 2, 2);  // empty: nothing
    parts.read_key(1, slot_p, got.data());
    EXPECT_EQ(std::memcmp(got.data(), want.data(), row * sizeof(float)), 0) << to_string(dtype) << ": keys";
    parts.read_value(1, slot_p, got.data());
    whole.read_value(1, slot_w, want.data());
    EXPECT_EQ(std::memcmp(got.data(), want.data(), row * sizeof(float)), 0) << to_string(dtype) << ": values";
    for (const auto& [b, e] : std::vector<std::pair<int, int>>{{-1, 2}, {3, 2}, {0, 5}}) {
      try {
        parts.write(1, slot_p, k.data(), v.data(), b, e);
        ADD_FAILURE() << "no exception for [" << b << ", " << e << ")";
      } catch (const InvalidArgument& ex) {
        EXPECT_NE(std::string(ex.what()).find("num_key_value_heads"), std::string::npos) << ex.what();
      }
    }
  }
}

}  // namespace POSENC_UNITY_ID
