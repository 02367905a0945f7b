// Issue 16, section 3: the configs real models ship. Each case names the
// reference implementation whose behaviour it checks and says what main gave.
// Configs: /work/shared/configs* and tests/config/data/ (SOURCES.md there).
#include <cmath>
#include <filesystem>
#include <numbers>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "config/test_util.hpp"
#include "posenc/analysis.hpp"
#include "posenc/bias.hpp"
#include "posenc/config.hpp"
#include "posenc/error.hpp"
#include "posenc/rope.hpp"
#include "posenc/scaling.hpp"

namespace POSENC_UNITY_ID {  // this file's own namespace in the tests' unity build (CMakeLists.txt)

using namespace posenc;
using posenc::test::run_cli;
using posenc::test::ScratchDir;
using posenc::test::slurp;

namespace {

std::filesystem::path data(std::string_view name) {
  return std::filesystem::path(POSENC_SOURCE_DIR) / "tests" / "config" / "data" / name;
}
std::filesystem::path extra(std::string_view name) {
  return std::filesystem::path(POSENC_SHARED_DIR) / "configs-extra" / name;
}
PositionalSpec parse_text(std::string_view text) { return parse_positional_spec(text, "inline.json"); }

bool has_note(const PositionalSpec& s, std::string_view part) {
  for (const auto& n : s.notes)
    if (n.find(part) != std::string::npos) return true;
  return false;
}

bool ignored(const PositionalSpec& s, std::string_view key) {
  for (const auto& k : s.ignored_keys)
    if (k == key) return true;
  return false;
}

std::string error_of(std::string_view text) {
  try {
    (void)parse_text(text);
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "";
}

/// The rope_init.json case `name` of the Hugging Face golden vectors.
nlohmann::json golden(std::string_view file, std::string_view name) {
  const auto doc = nlohmann::json::parse(
      slurp(std::filesystem::path(POSENC_SHARED_DIR) / "testdata" / "hf_reference" / file));
  for (const auto& c : doc.at("cases"))
    if (c.at("name") == name) return c;
  ADD_FAILURE() << "golden case " << name << " not found in " << file;
  return {};
}

/// ChatGLM's RotaryEmbedding (modeling_chatglm.py): theta_i = 1 / base^(2i / n_elem)
/// with n_elem = kv_channels // 2 and base = 10000 * rope_ratio, computed here in
/// double from that formula (not through posenc's RoPE code).
std::vector<double> chatglm_theta(int kv_channels, double rope_ratio) {
  const int n_elem = kv_channels / 2;
  const double base = 10000.0 * rope_ratio;
  std::vector<double> t;
  for (int i = 0; i < n_elem; i += 2) t.push_back(1.0 / std::pow(base, static_cast<double>(i) / n_elem));
  return t;
}

}  // namespace

// ---------------------------------------------------------------------------
// Nested text_config.

// main: "model_type: unknown architecture (architectures[0] 'MllamaForConditionalGeneration') and no
// positional field" — the decoder's keys sit under text_config.
TEST(ConfigTextConfig, MllamaReadsItsTextConfig) {
  const PositionalSpec s = load_positional_spec(data("llama-3.2-90b-vision-instruct.json"));
  EXPECT_EQ(s.family, PositionFamily::rope);
  EXPECT_EQ(s.model_type, "mllama");
  ASSERT_TRUE(s.rope);
  EXPECT_EQ(s.rope->rope_type, "llama3");
  EXPECT_EQ(s.rope->rope_theta, 500000.0);
  EXPECT_EQ(s.rope->head_dim, 128);  // 8192 / 64
  EXPECT_EQ(s.num_attention_heads, 64);
  EXPECT_EQ(s.num_key_value_heads, 8);
  EXPECT_EQ(s.num_hidden_layers, 100);
  EXPECT_EQ(s.max_position_embeddings, 131072);
  EXPECT_EQ(s.layout, RopeLayout::half);  // MllamaTextSelfAttention: Llama's rotate_half
  EXPECT_TRUE(has_note(s, "read from text_config")) << "provenance of the keys";
  // Reference: HF _compute_llama3_parameters for the same (theta, factor, low, high, orig, d)
  // = the golden case llama3_f8_lo1_hi4_orig8192_d128 (transformers 5.16.0.dev0).
  const auto g = golden("rope_init.json", "llama3_f8_lo1_hi4_orig8192_d128");
  const RopeFrequencies f = compute_rope_frequencies(*s.rope);
  const auto& inv = g.at("outputs").at("inv_freq");
  ASSERT_EQ(f.inv_freq.size(), inv.size());
  for (std::size_t i = 0; i < inv.size(); ++i)
    EXPECT_NEAR(f.inv_freq[i], inv[i].get<double>(), 1e-6 * inv[i].get<double>()) << i;
}

// main: rope_type "default" — rope_scaling under text_config was silently dropped.
TEST(ConfigTextConfig, LlamaRopeScalingUnderTextConfigIsNotPlainRope) {
  const PositionalSpec s = parse_text(R"({"model_type": "llama", "num_attention_heads": 4, "hidden_size": 256,
      "text_config": {"rope_scaling": {"rope_type": "linear", "factor": 4.0}, "rope_theta": 500000.0}})");
  ASSERT_TRUE(s.rope);
  EXPECT_EQ(s.rope->rope_type, "linear");
  EXPECT_EQ(s.rope->factor, 4.0);
  EXPECT_EQ(s.rope->rope_theta, 500000.0);
  // text_config wins where both have a key, as in HF's composite configs (MllamaForConditionalGeneration,
  // Qwen2_5_VLModel build the decoder from config.text_config), and a note says they differ.
  const PositionalSpec both = parse_text(R"({"model_type": "llama", "num_attention_heads": 4, "hidden_size": 256,
      "rope_theta": 10000.0, "text_config": {"rope_theta": 500000.0}})");
  EXPECT_EQ(both.rope->rope_theta, 500000.0);
  EXPECT_TRUE(has_note(both, "differ"));
  EXPECT_NE(error_of(R"({"model_type": "llama", "num_attention_heads": 4, "hidden_size": 256,
      "text_config": [1]})")
                .find("text_config: must be an object or null"),
            std::string::npos);
}

