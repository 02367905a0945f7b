// posenc — the position-consistency checker: proves on a real checkpoint that
// the KV cache and the batched runtime keep position semantics intact.
//
// Every scenario computes logits along an incremental / batched / cached path
// and compares them with the logits of one full forward over the same tokens
// (a fresh sequence at positions 0..n-1), reporting max |Δlogit|.
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
  bool ok(double tolerance) const { return failure.empty() && max_abs_logit_diff <= tolerance; }
};

struct ConsistencyReport {
  std::vector<ConsistencyScenario> scenarios;
  double tolerance = 1e-4;
  bool passed = false;  ///< every scenario ok(tolerance)
};

/// The shortest ConsistencyOptions::length the scenarios fit in.
inline constexpr int64_t kMinConsistencyLength = 96;

struct ConsistencyOptions {
  int64_t length = 512;                        ///< tokens per sequence (<= the trained context)
  std::vector<int64_t> chunk_sizes{1, 7, 64, 512};
  int block_size = 16;                         ///< KV cache block size
  int64_t sliding_window = 64;                 ///< window of the eviction scenario
  double tolerance = 1e-4;
};

/// Runs the scenarios on `model` with tokens taken from `stream`:
///  token_by_token; chunked_prefill_<c> for each chunk size; left_padded_batch
///  (4 prompts of different lengths, prefilled in two left-padded steps, then
///  decoded together; the cached position ids must be 0..len-1); ragged_batch (sequences of different lengths
///  advancing by different amounts in shared steps); prefix_reuse_fork (a
///  prefix prefilled once, forked three ways with copy-on-write, each fork and
///  the parent continuing with its own suffix); context_shift (a prefix
///  prefilled at positions 1000.., shifted by -1000 with re-rotation of its
///  cached keys, then continued); sliding_window_eviction (token by token with
///  blocks evicted outside a window, against one full forward under the
///  sliding-window mask).
/// Throws InvalidArgument if length < kMinConsistencyLength, the stream is
/// shorter than max(3 * length, 1.5 * length + 288) tokens or the options are
/// out of range.
ConsistencyReport check_cache_consistency(const Model& model, std::span<const int32_t> stream,
                                          const ConsistencyOptions& options);

}  // namespace posenc
