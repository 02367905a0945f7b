// posenc serve: the HTTP side (cpp-httplib) and the response formats.
#include <httplib.h>

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <cerrno>
#include <cstring>
#include <strings.h>
#include <atomic>
#include <condition_variable>
#include <mutex>
#include <ctime>
#include <deque>
#include <list>
#include <poll.h>
#include <random>
#include <thread>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "posenc/serve.hpp"
#include "serve/connection_threads.hpp"
#include "serve/metrics.hpp"
#include "serve/scheduler.hpp"

namespace posenc::serve {

using nlohmann::json;
using detail::Job;
using detail::TokenLogprob;

namespace {

// A /tokenize or /detokenize body: at most `max_bytes` (413 past it, naming the limit) and a JSON object (400).
json object_body(const std::string& body, std::size_t max_bytes) {
  if (body.size() > max_bytes)
    throw RequestError(413, "invalid_request_error", "",
                       fmt::format("request body: {} bytes exceed the limit of {} bytes (max_request_bytes)",
                                   body.size(), max_bytes));
  json j = json::parse(body, nullptr, false);
  if (!j.is_object()) throw RequestError(400, "invalid_request_error", "", "request body: must be a JSON object");
  return j;
}

std::string dump(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

json error_body(int status, const std::string& type, const std::string& param, const std::string& message) {
  return {{"error",
           {{"message", message}, {"type", type}, {"param", param.empty() ? json(nullptr) : json(param)},
            {"code", status}}}};
}

std::string default_model_name(const Model& model) {
  std::filesystem::path p = model.source().path;
  if (p.filename().empty()) p = p.parent_path();
  const std::string name = p.filename().string();
  return name.empty() ? std::string("posenc") : name;
}

/// The endpoints and the methods each answers (the Allow header of a 405).
struct Route {
  const char* path;
  const char* allow;
};
constexpr Route kRoutes[] = {{"/health", "GET, HEAD"},       {"/version", "GET, HEAD"}, {"/v1/models", "GET, HEAD"},
                             {"/v1/completions", "POST"},    {"/tokenize", "POST"},     {"/detokenize", "POST"},
                             {"/metrics", "GET, HEAD"}};

/// The route of a known path, nullptr for an unknown one.
const Route* find_route(const std::string& path) {
  for (const Route& r : kRoutes)
    if (path == r.path) return &r;
  return nullptr;
}

/// True when `route` answers `method`.
bool allows(const Route& route, const std::string& method) {
  return std::string_view(route.allow) == "POST" ? method == "POST" : method == "GET" || method == "HEAD";
}

/// True when a request declares a body (Content-Length or chunked Transfer-Encoding). Without either a request
/// has no body (RFC 9112 6.3); cpp-httplib 0.11.4 would read one until the connection closes or times out.
bool has_body_framing(const httplib::Request& req) {
  return req.has_header("Content-Length") || strcasecmp(req.get_header_value("Transfer-Encoding").c_str(), "chunked") == 0;
}

/// Trims optional whitespace (spaces, tabs) at both ends.
std::string_view trim_ows(std::string_view v) {
  while (!v.empty() && (v.front() == ' ' || v.front() == '\t')) v.remove_prefix(1);
  while (!v.empty() && (v.back() == ' ' || v.back() == '\t')) v.remove_suffix(1);
  return v;
}

/// Why a request's body framing cannot be trusted (RFC 9112 6), or nullopt: a Content-Length that is not
/// 1*DIGIT, Content-Length fields (or list members) of different values, Content-Length together with
/// Transfer-Encoding (400: the length of the body is unknown, so the connection cannot carry another request);
/// a transfer coding other than chunked (501, RFC 9112 6.1); a Content-Encoding other than identity (415: bodies
/// are not decoded; Debian's cpp-httplib would inflate gzip, deflate and br, with no bound on the inflated size
/// before the handlers' max_request_bytes check). Values are quoted as sent.
std::optional<RequestError> framing_error(const httplib::Request& req) {
  auto refuse = [](int status, const std::string& msg) {
    return RequestError(status, "invalid_request_error", "", msg);
  };
  const std::size_t n_cl = req.get_header_value_count("Content-Length");
  std::optional<uint64_t> length;  // the first value's
  std::string first_item;
  for (std::size_t i = 0; i < n_cl; ++i) {
    const std::string value = req.get_header_value("Content-Length", i);
    std::string_view rest = value;
    do {  // a list "5, 5" (RFC 9110 8.6: a recipient may take it as one valid length when the members agree)
      const auto comma = rest.find(',');
      const std::string_view item = trim_ows(rest.substr(0, comma));
      rest = comma == std::string_view::npos ? std::string_view() : rest.substr(comma + 1);
      uint64_t n = 0;
      // (at most 19 digits: any such number fits in uint64_t)
      if (item.empty() || item.size() > 19 || item.find_first_not_of("0123456789") != std::string_view::npos)
        return refuse(400, fmt::format("Content-Length: '{}' is not a valid length (decimal digits)", value));
      std::from_chars(item.data(), item.data() + item.size(), n);
      if (!length) {
        length = n;
        first_item = item;
      } else if (n != *length) {
        return refuse(400, fmt::format("Content-Length: conflicting values '{}' and '{}'", first_item, item));
      }
    } while (!rest.empty());
  }
  const std::size_t n_te = req.get_header_value_count("Transfer-Encoding");
  if (n_te > 0) {
    const std::string te = req.get_header_value("Transfer-Encoding");
    if (n_te > 1 || strcasecmp(std::string(trim_ows(te)).c_str(), "chunked") != 0)
      return refuse(501, fmt::format("Transfer-Encoding: '{}' is not supported (only chunked)", te));
    if (n_cl > 0) return refuse(400, "Content-Length and Transfer-Encoding: a request may not have both");
  }
  for (std::size_t i = 0, n = req.get_header_value_count("Content-Encoding"); i < n; ++i) {
    const std::string ce = req.get_header_value("Content-Encoding", i);
    if (strcasecmp(std::string(trim_ows(ce)).c_str(), "identity") != 0)
      return refuse(415, fmt::format("Content-Encoding: '{}' is not supported: send the request body uncompressed",
                                     ce));
  }
  return std::nullopt;
}

/// The endpoint label of a request's metrics: a known path, else "other" (unknown paths must not grow the series).
std::string endpoint_label(const std::string& path) {
  const Route* r = find_route(path);
  return r != nullptr ? r->path : "other";
}

std::string random_hex() {
  static std::atomic<uint64_t> counter{0};
  static const uint64_t base = std::random_device{}() * 0x9e3779b97f4a7c15ULL ^ static_cast<uint64_t>(std::time(nullptr));
  return fmt::format("{:016x}", ::posenc::detail::splitmix64(base + counter++));
}

/// What the connection layer knows of the request its thread is handling (thread-local `current_connection`,
/// read by the pre-routing and error handlers, which httplib calls on the connection's thread).
struct ConnectionState {
  bool timed_out = false;    ///< a read of this request waited read_timeout without a byte
  bool close_after = false;  ///< the request's framing was refused: its body was not read, close after answering
  bool answered = false;     ///< bytes of an answer were written
  bool head_read = false;    ///< the request's head was read (the pre-routing handler ran)
  std::size_t bytes_in = 0;  ///< bytes of this request read so far
};
thread_local ConnectionState* current_connection = nullptr;

/// Marks the request being answered as the last of its connection (its body was not read, so the connection
/// cannot carry another request): httplib 0.11.4 ignores a "Connection: close" set on the response (it keeps the
/// connection and adds Keep-Alive), but writes "Connection: close" when the request has it. The Request is
/// httplib's non-const local of process_request, handed to the handlers as const.
void close_after_answer(const httplib::Request& req) {
  if (current_connection != nullptr) current_connection->close_after = true;
  if (req.get_header_value("Connection") != "close")
    const_cast<httplib::Request&>(req).headers.emplace("Connection", "close");
}

/// One connection's socket as httplib reads and writes it (httplib's own SocketStream is not in the Debian
/// header): reads buffered (httplib reads a request's head a byte at a time), every wait bounded by the read or
/// write timeout, and a read that times out is recorded in the ConnectionState so that the answer can be 408.
class ConnectionStream : public httplib::Stream {
 public:
  /// read_wait_ms(started): how much longer a read that began at `started` may wait for bytes (the read timeout,
  /// less once the server stops); a wait asks again every 200 ms.
  ConnectionStream(int fd, std::function<int(std::chrono::steady_clock::time_point)> read_wait_ms,
                   int write_timeout_ms, ConnectionState& state)
      : fd_(fd), read_wait_ms_(std::move(read_wait_ms)), write_ms_(write_timeout_ms), state_(state) {}
  bool is_readable() const override {
    if (buffered()) return true;
    const auto started = std::chrono::steady_clock::now();
    for (int left = read_wait_ms_(started);; left = read_wait_ms_(started)) {
      if (wait_for(POLLIN, std::clamp(left, 0, 200))) return true;
      if (left <= 200) break;
    }
    state_.timed_out = true;
    return false;
  }
  bool is_writable() const override { return wait_for(POLLOUT, write_ms_) && peer_open(); }
  ssize_t read(char* ptr, size_t size) override {
    if (!buffered()) {
      if (!is_readable()) return -1;
      const ssize_t n = ::recv(fd_, buf_, sizeof(buf_), 0);
      if (n <= 0) return n;
      off_ = 0;
      len_ = static_cast<std::size_t>(n);
      state_.bytes_in += len_;
    }
    const std::size_t k = std::min(size, len_ - off_);
    std::memcpy(ptr, buf_ + off_, k);
    off_ += k;
    return static_cast<ssize_t>(k);
  }
  ssize_t write(const char* ptr, size_t size) override {
    if (!is_writable()) return -1;
    state_.answered = true;
    return ::send(fd_, ptr, size, MSG_NOSIGNAL);
  }
  void get_remote_ip_and_port(std::string& ip, int& port) const override { address(true, ip, port); }
  void get_local_ip_and_port(std::string& ip, int& port) const override { address(false, ip, port); }
  socket_t socket() const override { return fd_; }
  /// Bytes of a next (pipelined) request already read.
  bool buffered() const { return off_ < len_; }

 private:
  bool wait_for(short events, int ms) const {
    pollfd p{fd_, events, 0};
    int rc;
    while ((rc = ::poll(&p, 1, ms)) < 0 && errno == EINTR) {
    }
    return rc > 0;
  }
  /// False once the peer has closed its side (a write of a long answer's keep-alive space would otherwise succeed
  /// once more): a readable socket whose peek reads 0 bytes.
  bool peer_open() const {
    pollfd p{fd_, POLLIN, 0};
    if (::poll(&p, 1, 0) <= 0) return true;
    char c;
    return ::recv(fd_, &c, 1, MSG_PEEK | MSG_DONTWAIT) != 0;
  }
  void address(bool remote, std::string& ip, int& port) const {
    sockaddr_storage a{};
    socklen_t len = sizeof(a);
    if ((remote ? ::getpeername(fd_, reinterpret_cast<sockaddr*>(&a), &len)
                : ::getsockname(fd_, reinterpret_cast<sockaddr*>(&a), &len)) != 0)
      return;
    char host[NI_MAXHOST];
    char serv[NI_MAXSERV];
    if (::getnameinfo(reinterpret_cast<sockaddr*>(&a), len, host, sizeof(host), serv, sizeof(serv),
                      NI_NUMERICHOST | NI_NUMERICSERV) == 0) {
      ip = host;
      port = std::atoi(serv);
    }
  }
  int fd_;
  std::function<int(std::chrono::steady_clock::time_point)> read_wait_ms_;
  int write_ms_;
  ConnectionState& state_;
  char buf_[4096];
  std::size_t off_ = 0;
  std::size_t len_ = 0;
};

/// httplib::Server with its own connection loop (process_and_close_socket): httplib 0.11.4's loop polls each idle
/// keep-alive connection every 10 ms for up to its keep-alive timeout while it holds a thread, so with every
/// connection thread held by idle connections a new client waited seconds for one. Here a connection with no
/// request in progress (before its first request, between keep-alive requests) waits in poll() for at most
/// keep_alive_timeout, and while it waits it may be closed at once to make room for a new connection
/// (close_idle_connection, called by ConnectionThreads when every thread is taken); when none waits so, the next
/// connection to answer a request, or one silent for a second since it opened, closes instead (claim_room). A
/// request that has arrived is answered even when the server is stopping (503 while draining: the client is told,
/// not cut off). A request that stalls (head or body) is answered 408 by the error handler; one whose framing was
/// refused closes the connection.
class HttpServer : public httplib::Server {
 public:
  /// cpp-httplib 0.11.4 listens with a backlog of 5 (CPPHTTPLIB_LISTEN_BACKLOG, compiled into Debian's shared
  /// library), and 64 clients connecting at once overflow it (connections reset, "Read" errors on the client).
  /// listen() again on a listening socket sets a new backlog.
  void set_backlog(int backlog) {
    const auto fd = svr_sock_.load();
    if (fd != INVALID_SOCKET && ::listen(fd, backlog) != 0)
      throw IoError(fmt::format("posenc serve: listen(backlog {}) failed: {}", backlog, std::strerror(errno)));
  }
  void set_connection_timeouts(std::chrono::milliseconds read, std::chrono::milliseconds keep_alive,
                               std::chrono::milliseconds write) {
    read_ms_ = static_cast<int>(read.count());
    keep_alive_ms_ = static_cast<int>(keep_alive.count());
    write_ms_ = static_cast<int>(write.count());
    // (the Keep-Alive header of an answer: whole seconds, at least 1)
    set_keep_alive_timeout(std::max<time_t>(1, static_cast<time_t>(keep_alive.count() / 1000)));
  }
  /// Called with the answer body when a request line stalled (httplib writes nothing then): 408 is written.
  std::function<std::string()> request_line_timeout_body;
  /// Whether a connection waits for a connection thread (ConnectionThreads::jobs_waiting); set by new_task_queue
  /// before the first connection is accepted.
  std::function<bool()> connections_waiting;

  /// Closes the connection that has waited longest for its next request after answering one (a keep-alive wait);
  /// when none is waiting, the next connection to answer a request closes after it instead (claim_room). Called by
  /// ConnectionThreads for each connection that waits for a thread.
  bool close_idle_connection() {
    std::lock_guard lk(conns_mu_);
    Connection* oldest = nullptr;
    // Only a keep-alive wait: a connection waiting for its first request may have it on the way (closing it lost
    // requests sent on fresh connections).
    for (Connection* c : conns_)
      if (c->idle && c->served && !c->closing && (oldest == nullptr || c->idle_since < oldest->idle_since))
        oldest = c;
    if (oldest == nullptr) {
      ++room_wanted_;
      return false;
    }
    oldest->closing = true;
    ::shutdown(oldest->fd, SHUT_RDWR);  // wakes its poll; its thread closes the socket
    return true;
  }
  /// Whether the connection answering a request is to close after it (and say so) to make room for a connection
  /// waiting for a thread that close_idle_connection could not free one for: each such wait is claimed once
  /// (closing every connection that saw it left threads idle and kept-alive connections closed). Called as each
  /// answer is about to be written (the post-routing handler) and as a kept-alive connection begins to wait.
  bool claim_room() {
    const bool waiting = connections_waiting && connections_waiting();  // (not under conns_mu_: lock order)
    std::lock_guard lk(conns_mu_);
    if (!waiting) room_wanted_ = 0;  // the waits were met otherwise (a connection ended)
    if (room_wanted_ == 0) return false;
    --room_wanted_;
    return true;
  }
  std::size_t open_connections() const {
    std::lock_guard lk(conns_mu_);
    return conns_.size();
  }

 private:
  struct Connection {
    int fd;
    bool idle = false;
    bool closing = false;
    bool served = false;  // a request has been answered (idle is then a keep-alive wait, not a first request's)
    std::chrono::steady_clock::time_point idle_since;
  };

  /// How much longer a read that began at `started` may wait: what is left of the read timeout, and once the server
  /// is stopping at most what is left of a second from when a connection first saw it stop, so that requests
  /// already sent are answered and one that stalls or trickles (408) does not hold the stop.
  int read_wait_ms(std::chrono::steady_clock::time_point started) {
    const auto now = std::chrono::steady_clock::now();
    const int64_t left =
        read_ms_ - std::chrono::duration_cast<std::chrono::milliseconds>(now - started).count();
    if (svr_sock_ != INVALID_SOCKET) return static_cast<int>(std::max<int64_t>(left, 0));
    const int64_t now_ms = std::chrono::duration_cast<std::chrono::milliseconds>(now.time_since_epoch()).count();
    int64_t deadline = stop_deadline_ms_.load();
    if (deadline == 0) {  // the first to see it: now + 1 s, unless another connection has just set it
      const int64_t mine = now_ms + 1000;
      deadline = stop_deadline_ms_.compare_exchange_strong(deadline, mine) ? mine : deadline;
    }
    return static_cast<int>(std::clamp<int64_t>(std::min(deadline - now_ms, left), 0, read_ms_));
  }

  /// Waits (idle) for the next request's first bytes, at most keep_alive_ms_; false when the connection is to be
  /// closed (timed out, closed by the peer or by close_idle_connection). Bytes that have already arrived are a
  /// request to answer even when the server is stopping, and a new connection's first request (none served yet) is
  /// waited for then as long as read_wait_ms allows; otherwise stopping ends the wait, and so does, after the
  /// connection's first request, a connection waiting for a thread (claim_room): this one closes to make room, or,
  /// when its next request has already arrived, answers it as its last (`last` set).
  bool next_request(Connection& c, const ConnectionStream& strm, bool& last) {
    last = false;
    const bool first = !c.served;  // (written by this thread only)
    if (strm.buffered()) {
      last = !first && claim_room();
      return true;
    }
    {
      std::lock_guard lk(conns_mu_);
      c.idle = true;
      c.idle_since = std::chrono::steady_clock::now();
    }
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(keep_alive_ms_);
    // Once, as the wait begins (after c.idle is set: a connection queued from here on finds this one idle, and
    // close_idle_connection closes the one idle the longest).
    const bool make_room = !first && claim_room();
    bool ready = false;
    for (;;) {
      const bool stopping = svr_sock_ == INVALID_SOCKET;
      const auto left =
          std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now()).count();
      // 200 ms at most: notice stop() and waiting connections
      const int64_t wait = stopping ? (first ? read_wait_ms(std::chrono::steady_clock::now()) : 0) : make_room ? 0 : left;
      pollfd p{c.fd, POLLIN, 0};
      const int rc = ::poll(&p, 1, static_cast<int>(std::clamp<int64_t>(wait, 0, 200)));
      if (rc > 0) {
        ready = true;
        break;
      }
      if (rc < 0 && errno != EINTR) break;
      if (stopping ? !first || read_wait_ms(std::chrono::steady_clock::now()) == 0 : make_room || left <= 0) break;
      // A new connection silent for kSilentFirstMs gives its thread to one waiting for it (claim_room); sooner, its
      // first request may be on the way (closing such connections lost requests).
      if (first && !stopping && keep_alive_ms_ - left >= kSilentFirstMs && claim_room()) break;
    }
    std::lock_guard lk(conns_mu_);
    c.idle = false;
    last = make_room;
    return ready && !c.closing;
  }

  bool process_and_close_socket(socket_t sock) override {
    Connection c{sock, false, false, false, {}};
    {
      std::lock_guard lk(conns_mu_);
      conns_.push_back(&c);
    }
    int yes = 1;
    ::setsockopt(sock, IPPROTO_TCP, TCP_NODELAY, &yes, sizeof(yes));
    ConnectionState state;
    current_connection = &state;
    ConnectionStream strm(sock, [this](std::chrono::steady_clock::time_point t) { return read_wait_ms(t); }, write_ms_,
                          state);
    bool ok = false;
    bool linger = false;  // a refused request's body may still be arriving
    // On the accepting thread (no connection thread could be had: ConnectionThreads), one request, then close, so
    // that the next connection is accepted.
    const std::size_t max_requests = posenc::detail::ConnectionThreads::serving_inline() ? 1 : keep_alive_max_count_;
    bool last = false;  // next_request: this connection makes room for a waiting one after this request
    for (std::size_t left = max_requests; left > 0 && next_request(c, strm, last); --left) {
      state = ConnectionState{};
      state.bytes_in = strm.buffered() ? 1 : 0;  // (a pipelined request's first bytes were read with the last)
      bool closed = false;
      // The last request, the server stopping or a connection waiting for a thread (which this one then makes
      // room for; or claimed as the answer is written, the post-routing handler): answered with Connection: close,
      // and no further request is read.
      const bool close_after = left == 1 || svr_sock_ == INVALID_SOCKET || last;
      ok = process_request(strm, close_after, closed, nullptr);
      {
        std::lock_guard lk(conns_mu_);
        c.served = true;
      }
      if (!ok && state.timed_out && state.bytes_in > 0 && !state.answered && request_line_timeout_body) {
        const std::string body = request_line_timeout_body();
        const std::string head = fmt::format(
            "HTTP/1.1 408 Request Timeout\r\nConnection: close\r\nContent-Type: application/json\r\n"
            "Content-Length: {}\r\n\r\n",
            body.size());
        strm.write(head.data(), head.size());
        strm.write(body.data(), body.size());
      }
      linger = state.close_after || state.timed_out;
      if (!ok || closed || close_after || state.close_after || state.timed_out) break;
    }
    current_connection = nullptr;
    {
      std::lock_guard lk(conns_mu_);
      conns_.erase(std::find(conns_.begin(), conns_.end(), &c));
    }
    // Closing with unread bytes would reset the connection (RST), and the client could lose the answer: stop
    // writing, then read what still comes for a moment.
    ::shutdown(sock, linger ? SHUT_WR : SHUT_RDWR);
    if (linger) {
      char buf[4096];
      const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(1);
      pollfd p{sock, POLLIN, 0};
      while (std::chrono::steady_clock::now() < until && ::poll(&p, 1, 100) > 0 &&
             ::recv(sock, buf, sizeof(buf), MSG_DONTWAIT) > 0) {
      }
    }
    ::close(sock);
    return ok;
  }

  static constexpr int64_t kSilentFirstMs = 1000;
  int read_ms_ = 5000;
  std::atomic<int64_t> stop_deadline_ms_{0};  // read_wait_ms: steady_clock ms, 0 until the server is seen stopping
  int keep_alive_ms_ = 5000;
  int write_ms_ = 30000;
  mutable std::mutex conns_mu_;
  std::vector<Connection*> conns_;
  int64_t room_wanted_ = 0;  // connections waiting for a thread that no idle connection was closed for (conns_mu_)
};

/// Listening-socket options: SO_REUSEADDR only (a restarted server can bind while old connections are in
/// TIME_WAIT). cpp-httplib 0.11.4's default_socket_options sets SO_REUSEPORT instead, which lets a second server
/// bind the same port and the kernel spread connections between the two: a port in use must fail to bind.
void listening_socket_options(socket_t sock) {
  int yes = 1;
  ::setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
}

/// Why host:port cannot be bound (cpp-httplib only says that it failed): binds a probe socket with the same
/// options and describes its errno ("address in use", "not an address of this host", ...).
std::string bind_failure(const std::string& host, int port) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  addrinfo* found = nullptr;
  const std::string service = std::to_string(port);
  if (const int rc = ::getaddrinfo(host.c_str(), service.c_str(), &hints, &found); rc != 0)
    return fmt::format("cannot resolve the host ({})", ::gai_strerror(rc));
  int err = 0;
  for (addrinfo* a = found; a != nullptr; a = a->ai_next) {
    const int fd = ::socket(a->ai_family, a->ai_socktype, a->ai_protocol);
    if (fd < 0) {
      err = errno;
      continue;
    }
    listening_socket_options(fd);
    const bool ok = ::bind(fd, a->ai_addr, a->ai_addrlen) == 0;
    err = ok ? 0 : errno;
    ::close(fd);
    if (!ok) break;
  }
  ::freeaddrinfo(found);
  switch (err) {
    case EADDRINUSE: return "address in use";
    case EADDRNOTAVAIL: return "not an address of this host";
    case EACCES: return "permission denied (ports below 1024 need privileges)";
    case 0: return "bind failed (the address is free now: a race with another process?)";
    default: return std::strerror(err);
  }
}

/// Throws ConfigError("host: ...") unless `host` is a literal IPv4 / IPv6 address or a name that resolves (a
/// malformed address is a configuration error, not a bind failure). All-numeric dotted names (999.1.1.1) are
/// malformed IPv4 addresses, never names to look up.
void check_host(const std::string& host) {
  unsigned char buf[sizeof(in6_addr)];
  if (::inet_pton(AF_INET, host.c_str(), buf) == 1 || ::inet_pton(AF_INET6, host.c_str(), buf) == 1) return;
  const bool numeric = host.find_first_not_of("0123456789.") == std::string::npos;
  if (numeric || host.find(':') != std::string::npos)
    throw ConfigError(fmt::format("host: '{}' is not a valid {} address", host, numeric ? "IPv4" : "IPv6"));
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (const int rc = ::getaddrinfo(host.c_str(), nullptr, &hints, &found); rc != 0)
    throw ConfigError(fmt::format("host: '{}' is neither an IPv4/IPv6 address nor a resolvable host name ({})", host,
                                  ::gai_strerror(rc)));
  ::freeaddrinfo(found);
}

}  // namespace

