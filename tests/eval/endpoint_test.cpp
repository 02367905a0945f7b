// `posenc eval --endpoint` against an in-test OpenAI-compatible server backed
// by the real stories260K (tests/eval/fake_endpoint.hpp), all on loopback:
// the lab over HTTP equals the in-process lab cell for cell; a server that
// stops mid-sweep stops the run with EndpointUnavailable, and the resumed run
// (on another port) re-sends nothing finished and ends equal to an
// uninterrupted run; garbage, truncated JSON, wrong logprob counts and HTTP
// 500 are clear errors naming the endpoint and the request, with nothing
// written for the affected sample; 429 is retried; posenc serve's
// numeric_error (the model's non-finite logits) is sent once and stops the
// run naming them, while other 500s and 503 are retried; an endpoint without prompt
// log-probabilities runs the generation cells and reports the rest as not
// supported.
#include <algorithm>
#include <cmath>
#include <filesystem>
#include <map>
#include <thread>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "../model/random_checkpoint.hpp"
#include "fake_endpoint.hpp"
#include "posenc/checkpoint.hpp"
#include "posenc/synthetic_tasks.hpp"
#include "posenc/endpoint.hpp"
#include "posenc/eval.hpp"
#include "posenc/io.hpp"
#include "posenc/serve.hpp"
#include "test_support.hpp"

