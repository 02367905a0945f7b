// `posenc eval` end to end on stories260K: a run killed (SIGKILL) mid-way and
// restarted loses no finished cell and ends equal to an uninterrupted run;
// shards merged equal the unsharded run; cells that cannot fit are recorded;
// the report writes its table, heatmaps and a self-contained HTML.
#include <fcntl.h>
#include <sys/file.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <thread>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "posenc/eval.hpp"
#include "test_support.hpp"

extern char** environ;

namespace POSENC_UNITY_ID {  // this file's own namespace in the tests' unity build (CMakeLists.txt)

namespace fs = std::filesystem;
using posenc::test::run_cli;
using posenc::test::slurp;
using posenc::test::TempDir;

namespace {

std::string q(const fs::path& p) {
  std::string s(1, '\'');
  s += p.string();
  s += '\'';
  return s;
}

// Small but real: 8 groups (4 lengths x 2 encodings) x 3 depths x 6 samples, and the 8 absent-control cells.
std::vector<std::string> run_args(const fs::path& out) {
  return {"eval",      "--model",        posenc::test::model_path().string(),
          "--tokenizer", posenc::test::tokenizer_path().string(),
          "--haystack",  posenc::test::text_path().string(),
          "--tasks",     "name_recall",  "--context", "128,192,256,320", "--depths", "0,0.5,1",
          "--samples",   "6",            "--rope-scaling", "default,linear", "--rope-factor", "2",
          "--ppl-tokens", "1500",        "--quiet",  "--out", out.string()};
}

std::string joined(const std::vector<std::string>& args) {
  std::string s;
  for (const auto& a : args) s += q(a) + " ";
  return s;
}

fs::path run_dir_of(const fs::path& out) {
  std::string id = slurp(out / "LATEST");
  while (!id.empty() && (id.back() == '\n' || id.back() == ' ')) id.pop_back();
  return out / id;
}

std::map<std::string, std::string> cell_files(const fs::path& run_dir) {
  std::map<std::string, std::string> m;
  if (!fs::exists(run_dir / "cells")) return m;
  for (const auto& e : fs::directory_iterator(run_dir / "cells"))
    if (e.path().extension() == ".json") m[e.path().filename().string()] = slurp(e.path());
  return m;
}

class EvalCli : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    ref_ = new TempDir();
    const auto r = run_cli(joined(run_args(ref_->path() / "out")));
    ASSERT_EQ(r.exit_code, 0) << r.err;
    ref_run_ = run_dir_of(ref_->path() / "out");
  }
  static void TearDownTestSuite() {
    delete ref_;
    ref_ = nullptr;
  }
  static TempDir* ref_;
  static fs::path ref_run_;
};
TempDir* EvalCli::ref_ = nullptr;
fs::path EvalCli::ref_run_;

}  // namespace

TEST_F(EvalCli, UninterruptedRunWritesEveryOutput) {
  for (const char* f : {"run.json", "summary.json", "summary.csv", "samples.jsonl", "ppl.json"})
    EXPECT_TRUE(fs::exists(ref_run_ / f)) << f;
  const auto summary = nlohmann::json::parse(slurp(ref_run_ / "summary.json"));
  EXPECT_TRUE(summary["complete"].get<bool>());
  ASSERT_EQ(summary["cells"].size(), 32u);  // 4 lengths x 2 encodings x (3 depths + the absent control)
  for (const auto& c : summary["cells"]) {
    EXPECT_EQ(c["n"].get<int>(), 6);
    EXPECT_LE(c["ci_low"].get<double>(), c["accuracy"].get<double>());
    EXPECT_GE(c["ci_high"].get<double>(), c["accuracy"].get<double>());
  }
  ASSERT_EQ(summary["effective_context"].size(), 4u);  // 2 encodings x {acc_norm, acc}
  // One JSON line per sample, each with its realised needle position.
  const std::string lines = slurp(ref_run_ / "samples.jsonl");
  EXPECT_EQ(std::count(lines.begin(), lines.end(), '\n'), 32 * 6);
  const auto first = nlohmann::json::parse(lines.substr(0, lines.find('\n')));
  for (const char* k : {"seed", "task", "length", "depth", "prompt_tokens", "answer", "candidate_logprobs", "correct", "needles"})
    EXPECT_TRUE(first.contains(k)) << k;
  EXPECT_TRUE(first["needles"][0].contains("token_position"));
  // run.json: config, seeds, model/tokenizer identity, the encodings used.
  const auto run = nlohmann::json::parse(slurp(ref_run_ / "run.json"));
  for (const char* k : {"config", "seeds", "model", "tokenizer", "haystack", "encodings", "date", "git_hash"})
    EXPECT_TRUE(run.contains(k)) << k;
  EXPECT_EQ(run["encodings"].size(), 8u);
  // The perplexity matrix has the `posenc ppl --json` schema.
  const auto ppl = nlohmann::json::parse(slurp(ref_run_ / "ppl.json"));
  ASSERT_EQ(ppl["results"].size(), 8u);
  EXPECT_TRUE(ppl["results"][0].contains("buckets"));
}

