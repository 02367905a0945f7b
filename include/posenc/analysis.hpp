// posenc — analysis of positional encodings: per-channel RoPE periods and
// wrap-around, what a scaling method changes per channel, RoFormer's
// long-term decay bound, ALiBi slopes of a parsed spec, and the bridge to the
// matplotlib scripts under scripts/.
//
// Units: a channel pair's wavelength (period) is in tokens, 2π / inv_freq_i;
// rotations over a length L are L / wavelength = L · inv_freq_i / (2π).
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "posenc/config.hpp"
#include "posenc/rope.hpp"
#include "posenc/scaling.hpp"

namespace posenc {

// ---------------------------------------------------------------------------
// Context lengths.

/// Parses a context length: a positive integer with an optional binary
/// suffix, K = 1024 or M = 1048576 (either case). "128K" = 131072,
/// "1M" = 1048576, "4096" = 4096. Throws ConfigError naming `field` and the
/// text for anything else (empty, negative, zero, fraction, unknown suffix,
/// overflow past 2^53).
int64_t parse_context_length(std::string_view text, std::string_view field);

/// Parses a finite decimal number ("10000", "5e5", "0.25"); the whole text
/// must be consumed. Throws ConfigError naming `field` and the text.
double parse_number(std::string_view text, std::string_view field);

/// The inverse of parse_context_length for display: 131072 → "128K", 1048576 → "1M", 3000 → "3000".
std::string format_context_length(int64_t length);

// ---------------------------------------------------------------------------
// Per-channel periods.

/// wavelength_i = 2π / inv_freq_i in tokens, double, [rotary_dim/2].
/// An inv_freq of 0 gives +infinity (never wraps).
std::vector<double> rope_wavelengths(const RopeFrequencies& freqs);

/// One row of `posenc inspect`'s channel table.
struct ChannelInfo {
  int i = 0;                        ///< channel pair index, 0 = fastest
  double inv_freq = 0;              ///< radians per token (the float32 value, widened)
  double wavelength = 0;            ///< 2π / inv_freq, tokens
  double rotations_original = 0;    ///< original_length / wavelength
  double rotations_target = 0;      ///< target_length / wavelength
  double wavelength_ratio = 1;      ///< wavelength / wavelength of plain RoPE (same theta)
};

struct RopeInspection {
  RopeFrequencies frequencies;  ///< computed by the registry for seq_len = target_length
  RopeFrequencies unscaled;     ///< rope_type "default", same rope_theta/head_dim/rotary_dim
  int64_t original_length = 0;  ///< context the model was trained with
  int64_t target_length = 0;    ///< context being analysed (N)
  std::vector<ChannelInfo> channels;  ///< [rotary_dim/2]
};

/// Per-channel table of `params` over an original and a target length. The
/// frequencies are computed with seq_len = target_length (this matters for
/// the length-dependent methods: dynamic, longrope). Throws ConfigError for
/// bad params (from the registry) or non-positive lengths.
RopeInspection inspect_rope(const RopeParams& params, int64_t original_length,
                            int64_t target_length);

/// The same from a parsed config: original_length =
/// rope.original_max_position_embeddings, else max_position_embeddings;
/// target_length = seq_len, else max_position_embeddings. Throws ConfigError
/// if the spec is not RoPE/MRoPE or a length is unknown.
RopeInspection inspect_rope(const PositionalSpec& spec, std::optional<int64_t> seq_len);

// ---------------------------------------------------------------------------
// Wrap-around: which channels complete at least one period within a length.

struct WrapCount {
  int64_t length = 0;
  int wrapped = 0;    ///< channels with wavelength < length (strictly)
  int unwrapped = 0;  ///< the rest
  std::vector<int> unwrapped_channels;  ///< their indices i, ascending
};

WrapCount count_wrapped(const RopeFrequencies& freqs, int64_t length);

/// A grid of thetas × scalings × lengths for `posenc periods`.
///  - rope_types empty: plain RoPE only, rows carry rope_type "default" and
///    has_rope_type() is false (the CLI then omits the column).
///  - factor: required for every rope_type except "default".
///  - original_max_position_embeddings: required for dynamic, yarn, llama3;
///    it is also used as max_position_embeddings (the threshold of dynamic NTK).
///  - low_freq_factor / high_freq_factor: llama3 only (defaults 1 and 4,
///    Llama 3.1's values).
/// The frequencies of each row are computed with seq_len = the row's length.
/// longrope needs per-channel factors from a config and is refused here.
struct PeriodsRequest {
  int head_dim = 128;
  int rotary_dim = 0;  ///< 0 = head_dim
  std::vector<double> rope_thetas;
  std::vector<int64_t> lengths;
  std::vector<std::string> rope_types;
  std::optional<double> factor;
  std::optional<int64_t> original_max_position_embeddings;
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;

