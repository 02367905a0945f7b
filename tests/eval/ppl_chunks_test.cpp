// Perplexity windows scored a chunk of tokens at a time (Model::score_window's chunked overload,
// PplOptions::chunk_tokens): only one chunk's logits are held, so memory does not grow with context x vocab_size,
// and progress is reported within a window. The chunks must give the whole window's logits to the bit, on the
// real checkpoints in ../shared/models, in every weight path and KV cache type, and with a length-dependent RoPE.
#include <cstring>
#include <optional>
#include <stdexcept>
#include <vector>

#include <gtest/gtest.h>

#include "posenc/error.hpp"
#include "posenc/io.hpp"
#include "posenc/model.hpp"
#include "posenc/perplexity.hpp"
#include "posenc/tokenizer.hpp"
#include "test_support.hpp"

namespace POSENC_UNITY_ID {  // this file's own namespace in the tests' unity build (CMakeLists.txt)

using namespace posenc;
namespace fs = std::filesystem;

namespace {

fs::path models() { return test::shared_dir() / "models"; }

/// The first `n` tokens of the validation text in `tok`'s encoding.
std::vector<int32_t> text_tokens(const Tokenizer& tok, std::size_t n) {
  std::vector<int32_t> ids = encode_stream(tok, read_file(test::text_path()).substr(0, 40000));
  if (ids.size() < n) throw std::runtime_error("the validation text is too short for the test");
  ids.resize(n);
  return ids;
}

/// The window's logits collected from the chunked overload; checks that the chunks come in order, back to back,
/// each of at most `chunk` rows.
std::vector<float> chunked_logits(const Model& m, std::span<const int32_t> tokens, int64_t chunk) {
  const std::size_t V = static_cast<std::size_t>(m.config().vocab_size);
  std::vector<float> out;
  int64_t next = 0;
  m.score_window(tokens, chunk, [&](int64_t first, const float* logits, int64_t rows) {
    EXPECT_EQ(first, next);
    EXPECT_GE(rows, 1);
    EXPECT_LE(rows, chunk);
    out.insert(out.end(), logits, logits + static_cast<std::size_t>(rows) * V);
    next = first + rows;
  });
  EXPECT_EQ(next, static_cast<int64_t>(tokens.size()));
  return out;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

/// Every chunk size gives score_window's logits to the bit.
void expect_chunks_give_the_window(const Model& m, std::span<const int32_t> tokens, const std::string& what) {
  const std::vector<float> whole = m.score_window(tokens);
  const auto n = static_cast<int64_t>(tokens.size());
  for (int64_t chunk : {int64_t{1}, int64_t{7}, int64_t{64}, n - 1, n, n + 100}) {
    const std::vector<float> parts = chunked_logits(m, tokens, chunk);
    EXPECT_TRUE(same_bits(parts, whole)) << what << ", chunks of " << chunk << " tokens";
  }
}

}  // namespace

TEST(PplChunks, ChunksGiveTheWholeWindowsLogitsOnRealCheckpoints) {
  const Tokenizer stories_tok = Tokenizer::load_llama2c(test::tokenizer_path(), 512);
  {
    const Model m = Model::load_llama2c(test::model_path());
    expect_chunks_give_the_window(m, text_tokens(stories_tok, 300), "stories260K");
    Model f16 = m;
    f16.set_kv_cache_dtype(KvCacheDtype::f16);
    expect_chunks_give_the_window(f16, text_tokens(stories_tok, 300), "stories260K, f16 KV cache");
    Model bf16 = m;
    bf16.set_kv_cache_dtype(KvCacheDtype::bf16);
    expect_chunks_give_the_window(bf16, text_tokens(stories_tok, 300), "stories260K, bf16 KV cache");
  }
  const fs::path hf = models() / "TinyStories-656K";
  const fs::path q8 = models() / "TinyStories-656K-gguf/TinyStories-656K-Q8_0.gguf";
  const Tokenizer tok = Tokenizer::load_tokenizer_json(hf / "tokenizer.json");
  const std::vector<int32_t> tokens = text_tokens(tok, 200);
  expect_chunks_give_the_window(Model::load(hf), tokens, "TinyStories-656K (Hugging Face directory)");
  expect_chunks_give_the_window(Model::load(q8), tokens, "TinyStories-656K Q8_0, float32 products");
  LoadOptions q8a;
  q8a.quantized_matmul = QuantizedMatmul::q8_activations;
  expect_chunks_give_the_window(Model::load(q8, q8a), tokens, "TinyStories-656K Q8_0, q8_activations");
}

// Dynamic NTK recomputes its frequencies from the length in every forward: the chunks are rotated with the
// whole window's, as one forward over it is. Without the freeze a chunk short of the trained context would keep
// the unscaled frequencies (checked below, so that the comparison can fail).
TEST(PplChunks, ALengthDependentRopeIsFrozenAtTheWindowsLength) {
  const Tokenizer tok = Tokenizer::load_llama2c(test::tokenizer_path(), 512);
  Model m = Model::load_llama2c(test::model_path());
  const int64_t L = 1024;  // past stories260K's 512: dynamic NTK scales
  m.set_rope(rope_setup_for_context(m.rope(), m.trained_context(), "dynamic", L, std::nullopt));
  ASSERT_TRUE(m.rope().update_with_length);
  const std::vector<int32_t> tokens = text_tokens(tok, static_cast<std::size_t>(L));
  const std::vector<float> whole = m.score_window(tokens);
  EXPECT_TRUE(same_bits(chunked_logits(m, tokens, 100), whole));
  EXPECT_TRUE(same_bits(chunked_logits(m, tokens, 512), whole));

  // A plain forward of the first 100 tokens (frequencies for 100 positions, those of the trained context)
  // differs from the whole window's first 100 rows.
  const std::vector<float> first = m.score_window(std::span<const int32_t>(tokens).first(100));
  const std::vector<float> whole_first(whole.begin(), whole.begin() + static_cast<std::ptrdiff_t>(first.size()));
  EXPECT_FALSE(same_bits(first, whole_first));
}

TEST(PplChunks, PerplexityIsTheSameForEveryChunkSizeAndReportsProgressWithinWindows) {
  const Tokenizer tok = Tokenizer::load_llama2c(test::tokenizer_path(), 512);
  const Model m = Model::load_llama2c(test::model_path());
  const std::vector<int32_t> stream = text_tokens(tok, 5000);
  PplOptions o;
  o.context = 1024;
  o.chunk_tokens = 0;  // automatic: a whole window for a 512-token vocabulary
  const PplResult whole = evaluate_perplexity(m, stream, o);
  ASSERT_EQ(whole.windows, 5);
  for (int64_t chunk : {int64_t{7}, int64_t{256}}) {
    o.chunk_tokens = chunk;
    std::vector<PplProgress> reports;
    o.on_progress = [&](const PplProgress& p) { reports.push_back(p); };
    const PplResult r = evaluate_perplexity(m, stream, o);
    EXPECT_EQ(r.nll, whole.nll) << chunk;
    EXPECT_EQ(r.tokens, whole.tokens);
    ASSERT_EQ(r.buckets.size(), whole.buckets.size());
    for (std::size_t b = 0; b < r.buckets.size(); ++b) {
      EXPECT_EQ(r.buckets[b].nll_sum, whole.buckets[b].nll_sum) << chunk << " bucket " << b;
      EXPECT_EQ(r.buckets[b].nll_ci_low, whole.buckets[b].nll_ci_low);
      EXPECT_EQ(r.buckets[b].nll_ci_high, whole.buckets[b].nll_ci_high);
    }
    // Reports count predictions (chunks of windows in flight included) against all of them; the last is the
    // whole run's.
    ASSERT_FALSE(reports.empty());
    int64_t last = 0;
    for (const PplProgress& p : reports) {
      EXPECT_EQ(p.tokens_total, whole.tokens);
      EXPECT_GE(p.tokens_done, last);
      EXPECT_LE(p.tokens_done, p.tokens_total);
      last = p.tokens_done;
    }
    EXPECT_EQ(reports.back().windows_done, 5);
    EXPECT_EQ(reports.back().tokens_done, whole.tokens);
  }
}

TEST(PplChunks, AutomaticChunksFollowTheVocabulary) {
  EXPECT_EQ(ppl_auto_chunk_tokens(32000), 512);    // 64 MiB / (4 x 32000) = 524 -> 512
  EXPECT_EQ(ppl_auto_chunk_tokens(128256), 128);   // Llama 3: 130 -> 128
  EXPECT_EQ(ppl_auto_chunk_tokens(512), 32768);    // stories260K: a whole window at any context it is run at
  EXPECT_EQ(ppl_auto_chunk_tokens(int64_t{1} << 24), 16);  // at least 16
  EXPECT_THROW(ppl_auto_chunk_tokens(0), InvalidArgument);
}

TEST(PplChunks, BadChunkSizesAreRefusedNamingTheField) {
  const Model m = Model::load_llama2c(test::model_path());
  const std::vector<int32_t> tokens = {1, 2, 3, 4};
  try {
    m.score_window(tokens, 0, [](int64_t, const float*, int64_t) {});
    FAIL() << "chunk_tokens 0 accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("chunk_tokens"), std::string::npos) << e.what();
  }
  PplOptions o;
  o.context = 4;
  o.chunk_tokens = -1;
  try {
    evaluate_perplexity(m, tokens, o);
    FAIL() << "chunk_tokens -1 accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("chunk_tokens"), std::string::npos) << e.what();
  }
  // An exception from the callback reaches the caller.
  EXPECT_THROW(m.score_window(tokens, 2, [](int64_t, const float*, int64_t) { throw std::runtime_error("stop"); }),
               std::runtime_error);
}

}  // namespace POSENC_UNITY_ID
