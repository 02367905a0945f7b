// parse_completion_request: the /v1/completions body, validated field by field.
// No HTTP here (the fuzz harness links this file without cpp-httplib).
#include <cmath>
#include <limits>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "posenc/serve.hpp"

namespace posenc::serve {

namespace {

using nlohmann::json;

[[noreturn]] void bad(std::string_view field, const std::string& message) {
  throw RequestError(400, "invalid_request_error", std::string(field), message);
}

/// A short rendering of a JSON value for messages (at most ~60 bytes).
std::string shown(const json& v) {
  std::string s = v.dump(-1, ' ', false, json::error_handler_t::replace);
  if (s.size() > 60) s = s.substr(0, 57) + "...";
  return s;
}

std::string type_name(const json& v) {
  if (v.is_number_integer()) return "integer";
  if (v.is_number_float()) return "number";
  return v.type_name();
}

[[noreturn]] void wrong_type(std::string_view field, std::string_view want, const json& v) {
  bad(field, fmt::format("{}: must be {} (got {} {})", field, want, type_name(v), shown(v)));
}

int64_t integer(std::string_view field, const json& v, int64_t lo, int64_t hi) {
  if (!v.is_number_integer()) wrong_type(field, "an integer", v);
  if (v.is_number_unsigned() && v.get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
    bad(field, fmt::format("{}: must be an integer in [{}, {}] (got {})", field, lo, hi, shown(v)));
  const int64_t x = v.get<int64_t>();
  if (x < lo || x > hi) bad(field, fmt::format("{}: must be an integer in [{}, {}] (got {})", field, lo, hi, x));
  return x;
}

double number(std::string_view field, const json& v) {
  if (!v.is_number()) wrong_type(field, "a number", v);
  const double x = v.get<double>();
  if (!std::isfinite(x)) bad(field, fmt::format("{}: must be finite (got {})", field, shown(v)));
  return x;
}

int32_t token_id(std::string_view field, const json& v, int vocab_size) {
  if (!v.is_number_integer()) wrong_type(field, "an array of token ids (integers)", v);
  if (v.is_number_unsigned() ? v.get<uint64_t>() >= static_cast<uint64_t>(vocab_size)
                             : (v.get<int64_t>() < 0 || v.get<int64_t>() >= vocab_size))
    bad(field, fmt::format("{}: token id {} is out of range [0, {}) (vocab_size {})", field, shown(v), vocab_size,
                           vocab_size));
  return static_cast<int32_t>(v.get<int64_t>());
}

}  // namespace

CompletionRequest parse_completion_request(std::string_view body, const RequestLimits& limits) {
  if (body.size() > limits.max_request_bytes)
    throw RequestError(413, "invalid_request_error", "",
                       fmt::format("request body: {} bytes exceed the limit of {} bytes (max_request_bytes)",
                                   body.size(), limits.max_request_bytes));
  json j;
  try {
    j = json::parse(body);
  } catch (const json::exception& e) {  // parse_error, and out_of_range for a number past double (1e400)
    throw RequestError(400, "invalid_request_error", "", fmt::format("request body: malformed JSON: {}", e.what()));
  }
  if (!j.is_object())
    throw RequestError(400, "invalid_request_error", "",
                       fmt::format("request body: must be a JSON object (got {})", type_name(j)));
  CompletionRequest r;
  bool have_prompt = false;
  for (auto it = j.begin(); it != j.end(); ++it) {
    const std::string& k = it.key();
    const json& v = it.value();
    if (k == "model") {
      if (!v.is_string()) wrong_type(k, "a string", v);
      r.model = v.get<std::string>();
    } else if (k == "prompt") {
      have_prompt = true;
      if (v.is_string()) {
        r.prompt = v.get<std::string>();
      } else if (v.is_array()) {
        if (!v.empty() && (v.front().is_array() || v.front().is_string()))
          bad(k, "prompt: one prompt per request (got a batch of prompts)");
        std::vector<int32_t> ids;
        ids.reserve(v.size());
        for (const json& t : v) ids.push_back(token_id(k, t, limits.vocab_size));
        r.prompt = std::move(ids);
      } else {
        wrong_type(k, "a string or an array of token ids", v);
      }
    } else if (k == "max_tokens") {
      if (!v.is_null()) r.max_tokens = integer(k, v, 0, limits.max_model_len);
    } else if (k == "temperature") {
      if (!v.is_null()) {
        r.temperature = number(k, v);
        if (r.temperature < 0) bad(k, fmt::format("temperature: must be >= 0 (got {})", shown(v)));
      }
    } else if (k == "top_p") {
      if (!v.is_null()) {
        r.top_p = number(k, v);
        if (!(r.top_p > 0 && r.top_p <= 1)) bad(k, fmt::format("top_p: must be in (0, 1] (got {})", shown(v)));
      }
    } else if (k == "seed") {
      if (!v.is_null()) {
        if (!v.is_number_integer()) wrong_type(k, "an integer", v);
        if (!v.is_number_unsigned() && v.get<int64_t>() < 0)
          bad(k, fmt::format("seed: must be an integer in [0, 2^64 - 1] (got {})", shown(v)));
        r.seed = v.get<uint64_t>();
      }
    } else if (k == "stop") {
      if (v.is_null()) continue;
      if (v.is_string()) {
        r.stop.push_back(v.get<std::string>());
      } else if (v.is_array()) {
        if (v.size() > 4) bad(k, fmt::format("stop: at most 4 stop strings (got {})", v.size()));
        for (const json& s : v) {
          if (!s.is_string()) wrong_type(k, "a string or an array of strings", s);
          r.stop.push_back(s.get<std::string>());
        }
      } else {
        wrong_type(k, "a string or an array of strings", v);
      }
      for (const auto& s : r.stop)
        if (s.empty()) bad(k, "stop: a stop string must not be empty");
    } else if (k == "stop_token_ids") {
      if (v.is_null()) continue;
      if (!v.is_array()) wrong_type(k, "an array of token ids", v);
      for (const json& t : v) r.stop_token_ids.push_back(token_id(k, t, limits.vocab_size));
    } else if (k == "logprobs") {
      if (!v.is_null()) r.logprobs = static_cast<int>(integer(k, v, 0, 20));
    } else if (k == "echo") {
      if (!v.is_boolean()) wrong_type(k, "a boolean", v);
      r.echo = v.get<bool>();
    } else if (k == "n" || k == "best_of") {
      if (v.is_null()) continue;
      if (integer(k, v, 1, std::numeric_limits<int64_t>::max()) != 1)
        bad(k, fmt::format("{}: only 1 is supported (got {})", k, shown(v)));
    } else if (k == "stream") {
      if (v.is_null()) continue;
      if (!v.is_boolean()) wrong_type(k, "a boolean", v);
      if (v.get<bool>()) bad(k, "stream: streaming is not supported (only false)");
    } else if (k == "presence_penalty" || k == "frequency_penalty") {
      if (v.is_null()) continue;
      if (number(k, v) != 0) bad(k, fmt::format("{}: only 0 is supported (got {})", k, shown(v)));
    } else if (k == "logit_bias") {
      if (v.is_null()) continue;
      if (!v.is_object()) wrong_type(k, "an object", v);
      if (!v.empty()) bad(k, "logit_bias: not supported (only empty or null)");
    } else if (k == "suffix") {
      if (!v.is_null()) bad(k, "suffix: not supported (only null)");
    } else if (k == "user") {
      if (!v.is_null() && !v.is_string()) wrong_type(k, "a string", v);
    } else {
      bad(k, fmt::format("{}: unknown field", k));
    }
  }
  if (!have_prompt) bad("prompt", "prompt: required");
  if (r.max_tokens && *r.max_tokens == 0 && !r.echo)
    bad("max_tokens", "max_tokens: 0 is allowed only with echo: true");
  return r;
}

}  // namespace posenc::serve
