#include <algorithm>
#include <cmath>

#include "encoding/scaling/methods.hpp"

namespace posenc {

// Dynamic NTK scaling (bloc97 and emozilla, 2023; HF
// _compute_dynamic_ntk_parameters). The NTK base change of `ntk` with the
// factor derived from the current length, so that at or below
// max_position_embeddings it is plain RoPE.
namespace {

// The dynamic-NTK base' at the current length, in the given arithmetic.
double dynamic_ntk_base(const RopeParams& p, std::optional<int64_t> seq_len, DynamicNtkArithmetic arithmetic) {
  const double factor = detail::require_factor(p);
  const int64_t max_pos = detail::require_max_position_embeddings(p);
  const int d = detail::resolve_rotary_dim(p);
  if (d <= 2) fail_field<ConfigError>("rotary_dim", "dynamic NTK needs rotary_dim > 2", d);
  if (seq_len && *seq_len < 0) fail_field<ConfigError>("seq_len", "must be non-negative", *seq_len);
  const int64_t len = std::max(seq_len.value_or(max_pos), max_pos);
  const double exponent = static_cast<double>(d) / static_cast<double>(d - 2);
  double base = 0.0;
  if (arithmetic == DynamicNtkArithmetic::python_double) {
    // base * ((factor * seq_len / max_pos) - (factor - 1)) ** (dim / (dim - 2)), Python floats.
    base = p.rope_theta *
           std::pow(factor * static_cast<double>(len) / static_cast<double>(max_pos) - (factor - 1.0),
                    exponent);
  } else {
    // Same expression with seq_len an int64 tensor: every step is a float32
    // tensor op; `tensor ** python_float` evaluates std::pow(float, double)
    // and rounds to float (ATen pow_tensor_scalar_optimized_kernel).
    float t = static_cast<float>(factor) * static_cast<float>(len);
    t = t / static_cast<float>(max_pos);
    t = t - static_cast<float>(factor - 1.0);
    const float scaled = static_cast<float>(std::pow(static_cast<double>(t), exponent));
    base = static_cast<double>(static_cast<float>(p.rope_theta) * scaled);
  }
  return base;
}

}  // namespace

RopeFrequencies dynamic_ntk_frequencies(const RopeParams& p, std::optional<int64_t> seq_len,
                                        DynamicNtkArithmetic arithmetic) {
  const double base = dynamic_ntk_base(p, seq_len, arithmetic);
  const int d = detail::resolve_rotary_dim(p);
  RopeFrequencies f = detail::make_frequencies(p.head_dim, d, detail::default_inv_freq<float>(d / 2, d, base), 1.0);
  // The reference: the formula in double whatever HF's arithmetic.
  f.inv_freq_f64 = detail::default_inv_freq<double>(
      d / 2, d, dynamic_ntk_base(p, seq_len, DynamicNtkArithmetic::python_double));
  return f;
}

namespace detail {

template <class T>
RopeFrequencies rope_dynamic(const RopeParams& p, std::optional<int64_t> seq_len) {
  const double base = dynamic_ntk_base(p, seq_len, DynamicNtkArithmetic::python_double);
  const int d = resolve_rotary_dim(p);
  return make_frequencies(p.head_dim, d, default_inv_freq<T>(d / 2, d, base), 1.0);
}

POSENC_ROPE_METHOD_INSTANTIATE(rope_dynamic)

}  // namespace detail
}  // namespace posenc
