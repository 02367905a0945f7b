// The checks of an eval run directory read back (issue 13) on small synthetic
// runs (tests/eval/eval_run_seeds.hpp): the seed corpus of fuzz/eval_run_fuzz.cpp
// and what resume, report and merge accept or refuse. The CLI cases on a real
// run are in eval_cli_test.cpp.
#include <climits>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include <gtest/gtest.h>

#include "eval/eval_run_seeds.hpp"
#include "posenc/convert.hpp"
#include "posenc/error.hpp"
#include "posenc/eval.hpp"
#include "posenc/io.hpp"
#include "posenc/model.hpp"
#include "posenc/perplexity.hpp"
#include "test_support.hpp"

namespace POSENC_UNITY_ID {  // this file's own namespace in the tests' unity build (CMakeLists.txt)

namespace fs = std::filesystem;
using namespace posenc;
using posenc::test::slurp;
using posenc::test::TempDir;

namespace {

// Lays out a fuzz input as fuzz/eval_run_fuzz.cpp does: OUT/run/run.json,
// OUT/run/<section path>, OUT/LATEST. Returns the directory to report/merge.
fs::path lay_out(const fs::path& root, const std::string& input) {
  const fs::path out = root / "out", run = out / "run";
  fs::create_directories(run / "cells");
  fs::create_directories(run / "ppl");
  const std::string mark = "\n=== ";
  std::size_t pos = input.find(mark);
  std::ofstream(run / "run.json") << input.substr(0, pos);
  bool latest = false;
  while (pos != std::string::npos) {
    const std::size_t eol = input.find('\n', pos + mark.size());
    const std::string name = input.substr(pos + mark.size(), eol - pos - mark.size());
    pos = input.find(mark, eol);
    const std::string bytes = input.substr(eol + 1, pos == std::string::npos ? std::string::npos : pos - eol - 1);
    if (name == "LATEST") latest = true;
    std::ofstream(name == "LATEST" ? out / "LATEST" : run / name) << bytes;
  }
  return latest ? out : run;
}

template <class F>
std::string data_error_of(F&& f) {
  return test::message_of<DataError>(std::forward<F>(f));
}

}  // namespace

// fuzz/corpus/eval_run/ holds exactly evalrun::seeds(); the valid ones are
// reported and merged, the others refused with a DataError.
// POSENC_WRITE_FUZZ_CORPUS=1 rewrites the directory.
TEST(EvalRunFuzzCorpus, SeedsAreCurrent) {
  const auto dir = fs::path(POSENC_SOURCE_DIR) / "fuzz/corpus/eval_run";
  const auto seeds = test::evalrun::seeds();
  if (const char* e = std::getenv("POSENC_WRITE_FUZZ_CORPUS"); e != nullptr && std::string(e) == "1") {
    fs::create_directories(dir);
    for (const auto& s : seeds) write_file_atomic(dir / s.name, s.bytes);
  }
  std::size_t on_disk = 0;
  for (const auto& entry : fs::directory_iterator(dir))
    on_disk += entry.is_regular_file() && entry.path().filename().string().rfind("regression_", 0) != 0;
  EXPECT_EQ(on_disk, seeds.size());
  for (const auto& s : seeds) {
    SCOPED_TRACE(s.name);
    ASSERT_TRUE(fs::exists(dir / s.name)) << "run with POSENC_WRITE_FUZZ_CORPUS=1 to write the corpus";
    EXPECT_TRUE(slurp(dir / s.name) == s.bytes) << "stale seed; POSENC_WRITE_FUZZ_CORPUS=1 rewrites it";
    TempDir d;
    const fs::path target = lay_out(d.path(), s.bytes);
    if (s.valid) {
      EXPECT_NO_THROW((void)rebuild_eval_outputs(target));
      EXPECT_NO_THROW((void)merge_eval_runs(std::vector<fs::path>{target}, d.path() / "merged"));
      EXPECT_NO_THROW((void)eval_resume_plan(target));
    } else {
      EXPECT_NE(data_error_of([&] { (void)rebuild_eval_outputs(target); }).find(": "), std::string::npos);
      EXPECT_EQ(data_error_of([&] { (void)merge_eval_runs(std::vector<fs::path>{target}, d.path() / "merged"); })
                    .rfind("wrong exception type", 0),
                std::string::npos);
    }
  }
}

TEST(EvalRunDir, SummaryCountsOnlyCellsThatHoldTheirCell) {
  const auto seeds = test::evalrun::seeds();
  TempDir d;
  const fs::path run = lay_out(d.path(), seeds[0].bytes);
  const auto s = rebuild_eval_outputs(run);
  EXPECT_EQ(s.at("cells_present").get<int>(), 4);
  EXPECT_TRUE(s.at("complete").get<bool>());
  EXPECT_TRUE(eval_resume_plan(run).empty());
  // The d0 cell copied over d1: 4 of 4 before the checks, refused now.
  fs::copy_file(run / "cells/name_recall__none__default__L128__d0.json", run / "cells/name_recall__none__default__L128__d1.json",
                fs::copy_options::overwrite_existing);
  const std::string e = data_error_of([&] { (void)rebuild_eval_outputs(run); });
  EXPECT_NE(e.find("name_recall__none__default__L128__d1.json: cell.depth"), std::string::npos) << e;
  const auto plan = eval_resume_plan(run);
  ASSERT_EQ(plan.size(), 1u);
  EXPECT_NE(plan[0].find("d1.json"), std::string::npos) << plan[0];
}

TEST(EvalRunDir, ACellWithoutChecksumIsRefusedNamingTheFile) {
  TempDir d;
  const fs::path run = lay_out(d.path(), test::evalrun::seeds()[0].bytes);
  const fs::path p = run / "cells/name_recall__swap__default__L128__d1.json";
  auto j = nlohmann::json::parse(slurp(p));
  j.erase("checksum");
  std::ofstream(p, std::ios::trunc) << j.dump();
  const std::string e = data_error_of([&] { (void)rebuild_eval_outputs(run); });
  EXPECT_NE(e.find(p.string() + ": missing key 'checksum'"), std::string::npos) << e;
}

TEST(EvalRunDir, LatestMustNameADirectChild) {
  for (const std::string& latest : std::vector<std::string>{"../run", "/etc", "run/..", "", "a b"}) {
    SCOPED_TRACE(latest);
    TempDir d;
    fs::create_directories(d.path() / "out");
    std::ofstream(d.path() / "out" / "LATEST") << latest << "\n";
    const std::string e = data_error_of([&] { (void)resolve_run_dir(d.path() / "out"); });
    EXPECT_NE(e.find("LATEST: names"), std::string::npos) << e;
  }
}

// ceil(max_tokens / (L - 1)) overflowed int64 for max_tokens near INT64_MAX:
// a negative window count, then vector::resize(2^64 - n) threw length_error
// (`posenc ppl --max-tokens`, and eval left its cells without a summary).
TEST(EvalRunDir, PerplexityMaxTokensNearInt64MaxMeansTheWholeStream) {
  const Model m = Model::load_llama2c(test::model_path());
  std::vector<int32_t> stream;
  for (int i = 0; i < 150; ++i) stream.push_back(1 + (i * 37) % 500);
  PplOptions all;
  all.context = 64;
  PplOptions huge = all;
  huge.max_tokens = INT64_MAX;
  const PplResult a = evaluate_perplexity(m, stream, all);
  const PplResult b = evaluate_perplexity(m, stream, huge);
  EXPECT_EQ(a.windows, b.windows);
  EXPECT_EQ(a.tokens, b.tokens);
  EXPECT_EQ(a.nll, b.nll);
  huge.max_tokens = INT64_MAX - 1;
  EXPECT_EQ(evaluate_perplexity(m, stream, huge).windows, a.windows);
}

TEST(EvalRunDir, PplTokensNearInt64MaxIsRefusedByName) {
  EvalConfig c;
  c.tasks = {"kv_retrieval"};
  c.lengths = {128};
  c.depths = {0.5};
  c.samples = 1;
  c.haystack_path = "x.txt";
  c.out = "out";
  c.ppl_tokens = INT64_MAX;
  try {
    validate_eval_config(c);
    FAIL() << "accepted";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("--ppl-tokens"), std::string::npos) << e.what();
  }
  c.ppl_tokens = int64_t{1} << 48;
  EXPECT_NO_THROW(validate_eval_config(c));
}

