// posenc serve's HTTP edges on loopback: binding, methods, request framing and slow clients.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "serve_support.hpp"

using namespace posenc;
using namespace posenc::test::serve;
using posenc::serve::ServeConfig;

namespace {

TEST(ServeHttp, APortInUseIsRefusedNamingThePort) {
  Running first;
  ServeConfig cfg;
  cfg.port = first.port;
  cfg.served_model_name = "second";
  posenc::serve::Server second(stories().model, stories().tok, cfg);
  const std::string msg = posenc::test::message_of<IoError>([&] { second.start(); });
  EXPECT_NE(msg.find(fmt::format("cannot bind 127.0.0.1:{}: address in use", first.port)), std::string::npos) << msg;
  // The first server still answers every request (no second listener shares the port).
  auto c = first.client(5);
  for (int i = 0; i < 20; ++i) {
    auto r = get(c, "/v1/models");
    ASSERT_EQ(r.status, 200);
    EXPECT_EQ(r.body["data"][0]["id"], "stories260K");
  }
}

// A server stopped right after start() (a caller failing before its first request) hung in stop(): httplib's
// stop() is a no-op until the listener thread is in its accept loop, and the join then waited forever. A watchdog
// ends the process (failing) if the loop hangs; the fixed stop waits for the listener to run first.
TEST(ServeHttp, StopRightAfterStartDoesNotHang) {
  std::atomic<bool> finished{false};
  std::thread watchdog([&] {
    for (int i = 0; i < 600 && !finished; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(100));
    if (!finished) {
      std::fprintf(stderr, "ServeHttp.StopRightAfterStartDoesNotHang: Server::stop() hung after start()\n");
      std::_Exit(1);
    }
  });
  for (int i = 0; i < 200; ++i) {
    ServeConfig cfg;
    cfg.port = 0;
    posenc::serve::Server server(stories().model, stories().tok, cfg);
    EXPECT_GT(server.start(), 0);
  }  // ~Server stops it at once
  finished = true;
  watchdog.join();
}

TEST(ServeHttp, AMalformedHostIsAConfigErrorNotABindFailure) {
  auto make = [](const std::string& host) {
    ServeConfig c;
    c.host = host;
    posenc::serve::Server s(stories().model, stories().tok, c);
  };
  using posenc::test::message_of;
  EXPECT_EQ(message_of<ConfigError>([&] { make("999.1.1.1"); }), "host: '999.1.1.1' is not a valid IPv4 address");
  EXPECT_EQ(message_of<ConfigError>([&] { make("1.2.3"); }), "host: '1.2.3' is not a valid IPv4 address");
  EXPECT_EQ(message_of<ConfigError>([&] { make("::g"); }), "host: '::g' is not a valid IPv6 address");
  // .invalid never resolves (RFC 2606).
  EXPECT_NE(message_of<ConfigError>([&] { make("example.invalid"); })
                .find("host: 'example.invalid' is neither an IPv4/IPv6 address nor a resolvable host name"),
            std::string::npos);
  // Literal addresses and a resolvable name are accepted (validation only: nothing is bound here).
  for (const char* ok : {"127.0.0.1", "0.0.0.0", "::1", "localhost"}) EXPECT_NO_THROW(make(ok)) << ok;
}

/// The answer to one raw HTTP/1.1 request on a new loopback connection (receive timeout `seconds`): the status
/// line, headers and body as the server wrote them until it closed the connection or went quiet.
std::string raw_exchange(int port, const std::string& request, double seconds = 3) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  timeval tv{static_cast<time_t>(seconds), static_cast<suseconds_t>((seconds - static_cast<time_t>(seconds)) * 1e6)};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  std::string got;
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0 &&
      ::send(fd, request.data(), request.size(), MSG_NOSIGNAL) == static_cast<ssize_t>(request.size())) {
    char buf[4096];
    for (;;) {
      const ssize_t n = ::recv(fd, buf, sizeof(buf), 0);
      if (n <= 0) break;
      got.append(buf, static_cast<std::size_t>(n));
      // One complete answer (head + Content-Length body) is enough: keep-alive connections stay open.
      const auto head_end = got.find("\r\n\r\n");
      const auto cl = got.find("Content-Length: ");
      if (head_end != std::string::npos && cl != std::string::npos && cl < head_end &&
          got.size() >= head_end + 4 + std::stoul(got.substr(cl + 16)))
        break;
    }
  }
  ::close(fd);
  return got;
}

int status_of(const std::string& answer) {
  return answer.rfind("HTTP/1.1 ", 0) == 0 ? std::stoi(answer.substr(9, 3)) : -1;
}

