// Training: the torch network equals the runtime's on the saved checkpoint,
// training is deterministic by seed, evaluation handles learned tables and
// scalings, and the CLI's train/generate round trip works.
#include <algorithm>
#include <cmath>

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "posenc/checkpoint.hpp"
#include "posenc/error.hpp"
#include "posenc/train.hpp"
#include "test_support.hpp"
#include "train/transformer.hpp"

namespace POSENC_UNITY_ID {  // this file's own namespace in the tests' unity build (CMakeLists.txt)

using namespace posenc;
using posenc::test::TempDir;

namespace {

TrainConfig tiny(TrainTaskKind task, TrainEncoding pe) {
  TrainConfig c;
  c.task = task;
  c.pe = pe;
  c.dim = 32;
  c.n_heads = 4;  // head_dim 8, rope25 rotates 2 channels
  c.n_layers = 2;
  c.train_lengths = {4, 12, 1};
  c.steps = 12;
  c.batch_size = 8;
  c.threads = 1;
  return c;
}

const TrainEncoding kAllPe[] = {TrainEncoding::nope, TrainEncoding::learned, TrainEncoding::sinusoidal,
                                TrainEncoding::t5,   TrainEncoding::alibi,   TrainEncoding::rope,
                                TrainEncoding::rope25};

}  // namespace

// The acceptance check "trained, saved, reloaded: identical logits": a torch
// network is trained a few AdamW steps (so every table, the T5 bias included,
// moves off its initial value), its logits on a sequence are taken, it is
// saved as a posenc checkpoint, and the runtime's logits on the loaded file
// are compared. Tolerance: |torch - runtime| <= 1e-5 * max(1, max|logit|)
// (float32 with different summation orders and FMA in the runtime's kernels;
// measured: at most 1.0e-6 with |logit| up to 3.7, all seven encodings);
// the greedy token must agree at every position.
TEST(TrainModel, TorchForwardEqualsTheRuntimeOnTheSavedCheckpointForEveryEncoding) {
  at::set_num_threads(1);
  const Task task(TrainTaskKind::copy);
  for (TrainEncoding pe : kAllPe) {
    SCOPED_TRACE(std::string(to_string(pe)));
    const TrainConfig cfg = tiny(TrainTaskKind::copy, pe);
    torch::manual_seed(3);
    posenc::detail::Transformer net(model_config_for(cfg), positional_config_for(cfg));
    torch::optim::AdamW opt(net->parameters(), torch::optim::AdamWOptions(3e-2));
    SampleRng rng(17);
    for (int step = 0; step < 5; ++step) {
      const TrainSample s = task.sample(rng, 12);
      std::vector<int64_t> toks(s.prompt.begin(), s.prompt.end());
      toks.insert(toks.end(), s.answer.begin(), s.answer.end() - 1);
      const auto t = torch::tensor(toks).view({1, -1});
      const auto logits = net->forward(t);
      const auto target = torch::roll(t, -1, 1);
      const auto loss = torch::nn::functional::cross_entropy(logits.view({-1, task.vocab_size()}), target.view({-1}));
      opt.zero_grad();
      loss.backward();
      opt.step();
    }
    const TrainSample s = task.sample(rng, 12);
    std::vector<int32_t> seq(s.prompt.begin(), s.prompt.end());
    seq.insert(seq.end(), s.answer.begin(), s.answer.end() - 1);
    std::vector<int64_t> seq64(seq.begin(), seq.end());
    torch::Tensor ref;
    {
      torch::NoGradGuard ng;
      ref = net->forward(torch::tensor(seq64).view({1, -1}))[0].contiguous();
    }
    TempDir d;
    const auto path = d.path() / "m.pt";
    save_posenc_checkpoint(path, net->to_checkpoint(task.symbols(), "{}"));
    const Model m = Model::load(path);
    EXPECT_EQ(m.family(), family_of(pe));
    const std::vector<float> got = m.score_window(seq);
    ASSERT_EQ(static_cast<int64_t>(got.size()), ref.numel());
    const float* r = ref.data_ptr<float>();
    float maxabs = 1.0f, maxdiff = 0.0f;
    for (int64_t i = 0; i < ref.numel(); ++i) maxabs = std::max(maxabs, std::abs(r[i]));
    for (int64_t i = 0; i < ref.numel(); ++i) maxdiff = std::max(maxdiff, std::abs(r[i] - got[static_cast<std::size_t>(i)]));
    EXPECT_LE(maxdiff, 1e-5f * maxabs) << "max |logit| " << maxabs;
    ::testing::Test::RecordProperty(std::string("max_abs_logit_diff_") + std::string(to_string(pe)),
                                    fmt::format("{:.3g} (max |logit| {:.3g})", maxdiff, maxabs));
    const int V = task.vocab_size();
    for (std::size_t p = 0; p < seq.size(); ++p) {
      const auto* a = r + p * static_cast<std::size_t>(V);
      const auto* b = got.data() + p * static_cast<std::size_t>(V);
      EXPECT_EQ(std::max_element(a, a + V) - a, std::max_element(b, b + V) - b) << "position " << p;
    }
    if (pe == TrainEncoding::t5) {  // the T5 table did train
      const auto ck = m.to_checkpoint();
      const auto it = std::find_if(ck.tensors.begin(), ck.tensors.end(),
                                   [](const auto& t) { return t.name == "t5_relative_attention_bias"; });
      ASSERT_NE(it, ck.tensors.end());
      EXPECT_GT(*std::max_element(it->data.begin(), it->data.end()), 1e-3f);
    }
  }
}

TEST(TrainModel, TrainingIsDeterministicBySeed) {
  TempDir d;
  TrainConfig c = tiny(TrainTaskKind::associative_recall, TrainEncoding::t5);
  c.out = d.path() / "a.pt";
  const TrainResult ra = train_model(c);
  c.out = d.path() / "b.pt";
  const TrainResult rb = train_model(c);
  c.seed = 2;
  c.out = d.path() / "c.pt";
  train_model(c);
  EXPECT_EQ(ra.loss_curve, rb.loss_curve);
  auto weights = [](const std::filesystem::path& p) {
    std::vector<float> all;
    for (const auto& t : Model::load(p).to_checkpoint().tensors) all.insert(all.end(), t.data.begin(), t.data.end());
    return all;
  };
  EXPECT_EQ(weights(d.path() / "a.pt"), weights(d.path() / "b.pt"));
  EXPECT_NE(weights(d.path() / "a.pt"), weights(d.path() / "c.pt"));
  const Model m = Model::load(d.path() / "a.pt");
  // Trained context: the longest multi-query training sequence (m = 5 pairs
  // at 12 tokens, so 4 extra queries of 4 tokens each).
  ASSERT_EQ(c.ar_queries, 8);
  EXPECT_EQ(m.config().max_position_embeddings, Task(TrainTaskKind::associative_recall).training_positions(12, 8));
  EXPECT_EQ(m.config().max_position_embeddings, Task(TrainTaskKind::associative_recall).positions_needed(12) + 4 * 4);
  EXPECT_EQ(m.embedded_symbols(), Task(TrainTaskKind::associative_recall).symbols());
  const auto meta = nlohmann::json::parse(m.metadata_json());
  EXPECT_EQ(meta["task"], "associative_recall");
  EXPECT_EQ(meta["pe"], "t5");
  EXPECT_EQ(meta["steps"], 12);
}

TEST(TrainModel, BadHyperParametersAreConfigErrors) {
  TrainConfig c = tiny(TrainTaskKind::copy, TrainEncoding::rope25);
  c.dim = 24;  // head_dim 6: rope25 needs head_dim % 8 == 0
  EXPECT_THROW(train_model(c), ConfigError);
  c = tiny(TrainTaskKind::copy, TrainEncoding::rope);
  c.steps = 0;
  EXPECT_THROW(train_model(c), ConfigError);
  c = tiny(TrainTaskKind::associative_recall, TrainEncoding::rope);
  c.train_lengths = {3, 3, 1};  // no valid associative-recall length
  EXPECT_THROW(train_model(c), ConfigError);
  c = tiny(TrainTaskKind::copy, TrainEncoding::rope);
  c.curriculum = 1.0;  // the whole run would be a ramp that never reaches the longest length
  EXPECT_THROW(train_model(c), ConfigError);
}

TEST(TrainModel, CurriculumRampsTheLongestLengthOverItsFraction) {
  TrainConfig c;
  c.steps = 1000;
  c.curriculum = 0.5;
  const std::vector<int> lengths = Task(TrainTaskKind::associative_recall).lengths_in(8, 32);  // 8, 10, ..., 32
  ASSERT_EQ(lengths.size(), 13u);
  EXPECT_EQ(curriculum_count(c, lengths, 0), 1u);    // the shortest length only
  EXPECT_EQ(curriculum_count(c, lengths, 249), 7u);  // half-way up the ramp: bound 20, lengths 8..20
  EXPECT_EQ(curriculum_count(c, lengths, 499), 13u);
  EXPECT_EQ(curriculum_count(c, lengths, 500), 13u);
  std::size_t previous = 0;
  for (int step = 0; step < c.steps; ++step) {  // never shrinks, never exceeds the list
    const std::size_t k = curriculum_count(c, lengths, step);
    EXPECT_GE(k, previous);
    EXPECT_LE(k, lengths.size());
    previous = k;
  }
  c.curriculum = 0.0;
  EXPECT_EQ(curriculum_count(c, lengths, 0), 13u);
  EXPECT_EQ(curriculum_count(c, {}, 0), 0u);
}

TEST(TrainRecipe, ParsesAppliesAndNamesBadEntries) {
  const TaskRecipe r = parse_task_recipe("curriculum=0.25,steps=6000,lr=1e-3,batch-size=16", "--recipe");
  EXPECT_EQ(to_string(r), "lr=0.001,steps=6000,batch-size=16,curriculum=0.25");
  EXPECT_EQ(parse_task_recipe("steps=6000,lr=1e-3", "--recipe"),
            default_recipe(TrainTaskKind::associative_recall));
  EXPECT_EQ(parse_task_recipe(to_string(r), "--recipe"), r);  // round trip
  EXPECT_TRUE(parse_task_recipe("none", "--recipe").empty());
  EXPECT_TRUE(default_recipe(TrainTaskKind::copy).empty());
  EXPECT_EQ(default_recipes().size(), 1u);
  TrainConfig c;
  apply_recipe(c, parse_task_recipe("lr=2e-3", "--recipe"));
  EXPECT_EQ(c.lr, 2e-3);
  EXPECT_EQ(c.steps, TrainConfig{}.steps);  // unset fields keep the common value
  for (const char* bad : {"lr=0", "lr=-1", "lr=nan", "lr=1e999", "steps=0", "steps=1.5", "steps=x", "warmup=10", "lr",
                          "lr=", "", "lr=1e-3,", "lr=1e300", "lr=0.1,lr=0.2", "steps=1,steps=2", "curriculum=1",
                          "curriculum=-0.1", "curriculum=nan", "curriculum=0.5,curriculum=0.5"}) {
    try {
      (void)parse_task_recipe(bad, "--recipe");
      ADD_FAILURE() << "accepted '" << bad << "'";
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find("--recipe"), std::string::npos) << e.what();
    }
  }
}

