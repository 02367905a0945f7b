// The model loaders on bad input, built from the real TinyStories-656K files
// (Hugging Face directory and Q8_0 GGUF) and from tiny generated models: a
// typed error naming the file, field or tensor and the value, never a model
// that runs something else than the file describes, never an allocation the
// file does not justify. Also the real-weight checks of the Qwen2 / Qwen3 /
// Mistral paths and what posenc convert refuses.
#include <cmath>
#include <filesystem>
#include <functional>
#include <map>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "model/kernels.hpp"
#include "posenc/consistency.hpp"
#include "posenc/convert.hpp"
#include "posenc/error.hpp"
#include "posenc/gguf.hpp"
#include "posenc/io.hpp"
#include "posenc/model.hpp"
#include "posenc/overrides.hpp"
#include "posenc/safetensors.hpp"
#include "test_support.hpp"
#include "tiny_models.hpp"

namespace POSENC_UNITY_ID {  // this file's own namespace in the tests' unity build (CMakeLists.txt)

using namespace posenc;
namespace fs = std::filesystem;
using json = nlohmann::json;
using posenc::test::run_cli;
using posenc::test::slurp;
using posenc::test::TempDir;

namespace {

fs::path hf656() { return test::shared_dir() / "models/TinyStories-656K"; }
fs::path q8_656() { return test::shared_dir() / "models/TinyStories-656K-gguf/TinyStories-656K-Q8_0.gguf"; }
json real_config() { return json::parse(slurp(hf656() / "config.json")); }
std::string q(const fs::path& p) {  // built by appending: GCC 12 warns (-Wrestrict, falsely) on "'" + s + "'"
  std::string s(1, '\'');
  s += p.string();
  s += '\'';
  return s;
}

using Tensors = std::map<std::string, test::tiny::Tensor>;

/// The real model.safetensors as float32 tensors.
Tensors real_tensors() {
  const auto f = SafetensorsFile::open(hf656() / "model.safetensors");
  Tensors t;
  for (const auto& x : f.tensors()) t[x.name] = {x.shape, f.to_float32(x)};
  return t;
}

/// A Hugging Face directory in `parent`/`name`: config.json = `cfg`; the real
/// model.safetensors (symlinked) or `tensors`; tokenizer.json copied unless
/// `tokenizer` says otherwise ("" = none, else its contents).
fs::path hf_dir(const TempDir& parent, const std::string& name, const json& cfg, const Tensors* tensors = nullptr,
                const std::string* tokenizer = nullptr) {
  const fs::path d = parent.path() / name;
  fs::create_directories(d);
  write_file_atomic(d / "config.json", cfg.dump(2));
  if (tensors)
    write_file_atomic(d / "model.safetensors", test::tiny::safetensors_bytes(*tensors));
  else
    fs::create_symlink(hf656() / "model.safetensors", d / "model.safetensors");
  if (tokenizer == nullptr)
    fs::copy_file(hf656() / "tokenizer.json", d / "tokenizer.json");
  else if (!tokenizer->empty())
    write_file_atomic(d / "tokenizer.json", *tokenizer);
  return d;
}

/// The message of the posenc::Error Model::load throws ("" when it loads).
/// Any other exception fails the test: the loaders throw typed errors only.
std::string load_error(const fs::path& p, LoadOptions o = {}) {
  try {
    (void)Model::load(p, o);
  } catch (const Error& e) {
    return e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << p << ": not a posenc::Error: " << e.what();
    return std::string("untyped: ") + e.what();
  }
  return "";
}

void expect_refused(const fs::path& p, std::initializer_list<std::string> parts) {
  const std::string e = load_error(p);
  EXPECT_FALSE(e.empty()) << p << " loaded";
  for (const auto& s : parts) EXPECT_NE(e.find(s), std::string::npos) << "'" << s << "' not in: " << e;
}

std::vector<int32_t> some_tokens(int n, int vocab) {
  std::vector<int32_t> t;
  uint32_t s = 7;
  for (int i = 0; i < n; ++i) {
    s = s * 1664525u + 1013904223u;
    t.push_back(static_cast<int32_t>((s >> 8) % static_cast<uint32_t>(vocab)));
  }
  t[0] = 1;  // BOS
  return t;
}

double max_abs_diff(const std::vector<float>& a, const std::vector<float>& b, std::size_t from = 0,
                    std::size_t to = SIZE_MAX) {
  EXPECT_EQ(a.size(), b.size());
  double d = 0;
  for (std::size_t i = from; i < std::min({a.size(), b.size(), to}); ++i)
    d = std::max(d, std::fabs(static_cast<double>(a[i]) - b[i]));
  return d;
}

// ---- GGUF copies of the real Q8_0 file with edits ---------------------------

GgufValue u32(uint64_t v) {
  GgufValue x;
  x.type = GgufValue::Type::uint32;
  x.scalar = v;
  return x;
}
GgufValue i32(int64_t v) {
  GgufValue x;
  x.type = GgufValue::Type::int32;
  x.scalar = v;
  return x;
}
GgufValue f32(double v) {
  GgufValue x;
  x.type = GgufValue::Type::float32;
  x.scalar = v;
  return x;
}
GgufValue str(std::string v) {
  GgufValue x;
  x.type = GgufValue::Type::string;
  x.scalar = std::move(v);
  return x;
}

/// `src` rewritten with GgufWriter: keys in `set` replaced or added, keys in
/// `drop` and tensors in `drop_tensors` left out.
fs::path gguf_copy(const TempDir& d, const std::string& name, const fs::path& src,
                   const std::map<std::string, GgufValue>& set, const std::vector<std::string>& drop = {},
                   const std::vector<std::string>& drop_tensors = {}) {
  const GgufFile f = GgufFile::open(src);
  GgufWriter w;
  auto listed = [](const std::vector<std::string>& v, const std::string& s) {
    return std::find(v.begin(), v.end(), s) != v.end();
  };
  for (const auto& [k, v] : f.metadata())
    if (!set.contains(k) && !listed(drop, k) && k != "general.alignment") w.add_value(k, v);
  for (const auto& [k, v] : set) w.add_value(k, v);
  for (const auto& t : f.tensors()) {
    if (listed(drop_tensors, t.name)) continue;
    const auto b = f.tensor_data(t);
    w.add_tensor(t.name, t.ne, t.type, std::vector<std::byte>(b.begin(), b.end()));
  }
  const fs::path p = d.path() / name;
  w.write(p);
  return p;
}

}  // namespace

// ---- Hugging Face directories ----------------------------------------------

// num_hidden_layers is believed only as far as the tensors go: 10^9 layers
// used to allocate 10^9 layer records first (std::bad_alloc, "out of memory").
TEST(HfBadInput, HugeLayerCountFailsOnTheFirstMissingLayer) {
  TempDir d;
  json c = real_config();
  c["num_hidden_layers"] = 1000000000;  // past the bound: refused before any layer is read
  expect_refused(hf_dir(d, "a", c), {"num_hidden_layers: must be an integer in [1, 16384] (got 1000000000)"});
  c["num_hidden_layers"] = 16384;  // within it: believed only as far as the tensors go
  expect_refused(hf_dir(d, "c", c), {"model.layers.2.input_layernorm.weight", "is missing"});
  c["num_hidden_layers"] = 3;
  expect_refused(hf_dir(d, "b", c), {"model.layers.2.input_layernorm.weight", "is missing", "[128]"});
}

// A stored weight the config does not use used to be dropped silently (a
// 2-layer checkpoint ran as 1 layer; a q_proj.bias with attention_bias false
// was ignored). inv_freq buffers and a tied lm_head copy are not weights.
TEST(HfBadInput, TensorsTheConfigDoesNotUseAreRefused) {
  TempDir d;
  json c = real_config();
  c["num_hidden_layers"] = 1;
  expect_refused(hf_dir(d, "one_layer", c), {"tensor model.layers.1.", "not used", "num_hidden_layers 1"});

  Tensors t = real_tensors();
  t["model.layers.0.self_attn.q_proj.bias"] = {{128}, std::vector<float>(128, 0.0f)};
  expect_refused(hf_dir(d, "bias", real_config(), &t), {"tensor model.layers.0.self_attn.q_proj.bias", "not used"});
  // A name with a NUL (an escaped NUL in the header's JSON) and an ESC: escaped, and the message whole.
  t = real_tensors();
  t[std::string("extra\0tail\x1b[31m", 15)] = {{4}, std::vector<float>(4, 0.0f)};
  expect_refused(hf_dir(d, "nul", real_config(), &t), {"tensor extra\\x00tail\\x1b[31m is not used", "refusing"});

  // Accepted: a rotary_emb.inv_freq buffer; lm_head stored next to embed_tokens with tied embeddings.
  t = real_tensors();
  t["model.layers.0.self_attn.rotary_emb.inv_freq"] = {{8}, std::vector<float>(8, 1.0f)};
  t["model.embed_tokens.weight"] = t.at("lm_head.weight");
  const Model ref = Model::load(hf656());
  const Model m = Model::load(hf_dir(d, "buffers", real_config(), &t));
  const auto ids = some_tokens(20, 2048);
  EXPECT_EQ(max_abs_diff(m.score_window(ids), ref.score_window(ids)), 0.0);
}

// transformers builds the model from model_type, vLLM from architectures:
// LlamaForCausalLM with model_type gemma2 used to run as Llama.
TEST(HfBadInput, ModelTypeMustAgreeWithArchitectures) {
  TempDir d;
  json c = real_config();
  c["model_type"] = "gemma2";
  expect_refused(hf_dir(d, "gemma", c), {"config.json", "model_type", "disagrees with architectures LlamaForCausalLM",
                                         "gemma2"});
  c["model_type"] = "qwen2";
  expect_refused(hf_dir(d, "qwen", c), {"model_type", "qwen2"});
  c = real_config();
  c["architectures"] = {"Qwen2ForCausalLM"};  // model_type llama
  expect_refused(hf_dir(d, "qwen_arch", c), {"model_type", "Qwen2ForCausalLM", "llama"});
  c.erase("model_type");  // architectures alone decide
  Tensors t = real_tensors();
  for (int l = 0; l < 2; ++l)
    for (auto [p, n] : {std::pair{"q", 128}, {"k", 64}, {"v", 64}})
      t[fmt::format("model.layers.{}.self_attn.{}_proj.bias", l, p)] = {{n}, std::vector<float>(static_cast<std::size_t>(n), 0.0f)};
  EXPECT_EQ(load_error(hf_dir(d, "qwen_arch_only", c, &t)), "");
}

// Refused by name, never run: other architectures and activations.
TEST(HfBadInput, OtherArchitecturesAndActivationsAreRefusedByName) {
  TempDir d;
  int i = 0;
  for (auto [arch, mt] : {std::pair{"GPT2LMHeadModel", "gpt2"}, {"BertModel", "bert"}, {"Gemma2ForCausalLM", "gemma2"},
                          {"MixtralForCausalLM", "mixtral"}}) {
    json c = real_config();
    c["architectures"] = {arch};
    c["model_type"] = mt;
    expect_refused(hf_dir(d, fmt::format("a{}", i++), c), {"config.json", "architectures", arch, "not supported"});
  }
  json c = real_config();
  c["hidden_act"] = "gelu";
  expect_refused(hf_dir(d, "gelu", c), {"hidden_act", "gelu"});
  for (auto [key, value, says] : {std::tuple{"hidden_size", json(256), "[2048, 256]"},
                                  {"num_attention_heads", json(16), "k_proj.weight has shape [64, 128]"},
                                  {"num_key_value_heads", json(2), "[32, 128]"},
                                  {"num_key_value_heads", json(3), "must divide num_attention_heads 8"},
                                  {"intermediate_size", json(512), "gate_proj.weight has shape [384, 128]"},
                                  {"vocab_size", json(4096), "[4096, 128]"},
                                  {"head_dim", json(32), "q_proj.weight has shape [128, 128], config.json implies [256, 128]"},
                                  {"hidden_size", json(2147483648LL), "2147483648"},
                                  {"num_attention_heads", json(-8), "-8"},
                                  {"num_attention_heads", json(8.5), "8.5"},
                                  {"num_attention_heads", json("8"), "\"8\""}}) {
    json x = real_config();
    x[key] = value;
    expect_refused(hf_dir(d, fmt::format("s{}", i++), x), {says});
  }
}

// A tokenizer.json posenc cannot read used to make the whole directory
// unloadable, even with --tokenizer given; now only asking for it fails.
TEST(HfBadInput, UnreadableTokenizerJsonDoesNotBlockTheWeights) {
  TempDir d;
  const std::string wordpiece = slurp(test::shared_dir() / "tokenizers/bert-base-uncased/tokenizer.json");
  const std::string broken = "{\"model\": ";
  const auto ids = some_tokens(12, 2048);
  const auto ref = Model::load(hf656()).score_window(ids);
  for (const auto* tok : {&wordpiece, &broken}) {
    const fs::path dir = hf_dir(d, tok == &wordpiece ? "wordpiece" : "broken", real_config(), nullptr, tok);
    const Model m = Model::load(dir);
    EXPECT_FALSE(m.bundled_tokenizer().has_value());
    EXPECT_NE(m.source().tokenizer_error.find((dir / "tokenizer.json").string()), std::string::npos)
        << m.source().tokenizer_error;
    EXPECT_EQ(max_abs_diff(m.score_window(ids), ref), 0.0);
    auto r = run_cli("generate --model " + q(dir) + " --prompt 'Once upon' --max-tokens 3");
    EXPECT_EQ(r.exit_code, 1) << r.err;
    EXPECT_NE(r.err.find("tokenizer.json"), std::string::npos) << r.err;
    EXPECT_NE(r.err.find("--tokenizer"), std::string::npos) << r.err;
    r = run_cli("generate --model " + q(dir) + " --tokenizer " + q(hf656()) + " --prompt 'Once upon' --max-tokens 3");
    EXPECT_EQ(r.exit_code, 0) << r.err;
    EXPECT_NE(r.out.find("Once upon"), std::string::npos) << r.out;
  }
}

// ---- Qwen2 / Qwen3 / Mistral on the real weights ---------------------------

// Qwen2ForCausalLM always has q/k/v biases: zero biases give Llama's logits
// exactly; Qwen3's q/k RMSNorm with all-ones weights is not the identity, so
// logits change (and stay finite) everywhere but at position 0, whose only
// key is itself (softmax of one score is 1 whatever q and k are).
TEST(HfRealWeights, Qwen2ZeroBiasesAndQwen3OnesNorms) {
  TempDir d;
  const auto ids = some_tokens(48, 2048);
  const Model llama = Model::load(hf656());
  const auto ref = llama.score_window(ids);
  const std::size_t V = 2048;

  json c = real_config();
  c["architectures"] = {"Qwen2ForCausalLM"};
  c["model_type"] = "qwen2";
  Tensors t = real_tensors();
  for (int l = 0; l < 2; ++l)
    for (auto [p, n] : {std::pair{"q", 128}, {"k", 64}, {"v", 64}})
      t[fmt::format("model.layers.{}.self_attn.{}_proj.bias", l, p)] = {{n}, std::vector<float>(static_cast<std::size_t>(n), 0.0f)};
  const Model qwen2 = Model::load(hf_dir(d, "qwen2", c, &t));
  EXPECT_TRUE(qwen2.config().qkv_bias);
  EXPECT_EQ(max_abs_diff(qwen2.score_window(ids), ref), 0.0);
  EXPECT_NE(load_error(hf_dir(d, "qwen2_nobias", c)).find("self_attn.q_proj.bias is missing"), std::string::npos);

  c["architectures"] = {"Qwen3ForCausalLM"};
  c["model_type"] = "qwen3";
  t = real_tensors();
  for (int l = 0; l < 2; ++l)
    for (auto p : {"q", "k"}) t[fmt::format("model.layers.{}.self_attn.{}_norm.weight", l, p)] = {{16}, std::vector<float>(16, 1.0f)};
  const Model qwen3 = Model::load(hf_dir(d, "qwen3", c, &t));
  EXPECT_TRUE(qwen3.config().qk_norm);
  const auto got = qwen3.score_window(ids);
  for (float x : got) ASSERT_TRUE(std::isfinite(x));
  EXPECT_LT(max_abs_diff(got, ref, 0, V), 1e-4);  // position 0
  for (std::size_t p = 1; p < ids.size(); ++p) EXPECT_GT(max_abs_diff(got, ref, p * V, (p + 1) * V), 1e-2) << p;
  t["model.layers.1.self_attn.q_norm.weight"] = {{128}, std::vector<float>(128, 1.0f)};
  expect_refused(hf_dir(d, "qwen3_badnorm", c, &t), {"model.layers.1.self_attn.q_norm.weight has shape [128]", "[16]"});
}

// Mistral's sliding window W: positions < W see the same keys as Llama's
// causal mask (identical logits), later ones fewer (different); decoding
// token by token through the KV cache gives the full forward's logits.
TEST(HfRealWeights, MistralSlidingWindowSmallerThanTheText) {
  TempDir d;
  json c = real_config();
  c["architectures"] = {"MistralForCausalLM"};
  c["model_type"] = "mistral";
  c["sliding_window"] = 16;
  const Model m = Model::load(hf_dir(d, "mistral", c));
  EXPECT_EQ(m.sliding_window(), 16);
  const auto ids = some_tokens(48, 2048);
  const auto ref = Model::load(hf656()).score_window(ids);
  const auto got = m.score_window(ids);
  const std::size_t V = 2048;
  EXPECT_EQ(max_abs_diff(got, ref, 0, 16 * V), 0.0);
  for (std::size_t p = 16; p < ids.size(); ++p) EXPECT_GT(max_abs_diff(got, ref, p * V, (p + 1) * V), 1e-3) << p;
  KvCache cache = m.make_cache(8);
  const auto seq = cache.create();
  std::vector<float> step, all;
  for (std::size_t i = 0; i < ids.size(); ++i) {
    Model::SequenceInput in{seq, std::span(ids).subspan(i, 1), {}};
    m.forward(cache, std::span(&in, 1), Model::LogitsMode::all, step);
    all.insert(all.end(), step.begin(), step.end());
  }
  EXPECT_LT(max_abs_diff(all, got), 1e-4);
  // Llama ignores sliding_window (transformers' LlamaConfig has none).
  c["architectures"] = {"LlamaForCausalLM"};
  c["model_type"] = "llama";
  EXPECT_EQ(Model::load(hf_dir(d, "llama_sw", c)).sliding_window(), 0);
}

// llama3 scaling with factor 8 and original_max_position_embeddings 512 on
// head_dim 16, theta 1e4: wavelengths 2π·1e4^(i/8); channels shorter than
// 512/4 = 128 tokens (i = 0..2) keep their frequency, those longer than 512
// (i = 4..7) are divided by 8, i = 3 (wavelength 199) is interpolated between.
TEST(HfRealWeights, Llama3ScalingMovesOnlyTheLowFrequencies) {
  TempDir d;
  json c = real_config();
  c["rope_scaling"] = {{"rope_type", "llama3"}, {"factor", 8.0}, {"low_freq_factor", 1.0}, {"high_freq_factor", 4.0},
                       {"original_max_position_embeddings", 512}};
  const Model m = Model::load(hf_dir(d, "llama3", c));
  const Model base = Model::load(hf656());
  const auto& a = m.rope().freqs.inv_freq;
  const auto& b = base.rope().freqs.inv_freq;
  ASSERT_EQ(a.size(), 8u);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(a[static_cast<std::size_t>(i)], b[static_cast<std::size_t>(i)]) << i;
  for (int i = 4; i < 8; ++i) EXPECT_NEAR(a[static_cast<std::size_t>(i)] * 8.0 / b[static_cast<std::size_t>(i)], 1.0, 1e-12) << i;
  // i = 3: smooth = (512 / wavelength - 1) / 3, inv_freq = (1 - smooth) inv/8 + smooth inv (HF _compute_llama3_parameters)
  const double wl = 2 * M_PI / b[3], smooth = (512.0 / wl - 1.0) / 3.0;
  EXPECT_NEAR(a[3], (1 - smooth) * b[3] / 8 + smooth * b[3], 1e-6 * b[3]);  // HF computes in float32
  EXPECT_EQ(m.trained_context(), 512);
  const auto ids = some_tokens(40, 2048);
  EXPECT_GT(max_abs_diff(m.score_window(ids), base.score_window(ids)), 1e-3);
}

// ---- GGUF -------------------------------------------------------------------

// block_count smaller than the blocks stored used to run the first blocks only.
TEST(GgufModelBadInput, BlocksTheMetadataDoNotCountAreRefused) {
  TempDir d;
  expect_refused(gguf_copy(d, "bc1.gguf", q8_656(), {{"llama.block_count", u32(1)}}),
                 {"bc1.gguf", "tensor blk.1.", "not used", "llama.block_count 1"});
  expect_refused(gguf_copy(d, "bc3.gguf", q8_656(), {{"llama.block_count", u32(3)}}),
                 {"tensor blk.2.attn_norm.weight is missing"});
  expect_refused(gguf_copy(d, "bcs.gguf", q8_656(), {{"llama.block_count", str("two")}}),
                 {"llama.block_count", "expected an integer"});
  // A string value with a NUL and an ESC: escaped, and the message whole.
  expect_refused(gguf_copy(d, "arch.gguf", q8_656(), {{"general.architecture", str(std::string("lla\0ma\x1b", 7))}}),
                 {"general.architecture: lla\\x00ma\\x1b is not supported yet"});
}

// value_length was compared with key_length only when key_length was present.
TEST(GgufModelBadInput, ValueLengthMustBeTheHeadDim) {
  TempDir d;
  expect_refused(gguf_copy(d, "vl.gguf", q8_656(), {{"llama.attention.value_length", u32(8)}}),
                 {"vl.gguf", "llama.attention.value_length 8", "head_dim 16"});
  EXPECT_EQ(load_error(gguf_copy(d, "vl16.gguf", q8_656(), {{"llama.attention.value_length", u32(16)}})), "");
}

// RoPE scaling values were refused without the file or the GGUF key
// ("rope_scaling.factor: must be finite and > 0 (got 0)").
TEST(GgufModelBadInput, RopeScalingValuesNameTheFileAndKey) {
  TempDir d;
  const GgufValue lin = str("linear"), yarn = str("yarn");
  // One message for every value outside the bounds config.json's factor has (as --rope-factor).
  for (double bad : {0.0, -2.0, std::nan(""), 1e-7, 2e6})
    expect_refused(gguf_copy(d, "f.gguf", q8_656(), {{"llama.rope.scaling.type", lin}, {"llama.rope.scaling.factor", f32(bad)}}),
                   {"f.gguf", "llama.rope.scaling.factor must be in [1e-06, 1e+06]"});
  expect_refused(gguf_copy(d, "o.gguf", q8_656(),
                           {{"llama.rope.scaling.type", yarn},
                            {"llama.rope.scaling.factor", f32(4)},
                            {"llama.rope.scaling.original_context_length", u32(0)}}),
                 {"o.gguf", "llama.rope.scaling.original_context_length", "got 0"});
  expect_refused(gguf_copy(d, "b.gguf", q8_656(),
                           {{"llama.rope.scaling.type", yarn},
                            {"llama.rope.scaling.factor", f32(4)},
                            {"llama.rope.scaling.yarn_beta_fast", f32(std::nan(""))}}),
                 {"b.gguf", "llama.rope.scaling.yarn_beta_fast"});
  expect_refused(gguf_copy(d, "t.gguf", q8_656(), {{"llama.rope.scaling.type", str("longrope")}}),
                 {"t.gguf", "llama.rope.scaling.type longrope is not supported"});
  const Model m = Model::load(gguf_copy(d, "ok.gguf", q8_656(),
                                        {{"llama.rope.scaling.type", yarn},
                                         {"llama.rope.scaling.factor", f32(4)},
                                         {"llama.rope.scaling.original_context_length", u32(128)}}));
  EXPECT_EQ(m.rope().params.rope_type, "yarn");
  EXPECT_EQ(m.trained_context(), 128);
}

// The RMSNorm epsilon: NaN, inf and negatives were "missing or not positive" without the value read. Each refusal
// now names the file, the key and the value; a float64 below float32's range (0 in the model's arithmetic) too.
TEST(GgufModelBadInput, RmsNormEpsilonNamesTheValueRead) {
  TempDir d;
  const std::string key = "llama.attention.layer_norm_rms_epsilon";
  GgufValue tiny, huge;  // float64 1e-60 and 1e39: finite and > 0, but 0 and inf as float32
  tiny.type = huge.type = GgufValue::Type::float64;
  tiny.scalar = 1e-60;
  huge.scalar = 1e39;
  const std::pair<GgufValue, std::string> cases[] = {
      {f32(std::nan("")), "(got nan)"}, {f32(INFINITY), "(got inf)"},  {f32(-INFINITY), "(got -inf)"},
      {f32(-1e-5), "(got -1e-05)"},     {f32(0.0), "(got 0)"},         {tiny, "(got 1e-60)"},
      {huge, "(got 1e+39)"}};
  int i = 0;
  for (const auto& [value, got] : cases)
    expect_refused(gguf_copy(d, fmt::format("eps{}.gguf", i++), q8_656(), {{key, value}}),
                   {"eps", key + " (the RMSNorm epsilon) must be finite and > 0 in float32 " + got});
  expect_refused(gguf_copy(d, "no_eps.gguf", q8_656(), {}, {key}), {"no_eps.gguf", key + " (the RMSNorm epsilon) is missing"});
  const Model ok = Model::load(gguf_copy(d, "ok.gguf", q8_656(), {{key, f32(1e-6)}}));
  EXPECT_FLOAT_EQ(ok.config().norm_eps, 1e-6f);
  // The same underflow and overflow in a config.json (parse_decoder_spec takes 1e-60 and 1e39 as finite and > 0;
  // 1e39 made every normed activation 0 and ppl printed the uniform prediction's 7.6246 with exit 0).
  json cfg = real_config();
  cfg["rms_norm_eps"] = 1e-60;
  expect_refused(hf_dir(d, "hf_eps", cfg), {"config.json", "rms_norm_eps: must be finite and > 0 in float32", "(got 1e-60)"});
  cfg["rms_norm_eps"] = 1e39;
  expect_refused(hf_dir(d, "hf_eps_big", cfg), {"config.json", "rms_norm_eps: must be finite and > 0 in float32", "(got 1e+39)"});
}

// The metadata checked against the tensors, each refusal naming key or tensor.
TEST(GgufModelBadInput, MetadataInconsistentWithTheTensors) {
  TempDir d;
  int i = 0;
  auto one = [&](const std::map<std::string, GgufValue>& set, std::initializer_list<std::string> parts,
                 const std::vector<std::string>& drop = {}) {
    expect_refused(gguf_copy(d, fmt::format("m{}.gguf", i++), q8_656(), set, drop), parts);
  };
  one({{"llama.attention.head_count", u32(0)}}, {"llama.attention.head_count", "got 0"});
  one({{"llama.attention.head_count", str("8")}}, {"llama.attention.head_count", "expected an integer"});
  one({{"llama.embedding_length", u32(256)}}, {"token_embd.weight", "[128, 2048]", "[256, vocab_size]"});
  one({{"llama.rope.dimension_count", u32(15)}}, {"llama.rope.dimension_count", "got 15"});
  one({{"llama.rope.dimension_count", u32(32)}}, {"llama.rope.dimension_count", "head_dim 16", "got 32"});
  one({{"general.architecture", str("qwen2")}}, {"general.architecture", "qwen2"});
  one({}, {"general.architecture", "(missing)"}, {"general.architecture"});
  one({{"llama.vocab_size", u32(4096)}}, {"token_embd.weight", "[128, 4096]"});
  GgufValue big;  // 2^32 + 2048: was cast to int (2048) before the range check and accepted
  big.type = GgufValue::Type::uint64;
  big.scalar = uint64_t{(uint64_t{1} << 32) + 2048};
  one({{"llama.vocab_size", big}}, {"llama.vocab_size", "4294969344"});
  big.scalar = uint64_t{(uint64_t{1} << 32) + 16};  // was cast to 16 and accepted
  one({{"llama.rope.dimension_count", big}}, {"llama.rope.dimension_count", "4294967312"});
  one({{"llama.attention.head_count_kv", u32(3)}}, {"n_heads 8", "n_kv_heads 3"});
  one({{"llama.rope.freq_base", f32(std::nan(""))}}, {"llama.rope.freq_base", "nan"});
  one({{"llama.context_length", u32(0)}}, {"llama.context_length", "got 0"});
  expect_refused(gguf_copy(d, "no_norm.gguf", q8_656(), {}, {}, {"blk.1.ffn_norm.weight"}),
                 {"tensor blk.1.ffn_norm.weight is missing", "[128]"});
}

// The embedded vocabulary: a bad one used to make the file unloadable even
// with --tokenizer (whose advice the message gave); token ids out of range
// were dropped silently.
TEST(GgufModelBadInput, EmbeddedVocabularyErrorsDoNotBlockTheWeights) {
  TempDir d;
  struct Case {
    std::map<std::string, GgufValue> set;
    std::vector<std::string> drop;
    std::string says;
  };
  const std::vector<Case> cases{
      {{}, {"tokenizer.ggml.tokens"}, "tokenizer.ggml.model is llama but tokenizer.ggml.tokens is missing"},
      {{{"tokenizer.ggml.model", str("bert")}}, {}, "tokenizer.ggml.model bert is not supported"},
      {{{"tokenizer.ggml.bos_token_id", u32(99999)}}, {}, "tokenizer.ggml.bos_token_id: token id 99999 is not in the vocabulary of 2048"},
      {{{"tokenizer.ggml.eos_token_id", u32(2048)}}, {}, "tokenizer.ggml.eos_token_id: token id 2048"},
      {{{"tokenizer.ggml.bos_token_id", i32(-5)}}, {}, "token id -5"},
  };
  const auto ids = some_tokens(12, 2048);
  const auto ref = Model::load(q8_656()).score_window(ids);
  int i = 0;
  for (const auto& c : cases) {
    const fs::path p = gguf_copy(d, fmt::format("v{}.gguf", i++), q8_656(), c.set, c.drop);
    const Model m = Model::load(p);
    EXPECT_FALSE(m.bundled_tokenizer().has_value());
    EXPECT_NE(m.source().tokenizer_error.find(c.says), std::string::npos) << m.source().tokenizer_error;
    EXPECT_NE(m.source().tokenizer_error.find(p.string()), std::string::npos) << m.source().tokenizer_error;
    EXPECT_EQ(max_abs_diff(m.score_window(ids), ref), 0.0);
  }
  // -1 (int32) means "none", as in llama.cpp: no error.
  const Model none = Model::load(gguf_copy(d, "none.gguf", q8_656(), {{"tokenizer.ggml.eos_token_id", i32(-1)}}));
  EXPECT_EQ(none.source().tokenizer_error, "");
  // The CLI: the error without --tokenizer, a run with it.
  const fs::path p = gguf_copy(d, "bert.gguf", q8_656(), {{"tokenizer.ggml.model", str("bert")}});
  auto r = run_cli("generate --model " + q(p) + " --prompt 'Once upon' --max-tokens 3");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find("tokenizer.ggml.model bert is not supported"), std::string::npos) << r.err;
  r = run_cli("generate --model " + q(p) + " --tokenizer " + q(hf656()) + " --prompt 'Once upon' --max-tokens 3");
  EXPECT_EQ(r.exit_code, 0) << r.err;
}

