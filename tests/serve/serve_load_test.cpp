// posenc serve under load (64 concurrent clients, a fixed number of requests),
// and the `posenc serve` command (port 0, /health, a completion, SIGTERM).
#include <fcntl.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <map>
#include <mutex>
#include <regex>
#include <set>
#include <thread>

#include <gtest/gtest.h>

#include "serve_process.hpp"
#include "serve_support.hpp"

extern char** environ;

namespace POSENC_UNITY_ID {  // this file's own namespace in the tests' unity build (CMakeLists.txt)

using namespace posenc;
using namespace posenc::test::serve;
using posenc::serve::ServeConfig;

namespace {

TEST(ServeLoad, SixtyFourClientsGetEveryAnswerOnceAndEachEqualsItsSingleRequestResult) {
  ServeConfig cfg;
  cfg.max_batch = 16;
  cfg.max_queue = 24;       // < 64 clients: some requests meet a full queue (503 + Retry-After) and retry
  cfg.max_step_tokens = 128;
  Running s(cfg);
  // 24 distinct requests (prompts sharing prefixes, so the prefix cache is in play; some with echo + logprobs).
  struct Req {
    std::vector<int32_t> prompt;
    int max_tokens;
    bool echo;
    json body;
    Reference ref;
  };
  std::vector<Req> reqs;
  for (int i = 0; i < 24; ++i) {
    Req r;
    r.prompt = text_prompt(static_cast<std::size_t>(i % 6) * 40, static_cast<std::size_t>(6 + 3 * i));
    r.max_tokens = 8 + (i * 7) % 25;
    r.echo = i % 5 == 0;
    r.body = {{"prompt", r.prompt}, {"max_tokens", r.max_tokens}, {"temperature", 0}, {"logprobs", 1},
              {"echo", r.echo}};
    r.ref = reference(r.prompt, r.max_tokens, 1);
    reqs.push_back(std::move(r));
  }
  constexpr int kClients = 64, kRequests = 256;
  std::atomic<int> next{0};
  std::mutex mu;
  std::map<int, json> answers;  // request number -> its answer
  std::set<std::string> completion_ids;
  std::atomic<int> retried_503{0}, other_errors{0}, duplicates{0};
  std::vector<std::string> error_samples;
  std::vector<std::thread> clients;
  for (int t = 0; t < kClients; ++t)
    clients.emplace_back([&] {
      auto c = s.client();
      for (int n; (n = next++) < kRequests;) {
        const Req& r = reqs[static_cast<std::size_t>(n) % reqs.size()];
        // Retried for up to 120 s: a count of attempts (200, ~7 s of backoff) ran out under the sanitizer build,
        // where one client of 64 kept finding the queue full while the others were served.
        const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(120);
        for (int attempt = 0;; ++attempt) {
          Reply rep = post(c, "/v1/completions", r.body);
          if (rep.status == 503 && rep.retry_after == "1" && std::chrono::steady_clock::now() < give_up) {
            ++retried_503;  // documented: the queue is full; back off (a short wait, not the advised second)
            std::this_thread::sleep_for(std::chrono::milliseconds(20 + 5 * (attempt % 8)));
            continue;
          }
          std::lock_guard lk(mu);
          if (rep.status != 200) {
            ++other_errors;
            if (error_samples.size() < 5) error_samples.push_back(std::to_string(rep.status) + " " + rep.raw);
          } else {
            if (!completion_ids.insert(rep.body["id"].get<std::string>()).second) ++duplicates;
            if (!answers.emplace(n, rep.body).second) ++duplicates;
          }
          break;
        }
      }
    });
  for (auto& t : clients) t.join();
  EXPECT_EQ(other_errors.load(), 0) << (error_samples.empty() ? "" : error_samples.front());
  EXPECT_EQ(duplicates.load(), 0);
  ASSERT_EQ(answers.size(), static_cast<std::size_t>(kRequests));  // nothing lost
  for (const auto& [n, body] : answers) {
    const Req& r = reqs[static_cast<std::size_t>(n) % reqs.size()];
    const json& c = body["choices"][0];
    ASSERT_EQ(c["text"].get<std::string>(), (r.echo ? stories().tok.decode(r.prompt) : std::string()) + r.ref.text)
        << "request " << n;
    std::vector<int32_t> want = r.echo ? r.prompt : std::vector<int32_t>{};
    want.insert(want.end(), r.ref.tokens.begin(), r.ref.tokens.end());
    ASSERT_EQ(c["logprobs"]["token_ids"].get<std::vector<int32_t>>(), want) << "request " << n;
    const json& tl = c["logprobs"]["token_logprobs"];
    const std::size_t g0 = r.echo ? r.prompt.size() : 0;
    for (std::size_t g = 0; g < r.ref.logprobs.size(); ++g)
      ASSERT_EQ(tl[g0 + g].get<double>(), r.ref.logprobs[g]) << "request " << n << " token " << g;
    if (r.echo) {
      for (std::size_t i = 1; i < r.prompt.size(); ++i)
        ASSERT_EQ(tl[i].get<double>(), r.ref.prompt_logprobs[i - 1]) << "request " << n << " prompt token " << i;
    }
  }
  const auto st = s.server->stats();
  EXPECT_EQ(st.requests_completed, kRequests);
  EXPECT_GT(st.max_sequences_in_a_step, 8);   // batching happened
  EXPECT_GT(st.prefix_cache_hits, 0);         // and prefix reuse
  EXPECT_EQ(st.queue_depth, 0);
  EXPECT_EQ(st.running_sequences, 0);
  std::printf("[ load ] %d requests by %d clients: %d answers 503 retried; %lld steps, up to %lld sequences a step, "
              "%lld prefix-cache hits, %lld of %lld prompt tokens computed\n",
              kRequests, kClients, retried_503.load(), static_cast<long long>(st.steps),
              static_cast<long long>(st.max_sequences_in_a_step), static_cast<long long>(st.prefix_cache_hits),
              static_cast<long long>(st.computed_prompt_tokens), static_cast<long long>(st.prompt_tokens));
}

TEST(ServeCli, ServesOnAnyFreePortAndExitsZeroOnSigterm) {
  ServeProcess p({"--model", posenc::test::model_path().string(), "--tokenizer", posenc::test::tokenizer_path().string(),
                  "--port", "0", "--max-model-len", "256"});
  ASSERT_GT(p.pid(), 0);
  const int port = p.wait_port(60);
  ASSERT_GT(port, 0) << p.err();
  EXPECT_NE(p.err().find("(model stories260K.bin, max_model_len 256)"), std::string::npos) << p.err();
  httplib::Client c("127.0.0.1", port);
  c.set_read_timeout(30, 0);
  auto h = get(c, "/health");
  EXPECT_EQ(h.status, 200);
  auto m = get(c, "/v1/models");
  EXPECT_EQ(m.body["data"][0]["id"], "stories260K.bin");
  EXPECT_EQ(m.body["data"][0]["max_model_len"], 256);
  const auto prompt = text_prompt(0, 12);
  auto r = post(c, "/v1/completions", json{{"model", "stories260K.bin"}, {"prompt", prompt}, {"max_tokens", 10},
                                           {"temperature", 0}, {"logprobs", 0}});
  ASSERT_EQ(r.status, 200) << r.raw;
  const Reference ref = reference(prompt, 10);
  EXPECT_EQ(r.body["choices"][0]["text"], ref.text);
  EXPECT_EQ(r.body["choices"][0]["logprobs"]["token_logprobs"][0].get<double>(), ref.logprobs[0]);
  EXPECT_EQ(p.terminate(30), 0) << p.err();
  EXPECT_NE(p.err().find("SIGTERM: draining"), std::string::npos) << p.err();
}

TEST(ServeCli, RejectsABadCommandLineWithExit2) {
  const auto r = posenc::test::run_cli("serve --model '" + posenc::test::model_path().string() + "' --port 70000");
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_NE(r.err.find("--port"), std::string::npos) << r.err;
  // A missing model is a problem of the inputs: exit 1, naming the file.
  const auto m = posenc::test::run_cli("serve --model /nonexistent/model.bin --port 0");
  EXPECT_EQ(m.exit_code, 1) << m.err;
  EXPECT_NE(m.err.find("/nonexistent/model.bin"), std::string::npos) << m.err;
  // A KV budget below one sequence of the allowed context: a flag the model cannot take, exit 2 naming it.
  const auto k = posenc::test::run_cli("serve --model '" + posenc::test::model_path().string() + "' --tokenizer '" +
                                       posenc::test::tokenizer_path().string() + "' --kv-cache-tokens 10 --port 0");
  EXPECT_EQ(k.exit_code, 2) << k.err;
  EXPECT_NE(k.err.find("--kv-cache-tokens: 10 tokens cannot hold one sequence of max_model_len 512"), std::string::npos)
      << k.err;
}

}  // namespace

}  // namespace POSENC_UNITY_ID
