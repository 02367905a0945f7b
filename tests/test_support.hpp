// Shared test helpers: fixture paths, temp files, running the CLI.
#pragma once

#include <cstdio>
#include <exception>
#include <filesystem>
#include <fstream>
#include <string>

#include <sys/wait.h>

#include "sanitizer.hpp"

namespace posenc::test {

/// The message of the E that f() throws; "wrong exception type: ..." for any
/// other exception, "no exception" when it returns.
template <class E, class F>
std::string message_of(F&& f) {
  try {
    f();
  } catch (const E& e) {
    return e.what();
  } catch (const std::exception& e) {
    return std::string("wrong exception type: ") + e.what();
  }
  return "no exception";
}

inline std::filesystem::path shared_dir() { return POSENC_SHARED_DIR; }
inline std::filesystem::path model_path() { return shared_dir() / "models/stories260K/stories260K.bin"; }
inline std::filesystem::path tokenizer_path() { return shared_dir() / "models/stories260K/tok512.bin"; }
inline std::filesystem::path text_path() { return shared_dir() / "data/tinystories_val.txt"; }
/// tools/refs: reference-generation scripts; node_modules/ there once scripts/install-refs ran.
inline std::filesystem::path refs_dir() { return POSENC_REFS_DIR; }
/// True when the npm package `name` is installed under refs_dir() and `node` runs.
inline bool ref_installed(const std::string& name) {
  std::error_code ec;
  if (!std::filesystem::exists(refs_dir() / "node_modules" / name / "package.json", ec)) return false;
  return std::system("node --version >/dev/null 2>&1") == 0;
}

/// A fresh temporary directory, removed when the object dies.
class TempDir {
 public:
  TempDir() {
    std::string tmpl = (std::filesystem::temp_directory_path() / "posenc-test-XXXXXX").string();
    path_ = ::mkdtemp(tmpl.data());
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  const std::filesystem::path& path() const { return path_; }
  std::filesystem::path file(const std::string& name, const std::string& contents) const {
    auto p = path_ / name;
    std::ofstream(p, std::ios::binary) << contents;
    return p;
  }

 private:
  std::filesystem::path path_;
};

inline std::string slurp(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

struct CliResult {
  int exit_code = -1;
  bool signaled = false;
  std::string out, err;
};

/// Runs the posenc CLI with `args` (a shell-quoted string), capturing stdout/stderr.
inline CliResult run_cli(const std::string& args) {
  TempDir d;
  const auto out = d.path() / "out", err = d.path() / "err";
  const std::string cmd = std::string("'") + POSENC_CLI_PATH + "' " + args + " >'" + out.string() + "' 2>'" +
                          err.string() + "'";
  const int st = std::system(cmd.c_str());
  CliResult r;
  if (WIFEXITED(st)) r.exit_code = WEXITSTATUS(st);
  if (WIFSIGNALED(st)) r.signaled = true;
  r.out = slurp(out);
  r.err = slurp(err);
  return r;
}

}  // namespace posenc::test