// K-quants parse, and the model loader refuses them naming tensor and type:
// the tiny model with feed_forward_length 256, its down projection q4_K
// (blocks of 256 along the row).
TEST(GgufModelBadInput, KQuantWeightsAreRefusedByName) {
  TempDir d;
  const std::string bytes = test::tiny::gguf_writer({}).serialize();
  const GgufFile f = GgufFile::parse(std::as_bytes(std::span(bytes.data(), bytes.size())), "tiny");
  GgufWriter w;
  for (const auto& [key, v] : f.metadata())
    if (key != "llama.feed_forward_length") w.add_value(key, v);
  w.add_uint32("llama.feed_forward_length", 256);
  for (const auto& t : f.tensors()) {
    if (t.name.find("ffn_") != std::string::npos && t.name.find("norm") == std::string::npos) continue;
    const auto b = f.tensor_data(t);
    w.add_tensor(t.name, t.ne, t.type, std::vector<std::byte>(b.begin(), b.end()));
  }
  const auto gate = test::tiny::values(32 * 256, 0.3f, 5);
  w.add_tensor("blk.0.ffn_gate.weight", {32, 256}, GgmlType::f32, ggml_quantize(GgmlType::f32, gate));
  w.add_tensor("blk.0.ffn_up.weight", {32, 256}, GgmlType::f32, ggml_quantize(GgmlType::f32, gate));
  w.add_tensor("blk.0.ffn_down.weight", {256, 32}, GgmlType::q4_K, std::vector<std::byte>(32 * 144));
  const fs::path p = d.path() / "k.gguf";
  w.write(p);
  expect_refused(p, {"k.gguf", "tensor blk.0.ffn_down.weight", "q4_K", "not supported"});
}

