// Weights kept as stored (issue 19): a model's resident memory is its file, not a float32 expansion of it, and
// a model in F16/BF16/Q8_0 weights computes what the same weights widened to float32 compute.
#include <fcntl.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <omp.h>

#include "model/kernels.hpp"
#include "model/kernels_dense.hpp"
#include "posenc/convert.hpp"
#include "posenc/error.hpp"
#include "posenc/io.hpp"
#include "posenc/model.hpp"
#include "posenc/tokenizer.hpp"
#include "test_support.hpp"
#include "formats/tiny_models.hpp"

namespace POSENC_UNITY_ID {  // this file's own namespace in the tests' unity build (CMakeLists.txt)

using namespace posenc;

namespace {

/// Runs argv (stdout/stderr to /dev/null) and returns {exit code, peak resident set in bytes} from wait4.
std::pair<int, double> run_peak_rss(const std::vector<std::string>& argv) {
  std::vector<char*> args;
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  const pid_t pid = fork();
  if (pid == 0) {
    const int fd = ::open("/dev/null", O_WRONLY);
    ::dup2(fd, 1);
    ::dup2(fd, 2);
    ::execv(args[0], args.data());
    ::_exit(127);
  }
  int status = 0;
  struct rusage ru {};
  ::wait4(pid, &status, 0, &ru);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, static_cast<double>(ru.ru_maxrss) * 1024.0};
}

/// A small random Llama (dim 64, 4 heads / 2 KV heads, ffn 96, vocab 300) of `layers` layers in `type`.
RandomGgufOptions small_random(int layers, GgmlType type) {
  RandomGgufOptions o;
  o.config.dim = 64;
  o.config.n_layers = layers;
  o.config.n_heads = 4;
  o.config.n_kv_heads = 2;
  o.config.hidden_dim = 96;
  o.config.vocab_size = 300;
  o.type = type;
  return o;
}

/// The logits of `ids` prefilled in one call equal, bit for bit, those of decoding them one token at a time.
void expect_decode_equals_prefill(const Model& m, const std::vector<int32_t>& ids, const std::string& label) {
  std::vector<float> prefill, step, last;
  {
    KvCache cache = m.make_cache();
    const auto seq = cache.create();
    Model::SequenceInput in{seq, ids, {}};
    m.forward(cache, std::span(&in, 1), Model::LogitsMode::all, prefill);
  }
  KvCache cache = m.make_cache();
  const auto seq = cache.create();
  for (std::size_t i = 0; i < ids.size(); ++i) {
    Model::SequenceInput in{seq, std::span(ids.data() + i, 1), {}};
    m.forward(cache, std::span(&in, 1), Model::LogitsMode::last, last);
    step.insert(step.end(), last.begin(), last.end());
  }
  ASSERT_EQ(prefill.size(), ids.size() * static_cast<std::size_t>(m.config().vocab_size)) << label;
  ASSERT_EQ(step.size(), prefill.size()) << label;
  EXPECT_EQ(std::memcmp(step.data(), prefill.data(), step.size() * sizeof(float)), 0) << label;
}

}  // namespace

// A model of over 100 MB, with the process's own footprint measured on stories260K: peak resident memory is the
// file (at most 1.1x) plus the KV cache and the activations. F16 weights with the default products (each weight
// widened in registers), and Q8_0 with --quantized-matmul q8_activations (AMX/VNNI panels repacked within a call,
// no copy kept: until this session's AVX-512 change the VNNI path kept a 1.18x repacked copy of every matrix).
class PeakResidentMemory : public ::testing::TestWithParam<GgmlType> {};

