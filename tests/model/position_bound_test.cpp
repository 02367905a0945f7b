// Bounds on positions (issue 16 finding 4): "a model trained at 512 runs at
// position 5,000,000 with no message". Every command that runs a model warns
// once when positions pass trained context x the rope_scaling factor, and
// --max-position N makes a position past N a PositionError.
//
// On main (6a8040e) the library had no hook (Model::forward at position_ids
// 5,000,000 on stories260K returned logits, nothing was said), and
// `posenc ppl --context 1024` (native RoPE, trained at 512) exited 0 with no
// warning on stderr and no position_warning in --json: the CLI tests below
// fail there on "passes the trained context" not being found.
#include <cmath>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "posenc/error.hpp"
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

const Model& stories() {
  static const Model m = Model::load_llama2c(posenc::test::model_path());
  return m;
}

std::string q(const fs::path& p) { return "'" + p.string() + "'"; }
std::string stories_args() {
  return "--model " + q(posenc::test::model_path()) + " --tokenizer " + q(posenc::test::tokenizer_path());
}

std::size_t count(const std::string& text, const std::string& needle) {
  std::size_t n = 0;
  for (auto at = text.find(needle); at != std::string::npos; at = text.find(needle, at + 1)) ++n;
  return n;
}

/// Feeds `tokens` at explicit `positions` to a fresh sequence of `cache`.
void feed(const Model& m, KvCache& cache, KvCache::SeqId seq, const std::vector<int32_t>& tokens,
          const std::vector<int64_t>& positions) {
  std::vector<float> logits;
  const Model::SequenceInput in{seq, tokens, positions};
  m.forward(cache, std::span<const Model::SequenceInput>(&in, 1), Model::LogitsMode::last, logits);
}

}  // namespace

// Finding 4 as the issue states it: stories260K (llama2.c seq_len 512) fed explicit position ids 5,000,000 and on.
TEST(PositionBound, FiveMillionOnAModelTrainedAt512WarnsOnce) {
  Model m = stories();
  ASSERT_EQ(m.trained_context(), 512);
  EXPECT_EQ(trained_position_bound(m), 512);
  std::vector<PositionWarning> seen;
  m.set_position_warning([&](const PositionWarning& w) { seen.push_back(w); });
  KvCache cache = m.make_cache();
  const auto seq = cache.create();
  feed(m, cache, seq, {1, 403, 407}, {5000000, 5000001, 5000002});
  ASSERT_EQ(seen.size(), 1u);
  EXPECT_EQ(seen[0].position, 5000000);
  EXPECT_EQ(seen[0].bound, 512);
  EXPECT_EQ(seen[0].trained_context, 512);
  EXPECT_EQ(seen[0].factor, 1.0);
  EXPECT_NE(seen[0].message.find("passes the trained context (512 tokens"), std::string::npos) << seen[0].message;
  EXPECT_NE(seen[0].message.find("at position 5000000"), std::string::npos) << seen[0].message;
  EXPECT_EQ(cache.size(seq), 3);
  // Once: the next step (and a copy made after the hook, which shares it) says nothing more.
  feed(m, cache, seq, {300}, {5000003});
  const Model copy = m;
  KvCache c2 = copy.make_cache();
  feed(copy, c2, c2.create(), {1}, {6000000});
  EXPECT_EQ(seen.size(), 1u);
}

