// The synthetic tasks: determinism by seed, formats, and answers that are right.
#include <algorithm>
#include <set>

#include <gtest/gtest.h>

#include "posenc/error.hpp"
#include "posenc/tokenizer.hpp"
#include "posenc/synthetic_tasks.hpp"

namespace POSENC_UNITY_ID {  // this file's own namespace in the tests' unity build (CMakeLists.txt)

using namespace posenc;

namespace {

const TrainTaskKind kAll[] = {TrainTaskKind::copy, TrainTaskKind::reverse, TrainTaskKind::addition, TrainTaskKind::sort,
                         TrainTaskKind::associative_recall};

std::vector<TrainSample> draw(const Task& t, uint64_t seed, int n, int count) {
  SampleRng rng(seed);
  std::vector<TrainSample> out;
  for (int i = 0; i < count; ++i) out.push_back(t.sample(rng, n));
  return out;
}

bool same(const std::vector<TrainSample>& a, const std::vector<TrainSample>& b) {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i)
    if (a[i].prompt != b[i].prompt || a[i].answer != b[i].answer) return false;
  return true;
}

}  // namespace

TEST(TrainTasks, SplitMixIsTheReferenceSequence) {
  // SplitMix64 with seed 0: first outputs from Vigna's reference splitmix64.c.
  SampleRng r(0);
  EXPECT_EQ(r.next(), 0xE220A8397B1DCDAFull);
  EXPECT_EQ(r.next(), 0x6E789E6AA1B965F4ull);
  EXPECT_EQ(r.next(), 0x06C45D188009454Full);
  SampleRng u(7);
  std::vector<int> counts(5, 0);
  for (int i = 0; i < 5000; ++i) ++counts[static_cast<std::size_t>(u.below(5))];
  for (int c : counts) EXPECT_NEAR(c, 1000, 150);
  EXPECT_THROW(u.below(0), InvalidArgument);
  EXPECT_NE(derive_seed(1, "train/copy"), derive_seed(2, "train/copy"));
  EXPECT_NE(derive_seed(1, "train/copy"), derive_seed(1, "eval/copy"));
  EXPECT_NE(derive_seed(1, "eval/copy", 8), derive_seed(1, "eval/copy", 16));
}

TEST(TrainTasks, GeneratorsAreDeterministicBySeed) {
  for (TrainTaskKind k : kAll) {
    const Task t(k);
    const int n = t.round_length(20);
    EXPECT_TRUE(same(draw(t, 5, n, 50), draw(t, 5, n, 50))) << t.name();
    EXPECT_FALSE(same(draw(t, 5, n, 50), draw(t, 6, n, 50))) << t.name();
  }
}

TEST(TrainTasks, SamplesHaveTheRequestedLengthAndFormat) {
  for (TrainTaskKind k : kAll) {
    const Task t(k);
    const Tokenizer tok = Tokenizer::from_symbols(t.symbols());  // a valid symbol vocabulary
    for (int n : t.lengths_in(1, 64)) {
      for (const auto& s : draw(t, 11, n, 5)) {
        ASSERT_EQ(s.input_length, n);
        const int sep = k == TrainTaskKind::associative_recall ? 0 : 1;
        ASSERT_EQ(static_cast<int>(s.prompt.size()), n + 1 + sep) << t.name();
        EXPECT_EQ(s.prompt.front(), Tokenizer::kBos);
        EXPECT_EQ(s.answer.back(), Tokenizer::kEos);
        EXPECT_EQ(static_cast<int>(s.answer.size()), t.answer_length(n));
        EXPECT_EQ(t.positions_needed(n), static_cast<int64_t>(s.prompt.size() + s.answer.size()) - 1);
        for (int32_t id : s.prompt) EXPECT_TRUE(id > 0 && id < t.vocab_size());
        // The symbol text round-trips through the runtime's tokenizer.
        EXPECT_EQ(tok.encode(t.text(std::span(s.prompt).subspan(1)), true, false), s.prompt);
      }
    }
  }
  EXPECT_THROW(Task(TrainTaskKind::associative_recall).sample(*std::make_unique<SampleRng>(1), 9), InvalidArgument);
  EXPECT_EQ(Task(TrainTaskKind::associative_recall).round_length(9), 8);
  EXPECT_EQ(Task(TrainTaskKind::addition).round_length(2), 0);
}