void ServeConfig::validate(const Model& model) const {
  if (host.empty()) throw ConfigError("host: must not be empty");
  check_host(host);
  if (port < 0 || port > 65535) fail_field<ConfigError>("port", "must be in [0, 65535]", port);
  if (max_batch < 1) fail_field<ConfigError>("max_batch", "must be >= 1", max_batch);
  if (max_queue < 0) fail_field<ConfigError>("max_queue", "must be >= 0", max_queue);
  if (retry_after_seconds < 1) fail_field<ConfigError>("retry_after_seconds", "must be >= 1", retry_after_seconds);
  if (max_request_bytes < 1024) fail_field<ConfigError>("max_request_bytes", "must be >= 1024", max_request_bytes);
  if (block_size < 1 || block_size > 4096) fail_field<ConfigError>("block_size", "must be in [1, 4096]", block_size);
  if (prefix_cache_entries < 0) fail_field<ConfigError>("prefix_cache_entries", "must be >= 0", prefix_cache_entries);
  if (threads < 0) fail_field<ConfigError>("threads", "must be >= 0", threads);
  if (http_threads < 0) fail_field<ConfigError>("http_threads", "must be >= 0", http_threads);
  if (read_timeout.count() < 10 || read_timeout.count() > 3600000)
    throw ConfigError(fmt::format("read_timeout: must be in [0.01, 3600] s (got {} ms)", read_timeout.count()));
  if (keep_alive_timeout.count() < 10 || keep_alive_timeout.count() > 3600000)
    throw ConfigError(
        fmt::format("keep_alive_timeout: must be in [0.01, 3600] s (got {} ms)", keep_alive_timeout.count()));
  if (max_step_tokens < max_batch)
    throw ConfigError(fmt::format("max_step_tokens: must be >= max_batch ({}) so every running sequence can decode in "
                                  "each step (got {})",
                                  max_batch, max_step_tokens));
  const int64_t L = max_model_len > 0 ? max_model_len : model.trained_context();
  if (max_model_len < 0) fail_field<ConfigError>("max_model_len", "must be >= 0 (0 = the trained context)", max_model_len);
  if (L < 2) fail_field<ConfigError>("max_model_len", "must be >= 2", L);
  if (model.family() == PositionFamily::learned_absolute && L > model.config().max_position_embeddings)
    throw ConfigError(fmt::format("max_model_len: {} is past the learned position table ({} positions)", L,
                                  model.config().max_position_embeddings));
  if (kv_cache_tokens < 0) fail_field<ConfigError>("kv_cache_tokens", "must be >= 0", kv_cache_tokens);
  if (kv_cache_tokens > 0 && (kv_cache_tokens + block_size - 1) / block_size < (L + block_size - 1) / block_size + 2)
    throw ConfigError(fmt::format("kv_cache_tokens: {} tokens cannot hold one sequence of max_model_len {} "
                                  "(blocks of {}; at least {} tokens)",
                                  kv_cache_tokens, L, block_size, ((L + block_size - 1) / block_size + 2) * block_size));
}

