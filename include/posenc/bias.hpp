// posenc — positional biases added to attention logits: ALiBi and T5 relative
// position buckets.
//
// ALiBi: Press, Smith & Lewis, "Train Short, Test Long: Attention with Linear
// Biases Enables Input Length Extrapolation", ICLR 2022, §3: logit(i, j) +=
// -m_h * (i - j) for a query at position i and a key at position j <= i, with
// per-head slopes m_h. Since softmax is shift-invariant per query, BLOOM and
// Falcon add +m_h * j instead (same probabilities under a causal mask) and MPT
// adds m_h * (j - (L-1)); the reference tensors of all three are provided.
//
// T5: Raffel et al., "Exploring the Limits of Transfer Learning with a Unified
// Text-to-Text Transformer", JMLR 2020, §2.1: a learned scalar per (bucket of
// key_position - query_position, head), shared by all layers.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

namespace posenc {

// ---- ALiBi slopes -----------------------------------------------------------

/// ALiBi head slopes m_h, h = 0..n_heads-1, as llama.cpp computes them from
/// `max_bias` (llama.cpp ggml_soft_max_ext / ggml_alibi): with p = the largest
/// power of two <= n_heads,
///   m_h = 2^(-max_bias/p)^(h+1)                 for h < p,
///   m_h = 2^(-max_bias/(2p))^(2(h-p)+1)         for h >= p (the paper's interleaving rule).
/// max_bias = 8 gives the paper's geometric 2^(-8/n) sequence for powers of two
/// and BLOOM's slopes otherwise. Computed in double, returned as the nearest
/// float32 (BLOOM's float32 pow can differ by 1 ulp; see bloom_alibi_slopes).
/// Throws InvalidArgument if n_heads <= 0 or max_bias is not finite and > 0.
std::vector<float> alibi_slopes(int n_heads, double max_bias = 8.0);

/// BLOOM's slopes, bit for bit (HF models/bloom/modeling_bloom.py
/// build_alibi_tensor): base = float32(2^(-8/p)), slopes = float32 pow(base, k)
/// for k = 1..p; when p != n_heads the extra heads take float32
/// pow(float32(2^(-4/p)), k) for odd k = 1, 3, ... ([n_heads] float32).
/// Throws InvalidArgument if n_heads <= 0.
std::vector<float> bloom_alibi_slopes(int n_heads);

/// Falcon's effective slopes: BLOOM's rounded to bfloat16 (HF
/// models/falcon/modeling_falcon.py build_alibi_tensor casts the slopes to
/// bfloat16 before multiplying). [n_heads] float32 holding bfloat16 values.
std::vector<float> falcon_alibi_slopes(int n_heads);

/// MPT's slopes (HF models/mpt/modeling_mpt.py build_mpt_alibi_tensor): with
/// p = n_heads rounded UP to a power of two, s_k = 1 / 2^(k * alibi_bias_max / p)
/// for k = 1..p in float32; when p != n_heads the order is k = 2, 4, 6, ...
/// then k = 1, 3, 5, ..., truncated to n_heads. [n_heads] float32.
/// Throws InvalidArgument if n_heads <= 0 or alibi_bias_max is not finite and > 0.
std::vector<float> mpt_alibi_slopes(int n_heads, double alibi_bias_max = 8.0);

/// Rounds a float32 to the nearest bfloat16 (round half to even; NaN stays
/// NaN), returned as float32 -- what torch's .bfloat16() does.
float round_to_bfloat16(float x);

// ---- ALiBi biases -----------------------------------------------------------

/// The two forms of the bias for query position i and key position j.
///  - causal:    -m (i - j)   (Press et al. 2022; meant for keys j <= i, which
///               a causal mask guarantees; for j > i it is positive)
///  - symmetric: -m |i - j|   (bidirectional/encoder use)
enum class AlibiForm { causal, symmetric };

/// One query's bias row: out[j] = -slope * (query_position - key_positions[j])
/// (causal) or -slope * |query_position - key_positions[j]| (symmetric), in
/// float32 (slope * float(distance), negated). Positions may be any int64
/// (a query deep into a KV cache). out: [key_positions.size()].
/// Throws InvalidArgument if out is too small or slope is not finite.
void alibi_bias_row(float slope, int64_t query_position, std::span<const int64_t> key_positions,
                    AlibiForm form, std::span<float> out);

/// The full bias [heads, q_len, k_len] float32 (row-major) for queries at
/// positions query_offset .. query_offset+q_len-1 and keys at 0 .. k_len-1
/// (query_offset = number of cached tokens when decoding).
/// Throws InvalidArgument on negative sizes/offset, empty slopes, or an output size or last query position
/// that overflows int64 (checked before anything is allocated).
std::vector<float> alibi_bias(std::span<const float> slopes, int64_t q_len, int64_t k_len,
                              int64_t query_offset, AlibiForm form);

/// Which slopes/product rounding build_bloom_alibi_tensor reproduces.
enum class AlibiTensorStyle { bloom, falcon };

/// BLOOM/Falcon build_alibi_tensor: attention_mask [batch, seq_len] of 0/1
/// (int64, row-major; 0 = padding), result [batch * n_heads, 1, seq_len]
/// float32 with value slope[h] * key_index, key_index = (cumsum(mask) - 1) * mask
/// along the row (the key's position among the row's real tokens; 0 on
/// padding). Falcon: slopes rounded to bfloat16 and the product rounded to
/// bfloat16. Throws InvalidArgument on a size mismatch, a mask value not 0/1, or an output size that
/// overflows int64.
std::vector<float> build_bloom_alibi_tensor(std::span<const int64_t> attention_mask, int64_t batch,
                                            int64_t seq_len, int n_heads, AlibiTensorStyle style);

/// MPT build_mpt_alibi_tensor: [n_heads, 1, seq_len] float32 with value
/// slope[h] * (j - (seq_len - 1)) (non-positive; mpt_alibi_slopes order).
/// Throws InvalidArgument for seq_len < 0, an output size that overflows int64, and as mpt_alibi_slopes.
std::vector<float> build_mpt_alibi_tensor(int n_heads, int64_t seq_len, double alibi_bias_max = 8.0);

// ---- T5 relative position bias ------------------------------------------------

/// T5's relative position bucket (Raffel et al. 2020; HF
/// T5Attention._relative_position_bucket), bit-identical to the reference:
/// relative_position = key_position - query_position. Bidirectional: half the
/// buckets for positive offsets. Causal (bidirectional = false): positive
/// offsets go to bucket 0. Offsets below max_exact = num_buckets/2 (after the
/// bidirectional halving) get their own bucket; larger ones are log-spaced up
/// to max_distance, computed in float32 and truncated, capped at the last bucket.
/// Returns a bucket in [0, num_buckets). Throws InvalidArgument for
/// num_buckets < 2 (< 4 when bidirectional) or max_distance <= max_exact.
int t5_relative_position_bucket(int64_t relative_position, bool bidirectional, int num_buckets,
                                int max_distance);

/// Buckets for a block of queries against keys, [q_len, k_len] int32
/// (row-major): query t sits at position query_offset + t (HF compute_bias's
/// cache_position; query_offset = past_seen_tokens), key j at position j.
/// Errors as t5_relative_position_bucket, plus InvalidArgument for negative sizes/offset and for an output
/// size or last query position that overflows int64.
std::vector<int> t5_relative_position_buckets(int64_t q_len, int64_t k_len, int64_t query_offset,
                                              bool bidirectional, int num_buckets, int max_distance);

/// T5 bias [heads, q_len, k_len] float32 (row-major) from the learned table
/// [num_buckets, heads] float32 (HF relative_attention_bias.weight):
/// bias[h, t, j] = table[bucket(j - (query_offset + t)), h] (HF
/// T5Attention.compute_bias). Throws InvalidArgument if the table does not hold
/// num_buckets * heads values, heads <= 0, or as t5_relative_position_buckets.
std::vector<float> t5_relative_position_bias(std::span<const float> table, int num_buckets, int heads,
                                             int64_t q_len, int64_t k_len, int64_t query_offset,
                                             bool bidirectional, int max_distance);

}  // namespace posenc
