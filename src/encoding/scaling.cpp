#include "posenc/scaling.hpp"

#include <array>
#include <cmath>

#include <fmt/format.h>

#include "encoding/scaling/methods.hpp"

namespace posenc {

namespace {

// To add a method: write one function in src/encoding/scaling/<name>.cpp,
// declare it in methods.hpp and add one row here.
constexpr std::array kRegistry{
    RopeScaling{"default", "plain RoPE: inv_freq_i = 1/theta^(2i/d)", false, &detail::rope_default},
    RopeScaling{"linear", "position interpolation (Chen et al. 2023): inv_freq / factor", false,
                &detail::rope_linear},
    RopeScaling{"ntk", "static NTK-aware base change: theta * factor^(d/(d-2))", false,
                &detail::rope_ntk},
};

}  // namespace

std::span<const RopeScaling> rope_scalings() { return kRegistry; }

const RopeScaling& find_rope_scaling(std::string_view rope_type) {
  for (const auto& m : kRegistry)
    if (m.name == rope_type) return m;
  std::string known;
  for (const auto& m : kRegistry) known += (known.empty() ? "" : ", ") + std::string(m.name);
  throw ConfigError(fmt::format("rope_type: unknown RoPE scaling '{}' (known: {})", rope_type, known));
}

RopeFrequencies compute_rope_frequencies(const RopeParams& params, std::optional<int64_t> seq_len) {
  const auto& method = find_rope_scaling(params.rope_type);
  if (params.head_dim <= 0) fail_field<ConfigError>("head_dim", "must be positive", params.head_dim);
  const int rd = params.effective_rotary_dim();
  if (rd <= 0 || rd % 2 != 0)
    fail_field<ConfigError>("rotary_dim", "must be a positive even number", rd);
  if (rd > params.head_dim)
    throw ConfigError(
        fmt::format("rotary_dim: must not exceed head_dim {} (got {})", params.head_dim, rd));
  if (!std::isfinite(params.rope_theta) || params.rope_theta <= 0)
    fail_field<ConfigError>("rope_theta", "must be finite and positive", params.rope_theta);
  if (seq_len && *seq_len < 0) fail_field<ConfigError>("seq_len", "must be non-negative", *seq_len);
  RopeFrequencies f = method.compute(params, seq_len);
  f.rope_type = std::string(method.name);
  f.validate();
  return f;
}

namespace detail {

double require_factor(const RopeParams& p) {
  const std::string field = p.rope_type + ".factor";
  if (!p.factor) throw ConfigError(fmt::format("{}: required for rope_type '{}'", field, p.rope_type));
  if (!std::isfinite(*p.factor) || *p.factor <= 0)
    fail_field<ConfigError>(field, "must be finite and > 0", *p.factor);
  return *p.factor;
}

}  // namespace detail
}  // namespace posenc
