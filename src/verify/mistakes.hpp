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

/// Llama-3 inverse frequencies with the band rule's smooth factor either as
/// the reference (HF _compute_llama3_parameters, float32; wavelength_smooth
/// false) or linear in wavelength instead of orig/wavelength (true). The
/// mistakes that only change a parameter (factor hard-coded to 8, every band
/// divided by factor) are computed by the library itself.
std::vector<float> llama3_inv_freq_variant(const RopeParams& p, bool wavelength_smooth);
/// YaRN inverse frequencies (HF _compute_yarn_parameters) with the ramp
/// evaluated at the channel index 2i instead of the pair index i when
/// ramp_over_channels (false: the reference). "truncate ignored" needs no
/// formula of its own: it is the library's YaRN with truncate flipped.
std::vector<float> yarn_inv_freq_variant(const RopeParams& p, bool ramp_over_channels);

}  // namespace posenc::detail
