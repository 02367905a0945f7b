// The CLI on real models in every format: Hugging Face directories and GGUF
// files through ppl/generate/tokenize/detect-layout/convert, the positional
// overrides, and their errors (typed, exit 1; usage errors exit 2).
#include <cstdint>
#include <cstring>
#include <filesystem>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "posenc/io.hpp"
#include "test_support.hpp"

namespace POSENC_UNITY_ID {  // this file's own namespace in the tests' unity build (CMakeLists.txt)

using posenc::test::run_cli;
using posenc::test::TempDir;
using json = nlohmann::json;
namespace fs = std::filesystem;

namespace {
std::string q(const fs::path& p) { return "'" + p.string() + "'"; }
fs::path models() { return posenc::test::shared_dir() / "models"; }
fs::path hf() { return models() / "TinyStories-656K"; }
fs::path q8() { return models() / "TinyStories-656K-gguf/TinyStories-656K-Q8_0.gguf"; }
fs::path gguf260() { return models() / "stories260K/stories260K.gguf"; }
fs::path text() { return posenc::test::text_path(); }
fs::path refs() { return fs::path(POSENC_SOURCE_DIR) / "tests/model/data"; }
void expect_failure(const posenc::test::CliResult& r, int code, const std::string& needle) {
  EXPECT_FALSE(r.signaled);
  EXPECT_EQ(r.exit_code, code) << r.err;
  EXPECT_NE(r.err.find(needle), std::string::npos) << "stderr: " << r.err;
}
}  // namespace

// The README's main job on TinyStories-656K: --model is the Hugging Face directory, the tokenizer comes with it.
TEST(CliFormats, PplOnAHuggingFaceDirectory) {
  TempDir d;
  const auto out = d.path() / "ppl.json";
  const auto r = run_cli("ppl --model " + q(hf()) + " --text " + q(text()) +
                         " --context 256,1024 --rope-scaling default,linear --scored-tokens 4000 --json " + q(out));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("Hugging Face directory, LlamaForCausalLM"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("trained context: 512 (config.json max_position_embeddings)"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("layout: half"), std::string::npos);
  const json j = json::parse(posenc::read_file(out));
  EXPECT_EQ(j["model_format"], "Hugging Face directory");
  EXPECT_EQ(j["trained_context"], 512);
  EXPECT_EQ(j["rope_layout"], "half");
  ASSERT_EQ(j["results"].size(), 4u);
  // At 1024 = 2 x the trained context, linear uses factor 2 and changes the result.
  EXPECT_EQ(j["results"][3]["factor"], 2.0);
  EXPECT_NE(j["results"][2]["nll"], j["results"][3]["nll"]);
  // Within the trained context a 256-token window has NLL near 4.2 nats (a 2048-token vocabulary).
  EXPECT_GT(j["results"][0]["nll"].get<double>(), 3.5);
  EXPECT_LT(j["results"][0]["nll"].get<double>(), 4.8);
}

// A GGUF whose embedded vocabulary cannot encode is refused with advice; with
// the model's tokenizer.json it runs (and agrees with the HF directory's NLL).
TEST(CliFormats, Q8GgufNeedsTheTokenizerJson) {
  expect_failure(run_cli("ppl --model " + q(q8()) + " --text " + q(text()) + " --scored-tokens 1000"), 1,
                 "--tokenizer");
  const auto a = run_cli("ppl --model " + q(q8()) + " --tokenizer " + q(hf() / "tokenizer.json") + " --text " +
                         q(text()) + " --context 256 --rope-scaling default --scored-tokens 4000 --quiet");
  const auto b = run_cli("ppl --model " + q(hf()) + " --text " + q(text()) +
                         " --context 256 --rope-scaling default --scored-tokens 4000 --quiet");
  ASSERT_EQ(a.exit_code, 0) << a.err;
  ASSERT_EQ(b.exit_code, 0) << b.err;
  // The table row: "256 default 1.000 ppl nll tokens ...": same token count, NLL within the Q8_0 error.
  auto nll_of = [](const std::string& out) {
    const auto pos = out.find("\n     256 default");
    EXPECT_NE(pos, std::string::npos) << out;
    std::istringstream in(out.substr(pos));
    int64_t ctx, tokens;
    std::string name;
    double factor, ppl, nll;
    in >> ctx >> name >> factor >> ppl >> nll >> tokens;
    return std::pair{nll, tokens};
  };
  const auto [na, ta] = nll_of(a.out);
  const auto [nb, tb] = nll_of(b.out);
  EXPECT_EQ(ta, tb);
  EXPECT_NEAR(na, nb, 0.01);
}

TEST(CliFormats, TokenizeGivesTheHuggingFaceIds) {
  const json ref = json::parse(posenc::read_file(refs() / "hf_tokenizers/tinystories-656k.json"));
  const auto& c = ref["cases"][7];  // "trailing spaces   "
  const auto r = run_cli("tokenize --tokenizer " + q(hf() / "tokenizer.json") + " --prompt " +
                         q(fs::path(c["text"].get<std::string>())));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  std::string want;
  for (const auto& id : c["ids_special"]) want += (want.empty() ? "" : " ") + std::to_string(id.get<int>());
  EXPECT_EQ(r.out, want + "\n");
  const auto n = run_cli("tokenize --model " + q(hf()) + " --no-special --prompt " +
                         q(fs::path(c["text"].get<std::string>())));
  std::string want_plain;
  for (const auto& id : c["ids"]) want_plain += (want_plain.empty() ? "" : " ") + std::to_string(id.get<int>());
  EXPECT_EQ(n.out, want_plain + "\n");
  // The GGUF's own vocabulary: stories260K.gguf encodes as tok512.bin (llama2.c's ids for the prompt).
  const auto g = run_cli("tokenize --model " + q(gguf260()) + " --prompt 'Once upon a time'");
  EXPECT_EQ(g.out, "1 403 407 261 378\n");
  // ... and given as --tokenizer, a GGUF is its embedded vocabulary too (not a llama2.c .bin).
  const auto gt = run_cli("tokenize --tokenizer " + q(gguf260()) + " --prompt 'Once upon a time'");
  EXPECT_EQ(gt.out, "1 403 407 261 378\n") << gt.err;
  TempDir d;
  const auto j = run_cli("tokenize --tokenizer " + q(hf()) + " --prompt 'Once upon a time' --pieces --json " +
                         q(d.path() / "t.json"));
  ASSERT_EQ(j.exit_code, 0) << j.err;
  const json t = json::parse(posenc::read_file(d.path() / "t.json"));
  EXPECT_EQ(t["ids"], json({1, 80, 147, 201, 282, 57}));
  EXPECT_EQ(t["count"], 6);
  EXPECT_EQ(t["pieces"].size(), 6u);
  expect_failure(run_cli("tokenize --prompt x"), 2, "At least 1 option from [--model,--tokenizer] is required");
  expect_failure(run_cli("tokenize --tokenizer " + q(hf()) + " --prompt x --text " + q(text())), 2,
                 "Exactly 1 option from [--text,--prompt-file,--prompt] is required");
  // --tokenizer overrides the one a model brings: the Q8_0 GGUF with tokenizer.json.
  const auto o = run_cli("tokenize --model " + q(q8()) + " --tokenizer " + q(hf()) + " --prompt 'Once upon a time'");
  EXPECT_EQ(o.out, "1 80 147 201 282 57\n") << o.err;
  expect_failure(run_cli("tokenize --model " + q(q8()) + " --prompt x"), 1,
                 "posenc: error: the tokenizer this model brings cannot be used: ");  // the reason first
  expect_failure(run_cli("tokenize --model " + q(q8()) + " --prompt x"), 1,
                 "use the model's Hugging Face tokenizer.json instead (--tokenizer <Hugging Face model dir>/tokenizer.json)");
  // Its equal-score vocabulary given as --tokenizer: refused, the file named once.
  const auto eq = run_cli("tokenize --tokenizer " + q(q8()) + " --prompt x");
  EXPECT_EQ(eq.exit_code, 1);
  EXPECT_NE(eq.err.find("scores of the SentencePiece vocabulary are equal"), std::string::npos) << eq.err;
  EXPECT_NE(eq.err.find("for all 2045 of its 2048 tokens of normal type"), std::string::npos) << eq.err;
  const std::string name = q8().filename().string();
  EXPECT_EQ(eq.err.find(name), eq.err.rfind(name)) << eq.err;
  expect_failure(run_cli("tokenize --tokenizer " + q(posenc::test::shared_dir() / "tokenizers/bert-base-uncased") +
                         " --prompt x"),
                 1, "WordPiece");
}

// generate --json: ids, log-probabilities and text; the ids are llama.cpp's
// greedy continuation of the same prompt on the same weights.
TEST(CliFormats, GenerateJsonRecordsIdsAndLogprobs) {
  TempDir d;
  const auto r = run_cli("generate --model " + q(hf()) + " --prompt 'Once upon a time' --max-tokens 40 --ignore-eos "
                         "--json " + q(d.path() / "g.json"));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const json g = json::parse(posenc::read_file(d.path() / "g.json"));
  EXPECT_EQ(g["prompt_ids"], json({1, 80, 147, 201, 282, 57}));
  ASSERT_EQ(g["generated_ids"].size(), 40u);
  ASSERT_EQ(g["generated_logprobs"].size(), 40u);
  for (const auto& lp : g["generated_logprobs"]) {
    EXPECT_LE(lp.get<double>(), 0.0);
    EXPECT_GT(lp.get<double>(), -20.0);
  }
  EXPECT_EQ(g["stop_reason"], "max_tokens");
  EXPECT_EQ(r.out.rfind("Once upon a time,", 0), 0u) << r.out;
  const json ref = json::parse(posenc::read_file(refs() / "llama_cpp/converted-TinyStories-656K-f32/summary.json"));
  EXPECT_EQ(g["generated_ids"], ref["greedy"][1]["new_ids"]);
  expect_failure(run_cli("generate --model " + q(hf()) + " --prompt x --json " + q(d.path())), 2, "directory");
}

TEST(CliFormats, DetectLayoutAgreesWithTheLoaders) {
  const auto a = run_cli("detect-layout --model " + q(q8()) + " --tokenizer " + q(hf()) + " --text " + q(text()) +
                         " --scored-tokens 2048 --json -");
  ASSERT_EQ(a.exit_code, 0) << a.err;
  const json ja = json::parse(a.out);
  EXPECT_EQ(ja["likely_layout"], "interleaved");
  EXPECT_EQ(ja["loader_layout"], "interleaved");
  EXPECT_EQ(ja["agrees_with_loader"], true);
  const auto b = run_cli("detect-layout --model " + q(hf()) + " --text " + q(text()) + " --scored-tokens 2048 --json -");
  ASSERT_EQ(b.exit_code, 0) << b.err;
  const json jb = json::parse(b.out);
  EXPECT_EQ(jb["likely_layout"], "half");
  EXPECT_EQ(jb["agrees_with_loader"], true);
  // Forcing the wrong layout: the evidence disagrees, and says so.
  const auto c = run_cli("detect-layout --model " + q(hf()) + " --rope-layout interleaved --text " + q(text()) +
                         " --scored-tokens 1024 --json -");
  EXPECT_EQ(json::parse(c.out)["agrees_with_loader"], false);
}

// --config with a bare rope_scaling object gives llama3 its real parameters;
// "native" is the model's own (here: --config's) setup; --trained-context moves
// the factor other methods derive.
TEST(CliFormats, PositionalOverrides) {
  TempDir d;
  const auto cfg = d.file("llama3.json",
                          R"({"rope_type": "llama3", "factor": 4, "low_freq_factor": 1, "high_freq_factor": 4,
                              "original_max_position_embeddings": 512})");
  expect_failure(run_cli("ppl --model " + q(hf()) + " --text " + q(text()) + " --context 1024 --rope-scaling llama3"),
                 1, "low_freq_factor");
  const auto out = d.path() / "p.json";
  const auto r = run_cli("ppl --model " + q(hf()) + " --text " + q(text()) + " --config " + q(cfg) +
                         " --context 1024 --rope-scaling default,native,llama3 --scored-tokens 3000 --quiet --json " +
                         q(out));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const json j = json::parse(posenc::read_file(out));
  EXPECT_EQ(j["results"][1]["nll"], j["results"][2]["nll"]);  // native = llama3 with the config's parameters
  EXPECT_NE(j["results"][0]["nll"], j["results"][1]["nll"]);
  EXPECT_EQ(j["results"][1]["factor"], 4.0);
  // stories260K.gguf says 2048; --trained-context 512 makes linear use factor 2 at 1024.
  const auto t = run_cli("ppl --model " + q(gguf260()) + " --text " + q(text()) +
                         " --context 1024 --rope-scaling linear --scored-tokens 2000 --trained-context 512 --json " +
                         q(d.path() / "t.json"));
  ASSERT_EQ(t.exit_code, 0) << t.err;
  EXPECT_NE(t.out.find("trained context: 512 (--trained-context)"), std::string::npos) << t.out;
  EXPECT_EQ(json::parse(posenc::read_file(d.path() / "t.json"))["results"][0]["factor"], 2.0);
  const auto u = run_cli("ppl --model " + q(gguf260()) + " --text " + q(text()) +
                         " --context 1024 --rope-scaling linear --scored-tokens 2000 --json " + q(d.path() / "u.json"));
  EXPECT_EQ(json::parse(posenc::read_file(d.path() / "u.json"))["results"][0]["factor"], 1.0);
  // --rope-theta changes the frequencies (and the numbers).
  const auto th = run_cli("ppl --model " + q(hf()) + " --text " + q(text()) +
                          " --context 256 --rope-scaling default --scored-tokens 2000 --rope-theta 500000 --json " +
                          q(d.path() / "th.json"));
  ASSERT_EQ(th.exit_code, 0) << th.err;
  const auto base = run_cli("ppl --model " + q(hf()) + " --text " + q(text()) +
                            " --context 256 --rope-scaling default --scored-tokens 2000 --json " + q(d.path() / "b.json"));
  EXPECT_NE(json::parse(posenc::read_file(d.path() / "th.json"))["results"][0]["nll"],
            json::parse(posenc::read_file(d.path() / "b.json"))["results"][0]["nll"]);
  expect_failure(run_cli("ppl --model " + q(hf()) + " --text " + q(text()) + " --rope-theta -1"), 2, "--rope-theta");  // out of range: a usage error (exit 2)
  expect_failure(run_cli("ppl --model " + q(hf()) + " --text " + q(text()) + " --trained-context 0"), 2,
                 "--trained-context");
  expect_failure(run_cli("ppl --model " + q(hf()) + " --text " + q(text()) + " --quantized-matmul int4"), 2,
                 "--quantized-matmul");  // a malformed flag value: a usage error, as the exit-code rule says
  expect_failure(run_cli("ppl --model " + q(hf()) + " --text " + q(text()) + " --angle-precision fp8"), 2,
                 "--angle-precision");
  expect_failure(run_cli("ppl --model " + q(hf()) + " --text " + q(text()) + " --rope-layout diagonal"), 2,
                 "--rope-layout");
  expect_failure(run_cli("ppl --model " + q(hf()) + " --text " + q(text()) + " --config " +
                         q(d.file("bad.json", R"({"rope_type": "su2"})"))),
                 1, "su2");
}

TEST(CliFormats, ConvertWritesAGgufThatReadsBack) {
  TempDir d;
  const auto out = d.path() / "m.gguf";
  const auto r = run_cli("convert --model " + q(hf()) + " --to gguf --type q8_0 --out " + q(out));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.err.find("permuted from half"), std::string::npos) << r.err;
  const auto g = run_cli("generate --model " + q(out) + " --prompt '' --max-tokens 20 --ignore-eos");
  const auto h = run_cli("generate --model " + q(q8()) + " --tokenizer " + q(hf()) +
                         " --prompt '' --max-tokens 20 --ignore-eos");
  ASSERT_EQ(g.exit_code, 0) << g.err;
  EXPECT_EQ(g.out, h.out);  // the same blocks as the published Q8_0 file, and a vocabulary that works
  // Values outside the lists are usage errors (exit 2); case does not matter.
  expect_failure(run_cli("convert --model " + q(hf()) + " --to gguf --type q4_K --out " + q(d.path() / "x.gguf")), 2,
                 "--type");
  expect_failure(run_cli("convert --model " + q(hf()) + " --to safetensors --out " + q(d.path() / "x")), 2, "--to");
  const auto upper = run_cli("convert --model " + q(hf()) + " --to GGUF --type Q4_0 --out " + q(d.path() / "u.gguf"));
  ASSERT_EQ(upper.exit_code, 0) << upper.err;
  EXPECT_NE(upper.out.find("q4_0)"), std::string::npos) << upper.out;
  expect_failure(run_cli("convert --model " + q(hf()) + " --out " + q(d.path())), 2, "directory");
}

