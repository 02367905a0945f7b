// config.json → PositionalSpec: every shared config with its real values,
// and every error case on small temp files.
#include <cmath>
#include <filesystem>
#include <string>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "config/test_util.hpp"
#include "posenc/config.hpp"
#include "posenc/json_file.hpp"
#include "posenc/error.hpp"
#include "posenc/rope.hpp"
#include "posenc/scaling.hpp"

namespace POSENC_UNITY_ID {  // this file's own namespace in the tests' unity build (CMakeLists.txt)

using namespace posenc;
using posenc::test::ScratchDir;
using posenc::test::shared_config;

namespace {

PositionalSpec load(std::string_view name) { return load_positional_spec(shared_config(name)); }

bool registered(std::string_view rope_type) {
  for (const auto& m : rope_scalings())
    if (m.name == rope_type) return true;
  return false;
}

#define SKIP_UNLESS_REGISTERED(type)                                                          \
  if (!registered(type))                                                                      \
  GTEST_SKIP() << "rope_type '" << type                                                       \
               << "' is not registered in this build yet (branch enc adds it); the parsed " \
                  "RopeParams are checked by the test above"

/// The rope_init.json case `name` from the Hugging Face golden vectors.
nlohmann::json golden_rope_init(std::string_view name) {
  const auto path =
      std::filesystem::path(POSENC_SHARED_DIR) / "testdata" / "hf_reference" / "rope_init.json";
  const auto doc = nlohmann::json::parse(posenc::test::slurp(path));
  for (const auto& c : doc.at("cases"))
    if (c.at("name") == name) return c;
  ADD_FAILURE() << "golden case " << name << " not found";
  return {};
}

/// Writes `text` to a temp file, loads it, and expects a ConfigError whose
/// message contains every one of `parts`.
void expect_error(std::string_view text, std::initializer_list<std::string_view> parts,
                  const ConfigOptions& options = {}) {
  ScratchDir dir;
  const auto p = dir.write("config.json", text);
  try {
    (void)load_positional_spec(p, options);
    ADD_FAILURE() << "no error for " << text;
  } catch (const ConfigError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find(p.string()), std::string::npos) << "file not named: " << msg;
    for (auto part : parts)
      EXPECT_NE(msg.find(part), std::string::npos) << "'" << part << "' missing from: " << msg;
  }
}

PositionalSpec parse_text(std::string_view text, const ConfigOptions& options = {}) {
  return parse_positional_spec(text, "inline.json", options);
}

}  // namespace

// ---------------------------------------------------------------------------
// The 16 shared configs.

TEST(ConfigShared, EveryFileParses) {
  int n = 0;
  for (const auto& entry :
       std::filesystem::directory_iterator(std::filesystem::path(POSENC_SHARED_DIR) / "configs")) {
    if (entry.path().extension() != ".json") continue;
    ++n;
    SCOPED_TRACE(entry.path().string());
    const PositionalSpec s = load_positional_spec(entry.path());
    EXPECT_GT(s.num_attention_heads, 0);
    EXPECT_FALSE(s.model_type.empty());
    if (s.rope) {
      EXPECT_TRUE(s.layout.has_value()) << "every shared RoPE config has a known architecture";
      EXPECT_GT(s.rope->head_dim, 0);
      // Default RoPE configs compute here; scaled ones once their method is registered.
      if (registered(s.rope->rope_type)) {
        const RopeFrequencies f = compute_rope_frequencies(*s.rope);
        EXPECT_EQ(f.n_pairs(), s.rope->effective_rotary_dim() / 2);
      }
    }
  }
  EXPECT_EQ(n, 16);
}

TEST(ConfigShared, Llama31) {
  const PositionalSpec s = load("llama-3.1-8b.json");
  EXPECT_EQ(s.family, PositionFamily::rope);
  EXPECT_EQ(s.model_type, "llama");
  EXPECT_EQ(s.architecture, "LlamaForCausalLM");
  ASSERT_TRUE(s.rope);
  const RopeParams& p = *s.rope;
  EXPECT_EQ(p.rope_type, "llama3");
  EXPECT_EQ(p.rope_theta, 500000.0);
  EXPECT_EQ(p.factor, 8.0);
  EXPECT_EQ(p.low_freq_factor, 1.0);
  EXPECT_EQ(p.high_freq_factor, 4.0);
  EXPECT_EQ(p.original_max_position_embeddings, 8192);
  EXPECT_EQ(p.max_position_embeddings, 131072);
  EXPECT_EQ(p.head_dim, 128);
  EXPECT_EQ(p.effective_rotary_dim(), 128);
  EXPECT_FALSE(p.attention_factor);
  EXPECT_EQ(s.layout, RopeLayout::half);
  EXPECT_EQ(layout_name(s), "half");
  EXPECT_EQ(s.num_attention_heads, 32);
  EXPECT_EQ(s.num_key_value_heads, 8);
  EXPECT_EQ(s.max_position_embeddings, 131072);
  EXPECT_FALSE(s.sliding_window.active);
}