// The edge: positions 0..511 are inside; the step that feeds 512 warns, naming 512 (a chunk crossing it too).
TEST(PositionBound, WarnsAtTheFirstPositionPastTheBound) {
  Model m = stories();
  std::vector<PositionWarning> seen;
  m.set_position_warning([&](const PositionWarning& w) { seen.push_back(w); });
  KvCache cache = m.make_cache();
  const auto seq = cache.create();
  std::vector<int32_t> toks(510, 300);
  std::vector<float> logits;
  Model::SequenceInput in{seq, toks, {}};
  m.forward(cache, std::span<const Model::SequenceInput>(&in, 1), Model::LogitsMode::last, logits);
  const std::vector<int32_t> two = {301, 302};  // positions 510, 511
  in = {seq, two, {}};
  m.forward(cache, std::span<const Model::SequenceInput>(&in, 1), Model::LogitsMode::last, logits);
  EXPECT_TRUE(seen.empty());
  in = {seq, two, {}};  // 512, 513
  m.forward(cache, std::span<const Model::SequenceInput>(&in, 1), Model::LogitsMode::last, logits);
  ASSERT_EQ(seen.size(), 1u);
  EXPECT_EQ(seen[0].position, 512);
}

// The bound is trained context x the active rope_scaling factor: linear to 2048 (factor 4) moves it to 2048.
TEST(PositionBound, BoundIsTrainedContextTimesTheScalingFactor) {
  Model m = stories();
  m.set_rope(rope_setup_for_context(stories().rope(), 512, "linear", 2048, std::nullopt));
  ASSERT_TRUE(m.rope().params.factor.has_value());
  EXPECT_DOUBLE_EQ(*m.rope().params.factor, 4.0);
  EXPECT_DOUBLE_EQ(trained_position_factor(m), 4.0);
  EXPECT_EQ(trained_position_bound(m), 2048);
  std::vector<PositionWarning> seen;
  m.set_position_warning([&](const PositionWarning& w) { seen.push_back(w); });
  KvCache cache = m.make_cache();
  feed(m, cache, cache.create(), {1, 2}, {1000, 2047});
  EXPECT_TRUE(seen.empty());
  feed(m, cache, cache.create(), {1, 2}, {2047, 2048});
  ASSERT_EQ(seen.size(), 1u);
  EXPECT_EQ(seen[0].position, 2048);
  EXPECT_EQ(seen[0].bound, 2048);
  EXPECT_NE(seen[0].message.find("x rope factor 4 = 2048 positions"), std::string::npos) << seen[0].message;
  // A factor of 1.5 rounds the bound up: 512 x 1.5 = 768.
  m.set_rope(rope_setup_for_context(stories().rope(), 512, "linear", 768, std::nullopt));
  EXPECT_EQ(trained_position_bound(m), 768);
}

// A file whose own rope_scaling extends the context is trained to the window it declares (Llama-3.1: original
// 8192 x factor 8 = 65536, max_position_embeddings 131072): TinyStories-656K's directory with a Llama-3.1-style
// rope_scaling (original 128, factor 2) and max_position_embeddings 512 has the bound 512, not 128 x 2; an override
// of the scaling gets trained context x its own factor.
TEST(PositionBound, TheFilesOwnScalingIsBoundedByItsDeclaredWindow) {
  TempDir d;
  const fs::path src = posenc::test::shared_dir() / "models" / "TinyStories-656K";
  auto cfg = nlohmann::json::parse(posenc::test::slurp(src / "config.json"));
  cfg["rope_scaling"] = {{"rope_type", "llama3"}, {"factor", 2.0}, {"low_freq_factor", 1.0},
                         {"high_freq_factor", 4.0}, {"original_max_position_embeddings", 128}};
  const fs::path dir = d.path() / "m";
  fs::create_directories(dir);
  write_file_atomic(dir / "config.json", cfg.dump(2));
  fs::create_symlink(src / "model.safetensors", dir / "model.safetensors");
  fs::copy_file(src / "tokenizer.json", dir / "tokenizer.json");
  const Model m = Model::load(dir);
  EXPECT_EQ(m.trained_context(), 128);
  EXPECT_EQ(m.rope().params.rope_type, "llama3");
  EXPECT_EQ(trained_position_bound(m), 512);
  Model linear = m;
  linear.set_rope(rope_setup_for_context(m.rope(), 128, "linear", 384, std::nullopt));
  EXPECT_EQ(trained_position_bound(linear), 384);  // 128 x 3: the file's window belongs to its own scaling
}

