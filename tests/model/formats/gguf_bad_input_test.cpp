// Bad GGUF input: the real files truncated and patched in memory, and files made
// by GgufWriter and patched. Each case asserts a CheckpointError whose message
// names the file, the field and the value, and that no large allocation was
// attempted for counts the file cannot back.
#include <atomic>
#include <cstdlib>
#include <new>

#include <gtest/gtest.h>

#include "gguf_seed_files.hpp"
#include "gguf_test_support.hpp"
#include "posenc/error.hpp"
#include "posenc/gguf.hpp"

// ---- the largest single allocation while a parse runs --------------------------
// Replaces the global operator new for this test binary: a pass-through to
// malloc that records the largest request made by the thread that set g_track.
// Not under AddressSanitizer, whose own operator new checks new/delete pairing.
#if defined(__SANITIZE_ADDRESS__)
#define POSENC_TRACK_ALLOCATIONS 0
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define POSENC_TRACK_ALLOCATIONS 0
#endif
#endif
#ifndef POSENC_TRACK_ALLOCATIONS
#define POSENC_TRACK_ALLOCATIONS 1
#endif

namespace {
thread_local bool g_track = false;
thread_local std::size_t g_largest = 0;
}  // namespace

#if POSENC_TRACK_ALLOCATIONS
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"  // new and delete below are malloc and free, as a pair

void* operator new(std::size_t n) {
  if (g_track && n > g_largest) g_largest = n;
  if (void* p = std::malloc(n == 0 ? 1 : n)) return p;
  throw std::bad_alloc();
}
void* operator new[](std::size_t n) { return ::operator new(n); }
void operator delete(void* p) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t) noexcept { std::free(p); }
#pragma GCC diagnostic pop
#endif

