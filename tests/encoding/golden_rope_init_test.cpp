// rope_init.json: inverse frequencies + attention factor of every RoPE type,
// against Hugging Face modeling_rope_utils.py (direct calls, seq_len a Python int).
#include <iostream>

#include "encoding/golden.hpp"
#include "posenc/scaling.hpp"

namespace POSENC_UNITY_ID {  // this file's own namespace in the tests' unity build (CMakeLists.txt)

using namespace posenc;
using namespace posenc::golden;

TEST(GoldenRopeInit, EveryCaseMatchesHuggingFace) {
  const json doc = load("rope_init.json");
  const auto& cases = doc.at("cases");
  ASSERT_FALSE(cases.empty());
  std::size_t checked = 0, values = 0, bit_exact = 0;
  for (const auto& c : cases) {
    const std::string name = c.at("name");
    const std::string function = c.at("function");
    const json& in = c.at("inputs");
    const json& out = c.at("outputs");
    RopeParams p = rope_params_from_dict(in.at("rope_parameters_standardized"));
    p.head_dim = in.at("head_dim");
    p.max_position_embeddings = in.at("max_position_embeddings").get<int64_t>();
    // Llama's default init ignores partial_rotary_factor (a model-level quirk
    // the config importer resolves); GPT-NeoX's and every scaled type apply it.
    if (function.find("LlamaRotaryEmbedding.compute_default_rope_parameters") != std::string::npos)
      p.partial_rotary_factor.reset();
    std::optional<int64_t> seq_len;
    if (!in.at("seq_len").is_null()) seq_len = in.at("seq_len").get<int64_t>();

    RopeFrequencies f;
    try {
      f = compute_rope_frequencies(p, seq_len);
    } catch (const std::exception& e) {
      ADD_FAILURE() << "case " << name << ": threw " << e.what();
      continue;
    }
    const Tensor inv = tensor(out.at("inv_freq"));
    EXPECT_TRUE(compare(name, "inv_freq", inv, f.inv_freq, Tol::rel, 1e-6));
    EXPECT_EQ(f.rotary_dim, out.at("rotary_dim").get<int>()) << "case " << name;
    EXPECT_EQ(f.head_dim, p.head_dim) << "case " << name;
    const double af = out.at("attention_factor").get<double>();
    EXPECT_NEAR(f.attention_factor, af, 1e-12 * af) << "case " << name << ": attention_factor";
    if (out.contains("deepseek_v3_softmax_scale_for_qk_head_dim_192")) {
      const double want = out.at("deepseek_v3_softmax_scale_for_qk_head_dim_192").get<double>();
      EXPECT_NEAR(deepseek_yarn_softmax_scale(192, p), want, 1e-12 * want)
          << "case " << name << ": DeepSeek-V3 softmax scale";
    }
    for (std::size_t i = 0; i < inv.size() && i < f.inv_freq.size(); ++i) {
      ++values;
      bit_exact += static_cast<float>(inv.values[i]) == f.inv_freq[i];
    }
    ++checked;
  }
  EXPECT_EQ(checked, cases.size()) << "every case of rope_init.json must be checked";
  std::cout << "[rope_init] " << checked << " cases, inv_freq bit-exact " << bit_exact << "/" << values
            << "\n";
}

}  // namespace POSENC_UNITY_ID
