// posenc serve's HTTP edges on loopback: binding, methods, request framing and slow clients.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "serve_support.hpp"

namespace POSENC_UNITY_ID {  // this file's own namespace in the tests' unity build (CMakeLists.txt)

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

/// A raw loopback connection: sends requests, reads whole answers, tells whether the server closed it.
struct RawConnection {
  int fd = -1;
  std::string pending;  // bytes read past the last answer
  explicit RawConnection(int port) {
    fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(static_cast<uint16_t>(port));
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    EXPECT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  }
  ~RawConnection() { ::close(fd); }
  RawConnection(const RawConnection&) = delete;
  RawConnection& operator=(const RawConnection&) = delete;
  void send(const std::string& bytes) const { ::send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL); }
  void set_timeout(double seconds) const {
    timeval tv{static_cast<time_t>(seconds), static_cast<suseconds_t>((seconds - static_cast<time_t>(seconds)) * 1e6)};
    ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  }
  /// One answer (head + Content-Length body, or a chunked body as sent), "" when none came within `seconds`.
  std::string answer(double seconds = 3) {
    set_timeout(seconds);
    char buf[4096];
    for (;;) {
      const auto head_end = pending.find("\r\n\r\n");
      const auto cl = pending.find("Content-Length: ");
      std::size_t end = std::string::npos;
      if (head_end != std::string::npos && cl != std::string::npos && cl < head_end) {
        end = head_end + 4 + std::stoul(pending.substr(cl + 16));
      } else if (const auto te = pending.find("Transfer-Encoding: chunked"); head_end != std::string::npos &&
                                                                            te != std::string::npos && te < head_end) {
        const auto last = pending.find("\r\n0\r\n\r\n", head_end + 2);  // the last chunk and an empty trailer
        if (last != std::string::npos) end = last + 7;
      }
      if (end != std::string::npos && pending.size() >= end) {
        std::string a = pending.substr(0, end);
        pending.erase(0, end);
        return a;
      }
      const ssize_t n = ::recv(fd, buf, sizeof(buf), 0);
      if (n <= 0) return "";
      pending.append(buf, static_cast<std::size_t>(n));
    }
  }
  /// True when the server closes the connection (EOF or reset) within `seconds` and sends nothing more.
  bool closed_by_server(double seconds) {
    set_timeout(seconds);
    char buf[256];
    const ssize_t n = ::recv(fd, buf, sizeof(buf), 0);
    return pending.empty() && (n == 0 || (n < 0 && errno == ECONNRESET));
  }
};

// RFC 9112 6.3: a Content-Length that is not a number, or Content-Length fields that disagree, make the body's
// length unknown: 400, naming the value as sent, and the connection closed (it cannot carry another request).
// httplib took the first of two Content-Length fields (the rest of the body then read as the next request) and
// read -5 as 2^64 - 5 (a 413 quoting 18446744073709551611).
TEST(ServeHttp, AnInvalidOrConflictingContentLengthIs400AndClosesTheConnection) {
  Running s;
  struct Case {
    std::string headers;
    std::string body;
    int status;
    std::string message;
  };
  const std::vector<Case> cases = {
      {"Content-Length: 2\r\nContent-Length: 18\r\n", R"({"prompt": "Once"})", 400,
       "Content-Length: conflicting values '2' and '18'"},
      {"Content-Length: 18, 2\r\n", R"({"prompt": "Once"})", 400, "Content-Length: conflicting values '18' and '2'"},
      {"Content-Length: -5\r\n", "abcde", 400, "Content-Length: '-5' is not a valid length (decimal digits)"},
      {"Content-Length: +5\r\n", "abcde", 400, "Content-Length: '+5' is not a valid length (decimal digits)"},
      {"Content-Length: 5x\r\n", "abcde", 400, "Content-Length: '5x' is not a valid length (decimal digits)"},
      {"Content-Length: 18446744073709551621\r\n", "abcde", 400,
       "Content-Length: '18446744073709551621' is not a valid length (decimal digits)"},
      {"Content-Length: 18\r\nTransfer-Encoding: chunked\r\n", R"({"prompt": "Once"})", 400,
       "Content-Length and Transfer-Encoding: a request may not have both"},
      {"Transfer-Encoding: gzip, chunked\r\n", "0\r\n\r\n", 501,
       "Transfer-Encoding: 'gzip, chunked' is not supported (only chunked)"},
  };
  for (const auto& c : cases) {
    RawConnection conn(s.port);
    conn.send("POST /tokenize HTTP/1.1\r\nHost: x\r\n" + c.headers + "\r\n" + c.body);
    const std::string a = conn.answer();
    EXPECT_EQ(status_of(a), c.status) << c.headers << a.substr(0, 300);
    const json b = body_of(a);
    ASSERT_TRUE(b.is_object() && b.contains("error")) << c.headers << a.substr(0, 300);
    EXPECT_EQ(b["error"]["message"], c.message) << c.headers;
    EXPECT_EQ(b["error"]["code"], c.status) << c.headers;
    EXPECT_EQ(header_of(a, "Connection"), "close") << c.headers << a.substr(0, 300);
    EXPECT_TRUE(conn.closed_by_server(2)) << c.headers;
  }
  // Equal values (in two fields, or a list) are one valid length (RFC 9110 8.6); the connection stays usable.
  for (const std::string cl : {"Content-Length: 18\r\nContent-Length: 18\r\n", "Content-Length: 18, 018\r\n"}) {
    RawConnection conn(s.port);
    conn.send("POST /tokenize HTTP/1.1\r\nHost: x\r\n" + cl + "\r\n" + R"({"prompt": "Once"})");
    EXPECT_EQ(status_of(conn.answer()), 200) << cl;
    conn.send("GET /health HTTP/1.1\r\nHost: x\r\n\r\n");
    EXPECT_EQ(status_of(conn.answer()), 200) << cl;
  }
  auto c = s.client(5);
  EXPECT_EQ(get(c, "/health").status, 200);
}

