#include "posenc/attention.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include <fmt/format.h>

#include "attention/attention_kernel.hpp"
#include "posenc/error.hpp"

namespace posenc {

std::string_view to_string(MaskKind mask) {
  switch (mask) {
    case MaskKind::none: return "none";
    case MaskKind::causal: return "causal";
    case MaskKind::sliding_window: return "sliding_window";
  }
  return "?";
}

std::string_view to_string(LogitBias bias) {
  switch (bias) {
    case LogitBias::none: return "none";
    case LogitBias::alibi: return "alibi";
    case LogitBias::t5: return "t5";
  }
  return "?";
}

float AttentionSpec::effective_scale() const {
  return softmax_scale != 0.0f ? softmax_scale : 1.0f / std::sqrt(static_cast<float>(head_dim));
}

void AttentionSpec::validate() const {
  if (heads <= 0) fail_field<InvalidArgument>("heads", "must be positive", heads);
  if (kv_heads <= 0) fail_field<InvalidArgument>("num_key_value_heads", "must be positive", kv_heads);
  if (heads % kv_heads != 0)
    throw InvalidArgument(fmt::format(
        "num_key_value_heads: heads ({}) must be a multiple of num_key_value_heads (got {})", heads,
        kv_heads));
  if (head_dim <= 0) fail_field<InvalidArgument>("head_dim", "must be positive", head_dim);
  if (!std::isfinite(softmax_scale))
    fail_field<InvalidArgument>("softmax_scale", "must be finite", softmax_scale);
  if (mask == MaskKind::sliding_window && sliding_window <= 0)
    fail_field<InvalidArgument>("sliding_window", "must be > 0 for a sliding-window mask",
                                sliding_window);
  if (bias == LogitBias::alibi && static_cast<int>(alibi_slopes.size()) != heads)
    throw InvalidArgument(fmt::format("slopes: expected {} ALiBi slopes, one per head (got {})",
                                      heads, alibi_slopes.size()));
  if (bias == LogitBias::t5) {
    const std::size_t need = static_cast<std::size_t>(t5.num_buckets) * static_cast<std::size_t>(heads);
    if (t5.num_buckets <= 0 || t5.table.size() != need)
      throw InvalidArgument(fmt::format(
          "relative_attention_bias: table must be [relative_attention_num_buckets={}, heads={}] "
          "= {} floats (got {})",
          t5.num_buckets, heads, need, t5.table.size()));
  }
}

void attention_forward(const AttentionSpec& spec, const float* q,
                       std::span<const int64_t> q_position_ids, std::span<const KvBlock> kv,
                       float* out) {
  detail::attention_kernel(spec, q, q_position_ids, kv, out, AttentionOptions{}, nullptr);
}

void attention_forward(const AttentionSpec& spec, const float* q,
                       std::span<const int64_t> q_position_ids, std::span<const KvBlock> kv,
                       float* out, const AttentionOptions& options) {
  detail::attention_kernel(spec, q, q_position_ids, kv, out, options, nullptr);
}

}  // namespace posenc
