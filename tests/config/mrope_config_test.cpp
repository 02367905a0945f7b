// Config import of Qwen3-VL's interleaved M-RoPE (issue 16, M-RoPE part).
//
// Reference behaviour: transformers models/qwen3_vl/modeling_qwen3_vl.py,
// Qwen3VLTextRotaryEmbedding: mrope_section = rope_scaling.get("mrope_section",
// [24, 20, 20]), and forward always applies apply_interleaved_mrope. The
// text_config of Qwen/Qwen3-VL-8B-Instruct's config.json carries
// "rope_scaling": {"mrope_interleaved": true, "mrope_section": [24, 20, 20],
// "rope_type": "default"}. Qwen2-VL/Qwen2.5-VL (modeling_qwen2_vl.py
// apply_multimodal_rotary_pos_emb) split the pairs in chunks. On main the key
// mrope_interleaved was refused as "not a parameter of rope_type 'default'" and
// model_type qwen3_vl_text was unknown.
#include <string>

#include <gtest/gtest.h>

#include "posenc/config.hpp"
#include "posenc/error.hpp"

namespace POSENC_UNITY_ID {  // this file's own namespace in the tests' unity build (CMakeLists.txt)

using namespace posenc;

namespace {
std::string qwen3_vl_text(const std::string& rope_scaling) {
  return R"({"model_type": "qwen3_vl_text", "hidden_size": 4096, "num_attention_heads": 32,
             "num_key_value_heads": 8, "head_dim": 128, "num_hidden_layers": 36,
             "max_position_embeddings": 262144, "rope_theta": 5000000)" +
         (rope_scaling.empty() ? std::string() : ", \"rope_scaling\": " + rope_scaling) + "}";
}
}  // namespace

TEST(MropeConfig, Qwen3VlTextIsInterleavedMrope) {
  const PositionalSpec s = parse_positional_spec(
      qwen3_vl_text(R"({"mrope_interleaved": true, "mrope_section": [24, 20, 20], "rope_type": "default"})"));
  EXPECT_EQ(s.family, PositionFamily::mrope);
  EXPECT_EQ(s.mrope_section, (std::vector<int>{24, 20, 20}));
  EXPECT_TRUE(s.mrope_interleaved);
  EXPECT_EQ(s.layout, RopeLayout::half);
  EXPECT_EQ(s.rope->rope_theta, 5000000.0);
}

TEST(MropeConfig, Qwen3VlDefaultsLikeTransformers) {
  // No rope_scaling at all: HF falls back to [24, 20, 20] and still interleaves.
  const PositionalSpec s = parse_positional_spec(qwen3_vl_text(""));
  EXPECT_EQ(s.family, PositionFamily::mrope);
  EXPECT_EQ(s.mrope_section, (std::vector<int>{24, 20, 20}));
  EXPECT_TRUE(s.mrope_interleaved);
  // mrope_interleaved false in the file: HF's Qwen3-VL interleaves regardless.
  const PositionalSpec f = parse_positional_spec(
      qwen3_vl_text(R"({"mrope_interleaved": false, "mrope_section": [24, 20, 20], "rope_type": "default"})"));
  EXPECT_TRUE(f.mrope_interleaved);
}

TEST(MropeConfig, Qwen2VlStaysChunkedAndTheKeyIsTyped) {
  const std::string qwen2_vl = R"({"model_type": "qwen2_vl", "hidden_size": 1536, "num_attention_heads": 12,
      "num_key_value_heads": 2, "max_position_embeddings": 32768, "rope_theta": 1000000,
      "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]}})";
  const PositionalSpec s = parse_positional_spec(qwen2_vl);
  EXPECT_EQ(s.family, PositionFamily::mrope);
  EXPECT_FALSE(s.mrope_interleaved);
  const std::string bad = R"({"model_type": "qwen2_vl", "hidden_size": 1536, "num_attention_heads": 12,
      "num_key_value_heads": 2, "max_position_embeddings": 32768,
      "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24], "mrope_interleaved": "yes"}})";
  try {
    (void)parse_positional_spec(bad);
    ADD_FAILURE() << "no error";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("rope_scaling.mrope_interleaved"), std::string::npos) << e.what();
  }
}

// Interleaved budgets the cycle cannot meet (HF's slice would silently shorten
// the width row) are refused at import, naming the field.
TEST(MropeConfig, InterleavedBudgetsOutOfReachAreRefused) {
  try {
    (void)parse_positional_spec(
        qwen3_vl_text(R"({"mrope_interleaved": true, "mrope_section": [16, 24, 24], "rope_type": "default"})"));
    ADD_FAILURE() << "no error";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("rope_scaling.mrope_section"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("height budget 24 needs pair 70"), std::string::npos) << e.what();
  }
}

}  // namespace POSENC_UNITY_ID
