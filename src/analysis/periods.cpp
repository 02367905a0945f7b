// Per-channel RoPE periods, wrap counts and the `posenc inspect` channel table.
#include <algorithm>
#include <charconv>
#include <cmath>
#include <limits>
#include <numbers>

#include <fmt/format.h>

#include "posenc/analysis.hpp"
#include "posenc/error.hpp"

namespace posenc {

int64_t parse_context_length(std::string_view text, std::string_view field) {
  auto bad = [&](std::string_view why) -> int64_t {
    throw ConfigError(fmt::format("{}: {} (got '{}'; a positive integer, optionally with K = 1024 "
                                  "or M = 1048576, e.g. 128K)",
                                  field, why, text));
  };
  if (text.empty()) return bad("empty length");
  int64_t mult = 1;
  std::string_view digits = text;
  const char last = text.back();
  if (last == 'K' || last == 'k') mult = 1024;
  if (last == 'M' || last == 'm') mult = 1024 * 1024;
  if (mult != 1) digits.remove_suffix(1);
  if (digits.empty()) return bad("missing number");
  int64_t value = 0;
  for (char c : digits) {
    if (c < '0' || c > '9') return bad("not a positive integer length");
    value = value * 10 + (c - '0');
    if (value > (int64_t{1} << 53)) return bad("too large");
  }
  value *= mult;
  if (value <= 0) return bad("must be > 0");
  if (value > (int64_t{1} << 53)) return bad("too large");
  return value;
}

double parse_number(std::string_view text, std::string_view field) {
  double v = 0;
  const char* end = text.data() + text.size();
  auto [ptr, ec] = std::from_chars(text.data(), end, v);
  if (text.empty() || ec != std::errc() || ptr != end || !std::isfinite(v))
    throw ConfigError(fmt::format("{}: not a finite number (got '{}')", field, text));
  return v;
}

std::string format_context_length(int64_t length) {
  constexpr int64_t M = 1024 * 1024;
  if (length > 0 && length % M == 0) return fmt::format("{}M", length / M);
  if (length > 0 && length % 1024 == 0) return fmt::format("{}K", length / 1024);
  return fmt::format("{}", length);
}

std::vector<double> rope_wavelengths(const RopeFrequencies& freqs) {
  std::vector<double> out;
  out.reserve(freqs.inv_freq.size());
  for (float f : freqs.inv_freq)
    out.push_back(f > 0 ? 2.0 * std::numbers::pi / static_cast<double>(f)
                        : std::numeric_limits<double>::infinity());
  return out;
}

RopeInspection inspect_rope(const RopeParams& params, int64_t original_length,
                            int64_t target_length) {
  if (original_length <= 0)
    fail_field<ConfigError>("original_length", "must be > 0", original_length);
  if (target_length <= 0) fail_field<ConfigError>("seq_len", "must be > 0", target_length);
  RopeInspection out;
  out.original_length = original_length;
  out.target_length = target_length;
  out.frequencies = compute_rope_frequencies(params, target_length);
  RopeParams plain;
  plain.rope_type = "default";
  plain.rope_theta = params.rope_theta;
  plain.head_dim = params.head_dim;
  plain.rotary_dim = params.effective_rotary_dim();
  out.unscaled = compute_rope_frequencies(plain);
  const auto wl = rope_wavelengths(out.frequencies);
  const auto wl0 = rope_wavelengths(out.unscaled);
  out.channels.resize(wl.size());
  for (std::size_t i = 0; i < wl.size(); ++i) {
    ChannelInfo& c = out.channels[i];
    c.i = static_cast<int>(i);
    c.inv_freq = out.frequencies.inv_freq[i];
    c.wavelength = wl[i];
    c.rotations_original = static_cast<double>(original_length) / wl[i];
    c.rotations_target = static_cast<double>(target_length) / wl[i];
    c.wavelength_ratio = wl[i] / wl0[i];
  }
  return out;
}

RopeInspection inspect_rope(const PositionalSpec& spec, std::optional<int64_t> seq_len) {
  if (!spec.rope)
    throw ConfigError(fmt::format("{}: family {} has no RoPE frequencies to inspect", spec.source,
                                  to_string(spec.family)));
  const RopeParams& p = *spec.rope;
  const std::optional<int64_t> original =
      p.original_max_position_embeddings ? p.original_max_position_embeddings
                                         : spec.max_position_embeddings;
  if (!original)
    throw ConfigError(fmt::format(
        "{}: max_position_embeddings: unknown, so the original context is unknown", spec.source));
  const std::optional<int64_t> target = seq_len ? seq_len : spec.max_position_embeddings;
  if (!target)
    throw ConfigError(fmt::format(
        "{}: seq_len: not given and max_position_embeddings unknown", spec.source));
  try {
    return inspect_rope(p, *original, *target);
  } catch (const Error& e) {
    throw ConfigError(fmt::format("{}: {}", spec.source, e.what()));
  }
}

WrapCount count_wrapped(const RopeFrequencies& freqs, int64_t length) {
  if (length <= 0) fail_field<ConfigError>("length", "must be > 0", length);
  WrapCount w;
  w.length = length;
  const auto wl = rope_wavelengths(freqs);
  for (std::size_t i = 0; i < wl.size(); ++i) {
    if (wl[i] < static_cast<double>(length)) {
      ++w.wrapped;
    } else {
      ++w.unwrapped;
      w.unwrapped_channels.push_back(static_cast<int>(i));
    }
  }
  return w;
}

void PeriodsRequest::validate() const {
  if (head_dim <= 0 || head_dim % 2 != 0)
    fail_field<ConfigError>("head_dim", "must be a positive even number", head_dim);
  if (rotary_dim < 0 || rotary_dim % 2 != 0 || rotary_dim > head_dim)
    throw ConfigError(fmt::format("rotary_dim: must be even and <= head_dim {} (got {})",
                                  head_dim, rotary_dim));
  if (rope_thetas.empty()) throw ConfigError("rope_theta: at least one value is required");
  for (double t : rope_thetas)
    if (!std::isfinite(t) || t <= 0)
      fail_field<ConfigError>("rope_theta", "must be finite and > 0", t);
  if (lengths.empty()) throw ConfigError("lengths: at least one length is required");
  for (int64_t l : lengths)
    if (l <= 0) fail_field<ConfigError>("lengths", "must be > 0", l);
  for (const auto& rt : rope_types) {
    (void)find_rope_scaling(rt);  // unknown → ConfigError listing the registry
    if (rt == "longrope")
      throw ConfigError(
          "rope_scaling: longrope needs per-channel short_factor/long_factor from a config "
          "(use `posenc inspect --config`) (got longrope)");
    if (rt != "default" && !factor)
      throw ConfigError(fmt::format("factor: required for rope_scaling '{}'", rt));
    if ((rt == "dynamic" || rt == "yarn" || rt == "llama3") && !original_max_position_embeddings)
      throw ConfigError(
          fmt::format("original_max_position_embeddings: required for rope_scaling '{}'", rt));
  }
  if (factor && (!std::isfinite(*factor) || *factor <= 0))
    fail_field<ConfigError>("factor", "must be finite and > 0", *factor);
  if (original_max_position_embeddings && *original_max_position_embeddings <= 0)
    fail_field<ConfigError>("original_max_position_embeddings", "must be > 0",
                            *original_max_position_embeddings);
  if (!(low_freq_factor > 0) || !(high_freq_factor > low_freq_factor))
    throw ConfigError(fmt::format(
        "high_freq_factor: must be > low_freq_factor > 0 (got low {}, high {})", low_freq_factor,
        high_freq_factor));
}

RopeParams periods_params(const PeriodsRequest& request, double rope_theta,
                          std::string_view rope_type) {
  RopeParams p;
  p.rope_type = std::string(rope_type);
  p.rope_theta = rope_theta;
  p.head_dim = request.head_dim;
  p.rotary_dim = request.rotary_dim == 0 ? request.head_dim : request.rotary_dim;
  if (rope_type != "default") {
    p.factor = request.factor;
    p.original_max_position_embeddings = request.original_max_position_embeddings;
    p.max_position_embeddings = request.original_max_position_embeddings;
  }
  if (rope_type == "llama3") {
    p.low_freq_factor = request.low_freq_factor;
    p.high_freq_factor = request.high_freq_factor;
  }
  return p;
}

namespace {
std::vector<std::string> types_of(const PeriodsRequest& r) {
  if (r.rope_types.empty()) return {"default"};
  return r.rope_types;
}
}  // namespace

std::vector<PeriodRow> periods_table(const PeriodsRequest& request) {
  request.validate();
  std::vector<PeriodRow> rows;
  for (double theta : request.rope_thetas)
    for (const auto& rt : types_of(request))
      for (int64_t length : request.lengths) {
        const RopeFrequencies f =
            compute_rope_frequencies(periods_params(request, theta, rt), length);
        WrapCount w = count_wrapped(f, length);
        rows.push_back(PeriodRow{theta, request.head_dim, rt, length, w.wrapped, w.unwrapped,
                                 std::move(w.unwrapped_channels)});
      }
  return rows;
}

std::vector<PeriodCurve> period_curves(const PeriodsRequest& request) {
  request.validate();
  const int64_t longest = *std::max_element(request.lengths.begin(), request.lengths.end());
  std::vector<PeriodCurve> curves;
  for (double theta : request.rope_thetas)
    for (const auto& rt : types_of(request)) {
      const RopeFrequencies f =
          compute_rope_frequencies(periods_params(request, theta, rt), longest);
      curves.push_back(PeriodCurve{theta, rt, longest, rope_wavelengths(f)});
    }
  return curves;
}

}  // namespace posenc
