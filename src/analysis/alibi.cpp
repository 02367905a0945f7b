// ALiBi slopes in the convention a parsed config names.
#include <cmath>

#include <fmt/format.h>

#include "posenc/analysis.hpp"
#include "posenc/bias.hpp"
#include "posenc/error.hpp"

namespace posenc {

std::vector<float> alibi_slopes_for(const AlibiSpec& alibi, int n_heads) {
  if (n_heads <= 0) fail_field<InvalidArgument>("num_attention_heads", "must be positive", n_heads);
  if (!std::isfinite(alibi.max_bias) || alibi.max_bias <= 0)
    fail_field<InvalidArgument>("max_bias", "must be finite and > 0", alibi.max_bias);
  if (alibi.convention == AlibiConvention::mpt) return mpt_alibi_slopes(n_heads, alibi.max_bias);
  // Falcon (HF build_alibi_tensor): BLOOM's slopes cast to bfloat16.
  if (alibi.bfloat16_slopes && alibi.max_bias == 8.0) return falcon_alibi_slopes(n_heads);
  // BLOOM has no max_bias: its slopes are the max_bias = 8 sequence in float32.
  return alibi.max_bias == 8.0 ? bloom_alibi_slopes(n_heads) : alibi_slopes(n_heads, alibi.max_bias);
}

}  // namespace posenc
