// posenc — the lab over HTTP: `posenc eval --endpoint URL` evaluates a model
// served by an OpenAI-compatible engine (vLLM, SGLang, TGI, llama.cpp's
// llama-server, `posenc serve`) through the legacy completions API.
//
// Protocol (what the client sends; /work/helper-notes/contract15.md, the
// issue 15 contract, is the reference):
//  - Prompts are always token ids built with the local tokenizer, so needle
//    depths and lengths are exact in the served model's tokens. At probe time a
//    probe text goes through POST <root>/tokenize where the server has one
//    (vLLM's {"prompt"} spelling, then llama.cpp's {"content"}): ids differing
//    from the local tokenizer's are a ConfigError naming both.
//  - Generation: {"model", "prompt": [ids], "max_tokens": answer budget,
//    "temperature": 0, "logprobs": K, "stop_token_ids": [bos, eos]} with K the
//    smallest logprobs whose answer carries token ids (posenc serve 0, via
//    token_ids; llama-server 1, via content[].id), else null. With ids the
//    prediction is the ids before the first BOS/EOS, each decoded by the local
//    tokenizer after the one before (the in-process rule; llama-server neither
//    honours stop_token_ids nor stops at BOS); without, choices[0].text.
//    Either way scored by score_generation().
//  - Likelihood (forced choice, perplexity): {"model", "prompt": [ids],
//    "max_tokens": 0 or 1, "temperature": 0, "logprobs": 0 or 1, "echo": true}
//    (the smallest form the probe found to answer prompt log-probabilities);
//    the prompt tokens' log-probabilities are choices[0].logprobs.token_logprobs
//    [0 .. len(prompt) - 1] (entry 0 null). A candidate's log-probability is
//    the sum of its tokens' entries after the prompt (prompt + candidate sent
//    as one request per candidate), in token order, as score_candidates sums
//    them; a window's prediction NLLs are the negated entries 1 .. n-1.
//  - Probe at start: GET <url>/models (the served model must be listed;
//    its max_model_len, else llama.cpp's meta.n_ctx), GET <root>/version and
//    <root>/props (recorded when they answer), the tokenize check, likelihood
//    requests on a 2-token prompt (max_tokens 0/1 x logprobs 0/1): a 4xx or a
//    200 without prompt log-probabilities for every form = likelihood not
//    supported; its cells are recorded "not supported by this endpoint"
//    (n = 0), never as zeros; and generation requests for the ids.
//  - A 200 whose body is {"error": {...}} (posenc serve, after a chunked
//    start) is the server's error with its code.
//  - Retries: connection errors, 429 and 5xx, exponential backoff with full
//    jitter (uniform in [0, min(max, initial x 2^attempt)]), a Retry-After
//    header honoured (seconds, capped at 120). Other 4xx, the 5xx that say the
//    server cannot do the request at all (501, 505, 506, 508, 510, 511: the
//    same request gets the same answer) and malformed answers are not
//    retried: EndpointProtocolError. A body that is not a JSON error (an HTML
//    page) is quoted as a short printable excerpt (tags dropped, at most 120
//    characters and its size). An error body of type
//    "numeric_error" (posenc serve's answer, 500 or a 200 with code 500, when
//    the model's logits for that input are not finite: serve::numeric_error_type)
//    is not retried either: the same input overflows the same way.
//    EndpointNumericError, at once, and no breaker failure (the endpoint
//    answered). A circuit breaker stops the run after `breaker_failures`
//    consecutive requests failed after their retries: EndpointUnavailable
//    (what finished is kept; the same command resumes).
//  - A non-retried error (EndpointProtocolError, EndpointNumericError) stops
//    the run like the in-process lab's NumericError: the samples finished
//    before it are kept in the run's journal, the failed one is not written.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "posenc/error.hpp"
#include "posenc/eval.hpp"
#include "posenc/tokenizer.hpp"

