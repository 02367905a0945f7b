// GGUF files (see include/posenc/gguf.hpp): the ggml type table, the reader
// (every count, length and offset checked against the bytes left before it is
// used) and the v3 writer.
#include "posenc/gguf.hpp"

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <unordered_set>

#include <fmt/format.h>

#include "core/text.hpp"
#include "model/formats/gguf_quant.hpp"
#include "posenc/error.hpp"

namespace posenc {

namespace {

constexpr uint64_t kDefaultAlignment = 32;
constexpr std::string_view kAlignmentKey = "general.alignment";
/// Arrays of arrays deeper than this are refused (the format sets no limit;
/// this keeps the reader's recursion bounded).
constexpr int kMaxArrayDepth = 16;
constexpr uint32_t kMaxDims = 4;

struct TypeTraits {
  std::string_view name;
  int64_t block = 0;        ///< elements per block; 0 = not a ggml type
  int64_t block_bytes = 0;  ///< bytes per block
};

/// ggml_type -> name and block shape (ggml.c type_traits at llama.cpp de3ff81).
/// Numbers 4, 5 (q4_2, q4_3), 31-33 and 36-38 (removed repacked layouts) are not types.
constexpr std::array<TypeTraits, 43> kTypes = [] {
  std::array<TypeTraits, 43> t{};
  t[0] = {"f32", 1, 4};
  t[1] = {"f16", 1, 2};
  t[2] = {"q4_0", 32, 18};
  t[3] = {"q4_1", 32, 20};
  t[6] = {"q5_0", 32, 22};
  t[7] = {"q5_1", 32, 24};
  t[8] = {"q8_0", 32, 34};
  t[9] = {"q8_1", 32, 36};
  t[10] = {"q2_K", 256, 84};
  t[11] = {"q3_K", 256, 110};
  t[12] = {"q4_K", 256, 144};
  t[13] = {"q5_K", 256, 176};
  t[14] = {"q6_K", 256, 210};
  t[15] = {"q8_K", 256, 292};
  t[16] = {"iq2_xxs", 256, 66};
  t[17] = {"iq2_xs", 256, 74};
  t[18] = {"iq3_xxs", 256, 98};
  t[19] = {"iq1_s", 256, 50};
  t[20] = {"iq4_nl", 32, 18};
  t[21] = {"iq3_s", 256, 110};
  t[22] = {"iq2_s", 256, 82};
  t[23] = {"iq4_xs", 256, 136};
  t[24] = {"i8", 1, 1};
  t[25] = {"i16", 1, 2};
  t[26] = {"i32", 1, 4};
  t[27] = {"i64", 1, 8};
  t[28] = {"f64", 1, 8};
  t[29] = {"iq1_m", 256, 56};
  t[30] = {"bf16", 1, 2};
  t[34] = {"tq1_0", 256, 54};
  t[35] = {"tq2_0", 256, 66};
  t[39] = {"mxfp4", 32, 17};
  t[40] = {"nvfp4", 64, 36};
  t[41] = {"q1_0", 128, 18};
  t[42] = {"q2_0", 64, 18};
  return t;
}();

const TypeTraits* type_traits(uint32_t type) {
  if (type >= kTypes.size() || kTypes[type].block == 0) return nullptr;
  return &kTypes[type];
}

constexpr std::string_view kSupported = "supported: f32, f16, bf16, q8_0, q4_0";

using VT = GgufValue::Type;
constexpr uint32_t kMaxValueType = 12;

/// Bytes a value of this type takes in the file at least (string: its length;
/// array: element type + count).
uint64_t min_value_bytes(VT t) {
  switch (t) {
    case VT::uint8: case VT::int8: case VT::boolean: return 1;
    case VT::uint16: case VT::int16: return 2;
    case VT::uint32: case VT::int32: case VT::float32: return 4;
    case VT::uint64: case VT::int64: case VT::float64: case VT::string: return 8;
    case VT::array: return 12;
  }
  return 1;
}

bool is_integer(VT t) {
  switch (t) {
    case VT::uint8: case VT::int8: case VT::uint16: case VT::int16: case VT::uint32: case VT::int32:
    case VT::uint64: case VT::int64: return true;
    default: return false;
  }
}
bool is_float(VT t) { return t == VT::float32 || t == VT::float64; }

/// Text from the file (a name, a key, the magic), quoted for a message (detail::escaped: a malformed name is
/// shown whole and cannot drive the terminal).
std::string printable(std::string_view text) {
  std::string s(1, '\'');  // appended, not "'" + ... + "'" (GCC 12 warns -Wrestrict on that, wrongly)
  s += detail::escaped(text);
  s += '\'';
  return s;
}

/// A byte of a GGUF key: printable ASCII, 0x20-0x7e.
bool is_key_byte(char c) { return c >= 0x20 && c <= 0x7e; }
/// The GGUF specification's key: printable ASCII, at most 65,535 bytes (empty is refused apart).
bool is_gguf_key_text(std::string_view key) {
  return key.size() <= 65535 && std::all_of(key.begin(), key.end(), is_key_byte);
}

/// printable() of the first 64 bytes of a key that is not one, "..." after it when there were more.
std::string printable_start(std::string_view text) {
  return printable(text.substr(0, 64)) + (text.size() > 64 ? "..." : "");
}

bool mul_overflows(uint64_t a, uint64_t b, uint64_t* out) { return __builtin_mul_overflow(a, b, out); }

// ---- reading --------------------------------------------------------------

class GgufReader {
 public:
  GgufReader(std::span<const std::byte> bytes, std::string_view source) : b_(bytes), src_(source) {}

