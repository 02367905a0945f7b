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
    RopeScaling{"default", "plain RoPE: inv_freq_i = 1/theta^(2i/d)", false, &detail::rope_default<float>, &detail::rope_default<double>},
    RopeScaling{"linear", "position interpolation (Chen et al. 2023): inv_freq / factor", false,
                &detail::rope_linear<float>, &detail::rope_linear<double>},
    RopeScaling{"ntk", "static NTK-aware base change: theta * factor^(d/(d-2))", false,
                &detail::rope_ntk<float>, &detail::rope_ntk<double>},
    RopeScaling{"dynamic",
                "dynamic NTK: theta * (factor*L/max_pos - (factor-1))^(d/(d-2)), "
                "L = max(seq_len, max_position_embeddings)",
                true, &detail::rope_dynamic<float>, &detail::rope_dynamic<double>},
    RopeScaling{"yarn",
                "YaRN (Peng et al. 2023): ramp between interpolated and extrapolated channels "
                "by rotations beta_fast..beta_slow, attention_factor 0.1 ln s + 1",
                false, &detail::rope_yarn<float>, &detail::rope_yarn<double>},
    RopeScaling{"longrope",
                "LongRoPE (Ding et al. 2024, Phi-3): per-channel short/long factors, long when "
                "seq_len > original_max_position_embeddings",
                true, &detail::rope_longrope<float>, &detail::rope_longrope<double>},
    RopeScaling{"llama3",
                "Llama 3.1: low-frequency channels / factor, high kept, medium blended by "
                "wavelength",
                false, &detail::rope_llama3<float>, &detail::rope_llama3<double>},
    RopeScaling{"proportional",
                "proportional (Gemma 4): first partial_rotary_factor*head_dim/2 pairs at "
                "theta^(-2i/head_dim), the rest zero, all / factor",
                false, &detail::rope_proportional<float>, &detail::rope_proportional<double>},
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
  if (!std::isfinite(params.rope_theta) || params.rope_theta <= 0)
    fail_field<ConfigError>("rope_theta", "must be finite and positive", params.rope_theta);
  if (params.partial_rotary_factor) {
    const double f = *params.partial_rotary_factor;
    const bool proportional = params.rope_type == "proportional";
    if (!std::isfinite(f) || f > 1.0 || (proportional ? f < 0.0 : f <= 0.0))
      fail_field<ConfigError>("partial_rotary_factor",
                              proportional ? "must be in [0, 1]" : "must be in (0, 1]", f);
  }
  if (params.rotary_dim < 0)
    fail_field<ConfigError>("rotary_dim", "must be a positive even number (0 = derive)",
                            params.rotary_dim);
  if (seq_len && *seq_len < 0) fail_field<ConfigError>("seq_len", "must be non-negative", *seq_len);
  RopeFrequencies f = method.compute(params, seq_len);
  f.inv_freq_f64 = method.compute_f64(params, seq_len).inv_freq_f64;
  f.rope_type = std::string(method.name);
  f.validate();
  return f;
}

double yarn_get_mscale(double scale, double mscale) {
  if (scale <= 1.0) return 1.0;
  return 0.1 * mscale * std::log(scale) + 1.0;
}

double deepseek_yarn_softmax_scale(int qk_head_dim, const RopeParams& params) {
  if (qk_head_dim <= 0) fail_field<ConfigError>("qk_head_dim", "must be positive", qk_head_dim);
  // HF: self.scaling = self.qk_head_dim ** (-0.5)
  double scale = std::pow(static_cast<double>(qk_head_dim), -0.5);
  if (params.rope_type != "default") {
    const double mscale_all_dim = params.mscale_all_dim.value_or(0.0);
    if (!std::isfinite(mscale_all_dim))
      fail_field<ConfigError>("rope_scaling.mscale_all_dim", "must be finite", mscale_all_dim);
    if (mscale_all_dim != 0.0) {
      const double factor = detail::require_factor(params);
      const double m = yarn_get_mscale(factor, mscale_all_dim);
      scale = scale * m * m;
    }
  }
  return scale;
}