  bool has_rope_type() const { return !rope_types.empty(); }
  /// Throws ConfigError naming the field and the value.
  void validate() const;
};

struct PeriodRow {
  double rope_theta = 0;
  int head_dim = 0;
  std::string rope_type;
  int64_t length = 0;
  int wrapped = 0;
  int unwrapped = 0;
  std::vector<int> unwrapped_channels;
};

/// The RopeParams a request implies for one theta and rope_type.
RopeParams periods_params(const PeriodsRequest& request, double rope_theta,
                          std::string_view rope_type);

/// Rows in the order theta (outer), rope_type, length (inner).
std::vector<PeriodRow> periods_table(const PeriodsRequest& request);

/// Wavelength of each channel for one theta and rope_type, for plotting.
/// seq_len: the longest requested length (matters only for dynamic).
struct PeriodCurve {
  double rope_theta = 0;
  std::string rope_type;
  int64_t seq_len = 0;
  std::vector<double> wavelengths;  ///< [rotary_dim/2], tokens
};
std::vector<PeriodCurve> period_curves(const PeriodsRequest& request);

// ---------------------------------------------------------------------------
// RoFormer long-term decay (Su et al. 2021, §3.4.3, eq. 35-37).
//
// With θ_k = rope_theta^(-2k/d), k = 0..d/2-1, and partial sums
// S_j(r) = Σ_{k<j} e^{i r θ_k}, the relative attention score is bounded by
// (max_j |h_{j+1} - h_j|) · Σ_{j=1}^{d/2} |S_j(r)|. The curve is the paper's
// "relative upper bound" (1/(d/2)) Σ_{j=1}^{d/2} |S_j(r)|, computed in double.
// At r = 0 every term is j, so the bound is (d/2 + 1) / 2 (32.5 for d = 128).

/// θ_k = rope_theta^(-2k/head_dim) in double, [head_dim/2]. Throws
/// ConfigError for an odd/non-positive head_dim or rope_theta <= 0.
std::vector<double> rope_decay_thetas(int head_dim, double rope_theta);

/// (1/n) Σ_{j=1}^{n} |S_j(distance)| for the n = thetas.size() frequencies.
double rope_decay_bound(std::span<const double> thetas, double distance);

/// Distances: every integer 0..min(dense_until, max_distance), then
/// `per_decade` log-spaced integers per factor of 10 up to max_distance
/// (rounded, deduplicated), always ending at max_distance. Ascending.
std::vector<int64_t> decay_grid(int64_t max_distance, int64_t dense_until = 1024,
                                int per_decade = 200);

struct DecayPoint {
  int64_t distance = 0;
  double bound = 0;
};

/// The bound over decay_grid(max_distance). Throws ConfigError for bad input
/// (max_distance must be >= 1).
std::vector<DecayPoint> rope_decay_curve(int head_dim, double rope_theta, int64_t max_distance);

// ---------------------------------------------------------------------------
// ALiBi slopes of a parsed spec.

/// [n_heads] float32 slopes in the spec's convention (see AlibiConvention):
/// bloom → alibi_slopes(n_heads, max_bias) (bias.hpp, double then rounded);
/// mpt → HF build_mpt_alibi_tensor's computation in float32. Equal up to
/// float32 rounding. Throws
/// InvalidArgument for n_heads <= 0 or a non-positive max_bias.
std::vector<float> alibi_slopes_for(const AlibiSpec& alibi, int n_heads);

// ---------------------------------------------------------------------------
// Plots.

/// Runs `python3 script data.json out_png`: writes `data_json` to a temporary
/// file, runs the script (Debian's /usr/bin/python3 when it exists, where
/// python3-matplotlib lives, else python3 from PATH), removes the temporary
/// file. The scripts write the PNG to a temporary file next to out_png and
/// rename it, so out_png is never partial. Throws IoError with the script's
/// stderr when it fails.
void render_plot(const std::filesystem::path& script, std::string_view data_json,
                 const std::filesystem::path& out_png);

}  // namespace posenc