// main: "num_attention_heads: required field missing" (the Llama row matched by prefix, the
// keys under text_config unread). Llama-4 ships low_freq_factor == high_freq_factor == 1.
TEST(ConfigTextConfig, Llama4ScoutInterleavedWithLlama3Step) {
  const PositionalSpec s = load_positional_spec(data("llama-4-scout-17b-16e-instruct.json"));
  ASSERT_TRUE(s.rope);
  EXPECT_EQ(s.rope->rope_type, "llama3");
  EXPECT_EQ(s.rope->head_dim, 128);
  EXPECT_EQ(s.num_attention_heads, 40);
  EXPECT_EQ(s.num_key_value_heads, 8);
  // HF modeling_llama4.apply_rotary_emb: view_as_complex(x.reshape(..., -1, 2)) → pairs (2i, 2i+1).
  EXPECT_EQ(s.layout, RopeLayout::interleaved);
  EXPECT_TRUE(has_note(s, "NoPE"));
  // HF _compute_llama3_parameters with low == high: wavelen > orig/low → inv/factor, else inv
  // (the smooth band is empty), from the float32 default frequencies.
  const RopeFrequencies f = compute_rope_frequencies(*s.rope);
  const RopeFrequencies d = default_rope_frequencies(128, 128, 500000.0);
  ASSERT_EQ(f.inv_freq.size(), 64u);
  int scaled = 0;
  for (std::size_t i = 0; i < 64; ++i) {
    const double wavelen = 2 * std::numbers::pi / d.inv_freq[i];
    const float want = wavelen > 8192.0 ? d.inv_freq[i] / 16.0f : d.inv_freq[i];
    scaled += wavelen > 8192.0 ? 1 : 0;
    EXPECT_FLOAT_EQ(f.inv_freq[i], want) << i;
  }
  EXPECT_GT(scaled, 0);
  EXPECT_LT(scaled, 64);
}

