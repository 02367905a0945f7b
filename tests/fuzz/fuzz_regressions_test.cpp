// Inputs the libFuzzer harnesses (fuzz/*_fuzz.cpp) found to misbehave, run
// through the parsers in the normal build. The same files are seeds of the
// fuzz corpora (fuzz/corpus/*/regression_*, written by fuzz/corpus/make_seeds.py),
// so the ASan/UBSan fuzz build replays them too.
#include <climits>
#include <filesystem>
#include <string>

#include <gtest/gtest.h>

#include "posenc/config.hpp"
#include "posenc/error.hpp"
#include "posenc/io.hpp"
#include "posenc/model.hpp"
#include "test_support.hpp"

namespace POSENC_UNITY_ID {  // this file's own namespace in the tests' unity build (CMakeLists.txt)

using namespace posenc;

namespace {

std::filesystem::path seed(const std::string& corpus, const std::string& name) {
  return std::filesystem::path(POSENC_SOURCE_DIR) / "fuzz/corpus" / corpus / name;
}

using posenc::test::message_of;

}  // namespace

// UBSan: 2000000000 + 1000000000 overflowed the int sum of mrope_section (the
// message then reported a wrapped sum). Each entry is now bounded by the
// head_dim bound and the sum formed in checked int64.
TEST(FuzzRegressions, ConfigMropeSectionSumDoesNotOverflow) {
  const std::string msg = message_of<ConfigError>(
      [] { load_positional_spec(seed("config", "regression_mrope_section_sum.json")); });
  EXPECT_NE(msg.find("rope_scaling.mrope_section[0]: must be an integer in [1, 16384] (got 1000000000)"),
            std::string::npos)
      << msg;
}

// UBSan: pad_token_id + 1 overflowed int for RoBERTa's position offset.
TEST(FuzzRegressions, ConfigRobertaPadTokenIdIsRangeChecked) {
  const std::string msg = message_of<ConfigError>(
      [] { load_positional_spec(seed("config", "regression_roberta_pad_token_id.json")); });
  EXPECT_NE(msg.find("pad_token_id"), std::string::npos) << msg;
  EXPECT_NE(msg.find("2147483647"), std::string::npos) << msg;
}

// UBSan: head_dim * num_attention_heads (65536 * 65536) overflowed int in the
// consistency note. Both are now bounded (16384) before the product is formed.
TEST(FuzzRegressions, ConfigHeadDimTimesHeadsDoesNotOverflow) {
  const std::string msg = message_of<ConfigError>(
      [] { load_positional_spec(seed("config", "regression_head_dim_times_heads.json")); });
  EXPECT_NE(msg.find("num_attention_heads: must be an integer in [1, 16384] (got 65536)"), std::string::npos) << msg;
}

// Hostile sizes of the fuzzing campaign (issue 13 item 6): refused by name.
TEST(FuzzRegressions, ConfigHostileSizesAreRefused) {
  const std::pair<const char*, const char*> cases[] = {
      {"regression_head_dim_1e9.json", "head_dim: must be an integer in [1, 16384] (got 1000000000)"},
      {"regression_layers_1e9_sliding_window.json", "num_hidden_layers: must be an integer in [1, 16384]"},
      {"regression_heads_1e9_alibi.json", "n_head: must be an integer in [1, 16384]"},
      {"regression_hidden_size_1e9.json", "hidden_size: must be an integer in [1, 1048576]"},
      {"regression_max_position_embeddings_int64_max.json", "max_position_embeddings: must be an integer in [1, 4294967296]"},
  };
  for (const auto& [file, needle] : cases) {
    const std::string msg = message_of<ConfigError>([&] { load_positional_spec(seed("config", file)); });
    EXPECT_NE(msg.find(needle), std::string::npos) << file << ": " << msg;
  }
}

// A non-string "format" made Model::load throw nlohmann::json::type_error.
TEST(FuzzRegressions, PosencCheckpointNonStringFormatIsCheckpointError) {
  const auto p = seed("posenc_checkpoint", "regression_format_object.posenc");
  const std::string msg = message_of<CheckpointError>([&] { Model::load(p); });
  EXPECT_NE(msg.find(p.string()), std::string::npos) << msg;
  EXPECT_NE(msg.find("format"), std::string::npos) << msg;
}

// "format": 1 (the case) and other wrong types are CheckpointErrors naming the file and field.
TEST(FuzzRegressions, PosencCheckpointIntegerFormatIsCheckpointError) {
  const auto p = seed("posenc_checkpoint", "regression_format_int.posenc");
  const std::string msg = message_of<CheckpointError>([&] { Model::load(p); });
  EXPECT_NE(msg.find(p.string()), std::string::npos) << msg;
  EXPECT_NE(msg.find("format"), std::string::npos) << msg;
}

}  // namespace POSENC_UNITY_ID