namespace posenc {

/// The endpoint stayed down (connection errors, 429 or 5xx through every
/// retry, for `breaker_failures` consecutive requests; never for a
/// "numeric_error" answer: EndpointNumericError). Message: the endpoint,
/// the last error, and "resume with the same command".
class EndpointUnavailable : public IoError {
 public:
  using IoError::IoError;
};

/// The endpoint answered something the protocol does not allow (not JSON,
/// truncated JSON, a missing key, a non-number, the wrong number of
/// log-probabilities, a 4xx other than 429). Message: the endpoint, the
/// request (path, task, sample, length) and what was wrong. Never retried.
class EndpointProtocolError : public DataError {
 public:
  using DataError::DataError;
};

/// The served model's logits for a request were not finite: the server
/// answered with an error body of type "numeric_error" (posenc serve: float32
/// overflowed in its forward pass; see NumericError). A deterministic failure
/// of the model on that input, not of the endpoint: never retried and not
/// counted by the circuit breaker. Message: the endpoint, the request (path,
/// task, sample, length), "the served model produced non-finite logits", the
/// HTTP status and the server's message (which names the position and logit).
class EndpointNumericError : public NumericError {
 public:
  using NumericError::NumericError;
};

// ---------------------------------------------------------------- parsing (pure)

/// choices[0] of a /v1/completions response.
struct CompletionResponse {
  std::string text;           ///< choices[0].text
  std::string finish_reason;  ///< "" when absent or null
  bool has_logprobs = false;  ///< choices[0].logprobs is an object
  /// choices[0].logprobs.token_logprobs (natural log); nullopt for a null entry.
  std::vector<std::optional<double>> token_logprobs;
  std::vector<int32_t> token_ids;          ///< logprobs.token_ids (a posenc extension) or content[].id (llama.cpp)
  bool has_token_ids = false;              ///< the logprobs object carries token ids (token_ids or content[].id)
  std::string logprobs_shape;              ///< "legacy" (token_logprobs), "content" (llama.cpp's chat-style), ""
  std::optional<int64_t> completion_tokens;  ///< usage.completion_tokens when present
};

/// Parses a /v1/completions response body. `source` names the endpoint and
/// request in errors. Two logprobs shapes are read: the OpenAI legacy one
/// ({"tokens", "token_logprobs", "top_logprobs", "text_offset"}, plus posenc's
/// "token_ids") and llama.cpp's chat-style {"content": [{"id", "token",
/// "bytes", "logprob", ...}]} (generated tokens only). Throws DataError
/// "<source>: <key path>: <what>" for text that is not JSON (or truncated), a
/// missing "choices" or empty list, a missing or non-string "text", a logprobs
/// object with neither token_logprobs nor content, an entry that is neither a
/// finite number nor null, a token id outside int32, a negative usage count.
CompletionResponse parse_completion_response(std::string_view body, std::string_view source);

/// One entry of GET /v1/models.
struct ServedModel {
  std::string id;
  std::optional<int64_t> max_model_len;  ///< when the entry reports one (vLLM, posenc serve)
  nlohmann::json entry;                  ///< the entry as the server sent it
};

/// Parses a GET /v1/models body ({"data": [{"id": ...}, ...]}). Throws
/// DataError naming `source` and the key for a body that is not that.
std::vector<ServedModel> parse_models_response(std::string_view body, std::string_view source);

// ---------------------------------------------------------------- the client

struct EndpointOptions {
  double request_timeout = 600.0;  ///< seconds, per request (connect, read and write each)
  int retries = 4;                 ///< retries of a request after the first attempt
  double backoff_initial = 0.5;    ///< seconds: the first retry waits up to this (full jitter)
  double backoff_max = 30.0;       ///< seconds: cap of one wait
  int breaker_failures = 3;        ///< consecutive failed requests (after retries) that stop the run
  int concurrency = 1;             ///< requests in flight (one worker thread and client each)
};

/// An --endpoint value: URL[=LABEL] split. URL must be http:// or https://
/// with a host (the API base, e.g. http://127.0.0.1:8000/v1); LABEL (default
/// "default") one path component of [A-Za-z0-9._-], not "." or "..". Throws
/// ConfigError naming the flag and the value.
struct EndpointSpec {
  std::string url;    ///< without a trailing '/'
  std::string label;  ///< the value of the run's scaling axis for this endpoint
};
EndpointSpec parse_endpoint_spec(std::string_view text);

/// Counts consecutive failed requests over the workers of one endpoint.
class CircuitBreaker {
 public:
  explicit CircuitBreaker(int threshold) : threshold_(threshold < 1 ? 1 : threshold) {}
  void success();
  /// Returns true when this failure trips the breaker (threshold reached).
  bool failure(const std::string& error);
  bool tripped() const;
  std::string last_error() const;

