// posenc — the JSON object `posenc inspect --json` prints for a parsed config:
// the positional spec and, for RoPE, its per-channel table. One definition,
// shared by the CLI and the Python package (posenc.inspect), so that both give
// the same keys and values.
#pragma once

#include <optional>

#include <nlohmann/json.hpp>

#include "posenc/analysis.hpp"
#include "posenc/config.hpp"

namespace posenc {

/// The scaling parameters of `p` that are set (factor, original_max_position_embeddings, beta_fast, ...,
/// short_factor/long_factor), in a stable order; absent ones are left out.
nlohmann::ordered_json rope_parameters_json(const RopeParams& p);

/// The whole `posenc inspect --json` object: family, RoPE parameters and frequencies (inv_freq [rotary_dim/2]
/// as doubles holding float32 values, channels [{i, inv_freq, wavelength, rotations_original,
/// rotations_target, wavelength_ratio}], original_length, seq_len) when `inspection` is given, ALiBi slopes,
/// T5 buckets, sinusoidal layout, model sizes, sliding window, ignored_keys and notes.
/// Throws InvalidArgument as alibi_slopes_for for an ALiBi spec without heads.
nlohmann::ordered_json inspect_json(const PositionalSpec& spec, const std::optional<RopeInspection>& inspection);

}  // namespace posenc