json body_of(const std::string& answer) {
  const auto at = answer.find("\r\n\r\n");
  return at == std::string::npos ? json() : json::parse(answer.substr(at + 4), nullptr, false);
}

std::string header_of(const std::string& answer, const std::string& name) {
  const auto at = answer.find("\r\n" + name + ": ");
  if (at == std::string::npos || at > answer.find("\r\n\r\n")) return "(none)";
  const auto from = at + 4 + name.size();
  return answer.substr(from, answer.find("\r\n", from) - from);
}

TEST(ServeHttp, AWrongMethodOnAKnownPathIs405WithAllow) {
  Running s;
  struct Case {
    std::string request;
    int status;
    std::string allow;
  };
  const std::vector<Case> cases = {
      {"GET /v1/completions HTTP/1.1\r\nHost: x\r\n\r\n", 405, "POST"},
      {"PUT /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}", 405, "POST"},
      {"PUT /v1/completions HTTP/1.1\r\nHost: x\r\n\r\n", 405, "POST"},
      {"DELETE /v1/models HTTP/1.1\r\nHost: x\r\n\r\n", 405, "GET, HEAD"},
      {"OPTIONS /v1/completions HTTP/1.1\r\nHost: x\r\n\r\n", 405, "POST"},
      {"POST /health HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}", 405, "GET, HEAD"},
      {"GET /tokenize HTTP/1.1\r\nHost: x\r\n\r\n", 405, "POST"},
      // Unknown paths stay 404, with or without a body.
      {"GET /v1/nothing HTTP/1.1\r\nHost: x\r\n\r\n", 404, "(none)"},
      {"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n\r\n", 404, "(none)"},
      {"DELETE /nope HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\n\r\nx", 404, "(none)"},
  };
  for (const auto& c : cases) {
    const auto t0 = std::chrono::steady_clock::now();
    const std::string a = raw_exchange(s.port, c.request);
    const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const std::string line = c.request.substr(0, c.request.find('\r'));
    EXPECT_EQ(status_of(a), c.status) << line << "\n" << a.substr(0, 300);
    EXPECT_LT(took, 1.0) << line;  // at once: a request without a body is not waited on
    EXPECT_EQ(header_of(a, "Allow"), c.allow) << line;
    const json b = body_of(a);
    ASSERT_TRUE(b.is_object() && b.contains("error")) << line << "\n" << a.substr(0, 300);
    EXPECT_EQ(b["error"]["code"], c.status) << line;
    EXPECT_NE(b["error"]["message"].get<std::string>().find(c.status == 405 ? "method not allowed" : "no such endpoint"),
              std::string::npos)
        << line << ": " << b.dump();
  }
  // The right methods still work, and a known route with a body under the wrong method does not poison the
  // connection (the body was read).
  auto c = s.client(5);
  EXPECT_EQ(get(c, "/health").status, 200);
  EXPECT_EQ(post(c, "/tokenize", R"({"prompt": "Once"})").status, 200);
}

/// A loopback connection that sent `request` and keeps the socket open (receive timeout `seconds`).
struct OpenConnection {
  int fd = -1;
  OpenConnection(int port, const std::string& request, double seconds) {
    fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(static_cast<uint16_t>(port));
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    timeval tv{static_cast<time_t>(seconds), 0};
    ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0)
      ::send(fd, request.data(), request.size(), MSG_NOSIGNAL);
  }
  ~OpenConnection() { ::close(fd); }
  std::string answer() const {
    std::string got;
    char buf[4096];
    for (;;) {
      const ssize_t n = ::recv(fd, buf, sizeof(buf), 0);
      if (n <= 0) break;
      got.append(buf, static_cast<std::size_t>(n));
      if (got.find("\r\n\r\n") != std::string::npos && got.back() == '}') break;
    }
    return got;
  }
};

TEST(ServeHttp, APostWithoutContentLengthIs411AtOnce) {
  Running s;
  for (const char* path : {"/v1/completions", "/tokenize", "/detokenize"}) {
    const auto t0 = std::chrono::steady_clock::now();
    const std::string a = raw_exchange(s.port, fmt::format("POST {} HTTP/1.1\r\nHost: x\r\n\r\n", path));
    const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    EXPECT_EQ(status_of(a), 411) << path << "\n" << a.substr(0, 300);
    EXPECT_LT(took, 1.0) << path;
    const json b = body_of(a);
    ASSERT_TRUE(b.is_object() && b.contains("error")) << a;
    EXPECT_EQ(b["error"]["code"], 411);
    EXPECT_NE(b["error"]["message"].get<std::string>().find("needs a Content-Length"), std::string::npos) << b.dump();
  }
  // A chunked body is framed: it is read and answered as usual.
  const std::string body = R"({"prompt": "Once"})";
  const std::string a = raw_exchange(
      s.port, fmt::format("POST /tokenize HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n{:x}\r\n{}\r\n0\r\n\r\n",
                          body.size(), body));
  EXPECT_EQ(status_of(a), 200) << a.substr(0, 300);
}