TEST(TrainEvaluate, LearnedTablePastItsLengthCannotRunAndScalingsApplyToRope) {
  TempDir d;
  TrainConfig c = tiny(TrainTaskKind::copy, TrainEncoding::learned);
  c.out = d.path() / "learned.pt";
  train_model(c);
  const Task task(TrainTaskKind::copy);
  const Model learned = Model::load(c.out);
  ExactMatchOptions o;
  o.lengths = {4, 12, 13, 40};
  o.samples = 8;
  const auto cells = evaluate_exact_match(learned, task, o);
  ASSERT_EQ(cells.size(), 4u);
  EXPECT_TRUE(cells[0].can_run);
  EXPECT_TRUE(cells[1].can_run);  // 12 is the longest training length
  EXPECT_EQ(cells[1].samples, 8);
  EXPECT_FALSE(cells[2].can_run);  // one input token more needs a row the table lacks
  EXPECT_NE(cells[2].note.find("max_position_embeddings"), std::string::npos) << cells[2].note;
  EXPECT_FALSE(cells[3].can_run);
  o.rope_scaling = "linear";
  EXPECT_THROW(evaluate_exact_match(learned, task, o), InvalidArgument);

  c.pe = TrainEncoding::rope;
  c.out = d.path() / "rope.pt";
  train_model(c);
  const Model rope = Model::load(c.out);
  for (const char* s : {"default", "linear", "ntk", "yarn", "dynamic"}) {
    o.rope_scaling = s;
    for (const auto& cell : evaluate_exact_match(rope, task, o)) {
      EXPECT_TRUE(cell.can_run) << s;
      EXPECT_EQ(cell.samples, 8);
      EXPECT_LE(cell.correct, cell.samples);
    }
  }
  // At training lengths the factor is 1: linear/ntk leave the frequencies unchanged.
  o.lengths = {4, 8};
  o.rope_scaling = "default";
  const auto base = evaluate_exact_match(rope, task, o);
  o.rope_scaling = "linear";
  const auto lin = evaluate_exact_match(rope, task, o);
  for (std::size_t i = 0; i < base.size(); ++i) EXPECT_EQ(base[i].correct, lin[i].correct);
}