// (The global operator new above cannot be in a namespace: this file's code from here on.)
namespace POSENC_UNITY_ID {  // this file's own namespace in the tests' unity build (CMakeLists.txt)


using namespace posenc;
using namespace posenc::test::gguf;

namespace {

const std::string& stories_bytes() {
  static const std::string b = posenc::test::slurp(stories_gguf());
  return b;
}
const std::string& tiny_bytes() {
  static const std::string b = posenc::test::slurp(tinystories_gguf());
  return b;
}

struct Outcome {
  std::string message;      ///< CheckpointError's message, or a description of what happened instead
  bool checkpoint_error = false;
  std::size_t largest_allocation = 0;
};

Outcome parse_outcome(const std::string& bytes, const std::string& source) {
  Outcome o;
  g_largest = 0;
  g_track = true;
  try {
    const GgufFile f = GgufFile::parse(as_bytes(bytes), source);
    g_track = false;
    o.message = fmt::format("<parsed: {} tensors>", f.tensors().size());
  } catch (const CheckpointError& e) {
    g_track = false;
    o.checkpoint_error = true;
    o.message = e.what();
  } catch (const std::exception& e) {
    g_track = false;
    o.message = std::string("<other exception: ") + e.what() + ">";
  }
  o.largest_allocation = g_largest;
  return o;
}

/// Parses `bytes`: a CheckpointError starting with "<source>: " and containing every part.
void expect_refused(const std::string& bytes, const std::string& source, const std::vector<std::string>& parts) {
  const Outcome o = parse_outcome(bytes, source);
  ASSERT_TRUE(o.checkpoint_error) << o.message;
  EXPECT_EQ(o.message.rfind(source + ": ", 0), 0u) << o.message;
  for (const auto& p : parts) EXPECT_NE(o.message.find(p), std::string::npos) << "missing '" << p << "' in: " << o.message;
  EXPECT_LT(o.largest_allocation, std::size_t{1} << 20) << o.message;
}

uint64_t data_offset_of(const std::string& bytes) {
  return GgufFile::parse(as_bytes(bytes), "x").data_offset();
}

constexpr uint64_t k2to60 = uint64_t{1} << 60;
const std::string k2to60s = "1152921504606846976";

}  // namespace

TEST(GgufBadInput, AllocationTrackerSeesAllocations) {
  if (!POSENC_TRACK_ALLOCATIONS) GTEST_SKIP() << "allocation tracking is off under AddressSanitizer";
  // the tracker must work for the allocation checks below to mean anything
  const Outcome o = parse_outcome(stories_bytes(), "stories260K.gguf");
  EXPECT_FALSE(o.checkpoint_error) << o.message;
  EXPECT_GE(o.largest_allocation, 512 * sizeof(std::string));  // the 512 tokens
}

TEST(GgufBadInput, TruncatedRealFilesAreRefusedAtEveryCut) {
  for (const auto& [name, bytes] : {std::pair{"stories260K.gguf", &stories_bytes()},
                                    std::pair{"TinyStories-656K-Q8_0.gguf", &tiny_bytes()}}) {
    SCOPED_TRACE(name);
    const GgufFile f = GgufFile::parse(as_bytes(*bytes), name);
    const uint64_t data = f.data_offset();
    std::vector<uint64_t> cuts;
    for (uint64_t c = 0; c < data + 97; c += 97) cuts.push_back(c);  // through the header, metadata, tensor infos
    for (const auto& t : f.tensors()) {
      const TensorInfoAt at = tensor_info_at(*bytes, t.name, data);
      for (auto c : {at.start, at.start + 5, at.start + 8, at.n_dims, at.ne, at.ne + 3, at.type, at.offset, at.end - 1})
        cuts.push_back(c);
      cuts.push_back(data + t.offset);  // the tensor's data missing entirely
      if (t.n_bytes > 0) cuts.push_back(data + t.offset + t.n_bytes - 1);  // one byte short
    }
    for (auto c : {data - 1, data, data + 1, static_cast<uint64_t>(bytes->size()) - 1}) cuts.push_back(c);
    int n = 0;
    for (uint64_t c : cuts) {
      ASSERT_LT(c, bytes->size());
      const std::string cut = bytes->substr(0, c);
      const Outcome o = parse_outcome(cut, name);
      ASSERT_TRUE(o.checkpoint_error) << "cut at " << c << ": " << o.message;
      ASSERT_EQ(o.message.rfind(std::string(name) + ": ", 0), 0u) << o.message;
      ASSERT_NE(o.message.find("(got "), std::string::npos) << o.message;
      // the error is about the end of the file, whatever field it hit
      const bool about_end = o.message.find("truncated file") != std::string::npos ||
                             o.message.find("bytes left in the file") != std::string::npos ||
                             o.message.find("past the end of the file") != std::string::npos ||
                             o.message.find("can hold") != std::string::npos;
      ASSERT_TRUE(about_end) << "cut at " << c << ": " << o.message;
      ASSERT_LT(o.largest_allocation, std::size_t{1} << 20) << o.message;
      ++n;
    }
    EXPECT_GT(n, 100);
  }
  // specific cuts name their field
  expect_refused(stories_bytes().substr(0, 2), "s.gguf", {"GGUF magic: truncated file", "a file of 2 bytes"});
  expect_refused(stories_bytes().substr(0, 10), "s.gguf", {"tensor_count: truncated file: 8 bytes needed at offset 8"});
  expect_refused(stories_bytes().substr(0, 20), "s.gguf", {"kv_count: truncated file"});
  expect_refused("", "empty.gguf", {"GGUF magic: truncated file", "a file of 0 bytes"});
  const uint64_t data = data_offset_of(stories_bytes());
  expect_refused(stories_bytes().substr(0, data + 100), "s.gguf",
                 {"tensor 'token_embd.weight' offset", "past the end of the file", "(got 0)"});
}

TEST(GgufBadInput, CountsAndLengthsOf2To60FailWithoutAllocating) {
  const std::string& b = stories_bytes();
  std::string x = b;
  patch<uint64_t>(x, 8, k2to60);
  expect_refused(x, "s.gguf", {"tensor_count", "more tensor infos than", k2to60s});
  x = b;
  patch<uint64_t>(x, 16, k2to60);
  expect_refused(x, "s.gguf", {"kv_count", "more key/value pairs than", k2to60s});
  x = b;
  patch<uint64_t>(x, 24, k2to60);  // the first key's length
  expect_refused(x, "s.gguf", {"metadata[0] key", "string length", k2to60s});

  // a string value: general.architecture = "llama"
  x = b;
  const std::size_t arch = find_gguf_string(x, "general.architecture");
  ASSERT_NE(arch, std::string::npos);
  const std::size_t arch_value = arch + 8 + 20 + 4;
  ASSERT_EQ(peek<uint64_t>(x, arch_value), 5u);
  patch<uint64_t>(x, arch_value, k2to60);
  expect_refused(x, "s.gguf", {"metadata 'general.architecture'", "string length", k2to60s});

  // an array count, and a string length inside an array: tokenizer.ggml.tokens
  const std::size_t tok = find_gguf_string(b, "tokenizer.ggml.tokens");
  const std::size_t type_at = tok + 8 + 21;
  ASSERT_EQ(peek<uint32_t>(b, type_at), 9u);       // array
  ASSERT_EQ(peek<uint32_t>(b, type_at + 4), 8u);   // of string
  ASSERT_EQ(peek<uint64_t>(b, type_at + 8), 512u);
  x = b;
  patch<uint64_t>(x, type_at + 8, k2to60);
  expect_refused(x, "s.gguf", {"metadata 'tokenizer.ggml.tokens'", "array count", k2to60s});
  x = b;
  patch<uint64_t>(x, type_at + 16, k2to60);
  expect_refused(x, "s.gguf", {"metadata 'tokenizer.ggml.tokens'[0]", "string length", k2to60s});
  // a float array: tokenizer.ggml.scores (4-byte elements)
  const std::size_t sc = find_gguf_string(b, "tokenizer.ggml.scores") + 8 + 21;
  ASSERT_EQ(peek<uint32_t>(b, sc + 4), 6u);
  x = b;
  patch<uint64_t>(x, sc + 8, k2to60);
  expect_refused(x, "s.gguf", {"metadata 'tokenizer.ggml.scores'", "array count", "float32 elements take at least 4",
                               k2to60s});
  // a count small enough that reserving it would succeed (2^26 doubles = 512 MiB) is refused all the same
  x = b;
  patch<uint64_t>(x, sc + 8, uint64_t{1} << 26);
  expect_refused(x, "s.gguf", {"metadata 'tokenizer.ggml.scores'", "array count", "67108864"});
  // a tensor name's length
  const uint64_t data = data_offset_of(b);
  const TensorInfoAt t0 = tensor_info_at(b, "token_embd.weight", data);
  x = b;
  patch<uint64_t>(x, t0.start, k2to60);
  expect_refused(x, "s.gguf", {"tensor[0] name", "string length", k2to60s});
  // an extent: the byte size runs past the file (or overflows)
  x = b;
  patch<uint64_t>(x, t0.ne, k2to60);
  expect_refused(x, "s.gguf", {"tensor 'token_embd.weight' ne[1]", "overflows int64", "512"});
}

TEST(GgufBadInput, TensorInfoFields) {
  const std::string& b = stories_bytes();
  const uint64_t data = data_offset_of(b);
  const TensorInfoAt t0 = tensor_info_at(b, "token_embd.weight", data);
  const TensorInfoAt t1 = tensor_info_at(b, "output_norm.weight", data);
  const TensorInfoAt last = tensor_info_at(b, "blk.4.ffn_norm.weight", data);
  std::string x = b;
  patch<uint32_t>(x, t0.n_dims, 5);
  expect_refused(x, "s.gguf", {"tensor 'token_embd.weight' n_dims", "at most 4", "(got 5)"});
  x = b;
  patch<uint32_t>(x, t0.type, 77);
  expect_refused(x, "s.gguf", {"tensor 'token_embd.weight' type", "unknown ggml type", "(got 77)"});
  x = b;
  patch<uint32_t>(x, t0.type, 31);  // a removed number (q4_0_4_4)
  expect_refused(x, "s.gguf", {"tensor 'token_embd.weight' type", "unknown ggml type", "(got 31)"});
  x = b;
  patch<uint32_t>(x, t0.type, 12);  // q4_K: rows of 64 are not whole 256-element blocks
  expect_refused(x, "s.gguf", {"tensor 'token_embd.weight' ne[0]", "q4_K", "256-element blocks", "(got 64)"});
  x = b;
  // q8_0 of [64, 512]: 34816 bytes, inside the file, but not the 131072 written: the next tensor is not where
  // token_embd.weight's data end (llama.cpp refuses it the same way: "tensor ... has offset 131072, expected 34816").
  patch<uint32_t>(x, t0.type, 8);
  expect_refused(x, "s.gguf",
                 {"tensor 'output_norm.weight' offset", "expected 34816",
                  "'token_embd.weight' (its 34816 bytes of q8_0 data at offset 0)", "alignment 32", "(got 131072)"});
  x = b;
  // The last tensor ([64] f32, 256 bytes) as f16: nothing follows it to move; bytes after the last tensor are
  // allowed (llama.cpp reads them), so this one is not caught. Appended bytes load too.
  patch<uint32_t>(x, last.type, 1);
  EXPECT_FALSE(parse_outcome(x, "s.gguf").checkpoint_error) << parse_outcome(x, "s.gguf").message;
  x = b + std::string(4096, '\0');
  EXPECT_FALSE(parse_outcome(x, "s.gguf").checkpoint_error) << parse_outcome(x, "s.gguf").message;
  x = b;
  // The first two tensors' offsets swapped: data in another order than the infos'.
  patch<uint64_t>(x, t0.offset, peek<uint64_t>(b, t1.offset));
  patch<uint64_t>(x, t1.offset, 0);
  expect_refused(x, "s.gguf", {"tensor 'token_embd.weight' offset", "must start the data section (offset 0)"});
  x = b;
  patch<uint64_t>(x, t0.ne, uint64_t{1} << 63);
  expect_refused(x, "s.gguf", {"tensor 'token_embd.weight' ne[0]", "above INT64_MAX", "9223372036854775808"});
  x = b;
  patch<uint64_t>(x, t0.ne, uint64_t{1} << 40);  // no overflow, but far past the end of the file
  expect_refused(x, "s.gguf", {"tensor 'token_embd.weight' offset", "past the end of the file"});
  x = b;
  patch<uint64_t>(x, last.offset, peek<uint64_t>(b, last.offset) + 4096);
  expect_refused(x, "s.gguf", {"tensor 'blk.4.ffn_norm.weight' offset", "past the end of the file"});
  x = b;
  patch<uint64_t>(x, last.offset, 0xffffffffffffffe0ull);  // aligned, and data_offset + offset overflows
  expect_refused(x, "s.gguf", {"tensor 'blk.4.ffn_norm.weight' offset", "past the end", "18446744073709551584"});
  x = b;
  patch<uint64_t>(x, t1.offset, peek<uint64_t>(b, t1.offset) + 4);
  expect_refused(x, "s.gguf", {"tensor 'output_norm.weight' offset", "multiple of the alignment 32", "(got 131076)"});
  x = b;
  patch<uint64_t>(x, t1.offset, 32);  // inside token_embd.weight's [0, 131072)
  expect_refused(x, "s.gguf",
                 {"tensor 'output_norm.weight' offset", "expected 131072", "'token_embd.weight' (its 131072 bytes of f32",
                  "(got 32)"});
}

TEST(GgufBadInput, HeaderFields) {
  const std::string& b = stories_bytes();
  std::string x = b;
  x[3] = 'X';
  expect_refused(x, "s.gguf", {"magic", "not a GGUF file", "(got 'GGUX')"});
  x = b;
  x[0] = '\x7f';
  expect_refused(x, "s.gguf", {"magic", "\\x7f"});
  x = b;
  patch<uint32_t>(x, 4, 1);
  expect_refused(x, "s.gguf", {"version", "GGUF version 1", "32-bit", "(got 1)"});
  x = b;
  patch<uint32_t>(x, 4, 4);
  expect_refused(x, "s.gguf", {"version", "unsupported GGUF version", "(got 4)"});
  x = b;
  patch<uint32_t>(x, 4, 0);
  expect_refused(x, "s.gguf", {"version", "(got 0)"});
  x = b;
  patch<uint32_t>(x, 4, 0x03000000);
  expect_refused(x, "s.gguf", {"version", "big-endian", "(got 50331648)"});
  x = b;
  patch<uint32_t>(x, 4, 2);  // version 2 reads like version 3
  EXPECT_FALSE(parse_outcome(x, "s.gguf").checkpoint_error);
}

TEST(GgufBadInput, MetadataFields) {
  // duplicate keys: "dup.a" and "dup.b" written, then the second renamed
  GgufWriter w;
  w.add_uint32("dup.a", 1);
  w.add_uint32("dup.b", 2);
  w.add_bool("flag", true);
  w.add_value("nested", array_of_arrays({int_array(GgufValue::Type::int8, {1})}));
  std::string good = w.serialize();
  std::string x = good;
  x[find_gguf_string(x, "dup.b") + 8 + 4] = 'a';
  expect_refused(x, "w.gguf", {"metadata[1] key", "duplicate key", "(got 'dup.a')"});
  // an empty key
  x = good;
  const std::size_t flag = find_gguf_string(good, "flag");
  patch<uint64_t>(x, flag, 0);
  expect_refused(x, "w.gguf", {"metadata[2] key", "empty key"});
  // a key length too long by 2: the key runs into its value type (bool = 7), which is not printable ASCII; the
  // error names the length's offset and the bad byte's, not the value that follows
  x = good;
  patch<uint64_t>(x, flag, 6);
  expect_refused(x, "w.gguf",
                 {"metadata[2] key", "printable ASCII", fmt::format("length at offset {}", flag),
                  fmt::format("byte 0x07 at offset {}", flag + 8 + 4), "(got 'flag\\x07\\x00')"});
  // a bool that is neither 0 nor 1
  x = good;
  const std::size_t flag_value = flag + 8 + 4 + 4;
  ASSERT_EQ(x[flag_value], 1);
  x[flag_value] = 2;
  expect_refused(x, "w.gguf", {"metadata 'flag'", "0 or 1", "(got 2)"});
  // an unknown value type
  x = good;
  patch<uint32_t>(x, flag + 8 + 4, 13);
  expect_refused(x, "w.gguf", {"metadata 'flag' type", "unknown GGUF value type", "(got 13)"});
  // an unknown element type inside an array of arrays
  x = good;
  const std::size_t nested = find_gguf_string(good, "nested") + 8 + 6 + 4;  // element type of the outer array
  ASSERT_EQ(peek<uint32_t>(x, nested), 9u);
  patch<uint32_t>(x, nested + 12, 42);  // the inner array's element type
  expect_refused(x, "w.gguf", {"metadata 'nested'[0] element type", "(got 42)"});
  // an array-of-arrays count the file cannot back (each element takes >= 12 bytes)
  x = good;
  patch<uint64_t>(x, nested + 4, k2to60);
  expect_refused(x, "w.gguf", {"metadata 'nested'", "array count", "array elements take at least 12", k2to60s});

  // general.alignment: wrong type, zero, not a power of two
  for (const auto& [value, part] : {std::pair{uint32_t{0}, "(got 0)"}, std::pair{uint32_t{48}, "(got 48)"}}) {
    GgufWriter a;
    a.add_uint32("general.alignment", 64);
    std::string y = a.serialize();
    patch<uint32_t>(y, find_gguf_string(y, "general.alignment") + 8 + 17 + 4, value);
    expect_refused(y, "a.gguf", {"metadata 'general.alignment'", "power of two", part});
  }
  {
    GgufWriter a;  // the writer refuses a uint64 alignment, so write another key and rename it
    a.add_value("general.alignmenX", scalar(GgufValue::Type::uint64, uint64_t{32}));
    std::string y = a.serialize();
    y[find_gguf_string(y, "general.alignmenX") + 8 + 16] = 't';
    expect_refused(y, "a.gguf", {"metadata 'general.alignment'", "must be a uint32", "(got uint64)"});
  }
}

TEST(GgufBadInput, ArraysNestedTooDeep) {
  // build a 17-level nesting by hand (the writer refuses it): key "d", type array,
  // then 16 x (element type array, count 1), then (element type uint8, count 0)
  std::string x = "GGUF";
  auto u32 = [&](uint32_t v) { x.append(reinterpret_cast<const char*>(&v), 4); };
  auto u64 = [&](uint64_t v) { x.append(reinterpret_cast<const char*>(&v), 8); };
  u32(3);
  u64(0);
  u64(1);
  u64(1);
  x += "d";
  u32(9);
  for (int i = 0; i < 16; ++i) {
    u32(9);
    u64(1);
  }
  u32(0);
  u64(0);
  expect_refused(x, "deep.gguf", {"metadata 'd'[0][0][0]", "nested more than 16", "(got 17)"});
  // one level less parses
  std::string y = "GGUF";
  x.swap(y);
  u32(3);
  u64(0);
  u64(1);
  u64(1);
  x += "d";
  u32(9);
  for (int i = 0; i < 15; ++i) {
    u32(9);
    u64(1);
  }
  u32(0);
  u64(0);
  EXPECT_FALSE(parse_outcome(x, "deep.gguf").checkpoint_error) << parse_outcome(x, "deep.gguf").message;
}

TEST(GgufBadInput, DuplicateAndEmptyTensorNames) {
  GgufWriter w;
  w.add_tensor("t.a", {1}, GgmlType::f32, std::vector<std::byte>(4));
  w.add_tensor("t.b", {1}, GgmlType::f32, std::vector<std::byte>(4));
  const std::string good = w.serialize();
  std::string x = good;
  const uint64_t data = data_offset_of(good);
  x[tensor_info_at(good, "t.b", data).start + 8 + 2] = 'a';
  expect_refused(x, "t.gguf", {"tensor[1] name", "duplicate tensor name", "(got 't.a')"});
  // A NUL or control byte in a name is shown escaped: the whole message survives (a raw NUL would end what()).
  x = good;
  x[tensor_info_at(good, "t.b", data).start + 8 + 1] = '\0';
  x[tensor_info_at(good, "t.b", data).start + 8 + 2] = 'a';
  const GgufFile f = GgufFile::parse(as_bytes(x), "t.gguf");
  const GgufTensorInfo* t = nullptr;
  for (const auto& ti : f.tensors())
    if (ti.name.size() == 3 && ti.name[1] == '\0') t = &ti;
  ASSERT_NE(t, nullptr);
  try {
    GgufTensorInfo moved = *t;
    moved.offset += 1000000;
    (void)f.tensor_data(moved);
    ADD_FAILURE() << "no exception";
  } catch (const posenc::InvalidArgument& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("tensor 't\\x00a' (offset"), std::string::npos) << msg;
    EXPECT_NE(msg.find("is not a tensor of this file"), std::string::npos) << msg;
  }
}

