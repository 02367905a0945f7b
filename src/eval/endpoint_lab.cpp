// eval --endpoint: probing the servers, the per-group worker pool with its
// journal, the perplexity windows over HTTP, and run_eval_endpoint.
#include "eval/endpoint_lab.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <deque>
#include <exception>
#include <map>
#include <mutex>
#include <set>
#include <thread>

#include <fmt/format.h>

#include "eval/rng.hpp"
#include "posenc/checked.hpp"
#include "posenc/io.hpp"
#include "posenc/json_file.hpp"

namespace posenc {

using detail::eval_warn;
using detail::hex16;

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

std::string prompt_hash(std::span<const int32_t> ids) {
  return hex16(detail::fnv1a64(
      std::string_view(reinterpret_cast<const char*>(ids.data()), ids.size() * sizeof(int32_t))));
}

// The text the probe tokenizes locally and through /tokenize.
constexpr std::string_view kProbeText = "Once upon a time, Lily found 7 red keys under the old tree.";

// The probe text for `tokenizer`: kProbeText, or for a symbol vocabulary (a `posenc train` model knows only its
// task's symbols, and encoding an English word is a TokenizerError) a sentence of its own first symbols (at most
// 12, not <pad>/<bos>/<eos>), so the probe checks the server's tokenizer on text this one can encode.
std::string probe_text(const Tokenizer& tokenizer) {
  if (!tokenizer.is_symbolic()) return std::string(kProbeText);
  std::string s;
  for (int32_t id = 3, n = 0; id < tokenizer.vocab_size() && n < 12; ++id, ++n) {
    if (!s.empty()) s += ' ';
    s += tokenizer.piece(id);
  }
  return s;
}

std::string error_message_of_body(const std::string& body) {
  try {
    const json j = json::parse(body);
    if (j.is_object() && j.contains("error") && j["error"].is_object() && j["error"].contains("message") &&
        j["error"]["message"].is_string())
      return j["error"]["message"].get<std::string>();
  } catch (const json::exception&) {
  }
  return body.substr(0, 200);
}

std::string shown_ids(const std::vector<int32_t>& ids) {
  std::string s = "[";
  for (std::size_t i = 0; i < ids.size() && i < 24; ++i) {  // two appends: g++ 12 -Wrestrict misreads "," + string
    if (i) s += ',';
    s += std::to_string(ids[i]);
  }
  if (ids.size() > 24) s += ",...";
  return s + "]";
}

// ---- the journal ----
//
// <run dir>/journal/<unit>.jsonl: one line per finished item (a group's
// sample index, a perplexity window): {"i": index, "d": data, "checksum":
// "fnv1a64:..."} with the checksum of eval_file_checksum (the line's JSON
// without "checksum"). Lines are appended with one write(2) each, before
// more work is dispatched: a killed process (or a dead server) loses at most
// the items in flight. Read back, a line that does not parse or whose
// checksum does not match (a torn last line) is dropped, and the file is
// rewritten without it.
class Journal {
 public:
  /// Loads the journal's valid lines (index -> data) that `accept` accepts, and opens it for appending.
  Journal(fs::path path, const std::function<bool(int64_t, const json&)>& accept) : path_(std::move(path)) {
    std::error_code ec;
    fs::create_directories(path_.parent_path(), ec);
    bool rewrite = false;
    if (fs::exists(path_, ec)) {
      const std::string text = read_file(path_);
      std::size_t pos = 0;
      while (pos < text.size()) {
        std::size_t nl = text.find('\n', pos);
        const bool torn = nl == std::string::npos;
        const std::string_view line(text.data() + pos, (torn ? text.size() : nl) - pos);
        pos = torn ? text.size() : nl + 1;
        bool ok = false;
        try {
          const json j = json::parse(line);
          if (!torn && j.is_object() && j.contains("i") && j["i"].is_number_integer() && j.contains("d") &&
              j.contains("checksum") && j["checksum"].is_string() &&
              j["checksum"].get<std::string>() == eval_file_checksum(j)) {
            const int64_t i = j["i"].get<int64_t>();
            if (accept(i, j["d"]) && !items_.count(i)) {
              items_.emplace(i, j["d"]);
              ok = true;
            }
          }
        } catch (const json::exception&) {
        }
        if (!ok) {
          rewrite = true;
          if (!torn || !line.empty())
            eval_warn(fmt::format("{}: dropped a {} journal line (it is recomputed)", path_.string(),
                                  torn ? "torn (incomplete) last" : "damaged or stale"));
        }
      }
    }
    if (rewrite) {
      std::string keep;
      for (const auto& [i, d] : items_) keep += line_of(i, d);
      write_file_atomic(path_, keep);
    }
    fd_ = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
    if (fd_ < 0) throw IoError(fmt::format("{}: cannot open the journal for appending ({})", path_.string(), std::strerror(errno)));
  }
  ~Journal() {
    if (fd_ >= 0) ::close(fd_);
  }
  Journal(const Journal&) = delete;
  Journal& operator=(const Journal&) = delete;

