// posenc — `posenc verify`: checks the RoPE of another engine against posenc's
// reference for a model config and, when they differ, says which known mistake
// the engine's tensors match.
//
// Input: a reference (a config.json, or a bare rope_scaling object carrying
// head_dim and rope_theta) and the arrays an engine dumped (TensorDump: .npy,
// .npz, safetensors; see tensor_dump.hpp):
//   q, q_rope        query before / after RoPE (required, unless only cos/sin/inv_freq are given)
//   k, k_rope        key before / after RoPE (optional; may have fewer heads: GQA)
//   position_ids     the positions the engine was asked to use (required with q/k)
//   cos, sin         a cos/sin table, [positions, rotary_dim] or [positions,
//                    rotary_dim/2] (leading axes of size 1 dropped; HF's
//                    [batch, tokens, rotary_dim] is read as batch*tokens rows)
//   inv_freq         [rotary_dim/2]
// q/k axis order (VerifyOptions::dump_layout):
//   tokens_heads_dim        [tokens, heads, head_dim], position_ids [tokens] (or [1, tokens])
//   batch_heads_tokens_dim  [batch, heads, tokens, head_dim] (HF's after transpose(1, 2)),
//                           position_ids [batch, tokens] (or [tokens], shared by the rows)
// Element types f64/f32/f16/bf16 (integers for position_ids).
//
// The reference is Hugging Face's: frequencies from compute_rope_frequencies
// through RopeFrequencySchedule::update over every position id of the dump
// (so dynamic NTK and LongRoPE are evaluated at max(position_ids)+1 as HF's
// forward does), cos/sin in float32 (AnglePrecision::float32), the rotation of
// apply_rope in the config's layout.
//
// Tolerance (the rule; override with VerifyOptions::tolerance_factor):
//   u = unit roundoff of the compared array's dtype: 2^-24 for f32 (and f64,
//       whose engine agrees with a float32 reference only to float32), 2^-11
//       for f16, 2^-8 for bf16;
//   q_rope, k_rope: |dump - expected| <= 8 u max(1, attention_factor) max|q|
//       (three rounded operations per element in the engine's dtype, one ulp of
//       cos/sin each side, twice over for safety);
//   cos, sin:       |dump - expected| <= 8 u max(1, attention_factor);
//   inv_freq:       |dump/expected - 1| <= 8 * 2^-24 whatever its dtype: every
//       reference keeps inv_freq in float32, so one held in bf16/f16 is the
//       mistake "inverse frequencies in bf16", not a tolerance.
// PASS: every array within its tolerance. A hypothesis "matches" when its
// recomputed arrays are within the same tolerances of the dump.
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "posenc/rope.hpp"
#include "posenc/scaling.hpp"
#include "posenc/tensor_dump.hpp"

