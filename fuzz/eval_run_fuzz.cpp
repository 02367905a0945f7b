// libFuzzer harness: an eval run directory read back by resume, report and
// merge. The input is run.json's bytes, then sections "\n=== <path>\n<bytes>"
// written to OUT/run/<path> (cells/<name>.json, ppl/<name>.json) or, for
// "LATEST", to OUT/LATEST (tests/eval/eval_run_seeds.hpp builds the seeds).
// Then: eval_resume_plan (what resume would recompute), rebuild_eval_outputs
// + format_eval_summary of the summary.json it wrote (`eval report`), and
// merge_eval_runs into another directory (`eval merge`). posenc::Error is the
// expected outcome for bad input; anything else is a finding, and so is any
// file written outside the scratch directory (a run id or LATEST escaping).
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

#include "fuzz_support.hpp"
#include "posenc/error.hpp"
#include "posenc/eval.hpp"
#include "posenc/io.hpp"
#include "posenc/json_file.hpp"

namespace fs = std::filesystem;

namespace {

class ScratchDir {
 public:
  ScratchDir() {
    std::error_code ec;
    const fs::path base = fs::is_directory("/dev/shm", ec) ? fs::path("/dev/shm") : fs::temp_directory_path();
    path_ = base / ("posenc-fuzz-" + std::to_string(::getpid()) + "-eval_run");
  }
  ~ScratchDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  const fs::path& path() const { return path_; }

 private:
  fs::path path_;
};

bool safe_name(std::string_view s) {
  if (s.empty() || s.size() > 200 || s == "." || s == "..") return false;
  for (char ch : s)
    if (!((ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9') || ch == '.' || ch == '_' ||
          ch == '-'))
      return false;
  return true;
}

void put(const fs::path& p, std::string_view bytes) {
  std::FILE* f = std::fopen(p.c_str(), "wb");
  if (f == nullptr || (!bytes.empty() && std::fwrite(bytes.data(), 1, bytes.size(), f) != bytes.size()) ||
      std::fclose(f) != 0) {
    std::perror(p.c_str());
    std::abort();
  }
}

// Nothing may appear in the scratch directory but OUT/ and MERGED/.
void check_confined(const fs::path& root) {
  for (const auto& e : fs::directory_iterator(root)) {
    const std::string n = e.path().filename().string();
    if (n != "out" && n != "merged") {
      std::fprintf(stderr, "finding: %s written outside the run directories\n", e.path().c_str());
      std::abort();
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const ScratchDir scratch;
  const std::string_view in(reinterpret_cast<const char*>(data), size);
  const fs::path root = scratch.path();
  const fs::path out = root / "out", run = out / "run", merged = root / "merged";
  std::error_code ec;
  fs::remove_all(root, ec);
  fs::create_directories(run / "cells");
  fs::create_directories(run / "ppl");

  constexpr std::string_view kMark = "\n=== ";
  std::size_t pos = in.find(kMark);
  put(run / "run.json", in.substr(0, pos));
  bool latest = false;
  while (pos != std::string_view::npos) {
    const std::size_t name_at = pos + kMark.size();
    const std::size_t eol = in.find('\n', name_at);
    if (eol == std::string_view::npos) break;
    const std::string_view name = in.substr(name_at, eol - name_at);
    pos = in.find(kMark, eol);
    const std::string_view bytes = in.substr(eol + 1, pos == std::string_view::npos ? std::string_view::npos : pos - eol - 1);
    if (name == "LATEST") {
      put(out / "LATEST", bytes);
      latest = true;
    } else if ((name.substr(0, 6) == "cells/" && safe_name(name.substr(6))) ||
               (name.substr(0, 4) == "ppl/" && safe_name(name.substr(4)))) {
      put(run / std::string(name), bytes);
    }
  }
  const fs::path target = latest ? out : run;

  try {
    (void)posenc::eval_resume_plan(target);
  } catch (const posenc::Error& e) {
    posenc::fuzz::refused(e);
  }
  try {
    const fs::path dir = posenc::resolve_run_dir(target);
    if (dir != run && dir != out) {
      std::fprintf(stderr, "finding: %s resolved to %s\n", target.c_str(), dir.c_str());
      std::abort();
    }
    const nlohmann::json summary = posenc::rebuild_eval_outputs(target);
    (void)posenc::format_eval_summary(summary);
    const posenc::JsonDocument doc = posenc::read_json_document(dir / "summary.json");
    (void)posenc::format_eval_summary(doc.root());
  } catch (const posenc::Error& e) {
    posenc::fuzz::refused(e);
  }
  try {
    const std::vector<fs::path> inputs{target};
    const fs::path dir = posenc::merge_eval_runs(inputs, merged);
    if (dir.parent_path() != merged) {
      std::fprintf(stderr, "finding: merge wrote %s\n", dir.c_str());
      std::abort();
    }
  } catch (const posenc::Error& e) {
    posenc::fuzz::refused(e);
  }
  check_confined(root);
  return 0;
}