  const std::map<int64_t, json>& items() const { return items_; }

  void append(int64_t i, const json& d) {
    const std::string line = line_of(i, d);
    std::size_t off = 0;
    while (off < line.size()) {
      const ssize_t w = ::write(fd_, line.data() + off, line.size() - off);
      if (w < 0) {
        if (errno == EINTR) continue;
        throw IoError(fmt::format("{}: cannot append to the journal ({})", path_.string(), std::strerror(errno)));
      }
      off += static_cast<std::size_t>(w);
    }
  }

 private:
  static std::string line_of(int64_t i, const json& d) {
    json j{{"i", i}, {"d", d}};
    j["checksum"] = eval_file_checksum(j);
    return j.dump(-1, ' ', false, json::error_handler_t::replace) + "\n";
  }
  fs::path path_;
  int fd_ = -1;
  std::map<int64_t, json> items_;
};

// ---- the worker pool ----
//
// Items 0..n-1 are handed to `concurrency` workers, each with its own client;
// a worker journals its item before it takes the next, so at most
// `concurrency` items are in flight. An item whose request failed through all
// its retries goes back to the queue unless the breaker tripped; a protocol
// error, the served model's non-finite logits (EndpointNumericError: not
// retried, no breaker failure; as the in-process lab stops at a NumericError)
// or any other error stops every worker; the first error is rethrown once they
// are joined.
void run_pool(const std::string& url, const EndpointOptions& opt, std::vector<int64_t> todo,
              const std::function<json(EndpointClient&, int64_t)>& compute,
              const std::function<void(int64_t, json)>& finished, const std::string& unit, int64_t total) {
  if (todo.empty()) return;
  auto breaker = std::make_shared<CircuitBreaker>(opt.breaker_failures);
  std::mutex mu;
  std::deque<int64_t> queue(todo.begin(), todo.end());
  std::exception_ptr error;
  bool unavailable = false;
  std::string unavailable_msg;
  int64_t done = 0;
  auto worker = [&] {
    EndpointClient client(url, opt, breaker);
    for (;;) {
      int64_t i;
      {
        std::lock_guard lock(mu);
        if (error || unavailable || queue.empty()) return;
        i = queue.front();
        queue.pop_front();
      }
      try {
        json d = compute(client, i);
        std::lock_guard lock(mu);
        finished(i, std::move(d));
        ++done;
      } catch (const EndpointUnavailable& e) {
        std::lock_guard lock(mu);
        if (breaker->tripped()) {
          if (!unavailable) unavailable_msg = e.what();
          unavailable = true;
        }
        queue.push_back(i);  // sent again later (or by the resumed run)
      } catch (...) {
        std::lock_guard lock(mu);
        if (!error) error = std::current_exception();
      }
    }
  };
  const std::size_t workers = std::min<std::size_t>(static_cast<std::size_t>(std::max(1, opt.concurrency)), todo.size());
  if (workers == 1) {
    worker();
  } else {
    std::vector<std::thread> threads;
    for (std::size_t w = 0; w < workers; ++w) threads.emplace_back([&] {
      try {
        worker();
      } catch (...) {
        std::lock_guard lock(mu);
        if (!error) error = std::current_exception();
      }
    });
    for (auto& t : threads) t.join();
  }
  if (error) std::rethrow_exception(error);
  if (unavailable)
    throw EndpointUnavailable(fmt::format(
        "endpoint {} is unavailable: {} consecutive requests failed after {} retries each (last error: {}; last "
        "request: {}); {} of {} items of {} are finished and kept (journal and cells); resume with the same command "
        "once the endpoint answers",
        url, opt.breaker_failures, opt.retries, breaker->last_error(), unavailable_msg,
        total - static_cast<int64_t>(queue.size()), total, unit));
}

}  // namespace

// ---------------------------------------------------------------- probe

