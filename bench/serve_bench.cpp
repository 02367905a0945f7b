// posenc serve under load: 64 concurrent HTTP clients (httplib, keep-alive)
// against an in-process server on stories260K, 128 greedy completions of 32
// tokens from prompts of 8..70 tokens; p50/p99 request latency and generated
// tokens/s as counters. Baseline in the same binary: the same 128 requests run
// one by one in-process (Model::forward prefill, then one decode step per
// token, argmax), no HTTP, no batching.
#include <httplib.h>
#include <signal.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include <benchmark/benchmark.h>
#include <nlohmann/json.hpp>

#include "eval/logprob.hpp"
#include "posenc/io.hpp"
#include "posenc/model.hpp"
#include "posenc/serve.hpp"

namespace {

using namespace posenc;
using Clock = std::chrono::steady_clock;

const std::string kModel = std::string(POSENC_SHARED_DIR) + "/models/stories260K/stories260K.bin";
const std::string kTok = std::string(POSENC_SHARED_DIR) + "/models/stories260K/tok512.bin";
const std::string kText = std::string(POSENC_SHARED_DIR) + "/data/tinystories_val.txt";
constexpr int kClients = 64, kRequests = 128, kNewTokens = 32;

struct Setup {
  Model model = Model::load_llama2c(kModel);
  Tokenizer tok = Tokenizer::load_llama2c(kTok, 512);
  std::vector<std::vector<int32_t>> prompts;
  Setup() {
    const std::string text = read_file(kText);
    std::size_t at = 0;
    for (int i = 0; i < kRequests; ++i) {
      const std::size_t len = 40 + static_cast<std::size_t>(i % 8) * 40;  // 40..320 bytes
      const std::size_t end = text.rfind(' ', at + len);
      prompts.push_back(tok.encode(text.substr(at, end - at), true, false));
      at = end + 1;
    }
  }
};
const Setup& setup() {
  static const Setup s;
  return s;
}

double percentile(std::vector<double> v, double q) {
  std::sort(v.begin(), v.end());
  return v[static_cast<std::size_t>(q * static_cast<double>(v.size() - 1) + 0.5)];
}

void report(benchmark::State& state, const std::vector<double>& latencies, double seconds, int64_t tokens) {
  state.counters["p50_ms"] = percentile(latencies, 0.5) * 1e3;
  state.counters["p99_ms"] = percentile(latencies, 0.99) * 1e3;
  state.counters["tokens_per_s"] = static_cast<double>(tokens) / seconds;
  state.counters["requests_per_s"] = static_cast<double>(latencies.size()) / seconds;
}

void BM_ServeLoad64Clients(benchmark::State& state) {
  ::signal(SIGPIPE, SIG_IGN);
  const Setup& s = setup();
  serve::ServeConfig cfg;
  cfg.port = 0;
  cfg.max_batch = static_cast<int>(state.range(0));
  cfg.max_queue = kClients;
  serve::Server server(s.model, s.tok, cfg);
  const int port = server.start();
  for (auto _ : state) {
    std::vector<double> lat(kRequests);
    std::atomic<int> next{0};
    std::atomic<int64_t> tokens{0};
    const auto t0 = Clock::now();
    std::vector<std::thread> clients;
    for (int c = 0; c < kClients; ++c)
      clients.emplace_back([&] {
        httplib::Client cli("127.0.0.1", port);
        cli.set_read_timeout(120, 0);
        for (int n; (n = next++) < kRequests;) {
          const nlohmann::json body = {{"prompt", s.prompts[static_cast<std::size_t>(n)]}, {"max_tokens", kNewTokens},
                                       {"temperature", 0}};
          const auto t = Clock::now();
          auto res = cli.Post("/v1/completions", body.dump(), "application/json");
          lat[static_cast<std::size_t>(n)] = std::chrono::duration<double>(Clock::now() - t).count();
          if (!res || res->status != 200) {
            state.SkipWithError("a request failed");
            return;
          }
          tokens += nlohmann::json::parse(res->body)["usage"]["completion_tokens"].get<int64_t>();
        }
      });
    for (auto& c : clients) c.join();
    report(state, lat, std::chrono::duration<double>(Clock::now() - t0).count(), tokens.load());
  }
  state.counters["max_step_sequences"] = static_cast<double>(server.stats().max_sequences_in_a_step);
  server.stop();
}
BENCHMARK(BM_ServeLoad64Clients)->Arg(16)->Arg(64)->ArgName("max_batch")->Unit(benchmark::kMillisecond)->UseRealTime()->Iterations(3);

void BM_ServeBaselineOneByOneInProcess(benchmark::State& state) {
  const Setup& s = setup();
  const int V = s.model.config().vocab_size;
  for (auto _ : state) {
    std::vector<double> lat;
    int64_t tokens = 0;
    const auto t0 = Clock::now();
    for (const auto& prompt : s.prompts) {
      const auto t = Clock::now();
      KvCache cache = s.model.make_cache(16);
      const auto seq = cache.create();
      std::vector<float> logits;
      Model::SequenceInput in{seq, prompt, {}};
      s.model.forward(cache, std::span(&in, 1), Model::LogitsMode::last, logits);
      for (int i = 0; i < kNewTokens; ++i) {
        const int32_t next = posenc::detail::argmax(logits.data(), V);
        if (next == *s.tok.eos_id()) break;
        ++tokens;
        if (i + 1 == kNewTokens) break;
        const int32_t tok[1] = {next};
        in = {seq, tok, {}};
        s.model.forward(cache, std::span(&in, 1), Model::LogitsMode::last, logits);
      }
      lat.push_back(std::chrono::duration<double>(Clock::now() - t).count());
    }
    report(state, lat, std::chrono::duration<double>(Clock::now() - t0).count(), tokens);
  }
}
BENCHMARK(BM_ServeBaselineOneByOneInProcess)->Unit(benchmark::kMillisecond)->UseRealTime()->Iterations(3);

}  // namespace
