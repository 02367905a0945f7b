// Forced choice without length bias (issue 14, part 1): acc and acc_norm side
// by side, name_recall's equal-length candidates, the "absent" control that
// measures chance on the real stories260K, the summary's measured chance and
// pooled Wilson brackets, and the defaults that follow the model.
#include <algorithm>
#include <cmath>
#include <filesystem>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "posenc/error.hpp"
#include "posenc/eval.hpp"
#include "posenc/io.hpp"
#include "posenc/stats.hpp"
#include "posenc/tasks.hpp"
#include "test_support.hpp"

namespace POSENC_UNITY_ID {  // this file's own namespace in the tests' unity build (CMakeLists.txt)

using namespace posenc;
namespace fs = std::filesystem;
using posenc::test::run_cli;
using posenc::test::slurp;
using posenc::test::TempDir;

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

}  // namespace

TEST(ChoiceScoring, AccSumsAndAccNormDividesByCandidateBytes) {
  // " Tom" (3 bytes) at -2.0 nats vs " Billy" (5 bytes) at -2.9: acc takes the
  // higher sum (Tom), acc_norm the higher per-byte value (-0.667 vs -0.58: Billy).
  const std::vector<double> lp{-2.0, -2.9};
  const std::vector<int64_t> bytes{candidate_bytes(" Tom"), candidate_bytes(" Billy")};
  EXPECT_EQ(bytes, (std::vector<int64_t>{3, 5}));
  const ChoiceScore s = score_choice(lp, bytes);
  EXPECT_EQ(s.acc, 0);
  EXPECT_EQ(s.acc_norm, 1);
  EXPECT_EQ(s.predicted("acc"), 0);
  EXPECT_EQ(s.predicted("acc_norm"), 1);
  // Ties go to the first candidate under both.
  const ChoiceScore t = score_choice(std::vector<double>{-1.0, -1.0}, std::vector<int64_t>{2, 2});
  EXPECT_EQ(t.acc, 0);
  EXPECT_EQ(t.acc_norm, 0);
  EXPECT_THROW(score_choice(lp, std::vector<int64_t>{3}), InvalidArgument);
  EXPECT_THROW(score_choice(lp, std::vector<int64_t>{3, 0}), InvalidArgument);
  EXPECT_THROW((void)s.predicted("choice"), InvalidArgument);
}

TEST(ChoiceScoring, NameRecallCandidatesHaveEqualTokensAndBytesUnderTok512) {
  // tok512 splits the 24 names unevenly, but classes of equal (tokens, bytes)
  // with >= 4 names exist, so every sample's candidates share one length and
  // acc and acc_norm pick the same candidate.
  const TaskGenerator gen(tok(), hay(), TaskOptions{});
  for (int64_t i = 0; i < 40; ++i) {
    const TaskSample s = gen.make("name_recall", i, 256, 0.5);
    ASSERT_EQ(s.choices.size(), 4u);
    EXPECT_TRUE(s.equal_length_choices) << i;
    ASSERT_EQ(s.choice_bytes.size(), 4u);
    for (std::size_t c = 1; c < 4; ++c) {
      EXPECT_EQ(s.choice_tokens[c].size(), s.choice_tokens[0].size()) << i;
      EXPECT_EQ(s.choice_bytes[c], s.choice_bytes[0]) << i;
      EXPECT_EQ(s.choice_bytes[c] + 1, static_cast<int64_t>(s.choices[c].size()));  // without the leading space
    }
  }
  const auto samples = [&] {
    std::vector<TaskSample> v;
    for (int64_t i = 0; i < 12; ++i) v.push_back(gen.make("name_recall", i, 128, 0.5));
    return v;
  }();
  for (std::size_t i = 0; i < samples.size(); ++i) {
    const auto o = evaluate_samples(model(), tok(), std::span<const TaskSample>(&samples[i], 1));
    EXPECT_EQ(o[0].predicted, o[0].predicted_acc) << i;
    EXPECT_EQ(o[0].correct, o[0].correct_acc) << i;
  }
  // associative_recall candidates are single one-byte value tokens.
  // (Its vocabulary needs a trained model: covered by the CLI test below.)
}

