// posenc — RoPE frequency scalings, keyed by Hugging Face's `rope_type`.
//
// Every method turns a typed RopeParams into one RopeFrequencies value
// (inv_freq per channel pair + attention_factor). Kernels never see config
// dictionaries. Numerics follow Hugging Face transformers,
// src/transformers/modeling_rope_utils.py (ROPE_INIT_FUNCTIONS), in float32.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "posenc/rope.hpp"

namespace posenc {

/// Typed RoPE parameters, as read from a config.json (`rope_scaling` /
/// `rope_parameters`) or from CLI flags. Optional fields are std::nullopt when
/// absent; each method documents which it requires.
struct RopeParams {
  std::string rope_type = "default";  ///< registry key (HF `rope_type`, legacy `type`)
  double rope_theta = 10000.0;        ///< base of the frequencies
  int head_dim = 0;                   ///< channels per attention head
  int rotary_dim = 0;                 ///< rotated channels (even); 0 means head_dim
  std::optional<double> factor;       ///< scaling factor s (linear, ntk, dynamic, yarn, longrope, llama3)
  std::optional<int64_t> original_max_position_embeddings;  ///< trained context
  std::optional<int64_t> max_position_embeddings;           ///< target context
  // yarn
  std::optional<double> attention_factor;
  std::optional<double> beta_fast;
  std::optional<double> beta_slow;
  std::optional<double> mscale;
  std::optional<double> mscale_all_dim;
  std::optional<bool> truncate;
  // longrope (each of length rotary_dim/2 when present)
  std::vector<double> short_factor;
  std::vector<double> long_factor;
  // llama3
  std::optional<double> low_freq_factor;
  std::optional<double> high_freq_factor;

  /// rotary_dim with 0 resolved to head_dim.
  int effective_rotary_dim() const { return rotary_dim == 0 ? head_dim : rotary_dim; }
  bool operator==(const RopeParams&) const = default;
};

/// One entry of the registry.
struct RopeScaling {
  std::string_view name;     ///< the rope_type string checkpoints carry
  std::string_view summary;  ///< one line for --help and `posenc inspect`
  /// True when the result depends on the current sequence length (dynamic,
  /// longrope): callers must recompute (and a KV cache re-rotate or refuse)
  /// when the length changes.
  bool depends_on_seq_len;
  /// Computes the frequencies. seq_len: the current sequence length, when the
  /// method uses it. Throws ConfigError naming the field for missing or
  /// out-of-range parameters.
  RopeFrequencies (*compute)(const RopeParams& params, std::optional<int64_t> seq_len);
};

/// All registered methods, in a stable order.
std::span<const RopeScaling> rope_scalings();

/// The method for `rope_type`. Throws ConfigError("rope_type: unknown ... (got X);
/// known: ...") for an unknown name.
const RopeScaling& find_rope_scaling(std::string_view rope_type);

/// Looks up params.rope_type and computes its frequencies. Validates
/// head_dim/rotary_dim/rope_theta first (ConfigError naming the field).
RopeFrequencies compute_rope_frequencies(const RopeParams& params,
                                         std::optional<int64_t> seq_len = std::nullopt);

}  // namespace posenc