TEST_P(PeakResidentMemory, IsTheFileNotItsFloat32ExpansionOrACopy) {
  if (test::kAddressSanitizer) GTEST_SKIP() << "AddressSanitizer's shadow memory and quarantine inflate the RSS";
  const GgmlType type = GetParam();
  const bool q8 = type == GgmlType::q8_0;
  // F16: 141 MB (dim 512, 12 layers, 8 heads / 4 KV heads, ffn 1536, vocab 32000, untied output), its float32
  // expansion alone 282 MB; Q8_0: 24 layers, 115 MB.
  test::TempDir dir;
  RandomGgufOptions o;
  o.config.dim = 512;
  o.config.n_layers = q8 ? 24 : 12;
  o.config.n_heads = 8;
  o.config.n_kv_heads = 4;
  o.config.hidden_dim = 1536;
  o.config.vocab_size = 32000;
  o.config.max_position_embeddings = 1024;
  o.config.shared_classifier = false;
  o.type = type;
  const auto big = dir.path() / "random.gguf";
  write_random_gguf(o, big);
  const double file = static_cast<double>(std::filesystem::file_size(big));
  ASSERT_GT(file, 100e6);
  // The same command on stories260K (1 MB): the process's own footprint (binary, libraries, allocator).
  const std::string cli = POSENC_CLI_PATH;
  const std::string prompt = "Once upon a time there was a little girl who";
  std::vector<std::string> extra;
  if (q8) extra = {"--quantized-matmul", "q8_activations"};
  auto command = [&](const std::string& model) {
    std::vector<std::string> argv = {cli, "generate", "--model", model, "--prompt", prompt, "--max-tokens", "16",
                                     "--temperature", "0"};
    argv.insert(argv.end(), extra.begin(), extra.end());
    return argv;
  };
  const auto [small_rc, baseline] =
      run_peak_rss(command((test::shared_dir() / "models/stories260K/stories260K.gguf").string()));
  ASSERT_EQ(small_rc, 0);
  const auto [rc, peak] = run_peak_rss(command(big.string()));
  ASSERT_EQ(rc, 0);
  // KV cache: at most 64 positions (prompt in byte pieces + 16 new), float32 k and v per layer; activations: the
  // rows of one forward (x, q, k, v, attention, the two FFN halves, logits) for those positions.
  const ModelConfig& c = o.config;
  const double positions = 64, kv = positions * c.n_layers * 2.0 * (c.n_kv_heads * (c.dim / c.n_heads)) * 4.0;
  const double activations = positions * (4.0 * c.dim + 2.0 * c.hidden_dim + c.vocab_size) * 4.0;
  const double bound = 1.1 * file + kv + activations + baseline;
  EXPECT_LE(peak, bound) << "peak RSS " << peak / 1e6 << " MB; file " << file / 1e6 << " MB, baseline "
                         << baseline / 1e6 << " MB, KV " << kv / 1e6 << " MB, activations " << activations / 1e6;
  // The weights are read, not skipped: at least the file's size is resident at the peak.
  EXPECT_GE(peak, 0.9 * file);
  RecordProperty("peak_rss_mb", std::to_string(peak / 1e6));
  RecordProperty("file_mb", std::to_string(file / 1e6));
  RecordProperty("baseline_mb", std::to_string(baseline / 1e6));
}

INSTANTIATE_TEST_SUITE_P(WeightsAsStored, PeakResidentMemory, ::testing::Values(GgmlType::f16, GgmlType::q8_0),
                         [](const auto& info) { return info.param == GgmlType::f16 ? "F16" : "Q8_0_q8_activations"; });

TEST(WeightsAsStored, F16AndQ8WeightsGiveTheLogitsOfTheirWidenedWeights) {
  // stories260K converted to F16, BF16, Q8_0 and Q4_0 GGUF (posenc convert's writer), then widened back to an F32
  // GGUF: each stored model's logits equal, bit for bit, those of its float32 twin — the product widens each weight
  // exactly in registers and sums in the same order — and the F16 model's logits are within the bound the
  // rounding of the weights allows of the original F32 model's.
  const Model f32 = Model::load(test::shared_dir() / "models/stories260K/stories260K.gguf");
  const Tokenizer tok = *f32.bundled_tokenizer();
  std::vector<int32_t> ids = tok.encode("Once upon a time, there was a little girl named Lily. She loved to play", true, false);
  ASSERT_GT(ids.size(), 10u);
  test::TempDir dir;
  auto logits_of = [&](const Model& m) {
    KvCache cache = m.make_cache(16);
    const auto seq = cache.create();
    Model::SequenceInput in{seq, ids, {}};
    std::vector<float> out;
    m.forward(cache, std::span(&in, 1), Model::LogitsMode::all, out);
    return out;
  };
  const std::vector<float> reference = logits_of(f32);
  for (GgmlType t : {GgmlType::f16, GgmlType::bf16, GgmlType::q8_0, GgmlType::q4_0}) {
    const std::string name = ggml_type_name(static_cast<uint32_t>(t));
    GgufExportOptions eo;
    eo.type = t;
    const auto stored_path = dir.path() / (name + ".gguf");
    write_model_gguf(f32, tok, stored_path, eo);
    const Model stored = Model::load(stored_path);
    eo.type = GgmlType::f32;
    const auto widened_path = dir.path() / (name + "-widened.gguf");
    write_model_gguf(stored, tok, widened_path, eo);
    const Model widened = Model::load(widened_path);
    const std::vector<float> a = logits_of(stored), b = logits_of(widened);
    ASSERT_EQ(a.size(), b.size());
    EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0) << name;
    if (t == GgmlType::f16) {
      double worst = 0.0, sum = 0.0;
      for (std::size_t i = 0; i < a.size(); ++i) {
        const double d = std::fabs(double{a[i]} - reference[i]);
        worst = std::max(worst, d);
        sum += d;
      }
      const double mean = sum / static_cast<double>(a.size());
      // The bound for F16 weights (11 significant bits: each weight moves by at most 2^-12 of itself) on this
      // model: max |dlogit| <= 0.05 and mean <= 0.005 over every position and vocabulary entry (logits span about
      // 20 nats). Measured: max 0.0113, mean 0.0018 (2026-12-02).
      EXPECT_LE(worst, 0.05) << "F16 logits against F32";
      EXPECT_LE(mean, 0.005) << "F16 logits against F32";
      EXPECT_GT(worst, 0.0) << "F16 rounding must move some logit: the F16 file would not be F16";
      RecordProperty("f16_max_abs_logit_diff", std::to_string(worst));
      RecordProperty("f16_mean_abs_logit_diff", std::to_string(mean));
      std::printf("F16 vs F32 logits: max |d| %.4g, mean |d| %.4g\n", worst, mean);
    }
  }
}

