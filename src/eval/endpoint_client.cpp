// The HTTP client of `posenc eval --endpoint`: response parsing (pure),
// retries with backoff and jitter, the circuit breaker, the two requests the
// lab sends (likelihood, generation).
#include <httplib.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <random>
#include <thread>

#include <fmt/format.h>

#include "posenc/endpoint.hpp"
#include "posenc/json_file.hpp"
#include "posenc/serve.hpp"

namespace posenc {

using nlohmann::json;

// ---------------------------------------------------------------- parsing

CompletionResponse parse_completion_response(std::string_view body, std::string_view source) {
  const JsonDocument doc = parse_json_document(body, source);
  const JsonView root = doc.root();
  if (!root.raw().is_object()) root.fail("expected a JSON object (a completions response)");
  const JsonView choices = root.at("choices");
  if (choices.size() == 0) choices.fail("is empty (expected one choice)");
  const JsonView c = choices.at(0);
  CompletionResponse r;
  r.text = c.at("text").string();
  if (const auto f = c.find("finish_reason")) r.finish_reason = f->string();
  if (const auto lp = c.find("logprobs")) {
    if (!lp->raw().is_object()) lp->fail("expected an object or null");
    r.has_logprobs = true;
    if (lp->raw().contains("token_logprobs") || !lp->raw().contains("content")) {
      r.logprobs_shape = "legacy";
      const JsonView tl = lp->at("token_logprobs");
      for (const JsonView& v : tl.elements())
        r.token_logprobs.push_back(v.is_null() ? std::optional<double>{} : std::optional<double>{v.number()});
      if (const auto ids = lp->find("token_ids")) {
        r.has_token_ids = true;
        for (const JsonView& v : ids->elements())
          r.token_ids.push_back(static_cast<int32_t>(v.integer(0, std::numeric_limits<int32_t>::max())));
      }
    } else {
      // llama.cpp's chat-style shape: {"content": [{"id", "token", "bytes", "logprob", "top_logprobs"}]}.
      r.logprobs_shape = "content";
      r.has_token_ids = true;
      for (const JsonView& e : lp->at("content").elements()) {
        r.token_ids.push_back(static_cast<int32_t>(e.at("id").integer(0, std::numeric_limits<int32_t>::max())));
        const JsonView v = e.at("logprob");
        r.token_logprobs.push_back(v.is_null() ? std::optional<double>{} : std::optional<double>{v.number()});
      }
    }
  }
  if (const auto u = root.find("usage"); u && u->raw().is_object())
    if (const auto ct = u->find("completion_tokens")) r.completion_tokens = ct->integer(0);
  return r;
}

std::vector<ServedModel> parse_models_response(std::string_view body, std::string_view source) {
  const JsonDocument doc = parse_json_document(body, source);
  const JsonView root = doc.root();
  if (!root.raw().is_object()) root.fail("expected a JSON object (a model list)");
  std::vector<ServedModel> out;
  for (const JsonView& e : root.at("data").elements()) {
    ServedModel m;
    m.id = e.at("id").string();
    if (const auto n = e.find("max_model_len")) m.max_model_len = n->integer(1);
    m.entry = e.raw();
    out.push_back(std::move(m));
  }
  return out;
}

// ---------------------------------------------------------------- specs

namespace {

bool safe_label(std::string_view s) {
  if (s.empty() || s.size() > 64 || s == "." || s == "..") return false;
  return std::all_of(s.begin(), s.end(), [](char ch) {
    return (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9') || ch == '.' || ch == '_' ||
           ch == '-';
  });
}

struct ParsedUrl {
  std::string scheme_host_port;  // http://host:port
  std::string path;              // "/v1" or ""
};

ParsedUrl parse_url(std::string_view url, std::string_view flag) {
  ParsedUrl p;
  std::string_view rest;
  if (url.starts_with("http://")) rest = url.substr(7);
  else if (url.starts_with("https://")) rest = url.substr(8);
  else
    throw ConfigError(fmt::format("{}: '{}' is not an http:// or https:// URL (expected e.g. http://127.0.0.1:8000/v1)",
                                  flag, url));
  const std::size_t slash = rest.find('/');
  const std::string_view host = rest.substr(0, slash);
  if (host.empty() || host.find_first_of(" @?#") != std::string_view::npos || host.front() == ':')
    throw ConfigError(fmt::format("{}: '{}' has no valid host", flag, url));
  if (const auto colon = host.rfind(':'); colon != std::string_view::npos && host.find(']') == std::string_view::npos) {
    const std::string_view port = host.substr(colon + 1);
    if (port.empty() || port.size() > 5 || !std::all_of(port.begin(), port.end(), [](char c) { return c >= '0' && c <= '9'; }) ||
        std::stoi(std::string(port)) < 1 || std::stoi(std::string(port)) > 65535)
      throw ConfigError(fmt::format("{}: '{}' has no valid port (1..65535)", flag, url));
  }
  p.scheme_host_port = std::string(url.substr(0, url.size() - rest.size())) + std::string(host);
  p.path = slash == std::string_view::npos ? "" : std::string(rest.substr(slash));
  while (!p.path.empty() && p.path.back() == '/') p.path.pop_back();
  if (p.path.find_first_of("?# ") != std::string::npos)
    throw ConfigError(fmt::format("{}: '{}': the API base must not hold a query or fragment", flag, url));
  return p;
}

}  // namespace

EndpointSpec parse_endpoint_spec(std::string_view text) {
  EndpointSpec s;
  std::string_view url = text;
  s.label = "default";
  // URL=LABEL: the label follows the last '=' after the host (a URL's own
  // query strings are refused anyway).
  if (const auto eq = text.rfind('='); eq != std::string_view::npos && eq > text.find("://") + 3) {
    url = text.substr(0, eq);
    s.label = std::string(text.substr(eq + 1));
    if (!safe_label(s.label))
      throw ConfigError(fmt::format("--endpoint: label '{}' of '{}' must be one path component of [A-Za-z0-9._-] (at "
                                    "most 64 characters, not '.' or '..')",
                                    s.label, text));
  }
  const ParsedUrl p = parse_url(url, "--endpoint");
  s.url = p.scheme_host_port + p.path;
  return s;
}

// ---------------------------------------------------------------- breaker

void CircuitBreaker::success() {
  std::lock_guard lock(mu_);
  if (!tripped_) consecutive_ = 0;
}

bool CircuitBreaker::failure(const std::string& error) {
  std::lock_guard lock(mu_);
  last_ = error;
  if (++consecutive_ >= threshold_) tripped_ = true;
  return tripped_;
}

bool CircuitBreaker::tripped() const {
  std::lock_guard lock(mu_);
  return tripped_;
}

std::string CircuitBreaker::last_error() const {
  std::lock_guard lock(mu_);
  return last_;
}

// ---------------------------------------------------------------- client

struct EndpointClient::Impl {
  ParsedUrl parsed;
  std::string root_path;  // parsed.path without a trailing "/v1"
  httplib::Client http;
  explicit Impl(ParsedUrl p) : parsed(std::move(p)), http(parsed.scheme_host_port) {}
};

namespace {

/// The error object of an error body ({"error": ...}: an object, or llama-server's bare string), null when the body
/// is not JSON or has none.
json error_of(const std::string& body) {
  try {
    const json j = json::parse(body);
    if (j.is_object() && j.contains("error")) return j["error"];
  } catch (const json::exception&) {
  }
  return nullptr;
}

/// At most this many characters of a body that is not a JSON error are quoted in a message.
constexpr std::size_t kBodyExcerptChars = 120;

/// A short, printable excerpt of a body that is not a JSON error (an HTML error page, a proxy's text): markup tags
/// dropped, runs of whitespace and control characters one space, bytes outside printable ASCII '?', at most
/// kBodyExcerptChars characters, then "... (N bytes)". A proxy's 501 page was quoted whole, newlines and markup
/// included.
std::string body_excerpt(const std::string& body) {
  std::string s;
  bool in_tag = false, space = false;
  std::size_t i = 0;
  for (; i < body.size() && s.size() < kBodyExcerptChars; ++i) {
    const auto c = static_cast<unsigned char>(body[i]);
    if (c == '<') in_tag = true;
    if (in_tag) {
      if (c == '>') {
        in_tag = false;
        space = !s.empty();  // a tag separates words ("</h1><p>")
      }
      continue;
    }
    if (c <= ' ' || c == 0x7f) {
      space = !s.empty();
      continue;
    }
    if (space) s += ' ';
    space = false;
    s += c < 0x80 ? static_cast<char>(c) : '?';
  }
  const bool rest = std::any_of(body.begin() + static_cast<std::ptrdiff_t>(i), body.end(),
                                [](char c) { return static_cast<unsigned char>(c) > ' '; });
  if (s.empty()) return body.empty() ? "(empty body)" : fmt::format("(a body of {} bytes, no text)", body.size());
  if (rest) s += fmt::format("... ({} bytes)", body.size());
  return s;
}

std::string error_message_of(const std::string& body) {
  const json e = error_of(body);
  if (e.is_object() && e.contains("message") && e["message"].is_string()) return e["message"].get<std::string>();
  if (e.is_string()) return e.get<std::string>();
  return body_excerpt(body);
}

/// Whether a status is worth retrying: 429 and 5xx, except the 5xx that say the server cannot do this request at
/// all (the same request gets the same answer): 501 Not Implemented, 505 HTTP Version Not Supported, 506 Variant
/// Also Negotiates, 508 Loop Detected, 510 Not Extended, 511 Network Authentication Required.
bool is_transient_status(int status) {
  if (status == 429) return true;
  if (status < 500 || status > 599) return false;
  return status != 501 && status != 505 && status != 506 && status != 508 && status != 510 && status != 511;
}

/// "HTTP 503", or for a 2xx answer whose body is an error ({"error": {"code": 500, ...}}) what happened: "HTTP 200
/// with an error body (code 500)".
std::string status_text(int status, bool on_200) {
  return on_200 ? fmt::format("HTTP 200 with an error body (code {})", status) : fmt::format("HTTP {}", status);
}

// error.type of an error body ({"error": {"type": ...}}), "" when it has none.
std::string error_type_of(const std::string& body) {
  const json e = error_of(body);
  return e.is_object() && e.contains("type") && e["type"].is_string() ? e["type"].get<std::string>() : "";
}

// A 2xx body that is {"error": {...}} (leading JSON whitespace allowed) and no completion: the status it carries
// (error.code, default 500).
std::optional<int> error_on_200(const std::string& body) {
  const std::size_t b = body.find_first_not_of(" \t\r\n");
  if (b == std::string::npos || body.compare(b, 9, "{\"error\":") != 0) return std::nullopt;
  try {
    const json j = json::parse(body);
    if (!j.is_object() || !j.contains("error") || j.contains("choices")) return std::nullopt;
    const json& e = j["error"];
    if (e.is_object() && e.contains("code") && e["code"].is_number_integer()) {
      const int64_t c = e["code"].get<int64_t>();
      if (c >= 400 && c <= 599) return static_cast<int>(c);
    }
    return 500;
  } catch (const json::exception&) {
    return std::nullopt;
  }
}

// httplib's terse error names, said in full.
std::string describe(httplib::Error e, double timeout) {
  switch (e) {
    case httplib::Error::Connection: return "cannot connect (Connection)";
    case httplib::Error::ConnectionTimeout: return fmt::format("connect timed out after {} s (ConnectionTimeout)", timeout);
    case httplib::Error::Read:
      return fmt::format("no complete answer: the connection closed or --request-timeout {} s passed (Read)", timeout);
    case httplib::Error::Write: return "sending the request failed (Write)";
    case httplib::Error::SSLConnection: return "TLS handshake failed (SSLConnection)";
    case httplib::Error::SSLServerVerification: return "the server's TLS certificate did not verify (SSLServerVerification)";
    default: return httplib::to_string(e);
  }
}

double jitter_seconds(double initial, double cap, int attempt) {
  thread_local std::mt19937_64 rng{std::random_device{}()};
  const double ceiling = std::min(cap, initial * std::ldexp(1.0, std::min(attempt, 30)));
  return std::uniform_real_distribution<double>(0.0, std::max(0.0, ceiling))(rng);
}

}  // namespace

EndpointClient::EndpointClient(std::string url, EndpointOptions options, std::shared_ptr<CircuitBreaker> breaker)
    : url_(std::move(url)), options_(options), breaker_(std::move(breaker)) {
  ParsedUrl p = parse_url(url_, "--endpoint");
  impl_ = std::make_unique<Impl>(p);
  impl_->root_path = p.path.ends_with("/v1") ? p.path.substr(0, p.path.size() - 3) : p.path;
  const double t = std::max(0.001, options_.request_timeout);
  const auto sec = static_cast<time_t>(t);
  const auto usec = static_cast<time_t>((t - static_cast<double>(sec)) * 1e6);
  impl_->http.set_connection_timeout(sec, usec);
  impl_->http.set_read_timeout(sec, usec);
  impl_->http.set_write_timeout(sec, usec);
  impl_->http.set_keep_alive(true);
  // httplib writes the headers and the body in separate send()s: without TCP_NODELAY, Nagle's algorithm holds the
  // body until the server's delayed ACK (~40 ms on Linux) on every request.
  impl_->http.set_tcp_nodelay(true);
  if (!breaker_) breaker_ = std::make_shared<CircuitBreaker>(options_.breaker_failures);
}

EndpointClient::~EndpointClient() = default;

std::string EndpointClient::root() const { return impl_->parsed.scheme_host_port + impl_->root_path; }

EndpointClient::Reply EndpointClient::get_once(const std::string& path) {
  ++sent_;
  Reply r;
  auto res = impl_->http.Get(path.starts_with("/v1/") ? impl_->parsed.path + path.substr(3) : impl_->root_path + path);
  if (!res) {
    r.error = describe(res.error(), options_.request_timeout);
    return r;
  }
  r.status = res->status;
  r.body = res->body;
  return r;
}

EndpointClient::Reply EndpointClient::post_once(const std::string& path, const json& body) {
  ++sent_;
  Reply r;
  // "/v1/x" is relative to the API base (the URL's path), anything else to the root.
  const std::string full = path.starts_with("/v1/") ? impl_->parsed.path + path.substr(3) : impl_->root_path + path;
  auto res = impl_->http.Post(full, body.dump(), "application/json");
  if (!res) {
    r.error = describe(res.error(), options_.request_timeout);
    return r;
  }
  r.status = res->status;
  r.body = res->body;
  if (res->status == 429 || res->status >= 500) {
    const std::string ra = res->get_header_value("Retry-After");
    if (!ra.empty() && std::all_of(ra.begin(), ra.end(), [](char c) { return c >= '0' && c <= '9'; }) && ra.size() < 6)
      r.retry_after = std::stod(ra);
  }
  return r;
}

EndpointClient::Reply EndpointClient::post(const std::string& path, const json& body, const std::string& what,
                                           bool return_4xx) {
  const std::string where = fmt::format("endpoint {}: POST {} ({})", url_, path, what);
  std::string last;
  const int attempts = 1 + std::max(0, options_.retries);
  for (int attempt = 0; attempt < attempts; ++attempt) {
    if (breaker_->tripped())
      throw EndpointUnavailable(fmt::format("{}: not sent, the endpoint is down (last error: {}); resume with the same "
                                            "command once it answers",
                                            where, breaker_->last_error()));
    Reply r = post_once(path, body);
    bool on_200 = false;
    double wait = jitter_seconds(options_.backoff_initial, options_.backoff_max, attempt);
    if (r.status >= 200 && r.status < 300) {
      // posenc serve answers an error found after it started a (chunked) 200 answer as {"error": {...}}: the
      // server's error, with its code, under the retry rules of that code.
      if (const auto code = error_on_200(r.body)) {
        r.status = *code;
        on_200 = true;
      } else {
        breaker_->success();
        return r;
      }
    }
    if (r.status >= 300 && error_type_of(r.body) == serve::numeric_error_type) {
      // The model's logits for this input were not finite (posenc serve): the same request fails the same way, so
      // it is not retried, and the endpoint answered, so it is no breaker failure.
      breaker_->success();
      throw EndpointNumericError(
          fmt::format("{}: the served model produced non-finite logits ({}, error type {}; not retried: the "
                      "model overflows float32 on this input, the endpoint is up): {}",
                      where, status_text(r.status, on_200), serve::numeric_error_type, error_message_of(r.body)));
    }
    if (r.status == 0) {
      last = fmt::format("connection error: {}", r.error);
    } else if (is_transient_status(r.status)) {
      last = fmt::format("{}: {}", status_text(r.status, on_200), error_message_of(r.body));
      if (r.retry_after) wait = std::min(120.0, *r.retry_after);
    } else {
      if (return_4xx && r.status >= 400 && r.status < 500) return r;
      throw EndpointProtocolError(fmt::format(
          "{}: {} (not retried: {}): {}", where, status_text(r.status, on_200),
          r.status >= 500 ? "the server cannot do this request, the same request gets the same answer"
                          : "the server refused the request",
          error_message_of(r.body)));
    }
    if (attempt + 1 < attempts) std::this_thread::sleep_for(std::chrono::duration<double>(wait));
  }
  breaker_->failure(last);
  throw EndpointUnavailable(fmt::format("{}: no answer after {} attempts (last error: {}); resume with the same command "
                                        "once the endpoint answers",
                                        where, attempts, last));
}

// POST /v1/completions under the retry rules, its answer parsed; a malformed answer is an EndpointProtocolError
// naming `where` (the endpoint and the request).
CompletionResponse EndpointClient::post_completion(const json& body, const std::string& where, const std::string& what) {
  const Reply r = post("/v1/completions", body, what);
  try {
    return parse_completion_response(r.body, where);
  } catch (const EndpointProtocolError&) {
    throw;
  } catch (const DataError& e) {
    throw EndpointProtocolError(e.what());
  }
}

std::vector<double> EndpointClient::prompt_logprobs(std::span<const int32_t> prompt, const std::string& served_model,
                                                    const std::string& what, int max_tokens, int logprobs) {
  const json body{{"model", served_model}, {"prompt", prompt},         {"max_tokens", max_tokens},
                  {"temperature", 0},      {"logprobs", logprobs},     {"echo", true}};
  const std::string where = fmt::format("endpoint {}: POST /v1/completions ({}, {} prompt tokens)", url_, what, prompt.size());
  CompletionResponse c = post_completion(body, where, fmt::format("{}, {} prompt tokens", what, prompt.size()));
  const std::size_t n = prompt.size();
  if (!c.has_logprobs)
    throw EndpointProtocolError(fmt::format("{}: choices[0].logprobs is missing or null (echo with logprobs asked)", where));
  if (c.logprobs_shape != "legacy")
    throw EndpointProtocolError(fmt::format("{}: choices[0].logprobs has no token_logprobs (the {} shape holds no prompt "
                                            "log-probabilities)",
                                            where, c.logprobs_shape));
  if (c.token_logprobs.size() < n || c.token_logprobs.size() > n + 1)
    throw EndpointProtocolError(fmt::format("{}: choices[0].logprobs.token_logprobs holds {} entries, expected the {} "
                                            "prompt tokens (echo) and at most 1 generated",
                                            where, c.token_logprobs.size(), n));
  if (!c.token_ids.empty() && (c.token_ids.size() < n || !std::equal(prompt.begin(), prompt.end(), c.token_ids.begin())))
    throw EndpointProtocolError(
        fmt::format("{}: choices[0].logprobs.token_ids do not start with the prompt's {} ids (the server echoed other "
                    "tokens)",
                    where, n));
  std::vector<double> out;
  out.reserve(n > 0 ? n - 1 : 0);
  for (std::size_t i = 1; i < n; ++i) {
    if (!c.token_logprobs[i])
      throw EndpointProtocolError(
          fmt::format("{}: choices[0].logprobs.token_logprobs[{}] is null (only entry 0 may be)", where, i));
    if (*c.token_logprobs[i] > 1e-9)
      throw EndpointProtocolError(fmt::format("{}: choices[0].logprobs.token_logprobs[{}] is {}, above 0 (not a "
                                              "log-probability)",
                                              where, i, *c.token_logprobs[i]));
    out.push_back(*c.token_logprobs[i]);
  }
  return out;
}

EndpointClient::Generation EndpointClient::generate(std::span<const int32_t> prompt, int max_tokens,
                                                    std::span<const int32_t> stop_ids, const std::string& served_model,
                                                    const std::string& what, std::optional<int> logprobs) {
  const json body{{"model", served_model},
                  {"prompt", prompt},
                  {"max_tokens", max_tokens},
                  {"temperature", 0},
                  {"logprobs", logprobs ? json(*logprobs) : json(nullptr)},
                  {"stop_token_ids", stop_ids}};
  const std::string where = fmt::format("endpoint {}: POST /v1/completions ({}, {} prompt tokens)", url_, what, prompt.size());
  CompletionResponse c = post_completion(body, where, fmt::format("{}, {} prompt tokens", what, prompt.size()));
  if (c.completion_tokens && *c.completion_tokens > max_tokens + 1)
    throw EndpointProtocolError(
        fmt::format("{}: usage.completion_tokens is {}, more than the {} asked", where, *c.completion_tokens, max_tokens));
  Generation g{std::move(c.text), c.completion_tokens, false, {}};
  if (logprobs && c.has_token_ids) {
    // Only the generated tokens: posenc's token_ids without echo, llama.cpp's content[] (generated only).
    if (c.token_ids.size() > static_cast<std::size_t>(max_tokens) + 1)
      throw EndpointProtocolError(fmt::format("{}: choices[0].logprobs holds {} token ids, more than the {} asked", where,
                                              c.token_ids.size(), max_tokens));
    g.has_ids = true;
    g.ids = std::move(c.token_ids);
  }
  return g;
}

}  // namespace posenc
