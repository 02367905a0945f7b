// Where scripts/build-llama-server puts llama.cpp's binaries (llama-server, llama-tokenize): the tests that run
// them find them here (tests/eval/llama_server_support.hpp, tests/model/tokenizer_gguf_test.cpp).
#pragma once

#include <cstdlib>
#include <filesystem>
#include <string>

namespace posenc::test {

/// The llama.cpp commit scripts/build-llama-server builds (its LLAMA_CPP_COMMIT: the source
/// node-llama-cpp 3.22.1 bundles). LlamaServer.CachePathMatchesBuildScript keeps the two in step.
inline constexpr const char* kLlamaCppCommit = "de3ff815ea7d559ee917f063901b8986f038abc6";

inline std::string env_or_empty(const char* name) {
  const char* v = std::getenv(name);
  return v ? std::string(v) : std::string();
}

/// scripts/build-llama-server's binary: $POSENC_LLAMA_CPP_CACHE/bin/llama-server, else
/// ${XDG_CACHE_HOME:-$HOME/.cache}/posenc/llama.cpp-<first 12 digits of the commit>/bin/llama-server.
inline std::filesystem::path llama_server_cache_path() {
  std::filesystem::path cache = env_or_empty("POSENC_LLAMA_CPP_CACHE");
  if (cache.empty()) {
    std::filesystem::path base = env_or_empty("XDG_CACHE_HOME");
    if (base.empty()) base = std::filesystem::path(env_or_empty("HOME")) / ".cache";
    cache = base / "posenc" / (std::string("llama.cpp-") + std::string(kLlamaCppCommit).substr(0, 12));
  }
  return cache / "bin" / "llama-server";
}

/// llama-tokenize, which scripts/build-llama-server puts beside llama-server.
inline std::filesystem::path llama_tokenize_cache_path() {
  return llama_server_cache_path().parent_path() / "llama-tokenize";
}

}  // namespace posenc::test
