// posenc's positional kernels as torch autograd functions (private to the
// trainer and its tests; the only headers besides transformer.hpp that
// include torch).
//
// Every function runs posenc's own float32 kernel in forward and implements
// the backward by hand:
//   rope_rotate        apply_rope (rope.hpp); backward = the inverse rotation of
//                      the incoming gradient (a rotation's transpose is its inverse).
//   add_sinusoidal     add_sinusoidal_encoding (absolute.hpp); constant, so the
//                      gradient passes through unchanged.
//   learned_positions  learned_position_lookup (absolute.hpp); backward =
//                      scatter-add of the gradient rows into the table.
//   t5_bias            t5_relative_position_bias (bias.hpp); backward =
//                      scatter-add of the gradient over each (bucket, head).
//   add_alibi          alibi_bias (bias.hpp); fixed bias without parameters, so
//                      the gradient passes through unchanged.
// Positions are 0..T-1 along the sequence axis (right-padded batches).
#pragma once

#include <torch/torch.h>

#include "posenc/rope.hpp"

namespace posenc::detail {

/// x: [B, T, heads, head_dim] float32. Rotates the first rotary_dim channels
/// of every head at positions 0..T-1 with inv_freq = default_rope_frequencies(
/// head_dim, rotary_dim, rope_theta), float32 angles, in `layout`.
/// Throws InvalidArgument on a bad shape/dtype or rotary_dim.
torch::Tensor rope_rotate(const torch::Tensor& x, int rotary_dim, double rope_theta, RopeLayout layout);

/// x: [B, T, d_model] float32; returns x + PE(0..T-1), PE = the interleaved
/// sinusoidal encoding (Vaswani et al. 2017 §3.5) with `base`.
torch::Tensor add_sinusoidal(const torch::Tensor& x, double base);

/// table: [max_position_embeddings, d_model] float32; returns rows 0..T-1
/// ([T, d_model]). Throws PositionError when T > max_position_embeddings.
torch::Tensor learned_positions(const torch::Tensor& table, int64_t T);

/// table: [num_buckets, heads] float32; returns the causal T5 bias
/// [heads, T, T]: bias[h, i, j] = table[bucket(j - i), h].
torch::Tensor t5_bias(const torch::Tensor& table, int64_t T, int num_buckets, int max_distance);

/// scores: [B, heads, T, T] float32; returns scores + ALiBi's causal bias
/// -m_h (i - j), m = alibi_slopes(heads, max_bias).
torch::Tensor add_alibi(const torch::Tensor& scores, double max_bias);

}  // namespace posenc::detail
