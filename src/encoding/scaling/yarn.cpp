#include <algorithm>
#include <cmath>
#include <numbers>

#include <fmt/format.h>

#include "encoding/scaling/methods.hpp"

namespace posenc::detail {

namespace {

// Inverse of the rotation count: the (fractional) dimension index whose
// wavelength fits `num_rotations` times into `max_pos` (YaRN eq. 25-26; HF
// find_correction_dim), in double.
double find_correction_dim(double num_rotations, int dim, double base, double max_pos) {
  return (dim * std::log(max_pos / (num_rotations * 2 * std::numbers::pi))) /
         (2 * std::log(base));
}

}  // namespace

// YaRN (Peng et al. 2023, "YaRN: Efficient Context Window Extension of Large
// Language Models", §3.2 "NTK-by-parts" eq. 17-18 + §3.4 attention scaling
// eq. 22). HF: _compute_yarn_parameters. Channel pairs whose wavelength is
// short compared with the original context keep their frequency
// (extrapolation), long ones are divided by the factor (interpolation), a
// linear ramp over the correction range [low, high] blends in between.
template <class T>
RopeFrequencies rope_yarn(const RopeParams& p, std::optional<int64_t>) {
  const int dim = resolve_rotary_dim(p);
  const int64_t orig = original_max_position(p);
  const double factor = factor_or_context_ratio(p, orig);

  // Attention factor: explicit; else mscale/mscale_all_dim when both are
  // truthy; else g(factor, 1). A lone mscale, or a zero, is ignored.
  double attention_factor = 0.0;
  if (p.attention_factor) {
    attention_factor = *optional_positive(p.attention_factor, "attention_factor");
  } else {
    for (auto [v, name] : {std::pair{p.mscale, "mscale"}, std::pair{p.mscale_all_dim, "mscale_all_dim"}})
      if (v && !std::isfinite(*v))
        fail_field<ConfigError>(fmt::format("rope_scaling.{}", name), "must be finite", *v);
    const double mscale = p.mscale.value_or(0.0);
    const double mscale_all_dim = p.mscale_all_dim.value_or(0.0);
    if (mscale != 0.0 && mscale_all_dim != 0.0)
      attention_factor = yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, mscale_all_dim);
    else
      attention_factor = yarn_get_mscale(factor);
  }

  // beta_fast/beta_slow default to 32/1; HF's `or` also replaces 0.
  auto beta = [](const std::optional<double>& v, double fallback, const char* name) {
    if (!v || *v == 0.0) return fallback;
    if (!std::isfinite(*v) || *v < 0)
      fail_field<ConfigError>(fmt::format("rope_scaling.{}", name), "must be finite and > 0", *v);
    return *v;
  };
  const double beta_fast = beta(p.beta_fast, 32.0, "beta_fast");
  const double beta_slow = beta(p.beta_slow, 1.0, "beta_slow");
  if (beta_fast < beta_slow)
    throw ConfigError(fmt::format(
        "rope_scaling.beta_fast: must be >= beta_slow {} (got {}); the ramp would be inverted",
        beta_slow, beta_fast));

  // Correction range against the ORIGINAL context, clamped to [0, dim-1]
  // (not dim/2-1, although the ramp spans dim/2 entries: HF's quirk).
  double low = find_correction_dim(beta_fast, dim, p.rope_theta, static_cast<double>(orig));
  double high = find_correction_dim(beta_slow, dim, p.rope_theta, static_cast<double>(orig));
  if (p.truncate.value_or(true)) {
    low = std::floor(low);
    high = std::ceil(high);
  }
  low = std::max(low, 0.0);
  high = std::min(high, static_cast<double>(dim - 1));
  if (low == high) high += 0.001;  // prevent a singular ramp
  const T ramp_lo = static_cast<T>(low);
  const T ramp_span = static_cast<T>(high - low);

  const int n = dim / 2;
  const T b = static_cast<T>(p.rope_theta);
  const T s = static_cast<T>(factor);
  std::vector<T> inv(static_cast<std::size_t>(n));
  for (int i = 0; i < n; ++i) {
    const T pos_freq = std::pow(b, static_cast<T>(2 * i) / static_cast<T>(dim));
    const T extrapolation = T(1) / pos_freq;
    const T interpolation = T(1) / (s * pos_freq);
    const T ramp = std::clamp((static_cast<T>(i) - ramp_lo) / ramp_span, T(0), T(1));
    const T extrapolation_factor = T(1) - ramp;
    const T keep = T(1) - extrapolation_factor;
    inv[static_cast<std::size_t>(i)] =
        interpolation * keep + extrapolation * extrapolation_factor;
  }
  return make_frequencies(p.head_dim, dim, std::move(inv), attention_factor);
}

POSENC_ROPE_METHOD_INSTANTIATE(rope_yarn)

}  // namespace posenc::detail
