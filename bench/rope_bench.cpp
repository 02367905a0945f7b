// RoPE apply throughput next to a plain memory copy of the same bytes.
//
// BM_RopeApply rotates x [tokens, heads, head_dim] float32 in place from
// position ids (apply_rope(x, tokens, heads, freqs, position_ids, ...)): the
// timed work includes computing cos/sin for every (position, pair), in float32
// angle mode as the reference. GBps counts the bytes of x read and written
// (2 * tokens * heads * head_dim * 4 per iteration).
// BM_RopeApplyTable: the same rotation with a precomputed RopeTable.
// BM_MemCopy: memcpy of the same number of bytes (x.size() floats from one
// buffer to another), GBps = bytes read + bytes written, i.e. the same count.
// Arguments: tokens, heads, head_dim, threads (and layout: 0 half, 1 interleaved).
#include <cstring>
#include <numeric>
#include <vector>

#include "bench_util.hpp"
#include "posenc/rope.hpp"

namespace {

using posenc::bench::FloatBuffer;
using posenc::bench::giga_rate;
using posenc::bench::ThreadScope;

std::vector<int64_t> iota_positions(int64_t n) {
  std::vector<int64_t> pos(static_cast<std::size_t>(n));
  std::iota(pos.begin(), pos.end(), int64_t{0});
  return pos;
}

void BM_RopeApply(benchmark::State& state) {
  const int64_t tokens = state.range(0);
  const int heads = static_cast<int>(state.range(1));
  const int head_dim = static_cast<int>(state.range(2));
  const ThreadScope threads(static_cast<int>(state.range(3)));
  const auto layout = state.range(4) == 0 ? posenc::RopeLayout::half : posenc::RopeLayout::interleaved;
  const auto freqs = posenc::default_rope_frequencies(head_dim, head_dim, 10000.0);
  const auto pos = iota_positions(tokens);
  FloatBuffer x(static_cast<std::size_t>(tokens) * heads * head_dim);
  x.fill_normal(1);
  for (auto _ : state) {
    posenc::apply_rope(x.get(), tokens, heads, freqs, pos, layout, posenc::AnglePrecision::float32);
    benchmark::ClobberMemory();
  }
  state.counters["GBps"] = giga_rate(2.0 * static_cast<double>(x.size) * sizeof(float), state);
}

void BM_RopeApplyTable(benchmark::State& state) {
  const int64_t tokens = state.range(0);
  const int heads = static_cast<int>(state.range(1));
  const int head_dim = static_cast<int>(state.range(2));
  const ThreadScope threads(static_cast<int>(state.range(3)));
  const auto layout = state.range(4) == 0 ? posenc::RopeLayout::half : posenc::RopeLayout::interleaved;
  const auto freqs = posenc::default_rope_frequencies(head_dim, head_dim, 10000.0);
  const auto pos = iota_positions(tokens);
  const posenc::RopeTable table(freqs, pos, posenc::AnglePrecision::float32);
  FloatBuffer x(static_cast<std::size_t>(tokens) * heads * head_dim);
  x.fill_normal(1);
  for (auto _ : state) {
    posenc::apply_rope(x.get(), tokens, heads, head_dim, table, layout);
    benchmark::ClobberMemory();
  }
  state.counters["GBps"] = giga_rate(2.0 * static_cast<double>(x.size) * sizeof(float), state);
}

void BM_MemCopy(benchmark::State& state) {
  const std::size_t n = static_cast<std::size_t>(state.range(0)) * state.range(1) * state.range(2);
  const int threads = static_cast<int>(state.range(3));
  FloatBuffer src(n), dst(n);
  src.fill_normal(2);
  for (auto _ : state) {
    if (threads == 1) {
      std::memcpy(dst.get(), src.get(), n * sizeof(float));
    } else {
#pragma omp parallel num_threads(threads)
      {
        const std::size_t nt = static_cast<std::size_t>(omp_get_num_threads());
        const std::size_t id = static_cast<std::size_t>(omp_get_thread_num());
        const std::size_t chunk = (n + nt - 1) / nt / 16 * 16 + 16;
        const std::size_t begin = std::min(n, id * chunk), end = std::min(n, begin + chunk);
        std::memcpy(dst.get() + begin, src.get() + begin, (end - begin) * sizeof(float));
      }
    }
    benchmark::ClobberMemory();
  }
  state.counters["GBps"] = giga_rate(2.0 * static_cast<double>(n) * sizeof(float), state);
}

void rope_shapes(benchmark::internal::Benchmark* b, bool layouts) {
  b->ArgNames({"tokens", "heads", "head_dim", "threads", "interleaved"});
  for (int threads : {1, 2}) {
    b->Args({4096, 32, 128, threads, 0});
    if (layouts) b->Args({4096, 32, 128, threads, 1});
    b->Args({512, 8, 64, threads, 0});
    if (layouts) b->Args({512, 8, 64, threads, 1});
  }
  b->UseRealTime()->Unit(benchmark::kMillisecond);
}

}  // namespace

BENCHMARK(BM_MemCopy)->Apply([](auto* b) { rope_shapes(b, false); });
BENCHMARK(BM_RopeApply)->Apply([](auto* b) { rope_shapes(b, true); });
BENCHMARK(BM_RopeApplyTable)->Apply([](auto* b) { rope_shapes(b, false); });
