// generate(): RoPE scaling as ppl applies it, the trained-context warning, and
// where generation stops for every checkpoint format.
#include <algorithm>
#include <cmath>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "posenc/checkpoint.hpp"
#include "posenc/error.hpp"
#include "posenc/generate.hpp"
#include "posenc/io.hpp"
#include "posenc/model.hpp"
#include "posenc/perplexity.hpp"
#include "test_support.hpp"

namespace POSENC_UNITY_ID {  // this file's own namespace in the tests' unity build (CMakeLists.txt)

using namespace posenc;
using posenc::test::run_cli;
using posenc::test::TempDir;
namespace fs = std::filesystem;

namespace {

struct Fixture {
  Model model = Model::load_llama2c(posenc::test::model_path());
  Tokenizer tok = Tokenizer::load_llama2c(posenc::test::tokenizer_path(), 512);
  /// A prefix of the validation text (cut at a space) of 480..511 tokens:
  /// 40 new tokens take the sequence past the trained context 512.
  std::string long_prompt;
  Fixture() {
    const std::string text = read_file(posenc::test::text_path());
    for (std::size_t n = 400; n < 4000; n += 4) {
      const std::string p = text.substr(0, text.rfind(' ', n));
      const auto ids = tok.encode(p, true, false);
      if (ids.size() >= 480 && ids.size() < 505) {
        long_prompt = p;
        break;
      }
    }
  }
};
const Fixture& fx() {
  static const Fixture f;
  return f;
}

double log_softmax(const float* x, int n, int32_t i) {
  double mx = x[0];
  for (int j = 1; j < n; ++j) mx = std::max(mx, static_cast<double>(x[j]));
  double sum = 0;
  for (int j = 0; j < n; ++j) sum += std::exp(static_cast<double>(x[j]) - mx);
  return static_cast<double>(x[i]) - mx - std::log(sum);
}

std::string q(const fs::path& p) { return "'" + p.string() + "'"; }
fs::path models() { return posenc::test::shared_dir() / "models"; }
std::string stories_args() {
  return "--model " + q(posenc::test::model_path()) + " --tokenizer " + q(posenc::test::tokenizer_path());
}

/// A posenc checkpoint (learned positions, table of 32 rows, one layer whose
/// attention and MLP outputs are zero) whose greedy continuation is fixed by
/// its position table: row p is the one-hot of channel target(p) and the
/// classifier row v the one-hot of channel v, so the token predicted at
/// position p is target(p) = 3 + p % 5 ("a".."e"), except <eos> (2) at 20.
PosencCheckpoint scripted_checkpoint() {
  PosencCheckpoint ck;
  ModelConfig& c = ck.config;
  c.dim = 32;
  c.hidden_dim = 32;
  c.n_layers = 1;
  c.n_heads = 4;
  c.n_kv_heads = 4;
  c.vocab_size = 16;
  c.head_dim = 8;
  c.max_position_embeddings = 32;
  c.shared_classifier = false;
  ck.positional.family = PositionFamily::learned_absolute;
  auto t = [&](std::string name, std::vector<int64_t> shape, float fill) {
    int64_t n = 1;
    for (auto d : shape) n *= d;
    ck.tensors.push_back({std::move(name), std::move(shape), std::vector<float>(static_cast<std::size_t>(n), fill)});
    return &ck.tensors.back().data;
  };
  t("tok_embeddings", {16, 32}, 0.0f);
  t("layers.0.attention_norm", {32}, 1.0f);
  t("layers.0.wq", {32, 32}, 0.01f);
  t("layers.0.wk", {32, 32}, 0.01f);
  t("layers.0.wv", {32, 32}, 0.01f);
  t("layers.0.wo", {32, 32}, 0.0f);
  t("layers.0.ffn_norm", {32}, 1.0f);
  t("layers.0.w1", {32, 32}, 0.01f);
  t("layers.0.w2", {32, 32}, 0.0f);
  t("layers.0.w3", {32, 32}, 0.01f);
  t("norm", {32}, 1.0f);
  auto* out = t("output", {16, 32}, 0.0f);
  for (int v = 0; v < 16; ++v) (*out)[static_cast<std::size_t>(v * 32 + v)] = 1.0f;
  auto* pos = t("pos_embeddings", {32, 32}, 0.0f);
  for (int p = 0; p < 32; ++p) (*pos)[static_cast<std::size_t>(p * 32 + (p == 20 ? 2 : 3 + p % 5))] = 1.0f;
  ck.symbols = {"<pad>", "<bos>", "<eos>", "a", "b", "c", "d", "e", "f", "g", "h", "i", "j", "k", "=", "|"};
  return ck;
}

std::vector<int32_t> scripted_tokens(int64_t from, int64_t to) {  // target(p) for p in [from, to)
  std::vector<int32_t> v;
  for (int64_t p = from; p < to; ++p) v.push_back(p == 20 ? 2 : static_cast<int32_t>(3 + p % 5));
  return v;
}

}  // namespace

// --rope-scaling linear: generate runs the setup ppl uses for a window of
// prompt + max_new_tokens (factor (P + 40) / 512): every generated token's
// log-probability equals the full forward's under rope_setup_for_context, and
// those logits differ from the unscaled model's past the trained context.
// Positions stay inside the trained context x the factor (512 x (P + 40) / 512
// = P + 40): no warning (issue 16: the bound is trained context x factor; on
// main this warned at 512 although the scaling covered the window). Native
// RoPE passes 512 once: one warning, at position 512.
TEST(Generate, RopeScalingIsPplsSetupAndWarnsOncePastTheScaledBound) {
  ASSERT_FALSE(fx().long_prompt.empty());
  GenerateOptions o;
  o.max_new_tokens = 40;
  o.stop_at_bos = o.stop_at_eos = false;
  o.rope_scaling = "linear";
  std::vector<std::string> warnings;
  o.on_warning = [&](const std::string& w) { warnings.push_back(w); };
  const GenerateResult r = generate(fx().model, fx().tok, fx().long_prompt, o);
  const int64_t P = static_cast<int64_t>(r.prompt_tokens.size());
  ASSERT_GE(P, 480);
  ASSERT_LT(P, 512);
  ASSERT_EQ(r.new_tokens.size(), 40u);
  EXPECT_EQ(r.stop_reason, "max_tokens");
  EXPECT_EQ(r.rope_scaling, "linear");
  EXPECT_EQ(r.rope_context, P + 40);
  ASSERT_TRUE(r.rope_factor.has_value());
  EXPECT_DOUBLE_EQ(*r.rope_factor, static_cast<double>(P + 40) / 512.0);
  EXPECT_TRUE(warnings.empty()) << warnings[0];
  EXPECT_EQ(r.passed_trained_context_at, -1);

  std::vector<int32_t> seq = r.prompt_tokens;
  seq.insert(seq.end(), r.new_tokens.begin(), r.new_tokens.end() - 1);
  Model scaled = fx().model;
  scaled.set_rope(rope_setup_for_context(fx().model.rope(), 512, "linear", P + 40, std::nullopt));
  const auto ls = scaled.score_window(seq);
  const auto ld = fx().model.score_window(seq);
  const int V = fx().model.config().vocab_size;
  double worst = 0, past = 0;
  const auto UV = static_cast<std::size_t>(V);
  for (std::size_t i = 0; i < r.new_tokens.size(); ++i) {
    const std::size_t row = static_cast<std::size_t>(P - 1) + i;
    worst = std::max(worst, std::abs(log_softmax(&ls[row * UV], V, r.new_tokens[i]) - r.new_token_logprobs[i]));
    if (static_cast<int64_t>(row) >= 512)
      for (std::size_t v = 0; v < UV; ++v)
        past = std::max(past, static_cast<double>(std::abs(ls[row * UV + v] - ld[row * UV + v])));
  }
  EXPECT_LE(worst, 1e-4);
  EXPECT_GT(past, 1e-2);

  // The default setup: its own logits (not the scaled ones), one warning too.
  GenerateOptions d = o;
  d.rope_scaling = "native";
  warnings.clear();
  const GenerateResult rd = generate(fx().model, fx().tok, fx().long_prompt, d);
  ASSERT_EQ(warnings.size(), 1u);
  EXPECT_NE(warnings[0].find("trained context (512 tokens"), std::string::npos) << warnings[0];
  EXPECT_EQ(rd.passed_trained_context_at, 512);
  EXPECT_FALSE(rd.rope_factor.has_value());
  EXPECT_NEAR(rd.new_token_logprobs[0], log_softmax(&ld[static_cast<std::size_t>(P - 1) * UV], V, rd.new_tokens[0]),
              1e-4);
}

TEST(Generate, NoWarningWithinTheTrainedContext) {
  GenerateOptions o;
  o.max_new_tokens = 30;
  int warnings = 0;
  o.on_warning = [&](const std::string&) { ++warnings; };
  const auto r = generate(fx().model, fx().tok, "Once upon a time", o);
  EXPECT_EQ(warnings, 0);
  EXPECT_EQ(r.passed_trained_context_at, -1);
}

TEST(Generate, ScalingOnAModelWithoutRopeIsRefused) {
  TempDir d;
  save_posenc_checkpoint(d.path() / "m.pt", scripted_checkpoint());
  const Model m = Model::load(d.path() / "m.pt");
  GenerateOptions o;
  o.rope_scaling = "linear";
  const std::string msg =
      posenc::test::message_of<InvalidArgument>([&] { generate(m, *m.bundled_tokenizer(), "a b", o); });
  EXPECT_NE(msg.find("learned_absolute"), std::string::npos) << msg;
}

// Where generation stops, per checkpoint format (greedy, "Once upon a time",
// up to 1000 new tokens): llama2.c .bin and GGUF stories260K emit BOS (id 1,
// run.c's stop) after 341 tokens, the same tokens in both files; the HF
// TinyStories-656K directory emits EOS </s> after 134; a posenc checkpoint
// stops at its <eos>, and with EOS ignored where its learned table ends.
TEST(Generate, StopReasonForEveryCheckpointFormat) {
  GenerateOptions o;
  o.max_new_tokens = 1000;
  const auto bin = generate(fx().model, fx().tok, "Once upon a time", o);
  EXPECT_EQ(bin.stop_reason, "bos");
  EXPECT_EQ(bin.new_tokens.size(), 341u);

  const Model gguf = Model::load(models() / "stories260K/stories260K.gguf");
  const auto g = generate(gguf, *gguf.bundled_tokenizer(), "Once upon a time", o);
  EXPECT_EQ(g.stop_reason, "bos");
  EXPECT_EQ(g.new_tokens, bin.new_tokens);

  const Model hf = Model::load(models() / "TinyStories-656K");
  const auto h = generate(hf, *hf.bundled_tokenizer(), "Once upon a time", o);
  EXPECT_EQ(h.stop_reason, "eos");
  EXPECT_EQ(h.new_tokens.size(), 134u);
  EXPECT_EQ(hf.bundled_tokenizer()->eos_id(), 2);

  TempDir d;
  save_posenc_checkpoint(d.path() / "m.pt", scripted_checkpoint());
  const Model pm = Model::load(d.path() / "m.pt");
  const Tokenizer& pt = *pm.bundled_tokenizer();
  const auto p = generate(pm, pt, "a b", o);  // <bos> a b: positions 0..2
  EXPECT_EQ(p.stop_reason, "eos");
  EXPECT_EQ(p.new_tokens, scripted_tokens(2, 20));
  GenerateOptions ignore = o;
  ignore.stop_at_bos = ignore.stop_at_eos = false;
  const auto pl = generate(pm, pt, "a b", ignore);
  EXPECT_EQ(pl.stop_reason, "position_limit");
  EXPECT_EQ(pl.new_tokens, scripted_tokens(2, 32));  // the token predicted at the last row, 31, is kept
  GenerateOptions few = ignore;
  few.max_new_tokens = 5;
  EXPECT_EQ(generate(pm, pt, "a b", few).stop_reason, "max_tokens");
  // A prompt longer than the table: a typed error naming it.
  std::string longp;
  for (int i = 0; i < 32; ++i) longp += "a ";
  const std::string msg = posenc::test::message_of<PositionError>([&] { generate(pm, pt, longp, o); });
  EXPECT_NE(msg.find("33 tokens are past the learned position table (32"), std::string::npos) << msg;
}

// The CLI: --rope-scaling/--rope-factor as ppl's, --config honoured, one
// warning on stderr past the trained context, stop_reason in --json.
TEST(GenerateCli, RopeScalingFactorAndConfigChangeTheLogits) {
  TempDir d;
  const auto cfg = d.file("linear2.json", R"({"rope_type": "linear", "factor": 2.0})");
  auto run = [&](const std::string& extra, const std::string& name) {
    const auto out = d.path() / (name + ".json");
    const auto r = run_cli("generate " + stories_args() + " --prompt 'Once upon a time' --max-tokens 30 --ignore-eos "
                           "--quiet --json " + q(out) + " " + extra);
    EXPECT_EQ(r.exit_code, 0) << r.err;
    return nlohmann::json::parse(posenc::test::slurp(out));
  };
  const auto base = run("", "base");
  const auto lin = run("--rope-scaling linear --rope-factor 2", "lin");
  const auto conf = run("--config " + q(cfg), "conf");
  EXPECT_EQ(base["rope_scaling"], "native");
  EXPECT_EQ(lin["rope_scaling"], "linear");
  EXPECT_EQ(lin["rope_factor"], 2.0);
  EXPECT_EQ(conf["rope_type"], "linear");
  EXPECT_EQ(lin["generated_ids"], conf["generated_ids"]);
  ASSERT_EQ(lin["generated_logprobs"].size(), 30u);
  double same = 0, differ = 0;
  for (std::size_t i = 0; i < 30; ++i) {
    const double l = lin["generated_logprobs"][i].get<double>();
    same = std::max(same, std::abs(l - conf["generated_logprobs"][i].get<double>()));
    differ = std::max(differ, std::abs(l - base["generated_logprobs"][i].get<double>()));
  }
  EXPECT_LE(same, 1e-9);
  EXPECT_GT(differ, 1e-2);

  const auto f = run_cli("generate " + stories_args() + " --prompt hi --rope-factor 2");
  EXPECT_EQ(f.exit_code, 2) << f.err;
  EXPECT_NE(f.err.find("--rope-factor"), std::string::npos) << f.err;
  const auto u = run_cli("generate " + stories_args() + " --prompt hi --rope-scaling bogus");
  EXPECT_EQ(u.exit_code, 2) << u.err;
  EXPECT_NE(u.err.find("bogus"), std::string::npos) << u.err;
}

TEST(GenerateCli, WarnsOnceOnStderrPastTheTrainedContext) {
  TempDir d;
  const auto prompt = d.file("prompt.txt", fx().long_prompt);
  const auto r = run_cli("generate " + stories_args() + " --prompt-file " + q(prompt) +
                         " --max-tokens 40 --ignore-eos --quiet");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const std::string needle = "passes the trained context";
  const auto first = r.err.find(needle);
  ASSERT_NE(first, std::string::npos) << r.err;
  EXPECT_EQ(r.err.find(needle, first + 1), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("warning"), std::string::npos);
  const auto s = run_cli("generate " + stories_args() + " --prompt 'Once upon a time' --max-tokens 40 --quiet");
  ASSERT_EQ(s.exit_code, 0) << s.err;
  EXPECT_EQ(s.err.find(needle), std::string::npos) << s.err;
}

TEST(GenerateCli, PosencCheckpointStopsAtEosOrTheTableEnd) {
  TempDir d;
  const auto model = d.path() / "m.pt";
  save_posenc_checkpoint(model, scripted_checkpoint());
  const auto out = d.path() / "g.json";
  auto r = run_cli("generate --model " + q(model) + " --prompt 'a b' --quiet --json " + q(out));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  auto j = nlohmann::json::parse(posenc::test::slurp(out));
  EXPECT_EQ(j["stop_reason"], "eos");
  EXPECT_EQ(j["generated_ids"].size(), 18u);
  r = run_cli("generate --model " + q(model) + " --prompt 'a b' --ignore-eos --json " + q(out));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  j = nlohmann::json::parse(posenc::test::slurp(out));
  EXPECT_EQ(j["stop_reason"], "position_limit");
  EXPECT_EQ(j["generated_ids"].size(), 30u);
  EXPECT_NE(r.err.find("learned position table ends at 32"), std::string::npos) << r.err;
  r = run_cli("generate --model " + q(model) + " --prompt 'a b' --rope-scaling linear");
  EXPECT_EQ(r.exit_code, 1) << r.err;
  EXPECT_NE(r.err.find("--rope-scaling"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("learned_absolute"), std::string::npos) << r.err;
}

}  // namespace POSENC_UNITY_ID