// A file that mixes types within a layer (F16 attn_q and ffn_gate, every other matrix Q8_0, as llama.cpp's
// quantizer writes mixtures) under --quantized-matmul q8_activations: K, V and the FFN's up projection quantize
// their input themselves when the projection before them did not (it reused a stale quantization from the call
// before until this was fixed). Token-by-token decode must give the one-call prefill's logits, bit for bit.
TEST(WeightsAsStored, MixedTypesUnderQ8ActivationsDecodeAsTheyPrefill) {
  test::TempDir dir;
  const auto path = dir.path() / "mixed.gguf";
  test::tiny::gguf_writer({}, GgmlType::q8_0,
                          {{"blk.0.attn_q.weight", GgmlType::f16}, {"blk.0.ffn_gate.weight", GgmlType::f16}})
      .write(path);
  LoadOptions options;
  options.quantized_matmul = QuantizedMatmul::q8_activations;
  expect_decode_equals_prefill(Model::load(path, options), {1, 7, 12, 30, 5, 19, 3, 25}, "mixed");
}

// Prefill of 40 tokens (AMX tiles of 16 rows where the CPU has AMX: the up projection's SwiGLU runs in the tile
// epilogue, matmul_q8_swiglu) against decode one token at a time (one row: no fusion), bit for bit, for Q8_0 and
// Q4_0 files and for the mixed one whose F16 gate leaves the up projection to quantize its own input.
TEST(WeightsAsStored, Q8ActivationsPrefillOfManyRowsDecodesAsItPrefills) {
  test::TempDir dir;
  std::vector<std::pair<std::string, GgufWriter>> files;
  files.emplace_back("q8_0", test::tiny::gguf_writer({}, GgmlType::q8_0));
  files.emplace_back("q4_0", test::tiny::gguf_writer({}, GgmlType::q4_0));
  files.emplace_back("mixed", test::tiny::gguf_writer({}, GgmlType::q8_0, {{"blk.0.ffn_gate.weight", GgmlType::f16}}));
  std::vector<int32_t> ids;
  for (int i = 0; i < 40; ++i) ids.push_back((i * 7 + 3) % 40);
  for (auto& [name, writer] : files) {
    const auto path = dir.path() / (name + ".gguf");
    writer.write(path);
    LoadOptions options;
    options.quantized_matmul = QuantizedMatmul::q8_activations;
    expect_decode_equals_prefill(Model::load(path, options), ids, name);
  }
}

TEST(WeightsAsStored, RandomModelRefusesShapesItCannotWriteNamingTheField) {
  test::TempDir dir;
  auto err = [&](auto edit, GgmlType type = GgmlType::f16) {
    RandomGgufOptions o = small_random(1, type);
    edit(o);
    const auto out = dir.path() / "m.gguf";
    const std::string m = test::message_of<InvalidArgument>([&] { write_random_gguf(o, out); });
    EXPECT_FALSE(std::filesystem::exists(out)) << m;
    return m;
  };
  EXPECT_NE(err([](auto& o) { o.config.n_heads = 0; }).find("n_heads"), std::string::npos);
  EXPECT_NE(err([](auto& o) { o.config.n_kv_heads = 3; }).find("n_kv_heads: 3 does not divide n_heads 4"),
            std::string::npos);
  EXPECT_NE(err([](auto& o) { o.config.vocab_size = 100; }).find("vocab_size"), std::string::npos);
  EXPECT_NE(err([](auto& o) { o.config.dim = 48; o.config.n_heads = 3; o.config.n_kv_heads = 1; }, GgmlType::q8_0)
                .find("blocks of 32 weights; 48 is not a multiple of 32"),
            std::string::npos);
  // A valid small one loads, with its vocabulary, and the CLI writes the same bytes for the same seed.
  RandomGgufOptions o = small_random(2, GgmlType::q4_0);
  o.seed = 7;
  write_random_gguf(o, dir.path() / "lib.gguf");
  const Model m = Model::load(dir.path() / "lib.gguf");
  EXPECT_EQ(m.config().vocab_size, 300);
  ASSERT_TRUE(m.bundled_tokenizer().has_value());
  const auto r = test::run_cli("random-model --dim 64 --layers 2 --heads 4 --kv-heads 2 --ffn 96 --vocab 300 --tied "
                               "--type q4_0 --seed 7 --context 2048 --name posenc-random --out '" +
                               (dir.path() / "cli.gguf").string() + "'");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(test::slurp(dir.path() / "lib.gguf"), test::slurp(dir.path() / "cli.gguf"));
  const auto bad = test::run_cli("random-model --heads 5 --out '" + (dir.path() / "bad.gguf").string() + "'");
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_NE(bad.err.find("n_heads"), std::string::npos) << bad.err;
}

