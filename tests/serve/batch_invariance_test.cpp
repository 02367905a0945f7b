// Is a sequence's logits row independent of how the forward step was formed?
// posenc serve's exactness rests on this: a completion must equal the
// in-process forward of the same request whatever else shared its steps. The
// paths a continuous-batching scheduler takes are measured against one
// single-sequence prefill of the whole sequence (LogitsMode::all):
//  (a) the same prefill again (the reference is reproducible),
//  (b) the sequence in one ragged batch with others (other prefills and decodes),
//  (c) a fork of a cached sequence cut to the common prefix (KvCache::evict),
//      then the remainder as one chunk,
//  (d) token-by-token decode, each step batched with other sequences' work,
//  (e) chunked prefill (chunks of 7), and LogitsMode::last rows.
// Every comparison is bit for bit (memcmp of the float32 rows).
#include <ostream>
#include <cstring>
#include <vector>

#include <gtest/gtest.h>

#include "eval/rng.hpp"
#include "posenc/model.hpp"
#include "test_support.hpp"

namespace POSENC_UNITY_ID {  // this file's own namespace in the tests' unity build (CMakeLists.txt)

using namespace posenc;
namespace fs = std::filesystem;

namespace {

struct Case {
  const char* name;
  fs::path path;
  LoadOptions options;
};

// gtest prints a parameter in test listings (and so in ctest's names): the model, not the struct's bytes.
void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

std::vector<Case> cases() {
  const fs::path m = posenc::test::shared_dir() / "models";
  LoadOptions q8;
  q8.quantized_matmul = QuantizedMatmul::q8_activations;
  return {{"stories260K.bin", m / "stories260K/stories260K.bin", {}},
          {"stories260K.gguf", m / "stories260K/stories260K.gguf", {}},
          {"TinyStories-656K", m / "TinyStories-656K", {}},
          {"TinyStories-656K-Q8_0 q8_activations", m / "TinyStories-656K-gguf/TinyStories-656K-Q8_0.gguf", q8}};
}

std::vector<int32_t> random_tokens(uint64_t seed, std::size_t n, int V) {
  detail::Rng rng(seed);
  std::vector<int32_t> t(n);
  for (auto& x : t) x = static_cast<int32_t>(rng.uniform(static_cast<uint64_t>(V)));
  return t;
}

/// Rows [n, V] of one fresh prefill.
std::vector<float> alone(const Model& m, std::span<const int32_t> toks) {
  KvCache cache = m.make_cache(16);
  const auto s = cache.create();
  Model::SequenceInput in{s, toks, {}};
  std::vector<float> out;
  m.forward(cache, std::span(&in, 1), Model::LogitsMode::all, out);
  return out;
}

/// Number of rows of `got` (starting at reference row `first`) that are not bit-identical to `ref`, and the
/// largest absolute difference.
struct Diff {
  int rows_differing = 0;
  double max_abs = 0;
};
Diff compare(const std::vector<float>& ref, std::size_t first, const float* got, std::size_t rows, int V) {
  Diff d;
  for (std::size_t r = 0; r < rows; ++r) {
    const float* a = ref.data() + (first + r) * static_cast<std::size_t>(V);
    const float* b = got + r * static_cast<std::size_t>(V);
    if (std::memcmp(a, b, sizeof(float) * static_cast<std::size_t>(V)) != 0) ++d.rows_differing;
    for (int v = 0; v < V; ++v) d.max_abs = std::max(d.max_abs, static_cast<double>(std::abs(a[v] - b[v])));
  }
  return d;
}

class BatchInvariance : public ::testing::TestWithParam<Case> {};

TEST_P(BatchInvariance, EveryPathGivesTheSingleSequenceRowsBitForBit) {
  const Case& c = GetParam();
  const Model m = Model::load(c.path, c.options);
  const int V = m.config().vocab_size;
  const int64_t T = std::min<int64_t>(m.trained_context(), 256);
  // The sequence under test and three neighbours of other lengths (one longer than a 64-key attention tile).
  const auto seq = random_tokens(1, static_cast<std::size_t>(T - 20), V);
  const std::vector<std::vector<int32_t>> others = {random_tokens(2, 5, V), random_tokens(3, 90, V),
                                                    random_tokens(4, 1, V)};
  const std::vector<float> ref = alone(m, seq);

  // (a)
  EXPECT_EQ(compare(ref, 0, alone(m, seq).data(), seq.size(), V).rows_differing, 0) << c.name << " (a)";
  // The comparison can fail: one changed token changes every row from there on.
  auto changed = seq;
  changed[10] = (changed[10] + 1) % V;
  EXPECT_EQ(compare(ref, 0, alone(m, changed).data(), seq.size(), V).rows_differing,
            static_cast<int>(seq.size()) - 10)
      << c.name;

  // (b) one ragged batch: neighbours before and after the sequence.
  {
    KvCache cache = m.make_cache(16);
    std::vector<Model::SequenceInput> batch;
    for (std::size_t i = 0; i < 2; ++i) batch.push_back({cache.create(), others[i], {}});
    batch.push_back({cache.create(), seq, {}});
    batch.push_back({cache.create(), others[2], {}});
    std::vector<float> out;
    m.forward(cache, batch, Model::LogitsMode::all, out);
    const std::size_t first = others[0].size() + others[1].size();
    const Diff d = compare(ref, 0, out.data() + first * V, seq.size(), V);
    EXPECT_EQ(d.rows_differing, 0) << c.name << " (b): max |diff| " << d.max_abs;
  }

  // (c) prefix from a fork: a finished sequence holding seq[0..k) + 9 other tokens is forked, cut to the
  // common prefix k, and the rest of seq runs as one chunk, batched with a neighbour's prefill.
  for (std::size_t k : {std::size_t{1}, std::size_t{16}, std::size_t{37}, seq.size() - 1}) {
    KvCache cache = m.make_cache(16);
    const auto donor = cache.create();
    std::vector<int32_t> dt(seq.begin(), seq.begin() + static_cast<std::ptrdiff_t>(k));
    for (int32_t t : random_tokens(5, 9, V)) dt.push_back(t);
    std::vector<float> out;
    Model::SequenceInput din{donor, dt, {}};
    m.forward(cache, std::span(&din, 1), Model::LogitsMode::last, out);
    const auto f = cache.fork(donor);
    cache.evict(f, static_cast<int64_t>(k), cache.next_position(f));
    ASSERT_EQ(cache.size(f), static_cast<int64_t>(k));
    // The fork's next position is one past the largest position ever appended: continue with explicit ids.
    std::vector<int64_t> pos;
    for (std::size_t i = k; i < seq.size(); ++i) pos.push_back(static_cast<int64_t>(i));
    const std::span<const int32_t> rest(seq.data() + k, seq.size() - k);
    std::vector<Model::SequenceInput> batch = {{cache.create(), others[1], {}}, {f, rest, pos}};
    m.forward(cache, batch, Model::LogitsMode::all, out);
    const Diff d = compare(ref, k, out.data() + others[1].size() * V, rest.size(), V);
    EXPECT_EQ(d.rows_differing, 0) << c.name << " (c) prefix " << k << ": max |diff| " << d.max_abs;
  }

  // (d) decode token by token, each step batched with a neighbour's decode step (LogitsMode::last).
  {
    KvCache cache = m.make_cache(16);
    const auto s = cache.create(), o = cache.create();
    std::vector<float> out;
    Diff worst;
    const auto& on = others[1];
    for (std::size_t i = 0; i < seq.size(); ++i) {
      std::vector<Model::SequenceInput> batch;
      if (i < on.size()) batch.push_back({o, std::span(on.data() + i, 1), {}});
      batch.push_back({s, std::span(seq.data() + i, 1), {}});
      m.forward(cache, batch, Model::LogitsMode::last, out);
      const Diff d = compare(ref, i, out.data() + (batch.size() - 1) * V, 1, V);
      worst.rows_differing += d.rows_differing;
      worst.max_abs = std::max(worst.max_abs, d.max_abs);
    }
    EXPECT_EQ(worst.rows_differing, 0) << c.name << " (d): max |diff| " << worst.max_abs;
  }

  // (e) chunked prefill, chunks of 7, rows of every chunk; then LogitsMode::last of the whole sequence.
  {
    KvCache cache = m.make_cache(16);
    const auto s = cache.create();
    std::vector<float> out;
    Diff worst;
    for (std::size_t i = 0; i < seq.size(); i += 7) {
      const std::size_t n = std::min<std::size_t>(7, seq.size() - i);
      Model::SequenceInput in{s, std::span(seq.data() + i, n), {}};
      m.forward(cache, std::span(&in, 1), Model::LogitsMode::all, out);
      const Diff d = compare(ref, i, out.data(), n, V);
      worst.rows_differing += d.rows_differing;
      worst.max_abs = std::max(worst.max_abs, d.max_abs);
    }
    EXPECT_EQ(worst.rows_differing, 0) << c.name << " (e) chunks: max |diff| " << worst.max_abs;
    KvCache c2 = m.make_cache(16);
    Model::SequenceInput in{c2.create(), seq, {}};
    m.forward(c2, std::span(&in, 1), Model::LogitsMode::last, out);
    const Diff d = compare(ref, seq.size() - 1, out.data(), 1, V);
    EXPECT_EQ(d.rows_differing, 0) << c.name << " (e) last: max |diff| " << d.max_abs;
  }
}

INSTANTIATE_TEST_SUITE_P(Models, BatchInvariance, ::testing::ValuesIn(cases()),
                         [](const ::testing::TestParamInfo<Case>& i) { return std::to_string(i.index); });

}  // namespace

}  // namespace POSENC_UNITY_ID
