// The cost of the RoPE change policies (issue 16): stories260K with an original
// context of 128, dynamic NTK (and LongRoPE), a 100-token prompt prefilled at
// once, then 72 tokens decoded one at a time to 172 (the switch point 128 is
// crossed at the 29th step). The baseline, in the same binary: plain decoding
// of the same tokens with the frequencies frozen at the window's (no change
// ever happens, so no policy runs). recompute re-prefills the cached tokens at
// every step past 128 under dynamic NTK (44 re-prefills, 6,578 tokens), once
// under LongRoPE; hf and rerotate cost about plain decoding but drift (see
// check-cache). One OpenMP thread (the steps are tiny).
#include <string>
#include <vector>

#include <benchmark/benchmark.h>
#include <omp.h>

#include "posenc/io.hpp"
#include "posenc/model.hpp"
#include "posenc/perplexity.hpp"
#include "posenc/scaling.hpp"

namespace {

using namespace posenc;

const std::string kModel = std::string(POSENC_SHARED_DIR) + "/models/stories260K/stories260K.bin";
const std::string kTok = std::string(POSENC_SHARED_DIR) + "/models/stories260K/tok512.bin";
const std::string kText = std::string(POSENC_SHARED_DIR) + "/data/tinystories_val.txt";
constexpr int64_t kOriginal = 128, kPrompt = 100, kTotal = 172;

struct Setup {
  Model base = [] {
    Model m = Model::load_llama2c(kModel);
    m.set_trained_context(kOriginal, "bench");
    return m;
  }();
  std::vector<int32_t> tokens = [] {
    auto s = encode_stream(Tokenizer::load_llama2c(kTok, 512), read_file(kText));
    s.resize(static_cast<std::size_t>(kTotal));
    return s;
  }();
  Model dynamic = [this] {
    Model m = base;
    m.set_rope(rope_setup_for_context(m.rope(), kOriginal, "dynamic", kTotal, std::nullopt));
    return m;
  }();
  Model longrope = [this] {
    Model m = base;
    RopeSetup r = m.rope();
    r.params.rope_type = "longrope";
    r.params.original_max_position_embeddings = kOriginal;
    r.params.factor = 32.0;
    r.params.short_factor = {1.0, 1.05, 1.2, 1.5};
    r.params.long_factor = {1.0, 2.5, 8.0, 20.0};
    r.freqs = compute_rope_frequencies(r.params, kOriginal);
    m.set_rope(r);
    return m;
  }();
};
const Setup& setup() {
  static const Setup s;
  return s;
}

/// `model` with the frequencies of a full window of kTotal tokens frozen: the plain-decoding baseline.
Model frozen(const Model& model) {
  Model m = model;
  m.set_rope(freeze_rope_for_length(m.rope(), kTotal));
  return m;
}

/// method: 0 dynamic, 1 longrope; policy: -1 = the frozen baseline, else a RopeChangePolicy.
void decode(benchmark::State& state, int method, int policy, bool planned) {
  omp_set_num_threads(1);
  const Setup& s = setup();
  const Model& base = method == 0 ? s.dynamic : s.longrope;
  Model m = policy < 0 ? frozen(base) : base;
  if (policy >= 0) m.set_rope_change_policy(static_cast<RopeChangePolicy>(policy));
  std::vector<float> logits;
  KvCache::SequenceStats stats;
  for (auto _ : state) {
    KvCache cache = m.make_cache(16);
    const auto seq = cache.create();
    if (planned) cache.set_planned_length(seq, kTotal);
    Model::SequenceInput in{seq, std::span(s.tokens).first(kPrompt), {}};
    m.forward(cache, std::span(&in, 1), Model::LogitsMode::last, logits);
    for (int64_t p = kPrompt; p < kTotal; ++p) {
      in = {seq, std::span(s.tokens).subspan(static_cast<std::size_t>(p), 1), {}};
      m.forward(cache, std::span(&in, 1), Model::LogitsMode::last, logits);
    }
    benchmark::DoNotOptimize(logits.data());
    stats = cache.stats(seq);
  }
  state.counters["decode_tok/s"] =
      benchmark::Counter(static_cast<double>(kTotal - kPrompt) * static_cast<double>(state.iterations()),
                         benchmark::Counter::kIsRate);
  state.counters["recomputes"] = static_cast<double>(stats.rope_recomputes);
  state.counters["tokens_reprefilled"] = static_cast<double>(stats.tokens_reprefilled);
}

constexpr int kBaseline = -1;
constexpr int kRecompute = static_cast<int>(RopeChangePolicy::recompute);
constexpr int kHf = static_cast<int>(RopeChangePolicy::hf);
constexpr int kRerotate = static_cast<int>(RopeChangePolicy::rerotate);

BENCHMARK_CAPTURE(decode, dynamic_plain_frozen_baseline, 0, kBaseline, false)->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(decode, dynamic_recompute, 0, kRecompute, false)->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(decode, dynamic_hf, 0, kHf, false)->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(decode, dynamic_rerotate, 0, kRerotate, false)->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(decode, longrope_plain_frozen_baseline, 1, kBaseline, false)->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(decode, longrope_recompute, 1, kRecompute, false)->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(decode, longrope_recompute_planned, 1, kRecompute, true)->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(decode, longrope_hf, 1, kHf, false)->Unit(benchmark::kMillisecond);

}  // namespace
