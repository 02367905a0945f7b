// posenc benchmarks — shared helpers (buffers, counters, thread control).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>

#include <benchmark/benchmark.h>
#include <omp.h>

namespace posenc::bench {

/// 64-byte aligned float buffer, zero pages touched at construction so the
/// first timed iteration does not pay the page faults.
struct FloatBuffer {
  explicit FloatBuffer(std::size_t n) : size(n) {
    void* p = std::aligned_alloc(64, (n * sizeof(float) + 63) / 64 * 64);
    data.reset(static_cast<float*>(p));
    std::memset(data.get(), 0, n * sizeof(float));
  }
  void fill_normal(uint32_t seed, float stddev = 1.0f) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> nd(0.0f, stddev);
    for (std::size_t i = 0; i < size; ++i) data[i] = nd(rng);
  }
  float* get() { return data.get(); }
  const float* get() const { return data.get(); }
  struct Free {
    void operator()(float* p) const { std::free(p); }
  };
  std::unique_ptr<float[], Free> data;
  std::size_t size;
};

/// Sets OpenMP's thread count for the lifetime of the object.
struct ThreadScope {
  explicit ThreadScope(int n) : saved(omp_get_max_threads()) { omp_set_num_threads(n); }
  ~ThreadScope() { omp_set_num_threads(saved); }
  int saved;
};

/// A per-second rate counter in units of 1e9 (GB/s, GFLOP/s): `amount` is the
/// amount of one iteration.
inline benchmark::Counter giga_rate(double amount_per_iteration, benchmark::State& state) {
  return benchmark::Counter(amount_per_iteration * static_cast<double>(state.iterations()) / 1e9,
                            benchmark::Counter::kIsRate);
}

}  // namespace posenc::bench
