// The lab's HTTP path against a real third-party server: llama.cpp's llama-server
// (built from the source node-llama-cpp bundles, by scripts/build-llama-server)
// serving stories260K.gguf on loopback. SKIPPED, saying how to build it, when the
// binary is absent (.ci/run does not build it: ~10 minutes on 2 cores).
//
// The server runs with an F32 KV cache AND flash attention off (-fa off): with
// flash attention llama.cpp casts F32 K/V to F16 before attention
// (src/llama-graph.cpp), whatever --cache-type-k/v say, and greedy text then
// drifts from an F32 forward (measured: 600 greedy tokens diverge at token 583,
// chosen-token logprobs off by up to 1.3e-2; with -fa off identical, within 1e-5;
// /work/helper-notes/llama-server-findings.md).
//
// What is compared and why:
//  - Tokenization. The lab always sends token ids built by posenc's tokenizer, so
//    the meaningful question is whether those ids are what the served model's own
//    tokenizer makes of the prompt's text (needles at exact token depths, lengths
//    exact in the served model's tokens, no out-of-distribution segmentation). So
//    for every generation task's prompt at two lengths: llama-server's /tokenize of
//    TaskSample::prompt_text with add_special=true (BOS, as the lab's prompts begin
//    with it) must equal TaskSample::prompt_tokens, and with add_special=false the
//    same ids without the BOS. The reverse (/detokenize of the ids) is checked too,
//    but many id sequences decode to one text, so it is the weaker check.
//  - Greedy completions. /v1/completions with the ids, temperature 0, max_tokens =
//    the answer budget, logprobs 1 (for the chosen ids) must give the ids and the
//    text of the in-process lab (posenc::evaluate_samples on the same GGUF), and
//    each chosen token's logprob must match log_softmax of posenc's logits.
//    llama-server does not stop at BOS (only EOG tokens; it ignores
//    stop_token_ids), posenc does: where posenc stopped at BOS/EOS, the server's
//    next id must be that token and its ids before it posenc's.
#include <algorithm>
#include <map>
#include <cstdio>
#include <memory>
#include <optional>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "eval/logprob.hpp"
#include "llama_server_support.hpp"
#include "posenc/endpoint.hpp"
#include "posenc/eval.hpp"
#include "posenc/io.hpp"
#include "posenc/model.hpp"
#include "posenc/tasks.hpp"
#include "posenc/tokenizer.hpp"

namespace POSENC_UNITY_ID {  // this file's own namespace in the tests' unity build (CMakeLists.txt)

using namespace posenc;
namespace fs = std::filesystem;
using nlohmann::json;

namespace {

fs::path gguf_path() { return test::shared_dir() / "models/stories260K/stories260K.gguf"; }

const Tokenizer& gguf_tok() {
  static const Tokenizer t = *Model::load_bundled_tokenizer(gguf_path());
  return t;
}
const Model& gguf_model() {
  static const Model m = Model::load(gguf_path());
  return m;
}
const Haystack& hay() {
  static const Haystack h = Haystack::build(read_file(test::text_path()), gguf_tok(), TaskGenerator::candidate_names());
  return h;
}

constexpr int64_t kLengths[] = {512, 1024};
constexpr int kServerContext = 2048;  // -c: every prompt + answer budget of kLengths fits one slot

std::vector<std::string> generation_tasks() {
  std::vector<std::string> out;
  for (const auto& t : eval_tasks())
    if (t.kind == TaskKind::generation) out.emplace_back(t.name);
  return out;
}

// One server for the whole suite (ctest runs each test in its own process, so one per test there).
class LlamaServer : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (!test::llama_server_missing().empty()) return;
    server_ = std::make_unique<test::LlamaServerProcess>();
    try {
      server_->start(test::llama_server_path(),
                     {"-m", gguf_path().string(), "--host", "127.0.0.1", "--port", "0", "-c",
                      std::to_string(kServerContext), "--cache-type-k", "f32", "--cache-type-v", "f32", "-fa", "off",
                      "--threads", "1", "-np", "1", "--no-webui", "--alias", "stories260K"});
    } catch (const std::exception& e) {
      start_error_ = e.what();
      server_.reset();
    }
  }
  static void TearDownTestSuite() { server_.reset(); }

  void SetUp() override {
    if (const auto why = test::llama_server_missing(); !why.empty()) GTEST_SKIP() << why;
    ASSERT_TRUE(server_) << "llama-server did not start: " << start_error_;
  }

