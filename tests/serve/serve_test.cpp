// posenc serve on loopback: every endpoint and field, exactness against the
// in-process forward (alone, batched, from the prefix cache), seeded sampling,
// stops, limits, the bounded queue, bad requests, disconnects and draining.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <set>
#include <thread>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "serve/scheduler.hpp"
#include "serve_support.hpp"

namespace POSENC_UNITY_ID {  // this file's own namespace in the tests' unity build (CMakeLists.txt)

using namespace posenc;
using namespace posenc::test::serve;
using posenc::serve::ServeConfig;

namespace {

/// Asserts that a completion (echo or not, logprobs k) equals the in-process reference, bit for bit.
void expect_equal(const json& body, const std::vector<int32_t>& prompt, const Reference& ref, bool echo, int k,
                  const std::string& what) {
  ASSERT_TRUE(body.contains("choices")) << what << ": " << body.dump();
  const json& c = body["choices"][0];
  // With echo the text is the prompt's (as decoded) and then the completion's.
  EXPECT_EQ(c["text"].get<std::string>(), (echo ? stories().tok.decode(prompt) : std::string()) + ref.text) << what;
  EXPECT_EQ(c["finish_reason"].get<std::string>(), ref.finish_reason) << what;
  EXPECT_EQ(body["usage"]["prompt_tokens"].get<int64_t>(), static_cast<int64_t>(prompt.size())) << what;
  EXPECT_EQ(body["usage"]["completion_tokens"].get<int64_t>(), static_cast<int64_t>(ref.tokens.size())) << what;
  const json& lp = c["logprobs"];
  ASSERT_TRUE(lp.is_object()) << what;
  std::vector<int32_t> ids = lp["token_ids"].get<std::vector<int32_t>>();
  std::vector<int32_t> want_ids;
  if (echo) want_ids = prompt;
  want_ids.insert(want_ids.end(), ref.tokens.begin(), ref.tokens.end());
  ASSERT_EQ(ids, want_ids) << what;
  const json& tl = lp["token_logprobs"];
  const json& top = lp["top_logprobs"];
  ASSERT_EQ(tl.size(), ids.size()) << what;
  ASSERT_EQ(top.size(), ids.size()) << what;
  ASSERT_EQ(lp["tokens"].size(), ids.size()) << what;
  ASSERT_EQ(lp["text_offset"].size(), ids.size()) << what;
  std::size_t i = 0;
  if (echo) {
    EXPECT_TRUE(tl[0].is_null()) << what;
    EXPECT_TRUE(top[0].is_null()) << what;
    for (i = 1; i < prompt.size(); ++i) {
      EXPECT_EQ(tl[i].get<double>(), ref.prompt_logprobs[i - 1]) << what << " prompt token " << i;
      // Every top-k alternative of the reference with its exact logprob (keys are token texts).
      for (const auto& [id, v] : ref.prompt_top[i - 1]) {
        bool found = false;
        for (const auto& [key, val] : top[i].items()) found = found || val.get<double>() == v;
        EXPECT_TRUE(found) << what << " prompt token " << i << " alternative " << id;
      }
      EXPECT_LE(top[i].size(), static_cast<std::size_t>(k) + 1);
    }
  }
  for (std::size_t g = 0; g < ref.tokens.size(); ++g, ++i) {
    EXPECT_EQ(tl[i].get<double>(), ref.logprobs[g]) << what << " generated token " << g;
    for (const auto& [id, v] : ref.top[g]) {
      bool found = false;
      for (const auto& [key, val] : top[i].items()) found = found || val.get<double>() == v;
      EXPECT_TRUE(found) << what << " generated token " << g << " alternative " << id;
    }
  }
}

json greedy(const std::vector<int32_t>& prompt, int max_tokens, int k, bool echo) {
  return {{"model", "stories260K"}, {"prompt", prompt}, {"max_tokens", max_tokens}, {"temperature", 0},
          {"logprobs", k},          {"echo", echo}};
}

TEST(Serve, Endpoints) {
  Running s;
  auto c = s.client();
  auto h = get(c, "/health");
  EXPECT_EQ(h.status, 200);
  EXPECT_EQ(h.body, json({{"status", "ok"}}));
  auto v = get(c, "/version");
  EXPECT_EQ(v.status, 200);
  EXPECT_EQ(v.body["server"], "posenc");
  auto m = get(c, "/v1/models");
  ASSERT_EQ(m.status, 200);
  EXPECT_EQ(m.body["object"], "list");
  ASSERT_EQ(m.body["data"].size(), 1u);
  const json& d = m.body["data"][0];
  EXPECT_EQ(d["id"], "stories260K");
  EXPECT_EQ(d["object"], "model");
  EXPECT_EQ(d["owned_by"], "posenc");
  EXPECT_EQ(d["max_model_len"], 512);  // stories260K.bin's seq_len
  EXPECT_EQ(d["posenc"]["vocab_size"], 512);
  EXPECT_EQ(d["posenc"]["trained_context"], 512);
  EXPECT_EQ(d["posenc"]["family"], "rope");
  EXPECT_EQ(d["posenc"]["format"], "llama2.c");
  EXPECT_EQ(d["posenc"]["rope_layout"], "interleaved");

  const std::string text = "Once upon a time, there was a little girl.";
  const auto& tok = stories().tok;
  auto t1 = post(c, "/tokenize", json{{"prompt", text}});  // vLLM: add_special_tokens defaults to true
  ASSERT_EQ(t1.status, 200);
  EXPECT_EQ(t1.body["tokens"].get<std::vector<int32_t>>(), tok.encode_hf(text, true));
  EXPECT_EQ(t1.body["count"], tok.encode_hf(text, true).size());
  EXPECT_EQ(t1.body["max_model_len"], 512);
  EXPECT_EQ(t1.body["tokens"][0], 1);  // BOS
  auto t2 = post(c, "/tokenize", json{{"content", text}});  // llama.cpp: add_special defaults to false
  ASSERT_EQ(t2.status, 200);
  EXPECT_EQ(t2.body["tokens"].get<std::vector<int32_t>>(), tok.encode_hf(text, false));
  auto t3 = post(c, "/tokenize", json{{"content", text}, {"add_special", true}});
  EXPECT_EQ(t3.body["tokens"].get<std::vector<int32_t>>(), tok.encode_hf(text, true));
  auto t4 = post(c, "/tokenize", json{{"prompt", text}, {"add_special_tokens", false}});
  EXPECT_EQ(t4.body["tokens"].get<std::vector<int32_t>>(), tok.encode_hf(text, false));
  auto dt = post(c, "/detokenize", json{{"tokens", tok.encode_hf(text, true)}});
  ASSERT_EQ(dt.status, 200);
  EXPECT_EQ(dt.body["prompt"], tok.decode(tok.encode_hf(text, true)));
  EXPECT_EQ(dt.body["content"], dt.body["prompt"]);
  EXPECT_EQ(dt.body["prompt"], text);
  auto bad_ids = post(c, "/detokenize", json{{"tokens", {1, 512}}});
  EXPECT_EQ(bad_ids.status, 400);
  EXPECT_NE(bad_ids.body["error"]["message"].get<std::string>().find("512"), std::string::npos);

  // A text prompt is tokenized with the special tokens (BOS), as /tokenize does by default.
  auto comp = post(c, "/v1/completions", json{{"prompt", text}, {"max_tokens", 5}, {"temperature", 0}});
  ASSERT_EQ(comp.status, 200) << comp.raw;
  EXPECT_EQ(comp.body["object"], "text_completion");
  EXPECT_EQ(comp.body["model"], "stories260K");
  EXPECT_TRUE(comp.body["choices"][0]["logprobs"].is_null());
  EXPECT_EQ(comp.body["id"].get<std::string>().rfind("cmpl-", 0), 0u);
  const Reference ref = reference(tok.encode_hf(text, true), 5);
  EXPECT_EQ(comp.body["choices"][0]["text"], ref.text);
  EXPECT_EQ(comp.body["usage"]["total_tokens"], comp.body["usage"]["prompt_tokens"].get<int>() + 5);

  auto wrong_model = post(c, "/v1/completions", json{{"model", "gpt-4"}, {"prompt", {1, 2}}});
  EXPECT_EQ(wrong_model.status, 404);
  EXPECT_EQ(wrong_model.body["error"]["type"], "model_not_found");
  EXPECT_EQ(wrong_model.body["error"]["param"], "model");
  EXPECT_EQ(get(c, "/v1/nothing").status, 404);

  auto metrics = get(c, "/metrics");
  ASSERT_EQ(metrics.status, 200);
  for (const char* name : {"posenc_requests_total{endpoint=\"/v1/completions\",status=\"200\"}",
                           "posenc_requests_total{endpoint=\"/v1/completions\",status=\"404\"}",
                           "posenc_requests_total{endpoint=\"/tokenize\",status=\"200\"}",
                           "posenc_prompt_tokens_total", "posenc_generation_tokens_total", "posenc_queue_depth",
                           "posenc_running_sequences", "posenc_request_duration_seconds_count",
                           "posenc_time_to_first_token_seconds_count"})
    EXPECT_GE(metric(metrics.raw, name), 0) << name << "\n" << metrics.raw;
  EXPECT_EQ(metric(metrics.raw, "posenc_requests_total{endpoint=\"/v1/completions\",status=\"200\"}"), 1);
  EXPECT_EQ(metric(metrics.raw, "posenc_requests_total{endpoint=\"/tokenize\",status=\"200\"}"), 4);
  EXPECT_EQ(metric(metrics.raw, "posenc_generation_tokens_total"), 5);
  EXPECT_EQ(metric(metrics.raw, "posenc_request_duration_seconds_bucket{le=\"+Inf\"}"), 1);
  EXPECT_EQ(metric(metrics.raw, "posenc_queue_depth"), 0);
}

TEST(Serve, GreedyTokensAndLogprobsEqualTheInProcessForward) {
  ServeConfig cfg;
  cfg.prefix_cache_entries = 0;  // this test: no reuse (see PrefixReuse)
  Running s(cfg);
  auto c = s.client();
  const auto prompt = text_prompt(0, 40);
  ASSERT_GT(prompt.size(), 20u);
  for (int k : {0, 1, 5}) {
    for (bool echo : {false, true}) {
      const Reference ref = reference(prompt, 24, k);
      auto r = post(c, "/v1/completions", greedy(prompt, 24, k, echo));
      ASSERT_EQ(r.status, 200) << r.raw;
      expect_equal(r.body, prompt, ref, echo, k, fmt::format("k {} echo {}", k, echo));
      if (echo) {  // the echoed text is the prompt's text, then the completion
        const std::string t = r.body["choices"][0]["text"];
        EXPECT_EQ(t, stories().tok.decode(prompt) + ref.text);
        // text_offset: where each token's text starts.
        const auto& off = r.body["choices"][0]["logprobs"]["text_offset"];
        EXPECT_EQ(off[0], 0);
        EXPECT_EQ(off[prompt.size()].get<std::size_t>(), stories().tok.decode(prompt).size());
      }
    }
  }
  // Likelihood as the lab asks for it: max_tokens 1, echo, logprobs 1; and max_tokens 0 with echo.
  for (int mt : {0, 1}) {
    const Reference ref = reference(prompt, mt, 1);
    auto r = post(c, "/v1/completions", greedy(prompt, mt, 1, true));
    ASSERT_EQ(r.status, 200) << r.raw;
    expect_equal(r.body, prompt, ref, true, 1, fmt::format("max_tokens {}", mt));
  }
}

TEST(Serve, ConcurrentRequestsAreBatchedAndEachEqualsItsSingleRequestResult) {
  ServeConfig cfg;
  cfg.max_batch = 8;
  cfg.max_step_tokens = 64;  // long prompts are prefilled in chunks, next to other sequences' decodes
  Running s(cfg);
  constexpr int N = 12;
  std::vector<std::vector<int32_t>> prompts;
  std::vector<Reference> refs;
  for (int i = 0; i < N; ++i) {
    prompts.push_back(text_prompt(static_cast<std::size_t>(37 * i), static_cast<std::size_t>(5 + 11 * i)));
    refs.push_back(reference(prompts.back(), 20 + i, 2));
  }
  std::vector<Reply> replies(N);
  std::vector<std::thread> threads;
  for (int i = 0; i < N; ++i)
    threads.emplace_back([&, i] {
      auto c = s.client();
      replies[static_cast<std::size_t>(i)] = post(c, "/v1/completions", greedy(prompts[i], 20 + i, 2, i % 2 == 0));
    });
  for (auto& t : threads) t.join();
  for (int i = 0; i < N; ++i) {
    ASSERT_EQ(replies[i].status, 200) << replies[i].raw;
    expect_equal(replies[i].body, prompts[i], refs[i], i % 2 == 0, 2, fmt::format("request {}", i));
  }
  // The requests really shared steps.
  EXPECT_GT(s.server->stats().max_sequences_in_a_step, 1);
}

TEST(Serve, PrefixReuseHappensAndDoesNotChangeResults) {
  Running s;
  auto c = s.client();
  const auto base = text_prompt(100, 60);
  std::vector<int32_t> a = base, b = base;
  a.resize(base.size() - 10);
  b.resize(base.size() - 10);
  const auto tail_a = text_prompt(400, 8), tail_b = text_prompt(500, 12);
  a.insert(a.end(), tail_a.begin() + 1, tail_a.end());  // without their BOS
  b.insert(b.end(), tail_b.begin() + 1, tail_b.end());
  const std::size_t shared = base.size() - 10;
  auto ra = post(c, "/v1/completions", greedy(a, 12, 3, false));
  ASSERT_EQ(ra.status, 200) << ra.raw;
  const auto before = s.server->stats();
  EXPECT_EQ(before.prefix_cache_hits, 0);
  EXPECT_EQ(before.computed_prompt_tokens, static_cast<int64_t>(a.size()));
  auto rb = post(c, "/v1/completions", greedy(b, 12, 3, false));
  ASSERT_EQ(rb.status, 200) << rb.raw;
  const auto after = s.server->stats();
  EXPECT_EQ(after.prefix_cache_hits, 1);
  // b computed only what it does not share with a.
  EXPECT_EQ(after.computed_prompt_tokens - before.computed_prompt_tokens, static_cast<int64_t>(b.size() - shared));
  expect_equal(ra.body, a, reference(a, 12, 3), false, 3, "a");
  expect_equal(rb.body, b, reference(b, 12, 3), false, 3, "b (from a's prefix)");
  // The same prompt again: everything but its last token comes from the cache (a's sequence, or b's).
  auto rb2 = post(c, "/v1/completions", greedy(b, 12, 3, false));
  ASSERT_EQ(rb2.status, 200);
  EXPECT_EQ(s.server->stats().computed_prompt_tokens - after.computed_prompt_tokens, 1);
  expect_equal(rb2.body, b, reference(b, 12, 3), false, 3, "b again");
  // The metrics say so too.
  auto m = get(c, "/metrics");
  EXPECT_EQ(metric(m.raw, "posenc_prefix_cache_hits_total"), 2);
  // Prompt logprobs (echo) need every prompt row: the cached sequences kept none (they were no echo requests),
  // so this one is computed in full, and still exact.
  const auto hits = s.server->stats().prefix_cache_hits;
  auto re = post(c, "/v1/completions", greedy(b, 4, 2, true));
  ASSERT_EQ(re.status, 200);
  EXPECT_EQ(s.server->stats().prefix_cache_hits, hits);
  expect_equal(re.body, b, reference(b, 4, 2), true, 2, "b echo");
  // Its rows are kept with the cached sequence: an echo request sharing b's first tokens (the forced-choice
  // pattern: one request per candidate after the same prompt) reuses them up to one token before the first
  // difference (that token's row is recomputed: it scores the new token), bit for bit equal to a full forward.
  std::vector<int32_t> b2(b.begin(), b.end() - 5);
  const auto tail_c = text_prompt(700, 6);
  b2.insert(b2.end(), tail_c.begin() + 1, tail_c.end());
  const std::size_t common = b.size() - 5;
  {
    const auto st0 = s.server->stats();
    auto r2 = post(c, "/v1/completions", greedy(b2, 3, 2, true));
    ASSERT_EQ(r2.status, 200);
    const auto st1 = s.server->stats();
    EXPECT_EQ(st1.prefix_cache_hits, st0.prefix_cache_hits + 1);
    EXPECT_EQ(st1.computed_prompt_tokens - st0.computed_prompt_tokens, static_cast<int64_t>(b2.size() - (common - 1)));
    expect_equal(r2.body, b2, reference(b2, 3, 2), true, 2, "b2 echo from b's rows");
  }
  {
    // The same prompt with fewer alternatives (logprobs 0): all but the last prompt token from b2's own rows.
    const auto st0 = s.server->stats();
    auto r2 = post(c, "/v1/completions", greedy(b2, 3, 0, true));
    ASSERT_EQ(r2.status, 200);
    const auto st1 = s.server->stats();
    EXPECT_EQ(st1.prefix_cache_hits, st0.prefix_cache_hits + 1);
    EXPECT_EQ(st1.computed_prompt_tokens - st0.computed_prompt_tokens, 1);
    expect_equal(r2.body, b2, reference(b2, 3, 0), true, 0, "b2 echo again, logprobs 0");
  }
  // More alternatives than the cached rows hold: no reuse, computed in full, exact.
  std::vector<int32_t> b3(b.begin(), b.end() - 3);
  b3.push_back(tail_c[2]);
  const auto st0 = s.server->stats();
  auto r3 = post(c, "/v1/completions", greedy(b3, 2, 4, true));
  ASSERT_EQ(r3.status, 200);
  EXPECT_EQ(s.server->stats().computed_prompt_tokens - st0.computed_prompt_tokens, static_cast<int64_t>(b3.size()));
  expect_equal(r3.body, b3, reference(b3, 2, 4), true, 4, "b3 echo with k 4 (cached rows hold 2)");
}

TEST(Serve, SeededSamplingIsReproducibleWhateverTheBatch) {
  Running s;
  auto c = s.client();
  const auto prompt = text_prompt(10, 12);
  auto sampled = [&](uint64_t seed, double temperature, double top_p) {
    json body = {{"prompt", prompt}, {"max_tokens", 30}, {"temperature", temperature}, {"top_p", top_p},
                 {"seed", seed},     {"logprobs", 0}};
    auto r = post(c, "/v1/completions", body);
    EXPECT_EQ(r.status, 200) << r.raw;
    return r.body["choices"][0]["logprobs"]["token_ids"].get<std::vector<int32_t>>();
  };
  const auto a = sampled(7, 1.0, 0.9);
  EXPECT_EQ(sampled(7, 1.0, 0.9), a);
  EXPECT_NE(sampled(8, 1.0, 0.9), a);
  // The same request while 6 others run next to it.
  std::vector<std::thread> noise;
  std::atomic<bool> go{true};
  for (int i = 0; i < 6; ++i)
    noise.emplace_back([&, i] {
      auto cn = s.client();
      while (go) post(cn, "/v1/completions", json{{"prompt", text_prompt(200 + 13 * i, 9)}, {"max_tokens", 20}});
    });
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  const auto batched = sampled(7, 1.0, 0.9);
  go = false;
  for (auto& t : noise) t.join();
  EXPECT_EQ(batched, a);
  // The same draws in process: the forward of the prompt alone, then token by token, sampled with the seed's Rng.
  {
    const Model& m = stories().model;
    const int V = m.config().vocab_size;
    KvCache cache = m.make_cache(16);
    const auto seq = cache.create();
    std::vector<float> row;
    Model::SequenceInput in{seq, prompt, {}};
    m.forward(cache, std::span(&in, 1), Model::LogitsMode::last, row);
    posenc::detail::Rng rng(7);
    std::vector<int32_t> want;
    for (int i = 0; i < 30; ++i) {
      const int32_t next = posenc::serve::detail::sample_token(row.data(), V, 1.0, 0.9, rng);
      if (next == *stories().tok.eos_id()) break;
      want.push_back(next);
      const int32_t t[1] = {next};
      in = {seq, t, {}};
      m.forward(cache, std::span(&in, 1), Model::LogitsMode::last, row);
    }
    EXPECT_EQ(a, want);
  }
  // Temperature 0 is greedy, whatever the seed.
  EXPECT_EQ(sampled(1, 0.0, 0.5), reference(prompt, 30).tokens);
  // The sampler itself: a seed gives the splitmix64 draws of detail::Rng; top_p keeps the nucleus only.
  const int V = 5;
  const float row[V] = {2.0f, 1.0f, 0.5f, 3.0f, -1.0f};
  std::set<int32_t> seen;
  for (uint64_t seed = 0; seed < 200; ++seed) {
    posenc::detail::Rng rng(seed);
    seen.insert(posenc::serve::detail::sample_token(row, V, 1.0, 0.5, rng));
  }
  EXPECT_EQ(seen, std::set<int32_t>({3}));  // p(3) = 0.61 > 0.5: the nucleus is token 3 alone
  seen.clear();
  for (uint64_t seed = 0; seed < 200; ++seed) {
    posenc::detail::Rng rng(seed);
    seen.insert(posenc::serve::detail::sample_token(row, V, 1.0, 0.8, rng));
  }
  EXPECT_EQ(seen, std::set<int32_t>({0, 3}));  // 0.61 + 0.22 >= 0.8
}

TEST(Serve, StopStringsAndStopTokenIds) {
  Running s;
  auto c = s.client();
  const auto prompt = text_prompt(0, 20);
  const Reference full = reference(prompt, 40);
  ASSERT_GE(full.tokens.size(), 10u);
  // A stop string taken from the middle of the greedy continuation: the text is cut right before it.
  const std::string stop = full.text.substr(full.text.size() / 2, 4);
  const std::size_t cut = full.text.find(stop);
  auto r = post(c, "/v1/completions",
                json{{"prompt", prompt}, {"max_tokens", 40}, {"temperature", 0}, {"stop", {"zzzz", stop}}});
  ASSERT_EQ(r.status, 200) << r.raw;
  EXPECT_EQ(r.body["choices"][0]["text"], full.text.substr(0, cut));
  EXPECT_EQ(r.body["choices"][0]["finish_reason"], "stop");
  auto r1 = post(c, "/v1/completions", json{{"prompt", prompt}, {"max_tokens", 40}, {"temperature", 0}, {"stop", stop}});
  EXPECT_EQ(r1.body["choices"][0]["text"], full.text.substr(0, cut));
  // A stop token id: generation ends before it; the token is not part of the text or the logprobs.
  const int32_t stop_id = full.tokens[5];
  const Reference ref = reference(prompt, 40, 0, {stop_id});
  auto r2 = post(c, "/v1/completions",
                 json{{"prompt", prompt}, {"max_tokens", 40}, {"temperature", 0}, {"stop_token_ids", {stop_id}},
                      {"logprobs", 0}});
  ASSERT_EQ(r2.status, 200) << r2.raw;
  EXPECT_EQ(ref.finish_reason, "stop");
  expect_equal(r2.body, prompt, ref, false, 0, "stop_token_ids");
  // max_tokens: "length".
  auto r3 = post(c, "/v1/completions", json{{"prompt", prompt}, {"max_tokens", 3}, {"temperature", 0}});
  EXPECT_EQ(r3.body["choices"][0]["finish_reason"], "length");
  EXPECT_EQ(r3.body["usage"]["completion_tokens"], 3);
}

TEST(Serve, TheAllowedContextIsALimit) {
  ServeConfig cfg;
  cfg.max_model_len = 64;
  Running s(cfg);
  auto c = s.client();
  std::vector<int32_t> long_prompt(65, 300);
  auto r = post(c, "/v1/completions", json{{"prompt", long_prompt}, {"max_tokens", 1}});
  EXPECT_EQ(r.status, 400);
  EXPECT_EQ(r.body["error"]["param"], "prompt");
  EXPECT_NE(r.body["error"]["message"].get<std::string>().find("65 tokens exceed"), std::string::npos) << r.raw;
  EXPECT_NE(r.body["error"]["message"].get<std::string>().find("max_model_len 64"), std::string::npos) << r.raw;
  std::vector<int32_t> p60(60, 300);
  auto r2 = post(c, "/v1/completions", json{{"prompt", p60}, {"max_tokens", 5}});
  EXPECT_EQ(r2.status, 400);
  EXPECT_EQ(r2.body["error"]["param"], "max_tokens");
  EXPECT_NE(r2.body["error"]["message"].get<std::string>().find("max_model_len 64"), std::string::npos) << r2.raw;
  // Without max_tokens the default 16 shrinks to the room left and generation stops there ("length").
  const auto prompt = text_prompt(0, 80);
  std::vector<int32_t> p(prompt.begin(), prompt.begin() + 60);
  auto r3 = post(c, "/v1/completions", json{{"prompt", p}, {"temperature", 0}, {"logprobs", 0}});
  ASSERT_EQ(r3.status, 200) << r3.raw;
  const Reference ref = reference(p, 16, 0, {}, 64);
  expect_equal(r3.body, p, ref, false, 0, "at the context end");
  EXPECT_LE(r3.body["usage"]["total_tokens"].get<int>(), 64);
}

TEST(Serve, BadRequestsAre400NamingTheFieldAndTheServerKeepsServing) {
  Running s;
  auto c = s.client();
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"{\"prompt\": [1, 2", "malformed JSON"},
      {"[1, 2, 3]", "must be a JSON object"},
      {R"({"prompt": [1, 2], "temperature": 301e308})", "number overflow"},  // fuzz finding: out_of_range, not parse_error
      {R"({"prompt": [1, 2], "max_tokens": -1})", "max_tokens"},
      {R"({"prompt": [1, 2], "max_tokens": 0})", "max_tokens: 0 is allowed only with echo"},
      {R"({"prompt": [1, 2], "max_tokens": "5"})", "max_tokens: must be an integer"},
      {R"({"prompt": [1, 2], "max_tokens": 2.5})", "max_tokens: must be an integer"},
      {R"({"prompt": [1, 2], "frobnicate": 1})", "frobnicate: unknown field"},
      {R"({"prompt": [1, 512]})", "token id 512 is out of range [0, 512)"},
      {R"({"prompt": [1, -3]})", "token id -3 is out of range"},
      {R"({"prompt": [1, "x"]})", "prompt"},
      {R"({"prompt": [[1, 2], [3]]})", "one prompt per request"},
      {R"({"prompt": 17})", "prompt: must be a string or an array"},
      {R"({"max_tokens": 3})", "prompt: required"},
      {R"({"prompt": []})", "prompt: empty"},
      {R"({"prompt": [1, 2], "temperature": -0.5})", "temperature: must be >= 0"},
      {R"({"prompt": [1, 2], "temperature": "hot"})", "temperature: must be a number"},
      {R"({"prompt": [1, 2], "top_p": 0})", "top_p: must be in (0, 1]"},
      {R"({"prompt": [1, 2], "top_p": 1.5})", "top_p"},
      {R"({"prompt": [1, 2], "logprobs": 21})", "logprobs: must be an integer in [0, 20]"},
      {R"({"prompt": [1, 2], "logprobs": true})", "logprobs: must be an integer"},
      {R"({"prompt": [1, 2], "echo": 1})", "echo: must be a boolean"},
      {R"({"prompt": [1, 2], "seed": -1})", "seed"},
      {R"({"prompt": [1, 2], "stop": ["a", "b", "c", "d", "e"]})", "stop: at most 4"},
      {R"({"prompt": [1, 2], "stop": [""]})", "stop: a stop string must not be empty"},
      {R"({"prompt": [1, 2], "stop": 3})", "stop: must be a string"},
      {R"({"prompt": [1, 2], "stop_token_ids": [600]})", "stop_token_ids: token id 600"},
      {R"({"prompt": [1, 2], "n": 2})", "n: only 1"},
      {R"({"prompt": [1, 2], "stream": true})", "stream"},
      {R"({"prompt": [1, 2], "best_of": 3})", "best_of"},
      {R"({"prompt": [1, 2], "presence_penalty": 0.5})", "presence_penalty"},
      {R"({"prompt": [1, 2], "logit_bias": {"5": 1}})", "logit_bias"},
      {R"({"prompt": [1, 2], "suffix": "x"})", "suffix"},
  };
  const json good = {{"prompt", {1, 403, 407}}, {"max_tokens", 2}, {"temperature", 0}};
  for (const auto& [body, want] : cases) {
    auto r = post(c, "/v1/completions", body);
    EXPECT_EQ(r.status, 400) << body.substr(0, 80);
    ASSERT_TRUE(r.body.is_object()) << r.raw.substr(0, 200);
    const std::string msg = r.body["error"]["message"];
    EXPECT_NE(msg.find(want), std::string::npos) << "message: " << msg << "\nwanted: " << want;
    EXPECT_EQ(r.body["error"]["code"], 400);
    EXPECT_EQ(r.body["error"]["type"], "invalid_request_error");
    auto ok = post(c, "/v1/completions", good);
    EXPECT_EQ(ok.status, 200) << "after " << body.substr(0, 80);
  }
  // The field is named in "param" too.
  auto r = post(c, "/v1/completions", R"({"prompt": [1, 2], "max_tokens": -1})");
  EXPECT_EQ(r.body["error"]["param"], "max_tokens");
  EXPECT_EQ(post(c, "/tokenize", R"({"prompt": 3})").status, 400);
  EXPECT_EQ(post(c, "/tokenize", R"({"text": "x"})").body["error"]["param"], "text");
  EXPECT_EQ(post(c, "/detokenize", "not json").status, 400);
}

