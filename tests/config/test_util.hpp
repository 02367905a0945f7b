// Test helpers shared by tests/config and tests/analysis: a scratch directory
// and running the posenc CLI binary.
#pragma once

#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

// CliResult and slurp are test_support.hpp's: this header had its own posenc::test::CliResult of another layout
// (no `signaled`), an ODR violation that the -O0 sanitizer build turned into garbage bools in the other tests.
#include "test_support.hpp"

namespace posenc::test {

/// A fresh directory under the system temp dir, removed with its contents.
class ScratchDir {
 public:
  ScratchDir() {
    std::string pattern = (std::filesystem::temp_directory_path() / "posenc-test-XXXXXX").string();
    std::vector<char> buf(pattern.begin(), pattern.end());
    buf.push_back('\0');
    if (::mkdtemp(buf.data()) == nullptr) throw std::runtime_error("mkdtemp failed");
    path_ = buf.data();
  }
  ~ScratchDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  ScratchDir(const ScratchDir&) = delete;
  ScratchDir& operator=(const ScratchDir&) = delete;

  const std::filesystem::path& path() const { return path_; }
  std::filesystem::path operator/(std::string_view name) const { return path_ / name; }

  /// Writes `text` to a file in the directory and returns its path.
  std::filesystem::path write(std::string_view name, std::string_view text) const {
    const auto p = path_ / name;
    std::ofstream(p, std::ios::binary) << text;
    return p;
  }

 private:
  std::filesystem::path path_;
};

inline std::string shell_quote(std::string_view s) {
  std::string out(1, '\'');
  for (char c : s) {
    if (c == '\'')
      out.append("'\\''");
    else
      out.push_back(c);
  }
  out.push_back('\'');
  return out;
}

/// Runs the posenc binary (POSENC_CLI_PATH) with `args` (each quoted).
inline CliResult run_cli(const std::vector<std::string>& args) {
  ScratchDir dir;
  std::string cmd = shell_quote(POSENC_CLI_PATH);
  for (const auto& a : args) {
    cmd.push_back(' ');
    cmd.append(shell_quote(a));
  }
  cmd.append(" >").append(shell_quote((dir / "out").string()));
  cmd.append(" 2>").append(shell_quote((dir / "err").string()));
  const int status = std::system(cmd.c_str());
  CliResult r;
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  r.signaled = WIFSIGNALED(status);
  r.out = slurp(dir / "out");
  r.err = slurp(dir / "err");
  return r;
}

inline std::filesystem::path shared_config(std::string_view name) {
  return std::filesystem::path(POSENC_SHARED_DIR) / "configs" / name;
}

}  // namespace posenc::test
