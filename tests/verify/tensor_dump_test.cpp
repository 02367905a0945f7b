// Tensor dumps (include/posenc/tensor_dump.hpp): files numpy wrote (tests/data/dumps, from
// tools/refs/make_dump_reference.py) read value for value, np.save's bytes reproduced by
// encode_npy, round trips through the writers (and numpy reading what they write), and bad
// input: each a DumpError naming the file, the array and the value.
#include "posenc/tensor_dump.hpp"

#include <gtest/gtest.h>

#include <bit>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <iostream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "posenc/error.hpp"
#include "posenc/float16.hpp"
#include "posenc/io.hpp"
#include "test_support.hpp"

namespace POSENC_UNITY_ID {  // this file's own namespace in the tests' unity build (CMakeLists.txt)

using namespace posenc;
using posenc::test::message_of;
using posenc::test::TempDir;
using json = nlohmann::json;

namespace {

std::filesystem::path data_dir() { return std::filesystem::path(POSENC_SOURCE_DIR) / "tests/data/dumps"; }
const json& reference() {
  static const json r = json::parse(read_file(data_dir() / "reference.json"));
  return r;
}
bool have_numpy() { return std::system("/usr/bin/python3 -c 'import numpy' >/dev/null 2>&1") == 0; }

std::span<const std::byte> bytes_of(const std::string& s) { return std::as_bytes(std::span(s.data(), s.size())); }
std::string string_of(const std::vector<std::byte>& b) { return std::string(reinterpret_cast<const char*>(b.data()), b.size()); }

/// The dtype a numpy descr reads as.
DumpDtype dtype_of_descr(const std::string& descr) {
  const std::string t = descr.substr(1);
  if (t == "f8") return DumpDtype::f64;
  if (t == "f4") return DumpDtype::f32;
  if (t == "f2") return DumpDtype::f16;
  if (t == "i8") return DumpDtype::i64;
  if (t == "i4") return DumpDtype::i32;
  if (t == "i2") return DumpDtype::i16;
  if (t == "i1") return DumpDtype::i8;
  if (t == "u1") return DumpDtype::u8;
  if (t == "b1") return DumpDtype::boolean;
  throw std::runtime_error("descr " + descr);
}

/// `got` equals the reference value (a number, or "nan", "inf", "-inf"); -0.0 keeps its sign.
::testing::AssertionResult same_value(double got, const json& want) {
  if (want.is_string()) {
    const auto& s = want.get_ref<const std::string&>();
    if (s == "nan" ? std::isnan(got) : s == "inf" ? got == INFINITY : s == "-inf" ? got == -INFINITY : false)
      return ::testing::AssertionSuccess();
    return ::testing::AssertionFailure() << "got " << got << ", want " << s;
  }
  const double w = want.get<double>();
  if (std::bit_cast<uint64_t>(got) == std::bit_cast<uint64_t>(w)) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "got " << got << ", want " << w;
}

void expect_matches_reference(const DumpArray& a, const json& want, const std::string& where) {
  SCOPED_TRACE(where + ": " + a.name);
  EXPECT_EQ(a.name, want["name"].get<std::string>());
  EXPECT_EQ(a.dtype, dtype_of_descr(want["descr"].get<std::string>()));
  EXPECT_EQ(a.shape, want["shape"].get<std::vector<int64_t>>());
  const auto& values = want["values"];
  ASSERT_EQ(a.values.size(), values.size());
  EXPECT_EQ(a.n_elements(), static_cast<int64_t>(values.size()));
  for (std::size_t i = 0; i < values.size(); ++i) EXPECT_TRUE(same_value(a.values[i], values[i])) << "element " << i;
}

/// The message of the DumpError f() throws, checked to contain every one of `parts`.
template <class F>
void expect_dump_error(F&& f, std::initializer_list<std::string> parts) {
  const std::string m = message_of<DumpError>(f);
  for (const auto& p : parts) EXPECT_NE(m.find(p), std::string::npos) << "message lacks '" << p << "': " << m;
}

/// A .npy file with this header text (padded to 64 bytes and '\n' as numpy does) and data.
std::string npy(const std::string& dict, const std::string& data, int major = 1) {
  std::string header = dict;
  const std::size_t prefix = major == 1 ? 10 : 12;
  header.append(63 - (prefix + header.size()) % 64, ' ');
  header += '\n';
  std::string out = "\x93NUMPY";
  out += static_cast<char>(major);
  out += '\0';
  const uint32_t n = static_cast<uint32_t>(header.size());
  out.append(reinterpret_cast<const char*>(&n), major == 1 ? 2 : 4);
  return out + header + data;
}
template <class T>
std::string raw(std::initializer_list<T> v) {
  std::string s;
  for (T x : v) s.append(reinterpret_cast<const char*>(&x), sizeof x);
  return s;
}
TensorDump parse_npy(const std::string& file, std::string_view name = "x") {
  return TensorDump::parse_npy(bytes_of(file), name, "bad.npy");
}

// ---- a minimal zip writer, for archives libzip would not write --------------------------------

uint32_t crc32(std::string_view s) {
  uint32_t c = 0xffffffffu;
  for (unsigned char b : s) {
    c ^= b;
    for (int k = 0; k < 8; ++k) c = (c >> 1) ^ (0xedb88320u & (0u - (c & 1u)));
  }
  return ~c;
}
struct ZipMember {
  std::string name;
  uint16_t method = 0;        // 0 stored, 8 deflate
  std::string data;           // as stored (compressed for method 8)
  uint32_t crc = 0;
  uint32_t uncompressed = 0;  // declared size
};
ZipMember stored(const std::string& name, const std::string& content) {
  return {name, 0, content, crc32(content), static_cast<uint32_t>(content.size())};
}
template <class T>
void put(std::string& s, T v) {
  s.append(reinterpret_cast<const char*>(&v), sizeof v);
}
std::string zip(const std::vector<ZipMember>& members) {
  std::string out, central;
  for (const auto& m : members) {
    const uint32_t offset = static_cast<uint32_t>(out.size());
    put<uint32_t>(out, 0x04034b50);
    put<uint16_t>(out, 20);
    put<uint16_t>(out, 0);
    put<uint16_t>(out, m.method);
    put<uint16_t>(out, 0);
    put<uint16_t>(out, 0x21);  // 1980-01-01
    put<uint32_t>(out, m.crc);
    put<uint32_t>(out, static_cast<uint32_t>(m.data.size()));
    put<uint32_t>(out, m.uncompressed);
    put<uint16_t>(out, static_cast<uint16_t>(m.name.size()));
    put<uint16_t>(out, 0);
    out += m.name;
    out += m.data;
    put<uint32_t>(central, 0x02014b50);
    put<uint16_t>(central, 20);
    put<uint16_t>(central, 20);
    put<uint16_t>(central, 0);
    put<uint16_t>(central, m.method);
    put<uint16_t>(central, 0);
    put<uint16_t>(central, 0x21);
    put<uint32_t>(central, m.crc);
    put<uint32_t>(central, static_cast<uint32_t>(m.data.size()));
    put<uint32_t>(central, m.uncompressed);
    put<uint16_t>(central, static_cast<uint16_t>(m.name.size()));
    put<uint16_t>(central, 0);
    put<uint16_t>(central, 0);
    put<uint16_t>(central, 0);
    put<uint16_t>(central, 0);
    put<uint32_t>(central, 0);
    put<uint32_t>(central, offset);
    central += m.name;
  }
  const uint32_t cd_offset = static_cast<uint32_t>(out.size());
  out += central;
  put<uint32_t>(out, 0x06054b50);
  put<uint16_t>(out, 0);
  put<uint16_t>(out, 0);
  put<uint16_t>(out, static_cast<uint16_t>(members.size()));
  put<uint16_t>(out, static_cast<uint16_t>(members.size()));
  put<uint32_t>(out, static_cast<uint32_t>(central.size()));
  put<uint32_t>(out, cd_offset);
  put<uint16_t>(out, 0);
  return out;
}

/// A raw deflate stream (RFC 1951, one block with the fixed Huffman codes) of `prefix` followed by
/// 1 + 258 * n_matches zero bytes: each run of 258 zeros is one length-258, distance-1 match, 13
/// bits: a deflate bomb.
std::string deflate_bomb(const std::string& prefix, uint64_t n_matches) {
  std::string out;
  uint32_t acc = 0;
  int nbits = 0;
  auto bits_lsb = [&](uint32_t v, int n) {  // a data element: least significant bit first
    for (int i = 0; i < n; ++i) {
      acc |= ((v >> i) & 1u) << nbits;
      if (++nbits == 8) {
        out += static_cast<char>(acc);
        acc = 0;
        nbits = 0;
      }
    }
  };
  auto code = [&](uint32_t c, int n) {  // a Huffman code: most significant bit first
    for (int i = n - 1; i >= 0; --i) bits_lsb((c >> i) & 1u, 1);
  };
  auto literal = [&](unsigned char b) {
    if (b < 144)
      code(0x30 + b, 8);
    else
      code(0x190 + (b - 144), 9);
  };
  bits_lsb(1, 1);  // BFINAL
  bits_lsb(1, 2);  // BTYPE 01: fixed Huffman codes
  for (unsigned char b : prefix) literal(b);
  literal(0);
  for (uint64_t i = 0; i < n_matches; ++i) {
    code(0xc0 + 5, 8);  // length code 285: 258
    code(0, 5);         // distance code 0: 1
  }
  code(0, 7);  // end of block (256)
  if (nbits > 0) out += static_cast<char>(acc);
  return out;
}

DumpArray array(std::string name, DumpDtype dtype, std::vector<int64_t> shape, std::vector<double> values) {
  DumpArray a;
  a.name = std::move(name);
  a.dtype = dtype;
  a.shape = std::move(shape);
  a.values = std::move(values);
  return a;
}

/// An array of every dtype with values each holds exactly (edges included).
std::vector<DumpArray> every_dtype(bool with_bf16) {
  std::vector<DumpArray> v = {
      array("f64", DumpDtype::f64, {2, 3}, {0.1, -1e300, 5e-324, -0.0, INFINITY, NAN}),
      array("f32", DumpDtype::f32, {3}, {0.5f, std::bit_cast<float>(1u), -INFINITY}),
      array("f16", DumpDtype::f16, {2, 2}, {65504.0, -std::ldexp(1.0, -24), 0.333251953125, NAN}),
      array("i64", DumpDtype::i64, {4}, {9007199254740992.0, -9007199254740992.0, 0, -1}),
      array("i32", DumpDtype::i32, {2}, {-2147483648.0, 2147483647.0}),
      array("i16", DumpDtype::i16, {2}, {-32768, 32767}),
      array("i8", DumpDtype::i8, {1, 2}, {-128, 127}),
      array("u8", DumpDtype::u8, {2}, {0, 255}),
      array("b1", DumpDtype::boolean, {3}, {1, 0, 1}),
      array("scalar", DumpDtype::f32, {}, {2.75}),
      array("empty", DumpDtype::i64, {0, 4}, {}),
  };
  if (with_bf16) v.push_back(array("bf16", DumpDtype::bf16, {3}, {1.0078125, -3.140625, -INFINITY}));
  return v;
}

void expect_same_arrays(const std::vector<DumpArray>& got, const std::vector<DumpArray>& want) {
  ASSERT_EQ(got.size(), want.size());
  for (std::size_t k = 0; k < want.size(); ++k) {
    SCOPED_TRACE(want[k].name);
    EXPECT_EQ(got[k].name, want[k].name);
    EXPECT_EQ(got[k].dtype, want[k].dtype);
    EXPECT_EQ(got[k].shape, want[k].shape);
    ASSERT_EQ(got[k].values.size(), want[k].values.size());
    for (std::size_t i = 0; i < want[k].values.size(); ++i) {
      const double g = got[k].values[i], w = want[k].values[i];
      EXPECT_TRUE(std::isnan(w) ? std::isnan(g) : std::bit_cast<uint64_t>(g) == std::bit_cast<uint64_t>(w))
          << "element " << i << ": got " << g << ", want " << w;
    }
  }
}

}  // namespace

// ---- files numpy wrote ----------------------------------------------------------------------

TEST(TensorDumpNumpy, ReadsEveryValueOfNumpysFiles) {
  const auto& files = reference()["files"];
  ASSERT_GE(files.size(), 24u);
  int fortran = 0, big_endian = 0, scalars = 0, npz_members = 0;
  for (const auto& f : files) {
    const std::string name = f["file"].get<std::string>();
    const auto dump = TensorDump::open(data_dir() / name);
    EXPECT_EQ(dump.source(), (data_dir() / name).string());
    const auto& want = f["arrays"];
    ASSERT_EQ(dump.arrays().size(), want.size()) << name;
    for (std::size_t i = 0; i < want.size(); ++i) {
      expect_matches_reference(dump.arrays()[i], want[i], name);  // in file order
      fortran += want[i]["fortran_order"].get<bool>();
      big_endian += want[i]["descr"].get<std::string>()[0] == '>';
      scalars += want[i]["shape"].empty();
      EXPECT_EQ(&dump.get(want[i]["name"].get<std::string>()), &dump.arrays()[i]);
    }
    if (f["kind"] == "npz") npz_members += static_cast<int>(want.size());
  }
  EXPECT_EQ(fortran, 3);      // f32_fortran, i32_fortran, cos in dump_compressed.npz
  EXPECT_EQ(big_endian, 7);   // six .npy files and k_be
  EXPECT_EQ(scalars, 2);
  EXPECT_EQ(npz_members, 9);
  // One value of each reordered array, spelled out: numpy's [1, 2, 3] of arange(24).reshape(2, 3, 4) * 0.25 - 1.
  const auto f = TensorDump::open(data_dir() / "f32_fortran.npy").get("f32_fortran");
  EXPECT_EQ(f.values[1 * 12 + 2 * 4 + 3], 23 * 0.25 - 1);
  const auto i = TensorDump::open(data_dir() / "i32_fortran.npy").get("i32_fortran");
  EXPECT_EQ(i.values, (std::vector<double>{1, 2, 3, 4, 5, 6}));
}

// np.save's files, read and encoded again, are the same bytes (version 1.0, little-endian, C order).
TEST(TensorDumpNumpy, EncodeNpyMatchesNpSaveByteForByte) {
  int checked = 0;
  for (const auto& f : reference()["files"]) {
    if (f["kind"] != "npy" || !f["canonical"].get<bool>()) continue;
    const auto path = data_dir() / f["file"].get<std::string>();
    const auto dump = TensorDump::open(path);
    ASSERT_EQ(dump.arrays().size(), 1u);
    EXPECT_EQ(string_of(encode_npy(dump.arrays()[0])), read_file(path)) << path;
    ++checked;
  }
  EXPECT_EQ(checked, 12);
}

// The committed files re-derived by their script (numpy needed): .npy files byte for byte, the
// values, and every npz member's bytes (the archives' time stamps differ from run to run).
TEST(TensorDumpNumpy, ScriptReproducesTheCommittedFiles) {
  if (!have_numpy()) GTEST_SKIP() << "/usr/bin/python3 with numpy is not installed (Debian python3-numpy)";
  TempDir d;
  const std::string cmd = "/usr/bin/python3 '" + (posenc::test::refs_dir() / "make_dump_reference.py").string() +
                          "' '" + d.path().string() + "'";
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  json fresh = json::parse(read_file(d.path() / "reference.json")), committed = reference();
  if (fresh["numpy_version"] != committed["numpy_version"])
    std::cerr << "note: committed with numpy " << committed["numpy_version"] << ", re-derived with "
              << fresh["numpy_version"] << "\n";
  for (auto* j : {&fresh, &committed}) {
    j->erase("numpy_version");
    j->erase("python_version");
  }
  EXPECT_EQ(fresh, committed);
  int compared = 0;
  for (const auto& f : committed["files"]) {
    const std::string name = f["file"].get<std::string>();
    if (f["kind"] == "npy") {
      EXPECT_EQ(read_file(d.path() / name), read_file(data_dir() / name)) << name;
      ++compared;
    }
    // The fresh archive reads as the committed one.
    const auto a = TensorDump::open(d.path() / name), b = TensorDump::open(data_dir() / name);
    expect_same_arrays(a.arrays(), b.arrays());
  }
  EXPECT_EQ(compared, 22);
}

// numpy reads what the writers write: np.load of our .npy and .npz, and a safetensors file parsed
// with Python's struct/json and numpy's frombuffer (bf16: the bits shifted up by 16).
TEST(TensorDumpNumpy, NumpyReadsWhatTheWritersWrite) {
  if (!have_numpy()) GTEST_SKIP() << "/usr/bin/python3 with numpy is not installed (Debian python3-numpy)";
  TempDir d;
  const auto npy_arrays = every_dtype(false), st_arrays = every_dtype(true);
  write_npz(d.path() / "all.npz", npy_arrays);
  write_npy(d.path() / "f16.npy", npy_arrays[2]);
  write_dump_safetensors(d.path() / "all.safetensors", st_arrays);
  const std::string script = R"PY(
import json, struct, sys, numpy as np
def vals(a):
    return [repr(float(x)) for x in np.asarray(a, dtype=np.float64).ravel()]
out = {}
with np.load(sys.argv[1]) as z:
    out["npz"] = [[k, z[k].dtype.str, list(z[k].shape), vals(z[k])] for k in z.files]
a = np.load(sys.argv[2])
out["npy"] = [a.dtype.str, list(a.shape), vals(a)]
raw = open(sys.argv[3], "rb").read()
(n,) = struct.unpack("<Q", raw[:8])
h = json.loads(raw[8:8 + n])
np_types = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "I64": "<i8", "I32": "<i4", "I16": "<i2", "I8": "|i1",
            "U8": "|u1", "BOOL": "|b1"}
st = []
for k in sorted(h):
    b, e = h[k]["data_offsets"]
    buf = raw[8 + n + b:8 + n + e]
    if h[k]["dtype"] == "BF16":
        x = (np.frombuffer(buf, dtype="<u2").astype(np.uint32) << 16).view(np.float32)
    else:
        x = np.frombuffer(buf, dtype=np_types[h[k]["dtype"]])
    st.append([k, h[k]["dtype"], h[k]["shape"], vals(x)])
out["safetensors"] = st
out["safetensors_header_bytes"] = n
print(json.dumps(out))
)PY";
  const auto script_path = d.file("read.py", script);
  const auto out = d.path() / "out.json";
  const std::string cmd = "/usr/bin/python3 '" + script_path.string() + "' '" + (d.path() / "all.npz").string() +
                          "' '" + (d.path() / "f16.npy").string() + "' '" + (d.path() / "all.safetensors").string() +
                          "' > '" + out.string() + "'";
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  const json r = json::parse(read_file(out));
  auto expect_values = [](const json& got, const DumpArray& want) {
    ASSERT_EQ(got.size(), want.values.size()) << want.name;
    for (std::size_t i = 0; i < got.size(); ++i) {
      const double g = std::strtod(got[i].get<std::string>().c_str(), nullptr), w = want.values[i];
      EXPECT_TRUE(std::isnan(w) ? std::isnan(g) : std::bit_cast<uint64_t>(g) == std::bit_cast<uint64_t>(w))
          << want.name << "[" << i << "]: numpy read " << g << ", written " << w;
    }
  };
  const std::vector<std::string> descr = {"<f8", "<f4", "<f2", "<i8", "<i4", "<i2", "|i1", "|u1", "|b1", "<f4", "<i8"};
  ASSERT_EQ(r["npz"].size(), npy_arrays.size());
  for (std::size_t k = 0; k < npy_arrays.size(); ++k) {
    EXPECT_EQ(r["npz"][k][0], npy_arrays[k].name);  // members in the order given
    EXPECT_EQ(r["npz"][k][1], descr[k]);
    EXPECT_EQ(r["npz"][k][2].get<std::vector<int64_t>>(), npy_arrays[k].shape);
    expect_values(r["npz"][k][3], npy_arrays[k]);
  }
  EXPECT_EQ(r["npy"][0], "<f2");
  expect_values(r["npy"][2], npy_arrays[2]);
  ASSERT_EQ(r["safetensors"].size(), st_arrays.size());
  EXPECT_EQ(r["safetensors_header_bytes"].get<int>() % 8, 0);
  auto sorted = st_arrays;
  std::sort(sorted.begin(), sorted.end(), [](const auto& a, const auto& b) { return a.name < b.name; });
  for (std::size_t k = 0; k < sorted.size(); ++k) {
    EXPECT_EQ(r["safetensors"][k][0], sorted[k].name);
    EXPECT_EQ(r["safetensors"][k][2].get<std::vector<int64_t>>(), sorted[k].shape);
    expect_values(r["safetensors"][k][3], sorted[k]);
  }
}

