// A small hand-made study directory (study.json + three evaluations) for the
// study-directory tests, and the seed corpus of fuzz/study_dir_fuzz.cpp made
// from it (StudyDirFuzzCorpus.SeedsAreCurrent keeps fuzz/corpus/study_dir/ equal).
#pragma once

#include <filesystem>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "../../fuzz/study_dir_input.hpp"
#include "posenc/io.hpp"

namespace posenc::test {

using posenc::fuzz::split_study_dir_input;

/// relative path -> JSON of a valid study: copy x {nope, rope, t5} x seed 1,
/// train lengths 8-16, test lengths 8-32 step 8, 10 samples; rope also
/// evaluated with "linear".
inline std::map<std::string, nlohmann::json> study_dir_base() {
  using nlohmann::json;
  std::map<std::string, json> files;
  files["study.json"] = {{"format", "posenc-study"},
                         {"version", 1},
                         {"settings",
                          {{"train_lengths", {8, 16}},
                           {"test_lengths", {8, 32, 8}},
                           {"samples", 10},
                           {"scalings", {"linear"}},
                           {"train", {{"steps", 30}, {"dim", 32}, {"n_layers", 3}, {"n_heads", 4}, {"lr", 0.003}}},
                           {"recipes", {{"reverse", "lr=0.001"}}}}},
                         {"tasks", {"copy"}},
                         {"pes", {"nope", "rope", "t5"}},
                         {"seeds", {1}},
                         {"threads", 1}};
  const std::pair<const char*, int> beyond[] = {{"nope", 8}, {"rope", 5}, {"t5", 2}};
  for (const auto& [pe, k] : beyond) {
    json cells = json::array();
    for (int len : {8, 16, 24, 32})
      cells.push_back({{"length", len}, {"samples", 10}, {"correct", len <= 16 ? 10 : k}, {"can_run", true}, {"note", ""}});
    json ev{{"task", "copy"},         {"pe", pe},          {"seed", 1},          {"model", "models/x.pt"},
            {"samples", 10},          {"train_seconds", 1.5}, {"eval_seconds", 0.25}, {"results", {{"default", cells}}}};
    if (std::string(pe) == "rope") ev["results"]["linear"] = cells;
    files[std::string("evals/copy-") + pe + "-s1.json"] = ev;
  }
  return files;
}

inline void write_study_dir(const std::filesystem::path& dir, const std::map<std::string, nlohmann::json>& files) {
  for (const auto& [name, j] : files) write_file_atomic(dir / name, j.dump(1));
}

/// The fuzz input (fuzz/study_dir_input.hpp) of a directory's files, study.json first.
inline std::string study_dir_input(const std::map<std::string, nlohmann::json>& files) {
  std::string s = files.at("study.json").dump(1);
  for (const auto& [name, j] : files)
    if (name != "study.json") s += std::string(posenc::fuzz::kStudyDirSeparator) + j.dump(1);
  return s;
}

/// fuzz/corpus/study_dir/: names starting "valid_" report; the others are
/// refused with a posenc::Error (one per kind of defect the report had).
inline std::vector<std::pair<std::string, std::string>> study_dir_fuzz_seeds() {
  using nlohmann::json;
  std::vector<std::pair<std::string, std::string>> out;
  auto base = study_dir_base();
  out.emplace_back("valid_study.txt", study_dir_input(base));
  {
    auto f = base;
    f.erase("evals/copy-t5-s1.json");
    f.erase("evals/copy-rope-s1.json");
    out.emplace_back("valid_partial.txt", study_dir_input(f));
  }
  {
    auto f = base;
    f.erase("evals/copy-nope-s1.json");
    f.erase("evals/copy-rope-s1.json");
    f.erase("evals/copy-t5-s1.json");
    f["study.json"]["settings"]["test_lengths"] = {4, 80, 4};  // below and far beyond the training range
    out.emplace_back("valid_no_evals.txt", study_dir_input(f));
  }
  {
    auto f = base;
    f["study.json"]["settings"].erase("train_lengths");
    out.emplace_back("missing_train_lengths.txt", study_dir_input(f));
  }
  {
    auto f = base;
    f["study.json"].erase("settings");
    out.emplace_back("missing_settings.txt", study_dir_input(f));
  }
  {
    auto f = base;
    f["study.json"]["settings"]["test_lengths"] = {8, 32};
    out.emplace_back("short_test_lengths.txt", study_dir_input(f));
  }
  {
    auto f = base;
    f["evals/copy-rope-s1.json"]["results"].erase("default");
    out.emplace_back("results_without_default.txt", study_dir_input(f));
  }
  {
    auto f = base;
    f["evals/copy-nope-s1.json"]["results"]["default"][2].erase("samples");
    out.emplace_back("cell_without_samples.txt", study_dir_input(f));
  }
  {
    auto f = base;
    f["evals/copy-nope-s1.json"]["results"]["default"][1]["correct"] = 99;
    out.emplace_back("correct_above_samples.txt", study_dir_input(f));
  }
  return out;
}

}  // namespace posenc::test
