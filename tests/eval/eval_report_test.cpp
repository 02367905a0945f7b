// scripts/eval_report.py on the fixtures in tests/eval/data/report (v1: a real
// stories260K run's summary.json/run.json/ppl.json without schema_version; v2:
// the same run edited per the issue-14 summary contract by
// tests/scripts/make_report_v2_fixture.py). The checks themselves are in
// tests/scripts/eval_report_test.py (Debian's /usr/bin/python3, matplotlib);
// exit 77 from it means a tool it needs is missing and is reported as skipped.
#include <algorithm>
#include <cstdlib>
#include <iostream>
#include <filesystem>
#include <fstream>
#include <string>

#include <gtest/gtest.h>

#include "test_support.hpp"

namespace POSENC_UNITY_ID {  // this file's own namespace in the tests' unity build (CMakeLists.txt)

namespace {

namespace fs = std::filesystem;
using posenc::test::slurp;
using posenc::test::TempDir;

struct ScriptResult {
  int exit_code = -1;
  std::string output;
};

ScriptResult run_check(const std::string& mode, const std::string& extra = "") {
  TempDir d;
  const fs::path log = d.path() / "log";
  const std::string src = POSENC_SOURCE_DIR;
  const std::string cmd = "MPLBACKEND=Agg /usr/bin/python3 '" + src + "/tests/scripts/eval_report_test.py' " + mode +
                          " '" + src + "' " + extra + " >'" + log.string() + "' 2>&1";
  const int st = std::system(cmd.c_str());
  ScriptResult r;
  if (WIFEXITED(st)) r.exit_code = WEXITSTATUS(st);
  r.output = slurp(log);
  return r;
}

bool have_matplotlib() { return std::system("/usr/bin/python3 -c 'import matplotlib' >/dev/null 2>&1") == 0; }

TEST(EvalReportHtml, TablesContentsChanceAndUnsolvableTasksFromSchema1And2Summaries) {
  if (!have_matplotlib()) GTEST_SKIP() << "python3-matplotlib is not installed (scripts/install-deps installs it)";
  const ScriptResult r = run_check("html");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("0 failure(s)"), std::string::npos) << r.output;
}

TEST(EvalReportHtml, LoadsWithoutErrorsAndEveryImageDecodesInHeadlessChromium) {
  if (!have_matplotlib()) GTEST_SKIP() << "python3-matplotlib is not installed (scripts/install-deps installs it)";
  // The screenshots stay for a person to look at (the test prints their paths).
  const fs::path shots = fs::temp_directory_path() / "posenc-report-screenshots";
  const ScriptResult r = run_check("chromium", "'" + shots.string() + "'");
  if (r.exit_code == 77) GTEST_SKIP() << r.output;
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("0 failure(s)"), std::string::npos) << r.output;
  std::cout << r.output;
}

// `eval report` on a run dir whose plots is a file, or whose report.html is a directory: one line naming the path,
// exit 1, no Python traceback and no "is python3-matplotlib installed?" (printed only when that import fails).
TEST(EvalReportHtml, BadPlotsOrReportPathIsOneLineErrorNamingItWithoutTheMatplotlibHint) {
  if (!have_matplotlib()) GTEST_SKIP() << "python3-matplotlib is not installed (scripts/install-deps installs it)";
  using posenc::test::model_path;
  if (!fs::exists(model_path())) GTEST_SKIP() << "no stories260K fixture";
  TempDir d;
  const std::string out = (d.path() / "run").string();
  const auto made = posenc::test::run_cli(
      "eval --model '" + model_path().string() + "' --tokenizer '" + posenc::test::tokenizer_path().string() +
      "' --haystack '" + posenc::test::text_path().string() +
      "' --tasks name_recall --context 64 --samples 2 --rope-scaling default --out '" + out + "' --quiet");
  ASSERT_EQ(made.exit_code, 0) << made.err;
  fs::path run;
  for (const auto& e : fs::directory_iterator(out))
    if (e.is_directory()) run = e.path();
  ASSERT_FALSE(run.empty());
  for (const std::string what : {"plots", "report.html"}) {
    const fs::path bad = run / what;
    std::error_code ec;
    fs::remove_all(bad, ec);
    if (what == "plots") {
      std::ofstream(bad) << "";
    } else {
      fs::create_directory(bad);
    }
    const auto r = posenc::test::run_cli("eval report '" + run.string() + "'");
    EXPECT_EQ(r.exit_code, 1) << r.err;
    EXPECT_NE(r.err.find(bad.string()), std::string::npos) << r.err;
    EXPECT_EQ(r.err.find("Traceback"), std::string::npos) << r.err;
    EXPECT_EQ(r.err.find("matplotlib"), std::string::npos) << r.err;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
    fs::remove_all(bad, ec);
  }
  // and with both in order the report is written
  const auto ok = posenc::test::run_cli("eval report '" + run.string() + "'");
  EXPECT_EQ(ok.exit_code, 0) << ok.err;
  EXPECT_TRUE(fs::is_regular_file(run / "report.html"));
}

}  // namespace

}  // namespace POSENC_UNITY_ID
