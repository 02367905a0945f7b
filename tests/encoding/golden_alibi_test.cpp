// alibi.json: ALiBi slopes and bias tensors of BLOOM, Falcon (bfloat16 slopes)
// and MPT (alibi_bias_max), against Hugging Face build_alibi_tensor /
// build_mpt_alibi_tensor.
//
// Tolerances (README: "match BLOOM/MPT to float32 precision, Falcon to
// bfloat16"): BLOOM/MPT within one float32 ulp (rel 1.2e-7) -- torch evaluates
// the float32 pow with SLEEF's 1-ulp vector powf when 16+ heads are computed
// at once, glibc's correctly rounded powf otherwise, and posenc uses the
// latter; Falcon exactly (bfloat16 values). llama.cpp's double-precision rule
// (alibi_slopes) is checked against BLOOM at rel 1e-6: BLOOM raises a float32-
// rounded base (e.g. 0.70710677 for 2^-0.5) to powers up to 64, which moves
// its slopes by up to ~k * 1.7e-8 relative from the exact 2^(-8k/p).
#include <cmath>
#include <iostream>

#include "encoding/golden.hpp"
#include "posenc/bias.hpp"

namespace POSENC_UNITY_ID {  // this file's own namespace in the tests' unity build (CMakeLists.txt)

using namespace posenc;
using namespace posenc::golden;

TEST(GoldenAlibi, EveryCaseMatchesHuggingFace) {
  const json doc = load("alibi.json");
  const auto& cases = doc.at("cases");
  ASSERT_FALSE(cases.empty());
  std::size_t checked = 0, values = 0, bit_exact = 0;
  for (const auto& c : cases) {
    const std::string name = c.at("name");
    const json& in = c.at("inputs");
    const json& out = c.at("outputs");
    const int heads = in.at("num_heads");
    const Tensor want = tensor(out.at("alibi"));
    const std::vector<std::size_t> shape = out.at("shape").get<std::vector<std::size_t>>();
    EXPECT_EQ(want.shape, shape) << "case " << name;

    std::vector<float> got, slopes;
    if (name.rfind("mpt", 0) == 0) {
      const int64_t len = in.at("sequence_length");
      const double bias_max = in.at("alibi_bias_max");
      got = build_mpt_alibi_tensor(heads, len, bias_max);
      slopes = mpt_alibi_slopes(heads, bias_max);
    } else {
      const bool falcon = name.rfind("falcon", 0) == 0;
      ASSERT_TRUE(falcon || name.rfind("bloom", 0) == 0) << "unknown ALiBi family in case " << name;
      const Tensor mask = tensor(in.at("attention_mask"));  // [batch, seq]
      got = build_bloom_alibi_tensor(mask.as_int(), static_cast<int64_t>(mask.shape[0]),
                                     static_cast<int64_t>(mask.shape[1]), heads,
                                     falcon ? AlibiTensorStyle::falcon : AlibiTensorStyle::bloom);
      slopes = falcon ? falcon_alibi_slopes(heads) : bloom_alibi_slopes(heads);
      if (!falcon) {
        // llama.cpp's rule in double agrees with BLOOM's float32 pow to 1 ulp.
        const std::vector<float> llama = alibi_slopes(heads, 8.0);
        EXPECT_TRUE(compare(name, "alibi_slopes(max_bias=8) vs BLOOM", tensor(json(slopes)), llama,
                            Tol::rel, 1e-6));
      }
    }
    const bool falcon = name.rfind("falcon", 0) == 0;
    const Tol mode = falcon ? Tol::exact : Tol::rel;
    const double tol = falcon ? 0.0 : 1.2e-7;
    EXPECT_TRUE(compare(name, "alibi", want, got, mode, tol));
    if (out.contains("slopes")) {
      EXPECT_TRUE(compare(name, "slopes", tensor(out.at("slopes")), slopes, mode, tol));
    }
    for (std::size_t i = 0; i < got.size() && i < want.size(); ++i) {
      ++values;
      bit_exact += static_cast<float>(want.values[i]) == got[i];
    }
    ++checked;
  }
  EXPECT_EQ(checked, cases.size()) << "every case of alibi.json must be checked";
  std::cout << "[alibi] " << checked << " cases, bias values bit-exact " << bit_exact << "/" << values
            << "\n";
}

}  // namespace POSENC_UNITY_ID
