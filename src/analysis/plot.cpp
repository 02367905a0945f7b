// Runs a matplotlib script of scripts/ on a JSON data file.
#include <fcntl.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <string>
#include <system_error>
#include <vector>

#include <fmt/format.h>

#include "posenc/analysis.hpp"
#include "posenc/error.hpp"
#include "posenc/io.hpp"

extern char** environ;

namespace posenc {

namespace {

/// A unique empty file in the temporary directory, removed on destruction.
class TempFile {
 public:
  explicit TempFile(std::string_view suffix) {
    std::string pattern =
        (std::filesystem::temp_directory_path() / "posenc-plot-XXXXXX").string() + std::string(suffix);
    std::vector<char> buf(pattern.begin(), pattern.end());
    buf.push_back('\0');
    const int fd = ::mkstemps(buf.data(), static_cast<int>(suffix.size()));
    if (fd < 0)
      throw IoError(fmt::format("{}: cannot create a temporary file: {}", pattern,
                                std::strerror(errno)));
    ::close(fd);
    path_ = buf.data();
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

std::string python_interpreter() {
  // Debian's python3-matplotlib installs into /usr/bin/python3's site; a
  // python3 earlier on PATH (pyenv, venv) may lack it.
  std::error_code ec;
  if (std::filesystem::exists("/usr/bin/python3", ec)) return "/usr/bin/python3";
  return "python3";
}

}  // namespace

void render_plot(const std::filesystem::path& script, std::string_view data_json,
                 const std::filesystem::path& out_png) {
  std::error_code ec;
  if (!std::filesystem::is_regular_file(script, ec))
    throw IoError(fmt::format("{}: plot script not found", script.string()));
  if (out_png.empty()) throw IoError("--plot: empty output path");
  TempFile data(".json");
  TempFile log(".log");
  write_file_atomic(data.path(), data_json);

  const std::string python = python_interpreter();
  const std::string script_s = script.string();
  const std::string data_s = data.path().string();
  const std::string out_s = out_png.string();
  std::vector<char*> argv{const_cast<char*>(python.c_str()), const_cast<char*>(script_s.c_str()),
                          const_cast<char*>(data_s.c_str()), const_cast<char*>(out_s.c_str()),
                          nullptr};
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  const std::string log_s = log.path().string();
  posix_spawn_file_actions_addopen(&actions, 1, log_s.c_str(), O_WRONLY | O_TRUNC, 0600);
  posix_spawn_file_actions_adddup2(&actions, 1, 2);
  pid_t pid = 0;
  const int rc = ::posix_spawnp(&pid, python.c_str(), &actions, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  if (rc != 0)
    throw IoError(fmt::format("--plot: cannot run {}: {}", python, std::strerror(rc)));
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0) {
    if (errno != EINTR)
      throw IoError(fmt::format("--plot: waiting for {} failed: {}", python, std::strerror(errno)));
  }
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    std::string output;
    try {
      output = read_file(log.path());
    } catch (const IoError&) {
    }
    if (output.size() > 2000) output = "..." + output.substr(output.size() - 2000);
    throw IoError(fmt::format("--plot {}: {} {} failed ({}): {}", out_s, python, script_s,
                              WIFEXITED(status) ? fmt::format("exit {}", WEXITSTATUS(status))
                                                : std::string("killed"),
                              output));
  }
}

}  // namespace posenc
