// Small synthetic eval run directories, built in code: the unit tests of the
// run-directory checks (tests/eval/eval_run_dir_test.cpp) and the seed corpus
// of fuzz/eval_run_fuzz.cpp (fuzz/corpus/eval_run/, EvalRunFuzzCorpus.SeedsAreCurrent
// rewrites it with POSENC_WRITE_FUZZ_CORPUS=1).
//
// The fuzz input format (parsed by fuzz/eval_run_fuzz.cpp): the bytes of
// run.json, then any number of sections "\n=== <relative path>\n<bytes>",
// each written to that path of the run directory OUT/run/ (cells/<name>.json,
// ppl/<name>.json) or, for "LATEST", to OUT/LATEST (then OUT is the directory
// reported and merged, else OUT/run).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "posenc/eval.hpp"

namespace posenc::test::evalrun {

using nlohmann::json;

inline json run_json(const std::string& id, const std::vector<std::string>& tasks, std::vector<std::string> controls,
                     const std::vector<int64_t>& lengths, const std::vector<double>& depths, int64_t samples,
                     int64_t ppl_tokens) {
  return {{"run_id", id},
          {"config",
           {{"tasks", tasks},
            {"controls", controls},
            {"rope_scalings", {"default"}},
            {"lengths", lengths},
            {"depths", depths},
            {"samples", samples},
            {"choices", 4},
            {"threshold", 0.85},
            {"min_baseline", 0.0},
            {"ppl_tokens", ppl_tokens},
            {"shard", "0/1"}}},
          {"model", {{"path", "m.bin"}, {"trained_context", 256}}},
          {"haystack", {{"path", nullptr}}},
          {"ppl_header", {{"model", "m.bin"}, {"tokens_total", 1000}}}};
}

/// A cell file whose first `correct` samples are correct; depth < 0 = no depth.
/// With `correct_acc` (generator version 2, forced choice): "metric" acc_norm,
/// "metrics" {acc_norm, acc} and each sample's correct_by_metric, the first
/// `correct_acc` samples correct under acc.
inline json cell_file(const std::string& task, const std::string& control, int64_t L, double depth, int64_t n,
                      int64_t correct, bool fits = true, std::optional<int64_t> correct_acc = {}) {
  const Interval ci = wilson_interval(correct, n);
  const json d = depth < 0 ? json(nullptr) : json(depth);
  json cell = {{"task", task},          {"control", control},
               {"rope_scaling", "default"}, {"length", L},
               {"depth", d},            {"n", fits ? n : 0},
               {"correct", fits ? correct : 0},
               {"accuracy", fits && n > 0 ? json(static_cast<double>(correct) / static_cast<double>(n)) : json(nullptr)},
               {"ci_low", fits ? ci.low : 0.0}, {"ci_high", fits ? ci.high : 0.0},
               {"status", fits ? "ok" : "does not fit"}};
  const int64_t m = fits ? n : 0;
  auto metric = [&](int64_t k) {
    const Interval mi = wilson_interval(k, m);
    return json{{"correct", k},
                {"accuracy", m > 0 ? json(static_cast<double>(k) / static_cast<double>(m)) : json(nullptr)},
                {"ci_low", mi.low},
                {"ci_high", mi.high}};
  };
  if (correct_acc) {
    cell["metric"] = "acc_norm";
    cell["metrics"] = {{"acc_norm", metric(fits ? correct : 0)}, {"acc", metric(fits ? *correct_acc : 0)}};
  }
  json samples = json::array();
  if (fits)
    for (int64_t i = 0; i < n; ++i) {
      samples.push_back({{"task", task}, {"control", control}, {"rope_scaling", "default"}, {"length", L}, {"depth", d},
                         {"index", i}, {"correct", i < correct}, {"prediction", i < correct ? "Anna" : "Bob"},
                         {"kept_original", false}});
      if (correct_acc) samples.back()["correct_by_metric"] = {{"acc_norm", i < correct}, {"acc", i < *correct_acc}};
    }
  json f = {{"cell", cell}, {"samples", samples}};
  f["checksum"] = eval_file_checksum(f);
  return f;
}

inline json ppl_file(int64_t L) {
  json f = {{"context", L},  {"rope_scaling", "default"}, {"factor", 1.0}, {"ppl", 7.5}, {"nll", 2.01},
            {"tokens", 400}, {"windows", 4},
            {"buckets", {{{"start", 0}, {"end", L}, {"nll", 2.01}, {"tokens", 400}}}}};
  f["checksum"] = eval_file_checksum(f);
  return f;
}

inline std::string cell_path(const std::string& task, const std::string& control, int64_t L, double depth) {
  return fmt::format("cells/{}__{}__default__L{}__d{}.json", task, control, L,
                     depth < 0 ? std::string("na") : fmt::format("{:g}", depth));
}

/// run.json then "\n=== path\n" + bytes per file.
inline std::string fuzz_input(const json& run, const std::vector<std::pair<std::string, std::string>>& files) {
  std::string s = run.dump(2);
  for (const auto& [path, bytes] : files) s += "\n=== " + path + "\n" + bytes;
  return s;
}

struct Seed {
  std::string name;
  std::string bytes;
  bool valid;  ///< report and merge accept it
};

inline std::vector<Seed> seeds() {
  std::vector<Seed> out;
  const json nr = run_json("0123456789abcdef", {"name_recall"}, {"none", "swap"}, {128}, {0.0, 1.0}, 2, 100);
  std::vector<std::pair<std::string, std::string>> nr_files;
  for (const char* c : {"none", "swap"})
    for (double d : {0.0, 1.0}) nr_files.push_back({cell_path("name_recall", c, 128, d), cell_file("name_recall", c, 128, d, 2, d == 0.0 ? 2 : 1).dump()});
  nr_files.push_back({"ppl/default__L128.json", ppl_file(128).dump(2)});
  out.push_back({"complete_name_recall.txt", fuzz_input(nr, nr_files), true});
  out.push_back({"incomplete.txt", fuzz_input(nr, {nr_files[0], nr_files[3]}), true});
  {
    auto files = nr_files;
    files.push_back({"LATEST", "run\n"});
    out.push_back({"latest.txt", fuzz_input(nr, files), true});
  }
  {
    // Generator version 2: acc_norm + acc per cell, the absent control (no depth) measuring chance.
    json v2 = run_json("fedcba9876543210", {"name_recall"}, {"none"}, {128, 256}, {0.5}, 4, -1);
    v2["config"]["absent_control"] = true;
    v2["model"]["family"] = "rope";
    std::vector<std::pair<std::string, std::string>> files;
    for (int64_t L : {128, 256}) {
      files.push_back({cell_path("name_recall", "none", L, 0.5), cell_file("name_recall", "none", L, 0.5, 4, 3, true, 2).dump()});
      files.push_back({cell_path("name_recall", "absent", L, -1), cell_file("name_recall", "absent", L, -1, 4, 1, true, 1).dump()});
    }
    out.push_back({"v2_acc_norm_absent.txt", fuzz_input(v2, files), true});
    // A cell whose acc count disagrees with its samples.
    json bad = cell_file("name_recall", "none", 128, 0.5, 4, 3, true, 2);
    const Interval four = wilson_interval(4, 4);
    bad["cell"]["metrics"]["acc"] = {{"correct", 4}, {"accuracy", 1.0}, {"ci_low", four.low}, {"ci_high", four.high}};
    bad["checksum"] = eval_file_checksum(bad);
    out.push_back({"v2_acc_count_edited.txt", fuzz_input(v2, {{cell_path("name_recall", "none", 128, 0.5), bad.dump()}}), false});
  }
  const json cw = run_json("cw-run", {"common_words", "variable_tracking"}, {"none"}, {64, 96}, {0.5}, 3, -1);
  out.push_back({"no_depth_and_does_not_fit.txt",
                 fuzz_input(cw, {{cell_path("common_words", "none", 64, -1), cell_file("common_words", "none", 64, -1, 3, 3).dump()},
                                 {cell_path("common_words", "none", 96, -1), cell_file("common_words", "none", 96, -1, 3, 0).dump()},
                                 {cell_path("variable_tracking", "none", 64, 0.5),
                                  cell_file("variable_tracking", "none", 64, 0.5, 3, 0, false).dump()}}),
                 true});
  // Rejected: an edited cell, a cell under another cell's name, a run id and a LATEST outside.
  {
    json edited = cell_file("name_recall", "none", 128, 0.0, 2, 2);
    edited["cell"]["correct"] = 1;
    out.push_back({"edited_cell.txt", fuzz_input(nr, {{cell_path("name_recall", "none", 128, 0.0), edited.dump()}}), false});
    out.push_back({"copied_cell.txt",
                   fuzz_input(nr, {{cell_path("name_recall", "none", 128, 1.0), cell_file("name_recall", "none", 128, 0.0, 2, 2).dump()}}),
                   false});
  }
  {
    json bad = nr;
    bad["run_id"] = "../escape";
    out.push_back({"run_id_escape.txt", fuzz_input(bad, {nr_files[0]}), false});
    out.push_back({"latest_escape.txt", fuzz_input(nr, {nr_files[0], {"LATEST", "../escape\n"}}), false});
  }
  return out;
}

}  // namespace posenc::test::evalrun