// A run.json whose axes list millions of cells made report and merge look up
// each cell file (minutes, unbounded): refused before any lookup.
TEST(EvalRunDir, AxesOfMoreThan2To20CellsAreRefused) {
  std::vector<int64_t> lengths;
  std::vector<double> depths;
  for (int i = 0; i < 1100; ++i) lengths.push_back(8 + i);
  for (int i = 0; i < 1000; ++i) depths.push_back(i / 1000.0);
  TempDir d;
  const fs::path run = lay_out(
      d.path(), test::evalrun::run_json("big", {"name_recall"}, {"none"}, lengths, depths, 1, -1).dump());
  const std::string e = data_error_of([&] { (void)rebuild_eval_outputs(run); });
  EXPECT_NE(e.find("run.json: config: the axes make more than 1048576 cells"), std::string::npos) << e;
  EvalConfig c;
  c.tasks = {"name_recall"};
  c.lengths = lengths;
  c.depths = depths;
  c.haystack_path = "x.txt";
  c.out = "out";
  try {
    validate_eval_config(c);
    FAIL() << "accepted";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("more than 1048576 cells"), std::string::npos) << e.what();
  }
}

// Generator version 1 runs (no absent control, no metrics) keep their
// meaning: forced choice was acc, chance the assumed 1/K. Version 2 runs
// measure chance with the absent cells, per metric, pooled over lengths.
TEST(EvalRunDir, OldRunsKeepAssumedChanceAndNewRunsMeasureIt) {
  const auto seeds = test::evalrun::seeds();
  auto seed = [&](const std::string& name) {
    for (const auto& s : seeds)
      if (s.name == name) return s.bytes;
    ADD_FAILURE() << name;
    return std::string();
  };
  {
    TempDir d;
    const auto s = rebuild_eval_outputs(lay_out(d.path(), seed("complete_name_recall.txt")));
    EXPECT_EQ(s.at("schema_version"), 2);
    EXPECT_TRUE(s.at("chance").empty());
    ASSERT_FALSE(s.at("effective_context").empty());
    for (const auto& e : s.at("effective_context")) {
      EXPECT_EQ(e.at("metric"), "acc");
      EXPECT_EQ(e.at("chance_source"), "assumed");
      EXPECT_DOUBLE_EQ(e.at("chance").get<double>(), 0.25);
    }
    EXPECT_NE(format_eval_summary(s).find("chance 0.25, assumed"), std::string::npos) << format_eval_summary(s);
  }
  {
    TempDir d;
    const auto s = rebuild_eval_outputs(lay_out(d.path(), seed("v2_acc_norm_absent.txt")));
    EXPECT_EQ(s.at("cells_present"), 4);
    ASSERT_EQ(s.at("chance").size(), 2u);
    for (const auto& c : s.at("chance")) {
      EXPECT_EQ(c.at("n"), 8);  // 4 samples x 2 lengths
      EXPECT_EQ(c.at("correct"), 2);
    }
    const Interval chance = wilson_interval(2, 8);
    ASSERT_EQ(s.at("effective_context").size(), 2u);
    for (const auto& e : s.at("effective_context")) {
      EXPECT_EQ(e.at("chance_source"), "measured");
      EXPECT_DOUBLE_EQ(e.at("chance").get<double>(), 0.25);
      EXPECT_DOUBLE_EQ(e.at("chance_gate").get<double>(), chance.high);
      const int64_t k = e.at("metric") == "acc_norm" ? 3 : 2;
      EXPECT_DOUBLE_EQ(e.at("baseline").get<double>(), static_cast<double>(k) / 4.0);
      EXPECT_FALSE(e.at("solvable").get<bool>());  // 4 samples cannot beat chance significantly
    }
  }
  {
    TempDir d;
    const std::string e = data_error_of([&] { (void)rebuild_eval_outputs(lay_out(d.path(), seed("v2_acc_count_edited.txt"))); });
    EXPECT_NE(e.find("cell.metrics.acc"), std::string::npos) << e;
  }
}

