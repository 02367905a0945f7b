// Sizes a config.json gives are bounded (posenc/config.hpp config_limits) and
// combined in checked int64 arithmetic before anything is allocated from them
// (issue 13, items 5 and 6): the hostile configs of the fuzzing campaign fail
// fast with a ConfigError naming the field and value, inside a small address
// space (a forked child under RLIMIT_AS), and through the CLI under `ulimit -v`.
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <climits>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "posenc/analysis.hpp"
#include "posenc/checked.hpp"
#include "posenc/config.hpp"
#include "posenc/error.hpp"
#include "posenc/mrope.hpp"
#include "sanitizer.hpp"
#include "test_util.hpp"

namespace POSENC_UNITY_ID {  // this file's own namespace in the tests' unity build (CMakeLists.txt)

using namespace posenc;

namespace {

// The campaign's hostile configs (a few tens of bytes each).
const char* const kHeadDim1e9 =
    R"({"model_type":"llama","num_attention_heads":1,"head_dim":1000000000,"max_position_embeddings":4096})";
const char* const kLayers1e9Sliding =
    R"({"model_type":"mistral","num_attention_heads":1,"head_dim":2,"num_hidden_layers":1000000000,)"
    R"("sliding_window":16,"max_position_embeddings":64})";
const char* const kHeads1e9Alibi = R"({"model_type":"bloom","n_head":1000000000,"hidden_size":64})";
const char* const kHidden1e9 =
    R"({"model_type":"llama","num_attention_heads":1,"hidden_size":1000000000,"max_position_embeddings":64})";
const char* const kMropeSum =
    R"({"model_type":"qwen2_vl","num_attention_heads":1,"head_dim":4,"max_position_embeddings":64,)"
    R"("rope_scaling":{"type":"mrope","mrope_section":[1000000000,1000000000,1000000000]}})";
const char* const kPadTokenId = R"({"model_type":"roberta","max_position_embeddings":64,"pad_token_id":2147483647})";

std::string error_of(const std::string& text) {
  try {
    const PositionalSpec s = parse_positional_spec(text, "hostile.json");
    if (s.rope) (void)inspect_rope(s, std::nullopt);
  } catch (const ConfigError& e) {
    return e.what();
  } catch (const std::exception& e) {
    return std::string("wrong exception type: ") + e.what();
  }
  return "no exception";
}

/// Virtual memory of this process now, in bytes (/proc/self/statm: pages).
uint64_t vm_size() {
  std::ifstream in("/proc/self/statm");
  uint64_t pages = 0;
  in >> pages;
  return pages * static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
}

/// Parses (and inspects) `text` in a forked child whose address space may grow
/// by at most 512 MiB and which is killed after 10 s: exit 0 when a ConfigError
/// naming `needle` came out, 1 for any other outcome, killed by a signal when
/// it ran out of time.
int in_small_child(const std::string& text, const std::string& needle) {
  const uint64_t limit = vm_size() + (uint64_t{512} << 20);
  const pid_t pid = ::fork();
  if (pid == 0) {
    const rlimit rl{limit, limit};
    ::setrlimit(RLIMIT_AS, &rl);
    ::alarm(10);
    const std::string msg = error_of(text);
    ::_exit(msg.find(needle) != std::string::npos && msg.find("wrong exception") == std::string::npos ? 0 : 1);
  }
  int st = 0;
  ::waitpid(pid, &st, 0);
  if (WIFSIGNALED(st)) return 128 + WTERMSIG(st);
  return WEXITSTATUS(st);
}

struct Hostile {
  const char* name;
  const char* text;
  const char* needle;  // in the ConfigError's message
};

const Hostile kHostile[] = {
    {"head_dim 1e9", kHeadDim1e9, "head_dim: must be an integer in [1, 16384] (got 1000000000)"},
    {"1e9 layers + sliding_window", kLayers1e9Sliding,
     "num_hidden_layers: must be an integer in [1, 16384] (got 1000000000)"},
    {"1e9 ALiBi heads", kHeads1e9Alibi, "n_head: must be an integer in [1, 16384] (got 1000000000)"},
    {"hidden_size 1e9", kHidden1e9, "hidden_size: must be an integer in [1, 1048576] (got 1000000000)"},
    {"mrope_section 3 x 1e9", kMropeSum, "mrope_section[0]: must be an integer in [1, 16384] (got 1000000000)"},
    {"pad_token_id INT_MAX", kPadTokenId, "pad_token_id: must be an integer in [0, 16777215] (got 2147483647)"},
};

}  // namespace

TEST(ConfigLimits, HostileSizesAreTypedErrorsNamingFieldAndValue) {
  for (const auto& h : kHostile) {
    const auto t0 = std::chrono::steady_clock::now();
    const std::string msg = error_of(h.text);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    EXPECT_NE(msg.find("hostile.json"), std::string::npos) << h.name << ": " << msg;
    EXPECT_NE(msg.find(h.needle), std::string::npos) << h.name << ": " << msg;
    EXPECT_LT(s, 2.0) << h.name << ": the refusal must not follow work proportional to the size";
  }
}

TEST(ConfigLimits, HostileSizesFailInASmallAddressSpace) {
  if (test::kAddressSanitizer) GTEST_SKIP() << "bounds the address space: not under AddressSanitizer";
  for (const auto& h : kHostile) EXPECT_EQ(in_small_child(h.text, h.needle), 0) << h.name;
}

TEST(ConfigLimits, BoundsAdmitRealModelsAtTheirEdges) {
  // A head_dim of exactly the bound and 16384 heads (their product 2^28 formed in int64) are accepted.
  const auto s = parse_positional_spec(
      R"({"model_type":"llama","num_attention_heads":16384,"num_key_value_heads":16384,"head_dim":16384,)"
      R"("hidden_size":1048576,"max_position_embeddings":4294967296})");
  ASSERT_TRUE(s.rope);
  EXPECT_EQ(s.rope->head_dim, 16384);
  EXPECT_EQ(*s.max_position_embeddings, int64_t{1} << 32);
  // hidden_size / heads above the head_dim bound is refused by name.
  const std::string msg = error_of(R"({"model_type":"llama","num_attention_heads":2,"hidden_size":1048576})");
  EXPECT_NE(msg.find("hidden_size / num_attention_heads = 1048576 / 2 = 524288 exceeds the head_dim bound 16384"),
            std::string::npos)
      << msg;
}

TEST(ConfigLimits, PositionsAndWindowsAreBounded) {
  const std::string mpe = error_of(
      R"({"model_type":"llama","num_attention_heads":1,"head_dim":2,"max_position_embeddings":9223372036854775807})");
  EXPECT_NE(mpe.find("max_position_embeddings: must be an integer in [1, 4294967296] (got 9223372036854775807)"),
            std::string::npos)
      << mpe;
  const std::string sw = error_of(
      R"({"model_type":"mistral","num_attention_heads":1,"head_dim":2,"sliding_window":1e15,"max_position_embeddings":64})");
  EXPECT_NE(sw.find("sliding_window: must be an integer in [1, 4294967296]"), std::string::npos) << sw;
  const std::string mwl = error_of(
      R"({"model_type":"qwen2","num_attention_heads":1,"head_dim":2,"num_hidden_layers":2,"sliding_window":8,)"
      R"("use_sliding_window":true,"max_window_layers":4294967297,"max_position_embeddings":64})");
  EXPECT_NE(mwl.find("max_window_layers: must be an integer in [0, 16384] (got 4294967297)"), std::string::npos)
      << mwl;
  const std::string dec = [] {
    try {
      parse_decoder_spec(R"({"architectures":["LlamaForCausalLM"],"model_type":"llama","num_attention_heads":1,)"
                         R"("head_dim":2,"hidden_size":2,"intermediate_size":4,"num_hidden_layers":1,)"
                         R"("vocab_size":1000000000,"max_position_embeddings":64})",
                         "d.json");
    } catch (const ConfigError& e) {
      return std::string(e.what());
    }
    return std::string("no ConfigError");
  }();
  EXPECT_NE(dec.find("d.json: vocab_size: must be an integer in [1, 16777216] (got 1000000000)"), std::string::npos)
      << dec;
}

// mrope_pair_rows summed the sections in int: 3 × 1e9 wrapped to -1294967296 (UB).
TEST(ConfigLimits, MropePairRowsSumsInInt64) {
  const std::vector<int> section{1000000000, 1000000000, 1000000000};
  try {
    (void)mrope_pair_rows(section, 4);
    FAIL() << "no exception";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("sum to 3000000000"), std::string::npos) << e.what();
  }
}

