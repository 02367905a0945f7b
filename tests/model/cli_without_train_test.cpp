// A build without the training part (-DPOSENC_WITH_TRAIN=OFF, no libtorch): `posenc train` and `posenc study`
// exist, say which option builds them and exit 2, whatever their flags; nothing is written.
#include <gtest/gtest.h>

#include <filesystem>
#include <string>

#include "../test_support.hpp"

namespace POSENC_UNITY_ID {  // this file's own namespace in the tests' unity build (CMakeLists.txt)

#if !POSENC_WITH_TRAIN

namespace {

namespace fs = std::filesystem;
using posenc::test::run_cli;
using posenc::test::TempDir;

TEST(WithoutTrain, TrainAndStudyExit2NamingTheBuildOption) {
  TempDir d;
  const std::string out = (d.path() / "m.pt").string(), dir = (d.path() / "study").string();
  for (const std::string& args : {"train --task copy --pe rope --steps 5 --out '" + out + "'", std::string("train"),
                                  "study --tasks copy --pe rope --seeds 1 --out '" + dir + "'",
                                  "study report --no-plots '" + dir + "'"}) {
    const auto r = run_cli(args);
    EXPECT_EQ(r.exit_code, 2) << args << ": " << r.err;
    EXPECT_NE(r.err.find("built without the training part"), std::string::npos) << args << ": " << r.err;
    EXPECT_NE(r.err.find("-DPOSENC_WITH_TRAIN=ON"), std::string::npos) << args << ": " << r.err;
    EXPECT_TRUE(r.out.empty()) << args << ": " << r.out;
  }
  EXPECT_FALSE(fs::exists(out));
  EXPECT_FALSE(fs::exists(dir));
  // The top-level help still lists them, marked.
  const auto h = run_cli("--help");
  ASSERT_EQ(h.exit_code, 0) << h.err;
  EXPECT_NE(h.out.find("not in this build: configure with -DPOSENC_WITH_TRAIN=ON"), std::string::npos) << h.out;
}

}  // namespace

#endif  // !POSENC_WITH_TRAIN

}  // namespace POSENC_UNITY_ID
