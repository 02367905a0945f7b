// M-RoPE in the runtime: a small random-weight Qwen2-VL-style model (posenc
// checkpoint, family mrope) run through Model::forward and the KV cache.
//
// Acceptance of issue 16 (M-RoPE): with an image span, chunked prefill + decode
// equals one whole forward to <= 1e-5; an M-RoPE model whose three rows are equal
// equals plain RoPE. Position ids come from mrope_position_ids (HF
// Qwen2VLModel.get_rope_index), decode continues from the rope delta as
// Qwen2_5_VLModel.forward does (cache_position[0] + rope_deltas).
// On main these could not run at all: save_posenc_checkpoint refused family
// mrope ("mrope models are not supported by the posenc checkpoint format") and
// the loader refused it ("mrope models are not run by this runtime").
#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <omp.h>

#include "model/kernels_dense.hpp"
#include "posenc/checkpoint.hpp"
#include "posenc/consistency.hpp"
#include "posenc/error.hpp"
#include "posenc/model.hpp"
#include "posenc/mrope.hpp"
#include "random_checkpoint.hpp"
#include "test_support.hpp"

namespace POSENC_UNITY_ID {  // this file's own namespace in the tests' unity build (CMakeLists.txt)

using namespace posenc;

namespace {

constexpr int kVocab = 24, kDim = 64, kHeads = 4, kKvHeads = 2, kHeadDim = 16, kHidden = 96, kLayers = 2;

/// dim 64, 4 heads of 16 channels (8 pairs, mrope_section [4, 2, 2]), 2 kv heads,
/// 2 layers, random weights (seeded).
PosencCheckpoint random_checkpoint(PositionFamily family, MropeMapping mapping = MropeMapping::chunked,
                                   uint32_t seed = 5) {
  PosencCheckpoint ck;
  ModelConfig& c = ck.config;
  c.dim = kDim;
  c.hidden_dim = kHidden;
  c.n_layers = kLayers;
  c.n_heads = kHeads;
  c.n_kv_heads = kKvHeads;
  c.vocab_size = kVocab;
  c.max_position_embeddings = 256;
  c.shared_classifier = false;
  c.head_dim = kHeadDim;
  ck.positional.family = family;
  RopeParams p;
  p.head_dim = kHeadDim;
  p.rope_theta = 10000.0;
  ck.positional.rope.params = p;
  ck.positional.rope.freqs = compute_rope_frequencies(p);
  ck.positional.rope.layout = RopeLayout::half;  // Qwen2-VL: rotate_half
  if (family == PositionFamily::mrope) {
    ck.positional.mrope_section = {4, 2, 2};
    ck.positional.mrope_mapping = mapping;
  }
  posenc::test::RandomTensors(ck, seed, 0.3f).add_llama();
  return ck;
}

Model save_and_load(const posenc::test::TempDir& d, const std::string& name, const PosencCheckpoint& ck) {
  const auto path = d.path() / name;
  save_posenc_checkpoint(path, ck);
  return Model::load(path);
}

std::vector<int32_t> tokens(std::size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> v(n);
  for (auto& x : v) x = static_cast<int32_t>(rng() % kVocab);
  return v;
}

/// Columns [from, from + n) of a [3, total] row-major id array.
std::vector<int64_t> columns(const std::vector<int64_t>& ids, int64_t total, int64_t from, int64_t n) {
  std::vector<int64_t> out;
  for (int r = 0; r < 3; ++r)
    out.insert(out.end(), ids.begin() + r * total + from, ids.begin() + r * total + from + n);
  return out;
}

double max_diff(const std::vector<float>& a, const std::vector<float>& b) {
  EXPECT_EQ(a.size(), b.size());
  double d = 0;
  for (std::size_t i = 0; i < std::min(a.size(), b.size()); ++i)
    d = std::max(d, static_cast<double>(std::fabs(a[i] - b[i])));
  return d;
}

/// Logits of every token of one whole forward with explicit 3-row ids.
std::vector<float> whole_forward(const Model& m, std::span<const int32_t> toks, std::span<const int64_t> ids) {
  KvCache cache = m.make_cache(8);
  const KvCache::SeqId s = cache.create();
  Model::SequenceInput in{s, toks, {}, ids};
  std::vector<float> logits;
  m.forward(cache, std::span(&in, 1), Model::LogitsMode::all, logits);
  return logits;
}

// 5 text tokens, an image (grid 1 x 4 x 6, merge 2 -> 6 tokens), 4 text tokens:
// the prompt (15 tokens, rope delta -3); then 5 decoded text tokens.
const std::vector<MropeSpan> kPrompt{MropeSpan::text(5), MropeSpan::image(1, 4, 6), MropeSpan::text(4)};
constexpr int64_t kPromptLen = 15, kDecode = 5;

}  // namespace

// The acceptance case, for both mappings: chunked prefill (chunks of 4, explicit
// rows) + token-by-token decode (no ids: the runtime continues from the delta)
// equals one whole forward over prompt + decoded tokens to <= 1e-5.
TEST(MropeModel, ImageSpanChunkedPrefillAndDecodeEqualOneWholeForward) {
  posenc::test::TempDir d;
  for (MropeMapping mapping : {MropeMapping::chunked, MropeMapping::interleaved}) {
    SCOPED_TRACE(std::string(to_string(mapping)));
    const Model m = save_and_load(d, "m.pt", random_checkpoint(PositionFamily::mrope, mapping));
    ASSERT_EQ(m.family(), PositionFamily::mrope);
    ASSERT_EQ(m.positional().mrope_section, (std::vector<int>{4, 2, 2}));
    ASSERT_EQ(m.positional().mrope_mapping, mapping);

    const MropePositionIds prompt = mrope_position_ids(kPrompt, {});
    ASSERT_EQ(prompt.tokens, kPromptLen);
    ASSERT_EQ(prompt.rope_delta, -3);
    auto full_spans = kPrompt;
    full_spans.back() = MropeSpan::text(4 + kDecode);
    const MropePositionIds full = mrope_position_ids(full_spans, {});
    const int64_t N = full.tokens;
    const auto toks = tokens(static_cast<std::size_t>(N), 9);
    const std::vector<float> ref = whole_forward(m, toks, full.position_ids);

    KvCache cache = m.make_cache(4);  // small blocks: the rows cross block boundaries
    const KvCache::SeqId s = cache.create();
    std::vector<float> got, logits;
    for (int64_t at = 0; at < kPromptLen; at += 4) {
      const int64_t n = std::min<int64_t>(4, kPromptLen - at);
      const auto rows = columns(prompt.position_ids, kPromptLen, at, n);
      Model::SequenceInput in{s, std::span(toks).subspan(static_cast<std::size_t>(at), static_cast<std::size_t>(n)), {},
                              rows};
      m.forward(cache, std::span(&in, 1), Model::LogitsMode::all, logits);
      got.insert(got.end(), logits.begin(), logits.end());
    }
    EXPECT_EQ(cache.mrope_delta(s), -3);
    EXPECT_EQ(cache.next_position(s), kPromptLen);
    for (int64_t i = kPromptLen; i < N; ++i) {
      // Alternate: no ids at all, and explicit 1-D ids (as forward_padded gives); both add the delta.
      const int64_t p1 = i;
      Model::SequenceInput in{s, std::span(toks).subspan(static_cast<std::size_t>(i), 1), {}};
      if (i % 2 == 0) in.position_ids = std::span(&p1, 1);
      m.forward(cache, std::span(&in, 1), Model::LogitsMode::all, logits);
      got.insert(got.end(), logits.begin(), logits.end());
    }
    const double diff = max_diff(got, ref);
    EXPECT_LE(diff, 1e-5) << "chunked prefill + decode vs whole forward";
    std::printf("[mrope %s] chunked prefill (4) + %lld decode steps vs whole forward: max |diff| = %.3g\n",
                std::string(to_string(mapping)).c_str(), static_cast<long long>(kDecode), diff);
    // The cache carries the 3 rows of every token, as the builder gave them.
    EXPECT_EQ(cache.mrope_positions(s), full.position_ids);
    EXPECT_EQ(cache.mrope_delta(s), full.rope_delta);

    // The check can fail: the image's rows matter, and so does the delta.
    std::vector<int64_t> flat;  // 1-D positions in all three rows
    for (int r = 0; r < 3; ++r)
      for (int64_t i = 0; i < N; ++i) flat.push_back(i);
    EXPECT_GT(max_diff(whole_forward(m, toks, flat), ref), 1e-3);
    KvCache c2 = m.make_cache(4);
    const KvCache::SeqId s2 = c2.create();
    Model::SequenceInput pre{s2, std::span(toks).subspan(0, kPromptLen), {}, prompt.position_ids};
    m.forward(c2, std::span(&pre, 1), Model::LogitsMode::all, logits);
    // A decode step that forgets the delta (rows = 1-D position 15, not 15 - 3 = 12).
    const std::vector<int64_t> no_delta{kPromptLen, kPromptLen, kPromptLen};
    Model::SequenceInput step{s2, std::span(toks).subspan(kPromptLen, 1), {}, no_delta};
    m.forward(c2, std::span(&step, 1), Model::LogitsMode::all, logits);
    const std::vector<float> ref_row(ref.begin() + kPromptLen * kVocab, ref.begin() + (kPromptLen + 1) * kVocab);
    EXPECT_GT(max_diff(logits, ref_row), 1e-4);
  }
}

// With all three rows equal, an M-RoPE model is the plain RoPE model with the
// same weights, in both mappings, with or without explicit rows.
TEST(MropeModel, AllEqualRowsEqualPlainRope) {
  posenc::test::TempDir d;
  const Model rope = save_and_load(d, "rope.pt", random_checkpoint(PositionFamily::rope));
  const auto toks = tokens(20, 4);
  const std::vector<float> ref = rope.score_window(toks);
  for (MropeMapping mapping : {MropeMapping::chunked, MropeMapping::interleaved}) {
    SCOPED_TRACE(std::string(to_string(mapping)));
    const Model m = save_and_load(d, "mrope.pt", random_checkpoint(PositionFamily::mrope, mapping));
    EXPECT_LE(max_diff(m.score_window(toks), ref), 1e-6);
    const MropePositionIds text = mrope_position_ids(std::vector<MropeSpan>{MropeSpan::text(20)}, {});
    EXPECT_LE(max_diff(whole_forward(m, toks, text.position_ids), ref), 1e-6);
    std::printf("[mrope %s] equal rows vs plain RoPE: max |diff| = %.3g\n", std::string(to_string(mapping)).c_str(),
                max_diff(whole_forward(m, toks, text.position_ids), ref));
  }
}

TEST(MropeModel, BadRowsAreRefusedBeforeTheCacheIsTouched) {
  posenc::test::TempDir d;
  const Model m = save_and_load(d, "m.pt", random_checkpoint(PositionFamily::mrope));
  const Model rope = save_and_load(d, "rope.pt", random_checkpoint(PositionFamily::rope));
  const auto toks = tokens(4, 1);
  const std::vector<int64_t> short_rows(11, 0);  // 3 x 4 = 12 needed
  KvCache cache = m.make_cache(4);
  const KvCache::SeqId s = cache.create();
  std::vector<float> logits;
  Model::SequenceInput bad{s, toks, {}, short_rows};
  const std::string msg =
      posenc::test::message_of<InvalidArgument>([&] { m.forward(cache, std::span(&bad, 1), Model::LogitsMode::all, logits); });
  EXPECT_NE(msg.find("mrope_position_ids: 11 entries for [3, 4]"), std::string::npos) << msg;
  EXPECT_EQ(cache.size(s), 0);
  const std::vector<int64_t> rows(12, 0);
  KvCache rc = rope.make_cache(4);
  const KvCache::SeqId rs = rc.create();
  Model::SequenceInput wrong{rs, toks, {}, rows};
  const std::string msg2 = posenc::test::message_of<InvalidArgument>(
      [&] { rope.forward(rc, std::span(&wrong, 1), Model::LogitsMode::all, logits); });
  EXPECT_NE(msg2.find("family is rope, not mrope"), std::string::npos) << msg2;
  EXPECT_EQ(rc.size(rs), 0);
}

TEST(MropeModel, CheckpointRoundTripsTheSectionAndRefusesABadOne) {
  posenc::test::TempDir d;
  const Model m = save_and_load(d, "m.pt", random_checkpoint(PositionFamily::mrope, MropeMapping::interleaved));
  const PosencCheckpoint back = m.to_checkpoint();
  EXPECT_EQ(back.positional.family, PositionFamily::mrope);
  EXPECT_EQ(back.positional.mrope_section, (std::vector<int>{4, 2, 2}));
  EXPECT_EQ(back.positional.mrope_mapping, MropeMapping::interleaved);
  PosencCheckpoint bad = random_checkpoint(PositionFamily::mrope);
  bad.positional.mrope_section = {4, 2, 1};
  const std::string msg =
      posenc::test::message_of<InvalidArgument>([&] { save_posenc_checkpoint(d.path() / "bad.pt", bad); });
  EXPECT_NE(msg.find("positional.mrope_section"), std::string::npos) << msg;
  EXPECT_NE(msg.find("sum to 7"), std::string::npos) << msg;
}

// The KV cache's 3-row storage: forks share the rows, copy-on-write keeps the
// parent's, shift moves all three rows (and re-rotates keys by the same delta).
TEST(KvCacheMrope, RowsFollowForkCopyOnWriteAndShift) {
  KvCache::Config kc;
  kc.n_layers = 1;
  kc.kv_heads = 1;
  kc.head_dim = 4;
  kc.block_size = 2;
  KvCache cache(kc);
  const KvCache::SeqId s = cache.create();
  const std::vector<int64_t> pos{0, 1, 2};
  const auto slots = cache.append(s, pos);
  const std::vector<int64_t> rows{0, 1, 1, 0, 1, 2, 0, 2, 2};  // t | h | w
  cache.set_mrope_positions(s, slots, rows);
  EXPECT_EQ(cache.mrope_positions(s), rows);
  EXPECT_EQ(cache.mrope_delta(s), 3 - 3);
  const KvCache::SeqId f = cache.fork(s);
  const std::vector<int64_t> p3{3};
  const auto fs = cache.append(f, p3);  // copy-on-write of the shared last block
  cache.set_mrope_positions(f, fs, std::vector<int64_t>{7, 8, 9});
  EXPECT_EQ(cache.mrope_positions(f), (std::vector<int64_t>{0, 1, 1, 7, 0, 1, 2, 8, 0, 2, 2, 9}));
  EXPECT_EQ(cache.mrope_positions(s), rows);  // the parent is untouched
  EXPECT_EQ(cache.mrope_delta(f), 10 - 4);
  cache.shift(f, 5, 1);
  EXPECT_EQ(cache.mrope_positions(f), (std::vector<int64_t>{0, 6, 6, 12, 0, 6, 7, 13, 0, 7, 7, 14}));
  EXPECT_EQ(cache.mrope_delta(f), 15 - 9);
  EXPECT_THROW(cache.set_mrope_positions(s, slots, std::vector<int64_t>(8)), InvalidArgument);
  // A token appended without rows reads its 1-D position in all three.
  const KvCache::SeqId plain = cache.create();
  (void)cache.append(plain, pos);
  EXPECT_EQ(cache.mrope_positions(plain), (std::vector<int64_t>{0, 1, 2, 0, 1, 2, 0, 1, 2}));
  EXPECT_EQ(cache.mrope_delta(plain), 0);
}

// The fuzz seed fuzz/corpus/posenc_checkpoint/mrope.posenc (make_seeds.py) loads
// as an interleaved M-RoPE model; the same header with a section that does not
// sum to rotary_dim/2 is a CheckpointError naming the file and the field.
TEST(MropeModel, SeedCheckpointLoadsAndABadHeaderSectionIsACheckpointError) {
  const auto seed = std::filesystem::path(POSENC_SOURCE_DIR) / "fuzz/corpus/posenc_checkpoint/mrope.posenc";
  const Model m = Model::load(seed);
  EXPECT_EQ(m.family(), PositionFamily::mrope);
  EXPECT_EQ(m.positional().mrope_section, (std::vector<int>{1, 1, 0}));
  EXPECT_EQ(m.positional().mrope_mapping, MropeMapping::interleaved);
  std::ifstream in(seed, std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const std::string from = "\"mrope_section\":[1,1,0]";
  const auto at = bytes.find(from);
  ASSERT_NE(at, std::string::npos);
  bytes.replace(at, from.size(), "\"mrope_section\":[1,1,1]");  // same length: offsets unchanged
  posenc::test::TempDir d;
  const auto bad = d.file("bad.posenc", bytes);
  const std::string msg = posenc::test::message_of<CheckpointError>([&] { (void)Model::load(bad); });
  EXPECT_NE(msg.find("bad.posenc: header field positional.mrope_section"), std::string::npos) << msg;
  EXPECT_NE(msg.find("sum to 3, expected rotary_dim/2 = 2"), std::string::npos) << msg;
}

// A ragged batch (an image sequence and a text sequence in one step) equals
// running each alone; the text sequence keeps delta 0.
TEST(MropeModel, RaggedBatchWithAnImageSequenceEqualsSeparateForwards) {
  posenc::test::TempDir d;
  const Model m = save_and_load(d, "m.pt", random_checkpoint(PositionFamily::mrope));
  const MropePositionIds img = mrope_position_ids(kPrompt, {});
  const auto a = tokens(static_cast<std::size_t>(img.tokens), 2), b = tokens(7, 3);
  KvCache cache = m.make_cache(4);
  const KvCache::SeqId sa = cache.create(), sb = cache.create();
  const std::vector<Model::SequenceInput> batch{{sa, a, {}, img.position_ids}, {sb, b, {}}};
  std::vector<float> logits;
  m.forward(cache, batch, Model::LogitsMode::all, logits);
  const std::vector<float> ra = whole_forward(m, a, img.position_ids);
  const std::vector<float> rb = m.score_window(b);
  std::vector<float> want = ra;
  want.insert(want.end(), rb.begin(), rb.end());
  EXPECT_LE(max_diff(logits, want), 1e-5);
  EXPECT_EQ(cache.mrope_delta(sa), -3);
  EXPECT_EQ(cache.mrope_delta(sb), 0);
}

// The cache consistency checker runs on an M-RoPE model (text streams: rows all
// equal, decode continuing from delta 0) and every scenario it runs passes.
TEST(MropeModel, ConsistencyCheckerPassesOnTextStreams) {
  posenc::test::TempDir d;
  const Model m = save_and_load(d, "m.pt", random_checkpoint(PositionFamily::mrope, MropeMapping::interleaved));
  const auto stream = tokens(1200, 8);
  const ConsistencyReport r = check_cache_consistency(m, stream, {});
  for (const auto& s : r.scenarios) {
    if (!s.skipped.empty()) continue;
    EXPECT_EQ(s.failure, "") << s.name;
    EXPECT_LE(s.max_abs_logit_diff, 1e-4) << s.name;
  }
  EXPECT_TRUE(r.passed);
  int ran = 0;
  for (const auto& s : r.scenarios) ran += s.skipped.empty() ? 1 : 0;
  EXPECT_GE(ran, 8);  // all but context_shift (RoPE only)
  std::printf("[mrope] consistency checker: %d of %zu scenarios ran, passed %d\n", ran, r.scenarios.size(),
              static_cast<int>(r.passed));
}

// forward_padded (1-D positions from the mask) continues an image sequence from
// its rope delta, as a decode step without ids does.
TEST(MropeModel, PaddedDecodeStepContinuesFromTheDelta) {
  posenc::test::TempDir d;
  const Model m = save_and_load(d, "m.pt", random_checkpoint(PositionFamily::mrope));
  const MropePositionIds prompt = mrope_position_ids(kPrompt, {});
  auto spans = kPrompt;
  spans.back() = MropeSpan::text(5);
  const MropePositionIds full = mrope_position_ids(spans, {});
  const auto toks = tokens(static_cast<std::size_t>(full.tokens), 6);
  const std::vector<float> ref = whole_forward(m, toks, full.position_ids);
  KvCache cache = m.make_cache(4);
  const KvCache::SeqId s = cache.create();
  Model::SequenceInput pre{s, std::span(toks).subspan(0, kPromptLen), {}, prompt.position_ids};
  std::vector<float> logits;
  m.forward(cache, std::span(&pre, 1), Model::LogitsMode::all, logits);
  const std::vector<int32_t> padded{0, toks[kPromptLen]};  // left padding
  const std::vector<uint8_t> mask{0, 1};
  m.forward_padded(cache, std::span(&s, 1), padded, mask, 2, logits);
  const std::vector<float> got(logits.begin() + kVocab, logits.end());
  const std::vector<float> want(ref.begin() + kPromptLen * kVocab, ref.begin() + (kPromptLen + 1) * kVocab);
  EXPECT_LE(max_diff(got, want), 1e-5);
}

// The decode team (Model::forward's one team of threads for a one-token step) rotates each thread's own Q and K
// heads with the M-RoPE table when the KV heads split evenly (2 KV heads on 2 threads), one thread all of them
// otherwise (3 threads): after an image prompt, decode steps give the bits of a region per projection.
TEST(MropeModel, DecodeTeamGivesTheBitsOfARegionPerProjection) {
  if (!detail::dense_kernel_supported(detail::DenseKernel::avx512))
    GTEST_SKIP() << "the decode team runs the AVX-512 one-row product; this CPU has no AVX-512";
  if (omp_get_thread_limit() < 2) GTEST_SKIP() << "OMP_THREAD_LIMIT leaves no second thread for a team";
  posenc::test::TempDir d;
  const int threads_before = omp_get_max_threads();
  const Model m = save_and_load(d, "m.pt", random_checkpoint(PositionFamily::mrope, MropeMapping::interleaved));
  const MropePositionIds prompt = mrope_position_ids(kPrompt, {});
  const auto toks = tokens(static_cast<std::size_t>(kPromptLen + kDecode), 3);
  const auto run = [&] {
    KvCache cache = m.make_cache(4);
    const KvCache::SeqId s = cache.create();
    std::vector<float> out, logits;
    Model::SequenceInput pre{s, std::span(toks).subspan(0, kPromptLen), {}, prompt.position_ids};
    m.forward(cache, std::span(&pre, 1), Model::LogitsMode::last, logits);
    for (int64_t i = kPromptLen; i < kPromptLen + kDecode; ++i) {
      Model::SequenceInput in{s, std::span(toks).subspan(static_cast<std::size_t>(i), 1), {}};
      m.forward(cache, std::span(&in, 1), Model::LogitsMode::last, logits);
      out.insert(out.end(), logits.begin(), logits.end());
    }
    return out;
  };
  for (int threads : {2, 3}) {
    omp_set_num_threads(threads);
    detail::set_decode_team(detail::DecodeTeam::always);
    const int64_t before = detail::decode_team_steps();
    const std::vector<float> team = run();
    EXPECT_EQ(detail::decode_team_steps() - before, kDecode) << threads << " threads";
    detail::set_decode_team(detail::DecodeTeam::off);
    const std::vector<float> regions = run();
    ASSERT_EQ(team.size(), regions.size());
    EXPECT_EQ(std::memcmp(team.data(), regions.data(), team.size() * sizeof(float)), 0) << threads << " threads";
  }
  detail::set_decode_team(detail::DecodeTeam::automatic);
  omp_set_num_threads(threads_before);
}

}  // namespace POSENC_UNITY_ID
