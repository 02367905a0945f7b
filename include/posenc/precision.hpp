// posenc — what the dtype of each stage of RoPE's cos/sin costs, by position:
// the error of the cos/sin table and of the rotated q·k score of every
// precision mode against the fp64 reference, and the first position at which
// distinct positions collapse onto the same table row (`posenc precision`).
//
// Modes are RopeNumerics presets (rope.hpp): the AnglePrecision modes plus
// single-stage variants, each with the public bug reports of engines that
// shipped it. All errors are measured against rope_cos_sin_f64 (inv_freq,
// angle, cos/sin and attention_factor in double).
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "posenc/rope.hpp"

namespace posenc {

/// A named RopeNumerics: what it models and where engines did it.
///  - name: "float32", "exact", "fp64", "bf16", "fp16" (the AnglePrecision
///    modes) or a single-stage variant ("bf16-table", "bf16-inv_freq", ...).
///  - sources: URLs of the public issues/PRs, space-separated ("" for the
///    reference modes).
struct RopeNumericsPreset {
  std::string_view name;
  RopeNumerics numerics;
  std::string_view description;
  std::string_view sources;
};

/// Every preset, in a stable order: float32, exact, fp64, bf16, fp16, then the
/// single-stage variants.
std::span<const RopeNumericsPreset> rope_numerics_presets();

/// The preset called `name`. Throws ConfigError naming `field`, the value and
/// the known names.
const RopeNumericsPreset& find_rope_numerics_preset(std::string_view name, std::string_view field = "mode");

/// What rope_precision_report measures.
///  - first_position, last_position: the range, both inclusive, 0 <= first <= last < 2^40.
///  - samples_per_bucket: positions sampled per bucket for the errors (all of
///    them when the bucket is smaller), evenly spaced, both ends included.
///  - heads: random (q, k) pairs per sampled position (unit vectors of
///    head_dim float32 values, normal then normalised, seeded with `seed`).
///  - deltas: the score is q rotated at p against k rotated at p - delta
///    (pairs with p - delta < 0 are skipped).
///  - modes: preset names (empty: all of rope_numerics_presets() except fp64).
///  - layout: the pairing used for the q·k rotation (errors barely depend on it).
///  - scan_collisions: also scan every position of the range for collisions.
struct PrecisionOptions {
  int64_t first_position = 0;
  int64_t last_position = int64_t{1} << 20;
  int samples_per_bucket = 256;
  int heads = 4;
  std::vector<int64_t> deltas{0, 1, 16, 256, 4096};
  std::vector<std::string> modes;
  RopeLayout layout = RopeLayout::half;
  uint64_t seed = 18;
  bool scan_collisions = true;
};

/// Errors of one mode over one position bucket [lo, hi] (inclusive), against
/// fp64. cos_sin: |table - fp64| over cos and sin of every pair of every
/// sampled position. score: |q·k - fp64 q·k| over heads x deltas x sampled
/// positions, with q·k in double of the float32 rotation by the mode's table
/// (apply_rope's arithmetic) and the reference rotating in double by the fp64
/// cos/sin; q and k are unit vectors, so |q·k| <= attention_factor^2.
/// non_finite: table entries that are inf/NaN (fp16 positions above 65504);
/// they are left out of the max/mean and counted here (max/mean are NaN, null
/// in JSON, when no finite entry is left).
struct PrecisionBucket {
  int64_t lo = 0, hi = 0;
  int64_t positions = 0;  ///< sampled positions
  double cos_sin_max = 0, cos_sin_mean = 0;
  double score_max = 0, score_mean = 0;
  int64_t non_finite = 0;
};

/// One mode's figures.
///  - first_collision: the first position p of the range (p > first) whose
///    table row -- cos and sin of every pair, as stored -- is bit-identical to
///    row p-1's. Each stage rounds monotonically, so every pair's angle is
///    non-decreasing in p and this is the first pair of distinct positions that
///    collapse (absent when no collision in the range, or when not scanned).
///  - collisions: positions p in (first, last] whose row equals row p-1's
///    (positions the mode cannot tell from their predecessor).
///  - position_limit: the first position the mode's position dtype cannot
///    hold exactly, 2^m + 1 for m significant bits: 257 (bf16), 2049 (f16),
///    16777217 (f32), none for f64 (2^53 + 1, beyond any range).
struct PrecisionMode {
  std::string name;
  RopeNumerics numerics;
  std::string description;
  std::string sources;
  std::vector<PrecisionBucket> buckets;
  std::optional<int64_t> first_collision;
  int64_t collisions = 0;
  bool scanned = false;
  std::optional<int64_t> position_limit;
};

struct PrecisionReport {
  RopeFrequencies freqs;  ///< the frequencies measured (inv_freq_f64 filled)
  PrecisionOptions options;
  std::vector<PrecisionMode> modes;
};

/// The position buckets of [first, last]: [first, 15] when first < 16, then
/// powers of two [2^k, 2^(k+1) - 1], clipped to the range.
std::vector<std::pair<int64_t, int64_t>> precision_buckets(int64_t first, int64_t last);

/// Runs the measurements. freqs must carry inv_freq_f64 (compute_rope_frequencies
/// fills it). Throws InvalidArgument for an empty inv_freq_f64, a bad range,
/// heads < 1 or > 1024, samples_per_bucket < 2, a negative delta; ConfigError
/// for an unknown mode name.
PrecisionReport rope_precision_report(const RopeFrequencies& freqs, const PrecisionOptions& options);

/// The first positions p (p > first) in [first, last] whose row under
/// `numerics` is bit-identical to row p-1's, at most `limit` of them, with the
/// total count in *count when given. Rows are compared on the highest-frequency
/// pair first and in full only where that pair collides. Throws InvalidArgument for a bad range or frequencies
/// that RopeFrequencies::validate refuses.
std::vector<int64_t> rope_row_collisions(const RopeFrequencies& freqs, const RopeNumerics& numerics, int64_t first,
                                         int64_t last, std::size_t limit, int64_t* count = nullptr);

/// The report as a text table: per bucket, the max |cos/sin error| of each
/// mode; then the max |q·k error|; then the collisions.
std::string format_precision_report(const PrecisionReport& report);

/// The report as JSON text (schema "posenc.precision/1"): frequencies, options,
/// and per mode its numerics, sources, buckets and collisions.
std::string precision_report_json(const PrecisionReport& report);

}  // namespace posenc