struct Server::Impl {
  Model model;
  Tokenizer tok;
  ServeConfig cfg;
  std::string name;
  int64_t max_model_len = 0;
  detail::Metrics metrics;
  std::unique_ptr<detail::Scheduler> scheduler;
  HttpServer http;
  std::thread listener;
  std::atomic<bool> listener_done{false};  // listen_after_bind returned (stopped, or failed to start)
  std::atomic<bool> draining{false};
  std::atomic<int64_t> in_flight{0};  // completion answers not yet written
  std::atomic<int64_t> http_threads_alive{0};  // connection threads (ConnectionThreads)
  std::atomic<int> bound_port{-1};
  std::mutex stop_mu;
  std::condition_variable stop_cv;
  bool stopped = false;    // stop() has begun
  bool stop_done = false;  // ... and completed
  int64_t created = static_cast<int64_t>(std::time(nullptr));

  Impl(Model m, Tokenizer t, ServeConfig c) : model(std::move(m)), tok(std::move(t)), cfg(std::move(c)) {}

  void reply(httplib::Response& res, const std::string& endpoint, int status, const json& body) {
    res.status = status;
    res.set_content(dump(body), "application/json");
    metrics.count_request(endpoint, status);
  }
  void reply_error(httplib::Response& res, const std::string& endpoint, const RequestError& e) {
    if (e.status() == 503) res.set_header("Retry-After", std::to_string(cfg.retry_after_seconds));
    reply(res, endpoint, e.status(), error_body(e.status(), e.type(), e.param(), e.what()));
  }