// The server does not decode compressed request bodies: 415 with Accept-Encoding: identity (RFC 9110 15.5.16),
// at once, the body unread and the connection closed. httplib inflated gzip itself (with no bound on the inflated
// size), and a body that was not gzip came back as a 408 "incomplete body".
TEST(ServeHttp, ACompressedRequestBodyIs415) {
  Running s;
  for (const std::string enc : {"gzip", "br", "deflate", "x-unknown"}) {
    RawConnection conn(s.port);
    const auto t0 = std::chrono::steady_clock::now();
    conn.send("POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Encoding: " + enc +
              "\r\nContent-Length: 18\r\n\r\n{\"prompt\": \"Once\"}");
    const std::string a = conn.answer();
    EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 1.0) << enc;
    EXPECT_EQ(status_of(a), 415) << enc << ": " << a.substr(0, 300);
    EXPECT_EQ(header_of(a, "Accept-Encoding"), "identity") << enc;
    const json b = body_of(a);
    ASSERT_TRUE(b.is_object() && b.contains("error")) << a;
    EXPECT_EQ(b["error"]["message"],
              "Content-Encoding: '" + enc + "' is not supported: send the request body uncompressed");
    EXPECT_TRUE(conn.closed_by_server(2)) << enc;
  }
  RawConnection conn(s.port);
  conn.send("POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Encoding: identity\r\nContent-Length: 18\r\n\r\n"
            "{\"prompt\": \"Once\"}");
  EXPECT_EQ(status_of(conn.answer()), 200);
}

// A client that stops in the middle of its request line or headers gets 408 after the read timeout (httplib
// answered 400 to a stalled header, and nothing to a stalled request line), and the connection is closed.
TEST(ServeHttp, AStallInTheRequestHeadIs408) {
  ServeConfig cfg;
  cfg.read_timeout = std::chrono::milliseconds(300);
  Running s(cfg);
  struct Case {
    std::string sent;
    std::string message;
  };
  const std::vector<Case> cases = {
      {"POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Le",
       "POST /tokenize: request headers incomplete: nothing more arrived for the read timeout (300 ms)"},
      {"GET /health HTTP/1.1\r\nHost: x\r\n",
       "GET /health: request headers incomplete: nothing more arrived for the read timeout (300 ms)"},
      {"POST /toke", "request line incomplete: nothing more arrived for the read timeout (300 ms)"},
      {"POST /tokenize HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n12\r\n{\"pro",
       "POST /tokenize: request body incomplete: 5 bytes of chunked body arrived, then nothing for the read timeout "
       "(300 ms)"},
  };
  for (const auto& c : cases) {
    RawConnection conn(s.port);
    const auto t0 = std::chrono::steady_clock::now();
    conn.send(c.sent);
    const std::string a = conn.answer(3);
    const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    EXPECT_EQ(status_of(a), 408) << c.sent << "\n" << a.substr(0, 300);
    EXPECT_GE(took, 0.25) << c.sent;
    EXPECT_LT(took, 2.0) << c.sent;
    const json b = body_of(a);
    ASSERT_TRUE(b.is_object() && b.contains("error")) << c.sent << "\n" << a;
    EXPECT_EQ(b["error"]["message"], c.message) << c.sent;
    EXPECT_EQ(header_of(a, "Connection"), "close") << c.sent;
    EXPECT_TRUE(conn.closed_by_server(2)) << c.sent;
  }
  // A connection that sent nothing is closed after the keep-alive timeout, unanswered.
  auto c = s.client(5);
  EXPECT_EQ(get(c, "/health").status, 200);
}