// --max-position: a position past the limit is a PositionError naming both, and nothing reaches the cache.
TEST(PositionBound, MaxPositionRefusesBeforeTheCacheIsTouched) {
  Model m = stories();
  m.set_max_position(4096);
  EXPECT_EQ(m.max_position(), 4096);
  KvCache cache = m.make_cache();
  const auto seq = cache.create();
  feed(m, cache, seq, {1, 2}, {4095, 4096});  // 4096 itself is allowed
  EXPECT_EQ(cache.size(seq), 2);
  const std::string msg = test::message_of<PositionError>([&] { feed(m, cache, seq, {3}, {5000000}); });
  EXPECT_NE(msg.find("position 5000000"), std::string::npos) << msg;
  EXPECT_NE(msg.find("position limit 4096"), std::string::npos) << msg;
  EXPECT_EQ(cache.size(seq), 2);
  EXPECT_EQ(cache.next_position(seq), 4097);
  // Continuing positions are checked too (no explicit ids): 4097 is past.
  const std::string cont = test::message_of<PositionError>([&] { feed(m, cache, seq, {3}, {}); });
  EXPECT_NE(cont.find("position 4097"), std::string::npos) << cont;
  EXPECT_NE(test::message_of<InvalidArgument>([&] { m.set_max_position(-2); }).find("max_position"),
            std::string::npos);
}

// ---- the CLI: one warning on stderr and in --json, for every command that runs the model ----

TEST(PositionBoundCli, PplWarnsOncePastTheTrainedContextAndInItsJson) {
  TempDir d;
  const auto out = d.path() / "ppl.json";
  const auto r = run_cli("ppl " + stories_args() + " --text " + q(posenc::test::text_path()) +
                         " --context 256,1024 --scored-tokens 2048 --quiet --json " + q(out));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(count(r.err, "posenc: warning: the sequence passes the trained context (512 tokens"), 1u) << r.err;
  const auto j = nlohmann::json::parse(test::slurp(out));
  ASSERT_TRUE(j.at("position_warning").is_object()) << j.dump();
  EXPECT_EQ(j["position_warning"]["position"], 512);
  EXPECT_EQ(j["position_warning"]["bound"], 512);
  EXPECT_EQ(j["position_warning"]["factor"], 1.0);
  // Linear scaling to the window (factor 1024/512 = 2): the positions are inside 512 x 2, no warning.
  const auto s = run_cli("ppl " + stories_args() + " --text " + q(posenc::test::text_path()) +
                         " --context 1024 --rope-scaling linear --scored-tokens 2048 --quiet --json " + q(out));
  ASSERT_EQ(s.exit_code, 0) << s.err;
  EXPECT_EQ(s.err.find("passes the trained context"), std::string::npos) << s.err;
  EXPECT_TRUE(nlohmann::json::parse(test::slurp(out)).at("position_warning").is_null());
}