  // POST path with a JSON body; fails the test (ADD_FAILURE) and returns null on a transport error
  // or a status other than 200.
  static json post(const std::string& path, const json& body) {
    httplib::Client cli("127.0.0.1", server_->port());
    cli.set_connection_timeout(5);
    cli.set_read_timeout(60);
    auto r = cli.Post(path, body.dump(), "application/json");
    if (!r) {
      ADD_FAILURE() << "POST " << path << ": " << httplib::to_string(r.error());
      return nullptr;
    }
    if (r->status != 200) {
      ADD_FAILURE() << "POST " << path << ": HTTP " << r->status << ": " << r->body;
      return nullptr;
    }
    return json::parse(r->body);
  }
  static std::vector<int32_t> ids_of(const json& tokenize_answer) {
    return tokenize_answer.at("tokens").get<std::vector<int32_t>>();
  }

  static inline std::unique_ptr<test::LlamaServerProcess> server_;
  static inline std::string start_error_;
};

}  // namespace

// Sets (or, with nullptr, unsets) an environment variable for its lifetime.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    if (value) ::setenv(name, value, 1);
    else ::unsetenv(name);
  }
  ~ScopedEnv() {
    if (old_) ::setenv(name_, old_->c_str(), 1);
    else ::unsetenv(name_);
  }

 private:
  const char* name_;
  std::optional<std::string> old_;
};

std::string script_print_path() {
  const std::string cmd = std::string("'") + POSENC_SOURCE_DIR + "/scripts/build-llama-server' --print-path";
  std::unique_ptr<FILE, int (*)(FILE*)> p(::popen(cmd.c_str(), "r"), ::pclose);
  if (!p) return "popen failed";
  std::string out;
  char buf[512];
  while (std::fgets(buf, sizeof buf, p.get())) out += buf;
  if (::pclose(p.release()) != 0) return "script failed: " + out;
  while (!out.empty() && out.back() == '\n') out.pop_back();
  return out;
}

// The C++ side looks for the binary where the script puts it (the commit is written in both).
TEST(LlamaServerLocate, CachePathMatchesBuildScript) {
  const ScopedEnv no_cache("POSENC_LLAMA_CPP_CACHE", nullptr);
  {
    const ScopedEnv xdg("XDG_CACHE_HOME", "/tmp/posenc-xdg-test");
    const std::string expected = std::string("/tmp/posenc-xdg-test/posenc/llama.cpp-") +
                                 std::string(test::kLlamaCppCommit).substr(0, 12) + "/bin/llama-server";
    EXPECT_EQ(script_print_path(), expected);
    EXPECT_EQ(test::llama_server_cache_path().string(), expected);
  }
  {
    const ScopedEnv xdg("XDG_CACHE_HOME", nullptr);
    const ScopedEnv home("HOME", "/tmp/posenc-home-test");
    EXPECT_EQ(script_print_path(), test::llama_server_cache_path().string());
    EXPECT_EQ(test::llama_server_cache_path().parent_path().parent_path().parent_path(),
              fs::path("/tmp/posenc-home-test/.cache/posenc"));
  }
  const ScopedEnv cache("POSENC_LLAMA_CPP_CACHE", "/tmp/posenc-cache-test");
  EXPECT_EQ(script_print_path(), "/tmp/posenc-cache-test/bin/llama-server");
  EXPECT_EQ(test::llama_server_cache_path().string(), "/tmp/posenc-cache-test/bin/llama-server");
}

TEST_F(LlamaServer, ReportsTheModelAndItsContext) {
  httplib::Client cli("127.0.0.1", server_->port());
  cli.set_read_timeout(10);
  auto models = cli.Get("/v1/models");
  ASSERT_TRUE(models && models->status == 200);
  const auto m = json::parse(models->body);
  ASSERT_EQ(m.at("data").size(), 1u);
  EXPECT_EQ(m["data"][0].at("id"), "stories260K");
  // No max_model_len (a vLLM field); the slot's context is meta.n_ctx.
  EXPECT_FALSE(m["data"][0].contains("max_model_len"));
  EXPECT_EQ(m["data"][0].at("meta").at("n_ctx"), kServerContext);
  EXPECT_EQ(m["data"][0]["meta"].at("n_vocab"), gguf_model().config().vocab_size);
  auto props = cli.Get("/props");
  ASSERT_TRUE(props && props->status == 200);
  const auto pr = json::parse(props->body);
  // "b<build number>-<commit>": the findings these tests pin (echo ignored, logprobs shape, ...) are this commit's.
  const std::string build = pr.at("build_info").get<std::string>();
  const std::string commit = std::string("-") + std::string(test::kLlamaCppCommit).substr(0, 7);
  EXPECT_TRUE(build.size() > commit.size() && build.compare(build.size() - commit.size(), commit.size(), commit) == 0)
      << build << ": POSENC_LLAMA_SERVER points at another llama.cpp than scripts/build-llama-server's";
  EXPECT_EQ(pr.at("default_generation_settings").at("n_ctx"), kServerContext);
}