TEST(ChoiceScoring, AWideClassIsNotInventedWhenKExceedsIt) {
  // K = 16 exceeds every (tokens, bytes) class of the 24 names: the candidates
  // fall back to the first 16 names and say so; acc_norm alone removes the bias.
  TaskOptions o;
  o.choices = 16;
  const TaskSample s = TaskGenerator(tok(), hay(), o).make("name_recall", 3, 256, 0.5);
  EXPECT_FALSE(s.equal_length_choices);
  EXPECT_EQ(s.choices.size(), 16u);
}

TEST(AbsentControl, RemovesTheEvidenceAndKeepsCandidatesAndGold) {
  const TaskGenerator gen(tok(), hay(), TaskOptions{});
  for (int64_t i = 0; i < 10; ++i) {
    const TaskSample none = gen.make("name_recall", i, 256, 0.5);
    const TaskSample absent = gen.make("name_recall", i, 256, 0.5, TaskControl::absent);
    EXPECT_EQ(absent.depth, -1.0);
    EXPECT_TRUE(absent.needles.empty());
    EXPECT_EQ(absent.choices, none.choices);
    EXPECT_EQ(absent.gold, none.gold);
    EXPECT_EQ(absent.original_gold, none.gold);
    // The gold name occurs nowhere in the prompt (the haystack drops every candidate name).
    const std::string name = none.choices[static_cast<std::size_t>(none.gold)].substr(1);
    EXPECT_EQ(absent.prompt_text.find(name), std::string::npos) << absent.prompt_text;
    EXPECT_NE(none.prompt_text.find(name), std::string::npos);
    EXPECT_LE(static_cast<int64_t>(absent.prompt_tokens.size()) + absent.answer_budget, 256);
  }
  EXPECT_THROW(gen.make("passkey", 0, 256, 0.5, TaskControl::absent), InvalidArgument);
  EXPECT_EQ(parse_task_control("absent"), TaskControl::absent);
}

TEST(AbsentControl, AccuracyWithoutEvidenceIsChanceForEveryScoringOnStories260K) {
  // 200 samples of name_recall at 128 tokens with the needle removed, K = 4:
  // for acc and acc_norm, 1/K lies in the Wilson 95% interval of the accuracy.
  // (With the evidence, acc_norm is far above it: the control is what removes it.)
  const TaskGenerator gen(tok(), hay(), TaskOptions{});
  const int64_t n = 200;
  std::vector<TaskSample> absent, none;
  const int64_t n_none = 60;
  for (int64_t i = 0; i < n; ++i) absent.push_back(gen.make("name_recall", i, 128, 0.0, TaskControl::absent));
  for (int64_t i = 0; i < n_none; ++i) none.push_back(gen.make("name_recall", i, 128, 1.0));
  int64_t k_acc = 0, k_norm = 0, k_none = 0;
  std::vector<SampleOutcome> a(absent.size()), b(none.size());
#pragma omp parallel for schedule(dynamic, 8)
  for (std::size_t i = 0; i < absent.size(); ++i)
    a[i] = evaluate_samples(model(), tok(), std::span<const TaskSample>(&absent[i], 1))[0];
#pragma omp parallel for schedule(dynamic, 8)
  for (std::size_t i = 0; i < none.size(); ++i)
    b[i] = evaluate_samples(model(), tok(), std::span<const TaskSample>(&none[i], 1))[0];
  for (const auto& o : a) {
    k_acc += o.correct_acc ? 1 : 0;
    k_norm += o.correct ? 1 : 0;
  }
  for (const auto& o : b) k_none += o.correct ? 1 : 0;
  for (const auto& [name, k] : {std::pair{"acc", k_acc}, std::pair{"acc_norm", k_norm}}) {
    const Interval ci = wilson_interval(k, n);
    EXPECT_LE(ci.low, 0.25) << name << " " << k << "/" << n;
    EXPECT_GE(ci.high, 0.25) << name << " " << k << "/" << n;
  }
  EXPECT_GT(wilson_interval(k_none, n_none).low, 0.25) << "with the needle at the end: " << k_none << "/" << n_none;
}

