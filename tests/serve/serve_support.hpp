// Helpers of the posenc serve tests: an in-process server on loopback, a JSON
// client, and the in-process reference a completion must equal.
#pragma once

#include <httplib.h>
#include <signal.h>

#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "eval/logprob.hpp"
#include "posenc/model.hpp"
#include "posenc/serve.hpp"
#include "posenc/tokenizer.hpp"
#include "test_support.hpp"

namespace posenc::test::serve {

using nlohmann::json;

struct Stories {
  Model model = Model::load_llama2c(posenc::test::model_path());
  Tokenizer tok = Tokenizer::load_llama2c(posenc::test::tokenizer_path(), 512);
};
inline const Stories& stories() {
  static const Stories s;
  return s;
}

/// A started server on 127.0.0.1 (any free port) over stories260K.
struct Running {
  std::unique_ptr<posenc::serve::Server> server;
  int port = 0;
  explicit Running(posenc::serve::ServeConfig cfg = {}) {
    ::signal(SIGPIPE, SIG_IGN);
    cfg.port = 0;
    if (cfg.served_model_name.empty()) cfg.served_model_name = "stories260K";
    server = std::make_unique<posenc::serve::Server>(stories().model, stories().tok, cfg);
    port = server->start();
  }
  httplib::Client client(int read_timeout_s = 60) const {
    httplib::Client c("127.0.0.1", port);
    c.set_read_timeout(read_timeout_s, 0);
    c.set_connection_timeout(10, 0);
    return c;
  }
};

struct Reply {
  int status = -1;  ///< -1: no HTTP answer (connection error)
  json body;
  std::string raw;
  std::string retry_after;
};

inline Reply post(httplib::Client& c, const std::string& path, const std::string& body) {
  Reply r;
  auto res = c.Post(path.c_str(), body, "application/json");
  if (!res) {
    r.raw = "httplib error: " + httplib::to_string(res.error());
    return r;
  }
  r.status = res->status;
  r.raw = res->body;
  r.body = json::parse(res->body, nullptr, false);
  r.retry_after = res->get_header_value("Retry-After");
  return r;
}
inline Reply post(httplib::Client& c, const std::string& path, const json& body) { return post(c, path, body.dump()); }
inline Reply post(httplib::Client& c, const std::string& path, const char* body) {
  return post(c, path, std::string(body));
}
inline Reply get(httplib::Client& c, const std::string& path) {
  Reply r;
  auto res = c.Get(path.c_str());
  if (!res) return r;
  r.status = res->status;
  r.raw = res->body;
  r.body = json::parse(res->body, nullptr, false);
  return r;
}

/// A value of the /metrics text ("name" or "name{labels}"), -1 when absent.
inline double metric(const std::string& text, const std::string& name) {
  std::size_t at = 0;
  while ((at = text.find(name + " ", at)) != std::string::npos) {
    if (at == 0 || text[at - 1] == '\n') return std::stod(text.substr(at + name.size() + 1));
    ++at;
  }
  return -1;
}

/// Waits (polling server stats, at most `seconds`) for `pred`.
template <class F>
bool eventually(F&& pred, double seconds = 10) {
  const auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  while (std::chrono::steady_clock::now() < end) {
    if (pred()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return pred();
}

/// What the in-process runtime gives for a greedy request: the prompt forwarded alone in one prefill
/// (LogitsMode::all), then one token at a time; argmax and log_prob of each row (the lab's functions).
struct Reference {
  std::vector<double> prompt_logprobs;  ///< [P - 1]: log p(prompt[i] | prompt[0..i)) for i = 1..P-1
  std::vector<std::vector<std::pair<int32_t, double>>> prompt_top;  ///< [P - 1] top-k of the row predicting i
  std::vector<int32_t> tokens;          ///< generated (the EOS / a stop id not included)
  std::vector<double> logprobs;
  std::vector<std::vector<std::pair<int32_t, double>>> top;
  std::string text;
  std::string finish_reason;
};

inline std::vector<std::pair<int32_t, double>> top_k(const float* row, int V, int k) {
  std::vector<std::pair<int32_t, double>> all;
  for (int v = 0; v < V; ++v) all.emplace_back(v, posenc::detail::log_prob(row, V, v));
  std::stable_sort(all.begin(), all.end(), [](const auto& a, const auto& b) { return a.second > b.second; });
  all.resize(static_cast<std::size_t>(std::min(k, V)));
  return all;
}

inline Reference reference(const std::vector<int32_t>& prompt, int max_tokens, int k = 0,
                           const std::vector<int32_t>& stop_ids = {}, int64_t max_model_len = 512) {
  const Model& m = stories().model;
  const Tokenizer& tok = stories().tok;
  const int V = m.config().vocab_size;
  Reference r;
  KvCache cache = m.make_cache(16);
  const auto seq = cache.create();
  std::vector<float> rows;
  Model::SequenceInput in{seq, prompt, {}};
  m.forward(cache, std::span(&in, 1), Model::LogitsMode::all, rows);
  for (std::size_t i = 1; i < prompt.size(); ++i) {
    const float* row = rows.data() + (i - 1) * static_cast<std::size_t>(V);
    r.prompt_logprobs.push_back(posenc::detail::log_prob(row, V, prompt[i]));
    r.prompt_top.push_back(top_k(row, V, k));
  }
  std::vector<float> last(rows.end() - V, rows.end());
  int32_t prev = prompt.back();
  r.finish_reason = "length";
  for (int step = 0; step < max_tokens; ++step) {
    const int32_t next = posenc::detail::argmax(last.data(), V);
    if ((tok.eos_id() && next == *tok.eos_id()) || std::find(stop_ids.begin(), stop_ids.end(), next) != stop_ids.end()) {
      r.finish_reason = "stop";
      break;
    }
    r.tokens.push_back(next);
    r.logprobs.push_back(posenc::detail::log_prob(last.data(), V, next));
    r.top.push_back(top_k(last.data(), V, k));
    r.text += tok.decode(prev, next);
    prev = next;
    if (static_cast<int64_t>(prompt.size() + r.tokens.size()) >= max_model_len) break;
    const int32_t t[1] = {next};
    in = {seq, t, {}};
    m.forward(cache, std::span(&in, 1), Model::LogitsMode::last, last);
  }
  return r;
}

/// Prompts of the validation text: token ids (BOS first) of `n` consecutive words from word `start`.
inline std::vector<int32_t> text_prompt(std::size_t start, std::size_t n) {
  static const std::string text = posenc::test::slurp(posenc::test::text_path());
  std::size_t b = 0;
  for (std::size_t w = 0; w < start; ++w) b = text.find(' ', b) + 1;
  std::size_t e = b;
  for (std::size_t w = 0; w < n; ++w) e = text.find(' ', e + 1);
  return stories().tok.encode(text.substr(b, e - b), true, false);
}

}  // namespace posenc::test::serve