  /// The text of `token` as a logprobs entry shows it: its decoded piece, or the vocabulary piece for a token
  /// that decodes to nothing (BOS, special tokens).
  std::string token_string(int32_t prev, int32_t token) const {
    std::string s = tok.decode(prev, token);
    return s.empty() ? tok.piece(token) : s;
  }

  void setup_routes();
  void completions(const httplib::Request& req, httplib::Response& res);
  std::shared_ptr<Job> make_job(const CompletionRequest& r);
  json completion_body(const Job& job) const;
  std::string metrics_text() const {
    ServerStats st;
    scheduler->fill_stats(st);
    return detail::render_metrics(metrics.snapshot(), st.queue_depth, st.running_sequences, st.kv_blocks_in_use,
                                  scheduler->block_budget(), st.prefix_cache_sequences);
  }
};

std::shared_ptr<Job> Server::Impl::make_job(const CompletionRequest& r) {
  if (r.model && *r.model != name)
    throw RequestError(404, "model_not_found", "model",
                       fmt::format("model: '{}' is not served here (the served model is '{}')", *r.model, name));
  auto job = std::make_shared<Job>();
  if (const auto* text = std::get_if<std::string>(&r.prompt)) {
    try {
      job->prompt = tok.encode_hf(*text, true);
    } catch (const TokenizerError& e) {
      throw RequestError(400, "invalid_request_error", "prompt", fmt::format("prompt: cannot be tokenized: {}", e.what()));
    }
  } else {
    job->prompt = std::get<std::vector<int32_t>>(r.prompt);
  }
  const int64_t P = static_cast<int64_t>(job->prompt.size());
  if (P == 0) throw RequestError(400, "invalid_request_error", "prompt", "prompt: empty (no tokens)");
  if (P > max_model_len)
    throw RequestError(400, "invalid_request_error", "prompt",
                       fmt::format("prompt: {} tokens exceed this model's maximum context length (max_model_len {})",
                                   P, max_model_len));
  if (r.max_tokens) {
    if (P + *r.max_tokens > max_model_len)
      throw RequestError(400, "invalid_request_error", "max_tokens",
                         fmt::format("max_tokens: {} prompt tokens + max_tokens {} = {} exceed this model's maximum "
                                     "context length (max_model_len {}{})",
                                     P, *r.max_tokens, P + *r.max_tokens, max_model_len,
                                     model.max_position() >= 0
                                         ? fmt::format(", at most the position limit {} + 2: --max-position",
                                                       model.max_position())
                                         : std::string()));
    job->max_tokens = *r.max_tokens;
  } else {
    job->max_tokens = std::min<int64_t>(16, max_model_len - P);
    if (job->max_tokens == 0 && !r.echo)
      throw RequestError(400, "invalid_request_error", "prompt",
                         fmt::format("prompt: {} tokens fill this model's maximum context length (max_model_len {}); "
                                     "no room for new tokens",
                                     P, max_model_len));
  }
  // Model::set_max_position (--max-position): a request whose context would reach a position id past it is a 400,
  // before it is queued (the forward would refuse it mid-batch). The last new token is sampled, never fed: the
  // largest position fed is P - 1 + max(max_tokens - 1, 0), as in generate.
  if (const int64_t limit = model.max_position();
      limit >= 0 && P - 1 + std::max<int64_t>(job->max_tokens - 1, 0) > limit)
    throw RequestError(400, "invalid_request_error", job->max_tokens > 0 ? "max_tokens" : "prompt",
                       fmt::format("position_ids: {} prompt tokens + max_tokens {} feed positions up to {}, past the "
                                   "position limit {} (--max-position; positions 0 .. {} are allowed)",
                                   P, job->max_tokens, P - 1 + std::max<int64_t>(job->max_tokens - 1, 0), limit,
                                   limit));
  if (scheduler->blocks_needed(P + job->max_tokens) > scheduler->block_budget())
    throw RequestError(400, "invalid_request_error", "max_tokens",
                       fmt::format("prompt + max_tokens = {} tokens do not fit the KV cache budget ({} blocks of {})",
                                   P + job->max_tokens, scheduler->block_budget(), cfg.block_size));
  job->temperature = r.temperature;
  job->top_p = r.top_p;
  job->seed = r.seed ? *r.seed : (static_cast<uint64_t>(std::random_device{}()) << 32) ^ std::random_device{}();
  job->stop = r.stop;
  job->stop_token_ids = r.stop_token_ids;
  job->logprobs = r.logprobs;
  job->echo = r.echo;
  job->enqueued = std::chrono::steady_clock::now();
  return job;
}

