#include "encoding/scaling/methods.hpp"

namespace posenc::detail {

// Position Interpolation (Chen et al. 2023, "Extending Context Window of Large
// Language Models via Positional Interpolation", eq. 3): positions are divided
// by the factor, i.e. every inverse frequency is. HF:
// _compute_linear_scaling_rope_parameters (inv_freq /= factor, float32).
template <class T>
RopeFrequencies rope_linear(const RopeParams& p, std::optional<int64_t>) {
  const double factor = require_factor(p);
  const int dim = resolve_rotary_dim(p);
  std::vector<T> inv = default_inv_freq<T>(dim / 2, dim, p.rope_theta);
  const T s = static_cast<T>(factor);
  for (T& v : inv) v /= s;
  return make_frequencies(p.head_dim, dim, std::move(inv), 1.0);
}

POSENC_ROPE_METHOD_INSTANTIATE(rope_linear)

}  // namespace posenc::detail
