// posenc::version(), `posenc --version` and the CMake project version are one number.
#include <gtest/gtest.h>

#include <regex>
#include <string>

#include "posenc/io.hpp"
#include "posenc/version.hpp"
#include "../test_support.hpp"

namespace POSENC_UNITY_ID {  // this file's own namespace in the tests' unity build (CMakeLists.txt)

namespace {

TEST(Version, LibraryCliAndCMakeProjectAgree) {
  // The version as the root CMakeLists.txt declares it, read from the file (not from a definition the build
  // derived from it, which would agree by construction).
  const std::string cmake = posenc::read_file(std::string(POSENC_SOURCE_DIR) + "/CMakeLists.txt");
  std::smatch m;
  ASSERT_TRUE(std::regex_search(cmake, m, std::regex(R"(\nproject\(posenc VERSION ([0-9]+\.[0-9]+\.[0-9]+)[ )])")))
      << "no project(posenc VERSION x.y.z) in CMakeLists.txt";
  const std::string project_version = m[1];
  EXPECT_EQ(posenc::version(), project_version);
  const auto r = posenc::test::run_cli("--version");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.out.rfind("posenc " + project_version + " (git ", 0), 0u) << r.out;
}

}  // namespace

}  // namespace POSENC_UNITY_ID
