// scripts/study_report.py on a real study's summary.json
// (tests/train/data/study_report/): bins, training-range band, Newcombe
// differences (Newcombe 1998's worked example) and one colour per encoding and
// per scaling in the written plots. The checks are in
// tests/scripts/study_report_test.py (Debian's /usr/bin/python3, matplotlib).
#include <cstdlib>
#include <filesystem>
#include <string>

#include <gtest/gtest.h>

#include "test_support.hpp"

namespace POSENC_UNITY_ID {  // this file's own namespace in the tests' unity build (CMakeLists.txt)

namespace {

TEST(StudyReportPlots, BinsBandsDifferencesAndColoursOnARealStudy) {
  if (std::system("/usr/bin/python3 -c 'import matplotlib' >/dev/null 2>&1") != 0)
    GTEST_SKIP() << "python3-matplotlib is not installed (scripts/install-deps installs it)";
  posenc::test::TempDir d;
  const auto log = d.path() / "log";
  const std::string src = POSENC_SOURCE_DIR;
  const std::string cmd = "MPLBACKEND=Agg /usr/bin/python3 '" + src + "/tests/scripts/study_report_test.py' '" + src +
                          "' >'" + log.string() + "' 2>&1";
  const int st = std::system(cmd.c_str());
  const std::string out = posenc::test::slurp(log);
  ASSERT_TRUE(WIFEXITED(st)) << out;
  EXPECT_EQ(WEXITSTATUS(st), 0) << out;
  EXPECT_NE(out.find("0 failure(s)"), std::string::npos) << out;
}

}  // namespace

}  // namespace POSENC_UNITY_ID