json Server::Impl::completion_body(const Job& job) const {
  const std::vector<int32_t>& p = job.prompt;
  std::string text;
  std::vector<std::string> strings;   // per returned token
  std::vector<int64_t> offsets;
  std::vector<const TokenLogprob*> lps;
  std::vector<int32_t> ids;
  if (job.echo) {
    // The prompt's text as generate() prints it: from after a leading BOS; the first piece decodes as the start.
    const auto bos = tok.bos_id();
    const std::size_t first = bos && p.front() == *bos ? 1 : 0;
    for (std::size_t i = 0; i < p.size(); ++i) {
      const int32_t prev = i > first ? p[i - 1] : first == 1 && i == 1 && tok.is_special(*bos) ? *bos : -1;
      offsets.push_back(static_cast<int64_t>(text.size()));
      const std::string piece = i < first ? std::string() : tok.decode(prev, p[i]);
      text += piece;
      strings.push_back(piece.empty() ? tok.piece(p[i]) : piece);
      ids.push_back(p[i]);
      if (job.prompt_rows()) lps.push_back(&job.prompt_lp[i]);
    }
  }
  const std::size_t gen_start = text.size();
  int32_t prev = p.back();
  std::string gen_text;
  for (std::size_t i = 0; i < job.generated.size(); ++i) {
    const int32_t t = job.generated[i];
    offsets.push_back(static_cast<int64_t>(gen_start + std::min(gen_text.size(), job.text.size())));
    const std::string piece = tok.decode(prev, t);
    gen_text += piece;
    strings.push_back(piece.empty() ? tok.piece(t) : piece);
    ids.push_back(t);
    if (job.logprobs) lps.push_back(&job.gen_lp[i]);
    prev = t;
  }
  text += job.text;
  json logprobs = nullptr;
  if (job.logprobs) {
    json tokens = json::array(), token_logprobs = json::array(), top = json::array(), text_offset = json::array();
    for (std::size_t i = 0; i < strings.size(); ++i) {
      tokens.push_back(strings[i]);
      text_offset.push_back(std::min<int64_t>(offsets[i], static_cast<int64_t>(text.size())));
      const TokenLogprob* e = i < lps.size() ? lps[i] : nullptr;
      if (e == nullptr || !e->logprob) {  // the first prompt token; or an echo without prompt rows (never)
        token_logprobs.push_back(nullptr);
        top.push_back(nullptr);
        continue;
      }
      token_logprobs.push_back(*e->logprob);
      // Alternatives keyed by their text as they would follow the previous token; the chosen token too.
      const int32_t before = i > 0 ? ids[i - 1] : -1;
      json alts = json::object();
      for (const auto& [id, lp] : e->top) {
        const std::string k = token_string(before, id);
        if (!alts.contains(k)) alts[k] = lp;
      }
      if (!alts.contains(strings[i])) alts[strings[i]] = *e->logprob;
      top.push_back(std::move(alts));
    }
    logprobs = {{"tokens", tokens}, {"token_logprobs", token_logprobs}, {"top_logprobs", top},
                {"text_offset", text_offset}, {"token_ids", ids}};
  }
  const int64_t P = static_cast<int64_t>(p.size()), C = static_cast<int64_t>(job.generated.size());
  return {{"id", "cmpl-" + random_hex()},
          {"object", "text_completion"},
          {"created", static_cast<int64_t>(std::time(nullptr))},
          {"model", name},
          {"choices", json::array({{{"index", 0},
                                    {"text", text},
                                    {"finish_reason", job.finish_reason},
                                    {"logprobs", logprobs}}})},
          {"usage", {{"prompt_tokens", P}, {"completion_tokens", C}, {"total_tokens", P + C}}}};
}

