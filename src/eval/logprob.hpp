// The two per-token decisions every path of the lab makes from a logits row,
// shared by the in-process engine and `posenc serve` so that a completion
// served over HTTP is scored with the very same arithmetic.
#pragma once

#include <cstdint>
#include <functional>
#include <string>

namespace posenc::detail {

/// log_softmax(row)[token] in double (natural log): row[token] - max - log(sum exp(row - max)).
/// `row` holds V float32 logits; `token` must be in [0, V) (not checked).
double log_prob(const float* row, int V, int32_t token);

/// Greedy decoding's choice: the index of the largest of the V logits, lowest index on ties.
int32_t argmax(const float* row, int V);

/// Throws NumericError "<where>: logit <i> is not finite (got <value>) ..." for the first of the `count` logits
/// (one row or several, V per row: the message names the row's logit index) that is NaN or infinite: a log
/// probability, a greedy choice or a sample from such a row would be a silent wrong answer. `where` names the
/// row's place (e.g. "position 17"), or, with several rows, is called with the row index to name it.
void check_logits_finite(const float* logits, int64_t count, int V, const std::function<std::string(int64_t row)>& where);

}  // namespace posenc::detail