TEST(ConfigShared, Llama31FrequenciesMatchHuggingFace) {
  SKIP_UNLESS_REGISTERED("llama3");
  const PositionalSpec s = load("llama-3.1-8b.json");
  const RopeFrequencies f = compute_rope_frequencies(*s.rope);
  // Same parameters as the HF golden case (llama3, factor 8, 1/4, 8192, d 128, theta 5e5).
  const auto g = golden_rope_init("llama3_f8_lo1_hi4_orig8192_d128");
  const auto& inv = g.at("outputs").at("inv_freq");
  ASSERT_EQ(f.inv_freq.size(), inv.size());
  for (std::size_t i = 0; i < inv.size(); ++i)
    EXPECT_NEAR(f.inv_freq[i], inv[i].get<double>(), 1e-6 * inv[i].get<double>()) << i;
  EXPECT_NEAR(f.attention_factor, g.at("outputs").at("attention_factor").get<double>(), 1e-12);
}

TEST(ConfigShared, DeepSeekV3) {
  const PositionalSpec s = load("deepseek-v3.json");
  EXPECT_EQ(s.family, PositionFamily::rope);
  ASSERT_TRUE(s.rope);
  const RopeParams& p = *s.rope;
  EXPECT_EQ(p.rope_type, "yarn");  // legacy "type" key
  EXPECT_EQ(p.rope_theta, 10000.0);  // an int in the file
  EXPECT_EQ(p.factor, 40.0);
  EXPECT_EQ(p.beta_fast, 32.0);
  EXPECT_EQ(p.beta_slow, 1.0);
  EXPECT_EQ(p.mscale, 1.0);
  EXPECT_EQ(p.mscale_all_dim, 1.0);
  EXPECT_EQ(p.original_max_position_embeddings, 4096);
  EXPECT_EQ(p.max_position_embeddings, 163840);
  EXPECT_EQ(p.head_dim, 64);  // qk_rope_head_dim, not hidden/heads = 56
  EXPECT_EQ(p.effective_rotary_dim(), 64);
  EXPECT_EQ(s.qk_head_dim, 192);
  EXPECT_EQ(s.layout, RopeLayout::interleaved);
  EXPECT_TRUE(s.rope_output_half_order);
  EXPECT_EQ(layout_name(s), "interleaved_in_half_out");
  EXPECT_EQ(s.num_attention_heads, 128);
  EXPECT_EQ(s.num_key_value_heads, 128);
  // HF golden: deepseek_v3_softmax_scale_for_qk_head_dim_192 of the same yarn parameters.
  const auto g = golden_rope_init("yarn_deepseek_v3_mscale1_mscale_all_dim1");
  ASSERT_TRUE(s.softmax_scale);
  EXPECT_NEAR(*s.softmax_scale,
              g.at("outputs").at("deepseek_v3_softmax_scale_for_qk_head_dim_192").get<double>(),
              1e-15);
  EXPECT_NEAR(*s.softmax_scale, 0.1352337788608801, 1e-15);
}

TEST(ConfigShared, DeepSeekV3FrequenciesMatchHuggingFace) {
  SKIP_UNLESS_REGISTERED("yarn");
  const PositionalSpec s = load("deepseek-v3.json");
  const RopeFrequencies f = compute_rope_frequencies(*s.rope);
  const auto g = golden_rope_init("yarn_deepseek_v3_mscale1_mscale_all_dim1");
  const auto& inv = g.at("outputs").at("inv_freq");
  ASSERT_EQ(f.inv_freq.size(), inv.size());
  for (std::size_t i = 0; i < inv.size(); ++i)
    EXPECT_NEAR(f.inv_freq[i], inv[i].get<double>(), 1e-6 * inv[i].get<double>()) << i;
  EXPECT_NEAR(f.attention_factor, g.at("outputs").at("attention_factor").get<double>(), 1e-12);
}

TEST(ConfigShared, DeepSeekRopeInterleaveFalseIsHalf) {
  const PositionalSpec s = parse_text(R"({"model_type": "deepseek_v3", "num_attention_heads": 4,
      "hidden_size": 256, "qk_rope_head_dim": 32, "qk_nope_head_dim": 64, "rope_theta": 10000,
      "rope_interleave": false})");
  EXPECT_EQ(s.layout, RopeLayout::half);
  EXPECT_FALSE(s.rope_output_half_order);
  EXPECT_EQ(s.rope->head_dim, 32);
  EXPECT_EQ(s.qk_head_dim, 96);
}

TEST(ConfigShared, Mixtral) {
  const PositionalSpec s = load("mixtral-8x7b-v0.1.json");
  EXPECT_EQ(s.family, PositionFamily::rope);
  EXPECT_EQ(s.rope->rope_theta, 1000000.0);
  EXPECT_EQ(s.rope->rope_type, "default");
  EXPECT_EQ(s.rope->head_dim, 128);
  EXPECT_EQ(s.layout, RopeLayout::half);
  EXPECT_EQ(s.num_key_value_heads, 8);
  EXPECT_EQ(s.max_position_embeddings, 32768);
  EXPECT_FALSE(s.sliding_window.size);  // "sliding_window": null
  EXPECT_FALSE(s.sliding_window.active);
}

