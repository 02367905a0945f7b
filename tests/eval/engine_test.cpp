// Running samples on the real stories260K: forced choice on KV-cache forks
// equals scoring each full sequence from scratch, prefix sharing across depths
// changes nothing, the greedy continuation equals generate(), dynamic is frozen.
#include <cmath>

#include <gtest/gtest.h>

#include "posenc/error.hpp"
#include "posenc/eval.hpp"
#include "posenc/generate.hpp"
#include "posenc/io.hpp"
#include "posenc/perplexity.hpp"
#include "posenc/scaling.hpp"
#include "test_support.hpp"

namespace POSENC_UNITY_ID {  // this file's own namespace in the tests' unity build (CMakeLists.txt)

using namespace posenc;

namespace {

const Model& model() {
  static const Model m = Model::load_llama2c(test::model_path());
  return m;
}
const Tokenizer& tok() {
  static const Tokenizer t = Tokenizer::load_llama2c(test::tokenizer_path());
  return t;
}
const Haystack& hay() {
  static const Haystack h = Haystack::build(read_file(test::text_path()), tok(), TaskGenerator::candidate_names());
  return h;
}

// Summed log-probability of `cont` after `prompt`, from one fresh full forward.
double full_logprob(const Model& m, const std::vector<int32_t>& prompt, const std::vector<int32_t>& cont) {
  std::vector<int32_t> all = prompt;
  all.insert(all.end(), cont.begin(), cont.end());
  const auto logits = m.score_window(all);
  const int V = m.config().vocab_size;
  double s = 0;
  for (std::size_t j = 0; j < cont.size(); ++j) {
    const float* row = logits.data() + (prompt.size() - 1 + j) * static_cast<std::size_t>(V);
    double mx = row[0];
    for (int v = 1; v < V; ++v) mx = std::max(mx, static_cast<double>(row[v]));
    double z = 0;
    for (int v = 0; v < V; ++v) z += std::exp(static_cast<double>(row[v]) - mx);
    s += static_cast<double>(row[cont[j]]) - mx - std::log(z);
  }
  return s;
}

}  // namespace

TEST(EvalEngine, ForkedCandidatesEqualFullRecomputationAndShareTheContext) {
  const TaskGenerator g(tok(), hay(), {});
  const TaskSample s = g.make("name_recall", 3, 600, 0.3);
  KvCache cache = model().make_cache(16);
  const auto seq = cache.create();
  std::vector<float> logits;
  const Model::SequenceInput in{seq, s.prompt_tokens, {}};
  model().forward(cache, std::span<const Model::SequenceInput>(&in, 1), Model::LogitsMode::last, logits);
  const int64_t blocks_context = cache.blocks_in_use();
  const int64_t allocated_before = cache.blocks_allocated();
  const auto lp = score_candidates(model(), cache, seq, logits, s.choice_tokens);
  ASSERT_EQ(lp.size(), s.choice_tokens.size());
  for (std::size_t c = 0; c < lp.size(); ++c)
    EXPECT_NEAR(lp[c], full_logprob(model(), s.prompt_tokens, s.choice_tokens[c]), 2e-4) << s.choices[c];
  // The forks shared the context's blocks: the pool grew by at most two
  // blocks per candidate (the copied partial block + one new), not by a copy
  // of the ~38-block context per candidate.
  EXPECT_GE(blocks_context, 36);
  EXPECT_LE(cache.blocks_allocated() - allocated_before, 2 * static_cast<int64_t>(s.choice_tokens.size()));
  EXPECT_EQ(cache.blocks_in_use(), blocks_context);  // forks freed, context untouched
  EXPECT_EQ(cache.size(seq), static_cast<int64_t>(s.prompt_tokens.size()));
}

TEST(EvalEngine, PrefixSharingAcrossDepthsChangesNoResult) {
  const TaskGenerator g(tok(), hay(), {});
  for (const std::string task : {"name_recall", "passkey"}) {
    std::vector<TaskSample> ss;
    for (double d : {0.0, 0.5, 1.0}) ss.push_back(g.make(task, 1, 400, d));
    const auto shared = evaluate_samples(model(), tok(), ss);
    for (std::size_t i = 0; i < ss.size(); ++i) {
      const auto alone = evaluate_samples(model(), tok(), std::span<const TaskSample>(&ss[i], 1));
      EXPECT_EQ(shared[i].predicted, alone[0].predicted);
      EXPECT_EQ(shared[i].new_tokens, alone[0].new_tokens);
      EXPECT_EQ(shared[i].correct, alone[0].correct);
      ASSERT_EQ(shared[i].logprobs.size(), alone[0].logprobs.size());
      for (std::size_t c = 0; c < shared[i].logprobs.size(); ++c)
        EXPECT_NEAR(shared[i].logprobs[c], alone[0].logprobs[c], 2e-4);
    }
  }
}

TEST(EvalEngine, GreedyContinuationEqualsGenerate) {
  const TaskGenerator g(tok(), hay(), {});
  const TaskSample s = g.make("passkey", 0, 400, 0.5);
  const auto out = evaluate_samples(model(), tok(), std::span<const TaskSample>(&s, 1));
  GenerateOptions o;
  o.max_new_tokens = s.answer_budget;
  const auto ref = generate(model(), tok(), s.prompt_text, o);
  ASSERT_EQ(ref.prompt_tokens, s.prompt_tokens);
  // generate() stops only at BOS; the eval also stops at EOS (id 2): compare up to it.
  auto expected = ref.new_tokens;
  if (auto it = std::find(expected.begin(), expected.end(), Tokenizer::kEos); it != expected.end())
    expected.erase(it, expected.end());
  EXPECT_EQ(out[0].new_tokens, expected);
  EXPECT_FALSE(out[0].prediction.empty());
}

TEST(EvalEngine, DynamicIsFrozenAtTheCellLength) {
  bool has_dynamic = false;
  for (const auto& m : rope_scalings()) has_dynamic = has_dynamic || m.name == "dynamic";
  if (!has_dynamic) GTEST_SKIP() << "rope_type 'dynamic' is not registered on this branch yet";
  const int64_t L = 1024;
  // Unfrozen (as `posenc ppl` uses it): the forward recomputes theta for the
  // window's length. Frozen (eval): the same frequencies, held fixed.
  Model unfrozen = model(), frozen = model();
  unfrozen.set_rope(rope_setup_for_context(model().rope(), 512, "dynamic", L, std::nullopt));
  frozen.set_rope(eval_rope_setup(model(), "dynamic", L, std::nullopt));
  EXPECT_NE(frozen.rope().freqs.inv_freq, model().rope().freqs.inv_freq);  // theta really changed (s = 2)
  const auto stream = encode_stream(tok(), read_file(test::text_path()).substr(0, 20000));
  ASSERT_GE(stream.size(), static_cast<std::size_t>(L));
  const std::span<const int32_t> window(stream.data(), static_cast<std::size_t>(L));
  EXPECT_EQ(frozen.score_window(window), unfrozen.score_window(window));  // bit-identical on a full window
  // Prompt, then generated tokens: the frozen frequencies never change under
  // the cached keys (unfrozen under the refuse policy, the cache refuses:
  // CacheError; the default policy, recompute, would re-prefill instead).
  const TaskGenerator g(tok(), hay(), {});
  const TaskSample s = g.make("passkey", 0, L, 0.5);
  EXPECT_NO_THROW(evaluate_samples(frozen, tok(), std::span<const TaskSample>(&s, 1)));
  unfrozen.set_rope_change_policy(RopeChangePolicy::refuse);
  EXPECT_THROW(evaluate_samples(unfrozen, tok(), std::span<const TaskSample>(&s, 1)), CacheError);
}

TEST(EvalEngine, RejectsOverlongSamples) {
  const TaskGenerator g(tok(), hay(), {});
  TaskSample s = g.make("passkey", 0, 300, 0.5);
  s.length = static_cast<int64_t>(s.prompt_tokens.size());  // no room for the answer budget
  EXPECT_THROW(evaluate_samples(model(), tok(), std::span<const TaskSample>(&s, 1)), InvalidArgument);
}

}  // namespace POSENC_UNITY_ID
