#include <algorithm>
#include <cmath>

#include <gtest/gtest.h>

#include "posenc/error.hpp"
#include "posenc/generate.hpp"
#include "posenc/io.hpp"
#include "posenc/model.hpp"
#include "posenc/perplexity.hpp"
#include "test_support.hpp"

namespace POSENC_UNITY_ID {  // this file's own namespace in the tests' unity build (CMakeLists.txt)

using namespace posenc;

namespace {

struct Fixture {
  Model model = Model::load_llama2c(posenc::test::model_path());
  Tokenizer tok = Tokenizer::load_llama2c(posenc::test::tokenizer_path(), 512);
  std::vector<int32_t> stream = encode_stream(tok, read_file(posenc::test::text_path()));
};

const Fixture& fx() {
  static const Fixture f;
  return f;
}

float max_abs_diff(const std::vector<float>& a, const std::vector<float>& b) {
  EXPECT_EQ(a.size(), b.size());
  float m = 0.0f;
  for (std::size_t i = 0; i < std::min(a.size(), b.size()); ++i) m = std::max(m, std::abs(a[i] - b[i]));
  return m;
}

}  // namespace

// llama2.c's reference run of this checkpoint at temperature 0 (also reproduced
// here with run.c built from karpathy/llama2.c).
TEST(Model, GreedyGenerationMatchesLlama2c) {
  GenerateOptions o;
  o.max_new_tokens = 60;
  const auto r = generate(fx().model, fx().tok, "Once upon a time", o);
  EXPECT_EQ(r.new_tokens.size(), 60u);
  const std::string golden =
      "Once upon a time, there was a little girl named Lily. She loved to play outside in the park. One day, "
      "she saw a big, red ball.";
  EXPECT_EQ(r.text.substr(0, golden.size()), golden) << r.text;
}

// The incremental path (KV cache, one token per forward) and the prefill path
// (whole window in one forward) give the same logits.
TEST(Model, TokenByTokenEqualsPrefill) {
  const std::span<const int32_t> window(fx().stream.data(), 300);
  const auto full = fx().model.score_window(window);
  KvCache cache = fx().model.make_cache(16);
  const auto seq = cache.create();
  std::vector<float> step, incremental;
  for (std::size_t i = 0; i < window.size(); ++i) {
    Model::SequenceInput in{seq, window.subspan(i, 1), {}};
    fx().model.forward(cache, std::span(&in, 1), Model::LogitsMode::last, step);
    incremental.insert(incremental.end(), step.begin(), step.end());
  }
  EXPECT_EQ(cache.size(seq), 300);
  EXPECT_EQ(cache.next_position(seq), 300);
  EXPECT_LT(max_abs_diff(full, incremental), 1e-4f);
}

TEST(Model, LinearFactorOneEqualsDefaultWithinTrainedContext) {
  for (int64_t L : {256, 512}) {
    Model lin = fx().model;
    lin.set_rope(rope_setup_for_context(fx().model.rope(), 512, "linear", L, std::nullopt));
    ASSERT_EQ(lin.rope().params.factor.value_or(0), 1.0);
    const std::span<const int32_t> w(fx().stream.data() + 1000, static_cast<std::size_t>(L));
    EXPECT_EQ(lin.score_window(w), fx().model.score_window(w)) << "L=" << L;
  }
  // ...and linear with factor 2 does change them.
  Model lin2 = fx().model;
  lin2.set_rope(rope_setup_for_context(fx().model.rope(), 512, "linear", 1024, std::nullopt));
  EXPECT_EQ(lin2.rope().params.factor.value_or(0), 2.0);
  const std::span<const int32_t> w(fx().stream.data(), 64);
  EXPECT_GT(max_abs_diff(lin2.score_window(w), fx().model.score_window(w)), 1e-3f);
}

// Perplexity at L = 512, default RoPE, first 60,000 scored tokens (118 windows,
// 60,298 predictions). Checked independently: llama2.c's own forward (run.c
// built from karpathy/llama2.c, token by token) gives NLL 1.398556979 on the
// same windows; this runtime's prefill gives 1.3985569901.
TEST(Perplexity, PinnedAtTrainedContext) {
  PplOptions o;
  o.context = 512;
  o.max_tokens = 60000;
  const PplResult r = evaluate_perplexity(fx().model, fx().stream, o);
  EXPECT_EQ(r.windows, 118);
  EXPECT_EQ(r.tokens, 60298);
  EXPECT_NEAR(r.nll, 1.398556979, 2e-6);
  EXPECT_NEAR(r.ppl, 4.049352449, 1e-5);
  ASSERT_EQ(r.buckets.size(), 2u);
  EXPECT_EQ(r.buckets[0].tokens, 30208);
  EXPECT_EQ(r.buckets[1].tokens, 30090);
  EXPECT_NEAR(r.buckets[0].nll(), 1.412998256, 2e-6);
  EXPECT_NEAR(r.buckets[1].nll(), 1.384059069, 2e-6);
}

// The checkpoint was trained with interleaved pairs; the half layout wrecks it.
TEST(Perplexity, WrongLayoutIsClearlyWorse) {
  const LayoutEvidence e = detect_rope_layout(fx().model, fx().stream, 512, 8192);
  EXPECT_EQ(e.likely, RopeLayout::interleaved);
  EXPECT_GT(e.nll_half - e.nll_interleaved, 0.3) << "half " << e.nll_half << " interleaved " << e.nll_interleaved;
}

TEST(Perplexity, ProtocolEdges) {
  // stories260K is trained at 512: the default buckets are the former fixed ones.
  ASSERT_EQ(fx().model.trained_context(), 512);
  EXPECT_EQ(position_buckets(512, 256).size(), 1u);
  const auto b = position_buckets(512, 3000);
  ASSERT_EQ(b.size(), 5u);
  EXPECT_EQ(b[4], (std::pair<int64_t, int64_t>{2048, 4096}));
  PplOptions o;
  o.context = 0;
  EXPECT_THROW(evaluate_perplexity(fx().model, fx().stream, o), InvalidArgument);
  o.context = (int64_t{1} << 20) + 1;
  EXPECT_THROW(evaluate_perplexity(fx().model, fx().stream, o), InvalidArgument);
  // A last, shorter window is scored: 1000 tokens at L = 512 -> 511 + 487 predictions.
  o.context = 512;
  const PplResult r = evaluate_perplexity(fx().model, std::span(fx().stream.data(), 1000), o);
  EXPECT_EQ(r.windows, 2);
  EXPECT_EQ(r.tokens, 511 + 487);
  EXPECT_THROW(encode_stream(fx().tok, "\n  \n"), InvalidArgument);
}

TEST(Model, BadForwardInputsLoseNothing) {
  KvCache cache = fx().model.make_cache(16);
  const auto seq = cache.create();
  std::vector<float> logits;
  const int32_t bad[2] = {5, 512};
  Model::SequenceInput in{seq, bad, {}};
  EXPECT_THROW(fx().model.forward(cache, std::span(&in, 1), Model::LogitsMode::all, logits), InvalidArgument);
  EXPECT_EQ(cache.size(seq), 0);  // nothing appended
  const int64_t pos[1] = {0};
  in = {seq, std::span(bad, 2), std::span(pos, 1)};
  EXPECT_THROW(fx().model.forward(cache, std::span(&in, 1), Model::LogitsMode::all, logits), InvalidArgument);
  EXPECT_EQ(cache.size(seq), 0);
}

}  // namespace POSENC_UNITY_ID