void Server::Impl::completions(const httplib::Request& req, httplib::Response& res) {
  const std::string ep = "/v1/completions";
  std::shared_ptr<Job> job;
  try {
    if (draining.load())
      throw RequestError(503, "service_unavailable", "", "the server is shutting down (draining)");
    RequestLimits limits;
    limits.vocab_size = model.config().vocab_size;
    limits.max_model_len = max_model_len;
    limits.max_request_bytes = cfg.max_request_bytes;
    job = make_job(parse_completion_request(req.body, limits));
    ++in_flight;
    try {
      scheduler->submit(job);
    } catch (...) {
      --in_flight;
      throw;
    }
  } catch (const RequestError& e) {
    reply_error(res, ep, e);
    return;
  }
  auto answer = [this, ep](const Job& j, int& status) {
    if (j.error_status != 0) {
      status = j.error_status;
      return dump(error_body(j.error_status, j.error_type, "", j.error_message));
    }
    status = 200;
    return dump(completion_body(j));
  };
  if (job->wait_for(std::chrono::milliseconds(50))) {
    int status = 200;
    const std::string body = answer(*job, status);
    res.status = status;
    res.set_content(body, "application/json");
    metrics.count_request(ep, status);
    --in_flight;
    return;
  }
  // Long request: answer with a chunked body, writing one space (JSON whitespace) every 200 ms while the result
  // is not ready. A failed write means the client has left: the request is cancelled and its sequence freed.
  // (An error found after this point comes with status 200 and an {"error": ...} body.)
  res.status = 200;
  res.set_chunked_content_provider(
      "application/json",
      [this, job, answer, ep](size_t, httplib::DataSink& sink) {
        if (job->wait_for(std::chrono::milliseconds(200))) {
          int status = 200;
          const std::string body = answer(*job, status);
          if (!sink.write(body.data(), body.size())) {
            metrics.count_request(ep, 499);
            return false;
          }
          metrics.count_request(ep, status);
          sink.done();
          return true;
        }
        if (!sink.write(" ", 1)) {
          job->cancelled = true;
          metrics.count_request(ep, 499);  // nginx's "client closed request"
          return false;
        }
        return true;
      },
      [this, job](bool) {
        if (!job->wait_for(std::chrono::milliseconds(0))) job->cancelled = true;
        --in_flight;
      });
}