// With every connection thread (http_threads) held by an idle keep-alive connection, a new client is served at
// once: the connection idle the longest is closed for it (httplib's pool kept each idle connection's thread for
// its whole keep-alive timeout, so /health waited seconds). Idle connections close after keep_alive_timeout and
// their threads end.
TEST(ServeHttp, IdleKeepAliveConnectionsMakeRoomAndTimeOut) {
  ServeConfig cfg;
  cfg.http_threads = 8;
  cfg.keep_alive_timeout = std::chrono::milliseconds(30000);
  Running s(cfg);
  std::vector<std::unique_ptr<RawConnection>> idle;
  for (int i = 0; i < 8; ++i) {
    idle.push_back(std::make_unique<RawConnection>(s.port));
    idle.back()->send("GET /health HTTP/1.1\r\nHost: x\r\n\r\n");
    ASSERT_EQ(status_of(idle.back()->answer()), 200) << i;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));  // idle since: in this order
  }
  EXPECT_EQ(s.server->stats().http_connections, 8);
  EXPECT_EQ(s.server->stats().http_threads, 8);
  std::vector<std::unique_ptr<RawConnection>> fresh;  // kept open: each new one needs a thread again
  for (int round = 0; round < 3; ++round) {
    const auto t0 = std::chrono::steady_clock::now();
    fresh.push_back(std::make_unique<RawConnection>(s.port));
    fresh.back()->send("GET /health HTTP/1.1\r\nHost: x\r\n\r\n");
    const std::string a = fresh.back()->answer(10);
    const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    EXPECT_EQ(status_of(a), 200) << round;
    EXPECT_LT(took, 1.0) << round;
    // The oldest idle connection made room; the others are still open and usable.
    EXPECT_TRUE(idle[static_cast<std::size_t>(round)]->closed_by_server(2)) << round;
  }
  idle.back()->send("GET /health HTTP/1.1\r\nHost: x\r\n\r\n");
  EXPECT_EQ(status_of(idle.back()->answer()), 200);
  EXPECT_EQ(s.server->stats().http_threads, 8);
  EXPECT_EQ(s.server->stats().http_connections, 8);
  idle.clear();
  fresh.clear();

  // Idle connections close after keep_alive_timeout; the threads end after it too.
  ServeConfig quick;
  quick.http_threads = 8;
  quick.keep_alive_timeout = std::chrono::milliseconds(300);
  Running q(quick);
  std::vector<std::unique_ptr<RawConnection>> open;
  for (int i = 0; i < 4; ++i) {
    open.push_back(std::make_unique<RawConnection>(q.port));
    open.back()->send("GET /health HTTP/1.1\r\nHost: x\r\n\r\n");
    ASSERT_EQ(status_of(open.back()->answer()), 200) << i;
  }
  EXPECT_EQ(q.server->stats().http_threads, 4);
  const auto t0 = std::chrono::steady_clock::now();
  for (auto& c : open) EXPECT_TRUE(c->closed_by_server(3));
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 1.5);
  EXPECT_TRUE(eventually([&] { return q.server->stats().http_connections == 0; }, 3));
  EXPECT_TRUE(eventually([&] { return q.server->stats().http_threads == 0; }, 3));
  auto c = q.client(5);
  EXPECT_EQ(get(c, "/health").status, 200);
}

/// A completion of `max_tokens` greedy tokens as raw HTTP/1.1 (keep-alive).
std::string completion_request(int max_tokens) {
  const std::string body = fmt::format(R"({{"prompt": "Once upon a time", "max_tokens": {}, "temperature": 0}})",
                                       max_tokens);
  return fmt::format("POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     "Content-Length: {}\r\n\r\n{}",
                     body.size(), body);
}

