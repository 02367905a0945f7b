// A model running on an f16 / bf16 KV cache (Model::set_kv_cache_dtype, --kv-dtype): decode reads exactly what
// prefill reads, the error against float32 is reported by the consistency checker and judged by a tolerance for the
// dtype, and position bugs still fail under it.
#include <cstring>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "posenc/consistency.hpp"
#include "posenc/error.hpp"
#include "posenc/io.hpp"
#include "posenc/perplexity.hpp"
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

Model with_dtype(KvCacheDtype d) {
  Model m = fx().model;
  m.set_kv_cache_dtype(d);
  return m;
}

std::vector<float> token_by_token(const Model& m, std::span<const int32_t> tokens) {
  KvCache cache = m.make_cache(16);
  const auto seq = cache.create();
  std::vector<float> all, step;
  for (std::size_t i = 0; i < tokens.size(); ++i) {
    Model::SequenceInput in{seq, tokens.subspan(i, 1), {}};
    m.forward(cache, std::span(&in, 1), Model::LogitsMode::all, step);
    all.insert(all.end(), step.begin(), step.end());
  }
  return all;
}

double max_abs_diff(const std::vector<float>& a, const std::vector<float>& b) {
  double m = 0;
  for (std::size_t i = 0; i < a.size(); ++i) m = std::max(m, std::abs(static_cast<double>(a[i]) - b[i]));
  return m;
}

std::size_t bit_mismatches(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size()) return std::max(a.size(), b.size());
  std::size_t n = 0;
  for (std::size_t i = 0; i < a.size(); ++i) n += std::memcmp(&a[i], &b[i], sizeof(float)) != 0;
  return n;
}

const ConsistencyScenario& find(const ConsistencyReport& r, const std::string& name) {
  for (const auto& s : r.scenarios)
    if (s.name == name) return s;
  throw std::runtime_error("no scenario " + name);
}

struct BugGuard {
  explicit BugGuard(detail::PositionBug b) { detail::set_position_bug_for_testing(b); }
  ~BugGuard() { detail::set_position_bug_for_testing(detail::PositionBug::none); }
};

}  // namespace

TEST(KvDtypeModel, DefaultIsFloat32) {
  EXPECT_EQ(fx().model.kv_cache_dtype(), KvCacheDtype::f32);
  EXPECT_EQ(fx().model.make_cache().dtype(), KvCacheDtype::f32);
  EXPECT_EQ(with_dtype(KvCacheDtype::bf16).make_cache().dtype(), KvCacheDtype::bf16);
  EXPECT_EQ(with_dtype(KvCacheDtype::bf16).make_cache(16, 0, KvCacheDtype::f16).dtype(), KvCacheDtype::f16);
  // stories260K: 5 layers x 2 (k, v) x 4 KV heads x 8 = 320 elements a token.
  EXPECT_EQ(fx().model.make_cache().kv_bytes_per_token(), 1280);
  EXPECT_EQ(with_dtype(KvCacheDtype::f16).make_cache().kv_bytes_per_token(), 640);
}

// Every key and value is rounded once when appended and attention reads the rounded values for the tokens of the
// same step too, so decode and prefill over a rounded cache see the same keys: bit-identical logits (the kernel is
// batch invariant). The rounding changes the logits (against f32) by a little.
TEST(KvDtypeModel, DecodeEqualsPrefillBitForBitAndDiffersFromFloat32) {
  const auto tokens = std::span<const int32_t>(fx().stream).first(96);
  const std::vector<float> f32 = fx().model.score_window(tokens);
  for (KvCacheDtype d : {KvCacheDtype::f16, KvCacheDtype::bf16}) {
    const Model m = with_dtype(d);
    const std::vector<float> prefill = m.score_window(tokens);
    const std::vector<float> decode = token_by_token(m, tokens);
    EXPECT_EQ(bit_mismatches(prefill, decode), 0u) << to_string(d);
    const double err = max_abs_diff(prefill, f32);
    EXPECT_GT(err, 1e-5) << to_string(d);
    EXPECT_LT(err, d == KvCacheDtype::f16 ? 0.02 : 0.2) << to_string(d);
  }
  // bf16 keeps 8 bits of mantissa against f16's 11: its error is larger.
  EXPECT_GT(max_abs_diff(with_dtype(KvCacheDtype::bf16).score_window(tokens), f32),
            max_abs_diff(with_dtype(KvCacheDtype::f16).score_window(tokens), f32));
}