TEST(ConfigLimits, CheckedArithmeticNamesTheField) {
  EXPECT_EQ(checked_add<ConfigError>(INT64_MAX - 1, 1, "f"), INT64_MAX);
  EXPECT_THROW(checked_add<ConfigError>(INT64_MAX, 1, "f"), ConfigError);
  EXPECT_THROW(checked_mul<ConfigError>(INT64_MAX / 2 + 1, 2, "f"), ConfigError);
  try {
    checked_mul<ConfigError>(int64_t{1} << 32, int64_t{1} << 32, "head_dim × num_attention_heads");
  } catch (const ConfigError& e) {
    EXPECT_STREQ(e.what(), "head_dim × num_attention_heads: 4294967296 × 4294967296 overflows int64");
  }
  EXPECT_THROW(checked_range<ConfigError>(-1, 0, 10, "--seed"), ConfigError);
}

// The same configs through the CLI in a 2 GiB address space: exit 1 at once
// with the message, never a multi-gigabyte allocation.
TEST(ConfigLimits, InspectRefusesHostileConfigsUnderUlimit) {
  if (test::kAddressSanitizer) GTEST_SKIP() << "bounds the address space: not under AddressSanitizer";
  test::ScratchDir dir;
  for (const auto& h : kHostile) {
    const auto p = dir.write("hostile.json", h.text);
    const std::string cmd = "ulimit -v 2097152; timeout 20 " + test::shell_quote(POSENC_CLI_PATH) +
                            " inspect --json - --config " + test::shell_quote(p.string()) + " >/dev/null 2>" +
                            test::shell_quote((dir / "err").string());
    const auto t0 = std::chrono::steady_clock::now();
    const int st = std::system(("sh -c " + test::shell_quote(cmd)).c_str());
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    ASSERT_TRUE(WIFEXITED(st)) << h.name;
    EXPECT_EQ(WEXITSTATUS(st), 1) << h.name;
    const std::string err = test::slurp(dir / "err");
    EXPECT_NE(err.find(h.needle), std::string::npos) << h.name << ": " << err;
    EXPECT_EQ(err.find("out of memory"), std::string::npos) << h.name << ": " << err;
    EXPECT_LT(s, 15.0) << h.name;
  }
}

}  // namespace POSENC_UNITY_ID
