// Shared helpers of the libFuzzer harnesses (fuzz/*_fuzz.cpp).
#pragma once

#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <string_view>

#include "posenc/error.hpp"

namespace posenc::fuzz {

/// Called with each swallowed posenc::Error: prints it when POSENC_FUZZ_VERBOSE
/// is set (to see why a seed is refused: POSENC_FUZZ_VERBOSE=1 ./x_fuzz seed).
inline void refused(const posenc::Error& e) {
  static const bool verbose = std::getenv("POSENC_FUZZ_VERBOSE") != nullptr;
  if (verbose) std::fprintf(stderr, "refused: %s\n", e.what());
}

/// A per-process scratch file for parsers that take a path: the input bytes
/// are written to it before each call. In /dev/shm when there is one (no disk
/// writes), removed at exit.
class ScratchFile {
 public:
  explicit ScratchFile(std::string_view name) {
    std::error_code ec;
    std::filesystem::path dir = std::filesystem::is_directory("/dev/shm", ec) ? std::filesystem::path("/dev/shm")
                                                                                : std::filesystem::temp_directory_path();
    path_ = dir / ("posenc-fuzz-" + std::to_string(::getpid()) + "-" + std::string(name));
  }
  ~ScratchFile() {
    std::error_code ec;
    std::filesystem::remove(path_, ec);
  }
  /// Replaces the file's contents with `size` bytes at `data`; aborts if it cannot (not a finding to swallow).
  const std::filesystem::path& write(const uint8_t* data, std::size_t size) const {
    std::FILE* f = std::fopen(path_.c_str(), "wb");
    if (f == nullptr || (size > 0 && std::fwrite(data, 1, size, f) != size) || std::fclose(f) != 0) {
      std::perror(path_.c_str());
      std::abort();
    }
    return path_;
  }
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
};

}  // namespace posenc::fuzz
