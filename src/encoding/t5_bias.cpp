// T5 relative position buckets and bias (Raffel et al. 2020; HF
// models/t5/modeling_t5.py T5Attention._relative_position_bucket and
// compute_bias). See include/posenc/bias.hpp.
#include <cmath>

#include <fmt/format.h>

#include "posenc/bias.hpp"
#include "posenc/checked.hpp"
#include "posenc/error.hpp"

namespace posenc {

int t5_relative_position_bucket(int64_t relative_position, bool bidirectional, int num_buckets,
                                int max_distance) {
  if (num_buckets < (bidirectional ? 4 : 2))
    fail_field<InvalidArgument>("relative_attention_num_buckets",
                                bidirectional ? "must be >= 4 when bidirectional" : "must be >= 2",
                                num_buckets);
  int bucket = 0;
  int64_t n = 0;
  if (bidirectional) {
    num_buckets /= 2;
    if (relative_position > 0) bucket += num_buckets;
    n = relative_position < 0 ? -relative_position : relative_position;
  } else {
    n = relative_position < 0 ? -relative_position : 0;
  }
  const int max_exact = num_buckets / 2;
  if (max_distance <= max_exact)
    throw InvalidArgument(fmt::format(
        "relative_attention_max_distance: must exceed num_buckets/2 = {} (got {})", max_exact,
        max_distance));
  if (n < max_exact) return bucket + static_cast<int>(n);
  // float32, as the reference: log(n.float() / max_exact) / log(max_distance / max_exact)
  // * (num_buckets - max_exact), truncated toward zero.
  const float ratio = static_cast<float>(n) / static_cast<float>(max_exact);
  const float denom = static_cast<float>(std::log(static_cast<double>(max_distance) / max_exact));
  const float scaled = std::log(ratio) / denom * static_cast<float>(num_buckets - max_exact);
  int64_t large = max_exact + static_cast<int64_t>(scaled);
  if (large > num_buckets - 1) large = num_buckets - 1;
  return bucket + static_cast<int>(large);
}

std::vector<int> t5_relative_position_buckets(int64_t q_len, int64_t k_len, int64_t query_offset,
                                              bool bidirectional, int num_buckets, int max_distance) {
  if (q_len < 0 || k_len < 0 || query_offset < 0)
    throw InvalidArgument(fmt::format(
        "t5_relative_position_buckets: q_len {}, k_len {}, query_offset {} must be >= 0", q_len, k_len,
        query_offset));
  // Validate the parameters once even for empty shapes.
  (void)t5_relative_position_bucket(0, bidirectional, num_buckets, max_distance);
  // [q_len, k_len] buckets and the last query position: refused before any allocation when they overflow.
  const int64_t n_out = checked_mul<InvalidArgument>(q_len, k_len, "t5_relative_position_buckets: q_len x k_len");
  (void)checked_mul<InvalidArgument>(n_out, static_cast<int64_t>(sizeof(int)), "t5_relative_position_buckets: bytes");
  (void)checked_add<InvalidArgument>(query_offset, q_len, "t5_relative_position_buckets: query_offset + q_len");
  std::vector<int> out(static_cast<std::size_t>(n_out));
  for (int64_t t = 0; t < q_len; ++t)
    for (int64_t j = 0; j < k_len; ++j)
      out[static_cast<std::size_t>(t * k_len + j)] =
          t5_relative_position_bucket(j - (query_offset + t), bidirectional, num_buckets, max_distance);
  return out;
}

std::vector<float> t5_relative_position_bias(std::span<const float> table, int num_buckets, int heads,
                                             int64_t q_len, int64_t k_len, int64_t query_offset,
                                             bool bidirectional, int max_distance) {
  if (heads <= 0) fail_field<InvalidArgument>("heads", "must be positive", heads);
  if (num_buckets <= 0)
    fail_field<InvalidArgument>("relative_attention_num_buckets", "must be positive", num_buckets);
  if (table.size() != static_cast<std::size_t>(num_buckets) * static_cast<std::size_t>(heads))
    throw InvalidArgument(fmt::format(
        "relative_attention_bias: expected a [{}, {}] table = {} values (got {})", num_buckets, heads,
        static_cast<std::size_t>(num_buckets) * static_cast<std::size_t>(heads), table.size()));
  const std::vector<int> buckets =
      t5_relative_position_buckets(q_len, k_len, query_offset, bidirectional, num_buckets, max_distance);
  const std::size_t plane = buckets.size();  // q_len x k_len, checked above
  (void)checked_mul<InvalidArgument>(
      checked_mul<InvalidArgument>(static_cast<int64_t>(plane), heads, "t5_relative_position_bias: heads x q_len x k_len"),
      static_cast<int64_t>(sizeof(float)), "t5_relative_position_bias: output bytes");
  std::vector<float> out(static_cast<std::size_t>(heads) * plane);
  for (int h = 0; h < heads; ++h)
    for (std::size_t c = 0; c < plane; ++c)
      out[static_cast<std::size_t>(h) * plane + c] =
          table[static_cast<std::size_t>(buckets[c]) * static_cast<std::size_t>(heads) + static_cast<std::size_t>(h)];
  return out;
}

}  // namespace posenc