TEST(TrainTasks, AnswersAreCorrect) {
  const Task copy(TrainTaskKind::copy), rev(TrainTaskKind::reverse), sort(TrainTaskKind::sort);
  for (const auto& s : draw(copy, 3, 12, 20))
    EXPECT_TRUE(std::equal(s.answer.begin(), s.answer.end() - 1, s.prompt.begin() + 1));
  for (const auto& s : draw(rev, 3, 12, 20))
    EXPECT_TRUE(std::equal(s.answer.begin(), s.answer.end() - 1, s.prompt.rbegin() + 1));
  for (const auto& s : draw(sort, 3, 12, 20)) {
    std::vector<int32_t> in(s.prompt.begin() + 1, s.prompt.end() - 1);
    std::sort(in.begin(), in.end());
    EXPECT_TRUE(std::equal(in.begin(), in.end(), s.answer.begin()));
  }
  // Addition: digits least-significant first; check with integers.
  const Task add(TrainTaskKind::addition);
  for (int n : {3, 4, 9, 18}) {
    for (const auto& s : draw(add, 4, n, 30)) {
      const std::string text = add.text(s.prompt);  // "<bos> d d + d d ="
      const auto plus = text.find('+');
      auto value = [&](const std::string& part) {  // reversed digits -> integer
        uint64_t v = 0, mul = 1;
        for (char c : part)
          if (c >= '0' && c <= '9') {
            v += static_cast<uint64_t>(c - '0') * mul;
            mul *= 10;
          }
        return v;
      };
      const uint64_t a = value(text.substr(0, plus)), b = value(text.substr(plus));
      const uint64_t sum = value(add.text(s.answer));
      EXPECT_EQ(sum, a + b) << text << " -> " << add.text(s.answer);
    }
  }
  // Associative recall: distinct keys, the answer is the value after the queried key.
  const Task ar(TrainTaskKind::associative_recall);
  for (const auto& s : draw(ar, 9, 40, 30)) {
    const int m = (40 - 2) / 2;
    std::set<int32_t> keys;
    for (int i = 0; i < m; ++i) keys.insert(s.prompt[static_cast<std::size_t>(1 + 2 * i)]);
    EXPECT_EQ(static_cast<int>(keys.size()), m);
    const int32_t q = s.prompt.back();  // the query key ends the prompt
    EXPECT_EQ(ar.text(std::span(&s.prompt[s.prompt.size() - 2], 1)), "?");
    int found = 0;
    for (int i = 0; i < m; ++i)
      if (s.prompt[static_cast<std::size_t>(1 + 2 * i)] == q) {
        EXPECT_EQ(s.answer[0], s.prompt[static_cast<std::size_t>(2 + 2 * i)]);
        ++found;
      }
    EXPECT_EQ(found, 1);
  }
}

TEST(TrainTasks, NamesAndRangesParseWithFieldNamingErrors) {
  EXPECT_EQ(parse_task_kind("associative_recall"), TrainTaskKind::associative_recall);
  EXPECT_EQ(parse_train_encoding("rope25"), TrainEncoding::rope25);
  EXPECT_EQ(family_of(TrainEncoding::t5), PositionFamily::t5_bias);
  try {
    parse_train_encoding("xpos");
    FAIL();
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("--pe: unknown positional encoding 'xpos'"), std::string::npos);
  }
  EXPECT_THROW(parse_task_kind("parity"), ConfigError);
  EXPECT_EQ(parse_length_range("8:32", "--train-lengths"), (LengthRange{8, 32, 8}));
  EXPECT_EQ(parse_length_range("8:128:16", "--test-lengths"), (LengthRange{8, 128, 16}));
  EXPECT_THROW(parse_length_range("32:8", "--train-lengths"), ConfigError);
  EXPECT_THROW(parse_length_range("8-32", "--train-lengths"), ConfigError);
  EXPECT_THROW(parse_length_range("0:4", "--train-lengths"), ConfigError);
}

