// Helpers shared by the GGUF tests: fixture paths, the gguf-py reference JSON,
// FNV-1a-64 (the hash tools/refs/gguf_refs.py records), byte patching.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "posenc/gguf.hpp"
#include "test_support.hpp"

namespace posenc::test::gguf {

inline std::filesystem::path stories_gguf() { return shared_dir() / "models/stories260K/stories260K.gguf"; }
inline std::filesystem::path tinystories_gguf() {
  return shared_dir() / "models/TinyStories-656K-gguf/TinyStories-656K-Q8_0.gguf";
}
inline std::filesystem::path reference_json_path() {
  return std::filesystem::path(POSENC_SOURCE_DIR) / "tests/model/formats/data/gguf_reference.json";
}
inline const nlohmann::json& reference() {
  static const nlohmann::json j = nlohmann::json::parse(slurp(reference_json_path()));
  return j;
}

/// FNV-1a 64 over bytes, as lowercase hex (the hash of tools/refs/gguf_refs.py).
inline std::string fnv1a64(std::span<const std::byte> b) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (auto c : b) {
    h ^= static_cast<uint8_t>(c);
    h *= 0x100000001b3ull;
  }
  return fmt::format("{:016x}", h);
}
inline std::string fnv1a64(std::span<const float> f) { return fnv1a64(std::as_bytes(f)); }
inline std::string fnv1a64(std::string_view s) {
  return fnv1a64(std::span<const std::byte>(reinterpret_cast<const std::byte*>(s.data()), s.size()));
}

inline std::string hex(std::span<const std::byte> b) {
  std::string s;
  for (auto c : b) s += fmt::format("{:02x}", static_cast<uint8_t>(c));
  return s;
}

inline std::span<const std::byte> as_bytes(const std::string& s) {
  return {reinterpret_cast<const std::byte*>(s.data()), s.size()};
}

/// Overwrites sizeof(T) bytes at `pos` with `v` (little-endian, as GGUF stores it).
template <class T>
void patch(std::string& bytes, std::size_t pos, T v) {
  if (pos + sizeof(T) > bytes.size()) throw std::out_of_range("patch past the end");
  std::memcpy(bytes.data() + pos, &v, sizeof(T));
}
template <class T>
T peek(const std::string& bytes, std::size_t pos) {
  T v;
  std::memcpy(&v, bytes.data() + pos, sizeof(T));
  return v;
}

/// Position of a GGUF string (uint64 length + bytes) equal to `s` in `bytes`, or npos.
inline std::size_t find_gguf_string(const std::string& bytes, std::string_view s, std::size_t from = 0) {
  std::string needle(8, '\0');
  const uint64_t n = s.size();
  std::memcpy(needle.data(), &n, 8);
  needle += s;
  return bytes.find(needle, from);
}

/// Layout of one tensor info in a file's bytes (found by its name).
struct TensorInfoAt {
  std::size_t start = 0, n_dims = 0, ne = 0, type = 0, offset = 0, end = 0;
};
inline TensorInfoAt tensor_info_at(const std::string& bytes, const std::string& name, uint64_t data_offset) {
  std::size_t at = std::string::npos, from = 0;
  for (std::size_t p; (p = find_gguf_string(bytes, name, from)) != std::string::npos && p < data_offset; from = p + 1)
    at = p;  // the last match before the data section is the tensor info (a token could spell the same text)
  if (at == std::string::npos) throw std::runtime_error("tensor info not found: " + name);
  TensorInfoAt t;
  t.start = at;
  t.n_dims = at + 8 + name.size();
  const auto nd = peek<uint32_t>(bytes, t.n_dims);
  t.ne = t.n_dims + 4;
  t.type = t.ne + 8 * nd;
  t.offset = t.type + 4;
  t.end = t.offset + 8;
  return t;
}

}  // namespace posenc::test::gguf
