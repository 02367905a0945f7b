// rope_forward.json: cos/sin tables of Llama's rotary module forward, with the
// dynamic and LongRoPE frequency updates that run inside it (HF
// dynamic_rope_update), reproduced by RopeFrequencySchedule + RopeTable.
#include <iostream>

#include "encoding/golden.hpp"
#include "posenc/rope.hpp"
#include "posenc/scaling.hpp"

namespace POSENC_UNITY_ID {  // this file's own namespace in the tests' unity build (CMakeLists.txt)

using namespace posenc;
using namespace posenc::golden;

TEST(GoldenRopeForward, EveryCaseMatchesHuggingFace) {
  const json doc = load("rope_forward.json");
  const auto& cases = doc.at("cases");
  ASSERT_FALSE(cases.empty());
  std::size_t checked = 0, values = 0, bit_exact = 0;
  for (const auto& c : cases) {
    const std::string name = c.at("name");
    const json& in = c.at("inputs");
    const json& out = c.at("outputs");
    RopeParams p = in.contains("rope_scaling") ? rope_params_from_dict(in.at("rope_scaling"))
                                                : RopeParams{};
    p.rope_theta = in.at("rope_theta");
    p.head_dim = in.at("head_dim");
    p.max_position_embeddings = in.at("max_position_embeddings").get<int64_t>();

    RopeFrequencySchedule schedule(p);
    if (in.contains("earlier_forward_position_ids"))
      for (const auto& earlier : in.at("earlier_forward_position_ids"))
        schedule.update(tensor(earlier).as_int());
    const Tensor pos = tensor(in.at("position_ids"));  // [batch, seq]
    ASSERT_EQ(pos.shape.size(), 2u) << name;
    const RopeFrequencies& f = schedule.update(pos.as_int());

    EXPECT_TRUE(compare(name, "inv_freq_used", tensor(out.at("inv_freq_used")), f.inv_freq, Tol::rel, 1e-6));
    // The forward path's float32 base' differs from the direct call's double
    // one in the last ulp (README "Dynamic NTK"): only bit-exactness can tell,
    // so the dynamic cases must match exactly.
    if (name.rfind("dynamic", 0) == 0) {
      EXPECT_TRUE(compare(name, "inv_freq_used (bit-exact)", tensor(out.at("inv_freq_used")),
                          f.inv_freq, Tol::exact, 0.0));
    }
    const double scaling = out.at("attention_scaling").get<double>();
    EXPECT_NEAR(f.attention_factor, scaling, 1e-12 * scaling) << "case " << name;

    // HF: cos = cat(freqs, freqs).cos() * attention_scaling, [batch, seq, rotary_dim].
    const RopeTable table(f, pos.as_int(), AnglePrecision::float32);
    const int n = table.n_pairs();
    for (const char* which : {"cos", "sin"}) {
      const Tensor want = tensor(out.at(which));
      std::vector<float> got(want.size());
      for (int64_t t = 0; t < table.n_positions(); ++t) {
        const float* row = std::string(which) == "cos" ? table.cos_row(t) : table.sin_row(t);
        for (int i = 0; i < 2 * n; ++i) got[static_cast<std::size_t>(t * 2 * n + i)] = row[i % n];
      }
      EXPECT_TRUE(compare(name, which, want, got, Tol::abs, 2e-6));
      for (std::size_t i = 0; i < got.size() && i < want.size(); ++i) {
        ++values;
        bit_exact += static_cast<float>(want.values[i]) == got[i];
      }
    }
    ++checked;
  }
  EXPECT_EQ(checked, cases.size()) << "every case of rope_forward.json must be checked";
  std::cout << "[rope_forward] " << checked << " cases, cos/sin bit-exact " << bit_exact << "/"
            << values << "\n";
}

}  // namespace POSENC_UNITY_ID
