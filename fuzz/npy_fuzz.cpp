// libFuzzer harness: TensorDump::parse_npy on the input bytes (the .npy reader of
// posenc verify's dumps: magic, version, header length, the header dict, the data).
// When they parse, the array must hold product(shape) values, and encode_npy of it
// must parse back to the same values (NaN as NaN): a file's values always fit its
// dtype. posenc::Error from parsing is the expected outcome for bad input; anything
// else (another exception, an Error from the round trip, a crash, a sanitizer
// report) is a finding.
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>

#include "fuzz_support.hpp"
#include "posenc/error.hpp"
#include "posenc/tensor_dump.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  posenc::TensorDump dump;
  try {
    dump = posenc::TensorDump::parse_npy(std::as_bytes(std::span(data, size)), "x", "fuzz.npy");
  } catch (const posenc::Error& e) {
    posenc::fuzz::refused(e);
    return 0;
  }
  if (dump.arrays().size() != 1) __builtin_trap();
  const auto& a = dump.arrays()[0];
  if (a.n_elements() < 0 || static_cast<std::size_t>(a.n_elements()) != a.values.size()) __builtin_trap();
  const auto again = posenc::TensorDump::parse_npy(posenc::encode_npy(a), "x", "fuzz-reencoded.npy");
  const auto& b = again.arrays()[0];
  if (b.dtype != a.dtype || b.shape != a.shape || b.values.size() != a.values.size()) __builtin_trap();
  for (std::size_t i = 0; i < a.values.size(); ++i)
    if (std::isnan(a.values[i]) ? !std::isnan(b.values[i]) : a.values[i] != b.values[i]) __builtin_trap();
  return 0;
}
