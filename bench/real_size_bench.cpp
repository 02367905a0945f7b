// Throughput on models of real size, for the side-by-side comparison with llama.cpp's llama-bench
// (scripts/bench-vs-llama-cpp runs both on the same GGUF files and prints the table with ratios).
//
// Models: the comma-separated GGUF paths of POSENC_BENCH_MODELS (nothing runs when it is unset; the
// script makes the 487M-parameter random-weight files with `posenc random-model`); a path ending in
// "@q8_activations" is loaded with --quantized-matmul q8_activations (Q8_0/Q4_0 products on quantized
// activations, llama.cpp's arithmetic) and named <file>@q8_activations; one ending in "@bf16x3" or "@bf16x6" with
// --dense-matmul bf16x3 / bf16x6 (F16/BF16 products on AMX-BF16 tiles). Per model and thread
// count (1, 2):
//   BM_RealPrefill: one 256-token prompt of fixed random ids from an empty cache, logits of the last
//                   position only (the work of llama-bench -p 256);
//   BM_RealDecode:  64 tokens decoded one forward at a time from an empty cache (llama-bench -n 64);
//   BM_RealDecodeTeam (2 threads): the same tokens alternating, two at a time, between the decode team (one
//                   team of threads through the layers, the default) and a region per projection: team_over_regions.
//   BM_DecodePlans: decode plans (DecodeStreams: runs of rows read side by side, software prefetch distance)
//                   against each other, tokens alternating between them two at a time (decode_plans_ab); not run
//                   by scripts/bench-vs-llama-cpp. Choosing a CPU's plans: POSENC_BENCH_DECODE_PLANS lists others.
// Counters: tokens_per_s; prefill also matmul_GFLOP_per_s (to set against BM_FmaPeak); decode also weight_GB_per_s
// (the tensor bytes a decode step reads x tokens/s: every tensor of the file but token_embd, of which one row is
// read, unless the classifier is tied to it; the whole file's bytes, counted until stop 37, overstated it by the
// embedding table, 6.7% of the 487M files)
// to set against BM_DramRead, the baseline run in the same process: the machine's DRAM read bandwidth,
// summing a 1 GiB buffer (well past the L3) with AVX2 loads on 1 or 2 threads.
// dram_GB_per_s (decode): the same read rate measured between the decode's iterations, untimed, on its threads.
// huge_page_share (decode, BM_DramRead): the share of the model file's (the buffer's) resident bytes mapped in
// 2 MiB pages; a read rate depends on it (TLB walks), so the two are stated side by side.
#include <immintrin.h>
#include <sys/mman.h>

// GCC 12 flags the undefined pass-through vectors inside its own AVX-512 intrinsics (_mm512_maskz_*, the
// reductions) as uninitialized.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "bench_util.hpp"
#include "model/kernels.hpp"
#include "core/text.hpp"
#include "model/kernels_dense.hpp"
#include "posenc/gguf.hpp"
#include "posenc/model.hpp"

