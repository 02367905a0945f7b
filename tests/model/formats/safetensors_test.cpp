// safetensors reader: the real TinyStories-656K file against an independent reader
// (tools/refs/safetensors_refs.py: Python's json + numpy), F16/BF16 copies of its
// tensors against numpy's conversions, a sharded copy against the unsharded file,
// and malformed files.
#include "posenc/safetensors.hpp"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <bit>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <iostream>
#include <nlohmann/json.hpp>

#include "posenc/error.hpp"
#include "posenc/io.hpp"
#include "test_support.hpp"

namespace POSENC_UNITY_ID {  // this file's own namespace in the tests' unity build (CMakeLists.txt)

using namespace posenc;
using posenc::test::TempDir;
using json = nlohmann::json;

namespace {

std::filesystem::path real_dir() { return posenc::test::shared_dir() / "models/TinyStories-656K"; }
std::filesystem::path real_file() { return real_dir() / "model.safetensors"; }
std::filesystem::path reference_path() {
  return std::filesystem::path(POSENC_SOURCE_DIR) / "tests/model/formats/data/safetensors_reference.json";
}
const json& reference() {
  static const json r = json::parse(read_file(reference_path()));
  return r;
}

// ---- checksums, as the reference script computes them ----
struct Checksums {
  double sum = 0, sum_sq = 0, sum_abs = 0;
  uint64_t bits_sum = 0, bits_weighted = 0;
};
template <class Bits>
Checksums checksums(std::span<const float> values, std::span<const Bits> bits) {
  Checksums c;
  for (std::size_t i = 0; i < values.size(); ++i) {
    const double v = values[i];
    c.sum += v;
    c.sum_sq += v * v;
    c.sum_abs += std::abs(v);
    c.bits_sum += bits[i];
    c.bits_weighted += (i + 1) * static_cast<uint64_t>(bits[i]);  // modulo 2^64, as numpy's uint64
  }
  return c;
}
/// Exact integer checksums and element samples; float sums to 1e-12 of sum_abs
/// (numpy sums pairwise, this loop in order).
template <class Bits>
void expect_checksums(const json& ref, std::span<const float> values, std::span<const Bits> bits,
                      const std::string& what) {
  SCOPED_TRACE(what);
  const Checksums c = checksums(values, bits);
  EXPECT_EQ(c.bits_sum, ref.at("bits_sum").get<uint64_t>());
  EXPECT_EQ(c.bits_weighted, ref.at("bits_weighted").get<uint64_t>());
  if (ref.contains("sum")) {
    const double tol = 1e-12 * ref["sum_abs"].get<double>();
    EXPECT_NEAR(c.sum, ref["sum"].get<double>(), tol);
    EXPECT_NEAR(c.sum_abs, ref["sum_abs"].get<double>(), tol);
    EXPECT_NEAR(c.sum_sq, ref["sum_sq"].get<double>(), 1e-12 * ref["sum_sq"].get<double>());
    for (const auto& s : ref.at("samples")) {
      const auto i = s[0].get<std::size_t>();
      ASSERT_LT(i, values.size());
      EXPECT_EQ(static_cast<uint64_t>(bits[i]), s[1].get<uint64_t>()) << "element " << i;
      EXPECT_EQ(static_cast<double>(values[i]), s[2].get<double>()) << "element " << i;
    }
  }
}

// ---- writing safetensors files ----
struct TensorBytes {
  std::string name, dtype;
  std::vector<int64_t> shape;
  std::string bytes;
};
/// uint64 header length + header text + data, as given (malformed headers too).
std::string raw_file(const std::string& header, const std::string& data = "") {
  std::string out(8, '\0');
  const uint64_t n = header.size();
  std::memcpy(out.data(), &n, 8);
  return out + header + data;
}
/// A well-formed file: tensors back to back in the given order, the header
/// space-padded to a multiple of 8 bytes (as huggingface/safetensors writes).
std::string safetensors_file(const std::vector<TensorBytes>& tensors, const json& metadata = nullptr) {
  json h = json::object();
  if (!metadata.is_null()) h["__metadata__"] = metadata;
  std::string data;
  for (const auto& t : tensors) {
    h[t.name] = {{"dtype", t.dtype}, {"shape", t.shape}, {"data_offsets", {data.size(), data.size() + t.bytes.size()}}};
    data += t.bytes;
  }
  std::string header = h.dump();
  header.resize((header.size() + 8 + 7) / 8 * 8 - 8, ' ');
  return raw_file(header, data);
}
template <class T>
std::string bytes_of(const std::vector<T>& v) {
  return std::string(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(T));
}
std::string floats(std::vector<float> v) { return bytes_of(v); }

SafetensorsFile parse(const std::string& bytes) {
  return SafetensorsFile::parse(std::as_bytes(std::span(bytes.data(), bytes.size())), "test.safetensors");
}
SafetensorsFile parse(const std::string&& bytes) = delete;  // the result views the bytes

/// Runs `f`, which must throw E with a message containing every one of `parts`.
template <class E>
void expect_error(const std::function<void()>& f, std::initializer_list<std::string> parts) {
  try {
    f();
    ADD_FAILURE() << "no exception; expected one naming " << *parts.begin();
  } catch (const E& e) {
    const std::string msg = e.what();
    for (const auto& p : parts) EXPECT_NE(msg.find(p), std::string::npos) << "message: " << msg << "\nlacks: " << p;
  } catch (const std::exception& e) {
    ADD_FAILURE() << "wrong exception type: " << e.what();
  }
}
void expect_bad(const std::string& bytes, std::initializer_list<std::string> parts) {
  std::vector<std::string> all{"test.safetensors"};
  all.insert(all.end(), parts.begin(), parts.end());
  try {
    parse(bytes);
    ADD_FAILURE() << "no exception; expected one naming " << *parts.begin();
  } catch (const CheckpointError& e) {
    const std::string msg = e.what();
    for (const auto& p : all) EXPECT_NE(msg.find(p), std::string::npos) << "message: " << msg << "\nlacks: " << p;
  } catch (const std::exception& e) {
    ADD_FAILURE() << "wrong exception type: " << e.what();
  }
}
std::string one_tensor(const json& entry, const std::string& data = std::string(8, '\0')) {
  return raw_file(json{{"w", entry}}.dump(), data);
}

/// The real file's tensors, re-encoded in `dtype` ("F16" or "BF16"); also returns the bits written.
std::string converted_copy(const SafetensorsFile& f, const std::string& dtype,
                           std::map<std::string, std::vector<uint16_t>>& bits) {
  std::vector<TensorBytes> out;
  for (const auto& t : f.tensors()) {
    auto& b = bits[t.name];
    for (float v : f.to_float32(t)) b.push_back(dtype == "F16" ? f32_to_f16(v) : f32_to_bf16(v));
    out.push_back({t.name, dtype, t.shape, bytes_of(b)});
  }
  return safetensors_file(out, json(f.metadata()));
}

}  // namespace

// ---- the real file ---------------------------------------------------------------

TEST(Safetensors, RealFileHeaderMatchesReference) {
  const json& ref = reference();
  const auto f = SafetensorsFile::open(real_file());
  EXPECT_EQ(std::filesystem::file_size(real_file()), ref["file"]["size"].get<uint64_t>());
  EXPECT_EQ(f.source(), real_file().string());
  EXPECT_EQ(json(f.metadata()), ref["metadata"]);
  // The quirk of this file (models/SOURCES.md): the tied matrix is stored once, as lm_head.weight.
  EXPECT_EQ(f.metadata().at("model.embed_tokens.weight"), "lm_head.weight");
  EXPECT_EQ(f.find("model.embed_tokens.weight"), nullptr);
  ASSERT_EQ(f.tensors().size(), ref["tensors"].size());
  for (std::size_t i = 0; i < f.tensors().size(); ++i) {
    const auto& t = f.tensors()[i];
    const auto& r = ref["tensors"][i];
    SCOPED_TRACE(r["name"].get<std::string>());
    EXPECT_EQ(t.name, r["name"].get<std::string>());  // both in name order
    EXPECT_EQ(to_string(t.dtype), r["dtype"].get<std::string>());
    EXPECT_EQ(t.shape, r["shape"].get<std::vector<int64_t>>());
    EXPECT_EQ(t.begin, r["data_offsets"][0].get<uint64_t>());
    EXPECT_EQ(t.end, r["data_offsets"][1].get<uint64_t>());
    EXPECT_EQ(f.find(t.name), &t);
    EXPECT_EQ(f.data(t).size(), t.end - t.begin);
    // data() is the range after the 8 + header_length bytes of the file.
    EXPECT_EQ(f.data(t).data() - f.data(f.tensors()[0]).data(), static_cast<std::ptrdiff_t>(t.begin));
  }
  EXPECT_EQ(f.find("lm_head.weight")->shape, (std::vector<int64_t>{2048, 128}));
  EXPECT_EQ(f.find("lm_head.weight")->n_elements(), 2048 * 128);
  EXPECT_EQ(f.find("nope"), nullptr);
}

TEST(Safetensors, RealFileFloat32MatchesNumpy) {
  const auto f = SafetensorsFile::open(real_file());
  for (const auto& r : reference()["tensors"]) {
    const auto* t = f.find(r["name"].get<std::string>());
    ASSERT_NE(t, nullptr);
    const auto v = f.to_float32(*t);
    ASSERT_EQ(static_cast<int64_t>(v.size()), t->n_elements());
    std::vector<uint32_t> bits(v.size());
    std::memcpy(bits.data(), v.data(), 4 * v.size());
    expect_checksums<uint32_t>(r["f32"], v, bits, t->name + " F32");
  }
}

TEST(Safetensors, F16CopyMatchesNumpyFloat16) {
  const auto f = SafetensorsFile::open(real_file());
  std::map<std::string, std::vector<uint16_t>> bits;
  const std::string bytes = converted_copy(f, "F16", bits);
  const auto g = parse(bytes);
  EXPECT_EQ(g.metadata(), f.metadata());
  for (const auto& r : reference()["tensors"]) {
    const auto name = r["name"].get<std::string>();
    const auto* t = g.find(name);
    ASSERT_NE(t, nullptr);
    EXPECT_EQ(t->dtype, SafetensorsDtype::F16);
    EXPECT_EQ(t->end - t->begin, 2 * static_cast<uint64_t>(t->n_elements()));
    // f32_to_f16 gives numpy's float16 bits; to_float32 gives numpy's float16 -> float32.
    const auto back = g.to_float32(*t);
    expect_checksums<uint16_t>(r["f16"], back, bits[name], name + " F16");
  }
}

TEST(Safetensors, Bf16CopyMatchesReference) {
  const auto f = SafetensorsFile::open(real_file());
  std::map<std::string, std::vector<uint16_t>> bits;
  const std::string bytes = converted_copy(f, "BF16", bits);
  const auto g = parse(bytes);
  for (const auto& r : reference()["tensors"]) {
    const auto name = r["name"].get<std::string>();
    const auto* t = g.find(name);
    ASSERT_NE(t, nullptr);
    EXPECT_EQ(t->dtype, SafetensorsDtype::BF16);
    const auto back = g.to_float32(*t);
    expect_checksums<uint16_t>(r["bf16"], back, bits[name], name + " BF16");
    // These weights have bfloat16 precision: the BF16 copy is lossless.
    EXPECT_EQ(back, f.to_float32(*f.find(name))) << name;
  }
}

// Every weight times 1.2345678 uses the whole float32 mantissa, so rounding to
// half and bfloat16 is exercised on 656000 values (subnormal halves included).
TEST(Safetensors, PerturbedWeightsRoundLikeNumpy) {
  const json& ref = reference()["perturbed"];
  const auto f = SafetensorsFile::open(real_file());
  const float factor = ref["factor"].get<float>();
  std::vector<float> all;
  for (const auto& t : f.tensors())
    for (float v : f.to_float32(t)) all.push_back(v * factor);
  ASSERT_EQ(all.size(), ref["count"].get<std::size_t>());
  std::vector<uint32_t> b32(all.size());
  std::memcpy(b32.data(), all.data(), 4 * all.size());
  expect_checksums<uint32_t>(ref["f32"], all, b32, "perturbed f32");

  std::vector<uint16_t> h(all.size()), b(all.size());
  for (std::size_t i = 0; i < all.size(); ++i) {
    h[i] = f32_to_f16(all[i]);
    b[i] = f32_to_bf16(all[i]);
  }
  const auto n = static_cast<int64_t>(all.size());
  const std::string bytes = safetensors_file({{"h", "F16", {n}, bytes_of(h)}, {"b", "BF16", {n}, bytes_of(b)}});
  const auto g = parse(bytes);
  expect_checksums<uint16_t>(ref["f16"], g.to_float32(*g.find("h")), h, "perturbed f16");
  expect_checksums<uint16_t>(ref["bf16"], g.to_float32(*g.find("b")), b, "perturbed bf16");
}

TEST(Safetensors, HalfConversionsMatchNumpyOnEveryPattern) {
  const json& ref = reference()["f16_to_f32_all_patterns"];
  uint64_t non_nan = 0, sum = 0, weighted = 0;
  for (uint32_t p = 0; p < 65536; ++p) {
    const auto h = static_cast<uint16_t>(p);
    const float f = f16_to_f32(h);
    const bool nan_pattern = (h & 0x7c00u) == 0x7c00u && (h & 0x3ffu) != 0;
    ASSERT_EQ(std::isnan(f), nan_pattern) << std::hex << p;
    if (nan_pattern) {
      EXPECT_EQ(std::signbit(f), (h & 0x8000u) != 0) << std::hex << p;
      EXPECT_EQ(f32_to_f16(f) & 0x7e00u, 0x7e00u) << std::hex << p;  // NaN stays (quiet) NaN
      continue;
    }
    ++non_nan;
    const auto bits = std::bit_cast<uint32_t>(f);
    sum += bits;
    weighted += (p + 1) * static_cast<uint64_t>(bits);
    // Every half is exactly representable: float32 -> half gives the pattern back.
    EXPECT_EQ(f32_to_f16(f), h) << std::hex << p;
  }
  EXPECT_EQ(non_nan, ref["non_nan"].get<uint64_t>());
  EXPECT_EQ(sum, ref["bits_sum"].get<uint64_t>());
  EXPECT_EQ(weighted, ref["bits_weighted"].get<uint64_t>());
  // Edges: overflow to inf at 65520, ties to even, subnormals, underflow to zero.
  for (const auto& e : reference()["f32_to_f16_edges"]) {
    const float x = std::bit_cast<float>(e[0].get<uint32_t>());
    EXPECT_EQ(f32_to_f16(x), e[1].get<uint16_t>()) << x;
  }
  EXPECT_EQ(f32_to_f16(-65520.0f), 0xfc00u);
  EXPECT_TRUE(std::isnan(f16_to_f32(f32_to_f16(std::nanf("")))));
  EXPECT_EQ(bf16_to_f32(0x3f80), 1.0f);
  EXPECT_EQ(bf16_to_f32(0xc049), std::bit_cast<float>(0xc0490000u));  // -3.140625
  EXPECT_TRUE(std::isinf(bf16_to_f32(0xff80)) && bf16_to_f32(0xff80) < 0);
  EXPECT_TRUE(std::isnan(bf16_to_f32(0x7fc1)));
}

// The reference file re-derived by its script (numpy needed).
TEST(Safetensors, ReferenceRederives) {
  if (std::system("/usr/bin/python3 -c 'import numpy' >/dev/null 2>&1") != 0)
    GTEST_SKIP() << "/usr/bin/python3 with numpy is not installed (Debian python3-numpy)";
  TempDir d;
  const auto out = d.path() / "ref.json";
  const std::string cmd = "/usr/bin/python3 '" + (posenc::test::refs_dir() / "safetensors_refs.py").string() + "' '" +
                          real_file().string() + "' '" + out.string() + "'";
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  json fresh = json::parse(read_file(out)), committed = reference();
  if (fresh["versions"] != committed["versions"])
    std::cerr << "note: reference made with " << committed["versions"].dump() << ", re-derived with "
              << fresh["versions"].dump() << "\n";
  fresh.erase("versions");
  committed.erase("versions");
  EXPECT_EQ(fresh, committed);
}

// ---- layouts the format allows --------------------------------------------------

TEST(Safetensors, UnalignedDataScalarsEmptyTensorsAndGaps) {
  // A 3-byte header puts the data at byte 11: F32 values are not 4-byte aligned.
  const std::string unaligned = raw_file("{} ", "");  // also: an empty header object
  EXPECT_TRUE(parse(unaligned).tensors().empty());
  json h = {{"s", {{"dtype", "F32"}, {"shape", json::array()}, {"data_offsets", {0, 4}}}},
            {"e", {{"dtype", "F16"}, {"shape", {0, 5}}, {"data_offsets", {4, 4}}}},
            {"e2", {{"dtype", "I64"}, {"shape", {3, 0}}, {"data_offsets", {4, 4}}}},
            {"v", {{"dtype", "BF16"}, {"shape", {2}}, {"data_offsets", {8, 12}}}}};  // bytes 4..8: a gap
  std::string data = floats({-2.5f});
  data += std::string(4, '\x7f');
  const uint16_t bf[2] = {0x3f80, 0xc000};
  data.append(reinterpret_cast<const char*>(bf), 4);
  std::string header = h.dump();
  if ((8 + header.size()) % 4 == 0) header += " ";
  const std::string bytes = raw_file(header, data);
  const auto f = parse(bytes);
  ASSERT_EQ(f.tensors().size(), 4u);
  EXPECT_EQ(f.find("s")->n_elements(), 1);
  EXPECT_EQ(f.to_float32(*f.find("s")), std::vector<float>{-2.5f});
  EXPECT_EQ(f.find("e")->n_elements(), 0);
  EXPECT_TRUE(f.to_float32(*f.find("e")).empty());
  EXPECT_EQ(f.to_float32(*f.find("v")), (std::vector<float>{1.0f, -2.0f}));
  EXPECT_EQ(safetensors_dtype_size(f.find("e2")->dtype), 8);
  expect_error<CheckpointError>([&] { f.to_float32(*f.find("e2")); }, {"tensor e2", "I64", "float32"});
  // A tensor that is not from this file is refused, not read out of bounds.
  SafetensorsTensor foreign{"x", SafetensorsDtype::F32, {100}, 0, 400};
  expect_error<InvalidArgument>([&] { f.data(foreign); }, {"tensor x", "[0, 400]"});
}

TEST(Safetensors, DtypeNamesAndSizes) {
  const std::pair<SafetensorsDtype, int> all[] = {
      {SafetensorsDtype::F64, 8},  {SafetensorsDtype::F32, 4},     {SafetensorsDtype::F16, 2},
      {SafetensorsDtype::BF16, 2}, {SafetensorsDtype::I64, 8},     {SafetensorsDtype::I32, 4},
      {SafetensorsDtype::I16, 2},  {SafetensorsDtype::I8, 1},      {SafetensorsDtype::U8, 1},
      {SafetensorsDtype::BOOL, 1}, {SafetensorsDtype::F8_E4M3, 1}, {SafetensorsDtype::F8_E5M2, 1}};
  for (const auto& [d, size] : all) {
    EXPECT_EQ(safetensors_dtype_size(d), size) << to_string(d);
    // Every name parses back to its dtype with the right size check.
    const std::string bytes = one_tensor(
        {{"dtype", std::string(to_string(d))}, {"shape", {2}}, {"data_offsets", {0, 2 * size}}}, std::string(16, '\0'));
    const auto f = parse(bytes);
    EXPECT_EQ(f.tensors().at(0).dtype, d);
  }
  EXPECT_EQ(to_string(SafetensorsDtype::F8_E4M3), "F8_E4M3");
}

// ---- malformed files -----------------------------------------------------------

TEST(Safetensors, BadHeaderLength) {
  expect_bad("abc", {"3 bytes", "8-byte"});
  std::string past(20, ' ');
  const uint64_t n = 1000;
  std::memcpy(past.data(), &n, 8);
  expect_bad(past, {"header length 1000", "past the end", "20 bytes"});
  const uint64_t huge = uint64_t{1} << 60;
  std::memcpy(past.data(), &huge, 8);
  expect_bad(past, {"header length 1152921504606846976", "exceeds", "100000000"});
  expect_bad(raw_file(""), {"not valid JSON"});
}

// The 100 MB limit on a file that really has the bytes (sparse: nothing is written).
TEST(Safetensors, HeaderLimitOnALargeSparseFile) {
  TempDir d;
  const auto p = d.path() / "big.safetensors";
  const uint64_t n = 100'000'001;
  { std::ofstream(p, std::ios::binary).write(reinterpret_cast<const char*>(&n), 8); }
  std::filesystem::resize_file(p, 8 + n + 64);
  expect_error<CheckpointError>([&] { SafetensorsFile::open(p); },
                                {p.string(), "header length 100000001", "exceeds the safetensors limit"});
  expect_error<IoError>([&] { SafetensorsFile::open(d.path() / "absent.safetensors"); }, {"absent.safetensors"});
}

TEST(Safetensors, BadJson) {
  expect_bad(raw_file("{\"w\": {\"dtype\": "), {"not valid JSON"});
  expect_bad(raw_file("not json at all"), {"not valid JSON"});
  expect_bad(raw_file("[1, 2]"), {"must be a JSON object", "[1,2]"});
  expect_bad(raw_file("{\"w\": 1e999}"), {"JSON"});
  expect_bad(raw_file("{\"w\": 3}"), {"tensor w", "must be an object", "got 3"});
  // A NUL (an escaped NUL in the JSON) or control byte in a name is shown escaped, so the message survives whole.
  expect_bad(raw_file("{\"w\\u0000x\\u001b\": 3}"), {"tensor w\\x00x\\x1b: ", "must be an object", "got 3"});
}

TEST(Safetensors, MissingOrMistypedFields) {
  const json ok = {{"dtype", "F32"}, {"shape", {2}}, {"data_offsets", {0, 8}}};
  const std::string good = one_tensor(ok);
  EXPECT_NO_THROW(parse(good));
  for (const char* field : {"dtype", "shape", "data_offsets"}) {
    json e = ok;
    e.erase(field);
    expect_bad(one_tensor(e), {"tensor w", std::string("field ") + field + " is missing"});
  }
  auto with = [&](const char* key, const json& v) {
    json e = ok;
    e[key] = v;
    return one_tensor(e);
  };
  expect_bad(with("dtype", 4), {"tensor w", "dtype must be a string", "got 4"});
  expect_bad(with("dtype", "F99"), {"tensor w", "unknown dtype \"F99\"", "BF16"});
  expect_bad(with("dtype", "f32"), {"tensor w", "unknown dtype \"f32\""});
  expect_bad(with("shape", "2"), {"tensor w", "field shape must be an array", "\"2\""});
  expect_bad(with("shape", {-2}), {"tensor w", "shape[0]", "got -2"});
  expect_bad(with("shape", {1, 2.0}), {"tensor w", "shape[1]", "got 2.0"});
  expect_bad(with("data_offsets", {0}), {"tensor w", "data_offsets must be [begin, end]", "[0]"});
  expect_bad(with("data_offsets", {0, -8}), {"tensor w", "data_offsets", "[0,-8]"});
  expect_bad(with("data_offsets", {8, 0}), {"tensor w", "[8, 0]", "begin is after end"});
  expect_bad(with("data_offsets", "0:8"), {"tensor w", "data_offsets", "\"0:8\""});
}

TEST(Safetensors, SizesThatDoNotFit) {
  const std::string data(16, '\0');
  // Out of the file: 16 data bytes, the tensor claims bytes up to 24.
  expect_bad(one_tensor({{"dtype", "F32"}, {"shape", {6}}, {"data_offsets", {0, 24}}}, data),
             {"tensor w", "[0, 24]", "past the end of the 16-byte data section"});
  expect_bad(
      one_tensor({{"dtype", "F32"}, {"shape", {1}}, {"data_offsets", {uint64_t{1} << 63, (uint64_t{1} << 63) + 4}}},
                 data),
      {"tensor w", "9223372036854775808", "past the end"});
  // The dtype does not fit the byte size: F32 [3] needs 12 bytes, the range holds 8.
  expect_bad(one_tensor({{"dtype", "F32"}, {"shape", {3}}, {"data_offsets", {0, 8}}}, data),
             {"tensor w", "hold 8 bytes", "F32", "[3]", "needs 12"});
  expect_bad(one_tensor({{"dtype", "BF16"}, {"shape", {2, 2}}, {"data_offsets", {0, 16}}}, data),
             {"tensor w", "hold 16 bytes", "BF16", "needs 8"});
  // A shape product that overflows 64 bits (and one that overflows only once multiplied by the dtype size).
  expect_bad(
      one_tensor({{"dtype", "U8"}, {"shape", {uint64_t{1} << 32, uint64_t{1} << 32, 2}}, {"data_offsets", {0, 8}}},
                 data),
      {"tensor w", "4294967296", "more elements than 64-bit sizes"});
  expect_bad(one_tensor({{"dtype", "F64"}, {"shape", {uint64_t{1} << 62}}, {"data_offsets", {0, 8}}}, data),
             {"tensor w", "4611686018427387904", "more elements"});
  expect_bad(one_tensor({{"dtype", "U8"}, {"shape", {uint64_t{1} << 63}}, {"data_offsets", {0, 8}}}, data),
             {"tensor w", "more elements"});
}

TEST(Safetensors, OverlappingRanges) {
  const json h = {{"a", {{"dtype", "F32"}, {"shape", {2}}, {"data_offsets", {0, 8}}}},
                  {"b", {{"dtype", "F32"}, {"shape", {2}}, {"data_offsets", {4, 12}}}}};
  expect_bad(raw_file(h.dump(), std::string(12, '\0')), {"tensor b", "[4, 12]", "overlap tensor a", "[0, 8]"});
  // A range inside a longer earlier one.
  const json g = {{"big", {{"dtype", "U8"}, {"shape", {12}}, {"data_offsets", {0, 12}}}},
                  {"mid", {{"dtype", "U8"}, {"shape", {2}}, {"data_offsets", {6, 8}}}},
                  {"z", {{"dtype", "U8"}, {"shape", {2}}, {"data_offsets", {9, 11}}}}};
  expect_bad(raw_file(g.dump(), std::string(12, '\0')), {"tensor mid", "overlap tensor big"});
  // The same range twice.
  const json s = {{"a", {{"dtype", "U8"}, {"shape", {4}}, {"data_offsets", {0, 4}}}},
                  {"b", {{"dtype", "U8"}, {"shape", {4}}, {"data_offsets", {0, 4}}}}};
  expect_bad(raw_file(s.dump(), std::string(4, '\0')), {"overlap", "[0, 4]"});
}

TEST(Safetensors, DuplicateNamesAndKeys) {
  const std::string e = R"({"dtype": "U8", "shape": [4], "data_offsets": [0, 4]})";
  const std::string e2 = R"({"dtype": "U8", "shape": [4], "data_offsets": [4, 8]})";
  expect_bad(raw_file("{\"w\": " + e + ", \"v\": " + e2 + ", \"w\": " + e2 + "}", std::string(8, '\0')),
             {"tensor w is listed twice"});
  expect_bad(
      raw_file(R"({"w": {"dtype": "U8", "dtype": "F32", "shape": [4], "data_offsets": [0, 4]}})", std::string(4, '\0')),
      {"w: key dtype appears twice"});
  expect_bad(raw_file(R"({"__metadata__": {"a": "1", "a": "2"}})"), {"__metadata__: key a appears twice"});
}

TEST(Safetensors, Metadata) {
  const std::string bytes = raw_file(R"({"__metadata__": {"format": "pt", "note": "x"}})");
  const auto f = parse(bytes);
  EXPECT_EQ(f.metadata(), (std::map<std::string, std::string>{{"format", "pt"}, {"note", "x"}}));
  EXPECT_TRUE(f.tensors().empty());
  expect_bad(raw_file(R"({"__metadata__": {"format": "pt", "step": 100}})"),
             {"__metadata__.step", "must be a string", "got 100"});
  expect_bad(raw_file(R"({"__metadata__": {"nested": {"a": "b"}}})"), {"__metadata__.nested", "an object with 1 keys"});
  expect_bad(raw_file(R"({"__metadata__": ["pt"]})"), {"__metadata__ must be an object of strings", "[\"pt\"]"});
}

// ---- sharded checkpoints ---------------------------------------------------------

namespace {

/// The real file split into two shards (tensors alternating) plus an index.json.
struct Shards {
  TempDir dir;
  json index;
  std::vector<std::vector<TensorBytes>> parts{2};
  explicit Shards(const SafetensorsFile& f) {
    index = {{"metadata", {{"total_size", 2624000}}}, {"weight_map", json::object()}};
    for (std::size_t i = 0; i < f.tensors().size(); ++i) {
      const auto& t = f.tensors()[i];
      const auto d = f.data(t);
      parts[i % 2].push_back({t.name, "F32", t.shape, std::string(reinterpret_cast<const char*>(d.data()), d.size())});
      index["weight_map"][t.name] = shard(i % 2);
    }
  }
  static std::string shard(std::size_t i) { return fmt::format("model-{:05}-of-00002.safetensors", i + 1); }
  void write() const {
    for (std::size_t i = 0; i < 2; ++i) dir.file(shard(i), safetensors_file(parts[i]));
    dir.file("model.safetensors.index.json", index.dump(1));
  }
};

}  // namespace

TEST(SafetensorsCheckpoint, ShardedEqualsUnsharded) {
  const auto whole = SafetensorsFile::open(real_file());
  Shards s(whole);
  s.write();
  const auto ck = SafetensorsCheckpoint::open(s.dir.path());
  ASSERT_EQ(ck.files().size(), 2u);
  EXPECT_EQ(ck.describe(), "2 shards (model-0000x-of-00002.safetensors)");
  std::vector<std::string> names;
  for (const auto& t : whole.tensors()) names.push_back(t.name);
  EXPECT_EQ(ck.names(), names);
  for (std::size_t i = 0; i < whole.tensors().size(); ++i) {
    const auto& t = whole.tensors()[i];
    const auto e = ck.find(t.name);
    ASSERT_NE(e.file, nullptr) << t.name;
    ASSERT_NE(e.tensor, nullptr) << t.name;
    EXPECT_EQ(e.file, &ck.files()[i % 2]) << t.name;
    EXPECT_EQ(e.tensor->shape, t.shape);
    EXPECT_EQ(e.file->to_float32(*e.tensor), whole.to_float32(t)) << t.name;
  }
  EXPECT_EQ(ck.find("model.embed_tokens.weight").file, nullptr);
  // The index may be named directly.
  EXPECT_EQ(SafetensorsCheckpoint::open(s.dir.path() / "model.safetensors.index.json").names(), names);
}

TEST(SafetensorsCheckpoint, SingleFile) {
  const auto ck = SafetensorsCheckpoint::open(real_dir());
  EXPECT_EQ(ck.describe(), "model.safetensors");
  ASSERT_EQ(ck.files().size(), 1u);
  EXPECT_EQ(ck.names().size(), reference()["tensors"].size());
  const auto e = ck.find("model.norm.weight");
  ASSERT_NE(e.tensor, nullptr);
  EXPECT_EQ(e.tensor->shape, std::vector<int64_t>{128});
  EXPECT_EQ(SafetensorsCheckpoint::open(real_file()).names(), ck.names());
  TempDir empty;
  expect_error<IoError>([&] { SafetensorsCheckpoint::open(empty.path()); },
                        {empty.path().string(), "model.safetensors.index.json", "model.safetensors"});
}

TEST(SafetensorsCheckpoint, BadIndexes) {
  const auto whole = SafetensorsFile::open(real_file());
  const std::string idx = "model.safetensors.index.json";
  {  // a tensor the index names but its shard lacks
    Shards s(whole);
    s.index["weight_map"]["model.ghost.weight"] = Shards::shard(1);
    s.write();
    expect_error<CheckpointError>([&] { SafetensorsCheckpoint::open(s.dir.path()); },
                                  {idx, "model.ghost.weight", "model-00002-of-00002.safetensors", "does not have it"});
  }
  {  // a shard file that is not there
    Shards s(whole);
    s.index["weight_map"]["model.norm.weight"] = "model-00003-of-00002.safetensors";
    s.write();
    expect_error<IoError>([&] { SafetensorsCheckpoint::open(s.dir.path()); },
                          {idx, "model-00003-of-00002.safetensors", "model.norm.weight", "does not exist"});
  }
  for (const std::string bad : {"../x", "sub/../../x.safetensors", "/etc/passwd", ""}) {
    Shards s(whole);
    s.index["weight_map"]["model.norm.weight"] = bad;
    s.write();
    expect_error<CheckpointError>([&] { SafetensorsCheckpoint::open(s.dir.path()); },
                                  {idx, "weight_map.model.norm.weight", "\"" + bad + "\""});
  }
  {  // a tensor in both shards
    Shards s(whole);
    s.parts[1].push_back(s.parts[0][0]);
    s.write();
    expect_error<CheckpointError>([&] { SafetensorsCheckpoint::open(s.dir.path()); },
                                  {idx, "tensor " + s.parts[0][0].name, "in two shards"});
  }
  {  // a tensor of a shard the weight_map does not list
    Shards s(whole);
    s.index["weight_map"].erase("model.norm.weight");
    s.write();
    expect_error<CheckpointError>([&] { SafetensorsCheckpoint::open(s.dir.path()); },
                                  {idx, "model.norm.weight", "not in the weight_map"});
  }
  {  // the weight_map puts a tensor in the wrong shard
    Shards s(whole);
    s.index["weight_map"]["lm_head.weight"] = Shards::shard(1);
    s.write();
    expect_error<CheckpointError>([&] { SafetensorsCheckpoint::open(s.dir.path()); },
                                  {idx, "lm_head.weight", "model-00002-of-00002.safetensors", "it is in"});
  }
  {  // malformed index files
    Shards s(whole);
    s.write();
    s.dir.file(idx, "{\"weight_map\": ");
    expect_error<CheckpointError>([&] { SafetensorsCheckpoint::open(s.dir.path()); }, {idx, "not valid JSON"});
    s.dir.file(idx, R"({"weight_map": ["a"]})");
    expect_error<CheckpointError>([&] { SafetensorsCheckpoint::open(s.dir.path()); },
                                  {idx, "weight_map must be an object"});
    s.dir.file(idx, R"({"metadata": {}})");
    expect_error<CheckpointError>([&] { SafetensorsCheckpoint::open(s.dir.path()); },
                                  {idx, "weight_map", "got nothing"});
    s.dir.file(idx, R"({"weight_map": {"a": 1}})");
    expect_error<CheckpointError>([&] { SafetensorsCheckpoint::open(s.dir.path()); }, {idx, "weight_map.a", "got 1"});
    s.dir.file(idx, R"({"weight_map": {"a": "x.safetensors", "a": "y.safetensors"}})");
    expect_error<CheckpointError>([&] { SafetensorsCheckpoint::open(s.dir.path()); }, {idx, "weight_map.a", "twice"});
    s.dir.file(idx, R"({"metadata": 3, "weight_map": {"a": "x.safetensors"}})");
    expect_error<CheckpointError>([&] { SafetensorsCheckpoint::open(s.dir.path()); },
                                  {idx, "metadata must be an object"});
    s.dir.file(idx, R"({"weight_map": {}})");
    expect_error<CheckpointError>([&] { SafetensorsCheckpoint::open(s.dir.path()); }, {idx, "weight_map is empty"});
  }
  {  // a bad shard names the shard file
    Shards s(whole);
    s.write();
    s.dir.file(Shards::shard(1), "short");
    expect_error<CheckpointError>([&] { SafetensorsCheckpoint::open(s.dir.path()); },
                                  {"model-00002-of-00002.safetensors", "5 bytes"});
  }
}

// nlohmann parses and destroys deep nesting without recursion; the reader must not
// recurse either (it never dump()s a container into a message).
TEST(Safetensors, DeeplyNestedHeaderIsRefused) {
  const std::size_t depth = 200000;
  const std::string header = "{\"w\": " + std::string(depth, '[') + std::string(depth, ']') + "}";
  expect_bad(raw_file(header), {"tensor w", "entry must be an object", "an array of 1 elements"});
  const std::string meta = "{\"__metadata__\": {\"k\": " + std::string(depth, '[') + std::string(depth, ']') + "}}";
  expect_bad(raw_file(meta), {"__metadata__.k", "an array of 1 elements"});
}

}  // namespace POSENC_UNITY_ID
