// A model whose weights are all finite but whose forward pass overflows float32 (a final norm weight of 3e38, as a
// corrupted checkpoint can have): perplexity, the lab's forced choice and greedy continuation, and generate() refuse
// its NaN/infinite logits with a NumericError naming where, instead of reporting NaN or a token taken from them; the
// CLI prints the error and exits 1. A sound model of the same shape passes the same calls.
#include <algorithm>
#include <cmath>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "posenc/checkpoint.hpp"
#include "posenc/error.hpp"
#include "posenc/eval.hpp"
#include "posenc/generate.hpp"
#include "posenc/model.hpp"
#include "posenc/perplexity.hpp"
#include "posenc/tokenizer.hpp"
#include "../model/random_checkpoint.hpp"
#include "../serve/serve_support.hpp"
#include "test_support.hpp"

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

// posenc serve: the request whose logits are not finite gets a 500 naming the position; the server keeps serving
// (health, and a well-formed refusal of the next request the same way).
TEST(NonFiniteLogits, ServeFailsThatRequestAndKeepsServing) {
  TempDir d;
  save_posenc_checkpoint(d.path() / "bad.pt", checkpoint(true));
  const Model bad = Model::load(d.path() / "bad.pt");
  const Tokenizer tok = Tokenizer::from_symbols(checkpoint(false).symbols);
  ::signal(SIGPIPE, SIG_IGN);
  posenc::serve::ServeConfig cfg;
  cfg.port = 0;
  cfg.served_model_name = "bad";
  posenc::serve::Server server(bad, tok, cfg);
  const int port = server.start();
  httplib::Client c("127.0.0.1", port);
  c.set_read_timeout(60, 0);
  for (int i = 0; i < 2; ++i) {
    const auto r = posenc::test::serve::post(c, "/v1/completions",
                                             nlohmann::json{{"prompt", "a b c"}, {"max_tokens", 2}, {"temperature", 0}});
    EXPECT_EQ(r.status, 500) << r.raw;
    EXPECT_NE(r.raw.find("is not finite"), std::string::npos) << r.raw;
    EXPECT_NE(r.raw.find("position "), std::string::npos) << r.raw;
  }
  EXPECT_EQ(posenc::test::serve::get(c, "/health").status, 200);
}

}  // namespace