TEST(CliFormats, BadModelDirectoriesAreTypedErrors) {
  TempDir d;
  fs::create_directories(d.path() / "empty");
  expect_failure(run_cli("generate --model " + q(d.path() / "empty") + " --prompt x"), 1, "config.json is missing");
  // tokenize reads only the tokenizer, and says the same (not "brings no tokenizer").
  expect_failure(run_cli("tokenize --model " + q(d.path() / "empty") + " --prompt x"), 1, "config.json is missing");
  // A llama2.c .bin brings no tokenizer: without --tokenizer the command line lacks a flag this model needs (exit 2,
  // as --endpoint without --tokenizer), for tokenize as for generate.
  const std::string bin = q(posenc::test::model_path());
  expect_failure(run_cli("tokenize --model " + bin + " --prompt x"), 2, "brings no tokenizer; pass --tokenizer");
  expect_failure(run_cli("generate --model " + bin + " --prompt x"), 2, "--tokenizer: required");
  fs::create_directories(d.path() / "gpt2");
  d.file("gpt2/config.json", R"({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_embd": 768,
                                 "n_head": 12, "n_layer": 12, "n_positions": 1024, "vocab_size": 50257})");
  expect_failure(run_cli("generate --model " + q(d.path() / "gpt2") + " --prompt x"), 1,
                 "GPT2LMHeadModel is not supported yet");
  // config.json claims a wider model than the weights hold: the tensor, expected and actual shapes are named.
  fs::create_directories(d.path() / "wide");
  std::string cfg = posenc::read_file(hf() / "config.json");
  cfg.replace(cfg.find("\"intermediate_size\": 384"), 24, "\"intermediate_size\": 512");
  d.file("wide/config.json", cfg);
  fs::create_symlink(hf() / "model.safetensors", d.path() / "wide/model.safetensors");
  expect_failure(run_cli("generate --model " + q(d.path() / "wide") + " --prompt x --tokenizer " + q(hf())), 1,
                 "model.layers.0.mlp.gate_proj.weight has shape [384, 128], config.json implies [512, 128]");
  // A directory of a GGUF file (or a llama2.c .bin) names the file to give instead.
  fs::create_directories(d.path() / "ggufdir");
  fs::create_symlink(q8(), d.path() / "ggufdir" / "m.gguf");
  expect_failure(run_cli("generate --model " + q(d.path() / "ggufdir") + " --prompt x"), 1,
                 "config.json is missing (it holds m.gguf: give the model file itself");
  // No weights at all.
  fs::create_directories(d.path() / "noweights");
  d.file("noweights/config.json", posenc::read_file(hf() / "config.json"));
  expect_failure(run_cli("generate --model " + q(d.path() / "noweights") + " --prompt x"), 1, "model.safetensors");
}