EndpointInfo probe_endpoint(const EndpointSpec& spec, const std::string& served_model, const Tokenizer& tokenizer,
                            const EndpointOptions& options) {
  EndpointInfo info;
  info.spec = spec;
  EndpointClient client(spec.url, options);
  // GET /v1/models, with the retry rules (a server still starting up).
  EndpointClient::Reply models;
  std::string last;
  for (int attempt = 0; attempt <= std::max(0, options.retries); ++attempt) {
    models = client.get_once("/v1/models");
    if (models.status == 200) break;
    last = models.status == 0 ? "connection error: " + models.error : fmt::format("HTTP {}", models.status);
    if (models.status >= 400 && models.status < 500 && models.status != 429)
      throw EndpointProtocolError(fmt::format("endpoint {}: GET /v1/models: HTTP {} (is the URL the API base, e.g. "
                                              "http://host:port/v1?)",
                                              spec.url, models.status));
    if (attempt < options.retries)
      std::this_thread::sleep_for(std::chrono::duration<double>(
          std::min(options.backoff_max, options.backoff_initial * static_cast<double>(1 << std::min(attempt, 20)))));
  }
  if (models.status != 200)
    throw EndpointUnavailable(fmt::format("endpoint {}: GET /v1/models: no answer after {} attempts (last error: {}); "
                                          "is the server running? resume with the same command once it answers",
                                          spec.url, options.retries + 1, last));
  std::vector<ServedModel> listed;
  try {
    listed = parse_models_response(models.body, fmt::format("endpoint {}: GET /v1/models", spec.url));
  } catch (const DataError& e) {
    throw EndpointProtocolError(e.what());
  }
  std::string names;
  for (const auto& m : listed) names += (names.empty() ? "" : ", ") + m.id;
  const ServedModel* chosen = nullptr;
  if (served_model.empty()) {
    if (listed.size() != 1)
      throw ConfigError(fmt::format("--served-model: endpoint {} serves {} models ({}); name one", spec.url,
                                    listed.size(), names.empty() ? "none" : names));
    chosen = &listed[0];
  } else {
    for (const auto& m : listed)
      if (m.id == served_model) chosen = &m;
    if (!chosen)
      throw ConfigError(fmt::format("--served-model: endpoint {} does not serve '{}' (it lists: {})", spec.url,
                                    served_model, names.empty() ? "none" : names));
  }
  info.served_model = chosen->id;
  info.model_entry = chosen->entry;
  if (chosen->max_model_len) {
    info.max_model_len = chosen->max_model_len;
    info.max_model_len_source = "/v1/models max_model_len";
  }
  // Optional probes: recorded when they answer JSON.
  auto optional_json = [&](const std::string& path) {
    const auto r = client.get_once(path);
    if (r.status != 200) return json(nullptr);
    try {
      return json::parse(r.body);
    } catch (const json::exception&) {
      return json(nullptr);
    }
  };
  if (!info.max_model_len && info.model_entry.is_object() && info.model_entry.contains("meta") &&
      info.model_entry["meta"].is_object() && info.model_entry["meta"].contains("n_ctx") &&
      info.model_entry["meta"]["n_ctx"].is_number_integer() && info.model_entry["meta"]["n_ctx"].get<int64_t>() > 0) {
    // llama-server: the per-slot context (-c / -np).
    info.max_model_len = info.model_entry["meta"]["n_ctx"].get<int64_t>();
    info.max_model_len_source = "/v1/models meta.n_ctx";
  }
  info.version = optional_json("/version");
  info.props = optional_json("/props");
  if (!info.max_model_len && info.props.is_object() && info.props.contains("default_generation_settings")) {
    const json& d = info.props["default_generation_settings"];
    if (d.is_object() && d.contains("n_ctx") && d["n_ctx"].is_number_integer() && d["n_ctx"].get<int64_t>() > 0) {
      info.max_model_len = d["n_ctx"].get<int64_t>();
      info.max_model_len_source = "/props default_generation_settings.n_ctx";
    }
  }
  // The tokenizer check: the probe text's ids through /tokenize (vLLM's spelling, then llama.cpp's).
  const std::string probe = probe_text(tokenizer);
  std::vector<int32_t> local, two;
  try {
    local = tokenizer.encode(probe, false, false);
    two = tokenizer.encode(probe, true, false);
  } catch (const Error& e) {
    throw ConfigError(fmt::format("--tokenizer: cannot encode the endpoint probe text \"{}\" ({})", probe, e.what()));
  }
  info.tokenize_check = "no /tokenize (not checked)";
  // llama.cpp's spelling first: llama-server answers {"prompt"} with 200 and no tokens. An empty list for the
  // non-empty probe text means the spelling was not understood: the next one is tried.
  for (const json& body : {json{{"content", probe}, {"add_special", false}},
                           json{{"prompt", probe}, {"add_special_tokens", false}}}) {
    const auto r = client.post_once("/tokenize", body);
    if (r.status != 200) continue;
    std::vector<int32_t> remote;
    try {
      const json j = json::parse(r.body);
      if (!j.is_object() || !j.contains("tokens") || !j["tokens"].is_array()) continue;
      bool ints = true;
      for (const json& t : j["tokens"]) {
        if (t.is_number_integer()) remote.push_back(t.get<int32_t>());
        else if (t.is_object() && t.contains("id") && t["id"].is_number_integer()) remote.push_back(t["id"].get<int32_t>());
        else ints = false;
      }
      if (!ints || remote.empty()) continue;
    } catch (const json::exception&) {
      continue;
    }
    if (remote != local)
      throw ConfigError(fmt::format("--tokenizer: endpoint {} tokenizes the probe text \"{}\" as {} (/tokenize, {}), "
                                    "the local tokenizer as {}: pass the served model's tokenizer",
                                    spec.url, probe, shown_ids(remote), body.contains("prompt") ? "prompt" : "content",
                                    shown_ids(local)));
    info.tokenize_check = fmt::format("matched ({} ids of the probe text, /tokenize {{\"{}\"}})", local.size(),
                                      body.contains("prompt") ? "prompt" : "content");
    break;
  }
  // The likelihood probe: echo + logprobs on a 2-token prompt, smallest request first: max_tokens 0 (so that a
  // sequence of max_model_len tokens fits; posenc serve and vLLM allow it with echo) and logprobs 0 (the chosen
  // token's log-probability only: the smallest answer), then max_tokens 1 and logprobs 1. The first answer that
  // holds the prompt's log-probabilities sets the likelihood requests. A 4xx, or a 200 without them (llama-server
  // ignores echo), for every form = not supported.
  two.resize(2, two.empty() ? 0 : two.back());
  std::vector<std::string> notes;
  for (const auto& [mt, k] : {std::pair{0, 0}, std::pair{1, 0}, std::pair{0, 1}, std::pair{1, 1}}) {
    const json body{{"model", info.served_model}, {"prompt", two}, {"max_tokens", mt},
                    {"temperature", 0},           {"logprobs", k}, {"echo", true}};
    const auto r = client.post("/v1/completions", body, "likelihood probe, 2 prompt tokens", true);
    const std::string form = fmt::format("max_tokens {}, logprobs {}", mt, k);
    if (r.status >= 400) {
      notes.push_back(fmt::format("{}: HTTP {} {}", form, r.status, json(error_message_of_body(r.body)).dump()));
      continue;
    }
    CompletionResponse c;
    try {
      c = parse_completion_response(r.body, fmt::format("endpoint {}: POST /v1/completions (likelihood probe)", spec.url));
    } catch (const DataError& e) {
      throw EndpointProtocolError(e.what());
    }
    if (!c.has_logprobs) {
      notes.push_back(fmt::format("{}: the answer has no logprobs", form));
    } else if (c.logprobs_shape != "legacy" || c.token_logprobs.size() < 2 || !c.token_logprobs[1] ||
               (c.has_token_ids && (c.token_ids.size() < 2 || c.token_ids[0] != two[0] || c.token_ids[1] != two[1]))) {
      notes.push_back(fmt::format("{}: HTTP 200 without prompt log-probabilities ({} logprobs shape, {} entries: echo "
                                  "ignored)",
                                  form, c.logprobs_shape, c.token_logprobs.size()));
    } else {
      info.likelihood = true;
      info.likelihood_max_tokens = mt;
      info.likelihood_logprobs = k;
      break;
    }
  }
  if (!info.likelihood) {
    std::string joined;
    for (const auto& n : notes) joined += (joined.empty() ? "" : "; ") + n;
    info.likelihood_note = "echo with logprobs gives no prompt log-probabilities (" + joined + ")";
  }
  // The generation probe: the smallest logprobs whose answer carries the generated tokens' ids (posenc serve's
  // token_ids, llama.cpp's content[].id). With ids the lab applies its own stop rule (cut at the first BOS/EOS,
  // which servers without stop_token_ids, like llama-server, do not stop at) and decodes them with the local
  // tokenizer as the in-process lab does; without, the prediction is the server's text.
  info.prediction_rule = "server text (choices[0].text)";
  for (const int k : {0, 1}) {
    const json body{{"model", info.served_model}, {"prompt", two}, {"max_tokens", 2}, {"temperature", 0}, {"logprobs", k}};
    const auto r = client.post("/v1/completions", body, "generation probe, 2 prompt tokens", true);
    if (r.status >= 400) continue;
    try {
      const CompletionResponse c =
          parse_completion_response(r.body, fmt::format("endpoint {}: POST /v1/completions (generation probe)", spec.url));
      if (c.has_token_ids) {
        info.generation_logprobs = k;
        info.prediction_rule = "token ids (cut at the first BOS/EOS, decoded by the local tokenizer)";
        break;
      }
    } catch (const DataError& e) {
      throw EndpointProtocolError(e.what());
    }
  }
  return info;
}