TEST(PositionBoundCli, MaxPositionIsAnErrorNamingThePositionAndTheLimit) {
  const auto r = run_cli("ppl " + stories_args() + " --text " + q(posenc::test::text_path()) +
                         " --context 1024 --scored-tokens 1024 --quiet --max-position 600");
  EXPECT_EQ(r.exit_code, 1) << r.err;
  EXPECT_NE(r.err.find("position 1023 is past the position limit 600"), std::string::npos) << r.err;
  // generate stops where the next token would pass the limit (stop_reason position_limit) and keeps its output:
  // positions 0 .. 20 are fed, so 5 prompt tokens + 17 new tokens (the last one sampled, never fed).
  TempDir d;
  const auto gj = d.path() / "g.json";
  const auto g = run_cli("generate " + stories_args() + " --prompt 'Once upon a time' --max-tokens 40 --ignore-eos "
                         "--quiet --max-position 20 --json " + q(gj));
  EXPECT_EQ(g.exit_code, 0) << g.err;
  const auto gr = nlohmann::json::parse(test::slurp(gj));
  EXPECT_EQ(gr["stop_reason"], "position_limit");
  EXPECT_EQ(gr["prompt_ids"].size() + gr["generated_ids"].size(), 22u) << gr.dump();
  // ... and says which end it met: --max-position, not a learned table this RoPE model does not have.
  EXPECT_NE(g.err.find("would pass --max-position 20"), std::string::npos) << g.err;
  EXPECT_EQ(g.err.find("learned position table"), std::string::npos) << g.err;
  // A prompt past the limit is refused before anything runs.
  const auto p = run_cli("generate " + stories_args() + " --prompt 'Once upon a time' --max-tokens 4 --quiet "
                         "--max-position 2");
  EXPECT_EQ(p.exit_code, 1) << p.err;
  EXPECT_NE(p.err.find("reach position 4, past the position limit 2"), std::string::npos) << p.err;
  EXPECT_NE(p.err.find("--max-position"), std::string::npos) << p.err;
  EXPECT_EQ(p.out, "") << "a refused prompt is not echoed";
  // Within the limit: runs.
  const auto ok = run_cli("generate " + stories_args() + " --prompt 'Once upon a time' --max-tokens 10 --quiet "
                          "--max-position 600");
  EXPECT_EQ(ok.exit_code, 0) << ok.err;
  const auto bad = run_cli("generate " + stories_args() + " --prompt hi --max-position -1");
  EXPECT_EQ(bad.exit_code, 2) << bad.err;
  EXPECT_NE(bad.err.find("--max-position"), std::string::npos) << bad.err;
}

TEST(PositionBoundCli, CheckCacheAndDetectLayoutWarnInStderrAndJson) {
  TempDir d;
  const auto cj = d.path() / "cc.json";
  const auto c = run_cli("check-cache --model " + q(posenc::test::model_path()) + " --length 600 --json " + q(cj));
  ASSERT_EQ(c.exit_code, 0) << c.err;
  EXPECT_EQ(count(c.err, "passes the trained context (512 tokens"), 1u) << c.err;
  const auto jc = nlohmann::json::parse(test::slurp(cj));
  ASSERT_TRUE(jc.at("position_warning").is_object()) << jc.dump();
  EXPECT_EQ(jc["position_warning"]["bound"], 512);
  EXPECT_GE(jc["position_warning"]["position"].get<int64_t>(), 512);
  const auto n = run_cli("check-cache --model " + q(posenc::test::model_path()) + " --length 64 --json " + q(cj));
  ASSERT_EQ(n.exit_code, 0) << n.err;
  EXPECT_EQ(n.err.find("passes the trained context"), std::string::npos) << n.err;
  EXPECT_TRUE(nlohmann::json::parse(test::slurp(cj)).at("position_warning").is_null());
  const auto m = run_cli("check-cache --model " + q(posenc::test::model_path()) + " --length 64 --max-position 10");
  EXPECT_EQ(m.exit_code, 1) << m.err;
  EXPECT_NE(m.err.find("past the position limit 10"), std::string::npos) << m.err;

  const auto dj = d.path() / "dl.json";
  const auto l = run_cli("detect-layout " + stories_args() + " --text " + q(posenc::test::text_path()) +
                         " --context 1024 --scored-tokens 1024 --json " + q(dj));
  ASSERT_EQ(l.exit_code, 0) << l.err;
  EXPECT_EQ(count(l.err, "passes the trained context (512 tokens"), 1u) << l.err;
  const auto jl = nlohmann::json::parse(test::slurp(dj));
  ASSERT_TRUE(jl.at("position_warning").is_object()) << jl.dump();
  EXPECT_EQ(jl["position_warning"]["position"], 512);
}

}  // namespace POSENC_UNITY_ID
