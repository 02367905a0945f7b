// The aggregation family: RULER common_words (cwe).
#include <algorithm>
#include <array>
#include <cctype>
#include <cmath>
#include <set>

#include <fmt/format.h>

#include "eval/tasks/task_kit.hpp"
#include "posenc/error.hpp"

namespace posenc::detail::tasks {

void build_common_words(TaskContext& x, TaskSample& s, double depth, TaskControl control) {
  const Tokenizer& tok_ = x.tok;
  const Haystack& hay_ = x.hay;
  const int64_t length = s.length;
  const uint64_t key = x.key;
  Rng& content = x.content;
  Rng& ctl = x.ctl;
  const auto& vocab = hay_.words();
  constexpr int kCommon = 5, kFreqCommon = 4;
  if (vocab.size() < 64) throw InvalidArgument("common_words: the haystack has fewer than 64 distinct words");
  auto words = vocab;
  content.shuffle(words);
  std::vector<std::string> common(words.begin(), words.begin() + kCommon);
  const auto original = common;
  if (control == TaskControl::swap) {
    // The repeated words become others (the last words of the shuffled list).
    for (int i = 0; i < kCommon; ++i) common[static_cast<std::size_t>(i)] = words[words.size() - 1 - static_cast<std::size_t>(i)];
  } else if (control == TaskControl::shuffle) {
    for (auto& w : common) w = permuted(w, ctl, words[words.size() - 1 - ctl.uniform(16)]);
  }
  s.answers = common;
  s.original_answers = original;
  const Piece pre = make_piece(tok_,
                               "Below is a numbered list of words. Some appear more often than others.");
  const Piece query = make_piece(tok_,
                                 "Question: What are the 5 most common words in the list? Answer: The 5 most common "
                                 "words are:");
  const int64_t fixed = 1 + static_cast<int64_t>(pre.tokens.size() + query.tokens.size()) + s.answer_budget;
  const std::size_t max_unique = words.size() - static_cast<std::size_t>(2 * kCommon);
  // The list for n unique words: common x 4 + n unique, shuffled by a stream
  // derived from (sample, n). Binary search the largest n that fits.
  auto build = [&](std::size_t n, TaskSample& out) {
    std::vector<std::string> list;
    for (const auto& w : common)
      for (int r = 0; r < kFreqCommon; ++r) list.push_back(w);
    for (std::size_t i = 0; i < n; ++i) list.push_back(words[static_cast<std::size_t>(kCommon) + i]);
    Rng lr(detail::mix(detail::mix(key, 4), n));
    lr.shuffle(list);
    out.prompt_tokens = start_tokens(tok_);
    out.prompt_text.clear();
    append(out, pre);
    out.context_start = static_cast<int64_t>(out.prompt_tokens.size());
    for (std::size_t i = 0; i < list.size(); ++i) append(out, make_piece(tok_, fmt::format("{}. {}", i + 1, list[i])));
    out.context_tokens = static_cast<int64_t>(out.prompt_tokens.size()) - out.context_start;
    out.haystack_sentences = static_cast<int64_t>(list.size());
    append(out, query);
    return static_cast<int64_t>(out.prompt_tokens.size()) + out.answer_budget;
  };
  TaskSample probe = s;
  if (fixed > length || build(0, probe) > length) too_short(s, build(0, probe));
  std::size_t lo = 0, hi = max_unique;
  while (lo < hi) {
    const std::size_t mid = (lo + hi + 1) / 2;
    if (build(mid, probe) <= length) lo = mid;
    else hi = mid - 1;
  }
  build(lo, s);
  return;
}

}  // namespace posenc::detail::tasks
