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
template <class T>
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
  std::vector<T> inv = default_inv_freq<T>(dim / 2, dim, p.rope_theta);

  const T low_freq_wavelen = static_cast<T>(static_cast<double>(orig) / low_freq_factor);
  const T high_freq_wavelen = static_cast<T>(static_cast<double>(orig) / high_freq_factor);
  const T two_pi = static_cast<T>(2 * std::numbers::pi);
  const T f = static_cast<T>(factor);
  const T lo = static_cast<T>(low_freq_factor);
  const T span = static_cast<T>(high_freq_factor - low_freq_factor);
  const T ctx = static_cast<T>(orig);
  for (T& x : inv) {
    const T wavelen = (T(1) / x) * two_pi;
    T scaled = wavelen > low_freq_wavelen ? x / f : x;
    const bool medium = !(wavelen < high_freq_wavelen) && !(wavelen > low_freq_wavelen);
    if (medium && span > 0) {
      const T smooth = ((T(1) / wavelen) * ctx - lo) / span;
      scaled = (T(1) - smooth) * scaled / f + smooth * scaled;
    }
    x = scaled;
  }
  return make_frequencies(p.head_dim, dim, std::move(inv), 1.0);
}

POSENC_ROPE_METHOD_INSTANTIATE(rope_llama3)

}  // namespace posenc::detail