TEST(ConfigShared, Qwen3ExplicitHeadDim) {
  const PositionalSpec s = load("qwen3-0.6b.json");
  EXPECT_EQ(s.rope->head_dim, 128);  // explicit, not hidden_size/heads = 1024/16 = 64
  EXPECT_EQ(s.hidden_size, 1024);
  EXPECT_EQ(s.num_attention_heads, 16);
  EXPECT_EQ(s.num_key_value_heads, 8);
  EXPECT_EQ(s.rope->rope_theta, 1000000.0);  // an int in the file
  EXPECT_EQ(s.rope->rope_type, "default");   // "rope_scaling": null
  EXPECT_EQ(s.layout, RopeLayout::half);
  EXPECT_EQ(s.max_position_embeddings, 40960);
  EXPECT_FALSE(s.sliding_window.active);
  const RopeFrequencies f = compute_rope_frequencies(*s.rope);
  EXPECT_EQ(f.inv_freq, default_rope_frequencies(128, 128, 1e6).inv_freq);
}

TEST(ConfigShared, Phi3LongRope) {
  const PositionalSpec s = load("phi-3-mini-128k-instruct.json");
  EXPECT_EQ(s.family, PositionFamily::rope);
  const RopeParams& p = *s.rope;
  EXPECT_EQ(p.rope_type, "longrope");
  EXPECT_EQ(p.head_dim, 96);  // 3072 / 32
  EXPECT_EQ(p.effective_rotary_dim(), 96);
  ASSERT_EQ(p.long_factor.size(), 48u);
  ASSERT_EQ(p.short_factor.size(), 48u);
  EXPECT_EQ(p.long_factor[0], 1.0700000524520874);
  EXPECT_EQ(p.long_factor[47], 64.76000213623047);
  EXPECT_EQ(p.short_factor[0], 1.1);
  EXPECT_EQ(p.short_factor[47], 3.049999999999997);
  EXPECT_EQ(p.original_max_position_embeddings, 4096);  // from the top level
  EXPECT_EQ(p.max_position_embeddings, 131072);
  EXPECT_FALSE(p.factor);  // absent: the method derives it from 131072/4096
  EXPECT_EQ(p.rope_theta, 10000.0);
  EXPECT_EQ(s.layout, RopeLayout::half);
  EXPECT_EQ(s.sliding_window.size, 262144);
  EXPECT_TRUE(s.sliding_window.active);
  EXPECT_EQ(s.sliding_window.layer_is_sliding, std::vector<bool>(32, true));
}

TEST(ConfigShared, Phi3LongRopeFrequencies) {
  SKIP_UNLESS_REGISTERED("longrope");
  const PositionalSpec s = load("phi-3-mini-128k-instruct.json");
  const RopeFrequencies plain = default_rope_frequencies(96, 96, 10000.0);
  // Past the original 4096 tokens the long factors divide the frequencies;
  // at or below it the short ones (HF _compute_longrope_parameters).
  const RopeFrequencies lng = compute_rope_frequencies(*s.rope, 131072);
  const RopeFrequencies sht = compute_rope_frequencies(*s.rope, 4096);
  for (std::size_t i = 0; i < 48; ++i) {
    EXPECT_NEAR(lng.inv_freq[i], plain.inv_freq[i] / s.rope->long_factor[i],
                2e-6 * lng.inv_freq[i]);
    EXPECT_NEAR(sht.inv_freq[i], plain.inv_freq[i] / s.rope->short_factor[i],
                2e-6 * sht.inv_freq[i]);
  }
  // attention_factor = sqrt(1 + ln(131072/4096) / ln(4096)).
  const double expected = std::sqrt(1.0 + std::log(32.0) / std::log(4096.0));
  EXPECT_NEAR(lng.attention_factor, expected, 1e-12);
  EXPECT_NEAR(expected, 1.1902380714238083, 1e-12);
}

TEST(ConfigShared, MptAlibi) {
  const PositionalSpec s = load("mpt-7b.json");
  EXPECT_EQ(s.family, PositionFamily::alibi);
  ASSERT_TRUE(s.alibi);
  EXPECT_EQ(s.alibi->convention, AlibiConvention::mpt);
  EXPECT_EQ(s.alibi->max_bias, 8.0);
  EXPECT_EQ(s.num_attention_heads, 32);
  EXPECT_EQ(s.hidden_size, 4096);
  EXPECT_EQ(s.max_position_embeddings, 2048);  // max_seq_len
  EXPECT_FALSE(s.rope);
}

TEST(ConfigShared, PythiaPartialRotary) {
  const PositionalSpec s = load("pythia-160m.json");
  EXPECT_EQ(s.family, PositionFamily::rope);
  EXPECT_EQ(s.rope->head_dim, 64);
  EXPECT_EQ(s.rope->rotary_dim, 16);  // rotary_pct 0.25
  EXPECT_EQ(s.rope->rope_theta, 10000.0);  // rotary_emb_base
  EXPECT_EQ(s.layout, RopeLayout::half);
  EXPECT_EQ(s.max_position_embeddings, 2048);
  const RopeFrequencies f = compute_rope_frequencies(*s.rope);
  EXPECT_EQ(f.inv_freq.size(), 8u);
  EXPECT_EQ(f.inv_freq, default_rope_frequencies(64, 16, 10000.0).inv_freq);
}

