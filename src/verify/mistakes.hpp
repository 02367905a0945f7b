// Internal: the catalogue of known RoPE mistakes behind `posenc verify`
// (mistakes.cpp): each entry names the mistake, cites the public report it
// comes from, and re-computes the engine's computation with the mistake
// applied, as one or more RopeVariants (a variant = frequencies, numerics,
// layout and positions; verify.cpp turns it into inv_freq, cos/sin and q/k).
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "posenc/rope.hpp"
#include "posenc/scaling.hpp"

namespace posenc::detail {

/// One way of computing RoPE: what the reference does, or a mistake.
struct RopeVariant {
  std::string detail;  ///< the variant's parameter ("offset +3"), "" for the only form
  RopeFrequencies freqs;
  RopeNumerics numerics;
  RopeLayout layout = RopeLayout::half;
  /// Positions each batch row is rotated at ([rows][tokens]); the dump's when
  /// the mistake leaves them alone.
  std::vector<std::vector<int64_t>> positions;
};

/// What a mistake is applied to.
struct MistakeContext {
  RopeParams params;                                  ///< the config's
  RopeLayout layout = RopeLayout::half;               ///< the config's
  RopeFrequencies reference;                          ///< in effect for this dump (after the schedule)
  std::vector<std::vector<int64_t>> positions;        ///< the dump's position ids per row ([1][P] for a lone table)
  std::vector<int64_t> all_positions;                 ///< flattened, for the frequency schedule

  /// The reference computation (the base every mistake modifies).
  RopeVariant base() const;
  /// Frequencies of other params, through RopeFrequencySchedule over all_positions
  /// (as the reference). Throws ConfigError when the params are invalid.
  RopeFrequencies scheduled(const RopeParams& p) const;
};

struct RopeMistake {
  std::string_view id;
  std::string_view title;
  std::string_view report;  ///< URL of the public bug report, or "no public report found: ..."
  /// The variants; empty when the mistake cannot apply to this config
  /// (`why_not` then says why).
  std::vector<RopeVariant> (*variants)(const MistakeContext& ctx, std::string& why_not);
};

/// The catalogue, in a stable order.
std::span<const RopeMistake> rope_mistakes();

/// Llama-3 inverse frequencies with one of the wrong forms of the band rule
/// (for the catalogue and its tests): 0 = the reference (HF
/// _compute_llama3_parameters, float32), 1 = every band divided by factor,
/// 2 = smooth factor linear in wavelength instead of orig/wavelength,
/// 3 = factor hard-coded to 8.
std::vector<float> llama3_inv_freq_variant(const RopeParams& p, int form);
/// YaRN inverse frequencies with knobs (0/false = the reference, HF
/// _compute_yarn_parameters): ramp_over_channels evaluates the ramp at the
/// channel index 2i instead of the pair index i; flip_truncate inverts the
/// config's truncate.
std::vector<float> yarn_inv_freq_variant(const RopeParams& p, bool ramp_over_channels, bool flip_truncate);

}  // namespace posenc::detail
