#include "posenc/stats.hpp"

#include <algorithm>
#include <cmath>

#include "posenc/error.hpp"

namespace posenc {

Interval wilson_interval(int64_t k, int64_t n, double z) {
  if (n < 0) fail_field<InvalidArgument>("n", "must be >= 0", n);
  if (k < 0 || k > n) throw InvalidArgument(fmt::format("successes: must be in [0, n = {}] (got {})", n, k));
  if (!std::isfinite(z) || z <= 0) fail_field<InvalidArgument>("z", "must be finite and > 0", z);
  if (n == 0) return {0.0, 1.0};
  const double nn = static_cast<double>(n);
  const double p = static_cast<double>(k) / nn;
  const double z2 = z * z;
  const double denom = 1.0 + z2 / nn;
  const double centre = (p + z2 / (2.0 * nn)) / denom;
  const double half = z / denom * std::sqrt(p * (1.0 - p) / nn + z2 / (4.0 * nn * nn));
  Interval r{centre - half, centre + half};
  // Exact at the edges (the formula gives 0 resp. 1 up to rounding).
  if (k == 0) r.low = 0.0;
  if (k == n) r.high = 1.0;
  r.low = std::clamp(r.low, 0.0, 1.0);
  r.high = std::clamp(r.high, 0.0, 1.0);
  return r;
}

EffectiveContext effective_context(std::span<const LengthAccuracy> by_length, double relative_threshold,
                                   double chance, double min_baseline) {
  if (by_length.empty()) throw InvalidArgument("effective_context: no lengths");
  for (std::size_t i = 1; i < by_length.size(); ++i)
    if (by_length[i].length <= by_length[i - 1].length)
      fail_field<InvalidArgument>("lengths", "must be strictly increasing", by_length[i].length);
  if (!(relative_threshold >= 0.0 && relative_threshold <= 1.0))
    fail_field<InvalidArgument>("threshold", "must be in [0, 1]", relative_threshold);
  if (!(min_baseline >= 0.0 && min_baseline <= 1.0))
    fail_field<InvalidArgument>("min_baseline", "must be in [0, 1]", min_baseline);
  if (!(chance >= 0.0 && chance <= 1.0)) fail_field<InvalidArgument>("chance", "must be in [0, 1]", chance);
  const LengthAccuracy& b = by_length.front();
  if (b.n <= 0) fail_field<InvalidArgument>("baseline n", "the shortest length needs samples", b.n);
  EffectiveContext e;
  e.baseline = b.accuracy;
  e.baseline_ci = wilson_interval(b.correct, b.n);
  e.threshold = relative_threshold * e.baseline;
  e.solvable = e.baseline_ci.low > chance && e.baseline >= min_baseline;
  if (!e.solvable) return e;
  for (const auto& la : by_length) {
    if (la.accuracy < e.threshold) break;
    e.length = la.length;
  }
  return e;
}

}  // namespace posenc
