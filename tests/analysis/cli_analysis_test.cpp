// `posenc inspect`, `posenc periods` and `posenc decay` through the binary
// (POSENC_CLI_PATH): outputs, files and non-zero exits on bad input.
#include <cmath>
#include <numbers>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "config/test_util.hpp"

namespace POSENC_UNITY_ID {  // this file's own namespace in the tests' unity build (CMakeLists.txt)

using posenc::test::CliResult;
using posenc::test::run_cli;
using posenc::test::ScratchDir;
using posenc::test::shared_config;
using json = nlohmann::json;

namespace {

void expect_failure(const std::vector<std::string>& args,
                    std::initializer_list<std::string_view> parts) {
  const CliResult r = run_cli(args);
  EXPECT_NE(r.exit_code, 0) << r.out;
  for (auto p : parts)
    EXPECT_NE(r.err.find(p), std::string::npos) << "'" << p << "' missing from: " << r.err;
}

bool is_png(const std::filesystem::path& p) {
  const std::string head = posenc::test::slurp(p).substr(0, 8);
  return head == std::string("\x89PNG\r\n\x1a\n", 8);
}

}  // namespace

TEST(CliPeriods, JsonReproducesWrapCounts) {
  const CliResult r = run_cli({"periods", "--head-dim", "128", "--rope-theta", "10000,500000",
                               "--context", "4K,32K,128K,1M", "--json", "-"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const json j = json::parse(r.out);
  const auto& rows = j.at("rows");
  ASSERT_EQ(rows.size(), 8u);
  EXPECT_FALSE(rows[0].contains("rope_type"));
  EXPECT_EQ(rows[2].at("rope_theta").get<double>(), 10000.0);
  EXPECT_EQ(rows[2].at("length").get<int64_t>(), 131072);
  EXPECT_EQ(rows[2].at("wrapped").get<int>(), 64);
  EXPECT_EQ(rows[6].at("length").get<int64_t>(), 131072);
  EXPECT_EQ(rows[6].at("unwrapped").get<int>(), 15);
  EXPECT_EQ(rows[6].at("unwrapped_channels").front().get<int>(), 49);
  EXPECT_EQ(rows[7].at("length").get<int64_t>(), 1048576);
  EXPECT_EQ(rows[7].at("unwrapped_channels").get<std::vector<int>>(),
            (std::vector<int>{59, 60, 61, 62, 63}));
}

TEST(CliPeriods, CsvWithScalingsAndPlot) {
  ScratchDir dir;
  const auto png = dir / "periods.png";
  const CliResult r = run_cli({"periods", "--rope-theta", "500000", "--context", "128K",
                               "--rope-scaling", "default,linear", "--rope-factor", "4", "--csv", "-",
                               "--plot", png.string()});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.out.substr(0, r.out.find('\n')),
            "rope_theta,head_dim,rope_type,length,wrapped,unwrapped,unwrapped_channels");
  EXPECT_NE(r.out.find("500000,128,default,131072,49,15,49 50 51"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("500000,128,linear,131072,"), std::string::npos) << r.out;
  EXPECT_TRUE(is_png(png)) << r.err;
  // No temporary left behind next to the PNG.
  int files = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir.path())) {
    (void)e;
    ++files;
  }
  EXPECT_EQ(files, 1);
}

TEST(CliPeriods, BadInputExitsNonZero) {
  expect_failure({"periods", "--rope-theta", "abc", "--context", "4K"}, {"--rope-theta", "abc"});
  expect_failure({"periods", "--rope-theta", "10000", "--context", "12X"}, {"--context", "12X"});
  expect_failure({"periods", "--rope-theta", "10000", "--context", "4K", "--rope-scaling",
                  "linear"},
                 {"factor", "linear"});
  expect_failure({"periods", "--rope-theta", "10000", "--context", "4K", "--rope-scaling",
                  "warp", "--rope-factor", "2"},
                 {"rope_type", "warp", "default"});
  expect_failure({"periods", "--rope-theta", "-3", "--context", "4K"}, {"rope_theta", "-3"});
  expect_failure({"periods", "--head-dim", "127", "--rope-theta", "10000", "--context", "4K"},
                 {"head_dim", "127"});
}

TEST(CliInspect, JsonForDefaultRope) {
  const CliResult r =
      run_cli({"inspect", "--config", shared_config("tinyllama-1.1b-chat-v1.0.json").string(),
               "--seq-len", "8K", "--json", "-"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const json j = json::parse(r.out);  // exactly one object
  ASSERT_TRUE(j.is_object());
  EXPECT_EQ(j.at("family"), "rope");
  EXPECT_EQ(j.at("rope_type"), "default");
  EXPECT_EQ(j.at("rope_theta").get<double>(), 10000.0);
  EXPECT_EQ(j.at("head_dim").get<int>(), 64);
  EXPECT_EQ(j.at("rotary_dim").get<int>(), 64);
  EXPECT_EQ(j.at("layout"), "half");
  EXPECT_EQ(j.at("attention_factor").get<double>(), 1.0);
  ASSERT_EQ(j.at("inv_freq").size(), 32u);
  const auto& c0 = j.at("channels").at(0);
  EXPECT_EQ(c0.at("i").get<int>(), 0);
  EXPECT_DOUBLE_EQ(c0.at("wavelength").get<double>(), 2 * std::numbers::pi);
  EXPECT_NEAR(c0.at("rotations_original").get<double>(), 2048 / (2 * std::numbers::pi), 1e-9);
  EXPECT_NEAR(c0.at("rotations_target").get<double>(), 8192 / (2 * std::numbers::pi), 1e-9);
  EXPECT_EQ(c0.at("wavelength_ratio").get<double>(), 1.0);
}

TEST(CliInspect, BiasFamilies) {
  const CliResult mpt =
      run_cli({"inspect", "--config", shared_config("mpt-7b.json").string(), "--json", "-"});
  ASSERT_EQ(mpt.exit_code, 0) << mpt.err;
  const json a = json::parse(mpt.out);
  EXPECT_EQ(a.at("family"), "alibi");
  ASSERT_EQ(a.at("slopes").size(), 32u);
  EXPECT_NEAR(a.at("slopes")[0].get<double>(), std::pow(2.0, -0.25), 1e-7);
  EXPECT_EQ(a.at("slopes")[31].get<double>(), 1.0 / 256);
  const CliResult t5 =
      run_cli({"inspect", "--config", shared_config("flan-t5-base.json").string(), "--json", "-"});
  ASSERT_EQ(t5.exit_code, 0) << t5.err;
  const json t = json::parse(t5.out);
  EXPECT_EQ(t.at("family"), "t5_bias");
  EXPECT_EQ(t.at("relative_attention_num_buckets").get<int>(), 32);
  EXPECT_EQ(t.at("relative_attention_max_distance").get<int>(), 128);
}

// inspect --model reads what the runtime's loaders read: the same model as a Hugging Face directory (its
// config.json), as GGUF (llama.rope.* keys; q/k stored for interleaved pairs) and, for stories260K, as llama2.c
// (its header and llama2.c's defaults) give the same frequencies; only the layouts differ, as the files store
// them. A model file given as --config is sent to --model (exit 2), a directory as --config reads its config.json.
TEST(CliInspect, ModelsOfEveryFormatGiveTheirConfigsFrequencies) {
  const std::filesystem::path models = std::filesystem::path(POSENC_SHARED_DIR) / "models";
  auto inspect = [](const std::vector<std::string>& args) {
    std::vector<std::string> a{"inspect"};
    a.insert(a.end(), args.begin(), args.end());
    a.insert(a.end(), {"--json", "-"});
    const CliResult r = run_cli(a);
    EXPECT_EQ(r.exit_code, 0) << r.err;
    return r.exit_code == 0 ? json::parse(r.out) : json::object();
  };
  const json hf = inspect({"--model", (models / "TinyStories-656K").string()});
  const json hf_dir = inspect({"--config", (models / "TinyStories-656K").string()});
  const json gguf = inspect({"--model", (models / "TinyStories-656K-gguf/TinyStories-656K-Q8_0.gguf").string()});
  ASSERT_FALSE(hf.empty());
  ASSERT_FALSE(gguf.empty());
  EXPECT_EQ(hf, hf_dir);
  EXPECT_EQ(hf.at("layout"), "half");
  EXPECT_EQ(gguf.at("layout"), "interleaved");
  for (const char* k : {"family", "rope_type", "rope_theta", "head_dim", "rotary_dim", "attention_factor", "inv_freq",
                        "sliding_window"})  // (the GGUF's sliding_window.source was empty)
    EXPECT_EQ(hf.at(k), gguf.at(k)) << k;
  EXPECT_EQ(gguf.at("inv_freq").size(), 8u);
  const json bin = inspect({"--model", (models / "stories260K/stories260K.bin").string()});
  const json bin_gguf = inspect({"--model", (models / "stories260K/stories260K.gguf").string()});
  ASSERT_FALSE(bin.empty());
  for (const char* k : {"family", "rope_type", "rope_theta", "head_dim", "rotary_dim", "layout", "inv_freq"})
    EXPECT_EQ(bin.at(k), bin_gguf.at(k)) << k;
  EXPECT_EQ(bin.at("head_dim").get<int>(), 8);
  // Each says the context its own file says (models/SOURCES.md: the GGUF's context_length is 2048, the model was
  // trained at the llama2.c header's 512), so the rotations over it differ by 4x, the wavelengths not at all.
  ASSERT_EQ(bin.at("channels").size(), bin_gguf.at("channels").size());
  for (std::size_t i = 0; i < bin.at("channels").size(); ++i) {
    const json& a = bin.at("channels")[i];
    const json& b = bin_gguf.at("channels")[i];
    EXPECT_EQ(a.at("wavelength"), b.at("wavelength")) << i;
    EXPECT_NEAR(b.at("rotations_original").get<double>() / a.at("rotations_original").get<double>(), 4.0, 1e-12) << i;
  }
  // The text names the loader's provenance: the GGUF key the context came from.
  const CliResult text = run_cli({"inspect", "--model", (models / "TinyStories-656K-gguf/TinyStories-656K-Q8_0.gguf").string()});
  ASSERT_EQ(text.exit_code, 0) << text.err;
  EXPECT_NE(text.out.find("max_position_embeddings:  512"), std::string::npos) << text.out;
  EXPECT_NE(text.out.find("GGUF llama.context_length"), std::string::npos) << text.out;
  // Model files as --config: exit 2, sent to --model.
  for (const auto& f : {models / "stories260K/stories260K.gguf", models / "stories260K/stories260K.bin"}) {
    const CliResult r = run_cli({"inspect", "--config", f.string()});
    EXPECT_EQ(r.exit_code, 2) << f << r.err;
    EXPECT_NE(r.err.find("give it as --model"), std::string::npos) << r.err;
  }
  ScratchDir dir;
  expect_failure({"inspect", "--config", dir.path().string()}, {"without config.json", "--model"});
  expect_failure({"inspect", "--model", (dir / "nothing.gguf").string()}, {"nothing.gguf"});
}

TEST(CliInspect, BadConfigExitsNonZero) {
  ScratchDir dir;
  const auto bad = dir.write("bad.json", R"({"model_type": "llama", "num_attention_heads": 4,
      "hidden_size": 256, "rope_scaling": {"rope_type": "linear", "factor": -2}})");
  expect_failure({"inspect", "--config", bad.string()}, {"rope_scaling.factor", "-2", "bad.json"});
  expect_failure({"inspect", "--config", (dir / "missing.json").string()}, {"missing.json"});
  expect_failure({"inspect", "--config", shared_config("mistral-7b-v0.1.json").string(),
                  "--seq-len", "many"},
                 {"--seq-len", "many"});
}

TEST(CliDecay, CsvFileAndPlot) {
  ScratchDir dir;
  const auto csv = dir / "decay.csv";
  const auto png = dir / "decay.png";
  const CliResult r = run_cli({"decay", "--head-dim", "128", "--rope-theta", "10000",
                               "--max-distance", "64K", "--csv", csv.string(), "--plot",
                               png.string()});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const std::string text = posenc::test::slurp(csv);
  EXPECT_EQ(text.substr(0, text.find('\n')), "distance,bound");
  EXPECT_NE(text.find("\n0,32.5\n"), std::string::npos);
  EXPECT_NE(text.find("\n1,31.53816614"), std::string::npos) << text.substr(0, 80);
  EXPECT_NE(text.find("\n65536,"), std::string::npos);
  EXPECT_TRUE(is_png(png)) << r.err;
  expect_failure({"decay", "--head-dim", "127"}, {"head_dim", "127"});
  expect_failure({"decay", "--rope-theta", "x1"}, {"--rope-theta", "x1"});
}

}  // namespace POSENC_UNITY_ID