// Weights that are not finite are refused naming the tensor (llama2.c and
// posenc checkpoints always were; GGUF and Hugging Face files ran into NaN
// logits): float32 elements, F16 elements, Q8_0 block scales, norm vectors.
TEST(ModelBadInput, NonFiniteWeightsAreRefusedByName) {
  TempDir d;
  Tensors t = real_tensors();
  t.at("model.layers.1.mlp.up_proj.weight").data[5 * 128 + 7] = std::nanf("");
  expect_refused(hf_dir(d, "nan", real_config(), &t),
                 {"model.safetensors", "tensor model.layers.1.mlp.up_proj.weight", "[5, 7]", "not finite"});
  t = real_tensors();
  t.at("model.norm.weight").data[3] = INFINITY;
  expect_refused(hf_dir(d, "inf_norm", real_config(), &t), {"model.norm.weight[3]", "inf"});

  auto tiny_with = [&](const std::string& name, GgmlType type, const std::function<void(std::vector<std::byte>&)>& edit) {
    const std::string bytes = test::tiny::gguf_writer({}, type).serialize();
    const GgufFile f = GgufFile::parse(std::as_bytes(std::span(bytes.data(), bytes.size())), "tiny");
    GgufWriter w;
    for (const auto& [key, v] : f.metadata()) w.add_value(key, v);
    for (const auto& x : f.tensors()) {
      const auto b = f.tensor_data(x);
      std::vector<std::byte> data(b.begin(), b.end());
      if (x.name == "blk.0.attn_v.weight") edit(data);
      w.add_tensor(x.name, x.ne, x.type, std::move(data));
    }
    const fs::path p = d.path() / name;
    w.write(p);
    return p;
  };
  const uint16_t f16_inf = 0x7c00;
  expect_refused(tiny_with("q8.gguf", GgmlType::q8_0, [&](auto& b) { std::memcpy(b.data() + 34, &f16_inf, 2); }),
                 {"q8.gguf", "tensor blk.0.attn_v.weight", "scale of the block at [1, 0]", "inf"});
  expect_refused(tiny_with("f16.gguf", GgmlType::f16, [&](auto& b) { std::memcpy(b.data() + 2 * 33, &f16_inf, 2); }),
                 {"f16.gguf", "tensor blk.0.attn_v.weight", "element [1, 1]", "inf"});
  const float nan = std::nanf("");
  expect_refused(tiny_with("f32.gguf", GgmlType::f32, [&](auto& b) { std::memcpy(b.data(), &nan, 4); }),
                 {"f32.gguf", "tensor blk.0.attn_v.weight", "element [0, 0]", "nan"});
}

