// posenc — positional overrides for a loaded model (the CLI's --config,
// --rope-theta, --rope-layout, --angle-precision, --trained-context).
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "posenc/model.hpp"

namespace posenc {

struct PositionalOverrides {
  /// A config.json (its RoPE parameters: rope_theta, rope_scaling /
  /// rope_parameters, partial_rotary_factor, max_position_embeddings) or a bare
  /// rope_scaling object ({"rope_type": "llama3", "factor": 8, ...}; with a
  /// "rope_theta" key it is read as rope_parameters). The layout always stays
  /// the loader's: it is a property of the stored weights, not of the config.
  std::optional<std::filesystem::path> config;
  std::optional<double> rope_theta;            ///< replaces rope_theta (after config)
  std::optional<RopeLayout> layout;
  std::optional<AnglePrecision> precision;
  std::optional<int64_t> trained_context;      ///< replaces the format's trained context
};

/// Applies `o` to `model` in the order config, rope_theta, trained_context,
/// layout, precision, and returns one line per change (for the CLI to print).
/// A config whose head_dim differs from the model's is a ConfigError naming
/// the file; its trained context (rope_scaling.original_max_position_embeddings
/// for a scaled rope_type, else max_position_embeddings) replaces the model's
/// unless trained_context is given. Throws ConfigError (naming "--config",
/// "--rope-theta", "--trained-context", ...) for bad values, or when a RoPE
/// override is given for a model whose positions are not RoPE.
std::vector<std::string> apply_positional_overrides(Model& model, const PositionalOverrides& o);

/// The RoPE parameters a config file or bare rope_scaling object gives for a
/// model with `base` (head_dim, rotary_dim, rope_theta, trained context), and
/// the trained context it implies (0 when it implies none). Throws ConfigError.
std::pair<RopeParams, int64_t> rope_params_from_config(const std::filesystem::path& path, const RopeParams& base,
                                                       int64_t trained_context);

}  // namespace posenc
