// Tensor dumps for `posenc verify` (see include/posenc/tensor_dump.hpp): .npy
// (numpy/lib/format.py), .npz (zip archives of .npy members, read and written
// with libzip) and safetensors (through SafetensorsFile).
//
// .npy header: numpy parses it with ast.literal_eval; here a strict parser of
// exactly the dict literal numpy writes: {'descr': <str>, 'fortran_order':
// True|False, 'shape': (<int>, ...)} in any key order, single- or
// double-quoted keys and strings, optional trailing comma, whitespace, then
// only spaces/newlines up to the end of the header. Python 2's "3L" integers
// are accepted in 1.0/2.0 headers (numpy's _filter_header does the same).
#include "posenc/tensor_dump.hpp"

#include <zip.h>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <bit>
#include <cctype>
#include <cmath>
#include <cstring>
#include <ctime>
#include <limits>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <utility>

#include "posenc/error.hpp"
#include "posenc/float16.hpp"
#include "posenc/io.hpp"
#include "posenc/safetensors.hpp"
#include "verify/shape_text.hpp"

namespace posenc {

std::string detail::shape_text(const std::vector<int64_t>& shape) {
  return fmt::format("[{}]", fmt::join(shape, ", "));
}
using detail::shape_text;

static_assert(std::endian::native == std::endian::little, "the dump readers assume a little-endian host");

namespace {

constexpr std::string_view kNpyMagic = "\x93NUMPY";
/// magic (6) + version (2).
constexpr std::size_t kNpyMagicLen = 8;
/// Integers beyond this magnitude do not all have a double.
constexpr double kMaxExactInteger = 9007199254740992.0;  // 2^53

struct DtypeInfo {
  DumpDtype dtype;
  std::string_view name;  // to_string
  int size;
  std::string_view npy;   // little-endian / byte-order-free descr; empty: none (bf16)
};
constexpr DtypeInfo kDtypes[] = {
    {DumpDtype::f64, "f64", 8, "<f8"},  {DumpDtype::f32, "f32", 4, "<f4"},   {DumpDtype::f16, "f16", 2, "<f2"},
    {DumpDtype::bf16, "bf16", 2, ""},   {DumpDtype::i64, "i64", 8, "<i8"},   {DumpDtype::i32, "i32", 4, "<i4"},
    {DumpDtype::i16, "i16", 2, "<i2"},  {DumpDtype::i8, "i8", 1, "|i1"},     {DumpDtype::u8, "u8", 1, "|u1"},
    {DumpDtype::boolean, "bool", 1, "|b1"},
};

const DtypeInfo& info(DumpDtype d) {
  for (const auto& i : kDtypes)
    if (i.dtype == d) return i;
  throw InvalidArgument(fmt::format("dtype: not a DumpDtype (got {})", static_cast<int>(d)));
}

/// A string for a message: printable ASCII kept, other bytes as \xNN, cut at 80 characters.
std::string printable(std::string_view s) {
  std::string out;
  for (unsigned char c : s) {
    if (out.size() >= 80) {
      out += "...";
      break;
    }
    if (c >= 0x20 && c < 0x7f && c != '\\')
      out += static_cast<char>(c);
    else
      out += fmt::format("\\x{:02x}", c);
  }
  return out;
}

// ---- element decoding ------------------------------------------------------

template <class T>
T load(const std::byte* p, bool big_endian) {
  using U = std::conditional_t<sizeof(T) == 8, uint64_t,
                               std::conditional_t<sizeof(T) == 4, uint32_t, std::conditional_t<sizeof(T) == 2, uint16_t, uint8_t>>>;
  U u;
  std::memcpy(&u, p, sizeof(U));
  if (big_endian) {
    if constexpr (sizeof(U) == 8) u = __builtin_bswap64(u);
    if constexpr (sizeof(U) == 4) u = __builtin_bswap32(u);
    if constexpr (sizeof(U) == 2) u = __builtin_bswap16(u);
  }
  return std::bit_cast<T>(u);
}

/// Element `i` (at `p`) widened to double. Throws DumpError for an integer beyond 2^53 or a bool byte other than 0/1.
double decode(DumpDtype dtype, const std::byte* p, bool big_endian, int64_t i, std::string_view source,
              std::string_view name) {
  switch (dtype) {
    case DumpDtype::f64: return load<double>(p, big_endian);
    case DumpDtype::f32: return load<float>(p, big_endian);
    case DumpDtype::f16: return f16_to_f32(load<uint16_t>(p, big_endian));
    case DumpDtype::bf16: return bf16_to_f32(load<uint16_t>(p, big_endian));
    case DumpDtype::i64: {
      const int64_t v = load<int64_t>(p, big_endian);
      if (v > (int64_t{1} << 53) || v < -(int64_t{1} << 53))
        throw DumpError(fmt::format("{}: {}: element {} is {}, beyond +-2^53, where doubles stop holding every integer",
                                    source, name, i, v));
      return static_cast<double>(v);
    }
    case DumpDtype::i32: return load<int32_t>(p, big_endian);
    case DumpDtype::i16: return load<int16_t>(p, big_endian);
    case DumpDtype::i8: return load<int8_t>(p, big_endian);
    case DumpDtype::u8: return load<uint8_t>(p, big_endian);
    case DumpDtype::boolean: {
      const uint8_t v = load<uint8_t>(p, big_endian);
      if (v > 1)
        throw DumpError(fmt::format("{}: {}: element {} is the byte {}, not a bool (0 or 1)", source, name, i, v));
      return v;
    }
  }
  throw DumpError(fmt::format("{}: {}: unknown dtype {}", source, name, static_cast<int>(dtype)));
}

/// Product of `shape`; false when it overflows int64 or a dimension is negative.
bool element_count(const std::vector<int64_t>& shape, uint64_t& n) {
  n = 1;
  for (int64_t d : shape) {
    if (d < 0) return false;
    if (__builtin_mul_overflow(n, static_cast<uint64_t>(d), &n)) return false;
  }
  return n <= static_cast<uint64_t>(INT64_MAX);
}

// ---- the .npy header ---------------------------------------------------------

struct NpyHeader {
  DumpDtype dtype = DumpDtype::f32;
  int itemsize = 4;
  bool big_endian = false;
  bool fortran_order = false;
  std::vector<int64_t> shape;
  uint64_t data_offset = 0;  ///< bytes before the data: magic, version, length, header
  uint64_t n_elements = 1;
  uint64_t data_bytes = 0;
};

/// numpy's _MAX_HEADER_SIZE: numpy refuses longer headers by default (they are never needed: numpy's own are < 200).
constexpr uint64_t kMaxNpyHeaderBytes = 10000;
/// numpy's NPY_MAXDIMS (32 in numpy 1.x, 64 in numpy 2).
constexpr std::size_t kMaxNdim = 64;

/// A strict parser of the header dict literal.
class HeaderDict {
 public:
  HeaderDict(std::string_view text, bool python2_ints, std::string_view source, std::string_view name)
      : s_(text), python2_ints_(python2_ints), source_(source), name_(name) {}