TEST(ConfigShared, Qwen25SlidingWindowPresentButOff) {
  const PositionalSpec s = load("qwen2.5-7b-instruct.json");
  EXPECT_EQ(s.rope->rope_theta, 1000000.0);
  EXPECT_EQ(s.rope->head_dim, 128);
  EXPECT_EQ(s.rope->rope_type, "default");
  EXPECT_EQ(s.num_attention_heads, 28);
  EXPECT_EQ(s.num_key_value_heads, 4);
  EXPECT_EQ(s.sliding_window.size, 131072);
  EXPECT_FALSE(s.sliding_window.active);
  EXPECT_EQ(s.sliding_window.layer_mask(27), MaskKind::causal);
}

TEST(ConfigShared, Qwen25VlMrope) {
  const PositionalSpec s = load("qwen2.5-vl-7b-instruct.json");
  EXPECT_EQ(s.family, PositionFamily::mrope);
  EXPECT_EQ(s.mrope_section, (std::vector<int>{16, 24, 24}));
  EXPECT_EQ(s.rope->rope_type, "default");
  EXPECT_EQ(s.rope->rope_theta, 1000000.0);
  EXPECT_EQ(s.rope->head_dim, 128);
  EXPECT_EQ(s.layout, RopeLayout::half);
  EXPECT_EQ(s.max_position_embeddings, 128000);
  EXPECT_FALSE(s.sliding_window.active);
}

TEST(ConfigShared, TinyLlama) {
  const PositionalSpec s = load("tinyllama-1.1b-chat-v1.0.json");
  EXPECT_EQ(s.rope->head_dim, 64);
  EXPECT_EQ(s.rope->rope_theta, 10000.0);
  EXPECT_EQ(s.num_key_value_heads, 4);
  EXPECT_EQ(s.max_position_embeddings, 2048);
  EXPECT_EQ(s.layout, RopeLayout::half);
}

TEST(ConfigShared, FlanT5Buckets) {
  const PositionalSpec s = load("flan-t5-base.json");
  EXPECT_EQ(s.family, PositionFamily::t5_bias);
  ASSERT_TRUE(s.t5);
  EXPECT_EQ(s.t5->relative_attention_num_buckets, 32);
  EXPECT_EQ(s.t5->relative_attention_max_distance, 128);
  EXPECT_TRUE(s.t5->encoder_bidirectional);
  EXPECT_FALSE(s.t5->decoder_bidirectional);
  EXPECT_TRUE(s.t5->is_encoder_decoder);
  EXPECT_EQ(s.num_attention_heads, 12);
  EXPECT_FALSE(s.rope);
}

TEST(ConfigShared, Gpt2LargeLearned) {
  const PositionalSpec s = load("gpt2-large.json");
  EXPECT_EQ(s.family, PositionFamily::learned_absolute);
  EXPECT_EQ(s.max_position_embeddings, 1024);  // n_positions
  EXPECT_EQ(s.num_attention_heads, 20);
  EXPECT_EQ(s.hidden_size, 1280);
  EXPECT_EQ(s.num_hidden_layers, 36);
  EXPECT_EQ(s.position_offset, 0);
}

TEST(ConfigShared, BertCrlfLearned) {
  const std::string raw = posenc::test::slurp(shared_config("bert-base-uncased.json"));
  ASSERT_NE(raw.find("\r\n"), std::string::npos) << "fixture is expected to have CRLF";
  const PositionalSpec s = load("bert-base-uncased.json");
  EXPECT_EQ(s.family, PositionFamily::learned_absolute);
  EXPECT_EQ(s.max_position_embeddings, 512);
  EXPECT_EQ(s.num_attention_heads, 12);
}

TEST(ConfigShared, FalconDefaults) {
  const PositionalSpec s = load("falcon-7b-instruct.json");
  EXPECT_EQ(s.family, PositionFamily::rope);
  EXPECT_EQ(s.rope->rope_theta, 10000.0);  // absent → default
  EXPECT_EQ(s.max_position_embeddings, 2048);  // absent → FalconConfig default
  EXPECT_EQ(s.rope->head_dim, 64);  // 4544 / 71
  EXPECT_EQ(s.num_attention_heads, 71);
  EXPECT_EQ(s.num_key_value_heads, 1);  // multi_query
  EXPECT_EQ(s.layout, RopeLayout::half);
  bool noted = false;
  for (const auto& n : s.notes) noted |= n.find("rope_theta absent") != std::string::npos;
  EXPECT_TRUE(noted);
}

