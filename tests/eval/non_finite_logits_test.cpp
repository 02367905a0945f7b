// A model whose weights are all finite but whose forward pass overflows float32 (a final norm weight of 3e38, as a
// corrupted checkpoint can have): perplexity, the lab's forced choice and greedy continuation, and generate() refuse
// its NaN/infinite logits with a NumericError naming where, instead of reporting NaN or a token taken from them; the
// CLI prints the error and exits 1. A sound model of the same shape passes the same calls. posenc serve answers such
// a request 500 with error type numeric_error (also on a chunked 200), and `eval --endpoint` against it stops after
// one attempt with EndpointNumericError naming non-finite logits, not "endpoint unavailable".
#include <algorithm>
#include <cmath>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "posenc/checkpoint.hpp"
#include "posenc/endpoint.hpp"
#include "posenc/error.hpp"
#include "posenc/eval.hpp"
#include "posenc/generate.hpp"
#include "posenc/io.hpp"
#include "posenc/model.hpp"
#include "posenc/perplexity.hpp"
#include "posenc/tokenizer.hpp"
#include "../model/random_checkpoint.hpp"
#include "../serve/serve_support.hpp"
#include "test_support.hpp"

namespace POSENC_UNITY_ID {  // this file's own namespace in the tests' unity build (CMakeLists.txt)

using namespace posenc;
using posenc::test::run_cli;
using posenc::test::TempDir;

namespace {

/// A 2-layer RoPE posenc checkpoint over 16 symbols (what `posenc train` writes, tiny); `overflow`: every weight of
/// the final norm 3e38 (finite), so that the logits overflow float32.
PosencCheckpoint checkpoint(bool overflow) {
  PosencCheckpoint ck;
  posenc::test::set_tiny_llama(ck.config, 64);
  ck.positional.family = PositionFamily::rope;
  RopeParams p;
  p.head_dim = 8;
  ck.positional.rope.params = p;
  ck.positional.rope.freqs = compute_rope_frequencies(p);
  ck.positional.rope.layout = RopeLayout::half;
  posenc::test::RandomTensors t(ck, 7, 0.4f);
  t.add_llama();
  if (overflow)
    for (auto& tensor : ck.tensors)
      if (tensor.name == "norm")
        for (float& v : tensor.data) v = 3e38f;
  ck.symbols = {"<pad>", "<bos>", "<eos>", "a", "b", "c", "d", "e", "f", "g", "h", "i", "j", "k", "=", "|"};
  return ck;
}

std::vector<int32_t> ids(std::size_t n) {
  std::vector<int32_t> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = static_cast<int32_t>(3 + (i * 7) % 13);
  return v;
}

std::string message_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const NumericError& e) {
    return e.what();
  }
  return "";
}

TEST(NonFiniteLogits, EveryScorerRefusesThemNamingWhere) {
  TempDir d;
  save_posenc_checkpoint(d.path() / "bad.pt", checkpoint(true));
  save_posenc_checkpoint(d.path() / "good.pt", checkpoint(false));
  const Model bad = Model::load(d.path() / "bad.pt"), good = Model::load(d.path() / "good.pt");
  const auto stream = ids(100);
  PplOptions o;
  o.context = 32;

  // The premise: every weight finite, the logits not.
  const std::vector<float> logits = bad.score_window(std::span(stream).first(8));
  EXPECT_FALSE(std::all_of(logits.begin(), logits.end(), [](float v) { return std::isfinite(v); }));

  const std::string ppl = message_of([&] { evaluate_perplexity(bad, stream, o); });
  // Every window overflows; on several threads whichever fails first is named.
  EXPECT_NE(ppl.find("window of tokens ["), std::string::npos) << ppl;
  EXPECT_NE(ppl.find("), position 0: logit "), std::string::npos) << ppl;
  EXPECT_NE(ppl.find("is not finite"), std::string::npos) << ppl;
  const PplResult ok = evaluate_perplexity(good, stream, o);
  EXPECT_TRUE(std::isfinite(ok.nll));

  for (const Model* m : {&bad, &good}) {
    KvCache cache = m->make_cache(16);
    const auto seq = cache.create();
    std::vector<float> last;
    const auto prompt = ids(10);
    Model::SequenceInput in{seq, prompt, {}};
    m->forward(cache, std::span<const Model::SequenceInput>(&in, 1), Model::LogitsMode::last, last);
    const std::vector<std::vector<int32_t>> candidates = {{4, 5}, {6}};
    const std::string choice = message_of([&] { score_candidates(*m, cache, seq, last, candidates); });
    const std::string greedy = message_of([&] { greedy_continue(*m, cache, seq, last, 4, {}); });
    if (m == &bad) {
      EXPECT_NE(choice.find("the context's last position: logit "), std::string::npos) << choice;
      EXPECT_NE(greedy.find("greedy continuation step 0: logit "), std::string::npos) << greedy;
      EXPECT_EQ(cache.size(seq), 10);  // the forks of the candidates are freed, the sequence kept
    } else {
      EXPECT_EQ(choice, "");
      EXPECT_EQ(greedy, "");
    }
  }

  const Tokenizer tok = Tokenizer::from_symbols(checkpoint(false).symbols);
  GenerateOptions g;
  g.max_new_tokens = 3;
  const std::string gen = message_of([&] { generate(bad, tok, "a b c", g); });
  EXPECT_NE(gen.find("(the logits after it, for generated token 0): logit "), std::string::npos) << gen;
  EXPECT_EQ(message_of([&] { generate(good, tok, "a b c", g); }), "");
}

