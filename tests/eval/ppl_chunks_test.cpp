// Perplexity windows scored a chunk of tokens at a time (Model::score_window's chunked overload,
// PplOptions::chunk_tokens): only one chunk's logits are held, so memory does not grow with context x vocab_size,
// and progress is reported within a window. The chunks must give the whole window's logits to the bit, on the
// real checkpoints in ../shared/models (float32 weights, Q8_0 in both products; f32, f16 and bf16 KV caches), and
// with a length-dependent RoPE (dynamic NTK under two change policies, LongRoPE).
#include <omp.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <utility>
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

/// The message of the InvalidArgument `f` throws ("" and a test failure when it throws none).
template <class F>
std::string invalid_argument_of(F&& f) {
  try {
    f();
  } catch (const InvalidArgument& e) {
    return e.what();
  }
  ADD_FAILURE() << "no InvalidArgument";
  return "";
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

/// The chunks of `m` give its whole window's logits, while a plain forward of the first `head` tokens (the
/// frequencies of `head` positions) differs from the whole window's first rows: the freeze matters, so the
/// comparison can fail.
void expect_frozen_at_the_windows_length(const Model& m, std::span<const int32_t> tokens, int64_t head,
                                         const std::string& what) {
  ASSERT_TRUE(m.rope().update_with_length) << what;
  const std::vector<float> whole = m.score_window(tokens);
  for (int64_t chunk : {head, int64_t{64}, static_cast<int64_t>(tokens.size()) - 1})
    EXPECT_TRUE(same_bits(chunked_logits(m, tokens, chunk), whole)) << what << ", chunks of " << chunk;
  const std::vector<float> first = m.score_window(tokens.first(static_cast<std::size_t>(head)));
  const std::vector<float> whole_first(whole.begin(), whole.begin() + static_cast<std::ptrdiff_t>(first.size()));
  EXPECT_FALSE(same_bits(first, whole_first)) << what;
}

// A length-dependent RoPE recomputes its frequencies from the length in every forward: the chunks are rotated
// with those one forward over the whole window computes.
TEST(PplChunks, ALengthDependentRopeIsFrozenAtTheWindowsLength) {
  const Tokenizer tok = Tokenizer::load_llama2c(test::tokenizer_path(), 512);
  const Model base = Model::load_llama2c(test::model_path());
  {
    // Dynamic NTK past stories260K's 512 (a 1024-token window), under the default policy and Hugging Face's.
    Model m = base;
    m.set_rope(rope_setup_for_context(m.rope(), m.trained_context(), "dynamic", 1024, std::nullopt));
    const std::vector<int32_t> tokens = text_tokens(tok, 1024);
    expect_frozen_at_the_windows_length(m, tokens, 100, "dynamic, recompute");
    m.set_rope_change_policy(RopeChangePolicy::hf);
    expect_frozen_at_the_windows_length(m, tokens, 100, "dynamic, hf");
  }
  {
    // LongRoPE (Phi-3 style: short and long factors, original context 128): a 300-token window takes the long
    // factors, a forward of its first 100 tokens the short ones.
    Model m = base;
    RopeSetup r = m.rope();
    r.params.rope_type = "longrope";
    r.params.original_max_position_embeddings = 128;
    r.params.factor = 32.0;
    r.params.short_factor = {1.0, 1.05, 1.2, 1.5};
    r.params.long_factor = {1.0, 2.5, 8.0, 20.0};
    r.freqs = compute_rope_frequencies(r.params, 128);
    r.update_with_length = true;
    m.set_rope(r);
    expect_frozen_at_the_windows_length(m, text_tokens(tok, 300), 100, "longrope");
  }
}

// With reports unthrottled (progress_interval_seconds 0) and one thread, the reports are exactly: after each chunk
// but a window's last, its predictions; after each window but the last, the rest of its predictions; then the
// final report, once.
TEST(PplChunks, ProgressCountsEveryChunksPredictionsOnce) {
  const Tokenizer tok = Tokenizer::load_llama2c(test::tokenizer_path(), 512);
  const Model m = Model::load_llama2c(test::model_path());
  const std::vector<int32_t> stream = text_tokens(tok, 5000);
  PplOptions o;
  o.context = 1024;
  o.chunk_tokens = 256;
  o.progress_interval_seconds = 0;
  std::vector<std::pair<int64_t, int64_t>> got;  // (windows_done, tokens_done)
  int64_t total = -1;
  o.on_progress = [&](const PplProgress& p) {
    got.emplace_back(p.windows_done, p.tokens_done);
    EXPECT_EQ(p.windows_total, 5);
    if (total < 0) total = p.tokens_total;
    EXPECT_EQ(p.tokens_total, total);
  };
  const int threads = omp_get_max_threads();
  omp_set_num_threads(1);  // windows in order, every report from the one thread
  const PplResult r = evaluate_perplexity(m, stream, o);
  omp_set_num_threads(threads);

  std::vector<std::pair<int64_t, int64_t>> want;
  int64_t done = 0, tokens = 0;
  const int64_t W = 5;
  for (int64_t w = 0; w < W; ++w) {
    const int64_t n = std::min<int64_t>(1024, 5000 - w * 1024), preds = n - 1;
    int64_t counted = 0;
    for (int64_t first = 0; first + 256 < preds; first += 256) {  // chunks that end before the last prediction
      tokens += 256;
      counted += 256;
      want.emplace_back(done, tokens);
    }
    tokens += preds - counted;
    ++done;
    if (done < W) want.emplace_back(done, tokens);
  }
  want.emplace_back(W, tokens);
  EXPECT_EQ(got, want);
  EXPECT_EQ(total, r.tokens);
  EXPECT_EQ(tokens, r.tokens);
}

TEST(PplChunks, PerplexityIsTheSameForEveryChunkSize) {
  const Tokenizer tok = Tokenizer::load_llama2c(test::tokenizer_path(), 512);
  const Model m = Model::load_llama2c(test::model_path());
  const std::vector<int32_t> stream = text_tokens(tok, 5000);
  PplOptions o;
  o.context = 1024;
  o.chunk_tokens = 0;  // automatic: a whole window for a 512-token vocabulary
  o.progress_interval_seconds = 0;
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
  const std::string zero =
      invalid_argument_of([&] { m.score_window(tokens, 0, [](int64_t, const float*, int64_t) {}); });
  EXPECT_NE(zero.find("chunk_tokens"), std::string::npos) << zero;
  PplOptions o;
  o.context = 4;
  o.chunk_tokens = -1;
  const std::string negative = invalid_argument_of([&] { evaluate_perplexity(m, tokens, o); });
  EXPECT_NE(negative.find("chunk_tokens"), std::string::npos) << negative;
  EXPECT_NE(negative.find("-1"), std::string::npos) << negative;
  o.chunk_tokens = 0;
  o.progress_interval_seconds = -0.5;
  const std::string interval = invalid_argument_of([&] { evaluate_perplexity(m, tokens, o); });
  EXPECT_NE(interval.find("progress_interval_seconds"), std::string::npos) << interval;
  // A window past the position limit is refused before any chunk, naming its last position as one forward does.
  Model limited = Model::load_llama2c(test::model_path());
  limited.set_max_position(100);
  const Tokenizer tok = Tokenizer::load_llama2c(test::tokenizer_path(), 512);
  const std::vector<int32_t> window = text_tokens(tok, 128);
  std::string whole_error;
  try {
    (void)limited.score_window(window);
  } catch (const PositionError& e) {
    whole_error = e.what();
  }
  EXPECT_NE(whole_error.find("position 127 is past the position limit 100"), std::string::npos) << whole_error;
  int chunks = 0;
  try {
    limited.score_window(window, 7, [&](int64_t, const float*, int64_t) { ++chunks; });
    FAIL() << "a window past max_position accepted";
  } catch (const PositionError& e) {
    EXPECT_EQ(std::string(e.what()), whole_error);
  }
  EXPECT_EQ(chunks, 0);
  PplOptions lo;
  lo.context = 128;
  lo.chunk_tokens = 7;
  int reports = 0;
  lo.on_progress = [&](const PplProgress&) { ++reports; };
  try {
    evaluate_perplexity(limited, text_tokens(tok, 1000), lo);
    FAIL() << "windows past max_position accepted";
  } catch (const PositionError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("windows of 128 tokens: position 127 is past the position limit 100"), std::string::npos)
        << what;
  }
  EXPECT_EQ(reports, 0);
  // An exception from the callback reaches the caller.
  EXPECT_THROW(m.score_window(tokens, 2, [](int64_t, const float*, int64_t) { throw std::runtime_error("stop"); }),
               std::runtime_error);
}

}  // namespace POSENC_UNITY_ID
