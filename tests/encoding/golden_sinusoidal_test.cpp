// sinusoidal.json: absolute sinusoidal tables (XLM/DistilBERT interleaved,
// Marian halves, M2M100/FSMT tensor2tensor with padding_idx), M2M100 position
// ids, and GPT-J's rotary [sin | cos] table.
#include <iostream>

#include "encoding/golden.hpp"
#include "posenc/absolute.hpp"
#include "posenc/rope.hpp"

namespace POSENC_UNITY_ID {  // this file's own namespace in the tests' unity build (CMakeLists.txt)

using namespace posenc;
using namespace posenc::golden;

TEST(GoldenSinusoidal, EveryCaseMatchesHuggingFace) {
  const json doc = load("sinusoidal.json");
  const auto& cases = doc.at("cases");
  ASSERT_FALSE(cases.empty());
  std::size_t checked = 0, values = 0, bit_exact = 0;
  for (const auto& c : cases) {
    const std::string name = c.at("name");
    const std::string convention = c.at("convention");
    const json& in = c.at("inputs");
    const json& out = c.at("outputs");

    if (convention == "position_ids") {
      const Tensor ids = tensor(in.at("input_ids"));
      const auto got = position_ids_from_input_ids(ids.as_int(), static_cast<int64_t>(ids.shape[0]),
                                                   static_cast<int64_t>(ids.shape[1]),
                                                   in.at("padding_idx"), in.at("past_key_values_length"));
      EXPECT_TRUE(compare(name, "position_ids", tensor(out.at("position_ids")), got, Tol::exact, 0.0));
      ++checked;
      continue;
    }

    const Tensor want = tensor(out.at("table"));
    std::vector<float> got;
    if (convention == "interleaved" || convention == "concat_halves_xlm_freqs") {
      got = sinusoidal_table(in.at("num_positions"), in.at("dim"),
                             convention == "interleaved" ? SinusoidalLayout::interleaved
                                                         : SinusoidalLayout::halves);
    } else if (convention == "concat_halves_t2t_freqs") {
      std::optional<int64_t> pad;
      if (!in.at("padding_idx").is_null()) pad = in.at("padding_idx").get<int64_t>();
      got = sinusoidal_table(in.at("num_embeddings"), in.at("dim"), SinusoidalLayout::tensor2tensor,
                             10000.0, pad);
    } else if (convention == "rope_table_sin_then_cos") {
      // GPT-J create_sinusoidal_positions: [sin(pos*inv_freq) | cos(pos*inv_freq)], float32.
      const int64_t n = in.at("num_positions");
      const int dim = in.at("dim");
      const RopeFrequencies f = default_rope_frequencies(dim, dim, 10000.0);
      std::vector<int64_t> pos(static_cast<std::size_t>(n));
      for (int64_t i = 0; i < n; ++i) pos[static_cast<std::size_t>(i)] = i;
      const RopeTable t(f, pos, AnglePrecision::float32);
      const int h = dim / 2;
      for (int64_t p = 0; p < n; ++p) {
        got.insert(got.end(), t.sin_row(p), t.sin_row(p) + h);
        got.insert(got.end(), t.cos_row(p), t.cos_row(p) + h);
      }
    } else {
      ADD_FAILURE() << "case " << name << ": unknown convention " << convention;
      continue;
    }
    EXPECT_TRUE(compare(name, "table", want, got, Tol::abs, 2e-6));
    for (std::size_t i = 0; i < got.size() && i < want.size(); ++i) {
      ++values;
      bit_exact += static_cast<float>(want.values[i]) == got[i];
    }
    ++checked;
  }
  EXPECT_EQ(checked, cases.size()) << "every case of sinusoidal.json must be checked";
  std::cout << "[sinusoidal] " << checked << " cases, table values bit-exact " << bit_exact << "/"
            << values << "\n";
}

}  // namespace POSENC_UNITY_ID
