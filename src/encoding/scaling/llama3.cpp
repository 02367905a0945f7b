#include <cmath>
#include <numbers>

#include <fmt/format.h>

#include "encoding/scaling/methods.hpp"

namespace posenc::detail {

// Llama 3.1 frequency scaling (Meta, "The Llama 3 Herd of Models" 2024,
// reference apply_scaling in llama-models; HF _compute_llama3_parameters), in
// wavelength terms, wavelen = 2*pi / inv_freq:
//   wavelen < orig/high_freq_factor   -> kept (high frequency)
//   wavelen > orig/low_freq_factor    -> inv_freq / factor (low frequency)
//   otherwise (both bounds inclusive)  -> (1-s) * inv/factor + s * inv,
//                                        s = (orig/wavelen - low)/(high - low)
// Float32 like the reference, including that `scalar / tensor` is evaluated by
// torch as reciprocal(tensor) * scalar.
RopeFrequencies rope_llama3(const RopeParams& p, std::optional<int64_t>) {
  const double factor = require_factor(p);
  const double low_freq_factor = require_positive(p, p.low_freq_factor, "low_freq_factor");
  const double high_freq_factor = require_positive(p, p.high_freq_factor, "high_freq_factor");
  // high == low is what Llama 4 ships (low_freq_factor = high_freq_factor = 1): HF only
  // warns, and the smooth band shrinks to wavelen == orig/low, so the result is a step
  // (kept above the boundary frequency, divided by factor below it).
  if (high_freq_factor < low_freq_factor)
    throw ConfigError(fmt::format(
        "rope_scaling.high_freq_factor: must be >= low_freq_factor {} (got {})", low_freq_factor,
        high_freq_factor));
  const int64_t orig = original_max_position(p);
  const int dim = resolve_rotary_dim(p);
  std::vector<float> inv = default_inv_freq(dim / 2, dim, p.rope_theta);

  const float low_freq_wavelen = static_cast<float>(static_cast<double>(orig) / low_freq_factor);
  const float high_freq_wavelen = static_cast<float>(static_cast<double>(orig) / high_freq_factor);
  const float two_pi = static_cast<float>(2 * std::numbers::pi);
  const float f = static_cast<float>(factor);
  const float lo = static_cast<float>(low_freq_factor);
  const float span = static_cast<float>(high_freq_factor - low_freq_factor);
  const float ctx = static_cast<float>(orig);
  for (float& x : inv) {
    const float wavelen = (1.0f / x) * two_pi;
    float scaled = wavelen > low_freq_wavelen ? x / f : x;
    const bool medium = !(wavelen < high_freq_wavelen) && !(wavelen > low_freq_wavelen);
    if (medium && span > 0) {
      const float smooth = ((1.0f / wavelen) * ctx - lo) / span;
      scaled = (1.0f - smooth) * scaled / f + smooth * scaled;
    }
    x = scaled;
  }
  return make_frequencies(p.head_dim, dim, std::move(inv), 1.0);
}

}  // namespace posenc::detail