// Found by a tester: a GGUF's llama.rope.scaling.factor was checked only for > 0, so 1e-30 ran with nonsense
// frequencies and 1e-44 failed as "inv_freq[0]: must be finite", naming no key; it is bounded as config.json's.
TEST(CliFormats, GgufRopeScalingFactorIsBoundedAndNamed) {
  TempDir d;
  fs::create_directories(d.path() / "lin");
  std::string cfg = posenc::read_file(hf() / "config.json");
  cfg.replace(cfg.find("\"rope_scaling\": null"), 20, R"("rope_scaling": {"rope_type": "linear", "factor": 2.0})");
  d.file("lin/config.json", cfg);
  for (const char* f : {"model.safetensors", "tokenizer.json", "tokenizer_config.json"})
    if (fs::exists(hf() / f)) fs::create_symlink(hf() / f, d.path() / "lin" / f);
  const fs::path gguf = d.path() / "lin.gguf";
  const auto r = run_cli("convert --model " + q(d.path() / "lin") + " --to gguf --out " + q(gguf));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  std::string bytes = posenc::read_file(gguf);
  const std::string key = "llama.rope.scaling.factor";
  const std::size_t at = bytes.find(key);
  ASSERT_NE(at, std::string::npos);
  uint32_t type = 0;
  std::memcpy(&type, bytes.data() + at + key.size(), 4);
  ASSERT_EQ(type, 6u);  // GGUF_TYPE_FLOAT32
  float stored = 0;
  std::memcpy(&stored, bytes.data() + at + key.size() + 4, 4);
  ASSERT_EQ(stored, 2.0f);
  ASSERT_EQ(run_cli("generate --model " + q(gguf) + " --prompt x --max-tokens 2").exit_code, 0);
  for (const float bad : {1e-30f, 1e-44f, 1e7f}) {
    std::memcpy(bytes.data() + at + key.size() + 4, &bad, 4);
    const fs::path p = d.path() / "bad.gguf";
    d.file("bad.gguf", bytes);
    expect_failure(run_cli("generate --model " + q(p) + " --prompt x --max-tokens 2"), 1,
                   "llama.rope.scaling.factor must be in [1e-06, 1e+06]");
  }
}

}  // namespace POSENC_UNITY_ID
