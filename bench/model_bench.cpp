// Model runtime throughput on the real stories260K checkpoint: prefill of a
// 512-token window and token-by-token decode over the first 256 positions, at
// 1 and 2 threads, next to a baseline measured in the same binary: the
// llama2.c run.c algorithm (one token at a time, matrix-vector products,
// cos/sin recomputed per token, contiguous KV cache), re-implemented here.
#include <cmath>
#include <cstring>
#include <vector>

#include <benchmark/benchmark.h>
#include <omp.h>

#include "posenc/io.hpp"
#include "posenc/model.hpp"
#include "posenc/perplexity.hpp"

namespace {

using namespace posenc;

const std::string kModel = std::string(POSENC_SHARED_DIR) + "/models/stories260K/stories260K.bin";
const std::string kTok = std::string(POSENC_SHARED_DIR) + "/models/stories260K/tok512.bin";
const std::string kText = std::string(POSENC_SHARED_DIR) + "/data/tinystories_val.txt";

struct Data {
  Model model = Model::load_llama2c(kModel);
  std::vector<int32_t> stream =
      encode_stream(Tokenizer::load_llama2c(kTok, 512), read_file(kText));
};
const Data& data() {
  static const Data d;
  return d;
}

void BM_ModelPrefill(benchmark::State& state) {
  omp_set_num_threads(static_cast<int>(state.range(0)));
  const std::span<const int32_t> window(data().stream.data(), 512);
  for (auto _ : state) benchmark::DoNotOptimize(data().model.score_window(window));
  state.counters["tokens_per_s"] = benchmark::Counter(512.0 * static_cast<double>(state.iterations()),
                                                      benchmark::Counter::kIsRate);
}
BENCHMARK(BM_ModelPrefill)->Arg(1)->Arg(2)->ArgName("threads")->Unit(benchmark::kMillisecond)->UseRealTime();

void BM_ModelDecode(benchmark::State& state) {
  omp_set_num_threads(static_cast<int>(state.range(0)));
  const int n = 256;
  std::vector<float> logits;
  for (auto _ : state) {
    KvCache cache = data().model.make_cache(16);
    const auto seq = cache.create();
    for (int i = 0; i < n; ++i) {
      Model::SequenceInput in{seq, std::span(data().stream.data() + i, 1), {}};
      data().model.forward(cache, std::span(&in, 1), Model::LogitsMode::last, logits);
    }
    benchmark::DoNotOptimize(logits.data());
  }
  state.counters["tokens_per_s"] =
      benchmark::Counter(static_cast<double>(n) * static_cast<double>(state.iterations()), benchmark::Counter::kIsRate);
}
BENCHMARK(BM_ModelDecode)->Arg(1)->Arg(2)->ArgName("threads")->Unit(benchmark::kMillisecond)->UseRealTime();

// ---- baseline: llama2.c run.c's algorithm, single thread ----
struct Llama2cStyle {
  MappedFile file{kModel};
  int dim, hidden, layers, heads, kv_heads, vocab, seq_len, hs, kv_dim;
  const float *emb, *rms_att, *wq, *wk, *wv, *wo, *rms_ffn, *w1, *w2, *w3, *rms_final;
  std::vector<float> x, xb, xb2, hb, hb2, q, k, v, att, logits, kc, vc;
  Llama2cStyle() {
    const int32_t* h = reinterpret_cast<const int32_t*>(file.bytes().data());
    dim = h[0], hidden = h[1], layers = h[2], heads = h[3], kv_heads = h[4], vocab = std::abs(h[5]), seq_len = h[6];
    hs = dim / heads;
    kv_dim = dim * kv_heads / heads;
    const float* p = reinterpret_cast<const float*>(file.bytes().data() + 28);
    auto take = [&](std::size_t n) { const float* r = p; p += n; return r; };
    emb = take(static_cast<std::size_t>(vocab) * dim);
    rms_att = take(static_cast<std::size_t>(layers) * dim);
    wq = take(static_cast<std::size_t>(layers) * dim * dim);
    wk = take(static_cast<std::size_t>(layers) * dim * kv_dim);
    wv = take(static_cast<std::size_t>(layers) * dim * kv_dim);
    wo = take(static_cast<std::size_t>(layers) * dim * dim);
    rms_ffn = take(static_cast<std::size_t>(layers) * dim);
    w1 = take(static_cast<std::size_t>(layers) * dim * hidden);
    w2 = take(static_cast<std::size_t>(layers) * dim * hidden);
    w3 = take(static_cast<std::size_t>(layers) * dim * hidden);
    rms_final = take(dim);
    x.resize(dim), xb.resize(dim), xb2.resize(dim), hb.resize(hidden), hb2.resize(hidden), q.resize(dim);
    k.resize(kv_dim), v.resize(kv_dim), att.resize(static_cast<std::size_t>(heads) * seq_len), logits.resize(vocab);
    kc.resize(static_cast<std::size_t>(layers) * seq_len * kv_dim), vc.resize(kc.size());
  }
  static void rmsnorm(float* o, const float* xx, const float* w, int n) {
    float ss = 0;
    for (int j = 0; j < n; ++j) ss += xx[j] * xx[j];
    ss = 1.0f / std::sqrt(ss / n + 1e-5f);
    for (int j = 0; j < n; ++j) o[j] = w[j] * (ss * xx[j]);
  }
  static void matvec(float* o, const float* xx, const float* w, int n, int d) {
    for (int i = 0; i < d; ++i) {
      float s = 0;
      for (int j = 0; j < n; ++j) s += w[static_cast<std::size_t>(i) * n + j] * xx[j];
      o[i] = s;
    }
  }
  void forward(int token, int pos) {
    std::memcpy(x.data(), emb + static_cast<std::size_t>(token) * dim, sizeof(float) * dim);
    for (int l = 0; l < layers; ++l) {
      rmsnorm(xb.data(), x.data(), rms_att + l * dim, dim);
      matvec(q.data(), xb.data(), wq + static_cast<std::size_t>(l) * dim * dim, dim, dim);
      matvec(k.data(), xb.data(), wk + static_cast<std::size_t>(l) * dim * kv_dim, dim, kv_dim);
      matvec(v.data(), xb.data(), wv + static_cast<std::size_t>(l) * dim * kv_dim, dim, kv_dim);
      for (int i = 0; i < dim; i += 2) {
        const float freq = 1.0f / std::pow(10000.0f, static_cast<float>(i % hs) / static_cast<float>(hs));
        const float val = static_cast<float>(pos) * freq, fcr = std::cos(val), fci = std::sin(val);
        for (int r = 0; r < (i < kv_dim ? 2 : 1); ++r) {
          float* vec = r == 0 ? q.data() : k.data();
          const float v0 = vec[i], v1 = vec[i + 1];
          vec[i] = v0 * fcr - v1 * fci;
          vec[i + 1] = v0 * fci + v1 * fcr;
        }
      }
      const std::size_t loff = static_cast<std::size_t>(l) * seq_len * kv_dim;
      std::memcpy(kc.data() + loff + static_cast<std::size_t>(pos) * kv_dim, k.data(), sizeof(float) * kv_dim);
      std::memcpy(vc.data() + loff + static_cast<std::size_t>(pos) * kv_dim, v.data(), sizeof(float) * kv_dim);
      for (int h = 0; h < heads; ++h) {
        const float* qh = q.data() + h * hs;
        float* a = att.data() + static_cast<std::size_t>(h) * seq_len;
        const int kvh = h / (heads / kv_heads);
        float mx = -1e30f;
        for (int t = 0; t <= pos; ++t) {
          const float* kt = kc.data() + loff + static_cast<std::size_t>(t) * kv_dim + kvh * hs;
          float s = 0;
          for (int i = 0; i < hs; ++i) s += qh[i] * kt[i];
          a[t] = s / std::sqrt(static_cast<float>(hs));
          mx = std::max(mx, a[t]);
        }
        float sum = 0;
        for (int t = 0; t <= pos; ++t) sum += a[t] = std::exp(a[t] - mx);
        float* o = xb.data() + h * hs;
        std::fill(o, o + hs, 0.0f);
        for (int t = 0; t <= pos; ++t) {
          const float* vt = vc.data() + loff + static_cast<std::size_t>(t) * kv_dim + kvh * hs;
          for (int i = 0; i < hs; ++i) o[i] += a[t] / sum * vt[i];
        }
      }
      matvec(xb2.data(), xb.data(), wo + static_cast<std::size_t>(l) * dim * dim, dim, dim);
      for (int i = 0; i < dim; ++i) x[i] += xb2[i];
      rmsnorm(xb.data(), x.data(), rms_ffn + l * dim, dim);
      matvec(hb.data(), xb.data(), w1 + static_cast<std::size_t>(l) * dim * hidden, dim, hidden);
      matvec(hb2.data(), xb.data(), w3 + static_cast<std::size_t>(l) * dim * hidden, dim, hidden);
      for (int i = 0; i < hidden; ++i) hb[i] = hb[i] / (1.0f + std::exp(-hb[i])) * hb2[i];
      matvec(xb.data(), hb.data(), w2 + static_cast<std::size_t>(l) * dim * hidden, hidden, dim);
      for (int i = 0; i < dim; ++i) x[i] += xb[i];
    }
    rmsnorm(x.data(), x.data(), rms_final, dim);
    matvec(logits.data(), x.data(), emb, dim, vocab);
  }
};

void BM_ModelDecodeBaselineLlama2c(benchmark::State& state) {
  Llama2cStyle m;
  const int n = 256;
  for (auto _ : state) {
    for (int i = 0; i < n; ++i) m.forward(data().stream[static_cast<std::size_t>(i)], i);
    benchmark::DoNotOptimize(m.logits.data());
  }
  state.counters["tokens_per_s"] =
      benchmark::Counter(static_cast<double>(n) * static_cast<double>(state.iterations()), benchmark::Counter::kIsRate);
}
BENCHMARK(BM_ModelDecodeBaselineLlama2c)->Unit(benchmark::kMillisecond)->UseRealTime();

}  // namespace
