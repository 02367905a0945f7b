// posenc — GGUF files (llama.cpp's model format, versions 2 and 3): reader
// and writer.
//
// Layout (little-endian; ggml/docs/gguf.md and ggml/src/gguf.cpp):
//   uint32 magic "GGUF", uint32 version (2 or 3), uint64 tensor_count,
//   uint64 kv_count; kv_count key/value pairs (key: gguf string = uint64
//   length + bytes; uint32 value type; the value); tensor_count tensor infos
//   (name; uint32 n_dims <= 4; n_dims uint64 extents, innermost first; uint32
//   ggml type; uint64 offset relative to the data section); padding to
//   `general.alignment` (default 32); the data section.
// Value types: 0 uint8, 1 int8, 2 uint16, 3 int16, 4 uint32, 5 int32,
//   6 float32, 7 bool, 8 string, 9 array (uint32 element type + uint64 count +
//   elements; arrays of arrays allowed), 10 uint64, 11 int64, 12 float64.
//
// Every count, length and offset is checked against the bytes left in the
// file before anything is allocated or read: a truncated file, a string
// length or element count of 2^60, a tensor past the end of the file, a data
// section the tensor infos do not tile, an extent product that overflows, or
// an unknown tensor type is a CheckpointError naming the file, the field and
// the value. Also
// refused: duplicate keys or tensor names, empty ones, a bool byte other than
// 0/1, a non-uint32 or non-power-of-two `general.alignment`, misaligned
// tensor offsets, rows that are not whole blocks of the type, n_dims > 4,
// arrays nested more than 16 deep, version 1 (32-bit counts), versions above
// 3 and byte-swapped (big-endian) files. Strings are taken as bytes (UTF-8 is
// not validated). The data section must be laid out as llama.cpp's reader
// requires (and its writers, gguf-py's and this one's make it): the tensors
// in the order of their infos, the first at offset 0, each next one where the
// one before it ends padded to the alignment (bytes after the last are
// allowed, as llama.cpp allows them). So a tensor whose type or shape in the
// header differs from what its bytes were written as (a different size) is
// refused, except the last one.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

#include "posenc/io.hpp"

namespace posenc {

/// Tensor element types (ggml_type numbering, ggml.h at llama.cpp de3ff81).
/// Readable and dequantizable: f32, f16, bf16, q8_0, q4_0. The others are
/// known by name and block size: a file holding them parses (its tensor
/// infos, sizes and offsets are validated), and the tensor is refused by name
/// when its data are requested (tensor_data, to_float32, ggml_dequantize:
/// "tensor blk.0.attn_q.weight: ggml type q4_K is not supported"). A number
/// that is no ggml type (e.g. 77, or the removed 4, 5, 31-33, 36-38) is
/// refused when the file is parsed.
enum class GgmlType : uint32_t {
  f32 = 0,
  f16 = 1,
  q4_0 = 2,
  q4_1 = 3,
  q5_0 = 6,
  q5_1 = 7,
  q8_0 = 8,
  q8_1 = 9,
  q2_K = 10,
  q3_K = 11,
  q4_K = 12,
  q5_K = 13,
  q6_K = 14,
  q8_K = 15,
  iq2_xxs = 16,
  iq2_xs = 17,
  iq3_xxs = 18,
  iq1_s = 19,
  iq4_nl = 20,
  iq3_s = 21,
  iq2_s = 22,
  iq4_xs = 23,
  i8 = 24,
  i16 = 25,
  i32 = 26,
  i64 = 27,
  f64 = 28,
  iq1_m = 29,
  bf16 = 30,
  tq1_0 = 34,
  tq2_0 = 35,
  mxfp4 = 39,
  nvfp4 = 40,
  q1_0 = 41,
  q2_0 = 42,
};

/// "f32", "q8_0", "q4_K", ...; "type 77" for an unknown value.
std::string ggml_type_name(uint32_t type);
/// True for the types this reader dequantizes (f32, f16, bf16, q8_0, q4_0).
bool ggml_type_supported(uint32_t type);
/// Elements per block and bytes per block of a supported type (f32: 1, 4;
/// f16/bf16: 1, 2; q8_0: 32, 34; q4_0: 32, 18). Throws CheckpointError for
/// an unsupported type (known or not).
std::pair<int64_t, int64_t> ggml_block_shape(GgmlType type);

/// One metadata value. Arrays hold one vector per element type.
struct GgufValue {
  enum class Type : uint32_t {
    uint8 = 0, int8 = 1, uint16 = 2, int16 = 3, uint32 = 4, int32 = 5, float32 = 6,
    boolean = 7, string = 8, array = 9, uint64 = 10, int64 = 11, float64 = 12
  };
  Type type = Type::uint32;
  Type array_type = Type::uint32;  ///< element type when type == array
  // Scalars: uint8/16/32/64 -> uint64_t, int8/16/32/64 -> int64_t, float32/float64 -> double.
  std::variant<std::monostate, uint64_t, int64_t, double, bool, std::string> scalar;
  // Arrays (element type -> one of these).
  std::vector<int64_t> ints;         ///< every signed/unsigned integer element type, and bool
  std::vector<uint64_t> uints;       ///< uint64 elements (values above INT64_MAX)
  std::vector<double> floats;        ///< float32 / float64 elements
  std::vector<std::string> strings;  ///< string elements
  std::vector<GgufValue> arrays;     ///< arrays of arrays
  uint64_t array_size = 0;           ///< element count when type == array