TEST(NonFiniteLogits, TheCliPrintsTheErrorAndExits1) {
  TempDir d;
  save_posenc_checkpoint(d.path() / "bad.pt", checkpoint(true));
  std::string text;
  for (int i = 0; i < 40; ++i) text += "a b c = | ";
  std::ofstream(d.path() / "t.txt") << text;
  const auto r = run_cli("ppl --model '" + (d.path() / "bad.pt").string() + "' --text '" + (d.path() / "t.txt").string() +
                         "' --context 32 --json '" + (d.path() / "ppl.json").string() + "'");
  EXPECT_EQ(r.exit_code, 1) << r.out << r.err;
  EXPECT_NE(r.err.find("is not finite"), std::string::npos) << r.err;
  EXPECT_FALSE(std::filesystem::exists(d.path() / "ppl.json"));
}

/// posenc serve of the overflowing checkpoint on a free port (`edit` adjusts its configuration), with a client.
struct OverflowingServer {
  explicit OverflowingServer(const std::function<void(posenc::serve::ServeConfig&)>& edit = {})
      : bad(saved(dir)), tok(Tokenizer::from_symbols(checkpoint(false).symbols)), server(bad, tok, config(edit)),
        client("127.0.0.1", server.start()) {
    client.set_read_timeout(60, 0);
  }
  static Model saved(const TempDir& d) {
    save_posenc_checkpoint(d.path() / "bad.pt", checkpoint(true));
    return Model::load(d.path() / "bad.pt");
  }
  static posenc::serve::ServeConfig config(const std::function<void(posenc::serve::ServeConfig&)>& edit) {
    ::signal(SIGPIPE, SIG_IGN);
    posenc::serve::ServeConfig cfg;
    cfg.port = 0;
    cfg.served_model_name = "bad";
    if (edit) edit(cfg);
    return cfg;
  }
  TempDir dir;
  Model bad;
  Tokenizer tok;
  posenc::serve::Server server;
  httplib::Client client;
};

// posenc serve: the request whose logits are not finite gets a 500 naming the position; the server keeps serving
// (health, and a well-formed refusal of the next request the same way).
TEST(NonFiniteLogits, ServeFailsThatRequestAndKeepsServing) {
  OverflowingServer srv;
  httplib::Client& c = srv.client;
  for (int i = 0; i < 2; ++i) {
    const auto r = posenc::test::serve::post(c, "/v1/completions",
                                             nlohmann::json{{"prompt", "a b c"}, {"max_tokens", 2}, {"temperature", 0}});
    EXPECT_EQ(r.status, 500) << r.raw;
    EXPECT_NE(r.raw.find("is not finite"), std::string::npos) << r.raw;
    EXPECT_NE(r.raw.find("position "), std::string::npos) << r.raw;
    // Its own error type (clients must not retry it), not the generic server_error.
    EXPECT_EQ(r.body["error"]["type"], "numeric_error") << r.raw;
    EXPECT_EQ(r.body["error"]["type"], std::string(posenc::serve::numeric_error_type));
    EXPECT_EQ(r.body["error"]["code"], 500) << r.raw;
    EXPECT_TRUE(r.body["error"]["param"].is_null()) << r.raw;
  }
  EXPECT_EQ(posenc::test::serve::get(c, "/health").status, 200);
  EXPECT_EQ(posenc::test::serve::metric(posenc::test::serve::get(c, "/metrics").raw,
                                        "posenc_requests_total{endpoint=\"/v1/completions\",status=\"500\"}"),
            2);
}

// The same failure found after the server began its chunked answer (a request slower than 50 ms: one prompt token
// per step, 100 ms a step) comes as status 200 with the {"error": ...} body: the same type and code.
TEST(NonFiniteLogits, ServeGivesTheSameErrorTypeOnAChunkedAnswer) {
  OverflowingServer srv([](posenc::serve::ServeConfig& cfg) {
    cfg.max_batch = 1;
    cfg.max_step_tokens = 1;
    cfg.step_delay = std::chrono::milliseconds(100);
  });
  httplib::Client& c = srv.client;
  const auto r = posenc::test::serve::post(
      c, "/v1/completions", nlohmann::json{{"prompt", "a b c d e"}, {"max_tokens", 2}, {"temperature", 0}});
  EXPECT_EQ(r.status, 200) << r.raw;
  ASSERT_FALSE(r.raw.empty());
  EXPECT_EQ(r.raw.front(), ' ') << r.raw;  // the chunked answer's keep-alive whitespace came first
  EXPECT_EQ(r.body["error"]["type"], "numeric_error") << r.raw;
  EXPECT_EQ(r.body["error"]["code"], 500) << r.raw;
  EXPECT_NE(r.raw.find("is not finite"), std::string::npos) << r.raw;
}

