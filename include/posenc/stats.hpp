// posenc — statistics of the evaluation lab: Wilson score intervals for a
// success rate, and the "effective context" of a task under one encoding.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

namespace posenc {

/// A two-sided confidence interval [low, high] for a proportion.
struct Interval {
  double low = 0.0;
  double high = 1.0;
};

/// z of the two-sided 95% normal interval (the 0.975 quantile of N(0, 1)).
inline constexpr double kZ95 = 1.959963984540054;

/// Wilson score interval (E. B. Wilson, "Probable inference, the law of
/// succession, and statistical inference", JASA 22 (1927) 209-212), as
/// statsmodels.stats.proportion.proportion_confint(method="wilson"):
///   p = k/n, c = (p + z^2/(2n)) / (1 + z^2/n),
///   half = z / (1 + z^2/n) * sqrt(p(1-p)/n + z^2/(4n^2)),
///   [c - half, c + half], clipped to [0, 1] (0/n gives low = 0, n/n high = 1).
/// n = 0 gives the uninformative [0, 1]. Throws InvalidArgument for k < 0,
/// n < 0, k > n or z not finite and > 0.
Interval wilson_interval(int64_t successes, int64_t n, double z = kZ95);

/// Depth-averaged accuracy of one task under one encoding at each length, in
/// increasing length order; the input of effective_context().
struct LengthAccuracy {
  int64_t length = 0;
  double accuracy = 0.0;  ///< mean over depths of the cell accuracies
  int64_t n = 0;          ///< samples pooled over depths
  int64_t correct = 0;    ///< successes pooled over depths
};

/// The effective context of a task under one encoding (RULER's notion, with a
/// baseline relative threshold):
///   baseline  = accuracy at the shortest length;
///   threshold = relative_threshold * baseline;
///   solvable  = the baseline is significantly above chance (the Wilson 95%
///               lower bound of the pooled shortest-length successes exceeds
///               `chance`: 1/K for K-way forced choice, 0 for generation) and
///               baseline >= min_baseline. Otherwise the task is "not solvable
///               by this model" and no effective length is given: a failure at
///               the baseline is not a length failure;
///   length    = the longest length L such that every tested length <= L has
///               accuracy >= threshold (accuracy must *stay* above it), or
///               nullopt when even the shortest length fails.
struct EffectiveContext {
  double baseline = 0.0;
  Interval baseline_ci;  ///< Wilson 95% of the pooled shortest-length samples
  double threshold = 0.0;
  bool solvable = false;
  std::optional<int64_t> length;
};

/// Throws InvalidArgument for an empty or unsorted list, thresholds or chance
/// outside [0, 1], or a shortest length without samples (n = 0).
EffectiveContext effective_context(std::span<const LengthAccuracy> by_length, double relative_threshold,
                                   double chance, double min_baseline = 0.0);

}  // namespace posenc