namespace {

using namespace posenc;

std::vector<std::string> bench_models() {
  std::vector<std::string> out;
  const char* env = std::getenv("POSENC_BENCH_MODELS");
  if (env == nullptr) return out;
  std::stringstream ss(env);
  for (std::string p; std::getline(ss, p, ',');)
    if (!p.empty()) out.push_back(p);
  return out;
}

struct Loaded {
  Model model;
  std::vector<int32_t> prompt;
  double decode_bytes;  ///< tensor bytes a decode step reads (see the header comment)
  std::string file;     ///< the mapped file's canonical path, as /proc/self/smaps names it
};

/// The share of the model file's resident pages this process maps in 2 MiB pages (MappedFile asks for them; the
/// kernel gives them to the parts it reads into the page cache after the advice, so a file already cached in small
/// pages stays in them: scripts/bench-vs-llama-cpp reads the files afresh first).
double file_huge_share(const Loaded* m) {
  return posenc::bench::huge_page_share([&](uintptr_t, const std::string& path) { return path == m->file; });
}

double decode_bytes(const std::string& path) {
  const GgufFile f = GgufFile::open(path);
  double bytes = 0;
  const GgufTensorInfo* embd = nullptr;
  bool tied = true;
  for (const auto& t : f.tensors()) {
    if (t.name == "token_embd.weight")
      embd = &t;
    else
      bytes += static_cast<double>(t.n_bytes);
    if (t.name == "output.weight") tied = false;
  }
  if (embd != nullptr)  // [vocab, dim]: ne = {dim, vocab}
    bytes += tied ? static_cast<double>(embd->n_bytes) : static_cast<double>(embd->n_bytes) / embd->ne.at(1);
  return bytes;
}

Loaded load(std::string path) {
  LoadOptions options;
  if (const auto at = path.rfind('@'); at != std::string::npos) {
    const std::string mode = path.substr(at + 1);
    path.resize(at);
    if (mode == "q8_activations")
      options.quantized_matmul = QuantizedMatmul::q8_activations;
    else if (mode == "bf16x3" || mode == "bf16x6")
      options.dense_matmul = parse_dense_matmul(mode, "POSENC_BENCH_MODELS suffix");
    else
      throw std::runtime_error("the suffix '@" + posenc::detail::escaped(mode) +
                               "' is not one of @q8_activations, @bf16x3, @bf16x6");
  }
  Loaded l{Model::load(path, options), {}, decode_bytes(path), std::filesystem::canonical(path).string()};
  std::mt19937 rng(42);
  std::uniform_int_distribution<int32_t> id(3, l.model.config().vocab_size - 1);
  l.prompt.resize(256);
  for (auto& t : l.prompt) t = id(rng);
  // One token through the model before anything is timed, as llama-bench's warm-up run does: the first touch of
  // each page of the mapped file (page faults) is not the work measured. Without it the first benchmark of a model
  // paid it (measured: the Q8_0 model's decode at two threads 85-98 tokens/s when run first, 130 after another).
  KvCache cache = l.model.make_cache(16);
  const auto seq = cache.create();
  Model::SequenceInput in{seq, std::span(l.prompt.data(), 1), {}};
  std::vector<float> logits;
  l.model.forward(cache, std::span(&in, 1), Model::LogitsMode::last, logits);
  return l;
}

// AVX2 loads (every x86-64 CPU this runs on has them; one 32-byte load per cycle is far above DRAM's rate).
__attribute__((target("avx2"))) float sum_range(const float* p, std::size_t n) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (std::size_t i = 0; i + 32 <= n; i += 32) {
    a0 = _mm256_add_ps(a0, _mm256_load_ps(p + i));
    a1 = _mm256_add_ps(a1, _mm256_load_ps(p + i + 8));
    a2 = _mm256_add_ps(a2, _mm256_load_ps(p + i + 16));
    a3 = _mm256_add_ps(a3, _mm256_load_ps(p + i + 24));
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
  float s = 0.0f;
  for (float v : lanes) s += v;
  return s;
}

/// `floats` zero floats at a 2 MiB boundary of an anonymous mapping advised to use 2 MiB pages: the read rate the
/// models' weights are held to is the best this machine's pages give, as the model files are mapped (see
/// MappedFile). A standalone sum over 900 MB with AVX-512 loads on one Zen 5 core: 42.0-43.3 GB/s in 4 KiB pages,
/// 43.9-44.2 in 2 MiB pages; this benchmark there, in 2 MiB pages: 41.0-43.3 (the host's rate moves).
struct HugeBuffer {
  explicit HugeBuffer(std::size_t n) : floats(n), bytes(n * sizeof(float) + (std::size_t{2} << 20)) {
    mapping = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (mapping == MAP_FAILED) throw std::runtime_error("BM_DramRead: cannot map its buffer");
    const uintptr_t at = (reinterpret_cast<uintptr_t>(mapping) + (uintptr_t{2} << 20) - 1) & ~((uintptr_t{2} << 20) - 1);
    data = reinterpret_cast<float*>(at);
    (void)::madvise(data, n * sizeof(float), MADV_HUGEPAGE);
    std::memset(data, 0, n * sizeof(float));
  }
  ~HugeBuffer() { ::munmap(mapping, bytes); }
  HugeBuffer(const HugeBuffer&) = delete;
  HugeBuffer& operator=(const HugeBuffer&) = delete;
  std::size_t floats, bytes;
  void* mapping;
  float* data;
};

/// The 1 GiB buffer the read rate is measured on (made once, on first use).
const HugeBuffer& dram_buffer() {
  static const HugeBuffer buf(std::size_t{1} << 28);
  return buf;
}

/// One pass summing the whole buffer on `threads` threads; returns the seconds it took.
double read_pass(int threads) {
  const HugeBuffer& buf = dram_buffer();
  const std::size_t n = buf.floats;
  const auto t0 = std::chrono::steady_clock::now();
  float total = 0.0f;
#pragma omp parallel for reduction(+ : total) schedule(static) num_threads(threads)
  for (int t = 0; t < threads; ++t) {
    const std::size_t lo = n / threads * t, hi = t + 1 == threads ? n : n / threads * (t + 1);
    total += sum_range(buf.data + lo, hi - lo);
  }
  benchmark::DoNotOptimize(total);
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

void prefill(benchmark::State& state, const Loaded* m, int threads) {
  posenc::bench::ThreadScope scope(threads);
  std::vector<float> logits;
  for (auto _ : state) {
    KvCache cache = m->model.make_cache(16);
    const auto seq = cache.create();
    Model::SequenceInput in{seq, m->prompt, {}};
    m->model.forward(cache, std::span(&in, 1), Model::LogitsMode::last, logits);
    benchmark::DoNotOptimize(logits.data());
  }
  state.counters["tokens_per_s"] =
      benchmark::Counter(256.0 * static_cast<double>(state.iterations()), benchmark::Counter::kIsRate);
  // The projections' multiply-adds (2 flops each) of 256 tokens through every layer; attention's (about 2% at
  // 256 positions) and the one output row's are not counted.
  const ModelConfig& c = m->model.config();
  const double per_token = 2.0 * c.n_layers *
                           (2.0 * c.dim * c.q_dim() + 2.0 * c.dim * c.kv_dim() + 3.0 * c.dim * c.hidden_dim);
  state.counters["matmul_GFLOP_per_s"] =
      benchmark::Counter(256.0 * per_token / 1e9 * static_cast<double>(state.iterations()), benchmark::Counter::kIsRate);
}

void decode(benchmark::State& state, const Loaded* m, int threads) {
  posenc::bench::ThreadScope scope(threads);
  constexpr int n = 64;
  std::vector<float> logits;
  double read_seconds = 0;
  for (auto _ : state) {
    KvCache cache = m->model.make_cache(16);
    const auto seq = cache.create();
    for (int i = 0; i < n; ++i) {
      Model::SequenceInput in{seq, std::span(m->prompt.data() + i, 1), {}};
      m->model.forward(cache, std::span(&in, 1), Model::LogitsMode::last, logits);
    }
    benchmark::DoNotOptimize(logits.data());
    // The read rate beside it, between its iterations and untimed: the host's rate moves (two threads: 50.9-81.7
    // GB/s within an hour on the Zen 5 host), so a share of a rate measured minutes apart says little.
    state.PauseTiming();
    read_seconds += read_pass(threads);
    state.ResumeTiming();
  }
  const double tokens = n * static_cast<double>(state.iterations());
  state.counters["dram_GB_per_s"] = static_cast<double>(dram_buffer().floats) * 4.0 *
                                    static_cast<double>(state.iterations()) / 1e9 / read_seconds;
  state.counters["tokens_per_s"] = benchmark::Counter(tokens, benchmark::Counter::kIsRate);
  state.counters["weight_GB_per_s"] =
      benchmark::Counter(tokens * m->decode_bytes / 1e9, benchmark::Counter::kIsRate);
  state.counters["huge_page_share"] = file_huge_share(m);
}

/// The seconds one decode step takes: the prompt's token `pos` through the model into `seq` of `cache`.
double timed_token(const Loaded* m, KvCache& cache, KvCache::SeqId seq, int64_t pos, std::vector<float>& logits) {
  Model::SequenceInput in{seq, std::span(m->prompt.data() + pos, 1), {}};
  const auto t0 = std::chrono::steady_clock::now();
  m->model.forward(cache, std::span(&in, 1), Model::LogitsMode::last, logits);
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

/// The decode team (Model::forward's one team of threads through the layers) against a region per projection, in one
/// process: tokens alternate between the two, two at a time, so both see the same host (whose two-core read rate
/// moves between levels within seconds: separate runs could not tell a 1-3% difference apart).
void decode_team_ab(benchmark::State& state, const Loaded* m, int threads) {
  posenc::bench::ThreadScope scope(threads);
  std::vector<float> logits;
  double seconds[2] = {0, 0};
  int64_t tokens[2] = {0, 0};
  for (auto _ : state) {
    KvCache cache = m->model.make_cache(16);
    const auto seq = cache.create();
    for (int i = 0; i < 64; ++i) {
      const int team = (i / 2) % 2;
      posenc::detail::set_decode_team(team == 1 ? posenc::detail::DecodeTeam::automatic
                                                : posenc::detail::DecodeTeam::off);
      seconds[team] += timed_token(m, cache, seq, i, logits);
      ++tokens[team];
    }
    benchmark::DoNotOptimize(logits.data());
  }
  posenc::detail::set_decode_team(posenc::detail::DecodeTeam::automatic);
  const auto rate = [&](int team) { return static_cast<double>(tokens[team]) / seconds[team]; };
  state.counters["team_tokens_per_s"] = rate(1);
  state.counters["regions_tokens_per_s"] = rate(0);
  state.counters["team_over_regions"] = rate(1) / rate(0);
}

/// POSENC_BENCH_DECODE_PLANS as plans: comma-separated in POSENC_DECODE_STREAMS's forms, no empty item, no plan
/// twice (two forms of one plan, "4:prefetch" and "4:prefetch=1024", are one), at most kMaxDecodePlans (each plan
/// takes two tokens a turn, at least two turns, from the 256-token prompt); empty when unset or empty. Throws
/// std::runtime_error naming the item and the rule otherwise.
constexpr std::size_t kMaxDecodePlans = 60;

std::vector<posenc::detail::DecodeStreams> asked_decode_plans() {
  using posenc::detail::DecodeStreams;
  std::vector<DecodeStreams> plans;
  const char* env = std::getenv("POSENC_BENCH_DECODE_PLANS");
  if (env == nullptr || *env == '\0') return plans;
  const std::string_view text(env);
  for (std::size_t begin = 0;;) {
    const std::size_t comma = std::min(text.find(',', begin), text.size());
    const std::string_view item = text.substr(begin, comma - begin);
    const auto plan = posenc::detail::parse_decode_streams(item);
    if (!plan)
      throw std::runtime_error("POSENC_BENCH_DECODE_PLANS: '" +
                               posenc::detail::escaped(item.substr(0, 64)) + (item.size() > 64 ? "...": "") +
                               "' is not a decode plan (a comma-separated list of R, R:prefetch or R:prefetch=BYTES; "
                               "R 2, 4, 8 or 16; BYTES a multiple of 64 from 64 to 65536; no empty item)");
    for (const DecodeStreams& p : plans)
      if (p.runs == plan->runs && p.prefetch_bytes == plan->prefetch_bytes)
        throw std::runtime_error("POSENC_BENCH_DECODE_PLANS: the plan " + posenc::detail::to_string(*plan) +
                                 " is listed twice");
    plans.push_back(*plan);
    if (plans.size() > kMaxDecodePlans)
      throw std::runtime_error("POSENC_BENCH_DECODE_PLANS: more than " + std::to_string(kMaxDecodePlans) + " plans");
    if (comma == text.size()) break;
    begin = comma + 1;
  }
  return plans;
}

/// The decode plans BM_DecodePlans compares: POSENC_BENCH_DECODE_PLANS's (asked_decode_plans), or by default the
/// plan decode_streams gives the model's projections (this CPU's, or POSENC_DECODE_STREAMS's when it is set; the
/// first, which the others are set against) and the plans chosen on some CPU before or near them
/// (kernels_dense.hpp). A plan runs for every dtype of the model while it is measured (the norms and embeddings
/// take no plan; a file whose projections mix F16 and Q8_0 would run each plan on both).
std::vector<posenc::detail::DecodeStreams> decode_plans(const Loaded* m) {
  using posenc::detail::DecodeStreams;
  std::vector<DecodeStreams> plans = asked_decode_plans();
  if (!plans.empty()) return plans;
  const GgufFile f = GgufFile::open(m->file);
  bool blocks = false;  // the first projection's type (blk.N.*, two dimensions)
  for (const auto& t : f.tensors())
    if (t.name.rfind("blk.", 0) == 0 && t.ne.size() == 2) {
      blocks = t.type == GgmlType::q8_0 || t.type == GgmlType::q4_0;
      break;
    }
  plans.push_back(posenc::detail::decode_streams(blocks ? posenc::detail::WeightType::q8_0
                                                        : posenc::detail::WeightType::f16,
                                                 posenc::detail::dense_kernel()));
  for (const char* form : {"2", "2:prefetch=512", "2:prefetch=4096", "4", "4:prefetch=256", "4:prefetch=512",
                           "4:prefetch=1024", "4:prefetch=3072", "8", "8:prefetch=1024", "16:prefetch=1024"}) {
    const DecodeStreams p = *posenc::detail::parse_decode_streams(form);
    if (p.runs != plans[0].runs || p.prefetch_bytes != plans[0].prefetch_bytes) plans.push_back(p);
  }
  return plans;
}

/// Decode plans against each other in one process: tokens go to the plans in turn, two at a time, the order
/// rotated every turn, so that every plan sees the same host (whose read rate moves within minutes: plans measured
/// in separate runs could not be told apart on a noisy host) and the same cache lengths. Counters: each plan's
/// tokens/s ("tokens_per_s[PLAN]") and its ratio to the first plan's ("over_first[PLAN]"). The plan changes no bit.
void decode_plans_ab(benchmark::State& state, const Loaded* m, int threads) {
  using posenc::detail::DecodeStreams;
  posenc::bench::ThreadScope scope(threads);
  std::vector<DecodeStreams> plans;
  try {
    plans = decode_plans(m);
  } catch (const std::exception& e) {
    state.SkipWithError(e.what());
    return;
  }
  // The CPU's plans again when this returns or a forward throws.
  struct Lift {
    ~Lift() { posenc::detail::set_decode_streams_for_benchmark(std::nullopt); }
  } lift;
  const int64_t count = static_cast<int64_t>(plans.size());
  const int64_t turns = 240 / (2 * count);  // the 256-token prompt's ids; count <= kMaxDecodePlans: 2 turns or more
  std::vector<double> seconds(plans.size(), 0.0);
  std::vector<int64_t> tokens(plans.size(), 0);
  std::vector<float> logits;
  for (auto _ : state) {
    KvCache cache = m->model.make_cache(16);
    const auto seq = cache.create();
    int64_t pos = 0;
    for (int64_t t = 0; t < turns; ++t)
      for (int64_t j = 0; j < count; ++j) {
        const int64_t p = (t + j) % count;
        posenc::detail::set_decode_streams_for_benchmark(plans[p]);
        for (int k = 0; k < 2; ++k, ++pos) {
          seconds[p] += timed_token(m, cache, seq, pos, logits);
          ++tokens[p];
        }
      }
    benchmark::DoNotOptimize(logits.data());
  }
  const auto rate = [&](int64_t p) { return static_cast<double>(tokens[p]) / seconds[p]; };
  for (int64_t p = 0; p < count; ++p) {
    const std::string plan = posenc::detail::to_string(plans[p]);
    state.counters["tokens_per_s[" + plan + "]"] = rate(p);
    state.counters["over_first[" + plan + "]"] = rate(p) / rate(0);
  }
}

void BM_DramRead(benchmark::State& state) {
  const int threads = static_cast<int>(state.range(0));
  posenc::bench::ThreadScope scope(threads);
  const HugeBuffer& buf = dram_buffer();
  const std::size_t n = buf.floats;
  for (auto _ : state) read_pass(threads);
  state.counters["GB_per_s"] =
      benchmark::Counter(static_cast<double>(n) * 4.0 * static_cast<double>(state.iterations()) / 1e9,
                         benchmark::Counter::kIsRate);
  const auto base = reinterpret_cast<uintptr_t>(buf.data);  // the advised part is a mapping of its own
  state.counters["huge_page_share"] =
      posenc::bench::huge_page_share([&](uintptr_t start, const std::string&) { return start == base; });
}

/// The model of `path`, loaded by the first benchmark of the file that runs and kept for the others; nullptr, with
/// the benchmark marked as failed by the error's message, when it cannot be loaded (a missing file, a file that is
/// not a model) instead of an exception ending the process.
const Loaded* loaded(benchmark::State& s, std::unique_ptr<Loaded>* holder, const std::string& path) {
  if (!*holder) {
    try {
      *holder = std::make_unique<Loaded>(load(path));
    } catch (const std::exception& e) {
      s.SkipWithError((std::string("POSENC_BENCH_MODELS: ") + e.what()).c_str());
      return nullptr;
    }
  }
  return holder->get();
}

const bool registered = [] {
  const auto models = bench_models();
  if (models.empty()) return false;
  // The plans and suffixes asked for are checked before anything runs: a bad value is an error naming it and a
  // non-zero exit, not a benchmark that fails after the others have run.
  try {
    (void)asked_decode_plans();
    for (const auto& spec : models) {
      // A file that is missing or not a model fails its own benchmarks (loaded()): scripts/bench-attention-vs-ggml
      // sets POSENC_BENCH_MODELS=unused for BM_DramRead alone.
      const std::size_t at = spec.rfind('@');
      if (at != std::string::npos && spec.substr(at) != "@q8_activations" && spec.substr(at) != "@bf16x3" &&
          spec.substr(at) != "@bf16x6")
        throw std::runtime_error("POSENC_BENCH_MODELS: '" + posenc::detail::escaped(spec) +
                                 "': the suffix is not one of @q8_activations, @bf16x3, @bf16x6");
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "posenc_bench: %s\n", e.what());
    std::exit(2);
  }
  // The paths the products take in this process (POSENC_DENSE_KERNEL / POSENC_Q8_KERNEL may ask for others), in the
  // JSON output's context: bench/vs_llama_cpp_table.py sets the AVX2 paths' prefill against BM_FmaPeakAvx2.
  benchmark::AddCustomContext("posenc_dense_kernel", std::string(posenc::detail::to_string(posenc::detail::dense_kernel())));
  benchmark::AddCustomContext("posenc_q8_kernel", std::string(posenc::detail::to_string(posenc::detail::q8_kernel())));
  benchmark::RegisterBenchmark("BM_DramRead", BM_DramRead)->Arg(1)->Arg(2)->ArgName("threads")
      ->Unit(benchmark::kMillisecond)->UseRealTime();
  for (const auto& path : models) {
    // Loaded when the first benchmark of the file runs, and kept for the others.
    auto* holder = new std::unique_ptr<Loaded>();
    const std::string name = std::filesystem::path(path).filename().string();  // keeps "@q8_activations"
    for (int threads : {1, 2}) {
      benchmark::RegisterBenchmark(("BM_RealPrefill/" + name + "/threads:" + std::to_string(threads)).c_str(),
                                   [holder, path, threads](benchmark::State& s) {
                                     if (const Loaded* m = loaded(s, holder, path)) prefill(s, m, threads);
                                   })
          ->Unit(benchmark::kMillisecond)->UseRealTime();
      benchmark::RegisterBenchmark(("BM_RealDecode/" + name + "/threads:" + std::to_string(threads)).c_str(),
                                   [holder, path, threads](benchmark::State& s) {
                                     if (const Loaded* m = loaded(s, holder, path)) decode(s, m, threads);
                                   })
          ->Unit(benchmark::kMillisecond)->UseRealTime();
    }
    for (int threads : {1, 2})
      benchmark::RegisterBenchmark(("BM_DecodePlans/" + name + "/threads:" + std::to_string(threads)).c_str(),
                                   [holder, path, threads](benchmark::State& s) {
                                     if (const Loaded* m = loaded(s, holder, path)) decode_plans_ab(s, m, threads);
                                   })
          ->Unit(benchmark::kMillisecond)->UseRealTime()->Iterations(2);
    benchmark::RegisterBenchmark(("BM_RealDecodeTeam/" + name + "/threads:2").c_str(),
                                 [holder, path](benchmark::State& s) {
                                   if (const Loaded* m = loaded(s, holder, path)) decode_team_ab(s, m, 2);
                                 })
        ->Unit(benchmark::kMillisecond)->UseRealTime();
  }
  return true;
}();

}  // namespace