// ---------------------------------------------------------------- the lab

struct detail::EndpointLab::Impl {
  EndpointEvalConfig config;
  const Tokenizer* tokenizer = nullptr;
  std::vector<EndpointInfo> infos;
  std::vector<int32_t> stop_ids;

  const EndpointInfo& by_label(const std::string& label) const {
    for (const auto& i : infos)
      if (i.spec.label == label) return i;
    throw InvalidArgument(fmt::format("endpoint label '{}' is not one of the run's", label));
  }
};

detail::EndpointLab::EndpointLab(const EndpointEvalConfig& config, const Tokenizer& tokenizer)
    : impl_(std::make_unique<Impl>()) {
  impl_->config = config;
  impl_->tokenizer = &tokenizer;
  if (config.endpoints.empty()) throw ConfigError("--endpoint: at least one endpoint is required");
  {
    std::set<std::string> labels;
    for (const auto& e : config.endpoints)
      if (!labels.insert(e.label).second)
        throw ConfigError(fmt::format("--endpoint: label '{}' given twice (each endpoint needs its own label: "
                                      "--endpoint URL=LABEL)",
                                      e.label));
  }
  if (config.options.concurrency < 1) fail_field<ConfigError>("--concurrency", "must be >= 1", config.options.concurrency);
  if (config.options.retries < 0) fail_field<ConfigError>("--retries", "must be >= 0", config.options.retries);
  if (!(config.options.request_timeout > 0))
    fail_field<ConfigError>("--request-timeout", "must be > 0 seconds", config.options.request_timeout);
  for (const auto& e : config.endpoints)
    impl_->infos.push_back(probe_endpoint(e, config.served_model, tokenizer, config.options));
  const std::string& first = impl_->infos.front().served_model;
  for (const auto& i : impl_->infos)
    if (i.served_model != first)
      throw ConfigError(fmt::format("--endpoint: endpoint {} serves '{}', endpoint {} serves '{}': one run compares "
                                    "servers of one model (name it with --served-model)",
                                    impl_->infos.front().spec.url, first, i.spec.url, i.served_model));
  if (tokenizer.bos_id()) impl_->stop_ids.push_back(*tokenizer.bos_id());
  if (tokenizer.eos_id()) impl_->stop_ids.push_back(*tokenizer.eos_id());
  if (config.trained_context) {
    trained_ = *config.trained_context;
    trained_source_ = "--trained-context";
  } else if (const json& e = impl_->infos.front().model_entry;
             e.is_object() && e.contains("posenc") && e["posenc"].is_object() && e["posenc"].contains("trained_context") &&
             e["posenc"]["trained_context"].is_number_integer() && e["posenc"]["trained_context"].get<int64_t>() > 0) {
    // The server says what its model was trained with (posenc serve): lengths and buckets follow that, as they
    // do in-process, not the context the server was started to allow.
    trained_ = e["posenc"]["trained_context"].get<int64_t>();
    trained_source_ = fmt::format("/v1/models posenc.trained_context of endpoint {}", impl_->infos.front().spec.label);
  } else if (impl_->infos.front().max_model_len) {
    trained_ = *impl_->infos.front().max_model_len;
    trained_source_ = fmt::format("max_model_len of endpoint {} ({})", impl_->infos.front().spec.label,
                                  impl_->infos.front().max_model_len_source);
  } else {
    throw ConfigError(fmt::format("--trained-context: endpoint {} reports no max_model_len; give the served model's "
                                  "trained context (default lengths and perplexity buckets follow it)",
                                  impl_->infos.front().spec.url));
  }
}

