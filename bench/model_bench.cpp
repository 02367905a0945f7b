// Model runtime throughput on real checkpoints: stories260K (llama2.c .bin),
// TinyStories-656K from its Hugging Face directory (F32 safetensors) and from
// its Q8_0 GGUF (weights dequantized at load, and with llama.cpp's Q8_0
// activation arithmetic). Prefill of a 512-token window and token-by-token
// decode (256 positions for stories260K; 128 from an empty cache for the
// TinyStories-656K files, as llama-bench's tg128), at 1 and 2 threads, next to
// a baseline measured in the same binary: the llama2.c run.c algorithm (one
// token at a time, matrix-vector products, cos/sin recomputed per token,
// contiguous KV cache), re-implemented here over any model's float32 weights.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include <benchmark/benchmark.h>
#include <omp.h>

#include "posenc/checkpoint.hpp"
#include "posenc/io.hpp"
#include "posenc/rope.hpp"
#include "posenc/model.hpp"
#include "posenc/perplexity.hpp"

namespace {

using namespace posenc;

const std::string kModel = std::string(POSENC_SHARED_DIR) + "/models/stories260K/stories260K.bin";
const std::string kTok = std::string(POSENC_SHARED_DIR) + "/models/stories260K/tok512.bin";
const std::string kText = std::string(POSENC_SHARED_DIR) + "/data/tinystories_val.txt";
const std::string kHf = std::string(POSENC_SHARED_DIR) + "/models/TinyStories-656K";
const std::string kQ8 = std::string(POSENC_SHARED_DIR) + "/models/TinyStories-656K-gguf/TinyStories-656K-Q8_0.gguf";

struct Data {
  Model model = Model::load_llama2c(kModel);
  std::vector<int32_t> stream =
      encode_stream(Tokenizer::load_llama2c(kTok, 512), read_file(kText));
};
const Data& data() {
  static const Data d;
  return d;
}

/// TinyStories-656K in its three runtime forms, and its tokenized text.
struct Tiny {
  Model hf = Model::load(kHf);
  Model q8 = Model::load(kQ8);
  Model q8a = Model::load(kQ8, LoadOptions{QuantizedMatmul::q8_activations});
  std::vector<int32_t> stream = encode_stream(*hf.bundled_tokenizer(), read_file(kText).substr(0, 200000));
  const Model& get(int which) const { return which == 0 ? hf : which == 1 ? q8 : q8a; }
};
const Tiny& tiny() {
  static const Tiny t;
  return t;
}
const char* kTinyNames[3] = {"hf_f32", "gguf_q8_0_dequantized", "gguf_q8_0_q8_activations"};

// Prompt processing of 512 tokens with the last position's logits, the work of
// llama-bench's pp512 (which outputs only the last row).
void BM_TinyPrefill(benchmark::State& state) {
  omp_set_num_threads(static_cast<int>(state.range(1)));
  const Model& m = tiny().get(static_cast<int>(state.range(0)));
  state.SetLabel(kTinyNames[state.range(0)]);
  const std::span<const int32_t> window(tiny().stream.data(), 512);
  std::vector<float> logits;
  for (auto _ : state) {
    KvCache cache = m.make_cache(16);
    const auto seq = cache.create();
    Model::SequenceInput in{seq, window, {}};
    m.forward(cache, std::span(&in, 1), Model::LogitsMode::last, logits);
    benchmark::DoNotOptimize(logits.data());
  }
  state.counters["tokens_per_s"] = benchmark::Counter(512.0 * static_cast<double>(state.iterations()),
                                                      benchmark::Counter::kIsRate);
}
BENCHMARK(BM_TinyPrefill)->ArgsProduct({{0, 1, 2}, {1, 2}})->ArgNames({"model", "threads"})
    ->Unit(benchmark::kMillisecond)->UseRealTime();

void BM_TinyDecode(benchmark::State& state) {
  omp_set_num_threads(static_cast<int>(state.range(1)));
  const Model& m = tiny().get(static_cast<int>(state.range(0)));
  state.SetLabel(kTinyNames[state.range(0)]);
  const int n = 128;
  std::vector<float> logits;
  for (auto _ : state) {
    KvCache cache = m.make_cache(16);
    const auto seq = cache.create();
    for (int i = 0; i < n; ++i) {
      Model::SequenceInput in{seq, std::span(tiny().stream.data() + i, 1), {}};
      m.forward(cache, std::span(&in, 1), Model::LogitsMode::last, logits);
    }
    benchmark::DoNotOptimize(logits.data());
  }
  state.counters["tokens_per_s"] =
      benchmark::Counter(static_cast<double>(n) * static_cast<double>(state.iterations()), benchmark::Counter::kIsRate);
}
BENCHMARK(BM_TinyDecode)->ArgsProduct({{0, 1, 2}, {1, 2}})->ArgNames({"model", "threads"})
    ->Unit(benchmark::kMillisecond)->UseRealTime();

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

// ---- baseline: llama2.c run.c's algorithm, single thread, over any model's
// float32 weights (export_tensors; q/k rows permuted to interleaved pairs when
// the model stores them for half, so that run.c's rotation applies) ----
struct RunCStyle {
  int dim, hidden, layers, heads, kv_heads, vocab, seq_len, hs, kv_dim, qd;
  float eps;
  std::map<std::string, std::vector<float>> t;
  const float* emb;
  const float* cls;
  std::vector<float> x, xb, xb2, hb, hb2, q, k, v, att, logits, kc, vc;
  explicit RunCStyle(const Model& m, int max_seq) {
    const auto& c = m.config();
    dim = c.dim, hidden = c.hidden_dim, layers = c.n_layers, heads = c.n_heads, kv_heads = c.n_kv_heads;
    vocab = c.vocab_size, seq_len = max_seq, hs = c.head_dim, kv_dim = c.kv_dim(), qd = c.q_dim(), eps = c.norm_eps;
    for (auto& x : m.export_tensors()) t.emplace(x.name, std::move(x.data));
    if (m.stored_layout() == RopeLayout::half)
      for (int l = 0; l < layers; ++l)
        for (const char* n : {"wq", "wk"}) {
          auto& w = t.at("layers." + std::to_string(l) + "." + n);
          const int rows = static_cast<int>(w.size() / dim);
          std::vector<float> col(static_cast<std::size_t>(rows));
          for (int j = 0; j < dim; ++j) {
            for (int r = 0; r < rows; ++r) col[r] = w[static_cast<std::size_t>(r) * dim + j];
            rope_half_to_interleaved(col.data(), rows / hs, hs, hs);
            for (int r = 0; r < rows; ++r) w[static_cast<std::size_t>(r) * dim + j] = col[r];
          }
        }
    emb = t.at("tok_embeddings").data();
    cls = t.count("output") ? t.at("output").data() : emb;
    x.resize(dim), xb.resize(std::max(dim, qd)), xb2.resize(dim), hb.resize(hidden), hb2.resize(hidden), q.resize(qd);
    k.resize(kv_dim), v.resize(kv_dim), att.resize(static_cast<std::size_t>(heads) * seq_len), logits.resize(vocab);
    kc.resize(static_cast<std::size_t>(layers) * seq_len * kv_dim), vc.resize(kc.size());
  }
  const float* w(int l, const char* n) const { return t.at("layers." + std::to_string(l) + "." + n).data(); }
  void rmsnorm(float* o, const float* xx, const float* wt, int n) const {
    float ss = 0;
    for (int j = 0; j < n; ++j) ss += xx[j] * xx[j];
    ss = 1.0f / std::sqrt(ss / n + eps);
    for (int j = 0; j < n; ++j) o[j] = wt[j] * (ss * xx[j]);
  }
  static void matvec(float* o, const float* xx, const float* wt, int n, int d) {
    for (int i = 0; i < d; ++i) {
      float s = 0;
      for (int j = 0; j < n; ++j) s += wt[static_cast<std::size_t>(i) * n + j] * xx[j];
      o[i] = s;
    }
  }
  void forward(int token, int pos) {
    std::memcpy(x.data(), emb + static_cast<std::size_t>(token) * dim, sizeof(float) * dim);
    for (int l = 0; l < layers; ++l) {
      rmsnorm(xb.data(), x.data(), w(l, "attention_norm"), dim);
      matvec(q.data(), xb.data(), w(l, "wq"), dim, qd);
      matvec(k.data(), xb.data(), w(l, "wk"), dim, kv_dim);
      matvec(v.data(), xb.data(), w(l, "wv"), dim, kv_dim);
      for (int i = 0; i < qd; i += 2) {
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
        for (int tt = 0; tt <= pos; ++tt) {
          const float* kt = kc.data() + loff + static_cast<std::size_t>(tt) * kv_dim + kvh * hs;
          float s = 0;
          for (int i = 0; i < hs; ++i) s += qh[i] * kt[i];
          a[tt] = s / std::sqrt(static_cast<float>(hs));
          mx = std::max(mx, a[tt]);
        }
        float sum = 0;
        for (int tt = 0; tt <= pos; ++tt) sum += a[tt] = std::exp(a[tt] - mx);
        float* o = xb.data() + h * hs;
        std::fill(o, o + hs, 0.0f);
        for (int tt = 0; tt <= pos; ++tt) {
          const float* vt = vc.data() + loff + static_cast<std::size_t>(tt) * kv_dim + kvh * hs;
          for (int i = 0; i < hs; ++i) o[i] += a[tt] / sum * vt[i];
        }
      }
      matvec(xb2.data(), xb.data(), w(l, "wo"), qd, dim);
      for (int i = 0; i < dim; ++i) x[i] += xb2[i];
      rmsnorm(xb.data(), x.data(), w(l, "ffn_norm"), dim);
      matvec(hb.data(), xb.data(), w(l, "w1"), dim, hidden);
      matvec(hb2.data(), xb.data(), w(l, "w3"), dim, hidden);
      for (int i = 0; i < hidden; ++i) hb[i] = hb[i] / (1.0f + std::exp(-hb[i])) * hb2[i];
      matvec(xb.data(), hb.data(), w(l, "w2"), hidden, dim);
      for (int i = 0; i < dim; ++i) x[i] += xb[i];
    }
    rmsnorm(x.data(), x.data(), t.at("norm").data(), dim);
    matvec(logits.data(), x.data(), cls, dim, vocab);
  }
};

void BM_ModelDecodeBaselineLlama2c(benchmark::State& state) {
  RunCStyle m(data().model, 512);
  const int n = 256;
  for (auto _ : state) {
    for (int i = 0; i < n; ++i) m.forward(data().stream[static_cast<std::size_t>(i)], i);
    benchmark::DoNotOptimize(m.logits.data());
  }
  state.counters["tokens_per_s"] =
      benchmark::Counter(static_cast<double>(n) * static_cast<double>(state.iterations()), benchmark::Counter::kIsRate);
}
BENCHMARK(BM_ModelDecodeBaselineLlama2c)->Unit(benchmark::kMillisecond)->UseRealTime();

void BM_TinyDecodeBaselineLlama2c(benchmark::State& state) {
  RunCStyle m(tiny().hf, 512);
  const int n = 128;
  for (auto _ : state) {
    for (int i = 0; i < n; ++i) m.forward(tiny().stream[static_cast<std::size_t>(i)], i);
    benchmark::DoNotOptimize(m.logits.data());
  }
  state.counters["tokens_per_s"] =
      benchmark::Counter(static_cast<double>(n) * static_cast<double>(state.iterations()), benchmark::Counter::kIsRate);
}
BENCHMARK(BM_TinyDecodeBaselineLlama2c)->Unit(benchmark::kMillisecond)->UseRealTime();

}  // namespace
