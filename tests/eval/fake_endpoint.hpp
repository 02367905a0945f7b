// A small OpenAI-compatible completions server for the endpoint client's
// tests: httplib::Server on loopback, answering per the issue 15 contract
// from a real in-process Model (echo + logprobs from one full forward of the
// prompt, greedy generation on a KV cache), with faults injectable per
// request. Not posenc serve (that is tested against its own server once
// merged); this is the client's counterpart.
#pragma once

#include <httplib.h>

#include <atomic>
#include <chrono>
#include <ctime>
#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "eval/logprob.hpp"
#include "posenc/eval.hpp"
#include "posenc/model.hpp"
#include "posenc/tokenizer.hpp"

namespace posenc::test {

class FakeEndpoint {
 public:
  using json = nlohmann::json;

  /// A canned answer that replaces the model's for one request.
  struct Fault {
    int status = 200;
    std::string body;
    std::string retry_after;  ///< Retry-After header when not empty
  };
  /// Called for every work request (a completions request with more than 2
  /// prompt tokens: not the probe), numbered from 1, with the request and the
  /// answer the model gives; returns a fault to send instead, or nullopt.
  using FaultFn = std::function<std::optional<Fault>(int64_t number, const json& request, const std::string& answer)>;

  FakeEndpoint(const Model& model, const Tokenizer& tok) : model_(model), tok_(tok) {}
  ~FakeEndpoint() { stop(); }

  std::string name = "stories260K";
  int64_t max_model_len = 1024;
  bool likelihood = true;  ///< false: echo is refused with 400, as llama-server does
  bool echo_max_tokens_0 = true;  ///< false: max_tokens 0 is refused with 400 (a server that always generates one)
  FaultFn fault;
  /// When > 0: after answering this many work requests the server stops (its
  /// listening socket closes: connection refused from then on).
  int64_t stop_after = 0;

  std::atomic<int64_t> work_requests{0};  ///< work requests received
  std::atomic<int64_t> work_answered{0};  ///< work requests answered with the model's 200

