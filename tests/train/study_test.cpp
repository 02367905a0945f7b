// The study smoke test (1 task x 2 encodings x 1 seed, few steps) through the
// CLI, its resumption, and its report; plus the train -> generate round trip.
#include <filesystem>
#include <fstream>

#include <fmt/format.h>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "posenc/error.hpp"
#include "posenc/checkpoint.hpp"
#include "posenc/model.hpp"
#include "posenc/study.hpp"
#include "test_support.hpp"

namespace POSENC_UNITY_ID {  // this file's own namespace in the tests' unity build (CMakeLists.txt)

using namespace posenc;
using posenc::test::run_cli;
using posenc::test::slurp;
using posenc::test::TempDir;
namespace fs = std::filesystem;

namespace {

const char* kSmoke =
    "study --tasks copy --pe learned,rope --seeds 1 --steps 40 --batch-size 8 --dim 32 --heads 4 "
    "--train-lengths 4:8 --test-lengths 4:20:4 --rope-scaling linear,dynamic --out ";

std::vector<float> weights(const fs::path& p) {
  std::vector<float> all;
  for (const auto& t : Model::load(p).to_checkpoint().tensors) all.insert(all.end(), t.data.begin(), t.data.end());
  return all;
}

}  // namespace

TEST(TrainStudy, SmokeStudyRunsResumesAndReports) {
  TempDir d;
  const fs::path out = d.path() / "study";
  const std::string smoke = kSmoke + out.string() + " --samples 12";
  // Shard 1 of 2 runs only the second model.
  const auto r0 = run_cli(smoke + " --shard 1/2");
  ASSERT_EQ(r0.exit_code, 0) << r0.err;
  EXPECT_TRUE(fs::exists(out / "evals/copy-rope-s1.json"));
  EXPECT_FALSE(fs::exists(out / "models/copy-learned-s1.pt"));
  EXPECT_EQ(r0.err.find("[1/2]"), std::string::npos) << r0.err;
  fs::remove(out / "models/copy-rope-s1.pt");
  fs::remove(out / "evals/copy-rope-s1.json");
  const auto r1 = run_cli(smoke);
  ASSERT_EQ(r1.exit_code, 0) << r1.err;
  EXPECT_NE(r1.err.find("[1/2] copy-learned-s1: training 40 steps"), std::string::npos) << r1.err;
  for (const char* n : {"copy-learned-s1", "copy-rope-s1"}) {
    EXPECT_TRUE(fs::exists(out / "models" / (std::string(n) + ".pt")));
    EXPECT_TRUE(fs::exists(out / "evals" / (std::string(n) + ".json")));
  }
  const auto rope_eval = nlohmann::json::parse(slurp(out / "evals/copy-rope-s1.json"));
  EXPECT_EQ(rope_eval["results"].size(), 3u);  // default, linear, dynamic
  const auto learned_eval = nlohmann::json::parse(slurp(out / "evals/copy-learned-s1.json"));
  EXPECT_EQ(learned_eval["results"].size(), 1u);
  const auto& cells = learned_eval["results"]["default"];
  ASSERT_EQ(cells.size(), 5u);  // 4, 8, 12, 16, 20
  EXPECT_TRUE(cells[1]["can_run"].get<bool>());
  EXPECT_FALSE(cells[2]["can_run"].get<bool>());  // past the learned table
  EXPECT_EQ(cells[2]["samples"], 0);

  // Resume after a "kill": the finished model is not retrained (bytes and
  // mtime unchanged); a lost evaluation and checkpoint are recomputed, and
  // determinism makes the new checkpoint identical to the lost one.
  const auto learned_pt = out / "models/copy-learned-s1.pt";
  const auto rope_pt = out / "models/copy-rope-s1.pt";
  const std::string learned_bytes = slurp(learned_pt);
  const auto rope_weights = weights(rope_pt);
  const auto learned_mtime = fs::last_write_time(learned_pt);
  fs::remove(rope_pt);
  fs::remove(out / "evals/copy-rope-s1.json");
  const auto r2 = run_cli(smoke);
  ASSERT_EQ(r2.exit_code, 0) << r2.err;
  EXPECT_NE(r2.err.find("[1/2] copy-learned-s1: evaluated already, skipped"), std::string::npos) << r2.err;
  EXPECT_NE(r2.err.find("[2/2] copy-rope-s1: training 40 steps"), std::string::npos) << r2.err;
  EXPECT_EQ(fs::last_write_time(learned_pt), learned_mtime);
  EXPECT_TRUE(slurp(learned_pt) == learned_bytes);
  EXPECT_TRUE(weights(rope_pt) == rope_weights);  // the metadata differs: it holds the training time
  // A checkpoint without its evaluation is evaluated, not retrained.
  fs::remove(out / "evals/copy-learned-s1.json");
  const auto r3 = run_cli(smoke);
  ASSERT_EQ(r3.exit_code, 0) << r3.err;
  EXPECT_NE(r3.err.find("[1/2] copy-learned-s1: checkpoint exists, training skipped"), std::string::npos) << r3.err;
  EXPECT_TRUE(slurp(learned_pt) == learned_bytes);

  // Other settings in the same directory are refused.
  const auto r4 = run_cli(kSmoke + out.string() + " --samples 13");
  EXPECT_EQ(r4.exit_code, 1);
  EXPECT_NE(r4.err.find("other settings (samples: 12 in the directory, 13 requested)"), std::string::npos) << r4.err;
  const auto r5 = run_cli(kSmoke + out.string() + " --samples 12 --recipe copy:lr=0.01");
  EXPECT_EQ(r5.exit_code, 1);
  EXPECT_NE(r5.err.find("(recipes/copy: absent in the directory, \"lr=0.01\" requested)"), std::string::npos) << r5.err;

  const auto rep = run_cli("study report --no-plots " + out.string());
  ASSERT_EQ(rep.exit_code, 0) << rep.err;
  EXPECT_NE(rep.out.find("2/2 models evaluated"), std::string::npos) << rep.out;
  EXPECT_NE(rep.out.find("cannot run"), std::string::npos) << rep.out;
  EXPECT_NE(rep.out.find("Mean reciprocal rank"), std::string::npos);
  EXPECT_NE(rep.out.find("rope+dynamic"), std::string::npos);
  const auto summary = nlohmann::json::parse(slurp(out / "summary.json"));
  EXPECT_EQ(summary["evaluations"], 2);
  // 40 steps learn nothing: the configuration is left out of the MRR, by name.
  EXPECT_EQ(summary["mrr_configurations"]["all"], 0);
  EXPECT_EQ(summary["mrr_left_out"], nlohmann::json::array({"copy seed 1"}));
  EXPECT_NE(rep.out.find("Left out of the MRR (no encoding reached 50% in distribution): copy seed 1"),
            std::string::npos)
      << rep.out;
  EXPECT_NE(slurp(out / "summary.csv").find("copy,learned,default,12,0,0,,,,0,1"), std::string::npos);
}

namespace {

// One evaluation file of a hand-made study: `in` correct of 10 at each
// training length (8, 16) and `beyond` correct of 10 at 24 and 32.
void write_eval(const fs::path& dir, const std::string& task, const std::string& pe, int in, int beyond,
                std::vector<int> lengths = {8, 16, 24, 32}) {
  nlohmann::json cells = nlohmann::json::array();
  for (int len : lengths)
    cells.push_back({{"length", len}, {"samples", 10}, {"correct", len <= 16 ? in : beyond}, {"can_run", true},
                     {"note", ""}});
  const nlohmann::json ev{{"task", task},  {"pe", pe},     {"seed", 1}, {"samples", 10},
                          {"model", "x"},  {"results", {{"default", cells}}}};
  std::ofstream(dir / "evals" / (task + "-" + pe + "-s1.json")) << ev.dump();
}

}  // namespace

TEST(TrainStudy, MeanReciprocalRankOfKnownScores) {
  TempDir d;
  const fs::path dir = d.path();
  fs::create_directories(dir / "evals");
  const nlohmann::json study{
      {"format", "posenc-study"},
      {"version", 1},
      {"settings",
       {{"train_lengths", {8, 16}}, {"test_lengths", {8, 32, 8}}, {"samples", 10}, {"scalings", nlohmann::json::array()},
        {"recipes", {{"reverse", "lr=0.001"}}}}},
      {"tasks", {"copy", "reverse", "sort"}},
      {"pes", {"nope", "rope", "t5"}},
      {"seeds", {1}}};
  std::ofstream(dir / "study.json") << study.dump();
  // copy was learned: beyond-range scores nope 0.8, rope 0.5, t5 0.5 -> ranks 1, 2.5, 2.5.
  write_eval(dir, "copy", "nope", 10, 8);
  write_eval(dir, "copy", "rope", 10, 5);
  write_eval(dir, "copy", "t5", 9, 5);
  // reverse was not (best in-distribution 40% < 50%): left out, although rope "wins" it.
  write_eval(dir, "reverse", "nope", 4, 0);
  write_eval(dir, "reverse", "rope", 3, 2);
  write_eval(dir, "reverse", "t5", 0, 0);
  // sort was tested beyond the training range only: no evidence it was not
  // learned, so it is ranked: t5 1 > nope 0.5 > rope 0.
  for (const auto& [pe, beyond] : {std::pair{"nope", 5}, std::pair{"rope", 0}, std::pair{"t5", 10}})
    write_eval(dir, "sort", pe, 0, beyond, {24, 32});
  const StudyReport r = write_study_report(dir);
  const auto s = nlohmann::json::parse(slurp(r.summary_json));
  EXPECT_EQ(s["mrr_configurations"]["all"], 2);
  EXPECT_EQ(s["mrr_left_out"], nlohmann::json::array({"reverse seed 1"}));
  EXPECT_DOUBLE_EQ(s["mrr"]["all"]["nope"].get<double>(), (1.0 + 0.5) / 2);
  EXPECT_DOUBLE_EQ(s["mrr"]["all"]["rope"].get<double>(), (1.0 / 2.5 + 1.0 / 3) / 2);
  EXPECT_DOUBLE_EQ(s["mrr"]["all"]["t5"].get<double>(), (1.0 / 2.5 + 1.0) / 2);
  EXPECT_NE(r.text.find("recipe for reverse: lr=0.001"), std::string::npos) << r.text;
  EXPECT_NE(r.text.find("below: t5 90.0%"), std::string::npos) << r.text;
}

TEST(TrainStudy, TrainedCheckpointRunsInPosencGenerate) {
  TempDir d;
  const auto model = d.path() / "ar.pt";
  const auto r = run_cli("train --task associative_recall --pe alibi --steps 30 --batch-size 8 --dim 32 --heads 4 "
                         "--train-lengths 4:10 --eval-samples 10 --out " + model.string());
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("exact match at 4 input tokens:"), std::string::npos) << r.out;
  // The embedded vocabulary is the tokenizer; one value then <eos>.
  const auto g = run_cli("generate --model " + model.string() + " --prompt 'k3 7 k12 1 ? k3' --max-tokens 2");
  ASSERT_EQ(g.exit_code, 0) << g.err;
  EXPECT_EQ(g.out.rfind("k3 7 k12 1 ? k3", 0), 0u) << g.out;
  EXPECT_GT(g.out.size(), std::string("k3 7 k12 1 ? k3\n").size());
}

