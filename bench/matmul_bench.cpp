// The products with weights as stored (src/model/kernels_dense.hpp, kernels.hpp) on the projection shapes of the
// 487M-parameter benchmark Llama (dim 1024, 16 heads / 4 KV heads, ffn 4864): the kernels alone, without the
// rest of a forward pass, to set against BM_FmaPeak (prefill, compute-bound) and BM_DramRead (decode,
// memory-bound) of the same process.
//   BM_MatmulPrefill/<dtype>/<path>/<out>x<in>/threads:T   y[256, out] = x[256, in] W^T: GFLOP_per_s (one
//                                                          matrix, which stays in a large L3; a model's come from
//                                                          DRAM, about 10% slower here)
//   BM_MatmulDecode/<dtype>/<path>/<out>x<in>/threads:T    one row of x against a 64 MiB+ stack of the matrix
//                                                          (so that it comes from DRAM, as a model's does):
//                                                          weight_GB_per_s
//   BM_MatmulDecodeCached/<dtype>/<path>/256x1024/threads:1  the same product on one matrix, which stays in L2
//                                                          (F32's 1 MiB: L2 or L3): weight_GB_per_s, the loop's
//                                                          own cost, what a decode reads at when memory is not
//                                                          its limit (to set against BM_DramRead: a loop that
//                                                          cannot outrun the DRAM from cache is arithmetic-bound)
// <path> is a DenseKernel (reference is left out: minutes per iteration), or q8_<Q8Kernel> (Q8_0/Q4_0 weights
// with activations quantized to Q8_0: matmul_q8_with, the quantization included in the time), or amx_bf16x3 /
// amx_bf16x6 (F16/BF16 weights: matmul_bf16_split, the activations' split into bf16 terms included).
#include <string>
#include <vector>

#include "bench_util.hpp"
#include "model/kernels.hpp"
#include "model/kernels_dense.hpp"
#include "posenc/gguf.hpp"