// main: unknown architecture 'Gemma3ForConditionalGeneration'. Built config (SOURCES.md).
TEST(ConfigTextConfig, Gemma3GlobalRopeAndSlidingPattern) {
  const PositionalSpec s = load_positional_spec(data("gemma-3-4b-it.minimal.json"));
  ASSERT_TRUE(s.rope);
  EXPECT_EQ(s.rope->rope_type, "linear");
  EXPECT_EQ(s.rope->factor, 8.0);
  EXPECT_EQ(s.rope->rope_theta, 1000000.0);
  EXPECT_EQ(s.rope->head_dim, 256);
  EXPECT_EQ(s.layout, RopeLayout::half);
  // Gemma3TextConfig: every sliding_window_pattern-th layer (6) is global.
  ASSERT_EQ(s.sliding_window.layer_is_sliding.size(), 34u);
  for (int i = 0; i < 34; ++i) EXPECT_EQ(s.sliding_window.layer_is_sliding[i], (i + 1) % 6 != 0) << i;
  // The local layers' theta is not this spec's: said, not dropped.
  EXPECT_TRUE(ignored(s, "text_config.rope_local_base_freq"));
}

// Qwen2.5-VL as transformers >= 4.53 saves it (a fine-tune re-saved by 4.55.2): the
// top level keeps the keys, text_config repeats them. And the newer layout where only
// text_config has them (Qwen2_5_VLConfig builds the text model from text_config).
// main: the stripped form errored "num_attention_heads: required field missing".
TEST(ConfigTextConfig, Qwen25VlNewerLayout) {
  const PositionalSpec s = load_positional_spec(data("olmocr-2-7b-1025.json"));
  EXPECT_EQ(s.family, PositionFamily::mrope);
  EXPECT_EQ(s.mrope_section, (std::vector<int>{16, 24, 24}));
  EXPECT_EQ(s.rope->rope_type, "default");  // {"rope_type": "default", "type": "default"}
  EXPECT_EQ(s.rope->head_dim, 128);
  EXPECT_FALSE(s.sliding_window.active);

  auto cfg = nlohmann::json::parse(slurp(data("olmocr-2-7b-1025.json")));
  for (const char* k : {"rope_scaling", "rope_theta", "num_attention_heads", "hidden_size", "num_key_value_heads",
                        "max_position_embeddings", "sliding_window", "use_sliding_window", "num_hidden_layers"})
    cfg.erase(k);
  const PositionalSpec t = parse_text(cfg.dump());
  EXPECT_EQ(t.family, PositionFamily::mrope);
  EXPECT_EQ(t.mrope_section, (std::vector<int>{16, 24, 24}));
  EXPECT_EQ(t.rope->rope_theta, 1000000.0);
  EXPECT_EQ(t.num_key_value_heads, 4);
  EXPECT_EQ(t.sliding_window.source, "layer_types");
  EXPECT_EQ(t.sliding_window.layer_is_sliding, std::vector<bool>(28, false));
}

// ---------------------------------------------------------------------------
// GLM / ChatGLM: rotary on half of each head, interleaved pairs.

// main: "unknown architecture (architectures[0] 'ChatGLMModel') and no positional field".
TEST(ConfigGlm, ChatGlm3RotatesHalfTheHeadInterleaved) {
  const PositionalSpec s = load_positional_spec(data("chatglm3-6b-ipex.json"));
  ASSERT_TRUE(s.rope);
  EXPECT_EQ(s.rope->head_dim, 128);    // kv_channels
  EXPECT_EQ(s.rope->rotary_dim, 64);   // RotaryEmbedding(rotary_dim // 2)
  EXPECT_EQ(s.layout, RopeLayout::interleaved);  // x.reshape(..., rot_dim // 2, 2)
  EXPECT_EQ(s.rope->rope_theta, 10000.0);
  EXPECT_EQ(s.num_key_value_heads, 2);  // multi_query_group_num
  EXPECT_EQ(s.max_position_embeddings, 8192);  // seq_length
  const RopeFrequencies f = compute_rope_frequencies(*s.rope);
  const auto want = chatglm_theta(128, 1.0);
  ASSERT_EQ(f.inv_freq.size(), want.size());
  for (std::size_t i = 0; i < want.size(); ++i) EXPECT_NEAR(f.inv_freq[i], want[i], 1e-6 * want[i]) << i;
}