  bool operator==(const GgufValue&) const = default;
};

std::string_view to_string(GgufValue::Type type);

struct GgufTensorInfo {
  std::string name;
  std::vector<int64_t> ne;  ///< ggml extents, innermost (contiguous) first: a [rows, cols] matrix has ne = {cols, rows}
  GgmlType type = GgmlType::f32;
  uint64_t offset = 0;      ///< relative to the data section
  uint64_t n_bytes = 0;     ///< validated size of the data
  int64_t n_elements() const;
};

/// A parsed GGUF file, memory-mapped. Tensor data stay in the map.
class GgufFile {
 public:
  /// Parses and validates `path` (see the header comment). Throws IoError if
  /// it cannot be read, CheckpointError naming the file and field otherwise.
  static GgufFile open(const std::filesystem::path& path);
  /// Parses bytes already in memory (fuzzing, tests); `bytes` must outlive the result.
  static GgufFile parse(std::span<const std::byte> bytes, std::string_view source);

  uint32_t version() const { return version_; }
  uint64_t alignment() const { return alignment_; }
  /// File offset of the data section (tensor offsets are relative to it).
  uint64_t data_offset() const { return data_offset_; }
  const std::string& source() const { return source_; }
  /// Metadata by key (a key that appears twice is a CheckpointError).
  const std::map<std::string, GgufValue>& metadata() const { return kv_; }
  const std::vector<GgufTensorInfo>& tensors() const { return tensors_; }

  const GgufValue* find(std::string_view key) const;
  /// Typed getters: nullopt when absent; CheckpointError naming the key when
  /// present with the wrong type (any integer type is accepted for integers,
  /// float32/float64 for floats) or out of range of the result.
  std::optional<std::string> get_string(std::string_view key) const;
  std::optional<int64_t> get_int(std::string_view key) const;
  std::optional<double> get_float(std::string_view key) const;
  std::optional<bool> get_bool(std::string_view key) const;
  /// Arrays: CheckpointError when present with another element type.
  const std::vector<std::string>* get_string_array(std::string_view key) const;
  std::optional<std::vector<double>> get_float_array(std::string_view key) const;
  std::optional<std::vector<int64_t>> get_int_array(std::string_view key) const;

