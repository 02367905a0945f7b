#include <cmath>

#include <fmt/format.h>

#include "encoding/scaling/methods.hpp"

namespace posenc::detail {

// Proportional RoPE (Gemma 4 global-attention layers; HF
// _compute_proportional_rope_parameters). Spans the whole head (rotary_dim =
// head_dim): the first k = int(partial_rotary_factor * head_dim // 2) pairs get
// inv_freq[i] = 1 / theta^(2i/head_dim) -- exponent over head_dim, not over
// 2k -- and the remaining head_dim/2 - k pairs get 0 (cos 1, sin 0: identity),
// then everything is divided by factor (default 1). With the half layout the
// identity pairs are channels [k, head_dim/2) and [head_dim/2 + k, head_dim),
// interleaved with the rotated ones at stride head_dim/2.
template <class T>
RopeFrequencies rope_proportional(const RopeParams& p, std::optional<int64_t>) {
  const int head_dim = p.head_dim;
  if (head_dim % 2 != 0)
    fail_field<ConfigError>("head_dim", "proportional RoPE needs an even head_dim", head_dim);
  if (p.rotary_dim != 0 && p.rotary_dim != head_dim)
    throw ConfigError(fmt::format(
        "rotary_dim: proportional RoPE always spans head_dim {} (got {}); use "
        "partial_rotary_factor for the rotated share",
        head_dim, p.rotary_dim));
  const double share = p.partial_rotary_factor.value_or(1.0);
  // Python: int(rope_proportion * head_dim // 2), a float floor division.
  const int angles = static_cast<int>(std::floor(share * head_dim / 2.0));
  const double factor = p.factor ? require_factor(p) : 1.0;
  std::vector<T> inv = default_inv_freq<T>(angles, head_dim, p.rope_theta);
  inv.resize(static_cast<std::size_t>(head_dim / 2), T(0));
  const T f = static_cast<T>(factor);
  for (T& x : inv) x /= f;
  return make_frequencies(head_dim, head_dim, std::move(inv), 1.0);
}

POSENC_ROPE_METHOD_INSTANTIATE(rope_proportional)

}  // namespace posenc::detail