void Server::Impl::setup_routes() {
  http.Get("/health", [this](const httplib::Request&, httplib::Response& res) {
    if (draining.load())
      reply(res, "/health", 503, {{"status", "draining"}});
    else
      reply(res, "/health", 200, {{"status", "ok"}});
  });
  http.Get("/version", [this](const httplib::Request&, httplib::Response& res) {
    reply(res, "/version", 200, {{"version", cfg.version}, {"git_commit", cfg.git_commit}, {"server", "posenc"}});
  });
  http.Get("/v1/models", [this](const httplib::Request&, httplib::Response& res) {
    const ModelSource& src = model.source();
    json info = {{"family", std::string(to_string(model.family()))},
                 {"format", std::string(to_string(src.format))},
                 {"architecture", src.architecture},
                 {"trained_context", model.trained_context()},
                 {"vocab_size", model.config().vocab_size},
                 {"n_layers", model.config().n_layers},
                 {"dim", model.config().dim},
                 {"tokenizer", tok.describe()},
                 {"bos_token_id", tok.bos_id() ? json(*tok.bos_id()) : json(nullptr)},
                 {"eos_token_id", tok.eos_id() ? json(*tok.eos_id()) : json(nullptr)}};
    if (model.family() == PositionFamily::rope) {
      const RopeSetup& r = model.rope();
      info["rope_type"] = r.params.rope_type;
      info["rope_theta"] = r.params.rope_theta;
      info["rope_factor"] = r.params.factor ? json(*r.params.factor) : json(nullptr);
      info["rope_layout"] = std::string(to_string(r.layout));
      info["angle_precision"] = std::string(to_string(r.precision));
    }
    reply(res, "/v1/models", 200,
          {{"object", "list"},
           {"data", json::array({{{"id", name},
                                  {"object", "model"},
                                  {"created", created},
                                  {"owned_by", "posenc"},
                                  {"max_model_len", max_model_len},
                                  {"posenc", info}}})}});
  });
  http.Post("/v1/completions", [this](const httplib::Request& req, httplib::Response& res) { completions(req, res); });
  http.Post("/tokenize", [this](const httplib::Request& req, httplib::Response& res) {
    try {
      const json j = object_body(req.body, cfg.max_request_bytes);
      std::optional<std::string> text;
      bool add_special = true;
      bool llama_spelling = false;
      std::optional<bool> add;
      for (auto it = j.begin(); it != j.end(); ++it) {
        const std::string& k = it.key();
        const json& v = it.value();
        if (k == "prompt" || k == "content") {
          if (!v.is_string()) throw RequestError(400, "invalid_request_error", k, fmt::format("{}: must be a string", k));
          if (text) throw RequestError(400, "invalid_request_error", k, "give one of prompt (vLLM) or content (llama.cpp)");
          text = v.get<std::string>();
          llama_spelling = k == "content";
        } else if (k == "add_special_tokens" || k == "add_special") {
          if (!v.is_boolean()) throw RequestError(400, "invalid_request_error", k, fmt::format("{}: must be a boolean", k));
          add = v.get<bool>();
        } else if (k == "model") {
          if (!v.is_string() || v.get<std::string>() != name)
            throw RequestError(404, "model_not_found", "model", fmt::format("model: not served here (the served model is '{}')", name));
        } else {
          throw RequestError(400, "invalid_request_error", k, fmt::format("{}: unknown field", k));
        }
      }
      if (!text) throw RequestError(400, "invalid_request_error", "prompt", "prompt: required (or content)");
      add_special = add.value_or(!llama_spelling);
      std::vector<int32_t> ids;
      try {
        ids = tok.encode_hf(*text, add_special);
      } catch (const TokenizerError& e) {
        throw RequestError(400, "invalid_request_error", llama_spelling ? "content" : "prompt", e.what());
      }
      reply(res, "/tokenize", 200,
            {{"tokens", ids}, {"count", static_cast<int64_t>(ids.size())}, {"max_model_len", max_model_len}});
    } catch (const RequestError& e) {
      reply_error(res, "/tokenize", e);
    }
  });
  http.Post("/detokenize", [this](const httplib::Request& req, httplib::Response& res) {
    try {
      const json j = object_body(req.body, cfg.max_request_bytes);
      std::optional<std::vector<int32_t>> ids;
      for (auto it = j.begin(); it != j.end(); ++it) {
        const std::string& k = it.key();
        const json& v = it.value();
        if (k == "tokens") {
          if (!v.is_array()) throw RequestError(400, "invalid_request_error", k, "tokens: must be an array of token ids");
          ids.emplace();
          for (const json& t : v) {
            if (!t.is_number_integer() || (t.is_number_unsigned() ? t.get<uint64_t>() >= static_cast<uint64_t>(model.config().vocab_size)
                                                                   : (t.get<int64_t>() < 0 || t.get<int64_t>() >= model.config().vocab_size)))
              throw RequestError(400, "invalid_request_error", k,
                                 fmt::format("tokens: {} is not a token id in [0, {})", dump(t), model.config().vocab_size));
            ids->push_back(t.get<int32_t>());
          }
        } else if (k == "model") {
          if (!v.is_string() || v.get<std::string>() != name)
            throw RequestError(404, "model_not_found", "model", fmt::format("model: not served here (the served model is '{}')", name));
        } else {
          throw RequestError(400, "invalid_request_error", k, fmt::format("{}: unknown field", k));
        }
      }
      if (!ids) throw RequestError(400, "invalid_request_error", "tokens", "tokens: required");
      const std::string text = tok.decode(*ids);
      reply(res, "/detokenize", 200, {{"prompt", text}, {"content", text}});
    } catch (const RequestError& e) {
      reply_error(res, "/detokenize", e);
    }
  });
  http.Get("/metrics", [this](const httplib::Request&, httplib::Response& res) {
    res.set_content(metrics_text(), "text/plain; version=0.0.4; charset=utf-8");
    metrics.count_request("/metrics", 200);
  });
  // Before any body is read: a request without a body for a path that does not take its method is answered at once
  // (404, or 405 + Allow from the error handler), and a POST without Content-Length (and not chunked) is 411,
  // instead of waiting for a body that will not come.
  // A request whose body framing is refused (framing_error) is answered at once, without reading its body, and
  // its connection closed.
  // An answer about to be written (httplib calls this handler after choosing the Connection / Keep-Alive headers
  // and before writing the head, a chunked answer's too) while a connection waits for a thread that no idle
  // connection was closed for: this connection closes after it (close_after: process_and_close_socket's loop), and
  // says so.
  // (Not for an answer already saying close, its last request's: that claimed no room or claimed it already.)
  http.set_post_routing_handler([this](const httplib::Request&, httplib::Response& res) {
    if (current_connection == nullptr || current_connection->close_after ||
        res.get_header_value("Connection") == "close" || !http.claim_room())
      return;
    current_connection->close_after = true;
    res.set_header("Connection", "close");
    res.headers.erase("Keep-Alive");
  });
  http.set_pre_routing_handler([this](const httplib::Request& req, httplib::Response& res) {
    if (current_connection != nullptr) current_connection->head_read = true;
    if (const auto e = framing_error(req)) {
      if (e->status() == 415) res.set_header("Accept-Encoding", "identity");
      reply_error(res, endpoint_label(req.path), *e);
      close_after_answer(req);
      return httplib::Server::HandlerResponse::Handled;
    }
    if (has_body_framing(req)) return httplib::Server::HandlerResponse::Unhandled;
    const Route* route = find_route(req.path);
    if (route != nullptr && allows(*route, req.method)) {
      if (req.method != "POST") return httplib::Server::HandlerResponse::Unhandled;
      res.status = 411;  // a POST endpoint takes a JSON body: its length must be declared
      return httplib::Server::HandlerResponse::Handled;
    }
    res.status = 404;
    return httplib::Server::HandlerResponse::Handled;
  });
  http.set_error_handler(httplib::Server::HandlerWithResponse([this](const httplib::Request& req, httplib::Response& res) {
    if (!res.body.empty()) return httplib::Server::HandlerResponse::Unhandled;
    // No handler for this method on a known path: 405 with the methods it has (RFC 9110 15.5.6).
    const Route* route = find_route(req.path);
    if (res.status == 404 && route != nullptr) {
      res.status = 405;
      res.set_header("Allow", route->allow);
    }
    // httplib's 400 for a request that stopped arriving (a read waited read_timeout): 408 saying so. (A request
    // whose framing was refused never gets here with a Content-Length that is not digits.)
    const bool chunked = req.has_header("Transfer-Encoding");
    const std::size_t declared =
        req.has_header("Content-Length") ? std::strtoull(req.get_header_value("Content-Length").c_str(), nullptr, 10) : 0;
    const bool timed_out = current_connection != nullptr && current_connection->timed_out;
    const bool head_stalled = timed_out && current_connection != nullptr && !current_connection->head_read;
    if (res.status == 400 && timed_out) {
      res.status = 408;
      close_after_answer(req);
    }
    const std::string msg = res.status == 404 ? fmt::format("{} {}: no such endpoint", req.method, req.path)
                            : res.status == 411
                                ? fmt::format("{} {}: a request body needs a Content-Length header (or chunked "
                                              "Transfer-Encoding)",
                                              req.method, req.path)
                            : res.status == 408 && head_stalled
                                ? fmt::format("{} {}: request headers incomplete: nothing more arrived for the read "
                                              "timeout ({} ms)",
                                              req.method, req.path, cfg.read_timeout.count())
                            : res.status == 408 && chunked
                                ? fmt::format("{} {}: request body incomplete: {} bytes of chunked body arrived, then "
                                              "nothing for the read timeout ({} ms)",
                                              req.method, req.path, req.body.size(), cfg.read_timeout.count())
                            : res.status == 408
                                ? fmt::format("{} {}: request body incomplete: {} of {} bytes arrived, then nothing "
                                              "for the read timeout ({} ms)",
                                              req.method, req.path, req.body.size(), declared, cfg.read_timeout.count())
                            : res.status == 405
                                ? fmt::format("{} {}: method not allowed (allowed: {})", req.method, req.path,
                                              route->allow)
                            : res.status == 413
                                ? fmt::format("request body: {} bytes exceed the limit of {} bytes (max_request_bytes)",
                                              declared, cfg.max_request_bytes)
                                : fmt::format("{} {}: HTTP {}", req.method, req.path, res.status);
    res.set_content(dump(error_body(res.status, "invalid_request_error", "", msg)), "application/json");
    metrics.count_request(endpoint_label(req.path), res.status);
    return httplib::Server::HandlerResponse::Handled;
  }));
  http.set_exception_handler([this](const httplib::Request& req, httplib::Response& res, std::exception_ptr ep) {
    std::string what = "unknown error";
    try {
      std::rethrow_exception(ep);
    } catch (const std::exception& e) {
      what = e.what();
    } catch (...) {
    }
    res.status = 500;
    res.set_content(dump(error_body(500, "server_error", "", fmt::format("{} {}: {}", req.method, req.path, what))),
                    "application/json");
    metrics.count_request(endpoint_label(req.path), 500);
  });
}

