// posenc — the length-generalization study: every (task, encoding, seed)
// model trained, evaluated by exact match at each test length with the
// runtime (plus RoPE scalings on the RoPE models), and reported as
// Kazemnejad et al. (NeurIPS 2023) do: accuracy by length bucket and the mean
// reciprocal rank of the encodings.
//
// Directory layout (everything written atomically, so a killed run resumes):
//   <out>/study.json                          the configuration (checked on resume)
//   <out>/models/<task>-<pe>-s<seed>.pt       posenc checkpoints
//   <out>/evals/<task>-<pe>-s<seed>.json      exact match per length (and per scaling)
//   <out>/summary.json, summary.csv, plots/   written by `posenc study report`
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "posenc/train.hpp"

namespace posenc {

struct StudyConfig {
  std::vector<TrainTaskKind> tasks{TrainTaskKind::copy, TrainTaskKind::reverse, TrainTaskKind::addition, TrainTaskKind::associative_recall};
  std::vector<TrainEncoding> pes{TrainEncoding::nope,  TrainEncoding::learned, TrainEncoding::sinusoidal,
                                 TrainEncoding::t5,    TrainEncoding::alibi,   TrainEncoding::rope,
                                 TrainEncoding::rope25};
  std::vector<uint64_t> seeds{1, 2, 3};
  LengthRange train_lengths{8, 32, 1};
  LengthRange test_lengths{8, 128, 8};  ///< lo, lo+step, ..., <= hi (each rounded down to a valid length)
  /// Hyper-parameters of every model (task, pe, seed, train_lengths and out are set per model).
  TrainConfig train;
  /// Per-task recipes applied on top of `train` (apply_recipe); a task absent
  /// here trains with `train` as is. Default: every non-empty default_recipe().
  std::map<TrainTaskKind, TaskRecipe> recipes = default_recipes();
  int samples = 100;  ///< evaluation samples per (model, length)
  /// RoPE scalings evaluated on the rope/rope25 models, besides "default".
  std::vector<std::string> scalings{"linear", "ntk", "yarn", "dynamic"};
  std::filesystem::path out;
  /// Process only the units (in run order, 0-based) with index % shard_count ==
  /// shard, so several processes can share one study directory (every file is
  /// per unit and written atomically; study.json is identical for all shards).
  int shard = 0;
  int shard_count = 1;
};

/// The test lengths of `config` (before rounding to a task's valid lengths).
std::vector<int> study_test_lengths(const StudyConfig& config);

/// Trains and evaluates every (seed, task, pe) in that order (seeds outermost,
/// so a partial run holds complete seeds first). Models and evaluations that
/// already exist in config.out are loaded instead of recomputed; each new one
/// is written atomically as soon as it is done. `log` receives one line per
/// event (progress, timings). Throws ConfigError if config.out holds a study
/// run with other settings (study.json), and as train_model/evaluate_exact_match.
void run_study(const StudyConfig& config, const std::function<void(std::string_view)>& log);

struct StudyReport {
  std::string text;                 ///< the printed table(s)
  std::filesystem::path summary_json;
  std::filesystem::path summary_csv;
  int evaluations = 0;              ///< eval files found
  int expected = 0;                 ///< models the study.json config implies
};

/// Reads <dir>/study.json and <dir>/evals/*.json and writes <dir>/summary.json
/// and <dir>/summary.csv atomically:
///  - per (task, pe, test length) and per (task, pe, length bucket): exact-match
///    accuracy pooled over seeds and samples, with the Wilson 95% interval;
///    "cannot run" where the model cannot process the length (learned table);
///  - buckets: the training range, then (1, 1.5], (1.5, 2], (2, 3], (3, 4], (4, ...]
///    times the longest training length;
///  - mean reciprocal rank (Kazemnejad et al.): for each (task, seed), the
///    encodings are ranked by their length-generalization score = mean
///    exact-match accuracy over the test lengths beyond the training range
///    (a length the model cannot run scores 0); tied scores share the
///    average of their ranks; the reciprocal ranks are averaged per encoding
///    over all (task, seed) that some encoding learned (pooled accuracy over
///    the training lengths >= 50%; the others are listed as left out: with
///    every score ~0 they would only add the same 1/mean-rank to every
///    encoding). Reported over all encodings and over the paper's
///    five (nope, t5, alibi, rope25 = "Rotary", sinusoidal = "APE");
///  - the scaling results of the RoPE models per bucket.
/// Works on partial runs (what exists is reported, with the count).
/// Throws IoError / ConfigError if the directory holds no study.
StudyReport write_study_report(const std::filesystem::path& dir);

}  // namespace posenc