/// One connection thread and connections kept alive 30 s (longer than any wait these tests allow), each decode step
/// `step_delay` long (a completion of n tokens takes about n steps).
ServeConfig one_thread(std::chrono::milliseconds step_delay = std::chrono::milliseconds(0)) {
  ServeConfig cfg;
  cfg.http_threads = 1;
  cfg.keep_alive_timeout = std::chrono::milliseconds(30000);
  cfg.step_delay = step_delay;
  return cfg;
}

/// On a one_thread() server whose thread a new connection holds (connected, no request sent yet): a second
/// connection that sends /health and is left waiting for the thread.
std::unique_ptr<RawConnection> waiting_behind_a_fresh_connection(const Running& s) {
  EXPECT_TRUE(eventually([&] { return s.server->stats().http_connections == 1; }));  // it holds the thread
  auto waiting = std::make_unique<RawConnection>(s.port);
  waiting->send("GET /health HTTP/1.1\r\nHost: x\r\n\r\n");
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  return waiting;
}

// With the only connection thread busy answering a slow request, a new connection waits for it; once the answer
// is written, the keep-alive connection closes rather than hold the thread for its keep-alive timeout (30 s here),
// and the waiting connection is served.
TEST(ServeHttp, AKeepAliveConnectionMakesRoomForAConnectionWaitingForAThread) {
  Running s(one_thread(std::chrono::milliseconds(20)));
  RawConnection busy(s.port);
  busy.send(completion_request(40));  // ~0.8 s of steps
  ASSERT_TRUE(eventually([&] { return s.server->stats().running_sequences == 1; }));
  RawConnection waiting(s.port);
  waiting.send("GET /health HTTP/1.1\r\nHost: x\r\n\r\n");
  EXPECT_TRUE(eventually([&] { return s.server->stats().http_connections == 1; }));  // the other one is queued
  EXPECT_EQ(status_of(busy.answer(10)), 200);
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_EQ(status_of(waiting.answer(10)), 200);
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 2.0);
  EXPECT_TRUE(busy.closed_by_server(2));
  // With nobody waiting, a keep-alive connection stays open between requests.
  waiting.send("GET /health HTTP/1.1\r\nHost: x\r\n\r\n");
  EXPECT_EQ(status_of(waiting.answer(3)), 200);
  waiting.send("GET /health HTTP/1.1\r\nHost: x\r\n\r\n");
  EXPECT_EQ(status_of(waiting.answer(3)), 200);
}

// Requests sent in full to connections that wait for a thread when the server stops are answered (503, the server
// draining: the client knows what happened), not closed unanswered.
TEST(ServeHttp, RequestsQueuedWhenTheServerStopsAreAnswered) {
  Running s(one_thread(std::chrono::milliseconds(20)));
  RawConnection busy(s.port);
  busy.send(completion_request(30));
  ASSERT_TRUE(eventually([&] { return s.server->stats().running_sequences == 1; }));
  std::vector<std::unique_ptr<RawConnection>> queued;
  for (int i = 0; i < 5; ++i) {
    queued.push_back(std::make_unique<RawConnection>(s.port));
    queued.back()->send("GET /health HTTP/1.1\r\nHost: x\r\n\r\n");
  }
  // Three pipelined requests on one connection: no request is read after an answer that says Connection: close
  // (RFC 9112 9.6).
  RawConnection pipelined(s.port);
  pipelined.send("GET /health HTTP/1.1\r\nHost: x\r\n\r\nGET /health HTTP/1.1\r\nHost: x\r\n\r\n"
                 "GET /health HTTP/1.1\r\nHost: x\r\n\r\n");
  // Half a request (its head never ends): answered 408 soon after the stop, not after the 5 s read timeout, and it
  // does not hold the stop.
  RawConnection stalled(s.port);
  stalled.send("GET /health HTTP/1.1\r\nHost: x\r\n");
  std::this_thread::sleep_for(std::chrono::milliseconds(100));  // the requests have arrived
  const auto t0 = std::chrono::steady_clock::now();
  std::thread stopper([&] { s.server->stop(); });
  EXPECT_EQ(status_of(busy.answer(10)), 200);  // the running request finishes (draining)
  for (std::size_t i = 0; i < queued.size(); ++i) {
    const std::string a = queued[i]->answer(10);
    EXPECT_EQ(status_of(a), 503) << i << ": " << a;
    EXPECT_NE(a.find("draining"), std::string::npos) << i << ": " << a;
  }
  int answers = 0;
  for (;;) {
    const std::string a = pipelined.answer(5);
    if (a.empty()) break;
    ++answers;
    EXPECT_EQ(status_of(a), 503) << a;
    if (header_of(a, "Connection") == "close") {
      EXPECT_TRUE(pipelined.closed_by_server(3)) << "an answer after Connection: close";
      break;
    }
  }
  EXPECT_GE(answers, 1);
  const std::string st = stalled.answer(5);
  EXPECT_TRUE(st.empty() || status_of(st) == 408) << st;
  stopper.join();
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 4.0);
  for (std::size_t i = 0; i < queued.size(); ++i) EXPECT_TRUE(queued[i]->closed_by_server(2)) << i;
}