namespace POSENC_UNITY_ID {  // this file's own namespace in the tests' unity build (CMakeLists.txt)

using namespace posenc;
namespace fs = std::filesystem;
using nlohmann::json;
using test::FakeEndpoint;
using test::TempDir;

namespace {

const Model& model() {
  static const Model m = Model::load_llama2c(test::model_path());
  return m;
}
const Tokenizer& tok() {
  static const Tokenizer t = Tokenizer::load_llama2c(test::tokenizer_path());
  return t;
}
const std::string& text() {
  static const std::string t = read_file(test::text_path());
  return t;
}

EvalConfig base_config(const fs::path& out) {
  EvalConfig c;
  c.model_path = test::model_path().string();
  c.tokenizer_path = test::tokenizer_path().string();
  c.haystack_path = test::text_path().string();
  c.tasks = {"name_recall", "passkey"};
  c.lengths = {128, 192};
  c.depths = {0.0, 1.0};
  c.samples = 4;
  c.ppl_tokens = 700;
  c.out = out;
  return c;
}

EndpointEvalConfig endpoint_config(const std::string& url, int concurrency = 1) {
  EndpointEvalConfig e;
  e.endpoints = {parse_endpoint_spec(url)};
  e.options.concurrency = concurrency;
  e.options.retries = 1;
  e.options.backoff_initial = 0.001;
  e.options.backoff_max = 0.002;
  e.options.breaker_failures = 2;
  e.options.request_timeout = 30;
  e.trained_context = 512;  // stories260K's (llama2.c seq_len): the in-process buckets' anchor
  return e;
}

json read_json(const fs::path& p) { return json::parse(test::slurp(p)); }

std::map<std::string, json> samples_by_key(const fs::path& run_dir) {
  std::map<std::string, json> m;
  const std::string all = test::slurp(run_dir / "samples.jsonl");
  std::size_t pos = 0;
  while (pos < all.size()) {
    const std::size_t nl = all.find('\n', pos);
    const json s = json::parse(all.substr(pos, nl - pos));
    pos = nl + 1;
    m[fmt::format("{}|{}|{}|{}|{}", s["task"].get<std::string>(), s["control"].get<std::string>(),
                  s["length"].get<int64_t>(), s["depth"].dump(), s["index"].get<int64_t>())] = s;
  }
  return m;
}

std::map<std::string, json> cells_by_key(const json& summary) {
  std::map<std::string, json> m;
  for (const auto& c : summary["cells"])
    m[fmt::format("{}|{}|{}|{}", c["task"].get<std::string>(), c["control"].get<std::string>(), c["length"].get<int64_t>(),
                  c["depth"].dump())] = c;
  return m;
}

std::size_t journal_lines(const fs::path& run_dir) {
  std::size_t n = 0;
  if (!fs::exists(run_dir / "journal")) return 0;
  for (const auto& e : fs::directory_iterator(run_dir / "journal")) {
    const std::string t = test::slurp(e.path());
    n += static_cast<std::size_t>(std::count(t.begin(), t.end(), '\n'));
  }
  return n;
}

std::size_t cell_files(const fs::path& run_dir) {
  std::size_t n = 0;
  for (const auto& e : fs::directory_iterator(run_dir / "cells")) n += e.path().extension() == ".json";
  return n;
}

}  // namespace

// ---------------------------------------------------------------- parsing and specs

TEST(EndpointParse, CompletionResponseAndItsErrors) {
  const auto r = parse_completion_response(
      R"({"choices":[{"text":" 42","finish_reason":"stop","logprobs":{"token_logprobs":[null,-0.5,-1.25],"token_ids":[1,5,9]}}],"usage":{"completion_tokens":2}})",
      "src");
  EXPECT_EQ(r.text, " 42");
  EXPECT_EQ(r.finish_reason, "stop");
  ASSERT_EQ(r.token_logprobs.size(), 3u);
  EXPECT_FALSE(r.token_logprobs[0]);
  EXPECT_EQ(*r.token_logprobs[2], -1.25);
  EXPECT_EQ(r.token_ids, (std::vector<int32_t>{1, 5, 9}));
  EXPECT_EQ(r.completion_tokens, 2);
  EXPECT_EQ(r.logprobs_shape, "legacy");
  EXPECT_TRUE(r.has_token_ids);
  // llama.cpp's chat-style shape (a real llama-server answer, logprobs 1, cut to 2 tokens): generated tokens only.
  const auto l = parse_completion_response(
      R"({"choices":[{"text":", there","index":0,"logprobs":{"content":[{"id":432,"token":",","bytes":[44],"logprob":-0.03178099915385246,"top_logprobs":[{"id":432,"token":",","bytes":[44],"logprob":-0.03178099915385246}]},{"id":383,"token":" there","bytes":[32,116,104,101,114,101],"logprob":-0.1,"top_logprobs":[]}]},"finish_reason":"length"}],"usage":{"completion_tokens":2,"prompt_tokens":5,"total_tokens":7}})",
      "src");
  EXPECT_EQ(l.logprobs_shape, "content");
  EXPECT_TRUE(l.has_token_ids);
  EXPECT_EQ(l.token_ids, (std::vector<int32_t>{432, 383}));
  ASSERT_EQ(l.token_logprobs.size(), 2u);
  EXPECT_EQ(*l.token_logprobs[0], -0.03178099915385246);
  // llama-server's logprobs 0: null (no ids).
  const auto n = parse_completion_response(R"({"choices":[{"text":",","logprobs":null,"finish_reason":"length"}]})", "src");
  EXPECT_FALSE(n.has_logprobs);
  EXPECT_FALSE(n.has_token_ids);
  for (const auto& [body, needle] : std::vector<std::pair<std::string, std::string>>{
           {"<html>502</html>", "not valid JSON"},
           {R"({"choices":[{"text":"ab)", "not valid JSON"},
           {R"({"choices":[]})", "choices: is empty"},
           {R"({"object":"x"})", "choices"},
           {R"({"choices":[{"text":1}]})", "choices[0].text"},
           {R"({"choices":[{"text":"","logprobs":{"token_logprobs":[null,"x"]}}]})", "token_logprobs[1]"},
           {R"({"choices":[{"text":"","logprobs":{"tokens":[]}}]})", "token_logprobs"},
           {R"({"choices":[{"text":"","logprobs":{"token_logprobs":[],"token_ids":[-1]}}]})", "token_ids[0]"},
           {R"({"choices":[{"text":"","logprobs":{"content":[{"token":","}]}}]})", "content[0]: missing key 'id'"},
           {R"({"choices":[{"text":"","logprobs":{"content":[{"id":3,"logprob":"x"}]}}]})", "content[0].logprob"},
       }) {
    const std::string m = test::message_of<DataError>([&] { (void)parse_completion_response(body, "endpoint E"); });
    EXPECT_NE(m.find("endpoint E"), std::string::npos) << body << " -> " << m;
    EXPECT_NE(m.find(needle), std::string::npos) << body << " -> " << m;
  }
}

TEST(EndpointParse, SpecsLabelsAndUrls) {
  auto s = parse_endpoint_spec("http://127.0.0.1:8000/v1/");
  EXPECT_EQ(s.url, "http://127.0.0.1:8000/v1");
  EXPECT_EQ(s.label, "default");
  s = parse_endpoint_spec("https://gpu7.example.org/v1=yarn-8x");
  EXPECT_EQ(s.url, "https://gpu7.example.org/v1");
  EXPECT_EQ(s.label, "yarn-8x");
  for (const char* bad : {"ftp://x/v1", "127.0.0.1:8000/v1", "http:///v1", "http://h:0/v1", "http://h:99999/v1",
                          "http://h:80/v1=a/b", "http://h:80/v1=..", "http://h:80/v1?x=1"})
    EXPECT_NE(test::message_of<ConfigError>([&] { (void)parse_endpoint_spec(bad); }).find("--endpoint"),
              std::string::npos)
        << bad;
}

// ---------------------------------------------------------------- (a) equals the in-process lab

TEST(EndpointLab, OverHttpEqualsTheInProcessLabCellForCell) {
  TempDir d;
  const EvalConfig c = base_config(d.path() / "local");
  const EvalRunResult local = run_eval(model(), tok(), text(), c);
  FakeEndpoint srv(model(), tok());
  srv.start();
  EvalConfig ce = c;
  ce.out = d.path() / "http";
  // Concurrency 3: the order requests finish in changes nothing.
  const EvalRunResult http = run_eval_endpoint(endpoint_config(srv.url(), 3), tok(), text(), ce);
  EXPECT_EQ(http.cells_present, local.cells_present);
  EXPECT_EQ(http.cells_present, http.cells_total);
  EXPECT_FALSE(fs::exists(http.run_dir / "journal") && !fs::is_empty(http.run_dir / "journal"));  // groups done

  const json sl = read_json(local.run_dir / "summary.json"), sh = read_json(http.run_dir / "summary.json");
  const auto cl = cells_by_key(sl), ch = cells_by_key(sh);
  ASSERT_EQ(cl.size(), ch.size());
  ASSERT_EQ(cl.size(), 2u * 2 * 2 + 2u /* absent */);  // 2 tasks x 2 lengths x 2 depths + name_recall absent x 2 lengths
  for (const auto& [k, a] : cl) {
    const json& b = ch.at(k);
    EXPECT_EQ(a["n"], b["n"]) << k;
    EXPECT_EQ(a["n"], 4) << k;
    EXPECT_EQ(a["status"], b["status"]) << k;
    EXPECT_EQ(a["metrics"], b["metrics"]) << k;  // every metric's counts and intervals
  }
  EXPECT_EQ(sl["effective_context"].size(), sh["effective_context"].size());
  for (std::size_t i = 0; i < sl["effective_context"].size(); ++i) {
    json a = sl["effective_context"][i], b = sh["effective_context"][i];
    EXPECT_EQ(a, b) << i;
  }
  EXPECT_EQ(sl["chance"], sh["chance"]);
  // Per sample: predictions equal; candidate log-probabilities within 2e-4 nats
  // (in-process scores candidates on KV-cache forks of the prompt, the server
  // from one full forward of prompt + candidate: EvalEngine's tolerance).
  const auto pl = samples_by_key(local.run_dir), ph = samples_by_key(http.run_dir);
  ASSERT_EQ(pl.size(), ph.size());
  ASSERT_EQ(pl.size(), 4u * 10);
  double max_lp_diff = 0;
  for (const auto& [k, a] : pl) {
    const json& b = ph.at(k);
    EXPECT_EQ(a["prediction"], b["prediction"]) << k;
    EXPECT_EQ(a["correct"], b["correct"]) << k;
    EXPECT_EQ(a["prompt_hash"], b["prompt_hash"]) << k;
    EXPECT_EQ(a.value("predicted_tokens", -1), b.value("predicted_tokens", -1)) << k;
    if (a.contains("candidate_logprobs"))
      for (std::size_t i = 0; i < a["candidate_logprobs"].size(); ++i)
        max_lp_diff = std::max(max_lp_diff, std::abs(a["candidate_logprobs"][i].get<double>() -
                                                     b["candidate_logprobs"][i].get<double>()));
  }
  EXPECT_LT(max_lp_diff, 2e-4);
  // The perplexity matrix: the same windows and buckets; NLLs equal to 1e-12
  // relative (both score with one full forward per window; the server's
  // log-probabilities are the lab's log_softmax, negated: the order of the
  // subtraction differs by an ulp).
  const json ql = read_json(local.run_dir / "ppl.json"), qh = read_json(http.run_dir / "ppl.json");
  ASSERT_EQ(ql["results"].size(), 2u);
  ASSERT_EQ(qh["results"].size(), 2u);
  double max_nll_rel = 0;
  for (std::size_t i = 0; i < 2; ++i) {
    const json &a = ql["results"][i], &b = qh["results"][i];
    EXPECT_EQ(a["context"], b["context"]);
    EXPECT_EQ(a["tokens"], b["tokens"]);
    EXPECT_EQ(a["windows"], b["windows"]);
    EXPECT_GT(a["tokens"].get<int64_t>(), 600);
    ASSERT_EQ(a["buckets"].size(), b["buckets"].size());
    auto rel = [](const json& x, const json& y) { return std::abs(x.get<double>() - y.get<double>()) / std::abs(x.get<double>()); };
    max_nll_rel = std::max(max_nll_rel, rel(a["nll"], b["nll"]));
    for (std::size_t k = 0; k < a["buckets"].size(); ++k) {
      EXPECT_EQ(a["buckets"][k]["tokens"], b["buckets"][k]["tokens"]);
      max_nll_rel = std::max({max_nll_rel, rel(a["buckets"][k]["nll"], b["buckets"][k]["nll"]),
                              rel(a["buckets"][k]["nll_ci_low"], b["buckets"][k]["nll_ci_low"]),
                              rel(a["buckets"][k]["nll_ci_high"], b["buckets"][k]["nll_ci_high"])});
    }
  }
  EXPECT_LT(max_nll_rel, 1e-12);
  std::printf("[ endpoint ] max |candidate logprob diff| %.3g nats, max relative ppl NLL diff %.3g\n", max_lp_diff,
              max_nll_rel);
  // run.json records the endpoint, its reported model and the request parameters.
  const json run = read_json(http.run_dir / "run.json");
  ASSERT_EQ(run["endpoints"].size(), 1u);
  EXPECT_EQ(run["endpoints"][0]["url"], srv.url());
  EXPECT_EQ(run["endpoints"][0]["served_model"], "stories260K");
  EXPECT_EQ(run["endpoints"][0]["version"]["server"], "fake_endpoint");
  EXPECT_EQ(run["endpoints"][0]["likelihood"], true);
  EXPECT_EQ(run["endpoints"][0]["max_model_len"], 1024);
  EXPECT_NE(run["endpoints"][0]["tokenize_check"].get<std::string>().find("matched"), std::string::npos);
  EXPECT_EQ(run["request_parameters"]["likelihood"]["echo"], true);
  EXPECT_EQ(run["request_parameters"]["concurrency"], 3);
  EXPECT_EQ(run["model"]["trained_context_source"], "--trained-context");
  EXPECT_EQ(run["config"]["scaling_axis"], "endpoint_label");
  // `eval report`'s rebuild and the text table read the run back.
  const json rebuilt = rebuild_eval_outputs(http.run_dir);
  EXPECT_EQ(rebuilt["cells"], sh["cells"]);
  EXPECT_TRUE(eval_resume_plan(http.run_dir).empty());
}

// The same comparison against the real `posenc serve` (posenc::serve::Server on loopback, continuous batching,
// prefix reuse for echo requests): counts exact, and — reported — whether candidate log-probabilities and
// perplexity NLLs are bit-identical. max_model_len = the longest length: the client's probe finds that the
// server takes max_tokens 0 with echo, so a likelihood request of L tokens fits in L.
TEST(EndpointLab, OverHttpAgainstPosencServeEqualsTheInProcessLab) {
  TempDir d;
  const EvalConfig c = base_config(d.path() / "local");
  const EvalRunResult local = run_eval(model(), tok(), text(), c);
  serve::ServeConfig sc;
  sc.port = 0;
  sc.served_model_name = "stories260K";
  sc.max_model_len = 192;
  serve::Server server(model(), tok(), sc);
  const int port = server.start();
  EvalConfig ce = c;
  ce.out = d.path() / "http";
  const std::string url = fmt::format("http://127.0.0.1:{}/v1", port);
  const EvalRunResult http = run_eval_endpoint(endpoint_config(url, 4), tok(), text(), ce);
  EXPECT_EQ(http.cells_present, local.cells_present);
  EXPECT_EQ(http.cells_present, http.cells_total);
  const json sl = read_json(local.run_dir / "summary.json"), sh = read_json(http.run_dir / "summary.json");
  const auto cl = cells_by_key(sl), ch = cells_by_key(sh);
  ASSERT_EQ(cl.size(), ch.size());
  ASSERT_EQ(cl.size(), 2u * 2 * 2 + 2u);
  for (const auto& [k, a] : cl) {
    const json& b = ch.at(k);
    EXPECT_EQ(a["status"], "ok") << k;  // L = 192 = max_model_len fits (max_tokens 0)
    EXPECT_EQ(a["status"], b["status"]) << k;
    EXPECT_EQ(a["n"], 4) << k;
    EXPECT_EQ(a["n"], b["n"]) << k;
    EXPECT_EQ(a["metrics"], b["metrics"]) << k;
  }
  EXPECT_EQ(sl["effective_context"], sh["effective_context"]);
  EXPECT_EQ(sl["chance"], sh["chance"]);
  const auto pl = samples_by_key(local.run_dir), ph = samples_by_key(http.run_dir);
  ASSERT_EQ(pl.size(), ph.size());
  ASSERT_EQ(pl.size(), 4u * 10);
  double max_lp_diff = 0;
  std::size_t lp_values = 0, lp_identical = 0;
  for (const auto& [k, a] : pl) {
    const json& b = ph.at(k);
    EXPECT_EQ(a["prediction"], b["prediction"]) << k;
    EXPECT_EQ(a["correct"], b["correct"]) << k;
    EXPECT_EQ(a["prompt_hash"], b["prompt_hash"]) << k;
    EXPECT_EQ(a.value("predicted_tokens", -1), b.value("predicted_tokens", -1)) << k;
    if (a.contains("candidate_logprobs"))
      for (std::size_t i = 0; i < a["candidate_logprobs"].size(); ++i) {
        const double x = a["candidate_logprobs"][i].get<double>(), y = b["candidate_logprobs"][i].get<double>();
        max_lp_diff = std::max(max_lp_diff, std::abs(x - y));
        ++lp_values;
        lp_identical += x == y;
      }
  }
  EXPECT_GT(lp_values, 0u);
  EXPECT_LT(max_lp_diff, 2e-4);
  const json ql = read_json(local.run_dir / "ppl.json"), qh = read_json(http.run_dir / "ppl.json");
  ASSERT_EQ(ql["results"].size(), 2u);
  ASSERT_EQ(qh["results"].size(), 2u);
  double max_nll_rel = 0;
  for (std::size_t i = 0; i < 2; ++i) {
    const json &a = ql["results"][i], &b = qh["results"][i];
    EXPECT_EQ(a["context"], b["context"]);
    EXPECT_EQ(a["tokens"], b["tokens"]);
    EXPECT_EQ(a["windows"], b["windows"]);
    ASSERT_EQ(a["buckets"].size(), b["buckets"].size());
    auto rel = [](const json& x, const json& y) { return std::abs(x.get<double>() - y.get<double>()) / std::abs(x.get<double>()); };
    max_nll_rel = std::max(max_nll_rel, rel(a["nll"], b["nll"]));
    for (std::size_t k = 0; k < a["buckets"].size(); ++k) {
      EXPECT_EQ(a["buckets"][k]["tokens"], b["buckets"][k]["tokens"]);
      max_nll_rel = std::max(max_nll_rel, rel(a["buckets"][k]["nll"], b["buckets"][k]["nll"]));
    }
  }
  // Bit for bit: the server's logprobs come from the same forward rows and the same log_prob (src/eval/logprob.hpp)
  // as the in-process lab's, and a window's NLL is -log_prob in both; so every perplexity result (NLLs, bootstrap
  // intervals, buckets from the model's own trained context, which the server reports) is equal.
  EXPECT_EQ(lp_identical, lp_values);
  EXPECT_EQ(max_nll_rel, 0.0);
  for (std::size_t i = 0; i < 2; ++i) EXPECT_EQ(ql["results"][i], qh["results"][i]) << i;
  std::printf("[ posenc serve ] candidate logprobs: %zu of %zu bit-identical, max |diff| %.3g nats; max relative ppl "
              "NLL diff %.3g\n",
              lp_identical, lp_values, max_lp_diff, max_nll_rel);
  const json run = read_json(http.run_dir / "run.json");
  ASSERT_EQ(run["endpoints"].size(), 1u);
  EXPECT_EQ(run["endpoints"][0]["version"]["server"], "posenc");
  EXPECT_EQ(run["endpoints"][0]["likelihood"], true);
  EXPECT_EQ(run["endpoints"][0]["likelihood_request"], json({{"max_tokens", 0}, {"logprobs", 0}}));
  EXPECT_EQ(run["endpoints"][0]["generation_logprobs"], 0);
  EXPECT_NE(run["endpoints"][0]["prediction_rule"].get<std::string>().find("token ids"), std::string::npos);
  EXPECT_EQ(run["endpoints"][0]["max_model_len"], 192);
  // The echo requests of a sample's candidates reused the shared prompt's cached prefix.
  const serve::ServerStats st = server.stats();
  EXPECT_GT(st.prefix_cache_hits, 0);
  EXPECT_LT(st.computed_prompt_tokens, st.prompt_tokens);
  std::printf("[ posenc serve ] prompt tokens %lld, computed %lld (prefix cache hits %lld)\n",
              static_cast<long long>(st.prompt_tokens), static_cast<long long>(st.computed_prompt_tokens),
              static_cast<long long>(st.prefix_cache_hits));
}

TEST(EndpointLab, LengthsPastMaxModelLenDoNotFitAndShardsMerge) {
  TempDir d;
  FakeEndpoint srv(model(), tok());
  srv.max_model_len = 192;  // likelihood at 192 needs 193 tokens; generation at 192 fits
  srv.echo_max_tokens_0 = false;  // the probe falls back to max_tokens 1
  srv.start();
  EvalConfig c = base_config(d.path() / "full");
  c.samples = 2;
  c.depths = {0.5};
  const EvalRunResult full = run_eval_endpoint(endpoint_config(srv.url()), tok(), text(), c);
  const json s = read_json(full.run_dir / "summary.json");
  for (const auto& cell : s["cells"]) {
    const bool choice = cell["task"] == "name_recall";
    if (cell["length"] == 192 && choice) {
      EXPECT_EQ(cell["status"], "does not fit") << cell.dump();
      EXPECT_EQ(cell["n"], 0);
    } else {
      EXPECT_EQ(cell["status"], "ok") << cell.dump();
    }
  }
  const json cellfile = read_json(full.run_dir / "cells" / "name_recall__none__default__L192__d0.5.json");
  EXPECT_NE(cellfile["cell"]["note"].get<std::string>().find("max_model_len 192"), std::string::npos);
  const json ppl = read_json(full.run_dir / "ppl.json");
  EXPECT_EQ(ppl["results"][1]["status"], "does not fit");
  EXPECT_TRUE(ppl["results"][1]["nll"].is_null());
  EXPECT_EQ(read_json(full.run_dir / "run.json")["endpoints"][0]["likelihood_request"],
            json({{"max_tokens", 1}, {"logprobs", 0}}));
  // --shard 0/2 + 1/2 merged = the unsharded run (same run id, another port).
  FakeEndpoint srv2(model(), tok());
  srv2.max_model_len = 192;
  srv2.echo_max_tokens_0 = false;
  srv2.start();
  std::vector<fs::path> shards;
  for (int i = 0; i < 2; ++i) {
    EvalConfig cs = c;
    cs.out = d.path() / fmt::format("s{}", i);
    cs.shard_index = i;
    cs.shard_count = 2;
    const auto r = run_eval_endpoint(endpoint_config(i ? srv2.url() : srv.url()), tok(), text(), cs);
    EXPECT_EQ(r.run_id, full.run_id);
    shards.push_back(r.run_dir);
  }
  const fs::path merged = merge_eval_runs(shards, d.path() / "merged");
  EXPECT_EQ(read_json(merged / "summary.json")["cells"], s["cells"]);
  EXPECT_NE(format_eval_summary(read_json(merged / "summary.json")).find("does not fit"), std::string::npos);
}

// ---------------------------------------------------------------- (b) killed server, resume

TEST(EndpointLab, AServerStoppedMidSweepStopsTheRunAndTheResumeReSendsNothingFinished) {
  TempDir d;
  EvalConfig c = base_config(d.path() / "ref");
  c.tasks = {"passkey"};  // one request per depth: sample boundaries are request counts
  c.depths = {0.0, 0.5, 1.0};
  // Uninterrupted reference.
  FakeEndpoint ref(model(), tok());
  ref.start();
  const EvalRunResult r0 = run_eval_endpoint(endpoint_config(ref.url()), tok(), text(), c);
  const int64_t total = ref.work_requests;
  const int64_t windows = read_json(r0.run_dir / "ppl.json")["results"][0]["windows"].get<int64_t>() +
                          read_json(r0.run_dir / "ppl.json")["results"][1]["windows"].get<int64_t>();
  ASSERT_EQ(total, 2 * 4 * 3 + windows);  // 2 lengths x 4 samples x 3 depths, then the perplexity windows
  EXPECT_EQ(windows, 6 + 4);             // ceil(700 / 127) + ceil(700 / 191)
  ref.stop();

  // The server answers 15 work requests (group 1: 12, group 2: one sample of 3), then stops listening.
  c.out = d.path() / "run";
  FakeEndpoint a(model(), tok());
  a.stop_after = 15;
  a.start();
  const std::string msg = test::message_of<EndpointUnavailable>(
      [&] { (void)run_eval_endpoint(endpoint_config(a.url()), tok(), text(), c); });
  EXPECT_NE(msg.find(a.url()), std::string::npos) << msg;
  EXPECT_NE(msg.find("resume with the same command"), std::string::npos) << msg;
  EXPECT_EQ(a.work_answered, 15);
  a.stop();
  const fs::path run_dir = d.path() / "run" / r0.run_id;
  ASSERT_TRUE(fs::exists(run_dir / "run.json"));
  EXPECT_EQ(cell_files(run_dir), 3u);    // group passkey L=128: its three depths
  EXPECT_EQ(journal_lines(run_dir), 1u);  // group L=192: sample 0, all depths
  EXPECT_EQ(json::parse(test::slurp(run_dir / "journal" / "passkey__none__default__L192.jsonl"))["i"], 0);

  // Restarted on another port: the same run id; only what was not finished is sent.
  FakeEndpoint b(model(), tok());
  b.start();
  ASSERT_NE(b.port(), a.port());
  const EvalRunResult r1 = run_eval_endpoint(endpoint_config(b.url()), tok(), text(), c);
  EXPECT_EQ(r1.run_id, r0.run_id);
  EXPECT_EQ(b.work_requests, total - 15);
  EXPECT_EQ(test::slurp(r1.run_dir / "summary.json"), test::slurp(r0.run_dir / "summary.json"));
  EXPECT_EQ(test::slurp(r1.run_dir / "samples.jsonl"), test::slurp(r0.run_dir / "samples.jsonl"));
  EXPECT_EQ(test::slurp(r1.run_dir / "ppl.json"), test::slurp(r0.run_dir / "ppl.json"));
  EXPECT_EQ(journal_lines(r1.run_dir), 0u);
}

TEST(EndpointLab, ATornJournalLineIsRecomputedAndPerplexityWindowsResume) {
  TempDir d;
  EvalConfig c = base_config(d.path() / "run");
  c.tasks = {"passkey"};
  c.lengths = {128};
  c.depths = {0.5};
  c.samples = 2;
  c.ppl_tokens = 400;
  FakeEndpoint ref(model(), tok());
  ref.start();
  const EvalRunResult r0 = run_eval_endpoint(endpoint_config(ref.url()), tok(), text(), c);
  const int64_t total = ref.work_requests;  // 2 samples + 4 windows of 128 (127 predictions each)
  ASSERT_EQ(total, 2 + 4);
  // Stop after the samples and 2 windows: the perplexity journal holds 2 windows.
  c.out = d.path() / "run2";
  FakeEndpoint a(model(), tok());
  a.stop_after = 4;
  a.start();
  EXPECT_THROW((void)run_eval_endpoint(endpoint_config(a.url()), tok(), text(), c), EndpointUnavailable);
  a.stop();
  const fs::path journal = d.path() / "run2" / r0.run_id / "journal" / "ppl__default__L128.jsonl";
  ASSERT_TRUE(fs::exists(journal));
  std::string lines = test::slurp(journal);
  ASSERT_EQ(std::count(lines.begin(), lines.end(), '\n'), 2);
  // A torn last line (a kill in the middle of a write): dropped, its window re-sent.
  lines = lines.substr(0, lines.size() - 20);
  write_file_atomic(journal, lines);
  FakeEndpoint b(model(), tok());
  b.start();
  const EvalRunResult r1 = run_eval_endpoint(endpoint_config(b.url()), tok(), text(), c);
  EXPECT_EQ(b.work_requests, total - 2 - 1);  // the samples and window 0 were kept: windows 1..3
  EXPECT_EQ(test::slurp(r1.run_dir / "ppl.json"), test::slurp(r0.run_dir / "ppl.json"));
}

// ---------------------------------------------------------------- (c) faults

namespace {

struct FaultCase {
  std::string name;
  std::string task;
  FakeEndpoint::FaultFn fault;
  std::string needle;  ///< in the error message
  bool unavailable = false;
};

}  // namespace

TEST(EndpointLab, MalformedAnswersAreClearErrorsAndNothingIsWrittenForTheSample) {
  std::vector<FaultCase> cases;
  // The third work request of each case answers wrongly.
  cases.push_back({"garbage", "passkey",
                   [](int64_t n, const json&, const std::string&) -> std::optional<FakeEndpoint::Fault> {
                     if (n == 3) return FakeEndpoint::Fault{200, "<html><body>Bad Gateway</body></html>", ""};
                     return std::nullopt;
                   },
                   "not valid JSON"});
  cases.push_back({"truncated", "passkey",
                   [](int64_t n, const json&, const std::string& answer) -> std::optional<FakeEndpoint::Fault> {
                     if (n == 3) return FakeEndpoint::Fault{200, answer.substr(0, answer.size() / 2), ""};
                     return std::nullopt;
                   },
                   "not valid JSON"});
  cases.push_back({"wrong count", "name_recall",
                   [](int64_t n, const json&, const std::string& answer) -> std::optional<FakeEndpoint::Fault> {
                     if (n != 3) return std::nullopt;
                     json j = json::parse(answer);
                     auto& lp = j["choices"][0]["logprobs"]["token_logprobs"];
                     lp.erase(lp.end() - 3, lp.end());
                     j["choices"][0]["logprobs"].erase("token_ids");
                     return FakeEndpoint::Fault{200, j.dump(), ""};
                   },
                   "token_logprobs holds"});
  cases.push_back({"http 404", "passkey",
                   [](int64_t n, const json&, const std::string&) -> std::optional<FakeEndpoint::Fault> {
                     if (n == 3) return FakeEndpoint::Fault{404, R"({"error":{"message":"model_not_found"}})", ""};
                     return std::nullopt;
                   },
                   "HTTP 404 (not retried"});
  cases.push_back({"http 500 forever", "passkey",
                   [](int64_t n, const json&, const std::string&) -> std::optional<FakeEndpoint::Fault> {
                     if (n >= 3) return FakeEndpoint::Fault{500, R"({"error":{"message":"CUDA out of memory"}})", ""};
                     return std::nullopt;
                   },
                   "HTTP 500: CUDA out of memory", true});
  // posenc serve's answer to an error found after it began a chunked 200: whitespace, then {"error": ...}.
  cases.push_back({"error body on 200", "passkey",
                   [](int64_t n, const json&, const std::string&) -> std::optional<FakeEndpoint::Fault> {
                     if (n >= 3)
                       return FakeEndpoint::Fault{
                           200, R"(   {"error":{"code":500,"message":"the forward step failed: bad_alloc","param":null,"type":"server_error"}})",
                           ""};
                     return std::nullopt;
                   },
                   "HTTP 200 with an error body (code 500): the forward step failed: bad_alloc", true});
  for (const auto& fc : cases) {
    SCOPED_TRACE(fc.name);
    TempDir d;
    EvalConfig c = base_config(d.path());
    c.tasks = {fc.task};
    c.lengths = {128};
    c.depths = {0.5};
    c.samples = 4;
    c.ppl_tokens = -1;
    FakeEndpoint srv(model(), tok());
    srv.fault = fc.fault;
    srv.start();
    std::string msg;
    try {
      (void)run_eval_endpoint(endpoint_config(srv.url()), tok(), text(), c);
      msg = "no exception";
    } catch (const EndpointUnavailable& e) {
      msg = std::string(fc.unavailable ? "" : "WRONG TYPE EndpointUnavailable: ") + e.what();
    } catch (const EndpointProtocolError& e) {
      msg = std::string(fc.unavailable ? "WRONG TYPE EndpointProtocolError: " : "") + e.what();
    }
    EXPECT_EQ(msg.find("WRONG TYPE"), std::string::npos) << msg;
    EXPECT_NE(msg.find(srv.url()), std::string::npos) << msg;          // the endpoint
    EXPECT_NE(msg.find("POST /v1/completions"), std::string::npos) << msg;  // the request
    EXPECT_NE(msg.find("task " + fc.task), std::string::npos) << msg;
    EXPECT_NE(msg.find("length 128"), std::string::npos) << msg;
    EXPECT_NE(msg.find(fc.needle), std::string::npos) << msg;
    // Requests 1-2 finished samples 0-1 (passkey: one request each; name_recall: request 3 is
    // sample 0's third candidate): those are journaled, the affected sample is not, no cell is written.
    const fs::path run_dir = resolve_run_dir(d.path());
    EXPECT_EQ(cell_files(run_dir), 0u);
    const std::string j = test::slurp(run_dir / "journal" / fmt::format("{}__none__default__L128.jsonl", fc.task));
    const std::size_t lines = static_cast<std::size_t>(std::count(j.begin(), j.end(), '\n'));
    if (fc.task == "passkey") {
      EXPECT_EQ(lines, 2u) << j;
      EXPECT_EQ(j.find("\"i\":2"), std::string::npos) << j;  // the affected sample
      EXPECT_NE(j.find("\"i\":1"), std::string::npos) << j;
    } else {
      EXPECT_EQ(lines, 0u) << j;
    }
    if (fc.name == "http 500 forever") {
      // retries 1: each failed request was sent twice; the breaker (2) stopped after two of them.
      EXPECT_EQ(srv.work_requests, 2 + 2 * 2);
    }
  }
}

// ---------------------------------------------------------------- (d) 429 then success

TEST(EndpointLab, Http429And503AreRetriedAndTheRunSucceeds) {
  TempDir d;
  EvalConfig c = base_config(d.path() / "a");
  c.tasks = {"passkey"};
  c.lengths = {128};
  c.depths = {0.5};
  c.ppl_tokens = -1;
  FakeEndpoint plain(model(), tok());
  plain.start();
  const auto r0 = run_eval_endpoint(endpoint_config(plain.url()), tok(), text(), c);
  FakeEndpoint busy(model(), tok());
  busy.fault = [](int64_t n, const json&, const std::string&) -> std::optional<FakeEndpoint::Fault> {
    if (n == 2) return FakeEndpoint::Fault{429, R"({"error":{"message":"rate limited"}})", "1"};
    if (n == 5) return FakeEndpoint::Fault{503, R"({"error":{"message":"queue full"}})", "0"};
    return std::nullopt;
  };
  busy.start();
  c.out = d.path() / "b";
  const auto t0 = std::chrono::steady_clock::now();
  const auto r1 = run_eval_endpoint(endpoint_config(busy.url()), tok(), text(), c);
  // Retry-After: 1 was honoured (the jittered backoff alone is at most 2 ms here).
  EXPECT_GE(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 0.95);
  EXPECT_EQ(busy.work_requests, plain.work_requests + 2);  // each refused request sent once more
  EXPECT_EQ(test::slurp(r1.run_dir / "summary.json"), test::slurp(r0.run_dir / "summary.json"));
}

TEST(EndpointLab, ARequestPastItsTimeoutIsRetriedThenStopsTheRun) {
  TempDir d;
  EvalConfig c = base_config(d.path());
  c.tasks = {"passkey"};
  c.lengths = {128};
  c.depths = {0.5};
  c.samples = 2;
  c.ppl_tokens = -1;
  FakeEndpoint srv(model(), tok());
  srv.fault = [](int64_t, const json&, const std::string&) -> std::optional<FakeEndpoint::Fault> {
    std::this_thread::sleep_for(std::chrono::milliseconds(3000));  // a server that hangs
    return std::nullopt;
  };
  srv.start();
  EndpointEvalConfig e = endpoint_config(srv.url());
  e.options.request_timeout = 0.25;
  const auto t0 = std::chrono::steady_clock::now();
  const std::string msg =
      test::message_of<EndpointUnavailable>([&] { (void)run_eval_endpoint(e, tok(), text(), c); });
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_NE(msg.find("--request-timeout 0.25 s"), std::string::npos) << msg;
  EXPECT_NE(msg.find(srv.url()), std::string::npos) << msg;
  EXPECT_EQ(srv.work_requests, 2 * 2);  // 2 attempts (retries 1) x 2 requests (breaker 2)
  // The client did not wait for the hanging answers (4 x 3 s; the timeouts themselves are 4 x 0.25 s). A wide
  // margin: under a loaded machine the run's own work took 5 s when the hang was 0.9 s and the bound 3.6 s.
  EXPECT_LT(s, 0.75 * 4 * 3.0);
}

// ---------------------------------------------------------------- (d2) the model's non-finite logits

namespace {

// posenc serve's answer when the model's logits for a request are not finite (src/serve/scheduler.cpp).
const std::string kNumericBody =
    R"({"error":{"message":"the model's output is not finite: position 7: logit 0 is not finite (got nan): float32 )"
    R"(overflowed in the forward pass","type":"numeric_error","param":null,"code":500}})";

}  // namespace

