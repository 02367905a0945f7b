#include <cmath>
#include <cstring>
#include <limits>

#include <gtest/gtest.h>

#include "posenc/error.hpp"
#include "posenc/model.hpp"
#include "test_support.hpp"

namespace POSENC_UNITY_ID {  // this file's own namespace in the tests' unity build (CMakeLists.txt)

using namespace posenc;
using posenc::test::TempDir;

namespace {
std::string model_bytes() { return posenc::test::slurp(posenc::test::model_path()); }
std::string with_header_field(std::string bytes, int field, int32_t value) {
  std::memcpy(bytes.data() + 4 * field, &value, 4);
  return bytes;
}
void expect_checkpoint_error(const std::filesystem::path& p, const std::string& needle) {
  try {
    Model::load_llama2c(p);
    FAIL() << "no error for " << p;
  } catch (const CheckpointError& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}
}  // namespace

TEST(Checkpoint, Stories260KHeader) {
  const Model m = Model::load_llama2c(posenc::test::model_path());
  const auto& c = m.config();
  EXPECT_EQ(c.dim, 64);
  EXPECT_EQ(c.hidden_dim, 172);
  EXPECT_EQ(c.n_layers, 5);
  EXPECT_EQ(c.n_heads, 8);
  EXPECT_EQ(c.n_kv_heads, 4);
  EXPECT_EQ(c.vocab_size, 512);
  EXPECT_EQ(c.max_position_embeddings, 512);
  EXPECT_EQ(c.head_dim, 8);
  EXPECT_TRUE(c.shared_classifier);
  EXPECT_EQ(m.rope().layout, RopeLayout::interleaved);
  EXPECT_EQ(m.rope().precision, AnglePrecision::float32);
  EXPECT_EQ(m.rope().freqs.rotary_dim, 8);
  EXPECT_FLOAT_EQ(m.rope().freqs.inv_freq[1], 0.1f);  // 10000^(-2/8)
}

TEST(Checkpoint, BadFilesNameTheProblem) {
  TempDir d;
  const std::string good = model_bytes();
  expect_checkpoint_error(d.file("empty.bin", ""), "empty");
  expect_checkpoint_error(d.file("short.bin", good.substr(0, 20)), "header");
  expect_checkpoint_error(d.file("trunc.bin", good.substr(0, good.size() / 2)), "truncated");
  expect_checkpoint_error(d.file("long.bin", good + "xxxx"), "beyond");
  expect_checkpoint_error(d.file("dim.bin", with_header_field(good, 0, 60)), "not divisible by n_heads");
  expect_checkpoint_error(d.file("kv.bin", with_header_field(good, 4, 3)), "n_kv_heads");
  expect_checkpoint_error(d.file("neg.bin", with_header_field(good, 2, -5)), "n_layers");
  expect_checkpoint_error(d.file("odd.bin", with_header_field(with_header_field(good, 0, 24), 3, 8)), "even");
  std::string nan = good;
  const float q = std::numeric_limits<float>::quiet_NaN();
  std::memcpy(nan.data() + 28 + 4 * 100, &q, 4);
  expect_checkpoint_error(d.file("nan.bin", nan), "not finite");
  EXPECT_THROW(Model::load_llama2c(d.path() / "missing.bin"), IoError);
}

}  // namespace POSENC_UNITY_ID
