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
// position_ids[row(i)][token] * inv_freq[i], with row(i) given by the mapping:
//  - chunked (Qwen2-VL, Qwen2.5-VL): row(i) = 0 for i < s_t, 1 for i < s_t + s_h,
//    2 otherwise ([TTT...HHH...WWW]);
//  - interleaved (Qwen3-VL, HF modeling_qwen3_vl.py
//    Qwen3VLTextRotaryEmbedding.apply_interleaved_mrope): row(i) = 1 if
//    i % 3 == 1 and i < 3*s_h, 2 if i % 3 == 2 and i < 3*s_w, else 0
//    ([THWTHW...TT]: pairs cycle t, h, w while the h and w budgets last, the
//    temporal row takes the rest).
// With all three rows equal (text tokens) MRoPE is plain RoPE under either mapping.
//
// Position ids (mrope_position_ids): Qwen2-VL's get_rope_index
// (modeling_qwen2_vl.py / modeling_qwen2_5_vl.py Qwen2*_VLModel.get_rope_index):
// text tokens get t = h = w = a running index; a vision span (image or video
// grid t x h x w patches, merged spatial_merge_size x spatial_merge_size into one
// token each) gets t/h/w grid coordinates offset by the index it starts at; the
// next span starts at (largest id so far) + 1. The rope delta, max + 1 - n, is
// what decoding continues from: a token at 1-D cache position p (text) gets
// t = h = w = p + delta (Qwen2_5_VLModel.forward's `cache_position[0] + rope_deltas`).
#pragma once

#include <array>
#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "posenc/rope.hpp"

namespace posenc {

/// How channel pairs are assigned to the three position rows (see the file comment).
enum class MropeMapping { chunked, interleaved };
std::string_view to_string(MropeMapping mapping);
/// Parses "chunked" or "interleaved". Throws ConfigError naming `field` and the value.
MropeMapping parse_mrope_mapping(std::string_view text, std::string_view field = "mrope_mapping");

/// The position row (0 = temporal, 1 = height, 2 = width) of each channel pair,
/// [n_pairs]. Throws ConfigError "mrope_section: ..." if there are not exactly
/// 3 entries, an entry is negative, the entries do not sum to n_pairs, or (interleaved)
/// the cycle cannot give each row its budget within n_pairs (3*s_h - 2 or
/// 3*s_w - 1 past the last pair: HF's slices would silently give that row fewer pairs).
std::vector<int> mrope_pair_rows(std::span<const int> mrope_section, int n_pairs,
                                 MropeMapping mapping = MropeMapping::chunked);

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
                      AnglePrecision precision, MropeMapping mapping = MropeMapping::chunked);

/// Rotates x: [tokens, heads, freqs.head_dim] float32 (contiguous) in place
/// with MRoPE, half layout (the only layout Qwen2-VL/Qwen3-VL use); channels at and
/// above freqs.rotary_dim pass through. Errors as mrope_table and apply_rope.
void apply_mrope(float* x, int64_t tokens, int heads, const RopeFrequencies& freqs,
                 std::span<const int> mrope_section, std::span<const int64_t> position_ids,
                 AnglePrecision precision, RopeDirection direction = RopeDirection::forward,
                 MropeMapping mapping = MropeMapping::chunked);

// ---- position ids of a mixed text / image / video sequence ----

enum class MropeSpanKind { text, image, video };

/// One span of the token sequence, in order.
///  - text: `tokens` text tokens (>= 0).
///  - image / video: the vision tower's patch grid (grid_t, grid_h, grid_w) as
///    HF's image_grid_thw / video_grid_thw give it (before the spatial merge);
///    the span holds grid_t * (grid_h / m) * (grid_w / m) tokens, m = spatial_merge_size.
///  - second_per_grid_t (video, Qwen2.5-VL rule only): seconds between temporal
///    grid steps (HF second_per_grid_ts = temporal_patch_size / fps; 1.0 when not given).
struct MropeSpan {
  MropeSpanKind kind = MropeSpanKind::text;
  int64_t tokens = 0;
  int64_t grid_t = 1, grid_h = 1, grid_w = 1;
  double second_per_grid_t = 1.0;
  static MropeSpan text(int64_t n) { return {MropeSpanKind::text, n, 1, 1, 1, 1.0}; }
  static MropeSpan image(int64_t t, int64_t h, int64_t w) { return {MropeSpanKind::image, 0, t, h, w, 1.0}; }
  static MropeSpan video(int64_t t, int64_t h, int64_t w, double second_per_grid_t = 1.0) {
    return {MropeSpanKind::video, 0, t, h, w, second_per_grid_t};
  }
};

/// Which model's temporal rule the vision spans follow.
///  - qwen2_vl (modeling_qwen2_vl.py): temporal id = grid step k, for images and videos.
///  - qwen2_5_vl (modeling_qwen2_5_vl.py): images get temporal id 0 (second_per_grid_t = 0);
///    videos get trunc(k * second_per_grid_t * tokens_per_second), the product formed in
///    float32 (k * s first, then * tokens_per_second) and truncated toward zero only at the
///    end, as transformers after PR #48669 ("Fix Qwen2.5-VL temporal RoPE for fractional
///    video intervals"; before it, s was cast to int64 first and 0.5 s became 0).
/// Qwen3-VL gives every video frame its own span with a timestamp in text: build it as
/// one video span with grid_t = 1 per frame (its temporal ids are then 0 within each span).
enum class MropeTemporalRule { qwen2_vl, qwen2_5_vl };

struct MropeVisionConfig {
  int spatial_merge_size = 2;         ///< vision_config.spatial_merge_size
  double tokens_per_second = 2.0;     ///< vision_config.tokens_per_second (qwen2_5_vl rule; 2 in Qwen2.5-VL configs)
  MropeTemporalRule rule = MropeTemporalRule::qwen2_vl;
};

struct MropePositionIds {
  int64_t tokens = 0;                 ///< n: the number of tokens of all spans
  std::vector<int64_t> position_ids;  ///< [3, n] int64, row-major (rows t, h, w)
  /// max(position_ids) + 1 - n (0 for text only, negative when vision spans compress
  /// positions): a continuing text token at 1-D position p gets t = h = w = p + rope_delta.
  int64_t rope_delta = 0;
};

/// The [3, n] position ids and the rope delta of a sequence of spans, by HF's
/// get_rope_index rules (see the file comment and MropeTemporalRule). An empty
/// list gives n = 0, delta 0. Throws InvalidArgument naming the span index and the
/// field for a negative text length, a non-positive grid entry, grid_h or grid_w
/// not divisible by spatial_merge_size, spatial_merge_size < 1, a negative or
/// non-finite second_per_grid_t or tokens_per_second, or a sequence whose length
/// or ids would pass 2^53.
MropePositionIds mrope_position_ids(std::span<const MropeSpan> spans, const MropeVisionConfig& config);

}  // namespace posenc
