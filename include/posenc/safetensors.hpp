// posenc — safetensors files (Hugging Face's tensor format) and sharded
// checkpoints (model.safetensors.index.json).
//
// Layout (huggingface/safetensors, docs "format"): uint64 little-endian N,
// then N bytes of UTF-8 JSON: {"__metadata__": {str: str} (optional),
// "<name>": {"dtype": "F32"|"F16"|"BF16"|..., "shape": [...],
// "data_offsets": [begin, end]}, ...}, then the data section; offsets are
// relative to its start, byte ranges must be in the file, must not overlap,
// and end - begin must equal product(shape) * dtype size.
//
// Everything is checked against the file size before any tensor byte is read:
// N past the end of the file (or above 100 MB, the format's own limit),
// malformed JSON, a missing or mistyped field, an unknown dtype, a shape
// whose product overflows, offsets out of the file, overlapping ranges, or a
// byte size that the dtype and shape do not fit is a CheckpointError naming
// the file, the tensor and the value.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <map>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "posenc/float16.hpp"  // f16_to_f32, bf16_to_f32 (declared there; kept reachable from here)
#include "posenc/io.hpp"

namespace posenc {

/// safetensors dtypes. Dequantizable to float32 by this reader: F32, F16, BF16.
enum class SafetensorsDtype { F64, F32, F16, BF16, I64, I32, I16, I8, U8, BOOL, F8_E4M3, F8_E5M2 };
std::string_view to_string(SafetensorsDtype dtype);
/// Bytes per element.
int safetensors_dtype_size(SafetensorsDtype dtype);

struct SafetensorsTensor {
  std::string name;
  SafetensorsDtype dtype = SafetensorsDtype::F32;
  std::vector<int64_t> shape;     ///< row-major (PyTorch order: [out, in] for nn.Linear weights)
  uint64_t begin = 0, end = 0;    ///< byte range relative to the data section
  int64_t n_elements() const;
};

/// One memory-mapped .safetensors file.
class SafetensorsFile {
 public:
  /// Throws IoError if unreadable, CheckpointError as described above.
  static SafetensorsFile open(const std::filesystem::path& path);
  /// Parses bytes already in memory (fuzzing, tests); `bytes` must outlive the result.
  static SafetensorsFile parse(std::span<const std::byte> bytes, std::string_view source);

  const std::string& source() const { return source_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  /// Sorted by name.
  const std::vector<SafetensorsTensor>& tensors() const { return tensors_; }
  const SafetensorsTensor* find(std::string_view name) const;
  std::span<const std::byte> data(const SafetensorsTensor& t) const;
  /// The tensor as float32 (F32 copied, F16/BF16 converted exactly; other
  /// dtypes are a CheckpointError naming the tensor and dtype).
  std::vector<float> to_float32(const SafetensorsTensor& t) const;

 private:
  MappedFile file_;
  std::span<const std::byte> bytes_;
  std::string source_;
  uint64_t data_start_ = 0;
  std::map<std::string, std::string> metadata_;
  std::vector<SafetensorsTensor> tensors_;
};

/// A checkpoint as one or more safetensors files: `model.safetensors`, or the
/// shards a `model.safetensors.index.json` ({"metadata": {...}, "weight_map":
/// {tensor: shard file}}) names. Every tensor the index names must be in its
/// shard, and shard file names must stay inside the directory.
class SafetensorsCheckpoint {
 public:
  /// `dir`: a directory with model.safetensors.index.json or model.safetensors
  /// (or a path to a single .safetensors file). Throws IoError / CheckpointError.
  static SafetensorsCheckpoint open(const std::filesystem::path& dir);

  struct Entry {
    const SafetensorsFile* file;
    const SafetensorsTensor* tensor;
  };
  /// nullptr-file entry when absent.
  Entry find(std::string_view name) const;
  std::vector<std::string> names() const;
  const std::vector<SafetensorsFile>& files() const { return files_; }
  /// Description for messages: "model.safetensors" or "3 shards (model-0000x-of-00003.safetensors)".
  std::string describe() const;

 private:
  std::vector<SafetensorsFile> files_;
  std::map<std::string, std::size_t, std::less<>> where_;  // tensor -> file index
};

}  // namespace posenc
