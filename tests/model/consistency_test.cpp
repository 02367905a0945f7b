#include <algorithm>
#include <random>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <omp.h>

#include "posenc/checkpoint.hpp"
#include "posenc/consistency.hpp"
#include "posenc/error.hpp"
#include "posenc/io.hpp"
#include "posenc/perplexity.hpp"
#include "random_checkpoint.hpp"
#include "test_support.hpp"

namespace POSENC_UNITY_ID {  // this file's own namespace in the tests' unity build (CMakeLists.txt)

using namespace posenc;

namespace {

struct Fixture {
  Model model = Model::load_llama2c(posenc::test::model_path());
  std::vector<int32_t> stream =
      encode_stream(Tokenizer::load_llama2c(posenc::test::tokenizer_path(), 512), read_file(posenc::test::text_path()));
};
const Fixture& fx() {
  static const Fixture f;
  return f;
}

struct BugGuard {
  explicit BugGuard(detail::PositionBug b) { detail::set_position_bug_for_testing(b); }
  ~BugGuard() { detail::set_position_bug_for_testing(detail::PositionBug::none); }
};

const ConsistencyScenario& find(const ConsistencyReport& r, const std::string& name) {
  for (const auto& s : r.scenarios)
    if (s.name == name) return s;
  throw std::runtime_error("no scenario " + name);
}

/// A posenc checkpoint of `family` with random weights (N(0, 0.4)), trained
/// context `T` (max_position_embeddings; the learned table has T rows),
/// vocabulary 16: what `posenc train --pe <family>` writes, at a size a test
/// runs in milliseconds.
PosencCheckpoint random_checkpoint(PositionFamily family, int64_t T, uint32_t seed = 11) {
  PosencCheckpoint ck;
  posenc::test::set_tiny_llama(ck.config, T);
  ck.positional.family = family;
  if (family == PositionFamily::rope) {
    RopeParams p;
    p.head_dim = 8;
    ck.positional.rope.params = p;
    ck.positional.rope.freqs = compute_rope_frequencies(p);
    ck.positional.rope.layout = RopeLayout::half;
  }
  ck.positional.t5_num_buckets = 16;
  ck.positional.t5_max_distance = 32;
  posenc::test::RandomTensors t(ck, seed, 0.4f);
  t.add_llama();
  if (family == PositionFamily::learned_absolute) t.add("pos_embeddings", {T, 32});
  if (family == PositionFamily::t5_bias) t.add("t5_relative_attention_bias", {16, 4});
  ck.symbols = {"<pad>", "<bos>", "<eos>", "a", "b", "c", "d", "e", "f", "g", "h", "i", "j", "k", "=", "|"};
  return ck;
}

std::vector<int32_t> random_ids(int vocab, std::size_t n, uint64_t seed = 5) {
  std::mt19937_64 rng(seed);
  std::vector<int32_t> v(n);
  for (auto& x : v) x = static_cast<int32_t>(rng() % static_cast<uint64_t>(vocab));
  return v;
}

const PositionFamily kRuntimeFamilies[] = {PositionFamily::rope,    PositionFamily::alibi,
                                           PositionFamily::t5_bias, PositionFamily::learned_absolute,
                                           PositionFamily::sinusoidal, PositionFamily::nope};

}  // namespace

TEST(Consistency, EveryScenarioWithinToleranceOnStories260K) {
  const ConsistencyReport r = check_cache_consistency(fx().model, fx().stream, {});
  EXPECT_TRUE(r.passed);
  // The defaults follow the trained context (seq_len 512): the sizes the
  // checker used to fix for every model are those of a 512-token model.
  EXPECT_EQ(r.plan.length, 512);
  EXPECT_EQ(r.plan.chunk_sizes, (std::vector<int64_t>{7, 64, 512}));
  EXPECT_EQ(r.plan.sliding_window, 64);
  EXPECT_EQ(r.plan.block_size, 16);
  EXPECT_EQ(r.plan.ragged_first, (std::vector<int64_t>{40, 63, 86}));
  EXPECT_EQ(r.plan.ragged_strides, (std::vector<int64_t>{5, 1, 17}));
  ASSERT_EQ(r.scenarios.size(), 9u);
  EXPECT_TRUE(find(r, "context_shift").skipped.empty());  // RoPE: it runs
  for (const auto& s : r.scenarios) {
    EXPECT_LE(s.max_abs_logit_diff, 1e-4) << s.name;
    EXPECT_TRUE(s.failure.empty()) << s.name << ": " << s.failure;
  }
}

TEST(Consistency, CatchesPositionsRestartingEveryChunk) {
  ConsistencyReport r;
  {
    BugGuard bug(detail::PositionBug::restart_each_chunk);
    r = check_cache_consistency(fx().model, fx().stream, {});
  }
  EXPECT_FALSE(r.passed);
  EXPECT_GT(find(r, "chunked_prefill_7").max_abs_logit_diff, 1e-2);
  EXPECT_GT(find(r, "token_by_token").max_abs_logit_diff, 1e-2);
}

TEST(Consistency, CatchesPaddingCountedAsPositions) {
  ConsistencyReport r;
  {
    BugGuard bug(detail::PositionBug::count_padding);
    r = check_cache_consistency(fx().model, fx().stream, {});
  }
  EXPECT_FALSE(r.passed);
  EXPECT_GT(find(r, "left_padded_batch").max_abs_logit_diff, 1e-2);
  EXPECT_NE(find(r, "left_padded_batch").failure.find("cached at position"), std::string::npos);
  EXPECT_LE(find(r, "chunked_prefill_64").max_abs_logit_diff, 1e-4);  // only the padded path is broken
}

// Dynamic NTK changes theta once the length passes the trained context: the
// runtime refuses to mix rotations by default, or re-rotates on request.
TEST(Consistency, DynamicNtkRefusesOrReRotates) {
  const auto methods = rope_scalings();
  if (std::none_of(methods.begin(), methods.end(), [](const RopeScaling& m) { return m.name == "dynamic"; }))
    GTEST_SKIP() << "rope_type dynamic is not registered yet";
  Model m = fx().model;
  RopeSetup r = m.rope();
  r.params.rope_type = "dynamic";
  r.params.factor = 2.0;
  r.params.max_position_embeddings = 512;
  r.freqs = compute_rope_frequencies(r.params, 512);
  m.set_rope(r);
  for (bool rerotate : {false, true}) {
    m.set_rope_change_policy(rerotate ? RopeChangePolicy::rerotate : RopeChangePolicy::refuse);
    KvCache cache = m.make_cache(16);
    const auto seq = cache.create();
    std::vector<float> logits;
    Model::SequenceInput in{seq, std::span(fx().stream.data(), 512), {}};
    m.forward(cache, std::span(&in, 1), Model::LogitsMode::last, logits);  // length 512: default theta
    in = {seq, std::span(fx().stream.data() + 512, 1), {}};
    if (!rerotate) {
      EXPECT_THROW(m.forward(cache, std::span(&in, 1), Model::LogitsMode::last, logits), CacheError);
      EXPECT_EQ(cache.size(seq), 512);  // refused before anything was appended
    } else {
      m.forward(cache, std::span(&in, 1), Model::LogitsMode::last, logits);
      EXPECT_EQ(cache.size(seq), 513);
      EXPECT_EQ(cache.rope_state(seq)->freqs,
                dynamic_ntk_frequencies(r.params, 513, DynamicNtkArithmetic::tensor_float32));
      EXPECT_NE(cache.rope_state(seq)->freqs.inv_freq, compute_rope_frequencies(r.params, 512).inv_freq);
    }
  }
}

// The fixed sizes of the 512-token era (a prompt of n/2 - 40 tokens, another
// of 77) made every length below 80 throw vector::_M_range_insert; now every
// size follows n, and every length from the minimum up runs and passes.
TEST(Consistency, EveryLengthFromTheMinimumTo130RunsAndPasses) {
  // One thread: the steps are tiny, and on a loaded machine the OpenMP team's
  // barriers cost 10x the arithmetic (115 lengths: ~10 s instead of ~140 s).
  const int threads = omp_get_max_threads();
  omp_set_num_threads(1);
  struct Restore {
    int n;
    ~Restore() { omp_set_num_threads(n); }
  } restore{threads};
  for (int64_t n = kMinConsistencyLength; n <= 130; ++n) {
    SCOPED_TRACE(n);
    ConsistencyOptions o;
    o.length = n;
    ConsistencyReport r;
    ASSERT_NO_THROW(r = check_cache_consistency(fx().model, fx().stream, o));
    EXPECT_TRUE(r.passed);
    EXPECT_EQ(r.plan.length, n);
    for (const auto& s : r.scenarios) {
      EXPECT_TRUE(s.skipped.empty()) << s.name;
      EXPECT_GT(s.tokens, 0) << s.name;
      EXPECT_LE(s.max_abs_logit_diff, 1e-4) << s.name;
    }
  }
}

TEST(Consistency, BelowTheMinimumIsATypedErrorNamingLengthAndTheMinimum) {
  for (int64_t n : {int64_t{1}, int64_t{15}}) {
    ConsistencyOptions o;
    o.length = n;
    const std::string msg = posenc::test::message_of<InvalidArgument>(
        [&] { check_cache_consistency(fx().model, fx().stream, o); });
    EXPECT_NE(msg.find("length"), std::string::npos) << msg;
    EXPECT_NE(msg.find("[16, "), std::string::npos) << msg;
    EXPECT_NE(msg.find(std::to_string(n)), std::string::npos) << msg;
  }
  ConsistencyOptions o;
  o.length = 100;
  const std::string msg = posenc::test::message_of<InvalidArgument>(
      [&] { check_cache_consistency(fx().model, std::span(fx().stream).subspan(0, 299), o); });
  EXPECT_NE(msg.find("at least 300"), std::string::npos) << msg;
}

// A model trained at 64 tokens, in every positional family the runtime runs:
// the defaults derive from 64, every scenario passes, and context_shift
// (a RoPE re-rotation) is skipped, by name, for the others.
TEST(Consistency, EveryFamilyTrainedAt64GetsSizesFrom64) {
  posenc::test::TempDir d;
  const auto stream = random_ids(16, 192);
  for (PositionFamily family : kRuntimeFamilies) {
    SCOPED_TRACE(std::string(to_string(family)));
    const auto path = d.path() / (std::string(to_string(family)) + ".pt");
    save_posenc_checkpoint(path, random_checkpoint(family, 64));
    const Model m = Model::load(path);
    ASSERT_EQ(m.trained_context(), 64);
    EXPECT_EQ(default_consistency_length(m), 64);
    const ConsistencyReport r = check_cache_consistency(m, stream, {});
    EXPECT_TRUE(r.passed);
    EXPECT_EQ(r.family, family);
    EXPECT_EQ(r.trained_context, 64);
    const ConsistencyPlan& p = r.plan;
    EXPECT_EQ(p.length, 64);
    EXPECT_EQ(p.block_size, 8);
    EXPECT_EQ(p.chunk_sizes, (std::vector<int64_t>{7, 8, 64}));
    EXPECT_EQ(p.padded_first, (std::vector<int64_t>{32, 21, 11, 21}));
    EXPECT_EQ(p.padded_second, (std::vector<int64_t>{30, 6, 30, 16}));
    EXPECT_EQ(p.padded_decode_steps, 2);
    EXPECT_EQ(p.ragged_totals, (std::vector<int64_t>{64, 16, 32}));
    EXPECT_EQ(p.ragged_first, (std::vector<int64_t>{5, 8, 11}));
    EXPECT_EQ(p.ragged_strides, (std::vector<int64_t>{5, 1, 3}));
    EXPECT_EQ(p.fork_prefix, 35);
    EXPECT_EQ(p.fork_suffix, 29);
    EXPECT_EQ(p.fork_suffix_offsets, (std::vector<int64_t>{35, 86, 108, 130}));
    EXPECT_EQ(p.shift_offset, 128);
    EXPECT_EQ(p.sliding_window, 8);
    EXPECT_EQ(p.stream_tokens, 192);
    std::vector<std::string> names;
    for (const auto& s : r.scenarios) names.push_back(s.name);
    EXPECT_EQ(names, (std::vector<std::string>{"token_by_token", "chunked_prefill_7", "chunked_prefill_8",
                                               "chunked_prefill_64", "left_padded_batch", "ragged_batch",
                                               "prefix_reuse_fork", "context_shift", "sliding_window_eviction_8"}));
    for (const auto& s : r.scenarios) {
      if (s.name == "context_shift" && family != PositionFamily::rope) {
        EXPECT_NE(s.skipped.find("RoPE only"), std::string::npos) << s.skipped;
        EXPECT_NE(s.skipped.find(std::string(to_string(family))), std::string::npos) << s.skipped;
        EXPECT_EQ(s.tokens, 0);
        continue;
      }
      EXPECT_TRUE(s.skipped.empty()) << s.name;
      EXPECT_EQ(s.failure, "") << s.name;
      EXPECT_LE(s.max_abs_logit_diff, 1e-4) << s.name;
      EXPECT_GT(s.tokens, 0) << s.name;
    }
  }
}

// The checker really compares on every family: a position bug in the padded
// path is caught on an ALiBi and a learned-table model as on RoPE.
TEST(Consistency, CatchesPaddingCountedAsPositionsOnEveryFamily) {
  posenc::test::TempDir d;
  const auto stream = random_ids(16, 192);
  for (PositionFamily family : kRuntimeFamilies) {
    SCOPED_TRACE(std::string(to_string(family)));
    const auto path = d.path() / "m.pt";
    save_posenc_checkpoint(path, random_checkpoint(family, 64));
    const Model m = Model::load(path);
    ConsistencyReport r;
    {
      BugGuard bug(detail::PositionBug::count_padding);
      r = check_cache_consistency(m, stream, {});
    }
    EXPECT_FALSE(r.passed);
    EXPECT_NE(find(r, "left_padded_batch").failure.find("cached at position"), std::string::npos);
    EXPECT_TRUE(find(r, "token_by_token").ok(1e-4));
  }
}

// The default length is capped by a learned table; a longer one is refused
// naming the table, before any scenario runs.
TEST(Consistency, LearnedTableCapsTheLength) {
  posenc::test::TempDir d;
  const auto path = d.path() / "learned.pt";
  save_posenc_checkpoint(path, random_checkpoint(PositionFamily::learned_absolute, 48));
  Model m = Model::load(path);
  m.set_trained_context(100, "test");  // a trained context the table does not cover
  EXPECT_EQ(default_consistency_length(m), 48);
  const auto stream = random_ids(16, 400);
  EXPECT_EQ(check_cache_consistency(m, stream, {}).plan.length, 48);
  ConsistencyOptions o;
  o.length = 49;
  const std::string msg = posenc::test::message_of<PositionError>([&] { check_cache_consistency(m, stream, o); });
  EXPECT_NE(msg.find("length: 49"), std::string::npos) << msg;
  EXPECT_NE(msg.find("48 rows"), std::string::npos) << msg;
}

#if POSENC_WITH_TRAIN  // trains a model or runs `posenc train`/`study` (not in a -DPOSENC_WITH_TRAIN=OFF build)
// The CLI on a `posenc train` model trained at 64 tokens (copy, lengths 8..31:
// 2n + 2 = 64 positions), ALiBi: all defaults (no --text: pseudo-random ids),
// sizes from 64, context_shift skipped by name in the table and in --json.
TEST(ConsistencyCli, PosencTrainAlibiModelAt64RunsWithDefaults) {
  posenc::test::TempDir d;
  const auto model = d.path() / "alibi.pt";
  auto r = posenc::test::run_cli("train --task copy --pe alibi --train-lengths 8:31 --steps 5 --dim 32 --layers 1 "
                                 "--eval-samples 0 --out '" + model.string() + "'");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  r = posenc::test::run_cli("check-cache --model '" + model.string() + "' --json -");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const auto j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["positional_family"], "alibi");
  EXPECT_EQ(j["trained_context"], 64);
  EXPECT_EQ(j["length"], 64);
  EXPECT_EQ(j["plan"]["chunk_sizes"], (std::vector<int64_t>{7, 8, 64}));
  EXPECT_EQ(j["plan"]["sliding_window"], 8);
  EXPECT_EQ(j["plan"]["fork_prefix"], 35);
  EXPECT_TRUE(j["passed"].get<bool>());
  int skipped = 0;
  for (const auto& s : j["scenarios"]) {
    if (s["name"] == "context_shift") {
      EXPECT_TRUE(s["skipped"].get<bool>());
      EXPECT_NE(s["skip_reason"].get<std::string>().find("alibi"), std::string::npos);
      ++skipped;
    } else {
      EXPECT_FALSE(s["skipped"].get<bool>()) << s.dump();
      EXPECT_LE(s["max_abs_logit_diff"].get<double>(), 1e-4) << s.dump();
    }
  }
  EXPECT_EQ(skipped, 1);
  r = posenc::test::run_cli("check-cache --model '" + model.string() + "'");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("length 64 (from the trained context"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("context_shift"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("skipped: applies to RoPE only"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("PASSED"), std::string::npos) << r.out;
}
#endif

TEST(ConsistencyCli, LengthBelowTheMinimumOrPastALearnedTableExits2) {
  const std::string stories = "--model '" + posenc::test::model_path().string() + "' --tokenizer '" +
                              posenc::test::tokenizer_path().string() + "'";
  auto r = posenc::test::run_cli("check-cache " + stories + " --length 15");
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_NE(r.err.find("--length"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("[16, "), std::string::npos) << r.err;
  // 32..79 threw vector::_M_range_insert: now they run (stories260K, its text).
  r = posenc::test::run_cli("check-cache " + stories + " --length 40 --text '" + posenc::test::text_path().string() +
                            "'");
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("length 40 (from --length)"), std::string::npos) << r.out;
  posenc::test::TempDir d;
  save_posenc_checkpoint(d.path() / "learned.pt", random_checkpoint(PositionFamily::learned_absolute, 48));
  r = posenc::test::run_cli("check-cache --model '" + (d.path() / "learned.pt").string() + "' --length 64");
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_NE(r.err.find("--length: 64 positions are past the learned position table"), std::string::npos) << r.err;
}

// The plan's sizes hold at every length the CLI accepts: each piece is at
// least one token, every compared sequence fits in n (a learned table of n
// rows), the fork's last shared block is partial, nothing reads past 3n.
TEST(Consistency, PlanHoldsAtEveryLength) {
  int64_t lengths = 0;
  for (int64_t n = kMinConsistencyLength; n <= kMaxConsistencyLength; n += n < 4096 ? 1 : 997, ++lengths) {
    ConsistencyOptions o;
    o.length = n;
    ConsistencyPlan p;
    ASSERT_NO_THROW(p = consistency_plan(o)) << n;
    for (std::size_t b = 0; b < 4; ++b) {
      ASSERT_GE(p.padded_first[b], 1) << n;
      ASSERT_GE(p.padded_second[b], 1) << n;
      ASSERT_LE(p.padded_first[b] + p.padded_second[b] + p.padded_decode_steps, n) << n;
    }
    ASSERT_NE(p.fork_prefix % p.block_size, 0) << n;
    ASSERT_LT(p.fork_prefix, n) << n;
    ASSERT_EQ(p.fork_suffix_offsets.back() + p.fork_suffix <= 3 * n, true) << n;
    ASSERT_LT(p.sliding_window, n) << n;
    ASSERT_EQ(p.chunk_sizes.back(), n) << n;
  }
  EXPECT_EQ(lengths, 4080 + 1048);  // every length to 4095, then every 997th to 2^20
}

// A batch whose later sequence runs a bounded pool out appends nothing to any sequence of it (the earlier
// sequence's tokens were appended first and are taken back): the same tokens then run alone and give the logits of
// a cache that never ran out.
TEST(Consistency, ABatchThatRunsThePoolOutAppendsNothing) {
  const Model& m = fx().model;
  const auto tokens = [](int64_t begin, int64_t n) { return std::span(fx().stream.data() + begin, n); };
  KvCache cache = m.make_cache(16, /*max_blocks=*/4);  // 64 tokens
  const auto a = cache.create(), b = cache.create();
  std::vector<float> logits;
  Model::SequenceInput in{a, tokens(0, 20), {}};
  m.forward(cache, std::span(&in, 1), Model::LogitsMode::last, logits);  // 2 blocks
  const std::vector<Model::SequenceInput> batch = {{a, tokens(20, 10), {}}, {b, tokens(100, 40), {}}};
  EXPECT_THROW(m.forward(cache, batch, Model::LogitsMode::last, logits), CacheError);  // b needs 3 more blocks of 2
  EXPECT_EQ(cache.size(a), 20);
  EXPECT_EQ(cache.next_position(a), 20);
  EXPECT_EQ(cache.size(b), 0);
  EXPECT_EQ(cache.blocks_in_use(), 2);
  in = {a, tokens(20, 10), {}};
  m.forward(cache, std::span(&in, 1), Model::LogitsMode::all, logits);
  KvCache fresh = m.make_cache();
  const auto f = fresh.create();
  std::vector<float> expected;
  in = {f, tokens(0, 20), {}};
  m.forward(fresh, std::span(&in, 1), Model::LogitsMode::last, expected);
  in = {f, tokens(20, 10), {}};
  m.forward(fresh, std::span(&in, 1), Model::LogitsMode::all, expected);
  EXPECT_EQ(logits, expected);
}

}  // namespace POSENC_UNITY_ID