// ---- round trips ------------------------------------------------------------------------------

TEST(TensorDumpRoundTrip, NpyNpzAndSafetensorsKeepEveryValue) {
  TempDir d;
  const auto arrays = every_dtype(false);
  write_npz(d.path() / "a.npz", arrays);
  const auto npz = TensorDump::open(d.path() / "a.npz");
  expect_same_arrays(npz.arrays(), arrays);
  // Deterministic: the same arrays, the same archive bytes.
  write_npz(d.path() / "b.npz", arrays);
  EXPECT_EQ(read_file(d.path() / "a.npz"), read_file(d.path() / "b.npz"));
  for (const auto& a : arrays) {
    write_npy(d.path() / (a.name + ".npy"), a);
    const auto one = TensorDump::open(d.path() / (a.name + ".npy"));
    expect_same_arrays(one.arrays(), {a});
  }
  auto with_bf16 = every_dtype(true);
  write_dump_safetensors(d.path() / "a.safetensors", with_bf16);
  const auto st = TensorDump::open(d.path() / "a.safetensors");
  std::sort(with_bf16.begin(), with_bf16.end(), [](const auto& a, const auto& b) { return a.name < b.name; });
  expect_same_arrays(st.arrays(), with_bf16);  // in name order
  // An archive of no arrays is numpy's empty archive, and reads as no arrays.
  write_npz(d.path() / "none.npz", {});
  EXPECT_EQ(read_file(d.path() / "none.npz"), std::string("PK\x05\x06", 4) + std::string(18, '\0'));
  EXPECT_TRUE(TensorDump::open(d.path() / "none.npz").arrays().empty());
}