// --dense-matmul bf16x6 / bf16x3 (AMX-BF16 tiles) on stories260K converted to F16 and BF16: a 40-token prefill
// (three tiles of x, the SwiGLU in the up projection's epilogue) decodes token by token to the same bits, and the
// logits stay near the float32 products' logits: bf16x6's products are exact, so only the sums' rounding differs
// (measured max |dlogit| 1.2e-5 for F16, 9e-6 for BF16, logits spanning about 20 nats: bound 2e-4); bf16x3 drops
// terms under 2^-13 of each product (measured 8.6e-4 and 3.9e-4: bound 5e-3).
TEST(WeightsAsStored, Bf16SplitProductsDecodeAsTheyPrefillAndStayNearFloat32) {
  if (!detail::amx_bf16_supported()) GTEST_SKIP() << "this CPU has no AMX-BF16";
  const Model f32 = Model::load(test::shared_dir() / "models/stories260K/stories260K.gguf");
  const Tokenizer tok = *f32.bundled_tokenizer();
  test::TempDir dir;
  std::vector<int32_t> ids = tok.encode(
      "Once upon a time, there was a little girl named Lily. She loved to play outside in the park with her dog Max, "
      "who liked to run after the ball.", true, false);
  ASSERT_GE(ids.size(), 33u);  // three tiles of 16 rows, the last one short
  for (GgmlType t : {GgmlType::f16, GgmlType::bf16}) {
    const std::string name = ggml_type_name(static_cast<uint32_t>(t));
    GgufExportOptions eo;
    eo.type = t;
    const auto path = dir.path() / (name + ".gguf");
    write_model_gguf(f32, tok, path, eo);
    std::vector<float> reference;
    {
      const Model m = Model::load(path);
      KvCache cache = m.make_cache(16);
      const auto seq = cache.create();
      Model::SequenceInput in{seq, ids, {}};
      m.forward(cache, std::span(&in, 1), Model::LogitsMode::all, reference);
    }
    for (DenseMatmul mode : {DenseMatmul::bf16x6, DenseMatmul::bf16x3}) {
      LoadOptions options;
      options.dense_matmul = mode;
      const Model m = Model::load(path, options);
      const std::string label = name + " " + std::string(to_string(mode));
      expect_decode_equals_prefill(m, ids, label);
      KvCache cache = m.make_cache(16);
      const auto seq = cache.create();
      Model::SequenceInput in{seq, ids, {}};
      std::vector<float> got;
      m.forward(cache, std::span(&in, 1), Model::LogitsMode::all, got);
      ASSERT_EQ(got.size(), reference.size());
      double worst = 0.0;
      for (std::size_t i = 0; i < got.size(); ++i) worst = std::max(worst, std::fabs(double{got[i]} - reference[i]));
      EXPECT_LE(worst, mode == DenseMatmul::bf16x6 ? 2e-4 : 5e-3) << label;
      EXPECT_GT(worst, 0.0) << label << ": not float32's bits, so some logit must differ";
      std::printf("%s: max |dlogit| vs float32 products %.3g\n", label.c_str(), worst);
    }
  }
}

// Where the AMX-BF16 products cannot run (no AMX-BF16, or every SIMD path turned off with
// POSENC_DENSE_KERNEL=reference, which this test uses to observe it on any CPU), a model with F16 weights is refused
// at load naming the mode, and the CLI exits 1 with that message; an F32 model, which the mode does not touch, runs
// and says so. An unknown mode is a usage error naming the flag.
TEST(WeightsAsStored, Bf16SplitIsRefusedWhereItCannotRunNamingTheSetting) {
  EXPECT_NE(test::message_of<ConfigError>([] { parse_dense_matmul("bf16x9", "--dense-matmul"); })
                .find("--dense-matmul: must be float32, bf16x3 or bf16x6 (got 'bf16x9')"),
            std::string::npos);
  const std::string model = (test::shared_dir() / "models/stories260K/stories260K.gguf").string();
  test::TempDir d;
  const Model f32 = Model::load(model);
  GgufExportOptions eo;
  eo.type = GgmlType::f16;
  const std::string f16 = (d.path() / "f16.gguf").string();
  write_model_gguf(f32, *f32.bundled_tokenizer(), f16, eo);
  const auto out = d.path() / "out", err = d.path() / "err";
  auto run_reference = [&](const std::string& path) {
    const std::string cmd = "env POSENC_DENSE_KERNEL=reference '" + std::string(POSENC_CLI_PATH) +
                            "' generate --model '" + path + "' --prompt Once --max-tokens 2 --dense-matmul bf16x6 >'" +
                            out.string() + "' 2>'" + err.string() + "'";
    const int st = std::system(cmd.c_str());
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  };
  EXPECT_EQ(run_reference(f16), 1);
  const std::string msg = test::slurp(err);
  EXPECT_NE(msg.find("dense_matmul: bf16x6 runs on AMX-BF16 tiles"), std::string::npos) << msg;
  EXPECT_EQ(run_reference(model), 0) << test::slurp(err);
  EXPECT_NE(test::slurp(err).find("--dense-matmul changes nothing"), std::string::npos) << test::slurp(err);
  const auto usage = test::run_cli("generate --model '" + model + "' --prompt Once --max-tokens 2 --dense-matmul bf16");
  EXPECT_EQ(usage.exit_code, 2);
  EXPECT_NE(usage.err.find("--dense-matmul"), std::string::npos) << usage.err;
  // Names in any case (as --type): the header names the mode in its own spelling.
  const auto upper = test::run_cli("generate --model '" + model + "' --prompt Once --max-tokens 2 --dense-matmul BF16X6");
  EXPECT_EQ(upper.exit_code, 0) << upper.err;
  EXPECT_NE(upper.err.find("dense products: bf16x6"), std::string::npos) << upper.err;
}