// The client sends a numeric_error request once (500, or the 200 + {"error"} of a chunked answer) and throws
// EndpointNumericError without a breaker failure; a plain 500 server_error and a 503 are still retried.
TEST(EndpointClient, ANumericErrorIsSentOnceWhileOther5xxAreRetried) {
  FakeEndpoint srv(model(), tok());
  std::atomic<int> mode{0};
  srv.fault = [&](int64_t, const json&, const std::string&) -> std::optional<FakeEndpoint::Fault> {
    switch (mode.load()) {
      case 0: return FakeEndpoint::Fault{500, kNumericBody, ""};
      case 1: return FakeEndpoint::Fault{200, "  " + kNumericBody, ""};
      case 2:
        return FakeEndpoint::Fault{500, R"({"error":{"message":"CUDA out of memory","type":"server_error","code":500}})",
                                   ""};
      default:
        return FakeEndpoint::Fault{
            503, R"({"error":{"message":"queue full","type":"service_unavailable","code":503}})", "0"};
    }
  };
  srv.start();
  EndpointOptions o;
  o.retries = 2;
  o.backoff_initial = 0.001;
  o.backoff_max = 0.002;
  auto breaker = std::make_shared<CircuitBreaker>(1);  // one failed request trips it
  EndpointClient client(srv.url(), o, breaker);
  const json body{{"model", srv.name}, {"prompt", {1, 403, 404, 405}}, {"max_tokens", 2}, {"temperature", 0}};
  for (int m : {0, 1}) {
    SCOPED_TRACE(m);
    mode = m;
    const int64_t before = srv.work_requests, sent = client.requests_sent();
    const std::string msg = test::message_of<EndpointNumericError>(
        [&] { (void)client.post("/v1/completions", body, "task passkey, sample 2, length 128"); });
    EXPECT_EQ(srv.work_requests - before, 1);  // exactly one attempt
    EXPECT_EQ(client.requests_sent() - sent, 1);
    EXPECT_NE(msg.find(srv.url()), std::string::npos) << msg;
    EXPECT_NE(msg.find("task passkey, sample 2, length 128"), std::string::npos) << msg;
    EXPECT_NE(msg.find(m == 0 ? "the served model produced non-finite logits (HTTP 500, error type numeric_error"
                              : "the served model produced non-finite logits (HTTP 200 with an error body (code 500), "
                                "error type numeric_error"),
              std::string::npos)
        << msg;
    EXPECT_NE(msg.find("position 7: logit 0 is not finite"), std::string::npos) << msg;  // the server's message
    EXPECT_EQ(msg.find("unavailable"), std::string::npos) << msg;
    EXPECT_FALSE(breaker->tripped());  // threshold 1: a counted failure would have tripped it
  }
  // A NumericError like the in-process lab's, and no protocol error.
  EXPECT_THROW((void)client.post("/v1/completions", body, "x"), NumericError);
  for (int m : {2, 3}) {  // 500 server_error, 503: retried, then a breaker failure (each on a fresh breaker)
    SCOPED_TRACE(m);
    mode = m;
    auto b = std::make_shared<CircuitBreaker>(1);
    EndpointClient cl(srv.url(), o, b);
    const int64_t before = srv.work_requests;
    const std::string msg = test::message_of<EndpointUnavailable>(
        [&] { (void)cl.post("/v1/completions", body, "task passkey, sample 2, length 128"); });
    EXPECT_EQ(srv.work_requests - before, 3);  // 1 + 2 retries
    EXPECT_EQ(cl.requests_sent(), 3);
    EXPECT_NE(msg.find(m == 2 ? "HTTP 500: CUDA out of memory" : "HTTP 503: queue full"), std::string::npos) << msg;
    EXPECT_TRUE(b->tripped());
  }
}

