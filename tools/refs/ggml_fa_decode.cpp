// One decode step of ggml's flash attention (ggml_flash_attn_ext) on the CPU backend, timed: the peer of
// posenc's BM_AttentionDecodeLong (bench/attention_bench.cpp). Built and run by scripts/bench-attention-vs-ggml
// against node-llama-cpp's prebuilt libggml (GGML_BACKEND_PATH names the libggml-cpu-<variant>.so).
//
//   ggml_fa_decode KV_TOKENS HEADS KV_HEADS HEAD_DIM THREADS REPS
//
// Tensors as llama.cpp's graph builds them for a decode step with -fa on (src/llama-graph.cpp, build_attn_mha):
// the cache K and V [n_kv][kv_heads][head_dim] F16 (its default cache type), viewed and permuted to
// [head_dim, n_kv, kv_heads]; q [1][heads][head_dim] F32 permuted likewise; an F16 mask [n_kv, 1] of zeros
// (every key visible); scale 1/sqrt(head_dim). Prints one line: milliseconds per call (median of REPS after
// one warm-up call), K+V bytes read per call and the rate.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "ggml.h"

int main(int argc, char** argv) {
  if (argc != 7) {
    std::fprintf(stderr, "usage: %s KV_TOKENS HEADS KV_HEADS HEAD_DIM THREADS REPS\n", argv[0]);
    return 2;
  }
  const int64_t n_kv = std::atoll(argv[1]);
  const int heads = std::atoi(argv[2]), kv_heads = std::atoi(argv[3]), head_dim = std::atoi(argv[4]);
  const int threads = std::atoi(argv[5]), reps = std::atoi(argv[6]);
  if (n_kv <= 0 || heads <= 0 || kv_heads <= 0 || heads % kv_heads != 0 || head_dim <= 0 || threads <= 0 ||
      reps <= 0) {
    std::fprintf(stderr, "ggml_fa_decode: bad arguments\n");
    return 2;
  }
  const char* path = std::getenv("GGML_BACKEND_PATH");
  ggml_backend_reg_t reg = path ? ggml_backend_load(path) : nullptr;
  if (!reg) {
    std::fprintf(stderr, "ggml_fa_decode: GGML_BACKEND_PATH must name a loadable libggml-cpu-*.so\n");
    return 1;
  }
  ggml_backend_t backend = ggml_backend_dev_init(ggml_backend_reg_dev_get(reg, 0), nullptr);
  auto set_threads = reinterpret_cast<ggml_backend_set_n_threads_t>(
      ggml_backend_reg_get_proc_address(reg, "ggml_backend_set_n_threads"));
  if (!backend || !set_threads) {
    std::fprintf(stderr, "ggml_fa_decode: no CPU backend in %s\n", path);
    return 1;
  }
  set_threads(backend, threads);

  ggml_init_params ip{16 * ggml_tensor_overhead() + ggml_graph_overhead(), nullptr, true};
  ggml_context* ctx = ggml_init(ip);
  ggml_tensor* q = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, head_dim, heads, 1);
  ggml_tensor* k = ggml_new_tensor_3d(ctx, GGML_TYPE_F16, head_dim, kv_heads, n_kv);
  ggml_tensor* v = ggml_new_tensor_3d(ctx, GGML_TYPE_F16, head_dim, kv_heads, n_kv);
  ggml_tensor* mask = ggml_new_tensor_4d(ctx, GGML_TYPE_F16, n_kv, 1, 1, 1);
  ggml_tensor* out = ggml_flash_attn_ext(ctx, ggml_permute(ctx, q, 0, 2, 1, 3), ggml_permute(ctx, k, 0, 2, 1, 3),
                                         ggml_permute(ctx, v, 0, 2, 1, 3), mask,
                                         1.0f / std::sqrt(static_cast<float>(head_dim)), 0.0f, 0.0f);
  ggml_cgraph* graph = ggml_new_graph(ctx);
  ggml_build_forward_expand(graph, out);
  ggml_backend_buffer_t buf = ggml_backend_alloc_ctx_tensors(ctx, backend);
  if (!buf) {
    std::fprintf(stderr, "ggml_fa_decode: allocating the tensors failed\n");
    return 1;
  }
  std::mt19937 rng(1);
  std::normal_distribution<float> nd;
  auto fill16 = [&](ggml_tensor* t, bool zero) {
    std::vector<float> f(static_cast<std::size_t>(ggml_nelements(t)));
    for (float& x : f) x = zero ? 0.0f : nd(rng);
    std::vector<ggml_fp16_t> h(f.size());
    ggml_fp32_to_fp16_row(f.data(), h.data(), static_cast<int64_t>(f.size()));
    ggml_backend_tensor_set(t, h.data(), 0, h.size() * sizeof(ggml_fp16_t));
  };
  fill16(k, false);
  fill16(v, false);
  fill16(mask, true);
  std::vector<float> qf(static_cast<std::size_t>(ggml_nelements(q)));
  for (float& x : qf) x = nd(rng);
  ggml_backend_tensor_set(q, qf.data(), 0, qf.size() * sizeof(float));

  if (ggml_backend_graph_compute(backend, graph) != GGML_STATUS_SUCCESS) {
    std::fprintf(stderr, "ggml_fa_decode: graph compute failed\n");
    return 1;
  }
  std::vector<double> ms;
  for (int r = 0; r < reps; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    ggml_backend_graph_compute(backend, graph);
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(ms.begin(), ms.end());
  const double med = ms[ms.size() / 2];
  const double bytes = 2.0 * static_cast<double>(n_kv) * kv_heads * head_dim * 2.0;
  std::printf("ggml_flash_attn_ext decode: n_kv %lld heads %d kv_heads %d head_dim %d threads %d: %.3f ms "
              "(median of %d), %.0f MB K+V, %.2f GB/s\n",
              static_cast<long long>(n_kv), heads, kv_heads, head_dim, threads, med, reps, bytes / 1e6,
              bytes / med / 1e6);
  ggml_backend_buffer_free(buf);
  ggml_free(ctx);
  ggml_backend_free(backend);
  return 0;
}
