#include "scripts.hpp"

#include <sys/wait.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>

#include <fmt/format.h>

#include "posenc/error.hpp"

#ifndef POSENC_SCRIPTS_DIR
#define POSENC_SCRIPTS_DIR "scripts"
#endif

namespace posenc::cli {

namespace {

std::string quote(const std::string& s) {
  std::string q = "'";
  for (char c : s) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}

std::string scripts_dir() {
  const char* env = std::getenv("POSENC_SCRIPTS_DIR");
  return env && *env ? env : POSENC_SCRIPTS_DIR;
}

}  // namespace

void run_script(const std::string& script, const std::vector<std::string>& args) {
  const std::filesystem::path path = std::filesystem::path(scripts_dir()) / script;
  if (!std::filesystem::exists(path)) throw IoError(fmt::format("{}: plotting script not found", path.string()));
  // Debian's python3-matplotlib lives in /usr/bin/python3's dist-packages; a
  // python3 earlier on PATH (pyenv, venv) may not have it.
  const char* env = std::getenv("POSENC_PYTHON");
  const std::string py = env && *env ? env : std::filesystem::exists("/usr/bin/python3") ? "/usr/bin/python3" : "python3";
  std::string cmd = fmt::format("MPLBACKEND=Agg {} {}", quote(py), quote(path.string()));
  for (const auto& a : args) {
    cmd += ' ';
    cmd += quote(a);
  }
  std::fflush(stdout);
  std::fflush(stderr);
  const int rc = std::system(cmd.c_str());
  if (rc == -1 || !WIFEXITED(rc) || WEXITSTATUS(rc) != 0)
    throw IoError(fmt::format("{} (run with {}): failed (exit status {}); is python3-matplotlib installed?", path.string(), py,
                              rc == -1 ? -1 : (WIFEXITED(rc) ? WEXITSTATUS(rc) : -1)));
}

std::string source_git_hash() {
  const std::string cmd = fmt::format("git -C {} rev-parse HEAD 2>/dev/null", quote(scripts_dir() + "/.."));
  FILE* p = ::popen(cmd.c_str(), "r");
  if (!p) return "";
  char buf[128] = {0};
  std::string out;
  while (std::fgets(buf, sizeof buf, p)) out += buf;
  ::pclose(p);
  while (!out.empty() && (out.back() == '\n' || out.back() == ' ')) out.pop_back();
  return out.size() == 40 ? out : "";
}

}  // namespace posenc::cli
