// posenc verify on a dump written by PyTorch: tools/refs/make_verify_torch_dump.py (a Llama-style rotary module
// written the way Hugging Face writes it, Llama-3.1-8B's config) run at test time into a temp dir. The rotate_half
// dump passes; the same module with interleaved pairing fails and is diagnosed as a layout error. SKIPPED when
// Debian's python3-torch is not installed.
#include <gtest/gtest.h>

#include <cstdlib>

#include <nlohmann/json.hpp>

#include "../test_support.hpp"

namespace posenc {
namespace {

bool have_torch() { return std::system("/usr/bin/python3 -c 'import torch, numpy' >/dev/null 2>&1") == 0; }

std::string make_dump(const test::TempDir& dir, const std::string& pairing) {
  const auto out = dir.path() / pairing;
  const std::string cmd = "/usr/bin/python3 '" + (test::refs_dir() / "make_verify_torch_dump.py").string() + "' '" +
                          (test::shared_dir() / "configs/llama-3.1-8b.json").string() + "' '" + out.string() +
                          "' --pairing " + pairing + " >/dev/null 2>&1";
  EXPECT_EQ(std::system(cmd.c_str()), 0) << cmd;
  std::string files;
  for (const char* n : {"q", "q_rope", "k", "k_rope", "position_ids"})
    files += (files.empty() ? "" : ",") + (out / (std::string(n) + ".npy")).string();
  return files;
}

TEST(VerifyTorchDump, HfRotateHalfPassesAndInterleavedIsALayoutError) {
  if (!have_torch()) GTEST_SKIP() << "python3-torch is not installed (Debian python3-torch)";
  test::TempDir dir;
  const std::string config = (test::shared_dir() / "configs/llama-3.1-8b.json").string();
  const std::string half = make_dump(dir, "half");
  const auto pass = test::run_cli("verify --config '" + config + "' --dump '" + half + "' --json -");
  ASSERT_EQ(pass.exit_code, 0) << pass.out << pass.err;
  const auto j = nlohmann::json::parse(pass.out);
  EXPECT_TRUE(j["pass"].get<bool>());
  ASSERT_EQ(j["errors"].size(), 2u);  // q_rope and k_rope
  for (const auto& e : j["errors"]) EXPECT_LE(e["max"].get<double>(), e["tolerance"].get<double>()) << e.dump();

  const std::string inter = make_dump(dir, "interleaved");
  const auto fail = test::run_cli("verify --config '" + config + "' --dump '" + inter + "'");
  EXPECT_EQ(fail.exit_code, 1) << fail.out << fail.err;
  EXPECT_NE(fail.out.find("FAIL: your output matches `rotate_half and interleaved pairing swapped`"),
            std::string::npos)
      << fail.out;
  EXPECT_NE(fail.err.find("does not match the reference"), std::string::npos) << fail.err;
  const auto fj = test::run_cli("verify --config '" + config + "' --dump '" + inter + "' --json -");
  const auto k = nlohmann::json::parse(fj.out);
  EXPECT_FALSE(k["pass"].get<bool>());
  EXPECT_EQ(k["hypotheses"][0]["id"], "layout_swapped");
  EXPECT_TRUE(k["hypotheses"][0]["matches"].get<bool>());
}

TEST(VerifyCli, ListsTheCatalogueAndRefusesBadFlags) {
  const auto list = test::run_cli("verify --list-mistakes");
  EXPECT_EQ(list.exit_code, 0) << list.err;
  EXPECT_NE(list.out.find("positions_count_left_padding"), std::string::npos);
  const auto bad = test::run_cli("verify --config x.json --dump y.npy --dump-layout heads,tokens");
  EXPECT_EQ(bad.exit_code, 2) << bad.err;
  EXPECT_NE(bad.err.find("--dump-layout"), std::string::npos) << bad.err;
  const auto none = test::run_cli("verify --dump y.npy");
  EXPECT_EQ(none.exit_code, 2) << none.err;
}

}  // namespace
}  // namespace posenc
