// Internal: one function per RoPE scaling method (one .cpp each under
// src/encoding/scaling/), registered in src/encoding/scaling.cpp, plus the
// small validated accessors they share. Every accessor throws ConfigError
// naming "rope_scaling.<field>" and the bad value.
#pragma once

#include <cstdint>
#include <optional>
#include <string_view>

#include "posenc/error.hpp"
#include "posenc/scaling.hpp"

namespace posenc::detail {

RopeFrequencies rope_default(const RopeParams& p, std::optional<int64_t> seq_len);
RopeFrequencies rope_linear(const RopeParams& p, std::optional<int64_t> seq_len);
RopeFrequencies rope_ntk(const RopeParams& p, std::optional<int64_t> seq_len);
RopeFrequencies rope_dynamic(const RopeParams& p, std::optional<int64_t> seq_len);
RopeFrequencies rope_yarn(const RopeParams& p, std::optional<int64_t> seq_len);
RopeFrequencies rope_longrope(const RopeParams& p, std::optional<int64_t> seq_len);
RopeFrequencies rope_llama3(const RopeParams& p, std::optional<int64_t> seq_len);
RopeFrequencies rope_proportional(const RopeParams& p, std::optional<int64_t> seq_len);

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
/// head_dim), `n` entries: inv[i] = 1 / (float(base) ^ (float(2i) / float(denom))),
/// all float32.
std::vector<float> default_inv_freq(int n, int denom, double base);

/// Frequencies value with the given fields (validated by the caller's caller).
RopeFrequencies make_frequencies(int head_dim, int rotary_dim, std::vector<float> inv_freq,
                                 double attention_factor);

}  // namespace posenc::detail
