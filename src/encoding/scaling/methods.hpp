// Internal: one function per RoPE scaling method (one .cpp each under
// src/encoding/scaling/), registered in src/encoding/scaling.cpp, plus the
// small validated accessors they share. Every accessor throws ConfigError
// naming "rope_scaling.<field>" and the bad value.
#pragma once

#include <cmath>
#include <cstdint>
#include <optional>
#include <string_view>
#include <vector>

#include "posenc/error.hpp"
#include "posenc/scaling.hpp"

namespace posenc::detail {

// Each method is written once, on the float type T of its arithmetic:
// T = float is Hugging Face's float32 computation (RopeFrequencies::inv_freq),
// T = double the same formula in double (RopeFrequencies::inv_freq_f64, the
// fp64 reference). Both are instantiated in the method's .cpp.
template <class T> RopeFrequencies rope_default(const RopeParams& p, std::optional<int64_t> seq_len);
template <class T> RopeFrequencies rope_linear(const RopeParams& p, std::optional<int64_t> seq_len);
template <class T> RopeFrequencies rope_ntk(const RopeParams& p, std::optional<int64_t> seq_len);
template <class T> RopeFrequencies rope_dynamic(const RopeParams& p, std::optional<int64_t> seq_len);
template <class T> RopeFrequencies rope_yarn(const RopeParams& p, std::optional<int64_t> seq_len);
template <class T> RopeFrequencies rope_longrope(const RopeParams& p, std::optional<int64_t> seq_len);
template <class T> RopeFrequencies rope_llama3(const RopeParams& p, std::optional<int64_t> seq_len);
template <class T> RopeFrequencies rope_proportional(const RopeParams& p, std::optional<int64_t> seq_len);

/// Instantiates a method template for float and double.
#define POSENC_ROPE_METHOD_INSTANTIATE(name)                                            \
  template RopeFrequencies name<float>(const RopeParams&, std::optional<int64_t>); \
  template RopeFrequencies name<double>(const RopeParams&, std::optional<int64_t>);

/// params.factor, required, finite and > 0.
double require_factor(const RopeParams& p);
/// An optional positive finite value: the value, or nullopt when absent.
std::optional<double> optional_positive(const std::optional<double>& v, std::string_view field);
/// A required positive finite value (ConfigError "required for rope_type ..." when absent).
double require_positive(const RopeParams& p, const std::optional<double>& v, std::string_view field);
/// max_position_embeddings, required and > 0.
int64_t require_max_position_embeddings(const RopeParams& p);
/// params.factor when given (finite, > 0); else max_position_embeddings /
/// `original` (the extended over the original context, as Phi-3's longrope and
/// DeepSeek-V3's yarn configs imply). ConfigError naming rope_scaling.factor
/// when neither is present.
double factor_or_context_ratio(const RopeParams& p, int64_t original);
/// original_max_position_embeddings, falling back to max_position_embeddings
/// as HF's standardize_rope_params does for yarn/longrope/llama3; > 0.
int64_t original_max_position(const RopeParams& p);
/// The rotated width (rotary_dim, else int(head_dim*partial_rotary_factor),
/// else head_dim), validated: even, >= 2, <= head_dim.
int resolve_rotary_dim(const RopeParams& p);

/// HF's default inverse frequencies over `dim` channels with exponent
/// denominator `denom` (dim for every type except proportional, which uses
/// head_dim), `n` entries: inv[i] = 1 / (T(base) ^ (T(2i) / T(denom))), all in
/// T (float32 for HF's numerics, double for the reference).
template <class T>
std::vector<T> default_inv_freq(int n, int denom, double base) {
  std::vector<T> inv(static_cast<std::size_t>(n));
  const T b = static_cast<T>(base);
  for (int i = 0; i < n; ++i) {
    // HF: 1.0 / (base ** (torch.arange(0, dim, 2).float() / dim)), all float32.
    const T exponent = static_cast<T>(2 * i) / static_cast<T>(denom);
    inv[static_cast<std::size_t>(i)] = T(1) / std::pow(b, exponent);
  }
  return inv;
}

/// Frequencies value with the given fields (validated by the caller's caller).
/// T = float: inv_freq; T = double: inv_freq_f64, and inv_freq its float cast
/// (compute_rope_frequencies replaces it by the float32 computation).
RopeFrequencies make_frequencies(int head_dim, int rotary_dim, std::vector<float> inv_freq,
                                 double attention_factor);
RopeFrequencies make_frequencies(int head_dim, int rotary_dim, std::vector<double> inv_freq,
                                 double attention_factor);

}  // namespace posenc::detail
