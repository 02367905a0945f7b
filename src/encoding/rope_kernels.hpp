// posenc — internal RoPE hot loops: vectorised cos/sin rows and rotations.
//
// Used by rope.cpp (RopeTable, apply_rope) and by the attention engine
// (attention_with_rope). Numerics are the public ones documented in
// posenc/rope.hpp:
//  - float32 angles: angle = float(position) * inv_freq[i] (one float32
//    product); cos/sin evaluated in double (Cody-Waite reduction with a
//    three-part pi/2, fdlibm's kernel polynomials) and rounded once to float,
//    which lands within 1 ulp of glibc's cosf/sinf (both are within ~0.5 ulp
//    of the true value). Lanes with |angle| > 2^30 use std::cos/std::sin.
//  - exact angles: angle = double(position) * double(inv_freq[i]), same
//    double evaluation, cast to float.
//  - rotation: (x0*c - x1*s, x1*c + x0*s) with separate float32 products and
//    sums (no FMA); this file is compiled with -ffp-contract=off.
#pragma once

#include <cstdint>

#include "posenc/rope.hpp"

namespace posenc::detail {

/// cos/sin of `position * inv_freq[i]`, i in [0, n_pairs), each multiplied by
/// attention_factor when `scale` is true (float32 product, as the reference).
/// c, s: [n_pairs] float32.
void rope_cos_sin_row(const float* inv_freq, int n_pairs, int64_t position,
                      AnglePrecision precision, float attention_factor, bool scale, float* c,
                      float* s);

/// The same for any AnglePrecision (implemented in rope.cpp): the vector
/// kernel above for float32/exact, rope_cos_sin_with(rope_numerics(precision))
/// for fp64/bf16/fp16 (scalar; fp64 needs freqs.inv_freq_f64). Attention
/// factor from freqs. c, s: [freqs.n_pairs()] float32.
void rope_cos_sin_row(const RopeFrequencies& freqs, int64_t position, AnglePrecision precision, float* c, float* s);

/// Rotates `tokens` rows of x in place. Token t starts at x + t*token_stride
/// and holds `heads` heads of head_dim floats; it uses cos/sin rows
/// cos + t*table_stride, sin + t*table_stride ([n_pairs] each; table_stride 0
/// means every token uses the same row). Only the first 2*n_pairs channels of
/// each head rotate. Single-threaded.
void rope_rotate_rows(float* x, int64_t tokens, int heads, int head_dim, int64_t token_stride,
                      const float* cos, const float* sin, int64_t table_stride, int n_pairs,
                      RopeLayout layout, RopeDirection direction);

}  // namespace posenc::detail
