// `posenc serve` as a child process (POSENC_CLI_PATH) for the CLI tests of serve and eval --endpoint.
#pragma once

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <regex>
#include <string>
#include <vector>

#include "serve_support.hpp"

extern char** environ;

namespace posenc::test::serve {

/// `posenc serve --port 0` as a child process with stderr in a file.
class ServeProcess {
 public:
  explicit ServeProcess(const std::vector<std::string>& args) {
    err_ = dir_.path() / "stderr";
    std::vector<std::string> argv = {POSENC_CLI_PATH, "serve"};
    argv.insert(argv.end(), args.begin(), args.end());
    std::vector<char*> cargv;
    for (auto& a : argv) cargv.push_back(a.data());
    cargv.push_back(nullptr);
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_addopen(&fa, 2, err_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    posix_spawn_file_actions_addopen(&fa, 1, "/dev/null", O_WRONLY, 0);
    if (posix_spawn(&pid_, cargv[0], &fa, nullptr, cargv.data(), environ) != 0) pid_ = -1;
    posix_spawn_file_actions_destroy(&fa);
  }
  ~ServeProcess() {
    if (pid_ > 0 && !reaped_) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
    }
  }
  pid_t pid() const { return pid_; }
  std::string err() const { return posenc::test::slurp(err_); }
  /// The port of the "listening on" line, -1 if it did not come within `seconds`.
  int wait_port(double seconds) const {
    const std::regex re(R"(posenc serve: listening on http://127\.0\.0\.1:(\d+)/v1 \(model (\S+), max_model_len (\d+)\))");
    int port = -1;
    eventually(
        [&] {
          std::smatch m;
          const std::string e = err();
          if (std::regex_search(e, m, re)) port = std::stoi(m[1]);
          return port > 0;
        },
        seconds);
    return port;
  }
  /// Exit status after SIGTERM (-1: signaled or not within `seconds`).
  int terminate(double seconds) {
    ::kill(pid_, SIGTERM);
    int st = 0;
    const bool done = eventually([&] { return ::waitpid(pid_, &st, WNOHANG) == pid_; }, seconds);
    if (!done) return -1;
    reaped_ = true;
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  }

  /// SIGKILL and reap (a crash of the server: nothing drained, sockets reset).
  void kill_now() {
    if (pid_ > 0 && !reaped_) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
      reaped_ = true;
    }
  }

 private:
  posenc::test::TempDir dir_;
  std::filesystem::path err_;
  pid_t pid_ = -1;
  bool reaped_ = false;
};

}  // namespace posenc::test::serve
