#include "encoding/scaling/methods.hpp"

namespace posenc::detail {

// Position Interpolation (Chen et al. 2023, "Extending Context Window of Large
// Language Models via Positional Interpolation", eq. 3): positions are divided
// by the factor, i.e. every inverse frequency is. HF:
// _compute_linear_scaling_rope_parameters (inv_freq /= factor, float32).
RopeFrequencies rope_linear(const RopeParams& p, std::optional<int64_t>) {
  const double factor = require_factor(p);
  RopeFrequencies f = default_rope_frequencies(p.head_dim, p.effective_rotary_dim(), p.rope_theta);
  const float s = static_cast<float>(factor);
  for (float& v : f.inv_freq) v /= s;
  return f;
}

}  // namespace posenc::detail