// f16/bf16 are rounded once, from the double: 1 + 2^-11 + 2^-40 is above the midpoint of 1 and
// 1 + 2^-10, so binary16 rounds it up (0x3c01); through float32 it would first become the midpoint
// 1 + 2^-11 and then round to even, 1.0 (0x3c00). The same for bfloat16 at 1 + 2^-8 + 2^-40.
TEST(TensorDumpRoundTrip, HalfRoundingIsDirectFromDouble) {
  const double above_f16_tie = 1 + std::ldexp(1.0, -11) + std::ldexp(1.0, -40);
  const auto b = encode_npy(array("h", DumpDtype::f16, {4}, {above_f16_tie, -above_f16_tie, 1 + std::ldexp(1.0, -11), 1e6}));
  const std::string s = string_of(b);
  ASSERT_EQ(s.size(), 128u + 8);
  uint16_t h[4];
  std::memcpy(h, s.data() + 128, 8);
  EXPECT_EQ(h[0], 0x3c01);
  EXPECT_EQ(h[1], 0xbc01);
  EXPECT_EQ(h[2], 0x3c00);  // an exact tie: to even
  EXPECT_EQ(h[3], 0x7c00);  // overflow: inf
  EXPECT_EQ(f32_to_f16(static_cast<float>(above_f16_tie)), 0x3c00);  // what double rounding would give
  TempDir d;
  const double above_bf16_tie = 1 + std::ldexp(1.0, -8) + std::ldexp(1.0, -40);
  write_dump_safetensors(d.path() / "b.safetensors", std::vector{array("b", DumpDtype::bf16, {1}, {above_bf16_tie})});
  const auto st = TensorDump::open(d.path() / "b.safetensors");
  EXPECT_EQ(st.get("b").values[0], bf16_to_f32(0x3f81));
  EXPECT_EQ(f32_to_bf16(static_cast<float>(above_bf16_tie)), 0x3f80);
  // float32 is rounded to nearest from the double directly.
  const auto f = TensorDump::parse_npy(encode_npy(array("f", DumpDtype::f32, {1}, {0.1})), "f", "f.npy");
  EXPECT_EQ(f.get("f").values[0], static_cast<double>(0.1f));
}