  uint64_t pos() const { return pos_; }
  uint64_t left() const { return b_.size() - pos_; }
  uint64_t size() const { return b_.size(); }
  const std::string_view& source() const { return src_; }

  template <class V>
  [[noreturn]] void fail(std::string_view field, std::string_view reason, const V& value) const {
    throw CheckpointError(fmt::format("{}: {}: {} (got {})", src_, field, reason, value));
  }

  void need(uint64_t n, std::string_view field) const {
    if (n > left())
      fail(field, fmt::format("truncated file: {} bytes needed at offset {}, {} left", n, pos_, left()),
           fmt::format("a file of {} bytes", b_.size()));
  }
  template <class T>
  T scalar(std::string_view field) {
    need(sizeof(T), field);
    T v;
    std::memcpy(&v, b_.data() + pos_, sizeof(T));
    pos_ += sizeof(T);
    return v;
  }
  uint32_t u32(std::string_view field) { return scalar<uint32_t>(field); }
  uint64_t u64(std::string_view field) { return scalar<uint64_t>(field); }
  std::span<const std::byte> bytes(uint64_t n) {
    auto s = b_.subspan(pos_, n);
    pos_ += n;
    return s;
  }
  std::string string(std::string_view field) {
    const uint64_t start = pos_;
    const uint64_t n = u64(field);
    if (n > left())
      fail(field,
           fmt::format("string length at offset {} exceeds the {} bytes left in the file", start, left()), n);
    auto s = bytes(n);
    return {reinterpret_cast<const char*>(s.data()), s.size()};
  }

  GgufValue value(VT type, const std::string& field, int depth) {
    GgufValue v;
    v.type = type;
    switch (type) {
      case VT::uint8: v.scalar = uint64_t{scalar<uint8_t>(field)}; break;
      case VT::int8: v.scalar = int64_t{scalar<int8_t>(field)}; break;
      case VT::uint16: v.scalar = uint64_t{scalar<uint16_t>(field)}; break;
      case VT::int16: v.scalar = int64_t{scalar<int16_t>(field)}; break;
      case VT::uint32: v.scalar = uint64_t{scalar<uint32_t>(field)}; break;
      case VT::int32: v.scalar = int64_t{scalar<int32_t>(field)}; break;
      case VT::uint64: v.scalar = scalar<uint64_t>(field); break;
      case VT::int64: v.scalar = scalar<int64_t>(field); break;
      case VT::float32: v.scalar = double{scalar<float>(field)}; break;
      case VT::float64: v.scalar = scalar<double>(field); break;
      case VT::boolean: v.scalar = boolean(field); break;
      case VT::string: v.scalar = string(field); break;
      case VT::array: array(v, field, depth + 1); break;
    }
    return v;
  }

 private:
  bool boolean(std::string_view field) {
    const uint64_t at = pos_;
    const auto x = scalar<uint8_t>(field);
    if (x > 1) fail(field, fmt::format("a bool must be 0 or 1 (byte at offset {})", at), unsigned{x});
    return x == 1;
  }

  VT value_type(std::string_view field) {
    const uint64_t at = pos_;
    const uint32_t t = u32(field);
    if (t > kMaxValueType) fail(field, fmt::format("unknown GGUF value type at offset {}", at), t);
    return static_cast<VT>(t);
  }

  void array(GgufValue& v, const std::string& field, int depth) {
    if (depth > kMaxArrayDepth)
      fail(field, fmt::format("arrays nested more than {} deep are not supported", kMaxArrayDepth), depth);
    const VT et = value_type(field + " element type");
    const uint64_t at = pos_;
    const uint64_t n = u64(field + " count");
    const uint64_t min = min_value_bytes(et);
    if (n > left() / min)
      fail(field,
           fmt::format("array count at offset {} exceeds what the {} bytes left in the file can hold ({} elements "
                       "take at least {} bytes each)",
                       at, left(), to_string(et), min),
           n);
    v.array_type = et;
    v.array_size = n;
    if (et == VT::string) {
      for (uint64_t i = 0; i < n; ++i) {
        // fast path without naming the element; string() names it when the element is bad
        if (left() >= 8) {
          uint64_t len;
          std::memcpy(&len, b_.data() + pos_, 8);
          if (len <= left() - 8) {
            pos_ += 8;
            const auto s = bytes(len);
            v.strings.emplace_back(reinterpret_cast<const char*>(s.data()), s.size());
            continue;
          }
        }
        (void)string(fmt::format("{}[{}]", field, i));  // throws
      }
      return;
    }
    if (et == VT::array) {
      for (uint64_t i = 0; i < n; ++i) {
        const std::string f = fmt::format("{}[{}]", field, i);
        v.arrays.push_back(value(VT::array, f, depth));
      }
      return;
    }
    // fixed-size elements: n * min <= left() was checked above, so reserving is bounded by the file
    if (et == VT::uint64) {
      v.uints.reserve(n);
      for (uint64_t i = 0; i < n; ++i) v.uints.push_back(scalar<uint64_t>(field));
    } else if (is_float(et)) {
      v.floats.reserve(n);
      for (uint64_t i = 0; i < n; ++i)
        v.floats.push_back(et == VT::float32 ? double{scalar<float>(field)} : scalar<double>(field));
    } else {
      v.ints.reserve(n);
      for (uint64_t i = 0; i < n; ++i) v.ints.push_back(small_int(et, field, i));
    }
  }

