#include "posenc/attention.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include <fmt/format.h>

#include "posenc/bias.hpp"
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

namespace {

inline bool visible(const AttentionSpec& s, int64_t qi, int64_t kj) {
  if (kj < 0) return false;
  switch (s.mask) {
    case MaskKind::none: return true;
    case MaskKind::causal: return kj <= qi;
    case MaskKind::sliding_window: return kj <= qi && qi - kj < s.sliding_window;
  }
  return false;
}

inline float logit_bias(const AttentionSpec& s, int h, int64_t qi, int64_t kj) {
  switch (s.bias) {
    case LogitBias::none: return 0.0f;
    case LogitBias::alibi: {
      const int64_t d = qi >= kj ? qi - kj : kj - qi;
      return -s.alibi_slopes[static_cast<std::size_t>(h)] * static_cast<float>(d);
    }
    case LogitBias::t5: {
      const int b = t5_relative_position_bucket(kj - qi, s.t5.bidirectional, s.t5.num_buckets,
                                                s.t5.max_distance);
      return s.t5.table[static_cast<std::size_t>(b) * static_cast<std::size_t>(s.heads) +
                        static_cast<std::size_t>(h)];
    }
  }
  return 0.0f;
}

}  // namespace

void attention_forward(const AttentionSpec& spec, const float* q,
                       std::span<const int64_t> q_position_ids, std::span<const KvBlock> kv,
                       float* out) {
  spec.validate();
  const int64_t q_tokens = static_cast<int64_t>(q_position_ids.size());
  const int H = spec.heads, KVH = spec.kv_heads, D = spec.head_dim;
  const int group = H / KVH;
  const float scale = spec.effective_scale();
  for (const auto& b : kv)
    if (b.n_tokens < 0 || (b.n_tokens > 0 && (!b.k || !b.v || !b.position_ids)))
      throw InvalidArgument("attention_forward: KvBlock with null data or negative n_tokens");

#pragma omp parallel for collapse(2) schedule(dynamic, 1) if (q_tokens * H > 8)
  for (int64_t t = 0; t < q_tokens; ++t) {
    for (int h = 0; h < H; ++h) {
      const float* qv = q + (t * H + h) * D;
      float* o = out + (t * H + h) * D;
      const int64_t qi = q_position_ids[static_cast<std::size_t>(t)];
      const int kvh = h / group;
      float m = -std::numeric_limits<float>::infinity();
      float l = 0.0f;
      std::fill(o, o + D, 0.0f);
      for (const auto& b : kv) {
        for (int64_t j = 0; j < b.n_tokens; ++j) {
          const int64_t kj = b.position_ids[j];
          if (!visible(spec, qi, kj)) continue;
          const float* kr = b.k + (j * KVH + kvh) * D;
          float dot = 0.0f;
          for (int d = 0; d < D; ++d) dot += qv[d] * kr[d];
          const float x = dot * scale + logit_bias(spec, h, qi, kj);
          const float* vr = b.v + (j * KVH + kvh) * D;
          if (x > m) {
            const float corr = std::exp(m - x);
            l = l * corr + 1.0f;
            for (int d = 0; d < D; ++d) o[d] = o[d] * corr + vr[d];
            m = x;
          } else {
            const float p = std::exp(x - m);
            l += p;
            for (int d = 0; d < D; ++d) o[d] += p * vr[d];
          }
        }
      }
      if (l > 0.0f) {
        const float inv = 1.0f / l;
        for (int d = 0; d < D; ++d) o[d] *= inv;
      }
    }
  }
}

}  // namespace posenc