// The run id hashes --quantized-matmul and --dense-matmul only for a model whose matrices they change (Q8_0/Q4_0
// ones, F16/BF16 ones): the same run of a float32 model under another mode is the same run.
TEST(EvalRunId, MatmulModesCountOnlyForMatricesTheyChange) {
  TempDir dir;
  const auto write = [&](GgmlType type) {
    RandomGgufOptions o;
    o.config.dim = 64;
    o.config.n_layers = 1;
    o.config.n_heads = 4;
    o.config.n_kv_heads = 2;
    o.config.hidden_dim = 96;
    o.config.vocab_size = 300;
    o.type = type;
    const fs::path p = dir.path() / (std::string(ggml_type_name(static_cast<uint32_t>(type))) + ".gguf");
    write_random_gguf(o, p);
    return p;
  };
  const auto id = [](const fs::path& path, const LoadOptions& options) {
    const Model m = Model::load(path, options);
    EvalConfig c;
    c.model_path = path.string();
    return eval_run_id(c, m);
  };
  LoadOptions q8;
  q8.quantized_matmul = QuantizedMatmul::q8_activations;
  LoadOptions bf16x3;
  bf16x3.dense_matmul = DenseMatmul::bf16x3;
  const fs::path f32 = write(GgmlType::f32), q8_0 = write(GgmlType::q8_0), f16 = write(GgmlType::f16);
  EXPECT_FALSE(Model::load(f32).has_block_quantized_matrices());
  EXPECT_FALSE(Model::load(f32).has_half_precision_matrices());
  EXPECT_TRUE(Model::load(q8_0).has_block_quantized_matrices());
  EXPECT_TRUE(Model::load(f16).has_half_precision_matrices());
  EXPECT_FALSE(Model::load(f16).has_block_quantized_matrices());
  EXPECT_EQ(id(f32, q8), id(f32, {}));
  EXPECT_EQ(id(f32, bf16x3), id(f32, {}));  // no F16/BF16 matrix: loads without AMX too
  EXPECT_EQ(id(f16, q8), id(f16, {}));
  EXPECT_NE(id(q8_0, q8), id(q8_0, {}));
  EXPECT_EQ(id(q8_0, bf16x3), id(q8_0, {}));
  // An F16 model under bf16x3 is a different run (it needs AMX-BF16 to load at all).
  try {
    EXPECT_NE(id(f16, bf16x3), id(f16, {}));
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("AMX-BF16"), std::string::npos) << e.what();
  }
}

}  // namespace POSENC_UNITY_ID
