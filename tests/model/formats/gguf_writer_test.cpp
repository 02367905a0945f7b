// GgufWriter: write -> parse round trips (every value type, every supported
// tensor type, the real files rewritten), layout, errors; the fuzz seed corpus.
#include <cstdlib>
#include <fstream>

#include <gtest/gtest.h>

#include "gguf_seed_files.hpp"
#include "gguf_test_support.hpp"
#include "posenc/error.hpp"
#include "posenc/gguf.hpp"

namespace POSENC_UNITY_ID {  // this file's own namespace in the tests' unity build (CMakeLists.txt)

using namespace posenc;
using namespace posenc::test::gguf;
using VT = GgufValue::Type;

namespace {

template <class F>
std::string invalid_argument_message(F&& f) {
  try {
    f();
  } catch (const InvalidArgument& e) {
    return e.what();
  }
  return "<no InvalidArgument>";
}

}  // namespace

TEST(GgufWriter, EveryValueAndTensorTypeRoundTrips) {
  const std::string bytes = every_type_writer().serialize();
  const GgufFile f = GgufFile::parse(as_bytes(bytes), "every_type.gguf");
  EXPECT_EQ(f.version(), 3u);
  EXPECT_EQ(f.alignment(), 32u);
  EXPECT_EQ(f.data_offset() % 32, 0u);
  EXPECT_EQ(bytes.size() % 32, 0u);  // every tensor, the last one too, is padded to the alignment

  // metadata: what was added comes back, value for value and type for type
  EXPECT_EQ(f.metadata().size(), 28u);
  const GgufValue* u8 = f.find("k.uint8");
  ASSERT_NE(u8, nullptr);
  EXPECT_EQ(u8->type, VT::uint8);
  EXPECT_EQ(std::get<uint64_t>(u8->scalar), 255u);
  EXPECT_EQ(std::get<int64_t>(f.find("k.int8")->scalar), -128);
  EXPECT_EQ(std::get<int64_t>(f.find("k.int64")->scalar), INT64_MIN);
  EXPECT_EQ(std::get<uint64_t>(f.find("k.uint64")->scalar), UINT64_MAX);
  EXPECT_EQ(f.get_float("k.float32"), static_cast<double>(-1.5e-7f));
  EXPECT_EQ(f.get_float("k.float64"), 2.718281828459045);
  EXPECT_EQ(f.get_string("k.string"), "h\xc3\xa9llo");
  EXPECT_EQ(f.get_string("k.empty_string"), "");
  EXPECT_EQ(f.get_int_array("a.uint8"), (std::vector<int64_t>{0, 1, 255}));
  EXPECT_EQ(f.find("a.bool")->array_type, VT::boolean);
  EXPECT_EQ(f.find("a.bool")->ints, (std::vector<int64_t>{1, 0, 1}));
  EXPECT_EQ(f.find("a.uint64")->uints, (std::vector<uint64_t>{0, UINT64_MAX}));
  EXPECT_EQ(f.get_float_array("a.float32"), (std::vector<double>{0.5, -0.0, 3.4028234663852886e38}));
  EXPECT_TRUE(std::signbit(f.get_float_array("a.float32")->at(1)));
  EXPECT_EQ(f.get_float_array("a.float64"), (std::vector<double>{1e300, -1e-300}));
  EXPECT_EQ(f.find("a.empty")->array_size, 0u);
  const GgufValue* aa = f.find("a.array");
  ASSERT_NE(aa, nullptr);
  ASSERT_EQ(aa->array_type, VT::array);
  ASSERT_EQ(aa->arrays.size(), 4u);
  EXPECT_EQ(aa->arrays[0].array_type, VT::int16);
  EXPECT_EQ(aa->arrays[0].ints, (std::vector<int64_t>{1, 2}));
  EXPECT_EQ(aa->arrays[1].strings, (std::vector<std::string>{"x", "yz"}));
  EXPECT_EQ(aa->arrays[2].arrays.at(0).ints, (std::vector<int64_t>{9}));
  EXPECT_EQ(aa->arrays[3].array_size, 0u);

  // parse -> re-add every value -> parse: the same values (GgufValue::operator==)
  GgufWriter w2;
  for (const auto& [k, v] : f.metadata()) w2.add_value(k, v);
  const std::string bytes2 = w2.serialize();
  const GgufFile f2 = GgufFile::parse(as_bytes(bytes2), "again.gguf");
  EXPECT_EQ(f2.metadata(), f.metadata());

  // tensors: file order, sequential 32-aligned offsets, the bytes that were given
  const GgufWriter w = every_type_writer();
  const std::vector<std::pair<std::string, GgmlType>> expect = {
      {"f32.matrix", GgmlType::f32}, {"f16.vector", GgmlType::f16}, {"bf16.3d", GgmlType::bf16},
      {"q8_0.rows", GgmlType::q8_0}, {"q4_0.row", GgmlType::q4_0},   {"f32.scalar", GgmlType::f32},
      {"f32.empty", GgmlType::f32},  {"f32.4d", GgmlType::f32}};
  ASSERT_EQ(f.tensors().size(), expect.size());
  uint64_t next = 0;
  for (std::size_t i = 0; i < expect.size(); ++i) {
    const auto& t = f.tensors()[i];
    EXPECT_EQ(t.name, expect[i].first);
    EXPECT_EQ(t.type, expect[i].second);
    EXPECT_EQ(t.offset, next) << t.name;
    next = (t.offset + t.n_bytes + 31) / 32 * 32;
  }
  EXPECT_EQ(f.data_offset() + next, bytes.size());
  const auto* q8 = f.find_tensor("q8_0.rows");
  EXPECT_EQ(q8->ne, (std::vector<int64_t>{32, 2}));
  EXPECT_EQ(hex(f.tensor_data(*q8)), hex(ggml_quantize(GgmlType::q8_0, test_values(64, 0.5f, 4))));
  const auto* q4 = f.find_tensor("q4_0.row");
  EXPECT_EQ(hex(f.tensor_data(*q4)), hex(ggml_quantize(GgmlType::q4_0, test_values(64, 3.0f, 5))));
  EXPECT_EQ(f.to_float32(*f.find_tensor("f32.matrix")), test_values(8, 2.0f, 1));
  const auto* scalar_t = f.find_tensor("f32.scalar");
  EXPECT_TRUE(scalar_t->ne.empty());
  EXPECT_EQ(scalar_t->n_elements(), 1);
  EXPECT_EQ(f.to_float32(*scalar_t), std::vector<float>{7.0f});
  const auto* empty = f.find_tensor("f32.empty");
  EXPECT_EQ(empty->n_bytes, 0u);
  EXPECT_TRUE(f.to_float32(*empty).empty());
  EXPECT_EQ(f.find_tensor("f32.4d")->ne, (std::vector<int64_t>{1, 2, 1, 2}));
  // f16 of values up to 1000: each within half an ulp of binary16 (2^-11 relative)
  const auto f16 = f.to_float32(*f.find_tensor("f16.vector"));
  const auto orig = test_values(8, 1000.0f, 2);
  for (std::size_t i = 0; i < 8; ++i) EXPECT_LE(std::fabs(f16[i] - orig[i]), std::fabs(orig[i]) * 0x1.0p-11f) << i;
}

TEST(GgufWriter, KeysAreWrittenInInsertionOrder) {
  GgufWriter w;
  const std::vector<std::string> keys = {"zeta", "alpha", "mid.key", "beta"};
  for (std::size_t i = 0; i < keys.size(); ++i) w.add_uint32(keys[i], static_cast<uint32_t>(i));
  const std::string bytes = w.serialize();
  std::size_t last = 0;
  for (const auto& k : keys) {
    const std::size_t at = find_gguf_string(bytes, k);
    ASSERT_NE(at, std::string::npos) << k;
    EXPECT_GT(at, last) << k;
    last = at;
  }
  EXPECT_EQ(bytes.substr(0, 4), "GGUF");
  EXPECT_EQ(peek<uint32_t>(bytes, 4), 3u);  // version
  EXPECT_EQ(peek<uint64_t>(bytes, 8), 0u);  // tensor_count
  EXPECT_EQ(peek<uint64_t>(bytes, 16), 4u);  // kv_count
}

TEST(GgufWriter, WriteIsTheSerializedBytesAndOpens) {
  posenc::test::TempDir d;
  const auto path = d.path() / "sub" / "every_type.gguf";
  const GgufWriter w = every_type_writer();
  w.write(path);
  EXPECT_EQ(posenc::test::slurp(path), w.serialize());
  const GgufFile f = GgufFile::open(path);
  EXPECT_EQ(f.source(), path.string());
  EXPECT_EQ(f.tensors().size(), 8u);
  EXPECT_EQ(f.to_float32(*f.find_tensor("f32.4d")), test_values(4, 1.0f, 6));
}

TEST(GgufWriter, Alignment64IsHonoured) {
  const auto seeds = seed_files();
  const auto& bytes = std::find_if(seeds.begin(), seeds.end(), [](auto& s) { return s.first == "alignment64.gguf"; })->second;
  const GgufFile f = GgufFile::parse(as_bytes(bytes), "alignment64.gguf");
  EXPECT_EQ(f.alignment(), 64u);
  EXPECT_EQ(f.data_offset() % 64, 0u);
  ASSERT_EQ(f.tensors().size(), 2u);
  EXPECT_EQ(f.tensors()[0].offset, 0u);
  EXPECT_EQ(f.tensors()[1].offset, 64u);  // 34 bytes of q8_0, padded to 64
  EXPECT_EQ(bytes.size(), f.data_offset() + 128);
}

TEST(GgufWriter, VersionTwoParsesTheSame) {
  const auto seeds = seed_files();
  const GgufFile v3 = GgufFile::parse(as_bytes(seeds[0].second), "v3");
  const GgufFile v2 = GgufFile::parse(as_bytes(seeds[1].second), "v2");
  EXPECT_EQ(v2.version(), 2u);
  EXPECT_EQ(v2.metadata(), v3.metadata());
  ASSERT_EQ(v2.tensors().size(), v3.tensors().size());
  for (std::size_t i = 0; i < v2.tensors().size(); ++i) EXPECT_EQ(v2.tensors()[i].offset, v3.tensors()[i].offset);
}

// The real files rewritten by GgufWriter: the same metadata and tensors, and since
// both writers lay the tensors out in order at 32-byte boundaries, the same data section.
TEST(GgufWriter, RealFilesRewriteToTheSameMetadataAndData) {
  for (const auto& path : {stories_gguf(), tinystories_gguf()}) {
    SCOPED_TRACE(path.filename().string());
    const GgufFile f = GgufFile::open(path);
    GgufWriter w;
    for (const auto& [k, v] : f.metadata()) w.add_value(k, v);
    for (const auto& t : f.tensors()) {
      const auto d = f.tensor_data(t);
      w.add_tensor(t.name, t.ne, t.type, std::vector<std::byte>(d.begin(), d.end()));
    }
    const std::string bytes = w.serialize();
    const GgufFile g = GgufFile::parse(as_bytes(bytes), "rewritten.gguf");
    EXPECT_EQ(g.metadata(), f.metadata());
    ASSERT_EQ(g.tensors().size(), f.tensors().size());
    for (std::size_t i = 0; i < f.tensors().size(); ++i) {
      const auto &a = f.tensors()[i], &b = g.tensors()[i];
      EXPECT_EQ(b.name, a.name);
      EXPECT_EQ(b.ne, a.ne);
      EXPECT_EQ(b.type, a.type);
      EXPECT_EQ(b.offset, a.offset);
      EXPECT_EQ(b.n_bytes, a.n_bytes);
    }
    const std::string orig = posenc::test::slurp(path);
    EXPECT_EQ(bytes.size() - g.data_offset(), orig.size() - f.data_offset());
    EXPECT_TRUE(bytes.compare(g.data_offset(), std::string::npos, orig, f.data_offset(), std::string::npos) == 0)
        << "data sections differ";
  }
}

TEST(GgufWriter, RefusesInconsistentInput) {
  GgufWriter w;
  w.add_uint32("a", 1);
  EXPECT_NE(invalid_argument_message([&] { w.add_string("a", "x"); }).find("'a' added twice"), std::string::npos);
  EXPECT_NE(invalid_argument_message([&] { w.add_bool("", true); }).find("empty metadata key"), std::string::npos);
  EXPECT_NE(invalid_argument_message([&] { w.add_bool(std::string("bad\x01key"), true); }).find("not printable ASCII"),
            std::string::npos);
  EXPECT_NE(invalid_argument_message([&] { w.add_bool("caf\xc3\xa9", true); }).find("not printable ASCII"),
            std::string::npos);
  EXPECT_NE(invalid_argument_message([&] { w.add_bool(std::string(65536, 'k'), true); }).find("at most 65535 bytes"),
            std::string::npos);
  EXPECT_NE(invalid_argument_message([&] { w.add_uint32("general.alignment", 48); }).find("power of two (got 48)"),
            std::string::npos);
  EXPECT_NE(invalid_argument_message([&] { w.add_int32("general.alignment", 32); }).find("must be a uint32"),
            std::string::npos);
  EXPECT_NE(invalid_argument_message([&] { w.add_value("u8", scalar(VT::uint8, uint64_t{256})); })
                .find("256 is out of range of uint8"),
            std::string::npos);
  EXPECT_NE(invalid_argument_message([&] { w.add_value("i8a", int_array(VT::int8, {1, -129})); })
                .find("metadata 'i8a'[1]: -129 is out of range of int8"),
            std::string::npos);
  GgufValue bad = int_array(VT::int32, {1, 2});
  bad.array_size = 3;
  EXPECT_NE(invalid_argument_message([&] { w.add_value("sz", bad); }).find("array_size 3 does not match the 2"),
            std::string::npos);
  EXPECT_NE(invalid_argument_message([&] { w.add_value("f", scalar(VT::float32, 1e39)); }).find("out of range of float32"),
            std::string::npos);
  EXPECT_NE(invalid_argument_message([&] { w.add_value("s", scalar(VT::string, int64_t{1})); }).find("string scalar"),
            std::string::npos);
  GgufValue deep = int_array(VT::uint8, {1});
  for (int i = 0; i < 16; ++i) deep = array_of_arrays({deep});  // 17 levels
  EXPECT_NE(invalid_argument_message([&] { w.add_value("deep", deep); }).find("nested more than 16"), std::string::npos);

  w.add_tensor("t", {32}, GgmlType::q8_0, std::vector<std::byte>(34));
  EXPECT_NE(invalid_argument_message([&] { w.add_tensor("t", {32}, GgmlType::q8_0, std::vector<std::byte>(34)); })
                .find("tensor 't' added twice"),
            std::string::npos);
  EXPECT_NE(invalid_argument_message([&] { w.add_tensor("u", {32}, GgmlType::q8_0, std::vector<std::byte>(33)); })
                .find("32 q8_0 elements take 34 bytes (got 33)"),
            std::string::npos);
  EXPECT_NE(invalid_argument_message([&] { w.add_tensor("u", {16}, GgmlType::q4_0, std::vector<std::byte>(9)); })
                .find("multiple of the q4_0 block size 32 (got 16)"),
            std::string::npos);
  EXPECT_NE(invalid_argument_message([&] { w.add_tensor("u", {1, 1, 1, 1, 1}, GgmlType::f32, {}); })
                .find("at most 4 dimensions"),
            std::string::npos);
  EXPECT_NE(invalid_argument_message([&] { w.add_tensor("u", {4}, static_cast<GgmlType>(77), {}); })
                .find("unknown ggml type 77"),
            std::string::npos);
  EXPECT_NE(invalid_argument_message([&] { w.add_tensor("", {1}, GgmlType::f32, std::vector<std::byte>(4)); })
                .find("empty tensor name"),
            std::string::npos);
  // a refused add leaves the writer as it was
  const GgufFile f = GgufFile::parse(as_bytes(w.serialize()), "w");
  EXPECT_EQ(f.metadata().size(), 1u);
  EXPECT_EQ(f.tensors().size(), 1u);
}

// fuzz/corpus/gguf/ holds exactly seed_files(); POSENC_WRITE_FUZZ_CORPUS=1 rewrites it.
TEST(GgufFuzzCorpus, SeedsAreCurrent) {
  const auto dir = std::filesystem::path(POSENC_SOURCE_DIR) / "fuzz/corpus/gguf";
  const auto seeds = seed_files();
  if (const char* e = std::getenv("POSENC_WRITE_FUZZ_CORPUS"); e != nullptr && std::string(e) == "1") {
    std::filesystem::create_directories(dir);
    for (const auto& [name, bytes] : seeds) write_file_atomic(dir / name, bytes);
  }
  std::size_t on_disk = 0;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) on_disk += entry.is_regular_file();
  EXPECT_EQ(on_disk, seeds.size());
  for (const auto& [name, bytes] : seeds) {
    SCOPED_TRACE(name);
    ASSERT_TRUE(std::filesystem::exists(dir / name)) << "run with POSENC_WRITE_FUZZ_CORPUS=1 to write the corpus";
    EXPECT_TRUE(posenc::test::slurp(dir / name) == bytes) << "stale seed; POSENC_WRITE_FUZZ_CORPUS=1 rewrites it";
    EXPECT_NO_THROW(GgufFile::parse(as_bytes(bytes), name));
  }
}

}  // namespace POSENC_UNITY_ID