TEST(ConfigShared, MistralSlidingWindowAllLayers) {
  const PositionalSpec s = load("mistral-7b-v0.1.json");
  EXPECT_EQ(s.rope->rope_theta, 10000.0);
  EXPECT_EQ(s.max_position_embeddings, 32768);
  EXPECT_EQ(s.sliding_window.size, 4096);
  EXPECT_TRUE(s.sliding_window.active);
  EXPECT_EQ(s.sliding_window.layer_is_sliding, std::vector<bool>(32, true));
  EXPECT_EQ(s.sliding_window.layer_mask(31), MaskKind::sliding_window);
}

TEST(ConfigShared, Gemma2AlternatingWindow) {
  const PositionalSpec s = load("gemma-2-2b.json");
  EXPECT_EQ(s.rope->head_dim, 256);  // explicit; hidden/heads = 288
  EXPECT_EQ(s.rope->rope_theta, 10000.0);
  EXPECT_EQ(s.num_key_value_heads, 4);
  EXPECT_EQ(s.max_position_embeddings, 8192);
  EXPECT_EQ(s.sliding_window.size, 4096);
  EXPECT_TRUE(s.sliding_window.active);
  ASSERT_EQ(s.sliding_window.layer_is_sliding.size(), 26u);
  for (int i = 0; i < 26; ++i)
    EXPECT_EQ(s.sliding_window.layer_is_sliding[static_cast<std::size_t>(i)], i % 2 == 0) << i;
  EXPECT_EQ(s.sliding_window.layer_mask(0), MaskKind::sliding_window);
  EXPECT_EQ(s.sliding_window.layer_mask(1), MaskKind::causal);
  EXPECT_THROW((void)s.sliding_window.layer_mask(26), InvalidArgument);
}

// ---------------------------------------------------------------------------
// Other accepted forms.

TEST(ConfigForms, RopeParametersNewStyle) {
  const PositionalSpec s = parse_text(R"({"model_type": "llama", "num_attention_heads": 4,
      "hidden_size": 256, "max_position_embeddings": 8192,
      "rope_parameters": {"rope_type": "linear", "factor": 4.0, "rope_theta": 500000.0}})");
  EXPECT_EQ(s.rope->rope_type, "linear");
  EXPECT_EQ(s.rope->factor, 4.0);
  EXPECT_EQ(s.rope->rope_theta, 500000.0);
  EXPECT_EQ(s.rope->head_dim, 64);
  const RopeFrequencies f = compute_rope_frequencies(*s.rope);
  const RopeFrequencies d = default_rope_frequencies(64, 64, 500000.0);
  for (std::size_t i = 0; i < f.inv_freq.size(); ++i) EXPECT_EQ(f.inv_freq[i], d.inv_freq[i] / 4.0f);
}

TEST(ConfigForms, PartialRotaryFactorAndGptjRotaryDim) {
  const PositionalSpec phi = parse_text(R"({"model_type": "phi", "num_attention_heads": 32,
      "hidden_size": 2560, "partial_rotary_factor": 0.4, "rope_theta": 10000.0})");
  EXPECT_EQ(phi.rope->head_dim, 80);
  EXPECT_EQ(phi.rope->rotary_dim, 32);
  EXPECT_EQ(phi.layout, RopeLayout::half);
  const PositionalSpec gptj = parse_text(R"({"model_type": "gptj", "n_head": 16, "n_embd": 4096,
      "rotary_dim": 64, "n_positions": 2048})");
  EXPECT_EQ(gptj.rope->head_dim, 256);
  EXPECT_EQ(gptj.rope->rotary_dim, 64);
  EXPECT_EQ(gptj.layout, RopeLayout::interleaved);
  EXPECT_EQ(gptj.max_position_embeddings, 2048);
}

TEST(ConfigForms, LlamaDefaultIgnoresPartialRotaryFactor) {
  // HF golden case default_llama_ignores_partial_rotary_factor: 16 frequencies, not 8.
  const PositionalSpec s = parse_text(R"({"model_type": "llama", "num_attention_heads": 2,
      "hidden_size": 64, "head_dim": 32, "partial_rotary_factor": 0.5})");
  EXPECT_EQ(s.rope->rotary_dim, 32);
  const PositionalSpec neox = parse_text(R"({"model_type": "gpt_neox", "num_attention_heads": 2,
      "hidden_size": 64, "head_dim": 32, "partial_rotary_factor": 0.5})");
  EXPECT_EQ(neox.rope->rotary_dim, 16);
  const PositionalSpec scaled = parse_text(R"({"model_type": "llama", "num_attention_heads": 2,
      "hidden_size": 64, "head_dim": 32, "partial_rotary_factor": 0.5,
      "rope_scaling": {"rope_type": "linear", "factor": 4.0}})");
  EXPECT_EQ(scaled.rope->rotary_dim, 16);  // scaled variants apply it
}

