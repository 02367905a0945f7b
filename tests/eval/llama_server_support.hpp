// Tests against llama.cpp's llama-server: where its binary is, and a running
// instance on a free loopback port that dies with the test.
//
// The binary is built once, outside the checkout, by scripts/build-llama-server
// (from the llama.cpp source node-llama-cpp bundles; about 10 minutes on 2
// cores, so .ci/run does not build it). Tests that need it are SKIPPED with a
// message naming that script when it is absent.
#pragma once

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <optional>
#include <regex>
#include <string>
#include <thread>
#include <vector>

#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fmt/format.h>
#include <httplib.h>

#include "llama_cpp_cache.hpp"
#include "test_support.hpp"

namespace posenc::test {

/// The llama-server to test against: $POSENC_LLAMA_SERVER when set (any build), else the cache path.
inline std::filesystem::path llama_server_path() {
  const std::string explicit_path = env_or_empty("POSENC_LLAMA_SERVER");
  return explicit_path.empty() ? llama_server_cache_path() : std::filesystem::path(explicit_path);
}

/// Empty when llama_server_path() is an executable file; else why not, with how to get one
/// (the GTEST_SKIP message).
inline std::string llama_server_missing() {
  const auto p = llama_server_path();
  std::error_code ec;
  if (std::filesystem::is_regular_file(p, ec) && ::access(p.c_str(), X_OK) == 0) return {};
  return fmt::format(
      "no llama-server at {} ({}): build it once with scripts/build-llama-server (~10 min on 2 cores, into a cache "
      "outside the checkout; .ci/run does not), or set POSENC_LLAMA_SERVER=/path/to/llama-server",
      p.string(),
      env_or_empty("POSENC_LLAMA_SERVER").empty() ? "scripts/build-llama-server's cache" : "POSENC_LLAMA_SERVER");
}

/// One llama-server process on 127.0.0.1 at a port it picks itself (--port 0; read back from its
/// log). Killed (SIGTERM, then SIGKILL after 5 s) by the destructor, and by the kernel when the
/// test process dies first (PR_SET_PDEATHSIG). start() throws std::runtime_error with the log's
/// tail when the server exits or is not healthy within `timeout`.
class LlamaServerProcess {
 public:
  LlamaServerProcess() = default;
  LlamaServerProcess(const LlamaServerProcess&) = delete;
  LlamaServerProcess& operator=(const LlamaServerProcess&) = delete;
  ~LlamaServerProcess() { stop(); }

  void start(const std::filesystem::path& binary, std::vector<std::string> args,
             std::chrono::seconds timeout = std::chrono::seconds(60)) {
    log_ = dir_.path() / "llama-server.log";
    std::vector<std::string> argv_s{binary.string()};
    argv_s.insert(argv_s.end(), args.begin(), args.end());
    std::vector<char*> argv;
    for (auto& s : argv_s) argv.push_back(s.data());
    argv.push_back(nullptr);
    const std::string log = log_.string();
    const pid_t parent = ::getpid();
    pid_ = ::fork();
    if (pid_ < 0) throw std::runtime_error("fork failed");
    if (pid_ == 0) {  // child: only async-signal-safe calls until exec
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (::getppid() != parent) ::_exit(127);
      const int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      if (fd >= 0) {
        ::dup2(fd, 1);
        ::dup2(fd, 2);
      }
      ::execv(argv[0], argv.data());
      ::_exit(127);
    }
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    const std::regex listening(R"(listening on http://127\.0\.0\.1:(\d+))");
    while (port_ == 0) {
      std::smatch m;
      const std::string text = slurp(log_);
      if (std::regex_search(text, m, listening)) port_ = std::stoi(m[1].str());
      else fail_if_gone_or_late(deadline, "listening");
    }
    httplib::Client cli("127.0.0.1", port_);
    cli.set_connection_timeout(2);
    cli.set_read_timeout(5);
    for (;;) {  // /health is 503 while the model loads
      auto r = cli.Get("/health");
      if (r && r->status == 200) return;
      fail_if_gone_or_late(deadline, "answering /health with 200");
    }
  }

  int port() const { return port_; }
  std::string log_text() const { return slurp(log_); }

  void stop() {
    if (pid_ <= 0) return;
    ::kill(pid_, SIGTERM);
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
    int st = 0;
    while (::waitpid(pid_, &st, WNOHANG) == 0) {
      if (std::chrono::steady_clock::now() > deadline) {
        ::kill(pid_, SIGKILL);
        ::waitpid(pid_, &st, 0);
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    pid_ = -1;
  }

 private:
  void fail_if_gone_or_late(std::chrono::steady_clock::time_point deadline, const char* what) {
    int st = 0;
    if (::waitpid(pid_, &st, WNOHANG) == pid_) {
      pid_ = -1;
      throw std::runtime_error(fmt::format("llama-server exited ({}) before {}; log:\n{}",
                                           WIFEXITED(st) ? fmt::format("status {}", WEXITSTATUS(st)) : "signal",
                                           what, tail(slurp(log_))));
    }
    if (std::chrono::steady_clock::now() > deadline)
      throw std::runtime_error(fmt::format("llama-server timed out before {}; log:\n{}", what, tail(slurp(log_))));
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  static std::string tail(const std::string& s) { return s.size() > 4000 ? s.substr(s.size() - 4000) : s; }

  TempDir dir_;
  std::filesystem::path log_;
  pid_t pid_ = -1;
  int port_ = 0;
};

}  // namespace posenc::test