// A path asked for by POSENC_Q8_KERNEL / POSENC_DENSE_KERNEL that this CPU cannot run (or that is no path) is reported
// with the paths it does run, listed from this CPU's own support, not with every path known (the newcomer helper
// read "amx" in the list of "paths this CPU runs" on a CPU without AMX); the run goes on on the best path.
TEST(WeightsAsStored, AnUnrunnableKernelPathIsReportedWithThePathsThisCpuRuns) {
  using detail::DenseKernel, detail::Q8Kernel, detail::dense_kernel_supported, detail::q8_kernel_supported;
  const std::string model = (test::shared_dir() / "models/TinyStories-656K-gguf/TinyStories-656K-Q8_0.gguf").string();
  const std::string tok = (test::shared_dir() / "models/TinyStories-656K/tokenizer.json").string();
  test::TempDir d;
  const auto err = d.path() / "err";
  auto run = [&](const std::string& env) {
    const std::string cmd = "env " + env + " '" + std::string(POSENC_CLI_PATH) + "' generate --model '" + model +
                            "' --tokenizer '" + tok + "' --prompt Once --max-tokens 2 --quantized-matmul " +
                            "q8_activations >/dev/null 2>'" + err.string() + "'";
    const int st = std::system(cmd.c_str());
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  };
  std::string q8_runs, dense_runs;
  for (Q8Kernel k : {Q8Kernel::reference, Q8Kernel::avx2, Q8Kernel::avx512_vnni, Q8Kernel::amx})
    if (q8_kernel_supported(k)) q8_runs += (q8_runs.empty() ? "" : ", ") + std::string(to_string(k));
  for (DenseKernel k : {DenseKernel::reference, DenseKernel::avx2, DenseKernel::avx512})
    if (dense_kernel_supported(k)) dense_runs += (dense_runs.empty() ? "" : ", ") + std::string(to_string(k));
  ASSERT_EQ(run("POSENC_Q8_KERNEL=bogus"), 0) << test::slurp(err);
  EXPECT_NE(test::slurp(err).find("POSENC_Q8_KERNEL=bogus is not a path this CPU runs (it runs " + q8_runs + ";"),
            std::string::npos)
      << test::slurp(err);
  if (!q8_kernel_supported(Q8Kernel::amx)) {
    ASSERT_EQ(run("POSENC_Q8_KERNEL=amx"), 0) << test::slurp(err);
    EXPECT_NE(test::slurp(err).find("POSENC_Q8_KERNEL=amx is not a path this CPU runs (it runs " + q8_runs + ";"),
              std::string::npos)
        << test::slurp(err);
  }
  ASSERT_EQ(run("POSENC_DENSE_KERNEL=bogus"), 0) << test::slurp(err);
  EXPECT_NE(test::slurp(err).find("POSENC_DENSE_KERNEL=bogus is not a path this CPU runs (it runs " + dense_runs + ";"),
            std::string::npos)
      << test::slurp(err);
}

namespace {

/// The last-token logits of decoding `ids` one token at a time, concatenated (a cache of `dtype`, or of the
/// model's kv_cache_dtype()).
std::vector<float> decode_steps(const Model& m, const std::vector<int32_t>& ids,
                                std::optional<KvCacheDtype> dtype = std::nullopt) {
  KvCache cache = dtype ? m.make_cache(16, 0, *dtype) : m.make_cache();
  const auto seq = cache.create();
  std::vector<float> out, last;
  for (std::size_t i = 0; i < ids.size(); ++i) {
    Model::SequenceInput in{seq, std::span(ids.data() + i, 1), {}};
    m.forward(cache, std::span(&in, 1), Model::LogitsMode::last, last);
    out.insert(out.end(), last.begin(), last.end());
  }
  return out;
}

/// Restores the OpenMP thread count and the decode team's switch when a test ends.
struct TeamScope {
  int threads = omp_get_max_threads();
  ~TeamScope() {
    omp_set_num_threads(threads);
    detail::set_decode_team(detail::DecodeTeam::automatic);
  }
};

}  // namespace

