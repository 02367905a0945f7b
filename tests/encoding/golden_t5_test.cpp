// t5_relative_bucket.json: T5 relative position buckets (bidirectional and
// causal, two bucket/distance settings) and compute_bias's (key - query)
// matrix with past_seen_tokens, exactly.
#include <iostream>

#include "encoding/golden.hpp"
#include "posenc/bias.hpp"

namespace POSENC_UNITY_ID {  // this file's own namespace in the tests' unity build (CMakeLists.txt)

using namespace posenc;
using namespace posenc::golden;

TEST(GoldenT5, EveryCaseMatchesHuggingFace) {
  const json doc = load("t5_relative_bucket.json");
  const auto& cases = doc.at("cases");
  ASSERT_FALSE(cases.empty());
  std::size_t checked = 0;
  for (const auto& c : cases) {
    const std::string name = c.at("name");
    const json& in = c.at("inputs");
    const bool bidirectional = in.at("bidirectional");
    const int num_buckets = in.at("num_buckets");
    const int max_distance = in.at("max_distance");
    const Tensor rel = tensor(in.at("relative_position"));
    const Tensor want = tensor(c.at("outputs").at("bucket"));

    std::vector<int> got;
    for (int64_t r : rel.as_int())
      got.push_back(t5_relative_position_bucket(r, bidirectional, num_buckets, max_distance));
    EXPECT_TRUE(compare(name, "bucket", want, got, Tol::exact, 0.0));

    if (in.contains("query_length")) {
      // compute_bias: query t at past_seen_tokens + t, key j at j.
      const int64_t q_len = in.at("query_length"), k_len = in.at("key_length");
      const int64_t past = in.at("past_seen_tokens");
      std::vector<int64_t> rel_got;
      for (int64_t t = 0; t < q_len; ++t)
        for (int64_t j = 0; j < k_len; ++j) rel_got.push_back(j - (past + t));
      EXPECT_TRUE(compare(name, "relative_position", rel, rel_got, Tol::exact, 0.0));
      EXPECT_TRUE(compare(name, "bucket (matrix)", want,
                          t5_relative_position_buckets(q_len, k_len, past, bidirectional, num_buckets, max_distance),
                          Tol::exact, 0.0));
    }
    ++checked;
  }
  EXPECT_EQ(checked, cases.size()) << "every case of t5_relative_bucket.json must be checked";
  std::cout << "[t5_relative_bucket] " << checked << " cases\n";
}

}  // namespace POSENC_UNITY_ID