TEST(Serve, AFullQueueAnswers503WithRetryAfter) {
  ServeConfig cfg;
  cfg.max_batch = 1;
  cfg.max_queue = 1;
  cfg.step_delay = std::chrono::milliseconds(20);
  Running s(cfg);
  const auto prompt = text_prompt(0, 10);
  const json slow = {{"prompt", prompt}, {"max_tokens", 60}, {"temperature", 0}};
  Reply a, b;
  std::thread ta([&] {
    auto c = s.client();
    a = post(c, "/v1/completions", slow);
  });
  ASSERT_TRUE(eventually([&] { return s.server->stats().running_sequences == 1; }));
  std::thread tb([&] {
    auto c = s.client();
    b = post(c, "/v1/completions", slow);
  });
  ASSERT_TRUE(eventually([&] { return s.server->stats().queue_depth == 1; }));
  auto c = s.client();
  auto full = post(c, "/v1/completions", slow);
  EXPECT_EQ(full.status, 503);
  EXPECT_EQ(full.retry_after, "1");
  EXPECT_NE(full.body["error"]["message"].get<std::string>().find("queue is full"), std::string::npos);
  ta.join();
  tb.join();
  const Reference ref = reference(prompt, 60);
  EXPECT_EQ(a.status, 200);
  EXPECT_EQ(b.status, 200);
  EXPECT_EQ(a.body["choices"][0]["text"], ref.text);
  EXPECT_EQ(b.body["choices"][0]["text"], ref.text);
  EXPECT_EQ(metric(get(c, "/metrics").raw, "posenc_requests_total{endpoint=\"/v1/completions\",status=\"503\"}"), 1);
}