  void parse(NpyHeader& h) {
    ws();
    expect('{', "the header must be a dict literal starting with '{'");
    std::set<std::string> seen;
    std::optional<std::string> descr;
    std::optional<bool> fortran;
    std::optional<std::vector<int64_t>> shape;
    while (true) {
      ws();
      if (peek() == '}') {
        ++i_;
        break;
      }
      const std::size_t key_at = i_;
      const std::string key = string_literal("a key");
      ws();
      expect(':', fmt::format("':' after key '{}'", printable(key)));
      ws();
      if (!seen.insert(key).second) fail(key_at, fmt::format("key '{}' appears twice", printable(key)));
      if (key == "descr") {
        if (peek() == '[')
          fail(i_, "descr: a structured dtype (a list of fields) is not a tensor; dump plain arrays");
        descr = string_literal("descr's value");
      } else if (key == "fortran_order") {
        fortran = boolean_literal();
      } else if (key == "shape") {
        shape = tuple_literal();
      } else {
        fail(key_at, fmt::format("unknown key '{}' (numpy writes exactly descr, fortran_order and shape)",
                                 printable(key)));
      }
      ws();
      if (peek() == ',') {
        ++i_;
        continue;
      }
      if (peek() == '}') {
        ++i_;
        break;
      }
      fail(i_, fmt::format("expected ',' or '}}' after the value of '{}'", key));
    }
    // numpy pads with spaces and ends with '\n'; nothing else may follow the dict.
    for (std::size_t j = i_; j < s_.size(); ++j)
      if (s_[j] != ' ' && s_[j] != '\n' && s_[j] != '\t' && s_[j] != '\r')
        fail(j, fmt::format("unexpected text after the dict: '{}'", printable(s_.substr(j, 20))));
    for (const char* k : {"descr", "fortran_order", "shape"})
      if (!seen.contains(k))
        throw DumpError(fmt::format("{}: {}: the .npy header has no key '{}' (got '{}')", source_, name_, k,
                                    printable(s_.substr(0, i_))));
    h.fortran_order = *fortran;
    h.shape = std::move(*shape);
    set_dtype(h, *descr);
  }