TEST(TensorDumpRoundTrip, WritersRefuseWhatTheDtypeCannotHold) {
  auto invalid = [](auto f, std::string_view part) {
    const std::string m = message_of<InvalidArgument>(f);
    EXPECT_NE(m.find(part), std::string::npos) << m;
  };
  invalid([] { encode_npy(array("q", DumpDtype::bf16, {1}, {1})); }, "array 'q' is bf16");
  invalid([] { encode_npy(array("p", DumpDtype::i32, {2}, {1, 2.5})); }, "array 'p': element 1 is 2.5, not an integer");
  invalid([] { encode_npy(array("p", DumpDtype::u8, {1}, {256})); }, "element 0 is 256, out of the range of dtype u8");
  invalid([] { encode_npy(array("p", DumpDtype::i64, {1}, {NAN})); }, "element 0 is nan, not an integer");
  invalid([] { encode_npy(array("m", DumpDtype::boolean, {1}, {2})); }, "element 0 is 2, not 0 or 1");
  invalid([] { encode_npy(array("s", DumpDtype::f32, {2, 3}, {1, 2})); }, "shape [2, 3] holds 6 elements, values has 2");
  invalid([] { encode_npy(array("s", DumpDtype::f32, {-1}, {})); }, "negative dimension");
  TempDir d;
  const std::vector<DumpArray> twice = {array("q", DumpDtype::f32, {1}, {1}), array("q", DumpDtype::f32, {1}, {2})};
  invalid([&] { write_npz(d.path() / "x.npz", twice); }, "two arrays are named 'q'");
  invalid([&] { write_dump_safetensors(d.path() / "x.safetensors", twice); }, "two arrays are named 'q'");
  EXPECT_FALSE(std::filesystem::exists(d.path() / "x.npz"));
}

