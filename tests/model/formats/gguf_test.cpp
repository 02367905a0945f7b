// GGUF reader/writer/quantizer against gguf-py's view of the real files
// (tests/model/formats/data/gguf_reference.json, made by tools/refs/gguf_refs.py)
// and against the llama2.c checkpoint of the same model.
#include <chrono>
#include <cmath>
#include <cstring>
#include <iostream>

#include <gtest/gtest.h>

#include "gguf_test_support.hpp"
#include "posenc/error.hpp"
#include "posenc/gguf.hpp"

namespace POSENC_UNITY_ID {  // this file's own namespace in the tests' unity build (CMakeLists.txt)

using namespace posenc;
using namespace posenc::test::gguf;
using nlohmann::json;
using VT = GgufValue::Type;

namespace {

const json& file_ref(const std::string& name) { return reference().at("files").at(name); }

/// The array's elements encoded as the file stores them (the bytes gguf_refs.py hashes).
std::string element_bytes(const GgufValue& v) {
  std::string out;
  auto put = [&](const void* p, std::size_t n) { out.append(static_cast<const char*>(p), n); };
  switch (v.array_type) {
    case VT::string:
      for (const auto& s : v.strings) {
        const uint64_t n = s.size();
        put(&n, 8);
        out += s;
      }
      break;
    case VT::uint64: for (auto x : v.uints) put(&x, 8); break;
    case VT::float32:
      for (auto x : v.floats) {
        const auto f = static_cast<float>(x);
        put(&f, 4);
      }
      break;
    case VT::float64: for (auto x : v.floats) put(&x, 8); break;
    case VT::uint8: case VT::int8: case VT::boolean:
      for (auto x : v.ints) {
        const auto b = static_cast<uint8_t>(x);
        put(&b, 1);
      }
      break;
    case VT::uint16: case VT::int16:
      for (auto x : v.ints) {
        const auto b = static_cast<uint16_t>(x);
        put(&b, 2);
      }
      break;
    case VT::uint32: case VT::int32:
      for (auto x : v.ints) {
        const auto b = static_cast<uint32_t>(x);
        put(&b, 4);
      }
      break;
    case VT::int64: for (auto x : v.ints) put(&x, 8); break;
    default: ADD_FAILURE() << "unexpected element type " << to_string(v.array_type);
  }
  return out;
}

/// Element i of an array value as JSON (for comparing with gguf-py's first/last elements).
json element_json(const GgufValue& v, std::size_t i) {
  switch (v.array_type) {
    case VT::string: return v.strings.at(i);
    case VT::uint64: return v.uints.at(i);
    case VT::float32: case VT::float64: return v.floats.at(i);
    case VT::boolean: return v.ints.at(i) != 0;
    default: return v.ints.at(i);
  }
}

json scalar_json(const GgufValue& v) {
  if (const auto* s = std::get_if<std::string>(&v.scalar)) return *s;
  if (const auto* b = std::get_if<bool>(&v.scalar)) return *b;
  if (const auto* d = std::get_if<double>(&v.scalar)) return *d;
  if (const auto* u = std::get_if<uint64_t>(&v.scalar)) return *u;
  if (const auto* i = std::get_if<int64_t>(&v.scalar)) return *i;
  return nullptr;
}

void expect_matches_reference(const GgufFile& f, const json& ref) {
  EXPECT_EQ(f.version(), ref.at("version").get<uint32_t>());
  EXPECT_EQ(f.tensors().size(), ref.at("tensor_count").get<std::size_t>());
  EXPECT_EQ(f.metadata().size(), ref.at("kv_count").get<std::size_t>());
  EXPECT_EQ(f.alignment(), ref.at("alignment").get<uint64_t>());
  EXPECT_EQ(f.data_offset(), ref.at("data_offset").get<uint64_t>());

  ASSERT_EQ(ref.at("metadata").size(), f.metadata().size());
  for (const auto& m : ref.at("metadata")) {
    const std::string key = m.at("key");
    SCOPED_TRACE(key);
    const GgufValue* v = f.find(key);
    ASSERT_NE(v, nullptr);
    EXPECT_EQ(to_string(v->type), m.at("type").get<std::string>());
    if (v->type != VT::array) {
      EXPECT_EQ(scalar_json(*v), m.at("value"));
      continue;
    }
    EXPECT_EQ(to_string(v->array_type), m.at("element_type").get<std::string>());
    const auto n = m.at("count").get<std::size_t>();
    ASSERT_EQ(v->array_size, n);
    EXPECT_EQ(fnv1a64(element_bytes(*v)), m.at("fnv1a64").get<std::string>());
    if (m.contains("values")) {
      for (std::size_t i = 0; i < n; ++i) EXPECT_EQ(element_json(*v, i), m.at("values").at(i));
    } else {
      for (std::size_t i = 0; i < 3; ++i) {
        EXPECT_EQ(element_json(*v, i), m.at("first").at(i));
        EXPECT_EQ(element_json(*v, n - 3 + i), m.at("last").at(i));
      }
    }
  }

  const auto& tref = ref.at("tensors");
  ASSERT_EQ(tref.size(), f.tensors().size());
  for (std::size_t i = 0; i < tref.size(); ++i) {
    const auto& r = tref[i];
    const GgufTensorInfo& t = f.tensors()[i];  // file order
    SCOPED_TRACE(t.name);
    EXPECT_EQ(t.name, r.at("name").get<std::string>());
    EXPECT_EQ(static_cast<uint32_t>(t.type), r.at("type").get<uint32_t>());
    std::string upper = ggml_type_name(static_cast<uint32_t>(t.type));
    for (auto& c : upper) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
    EXPECT_EQ(upper, r.at("type_name").get<std::string>());
    EXPECT_EQ(t.ne, r.at("ne").get<std::vector<int64_t>>());
    EXPECT_EQ(t.offset, r.at("offset").get<uint64_t>());
    EXPECT_EQ(t.n_bytes, r.at("n_bytes").get<uint64_t>());
    EXPECT_EQ(t.n_elements(), r.at("n_elements").get<int64_t>());
    EXPECT_EQ(f.find_tensor(t.name), &t);

    const std::vector<float> x = f.to_float32(t);
    ASSERT_EQ(static_cast<int64_t>(x.size()), t.n_elements());
    EXPECT_EQ(fnv1a64(std::span<const float>(x)), r.at("fnv1a64_f32").get<std::string>());  // bit-exact
    double sum = 0, sum_sq = 0;
    for (float v : x) {
      sum += v;
      sum_sq += static_cast<double>(v) * v;
    }
    const double rs = r.at("sum"), rq = r.at("sum_sq");
    EXPECT_NEAR(sum, rs, 1e-9 * std::max(1.0, rq));  // summation order differs from numpy's pairwise sum
    EXPECT_NEAR(sum_sq, rq, 1e-9 * std::max(1.0, rq));
    for (const auto& s : r.at("samples")) EXPECT_EQ(x.at(s.at(0).get<std::size_t>()), s.at(1).get<float>());
  }
}

}  // namespace

TEST(GgufReference, GeneratorVersionsAreRecorded) {
  const auto& g = reference().at("generator");
  EXPECT_EQ(g.at("gguf_py_version").get<std::string>(), "0.19.0");
  EXPECT_EQ(g.at("llama_cpp_commit").get<std::string>(), "de3ff81");
}

TEST(GgufReference, Stories260KMatchesGgufPy) {
  const GgufFile f = GgufFile::open(stories_gguf());
  EXPECT_EQ(std::filesystem::file_size(stories_gguf()), file_ref("stories260K.gguf").at("size").get<uint64_t>());
  expect_matches_reference(f, file_ref("stories260K.gguf"));
  // facts SOURCES.md states about the file
  EXPECT_EQ(f.get_string("general.architecture"), "llama");
  EXPECT_EQ(f.get_int("llama.context_length"), 2048);
  EXPECT_FALSE(f.get_float("llama.rope.freq_base").has_value());
  EXPECT_NE(f.find_tensor("output.weight"), nullptr);
  EXPECT_EQ(f.get_string_array("tokenizer.ggml.tokens")->size(), 512u);
}

TEST(GgufReference, TinyStoriesQ8_0MatchesGgufPy) {
  const GgufFile f = GgufFile::open(tinystories_gguf());
  expect_matches_reference(f, file_ref("TinyStories-656K-Q8_0.gguf"));
  EXPECT_EQ(f.find_tensor("output.weight"), nullptr);  // tied to token_embd
  const auto scores = f.get_float_array("tokenizer.ggml.scores");
  ASSERT_TRUE(scores.has_value());
  ASSERT_EQ(scores->size(), 2048u);
  for (double s : *scores) ASSERT_EQ(s, -1000.0);  // SOURCES.md: all 2048 scores are -1000
  EXPECT_EQ(f.get_bool("tokenizer.ggml.add_bos_token"), true);
  EXPECT_EQ(f.get_float("llama.rope.freq_base"), 10000.0);
  int q8 = 0;
  for (const auto& t : f.tensors()) q8 += t.type == GgmlType::q8_0;
  EXPECT_EQ(q8, 15);  // token_embd + 7 matrices in each of the 2 layers
}

// The same weights in the llama2.c checkpoint (another writer, another format):
// token_embd.weight is its token_embedding_table, blk.L.attn_norm.weight its rms_att_weight[L].
TEST(GgufRealData, Stories260KF32TensorsEqualTheLlama2cCheckpoint) {
  const GgufFile f = GgufFile::open(stories_gguf());
  const std::string bin = posenc::test::slurp(posenc::test::model_path());
  ASSERT_GT(bin.size(), 28u);
  int32_t hdr[7];
  std::memcpy(hdr, bin.data(), sizeof hdr);
  const int dim = hdr[0], layers = hdr[2], vocab = std::abs(hdr[5]);
  ASSERT_EQ(dim, 64);
  auto bin_floats = [&](std::size_t first, std::size_t n) {
    std::vector<float> v(n);
    std::memcpy(v.data(), bin.data() + 28 + 4 * first, 4 * n);
    return v;
  };
  const auto* emb = f.find_tensor("token_embd.weight");
  ASSERT_NE(emb, nullptr);
  EXPECT_EQ(emb->ne, (std::vector<int64_t>{dim, vocab}));
  EXPECT_EQ(f.to_float32(*emb), bin_floats(0, static_cast<std::size_t>(vocab * dim)));
  for (int l = 0; l < layers; ++l) {
    const auto* t = f.find_tensor(fmt::format("blk.{}.attn_norm.weight", l));
    ASSERT_NE(t, nullptr);
    EXPECT_EQ(f.to_float32(*t), bin_floats(static_cast<std::size_t>(vocab * dim + l * dim), dim)) << l;
  }
}

// Q8_0 round trip: every block ggml's quantizer writes has max |q| == 127 (or is
// all zero), so dequantizing and quantizing again must give the same bytes.
TEST(GgufRealData, RequantizingTinyStoriesQ8_0TensorsGivesTheSameBytes) {
  const GgufFile f = GgufFile::open(tinystories_gguf());
  int checked = 0;
  int64_t blocks = 0;
  for (const auto& t : f.tensors()) {
    if (t.type != GgmlType::q8_0) continue;
    const auto raw = f.tensor_data(t);
    const std::vector<float> x = f.to_float32(t);
    const std::vector<std::byte> again = ggml_quantize(GgmlType::q8_0, x);
    ASSERT_EQ(again.size(), raw.size()) << t.name;
    int64_t differing = 0;
    for (std::size_t b = 0; b < raw.size(); b += 34)
      differing += std::memcmp(raw.data() + b, again.data() + b, 34) != 0;
    EXPECT_EQ(differing, 0) << t.name << ": blocks that differ after dequantize + quantize";
    blocks += static_cast<int64_t>(raw.size() / 34);
    ++checked;
  }
  EXPECT_EQ(checked, 15);
  EXPECT_EQ(blocks, 20480);  // 655360 quantized weights / 32
}

TEST(GgufRealData, OpenAndValidateTime) {
  for (const auto& p : {stories_gguf(), tinystories_gguf()}) {
    constexpr int kRuns = 20;
    const auto t0 = std::chrono::steady_clock::now();
    std::size_t n = 0;
    for (int i = 0; i < kRuns; ++i) n += GgufFile::open(p).tensors().size();
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count() / kRuns;
    std::cout << "[ info ] open+validate " << p.filename().string() << ": " << fmt::format("{:.3f}", ms) << " ms ("
              << n / kRuns << " tensors)\n";
    RecordProperty(p.filename().string() + "_open_ms", fmt::format("{:.3f}", ms));
    EXPECT_GT(n, 0u);
  }
}

// ---- quantization against gguf-py -------------------------------------------------

namespace {

void expect_quantization_matches(std::span<const float> x, const json& ref) {
  ASSERT_EQ(static_cast<int64_t>(x.size()), ref.at("n_values").get<int64_t>());
  const std::pair<const char*, GgmlType> types[] = {
      {"q8_0", GgmlType::q8_0}, {"q4_0", GgmlType::q4_0}, {"f16", GgmlType::f16}, {"bf16", GgmlType::bf16}};
  for (const auto& [name, type] : types) {
    SCOPED_TRACE(name);
    const auto& r = ref.at(name);
    const std::vector<std::byte> q = ggml_quantize(type, x);
    ASSERT_EQ(q.size(), r.at("n_bytes").get<std::size_t>());
    EXPECT_EQ(fnv1a64(q), r.at("fnv1a64").get<std::string>());
    const std::size_t block_bytes = type == GgmlType::q8_0 ? 34 : type == GgmlType::q4_0 ? 18 : 64;
    ASSERT_FALSE(r.at("blocks").empty());
    for (const auto& [idx, bytes] : r.at("blocks").items()) {
      const std::size_t i = std::stoul(idx);
      EXPECT_EQ(hex(std::span<const std::byte>(q).subspan(i * block_bytes, block_bytes)), bytes.get<std::string>())
          << "block " << i;
    }
    std::vector<float> y(x.size());
    ggml_dequantize(type, q, y);
    if (r.contains("dequantized_fnv1a64_f32")) {
      EXPECT_EQ(fnv1a64(std::span<const float>(y)), r.at("dequantized_fnv1a64_f32").get<std::string>());
    }
  }
}

}  // namespace

TEST(GgufQuantReference, TokenEmbeddingQuantizesLikeGgufPy) {
  const GgufFile f = GgufFile::open(stories_gguf());
  std::vector<float> all = f.to_float32(*f.find_tensor("token_embd.weight"));
  const auto& ref = reference().at("quantization").at("token_embd");
  std::vector<float> x(all.begin(), all.begin() + 4096);
  ASSERT_EQ(fnv1a64(std::span<const float>(x)), ref.at("input_fnv1a64_f32").get<std::string>());
  expect_quantization_matches(x, ref);
}

TEST(GgufQuantReference, EdgeCasesQuantizeLikeGgufPy) {
  const auto& ref = reference().at("quantization").at("edge");
  std::vector<float> x;
  for (const auto& b : ref.at("input_bits")) x.push_back(std::bit_cast<float>(static_cast<uint32_t>(
      std::stoul(b.get<std::string>(), nullptr, 16))));
  expect_quantization_matches(x, ref);
  // the set does reach the corners it is meant for
  const std::vector<std::byte> q8 = ggml_quantize(GgmlType::q8_0, x);
  auto d_bits = [&](int block) { uint16_t d; std::memcpy(&d, q8.data() + 34 * block, 2); return d; };
  EXPECT_EQ(d_bits(0), 0);          // all-zero block
  EXPECT_EQ(d_bits(2) & 0x7c00, 0);  // subnormal scale
  EXPECT_NE(d_bits(2), 0);
  EXPECT_EQ(d_bits(3), 0);          // scale underflows to zero
  EXPECT_EQ(d_bits(4), 0x3c00);     // d == 1: the .5 ties are rounded by roundf
  EXPECT_EQ(d_bits(6), 0x7c00);     // scale overflows binary16
}

TEST(GgufQuant, Q8_0AndQ4_0KnownBlocks) {
  // hand-checked: amax 127 -> d = 1 (0x3c00), q = round-half-away(x)
  std::vector<float> x(32);
  for (int i = 0; i < 32; ++i) x[i] = static_cast<float>(i) - 15.5f;
  x[0] = -127.0f;
  auto q = ggml_quantize(GgmlType::q8_0, x);
  ASSERT_EQ(q.size(), 34u);
  EXPECT_EQ(static_cast<uint8_t>(q[0]), 0x00);
  EXPECT_EQ(static_cast<uint8_t>(q[1]), 0x3c);
  EXPECT_EQ(static_cast<int8_t>(q[2]), -127);
  EXPECT_EQ(static_cast<int8_t>(q[3]), -15);  // -14.5 -> -15 (away from zero)
  EXPECT_EQ(static_cast<int8_t>(q[2 + 16]), 1);  // 0.5 -> 1
  EXPECT_EQ(static_cast<int8_t>(q[2 + 31]), 16);  // 15.5 -> 16
  // Q4_0 of the same block: max = -127 -> d = -127 / -8 = 15.875, id = 1/15.875
  q = ggml_quantize(GgmlType::q4_0, x);
  ASSERT_EQ(q.size(), 18u);
  uint16_t d;
  std::memcpy(&d, q.data(), 2);
  EXPECT_EQ(d, 0x4bf0);                              // 15.875 in binary16
  EXPECT_EQ(static_cast<uint8_t>(q[2]) & 0x0f, 0);   // -127 * id + 8.5 = 0.5 -> 0
  EXPECT_EQ(static_cast<uint8_t>(q[2 + 15]) >> 4, 9);  // x[31] = 15.5: 0.976 + 8.5 -> 9
  std::vector<float> y(32);
  ggml_dequantize(GgmlType::q4_0, q, y);
  EXPECT_EQ(y[0], -127.0f);
  EXPECT_EQ(y[31], 15.875f);
}

TEST(GgufQuant, SizeAndTypeErrors) {
  std::vector<float> x(33, 1.0f);
  EXPECT_THROW(ggml_quantize(GgmlType::q8_0, x), InvalidArgument);
  EXPECT_THROW(ggml_quantize(GgmlType::q4_K, std::vector<float>(256)), InvalidArgument);
  std::vector<std::byte> b(34);
  std::vector<float> y(32);
  EXPECT_NO_THROW(ggml_dequantize(GgmlType::q8_0, b, y));
  std::vector<float> y2(64);
  try {
    ggml_dequantize(GgmlType::q8_0, b, y2);
    ADD_FAILURE() << "no throw";
  } catch (const CheckpointError& e) {
    EXPECT_NE(std::string(e.what()).find("64 q8_0 elements take 68 bytes (got 34 bytes)"), std::string::npos) << e.what();
  }
  try {
    std::vector<float> z(256);
    ggml_dequantize(GgmlType::q6_K, std::vector<std::byte>(210), z);
    ADD_FAILURE() << "no throw";
  } catch (const CheckpointError& e) {
    EXPECT_NE(std::string(e.what()).find("q6_K is not supported"), std::string::npos) << e.what();
  }
  EXPECT_THROW(ggml_block_shape(GgmlType::q4_K), CheckpointError);
  EXPECT_EQ(ggml_block_shape(GgmlType::q4_0), (std::pair<int64_t, int64_t>{32, 18}));
  EXPECT_EQ(ggml_block_shape(GgmlType::bf16), (std::pair<int64_t, int64_t>{1, 2}));
  EXPECT_EQ(ggml_type_name(12), "q4_K");
  EXPECT_EQ(ggml_type_name(77), "type 77");
  EXPECT_EQ(ggml_type_name(31), "type 31");  // removed repacked layout
  EXPECT_TRUE(ggml_type_supported(30));
  EXPECT_FALSE(ggml_type_supported(12));
}

// ---- metadata getters -----------------------------------------------------------

TEST(GgufGetters, TypedAccessAndErrorsNameTheKey) {
  GgufWriter w;
  w.add_uint32("u32", 7);
  w.add_int32("i32", -3);
  w.add_float32("f32", 0.25f);
  w.add_bool("b", true);
  w.add_string("s", "text");
  w.add_string_array("sa", {"a", "bc"});
  w.add_int32_array("ia", {1, -2});
  w.add_float32_array("fa", {0.5f});
  GgufValue big;
  big.type = VT::uint64;
  big.scalar = uint64_t{1} << 63;
  w.add_value("u64big", big);
  GgufValue ua;
  ua.type = VT::array;
  ua.array_type = VT::uint64;
  ua.uints = {1, uint64_t{1} << 63};
  ua.array_size = 2;
  w.add_value("u64arr", ua);
  const std::string bytes = w.serialize();
  const GgufFile f = GgufFile::parse(as_bytes(bytes), "getters.gguf");
  EXPECT_EQ(f.get_int("u32"), 7);
  EXPECT_EQ(f.get_int("i32"), -3);
  EXPECT_EQ(f.get_float("f32"), 0.25);
  EXPECT_EQ(f.get_bool("b"), true);
  EXPECT_EQ(f.get_string("s"), "text");
  EXPECT_EQ(*f.get_string_array("sa"), (std::vector<std::string>{"a", "bc"}));
  EXPECT_EQ(f.get_int_array("ia"), (std::vector<int64_t>{1, -2}));
  EXPECT_EQ(f.get_float_array("fa"), (std::vector<double>{0.5}));
  EXPECT_FALSE(f.get_int("absent").has_value());
  EXPECT_EQ(f.get_string_array("absent"), nullptr);
  auto expect_error = [](auto&& fn, std::vector<std::string> parts) {
    try {
      fn();
      ADD_FAILURE() << "no throw";
    } catch (const CheckpointError& e) {
      for (const auto& p : parts) EXPECT_NE(std::string(e.what()).find(p), std::string::npos) << e.what();
    }
  };
  expect_error([&] { (void)f.get_int("s"); }, {"getters.gguf", "metadata 's'", "expected an integer", "got string"});
  expect_error([&] { (void)f.get_float("u32"); }, {"metadata 'u32'", "got uint32"});
  expect_error([&] { (void)f.get_string("b"); }, {"metadata 'b'", "got bool"});
  expect_error([&] { (void)f.get_bool("i32"); }, {"metadata 'i32'", "got int32"});
  expect_error([&] { (void)f.get_int("u64big"); }, {"metadata 'u64big'", "out of range", "9223372036854775808"});
  expect_error([&] { (void)f.get_int_array("u64arr"); }, {"metadata 'u64arr'", "element 1", "9223372036854775808"});
  expect_error([&] { (void)f.get_string_array("ia"); }, {"metadata 'ia'", "got array of int32"});
  expect_error([&] { (void)f.get_float_array("sa"); }, {"metadata 'sa'", "got array of string"});
}

}  // namespace POSENC_UNITY_ID
