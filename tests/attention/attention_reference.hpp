// The plain attention oracle: materialised [q_tokens, kv_tokens] scores per
// head, everything accumulated in double. Deliberately naive and independent
// of the library kernels (it re-implements masks, ALiBi and RoPE; only the T5
// bucket function is shared, and it has its own golden tests).
// Header-only so that bench/attention_bench.cpp can time it as the naive
// baseline (BM_AttentionNaive).
#pragma once

#include <cmath>
#include <cstdint>
#include <span>
#include <vector>

#include "posenc/attention.hpp"
#include "posenc/bias.hpp"
#include "posenc/rope.hpp"

namespace posenc::oracle {

/// out = softmax(q kᵀ scale + bias + mask) v; see posenc::attention_forward.
inline void reference_attention(const AttentionSpec& spec, const float* q,
                                std::span<const int64_t> q_pos, std::span<const KvBlock> kv,
                                float* out) {
  const int H = spec.heads, KVH = spec.kv_heads, D = spec.head_dim;
  const int group = H / KVH;
  const double scale = spec.softmax_scale != 0.0f ? static_cast<double>(spec.softmax_scale)
                                                  : 1.0 / std::sqrt(static_cast<double>(D));
  // Flatten the keys: row pointers and positions.
  std::vector<const float*> krow, vrow;
  std::vector<int64_t> kpos;
  for (const KvBlock& b : kv)
    for (int64_t j = 0; j < b.n_tokens; ++j) {
      krow.push_back(b.k + j * KVH * D);
      vrow.push_back(b.v + j * KVH * D);
      kpos.push_back(b.position_ids[j]);
    }
  const std::size_t nq = q_pos.size(), nk = kpos.size();
  std::vector<double> scores(nq * nk);
  std::vector<char> vis(nq * nk);
  for (int h = 0; h < H; ++h) {
    const int kvh = h / group;
    for (std::size_t t = 0; t < nq; ++t) {
      const int64_t qi = q_pos[t];
      const float* qv = q + (static_cast<int64_t>(t) * H + h) * D;
      for (std::size_t j = 0; j < nk; ++j) {
        const int64_t kj = kpos[j];
        bool v = kj >= 0;
        if (v && spec.mask == MaskKind::causal) v = kj <= qi;
        if (v && spec.mask == MaskKind::sliding_window) v = kj <= qi && qi - kj < spec.sliding_window;
        vis[t * nk + j] = v;
        if (!v) continue;
        double dot = 0;
        const float* kr = krow[j] + kvh * D;
        for (int d = 0; d < D; ++d) dot += static_cast<double>(qv[d]) * kr[d];
        double s = dot * scale;
        if (spec.bias == LogitBias::alibi)
          s -= static_cast<double>(spec.alibi_slopes[static_cast<std::size_t>(h)]) *
               static_cast<double>(qi >= kj ? qi - kj : kj - qi);
        if (spec.bias == LogitBias::t5) {
          const int b = t5_relative_position_bucket(kj - qi, spec.t5.bidirectional,
                                                    spec.t5.num_buckets, spec.t5.max_distance);
          s += spec.t5.table[static_cast<std::size_t>(b) * H + h];
        }
        scores[t * nk + j] = s;
      }
    }
    for (std::size_t t = 0; t < nq; ++t) {
      double mx = -INFINITY;
      for (std::size_t j = 0; j < nk; ++j)
        if (vis[t * nk + j]) mx = std::max(mx, scores[t * nk + j]);
      std::vector<double> acc(static_cast<std::size_t>(D), 0.0);
      double sum = 0;
      for (std::size_t j = 0; j < nk; ++j) {
        if (!vis[t * nk + j]) continue;
        const double p = std::exp(scores[t * nk + j] - mx);
        sum += p;
        const float* vr = vrow[j] + kvh * D;
        for (int d = 0; d < D; ++d) acc[static_cast<std::size_t>(d)] += p * vr[d];
      }
      float* o = out + (static_cast<int64_t>(t) * H + h) * D;
      for (int d = 0; d < D; ++d)
        o[d] = sum > 0 ? static_cast<float>(acc[static_cast<std::size_t>(d)] / sum) : 0.0f;
    }
  }
}

/// RoPE of x [tokens, heads, head_dim] by positions, the float32-angle
/// reference (angle = float(position) * inv_freq, cos/sin of the float angle,
/// times attention_factor in float), rotation computed in double.
inline std::vector<float> reference_rope(const float* x, int64_t tokens, int heads,
                                         const RopeFrequencies& f, const int64_t* pos,
                                         RopeLayout layout) {
  const int D = f.head_dim, np = f.n_pairs();
  std::vector<float> y(x, x + tokens * heads * D);
  for (int64_t t = 0; t < tokens; ++t)
    for (int h = 0; h < heads; ++h)
      for (int i = 0; i < np; ++i) {
        const float angle = static_cast<float>(pos[t]) * f.inv_freq[static_cast<std::size_t>(i)];
        const double c = std::cos(angle) * static_cast<float>(f.attention_factor);
        const double s = std::sin(angle) * static_cast<float>(f.attention_factor);
        float* head = y.data() + (t * heads + h) * D;
        const int a = layout == RopeLayout::half ? i : 2 * i;
        const int b = layout == RopeLayout::half ? i + np : 2 * i + 1;
        const double x0 = head[a], x1 = head[b];
        head[a] = static_cast<float>(x0 * c - x1 * s);
        head[b] = static_cast<float>(x1 * c + x0 * s);
      }
  return y;
}

}  // namespace posenc::oracle
