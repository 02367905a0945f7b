// posenc serve: the HTTP side (cpp-httplib) and the response formats.
#include <httplib.h>

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <strings.h>
#include <atomic>
#include <condition_variable>
#include <mutex>
#include <ctime>
#include <deque>
#include <random>
#include <thread>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "posenc/serve.hpp"
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

/// httplib::Server with its listening socket reachable: cpp-httplib 0.11.4 listens with a backlog of 5
/// (CPPHTTPLIB_LISTEN_BACKLOG, compiled into Debian's shared library), and 64 clients connecting at once overflow
/// it (connections reset, "Read" errors on the client). listen() again on a listening socket sets a new backlog.
class HttpServer : public httplib::Server {
 public:
  void set_backlog(int backlog) {
    const auto fd = svr_sock_.load();
    if (fd != INVALID_SOCKET && ::listen(fd, backlog) != 0)
      throw IoError(fmt::format("posenc serve: listen(backlog {}) failed: {}", backlog, std::strerror(errno)));
  }
};

/// cpp-httplib's task queue for connections, grown on demand: httplib keeps a pool thread for each connection's
/// whole life (every keep-alive request and every wait for bytes), so a fixed pool lets slow or idle clients hold
/// every thread while /health waits behind them. A connection gets an idle thread or a new one, up to `max_threads`
/// (past that it waits for a thread). Threads are kept for reuse until shutdown().
class ConnectionThreads : public httplib::TaskQueue {
 public:
  explicit ConnectionThreads(std::size_t max_threads) : max_(max_threads) {}
  void enqueue(std::function<void()> fn) override {
    std::lock_guard lk(mu_);
    jobs_.push_back(std::move(fn));
    if (jobs_.size() > idle_ && threads_.size() < max_) threads_.emplace_back([this] { work(); });
    else cv_.notify_one();
  }
  void shutdown() override {
    {
      std::lock_guard lk(mu_);
      shutdown_ = true;
    }
    cv_.notify_all();
    for (auto& t : threads_) t.join();  // enqueue is not called after shutdown (httplib's accept loop has ended)
  }

 private:
  void work() {
    std::unique_lock lk(mu_);
    for (;;) {
      ++idle_;
      cv_.wait(lk, [&] { return !jobs_.empty() || shutdown_; });
      --idle_;
      if (jobs_.empty()) return;  // shutdown, nothing left
      auto fn = std::move(jobs_.front());
      jobs_.pop_front();
      lk.unlock();
      fn();
      lk.lock();
    }
  }
  std::size_t max_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> jobs_;
  std::vector<std::thread> threads_;
  std::size_t idle_ = 0;
  bool shutdown_ = false;
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
  http.set_pre_routing_handler([](const httplib::Request& req, httplib::Response& res) {
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
    // httplib's 400 for a body that stopped arriving (read_timeout): 408 saying so.
    const std::size_t declared =
        req.has_header("Content-Length") ? std::strtoull(req.get_header_value("Content-Length").c_str(), nullptr, 10) : 0;
    if (res.status == 400 && req.body.size() < declared) res.status = 408;
    const std::string msg = res.status == 404 ? fmt::format("{} {}: no such endpoint", req.method, req.path)
                            : res.status == 411
                                ? fmt::format("{} {}: a request body needs a Content-Length header (or chunked "
                                              "Transfer-Encoding)",
                                              req.method, req.path)
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
  s.http.new_task_queue = [threads] { return new ConnectionThreads(threads); };
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
  s.http.set_keep_alive_timeout(std::max<time_t>(1, (rt + 999999) / 1000000));
  s.http.set_write_timeout(30, 0);
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
  return st;
}

std::string Server::metrics_text() const { return impl_->metrics_text(); }

}  // namespace posenc::serve