  const GgufTensorInfo* find_tensor(std::string_view name) const;
  /// The raw bytes of a tensor (inside the map; n_bytes long). Throws
  /// CheckpointError naming the file, tensor and type if the type is not
  /// supported (ggml_type_supported), InvalidArgument if `t` is not a tensor
  /// of this file.
  std::span<const std::byte> tensor_data(const GgufTensorInfo& t) const;
  /// The tensor's n_elements() values as float32, in ggml order (ne[0]
  /// fastest), dequantized by ggml_dequantize. Errors as tensor_data.
  std::vector<float> to_float32(const GgufTensorInfo& t) const;

 private:
  MappedFile file_;
  std::span<const std::byte> bytes_;
  std::string source_;
  uint32_t version_ = 0;
  uint64_t alignment_ = 32;
  uint64_t data_offset_ = 0;
  std::map<std::string, GgufValue> kv_;
  std::vector<GgufTensorInfo> tensors_;
};

/// Dequantizes `count` elements of `type` from `src` (count a multiple of the
/// block size) into float32 `dst`, exactly as ggml's dequantize_row_* /
/// ggml_fp16_to_fp32 / ggml_bf16_to_fp32 do. Throws CheckpointError for an
/// unsupported type or a size mismatch.
void ggml_dequantize(GgmlType type, std::span<const std::byte> src, std::span<float> dst);

/// Quantizes float32 rows into `type` (f32, f16, bf16, q8_0, q4_0) exactly as
/// ggml's quantize_row_*_ref does (f16: round to nearest even, NaN -> 0x7e00,
/// as ggml_compute_fp32_to_fp16; bf16: ggml_compute_fp32_to_bf16). `src.size()`
/// must be a multiple of the block size. Returns the encoded bytes. Throws
/// InvalidArgument for another type or a size that is not a whole number of blocks.
std::vector<std::byte> ggml_quantize(GgmlType type, std::span<const float> src);

// ---- writing ----------------------------------------------------------------

/// Builder for a GGUF v3 file. Metadata keys are written in insertion order;
/// tensors in insertion order at `general.alignment` boundaries (32 unless a
/// uint32 `general.alignment` key, a power of two, was added), each padded with
/// zeros to the next boundary.
class GgufWriter {
 public:
  void add_string(std::string key, std::string value);
  void add_uint32(std::string key, uint32_t value);
  void add_int32(std::string key, int32_t value);
  void add_float32(std::string key, float value);
  void add_bool(std::string key, bool value);
  void add_string_array(std::string key, std::vector<std::string> values);
  void add_float32_array(std::string key, std::vector<float> values);
  void add_int32_array(std::string key, std::vector<int32_t> values);
  /// Any value, including the types without a typed adder (uint8, int64,
  /// float64, arrays of arrays, ...). Throws InvalidArgument if the value is
  /// inconsistent (array_size or array_type not matching the filled vector,
  /// an element out of range of its type, arrays nested deeper than the
  /// reader accepts).
  void add_value(std::string key, GgufValue value);
  /// A tensor with ggml extents `ne` (innermost first) already encoded in
  /// `type` (see ggml_quantize; any known ggml type is accepted). Throws
  /// InvalidArgument if the byte size does not match or the name is used twice.
  /// Keys, too, are refused when empty or used twice.
  void add_tensor(std::string name, std::vector<int64_t> ne, GgmlType type, std::vector<std::byte> data);
  /// Writes the file atomically (write_file_atomic). Throws IoError.
  void write(const std::filesystem::path& path) const;
  /// The file's bytes.
  std::string serialize() const;

 private:
  struct Kv {
    std::string key;
    GgufValue value;
  };
  struct Tensor {
    std::string name;
    std::vector<int64_t> ne;
    GgmlType type;
    std::vector<std::byte> data;
  };
  std::vector<Kv> kv_;
  std::vector<Tensor> tensors_;
};

}  // namespace posenc