// In a run, the sample whose request hits numeric_error stops the run at once (no retry, whatever --retries),
// like the in-process lab's NumericError and the other non-retried errors: the samples before it are journaled, it is
// not, no cell is written, and the error names the request and non-finite logits, not an unavailable endpoint.
TEST(EndpointLab, TheModelsNonFiniteLogitsStopTheRunAtOnceNamingThem) {
  for (const bool chunked : {false, true}) {
    SCOPED_TRACE(chunked);
    TempDir d;
    EvalConfig c = base_config(d.path());
    c.tasks = {"passkey"};
    c.lengths = {128};
    c.depths = {0.5};
    c.samples = 4;
    c.ppl_tokens = -1;
    FakeEndpoint srv(model(), tok());
    srv.fault = [chunked](int64_t n, const json&, const std::string&) -> std::optional<FakeEndpoint::Fault> {
      if (n >= 3) return FakeEndpoint::Fault{chunked ? 200 : 500, (chunked ? " " : "") + kNumericBody, ""};
      return std::nullopt;
    };
    srv.start();
    EndpointEvalConfig e = endpoint_config(srv.url());
    e.options.retries = 3;
    std::string msg = "no exception";
    try {
      (void)run_eval_endpoint(e, tok(), text(), c);
    } catch (const EndpointNumericError& x) {
      msg = x.what();
    } catch (const std::exception& x) {
      msg = std::string("WRONG TYPE: ") + x.what();
    }
    EXPECT_EQ(msg.find("WRONG TYPE"), std::string::npos) << msg;
    EXPECT_NE(msg.find(srv.url()), std::string::npos) << msg;
    EXPECT_NE(msg.find("POST /v1/completions"), std::string::npos) << msg;
    EXPECT_NE(msg.find("task passkey"), std::string::npos) << msg;
    EXPECT_NE(msg.find("length 128"), std::string::npos) << msg;
    EXPECT_NE(msg.find("the served model produced non-finite logits"), std::string::npos) << msg;
    EXPECT_NE(msg.find("position 7: logit 0 is not finite"), std::string::npos) << msg;
    EXPECT_EQ(msg.find("unavailable"), std::string::npos) << msg;
    EXPECT_EQ(srv.work_requests, 3);  // samples 0 and 1, then sample 2 once: no retry (retries 3 would make it 6)
    const fs::path run_dir = resolve_run_dir(d.path());
    EXPECT_EQ(cell_files(run_dir), 0u);
    const std::string j = test::slurp(run_dir / "journal" / "passkey__none__default__L128.jsonl");
    EXPECT_EQ(std::count(j.begin(), j.end(), '\n'), 2) << j;
    EXPECT_EQ(j.find("\"i\":2"), std::string::npos) << j;
  }
}