// GLM-4-9B-chat (remote code, model_type chatglm) ships rope_ratio 500: base 5e6.
TEST(ConfigGlm, ChatGlmRopeRatioScalesTheBase) {
  auto cfg = nlohmann::json::parse(slurp(data("chatglm3-6b-ipex.json")));
  cfg["rope_ratio"] = 500;
  cfg["rope_theta"] = 123.0;  // not read by modeling_chatglm: reported, not used
  const PositionalSpec s = parse_text(cfg.dump());
  EXPECT_EQ(s.rope->rope_theta, 5000000.0);
  EXPECT_TRUE(ignored(s, "rope_theta"));
  const RopeFrequencies f = compute_rope_frequencies(*s.rope);
  const auto want = chatglm_theta(128, 500.0);
  ASSERT_EQ(f.inv_freq.size(), want.size());
  for (std::size_t i = 0; i < want.size(); ++i) EXPECT_NEAR(f.inv_freq[i], want[i], 1e-6 * want[i]) << i;
}

// main: rotary_dim 128, layout "unknown", exit 0 for a GLM config with rope_theta and no
// partial_rotary_factor (GlmConfig's default is 0.5); with the factor, 64 but layout unknown.
TEST(ConfigGlm, HfGlmAndGlm4HalfRotaryInterleaved) {
  const PositionalSpec s = load_positional_spec(data("glm-4-9b-chat-hf.minimal.json"));
  EXPECT_EQ(s.rope->rotary_dim, 64);
  EXPECT_EQ(s.layout, RopeLayout::interleaved);  // modeling_glm.rotate_half: x[..., 0::2], x[..., 1::2]
  for (const char* mt : {"glm", "glm4"}) {
    SCOPED_TRACE(mt);
    const PositionalSpec d = parse_text(fmt::format(R"({{"model_type": "{}", "num_attention_heads": 32,
        "hidden_size": 4096, "head_dim": 128, "rope_theta": 10000.0}})",
                                                    mt));
    EXPECT_EQ(d.rope->rotary_dim, 64);  // GlmConfig(partial_rotary_factor=0.5)
    EXPECT_EQ(d.layout, RopeLayout::interleaved);
    // GlmRotaryEmbedding(dim = head_dim * 0.5): theta^(-2i/64) for i < 32.
    const RopeFrequencies f = compute_rope_frequencies(*d.rope);
    ASSERT_EQ(f.inv_freq.size(), 32u);
    for (std::size_t i = 0; i < 32; ++i)
      EXPECT_NEAR(f.inv_freq[i], std::pow(10000.0, -2.0 * i / 64), 1e-6) << i;
  }
}

// ---------------------------------------------------------------------------
// Aliases where Hugging Face's config classes accept them.

// main: "unknown RoPE scaling 'su'". Phi3Config.convert_rope_params_to_dict maps 'su' and
// 'yarn' to 'longrope' ("For backward compatibility if previous version used su or yarn").
TEST(ConfigAliases, SuIsLongRopeForPhi3Only) {
  auto cfg = nlohmann::json::parse(slurp(std::filesystem::path(POSENC_SHARED_DIR) / "configs" /
                                         "phi-3-mini-128k-instruct.json"));
  const PositionalSpec ref = parse_text(cfg.dump());
  ASSERT_EQ(ref.rope->rope_type, "longrope");
  for (const char* alias : {"su", "yarn"}) {
    SCOPED_TRACE(alias);
    cfg["rope_scaling"]["type"] = alias;
    const PositionalSpec s = parse_text(cfg.dump());
    EXPECT_EQ(s.rope->rope_type, "longrope");
    EXPECT_EQ(s.rope->long_factor, ref.rope->long_factor);
    EXPECT_TRUE(has_note(s, "longrope"));
    const RopeFrequencies a = compute_rope_frequencies(*s.rope, int64_t{131072});
    const RopeFrequencies b = compute_rope_frequencies(*ref.rope, int64_t{131072});
    EXPECT_EQ(a.inv_freq, b.inv_freq);
  }
  // LlamaConfig has no such alias (rope_config_validation: no 'su'; ROPE_INIT_FUNCTIONS KeyError).
  const std::string e = error_of(R"({"model_type": "llama", "num_attention_heads": 4, "hidden_size": 256,
      "rope_scaling": {"type": "su", "short_factor": [1], "long_factor": [1]}})");
  EXPECT_NE(e.find("rope_scaling.type"), std::string::npos) << e;
  EXPECT_NE(e.find("Phi-3"), std::string::npos) << e;
  // yarn stays yarn outside the Phi-3 family.
  const PositionalSpec y = parse_text(R"({"model_type": "llama", "num_attention_heads": 4, "hidden_size": 256,
      "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096}})");
  EXPECT_EQ(y.rope->rope_type, "yarn");
}