namespace posenc {

/// Axis order of q, q_rope, k, k_rope in a dump.
enum class DumpLayout { tokens_heads_dim, batch_heads_tokens_dim };
/// "tokens,heads,head_dim" / "batch,heads,tokens,head_dim".
std::string_view to_string(DumpLayout layout);
/// Parses the strings above. Throws ConfigError naming `field` and the value.
DumpLayout parse_dump_layout(std::string_view text, std::string_view field = "--dump-layout");

/// What a dump is checked against.
struct VerifyReference {
  RopeParams params;     ///< typed RoPE parameters (scaling.hpp)
  RopeLayout layout = RopeLayout::half;
  std::string source;    ///< the config file, for messages
  std::vector<std::string> notes;  ///< how layout/rotary width were decided
};

/// Reads a config.json (through parse_positional_spec: text_config, families,
/// every rope_type) or a bare rope_scaling object {"rope_type": ..., "head_dim":
/// 128, "rope_theta": 500000, ...} (optional keys there: rotary_dim,
/// partial_rotary_factor, max_position_embeddings, and every rope_scaling key).
/// `layout` overrides the config's; a config that implies none (an unknown
/// model_type, a bare object) defaults to half (HF's rotate_half) with a note.
/// Throws ConfigError naming the source and field (not RoPE, head_dim missing,
/// the rope_scaling errors of parse_positional_spec); IoError if unreadable.
VerifyReference verify_reference_from_json(std::string_view json_text, std::string_view source,
                                           std::optional<RopeLayout> layout = std::nullopt);
VerifyReference load_verify_reference(const std::filesystem::path& path,
                                      std::optional<RopeLayout> layout = std::nullopt);

struct VerifyOptions {
  DumpLayout dump_layout = DumpLayout::tokens_heads_dim;
  /// Multiplies every tolerance of the rule above (> 0).
  double tolerance_factor = 1.0;
};

/// |dump - expected| of one array.
///  - by_channel: [last axis] (head_dim channels for q/k, table columns for
///    cos/sin, pairs for inv_freq): max and mean over the other axes.
///  - by_position: one entry per token row (batch-major for the batch layout)
///    / table row, with that row's position id; max and mean over heads and channels.
///  - inv_freq errors are relative (|dump/expected - 1|), the others absolute.
struct ArrayError {
  std::string array;
  std::string dtype;       ///< dtype of the dump's array
  bool relative = false;
  double max_abs = 0, mean_abs = 0;
  double tolerance = 0;
  std::vector<double> channel_max, channel_mean;
  std::vector<int64_t> row_position;
  std::vector<double> position_max, position_mean;
  bool within() const { return max_abs <= tolerance; }
};

/// One catalogue entry, re-computed for this dump.
struct VerifyHypothesis {
  std::string id;          ///< catalogue id ("attention_factor_twice")
  std::string title;
  std::string variant;     ///< which form of it fitted best ("offset +3", "table=f16"), may be ""
  std::string report;      ///< URL of the public bug report, or a sentence saying none was found
  double residual = 0;     ///< max |dump - hypothesis| of the primary array
  double score = 0;        ///< max over arrays of error / tolerance (<= 1: matches)
  bool matches() const { return score <= 1.0; }
};

struct VerifyResult {
  bool pass = false;
  std::string source;              ///< the dump
  std::string config;              ///< the reference's source
  /// The array residuals are quoted for: on PASS the first of q_rope, k_rope, cos, sin, inv_freq present; on
  /// FAIL the one furthest from the reference relative to its tolerance.
  std::string primary;
  double reference_residual = 0;   ///< max |dump - reference| of the primary array
  double reference_score = 0;
  std::vector<ArrayError> errors;  ///< dump against the reference, one per compared array
  /// Ranked best first (lowest score), every entry testable on this dump.
  std::vector<VerifyHypothesis> hypotheses;
  /// Entries whose re-computed arrays equal the reference's within tolerance on
  /// this dump (e.g. bf16 positions when every position is < 256), or that do
  /// not apply to the config (LongRoPE swap on a Llama config): id + why.
  std::vector<std::string> untestable;
  std::vector<std::string> notes;
  std::string summary;             ///< one line: PASS ..., or the best hypothesis and both residuals
};

/// Checks the arrays against the reference. Throws DumpError naming the
/// source, the array and the value when a needed array is missing, has the
/// wrong rank or shape (head_dim different from the config's, q_rope's shape
/// not q's, position_ids not matching the tokens), a non-finite value, or a
/// position id that is negative or not an integer; InvalidArgument for a
/// tolerance_factor <= 0.
VerifyResult verify_rope(const VerifyReference& reference, std::span<const DumpArray> arrays,
                         std::string_view source, const VerifyOptions& options = {});
/// Same, on a TensorDump (its arrays and source).
VerifyResult verify_rope(const VerifyReference& reference, const TensorDump& dump,
                         const VerifyOptions& options = {});

/// The human report: verdict, errors by channel and by position (the worst
/// rows), ranked hypotheses with residuals and their bug reports.
std::string format_verify_report(const VerifyResult& result);
/// The same as JSON text (for --json / CI).
std::string verify_result_json(const VerifyResult& result);

/// One entry of the mistake catalogue (src/verify/mistakes.cpp), for listings.
struct RopeMistakeInfo {
  std::string_view id;
  std::string_view title;
  std::string_view report;  ///< bug report URL, or "no public report found: ..."
};
std::vector<RopeMistakeInfo> rope_mistake_catalogue();

}  // namespace posenc