TEST(TensorDumpRoundTrip, OpenReadsByContentMergeAndGet) {
  TempDir d;
  // Names that lie about the format: the content decides.
  write_npz(d.path() / "npz.bin", std::vector{array("q", DumpDtype::f32, {1}, {1.5})});
  write_dump_safetensors(d.path() / "st.npy", std::vector{array("k", DumpDtype::f16, {1}, {2})});
  write_npy(d.path() / "position_ids.dat", array("ignored", DumpDtype::i64, {2}, {3, 4}));
  auto dump = TensorDump::open(d.path() / "npz.bin");
  dump.merge(TensorDump::open(d.path() / "st.npy"));
  dump.merge(TensorDump::open(d.path() / "position_ids.dat"));  // a lone .npy: the file stem names it
  EXPECT_EQ(dump.source(), (d.path() / "npz.bin").string() + " + " + (d.path() / "st.npy").string() + " + " +
                               (d.path() / "position_ids.dat").string());
  ASSERT_EQ(dump.arrays().size(), 3u);
  EXPECT_EQ(dump.get("q").values, std::vector<double>{1.5});
  EXPECT_EQ(dump.get("k").dtype, DumpDtype::f16);
  EXPECT_EQ(dump.get("position_ids").values, (std::vector<double>{3, 4}));
  EXPECT_EQ(dump.find("q_rope"), nullptr);
  expect_dump_error([&] { dump.get("q_rope"); }, {"no array 'q_rope' (has: q, k, position_ids)", "npz.bin"});
  expect_dump_error([&] { dump.merge(TensorDump::open(d.path() / "npz.bin")); },
                    {"npz.bin + ", "st.npy", "two arrays named 'q'"});
  EXPECT_EQ(dump.arrays().size(), 3u);  // a refused merge adds nothing
  // Not any of the three formats.
  const auto text = d.file("notes.txt", "q = [1, 2, 3]\n");
  expect_dump_error([&] { TensorDump::open(text); }, {"notes.txt", "read as safetensors", "header length"});
  EXPECT_NE(message_of<IoError>([&] { TensorDump::open(d.path() / "missing.npy"); }).find("missing.npy"),
            std::string::npos);
}

