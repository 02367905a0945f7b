// `posenc eval --endpoint` on the command line: the flags it refuses (exit 2)
// and a run against the in-test server (fake_endpoint.hpp) whose likelihood
// cells are not supported: exit 0, the table says so, `eval report` copes.
#include <chrono>
#include <filesystem>
#include <map>
#include <thread>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "../serve/serve_process.hpp"
#include "fake_endpoint.hpp"
#include "posenc/eval.hpp"
#include "test_support.hpp"

namespace POSENC_UNITY_ID {  // this file's own namespace in the tests' unity build (CMakeLists.txt)

using namespace posenc;
namespace fs = std::filesystem;
using test::run_cli;
using test::TempDir;

namespace {

const Model& model() {
  static const Model m = Model::load_llama2c(test::model_path());
  return m;
}
const Tokenizer& tok() {
  static const Tokenizer t = Tokenizer::load_llama2c(test::tokenizer_path());
  return t;
}

std::string tokf() { return " --tokenizer '" + test::tokenizer_path().string() + "'"; }

}  // namespace

TEST(EndpointCli, RefusedCommandLinesExit2WithTheReason) {
  TempDir d;
  const std::string out = " --out '" + (d.path() / "o").string() + "'";
  const std::string ep = " --endpoint http://127.0.0.1:9/v1";
  struct Case {
    std::string args, needle;
  };
  for (const Case& c : std::vector<Case>{
           {"eval --model '" + test::model_path().string() + "'" + ep + tokf() + out, "mutually exclusive"},
           {"eval" + ep + tokf() + " --rope-scaling yarn" + out, "server's business"},
           {"eval" + ep + tokf() + " --rope-factor 2" + out, "server's business"},
           {"eval" + ep + tokf() + " --rope-theta 10000" + out, "--rope-theta: applies to an in-process --model"},
           {"eval --endpoint ftp://host/v1" + tokf() + out, "not an http:// or https:// URL"},
           {"eval --endpoint 'http://h:99999/v1'" + tokf() + out, "port"},
           {"eval --endpoint 'http://a:1/v1=x/y'" + tokf() + out, "label 'x/y'"},
           {"eval --endpoint http://a:1/v1 --endpoint http://b:2/v1" + tokf() + out, "listed twice"},
           {"eval --endpoint http://a:1/v1=yarn --endpoint http://b:2/v1=yarn" + tokf() + out, "listed twice"},
           {"eval" + ep + out, "--tokenizer: required with --endpoint"},
           {"eval" + tokf() + out, "--model or --endpoint is required"},
           {"eval --model '" + test::model_path().string() + "'" + tokf() + " --concurrency 4" + out,
            "--concurrency: applies to --endpoint only"},
           {"eval" + ep + tokf() + " --concurrency 0" + out, "--concurrency"},
       }) {
    const auto r = run_cli(c.args);
    EXPECT_EQ(r.exit_code, 2) << c.args << "\n" << r.err;
    EXPECT_NE(r.err.find(c.needle), std::string::npos) << c.args << "\n" << r.err;
  }
  EXPECT_FALSE(fs::exists(d.path() / "o"));  // nothing contacted, nothing written
}

TEST(EndpointCli, AServerWithoutPromptLogprobsRunsGenerationAndReportsTheRestAsNotSupported) {
  TempDir d;
  test::FakeEndpoint a(model(), tok()), b(model(), tok());
  a.likelihood = b.likelihood = false;
  a.start();
  b.start();
  const std::string out = (d.path() / "o").string();
  const std::string args = "eval --endpoint " + a.url() + "=plain --endpoint " + b.url() + "=other" + tokf() +
                           " --haystack '" + test::text_path().string() +
                           "' --tasks passkey,name_recall --context 128 --depths 0.5 --samples 2 --ppl-tokens 200 "
                           "--trained-context 512 --concurrency 2 --retries 1 --request-timeout 30 --quiet --out '" +
                           out + "'";
  const auto r = run_cli(args);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("not supported by this endpoint"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("plain"), std::string::npos) << r.out;  // the labels are the scaling column
  EXPECT_NE(r.out.find("other"), std::string::npos) << r.out;
  const fs::path run_dir = resolve_run_dir(out);
  const auto run = nlohmann::json::parse(test::slurp(run_dir / "run.json"));
  EXPECT_EQ(run["config"]["rope_scalings"], (std::vector<std::string>{"plain", "other"}));
  EXPECT_EQ(run["endpoints"][1]["url"], b.url());
  EXPECT_EQ(run["request_parameters"]["retries"], 1);
  const auto summary = nlohmann::json::parse(test::slurp(run_dir / "summary.json"));
  for (const auto& c : summary["cells"])
    EXPECT_EQ(c["status"], c["task"] == "passkey" ? "ok" : "not supported by this endpoint") << c.dump();
  // The same command again: every cell on disk, nothing re-sent.
  const int64_t sent = a.work_requests + b.work_requests;
  EXPECT_EQ(sent, 2 * 2);  // passkey: 2 samples x 2 endpoints
  const auto again = run_cli(args);
  ASSERT_EQ(again.exit_code, 0) << again.err;
  EXPECT_EQ(a.work_requests + b.work_requests, sent);
  const auto rep = run_cli("eval report --no-plots '" + out + "'");
  EXPECT_EQ(rep.exit_code, 0) << rep.err;
  EXPECT_NE(rep.out.find("not supported by this endpoint"), std::string::npos) << rep.out;
  // The HTML report (matplotlib) copes with results that have no NLL, where python3 has matplotlib.
  if (std::system("/usr/bin/python3 -c 'import matplotlib' >/dev/null 2>&1") == 0) {
    const auto html = run_cli("eval report '" + out + "'");
    EXPECT_EQ(html.exit_code, 0) << html.err;
    EXPECT_TRUE(fs::exists(run_dir / "report.html"));
  }
}

// --tokenizer may name a model file whose bundled vocabulary is used; a real model's GGUF is far larger than the 8 MiB
// read limit of a tokenizer file (the magic was read with that limit, so every real GGUF was refused): stories260K's
// GGUF padded to 9 MiB (trailing bytes its loader ignores) gives the same run as its llama2.c tokenizer.
TEST(EndpointCli, AModelFileOfAnySizeServesAsTheTokenizer) {
  TempDir d;
  const fs::path big = d.path() / "big.gguf";
  fs::copy_file(test::shared_dir() / "models/stories260K/stories260K.gguf", big);
  fs::resize_file(big, 9u << 20);
  test::FakeEndpoint a(model(), tok());
  a.start();
  auto run = [&](const std::string& tokenizer, const std::string& out) {
    return run_cli("eval --endpoint " + a.url() + " --tokenizer '" + tokenizer + "' --haystack '" +
                   test::text_path().string() +
                   "' --tasks passkey --context 128 --depths 0.5 --samples 2 --ppl-tokens 200 --trained-context 512 "
                   "--quiet --out '" + (d.path() / out).string() + "'");
  };
  const auto r = run(big.string(), "o1");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const auto ref = run(test::tokenizer_path().string(), "o2");
  ASSERT_EQ(ref.exit_code, 0) << ref.err;
  const auto cells = [&](const std::string& out) {
    auto j = nlohmann::json::parse(test::slurp(resolve_run_dir((d.path() / out).string()) / "summary.json"))["cells"];
    for (auto& c : j) c.erase("seconds");
    return j;
  };
  EXPECT_EQ(cells("o1"), cells("o2"));
}

namespace {

/// `posenc <args>` as a child process, stdout and stderr in files.
class CliProcess {
 public:
  explicit CliProcess(const std::vector<std::string>& args) {
    std::vector<std::string> argv = {POSENC_CLI_PATH};
    argv.insert(argv.end(), args.begin(), args.end());
    std::vector<char*> cargv;
    for (auto& a : argv) cargv.push_back(a.data());
    cargv.push_back(nullptr);
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_addopen(&fa, 1, (dir_.path() / "out").c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    posix_spawn_file_actions_addopen(&fa, 2, (dir_.path() / "err").c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (posix_spawn(&pid_, cargv[0], &fa, nullptr, cargv.data(), environ) != 0) pid_ = -1;
    posix_spawn_file_actions_destroy(&fa);
  }
  ~CliProcess() {
    if (pid_ > 0 && !reaped_) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
    }
  }
  /// Exit code; -1 if it did not exit within `seconds` (then killed) or was signaled.
  int wait(double seconds) {
    int st = 0;
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
    while (::waitpid(pid_, &st, WNOHANG) != pid_) {
      if (std::chrono::steady_clock::now() > deadline) {
        ::kill(pid_, SIGKILL);
        ::waitpid(pid_, &st, 0);
        reaped_ = true;
        return -1;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    reaped_ = true;
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  }
  bool running() { return !reaped_ && ::waitpid(pid_, nullptr, WNOHANG) == 0; }
  std::string err() const { return test::slurp(dir_.path() / "err"); }

 private:
  TempDir dir_;
  pid_t pid_ = -1;
  bool reaped_ = false;
};

std::vector<std::string> serve_args() {
  return {"--model", test::model_path().string(), "--tokenizer", test::tokenizer_path().string(), "--port", "0",
          "--max-model-len", "512", "--quiet"};
}

std::vector<std::string> eval_args(int port, const std::string& out) {
  return {"eval", "--endpoint", fmt::format("http://127.0.0.1:{}/v1", port), "--tokenizer",
          test::tokenizer_path().string(), "--haystack", test::text_path().string(), "--tasks", "name_recall,passkey",
          "--context", "128,256", "--depths", "0,0.5,1", "--samples", "6", "--ppl-tokens", "3000",
          "--trained-context", "512", "--concurrency", "2", "--retries", "1", "--request-timeout", "20", "--quiet",
          "--out", out};
}

std::map<std::string, nlohmann::json> samples_of(const fs::path& run_dir) {
  std::map<std::string, nlohmann::json> m;
  const std::string all = test::slurp(run_dir / "samples.jsonl");
  std::size_t pos = 0;
  while (pos < all.size()) {
    const std::size_t nl = all.find('\n', pos);
    const auto s = nlohmann::json::parse(all.substr(pos, nl - pos));
    pos = nl + 1;
    m[s.dump()] = s;  // the whole row is the key: equal sets of rows, whatever their order
  }
  return m;
}

std::size_t journal_lines(const fs::path& run_dir) {
  std::size_t n = 0;
  std::error_code ec;
  if (!fs::exists(run_dir / "journal", ec)) return 0;
  for (const auto& e : fs::directory_iterator(run_dir / "journal", ec)) {
    const std::string t = test::slurp(e.path());
    n += static_cast<std::size_t>(std::count(t.begin(), t.end(), '\n'));
  }
  return n;
}

std::size_t cell_files(const fs::path& run_dir) {
  std::size_t n = 0;
  std::error_code ec;
  if (!fs::exists(run_dir / "cells", ec)) return 0;
  for (const auto& e : fs::directory_iterator(run_dir / "cells", ec)) n += e.path().extension() == ".json";
  return n;
}

// Finished results on disk, counted per unit of work (a group of cells, a perplexity job) in one unit whatever holds
// them: each depth of a journaled sample (a group's line holds one entry per depth) or each perplexity window in a
// journal; each sample of a cell file or each window of a ppl file. A unit that completes writes its cells (or ppl
// file) and then removes its journal, so a unit counts the larger of the two: a lower bound of what it has finished
// that never falls while the eval runs or after it stops.
std::size_t finished_results(const fs::path& run_dir) {
  std::map<std::string, std::pair<std::size_t, std::size_t>> units;  // unit -> (in its journal, in its results)
  std::error_code ec;
  if (fs::exists(run_dir / "journal", ec))
    for (const auto& e : fs::directory_iterator(run_dir / "journal", ec)) {
      const std::string t = test::slurp(e.path());
      std::size_t pos = 0, n = 0;
      while (pos < t.size()) {
        const std::size_t nl = t.find('\n', pos);
        if (nl == std::string::npos) break;  // a torn last line is not finished
        const auto j = nlohmann::json::parse(t.substr(pos, nl - pos), nullptr, false);
        pos = nl + 1;
        if (j.is_discarded() || !j.contains("d")) continue;
        n += j["d"].is_array() ? j["d"].size() : 1;
      }
      units[e.path().stem().string()].first += n;
    }
  for (const char* sub : {"cells", "ppl"}) {
    if (!fs::exists(run_dir / sub, ec)) continue;
    for (const auto& e : fs::directory_iterator(run_dir / sub, ec)) {
      if (e.path().extension() != ".json") continue;
      const auto j = nlohmann::json::parse(test::slurp(e.path()), nullptr, false);
      if (j.is_discarded()) continue;
      const std::string stem = e.path().stem().string();
      if (std::string(sub) == "cells") {  // <task>__<control>__<scaling>__L<n>__d<depth>: its group is all but __d
        if (j.contains("samples") && j["samples"].is_array())
          units[stem.substr(0, stem.rfind("__d"))].second += j["samples"].size();
      } else if (j.contains("windows") && j["windows"].is_number_integer()) {
        units["ppl__" + stem].second += j["windows"].get<std::size_t>();
      }
    }
  }
  std::size_t n = 0;
  for (const auto& [unit, c] : units) n += std::max(c.first, c.second);
  return n;
}

}  // namespace

// A real `posenc serve` process killed (SIGKILL) in the middle of an `eval --endpoint` sweep: the eval stops with
// exit 1 and the endpoint-unavailable message, keeps what finished, and the same command against a restarted server
// (another port) resumes to summary.json, samples.jsonl and ppl.json equal to an uninterrupted run's.
TEST(EndpointCli, AKilledPosencServeMidSweepResumesToTheUninterruptedRun) {
  using test::serve::ServeProcess;
  TempDir d;
  const std::string ref_out = (d.path() / "ref").string(), out = (d.path() / "run").string();
  {
    ServeProcess s(serve_args());
    const int port = s.wait_port(60);
    ASSERT_GT(port, 0) << s.err();
    CliProcess e(eval_args(port, ref_out));
    ASSERT_EQ(e.wait(300), 0) << e.err();
  }
  const fs::path ref_dir = resolve_run_dir(ref_out);
  std::size_t killed_at_lines = 0, killed_at_cells = 0, killed_at_results = 0;
  {
    // A server slowed to 20 ms per step (test-only hook), so that the sweep is still sending when it is killed.
    ::setenv("POSENC_SERVE_TEST_STEP_DELAY_MS", "20", 1);
    ServeProcess s(serve_args());
    ::unsetenv("POSENC_SERVE_TEST_STEP_DELAY_MS");
    const int port = s.wait_port(60);
    ASSERT_GT(port, 0) << s.err();
    CliProcess e(eval_args(port, out));
    // Wait for finished work on disk (a cell, and a group under way: journal lines), then kill the server.
    const fs::path run_dir = d.path() / "run" / ref_dir.filename();  // the same run id: URLs are not hashed
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
    while (e.running() && std::chrono::steady_clock::now() < deadline &&
           (cell_files(run_dir) < 1 || journal_lines(run_dir) < 2))
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    EXPECT_GE(cell_files(run_dir), 1u);
    ASSERT_TRUE(e.running()) << "the sweep ended before the server was killed: make it longer\n" << e.err();
    s.kill_now();
    killed_at_lines = journal_lines(run_dir);
    killed_at_cells = cell_files(run_dir);
    killed_at_results = finished_results(run_dir);
    EXPECT_EQ(e.wait(120), 1) << e.err();
    const std::string err = e.err();
    EXPECT_NE(err.find("unavailable"), std::string::npos) << err;
    EXPECT_NE(err.find("resume with the same command"), std::string::npos) << err;
    // Nothing finished is lost: at least the results on disk at the kill are still there (responses in flight at the
    // kill may add some, and a group completed by them moves its journal lines into cells).
    EXPECT_GT(killed_at_results, 0u);
    EXPECT_GE(finished_results(run_dir), killed_at_results) << err;
    if (fs::exists(run_dir / "summary.json")) {  // a partial summary, never a complete one
      const auto partial = nlohmann::json::parse(test::slurp(run_dir / "summary.json"));
      EXPECT_LT(partial["cells_present"].get<int64_t>(), partial["cells_expected"].get<int64_t>());
    }
  }
  {
    ServeProcess s(serve_args());  // another process, another port
    const int port = s.wait_port(60);
    ASSERT_GT(port, 0) << s.err();
    CliProcess e(eval_args(port, out));
    ASSERT_EQ(e.wait(300), 0) << e.err();
  }
  const fs::path run_dir = resolve_run_dir(out);
  EXPECT_EQ(run_dir.filename(), ref_dir.filename());
  const auto sa = nlohmann::json::parse(test::slurp(ref_dir / "summary.json"));
  const auto sb = nlohmann::json::parse(test::slurp(run_dir / "summary.json"));
  EXPECT_EQ(sa["cells"], sb["cells"]);
  EXPECT_EQ(sa["effective_context"], sb["effective_context"]);
  const auto pa = samples_of(ref_dir), pb = samples_of(run_dir);
  EXPECT_EQ(pa.size(), pb.size());
  EXPECT_EQ(pa.size(), 2u * 2 * 3 * 6 + 2 * 6);  // 2 tasks x 2 lengths x 3 depths x 6 samples + name_recall absent
  std::size_t same = 0;
  for (const auto& [k, v] : pa) same += pb.count(k);
  EXPECT_EQ(same, pa.size());
  const auto qa = nlohmann::json::parse(test::slurp(ref_dir / "ppl.json"));
  const auto qb = nlohmann::json::parse(test::slurp(run_dir / "ppl.json"));
  EXPECT_EQ(qa["results"], qb["results"]);
  EXPECT_EQ(journal_lines(run_dir), 0u);  // every group done: journals removed
  std::printf("[ kill ] server killed with %zu journal lines and %zu cells (%zu finished results) on disk; resumed "
              "to %zu samples equal to the uninterrupted run\n",
              killed_at_lines, killed_at_cells, killed_at_results, pa.size());
}

}  // namespace POSENC_UNITY_ID
