// posenc — internal entry point of the tiled CPU attention kernel.
#pragma once

#include <cstdint>
#include <span>

#include "posenc/attention.hpp"
#include "posenc/rope.hpp"

namespace posenc::detail {

/// Rotation of the query rows done by the kernel while it packs them
/// (attention_with_rope). cos/sin: [q_tokens, n_pairs], row t for query token t.
struct QueryRope {
  const float* cos = nullptr;
  const float* sin = nullptr;
  int n_pairs = 0;
  RopeLayout layout = RopeLayout::half;
};

/// attention_forward with an optional query rotation (nullptr: none).
/// Validates its arguments (InvalidArgument).
void attention_kernel(const AttentionSpec& spec, const float* q,
                      std::span<const int64_t> q_position_ids, std::span<const KvBlock> kv,
                      float* out, const AttentionOptions& options, const QueryRope* q_rope);

}  // namespace posenc::detail
