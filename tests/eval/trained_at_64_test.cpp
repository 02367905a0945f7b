// Issue 14's acceptance: a `posenc train` model trained at 64 tokens runs ppl,
// check-cache, eval (+ report) and generate with all defaults, and every size
// those commands choose follows its trained context T = 64 (stories260K's 512
// is one case, not an assumption).
#include <gtest/gtest.h>

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "posenc/eval.hpp"
#include "posenc/io.hpp"
#include "posenc/model.hpp"
#include "../test_support.hpp"

namespace POSENC_UNITY_ID {  // this file's own namespace in the tests' unity build (CMakeLists.txt)

#if POSENC_WITH_TRAIN  // every test here trains a model with `posenc train` (not in a -DPOSENC_WITH_TRAIN=OFF build)

namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using posenc::read_file;
namespace test = posenc::test;

std::vector<int64_t> edges_of(const json& result) {
  std::vector<int64_t> e;
  for (const auto& b : result.at("buckets")) e.push_back(b.at("start").get<int64_t>());
  if (!result.at("buckets").empty()) e.push_back(result.at("buckets").back().at("end").get<int64_t>());
  return e;
}

// Text in the model's own symbols (the associative-recall training format),
// blocks of 2..24 pairs, for ppl.
std::string recall_text(int blocks) {
  std::string t;
  uint64_t s = 987654321;
  auto next = [&] { return (s = s * 6364136223846793005ULL + 1442695040888963407ULL) >> 33; };
  for (int i = 0; i < blocks; ++i) {
    const int pairs = 2 + static_cast<int>(next() % 23);
    std::string x;
    int q = 0, qv = 0;
    for (int k = 0; k < pairs; ++k) {
      const int key = static_cast<int>(next() % 128), v = static_cast<int>(next() % 10);
      if (k == 0) q = key, qv = v;
      x += fmt::format("{}k{} {}", k ? " " : "", key, v);
    }
    t += fmt::format("{} ? k{} {}\n\n", x, q, qv);
  }
  return t;
}

TEST(TrainedAt64, EveryCommandRunsWithDefaultsScaledToTheTrainedContext) {
  test::TempDir d;
  const fs::path m = d.path() / "ar64.pt";
  // associative_recall at 8..34 pairs' worth of tokens: sequences of at most 64 tokens.
  const auto t = test::run_cli("train --task associative_recall --pe rope --steps 20 --batch-size 8 --dim 32 "
                               "--heads 4 --train-lengths 8:34 --eval-samples 0 --seed 1 --out " + m.string());
  ASSERT_EQ(t.exit_code, 0) << t.err;
  ASSERT_EQ(posenc::Model::load(m).trained_context(), 64);

  // ppl: window lengths T/2..4T, buckets [0,T/2) [T/2,T) [T,2T) [2T,4T), a plot.
  const fs::path text = d.file("recall.txt", recall_text(400));
  const fs::path pj = d.path() / "ppl.json", png = d.path() / "ppl.png";
  auto r = test::run_cli(fmt::format("ppl --model {} --text {} --json {} --plot {}", m.string(), text.string(),
                                     pj.string(), png.string()));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const json p = json::parse(read_file(pj));
  EXPECT_EQ(p.at("trained_context"), 64);
  std::vector<int64_t> contexts;
  for (const auto& x : p.at("results"))
    if (x.at("rope_scaling") == "default") contexts.push_back(x.at("context").get<int64_t>());
  EXPECT_EQ(contexts, (std::vector<int64_t>{32, 64, 128, 256}));
  for (const auto& x : p.at("results"))
    if (x.at("context") == 256) {
      EXPECT_EQ(edges_of(x), (std::vector<int64_t>{0, 32, 64, 128, 256}));
    }
  EXPECT_GT(fs::file_size(png), 10000u);

  // check-cache: length T, every scenario size derived from it.
  const fs::path cj = d.path() / "cache.json";
  r = test::run_cli(fmt::format("check-cache --model {} --json {}", m.string(), cj.string()));
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  const json c = json::parse(read_file(cj));
  EXPECT_EQ(c.at("length"), 64);
  EXPECT_EQ(c.at("trained_context"), 64);
  EXPECT_EQ(c.at("plan").at("chunk_sizes"), json::parse("[7, 8, 64]"));
  EXPECT_EQ(c.at("plan").at("sliding_window"), 8);
  EXPECT_EQ(c.at("plan").at("block_size"), 8);
  EXPECT_EQ(c.at("plan").at("fork_prefix"), 35);
  EXPECT_EQ(c.at("plan").at("shift_offset"), 128);
  EXPECT_TRUE(c.at("passed").get<bool>());

  // eval: the task the model was trained on, at T/2..8T, with a measured chance level.
  const fs::path out = d.path() / "eval";
  r = test::run_cli(fmt::format("eval --model {} --out {} --quiet", m.string(), out.string()));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const fs::path run = posenc::resolve_run_dir(out);
  const json rj = json::parse(read_file(run / "run.json"));
  EXPECT_EQ(rj.at("config").at("lengths"), json::parse("[32, 64, 128, 256, 512]"));
  EXPECT_EQ(rj.at("config").at("tasks"), json::parse(R"(["associative_recall"])"));
  const json s = json::parse(read_file(run / "summary.json"));
  bool measured = false;
  for (const auto& e : s.at("effective_context"))
    if (e.at("control") == "none") {
      EXPECT_EQ(e.at("chance_source"), "measured") << e.dump();
      measured = true;
    }
  EXPECT_TRUE(measured) << s.dump();
  r = test::run_cli("eval report " + out.string());
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_TRUE(fs::exists(run / "report.html"));
  const std::string html = read_file(run / "report.html");
  EXPECT_NE(html.find("64"), std::string::npos);

  // generate: RoPE past T warns once; the default stops at <eos> or --max-tokens.
  const fs::path gj = d.path() / "gen.json";
  r = test::run_cli(fmt::format("generate --model {} --prompt 'k3 7 k12 1 ? k3' --max-tokens 80 --ignore-eos --json {}",
                                m.string(), gj.string()));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const json g = json::parse(read_file(gj));
  EXPECT_EQ(g.at("generated_ids").size(), 80u);
  std::size_t warnings = 0;
  for (std::size_t at = r.err.find("passes the trained context"); at != std::string::npos;
       at = r.err.find("passes the trained context", at + 1))
    ++warnings;
  EXPECT_EQ(warnings, 1u) << r.err;
  EXPECT_NE(r.err.find("(64 tokens"), std::string::npos) << r.err;
  r = test::run_cli(fmt::format("generate --model {} --prompt 'k3 7 k12 1 ? k3' --json {}", m.string(), gj.string()));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const std::string why = json::parse(read_file(gj)).at("stop_reason").get<std::string>();
  EXPECT_TRUE(why == "eos" || why == "max_tokens") << why;
}

}  // namespace

#endif  // POSENC_WITH_TRAIN

}  // namespace POSENC_UNITY_ID