// ---------------------------------------------------------------- (e) no prompt log-probabilities

TEST(EndpointLab, WithoutPromptLogprobsGenerationRunsAndLikelihoodIsNotSupported) {
  TempDir d;
  EvalConfig c = base_config(d.path());
  c.samples = 2;
  FakeEndpoint srv(model(), tok());
  srv.likelihood = false;  // echo -> 400, as llama-server
  srv.start();
  const auto r = run_eval_endpoint(endpoint_config(srv.url()), tok(), text(), c);
  const json s = read_json(r.run_dir / "summary.json");
  int ok = 0, unsupported = 0;
  for (const auto& cell : s["cells"]) {
    if (cell["task"] == "passkey") {
      EXPECT_EQ(cell["status"], "ok");
      EXPECT_EQ(cell["n"], 2);
      ++ok;
    } else {
      EXPECT_EQ(cell["status"], "not supported by this endpoint");
      EXPECT_EQ(cell["n"], 0);
      EXPECT_TRUE(cell["accuracy"].is_null());  // never a zero accuracy
      ++unsupported;
    }
  }
  EXPECT_EQ(ok, 4);
  EXPECT_EQ(unsupported, 6);
  for (const auto& e : s["effective_context"]) {
    if (e["task"] == "name_recall") {
      EXPECT_EQ(e["status"], "not supported by this endpoint");
    }
  }
  const json ppl = read_json(r.run_dir / "ppl.json");  // a named object: a range-for over a temporary's member
  for (const auto& p : ppl["results"]) {               // would read freed memory (ASan found it in CI)
    EXPECT_EQ(p["status"], "not supported by this endpoint");
    EXPECT_TRUE(p["nll"].is_null());
  }
  const std::string table = format_eval_summary(s);
  EXPECT_NE(table.find("not supported by this endpoint"), std::string::npos) << table;
  EXPECT_NE(table.find("not supported"), std::string::npos) << table;
  const json run = read_json(r.run_dir / "run.json");
  EXPECT_EQ(run["endpoints"][0]["likelihood"], false);
  EXPECT_NE(run["endpoints"][0]["likelihood_note"].get<std::string>().find("HTTP 400"), std::string::npos);
  EXPECT_TRUE(eval_resume_plan(r.run_dir).empty());
  EXPECT_NO_THROW(rebuild_eval_outputs(r.run_dir));
}