namespace detail {

double require_factor(const RopeParams& p) {
  if (!p.factor)
    throw ConfigError(
        fmt::format("rope_scaling.factor: required for rope_type '{}' (missing)", p.rope_type));
  if (!std::isfinite(*p.factor) || *p.factor <= 0)
    fail_field<ConfigError>("rope_scaling.factor", "must be finite and > 0", *p.factor);
  return *p.factor;
}

std::optional<double> optional_positive(const std::optional<double>& v, std::string_view field) {
  if (!v) return std::nullopt;
  if (!std::isfinite(*v) || *v <= 0)
    fail_field<ConfigError>(fmt::format("rope_scaling.{}", field), "must be finite and > 0", *v);
  return v;
}

double require_positive(const RopeParams& p, const std::optional<double>& v, std::string_view field) {
  if (!v)
    throw ConfigError(fmt::format("rope_scaling.{}: required for rope_type '{}' (missing)", field,
                                  p.rope_type));
  return *optional_positive(v, field);
}

int64_t require_max_position_embeddings(const RopeParams& p) {
  if (!p.max_position_embeddings)
    throw ConfigError(fmt::format("max_position_embeddings: required for rope_type '{}' (missing)",
                                  p.rope_type));
  if (*p.max_position_embeddings <= 0)
    fail_field<ConfigError>("max_position_embeddings", "must be positive",
                            *p.max_position_embeddings);
  return *p.max_position_embeddings;
}

double factor_or_context_ratio(const RopeParams& p, int64_t original) {
  if (p.factor) return require_factor(p);
  if (!p.max_position_embeddings)
    throw ConfigError(fmt::format(
        "rope_scaling.factor: required for rope_type '{}' (missing, and no max_position_embeddings to derive it from)",
        p.rope_type));
  return static_cast<double>(require_max_position_embeddings(p)) / static_cast<double>(original);
}

int64_t original_max_position(const RopeParams& p) {
  if (p.original_max_position_embeddings) {
    if (*p.original_max_position_embeddings <= 0)
      fail_field<ConfigError>("rope_scaling.original_max_position_embeddings", "must be positive",
                              *p.original_max_position_embeddings);
    return *p.original_max_position_embeddings;
  }
  if (!p.max_position_embeddings)
    throw ConfigError(fmt::format(
        "rope_scaling.original_max_position_embeddings: required for rope_type '{}' (missing, and "
        "no max_position_embeddings to default to)",
        p.rope_type));
  return require_max_position_embeddings(p);
}

int resolve_rotary_dim(const RopeParams& p) {
  const int rd = p.effective_rotary_dim();
  if (p.rotary_dim != 0 && p.partial_rotary_factor) {
    const int from_factor = static_cast<int>(p.head_dim * *p.partial_rotary_factor);
    if (from_factor != p.rotary_dim)
      throw ConfigError(fmt::format(
          "rotary_dim: {} disagrees with partial_rotary_factor {} * head_dim {} = {}",
          p.rotary_dim, *p.partial_rotary_factor, p.head_dim, from_factor));
  }
  const std::string_view field = p.rotary_dim == 0 && p.partial_rotary_factor
                                     ? std::string_view("rotary_dim (head_dim * partial_rotary_factor)")
                                     : std::string_view("rotary_dim");
  if (rd < 2 || rd % 2 != 0) fail_field<ConfigError>(field, "must be a positive even number", rd);
  if (rd > p.head_dim)
    throw ConfigError(fmt::format("{}: must not exceed head_dim {} (got {})", field, p.head_dim, rd));
  return rd;
}

RopeFrequencies make_frequencies(int head_dim, int rotary_dim, std::vector<float> inv_freq,
                                 double attention_factor) {
  RopeFrequencies f;
  f.head_dim = head_dim;
  f.rotary_dim = rotary_dim;
  f.inv_freq = std::move(inv_freq);
  f.attention_factor = attention_factor;
  return f;
}

RopeFrequencies make_frequencies(int head_dim, int rotary_dim, std::vector<double> inv_freq,
                                 double attention_factor) {
  std::vector<float> narrow(inv_freq.size());
  for (std::size_t i = 0; i < inv_freq.size(); ++i) narrow[i] = static_cast<float>(inv_freq[i]);
  RopeFrequencies f = make_frequencies(head_dim, rotary_dim, std::move(narrow), attention_factor);
  f.inv_freq_f64 = std::move(inv_freq);
  return f;
}

}  // namespace detail
}  // namespace posenc