detail::EndpointLab::~EndpointLab() = default;

json detail::EndpointLab::run_id_material() const {
  json a = json::array();
  for (const auto& i : impl_->infos) {
    json entry = i.model_entry;
    if (entry.is_object()) entry.erase("created");  // a timestamp of the server's start, not of the model
    a.push_back({{"label", i.spec.label},
                 {"served_model", i.served_model},
                 {"model_entry", entry},
                 {"version", i.version},
                 {"likelihood", i.likelihood},
                 {"likelihood_max_tokens", i.likelihood_max_tokens},
                 {"prediction_rule", i.prediction_rule},
                 {"max_model_len", i.max_model_len ? json(*i.max_model_len) : json(nullptr)}});
  }
  return {{"endpoints", a}, {"trained_context", trained_}};
}

json detail::EndpointLab::endpoints_json() const {
  json a = json::array();
  for (const auto& i : impl_->infos)
    a.push_back({{"url", i.spec.url},
                 {"label", i.spec.label},
                 {"served_model", i.served_model},
                 {"model_entry", i.model_entry},
                 {"max_model_len", i.max_model_len ? json(*i.max_model_len) : json(nullptr)},
                 {"max_model_len_source", i.max_model_len_source},
                 {"version", i.version},
                 {"props", i.props},
                 {"likelihood", i.likelihood},
                 {"likelihood_note", i.likelihood_note},
                 {"likelihood_request", {{"max_tokens", i.likelihood_max_tokens}, {"logprobs", i.likelihood_logprobs}}},
                 {"generation_logprobs", i.generation_logprobs ? json(*i.generation_logprobs) : json(nullptr)},
                 {"prediction_rule", i.prediction_rule},
                 {"build_info", i.props.is_object() && i.props.contains("build_info") ? i.props["build_info"] : json(nullptr)},
                 {"tokenize_check", i.tokenize_check}});
  return a;
}

