// Internal: one function per RoPE scaling method (one .cpp each under
// src/encoding/scaling/), registered in src/encoding/scaling.cpp.
#pragma once

#include <optional>
#include <string_view>

#include "posenc/error.hpp"
#include "posenc/scaling.hpp"

namespace posenc::detail {

RopeFrequencies rope_default(const RopeParams& p, std::optional<int64_t> seq_len);
RopeFrequencies rope_linear(const RopeParams& p, std::optional<int64_t> seq_len);
RopeFrequencies rope_ntk(const RopeParams& p, std::optional<int64_t> seq_len);

/// params.factor, required and > 0 (finite). Throws ConfigError naming
/// "<rope_type>.factor".
double require_factor(const RopeParams& p);

}  // namespace posenc::detail