// Qwen2VLConfig maps type 'mrope' to default RoPE; no other config class does.
TEST(ConfigAliases, MropeOnlyForTheQwen2VlFamily) {
  const PositionalSpec s = load_positional_spec(std::filesystem::path(POSENC_SHARED_DIR) / "configs" /
                                                "qwen2.5-vl-7b-instruct.json");
  EXPECT_EQ(s.family, PositionFamily::mrope);
  EXPECT_EQ(s.rope->rope_type, "default");
  const std::string e = error_of(R"({"model_type": "llama", "num_attention_heads": 28, "hidden_size": 3584,
      "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]}})");
  EXPECT_NE(e.find("Qwen2-VL"), std::string::npos) << e;
  EXPECT_NE(e.find("rope_scaling.type"), std::string::npos) << e;
  // main: family mrope. LlamaConfig does not read mrope_section: one position row, key reported.
  const PositionalSpec l = parse_text(R"({"model_type": "llama", "num_attention_heads": 28, "hidden_size": 3584,
      "rope_scaling": {"rope_type": "default", "mrope_section": [16, 24, 24]}})");
  EXPECT_EQ(l.family, PositionFamily::rope);
  EXPECT_TRUE(l.mrope_section.empty());
  EXPECT_TRUE(ignored(l, "rope_scaling.mrope_section"));
}

// ChatGLM-6B (v1) shares model_type chatglm with a different (2-D) rotary: refused, not misread.
TEST(ConfigGlm, ChatGlmV1TwoDimensionalPositionsAreRefused) {
  const std::string e = error_of(R"({"model_type": "chatglm", "num_attention_heads": 32, "hidden_size": 4096,
      "position_encoding_2d": true, "max_sequence_length": 2048})");
  EXPECT_NE(e.find("position_encoding_2d"), std::string::npos) << e;
  EXPECT_NE(e.find("v1"), std::string::npos) << e;
}

// ---------------------------------------------------------------------------
// Layouts.

// main: layout "unknown" for both. gpt_oss: modeling_gpt_oss._apply_rotary_emb splits x with
// torch.chunk(x, 2) (halves); phi4mm: modeling_phi4mm / HF phi4_multimodal use Phi-3's rotate_half.
TEST(ConfigLayouts, GptOssAndPhi4mmAreHalf) {
  const PositionalSpec oss = load_positional_spec(extra("gpt-oss-20b.json"));
  EXPECT_EQ(layout_name(oss), "half");
  EXPECT_EQ(oss.rope->rope_type, "yarn");
  EXPECT_EQ(oss.rope->head_dim, 64);
  EXPECT_TRUE(oss.sliding_window.active);
  const PositionalSpec phi = load_positional_spec(extra("phi-4-multimodal-instruct.json"));
  EXPECT_EQ(layout_name(phi), "half");
  EXPECT_EQ(phi.rope->rope_type, "longrope");
  EXPECT_EQ(phi.rope->rotary_dim, 96);  // partial_rotary_factor 0.75 of 128
}

// ---------------------------------------------------------------------------
// Falcon's bfloat16 ALiBi slopes through `posenc inspect`.

