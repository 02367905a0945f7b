// posenc — Multimodal RoPE (MRoPE) of Qwen2-VL: three position rows
// (temporal, height, width) share one head's channel pairs.
//
// Source: Wang et al. 2024, "Qwen2-VL: Enhancing Vision-Language Model's
// Perception of the World at Any Resolution", §2.1 (M-RoPE). Numerics match
// Hugging Face transformers models/qwen2_vl/modeling_qwen2_vl.py
// (Qwen2VLRotaryEmbedding.forward + apply_multimodal_rotary_pos_emb): cos/sin
// per row in float32 as plain RoPE, the channel split `mrope_section +
// mrope_section` over [cos | cos] with chunk j taken from row j % 3, then the
// half-layout (rotate_half) rotation.
//
// Equivalently: mrope_section = (s_t, s_h, s_w), s_t + s_h + s_w = rotary_dim/2;
// channel pair i (channels i and i + rotary_dim/2) rotates by
// position_ids[row(i)][token] * inv_freq[i], with row(i) = 0 for i < s_t,
// 1 for i < s_t + s_h, 2 otherwise. With all three rows equal (text tokens)
// MRoPE is plain RoPE.
#pragma once

#include <array>
#include <cstdint>
#include <span>
#include <vector>

#include "posenc/rope.hpp"

namespace posenc {

/// The position row (0 = temporal, 1 = height, 2 = width) of each channel pair,
/// [n_pairs]. Throws ConfigError "mrope_section: ..." if an entry is negative or
/// the entries do not sum to n_pairs.
std::vector<int> mrope_pair_rows(std::span<const int> mrope_section, int n_pairs);

/// cos/sin table of MRoPE for `tokens` tokens: row t, pair i holds
/// cos/sin(position_ids[row(i) * tokens + t] * inv_freq[i]) * attention_factor.
///  - position_ids: [3, tokens] int64, row-major (rows t, h, w); non-negative
///    is not required (the rotation is defined for any integer).
///  - mrope_section: exactly 3 entries summing to freqs.rotary_dim/2.
/// Angles formed as `precision` says (float32 reproduces the reference).
/// Throws ConfigError for a bad section, InvalidArgument if position_ids does
/// not hold 3*tokens values.
RopeTable mrope_table(const RopeFrequencies& freqs, std::span<const int> mrope_section,
                      std::span<const int64_t> position_ids, int64_t tokens,
                      AnglePrecision precision);

/// Rotates x: [tokens, heads, freqs.head_dim] float32 (contiguous) in place
/// with MRoPE, half layout (the only layout Qwen2-VL uses); channels at and
/// above freqs.rotary_dim pass through. Errors as mrope_table and apply_rope.
void apply_mrope(float* x, int64_t tokens, int heads, const RopeFrequencies& freqs,
                 std::span<const int> mrope_section, std::span<const int64_t> position_ids,
                 AnglePrecision precision, RopeDirection direction = RopeDirection::forward);

}  // namespace posenc