json detail::EndpointLab::request_parameters_json() const {
  const auto& o = impl_->config.options;
  return {{"api", "OpenAI legacy completions (POST /v1/completions), prompts as token ids of the local tokenizer"},
          {"generation",
           {{"temperature", 0},
            {"max_tokens", "the task's answer budget"},
            {"logprobs", "the smallest that gives token ids (per endpoint: generation_logprobs), else null"},
            {"stop_token_ids", impl_->stop_ids},
            {"prediction", "with token ids: the ids up to the first BOS/EOS, decoded by the local tokenizer (the "
                           "in-process rule, also on servers that ignore stop_token_ids); else choices[0].text "
                           "(per endpoint: prediction_rule)"}}},
          {"likelihood",
           {{"temperature", 0},
            {"max_tokens", "0 where echo allows it, else 1 (per endpoint: likelihood_request)"},
            {"logprobs", "the smallest top-k that answers prompt log-probabilities (per endpoint: likelihood_request)"},
            {"echo", true},
            {"scores", "choices[0].logprobs.token_logprobs of the prompt tokens; forced choice: one request per "
                       "candidate (prompt + candidate)"}}},
          {"request_timeout_seconds", o.request_timeout},
          {"retries", o.retries},
          {"backoff", fmt::format("exponential from {} s, full jitter, cap {} s; Retry-After honoured", o.backoff_initial,
                                  o.backoff_max)},
          {"breaker_failures", o.breaker_failures},
          {"concurrency", o.concurrency}};
}

json detail::EndpointLab::model_json() const {
  const EndpointInfo& i = impl_->infos.front();
  std::string family = "served";
  if (i.model_entry.is_object() && i.model_entry.contains("posenc") && i.model_entry["posenc"].is_object() &&
      i.model_entry["posenc"].contains("family") && i.model_entry["posenc"]["family"].is_string())
    family = i.model_entry["posenc"]["family"].get<std::string>();
  return {{"served_model", i.served_model},
          {"family", family},
          {"trained_context", trained_},
          {"trained_context_source", trained_source_},
          {"vocab_size", vocab_size() ? json(*vocab_size()) : json(nullptr)}};
}

std::optional<int64_t> detail::EndpointLab::vocab_size() const {
  const json& e = impl_->infos.front().model_entry;
  if (e.is_object() && e.contains("posenc") && e["posenc"].is_object() && e["posenc"].contains("vocab_size") &&
      e["posenc"]["vocab_size"].is_number_integer())
    return e["posenc"]["vocab_size"].get<int64_t>();
  return std::nullopt;
}

std::optional<detail::UnitStatus> detail::EndpointLab::status(const std::string& label, int64_t length,
                                                              bool likelihood) const {
  const EndpointInfo& i = impl_->by_label(label);
  if (likelihood && !i.likelihood)
    // Notes name the label, never the URL: a cell must not depend on the port (resume, shards on other servers).
    return UnitStatus{kNotSupported, fmt::format("endpoint {}: {}", i.spec.label, i.likelihood_note)};
  // A likelihood request is the whole sequence plus the token it must generate (none where echo allows max_tokens 0).
  const int64_t extra = likelihood ? i.likelihood_max_tokens : 0;
  const int64_t need = length + extra;
  if (i.max_model_len && need > *i.max_model_len)
    return UnitStatus{"does not fit",
                      fmt::format("length {}{} exceeds the max_model_len {} of endpoint {} ({})", length,
                                  extra > 0 ? " + the 1 token a likelihood request generates" : "", *i.max_model_len,
                                  i.spec.label, i.max_model_len_source)};
  return std::nullopt;
}

