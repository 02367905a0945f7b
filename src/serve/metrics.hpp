// Counters and histograms of posenc serve, rendered as Prometheus text
// exposition format 0.0.4 (internal).
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <utility>

namespace posenc::serve::detail {

/// A cumulative histogram with fixed upper bounds (seconds).
class Histogram {
 public:
  static constexpr std::array<double, 14> kBounds = {0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                                                     1.0,   2.5,  5.0,   10.0, 30.0, 60.0, 120.0};
  void observe(double seconds);
  /// "<name>_bucket{le=...} n" lines (+Inf included), _sum and _count.
  std::string render(const std::string& name) const;

 private:
  std::array<int64_t, kBounds.size() + 1> counts_{};
  double sum_ = 0;
  int64_t count_ = 0;
};

struct MetricsSnapshot {
  std::map<std::pair<std::string, int>, int64_t> requests;  ///< (endpoint, status) -> count
  int64_t prompt_tokens = 0, computed_prompt_tokens = 0, generation_tokens = 0;
  int64_t prefix_cache_hits = 0, cancelled = 0, completed = 0, steps = 0, max_step_sequences = 0;
  Histogram request_duration, time_to_first_token;
};

/// Thread-safe: HTTP workers count requests, the scheduler counts tokens.
class Metrics {
 public:
  void count_request(const std::string& endpoint, int status);
  void add_tokens(int64_t prompt, int64_t computed_prompt, bool prefix_hit);
  void add_generated(int64_t n);
  void completed(double seconds, std::optional<double> first_token_seconds);
  void cancelled();
  void step(int64_t sequences);
  MetricsSnapshot snapshot() const;

 private:
  mutable std::mutex mu_;
  MetricsSnapshot s_;
};

/// The /metrics text: the snapshot plus the gauges given.
std::string render_metrics(const MetricsSnapshot& s, int64_t queue_depth, int64_t running, int64_t kv_blocks_in_use,
                           int64_t kv_blocks_total, int64_t prefix_cache_sequences);

}  // namespace posenc::serve::detail
