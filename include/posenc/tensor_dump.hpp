// posenc — tensors dumped by another engine for `posenc verify`: .npy, .npz
// and safetensors files, read into named arrays; and .npy/.npz writers.
//
// Formats:
//  - .npy: numpy's format (numpy/lib/format.py, NEP 1): magic "\x93NUMPY",
//    version 1.0, 2.0 or 3.0, a little-endian header length (uint16 for 1.0,
//    uint32 otherwise), a Python dict literal {'descr': ..., 'fortran_order':
//    ..., 'shape': (...)} padded with spaces and a newline, then the data.
//  - .npz: a zip archive of .npy members (numpy.savez: stored; savez_compressed:
//    deflate), member "q.npy" is array "q". Read with libzip.
//  - safetensors: through SafetensorsFile (include/posenc/safetensors.hpp).
// Every size is checked against the file before anything is allocated or
// read: a header, shape or member that does not fit is a DumpError naming the
// file, the array and the value.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace posenc {

/// The most uncompressed bytes an .npz archive's members may declare, each and
/// all together (1 GiB): checked against the zip directory before a member is
/// read, so a deflate bomb is refused, not inflated. Every member must also
/// hold exactly the bytes its declared size and its .npy header state.
inline constexpr uint64_t kMaxDumpMemberBytes = uint64_t{1} << 30;

/// Element types a dump may hold (as stored in the file).
enum class DumpDtype { f64, f32, f16, bf16, i64, i32, i16, i8, u8, boolean };
std::string_view to_string(DumpDtype dtype);
/// True for f64, f32, f16, bf16.
bool is_floating(DumpDtype dtype);

/// One named array, row-major (C order; Fortran-order .npy arrays are
/// reordered into C order on reading).
///  - values: every element widened exactly to double (f16/bf16/f32 widen
///    exactly; an integer beyond 2^53 in magnitude is a DumpError).
struct DumpArray {
  std::string name;             ///< npz member without ".npy"; safetensors tensor name; a lone .npy: the file stem
  DumpDtype dtype = DumpDtype::f32;
  std::vector<int64_t> shape;   ///< empty for a 0-d array
  std::vector<double> values;   ///< product(shape) elements
  int64_t n_elements() const;
};

/// The arrays of one or more dump files.
class TensorDump {
 public:
  /// Reads a file by its content (not its extension): "\x93NUMPY" is .npy,
  /// "PK\x03\x04" / "PK\x05\x06" an .npz archive, anything else must be
  /// safetensors. Throws IoError if unreadable, DumpError if malformed.
  static TensorDump open(const std::filesystem::path& path);
  /// Parsers on bytes in memory (fuzzing, tests). `name` is the array's name;
  /// `source` names the file in messages.
  static TensorDump parse_npy(std::span<const std::byte> bytes, std::string_view name, std::string_view source);
  static TensorDump parse_npz(std::span<const std::byte> bytes, std::string_view source);
  static TensorDump parse_safetensors(std::span<const std::byte> bytes, std::string_view source);

  /// Adds the arrays of `other` (e.g. q.npy, q_rope.npy and position_ids.npy
  /// given separately). Throws DumpError if a name is in both.
  void merge(TensorDump other);

  /// "dump.npz" or "q.npy + q_rope.npy + position_ids.npy".
  const std::string& source() const { return source_; }
  /// In file order (npz member order, safetensors name order).
  const std::vector<DumpArray>& arrays() const { return arrays_; }
  const DumpArray* find(std::string_view name) const;
  /// Throws DumpError "<source>: no array '<name>' (has: a, b, c)".
  const DumpArray& get(std::string_view name) const;

 private:
  std::string source_;
  std::vector<DumpArray> arrays_;
};

/// The bytes of a .npy file (version 1.0, little-endian, C order) holding
/// `array` in its dtype (values rounded to nearest even for f16/f32), with
/// numpy 1.24's header byte for byte (np.save of the same array gives the same
/// file).
/// numpy has no bfloat16, so a bf16 array is an InvalidArgument here: write
/// it with write_dump_safetensors. Also InvalidArgument: values that do not
/// fit an integer dtype, or a size that differs from product(shape).
std::vector<std::byte> encode_npy(const DumpArray& array);
/// Writes .npy / .npz (stored members, as numpy.savez) atomically. The npz
/// members are "<name>.npy" in the order given, time-stamped 2000-01-01 so the
/// same arrays give the same bytes; duplicate names are an InvalidArgument.
void write_npy(const std::filesystem::path& path, const DumpArray& array);
void write_npz(const std::filesystem::path& path, std::span<const DumpArray> arrays);
/// Writes a safetensors file of the arrays (any dtype above; boolean as BOOL),
/// atomically: tensors in name order, the header padded with spaces to 8 bytes.
/// f16/bf16 values are rounded to nearest even (directly from double, not
/// through a float32 rounding). InvalidArgument as for encode_npy, and for
/// duplicate names or an array named "__metadata__".
void write_dump_safetensors(const std::filesystem::path& path, std::span<const DumpArray> arrays);

}  // namespace posenc
