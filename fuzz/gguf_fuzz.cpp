// libFuzzer harness for the GGUF reader (posenc::GgufFile::parse).
//
// Parses the input; for a file that parses, walks every metadata value through
// the typed getters, dequantizes the supported tensors (up to a size cap) and
// asks for the unsupported ones (which must be refused with a CheckpointError),
// then writes the parsed metadata and tensors back with GgufWriter and checks
// that the result parses to the same metadata. posenc::Error is the expected
// outcome for bad input; any other exception, a crash or a sanitizer report is a finding.
//
// Seed corpus: fuzz/corpus/gguf/ (made by GgufWriter; see
// tests/model/formats/gguf_seed_files.hpp, POSENC_WRITE_FUZZ_CORPUS=1).
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <span>
#include <vector>

#include "posenc/error.hpp"
#include "posenc/gguf.hpp"

namespace {

constexpr int64_t kMaxDequantElements = int64_t{1} << 22;  // per input: bounds the time spent on one file

void walk(const posenc::GgufFile& f) {
  for (const auto& [key, v] : f.metadata()) {
    try {
      (void)f.get_string(key);
    } catch (const posenc::CheckpointError&) {
    }
    try {
      (void)f.get_int(key);
    } catch (const posenc::CheckpointError&) {
    }
    try {
      (void)f.get_float(key);
    } catch (const posenc::CheckpointError&) {
    }
    try {
      (void)f.get_bool(key);
    } catch (const posenc::CheckpointError&) {
    }
    try {
      (void)f.get_string_array(key);
    } catch (const posenc::CheckpointError&) {
    }
    try {
      (void)f.get_float_array(key);
    } catch (const posenc::CheckpointError&) {
    }
    try {
      (void)f.get_int_array(key);
    } catch (const posenc::CheckpointError&) {
    }
    if (v.type == posenc::GgufValue::Type::array && v.array_type != posenc::GgufValue::Type::array &&
        v.arrays.size() != 0)
      std::abort();  // only arrays of arrays hold nested values
  }
  int64_t budget = kMaxDequantElements;
  for (const auto& t : f.tensors()) {
    if (f.find_tensor(t.name) != &t) std::abort();
    if (!posenc::ggml_type_supported(static_cast<uint32_t>(t.type))) {
      bool refused = false;
      try {
        (void)f.tensor_data(t);
      } catch (const posenc::CheckpointError&) {
        refused = true;
      }
      if (!refused) std::abort();
      continue;
    }
    const auto data = f.tensor_data(t);
    if (data.size() != t.n_bytes) std::abort();
    if (t.n_elements() > budget) continue;
    budget -= t.n_elements();
    const std::vector<float> x = f.to_float32(t);
    if (static_cast<int64_t>(x.size()) != t.n_elements()) std::abort();
  }
}

void rewrite(const posenc::GgufFile& f) {
  posenc::GgufWriter w;
  for (const auto& [key, v] : f.metadata()) w.add_value(key, v);
  int64_t budget = kMaxDequantElements;
  for (const auto& t : f.tensors()) {
    if (!posenc::ggml_type_supported(static_cast<uint32_t>(t.type)) || t.n_elements() > budget) return;
    budget -= t.n_elements();
    const auto d = f.tensor_data(t);
    w.add_tensor(t.name, t.ne, t.type, std::vector<std::byte>(d.begin(), d.end()));
  }
  const std::string bytes = w.serialize();
  const auto g = posenc::GgufFile::parse(std::as_bytes(std::span(bytes.data(), bytes.size())), "rewritten");
  if (!(g.metadata() == f.metadata())) {
    // NaN float values compare unequal to themselves; anything else is a finding
    bool has_nan = false;
    for (const auto& [k, v] : f.metadata()) has_nan |= !(v == v);
    if (!has_nan) std::abort();
  }
  if (g.tensors().size() != f.tensors().size()) std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::span<const std::byte> bytes(reinterpret_cast<const std::byte*>(data), size);
  try {
    const posenc::GgufFile f = posenc::GgufFile::parse(bytes, "fuzz.gguf");
    walk(f);
    try {
      rewrite(f);  // what the reader accepts, the writer must write and the reader read back
    } catch (const posenc::Error&) {
      std::abort();
    }
  } catch (const posenc::Error&) {
  }
  return 0;
}
