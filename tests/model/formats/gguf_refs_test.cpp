// Re-derives tests/model/formats/data/gguf_reference.json with tools/refs/gguf_refs.py
// and gguf-py, when they are available: gguf-py from $POSENC_LLAMA_CPP_SRC (a llama.cpp
// checkout), or from a clone of the llama.cpp bundle node-llama-cpp ships
// (tools/refs/node_modules/node-llama-cpp/llama/gitRelease.bundle). Skipped otherwise.
#include <cstdlib>
#include <iostream>

#include <gtest/gtest.h>

#include "gguf_test_support.hpp"

namespace POSENC_UNITY_ID {  // this file's own namespace in the tests' unity build (CMakeLists.txt)

namespace {

std::string quoted(const std::filesystem::path& p) { return fmt::format("'{}'", p.string()); }

bool has_gguf_py(const std::filesystem::path& src) {
  std::error_code ec;
  return std::filesystem::exists(src / "gguf-py/gguf/__init__.py", ec);
}

}  // namespace

TEST(GgufReferenceRederive, ScriptReproducesTheCommittedReference) {
  if (std::system("/usr/bin/python3 -c 'import numpy' >/dev/null 2>&1") != 0)
    GTEST_SKIP() << "/usr/bin/python3 with numpy is not available";
  posenc::test::TempDir tmp;
  std::filesystem::path src;
  if (const char* e = std::getenv("POSENC_LLAMA_CPP_SRC"); e != nullptr && *e != '\0') {
    src = e;
    if (!has_gguf_py(src)) GTEST_SKIP() << "POSENC_LLAMA_CPP_SRC=" << e << " has no gguf-py/gguf";
  } else {
    const auto bundle = posenc::test::refs_dir() / "node_modules/node-llama-cpp/llama/gitRelease.bundle";
    std::error_code ec;
    if (!std::filesystem::exists(bundle, ec))
      GTEST_SKIP() << "no gguf-py: set POSENC_LLAMA_CPP_SRC or run scripts/install-refs (for " << bundle.string()
                   << ")";
    src = tmp.path() / "llama.cpp";
    const std::string clone = "git clone -q " + quoted(bundle) + " " + quoted(src) + " >/dev/null 2>&1";
    if (std::system(clone.c_str()) != 0 || !has_gguf_py(src)) GTEST_SKIP() << "could not clone " << bundle.string();
  }
  const auto out = tmp.path() / "gguf_reference.json";
  const std::string cmd = "PYTHONPATH=" + quoted(src / "gguf-py") + " /usr/bin/python3 " +
                          quoted(std::filesystem::path(POSENC_SOURCE_DIR) / "tools/refs/gguf_refs.py") +
                          " --shared " + quoted(posenc::test::shared_dir()) + " --out " + quoted(out);
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  const auto fresh = nlohmann::json::parse(posenc::test::slurp(out));
  const auto& committed = posenc::test::gguf::reference();
  std::cout << "[ info ] gguf-py " << fresh.at("generator").at("gguf_py_version") << ", llama.cpp checkout "
            << fresh.at("generator").at("llama_cpp_checkout") << ", numpy " << fresh.at("generator").at("numpy_version")
            << "\n";
  EXPECT_EQ(fresh.at("generator").at("gguf_py_version"), committed.at("generator").at("gguf_py_version"));
  EXPECT_EQ(fresh.at("generator").at("llama_cpp_commit"), committed.at("generator").at("llama_cpp_commit"));
  for (const char* section : {"files", "quantization"}) {
    const auto diff = nlohmann::json::diff(committed.at(section), fresh.at(section));
    EXPECT_TRUE(diff.empty()) << section << " differs: " << diff.dump().substr(0, 2000);
  }
}

}  // namespace POSENC_UNITY_ID