TEST(TrainStudy, ReportOfAMissingStudyIsAnError) {
  TempDir d;
  EXPECT_THROW(write_study_report(d.path()), posenc::Error);
  const auto r = run_cli("study report --no-plots " + d.path().string());
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find("study.json missing"), std::string::npos) << r.err;
}

// Bad input on trained checkpoints: typed errors with exit code 1, never an
// abort from inside a parallel loop (rc 134), and RoPE-less checkpoints score
// with the default scaling list.
TEST(TrainStudy, TrainedCheckpointsGiveTypedErrorsNotAborts) {
  TempDir d;
  const auto learned = d.path() / "learned.pt";
  const auto r = run_cli("train --task copy --pe learned --steps 5 --batch-size 4 --dim 32 --heads 4 "
                         "--train-lengths 4:8 --eval-samples 0 --out " + learned.string());
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const int64_t table = Model::load(learned).config().max_position_embeddings;
  ASSERT_GT(table, 0);
  {
    std::ofstream ok(d.path() / "ok.txt");
    for (int i = 0; i < 4 * table; ++i) ok << "a b c > a b c\n\n";  // longer than the table
    std::ofstream(d.path() / "oov.txt") << "a b c > a b c\n\nthis word is not a symbol\n";
  }
  // Windows longer than the learned table: a usage error naming --context before any work (as check-cache --length).
  auto p = run_cli(fmt::format("ppl --model {} --text {} --context {}", learned.string(),
                               (d.path() / "ok.txt").string(), 4 * table));
  EXPECT_EQ(p.exit_code, 2) << p.err;
  EXPECT_NE(p.err.find("--context: " + std::to_string(4 * table) + " positions"), std::string::npos) << p.err;
  EXPECT_NE(p.err.find("past the learned position table (max_position_embeddings " + std::to_string(table)),
            std::string::npos)
      << p.err;
  // A piece outside the embedded vocabulary: TokenizerError, not terminate().
  p = run_cli(fmt::format("ppl --model {} --text {} --context 8", learned.string(), (d.path() / "oov.txt").string()));
  EXPECT_EQ(p.exit_code, 1) << p.err;
  EXPECT_EQ(p.err.find("terminate"), std::string::npos) << p.err;
  // Default --rope-scaling on a learned-position model: only "default" is scored.
  const auto json_path = d.path() / "ppl.json";
  p = run_cli(fmt::format("ppl --model {} --text {} --context 8 --json {}", learned.string(),
                          (d.path() / "ok.txt").string(), json_path.string()));
  ASSERT_EQ(p.exit_code, 0) << p.err;
  const auto j = nlohmann::json::parse(slurp(json_path));
  ASSERT_EQ(j["results"].size(), 1u);
  EXPECT_EQ(j["results"][0]["rope_scaling"], "default");
  // An explicit RoPE scaling is refused up front.
  p = run_cli(fmt::format("ppl --model {} --text {} --context 8 --rope-scaling linear", learned.string(),
                          (d.path() / "ok.txt").string()));
  EXPECT_EQ(p.exit_code, 1);
  EXPECT_NE(p.err.find("RoPE scalings do not apply (got linear)"), std::string::npos) << p.err;
  // An output path that is a directory fails while parsing (usage error, 2).
  p = run_cli(fmt::format("ppl --model {} --text {} --context 8 --json {}", learned.string(),
                          (d.path() / "ok.txt").string(), d.path().string()));
  EXPECT_EQ(p.exit_code, 2);
  EXPECT_NE(p.err.find("is a directory"), std::string::npos) << p.err;
}

TEST(TrainStudy, BadSettingsLeaveNoStudyBehind) {
  TempDir d;
  const auto out = d.path() / "s";
  auto r = run_cli("study --tasks copy --pe rope --seeds 1 --steps 0 --out " + out.string());
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find("--steps"), std::string::npos) << r.err;
  EXPECT_FALSE(fs::exists(out / "study.json"));
  r = run_cli("study --tasks copy --pe rope --seeds 1 --dim 30 --heads 4 --out " + out.string());
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find("--heads"), std::string::npos) << r.err;
  EXPECT_FALSE(fs::exists(out / "study.json"));
}

}  // namespace POSENC_UNITY_ID