Server::Server(Model model, Tokenizer tokenizer, ServeConfig config)
    : impl_(std::make_unique<Impl>(std::move(model), std::move(tokenizer), std::move(config))) {
  Impl& s = *impl_;
  s.cfg.validate(s.model);
  if (s.tok.vocab_size() != s.model.config().vocab_size)
    throw TokenizerError(fmt::format("tokenizer vocab_size {} does not match the model's vocab_size {}",
                                     s.tok.vocab_size(), s.model.config().vocab_size));
  if (!s.tok.usable()) throw TokenizerError(fmt::format("tokenizer: cannot encode: {}", s.tok.unusable_reason()));
  s.name = s.cfg.served_model_name.empty() ? default_model_name(s.model) : s.cfg.served_model_name;
  s.max_model_len = s.cfg.max_model_len > 0 ? s.cfg.max_model_len : s.model.trained_context();
  // --max-position N: positions 0 .. N are fed, and the last new token is sampled, never fed, so no sequence of
  // more than N + 2 tokens fits; /v1/models says so, so that clients that size their requests from max_model_len
  // (eval --endpoint) stay inside it.
  if (s.model.max_position() >= 0)
    s.max_model_len = std::min(s.max_model_len, std::max<int64_t>(s.model.max_position() + 2, 2));
  // One positional setup for every sequence, whatever its length: a length-dependent method (dynamic NTK,
  // longrope) stays at the frequencies it was given, so cached keys and shared prefixes stay valid.
  if (s.model.family() == PositionFamily::rope) {
    RopeSetup r = s.model.rope();
    r.update_with_length = false;
    s.model.set_rope(r);
  }
  s.scheduler = std::make_unique<detail::Scheduler>(s.model, s.tok, s.cfg, s.max_model_len, s.metrics);
}

Server::~Server() { stop(); }

int Server::start() {
  Impl& s = *impl_;
  if (s.bound_port.load() >= 0) throw InvalidArgument("Server::start: already started");
  const std::size_t threads =
      s.cfg.http_threads > 0 ? static_cast<std::size_t>(s.cfg.http_threads)
                             : static_cast<std::size_t>(std::max(1024, s.cfg.max_batch + s.cfg.max_queue + 8));
  // Threads idle for keep_alive_timeout end (the connections they served have closed).
  s.http.new_task_queue = [&s, threads] {
    auto* queue = new posenc::detail::ConnectionThreads(threads, s.cfg.keep_alive_timeout, s.http_threads_alive,
                                                        [&s] { return s.http.close_idle_connection(); });
    s.http.connections_waiting = [queue] { return queue->jobs_waiting(); };
    return queue;
  };
  s.http.request_line_timeout_body = [&s] {
    s.metrics.count_request("other", 408);
    return dump(error_body(408, "invalid_request_error", "",
                           fmt::format("request line incomplete: nothing more arrived for the read timeout ({} ms)",
                                       s.cfg.read_timeout.count())));
  };
  // A declared body past max_request_bytes is refused (413) by httplib before it is buffered; the handlers check
  // the size too (a chunked body has no declared length).
  s.http.set_payload_max_length(s.cfg.max_request_bytes);
  s.http.set_socket_options(listening_socket_options);
  s.http.set_keep_alive_max_count(1000);
  // httplib sends the headers and the body (and each chunk) in separate writes: without TCP_NODELAY every answer
  // waits for the client's delayed ACK (~40 ms on Linux) under Nagle's algorithm.
  s.http.set_tcp_nodelay(true);
  // A client that stops sending (a half-sent head or body) holds its connection only this long per read.
  const auto rt = std::chrono::duration_cast<std::chrono::microseconds>(s.cfg.read_timeout).count();
  s.http.set_read_timeout(rt / 1000000, rt % 1000000);
  s.http.set_write_timeout(30, 0);
  s.http.set_connection_timeouts(s.cfg.read_timeout, s.cfg.keep_alive_timeout, std::chrono::seconds(30));
  s.setup_routes();
  int port = s.cfg.port;
  if (port == 0) {
    port = s.http.bind_to_any_port(s.cfg.host);
    if (port < 0)
      throw IoError(fmt::format("cannot bind {} (any port): {}", s.cfg.host, bind_failure(s.cfg.host, 0)));
  } else if (!s.http.bind_to_port(s.cfg.host, port)) {
    throw IoError(fmt::format("cannot bind {}:{}: {}", s.cfg.host, port, bind_failure(s.cfg.host, port)));
  }
  s.http.set_backlog(1024);
  s.bound_port = port;
  s.listener = std::thread([&s] {
    s.http.listen_after_bind();
    s.listener_done = true;
  });
  return port;
}

void Server::stop() {
  Impl& s = *impl_;
  {
    std::unique_lock lk(s.stop_mu);
    if (s.stopped) {  // another thread is stopping: wait until it is done
      s.stop_cv.wait(lk, [&] { return s.stop_done; });
      return;
    }
    s.stopped = true;
  }
  s.draining = true;
  s.scheduler->drain();  // every queued and running request finishes
  // Their answers are written (a chunked answer is written by its connection's thread within ~200 ms).
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (s.in_flight.load() > 0 && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  if (s.bound_port.load() >= 0) {
    // httplib's stop() does nothing until the listener thread has entered its accept loop (is_running): a stop
    // right after start() (an error before the first request) returned at once and the join below waited forever.
    while (!s.http.is_running() && !s.listener_done.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    s.http.stop();
    if (s.listener.joinable()) s.listener.join();
  }
  {
    std::lock_guard lk(s.stop_mu);
    s.stop_done = true;
  }
  s.stop_cv.notify_all();
}

void Server::wait() {
  Impl& s = *impl_;
  std::unique_lock lk(s.stop_mu);
  s.stop_cv.wait(lk, [&] { return s.stop_done; });
}

int Server::port() const { return impl_->bound_port.load(); }
const std::string& Server::served_model_name() const { return impl_->name; }
int64_t Server::max_model_len() const { return impl_->max_model_len; }

ServerStats Server::stats() const {
  ServerStats st;
  impl_->scheduler->fill_stats(st);
  const auto m = impl_->metrics.snapshot();
  st.requests_completed = m.completed;
  st.requests_cancelled = m.cancelled;
  st.prompt_tokens = m.prompt_tokens;
  st.computed_prompt_tokens = m.computed_prompt_tokens;
  st.prefix_cache_hits = m.prefix_cache_hits;
  st.generation_tokens = m.generation_tokens;
  st.steps = m.steps;
  st.max_sequences_in_a_step = m.max_step_sequences;
  st.http_connections = static_cast<int64_t>(impl_->http.open_connections());
  st.http_threads = impl_->http_threads_alive.load();
  return st;
}

std::string Server::metrics_text() const { return impl_->metrics_text(); }

}  // namespace posenc::serve
