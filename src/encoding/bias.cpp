#include "posenc/bias.hpp"

#include <cmath>
#include <cstdlib>

#include <fmt/format.h>

#include "posenc/error.hpp"

namespace posenc {

std::vector<float> alibi_slopes(int n_heads, double max_bias) {
  if (n_heads <= 0) fail_field<InvalidArgument>("n_heads", "must be positive", n_heads);
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
  const float scaled =
      std::log(ratio) / denom * static_cast<float>(num_buckets - max_exact);
  int64_t large = max_exact + static_cast<int64_t>(scaled);
  if (large > num_buckets - 1) large = num_buckets - 1;
  return bucket + static_cast<int>(large);
}

}  // namespace posenc
