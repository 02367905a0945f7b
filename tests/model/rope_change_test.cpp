// Issue 16, finding 1: frequencies that change with the length under a KV cache
// (dynamic NTK, LongRoPE). Settings of the issue: stories260K with an original
// context of 128, chunks of 32, 172 tokens of tinystories_val.txt.
//
// What main gave with these settings: the default policy (refuse) threw
// CacheError at the chunk reaching 160 tokens, so a chunked prefill or a decode
// could not pass 128 at all; rerotate continued but left layers >= 1 computed
// from hidden states of the old frequencies; LongRoPE chose short, short,
// short, short, long, long across the six chunks (max |dlogit| 16.9 against the
// whole forward of 172 tokens, with rerotate).
#include <algorithm>
#include <cmath>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "posenc/checkpoint.hpp"
#include "posenc/consistency.hpp"
#include "posenc/error.hpp"
#include "posenc/io.hpp"
#include "posenc/perplexity.hpp"
#include "posenc/scaling.hpp"
#include "test_support.hpp"

namespace posenc {
namespace {

using json = nlohmann::json;
constexpr int64_t kOriginal = 128, kChunk = 32, kTokens = 172;

const std::vector<int32_t>& tokens() {
  static const std::vector<int32_t> t = [] {
    auto s = encode_stream(Tokenizer::load_llama2c(test::tokenizer_path(), 512), read_file(test::text_path()));
    s.resize(static_cast<std::size_t>(kTokens));
    return s;
  }();
  return t;
}

const Model& stories() {
  static const Model m = Model::load(test::model_path());
  return m;
}

Model with_trained_context(const Model& base, int64_t n) {
  Model m = base;
  m.set_trained_context(n, "test");
  return m;
}

/// Dynamic NTK as `posenc ppl --rope-scaling dynamic --trained-context 128` sets it up for 172 tokens.
Model dynamic_model(const Model& base = stories()) {
  Model m = with_trained_context(base, kOriginal);
  m.set_rope(rope_setup_for_context(m.rope(), kOriginal, "dynamic", kTokens, std::nullopt));
  return m;
}

/// A Phi-3-style LongRoPE (short and long factor lists, original context 128).
RopeParams longrope_params(const Model& m) {
  RopeParams p = m.rope().params;
  p.rope_type = "longrope";
  p.original_max_position_embeddings = kOriginal;
  p.factor = 32.0;
  p.short_factor = {1.0, 1.05, 1.2, 1.5};
  p.long_factor = {1.0, 2.5, 8.0, 20.0};
  return p;
}

Model longrope_model(const Model& base = stories()) {
  Model m = with_trained_context(base, kOriginal);
  RopeSetup r = m.rope();
  r.params = longrope_params(m);
  r.freqs = compute_rope_frequencies(r.params, kOriginal);
  m.set_rope(r);
  return m;
}

double max_diff(std::span<const float> a, std::span<const float> b) {
  EXPECT_EQ(a.size(), b.size());
  double d = 0;
  for (std::size_t i = 0; i < std::min(a.size(), b.size()); ++i)
    d = std::max(d, std::fabs(static_cast<double>(a[i]) - static_cast<double>(b[i])));
  return d;
}

struct Chunked {
  std::vector<float> logits;                   // every row, in order
  std::vector<KvCache::RopeState> states;      // the cache's rope state after each chunk
  KvCache::SequenceStats stats;
  bool mixed = false;
};

Chunked run_chunked(const Model& m, int64_t chunk, int64_t planned = 0) {
  KvCache cache = m.make_cache(16);
  const auto seq = cache.create();
  cache.set_planned_length(seq, planned);
  Chunked out;
  std::vector<float> step;
  const auto& t = tokens();
  for (std::size_t i = 0; i < t.size(); i += static_cast<std::size_t>(chunk)) {
    const std::size_t n = std::min(t.size() - i, static_cast<std::size_t>(chunk));
    Model::SequenceInput in{seq, std::span(t).subspan(i, n), {}};
    m.forward(cache, std::span(&in, 1), Model::LogitsMode::all, step);
    out.logits.insert(out.logits.end(), step.begin(), step.end());
    out.states.push_back(*cache.rope_state(seq));
  }
  out.stats = cache.stats(seq);
  out.mixed = cache.rope_mixed(seq);
  return out;
}

/// The rows a chunked path must give: each chunk's rows of the full forward at the length it ends at.
std::vector<float> rows_at_each_length(const Model& m, int64_t chunk) {
  const auto& t = tokens();
  const std::size_t V = static_cast<std::size_t>(m.config().vocab_size);
  std::vector<float> out;
  for (std::size_t i = 0; i < t.size(); i += static_cast<std::size_t>(chunk)) {
    const std::size_t e = std::min(t.size(), i + static_cast<std::size_t>(chunk));
    const auto f = m.score_window(std::span(t).first(e));
    out.insert(out.end(), f.begin() + static_cast<std::ptrdiff_t>(i * V), f.end());
  }
  return out;
}

TEST(RopeChange, PolicyNamesRoundTripAndABadNameIsAConfigErrorNamingTheField) {
  for (auto p : {RopeChangePolicy::recompute, RopeChangePolicy::hf, RopeChangePolicy::refuse, RopeChangePolicy::rerotate})
    EXPECT_EQ(parse_rope_change_policy(to_string(p), "f"), p);
  const std::string msg =
      test::message_of<ConfigError>([] { parse_rope_change_policy("recomput", "--rope-change-policy"); });
  EXPECT_NE(msg.find("--rope-change-policy"), std::string::npos) << msg;
  EXPECT_NE(msg.find("recomput"), std::string::npos) << msg;
  EXPECT_EQ(Model::load(test::model_path()).rope_change_policy(), RopeChangePolicy::recompute);  // the default
}

// main: CacheError at the chunk to 160 (default refuse).
TEST(RopeChange, DynamicNtkChunked32Past128EqualsTheFullForwardAtEachLengthByDefault) {
  const Model m = dynamic_model();
  ASSERT_EQ(rope_switch_point(m.rope().params), kOriginal);
  const Chunked got = run_chunked(m, kChunk);
  EXPECT_LE(max_diff(got.logits, rows_at_each_length(m, kChunk)), 1e-4);
  // Re-prefills at the chunks ending at 160 (128 tokens cached) and 172 (160 cached).
  EXPECT_EQ(got.stats.rope_recomputes, 2);
  EXPECT_EQ(got.stats.tokens_reprefilled, 128 + 160);
  EXPECT_FALSE(got.mixed);
  // The last chunk's state is the full forward's at 172.
  EXPECT_EQ(got.states.back().freqs, dynamic_ntk_frequencies(m.rope().params, kTokens, DynamicNtkArithmetic::tensor_float32));
  // The last token: equal to one forward of the 172 tokens.
  const std::size_t V = 512;
  const auto full = m.score_window(tokens());
  EXPECT_LE(max_diff(std::span(got.logits).last(V), std::span(full).last(V)), 1e-4);
}

// main: CacheError at the step to 129 (default refuse); rerotate drifted.
TEST(RopeChange, DynamicNtkTokenByTokenDecodeEqualsTheFullForwardAtEveryStep) {
  const Model m = dynamic_model();
  const Chunked got = run_chunked(m, 1);
  EXPECT_LE(max_diff(got.logits, rows_at_each_length(m, 1)), 1e-4);
  EXPECT_EQ(got.stats.rope_recomputes, kTokens - kOriginal);  // every step past 128 changes theta
}

// main: no planned length; the chunks used short, short, short, short, long, long (16.9 with rerotate).
TEST(RopeChange, LongRopeChunked32WithThePlannedLengthUsesLongInEveryChunkAndEqualsTheWholeForward) {
  const Model m = longrope_model();
  const RopeFrequencies long_f = compute_rope_frequencies(m.rope().params, kOriginal + 1);
  const RopeFrequencies short_f = compute_rope_frequencies(m.rope().params, kOriginal);
  ASSERT_NE(long_f.inv_freq, short_f.inv_freq);
  const Chunked got = run_chunked(m, kChunk, kTokens);
  ASSERT_EQ(got.states.size(), 6u);
  for (const auto& s : got.states) EXPECT_EQ(s.freqs, long_f);
  EXPECT_EQ(got.stats.rope_recomputes, 0);
  EXPECT_LE(max_diff(got.logits, m.score_window(tokens())), 1e-4);
}

TEST(RopeChange, LongRopeWithoutAPlanRecomputesOnceAtTheSwitchPoint) {
  const Model m = longrope_model();
  const Chunked got = run_chunked(m, kChunk);
  EXPECT_LE(max_diff(got.logits, rows_at_each_length(m, kChunk)), 1e-4);
  EXPECT_EQ(got.stats.rope_recomputes, 1);
  EXPECT_EQ(got.stats.tokens_reprefilled, 128);
}

// hf: transformers' dynamic_rope_update (RopeFrequencySchedule, checked against
// HF's rope_forward.json) picks each chunk's frequencies; cached keys keep theirs.
TEST(RopeChange, HfPolicyFollowsTransformersScheduleAndItsDriftIsVisible) {
  Model m = longrope_model();
  m.set_rope_change_policy(RopeChangePolicy::hf);
  const Chunked got = run_chunked(m, kChunk, kTokens);  // HF has no planned length: ignored
  RopeFrequencySchedule schedule(m.rope().params);
  const RopeFrequencies short_f = schedule.original();
  ASSERT_EQ(got.states.size(), 6u);
  for (std::size_t k = 0; k < got.states.size(); ++k) {
    const int64_t e = std::min<int64_t>(kTokens, (static_cast<int64_t>(k) + 1) * kChunk);
    EXPECT_EQ(got.states[k].freqs, schedule.update_for_length(e)) << "chunk " << k;
    EXPECT_EQ(got.states[k].freqs == short_f, k < 4) << "chunk " << k;  // short x4, long x2: the public bug
  }
  EXPECT_TRUE(got.mixed);
  EXPECT_EQ(got.stats.rope_changes_kept, 1);
  const double drift = max_diff(got.logits, Model(longrope_model()).score_window(tokens()));
  EXPECT_GT(drift, 1.0);  // measured 18.9 against the whole forward (the issue: 16.9 with its factors)
  RecordProperty("hf_longrope_drift", std::to_string(drift));

  Model d = dynamic_model();
  d.set_rope_change_policy(RopeChangePolicy::hf);
  const Chunked dyn = run_chunked(d, 1);
  RopeFrequencySchedule ds(d.rope().params);
  for (std::size_t k = 0; k < dyn.states.size(); ++k)
    EXPECT_EQ(dyn.states[k].freqs, ds.update_for_length(static_cast<int64_t>(k) + 1)) << "step " << k;
  EXPECT_GT(max_diff(dyn.logits, rows_at_each_length(d, 1)), 1e-2);
}

TEST(RopeChange, HfMixedSequenceCannotBeShifted) {
  Model m = dynamic_model();
  m.set_rope_change_policy(RopeChangePolicy::hf);
  KvCache cache = m.make_cache(16);
  const auto seq = cache.create();
  std::vector<float> logits;
  Model::SequenceInput in{seq, std::span(tokens()).first(130), {}};
  m.forward(cache, std::span(&in, 1), Model::LogitsMode::last, logits);
  EXPECT_FALSE(cache.rope_mixed(seq));  // one forward: one rotation
  in = {seq, std::span(tokens()).subspan(130, 1), {}};
  m.forward(cache, std::span(&in, 1), Model::LogitsMode::last, logits);
  EXPECT_TRUE(cache.rope_mixed(seq));
  const std::string msg = test::message_of<CacheError>([&] { cache.shift(seq, -10, 20); });
  EXPECT_NE(msg.find("hf"), std::string::npos) << msg;
  cache.clear(seq);
  EXPECT_FALSE(cache.rope_mixed(seq));
}

// rerotate: exact for one layer (the re-rotated keys are all there is), not past it.
TEST(RopeChange, RerotateIsExactOnlyForSingleLayerAttention) {
  test::TempDir dir;
  PosencCheckpoint ck = stories().to_checkpoint();
  ck.config.n_layers = 1;
  std::erase_if(ck.tensors, [](const CheckpointTensor& t) {
    return t.name.rfind("layers.", 0) == 0 && t.name.rfind("layers.0.", 0) != 0;
  });
  save_posenc_checkpoint(dir.path() / "one.posenc", ck);
  const Model one = Model::load(dir.path() / "one.posenc");
  ASSERT_EQ(one.config().n_layers, 1);
  for (bool single : {true, false}) {
    Model m = dynamic_model(single ? one : stories());
    m.set_rope_change_policy(RopeChangePolicy::rerotate);
    const Chunked got = run_chunked(m, kChunk);
    const double d = max_diff(got.logits, rows_at_each_length(m, kChunk));
    EXPECT_EQ(got.stats.rope_rerotations, 2);
    if (single) {
      EXPECT_LE(d, 1e-4);
    } else {
      EXPECT_GT(d, 1e-2);  // measured 0.36 on stories260K (5 layers)
    }
  }
}

TEST(RopeChange, RecomputeAfterAnEvictionIsACacheErrorAndAppendsNothing) {
  const Model m = dynamic_model();
  KvCache cache = m.make_cache(16);
  const auto seq = cache.create();
  std::vector<float> logits;
  Model::SequenceInput in{seq, std::span(tokens()).first(128), {}};
  m.forward(cache, std::span(&in, 1), Model::LogitsMode::last, logits);
  cache.evict(seq, 0, 8);
  in = {seq, std::span(tokens()).subspan(128, 4), {}};
  const std::string msg =
      test::message_of<CacheError>([&] { m.forward(cache, std::span(&in, 1), Model::LogitsMode::last, logits); });
  EXPECT_NE(msg.find("recompute"), std::string::npos) << msg;
  EXPECT_NE(msg.find("8 of its tokens were evicted"), std::string::npos) << msg;
  EXPECT_EQ(cache.size(seq), 120);
}

TEST(RopeChange, ConsistencyCheckerJudgesRecomputeAndReportsTheOthersDrift) {
  const auto stream = encode_stream(Tokenizer::load_llama2c(test::tokenizer_path(), 512), read_file(test::text_path()));
  for (const Model& m : {dynamic_model(), longrope_model()}) {
    SCOPED_TRACE(m.rope().params.rope_type);
    ConsistencyOptions o;
    o.length = kTokens;
    const ConsistencyReport r = check_cache_consistency(m, stream, o);
    EXPECT_TRUE(r.passed);
    EXPECT_EQ(r.rope_switch_point, kOriginal);
    auto find = [&](const std::string& name) -> const ConsistencyScenario& {
      for (const auto& s : r.scenarios)
        if (s.name == name) return s;
      ADD_FAILURE() << "no scenario " << name;
      return r.scenarios.front();
    };
    for (const std::string path : {"token_by_token", "chunked_32"}) {
      EXPECT_LE(find("rope_change_recompute_" + path).max_abs_logit_diff, 1e-4);
      EXPECT_FALSE(find("rope_change_recompute_" + path).informational);
      for (const std::string p : {"hf", "rerotate"}) {
        const auto& s = find("rope_change_" + p + "_" + path);
        EXPECT_TRUE(s.informational);
        EXPECT_GT(s.max_abs_logit_diff, 1e-2) << s.name;  // the drift is there, reported
      }
      EXPECT_NE(find("rope_change_refuse_" + path).note.find("refused"), std::string::npos);
    }
    if (m.rope().params.rope_type == "longrope") {
      EXPECT_LE(find("longrope_planned_chunked_32").max_abs_logit_diff, 1e-4);
    }
    // Checking hf instead fails the report: its drift is judged then.
    o.rope_change_policy = RopeChangePolicy::hf;
    EXPECT_FALSE(check_cache_consistency(m, stream, o).passed);
  }
}

std::string q(const std::filesystem::path& p) { return "'" + p.string() + "'"; }

TEST(RopeChangeCli, CheckCacheDynamicAndLongRopePassUnderRecomputeAndPrintTheDrift) {
  test::TempDir d;
  const auto cfg = d.file("phi-3-style.json",
                          R"({"rope_type": "longrope", "original_max_position_embeddings": 128, "factor": 32.0,
                              "short_factor": [1.0, 1.05, 1.2, 1.5], "long_factor": [1.0, 2.5, 8.0, 20.0]})");
  const std::string base = "check-cache --model " + q(test::model_path()) + " --tokenizer " + q(test::tokenizer_path()) +
                           " --trained-context 128 --length 172 ";
  for (const std::string& extra : std::vector<std::string>{"--rope-scaling dynamic", "--rope-scaling longrope --config " + q(cfg)}) {
    SCOPED_TRACE(extra);
    const auto out = d.path() / "r.json";
    const auto r = test::run_cli(base + extra + " --json " + q(out));
    ASSERT_EQ(r.exit_code, 0) << r.err;
    EXPECT_NE(r.out.find("rope change policy recompute is checked"), std::string::npos) << r.out;
    EXPECT_NE(r.out.find("[drift, informational]"), std::string::npos) << r.out;
    const json j = json::parse(test::slurp(out));
    EXPECT_EQ(j["rope_change_policy"], "recompute");
    EXPECT_EQ(j["rope_switch_point"], 128);
    int drifts = 0;
    for (const auto& s : j["scenarios"]) {
      const std::string name = s["name"];
      if (name.rfind("rope_change_recompute_", 0) == 0) {
        EXPECT_LE(s["max_abs_logit_diff"].get<double>(), 1e-4);
      }
      if (name.rfind("rope_change_hf_", 0) == 0 || name.rfind("rope_change_rerotate_", 0) == 0) {
        EXPECT_TRUE(s["informational"].get<bool>());
        EXPECT_GT(s["max_abs_logit_diff"].get<double>(), 1e-2);
        ++drifts;
      }
    }
    EXPECT_EQ(drifts, 4);
    // Judging hf: the same drift fails the check (exit non-zero).
    EXPECT_NE(test::run_cli(base + extra + " --rope-change-policy hf").exit_code, 0);
  }
}

TEST(RopeChangeCli, GenerateRunsPastTheSwitchPointWithRecomputeAndReportsItsCost) {
  test::TempDir d;
  const auto out = d.path() / "g.json";
  const auto r = test::run_cli("generate --model " + q(test::model_path()) + " --tokenizer " +
                               q(test::tokenizer_path()) +
                               " --trained-context 128 --rope-scaling dynamic --prompt 'Once upon a time' "
                               "--max-tokens 160 --ignore-eos --stats --json " + q(out));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const json j = json::parse(test::slurp(out));
  EXPECT_EQ(j["rope_change_policy"], "recompute");
  EXPECT_EQ(j["rope_switch_point"], 128);
  std::vector<int32_t> ids = j["prompt_ids"].get<std::vector<int32_t>>();
  const auto gen = j["generated_ids"].get<std::vector<int32_t>>();
  ASSERT_EQ(gen.size(), 160u);
  const int64_t total = static_cast<int64_t>(ids.size() + gen.size());
  ASSERT_GT(total - 1, 128);
  // Every step fed at length L > 128 re-prefilled the L - 1 cached tokens.
  EXPECT_EQ(j["rope_recomputes"].get<int64_t>(), total - 1 - 128);
  EXPECT_GT(j["decode_seconds"].get<double>(), 0.0);
  EXPECT_NE(r.err.find("re-prefills"), std::string::npos) << r.err;
  // The last token's log-probability is that of one full forward at its length.
  ids.insert(ids.end(), gen.begin(), gen.end());
  Model m = with_trained_context(stories(), kOriginal);
  m.set_rope(rope_setup_for_context(m.rope(), kOriginal, "dynamic", total, std::nullopt));
  const std::size_t n = ids.size() - 1;
  const auto logits = m.score_window(std::span(ids).first(n));
  const float* row = logits.data() + (n - 1) * 512;
  double mx = -1e300, z = 0;
  for (int v = 0; v < 512; ++v) mx = std::max(mx, static_cast<double>(row[v]));
  for (int v = 0; v < 512; ++v) z += std::exp(row[v] - mx);
  EXPECT_NEAR(j["generated_logprobs"].back().get<double>(), row[ids[n]] - mx - std::log(z), 1e-4);
}

}  // namespace
}  // namespace posenc

namespace posenc {
namespace {

TEST(RopeChangeCli, PplRunsPastTheSwitchPointWithRecomputeNamedInItsRecord) {
  test::TempDir d;
  const auto out = d.path() / "p.json";
  const auto r = test::run_cli("ppl --model '" + test::model_path().string() + "' --tokenizer '" +
                               test::tokenizer_path().string() + "' --text '" + test::text_path().string() +
                               "' --trained-context 128 --context 172 --rope-scaling dynamic --scored-tokens 2000 "
                               "--quiet --json '" + out.string() + "'");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const auto j = nlohmann::json::parse(test::slurp(out));
  EXPECT_EQ(j["rope_change_policy"], "recompute");
  ASSERT_FALSE(j["results"].empty());
  EXPECT_EQ(j["results"][0]["context"], 172);
  EXPECT_TRUE(j["results"][0]["nll"].is_number());
}

}  // namespace
}  // namespace posenc