// Activations that overflowed float32 reach the Q8_0 activation quantizer
// (found by fuzz/gguf_model_fuzz.cpp: "-nan is outside the range of
// representable values of type 'signed char'" under UBSan): the block's
// scale carries the NaN/inf, its quants are 0, finite blocks are unchanged.
TEST(ModelBadInput, Q8ActivationQuantizerCarriesNonFiniteValuesInTheScale) {
  std::vector<float> x(96);
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(i % 13) - 6.0f;
  std::vector<std::byte> ref(3 * detail::kQ8Bytes), got(3 * detail::kQ8Bytes);
  detail::quantize_rows_q8_0(x.data(), 1, 96, ref.data());
  x[40] = std::nanf("");
  x[70] = INFINITY;
  detail::quantize_rows_q8_0(x.data(), 1, 96, got.data());
  EXPECT_TRUE(std::equal(ref.begin(), ref.begin() + detail::kQ8Bytes, got.begin()));  // block 0: finite
  for (int b : {1, 2}) {
    uint16_t h;
    std::memcpy(&h, got.data() + b * detail::kQ8Bytes, 2);
    const float d = f16_to_f32(h);
    EXPECT_TRUE(b == 1 ? std::isnan(d) : std::isinf(d)) << b << ": scale " << d;
  }
  EXPECT_EQ(static_cast<int8_t>(got[detail::kQ8Bytes + 2 + 8]), 0);       // the NaN
  EXPECT_EQ(static_cast<int8_t>(got[2 * detail::kQ8Bytes + 2 + 6]), 0);   // the inf
}