TEST_F(LlamaServer, GenerationPromptsTokenizeIdentically) {
  const Tokenizer& tok = gguf_tok();
  ASSERT_TRUE(tok.bos_id().has_value());
  const TaskGenerator gen(tok, hay(), TaskOptions{});
  int compared = 0;
  for (const auto& task : generation_tasks()) {
    int fitted = 0;
    for (const int64_t length : kLengths) {
      for (const double depth : {0.0, 0.5}) {
        TaskSample s;
        try {
          s = gen.make(task, /*index=*/0, length, depth);
        } catch (const TaskDoesNotFit&) {
          continue;
        }
        ++fitted;
        SCOPED_TRACE(fmt::format("{} length {} depth {}", task, length, depth));
        ASSERT_EQ(s.prompt_tokens.front(), *tok.bos_id());
        const json with_bos = post("/tokenize", {{"content", s.prompt_text}, {"add_special", true}});
        const json without = post("/tokenize", {{"content", s.prompt_text}});
        ASSERT_FALSE(with_bos.is_null() || without.is_null());
        const std::vector<int32_t> body(s.prompt_tokens.begin() + 1, s.prompt_tokens.end());
        EXPECT_EQ(ids_of(with_bos), s.prompt_tokens);
        EXPECT_EQ(ids_of(without), body);
        // The reverse: llama.cpp decodes the ids (without BOS) to the text with SentencePiece's dummy prefix space.
        const json text = post("/detokenize", {{"tokens", body}});
        ASSERT_FALSE(text.is_null());
        EXPECT_EQ(text.at("content").get<std::string>(), " " + s.prompt_text);
        ++compared;
      }
    }
    EXPECT_GT(fitted, 0) << task << " fits none of the lengths";
  }
  EXPECT_GE(compared, 2 * static_cast<int>(generation_tasks().size()));
}

TEST_F(LlamaServer, GreedyCompletionsEqualTheInProcessLab) {
  const Tokenizer& tok = gguf_tok();
  const Model& model = gguf_model();
  const int V = model.config().vocab_size;
  const TaskGenerator gen(tok, hay(), TaskOptions{});
  std::vector<TaskSample> samples;
  for (const auto& task : generation_tasks()) {
    for (const int64_t length : kLengths) {
      try {
        samples.push_back(gen.make(task, /*index=*/1, length, 0.5));
        break;  // the shortest length that fits, one sample per task
      } catch (const TaskDoesNotFit&) {
      }
    }
  }
  ASSERT_EQ(samples.size(), generation_tasks().size());
  const auto outcomes = evaluate_samples(model, tok, samples);
  const int32_t bos = *tok.bos_id(), eos = *tok.eos_id();
  int stopped_at_special = 0;
  for (std::size_t i = 0; i < samples.size(); ++i) {
    const auto& s = samples[i];
    const auto& o = outcomes[i];
    SCOPED_TRACE(fmt::format("{} length {} (prompt {} tokens, answer budget {})", s.task, s.length,
                             s.prompt_tokens.size(), s.answer_budget));
    const json r = post("/v1/completions", {{"model", "stories260K"},
                                            {"prompt", s.prompt_tokens},
                                            {"max_tokens", s.answer_budget},
                                            {"temperature", 0},
                                            {"logprobs", 1}});
    ASSERT_FALSE(r.is_null());
    const json& choice = r.at("choices").at(0);
    EXPECT_EQ(r.at("usage").at("prompt_tokens"), s.prompt_tokens.size());
    std::vector<int32_t> ids;
    std::vector<double> lps;
    std::string bytes_text;  // the text of the ids posenc also generated, from the server's bytes
    for (const auto& t : choice.at("logprobs").at("content")) {
      ids.push_back(t.at("id").get<int32_t>());
      lps.push_back(t.at("logprob").get<double>());
      if (ids.size() <= o.new_tokens.size())
        for (const auto& b : t.at("bytes")) bytes_text.push_back(static_cast<char>(b.get<int>()));
    }
    const std::size_t k = o.new_tokens.size();
    ASSERT_GE(ids.size(), k);
    EXPECT_EQ(std::vector<int32_t>(ids.begin(), ids.begin() + static_cast<std::ptrdiff_t>(k)), o.new_tokens);
    EXPECT_EQ(bytes_text, o.prediction);
    if (static_cast<int>(k) < s.answer_budget) {
      // posenc stopped before BOS/EOS; llama-server generated it (EOS: and stopped; BOS: and went on).
      ASSERT_GT(ids.size(), k);
      EXPECT_TRUE(ids[k] == bos || ids[k] == eos) << ids[k];
      ++stopped_at_special;
    } else {
      EXPECT_EQ(ids.size(), k);
      EXPECT_EQ(choice.at("finish_reason"), "length");
      EXPECT_EQ(choice.at("text").get<std::string>(), o.prediction);
    }
    // The chosen tokens' logprobs against log_softmax of posenc's own logits of prompt + continuation.
    std::vector<int32_t> all = s.prompt_tokens;
    all.insert(all.end(), ids.begin(), ids.end());
    const auto logits = model.score_window(all);
    const std::size_t p = s.prompt_tokens.size();
    for (std::size_t j = 0; j < ids.size(); ++j)
      EXPECT_NEAR(lps[j], detail::log_prob(logits.data() + (p - 1 + j) * V, V, ids[j]), 1e-4) << "token " << j;
  }
  RecordProperty("stopped_at_bos_or_eos", stopped_at_special);
}

