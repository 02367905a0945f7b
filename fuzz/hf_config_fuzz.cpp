// libFuzzer harness for the Hugging Face directory loader with the input as
// its config.json (posenc::Model::load of a directory: parse_decoder_spec,
// the shape checks against the safetensors, RoPE and sliding-window setup).
//
// At start-up it builds fixed directories of tiny models
// (tests/model/formats/tiny_models.hpp: plain Llama, Qwen2 q/k/v biases, Qwen3
// q/k norms, every bias + untied output) in a scratch directory; each input is
// written as the config.json of every one and loaded there. A directory that
// loads runs one forward of 2 tokens. posenc::Error is the expected outcome for
// bad input; any other exception, a crash or a sanitizer report is a finding.
//
// Seed corpus: fuzz/corpus/hf_config/ (tiny_models.hpp hf_config_seeds();
// HfConfigFuzzCorpus.SeedsAreCurrent with POSENC_WRITE_FUZZ_CORPUS=1 writes them).
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <vector>

#include "../tests/model/formats/tiny_models.hpp"
#include "fuzz_support.hpp"
#include "posenc/error.hpp"
#include "posenc/io.hpp"
#include "posenc/model.hpp"

namespace {

namespace fs = std::filesystem;

class Directories {
 public:
  Directories() {
    std::error_code ec;
    const fs::path base = fs::is_directory("/dev/shm", ec) ? fs::path("/dev/shm") : fs::temp_directory_path();
    root_ = base / ("posenc-fuzz-hf-" + std::to_string(::getpid()));
    const auto parts = posenc::test::tiny::hf_fuzz_parts();
    for (std::size_t i = 0; i < parts.size(); ++i) {
      const fs::path d = root_ / std::to_string(i);
      fs::create_directories(d);
      posenc::write_file_atomic(d / "model.safetensors",
                                posenc::test::tiny::safetensors_bytes(posenc::test::tiny::hf_tensors(parts[i])));
      dirs_.push_back(d);
    }
  }
  ~Directories() {
    std::error_code ec;
    fs::remove_all(root_, ec);
  }
  const std::vector<fs::path>& dirs() const { return dirs_; }

 private:
  fs::path root_;
  std::vector<fs::path> dirs_;
};

void write(const fs::path& p, const uint8_t* data, std::size_t size) {
  std::FILE* f = std::fopen(p.c_str(), "wb");
  if (f == nullptr || (size > 0 && std::fwrite(data, 1, size, f) != size) || std::fclose(f) != 0) {
    std::perror(p.c_str());
    std::abort();
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const Directories dirs;
  for (const auto& d : dirs.dirs()) {
    write(d / "config.json", data, size);
    try {
      const posenc::Model m = posenc::Model::load(d);
      const auto& c = m.config();
      const std::vector<float> logits = m.score_window(std::vector<int32_t>{0, c.vocab_size - 1});
      if (logits.size() != 2 * static_cast<std::size_t>(c.vocab_size)) std::abort();
    } catch (const posenc::Error& e) {
      posenc::fuzz::refused(e);
    }
  }
  return 0;
}