// stories260K with its final norm scaled to 3e38 (every weight finite, the logits not), served by posenc serve: `eval
// --endpoint` stops at the first request (the probe's 2-token likelihood request) after ONE attempt, saying that the
// model produced non-finite logits, with the server's message, instead of retrying it and reporting the endpoint
// unavailable. Library and CLI.
TEST(NonFiniteLogits, EvalOverAnEndpointStopsAtOnceNamingNonFiniteLogits) {
  TempDir d;
  const Model& stories = posenc::test::serve::stories().model;
  const Tokenizer& tok = posenc::test::serve::stories().tok;
  PosencCheckpoint ck = stories.to_checkpoint();
  bool scaled = false;
  for (auto& tensor : ck.tensors)
    if (tensor.name == "norm") {
      for (float& v : tensor.data) v = 3e38f;
      scaled = true;
    }
  ASSERT_TRUE(scaled);
  save_posenc_checkpoint(d.path() / "bad260.pt", ck);
  const Model bad = Model::load(d.path() / "bad260.pt");
  const std::vector<float> logits = bad.score_window(std::vector<int32_t>{1, 403});
  ASSERT_FALSE(std::all_of(logits.begin(), logits.end(), [](float v) { return std::isfinite(v); }));

  ::signal(SIGPIPE, SIG_IGN);
  posenc::serve::ServeConfig cfg;
  cfg.port = 0;
  cfg.served_model_name = "bad260";
  posenc::serve::Server server(bad, tok, cfg);
  const int port = server.start();
  const std::string url = "http://127.0.0.1:" + std::to_string(port) + "/v1";
  httplib::Client c("127.0.0.1", port);
  const auto failed_completions = [&] {
    return posenc::test::serve::metric(posenc::test::serve::get(c, "/metrics").raw,
                                       "posenc_requests_total{endpoint=\"/v1/completions\",status=\"500\"}");
  };

  EndpointEvalConfig e;
  e.endpoints = {parse_endpoint_spec(url)};
  e.options.retries = 3;  // a plain 500 would be sent 4 times and, twice over (breaker 2), end as "unavailable"
  e.options.backoff_initial = 0.001;
  e.options.backoff_max = 0.002;
  e.options.breaker_failures = 2;
  e.options.request_timeout = 30;
  e.trained_context = 512;
  EvalConfig ec;
  ec.tokenizer_path = posenc::test::tokenizer_path().string();
  ec.haystack_path = posenc::test::text_path().string();
  ec.tasks = {"passkey"};
  ec.lengths = {128};
  ec.depths = {0.5};
  ec.samples = 2;
  ec.ppl_tokens = -1;
  ec.out = d.path() / "run";
  const std::string haystack = read_file(posenc::test::text_path());
  std::string msg = "no exception";
  try {
    (void)run_eval_endpoint(e, tok, haystack, ec);
  } catch (const EndpointNumericError& x) {
    msg = x.what();
  } catch (const std::exception& x) {
    msg = std::string("WRONG TYPE: ") + x.what();
  }
  EXPECT_EQ(msg.find("WRONG TYPE"), std::string::npos) << msg;
  EXPECT_NE(msg.find("the served model produced non-finite logits"), std::string::npos) << msg;
  EXPECT_NE(msg.find(url), std::string::npos) << msg;
  EXPECT_NE(msg.find("likelihood probe"), std::string::npos) << msg;
  EXPECT_NE(msg.find("HTTP 500"), std::string::npos) << msg;
  EXPECT_NE(msg.find("the model's output is not finite: position "), std::string::npos) << msg;  // the server's
  EXPECT_EQ(msg.find("unavailable"), std::string::npos) << msg;
  EXPECT_EQ(failed_completions(), 1);  // one attempt, no retries

  // The CLI: exit 1 with that message on stderr.
  const auto r = run_cli("eval --endpoint " + url + " --tokenizer '" + posenc::test::tokenizer_path().string() +
                         "' --haystack '" + posenc::test::text_path().string() +
                         "' --tasks passkey --context 128 --depths 0.5 --samples 2 --ppl-tokens -1 "
                         "--trained-context 512 --retries 3 --request-timeout 30 --quiet --out '" +
                         (d.path() / "cli").string() + "'");
  EXPECT_EQ(r.exit_code, 1) << r.out << r.err;
  EXPECT_NE(r.err.find("the served model produced non-finite logits"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("is not finite"), std::string::npos) << r.err;
  EXPECT_EQ(r.err.find("unavailable"), std::string::npos) << r.err;
  EXPECT_EQ(failed_completions(), 2);
  server.stop();
}

}  // namespace

}  // namespace POSENC_UNITY_ID
