#include "scripts.hpp"

#include <fcntl.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include <fmt/format.h>

#include "posenc/error.hpp"
#include "posenc/io.hpp"

extern char** environ;

#ifndef POSENC_SCRIPTS_DIR
#define POSENC_SCRIPTS_DIR "scripts"
#endif
#ifndef POSENC_SCRIPTS_FROM_BIN
#define POSENC_SCRIPTS_FROM_BIN ""
#endif

namespace posenc::cli {

namespace {

/// A unique empty file in the temporary directory, removed on destruction.
class TempFile {
 public:
  explicit TempFile(std::string_view suffix) {
    std::string pattern =
        (std::filesystem::temp_directory_path() / "posenc-script-XXXXXX").string() + std::string(suffix);
    const int fd = ::mkstemps(pattern.data(), static_cast<int>(suffix.size()));
    if (fd < 0) throw IoError(fmt::format("{}: cannot create a temporary file: {}", pattern, std::strerror(errno)));
    ::close(fd);
    path_ = pattern;
  }
  ~TempFile() {
    std::error_code ec;
    std::filesystem::remove(path_, ec);
  }
  TempFile(const TempFile&) = delete;
  TempFile& operator=(const TempFile&) = delete;
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
};

/// $POSENC_SCRIPTS_DIR if set, else the source tree's scripts/ (the build's).
std::string source_scripts_dir() {
  const char* env = std::getenv("POSENC_SCRIPTS_DIR");
  return env && *env ? env : POSENC_SCRIPTS_DIR;
}

std::string scripts_dir() {
  const char* env = std::getenv("POSENC_SCRIPTS_DIR");
  if (env && *env) return env;
  // An installed CLI: <prefix>/bin/posenc finds <prefix>/share/posenc/scripts (the relative path the build gave).
  std::error_code ec;
  const std::filesystem::path exe = std::filesystem::read_symlink("/proc/self/exe", ec);
  if (!ec && std::string_view(POSENC_SCRIPTS_FROM_BIN) != "") {
    const std::filesystem::path installed = (exe.parent_path() / POSENC_SCRIPTS_FROM_BIN).lexically_normal();
    if (std::filesystem::is_directory(installed, ec)) return installed.string();
  }
  return POSENC_SCRIPTS_DIR;
}

std::string python_interpreter() {
  const char* env = std::getenv("POSENC_PYTHON");
  if (env && *env) return env;
  std::error_code ec;
  return std::filesystem::exists("/usr/bin/python3", ec) ? "/usr/bin/python3" : "python3";
}

}  // namespace

void run_script(const std::string& script, const std::vector<std::string>& args) {
  const std::filesystem::path path = std::filesystem::path(scripts_dir()) / script;
  std::error_code ec;
  if (!std::filesystem::is_regular_file(path, ec))
    throw IoError(fmt::format("{}: plotting script not found", path.string()));
  const std::string python = python_interpreter();
  const std::string path_s = path.string();
  std::vector<std::string> env_strings{"MPLBACKEND=Agg"};
  for (char** e = environ; *e; ++e)
    if (std::strncmp(*e, "MPLBACKEND=", 11) != 0) env_strings.emplace_back(*e);
  std::vector<char*> envp;
  for (auto& s : env_strings) envp.push_back(s.data());
  envp.push_back(nullptr);
  std::vector<std::string> argv_s{python, path_s};
  argv_s.insert(argv_s.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (auto& s : argv_s) argv.push_back(s.data());
  argv.push_back(nullptr);

  TempFile log(".log");
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  const std::string log_s = log.path().string();
  posix_spawn_file_actions_addopen(&actions, 1, log_s.c_str(), O_WRONLY | O_TRUNC, 0600);
  posix_spawn_file_actions_adddup2(&actions, 1, 2);
  std::fflush(stdout);
  std::fflush(stderr);
  pid_t pid = 0;
  const int rc = ::posix_spawnp(&pid, python.c_str(), &actions, nullptr, argv.data(), envp.data());
  posix_spawn_file_actions_destroy(&actions);
  if (rc != 0) throw IoError(fmt::format("cannot run {}: {}", python, std::strerror(rc)));
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0)
    if (errno != EINTR) throw IoError(fmt::format("waiting for {} failed: {}", python, std::strerror(errno)));
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    std::string output;
    try {
      output = read_file(log.path());
    } catch (const IoError&) {
    }
    if (output.size() > 2000) output = "..." + output.substr(output.size() - 2000);
    while (!output.empty() && (output.back() == '\n' || output.back() == ' ')) output.pop_back();
    // The hint only when the script could not import matplotlib; any other failure is the script's own message.
    const bool no_matplotlib = output.find("No module named 'matplotlib") != std::string::npos;
    throw IoError(fmt::format("{} {} failed ({}){}: {}", python, path_s,
                              WIFEXITED(status) ? fmt::format("exit {}", WEXITSTATUS(status)) : std::string("killed"),
                              no_matplotlib ? "; is python3-matplotlib installed?" : "", output));
  }
}

void run_plot(const std::string& script, std::string_view data_json, const std::filesystem::path& out_png) {
  if (out_png.empty()) throw IoError("--plot: empty output path");
  TempFile data(".json");
  write_file_atomic(data.path(), data_json);
  run_script(script, {data.path().string(), out_png.string()});
}

std::string source_git_hash() {
  const std::string dir = source_scripts_dir() + "/..";
  std::string cmd = "git -C '";
  for (char c : dir) cmd += c == '\'' ? std::string("'\\''") : std::string(1, c);
  cmd += "' rev-parse HEAD 2>/dev/null";
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
