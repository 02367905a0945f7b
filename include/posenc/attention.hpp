// posenc — position-aware scaled dot-product attention on the CPU.
//
// Positions enter attention in three ways: rotating q/k (RoPE, applied before
// this call or through attention_with_rope), a bias on the logits (ALiBi, T5),
// or not at all (NoPE). Masks are defined on position ids, never on indices
// into the current tensors, so a KV cache of any shape keeps its meaning.
#pragma once

#include <cstdint>
#include <span>
#include <string_view>

namespace posenc {

/// Which (query, key) pairs may attend, by position id (i = query, j = key):
///  - none:           every key.
///  - causal:         j <= i.
///  - sliding_window: 0 <= i - j < sliding_window (Mistral's definition: the
///                    query sees itself and the sliding_window-1 keys before it).
enum class MaskKind { none, causal, sliding_window };

/// What is added to the logit q·k * softmax_scale.
///  - none
///  - alibi: -slope[h] * |i - j|  (equals -m_h (i - j) under a causal mask;
///           Press et al. 2022, eq. in §3)
///  - t5:    table[bucket(j - i), h]  (Raffel et al. 2020; HF T5Attention.compute_bias)
enum class LogitBias { none, alibi, t5 };

std::string_view to_string(MaskKind mask);
std::string_view to_string(LogitBias bias);

/// T5 relative-attention bias parameters. table: [num_buckets, heads] float32
/// (HF's relative_attention_bias.weight), learned.
struct T5BiasParams {
  std::span<const float> table;
  int num_buckets = 32;     ///< relative_attention_num_buckets
  int max_distance = 128;   ///< relative_attention_max_distance
  bool bidirectional = false;
};

/// Shapes, mask and bias of one attention call.
struct AttentionSpec {
  int heads = 0;      ///< query heads
  int kv_heads = 0;   ///< key/value heads (num_key_value_heads); heads % kv_heads == 0 (GQA/MQA)
  int head_dim = 0;
  float softmax_scale = 0.0f;  ///< multiplies q·k; 0 means 1/sqrt(head_dim)
  MaskKind mask = MaskKind::causal;
  int64_t sliding_window = 0;  ///< used when mask == sliding_window; must be > 0 then
  LogitBias bias = LogitBias::none;
  std::span<const float> alibi_slopes;  ///< [heads], when bias == alibi
  T5BiasParams t5;                      ///< when bias == t5

  float effective_scale() const;
  /// Throws InvalidArgument naming the field (heads % kv_heads, slopes size,
  /// table size, sliding_window, non-finite scale, ...).
  void validate() const;
};

/// A run of cached (or fresh) keys and values with their position ids.
/// k, v: [n_tokens, kv_heads, head_dim] float32, contiguous. A key whose
/// position id is negative is an empty slot (padding, evicted): it never
/// receives attention.
struct KvBlock {
  const float* k = nullptr;
  const float* v = nullptr;
  const int64_t* position_ids = nullptr;
  int64_t n_tokens = 0;
};

/// out = softmax(q kᵀ * scale + bias + mask) v, per head, over all keys of all
/// blocks (order of blocks and keys is irrelevant: masks use position ids).
///  q:   [q_tokens, heads, head_dim] float32 (already rotated if RoPE is used)
///  q_position_ids: [q_tokens]
///  out: [q_tokens, heads, head_dim] float32 (must not alias q)
/// A query with no visible key gets a zero output row.
/// Tiled with an online softmax (never materialises the [q_tokens, kv_tokens]
/// score matrix beyond a tile); threads over heads and query blocks.
/// Throws InvalidArgument on inconsistent shapes (see AttentionSpec::validate).
void attention_forward(const AttentionSpec& spec, const float* q,
                       std::span<const int64_t> q_position_ids, std::span<const KvBlock> kv,
                       float* out);

}  // namespace posenc