// general.alignment 1 puts float32 tensors at odd addresses: the loader
// copies what it would read in place (UBSan: misaligned load otherwise).
TEST(GgufModelBadInput, UnalignedFloat32TensorsLoad) {
  TempDir d;
  const fs::path ref_path = d.path() / "ref.gguf";
  test::tiny::gguf_writer({.untied = true}).write(ref_path);
  const auto ids = some_tokens(8, test::tiny::kVocab);
  const auto ref = Model::load(ref_path).score_window(ids);
  for (uint32_t al : {1u, 2u}) {
    GgufWriter w;
    w.add_uint32("general.alignment", al);
    w.add_string("general.name", std::string(al == 1 ? 3 : 1, 'x'));  // shifts the data section off 4
    const std::string bytes = test::tiny::gguf_writer({.untied = true}).serialize();
    const GgufFile f = GgufFile::parse(std::as_bytes(std::span(bytes.data(), bytes.size())), "tiny");
    for (const auto& [key, v] : f.metadata())
      if (key != "general.name") w.add_value(key, v);
    for (const auto& x : f.tensors()) {
      const auto b = f.tensor_data(x);
      w.add_tensor(x.name, x.ne, x.type, std::vector<std::byte>(b.begin(), b.end()));
    }
    const fs::path p = d.path() / fmt::format("al{}.gguf", al);
    w.write(p);
    const GgufFile g = GgufFile::open(p);
    EXPECT_NE((reinterpret_cast<uintptr_t>(g.tensor_data(g.tensors()[0]).data())) % 4, 0u) << al;
    EXPECT_EQ(max_abs_diff(Model::load(p).score_window(ids), ref), 0.0) << al;
  }
}

