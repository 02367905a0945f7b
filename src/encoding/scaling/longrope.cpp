#include <cmath>

#include <fmt/format.h>

#include "encoding/scaling/methods.hpp"

namespace posenc::detail {

// LongRoPE (Ding et al. 2024, "LongRoPE: Extending LLM Context Window Beyond 2
// Million Tokens", eq. 3: per-dimension rescale factors found by search; Phi-3
// ships a short and a long list). HF: _compute_longrope_parameters.
//   inv_freq[i] = 1 / (ext[i] * base^(2i/d)), ext = long_factor when
//   seq_len > original_max_position_embeddings (strictly), else short_factor.
//   attention_factor: explicit, else sqrt(1 + ln(factor)/ln(original)) with
//   factor = rope_scaling.factor or max_position_embeddings/original; 1 if factor <= 1.
template <class T>
RopeFrequencies rope_longrope(const RopeParams& p, std::optional<int64_t> seq_len) {
  const int dim = resolve_rotary_dim(p);
  const int n = dim / 2;
  for (auto [list, name] : {std::pair{&p.short_factor, "short_factor"},
                            std::pair{&p.long_factor, "long_factor"}}) {
    if (list->empty())
      throw ConfigError(fmt::format(
          "rope_scaling.{}: required for rope_type 'longrope' (missing; expected {} entries)", name, n));
    if (static_cast<int>(list->size()) != n)
      throw ConfigError(fmt::format("rope_scaling.{}: expected {} entries (rotary_dim/2) (got {})",
                                    name, n, list->size()));
    for (std::size_t i = 0; i < list->size(); ++i)
      if (!std::isfinite((*list)[i]) || (*list)[i] <= 0)
        fail_field<ConfigError>(fmt::format("rope_scaling.{}[{}]", name, i), "must be finite and > 0",
                                (*list)[i]);
  }
  const int64_t orig = original_max_position(p);
  const double factor = factor_or_context_ratio(p, orig);
  double attention_factor = 1.0;
  if (p.attention_factor) {
    attention_factor = *optional_positive(p.attention_factor, "attention_factor");
  } else if (factor > 1.0) {
    attention_factor = std::sqrt(1 + std::log(factor) / std::log(static_cast<double>(orig)));
  }
  // HF: `if seq_len and seq_len > original_max_position_embeddings` (0 is falsy).
  const bool use_long = seq_len && *seq_len > 0 && *seq_len > orig;
  const std::vector<double>& ext = use_long ? p.long_factor : p.short_factor;
  const T b = static_cast<T>(p.rope_theta);
  std::vector<T> inv(static_cast<std::size_t>(n));
  for (int i = 0; i < n; ++i) {
    const T shape = static_cast<T>(2 * i) / static_cast<T>(dim);
    inv[static_cast<std::size_t>(i)] = T(1) / (static_cast<T>(ext[static_cast<std::size_t>(i)]) * std::pow(b, shape));
  }
  return make_frequencies(p.head_dim, dim, std::move(inv), attention_factor);
}

POSENC_ROPE_METHOD_INSTANTIATE(rope_longrope)

}  // namespace posenc::detail