// Known-but-unsupported types parse (so the caller can say which tensor is the
// problem) and are refused by name when their data are asked for.
TEST(GgufBadInput, KQuantParsesAndIsRefusedByNameOnUse) {
  const auto seeds = seed_files();
  const auto& bytes = std::find_if(seeds.begin(), seeds.end(), [](auto& s) { return s.first == "kquant.gguf"; })->second;
  const GgufFile f = GgufFile::parse(as_bytes(bytes), "kquant.gguf");
  const GgufTensorInfo* q4k = f.find_tensor("blk.0.attn_q.weight");
  ASSERT_NE(q4k, nullptr);
  EXPECT_EQ(q4k->type, GgmlType::q4_K);
  EXPECT_EQ(q4k->n_bytes, 144u);
  EXPECT_EQ(ggml_type_name(static_cast<uint32_t>(q4k->type)), "q4_K");
  EXPECT_FALSE(ggml_type_supported(static_cast<uint32_t>(q4k->type)));
  for (int use = 0; use < 2; ++use) {
    try {
      if (use == 0) (void)f.tensor_data(*q4k);
      else (void)f.to_float32(*q4k);
      ADD_FAILURE() << "no throw";
    } catch (const CheckpointError& e) {
      EXPECT_NE(std::string(e.what()).find("kquant.gguf: tensor 'blk.0.attn_q.weight': ggml type q4_K is not supported"),
                std::string::npos)
          << e.what();
    }
  }
  // the supported tensor next to it is fine
  const GgufTensorInfo* q8 = f.find_tensor("blk.0.attn_k.weight");
  EXPECT_EQ(f.to_float32(*q8).size(), 32u);
  // a tensor info that is not this file's
  GgufTensorInfo foreign = *q8;
  foreign.offset = 1 << 20;
  EXPECT_THROW((void)f.tensor_data(foreign), InvalidArgument);
}

}  // namespace POSENC_UNITY_ID