  /// One element of an integer or bool array (not uint64) as int64.
  int64_t small_int(VT et, const std::string& field, uint64_t i) {
    switch (et) {
      case VT::uint8: return scalar<uint8_t>(field);
      case VT::int8: return scalar<int8_t>(field);
      case VT::uint16: return scalar<uint16_t>(field);
      case VT::int16: return scalar<int16_t>(field);
      case VT::uint32: return scalar<uint32_t>(field);
      case VT::int32: return scalar<int32_t>(field);
      case VT::int64: return scalar<int64_t>(field);
      default: {
        const auto x = static_cast<uint8_t>(b_[pos_]);  // in the file: n * 1 <= left() was checked
        if (x > 1) return boolean(fmt::format("{}[{}]", field, i));  // throws, naming the element
        ++pos_;
        return x;
      }
    }
  }

  std::span<const std::byte> b_;
  std::string_view src_;
  uint64_t pos_ = 0;
};

// ---- writing --------------------------------------------------------------

void put(std::string& out, const void* p, std::size_t n) { out.append(static_cast<const char*>(p), n); }
template <class T>
void put(std::string& out, T v) {
  put(out, &v, sizeof v);
}
void put_string(std::string& out, std::string_view s) {
  put<uint64_t>(out, s.size());
  out.append(s);
}
void pad_to(std::string& out, uint64_t alignment) {
  out.append((alignment - out.size() % alignment) % alignment, '\0');
}
uint64_t align_up(uint64_t x, uint64_t a) { return (x + a - 1) / a * a; }

/// The integer in a scalar value as a signed 128-bit number (either variant alternative).
bool scalar_integer(const GgufValue& v, __int128* out) {
  if (const auto* u = std::get_if<uint64_t>(&v.scalar)) {
    *out = *u;
    return true;
  }
  if (const auto* i = std::get_if<int64_t>(&v.scalar)) {
    *out = *i;
    return true;
  }
  return false;
}

std::pair<__int128, __int128> integer_range(VT t) {
  switch (t) {
    case VT::uint8: return {0, 255};
    case VT::int8: return {-128, 127};
    case VT::uint16: return {0, 65535};
    case VT::int16: return {-32768, 32767};
    case VT::uint32: return {0, 4294967295};
    case VT::int32: return {INT32_MIN, INT32_MAX};
    case VT::uint64: return {0, static_cast<__int128>(UINT64_MAX)};
    case VT::int64: return {INT64_MIN, INT64_MAX};
    default: return {0, -1};
  }
}

void put_integer(std::string& out, VT t, __int128 x) {
  switch (t) {
    case VT::uint8: put<uint8_t>(out, static_cast<uint8_t>(x)); break;
    case VT::int8: put<int8_t>(out, static_cast<int8_t>(x)); break;
    case VT::uint16: put<uint16_t>(out, static_cast<uint16_t>(x)); break;
    case VT::int16: put<int16_t>(out, static_cast<int16_t>(x)); break;
    case VT::uint32: put<uint32_t>(out, static_cast<uint32_t>(x)); break;
    case VT::int32: put<int32_t>(out, static_cast<int32_t>(x)); break;
    case VT::uint64: put<uint64_t>(out, static_cast<uint64_t>(x)); break;
    case VT::int64: put<int64_t>(out, static_cast<int64_t>(x)); break;
    default: break;
  }
}

[[noreturn]] void bad_value(std::string_view field, std::string_view reason) {
  throw InvalidArgument(fmt::format("GgufWriter: {}: {}", field, reason));
}

void check_float32(std::string_view field, double x) {
  if (std::isfinite(x) && std::fabs(x) > static_cast<double>(std::numeric_limits<float>::max()))
    bad_value(field, fmt::format("{} is out of range of float32", x));
}

/// Checks that `v` is in the canonical form the reader produces and the writer encodes.
void validate(const GgufValue& v, const std::string& field, int depth) {
  if (static_cast<uint32_t>(v.type) > kMaxValueType)
    bad_value(field, fmt::format("unknown value type {}", static_cast<uint32_t>(v.type)));
  if (v.type != VT::array) {
    if (!v.ints.empty() || !v.uints.empty() || !v.floats.empty() || !v.strings.empty() || !v.arrays.empty() ||
        v.array_size != 0)
      bad_value(field, fmt::format("a {} value has array elements", to_string(v.type)));
    if (is_integer(v.type)) {
      __int128 x = 0;
      if (!scalar_integer(v, &x)) bad_value(field, fmt::format("a {} value needs an integer scalar", to_string(v.type)));
      const auto [lo, hi] = integer_range(v.type);
      if (x < lo || x > hi)
        bad_value(field, fmt::format("{} is out of range of {}", static_cast<long double>(x), to_string(v.type)));
    } else if (is_float(v.type)) {
      const auto* d = std::get_if<double>(&v.scalar);
      if (d == nullptr) bad_value(field, fmt::format("a {} value needs a double scalar", to_string(v.type)));
      if (v.type == VT::float32) check_float32(field, *d);
    } else if (v.type == VT::boolean) {
      if (!std::holds_alternative<bool>(v.scalar)) bad_value(field, "a bool value needs a bool scalar");
    } else if (v.type == VT::string) {
      if (!std::holds_alternative<std::string>(v.scalar)) bad_value(field, "a string value needs a string scalar");
    }
    return;
  }
  if (depth > kMaxArrayDepth) bad_value(field, fmt::format("arrays nested more than {} deep", kMaxArrayDepth));
  if (!std::holds_alternative<std::monostate>(v.scalar)) bad_value(field, "an array value has a scalar");
  const VT et = v.array_type;
  if (static_cast<uint32_t>(et) > kMaxValueType)
    bad_value(field, fmt::format("unknown array element type {}", static_cast<uint32_t>(et)));
  const bool in_ints = is_integer(et) && et != VT::uint64;
  const std::size_t sizes[] = {v.ints.size(), v.uints.size(), v.floats.size(), v.strings.size(), v.arrays.size()};
  const int which = in_ints || et == VT::boolean ? 0 : et == VT::uint64 ? 1 : is_float(et) ? 2 : et == VT::string ? 3 : 4;
  for (int k = 0; k < 5; ++k) {
    if (k == which && sizes[k] != v.array_size)
      bad_value(field, fmt::format("array_size {} does not match the {} {} elements", v.array_size, sizes[k],
                                   to_string(et)));
    if (k != which && sizes[k] != 0)
      bad_value(field, fmt::format("a {} array has elements in another vector", to_string(et)));
  }
  if (in_ints) {
    const auto [lo, hi] = integer_range(et);
    for (std::size_t i = 0; i < v.ints.size(); ++i)
      if (v.ints[i] < lo || v.ints[i] > hi)
        bad_value(fmt::format("{}[{}]", field, i), fmt::format("{} is out of range of {}", v.ints[i], to_string(et)));
  } else if (et == VT::boolean) {
    for (std::size_t i = 0; i < v.ints.size(); ++i)
      if (v.ints[i] != 0 && v.ints[i] != 1)
        bad_value(fmt::format("{}[{}]", field, i), fmt::format("a bool element must be 0 or 1, not {}", v.ints[i]));
  } else if (et == VT::float32) {
    for (std::size_t i = 0; i < v.floats.size(); ++i) check_float32(fmt::format("{}[{}]", field, i), v.floats[i]);
  } else if (et == VT::array) {
    for (std::size_t i = 0; i < v.arrays.size(); ++i) {
      if (v.arrays[i].type != VT::array) bad_value(fmt::format("{}[{}]", field, i), "element of an array array is not an array");
      validate(v.arrays[i], fmt::format("{}[{}]", field, i), depth + 1);
    }
  }
}

void put_value(std::string& out, const GgufValue& v) {
  if (is_integer(v.type)) {
    __int128 x = 0;
    scalar_integer(v, &x);
    put_integer(out, v.type, x);
    return;
  }
  switch (v.type) {
    case VT::float32: put<float>(out, static_cast<float>(std::get<double>(v.scalar))); return;
    case VT::float64: put<double>(out, std::get<double>(v.scalar)); return;
    case VT::boolean: put<uint8_t>(out, std::get<bool>(v.scalar) ? 1 : 0); return;
    case VT::string: put_string(out, std::get<std::string>(v.scalar)); return;
    default: break;
  }
  const VT et = v.array_type;
  put<uint32_t>(out, static_cast<uint32_t>(et));
  put<uint64_t>(out, v.array_size);
  switch (et) {
    case VT::uint64: for (auto x : v.uints) put<uint64_t>(out, x); break;
    case VT::float32: for (auto x : v.floats) put<float>(out, static_cast<float>(x)); break;
    case VT::float64: for (auto x : v.floats) put<double>(out, x); break;
    case VT::boolean: for (auto x : v.ints) put<uint8_t>(out, x ? 1 : 0); break;
    case VT::string: for (const auto& s : v.strings) put_string(out, s); break;
    case VT::array:
      for (const auto& a : v.arrays) put_value(out, a);  // an element of type array: element type, count, elements
      break;
    default: for (auto x : v.ints) put_integer(out, et, x); break;
  }
}

}  // namespace

// ---- types --------------------------------------------------------------------

std::string ggml_type_name(uint32_t type) {
  const TypeTraits* t = type_traits(type);
  return t != nullptr ? std::string(t->name) : fmt::format("type {}", type);
}

bool ggml_type_supported(uint32_t type) {
  switch (static_cast<GgmlType>(type)) {
    case GgmlType::f32: case GgmlType::f16: case GgmlType::bf16: case GgmlType::q8_0: case GgmlType::q4_0:
      return true;
    default: return false;
  }
}

std::pair<int64_t, int64_t> ggml_block_shape(GgmlType type) {
  const auto t = static_cast<uint32_t>(type);
  if (!ggml_type_supported(t))
    throw CheckpointError(fmt::format("ggml type {} is not supported ({})", ggml_type_name(t), kSupported));
  return {kTypes[t].block, kTypes[t].block_bytes};
}

std::string_view to_string(GgufValue::Type type) {
  switch (type) {
    case VT::uint8: return "uint8";
    case VT::int8: return "int8";
    case VT::uint16: return "uint16";
    case VT::int16: return "int16";
    case VT::uint32: return "uint32";
    case VT::int32: return "int32";
    case VT::float32: return "float32";
    case VT::boolean: return "bool";
    case VT::string: return "string";
    case VT::array: return "array";
    case VT::uint64: return "uint64";
    case VT::int64: return "int64";
    case VT::float64: return "float64";
  }
  return "unknown";
}

int64_t GgufTensorInfo::n_elements() const {
  int64_t n = 1;
  for (auto e : ne) n *= e;
  return n;
}

// ---- GgufFile -----------------------------------------------------------------

GgufFile GgufFile::open(const std::filesystem::path& path) {
  MappedFile map(path);
  const auto bytes = map.bytes();
  GgufFile f = parse(bytes, path.string());
  f.file_ = std::move(map);  // the span stays valid: moving a map keeps its address
  return f;
}

GgufFile GgufFile::parse(std::span<const std::byte> bytes, std::string_view source) {
  GgufFile f;
  f.bytes_ = bytes;
  f.source_ = std::string(source);
  GgufReader r(bytes, f.source_);

  // header
  r.need(4, "GGUF magic");
  const auto magic = r.bytes(4);
  if (std::memcmp(magic.data(), "GGUF", 4) != 0)
    r.fail("GGUF magic", "not a GGUF file, expected 'GGUF'",
           printable(std::string_view(reinterpret_cast<const char*>(magic.data()), magic.size())));
  const uint32_t version = r.u32("version");
  if (version == 1)
    r.fail("version", "GGUF version 1 (32-bit counts and lengths) is not supported; this reader reads versions 2 and 3",
           version);
  if (version != 0 && (version & 0xffffu) == 0)
    r.fail("version", "looks byte-swapped: big-endian GGUF files are not supported", version);
  if (version != 2 && version != 3) r.fail("version", "unsupported GGUF version (this reader reads 2 and 3)", version);
  f.version_ = version;
  const uint64_t n_tensors = r.u64("tensor_count");
  const uint64_t n_kv = r.u64("kv_count");
  // Smallest possible entries: a key/value pair is a key (8 + at least 1 byte),
  // a value type (4) and a value (at least 1); a tensor info is a name (8 + 1),
  // n_dims (4), a type (4) and an offset (8).
  constexpr uint64_t kMinKv = 8 + 1 + 4 + 1, kMinTensor = 8 + 1 + 4 + 4 + 8;
  if (n_tensors > r.left() / kMinTensor)
    r.fail("tensor_count",
           fmt::format("more tensor infos than the {} bytes after the header can hold (a truncated file, or a wrong "
                       "count)",
                       r.left()),
           n_tensors);
  if (n_kv > r.left() / kMinKv)
    r.fail("kv_count",
           fmt::format("more key/value pairs than the {} bytes after the header can hold (a truncated file, or a "
                       "wrong count)",
                       r.left()),
           n_kv);

  // metadata
  for (uint64_t i = 0; i < n_kv; ++i) {
    const std::string kfield = fmt::format("metadata[{}] key", i);
    const uint64_t key_at = r.pos();
    std::string key = r.string(kfield);
    if (key.empty()) r.fail(kfield, "empty key", "''");
    // The GGUF specification's keys are ASCII (and at most 65,535 bytes): a byte outside printable ASCII means the
    // length before it is wrong or the bytes are corrupt; said so, with the start of what was read, instead of
    // taking the key and failing on whatever follows it.
    if (!is_gguf_key_text(key)) {
      const auto bad = std::find_if_not(key.begin(), key.end(), is_key_byte);
      r.fail(kfield,
             fmt::format("a key is printable ASCII of at most 65535 bytes, and the {} bytes that the length at offset "
                         "{} gives {} (a wrong length or a corrupt file)",
                         key.size(), key_at,
                         bad != key.end() ? fmt::format("hold byte 0x{:02x} at offset {}", static_cast<uint8_t>(*bad),
                                                        key_at + 8 + static_cast<uint64_t>(bad - key.begin()))
                                          : std::string("are more")),
             printable_start(key));
    }
    if (f.kv_.contains(key)) r.fail(kfield, "duplicate key", printable(key));
    const std::string field = fmt::format("metadata {}", printable(key));
    const uint64_t at = r.pos();
    const uint32_t t = r.u32(field + " type");
    if (t > kMaxValueType) r.fail(field + " type", fmt::format("unknown GGUF value type at offset {}", at), t);
    GgufValue v = r.value(static_cast<VT>(t), field, 0);
    f.kv_.emplace(std::move(key), std::move(v));
  }
  if (const GgufValue* a = f.find(kAlignmentKey)) {
    const std::string field = fmt::format("metadata '{}'", kAlignmentKey);
    if (a->type != VT::uint32) r.fail(field, "must be a uint32", to_string(a->type));
    const uint64_t al = std::get<uint64_t>(a->scalar);
    if (al == 0 || (al & (al - 1)) != 0) r.fail(field, "must be a power of two", al);
    f.alignment_ = al;
  }

  // tensor infos
  if (n_tensors > r.left() / kMinTensor)
    r.fail("tensor_count", fmt::format("more tensor infos than the {} bytes after the metadata can hold", r.left()),
           n_tensors);
  f.tensors_.reserve(n_tensors);
  std::unordered_set<std::string> names;
  for (uint64_t i = 0; i < n_tensors; ++i) {
    GgufTensorInfo t;
    const std::string nfield = fmt::format("tensor[{}] name", i);
    t.name = r.string(nfield);
    if (t.name.empty()) r.fail(nfield, "empty tensor name", "''");
    if (names.contains(t.name)) r.fail(nfield, "duplicate tensor name", printable(t.name));
    names.insert(t.name);
    const std::string field = fmt::format("tensor {}", printable(t.name));
    const uint32_t n_dims = r.u32(field + " n_dims");
    if (n_dims > kMaxDims) r.fail(field + " n_dims", fmt::format("at most {} dimensions are allowed", kMaxDims), n_dims);
    uint64_t n_el = 1;
    for (uint32_t d = 0; d < n_dims; ++d) {
      const std::string efield = fmt::format("{} ne[{}]", field, d);
      const uint64_t e = r.u64(efield);
      if (e > static_cast<uint64_t>(INT64_MAX)) r.fail(efield, "extent above INT64_MAX", e);
      if (mul_overflows(n_el, e, &n_el) || n_el > static_cast<uint64_t>(INT64_MAX))
        r.fail(efield, "the product of the extents overflows int64", e);
      t.ne.push_back(static_cast<int64_t>(e));
    }
    const uint64_t tat = r.pos();
    const uint32_t type = r.u32(field + " type");
    const TypeTraits* tt = type_traits(type);
    if (tt == nullptr) r.fail(field + " type", fmt::format("unknown ggml type at offset {}", tat), type);
    t.type = static_cast<GgmlType>(type);
    const uint64_t ne0 = n_dims > 0 ? static_cast<uint64_t>(t.ne[0]) : 1;
    if (ne0 % static_cast<uint64_t>(tt->block) != 0)
      r.fail(field + " ne[0]",
             fmt::format("rows of {} must be a whole number of {}-element blocks", tt->name, tt->block), ne0);
    if (mul_overflows(n_el / static_cast<uint64_t>(tt->block), static_cast<uint64_t>(tt->block_bytes), &t.n_bytes))
      r.fail(field, fmt::format("the byte size of {} {} elements overflows", n_el, tt->name), n_el);
    t.offset = r.u64(field + " offset");
    f.tensors_.push_back(std::move(t));
  }

  // data section: after the tensor infos, padded to the alignment (from the start of the file)
  f.data_offset_ = align_up(r.pos(), f.alignment_);
  const uint64_t size = r.size();
  if (n_tensors > 0 && f.data_offset_ > size)
    r.fail("data section", fmt::format("the padding after the tensor infos (offset {}) to the alignment {} runs past "
                                       "the end of the file",
                                       r.pos(), f.alignment_),
           fmt::format("a file of {} bytes", size));
  const uint64_t data_size = f.data_offset_ <= size ? size - f.data_offset_ : 0;
  for (std::size_t i = 0; i < f.tensors_.size(); ++i) {
    const auto& t = f.tensors_[i];
    const std::string field = fmt::format("tensor {} offset", printable(t.name));
    if (t.offset % f.alignment_ != 0)
      r.fail(field, fmt::format("must be a multiple of the alignment {}", f.alignment_), t.offset);
    if (t.offset > data_size || t.n_bytes > data_size - t.offset)
      r.fail(field,
             fmt::format("its {} bytes of {} data end past the end of the file (data section at {}, {} bytes long)",
                         t.n_bytes, ggml_type_name(static_cast<uint32_t>(t.type)), f.data_offset_, data_size),
             t.offset);
  }
  // The data section as llama.cpp's reader (ggml/src/gguf.cpp) requires it and every writer makes it: the tensors in
  // the order of their infos, each where the one before it ends padded to the alignment, the first at 0. A tensor
  // whose type or shape in the header is not the one its bytes were written with (its size differs) then moves the
  // offset the next tensor must have. Bytes after the last tensor are allowed, as llama.cpp reads them (so a last
  // tensor retyped smaller is not caught).
  uint64_t expected = 0;
  for (std::size_t i = 0; i < f.tensors_.size(); ++i) {
    const auto& t = f.tensors_[i];
    if (t.offset != expected) {
      const std::string why =
          i == 0 ? std::string("the first tensor's data must start the data section (offset 0)")
                 : fmt::format("expected {}: where tensor {} (its {} bytes of {} data at offset {}) ends, padded to the "
                               "alignment {} (tensors follow each other in the order of their infos)",
                               expected, printable(f.tensors_[i - 1].name), f.tensors_[i - 1].n_bytes,
                               ggml_type_name(static_cast<uint32_t>(f.tensors_[i - 1].type)),
                               f.tensors_[i - 1].offset, f.alignment_);
      r.fail(fmt::format("tensor {} offset", printable(t.name)), why, t.offset);
    }
    expected = align_up(t.offset + t.n_bytes, f.alignment_);  // no overflow: t.offset + n_bytes <= data_size
  }
  return f;
}

const GgufValue* GgufFile::find(std::string_view key) const {
  auto it = kv_.find(std::string(key));
  return it == kv_.end() ? nullptr : &it->second;
}

namespace {
template <class V>
[[noreturn]] void fail_key(const std::string& source, std::string_view key, std::string_view reason, const V& value) {
  throw CheckpointError(fmt::format("{}: metadata {}: {} (got {})", source, printable(key), reason, value));
}
std::string type_text(const GgufValue& v) {
  return v.type == VT::array ? fmt::format("array of {}", to_string(v.array_type)) : std::string(to_string(v.type));
}
}  // namespace

std::optional<std::string> GgufFile::get_string(std::string_view key) const {
  const GgufValue* v = find(key);
  if (v == nullptr) return std::nullopt;
  if (v->type != VT::string) fail_key(source_, key, "expected a string", type_text(*v));
  return std::get<std::string>(v->scalar);
}

std::optional<int64_t> GgufFile::get_int(std::string_view key) const {
  const GgufValue* v = find(key);
  if (v == nullptr) return std::nullopt;
  if (!is_integer(v->type)) fail_key(source_, key, "expected an integer", type_text(*v));
  if (const auto* u = std::get_if<uint64_t>(&v->scalar)) {
    if (*u > static_cast<uint64_t>(INT64_MAX)) fail_key(source_, key, "out of range of int64", *u);
    return static_cast<int64_t>(*u);
  }
  return std::get<int64_t>(v->scalar);
}

std::optional<double> GgufFile::get_float(std::string_view key) const {
  const GgufValue* v = find(key);
  if (v == nullptr) return std::nullopt;
  if (!is_float(v->type)) fail_key(source_, key, "expected a float32 or float64", type_text(*v));
  return std::get<double>(v->scalar);
}

std::optional<bool> GgufFile::get_bool(std::string_view key) const {
  const GgufValue* v = find(key);
  if (v == nullptr) return std::nullopt;
  if (v->type != VT::boolean) fail_key(source_, key, "expected a bool", type_text(*v));
  return std::get<bool>(v->scalar);
}

const std::vector<std::string>* GgufFile::get_string_array(std::string_view key) const {
  const GgufValue* v = find(key);
  if (v == nullptr) return nullptr;
  if (v->type != VT::array || v->array_type != VT::string)
    fail_key(source_, key, "expected an array of string", type_text(*v));
  return &v->strings;
}

std::optional<std::vector<double>> GgufFile::get_float_array(std::string_view key) const {
  const GgufValue* v = find(key);
  if (v == nullptr) return std::nullopt;
  if (v->type != VT::array || !is_float(v->array_type))
    fail_key(source_, key, "expected an array of float32 or float64", type_text(*v));
  return v->floats;
}

std::optional<std::vector<int64_t>> GgufFile::get_int_array(std::string_view key) const {
  const GgufValue* v = find(key);
  if (v == nullptr) return std::nullopt;
  if (v->type != VT::array || !is_integer(v->array_type))
    fail_key(source_, key, "expected an array of integers", type_text(*v));
  if (v->array_type != VT::uint64) return v->ints;
  std::vector<int64_t> out;
  out.reserve(v->uints.size());
  for (std::size_t i = 0; i < v->uints.size(); ++i) {
    if (v->uints[i] > static_cast<uint64_t>(INT64_MAX))
      fail_key(source_, key, fmt::format("element {} is out of range of int64", i), v->uints[i]);
    out.push_back(static_cast<int64_t>(v->uints[i]));
  }
  return out;
}

const GgufTensorInfo* GgufFile::find_tensor(std::string_view name) const {
  for (const auto& t : tensors_)
    if (t.name == name) return &t;
  return nullptr;
}

std::span<const std::byte> GgufFile::tensor_data(const GgufTensorInfo& t) const {
  const auto type = static_cast<uint32_t>(t.type);
  if (!ggml_type_supported(type))
    throw CheckpointError(fmt::format("{}: tensor {}: ggml type {} is not supported ({})", source_, printable(t.name),
                                      ggml_type_name(type), kSupported));
  const uint64_t size = bytes_.size();
  if (data_offset_ > size || t.offset > size - data_offset_ || t.n_bytes > size - data_offset_ - t.offset)
    throw InvalidArgument(fmt::format("{}: tensor {} (offset {}, {} bytes) is not a tensor of this file", source_,
                                      printable(t.name), t.offset, t.n_bytes));
  return bytes_.subspan(data_offset_ + t.offset, t.n_bytes);
}

std::vector<float> GgufFile::to_float32(const GgufTensorInfo& t) const {
  const auto data = tensor_data(t);
  std::vector<float> out(static_cast<std::size_t>(t.n_elements()));
  try {
    ggml_dequantize(t.type, data, out);
  } catch (const CheckpointError& e) {
    throw CheckpointError(fmt::format("{}: tensor {}: {}", source_, printable(t.name), e.what()));
  }
  return out;
}

// ---- GgufWriter -------------------------------------------------------------------

namespace {
void check_key(const std::vector<std::string>& keys, std::string_view key) {
  if (key.empty()) throw InvalidArgument("GgufWriter: empty metadata key");
  if (!is_gguf_key_text(key))
    throw InvalidArgument(fmt::format("GgufWriter: metadata key {} is not printable ASCII of at most 65535 bytes "
                                      "(GGUF's keys are)",
                                      printable_start(key)));
  if (std::find(keys.begin(), keys.end(), key) != keys.end())
    throw InvalidArgument(fmt::format("GgufWriter: metadata key '{}' added twice", key));
}
GgufValue scalar_value(VT type, decltype(GgufValue::scalar) x) {
  GgufValue v;
  v.type = type;
  v.scalar = std::move(x);
  return v;
}
GgufValue array_value(VT et, uint64_t n) {
  GgufValue v;
  v.type = VT::array;
  v.array_type = et;
  v.array_size = n;
  return v;
}
}  // namespace

void GgufWriter::add_value(std::string key, GgufValue value) {
  std::vector<std::string> keys;
  keys.reserve(kv_.size());
  for (const auto& kv : kv_) keys.push_back(kv.key);
  check_key(keys, key);
  validate(value, fmt::format("metadata '{}'", key), value.type == VT::array ? 1 : 0);
  if (key == kAlignmentKey) {
    if (value.type != VT::uint32)
      throw InvalidArgument(fmt::format("GgufWriter: {} must be a uint32 (got {})", kAlignmentKey, to_string(value.type)));
    __int128 a = 0;
    scalar_integer(value, &a);
    if (a == 0 || (a & (a - 1)) != 0)
      throw InvalidArgument(fmt::format("GgufWriter: {} must be a power of two (got {})", kAlignmentKey,
                                        static_cast<uint64_t>(a)));
  }
  kv_.push_back({std::move(key), std::move(value)});
}

void GgufWriter::add_string(std::string key, std::string value) {
  add_value(std::move(key), scalar_value(VT::string, std::move(value)));
}
void GgufWriter::add_uint32(std::string key, uint32_t value) {
  add_value(std::move(key), scalar_value(VT::uint32, uint64_t{value}));
}
void GgufWriter::add_int32(std::string key, int32_t value) {
  add_value(std::move(key), scalar_value(VT::int32, int64_t{value}));
}
void GgufWriter::add_float32(std::string key, float value) {
  add_value(std::move(key), scalar_value(VT::float32, double{value}));
}
void GgufWriter::add_bool(std::string key, bool value) { add_value(std::move(key), scalar_value(VT::boolean, value)); }
void GgufWriter::add_string_array(std::string key, std::vector<std::string> values) {
  GgufValue v = array_value(VT::string, values.size());
  v.strings = std::move(values);
  add_value(std::move(key), std::move(v));
}
void GgufWriter::add_float32_array(std::string key, std::vector<float> values) {
  GgufValue v = array_value(VT::float32, values.size());
  v.floats.assign(values.begin(), values.end());
  add_value(std::move(key), std::move(v));
}
void GgufWriter::add_int32_array(std::string key, std::vector<int32_t> values) {
  GgufValue v = array_value(VT::int32, values.size());
  v.ints.assign(values.begin(), values.end());
  add_value(std::move(key), std::move(v));
}

void GgufWriter::add_tensor(std::string name, std::vector<int64_t> ne, GgmlType type, std::vector<std::byte> data) {
  if (name.empty()) throw InvalidArgument("GgufWriter: empty tensor name");
  for (const auto& t : tensors_)
    if (t.name == name) throw InvalidArgument(fmt::format("GgufWriter: tensor '{}' added twice", name));
  if (ne.size() > kMaxDims)
    throw InvalidArgument(fmt::format("GgufWriter: tensor '{}': at most {} dimensions (got {})", name, kMaxDims, ne.size()));
  const TypeTraits* tt = type_traits(static_cast<uint32_t>(type));
  if (tt == nullptr)
    throw InvalidArgument(fmt::format("GgufWriter: tensor '{}': unknown ggml type {}", name, static_cast<uint32_t>(type)));
  uint64_t n = 1;
  for (auto e : ne) {
    if (e < 0) throw InvalidArgument(fmt::format("GgufWriter: tensor '{}': negative extent (got {})", name, e));
    if (mul_overflows(n, static_cast<uint64_t>(e), &n) || n > static_cast<uint64_t>(INT64_MAX))
      throw InvalidArgument(fmt::format("GgufWriter: tensor '{}': the element count overflows int64", name));
  }
  const uint64_t ne0 = ne.empty() ? 1 : static_cast<uint64_t>(ne[0]);
  if (ne0 % static_cast<uint64_t>(tt->block) != 0)
    throw InvalidArgument(fmt::format("GgufWriter: tensor '{}': ne[0] must be a multiple of the {} block size {} (got {})",
                                      name, tt->name, tt->block, ne0));
  uint64_t bytes = 0;
  if (mul_overflows(n / static_cast<uint64_t>(tt->block), static_cast<uint64_t>(tt->block_bytes), &bytes) ||
      bytes != data.size())
    throw InvalidArgument(fmt::format("GgufWriter: tensor '{}': {} {} elements take {} bytes (got {})", name, n,
                                      tt->name, bytes, data.size()));
  tensors_.push_back({std::move(name), std::move(ne), type, std::move(data)});
}

std::string GgufWriter::serialize() const {
  uint64_t alignment = kDefaultAlignment;
  for (const auto& kv : kv_)
    if (kv.key == kAlignmentKey) alignment = std::get<uint64_t>(kv.value.scalar);
  std::string out;
  out.append("GGUF", 4);
  put<uint32_t>(out, 3);
  put<uint64_t>(out, tensors_.size());
  put<uint64_t>(out, kv_.size());
  for (const auto& kv : kv_) {
    put_string(out, kv.key);
    put<uint32_t>(out, static_cast<uint32_t>(kv.value.type));
    put_value(out, kv.value);
  }
  uint64_t offset = 0;
  for (const auto& t : tensors_) {
    put_string(out, t.name);
    put<uint32_t>(out, static_cast<uint32_t>(t.ne.size()));
    for (auto e : t.ne) put<uint64_t>(out, static_cast<uint64_t>(e));
    put<uint32_t>(out, static_cast<uint32_t>(t.type));
    put<uint64_t>(out, offset);
    offset = align_up(offset + t.data.size(), alignment);
  }
  pad_to(out, alignment);
  out.reserve(out.size() + offset);
  for (const auto& t : tensors_) {
    if (!t.data.empty()) put(out, t.data.data(), t.data.size());
    pad_to(out, alignment);
  }
  return out;
}

void GgufWriter::write(const std::filesystem::path& path) const { write_file_atomic(path, serialize()); }

}  // namespace posenc