// llama-server has no prompt log-probabilities: `echo` is accepted and ignored (HTTP 200; the
// "Only no echo is supported" check of tools/server/server-common.cpp is dead code in this commit)
// and `logprobs` is llama.cpp's chat-style list of the generated tokens only, not the OpenAI legacy
// {tokens, token_logprobs, top_logprobs, text_offset}. This is what the client's likelihood probe
// must see as "not supported by this endpoint".
TEST_F(LlamaServer, EchoGivesNoPromptLogprobs) {
  const std::vector<int32_t> prompt = gguf_tok().encode("Once upon a time", true, false);
  ASSERT_EQ(prompt.size(), 5u);
  const json r = post("/v1/completions",
                      {{"prompt", prompt}, {"max_tokens", 1}, {"temperature", 0}, {"logprobs", 1}, {"echo", true}});
  ASSERT_FALSE(r.is_null());
  const json& lp = r.at("choices").at(0).at("logprobs");
  EXPECT_FALSE(lp.contains("token_logprobs"));
  ASSERT_TRUE(lp.contains("content"));
  EXPECT_EQ(lp["content"].size(), 1u);  // the generated token only: no entries for the 5 prompt tokens
  EXPECT_EQ(r["choices"][0].at("text"), ",");
}

// `posenc eval --endpoint` (run_eval_endpoint, the CLI's library call) against llama-server vs the in-process lab
// on the same GGUF and tokenizer: the generation cells equal cell for cell, every prediction equal (the client cuts
// llama-server's answer at the first BOS/EOS id of logprobs.content[], which llama-server does not stop at, and
// decodes the ids locally); the likelihood cells and the perplexity matrix are "not supported by this endpoint"
// (llama-server answers echo with 200 and no prompt logprobs); run.json records build_info and the rules used.
TEST_F(LlamaServer, EvalEndpointRunsAgainstLlamaServer) {
  test::TempDir d;
  const std::string text = read_file(test::text_path());
  EvalConfig c;
  c.model_path = gguf_path().string();
  c.tokenizer_path = gguf_path().string();
  c.haystack_path = test::text_path().string();
  c.tasks = {"passkey", "niah_single", "niah_multiquery", "name_recall"};
  c.lengths = {512};
  c.depths = {0.0, 0.5};
  c.samples = 2;
  c.ppl_tokens = 600;
  c.out = d.path() / "local";
  const EvalRunResult local = run_eval(gguf_model(), gguf_tok(), text, c);
  EndpointEvalConfig e;
  e.endpoints = {parse_endpoint_spec(fmt::format("http://127.0.0.1:{}/v1=llama-server", server_->port()))};
  e.served_model = "stories260K";
  e.options.concurrency = 1;  // -np 1: one slot
  e.options.retries = 1;
  e.options.request_timeout = 60;
  e.trained_context = gguf_model().trained_context();  // the in-process buckets' anchor
  EvalConfig ce = c;
  ce.out = d.path() / "http";
  const EvalRunResult http = run_eval_endpoint(e, gguf_tok(), text, ce);
  const json sl = json::parse(read_file(local.run_dir / "summary.json"));
  const json sh = json::parse(read_file(http.run_dir / "summary.json"));
  std::map<std::string, json> cl, ch;
  for (const auto& x : sl["cells"]) cl[fmt::format("{}|{}|{}|{}", x["task"].get<std::string>(), x["control"].get<std::string>(), x["length"].get<int64_t>(), x["depth"].dump())] = x;
  for (const auto& x : sh["cells"]) ch[fmt::format("{}|{}|{}|{}", x["task"].get<std::string>(), x["control"].get<std::string>(), x["length"].get<int64_t>(), x["depth"].dump())] = x;
  ASSERT_EQ(cl.size(), ch.size());
  std::size_t generation_cells = 0, unsupported = 0;
  for (const auto& [k, a] : cl) {
    const json& b = ch.at(k);
    if (a["task"] == "name_recall") {
      EXPECT_EQ(b["status"], "not supported by this endpoint") << k;
      EXPECT_EQ(b["n"], 0) << k;  // never zeros counted as results
      ++unsupported;
    } else {
      EXPECT_EQ(a["status"], "ok") << k;
      EXPECT_EQ(b["status"], "ok") << k;
      EXPECT_EQ(a["n"], b["n"]) << k;
      EXPECT_EQ(a["metrics"], b["metrics"]) << k;
      ++generation_cells;
    }
  }
  EXPECT_EQ(generation_cells, 3u * 2);
  EXPECT_GE(unsupported, 2u);
  // Every generation sample's prediction and token count equal.
  auto rows = [](const fs::path& dir) {
    std::map<std::string, json> m;
    const std::string all = read_file(dir / "samples.jsonl");
    std::size_t pos = 0;
    while (pos < all.size()) {
      const std::size_t nl = all.find('\n', pos);
      const json r = json::parse(all.substr(pos, nl - pos));
      pos = nl + 1;
      if (r.contains("candidate_logprobs")) continue;
      m[fmt::format("{}|{}|{}|{}", r["task"].get<std::string>(), r["length"].get<int64_t>(), r["depth"].dump(),
                    r["index"].get<int64_t>())] = r;
    }
    return m;
  };
  const auto rl = rows(local.run_dir), rh = rows(http.run_dir);
  ASSERT_EQ(rl.size(), rh.size());
  EXPECT_EQ(rl.size(), 3u * 2 * 2);
  std::size_t cut_before_budget = 0;
  for (const auto& [k, a] : rl) {
    const json& b = rh.at(k);
    EXPECT_EQ(a["prediction"], b["prediction"]) << k;
    EXPECT_EQ(a["predicted_tokens"], b["predicted_tokens"]) << k;
    EXPECT_EQ(a["correct"], b["correct"]) << k;
    cut_before_budget += a["predicted_tokens"].get<int64_t>() < 8;
  }
  const json qh = json::parse(read_file(http.run_dir / "ppl.json"));
  ASSERT_EQ(qh["results"].size(), 1u);
  EXPECT_EQ(qh["results"][0]["status"], "not supported by this endpoint");
  EXPECT_TRUE(qh["results"][0]["nll"].is_null());
  const json run = json::parse(read_file(http.run_dir / "run.json"));
  const json& ep = run["endpoints"][0];
  EXPECT_EQ(ep["served_model"], "stories260K");
  EXPECT_EQ(ep["likelihood"], false);
  EXPECT_NE(ep["likelihood_note"].get<std::string>().find("echo ignored"), std::string::npos) << ep["likelihood_note"];
  EXPECT_EQ(ep["max_model_len"], kServerContext);
  EXPECT_EQ(ep["max_model_len_source"], "/v1/models meta.n_ctx");
  EXPECT_EQ(ep["generation_logprobs"], 1);  // llama-server's logprobs 0 is null: no ids
  EXPECT_NE(ep["prediction_rule"].get<std::string>().find("token ids"), std::string::npos);
  ASSERT_TRUE(ep["build_info"].is_string());
  EXPECT_NE(ep["build_info"].get<std::string>().find(std::string(test::kLlamaCppCommit).substr(0, 7)), std::string::npos)
      << ep["build_info"];
  EXPECT_NE(ep["tokenize_check"].get<std::string>().find("matched"), std::string::npos) << ep["tokenize_check"];
  std::printf("[ llama-server ] %zu generation cells and %zu predictions equal the in-process lab (%zu of them "
              "with fewer than 8 predicted tokens); build_info %s\n",
              generation_cells, rl.size(), cut_before_budget, ep["build_info"].get<std::string>().c_str());
}

}  // namespace POSENC_UNITY_ID
