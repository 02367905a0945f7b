// posenc — reading a study directory back (study.json, evals/*.json), for the
// report and for resume planning. Every value goes through JsonView: a missing
// key, a wrong type, a short array or an out-of-range number is a DataError
// naming the file and the key path, never undefined behaviour.
//
// This part of the study needs neither libtorch nor the trainer, so the fuzz
// build (fuzz/CMakeLists.txt, which leaves src/train/ out) compiles it too:
// fuzz/study_dir_fuzz.cpp.
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "posenc/json_file.hpp"

namespace posenc::detail {

/// Input lengths a study directory may hold (parse_length_range's bound).
inline constexpr int kStudyMaxLength = 4096;
/// Samples per cell accepted from an evaluation file: pooled sums of 10^9 cells
/// of this size stay far inside int64.
inline constexpr std::int64_t kStudyMaxSamples = 1'000'000'000;

/// study.json, checked: format "posenc-study", settings.train_lengths [lo, hi],
/// settings.test_lengths [lo, hi, step], settings.samples, settings.scalings
/// (strings), tasks and pes (strings), seeds (integers >= 0).
struct StudyFile {
  JsonDocument doc;
  int train_lo = 0, train_hi = 0;
  int test_lo = 0, test_hi = 0, test_step = 0;
  std::int64_t samples = 0;
  std::vector<std::string> scalings;  ///< settings.scalings (without "default")
  std::vector<std::string> tasks, pes;
  std::vector<std::uint64_t> seeds;
};

/// Reads and checks `path`. Throws IoError (cannot read), ConfigError "<path>:
/// not a posenc study file" (another format), DataError naming the file and the
/// key path (malformed).
StudyFile read_study_file(const std::filesystem::path& path);

/// Throws ConfigError if study.json's settings differ from `wanted` (the
/// settings of the run being resumed), listing the leaves that differ.
void check_study_settings(const StudyFile& study, const nlohmann::json& wanted, const std::filesystem::path& out);

/// "train/lr: 0.003 in the directory, 0.01 requested; ..." for the leaves that differ.
std::string settings_difference(const nlohmann::json& have, const nlohmann::json& want);

struct EvalCellRecord {
  int length = 0;
  std::int64_t samples = 0, correct = 0;
  bool can_run = true;
};

/// evals/<task>-<pe>-s<seed>.json, checked: task, pe, seed, results (an object
/// of scaling -> cells, with "default"), each cell's length, samples, correct
/// (<= samples) and can_run; a length at most once per scaling.
struct EvalFile {
  std::string task, pe;
  std::uint64_t seed = 0;
  std::optional<std::int64_t> samples;  ///< samples per length, as configured
  std::map<std::string, std::vector<EvalCellRecord>> results;
  double train_seconds = 0.0, eval_seconds = 0.0;
};

/// "<task>-<pe>-s<seed>": the file stem of a unit's model and evaluation.
std::string study_unit_name(std::string_view task, std::string_view pe, std::uint64_t seed);

/// Reads and checks an evaluation file; its name must be the unit it holds
/// (a file copied over another's is refused, not counted twice).
/// Throws IoError / DataError naming the file (and key path).
EvalFile read_eval_file(const std::filesystem::path& path);

/// Resume planning: why the evaluation at `path` cannot be kept for the unit
/// (task, pe, seed) evaluated with `samples` per length and the scalings
/// `scalings` (besides "default"), or nullopt when it is complete. Never throws:
/// an unreadable or malformed file is a reason (naming the file and key).
std::optional<std::string> eval_file_problem(const std::filesystem::path& path, std::string_view task,
                                             std::string_view pe, std::uint64_t seed, std::int64_t samples,
                                             const std::vector<std::string>& scalings);


}  // namespace posenc::detail