TEST(ServeHttp, SlowClientsTimeOutAndDoNotStarveHealth) {
  ServeConfig cfg;
  cfg.read_timeout = std::chrono::milliseconds(1000);
  Running s(cfg);  // the default pool bounds (max_batch 16, max_queue 64)
  // 120 clients that announce a 100-byte body and send 10 bytes (more than a fixed pool of
  // max_batch + max_queue + 8 = 88 threads).
  const std::string half = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                           "Content-Length: 100\r\n\r\n{\"prompt\":";
  std::vector<std::unique_ptr<OpenConnection>> slow;
  for (int i = 0; i < 120; ++i) slow.push_back(std::make_unique<OpenConnection>(s.port, half, 5));
  // /health answers within 2 s throughout, on new connections.
  const auto t0 = std::chrono::steady_clock::now();
  int answered = 0;
  while (std::chrono::steady_clock::now() - t0 < std::chrono::milliseconds(1500)) {
    httplib::Client c("127.0.0.1", s.port);
    c.set_connection_timeout(2, 0);
    c.set_read_timeout(2, 0);
    const auto q0 = std::chrono::steady_clock::now();
    auto r = c.Get("/health");
    const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - q0).count();
    ASSERT_TRUE(r) << "/health: " << httplib::to_string(r.error()) << " after " << took << " s";
    EXPECT_EQ(r->status, 200);
    EXPECT_LT(took, 2.0);
    ++answered;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  EXPECT_GE(answered, 5);
  // Each slow client is answered 408 after the read timeout (1 s), naming what arrived.
  for (std::size_t i = 0; i < slow.size(); ++i) {
    const std::string a = slow[i]->answer();
    ASSERT_EQ(status_of(a), 408) << "client " << i << ": " << a.substr(0, 300);
    const json b = body_of(a);
    ASSERT_TRUE(b.is_object()) << a;
    EXPECT_NE(b["error"]["message"].get<std::string>().find("10 of 100 bytes arrived"), std::string::npos) << b.dump();
  }
  const double total = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_LT(total, 4.0);
  // And the server still serves completions.
  auto c = s.client(10);
  EXPECT_EQ(post(c, "/v1/completions", json{{"prompt", {1, 403}}, {"max_tokens", 2}, {"temperature", 0}}).status, 200);
}

TEST(ServeHttp, ABodyOverMaxRequestBytesIs413NamingTheLimit) {
  // The parser alone (a chunked body reaches it with no declared length).
  posenc::serve::RequestLimits limits;
  limits.vocab_size = 512;
  limits.max_model_len = 512;
  limits.max_request_bytes = 1024;
  const std::string long_body = R"({"prompt": ")" + std::string(2000, 'a') + R"("})";
  try {
    posenc::serve::parse_completion_request(long_body, limits);
    ADD_FAILURE() << "no RequestError";
  } catch (const posenc::serve::RequestError& e) {
    EXPECT_EQ(e.status(), 413);
    EXPECT_EQ(std::string(e.what()), "request body: 2014 bytes exceed the limit of 1024 bytes (max_request_bytes)");
  }
  // Over HTTP, declared (Content-Length) and chunked, on every POST endpoint.
  ServeConfig cfg;
  cfg.max_request_bytes = 4096;
  Running s(cfg);
  auto c = s.client(10);
  const std::string big = R"({"prompt": ")" + std::string(10 << 10, 'a') + R"("})";
  for (const char* path : {"/v1/completions", "/tokenize", "/detokenize"}) {
    auto r = post(c, path, big);
    EXPECT_EQ(r.status, 413) << path << ": " << r.raw.substr(0, 200);
    ASSERT_TRUE(r.body.is_object()) << r.raw.substr(0, 200);
    EXPECT_EQ(r.body["error"]["code"], 413);
    EXPECT_EQ(r.body["error"]["message"], "request body: 10254 bytes exceed the limit of 4096 bytes (max_request_bytes)");
    const std::string a = raw_exchange(
        s.port, fmt::format("POST {} HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n{:x}\r\n{}\r\n0\r\n\r\n",
                            path, big.size(), big));
    EXPECT_EQ(status_of(a), 413) << path << " chunked: " << a.substr(0, 300);
  }
  // A body at the limit is read and parsed.
  EXPECT_EQ(post(c, "/tokenize", R"({"prompt": ")" + std::string(4096 - 14, 'a') + R"("})").status, 200);
}

}  // namespace