 private:
  [[noreturn]] void fail(std::size_t at, const std::string& what) const {
    throw DumpError(fmt::format("{}: {}: .npy header, byte {}: {} (header '{}')", source_, name_, at, what,
                                printable(s_)));
  }
  char peek() const { return i_ < s_.size() ? s_[i_] : '\0'; }
  void ws() {
    while (i_ < s_.size() && (s_[i_] == ' ' || s_[i_] == '\t' || s_[i_] == '\n' || s_[i_] == '\r')) ++i_;
  }
  void expect(char c, const std::string& what) {
    if (peek() != c) fail(i_, fmt::format("expected {}", what));
    ++i_;
  }
  std::string string_literal(std::string_view what) {
    const char q = peek();
    if (q != '\'' && q != '"') fail(i_, fmt::format("expected {} as a quoted string", what));
    const std::size_t start = ++i_;
    while (i_ < s_.size() && s_[i_] != q) {
      if (s_[i_] == '\\') fail(i_, "escape sequences are not used in .npy headers");
      if (s_[i_] == '\n') fail(i_, "newline inside a string");
      ++i_;
    }
    if (i_ >= s_.size()) fail(start - 1, "unterminated string");
    return std::string(s_.substr(start, i_++ - start));
  }
  bool boolean_literal() {
    for (auto [word, value] : {std::pair{std::string_view("True"), true}, std::pair{std::string_view("False"), false}}) {
      if (s_.substr(i_, word.size()) == word) {
        const std::size_t end = i_ + word.size();
        if (end < s_.size() && (std::isalnum(static_cast<unsigned char>(s_[end])) || s_[end] == '_')) break;
        i_ = end;
        return value;
      }
    }
    fail(i_, fmt::format("fortran_order must be True or False (got '{}')", printable(s_.substr(i_, 12))));
  }
  int64_t integer() {
    const std::size_t start = i_;
    if (peek() == '-' || peek() == '+') fail(i_, "a shape dimension must be a non-negative integer");
    uint64_t v = 0;
    while (i_ < s_.size() && s_[i_] >= '0' && s_[i_] <= '9') {
      if (__builtin_mul_overflow(v, 10u, &v) || __builtin_add_overflow(v, static_cast<uint64_t>(s_[i_] - '0'), &v) ||
          v > static_cast<uint64_t>(INT64_MAX))
        fail(start, fmt::format("shape dimension {}... does not fit in 64 bits", printable(s_.substr(start, 24))));
      ++i_;
    }
    if (i_ == start) fail(i_, fmt::format("expected a shape dimension (got '{}')", printable(s_.substr(i_, 12))));
    if (python2_ints_ && (peek() == 'L' || peek() == 'l')) ++i_;
    return static_cast<int64_t>(v);
  }
  std::vector<int64_t> tuple_literal() {
    if (peek() != '(') fail(i_, fmt::format("shape must be a tuple such as (2, 3) (got '{}')", printable(s_.substr(i_, 16))));
    const std::size_t open = i_++;
    std::vector<int64_t> dims;
    bool comma_after_last = false;
    ws();
    while (peek() != ')') {
      if (dims.size() >= kMaxNdim) fail(open, fmt::format("shape has more than {} dimensions", kMaxNdim));
      dims.push_back(integer());
      comma_after_last = false;
      ws();
      if (peek() == ',') {
        ++i_;
        comma_after_last = true;
        ws();
      } else if (peek() != ')') {
        fail(i_, fmt::format("expected ',' or ')' in shape (got '{}')", printable(s_.substr(i_, 12))));
      }
    }
    ++i_;
    if (dims.size() == 1 && !comma_after_last)
      fail(open, fmt::format("shape ({}) is an integer in parentheses, not a tuple (numpy writes ({},))", dims[0],
                             dims[0]));
    return dims;
  }
  void set_dtype(NpyHeader& h, const std::string& descr) const {
    if (descr.size() == 3 && descr[1] == 'V' && descr[2] == '2')
      throw DumpError(fmt::format(
          "{}: {}: descr '{}' is a 2-byte void type, which is how ml_dtypes' bfloat16 reaches .npy (numpy has no "
          "bfloat16, and the file does not say what the bytes are): write bfloat16 tensors as safetensors "
          "(safetensors.torch.save_file), or convert them to float32 before np.save",
          source_, name_, printable(descr)));
    for (const auto& d : kDtypes) {
      if (d.npy.empty()) continue;
      if (descr == d.npy) {
        h.dtype = d.dtype;
        h.itemsize = d.size;
        h.big_endian = false;
        return;
      }
      if (d.size > 1 && descr.size() == 3 && descr[0] == '>' && descr.substr(1) == d.npy.substr(1)) {
        h.dtype = d.dtype;
        h.itemsize = d.size;
        h.big_endian = true;
        return;
      }
    }
    std::vector<std::string> known;
    for (const auto& d : kDtypes) {
      if (d.npy.empty()) continue;
      known.emplace_back(d.npy);
      if (d.size > 1) known.push_back(">" + std::string(d.npy.substr(1)));
    }
    throw DumpError(fmt::format("{}: {}: unsupported descr '{}' (supported: {})", source_, name_, printable(descr),
                                fmt::join(known, ", ")));
  }