// ---------------------------------------------------------------- summary

namespace {

nlohmann::json cell(const std::string& task, const std::string& control, int64_t L, double depth, int64_t n, int64_t k,
                    std::optional<int64_t> k_acc = {}) {
  const Interval ci = wilson_interval(k, n);
  nlohmann::json c{{"task", task},     {"control", control}, {"rope_scaling", "default"}, {"length", L},
                   {"depth", depth},   {"n", n},             {"correct", k},
                   {"accuracy", static_cast<double>(k) / static_cast<double>(n)},
                   {"ci_low", ci.low}, {"ci_high", ci.high}, {"status", "ok"}};
  if (k_acc) {
    const Interval ca = wilson_interval(*k_acc, n);
    c["metric"] = "acc_norm";
    c["metrics"] = {{"acc_norm", {{"correct", k}, {"accuracy", c["accuracy"]}, {"ci_low", ci.low}, {"ci_high", ci.high}}},
                    {"acc", {{"correct", *k_acc}, {"accuracy", static_cast<double>(*k_acc) / static_cast<double>(n)},
                             {"ci_low", ca.low}, {"ci_high", ca.high}}}};
  }
  return c;
}

}  // namespace

TEST(EvalSummaryTable, PooledBracketIsTheWilsonIntervalOfThePooledCounts) {
  // Two depths at L=256: 9/10 and 1/10. Pooled 10/20: Wilson [0.299, 0.701]
  // (the old bracket was [min cell low, max cell high] = [0.017, 0.982]).
  nlohmann::json s{{"run_id", "x"}, {"cells_present", 2}, {"cells_expected", 2}, {"complete", true},
                   {"cells", {cell("passkey", "none", 256, 0.0, 10, 9), cell("passkey", "none", 256, 1.0, 10, 1)}},
                   {"effective_context", nlohmann::json::array()}};
  const Interval pooled = wilson_interval(10, 20);
  EXPECT_NEAR(pooled.low, 0.2993, 1e-4);
  EXPECT_NEAR(pooled.high, 0.7007, 1e-4);
  const std::string t = format_eval_summary(s);
  EXPECT_NE(t.find(fmt::format("0.50 [{:.2f},{:.2f}]", pooled.low, pooled.high)), std::string::npos) << t;
  EXPECT_EQ(t.find("0.02,0.98"), std::string::npos) << t;
}

TEST(EvalSummaryTable, OldSummaryWithoutSchemaVersionStillFormats) {
  // A generator-version-1 summary: no schema_version, no metric(s), chance 1/K assumed.
  nlohmann::json s{{"run_id", "old"}, {"cells_present", 1}, {"cells_expected", 1}, {"complete", true},
                   {"cells", {cell("name_recall", "none", 256, 0.5, 50, 30)}},
                   {"effective_context",
                    {{{"task", "name_recall"}, {"control", "none"}, {"rope_scaling", "default"}, {"baseline", 0.6},
                      {"baseline_ci_low", 0.46}, {"threshold", 0.51}, {"length", 256}, {"solvable", true},
                      {"status", "ok"}, {"chance", 0.25}}}}};
  const std::string t = format_eval_summary(s);
  EXPECT_NE(t.find("name_recall        none     default  acc         "), std::string::npos) << t;
  EXPECT_NE(t.find("256 (baseline 0.60, threshold 0.51; chance 0.25, assumed)"), std::string::npos) << t;
}

