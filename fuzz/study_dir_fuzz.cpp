// libFuzzer harness: a study directory read back. The input is study.json
// plus evaluation files (format: fuzz/study_dir_input.hpp), written to a
// scratch directory; then `posenc study report` (write_study_report: the
// table, MRR, summary.json/csv) and resume planning (read_study_file and the
// settings check against a fixed configuration, eval_file_problem for every
// evaluation). posenc::Error is the expected outcome for bad input; anything
// else is a finding. The training half of the study needs libtorch and is not
// built here (fuzz/CMakeLists.txt); checkpoints are the posenc_checkpoint
// harness's.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "fuzz_support.hpp"
#include "posenc/error.hpp"
#include "posenc/io.hpp"
#include "posenc/study.hpp"
#include "study_dir_input.hpp"
#include "train/study_dir.hpp"

namespace fs = std::filesystem;

namespace {

fs::path scratch_dir() {
  std::error_code ec;
  const fs::path base = fs::is_directory("/dev/shm", ec) ? fs::path("/dev/shm") : fs::temp_directory_path();
  return base / ("posenc-fuzz-" + std::to_string(::getpid()) + "-study");
}

struct ScratchDir {
  fs::path path = scratch_dir();
  ~ScratchDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
};

// What a resumed run of the seed corpus's configuration would want (the
// settings of tests/train/study_dir_seeds.hpp's study, so the valid seeds match).
const nlohmann::json& wanted_settings() {
  static const nlohmann::json s = {
      {"train_lengths", {8, 16}},
      {"test_lengths", {8, 32, 8}},
      {"samples", 10},
      {"scalings", {"linear"}},
      {"train", {{"steps", 30}, {"dim", 32}, {"n_layers", 3}, {"n_heads", 4}, {"lr", 0.003}}},
      {"recipes", {{"reverse", "lr=0.001"}}}};
  return s;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const ScratchDir dir;
  std::error_code ec;
  fs::remove_all(dir.path, ec);
  fs::create_directories(dir.path / "evals");
  const auto files = posenc::fuzz::split_study_dir_input(std::string_view(reinterpret_cast<const char*>(data), size));
  for (const auto& [name, contents] : files) posenc::write_file_atomic(dir.path / name, contents);
  try {
    const posenc::StudyReport r = posenc::write_study_report(dir.path);
    if (r.evaluations < 0 || r.expected < 0 || r.text.empty()) __builtin_trap();
  } catch (const posenc::Error& e) {
    posenc::fuzz::refused(e);
  }
  try {
    const auto study = posenc::detail::read_study_file(dir.path / "study.json");
    posenc::detail::check_study_settings(study, wanted_settings(), dir.path);
  } catch (const posenc::Error& e) {
    posenc::fuzz::refused(e);
  }
  for (std::size_t i = 1; i < files.size(); ++i) {
    const auto why = posenc::detail::eval_file_problem(dir.path / files[i].first, "copy", "rope", 1, 10, {"linear"});
    if (why && why->empty()) __builtin_trap();
  }
  return 0;
}
