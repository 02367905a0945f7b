// `posenc eval --endpoint` on the command line: the flags it refuses (exit 2)
// and a run against the in-test server (fake_endpoint.hpp) whose likelihood
// cells are not supported: exit 0, the table says so, `eval report` copes.
#include <filesystem>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "fake_endpoint.hpp"
#include "posenc/eval.hpp"
#include "test_support.hpp"

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
