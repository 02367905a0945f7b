// Small GGUF files made by GgufWriter: the writer round-trip tests use them, and
// they are the libFuzzer seed corpus fuzz/corpus/gguf/ (GgufFuzzCorpus.SeedsAreCurrent
// checks the committed copies; POSENC_WRITE_FUZZ_CORPUS=1 rewrites them).
#pragma once

#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include "posenc/gguf.hpp"

namespace posenc::test::gguf {

inline GgufValue scalar(GgufValue::Type t, decltype(GgufValue::scalar) x) {
  GgufValue v;
  v.type = t;
  v.scalar = std::move(x);
  return v;
}
inline GgufValue int_array(GgufValue::Type et, std::vector<int64_t> xs) {
  GgufValue v;
  v.type = GgufValue::Type::array;
  v.array_type = et;
  v.array_size = xs.size();
  v.ints = std::move(xs);
  return v;
}
inline GgufValue array_of_arrays(std::vector<GgufValue> xs) {
  GgufValue v;
  v.type = GgufValue::Type::array;
  v.array_type = GgufValue::Type::array;
  v.array_size = xs.size();
  v.arrays = std::move(xs);
  return v;
}

/// Deterministic float32 values (a fixed LCG), scaled by `scale`.
inline std::vector<float> test_values(std::size_t n, float scale, uint32_t seed) {
  std::vector<float> v(n);
  uint32_t s = seed;
  for (auto& x : v) {
    s = s * 1664525u + 1013904223u;
    x = scale * (static_cast<float>(s >> 8) / 8388608.0f - 1.0f);
  }
  return v;
}

/// A writer holding one key of every value type (arrays of every element type,
/// arrays of arrays, empty ones) and tiny tensors of every supported type.
inline GgufWriter every_type_writer() {
  using T = GgufValue::Type;
  GgufWriter w;
  w.add_string("general.architecture", "llama");
  w.add_value("k.uint8", scalar(T::uint8, uint64_t{255}));
  w.add_value("k.int8", scalar(T::int8, int64_t{-128}));
  w.add_value("k.uint16", scalar(T::uint16, uint64_t{65535}));
  w.add_value("k.int16", scalar(T::int16, int64_t{-32768}));
  w.add_uint32("k.uint32", 4000000000u);
  w.add_int32("k.int32", -2000000000);
  w.add_float32("k.float32", -1.5e-7f);
  w.add_bool("k.bool", true);
  w.add_string("k.string", "h\xc3\xa9llo");
  w.add_string("k.empty_string", "");
  w.add_value("k.uint64", scalar(T::uint64, uint64_t{18446744073709551615ull}));
  w.add_value("k.int64", scalar(T::int64, int64_t{-9223372036854775807ll - 1}));
  w.add_value("k.float64", scalar(T::float64, 2.718281828459045));
  w.add_value("a.uint8", int_array(T::uint8, {0, 1, 255}));
  w.add_value("a.int8", int_array(T::int8, {-128, 127}));
  w.add_value("a.uint16", int_array(T::uint16, {65535}));
  w.add_value("a.int16", int_array(T::int16, {-1, 2}));
  w.add_value("a.uint32", int_array(T::uint32, {4294967295}));
  w.add_int32_array("a.int32", {-5, 6, 7});
  w.add_float32_array("a.float32", {0.5f, -0.0f, 3.4028235e38f});
  w.add_value("a.bool", int_array(T::boolean, {1, 0, 1}));
  w.add_string_array("a.string", {"<unk>", "", "\xe2\x96\x81the"});
  GgufValue u64;
  u64.type = T::array;
  u64.array_type = T::uint64;
  u64.uints = {0, 18446744073709551615ull};
  u64.array_size = 2;
  w.add_value("a.uint64", u64);
  w.add_value("a.int64", int_array(T::int64, {-9223372036854775807ll - 1, 42}));
  GgufValue f64;
  f64.type = T::array;
  f64.array_type = T::float64;
  f64.floats = {1e300, -1e-300};
  f64.array_size = 2;
  w.add_value("a.float64", f64);
  w.add_value("a.empty", int_array(T::int32, {}));
  GgufValue strs;
  strs.type = T::array;
  strs.array_type = T::string;
  strs.strings = {"x", "yz"};
  strs.array_size = 2;
  w.add_value("a.array", array_of_arrays({int_array(T::int16, {1, 2}), strs, array_of_arrays({int_array(T::uint8, {9})}),
                                          array_of_arrays({})}));

  w.add_tensor("f32.matrix", {4, 2}, GgmlType::f32, ggml_quantize(GgmlType::f32, test_values(8, 2.0f, 1)));
  w.add_tensor("f16.vector", {8}, GgmlType::f16, ggml_quantize(GgmlType::f16, test_values(8, 1000.0f, 2)));
  w.add_tensor("bf16.3d", {4, 1, 2}, GgmlType::bf16, ggml_quantize(GgmlType::bf16, test_values(8, 1e-3f, 3)));
  w.add_tensor("q8_0.rows", {32, 2}, GgmlType::q8_0, ggml_quantize(GgmlType::q8_0, test_values(64, 0.5f, 4)));
  w.add_tensor("q4_0.row", {64}, GgmlType::q4_0, ggml_quantize(GgmlType::q4_0, test_values(64, 3.0f, 5)));
  w.add_tensor("f32.scalar", {}, GgmlType::f32, ggml_quantize(GgmlType::f32, std::vector<float>{7.0f}));
  w.add_tensor("f32.empty", {0, 3}, GgmlType::f32, {});
  w.add_tensor("f32.4d", {1, 2, 1, 2}, GgmlType::f32, ggml_quantize(GgmlType::f32, test_values(4, 1.0f, 6)));
  return w;
}

/// (file name, bytes) of the seed corpus.
inline std::vector<std::pair<std::string, std::string>> seed_files() {
  std::vector<std::pair<std::string, std::string>> out;
  out.emplace_back("every_type.gguf", every_type_writer().serialize());
  {
    std::string v2 = out.back().second;
    v2[4] = 2;  // version 2: the same layout for little-endian files
    out.emplace_back("every_type_v2.gguf", v2);
  }
  {
    GgufWriter w;
    w.add_uint32("general.alignment", 64);
    w.add_string("general.name", "aligned");
    w.add_tensor("a", {32}, GgmlType::q8_0, ggml_quantize(GgmlType::q8_0, test_values(32, 1.0f, 7)));
    w.add_tensor("b", {3}, GgmlType::f32, ggml_quantize(GgmlType::f32, test_values(3, 1.0f, 8)));
    out.emplace_back("alignment64.gguf", w.serialize());
  }
  {
    // a known-but-unsupported type next to a supported one
    GgufWriter w;
    w.add_string("general.architecture", "llama");
    w.add_tensor("blk.0.attn_q.weight", {256, 1}, GgmlType::q4_K, std::vector<std::byte>(144, std::byte{0x11}));
    w.add_tensor("blk.0.attn_k.weight", {32}, GgmlType::q8_0, ggml_quantize(GgmlType::q8_0, test_values(32, 1.0f, 9)));
    out.emplace_back("kquant.gguf", w.serialize());
  }
  {
    GgufWriter w;
    w.add_string("general.architecture", "llama");
    w.add_uint32("llama.block_count", 1);
    w.add_uint32("llama.embedding_length", 32);
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5f);
    w.add_string("tokenizer.ggml.model", "llama");
    w.add_string_array("tokenizer.ggml.tokens", {"<unk>", "<s>", "</s>", "\xe2\x96\x81" "a"});
    w.add_float32_array("tokenizer.ggml.scores", {0.0f, 0.0f, 0.0f, -1.0f});
    w.add_int32_array("tokenizer.ggml.token_type", {2, 3, 3, 1});
    w.add_tensor("token_embd.weight", {32, 4}, GgmlType::q8_0, ggml_quantize(GgmlType::q8_0, test_values(128, 0.1f, 10)));
    w.add_tensor("output_norm.weight", {32}, GgmlType::f32, ggml_quantize(GgmlType::f32, test_values(32, 1.0f, 11)));
    out.emplace_back("llama_like.gguf", w.serialize());
  }
  {
    GgufWriter w;
    w.add_string("general.name", "metadata only");
    out.emplace_back("metadata_only.gguf", w.serialize());
  }
  return out;
}

}  // namespace posenc::test::gguf
