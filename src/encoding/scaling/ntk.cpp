#include <cmath>

#include "encoding/scaling/methods.hpp"

namespace posenc::detail {

// Static NTK-aware scaling (bloc97, 2023; YaRN paper arXiv:2309.00071 eq. 16):
// the base becomes theta * s^(d/(d-2)) with d = rotary_dim, so the lowest
// frequency is interpolated by s while the highest is kept. HF has no rope_type
// for it (its "dynamic" applies the same rule with s derived from the length).
// base' is formed in double and cast to float32 for the power, as HF's
// _compute_dynamic_ntk_parameters does with a Python seq_len.
template <class T>
RopeFrequencies rope_ntk(const RopeParams& p, std::optional<int64_t>) {
  const double factor = require_factor(p);
  const int d = resolve_rotary_dim(p);
  if (d <= 2) fail_field<ConfigError>("rotary_dim", "ntk needs rotary_dim > 2", d);
  const double base = p.rope_theta * std::pow(factor, static_cast<double>(d) / (d - 2));
  return make_frequencies(p.head_dim, d, default_inv_freq<T>(d / 2, d, base), 1.0);
}

POSENC_ROPE_METHOD_INSTANTIATE(rope_ntk)

}  // namespace posenc::detail