TEST(EndpointLab, ProbeRefusesAnotherTokenizerAndNamesTheServedModels) {
  TempDir d;
  FakeEndpoint srv(model(), tok());
  srv.start();
  const Tokenizer gpt2 = Tokenizer::load_tokenizer_json(test::shared_dir() / "tokenizers/gpt2/tokenizer.json");
  const std::string m = test::message_of<ConfigError>(
      [&] { (void)probe_endpoint(parse_endpoint_spec(srv.url()), "", gpt2, endpoint_config(srv.url()).options); });
  EXPECT_NE(m.find("/tokenize"), std::string::npos) << m;
  EXPECT_NE(m.find(srv.url()), std::string::npos) << m;
  const std::string m2 = test::message_of<ConfigError>(
      [&] { (void)probe_endpoint(parse_endpoint_spec(srv.url()), "llama-70b", tok(), endpoint_config(srv.url()).options); });
  EXPECT_NE(m2.find("stories260K"), std::string::npos) << m2;
  // Nothing listening: EndpointUnavailable naming the URL.
  const int port = srv.port();
  srv.stop();
  const std::string m3 = test::message_of<EndpointUnavailable>([&] {
    (void)probe_endpoint(parse_endpoint_spec(fmt::format("http://127.0.0.1:{}/v1", port)), "", tok(),
                         endpoint_config(srv.url()).options);
  });
  EXPECT_NE(m3.find(fmt::format("127.0.0.1:{}", port)), std::string::npos) << m3;
}

