// Helpers for the tokenizer reference tests: the saved reference files
// (tests/model/data/hf_tokenizers, tests/model/data/llama_cpp, written by
// tools/refs/*.mjs) and the chunked FNV-1a 64 hashes they store.
#pragma once

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "posenc/io.hpp"
#include "posenc/tokenizer.hpp"
#include "test_support.hpp"

namespace posenc::test {

inline std::filesystem::path tokenizer_ref_dir() { return std::filesystem::path(POSENC_SOURCE_DIR) / "tests/model/data"; }

inline nlohmann::json read_json(const std::filesystem::path& p) { return nlohmann::json::parse(read_file(p)); }

/// FNV-1a 64 of the int32 little-endian ids [b, e), as hex (tools/refs/hf_tokenizers_refs.mjs fnv1a64).
inline std::string fnv1a64_hex(const std::vector<int32_t>& ids, std::size_t b, std::size_t e) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (std::size_t i = b; i < e; ++i) {
    unsigned char c[4];
    std::memcpy(c, &ids[i], 4);
    for (unsigned char x : c) {
      h ^= x;
      h *= 0x100000001b3ull;
    }
  }
  return fmt::format("{:016x}", h);
}

/// "" when `ids` has the reference's count and chunk hashes, else where they first differ.
inline std::string compare_whole_text(const std::vector<int32_t>& ids, const nlohmann::json& whole) {
  const auto chunk = whole["chunk"].get<std::size_t>();
  const auto& hashes = whole["fnv1a64"];
  for (std::size_t k = 0; k < hashes.size(); ++k) {
    const std::size_t b = k * chunk, e = std::min(ids.size(), b + chunk);
    if (b >= ids.size() || fnv1a64_hex(ids, b, e) != hashes[k].get<std::string>())
      return fmt::format("first differing chunk {} (ids [{}, {})) of {}; {} ids vs {} in the reference", k, b,
                         b + chunk, hashes.size(), ids.size(), whole["count"].get<std::size_t>());
  }
  if (ids.size() != whole["count"].get<std::size_t>())
    return fmt::format("{} ids vs {} in the reference", ids.size(), whole["count"].get<std::size_t>());
  return {};
}

/// The reference's patch applied to a tokenizer.json, as apply_patch() in
/// tools/refs/hf_tokenizers_refs.mjs does.
inline std::string apply_patch(const std::string& json_text, const nlohmann::json& patch) {
  nlohmann::json root = nlohmann::json::parse(json_text);
  for (const auto& [k, v] : patch.items()) {
    if (k == "model") {
      for (const auto& [kk, vv] : v.items()) root["model"][kk] = vv;
    } else if (k == "added_tokens+") {
      for (const auto& x : v) root["added_tokens"].push_back(x);
    } else if (k == "merges_as_arrays") {
      if (v.get<bool>())
        for (auto& m : root["model"]["merges"]) {
          const std::string s = m.get<std::string>();
          const auto i = s.find(' ');
          m = nlohmann::json::array({s.substr(0, i), s.substr(i + 1)});
        }
    } else {
      root[k] = v;
    }
  }
  return root.dump();
}

/// The tokenizer a reference file describes (a shared tokenizer.json, patched for variants).
inline Tokenizer load_reference_tokenizer(const nlohmann::json& ref) {
  const auto file = shared_dir() / ref["tokenizer"].get<std::string>();
  if (!ref.contains("patch")) return Tokenizer::load_tokenizer_json(file);
  return Tokenizer::from_tokenizer_json(apply_patch(read_file(file), ref["patch"]), file.string());
}

inline std::string show(const std::string& s) {
  return nlohmann::json(s).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

}  // namespace posenc::test
