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

#include "posenc/rope.hpp"

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

/// The element type the KV cache stores keys and values in.
///  - f32:  float32, exactly what the model computed (the default).
///  - f16:  IEEE binary16; each element rounded to nearest, ties to even, on
///          write (float16.hpp f32_to_f16: |x| >= 65520 becomes inf) and widened
///          exactly on read, as llama.cpp's `--cache-type-k f16` (its default)
///          and a torch.float16 cache of Hugging Face / vLLM store them.
///  - bf16: bfloat16 (8 exponent bits, 7 mantissa bits); the same rounding
///          (float16.hpp f32_to_bf16), as `--cache-type-k bf16` / a
///          torch.bfloat16 cache.
/// f16 and bf16 take 2 bytes per element, half of f32's 4.
enum class KvCacheDtype { f32, f16, bf16 };

/// A run of cached (or fresh) keys and values with their position ids.
/// k, v: [n_tokens, kv_heads, head_dim], contiguous, in `dtype`:
///  - f32:       k, v point at float32 values (k16, v16 unused);
///  - f16, bf16: k16, v16 point at binary16 / bfloat16 bits (k, v unused),
///               read as their exact float32 values: attention over such a
///               block gives bit for bit the output over the same block
///               widened to float32 by f16_to_f32 / bf16_to_f32 (NaN
///               payloads aside: F16C quiets a signalling NaN). Decode calls
///               (at most 8 rows per KV head) over blocks of one dtype, of an
///               AVX-512 or AVX2 + F16C build, read the 16-bit values in
///               place; every other call (prefill, blocks of mixed dtypes,
///               scalar builds) widens the blocks into a float32 copy once
///               per call.
/// A key whose position id is negative is an empty slot (padding, evicted):
/// it never receives attention.
struct KvBlock {
  const float* k = nullptr;
  const float* v = nullptr;
  const int64_t* position_ids = nullptr;
  int64_t n_tokens = 0;
  KvCacheDtype dtype = KvCacheDtype::f32;
  const uint16_t* k16 = nullptr;
  const uint16_t* v16 = nullptr;
};

/// Execution options of one attention call (they never change a computed
/// head's output: its bits are the same whatever the options).
struct AttentionOptions {
  /// Threads to use: 0 = OpenMP's current default (omp_get_max_threads()),
  /// 1 = the calling thread only. Small calls (below ~1M multiply-adds, e.g.
  /// decode of a small model) always run on the calling thread: forking a
  /// team would cost more than the work.
  int num_threads = 0;
  /// Only the query heads of the KV heads [kv_head_begin, kv_head_end) are
  /// computed (KV head g serves query heads g * heads / num_key_value_heads
  /// onwards); out's other heads are left as they are. kv_head_end = -1 means
  /// num_key_value_heads. For threads the caller already runs (one parallel
  /// region over a whole decode step): each takes a range, and every head's
  /// output has the bits of one call over all heads. Throws InvalidArgument
  /// unless 0 <= kv_head_begin <= kv_head_end <= num_key_value_heads.
  int kv_head_begin = 0;
  int kv_head_end = -1;
};

/// out = softmax(q kᵀ * scale + bias + mask) v, per head, over all keys of all
/// blocks (order of blocks and keys is irrelevant: masks use position ids).
///  q:   [q_tokens, heads, head_dim] float32 (already rotated if RoPE is used)
///  q_position_ids: [q_tokens]
///  out: [q_tokens, heads, head_dim] float32 (must not alias q)
/// A query with no visible key gets a zero output row.
///
/// Kernel (FlashAttention-2 style, Dao 2023, on the CPU): the rows that share
/// a KV head (query tokens x the heads of its GQA group) are processed in
/// blocks of 64 with the rows in SIMD lanes; keys in tiles of up to 64 (a
/// tile may span several small KvBlocks). Per tile: scores by a register-
/// blocked micro-kernel (8 keys x 32 rows), bias, mask, online softmax in
/// base 2, then P·V by a second micro-kernel (8 rows x 32 channels). No score
/// matrix larger than one 64x64 tile exists. Tiles whose key positions
/// (min/max per tile) are all invisible to the block are skipped; fully
/// visible tiles get no per-element mask work. Few rows per KV head (decode)
/// use a kernel that vectorises over head_dim instead. Work items (KV head x
/// row block) are shared by OpenMP threads. Float32 throughout: matches a
/// double-precision reference to ~1e-6 relative (tested to 1e-5).
/// Batch invariant: a row's output depends only on its query, its position
/// and the keys (in the order the blocks present them, empty slots ignored),
/// not on the other rows of the call or the thread count. Token-by-token
/// decode, chunked prefill and full prefill over a cache that appends keys
/// give bit-identical outputs. Key sets not in position order are sorted by
/// position (when a mask is set) before tiling, which costs a sort per call.
/// Throws InvalidArgument on inconsistent shapes (see AttentionSpec::validate),
/// a block (named kv[i].field) with negative n_tokens, an unknown dtype or a
/// null position_ids / data pointer of its dtype, or a T5 table/bucket
/// configuration t5_relative_position_bucket rejects.
void attention_forward(const AttentionSpec& spec, const float* q,
                       std::span<const int64_t> q_position_ids, std::span<const KvBlock> kv,
                       float* out);
void attention_forward(const AttentionSpec& spec, const float* q,
                       std::span<const int64_t> q_position_ids, std::span<const KvBlock> kv,
                       float* out, const AttentionOptions& options);

/// RoPE applied to q and k, then attention_forward. q and the blocks' k hold
/// UNROTATED values; query token t is rotated by q_position_ids[t], key j of a
/// block by that block's position_ids[j] (empty slots, position < 0, are
/// never attended). `freqs` is any value of the scaling registry (inv_freq,
/// attention_factor, partial rotary: channels >= rotary_dim pass through);
/// layout and angle precision as in apply_rope, whose numerics (float32
/// products without FMA) are used for both q and k.
/// Memory: a rotated copy of the keys ([kv_tokens, kv_heads, head_dim]) and
/// the cos/sin tables of the q and k positions; q is rotated row by row while
/// the kernel packs it. Throws InvalidArgument as attention_forward, or if
/// freqs.head_dim != spec.head_dim.
void attention_with_rope(const AttentionSpec& spec, const RopeFrequencies& freqs,
                         RopeLayout layout, AnglePrecision precision, const float* q,
                         std::span<const int64_t> q_position_ids, std::span<const KvBlock> kv,
                         float* out, const AttentionOptions& options = {});

}  // namespace posenc