// A symbol vocabulary (a `posenc train` model's: its task's symbols only) could not be evaluated over HTTP: the
// probe encoded a fixed English sentence and threw "text: unknown symbol 'Once'". The probe now takes the
// vocabulary's own symbols: against posenc serve its /tokenize check matches and the run equals the in-process lab.
TEST(EndpointLab, ASymbolVocabularyIsProbedWithItsOwnSymbols) {
  TempDir d;
  PosencCheckpoint ck;
  test::set_tiny_llama(ck.config, 64);
  ck.symbols = Task(TrainTaskKind::associative_recall).symbols();
  ck.config.vocab_size = static_cast<int>(ck.symbols.size());
  ck.positional.family = PositionFamily::rope;
  RopeParams p;
  p.head_dim = ck.config.head_dim;
  ck.positional.rope.params = p;
  ck.positional.rope.freqs = compute_rope_frequencies(p);
  ck.positional.rope.layout = RopeLayout::half;
  test::RandomTensors t(ck, 11, 0.3f);
  t.add_llama();
  save_posenc_checkpoint(d.path() / "ar.pt", ck);
  const Model m = Model::load(d.path() / "ar.pt");
  const Tokenizer symbols = Tokenizer::from_symbols(ck.symbols);
  ASSERT_TRUE(symbols.is_symbolic());
  EXPECT_THROW(symbols.encode("Once upon a time", false, false), TokenizerError);  // the old probe's failure

  EvalConfig c;
  c.model_path = (d.path() / "ar.pt").string();
  c.tasks = {"associative_recall"};
  c.lengths = {24, 48};
  c.depths = {0.0, 1.0};
  c.samples = 3;
  c.ppl_tokens = -1;
  c.out = d.path() / "local";
  const EvalRunResult local = run_eval(m, symbols, "", c);
  serve::ServeConfig sc;
  sc.port = 0;
  sc.served_model_name = "ar";
  serve::Server server(m, symbols, sc);
  const int port = server.start();
  EndpointEvalConfig e = endpoint_config(fmt::format("http://127.0.0.1:{}/v1", port));
  e.trained_context = m.trained_context();
  EvalConfig ce = c;
  ce.model_path.clear();
  ce.tokenizer_path = (d.path() / "ar.pt").string();  // a model file whose symbols are the tokenizer (as the CLI takes)
  ce.out = d.path() / "http";
  const EvalRunResult http = run_eval_endpoint(e, symbols, "", ce);
  EXPECT_EQ(http.cells_present, http.cells_total);
  EXPECT_EQ(http.cells_present, local.cells_present);
  const auto cl = cells_by_key(read_json(local.run_dir / "summary.json"));
  const auto ch = cells_by_key(read_json(http.run_dir / "summary.json"));
  ASSERT_EQ(cl.size(), ch.size());
  for (const auto& [k, cell] : cl) {
    ASSERT_TRUE(ch.count(k)) << k;
    EXPECT_EQ(cell["correct"], ch.at(k)["correct"]) << k;
    EXPECT_EQ(cell["n"], ch.at(k)["n"]) << k;
  }
  const std::string check = read_json(http.run_dir / "run.json")["endpoints"][0]["tokenize_check"];
  EXPECT_EQ(check.rfind("matched (12 ids of the probe text", 0), 0u) << check;  // 12 of the vocabulary's symbols
}