TEST_F(EvalCli, ResumeAfterKillLosesNoFinishedCell) {
  TempDir d;
  const fs::path out = d.path() / "out";
  auto args = run_args(out);
  std::vector<std::string> argv_s{POSENC_CLI_PATH};
  argv_s.insert(argv_s.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (auto& s : argv_s) argv.push_back(s.data());
  argv.push_back(nullptr);
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, 1, "/dev/null", O_WRONLY, 0);
  posix_spawn_file_actions_addopen(&fa, 2, "/dev/null", O_WRONLY, 0);
  // The child pauses 400 ms after each persisted group (test-only hook), so
  // the kill lands between groups however fast the machine is.
  std::vector<std::string> env_s;
  for (char** e = environ; *e; ++e) env_s.emplace_back(*e);
  env_s.emplace_back("POSENC_EVAL_TEST_GROUP_DELAY_MS=400");
  std::vector<char*> envp;
  for (auto& e : env_s) envp.push_back(e.data());
  envp.push_back(nullptr);
  pid_t pid = 0;
  ASSERT_EQ(posix_spawn(&pid, POSENC_CLI_PATH, &fa, nullptr, argv.data(), envp.data()), 0);
  posix_spawn_file_actions_destroy(&fa);
  // Kill as soon as one group (3 cells) is persisted.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::minutes(5);
  bool killed = false;
  while (std::chrono::steady_clock::now() < deadline) {
    if (fs::exists(out / "LATEST") && cell_files(run_dir_of(out)).size() >= 3) {
      ::kill(pid, SIGKILL);
      killed = true;
      break;
    }
    int st = 0;
    if (::waitpid(pid, &st, WNOHANG) == pid) {
      pid = 0;
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  if (pid != 0) {
    int st = 0;
    ::waitpid(pid, &st, 0);
    EXPECT_TRUE(WIFSIGNALED(st));
  }
  ASSERT_TRUE(killed) << "the run ended before it could be killed";
  const fs::path run_dir = run_dir_of(out);
  const auto before = cell_files(run_dir);
  ASSERT_GE(before.size(), 3u);
  ASSERT_LT(before.size(), 32u) << "the kill came too late to test resuming";
  std::map<std::string, fs::file_time_type> mtimes;
  for (const auto& [name, content] : before) mtimes[name] = fs::last_write_time(run_dir / "cells" / name);

  // Restart with the same arguments: same run id, only missing cells computed.
  const auto r = run_cli(joined(args));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(run_dir_of(out), run_dir);
  const auto after = cell_files(run_dir);
  EXPECT_EQ(after.size(), 32u);
  for (const auto& [name, content] : before) {
    EXPECT_EQ(after.at(name), content) << name;
    EXPECT_EQ(fs::last_write_time(run_dir / "cells" / name), mtimes[name]) << name << " was redone";
  }
  const auto run = nlohmann::json::parse(slurp(run_dir / "run.json"));
  EXPECT_EQ(run["timing"]["cells_computed"].get<std::size_t>(), 32u - before.size());
  // The final outputs equal the uninterrupted run's.
  EXPECT_EQ(run_dir.filename(), ref_run_.filename());
  EXPECT_EQ(slurp(run_dir / "summary.json"), slurp(ref_run_ / "summary.json"));
  EXPECT_EQ(slurp(run_dir / "samples.jsonl"), slurp(ref_run_ / "samples.jsonl"));
  EXPECT_EQ(slurp(run_dir / "ppl.json"), slurp(ref_run_ / "ppl.json"));
}

TEST_F(EvalCli, ShardsMergedEqualTheUnshardedRun) {
  TempDir d;
  std::vector<fs::path> outs;
  for (int i = 0; i < 3; ++i) {
    outs.push_back(d.path() / ("shard" + std::to_string(i)));
    auto args = run_args(outs.back());
    args.push_back("--shard");
    args.push_back(std::to_string(i) + "/3");
    const auto r = run_cli(joined(args));
    ASSERT_EQ(r.exit_code, 0) << r.err;
    const auto s = nlohmann::json::parse(slurp(run_dir_of(outs.back()) / "summary.json"));
    EXPECT_FALSE(s["complete"].get<bool>());
    EXPECT_GT(s["cells_present"].get<int>(), 0);
  }
  // A changed argument set is another run id and cannot be merged into it.
  auto other = run_args(d.path() / "other");
  other[std::find(other.begin(), other.end(), "--samples") - other.begin() + 1] = "5";
  other.push_back("--shard");
  other.push_back("0/50");
  ASSERT_EQ(run_cli(joined(other)).exit_code, 0);
  EXPECT_NE(run_dir_of(d.path() / "other").filename(), ref_run_.filename());
  const auto bad = run_cli("eval merge --out " + q(d.path() / "bad") + " " + q(outs[0]) + " " + q(d.path() / "other"));
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_NE(bad.err.find("different argument sets"), std::string::npos) << bad.err;

  const fs::path merged = d.path() / "merged";
  const auto m = run_cli("eval merge --out " + q(merged) + " " + q(outs[0]) + " " + q(outs[1]) + " " + q(outs[2]));
  ASSERT_EQ(m.exit_code, 0) << m.err;
  const fs::path run_dir = run_dir_of(merged);
  EXPECT_EQ(run_dir.filename(), ref_run_.filename());
  EXPECT_EQ(slurp(run_dir / "summary.json"), slurp(ref_run_ / "summary.json"));
  EXPECT_EQ(slurp(run_dir / "samples.jsonl"), slurp(ref_run_ / "samples.jsonl"));
  EXPECT_EQ(slurp(run_dir / "summary.csv"), slurp(ref_run_ / "summary.csv"));
  EXPECT_EQ(slurp(run_dir / "ppl.json"), slurp(ref_run_ / "ppl.json"));
}

TEST_F(EvalCli, ReportWritesTableHeatmapsAndSelfContainedHtml) {
  TempDir d;
  fs::copy(ref_run_, d.path() / "run", fs::copy_options::recursive);
  const auto t = run_cli("eval report --no-plots " + q(d.path() / "run"));
  ASSERT_EQ(t.exit_code, 0) << t.err;
  EXPECT_NE(t.out.find("name_recall"), std::string::npos);
  EXPECT_NE(t.out.find("L=320"), std::string::npos);
  EXPECT_TRUE(fs::exists(d.path() / "run" / "report.txt"));
  if (std::system("/usr/bin/python3 -c 'import matplotlib' >/dev/null 2>&1") != 0)
    GTEST_SKIP() << "python3-matplotlib is not installed (scripts/install-deps installs it)";
  const auto r = run_cli("eval report " + q(d.path() / "run"));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  for (const char* f : {"plots/heatmaps_name_recall_none.png",
                        "plots/accuracy_name_recall_none.png", "plots/ppl_by_position.png", "report.html"})
    EXPECT_TRUE(fs::exists(d.path() / "run" / f)) << f;
  const std::string html = slurp(d.path() / "run" / "report.html");
  EXPECT_NE(html.find("data:image/png;base64"), std::string::npos);
  EXPECT_EQ(html.find("src='plots/"), std::string::npos);  // images are inlined, not linked
}

TEST(EvalCliSmall, CellsThatCannotFitAreRecordedNotFatal) {
  TempDir d;
  const auto r = run_cli("eval --model " + q(posenc::test::model_path()) + " --tokenizer " +
                         q(posenc::test::tokenizer_path()) + " --haystack " + q(posenc::test::text_path()) +
                         " --tasks variable_tracking --context 128,160 --depths 0.5 --samples 2 --ppl-tokens -1 --quiet --out " +
                         q(d.path()));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const auto s = nlohmann::json::parse(slurp(run_dir_of(d.path()) / "summary.json"));
  ASSERT_EQ(s["cells"].size(), 2u);
  for (const auto& c : s["cells"]) {
    EXPECT_EQ(c["status"], "does not fit");
    EXPECT_EQ(c["n"].get<int>(), 0);
    EXPECT_TRUE(c["accuracy"].is_null());
  }
  EXPECT_EQ(s["effective_context"][0]["status"], "does not fit at any tested length");
  // Bad flags fail cleanly.
  const auto bad = run_cli("eval --model " + q(posenc::test::model_path()) + " --tokenizer " +
                           q(posenc::test::tokenizer_path()) + " --haystack " + q(posenc::test::text_path()) +
                           " --tasks nope --out " + q(d.path()));
  EXPECT_EQ(bad.exit_code, 2);  // a flag value: usage error
  EXPECT_NE(bad.err.find("unknown task 'nope'"), std::string::npos) << bad.err;
  const auto bad2 = run_cli("eval --model " + q(posenc::test::model_path()) + " --tokenizer " +
                            q(posenc::test::tokenizer_path()) + " --haystack " + q(posenc::test::text_path()) +
                            " --shard 2/2 --out " + q(d.path()));
  EXPECT_EQ(bad2.exit_code, 2);
  EXPECT_NE(bad2.err.find("--shard"), std::string::npos) << bad2.err;
}

// A haystack too short to fill the longest length is refused before anything runs (its contexts would be a
// fraction of the length they are reported under), naming its token count and the length.
TEST(EvalCliSmall, AHaystackShorterThanTheLongestLengthIsRefused) {
  TempDir d;
  std::ofstream(d.path() / "tiny.txt") << "The cat sat on the mat. The dog ran far away.\n";
  const std::string base = "eval --model " + q(posenc::test::model_path()) + " --tokenizer " +
                           q(posenc::test::tokenizer_path()) + " --haystack " + q(d.path() / "tiny.txt") +
                           " --tasks name_recall --depths 0.5 --samples 2 --ppl-tokens -1 --quiet --out " +
                           q(d.path() / "out");
  const auto bad = run_cli(base + " --context 32,256");
  EXPECT_EQ(bad.exit_code, 1);
  EXPECT_NE(bad.err.find("--haystack: its usable sentences hold"), std::string::npos) << bad.err;
  EXPECT_NE(bad.err.find("fewer than the longest length 256"), std::string::npos) << bad.err;
  EXPECT_FALSE(std::filesystem::exists(d.path() / "out" / "LATEST"));
}

// An --out that cannot be created (procfs refuses new directories, for root too): exit 1, the path first, not
// the library's "filesystem error: ..." text.
TEST(EvalCliSmall, AnOutputDirectoryThatCannotBeCreatedIsNamed) {
  const auto r = run_cli("eval --model " + q(posenc::test::model_path()) + " --tokenizer " +
                         q(posenc::test::tokenizer_path()) + " --haystack " + q(posenc::test::text_path()) +
                         " --tasks name_recall --context 128 --depths 0.5 --samples 1 --ppl-tokens -1 --quiet "
                         "--out /proc/posenc-nope");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_EQ(r.err.rfind("posenc: error: /proc/posenc-nope/", 0), 0u) << r.err;
  EXPECT_NE(r.err.find("cannot create directories"), std::string::npos) << r.err;
  EXPECT_EQ(r.err.find("filesystem error"), std::string::npos) << r.err;
}

// A run that fails on its input leaves the output directory as it was: no
// new run directory, LATEST still names the last good run.
TEST(EvalCliSmall, AFailedRunLeavesLatestOnTheGoodRun) {
  TempDir d;
  const std::string base = "eval --model " + q(posenc::test::model_path()) + " --tokenizer " +
                           q(posenc::test::tokenizer_path()) +
                           " --tasks kv_retrieval --context 256 --depths 0.5 --samples 1 --quiet --out " + q(d.path());
  ASSERT_EQ(run_cli(base + " --ppl-tokens -1").exit_code, 0);
  const std::string latest = slurp(d.path() / "LATEST");
  std::ofstream(d.path() / "empty.txt") << "\n  \n";
  const auto bad = run_cli(base + " --ppl-tokens 100 --haystack " + q(d.path() / "empty.txt"));
  EXPECT_EQ(bad.exit_code, 1);
  EXPECT_NE(bad.err.find("text: holds no non-blank line"), std::string::npos) << bad.err;
  EXPECT_EQ(slurp(d.path() / "LATEST"), latest);
  int runs = 0;
  for (const auto& e : std::filesystem::directory_iterator(d.path())) runs += e.is_directory();
  EXPECT_EQ(runs, 1);
  EXPECT_EQ(run_cli("eval report --no-plots " + q(d.path())).exit_code, 0);
}

// ---- issue 13: run directories that cannot be tricked ------------------------

namespace {

nlohmann::json read_json(const fs::path& p) { return nlohmann::json::parse(slurp(p)); }
void write_json(const fs::path& p, const nlohmann::json& j) { std::ofstream(p, std::ios::trunc) << j.dump() << "\n"; }

// A copy of the reference run's --out directory (LATEST + the run).
fs::path copy_ref_out(const TempDir& d, const fs::path& ref_run) {
  const fs::path out = d.path() / "out";
  fs::create_directories(out);
  fs::copy(ref_run, out / ref_run.filename(), fs::copy_options::recursive);
  std::ofstream(out / "LATEST") << ref_run.filename().string() << "\n";
  return out;
}

}  // namespace

TEST_F(EvalCli, ResumeRecomputesEditedAndMisplacedCellsAndRemovesStaleTemporaries) {
  TempDir d;
  const fs::path out = copy_ref_out(d, ref_run_);
  const fs::path run_dir = out / ref_run_.filename();
  const fs::path cells = run_dir / "cells";
  const std::string edited = "name_recall__none__default__L128__d0.json";
  const std::string victim = "name_recall__none__linear__L320__d1.json";
  const std::string source = "name_recall__none__linear__L320__d0.5.json";
  const std::string recounted = "name_recall__none__default__L256__d0.5.json";
  // 1. `correct` edited (the checksum no longer matches).
  auto j = read_json(cells / edited);
  j["cell"]["correct"] = j["cell"]["correct"].get<int>() == 6 ? 5 : 6;
  write_json(cells / edited, j);
  // 2. One cell's file copied over another's (checksum valid, coordinates wrong).
  fs::copy_file(cells / source, cells / victim, fs::copy_options::overwrite_existing);
  // 3. `correct` edited and the checksum recomputed: the samples disagree.
  auto r = read_json(cells / recounted);
  const bool first = r["samples"][0]["correct"].get<bool>();
  r["samples"][0]["correct"] = !first;
  r["checksum"] = posenc::eval_file_checksum(r);
  write_json(cells / recounted, r);
  // 4. A perplexity value edited.
  const fs::path ppl = run_dir / "ppl" / "linear__L192.json";
  auto p = read_json(ppl);
  p["ppl"] = p["ppl"].get<double>() * 0.5;
  std::ofstream(ppl, std::ios::trunc) << p.dump(2) << "\n";
  // 5. Temporaries left by a SIGKILL inside write_file_atomic.
  std::ofstream(cells / (victim + ".tmp.4242.0")) << "{\"half\":";
  std::ofstream(run_dir / "summary.json.tmp.4242.1") << "x";
  const auto mtime = fs::last_write_time(cells / source);

  const auto res = run_cli(joined(run_args(out)));
  ASSERT_EQ(res.exit_code, 0) << res.err;
  for (const std::string& f : std::vector<std::string>{edited, victim, recounted, "linear__L192.json"})
    EXPECT_NE(res.err.find(f), std::string::npos) << f << " not named in: " << res.err;
  EXPECT_NE(res.err.find("recomputing"), std::string::npos) << res.err;
  EXPECT_NE(res.err.find("checksum"), std::string::npos) << res.err;
  EXPECT_FALSE(fs::exists(cells / (victim + ".tmp.4242.0")));
  EXPECT_FALSE(fs::exists(run_dir / "summary.json.tmp.4242.1"));
  const auto run = read_json(run_dir / "run.json");
  EXPECT_EQ(run["timing"]["cells_computed"].get<int>(), 3);
  EXPECT_EQ(fs::last_write_time(cells / source), mtime) << "a good cell was redone";
  EXPECT_EQ(cell_files(run_dir), cell_files(ref_run_));
  EXPECT_EQ(slurp(run_dir / "summary.json"), slurp(ref_run_ / "summary.json"));
  EXPECT_EQ(slurp(run_dir / "samples.jsonl"), slurp(ref_run_ / "samples.jsonl"));
  EXPECT_EQ(slurp(run_dir / "ppl.json"), slurp(ref_run_ / "ppl.json"));
}

TEST_F(EvalCli, ReportAndMergeRejectCellsThatDoNotHoldTheirCell) {
  struct Case {
    const char* what;
    std::function<void(const fs::path& run_dir)> corrupt;
    const char* file;
    const char* message;
  };
  const std::vector<Case> cases = {
      {"correct edited",
       [](const fs::path& r) {
         auto j = read_json(r / "cells/name_recall__none__default__L192__d0.json");
         j["cell"]["correct"] = 0;
         j["cell"]["accuracy"] = 0.0;
         write_json(r / "cells/name_recall__none__default__L192__d0.json", j);
       },
       "name_recall__none__default__L192__d0.json", "checksum"},
      {"one cell copied over another (12 of 12 while one is missing)",
       [](const fs::path& r) {
         fs::copy_file(r / "cells/name_recall__none__default__L192__d0.json",
                       r / "cells/name_recall__none__default__L192__d1.json", fs::copy_options::overwrite_existing);
       },
       "name_recall__none__default__L192__d1.json", "depth"},
      {"a sample's correct flipped, checksum recomputed",
       [](const fs::path& r) {
         auto j = read_json(r / "cells/name_recall__none__linear__L128__d0.5.json");
         j["samples"][2]["correct"] = !j["samples"][2]["correct"].get<bool>();
         j["checksum"] = posenc::eval_file_checksum(j);
         write_json(r / "cells/name_recall__none__linear__L128__d0.5.json", j);
       },
       "name_recall__none__linear__L128__d0.5.json", "samples are marked correct"},
      {"ppl value edited",
       [](const fs::path& r) {
         auto j = read_json(r / "ppl/default__L320.json");
         j["nll"] = 0.125;
         write_json(r / "ppl/default__L320.json", j);
       },
       "default__L320.json", "checksum"},
      {"cell truncated",
       [](const fs::path& r) {
         const std::string s = slurp(r / "cells/name_recall__none__linear__L256__d1.json");
         std::ofstream(r / "cells/name_recall__none__linear__L256__d1.json", std::ios::trunc) << s.substr(0, s.size() / 2);
       },
       "name_recall__none__linear__L256__d1.json", "not valid JSON"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.what);
    TempDir d;
    fs::copy(ref_run_, d.path() / "run", fs::copy_options::recursive);
    c.corrupt(d.path() / "run");
    const std::string summary_before = slurp(d.path() / "run" / "summary.json");
    const auto rep = run_cli("eval report --no-plots " + q(d.path() / "run"));
    EXPECT_EQ(rep.exit_code, 1) << rep.err;
    EXPECT_NE(rep.err.find(c.file), std::string::npos) << rep.err;
    EXPECT_NE(rep.err.find(c.message), std::string::npos) << rep.err;
    EXPECT_EQ(slurp(d.path() / "run" / "summary.json"), summary_before) << "a rejected run was summarised";
    const auto m = run_cli("eval merge --out " + q(d.path() / "merged") + " " + q(d.path() / "run"));
    EXPECT_EQ(m.exit_code, 1) << m.err;
    EXPECT_NE(m.err.find(c.file), std::string::npos) << m.err;
    EXPECT_FALSE(fs::exists(d.path() / "merged" / "LATEST"));
  }
}

TEST_F(EvalCli, MergeRefusesARunIdThatIsNotOnePathComponent) {
  for (const std::string& bad : std::vector<std::string>{"../escape", "/tmp/posenc-escape-abs", "a/b", "..", ".", "", std::string("x\0y", 3),
                                std::string("ok id")}) {
    SCOPED_TRACE(bad);
    TempDir d;
    fs::copy(ref_run_, d.path() / "in", fs::copy_options::recursive);
    auto run = read_json(d.path() / "in" / "run.json");
    run["run_id"] = bad;
    write_json(d.path() / "in" / "run.json", run);
    fs::create_directories(d.path() / "o");
    const auto m = run_cli("eval merge --out " + q(d.path() / "o" / "out") + " " + q(d.path() / "in"));
    EXPECT_EQ(m.exit_code, 1) << m.err;
    EXPECT_NE(m.err.find("run.json: run_id"), std::string::npos) << m.err;
    EXPECT_NE(m.err.find("is not a run id"), std::string::npos) << m.err;
    EXPECT_FALSE(fs::exists(d.path() / "o" / "escape"));
    EXPECT_FALSE(fs::exists("/tmp/posenc-escape-abs"));
    EXPECT_FALSE(fs::exists(d.path() / "o" / "out" / "LATEST"));
    // report checks it too (summary.json would carry it).
    const auto rep = run_cli("eval report --no-plots " + q(d.path() / "in"));
    EXPECT_EQ(rep.exit_code, 1) << rep.err;
    EXPECT_NE(rep.err.find("run_id"), std::string::npos) << rep.err;
  }
}

TEST_F(EvalCli, ReportFollowsLatestOnlyToADirectChild) {
  TempDir d;
  fs::copy(ref_run_, d.path() / "victim", fs::copy_options::recursive);
  fs::remove(d.path() / "victim" / "summary.json");
  fs::create_directories(d.path() / "out");
  for (const std::string& latest : std::vector<std::string>{"../victim", (d.path() / "victim").string(), "..", "sub/../../victim"}) {
    SCOPED_TRACE(latest);
    std::ofstream(d.path() / "out" / "LATEST", std::ios::trunc) << latest << "\n";
    const auto rep = run_cli("eval report --no-plots " + q(d.path() / "out"));
    EXPECT_EQ(rep.exit_code, 1) << rep.err;
    EXPECT_NE(rep.err.find("LATEST"), std::string::npos) << rep.err;
    EXPECT_FALSE(fs::exists(d.path() / "victim" / "summary.json"));
    EXPECT_FALSE(fs::exists(d.path() / "victim" / "report.txt"));
    const auto m = run_cli("eval merge --out " + q(d.path() / "m") + " " + q(d.path() / "out"));
    EXPECT_EQ(m.exit_code, 1) << m.err;
    EXPECT_NE(m.err.find("LATEST"), std::string::npos) << m.err;
  }
}

TEST_F(EvalCli, RunJsonIsReadWithCheckedAccess) {
  struct Case {
    std::function<void(nlohmann::json&)> edit;
    const char* message;
  };
  const std::vector<Case> cases = {
      {[](nlohmann::json& r) { r.erase("config"); }, "run.json: missing key 'config'"},
      {[](nlohmann::json& r) { r["config"]["lengths"][1] = "a"; }, "run.json: config.lengths[1]: expected an integer"},
      {[](nlohmann::json& r) { r["config"]["tasks"] = {"name_recall", "name_recall"}; }, "config.tasks[1]"},
      {[](nlohmann::json& r) { r["config"]["controls"] = {"../../x"}; }, "config.controls[0]"},
      {[](nlohmann::json& r) { r["config"]["samples"] = -3; }, "config.samples"},
      {[](nlohmann::json& r) { r["ppl_header"] = 7; }, "ppl_header: expected an object"},
      {[](nlohmann::json& r) { r = nlohmann::json::array(); }, "run.json"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.message);
    TempDir d;
    fs::copy(ref_run_, d.path() / "run", fs::copy_options::recursive);
    auto run = read_json(d.path() / "run" / "run.json");
    c.edit(run);
    write_json(d.path() / "run" / "run.json", run);
    const auto rep = run_cli("eval report --no-plots " + q(d.path() / "run"));
    EXPECT_EQ(rep.exit_code, 1) << rep.err;
    EXPECT_NE(rep.err.find(c.message), std::string::npos) << rep.err;
    EXPECT_EQ(rep.err.find("json.exception"), std::string::npos) << rep.err;
  }
}

TEST_F(EvalCli, ReportHtmlEscapesEveryTextFromRunJson) {
  if (std::system("/usr/bin/python3 -c 'import matplotlib' >/dev/null 2>&1") != 0)
    GTEST_SKIP() << "python3-matplotlib is not installed (scripts/install-deps installs it)";
  TempDir d;
  fs::copy(ref_run_, d.path() / "run", fs::copy_options::recursive);
  auto run = read_json(d.path() / "run" / "run.json");
  run["model"]["trained_context"] = "<script>alert('trained_context')</script>";
  run["model"]["path"] = "</code><script>alert('path')</script>";
  run["haystack"]["path"] = "<img src=x onerror=alert(1)>";
  run["git_hash"] = "<script>alert('git')</script>";
  run["date"] = "<SCRIPT>alert('date')</SCRIPT>";
  run["command"] = "</pre><script>alert('command')</script>";
  write_json(d.path() / "run" / "run.json", run);
  const auto r = run_cli("eval report " + q(d.path() / "run"));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  std::string html = slurp(d.path() / "run" / "report.html");
  std::transform(html.begin(), html.end(), html.begin(), [](unsigned char ch) { return std::tolower(ch); });
  EXPECT_EQ(html.find("<script"), std::string::npos);
  EXPECT_EQ(html.find("<img src=x"), std::string::npos);
  EXPECT_NE(html.find("&lt;script&gt;alert(&#x27;trained_context&#x27;)"), std::string::npos);
}

TEST_F(EvalCli, ASecondRunOnTheSameRunDirectoryFailsAtOnce) {
  TempDir d;
  const fs::path out = copy_ref_out(d, ref_run_);
  const fs::path lock = out / ref_run_.filename() / ".lock";
  const int fd = ::open(lock.c_str(), O_RDWR | O_CREAT, 0644);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::flock(fd, LOCK_EX | LOCK_NB), 0);
  ASSERT_EQ(::ftruncate(fd, 0), 0);
  ASSERT_EQ(::write(fd, "4242\n", 5), 5);
  const auto t0 = std::chrono::steady_clock::now();
  const auto r = run_cli(joined(run_args(out)));
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(60));
  EXPECT_EQ(r.exit_code, 1) << r.err;
  EXPECT_NE(r.err.find(lock.string()), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("is in use by another posenc process (pid 4242; lock "), std::string::npos) << r.err;
  // merge into a locked output directory fails the same way.
  fs::create_directories(d.path() / "merged" / ref_run_.filename());
  const fs::path mlock = d.path() / "merged" / ref_run_.filename() / ".lock";
  const int mfd = ::open(mlock.c_str(), O_RDWR | O_CREAT, 0644);
  ASSERT_EQ(::flock(mfd, LOCK_EX | LOCK_NB), 0);
  const auto m = run_cli("eval merge --out " + q(d.path() / "merged") + " " + q(out));
  EXPECT_EQ(m.exit_code, 1) << m.err;
  EXPECT_NE(m.err.find(mlock.string()), std::string::npos) << m.err;
  ::close(mfd);
  ::close(fd);
  // Released: both go through.
  EXPECT_EQ(run_cli(joined(run_args(out))).exit_code, 0);
  EXPECT_EQ(run_cli("eval merge --out " + q(d.path() / "merged") + " " + q(out)).exit_code, 0);
}

}  // namespace POSENC_UNITY_ID
