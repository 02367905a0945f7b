// The two per-token decisions every path of the lab makes from a logits row,
// shared by the in-process engine and `posenc serve` so that a completion
// served over HTTP is scored with the very same arithmetic.
#pragma once

#include <cstdint>

namespace posenc::detail {

/// log_softmax(row)[token] in double (natural log): row[token] - max - log(sum exp(row - max)).
/// `row` holds V float32 logits; `token` must be in [0, V) (not checked).
double log_prob(const float* row, int V, int32_t token);

/// Greedy decoding's choice: the index of the largest of the V logits, lowest index on ties.
int32_t argmax(const float* row, int V);

}  // namespace posenc::detail