// main: inspect printed BLOOM's float32 slopes (0.707106769 for head 8 of 12) where Falcon's
// build_alibi_tensor multiplies with slopes.bfloat16() (0.70703125). Reference: the HF golden
// cases falcon_heads12 / falcon_heads40 (alibi.json, transformers 5.16.0.dev0).
TEST(InspectFalcon, AlibiSlopesAreBfloat16) {
  for (int heads : {12, 40}) {
    SCOPED_TRACE(heads);
    ScratchDir dir;
    const auto p = dir.write("config.json", fmt::format(R"({{"model_type": "falcon", "architectures":
        ["FalconForCausalLM"], "num_attention_heads": {}, "hidden_size": {}, "alibi": true}})",
                                                         heads, heads * 64));
    const auto r = run_cli({"inspect", "--config", p.string(), "--json", "-"});
    ASSERT_EQ(r.exit_code, 0) << r.err;
    const auto j = nlohmann::json::parse(r.out);
    EXPECT_EQ(j.at("slopes_dtype"), "bfloat16");
    const auto g = golden("alibi.json", fmt::format("falcon_heads{}", heads));
    const auto& want = g.at("outputs").at("slopes");
    ASSERT_EQ(j.at("slopes").size(), want.size());
    for (std::size_t h = 0; h < want.size(); ++h)
      EXPECT_EQ(j.at("slopes")[h].get<double>(), want[h].get<double>()) << h;
    int rounded = 0;  // heads whose float32 BLOOM slope is not a bfloat16 value
    const auto f32 = bloom_alibi_slopes(heads);
    for (std::size_t h = 0; h < f32.size(); ++h) rounded += j.at("slopes")[h].get<double>() != f32[h] ? 1 : 0;
    EXPECT_GT(rounded, 0);
    const auto text = run_cli({"inspect", "--config", p.string()});
    EXPECT_NE(text.out.find("rounded to bfloat16"), std::string::npos) << text.out;
  }
  // BLOOM keeps float32 (HF modeling_bloom.build_alibi_tensor).
  const PositionalSpec bloom = load_positional_spec(extra("bloom-560m.json"));
  EXPECT_FALSE(bloom.alibi->bfloat16_slopes);
  EXPECT_EQ(alibi_slopes_for(*bloom.alibi, 16), bloom_alibi_slopes(16));
}

// ---------------------------------------------------------------------------
// Positional keys a family ignores: kept in ignored_keys with a note.

// main: ignored_keys empty, nothing said. GPT2Model reads only wpe (n_positions rows);
// BloomModel builds ALiBi from n_head alone (BloomConfig has no rope_scaling, no offset_alibi).
TEST(ConfigIgnoredKeys, RopeKeysOnLearnedAndAlibiFamilies) {
  auto gpt2 = nlohmann::json::parse(slurp(std::filesystem::path(POSENC_SHARED_DIR) / "configs" / "gpt2-large.json"));
  gpt2["rope_scaling"] = {{"rope_type", "linear"}, {"factor", 4.0}};
  gpt2["rope_theta"] = 500000.0;
  const PositionalSpec g = parse_text(gpt2.dump());
  EXPECT_EQ(g.family, PositionFamily::learned_absolute);
  EXPECT_TRUE(ignored(g, "rope_scaling"));
  EXPECT_TRUE(ignored(g, "rope_theta"));
  EXPECT_TRUE(has_note(g, "rope_scaling ignored"));

  const PositionalSpec b = load_positional_spec(extra("bloom-560m.json"));
  EXPECT_EQ(b.ignored_keys, std::vector<std::string>{"offset_alibi"});
  auto bloom = nlohmann::json::parse(slurp(extra("bloom-560m.json")));
  bloom["rope_scaling"] = {{"type", "dynamic"}, {"factor", 2.0}};
  const PositionalSpec b2 = parse_text(bloom.dump());
  EXPECT_EQ(b2.family, PositionFamily::alibi);
  EXPECT_TRUE(ignored(b2, "rope_scaling"));

  // Falcon with alibi: FalconModel builds no rotary embedding, so rope_theta is unused.
  const PositionalSpec f = parse_text(R"({"model_type": "falcon", "num_attention_heads": 8, "hidden_size": 512,
      "alibi": true, "rope_theta": 20000.0})");
  EXPECT_TRUE(ignored(f, "rope_theta"));
  // T5's n_positions has no table behind it; an alibi flag on Llama is not read by LlamaConfig.
  const PositionalSpec t5 = load_positional_spec(std::filesystem::path(POSENC_SHARED_DIR) / "configs" /
                                                 "flan-t5-base.json");
  EXPECT_TRUE(ignored(t5, "n_positions"));
  const PositionalSpec l = parse_text(R"({"model_type": "llama", "num_attention_heads": 4, "hidden_size": 256,
      "alibi": true})");
  EXPECT_EQ(l.family, PositionFamily::rope);
  EXPECT_TRUE(ignored(l, "alibi"));
  // Keys read by the family are not listed.
  const PositionalSpec llama = load_positional_spec(extra("llama-3.2-1b-instruct.json"));
  EXPECT_FALSE(ignored(llama, "rope_scaling"));
  EXPECT_FALSE(ignored(llama, "rope_theta"));
}