// The tiny generated models: the GGUF (q/k permuted to interleaved) and the
// Hugging Face directory (rotate_half) are the same model.
TEST(TinyModels, GgufAndHfDirectoryGiveTheSameLogits) {
  TempDir d;
  for (const test::tiny::Parts p : {test::tiny::Parts{}, test::tiny::Parts{.qkv_bias = true, .o_bias = true},
                                    test::tiny::Parts{.untied = true}}) {
    const fs::path g = d.path() / "m.gguf", h = d.path() / "hf";
    test::tiny::gguf_writer(p).write(g);
    fs::remove_all(h);
    fs::create_directories(h);
    write_file_atomic(h / "config.json", test::tiny::hf_config(p).dump());
    write_file_atomic(h / "model.safetensors", test::tiny::safetensors_bytes(test::tiny::hf_tensors(p)));
    const Model a = Model::load(g), b = Model::load(h);
    EXPECT_EQ(a.rope().layout, RopeLayout::interleaved);
    EXPECT_EQ(b.rope().layout, RopeLayout::half);
    const auto ids = some_tokens(10, test::tiny::kVocab);
    const auto la = a.score_window(ids), lb = b.score_window(ids);
    EXPECT_LT(max_abs_diff(la, lb), 1e-5);
    EXPECT_GT(max_abs_diff(la, std::vector<float>(la.size(), 0.0f)), 0.1);
    ASSERT_TRUE(a.bundled_tokenizer().has_value());
    EXPECT_TRUE(a.bundled_tokenizer()->usable()) << a.bundled_tokenizer()->unusable_reason();
  }
}

// fuzz/corpus/gguf_model/ holds exactly gguf_model_seeds(), each loading and
// running; POSENC_WRITE_FUZZ_CORPUS=1 rewrites the directory.
TEST(GgufModelFuzzCorpus, SeedsAreCurrent) {
  const auto dir = fs::path(POSENC_SOURCE_DIR) / "fuzz/corpus/gguf_model";
  const auto seeds = test::tiny::gguf_model_seeds();
  if (const char* e = std::getenv("POSENC_WRITE_FUZZ_CORPUS"); e != nullptr && std::string(e) == "1") {
    fs::create_directories(dir);
    for (const auto& [name, bytes] : seeds) write_file_atomic(dir / name, bytes);
  }
  std::size_t on_disk = 0;
  for (const auto& entry : fs::directory_iterator(dir)) on_disk += entry.is_regular_file();
  EXPECT_EQ(on_disk, seeds.size());
  for (const auto& [name, bytes] : seeds) {
    SCOPED_TRACE(name);
    ASSERT_TRUE(fs::exists(dir / name)) << "run with POSENC_WRITE_FUZZ_CORPUS=1 to write the corpus";
    EXPECT_TRUE(slurp(dir / name) == bytes) << "stale seed; POSENC_WRITE_FUZZ_CORPUS=1 rewrites it";
    for (auto mode : {QuantizedMatmul::dequantize, QuantizedMatmul::q8_activations}) {
      const Model m = Model::load(dir / name, LoadOptions{mode});
      const auto logits = m.score_window(std::vector<int32_t>{1, 5, 9});
      ASSERT_EQ(logits.size(), 3u * test::tiny::kVocab);
      for (float x : logits) ASSERT_TRUE(std::isfinite(x));
    }
  }
}

