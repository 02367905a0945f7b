// posenc — positional biases added to attention logits: ALiBi and T5 relative
// position buckets.
#pragma once

#include <cstdint>
#include <vector>

namespace posenc {

/// ALiBi head slopes m_h, h = 0..n_heads-1, as llama.cpp computes them from
/// `max_bias` (Press et al., ICLR 2022, §3; llama.cpp ggml_soft_max_ext):
/// with p = the largest power of two <= n_heads,
///   m_h = 2^(-max_bias/p)^(h+1)                 for h < p,
///   m_h = 2^(-max_bias/(2p))^(2(h-p)+1)         for h >= p (the paper's interleaving rule).
/// max_bias = 8 gives the paper's geometric 2^(-8/n) sequence for powers of two
/// and BLOOM's slopes otherwise. Returns float32 values computed in double.
/// Throws InvalidArgument if n_heads <= 0 or max_bias is not finite and > 0.
std::vector<float> alibi_slopes(int n_heads, double max_bias = 8.0);

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

}  // namespace posenc