TEST(EvalSummaryTable, NoScalingColumnForAModelWithoutRope) {
  nlohmann::json s{{"run_id", "x"}, {"cells_present", 1}, {"cells_expected", 1}, {"complete", true},
                   {"model", {{"family", "alibi"}, {"trained_context", 64}}},
                   {"cells", {cell("passkey", "none", 64, 0.5, 10, 5), cell("passkey", "swap", 64, 0.5, 10, 4)}},
                   {"effective_context", nlohmann::json::array()},
                   {"controls",
                    {{{"task", "passkey"}, {"control", "swap"}, {"rope_scaling", "default"}, {"length", 64}, {"n", 10},
                      {"followed_rate", 0.4}, {"ci_low", 0.17}, {"ci_high", 0.69}, {"kept_original_answer", 1},
                      {"prediction_changed", 6}, {"paired_with_none", 10}, {"none_correct", 5}}}}};
  const std::string t = format_eval_summary(s);
  EXPECT_NE(t.find("followed [95% CI]"), std::string::npos) << t;
  EXPECT_EQ(t.find("scaling"), std::string::npos) << t;
  EXPECT_EQ(t.find("default"), std::string::npos) << t;
  s["model"]["family"] = "rope";
  EXPECT_NE(format_eval_summary(s).find("scaling"), std::string::npos);
}

// ---------------------------------------------------------------- the runner