// The decode team (Model::forward's one team of threads for a one-token step, its projections split by rows and
// its attention by KV heads between the threads, synchronised by barriers) against a parallel region per
// projection: the same bits for
// every weight type, in float32 products and under q8_activations (a file mixing F16 and Q8_0 included), with
// biases on every projection and Qwen3's Q/K norms, at 2 threads and at 3 (which split rows unevenly: 32 K rows
// as 10 + 11 + 11); and decode still equals prefill. The team's step count shows the path under test ran; on one
// thread, and for rows whose length is not a multiple of 16 (matmul_w's one-row product needs it), it does not;
// by default (DecodeTeam::automatic) only models whose matrices are large enough for threads use it.
TEST(WeightsAsStored, DecodeTeamGivesTheBitsOfARegionPerProjection) {
  if (!detail::dense_kernel_supported(detail::DenseKernel::avx512))
    GTEST_SKIP() << "the decode team runs the AVX-512 one-row product; this CPU has no AVX-512";
  if (omp_get_thread_limit() < 2)
    GTEST_SKIP() << "OMP_THREAD_LIMIT=" << omp_get_thread_limit() << " leaves no second thread for a team";
  TeamScope scope;
  test::TempDir dir;
  struct Case {
    std::string name;
    std::filesystem::path path;
    LoadOptions options;
  };
  std::vector<Case> models;
  LoadOptions q8_activations;
  q8_activations.quantized_matmul = QuantizedMatmul::q8_activations;
  const bool vnni = detail::q8_decode_rows_supported(64, false);
  for (GgmlType t : {GgmlType::f32, GgmlType::f16, GgmlType::bf16, GgmlType::q8_0, GgmlType::q4_0}) {
    const std::string name = ggml_type_name(static_cast<uint32_t>(t));
    const auto path = dir.path() / (name + ".gguf");
    write_random_gguf(small_random(3, t), path);
    models.push_back({name + " (3 layers)", path, {}});
    if ((t == GgmlType::q8_0 || t == GgmlType::q4_0) && vnni)
      models.push_back({name + " (3 layers) under q8_activations", path, q8_activations});
  }
  const auto biased = dir.path() / "biased-f16.gguf";
  test::tiny::gguf_writer({.qkv_bias = true, .o_bias = true, .untied = true}, GgmlType::f16).write(biased);
  models.push_back({"GGUF F16 with q/k/v/o biases", biased, {}});
  if (vnni) {
    const auto mixed = dir.path() / "mixed.gguf";
    test::tiny::gguf_writer({.qkv_bias = true, .o_bias = true, .untied = true}, GgmlType::q8_0,
                            {{"blk.0.attn_k.weight", GgmlType::f16}, {"blk.0.ffn_up.weight", GgmlType::f16}})
        .write(mixed);
    models.push_back({"GGUF Q8_0 with F16 K and up, biases, under q8_activations", mixed, q8_activations});
  }
  const auto hf_dir = [&](const std::string& name, const test::tiny::Parts& parts) {
    const auto hf = dir.path() / name;
    std::filesystem::create_directories(hf);
    write_file_atomic(hf / "config.json", test::tiny::hf_config(parts).dump());
    write_file_atomic(hf / "model.safetensors", test::tiny::safetensors_bytes(test::tiny::hf_tensors(parts)));
    models.push_back({name, hf, {}});
  };
  hf_dir("HF Llama with attention and MLP biases", {.qkv_bias = true, .o_bias = true, .mlp_bias = true, .untied = true});
  hf_dir("HF Qwen3 (Q/K norms)", {.qk_norm = true, .untied = true});

  const std::vector<int32_t> ids = {1, 7, 12, 30, 5, 19, 3, 25, 11, 38};
  for (const auto& [name, path, options] : models) {
    const Model m = Model::load(path, options);
    for (int threads : {2, 3}) {
      const std::string label = name + ", " + std::to_string(threads) + " threads";
      omp_set_num_threads(threads);
      detail::set_decode_team(detail::DecodeTeam::always);  // these models are small: automatic would not team
      const int64_t before = detail::decode_team_steps();
      const std::vector<float> team = decode_steps(m, ids);
      EXPECT_EQ(detail::decode_team_steps() - before, static_cast<int64_t>(ids.size())) << label;
      detail::set_decode_team(detail::DecodeTeam::off);
      const std::vector<float> regions = decode_steps(m, ids);
      EXPECT_EQ(detail::decode_team_steps() - before, static_cast<int64_t>(ids.size())) << label;
      ASSERT_EQ(team.size(), regions.size()) << label;
      EXPECT_EQ(std::memcmp(team.data(), regions.data(), team.size() * sizeof(float)), 0) << label;
      detail::set_decode_team(detail::DecodeTeam::always);
      expect_decode_equals_prefill(m, ids, label);
    }
  }
  // Attention inside the team, each thread on its own KV heads: one KV head (MQA: a thread with none), four KV
  // heads on 3 threads (1 + 1 + 2), f16 and bf16 caches, and 150 positions (many blocks, a prefetch past the
  // first tiles) give the bits of a region per projection (attention between the regions).
  {
    struct Shape {
      int heads, kv_heads;
      KvCacheDtype cache;
      int tokens;
      bool team = true;
    };
    // 16 query heads per KV head over a 16-bit cache: attention would widen it per thread, so no team (an f32 cache
    // of the same model does team).
    const Shape shapes[] = {{4, 1, KvCacheDtype::f32, 20},
                            {8, 4, KvCacheDtype::f16, 20},
                            {4, 2, KvCacheDtype::bf16, 20},
                            {4, 2, KvCacheDtype::f32, 150},
                            {32, 2, KvCacheDtype::f16, 20, false},
                            {32, 2, KvCacheDtype::f32, 20}};
    for (const Shape& sh : shapes) {
      RandomGgufOptions o = small_random(3, GgmlType::f16);
      o.config.n_heads = sh.heads;
      o.config.n_kv_heads = sh.kv_heads;
      o.config.head_dim = 16;
      const auto path = dir.path() / fmt::format("h{}kv{}{}.gguf", sh.heads, sh.kv_heads, to_string(sh.cache));
      write_random_gguf(o, path);
      const Model m = Model::load(path);
      std::vector<int32_t> long_ids(static_cast<std::size_t>(sh.tokens));
      for (std::size_t i = 0; i < long_ids.size(); ++i) long_ids[i] = static_cast<int32_t>((i * 37 + 5) % 300);
      const auto steps = [&] { return decode_steps(m, long_ids, sh.cache); };
      for (int threads : {2, 3}) {
        const std::string label = fmt::format("{} heads / {} KV heads, {} cache, {} tokens, {} threads", sh.heads,
                                              sh.kv_heads, to_string(sh.cache), sh.tokens, threads);
        omp_set_num_threads(threads);
        detail::set_decode_team(detail::DecodeTeam::always);
        const int64_t before = detail::decode_team_steps();
        const std::vector<float> team = steps();
        EXPECT_EQ(detail::decode_team_steps() - before, sh.team ? sh.tokens : 0) << label;
        detail::set_decode_team(detail::DecodeTeam::off);
        const std::vector<float> regions = steps();
        ASSERT_EQ(team.size(), regions.size()) << label;
        EXPECT_EQ(std::memcmp(team.data(), regions.data(), team.size() * sizeof(float)), 0) << label;
      }
    }
  }
  // Not the team's even when always asked: one thread, and an FFN of 40 (the down projection's rows are not a
  // multiple of 16). Nor, by default (automatic), a model this small.
  int64_t before = detail::decode_team_steps();
  omp_set_num_threads(1);
  decode_steps(Model::load(models.front().path), ids);
  omp_set_num_threads(2);
  RandomGgufOptions odd = small_random(2, GgmlType::f16);
  odd.config.hidden_dim = 40;
  write_random_gguf(odd, dir.path() / "ffn40.gguf");
  decode_steps(Model::load(dir.path() / "ffn40.gguf"), ids);
  detail::set_decode_team(detail::DecodeTeam::automatic);
  decode_steps(Model::load(models.front().path), ids);
  EXPECT_EQ(detail::decode_team_steps(), before);
  // By default a model whose Q, O and FFN matrices are each 512 x 512 or larger (matmul_w's threshold for a
  // parallel region) decodes in a team, with the bits of a region per projection.
  RandomGgufOptions big = small_random(2, GgmlType::f16);
  big.config.dim = 512;
  big.config.n_heads = 8;
  big.config.n_kv_heads = 2;
  big.config.hidden_dim = 512;
  write_random_gguf(big, dir.path() / "dim512.gguf");
  const Model m512 = Model::load(dir.path() / "dim512.gguf");
  before = detail::decode_team_steps();
  const std::vector<float> team = decode_steps(m512, ids);
  EXPECT_EQ(detail::decode_team_steps() - before, static_cast<int64_t>(ids.size()));
  detail::set_decode_team(detail::DecodeTeam::off);
  const std::vector<float> regions = decode_steps(m512, ids);
  ASSERT_EQ(team.size(), regions.size());
  EXPECT_EQ(std::memcmp(team.data(), regions.data(), team.size() * sizeof(float)), 0);
}