detail::EndpointLab::GroupResult detail::EndpointLab::run_group(const std::string& label, const fs::path& journal_path,
                                                                const std::vector<std::vector<TaskSample>>& samples,
                                                                const std::function<void(int64_t)>& on_sample) {
  const EndpointInfo& info = impl_->by_label(label);
  const std::string& model = info.served_model;
  const std::size_t n = samples.size();
  for (const auto& ss : samples)
    for (const auto& s : ss) {
      if (s.prompt_tokens.empty()) throw InvalidArgument(fmt::format("sample {} of {}: empty prompt", s.index, s.task));
      if (static_cast<int64_t>(s.prompt_tokens.size()) + s.answer_budget > s.length)
        throw InvalidArgument(fmt::format("sample {} of {}: prompt {} + answer budget {} exceed the length {}", s.index,
                                          s.task, s.prompt_tokens.size(), s.answer_budget, s.length));
    }
  // A journal line of sample i: per depth {"prompt_hash", then "logprobs" (choice) or "text" + "completion_tokens"
  // (+ "ids" where the server gives them)}.
  const int64_t vocab = impl_->tokenizer->vocab_size();
  auto accept = [&](int64_t i, const json& d) {
    if (i < 0 || static_cast<std::size_t>(i) >= n || !d.is_array() || d.size() != samples[static_cast<std::size_t>(i)].size())
      return false;
    for (std::size_t k = 0; k < d.size(); ++k) {
      const TaskSample& s = samples[static_cast<std::size_t>(i)][k];
      const json& e = d[k];
      if (!e.is_object() || e.value("prompt_hash", std::string()) != prompt_hash(s.prompt_tokens)) return false;
      if (!s.choice_tokens.empty()) {
        if (!e.contains("logprobs") || !e["logprobs"].is_array() || e["logprobs"].size() != s.choice_tokens.size())
          return false;
        for (const json& v : e["logprobs"])
          if (!v.is_number()) return false;
      } else if (!e.contains("text") || !e["text"].is_string()) {
        return false;
      } else if (e.contains("ids")) {
        if (!e["ids"].is_array()) return false;
        for (const json& v : e["ids"])
          if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() >= vocab) return false;
      }
    }
    return true;
  };
  Journal journal(journal_path, accept);
  GroupResult res;
  res.outcomes.resize(n);
  auto outcome_of = [&](std::size_t i, const json& d) {
    std::vector<SampleOutcome> out;
    for (std::size_t k = 0; k < d.size(); ++k) {
      const TaskSample& s = samples[i][k];
      if (!s.choice_tokens.empty()) {
        out.push_back(choice_outcome(s, d[k]["logprobs"].get<std::vector<double>>()));
      } else if (d[k].contains("ids")) {
        // The lab's stop rule and decoding (evaluate_samples): the ids before the first BOS/EOS, each decoded
        // after the one before it (the prompt's last token first).
        std::vector<int32_t> ids;
        for (const json& v : d[k]["ids"]) {
          const int32_t id = v.get<int32_t>();
          if (std::find(impl_->stop_ids.begin(), impl_->stop_ids.end(), id) != impl_->stop_ids.end()) break;
          ids.push_back(id);
        }
        std::string text;
        int32_t prev = s.prompt_tokens.back();
        for (const int32_t id : ids) {
          text += impl_->tokenizer->decode(prev, id);
          prev = id;
        }
        SampleOutcome o = generation_outcome(s, std::move(text));
        o.new_tokens = std::move(ids);
        out.push_back(std::move(o));
      } else {
        SampleOutcome o = generation_outcome(s, d[k]["text"].get<std::string>());
        if (d[k].contains("completion_tokens") && d[k]["completion_tokens"].is_number_integer())
          o.generated_tokens = d[k]["completion_tokens"].get<int64_t>();
        out.push_back(std::move(o));
      }
    }
    return out;
  };
  std::vector<int64_t> todo;
  for (std::size_t i = 0; i < n; ++i) {
    const auto it = journal.items().find(static_cast<int64_t>(i));
    if (it != journal.items().end()) res.outcomes[i] = outcome_of(i, it->second);
    else todo.push_back(static_cast<int64_t>(i));
  }
  int64_t done = static_cast<int64_t>(n - todo.size());
  const std::string unit = samples.empty() || samples[0].empty()
                               ? std::string("the group")
                               : fmt::format("group {} {} {} L={}", samples[0][0].task, to_string(samples[0][0].control),
                                             label, samples[0][0].length);
  auto compute = [&](EndpointClient& client, int64_t i) {
    json d = json::array();
    for (const TaskSample& s : samples[static_cast<std::size_t>(i)]) {
      const std::string what = fmt::format("task {} control {} sample {} depth {} length {}", s.task,
                                           to_string(s.control), s.index, s.depth < 0 ? std::string("none") : fmt::format("{:g}", s.depth), s.length);
      json e{{"prompt_hash", prompt_hash(s.prompt_tokens)}};
      if (!s.choice_tokens.empty()) {
        std::vector<double> lp;
        const std::size_t P = s.prompt_tokens.size();
        for (std::size_t c = 0; c < s.choice_tokens.size(); ++c) {
          const auto& cand = s.choice_tokens[c];
          if (cand.empty()) fail_field<InvalidArgument>("candidate", "has no tokens (index)", c);
          std::vector<int32_t> ids = s.prompt_tokens;
          ids.insert(ids.end(), cand.begin(), cand.end());
          const std::vector<double> tl =
              client.prompt_logprobs(ids, model, fmt::format("{}, candidate {}", what, c), info.likelihood_max_tokens,
                                     info.likelihood_logprobs);
          // tl[k] scores ids[k + 1]: the candidate's tokens are tl[P - 1 ..], summed in token order.
          double sum = tl[P - 1];
          for (std::size_t j = 1; j < cand.size(); ++j) sum += tl[P - 1 + j];
          lp.push_back(sum);
        }
        e["logprobs"] = lp;
      } else {
        const auto g =
            client.generate(s.prompt_tokens, s.answer_budget, impl_->stop_ids, model, what, info.generation_logprobs);
        e["text"] = g.text;
        e["completion_tokens"] = g.completion_tokens ? json(*g.completion_tokens) : json(nullptr);
        if (g.has_ids) e["ids"] = g.ids;
      }
      d.push_back(std::move(e));
    }
    return d;
  };
  auto finished = [&](int64_t i, json d) {
    journal.append(i, d);  // before this worker takes more work
    res.outcomes[static_cast<std::size_t>(i)] = outcome_of(static_cast<std::size_t>(i), d);
    res.computed += static_cast<int64_t>(d.size());
    ++done;
    if (on_sample) on_sample(done);
  };
  run_pool(info.spec.url, impl_->config.options, todo, compute, finished, unit, static_cast<int64_t>(n));
  return res;
}

