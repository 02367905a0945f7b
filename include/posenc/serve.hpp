// posenc — `posenc serve`: the runtime behind an OpenAI-compatible HTTP API
// (legacy completions, as vLLM serves it, plus llama.cpp's tokenize spellings).
//
// Endpoints (base http://HOST:PORT): GET /health, GET /version, GET /v1/models,
// POST /v1/completions, POST /tokenize, POST /detokenize, GET /metrics
// (Prometheus text exposition 0.0.4). The wire format is the contract of issue
// 15 (see README "Serving a model").
//
// Continuous batching: one scheduler thread owns the paged KV cache. Every step
// gathers each active sequence's next work — a prefill chunk of a newly admitted
// request or one decode token of a running one — into ONE ragged
// Model::forward batch, then samples per sequence, finishes sequences that
// stopped and admits queued requests. Finished sequences are kept (bounded, LRU)
// as a prefix cache: a new request forks the cached sequence with the longest
// common prefix (KvCache::fork shares its blocks, KvCache::evict cuts the fork
// to the common prefix) and computes only the rest.
//
// Exactness: a completion's tokens and log-probabilities equal those of the
// in-process forward of the same request (Model::forward of the prompt alone,
// then one token at a time, detail::log_prob / detail::argmax of its rows),
// whatever else shares its steps and whatever the prefix cache holds. This
// rests on the runtime's batch invariance (a sequence's logits rows are bit for
// bit the same alone, in a ragged batch, from a fork cut to a prefix, in chunks
// or token by token: tests/serve/batch_invariance_test.cpp measures it on every
// fixture model) and on per-request sampling state.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "posenc/error.hpp"
#include "posenc/model.hpp"
#include "posenc/tokenizer.hpp"

namespace posenc::serve {

/// The "type" of a NumericError's error body: {"error": {"message", "type": "numeric_error", "param": null,
/// "code": 500}}. The request was well-formed, but the model's logits for it were not finite (float32 overflowed
/// in the forward pass; see posenc::NumericError): a deterministic failure of the model on that input, so a client
/// should not retry it (posenc's endpoint client does not: EndpointNumericError). Other failures of the server
/// are type "server_error" (500; retrying may help), refusals of the request "invalid_request_error" (400, 408,
/// 411, 413), "model_not_found" (404) and "service_unavailable" (503 with Retry-After).
inline constexpr std::string_view numeric_error_type = "numeric_error";

/// A request the server refuses: HTTP `status` (400, 404, 503, ...) with the
/// OpenAI error body {"error": {"message", "type", "param", "code"}}. `param`
/// names the offending field ("" = none: null in the body). The message names
/// the field and the bad value, or the limit that was passed.
class RequestError : public InvalidArgument {
 public:
  RequestError(int status, std::string type, std::string param, const std::string& message)
      : InvalidArgument(message), status_(status), type_(std::move(type)), param_(std::move(param)) {}
  int status() const { return status_; }
  const std::string& type() const { return type_; }   ///< "invalid_request_error", "model_not_found", ...
  const std::string& param() const { return param_; }