TEST(TrainEvaluate, ExactMatchAgreesWithGreedyDecodingOneSampleAtATime) {
  TempDir d;
  TrainConfig c = tiny(TrainTaskKind::associative_recall, TrainEncoding::alibi);
  c.steps = 60;
  c.out = d.path() / "ar.pt";
  train_model(c);
  const Model m = Model::load(c.out);
  const Task task(TrainTaskKind::associative_recall);
  ExactMatchOptions o;
  o.lengths = {10};
  o.samples = 40;
  o.seed = 5;
  o.batch = 7;  // several batches
  const auto cells = evaluate_exact_match(m, task, o);
  SampleRng rng(derive_seed(5, "eval/associative_recall", 10));
  int64_t correct = 0;
  for (int i = 0; i < 40; ++i) {
    const TrainSample s = task.sample(rng, 10);
    correct += greedy_answer(m, s.prompt, static_cast<int>(s.answer.size())) == s.answer;
  }
  EXPECT_EQ(cells[0].correct, correct);
}

TEST(TrainBlas, SlowOpenBlasCoresAreReplacedByTheFastestTheCpuRuns) {
  // Only the two names 0.3.21 falls back to on recent Xeons are replaced.
  EXPECT_EQ(fast_openblas_coretype(nullptr), nullptr);
  EXPECT_EQ(fast_openblas_coretype("SkylakeX"), nullptr);
  EXPECT_EQ(fast_openblas_coretype("Haswell"), nullptr);
  EXPECT_EQ(fast_openblas_coretype("Zen"), nullptr);
  __builtin_cpu_init();
  const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  const std::string expected = avx512 ? "SkylakeX" : avx2 ? "Haswell" : "";
  for (const char* reported : {"Prescott", "Cooperlake"}) {
    const char* fast = fast_openblas_coretype(reported);
    EXPECT_EQ(fast ? std::string(fast) : std::string(), expected) << reported;
  }
}

}  // namespace POSENC_UNITY_ID