// ---- bad .npy ---------------------------------------------------------------------------------

const std::string kF32 = "{'descr': '<f4', 'fortran_order': False, 'shape': (2,), }";

TEST(TensorDumpBadNpy, SizesThatDoNotFitTheFile) {
  const std::string good = npy(kF32, raw<float>({1, 2}));
  EXPECT_EQ(parse_npy(good).get("x").values, (std::vector<double>{1, 2}));
  expect_dump_error([&] { parse_npy(good.substr(0, good.size() - 1)); },
                    {"bad.npy: x:", "needs 8 data bytes, the file has 7", "(truncated)"});
  expect_dump_error([&] { parse_npy(good + "z"); }, {"bad.npy: x:", "the file has 9", "(trailing bytes)"});
  expect_dump_error([&] { parse_npy(good.substr(0, 9)); }, {"bad.npy: x:", "9 bytes, too short for the header length"});
  std::string past = good;
  past[8] = '\xff';
  past[9] = '\x7f';
  past[9] = '\x10';
  expect_dump_error([&] { parse_npy(past); }, {"bad.npy: x:", "header length 4351 runs past the end", "136 bytes"});
  past[9] = '\x7f';
  expect_dump_error([&] { parse_npy(past); }, {"bad.npy: x:", "header length 32767 exceeds numpy's limit of 10000"});
  // An empty array keeps its shape, however large the other dimensions (Fortran order too).
  const auto empty = parse_npy(npy("{'descr': '<f4', 'fortran_order': True, 'shape': (0, 4611686018427387904, 2), }", ""));
  EXPECT_EQ(empty.get("x").shape, (std::vector<int64_t>{0, int64_t{1} << 62, 2}));
  EXPECT_TRUE(empty.get("x").values.empty());
  expect_dump_error([&] { parse_npy(npy("{'descr': '<f4', 'fortran_order': False, 'shape': (1000000,), }", raw<float>({1}))); },
                    {"bad.npy: x:", "shape [1000000] needs 4000000 data bytes, the file has 4"});
  expect_dump_error([&] {
    parse_npy(npy("{'descr': '<f8', 'fortran_order': False, 'shape': (4294967296, 4294967296), }", ""));
  }, {"bad.npy: x:", "shape (4294967296, 4294967296) holds more elements than 64-bit sizes can count"});
  expect_dump_error([&] {
    parse_npy(npy("{'descr': '<f8', 'fortran_order': False, 'shape': (2305843009213693952,), }", ""));
  }, {"bad.npy: x:", "(2305843009213693952) holds more elements"});  // 2^61 elements * 8 bytes overflows
  expect_dump_error([&] { parse_npy(npy("{'descr': '<f8', 'fortran_order': False, 'shape': (99999999999999999999,), }", "")); },
                    {"bad.npy: x:", "shape dimension 99999999999999999999", "does not fit in 64 bits"});
  std::string version = good;
  version[6] = 4;
  expect_dump_error([&] { parse_npy(version); }, {"bad.npy: x:", "unsupported .npy version 4.0"});
  expect_dump_error([&] { parse_npy("\x93NUMPX\x01\x00"); }, {"bad.npy: x:", "not a .npy file", "NUMPX"});
  expect_dump_error([&] { parse_npy(""); }, {"bad.npy: x:", "not a .npy file", "0 bytes"});
  // A 2.0 header (uint32 length) parses like 1.0.
  EXPECT_EQ(parse_npy(npy(kF32, raw<float>({3, 4}), 2)).get("x").values, (std::vector<double>{3, 4}));
}

TEST(TensorDumpBadNpy, DescrAndValues) {
  expect_dump_error([] { parse_npy(npy("{'descr': '<c8', 'fortran_order': False, 'shape': (1,), }", std::string(8, '\0'))); },
                    {"bad.npy: x:", "unsupported descr '<c8'", "<f8", ">i2", "|b1"});
  expect_dump_error([] { parse_npy(npy("{'descr': '<u4', 'fortran_order': False, 'shape': (1,), }", std::string(4, '\0'))); },
                    {"bad.npy: x:", "unsupported descr '<u4'"});
  expect_dump_error([] { parse_npy(npy("{'descr': '<V2', 'fortran_order': False, 'shape': (1,), }", "ab")); },
                    {"bad.npy: x:", "descr '<V2'", "bfloat16", "safetensors"});
  expect_dump_error([] { parse_npy(npy("{'descr': '|V2', 'fortran_order': False, 'shape': (1,), }", "ab")); },
                    {"descr '|V2'", "bfloat16"});
  expect_dump_error([] { parse_npy(npy("{'descr': [('a', '<f4')], 'fortran_order': False, 'shape': (1,), }", "abcd")); },
                    {"bad.npy: x:", "structured dtype"});
  // int64 beyond 2^53 has no exact double.
  const std::string i64 = "{'descr': '<i8', 'fortran_order': False, 'shape': (2,), }";
  expect_dump_error([&] { parse_npy(npy(i64, raw<int64_t>({0, (int64_t{1} << 53) + 1}))); },
                    {"bad.npy: x:", "element 1 is 9007199254740993, beyond +-2^53"});
  expect_dump_error([&] { parse_npy(npy("{'descr': '>i8', 'fortran_order': False, 'shape': (1,), }", raw<int64_t>({1}))); },
                    {"element 0 is 72057594037927936"});  // 1 read big-endian is 2^56
  expect_dump_error([] { parse_npy(npy("{'descr': '|b1', 'fortran_order': False, 'shape': (3,), }", std::string("\1\0\2", 3))); },
                    {"bad.npy: x:", "element 2 is the byte 2, not a bool"});
}

