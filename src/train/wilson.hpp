// TEMPORARY: the Wilson score interval until the evaluation lab's
// posenc/stats.hpp (branch eval) lands on main; then study.cpp includes that
// and this file goes. Same formula and signature as its wilson_interval().
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace posenc::detail {

struct Interval {
  double low = 0.0;
  double high = 1.0;
};

/// Wilson (1927) score interval for k successes in n trials, z = 1.96 (95%);
/// [0, 1] for n = 0.
inline Interval wilson_interval(int64_t k, int64_t n, double z = 1.959963984540054) {
  if (n <= 0) return {};
  const double p = static_cast<double>(k) / static_cast<double>(n), nn = static_cast<double>(n);
  const double d = 1.0 + z * z / nn;
  const double c = (p + z * z / (2.0 * nn)) / d;
  const double h = z / d * std::sqrt(p * (1.0 - p) / nn + z * z / (4.0 * nn * nn));
  return {k == 0 ? 0.0 : std::max(0.0, c - h), k == n ? 1.0 : std::min(1.0, c + h)};
}

}  // namespace posenc::detail
