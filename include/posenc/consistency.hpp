// posenc — the position-consistency checker: proves on a real checkpoint that
// the KV cache and the batched runtime keep position semantics intact.
//
// Every scenario computes logits along an incremental / batched / cached path
// and compares them with the logits of one full forward over the same tokens
// (a fresh sequence at positions 0..n-1), reporting max |Δlogit|. Every size a
// scenario uses (chunks, prompt lengths, fork point, window, block size) is
// derived from the sequence length n (consistency_plan), and n defaults to the
// model's trained context (default_consistency_length), so the checker fits
// a model trained at 64 tokens as well as one trained at 8192.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "posenc/model.hpp"

namespace posenc {

struct ConsistencyScenario {
  std::string name;
  double max_abs_logit_diff = 0.0;
  int64_t tokens = 0;     ///< logit rows compared
  std::string reference;  ///< what the path is compared with
  /// Non-empty when a position invariant was violated (e.g. a cached token's
  /// position id differs from its index in the sequence, or eviction left more
  /// tokens than the window): the scenario fails whatever the logits say.
  std::string failure;
  /// Non-empty when the scenario does not apply to the model (why, e.g.
  /// "context shift re-rotates RoPE keys; this model uses alibi positions"):
  /// it was not run, and neither passes nor fails the report.
  std::string skipped;
  /// The drift of a RoPE change policy other than the one checked: reported,
  /// never judged (ok() is true whatever the difference).
  bool informational = false;
  /// What happened on the path (e.g. "4 re-prefills, 92 tokens re-run", "refused
  /// at length 129 (CacheError), nothing appended").
  std::string note;
  /// KV cache in f16/bf16 (ConsistencyReport::kv_dtype): the max |Δlogit| between the scenario's reference full
  /// forward(s) with k/v stored in that dtype and the same forward(s) with a float32 cache, i.e. what the
  /// rounding alone costs on these tokens (0 for f32: nothing is rounded).
  double kv_rounding = 0.0;
  /// How many times the path rounds a cached key to the dtype: 1 (stored once), 2 for context_shift (rotated
  /// by the shift and rounded again), 1 + the re-rotations for the rerotate RoPE change policy.
  int64_t kv_roundings = 1;
  /// The bound max_abs_logit_diff (against the float32 full forward) is judged by:
  /// tolerance + kKvRoundingMargin x kv_roundings x kv_rounding (see there); `tolerance` for a float32 cache.
  double tolerance_for(double tolerance) const;
  bool ok(double tolerance) const {
    return !skipped.empty() || informational || (failure.empty() && max_abs_logit_diff <= tolerance_for(tolerance));
  }
};

/// The tolerance for an f16/bf16 KV cache, per rounding of the cached keys, in units of the scenario's own
/// kv_rounding. Derivation: a correct path stores every key and value once, rounded exactly as the reference
/// forward with the same dtype does, so it reads the same values and differs from that forward by float32 path
/// noise only (<= tolerance), hence from the float32 forward by <= kv_rounding + tolerance (measured on
/// stories260K and TinyStories-656K at length 512: equal to kv_rounding within 2e-5 in every such scenario, f16
/// and bf16). A key rotated again (context shift, rerotate) is rounded once more, an error of the same size:
/// k roundings bound it by k x kv_rounding in the linear regime (measured for context_shift: 1.25 to 1.93 x
/// kv_rounding). 1.5 leaves room for the non-linearity of the layers above the first. A bookkeeping bug (a wrong
/// position, a lost or doubled key) moves logits by far more and still fails (tested under bf16).
inline constexpr double kKvRoundingMargin = 1.5;
inline double ConsistencyScenario::tolerance_for(double tolerance) const {
  return tolerance + kKvRoundingMargin * static_cast<double>(kv_roundings) * kv_rounding;
}

/// The sizes the scenarios use for a sequence length n (all in tokens; every
/// sequence a scenario compares is at most n long, so it stays inside a
/// learned position table of n rows).
struct ConsistencyPlan {
  int64_t length = 0;                        ///< n
  int block_size = 0;                        ///< KV cache block size
  std::vector<int64_t> chunk_sizes;          ///< chunked_prefill_<c>, ascending, without 1 (token_by_token)
  std::vector<int64_t> padded_first;         ///< left_padded_batch: the 4 prompts' first step
  std::vector<int64_t> padded_second;        ///< ... their continuation (second padded step)
  int64_t padded_decode_steps = 0;           ///< ... then decode steps for all 4 together
  std::vector<int64_t> padded_offsets;       ///< ... where each prompt starts in the stream
  std::vector<int64_t> ragged_totals;        ///< ragged_batch: each sequence's length
  std::vector<int64_t> ragged_first;         ///< ... its first (prefill) step
  std::vector<int64_t> ragged_strides;       ///< ... tokens per later step
  int64_t fork_prefix = 0;                   ///< prefix_reuse_fork: shared prefix P (not a multiple of the block size)
  int64_t fork_suffix = 0;                   ///< ... each suffix's length n - P
  std::vector<int64_t> fork_suffix_offsets;  ///< ... where each of the 4 suffixes starts in the stream
  int64_t shift_offset = 0;                  ///< context_shift: the first half prefilled at positions offset..
  int64_t sliding_window = 0;                ///< sliding_window_eviction_<w>
  int64_t stream_tokens = 0;                 ///< tokens of the stream the scenarios read (3n)
};

struct ConsistencyReport {
  std::vector<ConsistencyScenario> scenarios;
  ConsistencyPlan plan;
  PositionFamily family = PositionFamily::rope;
  int64_t trained_context = 0;  ///< the model's
  /// Length-dependent RoPE (dynamic, longrope): the method, its switch point
  /// (rope_switch_point) and the policy checked; "" / 0 otherwise.
  std::string rope_type;
  int64_t rope_switch_point = 0;
  RopeChangePolicy rope_change_policy = RopeChangePolicy::recompute;
  double tolerance = 1e-4;
  bool passed = false;  ///< every scenario ok(tolerance)
  /// The element type of the checked paths' KV caches (the model's kv_cache_dtype()); the references are always
  /// full forwards with a float32 cache.
  KvCacheDtype kv_dtype = KvCacheDtype::f32;
};

/// The shortest sequence length the scenarios fit in.
inline constexpr int64_t kMinConsistencyLength = 16;
/// The longest (bounds the tokens the checker reads: 3 * n).
inline constexpr int64_t kMaxConsistencyLength = int64_t{1} << 20;

struct ConsistencyOptions {
  int64_t length = 0;               ///< tokens per sequence; 0 = default_consistency_length(model)
  std::vector<int64_t> chunk_sizes;  ///< empty = the plan's {7, n/8, n}
  int block_size = 0;               ///< KV cache block size; 0 = clamp(n/8, 2, 16)
  int64_t sliding_window = 0;       ///< window of the eviction scenario; 0 = max(2, n/8)
  double tolerance = 1e-4;
  /// Length-dependent RoPE: the policy the rope_change scenarios judge (the
  /// other policies' drift is reported as informational scenarios).
  RopeChangePolicy rope_change_policy = RopeChangePolicy::recompute;
  /// Chunk size of the rope_change chunked scenarios; 0 = max(2, switch point / 4)
  /// (32 at an original context of 128).
  int64_t rope_change_chunk = 0;
};

/// The default sequence length for `model`: its trained context, capped by the
/// learned position table (config().max_position_embeddings) for
/// learned-absolute models and by kMaxConsistencyLength; at least
/// kMinConsistencyLength (a model trained on shorter sequences is checked at
/// the minimum). A length-dependent RoPE (dynamic, longrope) whose switch
/// point S is reached by that length gets max(n, S + max(16, S / 3)), so that
/// the rope_change scenarios cross it (S = 128: 170).
int64_t default_consistency_length(const Model& model);

/// The plan for `options` at length n (options.length must be set, > 0):
/// chunk sizes {7, n/8, n} (deduplicated, 1 and sizes > n dropped); padded
/// prompts with q = n/8 + 3 and s = max(2, n/64) decode steps: first steps
/// {n/2, n/3, q, n/2 - q}, continuations {n/2 - s, q/2 + 1, n/2 - s, q + q/2},
/// offsets {0, n, 2n, n/3}; ragged totals {n, n/4, n/2}, first steps
/// n/13 + 1 + i (n/23 + 1), strides {5, 1, max(3, n/32 + 1)}; fork prefix
/// n/2 + 3, suffixes at {P, n + k (n/3 + 1)}; shift offset 2n; window
/// max(2, n/8); block size clamp(n/8, 2, 16). At n = 512 these are the
/// checker's former fixed sizes (chunks 7/64/512, window 64, block 16, ragged
/// 40/63/86 and 5/1/17). Throws InvalidArgument naming "length" and the
/// minimum for n < kMinConsistencyLength (or > kMaxConsistencyLength), and
/// naming the field for a non-positive chunk size, block size or window.
ConsistencyPlan consistency_plan(const ConsistencyOptions& options);

/// Runs the scenarios on `model` with tokens taken from `stream`:
///  token_by_token; chunked_prefill_<c> for each chunk size; left_padded_batch
///  (4 prompts of different lengths, prefilled in two left-padded steps, then
///  decoded together; the cached position ids must be 0..len-1); ragged_batch
///  (sequences of different lengths advancing by different amounts in shared
///  steps); prefix_reuse_fork (a prefix prefilled once, forked three ways with
///  copy-on-write, each fork and the parent continuing with its own suffix);
///  context_shift (RoPE only: a prefix prefilled at positions 2n.., shifted by
///  -2n with re-rotation of its cached keys, then continued; reported as
///  skipped for the other families); sliding_window_eviction_<w> (token by
///  token with blocks evicted outside a window, against one full forward under
///  the sliding-window mask). Every family the runtime runs (rope, alibi,
///  t5_bias, learned_absolute, sinusoidal, nope) goes through every other scenario.
///  Length-dependent RoPE (dynamic, longrope, update_with_length): the
///  scenarios above run with the frequencies frozen at length n (they check
///  position bookkeeping), and the rope_change scenarios cross the switch
///  point S: rope_change_<policy>_token_by_token and _chunked_<c> for each of
///  recompute, hf, rerotate, refuse, each row compared with the full forward
///  at the length it was computed at (the rows of score_window(tokens[0, e))
///  for a step ending at e); the checked policy is judged, the others are
///  informational (their drift reported). refuse passes when it refuses at the
///  first step past S with nothing appended. LongRoPE adds
///  longrope_planned_chunked_<c> (recompute, planned length n): every chunk
///  must use the long factors (no re-prefill) and equal one whole forward of n.
/// KV cache dtype: the paths build their caches with model.make_cache(), i.e. in model.kv_cache_dtype(); every
/// reference is a full forward with a float32 cache, so max_abs_logit_diff is the error the dtype adds plus any
/// bookkeeping error. For f16/bf16 each scenario also gets kv_rounding (its references re-run with the dtype's
/// cache) and is judged by ConsistencyScenario::tolerance_for (tolerance + kKvRoundingMargin x kv_roundings x kv_rounding).
/// Throws InvalidArgument as consistency_plan, or if the stream is shorter
/// than plan.stream_tokens (3n); PositionError naming "length" if n is past a
/// learned position table.
ConsistencyReport check_cache_consistency(const Model& model, std::span<const int32_t> stream,
                                          const ConsistencyOptions& options);

}  // namespace posenc