namespace {

using namespace posenc;
using namespace posenc::detail;

/// `copies` matrices of [out, in] random weights stored as t, one after the other.
struct Stack {
  std::vector<std::byte> bytes;
  std::vector<RawMatrix> m;
  Stack(WeightType t, int64_t out, int64_t in, int copies) {
    posenc::bench::FloatBuffer w(static_cast<std::size_t>(out * in));
    w.fill_normal(1, 0.05f);
    const std::vector<float> wv(w.get(), w.get() + w.size);
    const std::vector<std::byte> one = ggml_quantize(ggml_type(t), wv);
    bytes.resize(one.size() * static_cast<std::size_t>(copies));
    for (int i = 0; i < copies; ++i) std::copy(one.begin(), one.end(), bytes.begin() + static_cast<std::ptrdiff_t>(i * one.size()));
    for (int i = 0; i < copies; ++i) {
      RawMatrix r;
      r.type = t;
      r.data = bytes.data() + i * one.size();
      r.rows = out;
      r.cols = in;
      r.name = "bench";
      m.push_back(r);
    }
  }
};

struct Shape {
  int64_t out, in;
};
constexpr Shape kShapes[] = {{1024, 1024}, {256, 1024}, {4864, 1024}, {1024, 4864}};

void run(benchmark::State& state, WeightType t, const std::string& path, Shape s, int64_t n, int threads,
         bool cached = false) {
  posenc::bench::ThreadScope scope(threads);
  // Decode: enough copies that the matrices outgrow the last-level cache (480 MiB here) and are read from DRAM.
  RawMatrix shape;
  shape.type = t;
  shape.cols = s.in;
  const int64_t one = shape.row_bytes() * s.out;
  const int copies = n == 1 && !cached ? static_cast<int>(std::max<int64_t>(1, (int64_t{768} << 20) / one)) : 1;
  const Stack w(t, s.out, s.in, copies);
  posenc::bench::FloatBuffer x(static_cast<std::size_t>(n * s.in)), y(static_cast<std::size_t>(n * s.out));
  x.fill_normal(2);
  std::vector<std::byte> xq(static_cast<std::size_t>(n * (s.in / kQBlock) * kQ8Bytes));
  const bool q8 = path.starts_with("q8_"), split = path.starts_with("amx_bf16");
  const Bf16Split bs = path == "amx_bf16x3" ? Bf16Split::x3 : Bf16Split::x6;
  DenseKernel k = DenseKernel::reference;
  for (DenseKernel c : {DenseKernel::avx2, DenseKernel::avx512})
    if (path == to_string(c)) k = c;
  Q8Kernel qk = Q8Kernel::reference;
  for (Q8Kernel c : {Q8Kernel::avx2, Q8Kernel::avx512_vnni, Q8Kernel::amx})
    if (path == "q8_" + std::string(to_string(c))) qk = c;
  if (split ? !amx_bf16_supported() : q8 ? !q8_kernel_supported(qk) : !dense_kernel_supported(k)) {
    state.SkipWithError("this CPU cannot run the path");
    return;
  }
  int i = 0;
  for (auto _ : state) {
    const RawMatrix& m = w.m[static_cast<std::size_t>(i++ % copies)];
    if (split) {
      matmul_bf16_split(bs, x.get(), n, m, y.get(), false);
    } else if (q8) {
      quantize_rows_q8_0(x.get(), n, s.in, xq.data());
      matmul_q8_with(qk, xq.data(), n, s.in, m.data, t == WeightType::q4_0, s.out, y.get(), false);
    } else {
      matmul_w_with(k, x.get(), n, m, y.get(), false);
    }
    benchmark::DoNotOptimize(y.get());
  }
  if (n == 1)
    state.counters["weight_GB_per_s"] = posenc::bench::giga_rate(static_cast<double>(one), state);
  else
    state.counters["GFLOP_per_s"] = posenc::bench::giga_rate(2.0 * n * s.out * s.in, state);
}

const bool registered = [] {
  for (WeightType t : {WeightType::f32, WeightType::f16, WeightType::bf16, WeightType::q8_0, WeightType::q4_0}) {
    std::vector<std::string> paths = {"avx2", "avx512"};
    if (t == WeightType::q8_0 || t == WeightType::q4_0)
      for (const char* q : {"q8_avx2", "q8_avx512_vnni", "q8_amx"}) paths.push_back(q);
    if (t == WeightType::f16 || t == WeightType::bf16)
      for (const char* q : {"amx_bf16x3", "amx_bf16x6"}) paths.push_back(q);
    for (const std::string& path : paths)
      for (const Shape& s : kShapes)
        for (int threads : {1, 2})
          for (int64_t n : {int64_t{256}, int64_t{1}}) {
            const std::string name = std::string(n == 1 ? "BM_MatmulDecode/" : "BM_MatmulPrefill/") +
                                     std::string(to_string(t)) + "/" + path + "/" + std::to_string(s.out) + "x" +
                                     std::to_string(s.in) + "/threads:" + std::to_string(threads);
            benchmark::RegisterBenchmark(name.c_str(), [=](benchmark::State& st) { run(st, t, path, s, n, threads); })
                ->Unit(benchmark::kMillisecond)
                ->UseRealTime();
          }
    for (const std::string& path : paths) {
      if (path.starts_with("amx_bf16")) continue;  // not a decode path (decode widens and splits the weights again)
      const Shape s{256, 1024};
      const std::string name = "BM_MatmulDecodeCached/" + std::string(to_string(t)) + "/" + path + "/" +
                               std::to_string(s.out) + "x" + std::to_string(s.in) + "/threads:1";
      benchmark::RegisterBenchmark(name.c_str(), [=](benchmark::State& st) { run(st, t, path, s, 1, 1, true); })
          ->Unit(benchmark::kMicrosecond)
          ->UseRealTime();
    }
  }
  return true;
}();

}  // namespace