TEST(TensorDumpBadNpy, HeaderDictIsParsedStrictly) {
  const std::string data = raw<float>({1, 2});
  // What numpy accepts in the dict: any key order, double quotes, no trailing comma, Python 2 longs.
  EXPECT_EQ(parse_npy(npy("{\"shape\": (2,), \"fortran_order\": False, \"descr\": \"<f4\"}", data)).get("x").shape,
            std::vector<int64_t>{2});
  EXPECT_EQ(parse_npy(npy("{'descr':'<f4','fortran_order':True,'shape':(2L,)}", data)).get("x").values,
            (std::vector<double>{1, 2}));
  struct Case {
    std::string dict;
    std::vector<std::string> parts;
  };
  const std::vector<Case> cases = {
      {"{'descr': '<f4', 'fortran_order': False, 'shape': (2,), 'extra': 1}", {"unknown key 'extra'"}},
      {"{'descr': '<f4', 'fortran_order': False}", {"no key 'shape'"}},
      {"{'descr': '<f4', 'fortran_order': False, 'shape': (2,), 'shape': (2,)}", {"key 'shape' appears twice"}},
      {"{'descr': '<f4', 'fortran_order': False, 'shape': (2)}", {"shape (2) is an integer in parentheses", "(2,)"}},
      {"{'descr': '<f4', 'fortran_order': False, 'shape': [2]}", {"shape must be a tuple", "[2]"}},
      {"{'descr': '<f4', 'fortran_order': false, 'shape': (2,)}", {"fortran_order must be True or False", "false"}},
      {"{'descr': '<f4', 'fortran_order': Falsey, 'shape': (2,)}", {"fortran_order must be True or False", "Falsey"}},
      {"{'descr': '<f4', 'fortran_order': False, 'shape': (-2,)}", {"non-negative integer"}},
      {"{'descr': '<f4', 'fortran_order': False, 'shape': (2,)} junk", {"unexpected text after the dict: 'junk"}},
      {"{'descr': '<f4' 'fortran_order': False, 'shape': (2,)}", {"expected ',' or '}' after the value of 'descr'"}},
      {"{'descr' '<f4', 'fortran_order': False, 'shape': (2,)}", {"expected ':' after key 'descr'"}},
      {"['descr', '<f4']", {"dict literal starting with '{'"}},
      {"{'descr': '<f4', 'fortran_order': False, 'shape': (2,), ", {"a key as a quoted string"}},
      {"{'descr': '\\x3cf4', 'fortran_order': False, 'shape': (2,)}", {"escape sequences"}},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.dict);
    const std::string m = message_of<DumpError>([&] { parse_npy(npy(c.dict, data)); });
    EXPECT_EQ(m.rfind("bad.npy: x: ", 0), 0u) << m;
    for (const auto& p : c.parts) EXPECT_NE(m.find(p), std::string::npos) << "lacks '" << p << "': " << m;
  }
  // Python 2 longs only in the headers Python 2 could write (1.0, 2.0).
  expect_dump_error([&] { parse_npy(npy("{'descr':'<f4','fortran_order':False,'shape':(2L,)}", data, 3)); },
                    {"expected ',' or ')' in shape (got 'L"});
}

// ---- bad .npz -------------------------------------------------------------------------------------

TEST(TensorDumpBadNpz, MembersThatLie) {
  const std::string q = npy(kF32, raw<float>({1, 2}));
  auto parse = [](const std::string& z) { return TensorDump::parse_npz(bytes_of(z), "bad.npz"); };
  // The hand-made archive itself is good.
  const auto good = parse(zip({stored("q.npy", q), stored("p.npy", q)}));
  ASSERT_EQ(good.arrays().size(), 2u);
  EXPECT_EQ(good.arrays()[1].name, "p");
  EXPECT_EQ(good.get("q").values, (std::vector<double>{1, 2}));

  expect_dump_error([&] { parse(zip({stored("q.npy", q), stored("notes.txt", "hello")})); },
                    {"bad.npz: member 'notes.txt' is not a .npy array"});
  expect_dump_error([&] { parse(zip({stored("q.npy", q), stored("q.npy", q)})); }, {"bad.npz", "q.npy"});
  // The member's header wants 8 data bytes; the member (and its declared size) holds 4.
  const std::string short_q = q.substr(0, q.size() - 4);
  expect_dump_error([&] { parse(zip({stored("q.npy", short_q)})); },
                    {"bad.npz: q: member 'q.npy' declares 132 bytes, but its header (128 bytes) says f32 [2]", "136"});
  // Declared size larger than the stored bytes.
  ZipMember longer = stored("q.npy", q);
  longer.uncompressed += 100;
  expect_dump_error([&] { parse(zip({longer})); }, {"bad.npz: q: member 'q.npy': read error"});
  // A CRC that does not match the bytes.
  ZipMember crc = stored("q.npy", q);
  crc.crc ^= 1;
  expect_dump_error([&] { parse(zip({crc})); }, {"bad.npz: q: member 'q.npy': read error: CRC error"});
  // Not a zip archive after all.
  const std::string z = zip({stored("q.npy", q)});
  expect_dump_error([&] { parse(z.substr(0, z.size() - 10)); }, {"bad.npz: not a valid .npz (zip) archive"});
  expect_dump_error([&] { parse(z.substr(0, 40)); }, {"bad.npz"});
}

