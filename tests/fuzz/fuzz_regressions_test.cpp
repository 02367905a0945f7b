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

using namespace posenc;

namespace {

std::filesystem::path seed(const std::string& corpus, const std::string& name) {
  return std::filesystem::path(POSENC_SOURCE_DIR) / "fuzz/corpus" / corpus / name;
}

template <class E, class F>
std::string message_of(F&& f) {
  try {
    f();
  } catch (const E& e) {
    return e.what();
  } catch (const std::exception& e) {
    return std::string("wrong exception type: ") + e.what();
  }
  return "no exception";
}

}  // namespace

// UBSan: 2000000000 + 1000000000 overflowed the int sum of mrope_section (the
// message then reported a wrapped sum).
TEST(FuzzRegressions, ConfigMropeSectionSumDoesNotOverflow) {
  const std::string msg = message_of<ConfigError>(
      [] { load_positional_spec(seed("config", "regression_mrope_section_sum.json")); });
  EXPECT_NE(msg.find("rope_scaling.mrope_section"), std::string::npos) << msg;
  EXPECT_NE(msg.find("sums to 3000000000"), std::string::npos) << msg;
}

// UBSan: pad_token_id + 1 overflowed int for RoBERTa's position offset.
TEST(FuzzRegressions, ConfigRobertaPadTokenIdIsRangeChecked) {
  const std::string msg = message_of<ConfigError>(
      [] { load_positional_spec(seed("config", "regression_roberta_pad_token_id.json")); });
  EXPECT_NE(msg.find("pad_token_id"), std::string::npos) << msg;
  EXPECT_NE(msg.find("2147483647"), std::string::npos) << msg;
}

// UBSan: head_dim * num_attention_heads (65536 * 65536) overflowed int in the
// consistency note; the spec itself is valid.
TEST(FuzzRegressions, ConfigHeadDimTimesHeadsDoesNotOverflow) {
  const auto spec = load_positional_spec(seed("config", "regression_head_dim_times_heads.json"));
  ASSERT_TRUE(spec.rope);
  EXPECT_EQ(spec.rope->head_dim, 65536);
  EXPECT_EQ(spec.num_attention_heads, 65536);
}

// A non-string "format" made Model::load throw nlohmann::json::type_error.
TEST(FuzzRegressions, PosencCheckpointNonStringFormatIsCheckpointError) {
  const auto p = seed("posenc_checkpoint", "regression_format_object.posenc");
  const std::string msg = message_of<CheckpointError>([&] { Model::load(p); });
  EXPECT_NE(msg.find(p.string()), std::string::npos) << msg;
  EXPECT_NE(msg.find("format"), std::string::npos) << msg;
}