 private:
  int status_;
  std::string type_;
  std::string param_;
};

/// What a /v1/completions body may ask for, validated (parse_completion_request).
struct CompletionRequest {
  std::optional<std::string> model;  ///< if given, must equal the served model name (checked by the server: 404)
  /// The prompt: text (tokenized by the server with the tokenizer's special tokens, as vLLM does:
  /// Tokenizer::encode_hf(text, true)) or token ids (each in [0, vocab_size)).
  std::variant<std::string, std::vector<int32_t>> prompt;
  /// New tokens to generate; nullopt = not given (16, or fewer where the allowed context ends).
  std::optional<int64_t> max_tokens;
  double temperature = 1.0;  ///< >= 0; 0 = greedy (detail::argmax: lowest id on ties)
  double top_p = 1.0;        ///< (0, 1]
  std::optional<uint64_t> seed;  ///< sampling seed; nullopt = a random one (std::random_device)
  std::vector<std::string> stop;           ///< <= 4 non-empty stop strings
  std::vector<int32_t> stop_token_ids;     ///< vLLM extension; ids in [0, vocab_size)
  std::optional<int> logprobs;             ///< nullopt = no logprobs; 0..20 top alternatives per token
  bool echo = false;                       ///< return the prompt's tokens (and logprobs) first
};

/// Limits parse_completion_request checks against.
struct RequestLimits {
  int vocab_size = 0;                       ///< token ids must be in [0, vocab_size)
  int64_t max_model_len = 0;                ///< max_tokens may not exceed it
  std::size_t max_request_bytes = 4 << 20;  ///< a longer body is refused before parsing
};

/// Parses and validates a /v1/completions JSON body (no tokenization, no model
/// needed: a pure function, fuzzed by fuzz/serve_request_fuzz.cpp). Throws
/// RequestError with status 413 for a body over max_request_bytes, and with
/// status 400 (`param` = the field) for malformed JSON, a body that is not an object, an unknown
/// field, a wrong type or a value out of range (negative max_tokens, max_tokens
/// 0 without echo, temperature < 0, top_p outside (0, 1], logprobs outside
/// 0..20, more than 4 stop strings, a token id outside [0, vocab_size), n != 1,
/// stream true, best_of != 1, penalties != 0, a logit_bias, a suffix, a batch
/// of prompts: "one prompt per request").
CompletionRequest parse_completion_request(std::string_view body, const RequestLimits& limits);

/// Server configuration. validate() is called by Server's constructor.
struct ServeConfig {
  std::string host = "127.0.0.1";  ///< loopback by default; a literal IPv4/IPv6 address or a resolvable name
  int port = 8000;                 ///< 0 = any free port (Server::start returns the bound one)
  std::string served_model_name;   ///< "" = the model path's file or directory name (ModelSource::path)
  int64_t max_model_len = 0;       ///< allowed context (prompt + generated tokens); 0 = model.trained_context()
  int max_batch = 16;              ///< sequences per step (running requests)
  int max_queue = 64;              ///< requests waiting for a batch slot; one more gets 503 + Retry-After
  int retry_after_seconds = 1;     ///< the Retry-After of a 503
  std::size_t max_request_bytes = 4 << 20;  ///< a longer request body is a 413 naming the limit
  int64_t max_step_tokens = 512;   ///< tokens per forward step (prefill chunks share it; decodes come first)
  int block_size = 16;             ///< KV cache block (tokens)
  /// KV cache budget in tokens (blocks of block_size); 0 = (max_batch + 4) * max_model_len. Requests wait for
  /// room (their prompt + max_tokens is reserved at admission), so the pool never runs out mid-request.
  int64_t kv_cache_tokens = 0;
  int prefix_cache_entries = 16;   ///< finished sequences kept for prefix reuse (LRU); 0 = no prefix reuse
  int threads = 0;                 ///< OpenMP threads of the forward steps; 0 = the OpenMP default (all cores)
  /// Most HTTP connections served at once: each holds a connection thread while it is open (threads start on
  /// demand and end after keep_alive_timeout unused); 0 = max(1024, max_batch + max_queue + 8). With every one
  /// taken, a new connection closes the open connection that has waited longest for its next request (an idle
  /// keep-alive connection, which a client must expect to be closed: RFC 9112 9.3.1) and is served at once;
  /// when none is waiting it waits for a thread.
  int http_threads = 0;
  /// How long a read of a request (head or body) may wait for the next bytes: a client that stops sending in the
  /// middle of a request is answered 408 after it. A POST without Content-Length (and not chunked) is 411 at once.
  std::chrono::milliseconds read_timeout{5000};
  /// How long a connection may wait with no request in progress (before its first request, between keep-alive
  /// requests) before it is closed.
  std::chrono::milliseconds keep_alive_timeout{5000};
  std::string version = "unknown";     ///< GET /version
  std::string git_commit = "unknown";  ///< GET /version
  /// Testing and benchmarks only: the scheduler sleeps this long after every step (makes requests slow enough to
  /// fill a queue or to disconnect from in a test). Not a CLI option.
  std::chrono::milliseconds step_delay{0};
  /// Throws ConfigError naming the field for a value out of range (a host that is neither a literal IPv4/IPv6
  /// address nor a resolvable name, port outside [0, 65535], max_batch < 1,
  /// max_queue < 0, max_model_len past a learned position table, a KV budget below one max_model_len sequence).
  void validate(const Model& model) const;
};

/// Counters the tests and /metrics read (a snapshot).
struct ServerStats {
  int64_t queue_depth = 0;
  int64_t running_sequences = 0;
  int64_t requests_completed = 0;        ///< completions answered 200
  int64_t requests_cancelled = 0;        ///< clients that left before their answer (sequence freed)
  int64_t prompt_tokens = 0;             ///< prompt tokens of admitted requests
  int64_t computed_prompt_tokens = 0;    ///< ... of which the forward computed (the rest came from the prefix cache)
  int64_t prefix_cache_hits = 0;         ///< requests that started from a cached prefix
  int64_t generation_tokens = 0;
  int64_t steps = 0;                     ///< forward steps run
  int64_t max_sequences_in_a_step = 0;   ///< the most sequences one forward step carried
  int64_t kv_blocks_in_use = 0;
  int64_t prefix_cache_sequences = 0;
  int64_t http_connections = 0;          ///< connections open and served (each holds a connection thread)
  int64_t http_threads = 0;              ///< connection threads alive
};

/// The HTTP server (cpp-httplib) and its scheduler. Owns copies of the model
/// (weights are shared) and the tokenizer.
class Server {
 public:
  /// Throws ConfigError (ServeConfig::validate), TokenizerError when the tokenizer's vocabulary is not the
  /// model's or it cannot encode.
  Server(Model model, Tokenizer tokenizer, ServeConfig config);
  ~Server();  ///< stop()
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;

  /// Binds host:port and serves on background threads; returns the bound port. Throws IoError naming the
  /// address when it cannot bind. Call once.
  int start();
  /// Stops accepting work (/health answers 503 "draining", new completions 503), finishes every queued and
  /// running request, delivers their answers, then stops the HTTP server and joins its threads. Idempotent.
  void stop();
  /// Blocks until stop() has completed (from another thread, e.g. a signal watcher).
  void wait();

  int port() const;
  const std::string& served_model_name() const;
  int64_t max_model_len() const;
  ServerStats stats() const;
  /// The /metrics text.
  std::string metrics_text() const;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace posenc::serve