PplResult detail::EndpointLab::perplexity(const std::string& label, const fs::path& journal_path,
                                          std::span<const int32_t> stream, const PplOptions& options) {
  const EndpointInfo& info = impl_->by_label(label);
  const PplWindowsScorer scorer = [&](std::span<const PplWindow> windows, std::vector<std::vector<double>>& nll) {
    auto accept = [&](int64_t i, const json& d) {
      if (i < 0 || static_cast<std::size_t>(i) >= windows.size() || !d.is_object()) return false;
      const PplWindow& w = windows[static_cast<std::size_t>(i)];
      if (d.value("start", int64_t{-1}) != w.start || !d.contains("nll") || !d["nll"].is_array() ||
          static_cast<int64_t>(d["nll"].size()) != w.tokens - 1)
        return false;
      for (const json& v : d["nll"])
        if (!v.is_number()) return false;
      return true;
    };
    Journal journal(journal_path, accept);
    std::vector<int64_t> todo;
    // Progress counts the predictions of every window, those restored from the journal done from the start.
    int64_t tokens_done = 0, tokens_total = 0;
    for (std::size_t w = 0; w < windows.size(); ++w) {
      tokens_total += windows[w].tokens - 1;
      const auto it = journal.items().find(static_cast<int64_t>(w));
      if (it != journal.items().end()) {
        nll[w] = it->second["nll"].get<std::vector<double>>();
        tokens_done += windows[w].tokens - 1;
      } else {
        todo.push_back(static_cast<int64_t>(w));
      }
    }
    auto compute = [&](EndpointClient& client, int64_t w) {
      const PplWindow& win = windows[static_cast<std::size_t>(w)];
      const auto ids = stream.subspan(static_cast<std::size_t>(win.start), static_cast<std::size_t>(win.tokens));
      const std::vector<double> lp = client.prompt_logprobs(
          ids, info.served_model,
          fmt::format("perplexity {} L={} window {} (tokens [{}, {}))", label, options.context, w, win.start,
                      win.start + win.tokens),
          info.likelihood_max_tokens, info.likelihood_logprobs);
      std::vector<double> out(lp.size());
      for (std::size_t p = 0; p < lp.size(); ++p) out[p] = -lp[p];
      return json{{"start", win.start}, {"nll", out}};
    };
    auto finished = [&](int64_t w, json d) {
      journal.append(w, d);
      nll[static_cast<std::size_t>(w)] = d["nll"].get<std::vector<double>>();
      tokens_done += windows[static_cast<std::size_t>(w)].tokens - 1;
      if (options.on_progress)
        options.on_progress({0, static_cast<int64_t>(windows.size()), tokens_done, 0.0, tokens_total});
    };
    run_pool(info.spec.url, impl_->config.options, todo, compute, finished,
             fmt::format("perplexity {} L={}", label, options.context), static_cast<int64_t>(windows.size()));
  };
  PplResult r = evaluate_perplexity(stream, trained_, options, scorer);
  // The factor the server reports having applied (posenc serve's /v1/models "posenc" entry); other servers do
  // not say, and 1 stands for "none reported" as it does for an unscaled model in-process.
  const json& e = info.model_entry;
  if (e.is_object() && e.contains("posenc") && e["posenc"].is_object() && e["posenc"].contains("rope_factor") &&
      e["posenc"]["rope_factor"].is_number())
    r.factor = e["posenc"]["rope_factor"].get<double>();
  return r;
}

// ---------------------------------------------------------------- run

EvalRunResult run_eval_endpoint(const EndpointEvalConfig& endpoints, const Tokenizer& tokenizer,
                                std::string_view haystack_text, EvalConfig config,
                                const std::function<void(const EvalProgress&)>& on_progress) {
  if (config.tokenizer_path.empty())
    throw ConfigError("--tokenizer: required with --endpoint (prompts are sent as the served model's token ids)");
  if (config.rope_factor)
    throw ConfigError("--rope-factor: scaling a served model is the server's business (vLLM --hf-overrides / "
                      "--rope-scaling, llama-server --rope-scaling); label each endpoint instead (--endpoint URL=yarn)");
  config.rope_scalings.clear();
  for (const auto& e : endpoints.endpoints) config.rope_scalings.push_back(e.label);
  config.scaling_labels = true;
  {
    // Flag errors before any server is contacted.
    EvalConfig check = config;
    if (check.lengths.empty()) check.lengths = {256};
    validate_eval_config(check);
  }
  detail::EndpointLab lab(endpoints, tokenizer);
  if (config.lengths.empty()) {
    // default_eval_lengths' rule: T/2, T, 2T, 4T, 8T, each at least 8, distinct.
    const int64_t T = lab.trained_context();
    for (const int64_t L : {T / 2, T, 2 * T, 4 * T, 8 * T}) {
      const int64_t x = std::clamp<int64_t>(L, 8, int64_t{1} << 20);
      if (config.lengths.empty() || x > config.lengths.back()) config.lengths.push_back(x);
    }
    config.default_lengths = true;
  }
  return detail::run_eval_impl(nullptr, &lab, tokenizer, haystack_text, std::move(config), on_progress);
}

}  // namespace posenc
