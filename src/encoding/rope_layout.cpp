// Channel-order permutations between the two RoPE layouts, DeepSeek-V3's
// interleaved-in/half-out helper, and RopeTable::from_cos_sin. Kept out of
// rope.cpp, whose hot loops are tuned separately.
#include <algorithm>
#include <vector>

#include <fmt/format.h>

#include "posenc/error.hpp"
#include "posenc/rope.hpp"

namespace posenc {

RopeTable RopeTable::from_cos_sin(int64_t n_positions, int n_pairs, std::vector<float> cos,
                                  std::vector<float> sin, AnglePrecision precision) {
  if (n_pairs <= 0) fail_field<InvalidArgument>("n_pairs", "must be positive", n_pairs);
  if (n_positions < 0) fail_field<InvalidArgument>("n_positions", "must be non-negative", n_positions);
  const std::size_t need = static_cast<std::size_t>(n_positions) * static_cast<std::size_t>(n_pairs);
  if (cos.size() != need || sin.size() != need)
    throw InvalidArgument(fmt::format(
        "RopeTable::from_cos_sin: cos/sin hold {}/{} values, expected n_positions*n_pairs = {}",
        cos.size(), sin.size(), need));
  RopeTable t;
  t.n_positions_ = n_positions;
  t.n_pairs_ = n_pairs;
  t.precision_ = precision;
  t.cos_ = std::move(cos);
  t.sin_ = std::move(sin);
  return t;
}

namespace {

void check_permute_args(const char* what, int64_t rows, int head_dim, int rotary_dim) {
  if (rows < 0) fail_field<InvalidArgument>(fmt::format("{}: rows", what), "must be non-negative", rows);
  if (rotary_dim <= 0 || rotary_dim % 2 != 0)
    fail_field<InvalidArgument>(fmt::format("{}: rotary_dim", what), "must be a positive even number",
                                rotary_dim);
  if (rotary_dim > head_dim)
    throw InvalidArgument(fmt::format("{}: rotary_dim {} exceeds head_dim {}", what, rotary_dim, head_dim));
}

// Channel pair i sits at (2i, 2i+1) in the interleaved layout and at (i, i+n)
// in the half layout; `to_half` moves each row's rotary channels one way or
// the other, leaving the pass-through tail alone.
void permute_rotary(float* x, int64_t rows, int head_dim, int rotary_dim, bool to_half) {
  const int n = rotary_dim / 2;
  std::vector<float> tmp(static_cast<std::size_t>(rotary_dim));
  for (int64_t r = 0; r < rows; ++r) {
    float* row = x + r * head_dim;
    for (int i = 0; i < n; ++i) {
      const auto a = static_cast<std::size_t>(2 * i), b = static_cast<std::size_t>(2 * i + 1);
      const auto lo = static_cast<std::size_t>(i), hi = static_cast<std::size_t>(i + n);
      if (to_half) {
        tmp[lo] = row[a];
        tmp[hi] = row[b];
      } else {
        tmp[a] = row[lo];
        tmp[b] = row[hi];
      }
    }
    std::copy(tmp.begin(), tmp.end(), row);
  }
}

}  // namespace

void rope_interleaved_to_half(float* x, int64_t rows, int head_dim, int rotary_dim) {
  check_permute_args("rope_interleaved_to_half", rows, head_dim, rotary_dim);
  permute_rotary(x, rows, head_dim, rotary_dim, /*to_half=*/true);
}

void rope_half_to_interleaved(float* x, int64_t rows, int head_dim, int rotary_dim) {
  check_permute_args("rope_half_to_interleaved", rows, head_dim, rotary_dim);
  permute_rotary(x, rows, head_dim, rotary_dim, /*to_half=*/false);
}

void apply_rope_interleaved_in_half_out(float* x, int64_t tokens, int heads, int head_dim,
                                        const RopeTable& table, RopeDirection direction) {
  if (tokens < 0 || heads <= 0 || head_dim <= 0)
    throw InvalidArgument(fmt::format("apply_rope_interleaved_in_half_out: bad shape [{}, {}, {}]",
                                      tokens, heads, head_dim));
  if (table.rotary_dim() > head_dim)
    throw InvalidArgument(fmt::format("apply_rope_interleaved_in_half_out: rotary_dim {} exceeds head_dim {}",
                                      table.rotary_dim(), head_dim));
  if (table.n_positions() < tokens)
    throw InvalidArgument(fmt::format("apply_rope_interleaved_in_half_out: table holds {} positions for {} tokens",
                                      table.n_positions(), tokens));
  rope_interleaved_to_half(x, tokens * heads, head_dim, table.rotary_dim());
  apply_rope(x, tokens, heads, head_dim, table, RopeLayout::half, direction);
}

}  // namespace posenc