TEST(ConfigForms, ProportionalRopeMatchesHuggingFace) {
  if (!registered("proportional"))
    GTEST_SKIP() << "rope_type 'proportional' is not registered in this build yet (branch enc)";
  // Same inputs as the HF golden case proportional_partial0.25_d64.
  const PositionalSpec s = parse_text(R"({"model_type": "llama", "num_attention_heads": 2,
      "hidden_size": 128, "head_dim": 64, "max_position_embeddings": 8192,
      "rope_theta": 1000000.0,
      "rope_scaling": {"rope_type": "proportional", "partial_rotary_factor": 0.25}})");
  EXPECT_EQ(s.rope->rope_type, "proportional");
  EXPECT_EQ(s.rope->effective_rotary_dim(), 64);
  const RopeFrequencies f = compute_rope_frequencies(*s.rope);
  const auto g = golden_rope_init("proportional_partial0.25_d64");
  const auto& inv = g.at("outputs").at("inv_freq");
  ASSERT_EQ(f.inv_freq.size(), inv.size());
  for (std::size_t i = 0; i < inv.size(); ++i)
    EXPECT_NEAR(f.inv_freq[i], inv[i].get<double>(), 1e-6 * inv[i].get<double>()) << i;
}

TEST(ConfigForms, ArchitectureNameWhenModelTypeIsUnknown) {
  const PositionalSpec s = parse_text(R"({"model_type": "my_llama_finetune",
      "architectures": ["LlamaForCausalLM"], "num_attention_heads": 2, "hidden_size": 64})");
  EXPECT_EQ(s.layout, RopeLayout::half);
  const PositionalSpec n = parse_text(R"({"architectures": ["GPTNeoXForCausalLM"],
      "num_attention_heads": 2, "hidden_size": 64, "rotary_pct": 0.5})");
  EXPECT_EQ(n.rope->rotary_dim, 16);  // GPTNeoX, not the shorter prefix GPTNeo (learned)
  EXPECT_EQ(n.layout, RopeLayout::half);
}

TEST(ConfigForms, UnknownArchitectureWithRopeFieldsHasNoLayout) {
  const PositionalSpec s = parse_text(R"({"model_type": "mystery", "num_attention_heads": 2,
      "hidden_size": 64, "rope_theta": 20000})");
  EXPECT_EQ(s.family, PositionFamily::rope);
  EXPECT_FALSE(s.layout);
  EXPECT_EQ(layout_name(s), "unknown");
  EXPECT_EQ(s.rope->rope_theta, 20000.0);
}

TEST(ConfigForms, BloomAndFalconAlibi) {
  const PositionalSpec bloom =
      parse_text(R"({"model_type": "bloom", "n_head": 12, "hidden_size": 768})");
  EXPECT_EQ(bloom.family, PositionFamily::alibi);
  EXPECT_EQ(bloom.alibi->convention, AlibiConvention::bloom);
  const PositionalSpec falcon = parse_text(R"({"model_type": "falcon", "num_attention_heads": 8,
      "hidden_size": 512, "alibi": true})");
  EXPECT_EQ(falcon.family, PositionFamily::alibi);
  EXPECT_EQ(falcon.alibi->max_bias, 8.0);
}

TEST(ConfigForms, LayerTypesAndQwenWindow) {
  const PositionalSpec lt = parse_text(R"({"model_type": "llama", "num_attention_heads": 2,
      "hidden_size": 64, "num_hidden_layers": 3, "sliding_window": 128,
      "layer_types": ["full_attention", "sliding_attention", "full_attention"]})");
  EXPECT_EQ(lt.sliding_window.layer_is_sliding, (std::vector<bool>{false, true, false}));
  EXPECT_TRUE(lt.sliding_window.active);
  const PositionalSpec q = parse_text(R"({"model_type": "qwen2", "num_attention_heads": 2,
      "hidden_size": 64, "num_hidden_layers": 4, "sliding_window": 256,
      "use_sliding_window": true, "max_window_layers": 2})");
  EXPECT_EQ(q.sliding_window.layer_is_sliding, (std::vector<bool>{false, false, true, true}));
}

TEST(ConfigForms, LenientIgnoresUnknownScalingKeys) {
  const char* text = R"({"model_type": "llama", "num_attention_heads": 4, "hidden_size": 256,
      "rope_scaling": {"rope_type": "linear", "factor": 2.0, "finetuned": true}})";
  ConfigOptions lenient;
  lenient.lenient = true;
  const PositionalSpec s = parse_text(text, lenient);
  EXPECT_EQ(s.rope->factor, 2.0);
  EXPECT_EQ(s.ignored_keys, std::vector<std::string>{"rope_scaling.finetuned"});
  expect_error(text, {"rope_scaling.finetuned", "not a parameter of rope_type 'linear'", "lenient"});
}

// ---------------------------------------------------------------------------
// Errors: each names the field path and the bad value.

TEST(ConfigErrors, UnknownRopeTypeListsTheRegistry) {
  ScratchDir dir;
  const auto p = dir.write("c.json", R"({"model_type": "llama", "num_attention_heads": 4,
      "hidden_size": 256, "rope_scaling": {"rope_type": "superscale", "factor": 2}})");
  try {
    (void)load_positional_spec(p);
    FAIL() << "no error";
  } catch (const ConfigError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("rope_scaling.rope_type"), std::string::npos) << msg;
    EXPECT_NE(msg.find("'superscale'"), std::string::npos) << msg;
    for (const auto& m : rope_scalings())
      EXPECT_NE(msg.find(std::string(m.name)), std::string::npos) << m.name << ": " << msg;
  }
  expect_error(R"({"model_type": "llama", "num_attention_heads": 4, "hidden_size": 256,
      "rope_scaling": {"type": "superscale"}})",
               {"rope_scaling.type", "superscale"});
}

