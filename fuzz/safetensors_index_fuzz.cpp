// libFuzzer harness: SafetensorsCheckpoint::open on a directory whose
// model.safetensors.index.json is the input, next to two small valid shards
// (model-00001-of-00002.safetensors with tensors a, b; model-00002-of-00002
// with c). Exercises the index checks: JSON shape, shard names that would leave
// the directory, tensors missing from or duplicated across shards.
// posenc::Error is the expected outcome for bad input; anything else is a finding.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>

#include "fuzz_support.hpp"
#include "posenc/error.hpp"
#include "posenc/safetensors.hpp"

namespace {

std::string shard(const std::string& header, std::size_t data_bytes) {
  std::string out(8, '\0');
  const uint64_t n = header.size();
  std::memcpy(out.data(), &n, 8);
  return out + header + std::string(data_bytes, '\x3f');
}

struct Dir {
  std::filesystem::path path;
  Dir() {
    std::error_code ec;
    const std::filesystem::path base =
        std::filesystem::is_directory("/dev/shm", ec) ? "/dev/shm" : std::filesystem::temp_directory_path();
    path = base / ("posenc-fuzz-index-" + std::to_string(::getpid()));
    std::filesystem::create_directories(path);
    std::ofstream(path / "model-00001-of-00002.safetensors", std::ios::binary)
        << shard(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                 R"("b":{"dtype":"BF16","shape":[2,2],"data_offsets":[8,16]}})",
                 16);
    std::ofstream(path / "model-00002-of-00002.safetensors", std::ios::binary)
        << shard(R"({"__metadata__":{"format":"pt"},"c":{"dtype":"F16","shape":[3],"data_offsets":[0,6]}})", 6);
  }
  ~Dir() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const Dir dir;
  {
    std::ofstream out(dir.path / "model.safetensors.index.json", std::ios::binary | std::ios::trunc);
    out.write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(size));
  }
  try {
    const auto ck = posenc::SafetensorsCheckpoint::open(dir.path);
    for (const auto& name : ck.names()) {
      const auto e = ck.find(name);
      if (e.file == nullptr || e.tensor == nullptr || e.tensor->name != name) __builtin_trap();
      e.file->to_float32(*e.tensor);
    }
    (void)ck.describe();
  } catch (const posenc::Error& e) {
    posenc::fuzz::refused(e);
  }
  return 0;
}