TEST(Serve, AClientThatDisconnectsFreesItsSequence) {
  ServeConfig cfg;
  cfg.step_delay = std::chrono::milliseconds(20);
  cfg.prefix_cache_entries = 0;
  Running s(cfg);
  {
    // 400 tokens at >= 20 ms a step: >= 8 s; the client sends the request, gives up after 1 s and closes the socket.
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    ASSERT_GE(fd, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(static_cast<uint16_t>(s.port));
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ASSERT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
    const std::string body = json{{"prompt", {1, 403}}, {"max_tokens", 400}, {"temperature", 0}}.dump();
    const std::string req = fmt::format(
        "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: "
        "{}\r\n\r\n{}",
        body.size(), body);
    ASSERT_EQ(::send(fd, req.data(), req.size(), MSG_NOSIGNAL), static_cast<ssize_t>(req.size()));
    ASSERT_TRUE(eventually([&] { return s.server->stats().running_sequences == 1; }));
    std::this_thread::sleep_for(std::chrono::milliseconds(1000));
    ::close(fd);
  }
  EXPECT_TRUE(eventually([&] { return s.server->stats().requests_cancelled == 1; }, 3));
  const auto st = s.server->stats();
  EXPECT_EQ(st.running_sequences, 0);
  EXPECT_EQ(st.kv_blocks_in_use, 0);
  EXPECT_LT(st.generation_tokens, 400);
  EXPECT_EQ(st.requests_completed, 0);
  auto c = s.client();
  EXPECT_EQ(metric(get(c, "/metrics").raw, "posenc_cancelled_requests_total"), 1);
}

TEST(Serve, StopFinishesInFlightRequests) {
  ServeConfig cfg;
  cfg.step_delay = std::chrono::milliseconds(10);
  cfg.max_batch = 2;  // one of the three waits in the queue
  Running s(cfg);
  std::vector<std::vector<int32_t>> prompts = {text_prompt(0, 8), text_prompt(50, 9), text_prompt(90, 10)};
  std::vector<Reply> replies(3);
  std::vector<std::thread> threads;
  for (int i = 0; i < 3; ++i)
    threads.emplace_back([&, i] {
      auto c = s.client();
      replies[i] = post(c, "/v1/completions", greedy(prompts[i], 40, 0, false));
    });
  // Two running and the third queued: a request that only arrives after stop() began is refused (503, draining),
  // which is not what this test is about (it failed so under load when only the two running were waited for).
  ASSERT_TRUE(eventually([&] {
    const auto st = s.server->stats();
    return st.running_sequences == 2 && st.queue_depth == 1;
  }));
  std::atomic<int> health_while_draining{0};
  std::thread stopper([&] { s.server->stop(); });
  // While draining, /health says so.
  eventually([&] {
    auto c = s.client();
    const int st = get(c, "/health").status;
    health_while_draining = st;
    return st == 503 || st == -1;
  });
  stopper.join();
  for (auto& t : threads) t.join();
  EXPECT_EQ(health_while_draining, 503);
  for (int i = 0; i < 3; ++i) {
    ASSERT_EQ(replies[i].status, 200) << i << " " << replies[i].raw;
    expect_equal(replies[i].body, prompts[i], reference(prompts[i], 40), false, 0, fmt::format("in-flight {}", i));
  }
  auto c = s.client();
  EXPECT_EQ(get(c, "/health").status, -1);  // stopped: nothing listens
}

TEST(Serve, TheConfigurationIsValidated) {
  using posenc::test::message_of;
  auto make = [](ServeConfig c) { posenc::serve::Server s(stories().model, stories().tok, c); };
  ServeConfig c;
  c.max_batch = 0;
  EXPECT_EQ(message_of<ConfigError>([&] { make(c); }), "max_batch: must be >= 1 (got 0)");
  c = {};
  c.kv_cache_tokens = 100;
  EXPECT_NE(message_of<ConfigError>([&] { make(c); }).find("kv_cache_tokens: 100 tokens cannot hold one sequence of "
                                                          "max_model_len 512"),
            std::string::npos);
  c = {};
  c.port = 70000;
  EXPECT_EQ(message_of<ConfigError>([&] { make(c); }), "port: must be in [0, 65535] (got 70000)");
  c = {};
  c.max_step_tokens = 4;
  EXPECT_NE(message_of<ConfigError>([&] { make(c); }).find("max_step_tokens: must be >= max_batch (16)"),
            std::string::npos);
  // A tokenizer that is not the model's.
  const Tokenizer other = Tokenizer::load_tokenizer_json(posenc::test::shared_dir() / "tokenizers/gpt2/tokenizer.json");
  EXPECT_NE(message_of<TokenizerError>([&] { posenc::serve::Server s(stories().model, other, {}); })
                .find("does not match the model's vocab_size 512"),
            std::string::npos);
}

}  // namespace

}  // namespace POSENC_UNITY_ID