TEST(ConfigErrors, MissingRequiredFields) {
  expect_error(R"({"model_type": "llama", "hidden_size": 256})", {"num_attention_heads", "missing"});
  expect_error(R"({"model_type": "llama", "num_attention_heads": 4})", {"hidden_size", "missing"});
  expect_error(R"({"model_type": "llama", "num_attention_heads": 4, "hidden_size": 256,
      "rope_scaling": {"rope_type": "llama3", "factor": 8, "high_freq_factor": 4,
      "original_max_position_embeddings": 8192}})",
               {"rope_scaling.low_freq_factor", "required", "llama3"});
  expect_error(R"({"model_type": "llama", "num_attention_heads": 4, "hidden_size": 256,
      "rope_scaling": {"rope_type": "linear"}})",
               {"rope_scaling.factor", "required"});
  expect_error(R"({"model_type": "llama", "num_attention_heads": 4, "hidden_size": 256,
      "rope_scaling": {"factor": 2.0}})",
               {"rope_scaling.rope_type", "missing"});
  expect_error(R"({"model_type": "deepseek_v3", "num_attention_heads": 4, "hidden_size": 256})",
               {"qk_rope_head_dim", "missing"});
  expect_error(R"({"model_type": "qwen2_vl", "num_attention_heads": 4, "hidden_size": 256})",
               {"mrope_section", "missing"});
  expect_error(R"({"model_type": "gpt2", "n_head": 4, "n_embd": 256})",
               {"max_position_embeddings", "missing"});
}

// An odd head_dim that turns whole is the head_dim's fault, not a rotary_dim the file never gave (the newcomer
// helper's head_dim 15 was reported as "rotary_dim: must be even"); an odd rotary_dim given is still its own.
TEST(ConfigErrors, AnOddHeadDimThatTurnsWholeIsNamed) {
  expect_error(R"({"model_type": "llama", "num_attention_heads": 4, "hidden_size": 60, "head_dim": 15})",
               {"head_dim: must be even", "channels in pairs", "(got 15)"});
  expect_error(R"({"model_type": "llama", "num_attention_heads": 4, "hidden_size": 60})",
               {"head_dim: must be even", "(got 15)"});
  expect_error(R"({"model_type": "gptj", "n_head": 4, "n_embd": 64, "rotary_dim": 7, "n_positions": 2048})",
               {"rotary_dim: must be even", "(got 7)"});
}

TEST(ConfigErrors, NonPositiveFactor) {
  expect_error(R"({"model_type": "llama", "num_attention_heads": 4, "hidden_size": 256,
      "rope_scaling": {"rope_type": "linear", "factor": -2}})",
               {"rope_scaling.factor", "must be in [1e-06, 1e+06]", "(got -2)"});
  expect_error(R"({"model_type": "llama", "num_attention_heads": 4, "hidden_size": 256,
      "rope_scaling": {"rope_type": "linear", "factor": 0.0}})",
               {"rope_scaling.factor", "(got 0.0)"});
  expect_error(R"({"model_type": "llama", "num_attention_heads": 4, "hidden_size": 256,
      "rope_scaling": {"rope_type": "yarn", "factor": 4, "beta_fast": "fast"}})",
               {"rope_scaling.beta_fast", "number", "\"fast\""});
}

TEST(ConfigErrors, LongFactorLengthMustBeHalfRotaryDim) {
  expect_error(R"({"model_type": "phi3", "num_attention_heads": 4, "hidden_size": 256,
      "original_max_position_embeddings": 4096, "max_position_embeddings": 131072,
      "rope_scaling": {"type": "longrope", "long_factor": [1.0, 2.0, 3.0],
                       "short_factor": [1.0, 2.0, 3.0]}})",
               {"rope_scaling.", "_factor", "rotary_dim/2 = 32", "3 entries"});
  expect_error(R"({"model_type": "phi3", "num_attention_heads": 2, "hidden_size": 8,
      "rope_scaling": {"type": "longrope", "long_factor": [1.0, -2.0],
                       "short_factor": [1.0, 2.0]}})",
               {"rope_scaling.long_factor[1]", "> 0", "-2.0"});
}

TEST(ConfigErrors, NonNumericValues) {
  expect_error(R"({"model_type": "llama", "num_attention_heads": 4, "hidden_size": 256,
      "rope_theta": "abc"})",
               {"rope_theta", "must be a number", "\"abc\""});
  expect_error(R"({"model_type": "llama", "num_attention_heads": true, "hidden_size": 256})",
               {"num_attention_heads", "integer", "true"});
  expect_error(R"({"model_type": "llama", "num_attention_heads": 4, "hidden_size": 256,
      "head_dim": 64.5})",
               {"head_dim", "integer", "64.5"});
  expect_error(R"({"model_type": "llama", "num_attention_heads": 4, "hidden_size": 256,
      "rope_theta": -10})",
               {"rope_theta", "> 0", "-10"});
  expect_error(R"({"model_type": "gpt_neox", "num_attention_heads": 4, "hidden_size": 256,
      "rotary_pct": 1.5})",
               {"rotary_pct", "(0, 1]", "1.5"});
}