  void start() {
    svr_ = std::make_unique<httplib::Server>();
    svr_->Get("/v1/models", [this](const httplib::Request&, httplib::Response& res) {
      json m{{"id", name}, {"object", "model"}, {"created", static_cast<int64_t>(std::time(nullptr))},
             {"owned_by", "posenc-test"}, {"max_model_len", max_model_len}};
      res.set_content(json{{"object", "list"}, {"data", json::array({m})}}.dump(), "application/json");
    });
    svr_->Get("/version", [](const httplib::Request&, httplib::Response& res) {
      res.set_content(R"({"version":"0.0-test","server":"fake_endpoint"})", "application/json");
    });
    svr_->Post("/tokenize", [this](const httplib::Request& req, httplib::Response& res) {
      const json b = json::parse(req.body);
      const std::string text = b.contains("prompt") ? b["prompt"].get<std::string>() : b["content"].get<std::string>();
      const auto ids = tok_.encode(text, false, false);
      res.set_content(json{{"tokens", ids}, {"count", ids.size()}, {"max_model_len", max_model_len}}.dump(),
                      "application/json");
    });
    svr_->Post("/v1/completions", [this](const httplib::Request& req, httplib::Response& res) {
      complete(req, res);
    });
    port_ = svr_->bind_to_any_port("127.0.0.1");
    thread_ = std::thread([this] { svr_->listen_after_bind(); });
    while (!svr_->is_running()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }

  void stop() {
    if (svr_) svr_->stop();
    if (thread_.joinable()) thread_.join();
    if (stopper_.joinable()) stopper_.join();
  }

  int port() const { return port_; }
  std::string url() const { return "http://127.0.0.1:" + std::to_string(port_) + "/v1"; }

 private:
  void complete(const httplib::Request& req, httplib::Response& res) {
    const json b = json::parse(req.body);
    const std::vector<int32_t> prompt = b.at("prompt").get<std::vector<int32_t>>();
    const bool echo = b.value("echo", false);
    if (echo && !likelihood) {
      res.status = 400;
      res.set_content(R"({"error":{"message":"'echo' is not supported","type":"invalid_request_error","code":400}})",
                      "application/json");
      return;
    }
    if (!echo_max_tokens_0 && b.value("max_tokens", 16) == 0) {
      res.status = 400;
      res.set_content(R"({"error":{"message":"max_tokens: must be at least 1","type":"invalid_request_error","code":400}})",
                      "application/json");
      return;
    }
    const bool work = prompt.size() > 2;
    int64_t number = 0;
    if (work) {
      number = ++work_requests;
      if (stop_after > 0 && number > stop_after) {
        // Stop listening (from another thread: stop() waits for this handler)
        // and answer this request as a dying server would.
        std::call_once(stopped_, [this] { stopper_ = std::thread([this] { svr_->stop(); }); });
        res.status = 503;
        res.set_content(R"({"error":{"message":"shutting down"}})", "application/json");
        return;
      }
    }
    const std::string answer = echo ? likelihood_answer(prompt) : generation_answer(prompt, b);
    if (work && fault)
      if (const auto f = fault(number, b, answer)) {
        res.status = f->status;
        if (!f->retry_after.empty()) res.set_header("Retry-After", f->retry_after);
        res.set_content(f->body, "application/json");
        return;
      }
    if (work) ++work_answered;
    res.set_content(answer, "application/json");
  }

  std::string likelihood_answer(const std::vector<int32_t>& prompt) const {
    const int V = model_.config().vocab_size;
    const std::vector<float> logits = model_.score_window(prompt);
    json lp = json::array();
    lp.push_back(nullptr);
    for (std::size_t i = 1; i < prompt.size(); ++i)
      lp.push_back(detail::log_prob(logits.data() + (i - 1) * static_cast<std::size_t>(V), V, prompt[i]));
    const float* last = logits.data() + (prompt.size() - 1) * static_cast<std::size_t>(V);
    const int32_t next = detail::argmax(last, V);
    lp.push_back(detail::log_prob(last, V, next));
    std::vector<int32_t> ids = prompt;
    ids.push_back(next);
    json tokens = json::array();
    for (std::size_t i = 0; i < ids.size(); ++i) tokens.push_back(tok_.decode(i ? ids[i - 1] : ids[0], ids[i]));
    return response(tok_.decode(prompt.back(), next), "length",
                    json{{"tokens", tokens}, {"token_logprobs", lp}, {"token_ids", ids}}, prompt.size(), 1);
  }

  std::string generation_answer(const std::vector<int32_t>& prompt, const json& b) const {
    const int max_tokens = b.value("max_tokens", 16);
    const std::vector<int32_t> stop = b.value("stop_token_ids", std::vector<int32_t>{});
    KvCache cache = model_.make_cache(16);
    const auto seq = cache.create();
    std::vector<float> logits;
    const Model::SequenceInput in{seq, prompt, {}};
    model_.forward(cache, std::span<const Model::SequenceInput>(&in, 1), Model::LogitsMode::last, logits);
    const auto ids = greedy_continue(model_, cache, seq, logits, max_tokens, stop);
    std::string text;
    int32_t prev = prompt.back();
    for (int32_t id : ids) {
      text += tok_.decode(prev, id);
      prev = id;
    }
    return response(text, static_cast<int>(ids.size()) == max_tokens ? "length" : "stop", nullptr, prompt.size(),
                    ids.size());
  }

  std::string response(const std::string& text, const char* finish, json logprobs, std::size_t p, std::size_t c) const {
    json choice{{"index", 0}, {"text", text}, {"finish_reason", finish}, {"logprobs", std::move(logprobs)}};
    return json{{"id", "cmpl-test"},
                {"object", "text_completion"},
                {"created", 0},
                {"model", name},
                {"choices", json::array({choice})},
                {"usage", {{"prompt_tokens", p}, {"completion_tokens", c}, {"total_tokens", p + c}}}}
        .dump();
  }

  const Model& model_;
  const Tokenizer& tok_;
  std::unique_ptr<httplib::Server> svr_;
  std::thread thread_, stopper_;
  std::once_flag stopped_;
  int port_ = 0;
};

}  // namespace posenc::test