TEST(InspectIgnoredKeys, TextAndJsonListThem) {
  const auto r = run_cli({"inspect", "--config", extra("bloom-560m.json").string()});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("ignored keys:"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("offset_alibi ignored"), std::string::npos) << r.out;
  const auto j = run_cli({"inspect", "--config", extra("bloom-560m.json").string(), "--json", "-"});
  ASSERT_EQ(j.exit_code, 0) << j.err;
  EXPECT_EQ(nlohmann::json::parse(j.out).at("ignored_keys"), nlohmann::json::array({"offset_alibi"}));
}

// Found by a tester: a rope_scaling block on a ChatGLM config was listed in ignored_keys but applied (linear factor 2
// halved inv_freq). modeling_chatglm's RotaryEmbedding reads only kv_channels and rope_ratio: default frequencies.
TEST(ConfigGlm, ChatGlmRopeScalingIsIgnoredAndDoesNotChangeTheFrequencies) {
  auto cfg = nlohmann::json::parse(slurp(data("chatglm3-6b-ipex.json")));
  cfg["rope_scaling"] = {{"type", "linear"}, {"factor", 2.0}};
  const PositionalSpec s = parse_text(cfg.dump());
  EXPECT_TRUE(ignored(s, "rope_scaling"));
  EXPECT_EQ(s.rope->rope_type, "default");
  const RopeFrequencies f = compute_rope_frequencies(*s.rope);
  const auto want = chatglm_theta(128, cfg.value("rope_ratio", 1.0));
  ASSERT_EQ(f.inv_freq.size(), want.size());
  for (std::size_t i = 0; i < want.size(); ++i) EXPECT_NEAR(f.inv_freq[i], want[i], 1e-6 * want[i]) << i;
}

// Found by a tester: {"text_config": {"text_config": {}}} crashed the importer (the merge overwrote the object it
// iterated); HF's composite configs nest one level. And an mrope_section of 2 or 4 entries was accepted from a
// config.json (Qwen2-VL's apply_multimodal_rotary_pos_emb takes one section per row t, h, w).
TEST(ConfigTextConfig, NestedTextConfigAndMropeSectionsOfTheWrongLengthAreConfigErrors) {
  const std::string nested = error_of(R"({"model_type": "llama", "num_attention_heads": 32, "hidden_size": 4096,
      "max_position_embeddings": 512, "text_config": {"text_config": {}}})");
  EXPECT_NE(nested.find("text_config.text_config"), std::string::npos) << nested;
  EXPECT_NE(error_of(R"({"model_type": "llama", "num_attention_heads": 32, "hidden_size": 4096,
      "text_config": {"text_config": 1}})")
                .find("text_config.text_config"),
            std::string::npos);
  for (const char* section : {"[32, 32]", "[16, 16, 16, 16]"}) {
    const std::string e = error_of(std::string(R"({"model_type": "qwen2_vl", "num_attention_heads": 28,
        "hidden_size": 3584, "max_position_embeddings": 32768, "rope_scaling": {"type": "mrope", "mrope_section": )") +
                                   section + "}}");
    EXPECT_NE(e.find("mrope_section: must have 3 entries"), std::string::npos) << section << ": " << e;
  }
}

// Found by a tester: rope_scaling.factor 1e300 (yarn) ran with a failing context_shift and 1e308 (dynamic) gave
// "inv_freq[1]: must be finite (got -nan)", naming no field; the factor is bounded as --rope-factor is.
TEST(ConfigLimits, RopeScalingFactorIsBoundedAndNamed) {
  for (const char* type : {"yarn", "dynamic", "linear"})
    for (const char* factor : {"1e300", "1e-300", "0.0000009"}) {
      const std::string e = error_of(std::string(R"({"model_type": "llama", "num_attention_heads": 8,
        "hidden_size": 512, "max_position_embeddings": 2048, "rope_scaling": {"rope_type": ")") + type +
                                     R"(", "factor": )" + factor +
                                     (std::string(type) == "linear" ? "}}" : R"(, "original_max_position_embeddings": 128}})"));
      EXPECT_NE(e.find("rope_scaling.factor: must be in [1e-06, 1e+06]"), std::string::npos)
          << type << " " << factor << ": " << e;
    }
}

}  // namespace POSENC_UNITY_ID