TEST(ConfigErrors, MalformedJsonNamesFileAndPosition) {
  expect_error("{\"model_type\": \"llama\",\n \"num_attention_heads\": 4,,}", {"malformed JSON", "byte"});
  expect_error("", {"malformed JSON"});
  expect_error("[1, 2]", {"must be a JSON object"});
  // A number that overflows a double is a ConfigError too, not a raw json exception.
  expect_error("{\"model_type\": \"llama\", \"rope_theta\": 1e999}", {"unusable JSON value", "1e999"});
}

// nlohmann's "number overflow parsing '1e400'" named the file but not the key: the key path is now said, nested
// objects and array elements included.
TEST(ConfigErrors, AnOverflowingNumberNamesItsKey) {
  expect_error(R"({"model_type": "llama", "num_attention_heads": 4, "rope_theta": 1e400})",
               {"config.json: rope_theta: unusable JSON value", "1e400"});
  expect_error(R"({"model_type": "llama", "rope_scaling": {"rope_type": "linear", "factor": -1e400}})",
               {"config.json: rope_scaling.factor: unusable JSON value", "-1e400"});
  expect_error(R"({"model_type": "llama", "rope_scaling": {"rope_type": "longrope",
      "short_factor": [1, {"a": [2]}, [3, 4], 1e999]}})",
               {"config.json: rope_scaling.short_factor[3]: unusable JSON value", "1e999"});
  EXPECT_EQ(posenc::json_failure_path(R"({"a": [1, 2]})"), "");
  EXPECT_EQ(posenc::json_failure_path(R"([{"x": 1}, {"y": [5, 1e999]}])"), "[1].y[1]");
}

TEST(ConfigErrors, UnknownArchitectureWithoutPositions) {
  expect_error(R"({"model_type": "mystery", "architectures": ["MysteryModel"],
      "num_attention_heads": 4, "hidden_size": 256, "max_position_embeddings": 512})",
               {"model_type", "unknown architecture", "\"mystery\"", "MysteryModel"});
}

TEST(ConfigErrors, InconsistentValues) {
  // rope_type vs legacy type
  expect_error(R"({"model_type": "llama", "num_attention_heads": 4, "hidden_size": 256,
      "rope_scaling": {"rope_type": "linear", "type": "dynamic", "factor": 2}})",
               {"rope_scaling.type", "disagrees", "\"dynamic\""});
  // a parameter of another method
  expect_error(R"({"model_type": "llama", "num_attention_heads": 4, "hidden_size": 256,
      "rope_scaling": {"rope_type": "yarn", "factor": 4, "low_freq_factor": 1}})",
               {"rope_scaling.low_freq_factor", "not a parameter of rope_type 'yarn'"});
  // llama3 bounds
  expect_error(R"({"model_type": "llama", "num_attention_heads": 4, "hidden_size": 256,
      "rope_scaling": {"rope_type": "llama3", "factor": 8, "low_freq_factor": 4,
      "high_freq_factor": 1, "original_max_position_embeddings": 8192}})",
               {"rope_scaling.high_freq_factor", "low_freq_factor 4", "(got 1)"});
  // mrope sections must cover rotary_dim/2
  expect_error(R"({"model_type": "qwen2_5_vl", "num_attention_heads": 28, "hidden_size": 3584,
      "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 16]}})",
               {"rope_scaling.mrope_section", "rotary_dim/2 = 64", "56"});
  // rope_theta twice with different values
  expect_error(R"({"model_type": "llama", "num_attention_heads": 4, "hidden_size": 256,
      "rope_theta": 10000, "rope_parameters": {"rope_type": "default", "rope_theta": 500000}})",
               {"rope_parameters.rope_theta", "disagrees", "500000"});
  // head_dim from hidden_size must divide
  expect_error(R"({"model_type": "llama", "num_attention_heads": 3, "hidden_size": 100})",
               {"hidden_size", "not divisible", "100"});
  // unsupported BERT relative positions
  expect_error(R"({"model_type": "bert", "num_attention_heads": 4, "hidden_size": 256,
      "max_position_embeddings": 512, "position_embedding_type": "relative_key"})",
               {"position_embedding_type", "relative_key"});
  // T5 buckets too few for max distance
  expect_error(R"({"model_type": "t5", "num_heads": 4, "d_model": 256,
      "relative_attention_num_buckets": 32, "relative_attention_max_distance": 8})",
               {"relative_attention_max_distance", "(got 8)"});
}

TEST(ConfigErrors, MissingFileIsIoError) {
  EXPECT_THROW((void)load_positional_spec("/nonexistent/posenc/config.json"), IoError);
}

}  // namespace POSENC_UNITY_ID