TEST(EvalChanceRun, AbsentCellsMeasureChanceAndTheGateUsesIt) {
  // The real runner on stories260K: name_recall at two lengths, one depth.
  TempDir d;
  const auto r = run_cli("eval --model '" + test::model_path().string() + "' --tokenizer '" +
                         test::tokenizer_path().string() + "' --haystack '" + test::text_path().string() +
                         "' --tasks name_recall --context 128,256 --depths 1 --samples 30 --ppl-tokens -1 --quiet "
                         "--out '" + (d.path() / "e").string() + "'");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const fs::path run = resolve_run_dir(d.path() / "e");
  const auto summary = nlohmann::json::parse(slurp(run / "summary.json"));
  EXPECT_EQ(summary["schema_version"], 2);
  EXPECT_EQ(summary["model"]["family"], "rope");
  EXPECT_EQ(summary["cells_expected"], 4);  // 2 lengths x (1 depth + 1 absent)
  int64_t absent_cells = 0;
  for (const auto& c : summary["cells"]) {
    EXPECT_EQ(c["metric"], "acc_norm");
    EXPECT_TRUE(c["metrics"].contains("acc"));
    EXPECT_EQ(c["metrics"]["acc_norm"]["correct"], c["correct"]);
    if (c["control"] == "absent") {
      ++absent_cells;
      EXPECT_TRUE(c["depth"].is_null());
    }
  }
  EXPECT_EQ(absent_cells, 2);
  ASSERT_EQ(summary["chance"].size(), 2u);  // acc_norm, acc
  for (const auto& ch : summary["chance"]) {
    EXPECT_EQ(ch["n"], 60);
    EXPECT_DOUBLE_EQ(ch["assumed"].get<double>(), 0.25);
    const Interval ci = wilson_interval(ch["correct"].get<int64_t>(), 60);
    EXPECT_DOUBLE_EQ(ch["ci_high"].get<double>(), ci.high);
  }
  int64_t eff = 0;
  for (const auto& e : summary["effective_context"]) {
    ++eff;
    EXPECT_NE(e["control"], "absent");
    EXPECT_EQ(e["chance_source"], "measured");
    // The gate is the upper bound of the measured chance.
    EXPECT_DOUBLE_EQ(e["chance_gate"].get<double>(), e["chance_ci_high"].get<double>());
    EXPECT_EQ(e["solvable"].get<bool>(), e["baseline_ci_low"].get<double>() > e["chance_ci_high"].get<double>());
  }
  EXPECT_EQ(eff, 2);  // none x {acc_norm, acc}
  // Each sample records both scorings and the candidates' byte lengths.
  const std::string first = slurp(run / "samples.jsonl").substr(0, slurp(run / "samples.jsonl").find('\n'));
  const auto s0 = nlohmann::json::parse(first);
  EXPECT_EQ(s0["choice_bytes"].size(), 4u);
  EXPECT_EQ(s0["candidate_logprobs"].size(), 4u);
  EXPECT_TRUE(s0["correct_by_metric"].contains("acc"));
  EXPECT_EQ(s0["correct_by_metric"]["acc_norm"], s0["correct"]);
  // The table shows the absent row and the measured chance.
  EXPECT_NE(r.out.find("absent"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("measured"), std::string::npos) << r.out;
  const std::string csv = slurp(run / "summary.csv");
  EXPECT_EQ(csv.substr(0, csv.find('\n')), "task,control,rope_scaling,length,depth,metric,primary,n,correct,accuracy,ci_low,ci_high,status");
  // --control absent is not a choice: it runs by itself.
  const auto bad = run_cli("eval --model '" + test::model_path().string() + "' --tokenizer '" +
                           test::tokenizer_path().string() + "' --haystack '" + test::text_path().string() +
                           "' --tasks name_recall --control absent --out '" + (d.path() / "f").string() + "'");
  EXPECT_EQ(bad.exit_code, 2);
  EXPECT_NE(bad.err.find("--control: absent"), std::string::npos) << bad.err;
}

TEST(EvalChanceRun, ProgressEtaCoversThePerplexityMatrix) {
  // The ETA after the last task group still counts the perplexity jobs ahead.
  TempDir d;
  EvalConfig c;
  c.model_path = test::model_path().string();
  c.tokenizer_path = test::tokenizer_path().string();
  c.haystack_path = test::text_path().string();
  c.tasks = {"name_recall"};
  c.lengths = {64};
  c.depths = {0.5};
  c.samples = 4;
  c.ppl_tokens = 20000;
  c.out = d.path();
  std::vector<EvalProgress> events;
  (void)run_eval(model(), tok(), read_file(test::text_path()), c, [&](const EvalProgress& p) { events.push_back(p); });
  // Forced reports at the end of each group: after the last one, work remains (the ppl job).
  const auto last_group = std::find_if(events.rbegin(), events.rend(), [](const EvalProgress& p) {
    return p.current.rfind("ppl", 0) != 0;
  });
  ASSERT_NE(last_group, events.rend());
  EXPECT_GT(last_group->eta_seconds, 0.0) << last_group->current;
  EXPECT_TRUE(std::any_of(events.begin(), events.end(), [](const EvalProgress& p) { return p.current.rfind("ppl", 0) == 0; }));
  EXPECT_NEAR(events.back().eta_seconds, 0.0, 1e-9);
}

TEST(EvalDefaults, LengthsFollowTheTrainedContext) {
  // stories260K: trained at 512 (llama2.c seq_len).
  EXPECT_EQ(model().trained_context(), 512);
  EXPECT_EQ(default_eval_lengths(model()), (std::vector<int64_t>{256, 512, 1024, 2048, 4096}));
  EXPECT_EQ(default_eval_tasks(tok()), std::vector<std::string>{"name_recall"});
}

#if POSENC_WITH_TRAIN  // trains a model or runs `posenc train`/`study` (not in a -DPOSENC_WITH_TRAIN=OFF build)
TEST(EvalDefaults, AnAssociativeRecallModelTrainedAt64RunsEvalWithNoOtherFlag) {
  TempDir d;
  const fs::path m = d.path() / "ar.pt", learned = d.path() / "learned.pt";
  // --ar-queries 1: the training sequence of 62 tokens is the eval format, 64 positions.
  const auto t = run_cli("train --task associative_recall --pe rope --dim 32 --heads 4 --train-lengths 8:62 "
                         "--ar-queries 1 --eval-samples 0 --steps 20 --batch-size 8 --out " + m.string());
  ASSERT_EQ(t.exit_code, 0) << t.err;
  const auto r = run_cli("eval --model " + m.string() + " --out " + (d.path() / "e").string());
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const auto run = nlohmann::json::parse(slurp(resolve_run_dir(d.path() / "e") / "run.json"));
  EXPECT_EQ(run["model"]["trained_context"], 64);
  EXPECT_EQ(run["config"]["lengths"], (std::vector<int64_t>{32, 64, 128, 256, 512}));
  EXPECT_EQ(run["config"]["tasks"], std::vector<std::string>{"associative_recall"});
  EXPECT_EQ(run["config"]["ppl_tokens"], -1);  // no --haystack: no perplexity matrix
  const auto summary = nlohmann::json::parse(slurp(resolve_run_dir(d.path() / "e") / "summary.json"));
  int64_t fits = 0;
  for (const auto& c : summary["cells"]) {
    if (c["length"] == 512) EXPECT_EQ(c["status"], "does not fit");  // 128 keys fill at most 260 tokens
    else fits += c["status"] == "ok" ? 1 : 0;
  }
  EXPECT_EQ(fits, 4 * 6);  // 4 lengths x (5 depths + absent)
  // A learned table of 64 rows: no length past it.
  const auto tl = run_cli("train --task associative_recall --pe learned --dim 32 --heads 4 --train-lengths 8:62 "
                          "--ar-queries 1 --eval-samples 0 --steps 5 --batch-size 4 --out " + learned.string());
  ASSERT_EQ(tl.exit_code, 0) << tl.err;
  const auto rl = run_cli("eval --model " + learned.string() + " --samples 2 --out " + (d.path() / "l").string());
  ASSERT_EQ(rl.exit_code, 0) << rl.err;
  const auto runl = nlohmann::json::parse(slurp(resolve_run_dir(d.path() / "l") / "run.json"));
  EXPECT_EQ(runl["model"]["family"], "learned");
  EXPECT_EQ(runl["config"]["lengths"], (std::vector<int64_t>{32, 64}));
  EXPECT_EQ(rl.out.find("scaling"), std::string::npos) << rl.out;
  // A --trained-context past the table: the lengths follow the table (they were {8} alone).
  const auto rt = run_cli("eval --model " + learned.string() + " --trained-context 1000 --samples 2 --out " +
                          (d.path() / "t").string());
  ASSERT_EQ(rt.exit_code, 0) << rt.err;
  const auto runt = nlohmann::json::parse(slurp(resolve_run_dir(d.path() / "t") / "run.json"));
  EXPECT_EQ(runt["config"]["lengths"], (std::vector<int64_t>{32, 64}));
}
#endif

TEST(EvalSummaryTable, AccRowsAreShownOnlyWhereTheyDifferFromAccNorm) {
  auto summary = [](int64_t k_acc) {
    return nlohmann::json{{"run_id", "x"}, {"cells_present", 1}, {"cells_expected", 1}, {"complete", true},
                          {"cells", {cell("name_recall", "none", 256, 0.5, 20, 12, k_acc)}},
                          {"effective_context", nlohmann::json::array()}};
  };
  const std::string same = format_eval_summary(summary(12));
  EXPECT_NE(same.find("0.60 ["), std::string::npos) << same;
  EXPECT_EQ(same.find(" acc    "), std::string::npos) << same;
  EXPECT_NE(same.find("(1 acc rows equal to their acc_norm rows are not repeated"), std::string::npos) << same;
  const std::string differ = format_eval_summary(summary(7));
  const Interval ci = wilson_interval(7, 20);
  EXPECT_NE(differ.find(fmt::format("acc            0.35 [{:.2f},{:.2f}]", ci.low, ci.high)), std::string::npos)
      << differ;
}

}  // namespace POSENC_UNITY_ID
