// ALiBi slopes and bias tensors (Press et al., ICLR 2022) in the numerics of
// llama.cpp, BLOOM, Falcon and MPT. See include/posenc/bias.hpp.
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>

#include <fmt/format.h>

#include "posenc/bias.hpp"
#include "posenc/checked.hpp"
#include "posenc/error.hpp"

namespace posenc {

namespace {

void check_heads(int n_heads) {
  if (n_heads <= 0) fail_field<InvalidArgument>("n_heads", "must be positive", n_heads);
}

}  // namespace

std::vector<float> alibi_slopes(int n_heads, double max_bias) {
  check_heads(n_heads);
  if (!std::isfinite(max_bias) || max_bias <= 0)
    fail_field<InvalidArgument>("max_bias", "must be finite and > 0", max_bias);
  int p = 1;
  while (p * 2 <= n_heads) p *= 2;
  const double m0 = std::pow(2.0, -max_bias / p);
  const double m1 = std::pow(2.0, -(max_bias / 2.0) / p);
  std::vector<float> slopes(static_cast<std::size_t>(n_heads));
  for (int h = 0; h < n_heads; ++h) {
    const double m = h < p ? std::pow(m0, h + 1) : std::pow(m1, 2 * (h - p) + 1);
    slopes[static_cast<std::size_t>(h)] = static_cast<float>(m);
  }
  return slopes;
}

std::vector<float> bloom_alibi_slopes(int n_heads) {
  check_heads(n_heads);
  // closest_power_of_2 = 2 ** floor(log2(num_heads))
  int p = 1;
  while (p * 2 <= n_heads) p *= 2;
  // base = float32(2 ** (-(2 ** -(log2(p) - 3)))), i.e. 2^(-8/p) in double, then float32.
  auto base_for = [](int q) {
    return static_cast<float>(std::pow(2.0, -std::pow(2.0, -(std::log2(static_cast<double>(q)) - 3.0))));
  };
  const float base = base_for(p);
  std::vector<float> slopes;
  slopes.reserve(static_cast<std::size_t>(n_heads));
  for (int k = 1; k <= p; ++k) slopes.push_back(std::pow(base, static_cast<float>(k)));  // float32 pow
  if (p != n_heads) {
    const float extra_base = base_for(2 * p);
    const int remaining = std::min(p, n_heads - p);
    for (int k = 1; k < 1 + 2 * remaining; k += 2)
      slopes.push_back(std::pow(extra_base, static_cast<float>(k)));
  }
  return slopes;
}

float round_to_bfloat16(float x) {
  if (std::isnan(x)) return x;
  uint32_t bits = std::bit_cast<uint32_t>(x);
  const uint32_t lsb = (bits >> 16) & 1u;
  bits += 0x7FFFu + lsb;  // round half to even
  bits &= 0xFFFF0000u;
  return std::bit_cast<float>(bits);
}

std::vector<float> falcon_alibi_slopes(int n_heads) {
  std::vector<float> s = bloom_alibi_slopes(n_heads);
  for (float& v : s) v = round_to_bfloat16(v);
  return s;
}

std::vector<float> mpt_alibi_slopes(int n_heads, double alibi_bias_max) {
  check_heads(n_heads);
  if (!std::isfinite(alibi_bias_max) || alibi_bias_max <= 0)
    fail_field<InvalidArgument>("alibi_bias_max", "must be finite and > 0", alibi_bias_max);
  // num_heads_power_of_2 = 2 ** ceil(log2(num_heads))
  int p = 1;
  while (p < n_heads) p *= 2;
  const float step = static_cast<float>(alibi_bias_max / p);
  std::vector<float> all(static_cast<std::size_t>(p));
  for (int k = 1; k <= p; ++k)
    all[static_cast<std::size_t>(k - 1)] = 1.0f / std::pow(2.0f, static_cast<float>(k) * step);
  if (p == n_heads) return all;
  std::vector<float> slopes;
  slopes.reserve(static_cast<std::size_t>(p));
  for (int i = 1; i < p; i += 2) slopes.push_back(all[static_cast<std::size_t>(i)]);  // k = 2, 4, ...
  for (int i = 0; i < p; i += 2) slopes.push_back(all[static_cast<std::size_t>(i)]);  // k = 1, 3, ...
  slopes.resize(static_cast<std::size_t>(n_heads));
  return slopes;
}

void alibi_bias_row(float slope, int64_t query_position, std::span<const int64_t> key_positions,
                    AlibiForm form, std::span<float> out) {
  if (!std::isfinite(slope)) fail_field<InvalidArgument>("slope", "must be finite", slope);
  if (out.size() < key_positions.size())
    throw InvalidArgument(fmt::format("alibi_bias_row: out holds {} values for {} keys", out.size(),
                                      key_positions.size()));
  for (std::size_t j = 0; j < key_positions.size(); ++j) {
    int64_t d = query_position - key_positions[j];
    if (form == AlibiForm::symmetric && d < 0) d = -d;
    out[j] = -(slope * static_cast<float>(d));
  }
}

std::vector<float> alibi_bias(std::span<const float> slopes, int64_t q_len, int64_t k_len,
                              int64_t query_offset, AlibiForm form) {
  if (slopes.empty()) throw InvalidArgument("alibi_bias: slopes is empty (need one per head)");
  if (q_len < 0 || k_len < 0 || query_offset < 0)
    throw InvalidArgument(fmt::format("alibi_bias: q_len {}, k_len {}, query_offset {} must be >= 0",
                                      q_len, k_len, query_offset));
  // [heads, q_len, k_len] float32 and the last query position: refused before any allocation when they overflow.
  const int64_t n_out = checked_mul<InvalidArgument>(
      checked_mul<InvalidArgument>(static_cast<int64_t>(slopes.size()), q_len, "alibi_bias: heads x q_len"), k_len,
      "alibi_bias: heads x q_len x k_len");
  (void)checked_mul<InvalidArgument>(n_out, static_cast<int64_t>(sizeof(float)), "alibi_bias: output bytes");
  (void)checked_add<InvalidArgument>(query_offset, q_len, "alibi_bias: query_offset + q_len");
  std::vector<int64_t> keys(static_cast<std::size_t>(k_len));
  for (int64_t j = 0; j < k_len; ++j) keys[static_cast<std::size_t>(j)] = j;
  const std::size_t row = static_cast<std::size_t>(k_len);
  std::vector<float> out(static_cast<std::size_t>(n_out));
  for (std::size_t h = 0; h < slopes.size(); ++h)
    for (int64_t t = 0; t < q_len; ++t)
      alibi_bias_row(slopes[h], query_offset + t, keys, form,
                     std::span<float>(out).subspan((h * static_cast<std::size_t>(q_len) + static_cast<std::size_t>(t)) * row, row));
  return out;
}

std::vector<float> build_bloom_alibi_tensor(std::span<const int64_t> attention_mask, int64_t batch,
                                            int64_t seq_len, int n_heads, AlibiTensorStyle style) {
  if (batch < 0 || seq_len < 0)
    throw InvalidArgument(fmt::format("attention_mask: bad shape [{}, {}]", batch, seq_len));
  const int64_t n_mask = checked_mul<InvalidArgument>(batch, seq_len, "attention_mask: batch x seq_len");
  if (attention_mask.size() != static_cast<std::size_t>(n_mask))
    throw InvalidArgument(fmt::format("attention_mask: expected [{}, {}] = {} values (got {})", batch,
                                      seq_len, n_mask, attention_mask.size()));
  const bool falcon = style == AlibiTensorStyle::falcon;
  const std::vector<float> slopes = falcon ? falcon_alibi_slopes(n_heads) : bloom_alibi_slopes(n_heads);
  const std::size_t L = static_cast<std::size_t>(seq_len);
  const int64_t n_out = checked_mul<InvalidArgument>(n_mask, n_heads, "alibi tensor: batch x heads x seq_len");
  (void)checked_mul<InvalidArgument>(n_out, static_cast<int64_t>(sizeof(float)), "alibi tensor: output bytes");
  std::vector<float> out(static_cast<std::size_t>(n_out));
  std::vector<int64_t> key_index(L);
  for (int64_t b = 0; b < batch; ++b) {
    int64_t cumsum = 0;
    for (std::size_t j = 0; j < L; ++j) {
      const int64_t m = attention_mask[static_cast<std::size_t>(b) * L + j];
      if (m != 0 && m != 1)
        fail_field<InvalidArgument>(fmt::format("attention_mask[{}][{}]", b, j), "must be 0 or 1", m);
      cumsum += m;
      key_index[j] = (cumsum - 1) * m;
    }
    for (int h = 0; h < n_heads; ++h) {
      float* row = out.data() + (static_cast<std::size_t>(b) * static_cast<std::size_t>(n_heads) + static_cast<std::size_t>(h)) * L;
      for (std::size_t j = 0; j < L; ++j) {
        const float v = slopes[static_cast<std::size_t>(h)] * static_cast<float>(key_index[j]);
        row[j] = falcon ? round_to_bfloat16(v) : v;
      }
    }
  }
  return out;
}

std::vector<float> build_mpt_alibi_tensor(int n_heads, int64_t seq_len, double alibi_bias_max) {
  if (seq_len < 0) fail_field<InvalidArgument>("sequence_length", "must be non-negative", seq_len);
  const std::vector<float> slopes = mpt_alibi_slopes(n_heads, alibi_bias_max);
  const std::size_t L = static_cast<std::size_t>(seq_len);
  const int64_t n_out = checked_mul<InvalidArgument>(n_heads, seq_len, "mpt alibi tensor: heads x sequence_length");
  (void)checked_mul<InvalidArgument>(n_out, static_cast<int64_t>(sizeof(float)), "mpt alibi tensor: output bytes");
  std::vector<float> out(static_cast<std::size_t>(n_out));
  for (int h = 0; h < n_heads; ++h)
    for (std::size_t j = 0; j < L; ++j)
      out[static_cast<std::size_t>(h) * L + j] =
          static_cast<float>(static_cast<int64_t>(j) - (seq_len - 1)) * slopes[static_cast<std::size_t>(h)];
  return out;
}

}  // namespace posenc
