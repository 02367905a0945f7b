#include <algorithm>

#include <gtest/gtest.h>

#include "posenc/consistency.hpp"
#include "posenc/error.hpp"
#include "posenc/io.hpp"
#include "posenc/perplexity.hpp"
#include "test_support.hpp"

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

}  // namespace

TEST(Consistency, EveryScenarioWithinToleranceOnStories260K) {
  const ConsistencyReport r = check_cache_consistency(fx().model, fx().stream, {});
  EXPECT_TRUE(r.passed);
  EXPECT_EQ(r.scenarios.size(), 9u);
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