// fuzz/corpus/hf_config/ holds exactly hf_config_seeds(); each loads and runs
// in the fixed directory of fuzz/hf_config_fuzz.cpp it was made for (the
// first four in theirs, the others in the plain one); the regression_* seeds
// (hostile sizes) are refused by name.
TEST(HfConfigFuzzCorpus, SeedsAreCurrent) {
  const auto dir = fs::path(POSENC_SOURCE_DIR) / "fuzz/corpus/hf_config";
  const auto seeds = test::tiny::hf_config_seeds();
  if (const char* e = std::getenv("POSENC_WRITE_FUZZ_CORPUS"); e != nullptr && std::string(e) == "1") {
    fs::create_directories(dir);
    for (const auto& [name, bytes] : seeds) write_file_atomic(dir / name, bytes);
  }
  std::size_t on_disk = 0;
  for (const auto& entry : fs::directory_iterator(dir)) on_disk += entry.is_regular_file();
  EXPECT_EQ(on_disk, seeds.size());
  const auto parts = test::tiny::hf_fuzz_parts();
  TempDir d;
  for (std::size_t i = 0; i < seeds.size(); ++i) {
    const auto& [name, bytes] = seeds[i];
    SCOPED_TRACE(name);
    ASSERT_TRUE(fs::exists(dir / name)) << "run with POSENC_WRITE_FUZZ_CORPUS=1 to write the corpus";
    EXPECT_TRUE(slurp(dir / name) == bytes) << "stale seed; POSENC_WRITE_FUZZ_CORPUS=1 rewrites it";
    const fs::path h = d.path() / name;
    fs::create_directories(h);
    write_file_atomic(h / "config.json", bytes);
    write_file_atomic(h / "model.safetensors",
                      test::tiny::safetensors_bytes(test::tiny::hf_tensors(parts[i < parts.size() ? i : 0])));
    if (name.starts_with("regression_")) {
      // Hostile sizes (issue 13): a ConfigError naming the bounded field, before any allocation.
      try {
        Model::load(h);
        ADD_FAILURE() << "loaded";
      } catch (const ConfigError& e) {
        EXPECT_NE(std::string(e.what()).find("must be an integer in [1, "), std::string::npos) << e.what();
      }
      continue;
    }
    const Model m = Model::load(h);
    const auto logits = m.score_window(std::vector<int32_t>{1, 5, 9, 13, 17, 21});
    ASSERT_EQ(logits.size(), 6u * test::tiny::kVocab);
    for (float x : logits) ASSERT_TRUE(std::isfinite(x));
  }
}

// ---- check-cache, convert ---------------------------------------------------

// check-cache's scenario sizes follow the length (from 16 up) and read 3 x
// length tokens: the fixed sizes of before threw std::length_error
// ("vector::_M_range_insert") below 80, and texts shorter than the forks read
// ran past the stream.
TEST(ConsistencyBadInput, LengthAndTextSizeAreCheckedUpFront) {
  const Model m = Model::load(hf656());
  const auto stream = some_tokens(437, 2048);
  ConsistencyOptions o;
  o.length = 15;
  try {
    (void)check_cache_consistency(m, stream, o);
    ADD_FAILURE() << "length 15 accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("length"), std::string::npos) << e.what();
  }
  o.length = 146;  // 3 * 146 = 438 > 437 tokens
  try {
    (void)check_cache_consistency(m, stream, o);
    ADD_FAILURE() << "437 tokens accepted for length 146";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("438"), std::string::npos) << e.what();
  }
  o.length = 64;
  o.chunk_sizes = {1, 7};
  EXPECT_TRUE(check_cache_consistency(m, some_tokens(192, 2048), o).passed);
  const auto r = run_cli("check-cache --model " + q(hf656()) + " --text " + q(test::text_path()) + " --length 15");
  EXPECT_EQ(r.exit_code, 2);  // a flag value out of range: usage error, refused while parsing
  EXPECT_NE(r.err.find("--length: must be an integer in [16, 1048576] (got '15')"), std::string::npos) << r.err;
}

// convert used the file's layout whatever --rope-layout said (while honouring
// --rope-theta), wrote trained contexts past 2^32 truncated, and wrote symbol
// vocabularies as SentencePiece ones that split text into other ids.
TEST(ConvertBadInput, TheFileComputesWhatTheLoadedModelComputes) {
  TempDir d;
  Model m = Model::load(hf656());
  const Tokenizer tok = *m.bundled_tokenizer();
  RopeSetup r = m.rope();
  r.layout = RopeLayout::interleaved;  // --rope-layout interleaved
  m.set_rope(r);
  const fs::path out = d.path() / "lay.gguf";
  (void)write_model_gguf(m, tok, out, {});
  const auto ids = some_tokens(30, 2048);
  EXPECT_LT(max_abs_diff(Model::load(out).score_window(ids), m.score_window(ids)), 1e-4);
  EXPECT_GT(max_abs_diff(Model::load(hf656()).score_window(ids), m.score_window(ids)), 1e-2);

  m = Model::load(hf656());
  m.set_trained_context(int64_t{5000000000}, "test");
  try {
    (void)write_model_gguf(m, tok, d.path() / "tc.gguf", {});
    ADD_FAILURE() << "trained context 5e9 written";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("5000000000"), std::string::npos) << e.what();
  }
  EXPECT_FALSE(fs::exists(d.path() / "tc.gguf"));

  const auto sym = fs::path(POSENC_SOURCE_DIR) / "fuzz/corpus/posenc_checkpoint/rope_unshared_symbols.posenc";
  const Model s = Model::load(sym);
  ASSERT_TRUE(s.bundled_tokenizer() && s.bundled_tokenizer()->is_symbolic());
  EXPECT_THROW((void)write_model_gguf(s, *s.bundled_tokenizer(), d.path() / "sym.gguf", {}), InvalidArgument);
  const auto cli = run_cli("convert --model " + q(sym) + " --out " + q(d.path() / "sym.gguf"));
  EXPECT_EQ(cli.exit_code, 1);
  EXPECT_NE(cli.err.find("symbol vocabulary"), std::string::npos) << cli.err;
}

// ---- CLI --------------------------------------------------------------------

