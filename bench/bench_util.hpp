// posenc benchmarks — shared helpers (buffers, counters, thread control).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <random>
#include <sstream>
#include <string>

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

/// The share of the resident bytes of this process's mappings that `pick` selects (by start address and path,
/// from /proc/self/smaps) which are mapped by 2 MiB page-table entries (AnonHugePages + FilePmdMapped over Rss);
/// -1 where smaps cannot be read or nothing selected is resident. Decode's read rate depends on it (TLB walks).
template <class Pick>
double huge_page_share(Pick pick) {
  std::ifstream smaps("/proc/self/smaps");
  double rss = 0, huge = 0;
  bool in = false;
  for (std::string line; std::getline(smaps, line);) {
    const auto colon = line.find(':');
    const auto dash = line.find('-');
    if (dash != std::string::npos && dash < line.find(' ') && (colon == std::string::npos || dash < colon)) {
      // "start-end perms offset dev inode   path"
      const uintptr_t start = std::stoull(line.substr(0, dash), nullptr, 16);
      std::istringstream fields(line);
      std::string range, perms, offset, dev, inode, path;
      fields >> range >> perms >> offset >> dev >> inode;
      std::getline(fields >> std::ws, path);
      in = pick(start, path);
      continue;
    }
    if (!in || colon == std::string::npos) continue;
    const std::string key = line.substr(0, colon);
    if (key != "Rss" && key != "AnonHugePages" && key != "FilePmdMapped") continue;
    const double kb = std::stod(line.substr(colon + 1));
    (key == "Rss" ? rss : huge) += kb;
  }
  return rss > 0 ? huge / rss : -1.0;
}

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
