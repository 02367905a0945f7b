#include <cstring>

#include <gtest/gtest.h>

#include "posenc/error.hpp"
#include "posenc/io.hpp"
#include "posenc/perplexity.hpp"
#include "posenc/tokenizer.hpp"
#include "test_support.hpp"

namespace POSENC_UNITY_ID {  // this file's own namespace in the tests' unity build (CMakeLists.txt)

using namespace posenc;
using posenc::test::TempDir;

namespace {

uint64_t fnv1a(const std::vector<int32_t>& ids) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (int32_t t : ids) {
    unsigned char b[4];
    std::memcpy(b, &t, 4);
    for (unsigned char c : b) {
      h ^= c;
      h *= 0x100000001b3ull;
    }
  }
  return h;
}

const Tokenizer& tok512() {
  static const Tokenizer t = Tokenizer::load_llama2c(posenc::test::tokenizer_path(), 512);
  return t;
}

}  // namespace

TEST(Tokenizer, LoadsTok512) {
  EXPECT_EQ(tok512().vocab_size(), 512);
  EXPECT_EQ(tok512().max_token_length(), 7);
  EXPECT_EQ(tok512().piece(3), "<0x00>");
  EXPECT_EQ(tok512().piece(259), " t");
}

// Ids produced by llama2.c's run.c bpe_encode (built from karpathy/llama2.c and
// run on the same tokenizer file): BOS, " Once", " upon", " a", " time".
TEST(Tokenizer, OnceUponATimeMatchesLlama2c) {
  EXPECT_EQ(tok512().encode("Once upon a time", true, false), (std::vector<int32_t>{1, 403, 407, 261, 378}));
  EXPECT_EQ(tok512().encode("Once upon a time", false, true), (std::vector<int32_t>{403, 407, 261, 378, 2}));
  EXPECT_TRUE(tok512().encode("", false, false).empty());
}

TEST(Tokenizer, ByteFallbackAndUtf8) {
  // U+4E2D is not in this 512-token vocabulary: its three UTF-8 bytes fall
  // back to <0xE4> <0xB8> <0xAD> (id = byte + 3); U+00E9 is a token of its own.
  const auto ids = tok512().encode("\xe4\xb8\xad", false, false);
  ASSERT_EQ(ids.size(), 4u);
  EXPECT_EQ(std::vector<int32_t>(ids.begin() + 1, ids.end()), (std::vector<int32_t>{0xE4 + 3, 0xB8 + 3, 0xAD + 3}));
  EXPECT_EQ(tok512().piece(ids[0]), " ");
  EXPECT_EQ(tok512().decode(ids), " \xe4\xb8\xad");
  EXPECT_EQ(tok512().encode("\xc3\xa9", false, false).back(), 485);
}

// The whole shared text, block by block: identical to the stream llama2.c's
// encoder produces (count and FNV-1a hash of the int32 ids taken from the
// reference run), and every block decodes back to itself.
TEST(Tokenizer, WholeTextMatchesReferenceAndRoundTrips) {
  const std::string text = read_file(posenc::test::text_path());
  const auto blocks = split_blocks(text);
  EXPECT_EQ(blocks.size(), 4302u);
  const auto stream = encode_stream(tok512(), text);
  EXPECT_EQ(stream.size(), 384954u);
  EXPECT_EQ(fnv1a(stream), 0x0adb5b39a5c6887bull);
  for (const auto& b : blocks) ASSERT_EQ(tok512().decode(tok512().encode(b, true, false)), b);
}

TEST(Tokenizer, DecodeStripsLeadingSpaceOnlyAfterBos) {
  EXPECT_EQ(tok512().decode(1, 403), "Once");
  EXPECT_EQ(tok512().decode(403, 403), " Once");
  EXPECT_EQ(tok512().decode(1, 10 + 3), "\n");
}

TEST(Tokenizer, MalformedFilesThrowTypedErrors) {
  TempDir d;
  const std::string good = posenc::test::slurp(posenc::test::tokenizer_path());
  EXPECT_THROW(Tokenizer::load_llama2c(d.file("empty.bin", "")), TokenizerError);
  EXPECT_THROW(Tokenizer::load_llama2c(d.file("trunc.bin", good.substr(0, good.size() - 3))), TokenizerError);
  EXPECT_THROW(Tokenizer::load_llama2c(d.path() / "missing.bin"), IoError);
  try {
    Tokenizer::load_llama2c(posenc::test::tokenizer_path(), 32000);
    FAIL() << "vocab mismatch not detected";
  } catch (const TokenizerError& e) {
    EXPECT_NE(std::string(e.what()).find("32000"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("512"), std::string::npos) << e.what();
  }
  std::string bad_len = good;
  const int32_t huge = 1000;
  std::memcpy(bad_len.data() + 4 + 4, &huge, 4);  // token 0's length
  EXPECT_THROW(Tokenizer::load_llama2c(d.file("badlen.bin", bad_len)), TokenizerError);
}

TEST(Blocks, SplitOnBlankLinesJoinAndStrip) {
  const auto b = split_blocks("  a\nb  \n\n \t \nc\r\n\n\n d \n");
  ASSERT_EQ(b.size(), 3u);
  EXPECT_EQ(b[0], "a\nb");
  EXPECT_EQ(b[1], "c");
  EXPECT_EQ(b[2], "d");
  EXPECT_TRUE(split_blocks("\n \n\t\n").empty());
}

}  // namespace POSENC_UNITY_ID