 private:
  int threshold_;
  mutable std::mutex mu_;
  int consecutive_ = 0;
  bool tripped_ = false;
  std::string last_;
};

/// One HTTP client of an endpoint (not thread-safe: one per worker thread).
class EndpointClient {
 public:
  /// Throws ConfigError for a URL that is not http(s)://host[:port][/path].
  EndpointClient(std::string url, EndpointOptions options, std::shared_ptr<CircuitBreaker> breaker = {});
  ~EndpointClient();
  EndpointClient(const EndpointClient&) = delete;
  EndpointClient& operator=(const EndpointClient&) = delete;

  const std::string& url() const { return url_; }
  /// The server root: the URL without a trailing "/v1".
  std::string root() const;

  struct Reply {
    int status = 0;  ///< HTTP status; 0 = no answer (connection error)
    std::string body;
    std::string error;  ///< connection error text when status is 0
    std::optional<double> retry_after;  ///< seconds of a Retry-After header (429/5xx; delta-seconds form only)
  };
  /// GET root + path (no retries; the probes of optional endpoints).
  Reply get_once(const std::string& path);
  /// POST root + path, JSON body (no retries).
  Reply post_once(const std::string& path, const nlohmann::json& body);
  /// POST with the retry rules; returns a 2xx reply, or the first non-retried
  /// 4xx reply when `return_4xx` (else EndpointProtocolError). Throws
  /// EndpointNumericError at once, after one attempt and without a breaker
  /// failure, for an error body of type "numeric_error" (whatever its status);
  /// EndpointUnavailable when the retries run out (and counts a breaker
  /// failure), or at once when the breaker is already tripped.
  Reply post(const std::string& path, const nlohmann::json& body, const std::string& what, bool return_4xx = false);
  CompletionResponse post_completion(const nlohmann::json& body, const std::string& where, const std::string& what);

  /// Likelihood request: the log-probabilities of prompt tokens 1..n-1 given
  /// the tokens before (nats; [n - 1]). `what` names the request in errors.
  /// Throws EndpointProtocolError (wrong count, null or non-number entries,
  /// 4xx), EndpointNumericError (the served model's logits were not finite),
  /// EndpointUnavailable.
  /// `max_tokens` (0 where the server allows it with echo, else 1) and `logprobs` (the smallest top-k the
  /// server answers prompt log-probabilities for) come from the probe.
  std::vector<double> prompt_logprobs(std::span<const int32_t> prompt, const std::string& served_model,
                                      const std::string& what, int max_tokens = 1, int logprobs = 1);

  struct Generation {
    std::string text;
    std::optional<int64_t> completion_tokens;
    bool has_ids = false;        ///< the answer carried the generated tokens' ids
    std::vector<int32_t> ids;    ///< the generated tokens' ids (as the server sent them, not cut)
  };
  /// Greedy generation of at most max_tokens (stop_token_ids = stop_ids).
  /// Throws as prompt_logprobs.
  /// `logprobs` (nullopt = null) asks for the generated tokens' ids where the server gives them with
  /// logprobs (posenc serve's token_ids, llama.cpp's content[].id).
  Generation generate(std::span<const int32_t> prompt, int max_tokens, std::span<const int32_t> stop_ids,
                      const std::string& served_model, const std::string& what, std::optional<int> logprobs = {});

