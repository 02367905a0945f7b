// posenc serve and the bounds on positions (issue 16 finding 4): a request that would reach past --max-position
// is a 400 naming the position and the limit, and the server keeps serving; passing the trained context x the
// rope_scaling factor warns once on stderr.
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "serve_process.hpp"
#include "serve_support.hpp"

namespace POSENC_UNITY_ID {  // this file's own namespace in the tests' unity build (CMakeLists.txt)

using namespace posenc;
using namespace posenc::test::serve;

namespace {

std::vector<int32_t> ids(std::size_t n) {
  std::vector<int32_t> v(n, 300);
  v[0] = 1;
  return v;
}

}  // namespace

TEST(ServePosition, MaxPositionAnswers400AndKeepsServing) {
  Model m = stories().model;
  m.set_max_position(99);
  posenc::serve::ServeConfig cfg;
  cfg.port = 0;
  cfg.served_model_name = "stories260K";
  posenc::serve::Server server(m, stories().tok, cfg);
  const int port = server.start();
  httplib::Client c("127.0.0.1", port);
  c.set_read_timeout(60, 0);
  // 90 prompt tokens + 20 new feed positions 0..108 (the last new token is sampled, never fed): past 99.
  auto r = post(c, "/v1/completions", json{{"prompt", ids(90)}, {"max_tokens", 20}, {"temperature", 0}});
  ASSERT_EQ(r.status, 400) << r.raw;
  const std::string msg = r.body["error"]["message"].get<std::string>();
  EXPECT_NE(msg.find("max_model_len 101"), std::string::npos) << msg;  // /v1/models advertises it too
  auto models = c.Get("/v1/models");
  ASSERT_TRUE(models);
  EXPECT_EQ(json::parse(models->body)["data"][0]["max_model_len"], 101) << models->body;
  EXPECT_NE(msg.find("position limit 99"), std::string::npos) << msg;
  EXPECT_EQ(r.body["error"]["param"], "max_tokens") << r.raw;
  // The edge (positions 0..99 fed: 90 + 11 new, the 11th never fed) and a short request are served.
  auto e = post(c, "/v1/completions", json{{"prompt", ids(90)}, {"max_tokens", 11}, {"temperature", 0}});
  EXPECT_EQ(e.status, 200) << e.raw;
  auto s = post(c, "/v1/completions", json{{"prompt", ids(4)}, {"max_tokens", 4}, {"temperature", 0}});
  EXPECT_EQ(s.status, 200) << s.raw;
  EXPECT_EQ(s.body["choices"][0]["text"].is_string(), true) << s.raw;
  server.stop();
}

// The CLI: --max-position on `posenc serve`; --max-model-len past the trained context warns once when a request
// passes 512.
TEST(ServePosition, CliMaxPositionAndTheWarning) {
  ServeProcess p({"--model", posenc::test::model_path().string(), "--tokenizer",
                  posenc::test::tokenizer_path().string(), "--port", "0", "--max-model-len", "1024",
                  "--max-position", "700"});
  ASSERT_GT(p.pid(), 0);
  const int port = p.wait_port(60);
  ASSERT_GT(port, 0) << p.err();
  httplib::Client c("127.0.0.1", port);
  c.set_read_timeout(60, 0);
  auto r = post(c, "/v1/completions", json{{"prompt", ids(690)}, {"max_tokens", 20}, {"temperature", 0}});
  ASSERT_EQ(r.status, 400) << r.raw;
  EXPECT_NE(r.raw.find("position limit 700"), std::string::npos) << r.raw;
  EXPECT_EQ(p.err().find("passes the trained context"), std::string::npos) << p.err();
  for (int i = 0; i < 2; ++i) {
    auto ok = post(c, "/v1/completions", json{{"prompt", ids(600)}, {"max_tokens", 4}, {"temperature", 0}});
    EXPECT_EQ(ok.status, 200) << ok.raw;
  }
  EXPECT_EQ(p.terminate(30), 0) << p.err();
  const std::string err = p.err();
  std::size_t n = 0;
  for (auto at = err.find("passes the trained context (512 tokens"); at != std::string::npos;
       at = err.find("passes the trained context (512 tokens", at + 1))
    ++n;
  EXPECT_EQ(n, 1u) << err;
}

}  // namespace POSENC_UNITY_ID