// An exception inside the decode team (std::bad_alloc: a thread's first-use buffers, the attention kernel's
// per-thread tables growing with the positions) reaches forward's caller instead of ending the process (it called
// std::terminate): thrown by any one thread at
// any of its pieces of work, with the KV heads split evenly (2 threads: each prepares its own heads) and not (3
// threads over 2 KV heads: one thread prepares them all), the others neither hang at a barrier nor keep the
// exception; the step appended nothing, and taken again on the same cache it gives the logits of a run that never
// failed.
TEST(WeightsAsStored, AnExceptionInsideTheDecodeTeamReachesTheCaller) {
  if (!detail::dense_kernel_supported(detail::DenseKernel::avx512))
    GTEST_SKIP() << "the decode team runs the AVX-512 one-row product; this CPU has no AVX-512";
  if (omp_get_thread_limit() < 3)
    GTEST_SKIP() << "OMP_THREAD_LIMIT=" << omp_get_thread_limit() << " leaves no three threads for a team";
  TeamScope scope;
  struct NoFault {
    ~NoFault() { detail::set_decode_team_fault_for_testing(-1, 0); }
  } no_fault;
  test::TempDir dir;
  const auto path = dir.path() / "f16.gguf";
  write_random_gguf(small_random(3, GgmlType::f16), path);  // 3 layers, 4 heads over 2 KV heads
  const Model m = Model::load(path);
  const std::vector<int32_t> prompt = {1, 7, 12, 30, 5};
  const int32_t next = 19;
  // Prefill (no team: five tokens), then one team step; its logits. A step that throws appends nothing: the same
  // cache then takes the step again and gives the logits of a run that never failed.
  std::vector<float> retried;
  const auto step = [&] {
    KvCache cache = m.make_cache();
    const auto seq = cache.create();
    std::vector<float> logits;
    Model::SequenceInput in{seq, prompt, {}};
    m.forward(cache, std::span(&in, 1), Model::LogitsMode::last, logits);
    Model::SequenceInput one{seq, std::span(&next, 1), {}};
    try {
      m.forward(cache, std::span(&one, 1), Model::LogitsMode::last, logits);
    } catch (const std::bad_alloc&) {
      EXPECT_EQ(cache.size(seq), static_cast<int64_t>(prompt.size()));
      EXPECT_EQ(cache.next_position(seq), static_cast<int64_t>(prompt.size()));
      detail::set_decode_team_fault_for_testing(-1, 0);
      m.forward(cache, std::span(&one, 1), Model::LogitsMode::last, retried);
      throw;
    }
    return logits;
  };
  detail::set_decode_team(detail::DecodeTeam::always);
  for (int threads : {2, 3}) {
    omp_set_num_threads(threads);
    const std::vector<float> expected = step();
    // A thread's pieces: layer 0's Q, K, V; then per layer but the last its output projection, the FFN's up
    // projections, its down projection, the next layer's Q, K, V (and RoPE), attention (and with 3 threads the
    // preparing of all heads, on whichever thread comes first); the last layer's three and the classifier:
    // 1 + 5 x 2 + 4 = 15, up to 17 for a thread that prepares the heads of both layers.
    for (int thread = 0; thread < threads; ++thread) {
      int thrown = 0;
      for (int segment = 0; segment < 20; ++segment) {
        const std::string label = fmt::format("{} threads, thread {} throwing at piece {}", threads, thread, segment);
        detail::set_decode_team_fault_for_testing(segment, thread);
        const int64_t before = detail::decode_team_steps();
        try {
          const std::vector<float> got = step();
          // Past the thread's last piece: nothing thrown, the step ran as a team with the bits of one unfaulted.
          EXPECT_GE(segment, 15) << label;
          EXPECT_EQ(detail::decode_team_steps() - before, 1) << label;
          ASSERT_EQ(got.size(), expected.size()) << label;
          EXPECT_EQ(std::memcmp(got.data(), expected.data(), got.size() * sizeof(float)), 0) << label;
        } catch (const std::bad_alloc&) {
          ++thrown;
          EXPECT_EQ(detail::decode_team_steps() - before, 1) << label << ": the failed step is not counted, the retry is";
          ASSERT_EQ(retried.size(), expected.size()) << label;
          EXPECT_EQ(std::memcmp(retried.data(), expected.data(), retried.size() * sizeof(float)), 0) << label;
        }
      }
      EXPECT_GE(thrown, 15) << threads << " threads, thread " << thread;
      EXPECT_LE(thrown, threads == 2 ? 15 : 17) << threads << " threads, thread " << thread;
    }
    detail::set_decode_team_fault_for_testing(-1, 0);
    const std::vector<float> after = step();
    ASSERT_EQ(after.size(), expected.size());
    EXPECT_EQ(std::memcmp(after.data(), expected.data(), after.size() * sizeof(float)), 0) << threads << " threads";
  }
}

}  // namespace POSENC_UNITY_ID
