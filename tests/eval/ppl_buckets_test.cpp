// Perplexity buckets that follow the model (issue 14, part 2): default edges
// from the trained context T, --buckets, a bootstrap interval per bucket, the
// default --context from T, the tokenizer-mismatch warning and the columns a
// non-RoPE model does not print.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "posenc/error.hpp"
#include "posenc/io.hpp"
#include "posenc/model.hpp"
#include "posenc/perplexity.hpp"
#include "posenc/tokenizer.hpp"
#include "test_support.hpp"

namespace POSENC_UNITY_ID {  // this file's own namespace in the tests' unity build (CMakeLists.txt)

using namespace posenc;
using nlohmann::json;
using Buckets = std::vector<std::pair<int64_t, int64_t>>;
namespace fs = std::filesystem;

namespace {

struct Stories {
  Model model = Model::load_llama2c(test::model_path());
  Tokenizer tok = Tokenizer::load_llama2c(test::tokenizer_path(), 512);
  std::vector<int32_t> stream = encode_stream(tok, read_file(test::text_path()).substr(0, 400000));
};

const Stories& stories() {
  static const Stories s;
  return s;
}

std::vector<int64_t> edges_of(const json& result) {
  std::vector<int64_t> e;
  for (const auto& b : result.at("buckets")) e.push_back(b.at("start").get<int64_t>());
  if (!result.at("buckets").empty()) e.push_back(result.at("buckets").back().at("end").get<int64_t>());
  return e;
}

// A copy-task text in the symbols of a `posenc train --task copy` model:
// blocks "x1 ... xn > x1 ... xn", n in [8, 64], letters from a fixed LCG.
std::string copy_text(int blocks) {
  std::string t;
  uint64_t s = 12345;
  auto next = [&] { return (s = s * 6364136223846793005ULL + 1442695040888963407ULL) >> 33; };
  for (int i = 0; i < blocks; ++i) {
    const int n = 8 + static_cast<int>(next() % 57);
    std::string x;
    for (int k = 0; k < n; ++k) x += fmt::format("{}{}", k ? " " : "", static_cast<char>('a' + next() % 26));
    t += x + " > " + x + "\n\n";
  }
  return t;
}

// Width and height of a PNG (IHDR), or {0, 0} when `p` is not one.
std::pair<uint32_t, uint32_t> png_size(const fs::path& p) {
  const std::string b = test::slurp(p);
  if (b.size() < 24 || b.compare(0, 8, "\x89PNG\r\n\x1a\n") != 0 || b.compare(12, 4, "IHDR") != 0) return {0, 0};
  auto be32 = [&](std::size_t i) {
    uint32_t v = 0;
    for (std::size_t k = 0; k < 4; ++k) v = v << 8 | static_cast<unsigned char>(b[i + k]);
    return v;
  };
  return {be32(16), be32(20)};
}

}  // namespace

TEST(PplBuckets, DefaultEdgesFollowTheTrainedContext) {
  EXPECT_EQ(position_buckets(512, 2048), (Buckets{{0, 256}, {256, 512}, {512, 1024}, {1024, 2048}}));
  EXPECT_EQ(position_buckets(64, 64), (Buckets{{0, 32}, {32, 64}}));
  EXPECT_EQ(position_buckets(64, 65), (Buckets{{0, 32}, {32, 64}, {64, 128}}));
  EXPECT_EQ(position_buckets(130, 520), (Buckets{{0, 65}, {65, 130}, {130, 260}, {260, 520}}));
  EXPECT_EQ(position_buckets(64, 20), (Buckets{{0, 32}}));  // the last bucket may extend past L
  EXPECT_EQ(position_buckets(1, 4), (Buckets{{0, 1}, {1, 2}, {2, 4}}));
  EXPECT_EQ(position_buckets(3, 7), (Buckets{{0, 1}, {1, 3}, {3, 6}, {6, 12}}));
  EXPECT_THROW(position_buckets(0, 64), InvalidArgument);
  EXPECT_THROW(position_buckets(64, 0), InvalidArgument);
}

// The same stories260K weights told they were trained at 64 score in buckets
// [0,32) [32,64) [64,128) [128,256) at L = 256 (today: one bucket [0,256));
// every prediction is in a bucket.
TEST(PplBuckets, EvaluationUsesTheModelsTrainedContext) {
  Model m = stories().model;
  m.set_trained_context(64, "test");
  PplOptions o;
  o.context = 256;
  o.max_tokens = 4000;
  const PplResult r = evaluate_perplexity(m, stories().stream, o);
  EXPECT_EQ(r.trained_context, 64);
  ASSERT_EQ(r.buckets.size(), 4u);
  const Buckets want{{0, 32}, {32, 64}, {64, 128}, {128, 256}};
  int64_t tokens = 0;
  for (std::size_t i = 0; i < want.size(); ++i) {
    EXPECT_EQ(r.buckets[i].start, want[i].first);
    EXPECT_EQ(r.buckets[i].end, want[i].second);
    EXPECT_EQ(r.buckets[i].windows, r.windows);
    tokens += r.buckets[i].tokens;
  }
  EXPECT_EQ(r.buckets[0].tokens, 32 * r.windows);
  EXPECT_EQ(tokens, r.tokens);
  // Explicit edges: [0,100) [100,200) and the rest of the window [200,256).
  o.bucket_edges = {0, 100, 200};
  const PplResult e = evaluate_perplexity(m, stories().stream, o);
  ASSERT_EQ(e.buckets.size(), 3u);
  EXPECT_EQ(e.buckets[2].start, 200);
  EXPECT_EQ(e.buckets[2].end, 256);
  EXPECT_EQ(e.buckets[0].tokens, 100 * e.windows);
  EXPECT_NEAR(e.nll, r.nll, 1e-12);
  o.bucket_edges = {0, 300, 600};  // edges past L: one bucket [0,300)
  EXPECT_EQ(evaluate_perplexity(m, stories().stream, o).buckets.size(), 1u);
  o.bucket_edges = {0, 64, 32};
  EXPECT_THROW(evaluate_perplexity(m, stories().stream, o), InvalidArgument);
}

TEST(PplBuckets, EdgesAreValidated) {
  EXPECT_EQ(parse_bucket_edges("0,64,128,1K"), (std::vector<int64_t>{0, 64, 128, 1024}));
  EXPECT_EQ(parse_bucket_edges(" 0, 64 "), (std::vector<int64_t>{0, 64}));
  const std::vector<int64_t> e{0, 64, 128};
  EXPECT_EQ(buckets_from_edges(e, 100), (Buckets{{0, 64}, {64, 128}}));
  EXPECT_EQ(buckets_from_edges(e, 300), (Buckets{{0, 64}, {64, 128}, {128, 300}}));
  EXPECT_EQ(buckets_from_edges(e, 128), (Buckets{{0, 64}, {64, 128}}));
  struct Bad {
    const char* text;
    const char* message;
  };
  for (const Bad& b : {Bad{"0,,64", "entry 2 is empty"}, Bad{",0,64", "entry 1 is empty"},
                       Bad{"0,64,", "entry 3 is empty"}, Bad{"", "entry 1 is empty"},
                       Bad{"64,128", "the first edge must be 0 (got 64)"}, Bad{"0,64,32", "edges must increase (32 follows 64)"},
                       Bad{"0,64,64", "edges must increase (64 follows 64)"}, Bad{"0", "needs at least two edges"},
                       Bad{"0,x", "'x' is not an edge"}, Bad{"0,-4", "'-4' is not an edge"},
                       Bad{"0,2000000000000", "'2000000000000' is not an edge"}}) {
    SCOPED_TRACE(b.text);
    const std::string m = test::message_of<ConfigError>([&] { parse_bucket_edges(b.text); });
    EXPECT_NE(m.find("--buckets: "), std::string::npos) << m;
    EXPECT_NE(m.find(b.message), std::string::npos) << m;
  }
  EXPECT_THROW(buckets_from_edges(std::vector<int64_t>{0}, 10), InvalidArgument);
  EXPECT_THROW(buckets_from_edges(std::vector<int64_t>{1, 2}, 10), InvalidArgument);
  EXPECT_THROW(buckets_from_edges(std::vector<int64_t>{0, 5, 5}, 10), InvalidArgument);
}

// The percentile bootstrap on windows with a known distribution: the interval
// holds the point estimate, shrinks as 1/sqrt(W), is a function of the data
// and the seed only, and covers the true mean about 95% of the time.
TEST(PplBuckets, BootstrapIntervalBehavesAsAnInterval) {
  std::mt19937_64 g(7);
  std::gamma_distribution<double> nll(2.0, 1.0);  // per-window mean NLL, true mean 2
  auto sample = [&](std::size_t W) {
    std::vector<double> sums(W);
    std::vector<int64_t> counts(W, 100);
    for (auto& s : sums) s = 100 * nll(g);
    return std::pair{sums, counts};
  };
  auto width = [](std::pair<double, double> ci) { return ci.second - ci.first; };
  const auto [s100, c100] = sample(100);
  const auto [s1600, c1600] = sample(1600);
  const auto ci100 = bootstrap_mean_interval(s100, c100, 1000, 1);
  const auto ci1600 = bootstrap_mean_interval(s1600, c1600, 1000, 1);
  auto mean = [](const std::vector<double>& s) {
    double t = 0;
    for (double v : s) t += v;
    return t / (100.0 * static_cast<double>(s.size()));
  };
  EXPECT_LT(ci100.first, mean(s100));
  EXPECT_GT(ci100.second, mean(s100));
  EXPECT_LT(ci1600.first, mean(s1600));
  EXPECT_GT(ci1600.second, mean(s1600));
  // 16 times the windows: a quarter of the width (sd of a gamma(2) mean: sqrt(2/W)).
  EXPECT_NEAR(width(ci100) / width(ci1600), 4.0, 1.0);
  EXPECT_NEAR(width(ci100), 2 * 1.96 * std::sqrt(2.0 / 100), 0.25 * 2 * 1.96 * std::sqrt(2.0 / 100));
  EXPECT_EQ(bootstrap_mean_interval(s100, c100, 1000, 1), ci100);
  EXPECT_NE(bootstrap_mean_interval(s100, c100, 1000, 2), ci100);
  int covered = 0;
  const int trials = 300;
  for (int t = 0; t < trials; ++t) {
    const auto [s, c] = sample(60);
    const auto ci = bootstrap_mean_interval(s, c, 400, static_cast<uint64_t>(t));
    covered += ci.first <= 2.0 && 2.0 <= ci.second ? 1 : 0;
  }
  EXPECT_GE(covered, static_cast<int>(0.88 * trials)) << covered;
  EXPECT_LE(covered, static_cast<int>(0.99 * trials)) << covered;
  // Degenerate inputs.
  const std::vector<double> one{5.0, 0.0};
  const std::vector<int64_t> onec{2, 0};
  EXPECT_EQ(bootstrap_mean_interval(one, onec, 100, 1), (std::pair<double, double>{2.5, 2.5}));
  EXPECT_EQ(bootstrap_mean_interval(std::vector<double>{}, std::vector<int64_t>{}, 100, 1),
            (std::pair<double, double>{0.0, 0.0}));
  EXPECT_THROW(bootstrap_mean_interval(one, std::vector<int64_t>{1}, 100, 1), InvalidArgument);
  EXPECT_THROW(bootstrap_mean_interval(one, onec, 0, 1), InvalidArgument);
}

// On stories260K: each bucket's interval holds its NLL, is narrower with 8x the
// windows, and does not depend on the thread count.
TEST(PplBuckets, ModelIntervalsHoldTheEstimateShrinkAndAreDeterministic) {
  PplOptions o;
  o.context = 512;
  o.max_tokens = 20000;
  const PplResult small = evaluate_perplexity(stories().model, stories().stream, o);
  o.max_tokens = 160000;
  const PplResult large = evaluate_perplexity(stories().model, stories().stream, o);
  o.max_tokens = 40000;
  const int threads = omp_get_max_threads();
  omp_set_num_threads(1);
  const PplResult one = evaluate_perplexity(stories().model, stories().stream, o);
  omp_set_num_threads(std::max(2, threads));
  const PplResult two = evaluate_perplexity(stories().model, stories().stream, o);
  omp_set_num_threads(threads);
  ASSERT_EQ(small.buckets.size(), 2u);
  ASSERT_EQ(large.buckets.size(), 2u);
  EXPECT_EQ(small.windows, 40);
  EXPECT_EQ(large.windows, 314);
  for (std::size_t b = 0; b < 2; ++b) {
    for (const PplResult* r : {&small, &large}) {
      const PplBucket& k = r->buckets[b];
      EXPECT_LT(k.nll_ci_low, k.nll());
      EXPECT_GT(k.nll_ci_high, k.nll());
      EXPECT_EQ(k.windows, r->windows);
    }
    const double ws = small.buckets[b].nll_ci_high - small.buckets[b].nll_ci_low;
    const double wl = large.buckets[b].nll_ci_high - large.buckets[b].nll_ci_low;
    EXPECT_LT(wl, 0.7 * ws) << ws << " " << wl;  // ~ sqrt(40/314) = 0.36 for windows alike
    EXPECT_EQ(one.buckets[b].nll_ci_low, two.buckets[b].nll_ci_low);
    EXPECT_EQ(one.buckets[b].nll_ci_high, two.buckets[b].nll_ci_high);
    EXPECT_NE(one.buckets[b].nll_ci_low, large.buckets[b].nll_ci_low);  // another set of windows
  }
  const json j = ppl_result_json(large);
  EXPECT_EQ(j.at("trained_context"), 512);
  for (const char* k : {"start", "end", "tokens", "nll", "ppl", "nll_ci_low", "nll_ci_high", "windows"})
    EXPECT_TRUE(j.at("buckets").at(0).contains(k)) << k;
  EXPECT_DOUBLE_EQ(j["buckets"][1]["nll_ci_high"].get<double>(), large.buckets[1].nll_ci_high);
}

// One window holding a bucket's predictions: a bootstrap over it always draws that window, so its interval had zero
// width by construction and was reported as "±0.0000". The JSON now gives no interval (null) and says why; buckets
// of two or more windows keep theirs. On 700 tokens: L = 700 is one window; L = 600 is two, the second of 100
// tokens, so the first bucket holds both and the later buckets one; L = 87 gives every bucket eight or more.
TEST(PplBuckets, ABucketOfOneWindowHasNoIntervalAndSaysWhy) {
  const std::vector<int32_t> stream(stories().stream.begin(), stories().stream.begin() + 700);
  const auto T = static_cast<int64_t>(stream.size());
  PplOptions o;
  o.fine_bins_per_bucket = 2;
  for (const int64_t L : {T, T - 100, T / 8}) {
    o.context = L;
    const PplResult r = evaluate_perplexity(stories().model, stream, o);
    const json j = ppl_result_json(r);
    int single = 0, several = 0;
    for (const char* key : {"buckets", "fine_buckets"})
      for (std::size_t b = 0; b < j.at(key).size(); ++b) {
        const json& e = j.at(key).at(b);
        const PplBucket& k = (std::string(key) == "buckets" ? r.buckets : r.fine_buckets).at(b);
        ASSERT_EQ(e.at("windows").get<int64_t>(), k.windows);
        if (k.windows < 2) {
          ++single;
          EXPECT_FALSE(k.has_interval());
          EXPECT_TRUE(e.at("nll_ci_low").is_null()) << L << " " << e;
          EXPECT_TRUE(e.at("nll_ci_high").is_null()) << L << " " << e;
          EXPECT_EQ(e.at("nll_ci_note"), "one window holds all of this bucket's predictions: no interval can be "
                                         "estimated from a single window (a longer text or a shorter context "
                                         "gives more windows)");
          EXPECT_DOUBLE_EQ(e.at("nll").get<double>(), k.nll());  // the estimate itself stays
        } else {
          ++several;
          EXPECT_TRUE(k.has_interval());
          EXPECT_FALSE(e.contains("nll_ci_note")) << e;
          EXPECT_LT(e.at("nll_ci_low").get<double>(), e.at("nll_ci_high").get<double>()) << L << " " << e;
        }
      }
    if (L == T) {
      EXPECT_EQ(several, 0);  // one window in all
    }
    if (L == T / 8) {
      EXPECT_EQ(single, 0);  // eight or nine windows in every bucket
    }
    if (L == T - 100) {  // two windows; the second (100 tokens) reaches the first bucket only
      ASSERT_GE(r.buckets.size(), 2u);
      EXPECT_LE(100, r.buckets[1].start);
      EXPECT_EQ(r.buckets.front().windows, 2);
      EXPECT_EQ(r.buckets.back().windows, 1);
      EXPECT_GT(single, 0);
      EXPECT_GT(several, 0);
    }
  }
}

// The ppl table says so too, instead of "±0.0000": a context equal to the text's tokens gives one window.
TEST(PplBuckets, CliSaysNoIntervalForOneWindow) {
  test::TempDir d;
  const std::string text = read_file(test::text_path()).substr(0, 600);
  const fs::path txt = d.file("short.txt", text);
  const auto tokens = static_cast<int64_t>(encode_stream(stories().tok, text).size());
  const auto r = test::run_cli(fmt::format("ppl --model {} --tokenizer {} --text {} --context {},{} --rope-scaling "
                                           "default --quiet",
                                           test::model_path().string(), test::tokenizer_path().string(), txt.string(),
                                           tokens / 8, tokens));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.out.find("\u00b10.0000"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find(" (1 win)"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("(1 win): one window holds all of the bucket's predictions: no interval can be estimated from "
                       "a single window"),
            std::string::npos)
      << r.out;
  // The row of L = tokens / 8 (several windows) keeps its intervals.
  const auto row = r.out.find(fmt::format("\n{:>8} default", tokens / 8));
  ASSERT_NE(row, std::string::npos) << r.out;
  const std::string line = r.out.substr(row + 1, r.out.find('\n', row + 1) - row - 1);
  EXPECT_NE(line.find("\u00b1"), std::string::npos) << line;
  EXPECT_EQ(line.find("(1 win)"), std::string::npos) << line;
}

// stories260K fed another tokenizer's ids (TinyStories-656K's BPE, ids taken
// modulo the 512-piece vocabulary so they are valid) scores far above
// log(512); its own tokenizer far below.
TEST(PplBuckets, ForeignTokenizerIsFlagged) {
  const Tokenizer foreign =
      Tokenizer::load_tokenizer_json(test::shared_dir() / "models/TinyStories-656K/tokenizer.json");
  std::vector<int32_t> ids = encode_stream(foreign, read_file(test::text_path()).substr(0, 40000));
  for (auto& id : ids) id %= 512;
  PplOptions o;
  o.context = 256;
  const PplResult bad = evaluate_perplexity(stories().model, ids, o);
  o.max_tokens = static_cast<int64_t>(ids.size());
  const PplResult good = evaluate_perplexity(stories().model, stories().stream, o);
  const double uniform = std::log(512.0);
  const auto bad_nll = in_range_nll(std::span(&bad, 1));
  const auto good_nll = in_range_nll(std::span(&good, 1));
  ASSERT_TRUE(bad_nll && good_nll);
  EXPECT_GT(*bad_nll, uniform + kTokenizerMismatchMarginNats);
  EXPECT_LT(*good_nll, uniform - 3);
  const auto w = tokenizer_mismatch_warning(*bad_nll, 512, foreign, "656K/tokenizer.json");
  ASSERT_TRUE(w.has_value());
  EXPECT_NE(w->find(fmt::format("mean NLL {:.3f} nats/token", *bad_nll)), std::string::npos) << *w;
  EXPECT_NE(w->find("above log(512) = 6.238"), std::string::npos) << *w;
  EXPECT_NE(w->find("the tokenizer 656K/tokenizer.json"), std::string::npos) << *w;
  EXPECT_NE(w->find("2048 pieces for a model of 512"), std::string::npos) << *w;
  EXPECT_FALSE(tokenizer_mismatch_warning(*good_nll, 512, stories().tok, "tok512.bin").has_value());
  // Just at the threshold: no warning; just past it: a warning.
  EXPECT_FALSE(tokenizer_mismatch_warning(uniform + 0.99, 512, foreign, "x").has_value());
  EXPECT_TRUE(tokenizer_mismatch_warning(uniform + 1.01, 512, foreign, "x").has_value());
  // Windows entirely past the trained context do not judge the tokenizer.
  PplResult past = bad;
  past.trained_context = 16;
  past.buckets = {{.start = 0, .end = 256, .nll_sum = 1e4, .tokens = 100}};
  EXPECT_FALSE(in_range_nll(std::span(&past, 1)).has_value());
  // Nor do windows of a few tokens (TinyStories-656K's own tokenizer scored 8.84 nats at L = 2, above
  // log(2048) + 1, and was flagged as foreign): the same bad result cut to L = 8 is not judged, at L = 16 it is.
  PplResult tiny = bad;
  tiny.context = 8;
  EXPECT_FALSE(in_range_nll(std::span(&tiny, 1)).has_value());
  tiny.context = kTokenizerCheckMinContext;
  EXPECT_TRUE(in_range_nll(std::span(&tiny, 1)).has_value());
}

// The CLI: TinyStories-656K with a tokenizer.json whose ids are rotated (same
// pieces, other ids: another model's tokenizer of the same size) warns, its
// own tokenizer does not.
TEST(PplBuckets, CliWarnsOfAForeignTokenizer) {
  test::TempDir d;
  const fs::path model = test::shared_dir() / "models/TinyStories-656K";
  json tj = json::parse(read_file(model / "tokenizer.json"));
  for (auto& [piece, id] : tj["model"]["vocab"].items())
    if (id.get<int>() >= 3) id = 3 + (id.get<int>() - 3 + 1000) % 2045;
  const fs::path rotated = d.file("rotated.json", tj.dump());
  const fs::path text = d.file("text.txt", read_file(test::text_path()).substr(0, 12000));
  const std::string common = fmt::format("ppl --model {} --text {} --context 256 --rope-scaling default --quiet ",
                                         model.string(), text.string());
  const auto bad = test::run_cli(common + "--tokenizer " + rotated.string());
  ASSERT_EQ(bad.exit_code, 0) << bad.err;
  EXPECT_NE(bad.err.find("ppl: warning: mean NLL "), std::string::npos) << bad.err;
  EXPECT_NE(bad.err.find("above log(2048) = 7.625"), std::string::npos) << bad.err;
  EXPECT_NE(bad.err.find("the tokenizer " + rotated.string() + " (tokenizer.json BPE"), std::string::npos) << bad.err;
  EXPECT_NE(bad.err.find("likely does not belong to this model"), std::string::npos) << bad.err;
  const auto good = test::run_cli(common + "--json " + (d.path() / "good.json").string());
  ASSERT_EQ(good.exit_code, 0) << good.err;
  EXPECT_EQ(good.err.find("warning"), std::string::npos) << good.err;
  EXPECT_TRUE(json::parse(read_file(d.path() / "good.json")).at("tokenizer_mismatch").is_null());
}

// The ppl CLI and a context longer than the text (it would score the whole text as one shorter window and report
// it under the longer context, with a zero-width interval): a --context given so is refused before any context's
// work; default contexts (multiples of the trained context) longer than the text are left out, said on stderr.
TEST(PplBuckets, CliRefusesAContextLongerThanTheText) {
  test::TempDir d;
  const fs::path model = test::shared_dir() / "models/TinyStories-656K";  // trained context 512
  const fs::path txt = d.file("text.txt", read_file(test::text_path()).substr(0, 3000));  // 696 tokens
  const auto r = test::run_cli(fmt::format("ppl --model {} --text {} --context 256,2048 --json {}", model.string(),
                                           txt.string(), (d.path() / "o.json").string()));
  EXPECT_EQ(r.exit_code, 1) << r.err;
  EXPECT_NE(r.err.find("--context 2048: the text has only 696 tokens"), std::string::npos) << r.err;
  EXPECT_EQ(r.err.find("ppl L=256"), std::string::npos) << r.err;  // refused before the 256-token windows ran
  EXPECT_FALSE(fs::exists(d.path() / "o.json"));

  const auto dflt = test::run_cli(fmt::format("ppl --model {} --text {} --rope-scaling default --quiet --json {}",
                                              model.string(), txt.string(), (d.path() / "d.json").string()));
  ASSERT_EQ(dflt.exit_code, 0) << dflt.err;
  EXPECT_NE(dflt.err.find("ppl: note: default contexts 1024, 2048 left out: the text has only 696 tokens"),
            std::string::npos)
      << dflt.err;
  std::vector<int64_t> contexts;
  const json out = json::parse(read_file(d.path() / "d.json"));
  for (const auto& row : out.at("results")) contexts.push_back(row.at("context"));
  EXPECT_EQ(contexts, (std::vector<int64_t>{256, 512}));
}

// eval's perplexity matrix and a text shorter than a length: with no haystack task (whose own check refuses a short
// text) it scored the whole text as one window under the longer length. Now as `posenc ppl`: a length asked for is
// refused before anything is written, naming the length and the text's token count; default lengths longer than the
// text are left out of the matrix (their task cells still run), said on stderr and in run.json.
TEST(PplBuckets, EvalRefusesALengthLongerThanItsPerplexityText) {
  test::TempDir d;
  const std::string text = read_file(test::text_path()).substr(0, 600);
  const fs::path txt = d.file("short.txt", text);
  const auto tokens = static_cast<int64_t>(encode_stream(stories().tok, text).size());
  const std::string base = fmt::format("eval --model {} --tokenizer {} --haystack {} --tasks kv_retrieval --depths 0.5 "
                                       "--samples 1 --quiet ",
                                       test::model_path().string(), test::tokenizer_path().string(), txt.string());
  // One token past the text: refused, nothing written.
  const auto bad = test::run_cli(base + fmt::format("--context 64,{} --out {}", tokens + 1, (d.path() / "bad").string()));
  EXPECT_EQ(bad.exit_code, 1) << bad.err;
  EXPECT_NE(bad.err.find(fmt::format("--context {}: the perplexity matrix's text ({}) has only {} tokens", tokens + 1,
                                     txt.string(), tokens)),
            std::string::npos)
      << bad.err;
  EXPECT_FALSE(fs::exists(d.path() / "bad" / "LATEST"));
  // Exactly the text: one full window.
  const auto fits = test::run_cli(base + fmt::format("--context {} --out {}", tokens, (d.path() / "fits").string()));
  ASSERT_EQ(fits.exit_code, 0) << fits.err;

  // Default lengths (T/2 .. 8T of --trained-context 64): those past the text are left out of the matrix only.
  const auto dflt = test::run_cli(base + fmt::format("--trained-context 64 --out {}", (d.path() / "dflt").string()));
  ASSERT_EQ(dflt.exit_code, 0) << dflt.err;
  std::string id = read_file(d.path() / "dflt" / "LATEST");
  while (!id.empty() && id.back() == '\n') id.pop_back();
  const fs::path run = d.path() / "dflt" / id;
  const json cfg = json::parse(read_file(run / "run.json")).at("config");
  const auto lengths = cfg.at("lengths").get<std::vector<int64_t>>();
  std::vector<int64_t> kept, dropped;
  for (int64_t L : lengths) (L <= tokens ? kept : dropped).push_back(L);
  ASSERT_FALSE(kept.empty());
  ASSERT_FALSE(dropped.empty());  // the text is shorter than the longest default length: the case under test
  EXPECT_EQ(cfg.at("ppl_lengths").get<std::vector<int64_t>>(), kept);
  const std::string note = fmt::format("default length{} {} left out of the perplexity matrix: the text has only {} tokens",
                                       dropped.size() > 1 ? "s" : "", fmt::join(dropped, ", "), tokens);
  EXPECT_NE(dflt.err.find("eval: note: " + note), std::string::npos) << dflt.err;
  EXPECT_EQ(cfg.at("ppl_note"), note);
  std::vector<int64_t> scored;
  const json ppl = json::parse(read_file(run / "ppl.json"));
  for (const auto& r : ppl.at("results")) {
    scored.push_back(r.at("context"));
    // The whole text in windows of that context: every window of >= 2 tokens loses its first token's prediction.
    const int64_t L = r.at("context"), windows = r.at("windows");
    EXPECT_EQ(windows, tokens % L == 1 ? tokens / L : (tokens + L - 1) / L) << L;
    EXPECT_EQ(r.at("tokens").get<int64_t>(), tokens - windows - (tokens % L == 1 ? 1 : 0)) << L;
  }
  EXPECT_EQ(scored, kept);
  EXPECT_EQ(json::parse(read_file(run / "summary.json")).at("cells").size(), lengths.size());  // tasks at every length
  const auto report = test::run_cli(fmt::format("eval report {} --no-plots", run.string()));
  EXPECT_EQ(report.exit_code, 0) << report.err;  // run.json's ppl_lengths read back
}

// eval runs the same check on its perplexity matrix: a run whose tokenizer is
// not the model's warns (every task score of that run means nothing).
TEST(PplBuckets, EvalWarnsOfAForeignTokenizer) {
  test::TempDir d;
  const fs::path model = test::shared_dir() / "models/TinyStories-656K";
  json tj = json::parse(read_file(model / "tokenizer.json"));
  for (auto& [piece, id] : tj["model"]["vocab"].items())
    if (id.get<int>() >= 3) id = 3 + (id.get<int>() - 3 + 1000) % 2045;
  const fs::path rotated = d.file("rotated.json", tj.dump());
  const fs::path text = d.file("text.txt", read_file(test::text_path()).substr(0, 12000));
  const std::string common = fmt::format(
      "eval --model {} --haystack {} --tasks name_recall --context 256 --depths 0.5 --samples 2 --ppl-tokens 2048 "
      "--quiet ",
      model.string(), text.string());
  const auto bad = test::run_cli(common + "--tokenizer " + rotated.string() + " --out " + (d.path() / "bad").string());
  ASSERT_EQ(bad.exit_code, 0) << bad.err;
  EXPECT_NE(bad.err.find("eval: warning: mean NLL "), std::string::npos) << bad.err;
  EXPECT_NE(bad.err.find("likely does not belong to this model"), std::string::npos) << bad.err;
  const auto good = test::run_cli(common + "--out " + (d.path() / "good").string());
  ASSERT_EQ(good.exit_code, 0) << good.err;
  EXPECT_EQ(good.err.find("does not belong"), std::string::npos) << good.err;
}

#if POSENC_WITH_TRAIN  // trains a model or runs `posenc train`/`study` (not in a -DPOSENC_WITH_TRAIN=OFF build)
// A `posenc train` model trained on copy at input lengths 8..64 reads 130
// positions (<bos> + 64 + '>' + 64 answer tokens): with all defaults `ppl`
// scores L = 65, 130, 260, 520 in buckets 0,65,130,260,520 and prints the RoPE
// columns; --trained-context 64 gives 0,32,64,128,256; --buckets overrides;
// bad edges exit 2; an ALiBi model's table has no RoPE columns.
TEST(PplBuckets, CliDefaultsFollowATrainedModel) {
  test::TempDir d;
  const fs::path pt = d.path() / "copy64.pt";
  const auto t = test::run_cli("train --task copy --pe rope --steps 20 --batch-size 8 --dim 32 --heads 4 "
                               "--train-lengths 8:64 --eval-samples 0 --seed 1 --out " + pt.string());
  ASSERT_EQ(t.exit_code, 0) << t.err;
  ASSERT_EQ(Model::load(pt).trained_context(), 130);
  const fs::path text = d.file("copy.txt", copy_text(300));
  const fs::path js = d.path() / "ppl.json";
  const fs::path png = d.path() / "ppl.png";
  auto r = test::run_cli(
      fmt::format("ppl --model {} --text {} --json {} --plot {}", pt.string(), text.string(), js.string(), png.string()));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  // Four window lengths side by side over two rows (NLL, difference to default).
  const auto [pw, ph] = png_size(png);
  EXPECT_GT(pw, 1500u) << r.err;
  EXPECT_GT(ph, 500u);
  EXPECT_LT(ph, pw);
  json j = json::parse(read_file(js));
  EXPECT_EQ(j.at("trained_context"), 130);
  std::vector<int64_t> contexts;
  for (const auto& x : j.at("results"))
    if (x.at("rope_scaling") == "default") contexts.push_back(x.at("context").get<int64_t>());
  EXPECT_EQ(contexts, (std::vector<int64_t>{65, 130, 260, 520}));
  const json& last = j["results"].back();
  EXPECT_EQ(last.at("context"), 520);
  EXPECT_EQ(edges_of(last), (std::vector<int64_t>{0, 65, 130, 260, 520}));
  ASSERT_EQ(last.at("fine_buckets").size(), 16u);  // 4 bins per bucket
  EXPECT_EQ(last["fine_buckets"][0].at("start"), 0);
  EXPECT_EQ(last["fine_buckets"][15].at("end"), 520);
  int64_t fine_tokens = 0;
  for (const auto& b : last["fine_buckets"]) fine_tokens += b.at("tokens").get<int64_t>();
  EXPECT_EQ(fine_tokens, last.at("tokens").get<int64_t>());
  for (const auto& b : last.at("buckets")) {
    EXPECT_LE(b.at("nll_ci_low").get<double>(), b.at("nll").get<double>());
    EXPECT_GE(b.at("nll_ci_high").get<double>(), b.at("nll").get<double>());
  }
  EXPECT_NE(r.out.find(" context rope_scaling   factor"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("[260,520)"), std::string::npos) << r.out;
  EXPECT_EQ(r.err.find("ppl: warning"), std::string::npos) << r.err;  // its own symbols: no mismatch check
  // The default contexts reach 4T: the one position warning (issue 16 finding 4) past the trained context 130.
  EXPECT_NE(r.err.find("posenc: warning: the sequence passes the trained context (130 tokens"), std::string::npos)
      << r.err;

  r = test::run_cli(fmt::format("ppl --model {} --text {} --trained-context 64 --rope-scaling default --json {}",
                                pt.string(), text.string(), js.string()));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  j = json::parse(read_file(js));
  ASSERT_EQ(j.at("results").size(), 4u);
  EXPECT_EQ(j["results"][3].at("context"), 256);
  EXPECT_EQ(edges_of(j["results"][3]), (std::vector<int64_t>{0, 32, 64, 128, 256}));

  r = test::run_cli(fmt::format("ppl --model {} --text {} --context 200 --buckets 0,50,100 --rope-scaling default "
                                "--json {}",
                                pt.string(), text.string(), js.string()));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  j = json::parse(read_file(js));
  EXPECT_EQ(edges_of(j["results"][0]), (std::vector<int64_t>{0, 50, 100, 200}));
  EXPECT_EQ(j.at("buckets"), "--buckets");
  for (const char* bad : {"0,,64", "10,64", "0,64,32", "0,x", "0"}) {
    r = test::run_cli(fmt::format("ppl --model {} --text {} --buckets '{}'", pt.string(), text.string(), bad));
    EXPECT_EQ(r.exit_code, 2) << bad << ": " << r.err;
    EXPECT_NE(r.err.find("--buckets: "), std::string::npos) << r.err;
  }

  const fs::path alibi = d.path() / "alibi.pt";
  const auto ta = test::run_cli("train --task copy --pe alibi --steps 5 --batch-size 4 --dim 32 --heads 4 "
                                "--train-lengths 4:8 --eval-samples 0 --out " + alibi.string());
  ASSERT_EQ(ta.exit_code, 0) << ta.err;
  r = test::run_cli(fmt::format("ppl --model {} --text {}", alibi.string(), text.string()));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find(" context       ppl      nll    tokens"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("rope_scaling"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("factor"), std::string::npos) << r.out;
}
#endif

}  // namespace POSENC_UNITY_ID
