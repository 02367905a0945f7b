// libFuzzer harness: SafetensorsFile::parse on the input bytes; when they parse,
// every tensor of a dtype the reader converts is read as float32 (up to a size
// cap, so the harness does not spend its time copying). posenc::Error is the
// expected outcome for bad input; anything else (another exception, a crash, a
// sanitizer report) is a finding.
#include <cstddef>
#include <cstdint>
#include <span>

#include "fuzz_support.hpp"
#include "posenc/error.hpp"
#include "posenc/safetensors.hpp"

namespace {
constexpr int64_t kMaxElements = int64_t{1} << 20;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    const auto f = posenc::SafetensorsFile::parse(std::as_bytes(std::span(data, size)), "fuzz.safetensors");
    for (const auto& t : f.tensors()) {
      if (f.find(t.name) != &t) __builtin_trap();  // names are unique and sorted
      const auto bytes = f.data(t);
      if (bytes.size() != t.end - t.begin) __builtin_trap();
      if (t.n_elements() > kMaxElements) continue;
      if (t.dtype == posenc::SafetensorsDtype::F32 || t.dtype == posenc::SafetensorsDtype::F16 ||
          t.dtype == posenc::SafetensorsDtype::BF16) {
        const auto v = f.to_float32(t);
        if (static_cast<int64_t>(v.size()) != t.n_elements()) __builtin_trap();
      }
    }
  } catch (const posenc::Error& e) {
    posenc::fuzz::refused(e);
  }
  return 0;
}