TEST(TrainTasks, MultiQueryTrainingSequencesExtendTheEvaluationSample) {
  const Task ar(TrainTaskKind::associative_recall);
  for (int n : {4, 8, 20, 32}) {
    SampleRng a(21), b(21);
    const TrainSample s = ar.sample(a, n);
    const TrainingSequence t = ar.training_sequence(b, n, 4);
    const int m = (n - 2) / 2;
    const int extra = std::min(3, m - 1);
    ASSERT_EQ(static_cast<int64_t>(t.tokens.size()) - 1, ar.training_positions(n, 4));
    ASSERT_EQ(t.tokens.size(), s.prompt.size() + s.answer.size() + 4 * static_cast<std::size_t>(extra));
    // The prefix is the single-query sample; only answers are targets.
    EXPECT_TRUE(std::equal(s.prompt.begin(), s.prompt.end(), t.tokens.begin()));
    for (std::size_t i = 0; i < s.prompt.size(); ++i) EXPECT_EQ(t.is_answer[i], 0);
    std::set<int32_t> queried{s.prompt.back()};
    for (int q = 0; q < extra; ++q) {
      const std::size_t o = s.prompt.size() + s.answer.size() + 4 * static_cast<std::size_t>(q);
      EXPECT_EQ(ar.text(std::span(&t.tokens[o], 1)), "?");
      const int32_t key = t.tokens[o + 1];
      EXPECT_TRUE(queried.insert(key).second) << "keys queried once";
      for (int i = 0; i < m; ++i) {
        if (s.prompt[static_cast<std::size_t>(1 + 2 * i)] == key) {
          EXPECT_EQ(t.tokens[o + 2], s.prompt[static_cast<std::size_t>(2 + 2 * i)]);
        }
      }
      EXPECT_EQ(t.tokens[o + 3], Tokenizer::kEos);
      EXPECT_EQ(std::vector<uint8_t>(t.is_answer.begin() + static_cast<std::ptrdiff_t>(o), t.is_answer.begin() + static_cast<std::ptrdiff_t>(o + 4)),
                (std::vector<uint8_t>{0, 0, 1, 1}));
    }
  }
  // Other tasks: the sample itself.
  const Task copy(TrainTaskKind::copy);
  SampleRng r(3);
  const TrainingSequence c = copy.training_sequence(r, 10, 4);
  EXPECT_EQ(static_cast<int64_t>(c.tokens.size()) - 1, copy.positions_needed(10));
  EXPECT_EQ(std::count(c.is_answer.begin(), c.is_answer.end(), 1), 11);
}

TEST(TrainTasks, RecallPromptIsTheSampleFormatAndChecksItsInput) {
  const Task ar(TrainTaskKind::associative_recall);
  const auto rv = ar.recall_vocabulary();
  EXPECT_EQ(rv.keys, 128);
  EXPECT_EQ(rv.values, 10);
  EXPECT_EQ(ar.symbols()[static_cast<std::size_t>(rv.first_key + 5)], "k5");
  EXPECT_EQ(ar.symbols()[static_cast<std::size_t>(rv.first_value + 7)], "7");
  EXPECT_EQ(ar.symbols()[static_cast<std::size_t>(rv.query)], "?");
  const std::vector<int> keys{3, 12}, values{7, 1};
  EXPECT_EQ(ar.text(ar.recall_prompt(keys, values, 3)), "<bos> k3 7 k12 1 ? k3");
  // Every sample's prompt is recall_prompt of its own pairs and query.
  SampleRng rng(4);
  for (int n : {4, 10, 30}) {
    const TrainSample s = ar.sample(rng, n);
    std::vector<int> k, v;
    for (std::size_t i = 1; i + 2 < s.prompt.size(); i += 2) {
      k.push_back(s.prompt[i] - rv.first_key);
      v.push_back(s.prompt[i + 1] - rv.first_value);
    }
    EXPECT_EQ(ar.recall_prompt(k, v, s.prompt.back() - rv.first_key), s.prompt);
  }
  EXPECT_THROW(Task(TrainTaskKind::copy).recall_vocabulary(), InvalidArgument);
  EXPECT_THROW(ar.recall_prompt(keys, std::vector<int>{1}, 3), InvalidArgument);
  EXPECT_THROW(ar.recall_prompt(std::vector<int>{128}, std::vector<int>{1}, 3), InvalidArgument);
  EXPECT_THROW(ar.recall_prompt(keys, std::vector<int>{1, 10}, 3), InvalidArgument);
  EXPECT_THROW(ar.recall_prompt(keys, values, -1), InvalidArgument);
}

}  // namespace POSENC_UNITY_ID
