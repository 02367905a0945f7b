// libFuzzer harness: TensorDump::parse_npz on the input bytes (libzip's reading of
// the archive, the checks of member names and declared sizes against the limit and
// the .npy headers, inflating, and each member's .npy parse). When they parse, every
// array holds product(shape) values under a unique name. posenc::Error is the
// expected outcome for bad input; anything else (another exception, a crash, a
// sanitizer report, a leak) is a finding.
#include <cstddef>
#include <cstdint>
#include <set>
#include <span>
#include <string>

#include "fuzz_support.hpp"
#include "posenc/error.hpp"
#include "posenc/tensor_dump.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    const auto dump = posenc::TensorDump::parse_npz(std::as_bytes(std::span(data, size)), "fuzz.npz");
    std::set<std::string> names;
    for (const auto& a : dump.arrays()) {
      if (!names.insert(a.name).second) __builtin_trap();
      if (dump.find(a.name) != &a) __builtin_trap();
      if (a.n_elements() < 0 || static_cast<std::size_t>(a.n_elements()) != a.values.size()) __builtin_trap();
    }
  } catch (const posenc::Error& e) {
    posenc::fuzz::refused(e);
  }
  return 0;
}