TEST(CliBadInput, UsageErrorsOfTokenizeAndDetectLayout) {
  const std::string prompt = " --prompt 'Once'";
  for (const auto& [args, needle] :
       {std::pair{"tokenize" + prompt, std::string("At least 1 option from [--model,--tokenizer] is required")},
        std::pair{"tokenize --model " + q(hf656()),
                  std::string("Exactly 1 option from [--text,--prompt-file,--prompt] is required")}}) {
    const auto r = run_cli(args);
    EXPECT_EQ(r.exit_code, 2) << args << ": " << r.err;
    EXPECT_NE(r.err.find(needle), std::string::npos) << r.err;
  }
  const auto r = run_cli("detect-layout --model " + q(hf656()) + " --text " + q(test::text_path()) + " --context -1");
  EXPECT_EQ(r.exit_code, 2);  // out of range: a usage error, like a malformed value
  EXPECT_NE(r.err.find("--context"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("-1"), std::string::npos) << r.err;
}

// --config: a bare rope_parameters-style object with its own rope_theta was
// always refused ("disagrees with top-level rope_theta", a key the wrapper
// itself added); a config.json's sliding window was silently not applied.
TEST(OverridesBadInput, ConfigRopeThetaAndSlidingWindow) {
  TempDir d;
  const auto ids = some_tokens(30, 2048);
  Model a = Model::load(hf656()), b = Model::load(hf656());
  PositionalOverrides with_theta;
  with_theta.config = d.file("lin_theta.json", R"({"rope_type": "linear", "factor": 4, "rope_theta": 500})");
  (void)apply_positional_overrides(a, with_theta);
  PositionalOverrides separate;
  separate.config = d.file("lin.json", R"({"rope_type": "linear", "factor": 4})");
  separate.rope_theta = 500.0;
  (void)apply_positional_overrides(b, separate);
  EXPECT_EQ(a.rope().params.rope_theta, 500.0);
  EXPECT_EQ(a.rope().params.rope_type, "linear");
  EXPECT_EQ(max_abs_diff(a.score_window(ids), b.score_window(ids)), 0.0);

  json c = real_config();
  c["architectures"] = {"MistralForCausalLM"};
  c["model_type"] = "mistral";
  c["sliding_window"] = 8;
  PositionalOverrides o;
  o.config = d.file("mistral.json", c.dump());
  Model m = Model::load(hf656());
  try {
    (void)apply_positional_overrides(m, o);
    ADD_FAILURE() << "a sliding window of 8 was ignored";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("sliding window 8"), std::string::npos) << e.what();
  }
  // The model's own config.json (same window) is fine.
  Model mistral = Model::load(hf_dir(d, "mistral_dir", c));
  EXPECT_NO_THROW((void)apply_positional_overrides(mistral, o));
  EXPECT_EQ(mistral.sliding_window(), 8);
}

// Model options given an empty value were taken as absent (--tokenizer ''
// fell back to the bundled tokenizer, --rope-theta '' ran unchanged), and
// --trained-context 99999999999999999999 ran as INT64_MAX: usage errors now.
TEST(CliBadInput, EmptyAndOutOfRangeModelOptionsAreUsageErrors) {
  const std::string base = "ppl --model " + q(hf656()) + " --text " + q(test::text_path()) + " --context 32 --quiet";
  for (const std::string& opt : std::vector<std::string>{"--tokenizer ''", "--rope-theta ''", "--rope-layout ''",
                                                        "--trained-context ''", "--trained-context 99999999999999999999",
                                                        "--trained-context 0", "--trained-context -5"}) {
    const auto r = run_cli(base + " --scored-tokens 64 " + opt);
    EXPECT_EQ(r.exit_code, 2) << opt << ": " << r.err;
    EXPECT_NE(r.err.find(opt.substr(0, opt.find(' '))), std::string::npos) << r.err;
  }
  const auto ok = run_cli(base + " --scored-tokens 64 --trained-context 4294967296");
  EXPECT_EQ(ok.exit_code, 0) << ok.err;
}

// A file of a Hugging Face directory given as the model was read as a
// llama2.c header ("header field dim must be in [1, 65536] (got 538970747)").
TEST(HfBadInput, FilesOfADirectoryAreNotModels) {
  expect_refused(hf656() / "config.json", {"config.json: a JSON file, not a model", hf656().string()});
  expect_refused(hf656() / "tokenizer.json", {"a JSON file, not a model"});
  expect_refused(hf656() / "model.safetensors", {"model.safetensors: a safetensors file, not a model"});
  EXPECT_EQ(load_error(test::model_path()), "");  // a llama2.c checkpoint is still one
}

// generate on a model whose config.json scales RoPE dynamically stopped with
// a CacheError ("refusing to mix them (enable re-rotation ...)", no flag
// could) once the text passed the original context. Then the cache was
// re-rotated (near the full forward, not equal: layers >= 1 kept hidden states
// of the old frequencies); now the default policy recompute re-prefills the
// sequence, so the last token's log-probability is the full forward's.
TEST(CliBadInput, GenerateWithLengthDependentRopePassesTheTrainedContext) {
  TempDir d;
  json c = real_config();
  c["rope_scaling"] = {{"rope_type", "dynamic"}, {"factor", 4.0}};
  const fs::path dir = hf_dir(d, "dynamic", c);
  const fs::path out = d.path() / "g.json";
  const auto r = run_cli("generate --model " + q(dir) + " --prompt 'Once upon a time' --max-tokens 540 --ignore-eos --json " +
                         q(out));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const json j = json::parse(slurp(out));
  EXPECT_EQ(j["rope_change_policy"], "recompute");
  std::vector<int32_t> ids = j["prompt_ids"].get<std::vector<int32_t>>();
  const auto gen = j["generated_ids"].get<std::vector<int32_t>>();
  ASSERT_EQ(gen.size(), 540u);
  const std::size_t prompt = ids.size();
  ids.insert(ids.end(), gen.begin(), gen.end());
  ASSERT_GT(ids.size(), 512u);
  auto logprob = [&](const Model& m, std::size_t n) {  // of ids[n] after ids[0..n)
    const auto logits = m.score_window(std::span(ids).first(n));
    const std::size_t V = 2048, row = n - 1;
    double mx = -1e300, z = 0;
    for (std::size_t v = 0; v < V; ++v) mx = std::max(mx, static_cast<double>(logits[row * V + v]));
    for (std::size_t v = 0; v < V; ++v) z += std::exp(logits[row * V + v] - mx);
    return logits[row * V + static_cast<std::size_t>(ids[n])] - mx - std::log(z);
  };
  const Model m = Model::load(dir);
  const auto& lp = j["generated_logprobs"];
  EXPECT_NEAR(lp.front().get<double>(), logprob(m, prompt), 1e-5);  // within the trained context: one forward
  Model frozen = m;
  RopeSetup rs = frozen.rope();
  rs.update_with_length = false;
  frozen.set_rope(rs);
  const std::size_t n = ids.size() - 1;
  const double got = lp.back().get<double>(), full = logprob(m, n), stale = logprob(frozen, n);
  EXPECT_NEAR(got, full, 1e-4) << stale;
  EXPECT_GT(std::fabs(got - stale), 1e-3);  // frozen frequencies would not give it
}

}  // namespace POSENC_UNITY_ID