  std::string_view s_;
  std::size_t i_ = 0;
  bool python2_ints_;
  std::string_view source_, name_;
};

/// Reads the magic, version, header length and header. `bytes` may be a prefix of the file: it must hold the
/// whole header (a DumpError says so otherwise); the data is not looked at.
NpyHeader parse_npy_header(std::span<const std::byte> bytes, std::string_view source, std::string_view name) {
  const auto* c = reinterpret_cast<const char*>(bytes.data());
  if (bytes.size() < kNpyMagicLen || std::string_view(c, 6) != kNpyMagic)
    throw DumpError(fmt::format("{}: {}: not a .npy file: it does not start with \"\\x93NUMPY\" (got '{}', {} bytes)",
                                source, name, printable(std::string_view(c, std::min<std::size_t>(bytes.size(), 8))),
                                bytes.size()));
  const int major = static_cast<unsigned char>(c[6]), minor = static_cast<unsigned char>(c[7]);
  if (!((major == 1 || major == 2 || major == 3) && minor == 0))
    throw DumpError(fmt::format("{}: {}: unsupported .npy version {}.{} (numpy writes 1.0, 2.0 and 3.0)", source, name,
                                major, minor));
  const std::size_t len_bytes = major == 1 ? 2 : 4;
  if (bytes.size() < kNpyMagicLen + len_bytes)
    throw DumpError(fmt::format("{}: {}: truncated .npy: {} bytes, too short for the header length of version {}.0",
                                source, name, bytes.size(), major));
  uint64_t hlen = 0;
  if (major == 1) {
    hlen = load<uint16_t>(bytes.data() + kNpyMagicLen, false);
  } else {
    hlen = load<uint32_t>(bytes.data() + kNpyMagicLen, false);
  }
  const uint64_t start = kNpyMagicLen + len_bytes;
  if (hlen > kMaxNpyHeaderBytes)
    throw DumpError(fmt::format("{}: {}: .npy header length {} exceeds numpy's limit of {} bytes", source, name, hlen,
                                kMaxNpyHeaderBytes));
  if (hlen > bytes.size() - start)
    throw DumpError(fmt::format("{}: {}: .npy header length {} runs past the end of the file ({} bytes)", source, name,
                                hlen, bytes.size()));
  const std::string_view text(c + start, static_cast<std::size_t>(hlen));
  NpyHeader h;
  HeaderDict(text, major <= 2, source, name).parse(h);
  h.data_offset = start + hlen;
  if (!element_count(h.shape, h.n_elements) ||
      __builtin_mul_overflow(h.n_elements, static_cast<uint64_t>(h.itemsize), &h.data_bytes))
    throw DumpError(fmt::format("{}: {}: shape ({}) holds more elements than 64-bit sizes can count", source, name,
                                fmt::join(h.shape, ", ")));
  return h;
}

/// A whole .npy file (or npz member) as an array.
DumpArray read_npy(std::span<const std::byte> bytes, std::string_view name, std::string_view source) {
  const NpyHeader h = parse_npy_header(bytes, source, name);
  const uint64_t have = bytes.size() - h.data_offset;
  if (have != h.data_bytes)
    throw DumpError(fmt::format("{}: {}: {} ({} bytes) with shape {} needs {} data bytes, the file has {} after its "
                                "{}-byte header{}",
                                source, name, to_string(h.dtype), h.itemsize, shape_text(h.shape), h.data_bytes, have,
                                h.data_offset, have < h.data_bytes ? " (truncated)" : " (trailing bytes)"));
  DumpArray a;
  a.name = std::string(name);
  a.dtype = h.dtype;
  a.shape = h.shape;
  a.values.resize(h.n_elements);
  const std::byte* data = bytes.data() + h.data_offset;
  const int64_t n = static_cast<int64_t>(h.n_elements);
  if (n == 0) return a;  // (the strides below could overflow for a shape like (0, 2^62, 2^62))
  if (!h.fortran_order || h.shape.size() < 2) {
    for (int64_t i = 0; i < n; ++i) a.values[i] = decode(h.dtype, data + i * h.itemsize, h.big_endian, i, source, name);
    return a;
  }
  // Fortran order: the file's element k has the first axis fastest; its C-order index is sum(idx[j] * cstride[j]).
  const std::size_t nd = h.shape.size();
  std::vector<int64_t> cstride(nd, 1), idx(nd, 0);
  for (std::size_t j = nd - 1; j > 0; --j) cstride[j - 1] = cstride[j] * h.shape[j];
  int64_t dest = 0;
  for (int64_t k = 0; k < n; ++k) {
    a.values[dest] = decode(h.dtype, data + k * h.itemsize, h.big_endian, dest, source, name);
    for (std::size_t j = 0; j < nd; ++j) {
      dest += cstride[j];
      if (++idx[j] < h.shape[j]) break;
      dest -= cstride[j] * idx[j];
      idx[j] = 0;
    }
  }
  return a;
}

// ---- libzip helpers ---------------------------------------------------------

struct ZipDiscard {
  void operator()(zip_t* z) const { zip_discard(z); }
};
struct ZipFileClose {
  void operator()(zip_file_t* f) const { zip_fclose(f); }
};
using ZipPtr = std::unique_ptr<zip_t, ZipDiscard>;
using ZipFilePtr = std::unique_ptr<zip_file_t, ZipFileClose>;

std::string zip_message(zip_error_t* e) { return zip_error_strerror(e); }

/// Reads up to `n` bytes (fewer only at the end of the member). Throws DumpError on a read error (CRC mismatch...).
uint64_t read_member(zip_file_t* f, std::byte* out, uint64_t n, std::string_view source, std::string_view name,
                     std::string_view member) {
  uint64_t got = 0;
  while (got < n) {
    const zip_int64_t r = zip_fread(f, out + got, n - got);
    if (r < 0)
      throw DumpError(fmt::format("{}: {}: member '{}': read error: {}", source, printable(name), member,
                                  zip_message(zip_file_get_error(f))));
    if (r == 0) break;
    got += static_cast<uint64_t>(r);
  }
  return got;
}

// ---- encoding -----------------------------------------------------------------

/// `v` rounded to float32 with round-to-odd: exact when `v` is a float, otherwise the float toward zero with its
/// last mantissa bit set. Rounding that result to binary16 or bfloat16 (nearest even) equals rounding `v` to them
/// directly (24 bits >= 11 + 2 and 8 + 2), which double -> float -> half (nearest twice) is not.
float to_f32_round_odd(double v) {
  if (!std::isfinite(v)) return static_cast<float>(v);
  float f = static_cast<float>(v);
  if (static_cast<double>(f) == v || !std::isfinite(f)) return f;
  if (std::fabs(static_cast<double>(f)) > std::fabs(v)) f = std::nextafter(f, 0.0f);
  return std::bit_cast<float>(std::bit_cast<uint32_t>(f) | 1u);
}

template <class T>
void store(std::string& out, T v) {
  char b[sizeof(T)];
  std::memcpy(b, &v, sizeof(T));
  out.append(b, sizeof(T));
}

/// Appends the elements of `a` in its dtype, little-endian. Throws InvalidArgument naming `what`, the array and the
/// element for a value the dtype cannot hold.
void append_elements(std::string& out, const DumpArray& a, std::string_view what) {
  auto bad = [&](std::size_t i, double v, std::string_view why) {
    throw InvalidArgument(fmt::format("{}: array '{}': element {} is {}, {} of dtype {}", what, a.name, i, v, why,
                                      to_string(a.dtype)));
  };
  auto integer = [&](std::size_t i, double v, double lo, double hi) {
    if (!(v == std::trunc(v))) bad(i, v, "not an integer");
    if (v < lo || v > hi) bad(i, v, "out of the range");
    return v;
  };
  for (std::size_t i = 0; i < a.values.size(); ++i) {
    const double v = a.values[i];
    switch (a.dtype) {
      case DumpDtype::f64: store(out, v); break;
      case DumpDtype::f32: store(out, static_cast<float>(v)); break;
      case DumpDtype::f16: store(out, f32_to_f16(to_f32_round_odd(v))); break;
      case DumpDtype::bf16: store(out, f32_to_bf16(to_f32_round_odd(v))); break;
      case DumpDtype::i64:
        store(out, static_cast<int64_t>(integer(i, v, -kMaxExactInteger, kMaxExactInteger)));
        break;
      case DumpDtype::i32: store(out, static_cast<int32_t>(integer(i, v, INT32_MIN, INT32_MAX))); break;
      case DumpDtype::i16: store(out, static_cast<int16_t>(integer(i, v, INT16_MIN, INT16_MAX))); break;
      case DumpDtype::i8: store(out, static_cast<int8_t>(integer(i, v, INT8_MIN, INT8_MAX))); break;
      case DumpDtype::u8: store(out, static_cast<uint8_t>(integer(i, v, 0, UINT8_MAX))); break;
      case DumpDtype::boolean:
        if (v != 0.0 && v != 1.0) bad(i, v, "not 0 or 1, the values");
        store(out, static_cast<uint8_t>(v));
        break;
    }
  }
}

void check_array(const DumpArray& a, std::string_view what) {
  if (a.name.empty()) throw InvalidArgument(fmt::format("{}: an array has an empty name", what));
  uint64_t n = 0;
  if (!element_count(a.shape, n))
    throw InvalidArgument(fmt::format("{}: array '{}': shape {} has a negative dimension or too many elements", what,
                                      a.name, shape_text(a.shape)));
  if (n != a.values.size())
    throw InvalidArgument(fmt::format("{}: array '{}': shape {} holds {} elements, values has {}", what, a.name,
                                      shape_text(a.shape), n, a.values.size()));
  if (a.shape.size() > kMaxNdim)
    throw InvalidArgument(fmt::format("{}: array '{}': {} dimensions, more than {}", what, a.name, a.shape.size(),
                                      kMaxNdim));
}

void check_unique_names(std::span<const DumpArray> arrays, std::string_view what) {
  std::set<std::string_view> names;
  for (const auto& a : arrays)
    if (!names.insert(a.name).second)
      throw InvalidArgument(fmt::format("{}: two arrays are named '{}'", what, a.name));
}

/// A safetensors dtype's DumpDtype; nullopt for the float8 types.
std::optional<DumpDtype> from_safetensors(SafetensorsDtype d) {
  switch (d) {
    case SafetensorsDtype::F64: return DumpDtype::f64;
    case SafetensorsDtype::F32: return DumpDtype::f32;
    case SafetensorsDtype::F16: return DumpDtype::f16;
    case SafetensorsDtype::BF16: return DumpDtype::bf16;
    case SafetensorsDtype::I64: return DumpDtype::i64;
    case SafetensorsDtype::I32: return DumpDtype::i32;
    case SafetensorsDtype::I16: return DumpDtype::i16;
    case SafetensorsDtype::I8: return DumpDtype::i8;
    case SafetensorsDtype::U8: return DumpDtype::u8;
    case SafetensorsDtype::BOOL: return DumpDtype::boolean;
    default: return std::nullopt;
  }
}

std::string_view safetensors_name(DumpDtype d) {
  switch (d) {
    case DumpDtype::f64: return "F64";
    case DumpDtype::f32: return "F32";
    case DumpDtype::f16: return "F16";
    case DumpDtype::bf16: return "BF16";
    case DumpDtype::i64: return "I64";
    case DumpDtype::i32: return "I32";
    case DumpDtype::i16: return "I16";
    case DumpDtype::i8: return "I8";
    case DumpDtype::u8: return "U8";
    case DumpDtype::boolean: return "BOOL";
  }
  return "?";
}

}  // namespace

// ---- public API ------------------------------------------------------------------

std::string_view to_string(DumpDtype dtype) { return info(dtype).name; }
bool is_floating(DumpDtype dtype) {
  return dtype == DumpDtype::f64 || dtype == DumpDtype::f32 || dtype == DumpDtype::f16 || dtype == DumpDtype::bf16;
}

int64_t DumpArray::n_elements() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

TensorDump TensorDump::open(const std::filesystem::path& path) {
  MappedFile mapped(path);
  const auto bytes = mapped.bytes();
  const std::string_view head(reinterpret_cast<const char*>(bytes.data()), std::min<std::size_t>(bytes.size(), 6));
  if (head == kNpyMagic) return parse_npy(bytes, path.stem().string(), path.string());
  if (head.substr(0, 4) == std::string_view("PK\x03\x04", 4) || head.substr(0, 4) == std::string_view("PK\x05\x06", 4))
    return parse_npz(bytes, path.string());
  try {
    return parse_safetensors(bytes, path.string());
  } catch (const DumpError& e) {
    throw DumpError(fmt::format("{} (the file starts with neither .npy's \\x93NUMPY nor a zip archive's PK, so it was "
                                "read as safetensors)",
                                e.what()));
  }
}

TensorDump TensorDump::parse_npy(std::span<const std::byte> bytes, std::string_view name, std::string_view source) {
  TensorDump d;
  d.source_ = std::string(source);
  d.arrays_.push_back(read_npy(bytes, name, source));
  return d;
}

TensorDump TensorDump::parse_npz(std::span<const std::byte> bytes, std::string_view source) {
  TensorDump d;
  d.source_ = std::string(source);
  const std::string src(source);
  zip_error_t err;
  zip_error_init(&err);
  zip_source_t* zs = zip_source_buffer_create(bytes.data(), bytes.size(), 0, &err);
  if (zs == nullptr) {
    const std::string m = zip_message(&err);
    zip_error_fini(&err);
    throw DumpError(fmt::format("{}: cannot read the zip archive: {}", src, m));
  }
  // ZIP_CHECKCONS: the local headers must agree with the central directory. A name there twice fails that check
  // (ZIP_ER_EXISTS); opened again without it, the loop below names the member. A successful open takes over the
  // source; after a failed one it is still ours.
  ZipPtr za(zip_open_from_source(zs, ZIP_RDONLY | ZIP_CHECKCONS, &err));
  if (!za && zip_error_code_zip(&err) == ZIP_ER_EXISTS) {
    zip_error_fini(&err);
    zip_error_init(&err);
    za.reset(zip_open_from_source(zs, ZIP_RDONLY, &err));
  }
  if (!za) {
    zip_source_free(zs);
    const std::string m = zip_message(&err);
    zip_error_fini(&err);
    throw DumpError(fmt::format("{}: not a valid .npz (zip) archive: {}", src, m));
  }
  zip_error_fini(&err);
  // First the zip directory alone: names, methods and declared sizes of every member, before any is inflated.
  struct Member {
    zip_uint64_t index;
    std::string name, shown;
    uint64_t size;
  };
  std::vector<Member> members;
  const zip_int64_t count = zip_get_num_entries(za.get(), 0);
  uint64_t total = 0;
  std::set<std::string> names;
  for (zip_int64_t i = 0; i < count; ++i) {
    zip_stat_t st;
    zip_stat_init(&st);
    if (zip_stat_index(za.get(), static_cast<zip_uint64_t>(i), 0, &st) != 0)
      throw DumpError(fmt::format("{}: member {}: cannot stat: {}", src, i, zip_message(zip_get_error(za.get()))));
    const std::string member = (st.valid & ZIP_STAT_NAME) && st.name != nullptr ? st.name : fmt::format("#{}", i);
    const std::string shown = printable(member);
    if (member.size() < 5 || !member.ends_with(".npy"))
      throw DumpError(fmt::format("{}: member '{}' is not a .npy array (an .npz holds only <name>.npy members)", src,
                                  shown));
    const std::string name = member.substr(0, member.size() - 4);
    if (!names.insert(name).second)
      throw DumpError(fmt::format("{}: {}: member '{}' appears twice in the archive", src, printable(name), shown));
    if (!(st.valid & ZIP_STAT_SIZE))
      throw DumpError(fmt::format("{}: {}: member '{}' has no uncompressed size", src, printable(name), shown));
    if ((st.valid & ZIP_STAT_ENCRYPTION_METHOD) && st.encryption_method != ZIP_EM_NONE)
      throw DumpError(fmt::format("{}: {}: member '{}' is encrypted", src, printable(name), shown));
    if ((st.valid & ZIP_STAT_COMP_METHOD) && st.comp_method != ZIP_CM_STORE && st.comp_method != ZIP_CM_DEFLATE)
      throw DumpError(fmt::format("{}: {}: member '{}' uses compression method {} (numpy writes stored (0) or deflate "
                                  "(8))",
                                  src, printable(name), shown, st.comp_method));
    if (st.size > kMaxDumpMemberBytes)
      throw DumpError(fmt::format("{}: {}: member '{}' declares {} uncompressed bytes, more than the limit of {} bytes",
                                  src, printable(name), shown, st.size, kMaxDumpMemberBytes));
    total += st.size;  // each at most 2^30: no overflow below 2^33 members
    if (total > kMaxDumpMemberBytes)
      throw DumpError(fmt::format("{}: {}: member '{}' declares {} uncompressed bytes; with the members before it the "
                                  "archive's arrays would total {} bytes, more than the limit of {} bytes",
                                  src, printable(name), shown, st.size, total, kMaxDumpMemberBytes));
    members.push_back({static_cast<zip_uint64_t>(i), name, shown, st.size});
  }
  for (const auto& m : members) {
    const std::string& name = m.name;
    const std::string& shown = m.shown;
    const uint64_t size = m.size;
    ZipFilePtr f(zip_fopen_index(za.get(), m.index, 0));
    if (!f)
      throw DumpError(fmt::format("{}: {}: cannot open member '{}': {}", src, printable(name), shown,
                                  zip_message(zip_get_error(za.get()))));
    // The array header first (at most 12 + kMaxNpyHeaderBytes bytes): its shape and dtype must account for the
    // declared size exactly before the member is read whole.
    std::vector<std::byte> buf(static_cast<std::size_t>(std::min<uint64_t>(size, 12 + kMaxNpyHeaderBytes)));
    const uint64_t got_head = read_member(f.get(), buf.data(), buf.size(), src, name, shown);
    if (got_head < buf.size())
      throw DumpError(fmt::format("{}: {}: member '{}' declares {} bytes but holds only {}", src, printable(name),
                                  shown, size, got_head));
    const NpyHeader h = parse_npy_header(buf, src, name);
    uint64_t need = 0;
    if (__builtin_add_overflow(h.data_offset, h.data_bytes, &need) || need != size)
      throw DumpError(fmt::format("{}: {}: member '{}' declares {} bytes, but its header ({} bytes) says {} {} of "
                                  "data: {} bytes",
                                  src, printable(name), shown, size, h.data_offset, to_string(h.dtype),
                                  shape_text(h.shape), h.data_offset + h.data_bytes));
    const std::size_t head = buf.size();
    buf.resize(static_cast<std::size_t>(size));
    const uint64_t got = head + read_member(f.get(), buf.data() + head, size - head, src, name, shown);
    if (got != size)
      throw DumpError(fmt::format("{}: {}: member '{}' declares {} bytes but holds only {}", src, printable(name),
                                  shown, size, got));
    std::byte extra{};
    if (read_member(f.get(), &extra, 1, src, name, shown) != 0)
      throw DumpError(fmt::format("{}: {}: member '{}' holds more than the {} bytes it declares", src, printable(name),
                                  shown, size));
    d.arrays_.push_back(read_npy(buf, name, src));
  }
  return d;
}

TensorDump TensorDump::parse_safetensors(std::span<const std::byte> bytes, std::string_view source) {
  TensorDump d;
  d.source_ = std::string(source);
  try {
    const SafetensorsFile f = SafetensorsFile::parse(bytes, source);
    for (const auto& t : f.tensors()) {
      const auto dtype = from_safetensors(t.dtype);
      if (!dtype)
        throw DumpError(fmt::format("{}: {}: dtype {} is not a dump dtype (F64, F32, F16, BF16, I64, I32, I16, I8, U8, "
                                    "BOOL)",
                                    source, t.name, to_string(t.dtype)));
      DumpArray a;
      a.name = t.name;
      a.dtype = *dtype;
      a.shape = t.shape;
      const auto data = f.data(t);
      const int size = info(*dtype).size;
      const int64_t n = t.n_elements();
      a.values.resize(static_cast<std::size_t>(n));
      for (int64_t i = 0; i < n; ++i) a.values[i] = decode(*dtype, data.data() + i * size, false, i, source, t.name);
      d.arrays_.push_back(std::move(a));
    }
  } catch (const CheckpointError& e) {
    throw DumpError(e.what());
  }
  return d;
}

void TensorDump::merge(TensorDump other) {
  for (const auto& a : other.arrays_)
    if (find(a.name) != nullptr)
      throw DumpError(fmt::format("{} and {}: {}: the array is in both (got two arrays named '{}')", source_,
                                  other.source_, a.name, a.name));
  if (source_.empty())
    source_ = other.source_;
  else if (!other.source_.empty())
    source_ += " + " + other.source_;
  for (auto& a : other.arrays_) arrays_.push_back(std::move(a));
}

const DumpArray* TensorDump::find(std::string_view name) const {
  for (const auto& a : arrays_)
    if (a.name == name) return &a;
  return nullptr;
}

const DumpArray& TensorDump::get(std::string_view name) const {
  if (const auto* a = find(name)) return *a;
  std::vector<std::string_view> names;
  for (const auto& a : arrays_) names.push_back(a.name);
  throw DumpError(fmt::format("{}: no array '{}' (has: {})", source_, name, fmt::join(names, ", ")));
}

std::vector<std::byte> encode_npy(const DumpArray& array) {
  check_array(array, "encode_npy");
  if (array.dtype == DumpDtype::bf16)
    throw InvalidArgument(fmt::format("encode_npy: array '{}' is bf16, which numpy has no dtype for: write it with "
                                      "write_dump_safetensors",
                                      array.name));
  // numpy 1.24's _write_array_header: keys sorted, repr of each value, ", " after each, then spaces for the
  // first axis to grow to 21 digits, then padding to 64 bytes ending in '\n'.
  std::string shape;
  if (array.shape.empty())
    shape = "()";
  else if (array.shape.size() == 1)
    shape = fmt::format("({},)", array.shape[0]);
  else
    shape = fmt::format("({})", fmt::join(array.shape, ", "));
  std::string header = fmt::format("{{'descr': '{}', 'fortran_order': False, 'shape': {}, }}", info(array.dtype).npy,
                                   shape);
  if (!array.shape.empty()) header.append(21 - std::min<std::size_t>(21, std::to_string(array.shape[0]).size()), ' ');
  uint64_t hlen = header.size() + 1;
  int major = 1;
  std::size_t prefix = kNpyMagicLen + 2;
  if (hlen + 64 > 65535) {
    major = 2;
    prefix = kNpyMagicLen + 4;
  }
  const uint64_t pad = 64 - (prefix + hlen) % 64;
  header.append(pad, ' ');
  header += '\n';
  std::string out(kNpyMagic);
  out += static_cast<char>(major);
  out += '\0';
  if (major == 1)
    store(out, static_cast<uint16_t>(header.size()));
  else
    store(out, static_cast<uint32_t>(header.size()));
  out += header;
  append_elements(out, array, "encode_npy");
  std::vector<std::byte> bytes(out.size());
  std::memcpy(bytes.data(), out.data(), out.size());
  return bytes;
}

void write_npy(const std::filesystem::path& path, const DumpArray& array) {
  const auto bytes = encode_npy(array);
  write_file_atomic(path, std::string_view(reinterpret_cast<const char*>(bytes.data()), bytes.size()));
}

void write_npz(const std::filesystem::path& path, std::span<const DumpArray> arrays) {
  check_unique_names(arrays, "write_npz");
  std::vector<std::vector<std::byte>> members;
  members.reserve(arrays.size());
  for (const auto& a : arrays) members.push_back(encode_npy(a));
  if (arrays.empty()) {
    // An archive with no members: the 22-byte end-of-central-directory record alone, as numpy.savez (zipfile)
    // writes it; libzip removes an archive with no entries instead of writing one.
    std::string eocd("PK\x05\x06", 4);
    eocd.append(18, '\0');
    write_file_atomic(path, eocd);
    return;
  }
  const std::string where = path.string();
  zip_error_t err;
  zip_error_init(&err);
  zip_source_t* buffer = zip_source_buffer_create(nullptr, 0, 0, &err);
  if (buffer == nullptr) {
    const std::string m = zip_message(&err);
    zip_error_fini(&err);
    throw IoError(fmt::format("{}: cannot create a zip buffer: {}", where, m));
  }
  zip_source_keep(buffer);  // kept past zip_close, to read the archive's bytes from
  struct SourceFree {
    zip_source_t* s;
    ~SourceFree() { zip_source_free(s); }
  } keep{buffer};
  zip_t* za = zip_open_from_source(buffer, ZIP_TRUNCATE, &err);
  if (za == nullptr) {
    const std::string m = zip_message(&err);
    zip_error_fini(&err);
    throw IoError(fmt::format("{}: cannot create a zip archive: {}", where, m));
  }
  zip_error_fini(&err);
  ZipPtr owner(za);
  // A fixed time stamp (2000-01-01 00:00:00 UTC): the same arrays give the same bytes.
  constexpr time_t kMtime = 946684800;
  for (std::size_t i = 0; i < arrays.size(); ++i) {
    auto fail = [&](std::string_view what) {
      throw IoError(fmt::format("{}: {}: {}: {}", where, arrays[i].name, what, zip_message(zip_get_error(za))));
    };
    zip_source_t* s = zip_source_buffer(za, members[i].data(), members[i].size(), 0);
    if (s == nullptr) fail("cannot add the member");
    const std::string member = arrays[i].name + ".npy";
    const zip_int64_t idx = zip_file_add(za, member.c_str(), s, ZIP_FL_ENC_UTF_8);
    if (idx < 0) {
      zip_source_free(s);
      fail("cannot add the member");
    }
    if (zip_set_file_compression(za, static_cast<zip_uint64_t>(idx), ZIP_CM_STORE, 0) != 0) fail("cannot store");
    if (zip_file_set_mtime(za, static_cast<zip_uint64_t>(idx), kMtime, 0) != 0) fail("cannot set the time");
  }
  if (zip_close(za) != 0) {
    const std::string m = zip_message(zip_get_error(za));
    throw IoError(fmt::format("{}: cannot write the zip archive: {}", where, m));
  }
  owner.release();  // zip_close freed it
  if (zip_source_open(buffer) != 0)
    throw IoError(fmt::format("{}: cannot read the zip buffer: {}", where, zip_message(zip_source_error(buffer))));
  std::string out;
  char chunk[1 << 16];
  while (true) {
    const zip_int64_t r = zip_source_read(buffer, chunk, sizeof chunk);
    if (r < 0) {
      zip_source_close(buffer);
      throw IoError(fmt::format("{}: cannot read the zip buffer: {}", where, zip_message(zip_source_error(buffer))));
    }
    if (r == 0) break;
    out.append(chunk, static_cast<std::size_t>(r));
  }
  zip_source_close(buffer);
  write_file_atomic(path, out);
}

void write_dump_safetensors(const std::filesystem::path& path, std::span<const DumpArray> arrays) {
  check_unique_names(arrays, "write_dump_safetensors");
  std::vector<const DumpArray*> sorted;
  for (const auto& a : arrays) {
    check_array(a, "write_dump_safetensors");
    if (a.name == "__metadata__")
      throw InvalidArgument("write_dump_safetensors: an array cannot be named '__metadata__' (safetensors' metadata key)");
    sorted.push_back(&a);
  }
  std::sort(sorted.begin(), sorted.end(), [](const auto* a, const auto* b) { return a->name < b->name; });
  nlohmann::json header = nlohmann::json::object();
  std::string data;
  for (const auto* a : sorted) {
    const std::size_t begin = data.size();
    append_elements(data, *a, "write_dump_safetensors");
    header[a->name] = {{"dtype", safetensors_name(a->dtype)}, {"shape", a->shape}, {"data_offsets", {begin, data.size()}}};
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // the data section 8-byte aligned, as safetensors writes it
  std::string out;
  store(out, static_cast<uint64_t>(text.size()));
  out += text;
  out += data;
  write_file_atomic(path, out);
}

}  // namespace posenc