  /// The requests this client sent (attempts included).
  int64_t requests_sent() const { return sent_; }

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
  std::string url_;
  EndpointOptions options_;
  std::shared_ptr<CircuitBreaker> breaker_;
  int64_t sent_ = 0;
};

/// What the probe found at one endpoint (run.json "endpoints").
struct EndpointInfo {
  EndpointSpec spec;
  std::string served_model;
  nlohmann::json model_entry;                  ///< its /v1/models entry
  std::optional<int64_t> max_model_len;        ///< /v1/models max_model_len, else /props n_ctx
  std::string max_model_len_source;            ///< "/v1/models", "/props default_generation_settings.n_ctx", ""
  nlohmann::json version;                      ///< GET /version body, or null
  nlohmann::json props;                        ///< GET /props body (llama.cpp), or null
  bool likelihood = false;                     ///< prompt log-probabilities (echo + logprobs) work
  std::string likelihood_note;                 ///< why not, when not
  int likelihood_max_tokens = 1;               ///< max_tokens of a likelihood request (0 where echo allows it)
  int likelihood_logprobs = 1;                 ///< logprobs (top-k) of a likelihood request: the smallest that works
  std::optional<int> generation_logprobs;      ///< logprobs of a generation request: the smallest giving token ids
  std::string prediction_rule;                 ///< "token ids (cut at BOS/EOS, local decode)" or "server text"
  std::string tokenize_check;                  ///< "matched (/tokenize)", "no /tokenize", ...
};

/// Probes `spec` (see the file comment). `served_model` empty = the only
/// model /v1/models lists. Throws EndpointUnavailable when /v1/models does
/// not answer, EndpointProtocolError for a malformed answer,
/// EndpointNumericError when the model's logits for the 2-token probe prompt
/// are not finite, ConfigError when
/// the served model is not listed or several are and none was named (listing
/// them), or when /tokenize disagrees with `tokenizer` (naming both id lists).
EndpointInfo probe_endpoint(const EndpointSpec& spec, const std::string& served_model, const Tokenizer& tokenizer,
                            const EndpointOptions& options);

/// `posenc eval --endpoint`: the endpoints, one per label (the run's scaling
/// axis), serving one model.
struct EndpointEvalConfig {
  std::vector<EndpointSpec> endpoints;
  std::string served_model;                ///< empty = the only one listed
  EndpointOptions options;
  std::optional<int64_t> trained_context;  ///< --trained-context; else the first endpoint's max_model_len
};

/// Runs (or resumes) an evaluation whose forwards are served by the
/// endpoints: run_eval's cells, resume, shards, outputs and merge, with
/// config.rope_scalings set to the endpoints' labels (in order) and
/// config.model_path ignored. Lengths left empty follow
/// default lengths of the trained context. Per group a journal
/// (<run dir>/journal/<group>.jsonl, one checksummed JSON line per finished
/// sample index with every depth's raw result) is appended before more work is
/// dispatched; resumed, its samples are not re-sent; removed once the group's
/// cells are written. Cells of a length whose requests exceed an endpoint's
/// max_model_len are "does not fit" (the note names the limit); likelihood
/// cells and perplexity results of an endpoint without prompt
/// log-probabilities are "not supported by this endpoint". The run id hashes
/// the served model and its reported /v1/models entry (without "created") and
/// /version, the labels, the likelihood support, max_model_len, the
/// tokenizer's and haystack's contents and every axis, never the URLs.
/// Throws as run_eval, and EndpointUnavailable / EndpointProtocolError /
/// EndpointNumericError / ConfigError as probe_endpoint and the client (a
/// non-retried error stops the run; the finished samples stay journaled).
EvalRunResult run_eval_endpoint(const EndpointEvalConfig& endpoints, const Tokenizer& tokenizer,
                                std::string_view haystack_text, EvalConfig config,
                                const std::function<void(const EvalProgress&)>& on_progress = {});

}  // namespace posenc
