// RoFormer's long-term decay bound (Su et al. 2021, §3.4.3, eq. 35-37).
#include <algorithm>
#include <cmath>

#include <fmt/format.h>

#include "posenc/analysis.hpp"
#include "posenc/error.hpp"

namespace posenc {

std::vector<double> rope_decay_thetas(int head_dim, double rope_theta) {
  if (head_dim <= 0 || head_dim % 2 != 0)
    fail_field<ConfigError>("head_dim", "must be a positive even number", head_dim);
  if (!std::isfinite(rope_theta) || rope_theta <= 0)
    fail_field<ConfigError>("rope_theta", "must be finite and > 0", rope_theta);
  std::vector<double> t(static_cast<std::size_t>(head_dim / 2));
  for (int k = 0; k < head_dim / 2; ++k)
    t[static_cast<std::size_t>(k)] =
        std::pow(rope_theta, -2.0 * static_cast<double>(k) / static_cast<double>(head_dim));
  return t;
}

double rope_decay_bound(std::span<const double> thetas, double distance) {
  if (thetas.empty()) throw ConfigError("head_dim: the decay bound needs at least one frequency");
  // S_j = Σ_{k<j} e^{i r θ_k}; accumulate |S_j| for j = 1..n.
  double re = 0, im = 0, total = 0;
  for (double th : thetas) {
    const double a = distance * th;
    re += std::cos(a);
    im += std::sin(a);
    total += std::hypot(re, im);
  }
  return total / static_cast<double>(thetas.size());
}

std::vector<int64_t> decay_grid(int64_t max_distance, int64_t dense_until, int per_decade) {
  if (max_distance < 1) fail_field<ConfigError>("max_distance", "must be >= 1", max_distance);
  if (dense_until < 1) fail_field<ConfigError>("dense_until", "must be >= 1", dense_until);
  if (per_decade < 1) fail_field<ConfigError>("per_decade", "must be >= 1", per_decade);
  std::vector<int64_t> grid;
  const int64_t dense = std::min(dense_until, max_distance);
  for (int64_t r = 0; r <= dense; ++r) grid.push_back(r);
  for (int j = 1;; ++j) {
    const double v = static_cast<double>(dense) * std::pow(10.0, static_cast<double>(j) / per_decade);
    const int64_t r = static_cast<int64_t>(std::llround(v));
    if (r >= max_distance) break;
    if (r > grid.back()) grid.push_back(r);
  }
  if (grid.back() != max_distance) grid.push_back(max_distance);
  return grid;
}

std::vector<DecayPoint> rope_decay_curve(int head_dim, double rope_theta, int64_t max_distance) {
  const auto thetas = rope_decay_thetas(head_dim, rope_theta);
  const auto grid = decay_grid(max_distance);
  std::vector<DecayPoint> out;
  out.reserve(grid.size());
  for (int64_t r : grid) out.push_back({r, rope_decay_bound(thetas, static_cast<double>(r))});
  return out;
}

}  // namespace posenc