TEST(KvDtypeModel, CheckerReportsTheErrorAgainstFloat32AndPasses) {
  ConsistencyOptions o;
  o.length = 128;
  const ConsistencyReport ref = check_cache_consistency(fx().model, fx().stream, o);
  ASSERT_TRUE(ref.passed);
  EXPECT_EQ(ref.kv_dtype, KvCacheDtype::f32);
  for (const auto& s : ref.scenarios) EXPECT_EQ(s.kv_rounding, 0.0) << s.name;
  for (KvCacheDtype d : {KvCacheDtype::f16, KvCacheDtype::bf16}) {
    const ConsistencyReport r = check_cache_consistency(with_dtype(d), fx().stream, o);
    EXPECT_TRUE(r.passed) << to_string(d);
    EXPECT_EQ(r.kv_dtype, d);
    ASSERT_EQ(r.scenarios.size(), ref.scenarios.size());
    double worst = 0;
    for (std::size_t i = 0; i < r.scenarios.size(); ++i) {
      const auto& s = r.scenarios[i];
      ASSERT_TRUE(s.skipped.empty()) << s.name;
      EXPECT_GT(s.kv_rounding, 0.0) << s.name;
      EXPECT_LE(s.max_abs_logit_diff, s.tolerance_for(r.tolerance)) << to_string(d) << " " << s.name;
      EXPECT_EQ(s.kv_roundings, s.name == "context_shift" ? 2 : 1) << s.name;
      EXPECT_EQ(s.tolerance_for(r.tolerance),
                r.tolerance + kKvRoundingMargin * static_cast<double>(s.kv_roundings) * s.kv_rounding);
      worst = std::max(worst, s.max_abs_logit_diff);
    }
    // The error is reported as it is, not hidden behind float32's tolerance.
    EXPECT_GT(worst, 10 * r.tolerance) << to_string(d);
    // The paths that store each key once read what the f16/bf16 full forward reads: their distance to the f32
    // forward is the rounding's own (plus float32 noise).
    for (const char* name : {"token_by_token", "chunked_prefill_7", "prefix_reuse_fork"})
      EXPECT_LE(find(r, name).max_abs_logit_diff, find(r, name).kv_rounding + r.tolerance) << name;
  }
}

TEST(KvDtypeModel, PositionBugsStillFailUnderBf16) {
  ConsistencyOptions o;
  o.length = 128;
  ConsistencyReport r;
  {
    BugGuard bug(detail::PositionBug::restart_each_chunk);
    r = check_cache_consistency(with_dtype(KvCacheDtype::bf16), fx().stream, o);
  }
  EXPECT_FALSE(r.passed);
  const auto& s = find(r, "chunked_prefill_7");
  EXPECT_FALSE(s.ok(r.tolerance));
  EXPECT_GT(s.max_abs_logit_diff, 10 * s.tolerance_for(r.tolerance));
}

TEST(KvDtypeCli, CheckCacheJsonCarriesTheDtypeTheErrorAndTheBytes) {
  const std::string model = "--model '" + posenc::test::model_path().string() + "' --tokenizer '" +
                            posenc::test::tokenizer_path().string() + "' --length 64";
  auto r = posenc::test::run_cli("check-cache " + model + " --kv-dtype bf16 --json -");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const auto j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j.at("kv_dtype"), "bf16");
  EXPECT_EQ(j.at("kv_bytes_per_token").get<int64_t>(), 640);
  EXPECT_EQ(j.at("kv_bytes_per_token_f32").get<int64_t>(), 1280);
  EXPECT_GT(j.at("kv_error").get<double>(), 1e-3);
  EXPECT_EQ(j.at("kv_rounding_margin").get<double>(), kKvRoundingMargin);
  EXPECT_TRUE(j.at("passed").get<bool>());
  double worst = 0;
  for (const auto& s : j.at("scenarios")) {
    ASSERT_TRUE(s.contains("kv_rounding")) << s.dump();
    EXPECT_GT(s.at("kv_rounding").get<double>(), 0.0) << s.dump();
    EXPECT_DOUBLE_EQ(s.at("tolerance").get<double>(),
                     j.at("tolerance").get<double>() + kKvRoundingMargin * s.at("kv_roundings").get<double>() *
                                                           s.at("kv_rounding").get<double>());
    if (!s.contains("informational")) worst = std::max(worst, s.at("max_abs_logit_diff").get<double>());
  }
  EXPECT_EQ(j.at("kv_error").get<double>(), worst);

  r = posenc::test::run_cli("check-cache " + model + " --json -");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const auto f = nlohmann::json::parse(r.out);
  EXPECT_EQ(f.at("kv_dtype"), "f32");
  EXPECT_FALSE(f.contains("kv_error"));
  EXPECT_FALSE(f.at("scenarios").at(0).contains("kv_rounding"));

  r = posenc::test::run_cli("check-cache " + model + " --kv-dtype q8_0");
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_NE(r.err.find("--kv-dtype"), std::string::npos) << r.err;
}

TEST(KvDtypeCli, PplAndGenerateRunOnA16BitCacheAndSaySo) {
  const std::string model = "--model '" + posenc::test::model_path().string() + "' --tokenizer '" +
                            posenc::test::tokenizer_path().string() + "'";
  const std::string text = " --text '" + posenc::test::text_path().string() + "' --context 128 --scored-tokens 512";
  auto a = posenc::test::run_cli("ppl " + model + text + " --json -");
  auto b = posenc::test::run_cli("ppl " + model + text + " --kv-dtype bf16 --json -");
  ASSERT_EQ(a.exit_code, 0) << a.err;
  ASSERT_EQ(b.exit_code, 0) << b.err;
  const auto ja = nlohmann::json::parse(a.out), jb = nlohmann::json::parse(b.out);
  EXPECT_EQ(ja.at("kv_dtype"), "f32");
  EXPECT_EQ(jb.at("kv_dtype"), "bf16");
  const double na = ja.at("results").at(0).at("nll").get<double>(), nb = jb.at("results").at(0).at("nll").get<double>();
  EXPECT_NE(na, nb);               // the rounding reaches the scores
  EXPECT_NEAR(na, nb, 0.01 * na);  // and costs little
  auto g = posenc::test::run_cli("generate " + model + " --prompt 'Once upon a time' --max-tokens 8 --kv-dtype f16 "
                                 "--json -");
  ASSERT_EQ(g.exit_code, 0) << g.err;
  EXPECT_EQ(nlohmann::json::parse(g.out).at("kv_dtype"), "f16");
}

}  // namespace POSENC_UNITY_ID