// A deflate bomb: a member that inflates far past its declared size is stopped after the declared
// size + 1 byte, and a member declaring more than kMaxDumpMemberBytes is refused before it is inflated.
TEST(TensorDumpBadNpz, DeflateBombs) {
  auto parse = [](const std::string& z) { return TensorDump::parse_npz(bytes_of(z), "bomb.npz"); };
  const std::string header256 = npy("{'descr': '<f4', 'fortran_order': False, 'shape': (256,), }", "");
  ASSERT_EQ(header256.size(), 128u);
  // First, an honest deflated member: a u8 [775] array, the header and 1 + 258 * 3 zeros.
  {
    const std::string h775 = npy("{'descr': '|u1', 'fortran_order': False, 'shape': (775,), }", "");
    const std::string c775 = h775 + std::string(775, '\0');
    const ZipMember m{"x.npy", 8, deflate_bomb(h775, 3), crc32(c775), static_cast<uint32_t>(c775.size())};
    const auto d = parse(zip({m}));
    EXPECT_EQ(d.get("x").values, std::vector<double>(775, 0.0));
  }
  // Declared 1152 bytes (a consistent f32 [256] member), inflates to 128 + 1 + 258 * 40000 (10 MB).
  const std::string declared = header256 + std::string(1024, '\0');
  ZipMember lie{"x.npy", 8, deflate_bomb(header256, 40000), crc32(declared), static_cast<uint32_t>(declared.size())};
  expect_dump_error([&] { parse(zip({lie})); }, {"bomb.npz", "x.npy", "1152"});
  // Declared 1.5 GiB: a u8 array of 1 + 258 * 6242684 elements, inflating to exactly that (6 million matches,
  // 9.8 MB compressed; the CRC is not computed, it is never reached); refused from the zip directory alone.
  const uint64_t n_matches = 6242684, n_big = 1 + 258 * n_matches;
  const std::string big_header =
      npy("{'descr': '|u1', 'fortran_order': False, 'shape': (" + std::to_string(n_big) + ",), }", "");
  const uint64_t declared_big = big_header.size() + n_big;
  ZipMember bomb{"x.npy", 8, deflate_bomb(big_header, n_matches), 0, static_cast<uint32_t>(declared_big)};
  const auto t0 = std::chrono::steady_clock::now();
  expect_dump_error([&] { parse(zip({bomb})); },
                    {"bomb.npz: x: member 'x.npy' declares " + std::to_string(declared_big) + " uncompressed bytes",
                     "limit of 1073741824"});
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(2));  // not inflated
  // Many members, each under the limit, together over it.
  const std::string h = npy("{'descr': '|u1', 'fortran_order': False, 'shape': (400000000,), }", "");
  std::vector<ZipMember> many;
  for (int i = 0; i < 3; ++i)
    many.push_back({"m" + std::to_string(i) + ".npy", 8, deflate_bomb(h, 10), 0, static_cast<uint32_t>(h.size() + 400000000)});
  expect_dump_error([&] { parse(zip(many)); }, {"bomb.npz: m2: member 'm2.npy'", "would total 1200000384 bytes, more than the limit"});
}

// ---- safetensors -----------------------------------------------------------------------------------

TEST(TensorDumpSafetensors, MalformedAndFloat8AreDumpErrors) {
  auto file = [](const std::string& header, const std::string& data) {
    std::string s;
    put<uint64_t>(s, header.size());
    return s + header + data;
  };
  const std::string f8 = file(R"({"a":{"dtype":"F8_E4M3","shape":[2],"data_offsets":[0,2]}})", "ab");
  expect_dump_error([&] { TensorDump::parse_safetensors(bytes_of(f8), "d.safetensors"); },
                    {"d.safetensors: a: dtype F8_E4M3 is not a dump dtype"});
  const std::string bad = file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,4]}})", "abcd");
  expect_dump_error([&] { TensorDump::parse_safetensors(bytes_of(bad), "d.safetensors"); },
                    {"d.safetensors: tensor a: data_offsets [0, 4] hold 4 bytes", "needs 8"});
  const std::string i64 = file(R"({"p":{"dtype":"I64","shape":[1],"data_offsets":[0,8]}})", raw<int64_t>({-(int64_t{1} << 60)}));
  expect_dump_error([&] { TensorDump::parse_safetensors(bytes_of(i64), "d.safetensors"); },
                    {"d.safetensors: p: element 0 is -1152921504606846976, beyond +-2^53"});
  const std::string ok = file(R"({"p":{"dtype":"BF16","shape":[2],"data_offsets":[0,4]}})", raw<uint16_t>({0x3f80, 0xc049}));
  EXPECT_EQ(TensorDump::parse_safetensors(bytes_of(ok), "d.safetensors").get("p").values,
            (std::vector<double>{1.0, -3.140625}));
}

}  // namespace POSENC_UNITY_ID