// A 501 (and the other 5xx that say the server cannot do this request at all, such as 505) was retried as if
// transient, and its HTML page was quoted in the message, newlines and markup included. It is now sent once:
// EndpointProtocolError, no breaker failure, and the message quotes a short printable excerpt of the page.
TEST(EndpointClient, NonTransient5xxAreNotRetriedAndAnHtmlBodyIsQuotedShort) {
  std::string page = "<!DOCTYPE html>\n<html><head><title>501 Not Implemented</title></head>\n<body>\r\n<h1>Not "
                     "Implemented</h1>\n<p>POST to /v1/completions not supported.</p>\n";
  for (int i = 0; i < 200; ++i) page += "<p>padding line " + std::to_string(i) + "\x01\x7f\xc3\xa9</p>\n";
  page += "</body></html>\n";
  FakeEndpoint srv(model(), tok());
  std::atomic<int> status{501};
  srv.fault = [&](int64_t, const json&, const std::string&) -> std::optional<FakeEndpoint::Fault> {
    return FakeEndpoint::Fault{status.load(), page, "0"};
  };
  srv.start();
  EndpointOptions o;
  o.retries = 3;
  o.backoff_initial = 0.001;
  o.backoff_max = 0.002;
  const json body{{"model", srv.name}, {"prompt", {1, 403, 404, 405}}, {"max_tokens", 2}, {"temperature", 0}};
  for (int s : {501, 505}) {
    SCOPED_TRACE(s);
    status = s;
    auto breaker = std::make_shared<CircuitBreaker>(1);
    EndpointClient client(srv.url(), o, breaker);
    const int64_t before = srv.work_requests;
    const std::string msg = test::message_of<EndpointProtocolError>(
        [&] { (void)client.post("/v1/completions", body, "task passkey, sample 2, length 128"); });
    EXPECT_EQ(srv.work_requests - before, 1);  // one attempt, no retry
    EXPECT_FALSE(breaker->tripped());
    EXPECT_NE(msg.find("HTTP " + std::to_string(s) + " (not retried"), std::string::npos) << msg;
    EXPECT_NE(msg.find("501 Not Implemented Not Implemented POST to /v1/completions not supported."),
              std::string::npos)
        << msg;
    EXPECT_NE(msg.find("... (" + std::to_string(page.size()) + " bytes)"), std::string::npos) << msg;
    EXPECT_EQ(msg.find('<'), std::string::npos) << msg;
    EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
    EXPECT_TRUE(std::all_of(msg.begin(), msg.end(),
                            [](char c) { return static_cast<unsigned char>(c) >= ' ' && static_cast<unsigned char>(c) < 0x7f; }))
        << msg;
    EXPECT_LT(msg.size(), 400u) << msg;
  }
  // A 502 with the same page is transient: retried, and quoted the same short way.
  status = 502;
  auto breaker = std::make_shared<CircuitBreaker>(1);
  EndpointClient client(srv.url(), o, breaker);
  const int64_t before = srv.work_requests;
  const std::string msg = test::message_of<EndpointUnavailable>(
      [&] { (void)client.post("/v1/completions", body, "task passkey, sample 2, length 128"); });
  EXPECT_EQ(srv.work_requests - before, 4);  // 1 + 3 retries
  EXPECT_NE(msg.find("HTTP 502: 501 Not Implemented"), std::string::npos) << msg;
  EXPECT_EQ(msg.find('<'), std::string::npos) << msg;
}

}  // namespace POSENC_UNITY_ID