// A connection that has not sent its first request yet is not closed to make room for another (its request may be
// on the way: closing it lost requests sent on fresh connections); a keep-alive connection between requests is.
TEST(ServeHttp, AFreshConnectionIsNotClosedToMakeRoom) {
  Running s(one_thread());
  RawConnection fresh(s.port);
  const auto next = waiting_behind_a_fresh_connection(s);
  fresh.send("GET /health HTTP/1.1\r\nHost: x\r\n\r\n");
  const std::string a = fresh.answer(5);
  EXPECT_EQ(status_of(a), 200) << a;
  EXPECT_EQ(header_of(a, "Connection"), "close") << a;  // the other connection waits: this one makes room
  EXPECT_TRUE(fresh.closed_by_server(2));
  EXPECT_EQ(status_of(next->answer(5)), 200);
}

// A request that says Connection: close while a connection waits for a thread: its answer says close once (the
// room it makes is its close, not a claim on top of it), and the waiting connection is served.
TEST(ServeHttp, AClosingRequestIsAnsweredWithOneConnectionHeaderWhileAnotherWaits) {
  Running s(one_thread());
  RawConnection fresh(s.port);
  const auto next = waiting_behind_a_fresh_connection(s);
  fresh.send("GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
  const std::string a = fresh.answer(5);
  EXPECT_EQ(status_of(a), 200) << a;
  std::size_t headers = 0;
  for (std::size_t at = a.find("\r\nConnection:"); at != std::string::npos; at = a.find("\r\nConnection:", at + 1))
    ++headers;
  EXPECT_EQ(headers, 1u) << a;
  EXPECT_EQ(a.find("Keep-Alive"), std::string::npos) << a;
  EXPECT_EQ(status_of(next->answer(5)), 200);
}

// A new connection that stays silent gives its thread, after a second, to a connection waiting for one (rather
// than hold it for the keep-alive timeout, 30 s here).
TEST(ServeHttp, ASilentNewConnectionGivesItsThreadToAWaitingOne) {
  Running s(one_thread());
  RawConnection silent(s.port);
  ASSERT_TRUE(eventually([&] { return s.server->stats().http_connections == 1; }));  // it holds the thread
  const auto t0 = std::chrono::steady_clock::now();
  RawConnection waiting(s.port);
  waiting.send("GET /health HTTP/1.1\r\nHost: x\r\n\r\n");
  EXPECT_EQ(status_of(waiting.answer(10)), 200);
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 3.0);
  EXPECT_TRUE(silent.closed_by_server(2));
}

// A connection whose next request has already arrived when it finds a connection waiting for a thread answers
// that request as its last (Connection: close) and then makes room: the wait is not lost to that request (it was,
// and the waiting connection waited out the keep-alive timeout).
TEST(ServeHttp, AConnectionWithItsNextRequestWaitingMakesRoomAfterAnsweringIt) {
  Running s(one_thread(std::chrono::milliseconds(20)));
  RawConnection a(s.port);
  a.send(completion_request(20));
  ASSERT_TRUE(eventually([&] { return s.server->stats().running_sequences == 1; }));
  // Past 50 ms the first answer's head (a chunked body) is out, saying keep-alive: b's wait is met after it.
  std::this_thread::sleep_for(std::chrono::milliseconds(150));
  RawConnection b(s.port);
  b.send("GET /health HTTP/1.1\r\nHost: x\r\n\r\n");
  a.send(completion_request(20));  // in the socket, not yet read, when the first answer ends
  const std::string first = a.answer(10);
  EXPECT_EQ(status_of(first), 200) << first;
  EXPECT_EQ(header_of(first, "Connection"), "(none)") << first;
  const std::string second = a.answer(10);
  EXPECT_EQ(status_of(second), 200) << second;
  EXPECT_EQ(header_of(second, "Connection"), "close") << second;
  EXPECT_TRUE(a.closed_by_server(2));
  EXPECT_EQ(status_of(b.answer(5)), 200);
}

}  // namespace

}  // namespace POSENC_UNITY_ID
