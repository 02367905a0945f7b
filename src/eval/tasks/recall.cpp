// The recall family: name_recall (a name in a story haystack) and
// associative_recall (the trained key-value format).
#include <algorithm>
#include <array>
#include <cctype>
#include <cmath>
#include <set>

#include <fmt/format.h>

#include "eval/tasks/task_kit.hpp"
#include "posenc/error.hpp"
#include "posenc/synthetic_tasks.hpp"

namespace posenc::detail::tasks {

const Task& recall_task() {
  static const Task t(TrainTaskKind::associative_recall);
  return t;
}

void build_associative_recall(TaskContext& x, TaskSample& s, double depth, TaskControl control) {
  const TaskOptions& options_ = x.options;
  const int64_t length = s.length;
  Rng& content = x.content;
  Rng& ctl = x.ctl;
  const std::span<const int32_t> recall_ids_ = x.recall_ids;
  if (!x.recall_error.empty()) throw ConfigError(x.recall_error);
  const Task& ar = recall_task();
  const Task::RecallVocabulary rv = ar.recall_vocabulary();
  const int K = options_.choices;
  if (K > rv.values)
    throw InvalidArgument(fmt::format("choices: associative_recall has {} values, so K must be <= {} (got {})",
                                      rv.values, rv.values, K));
  // Content fixed per (seed, index): a key permutation and a value per slot;
  // slot 0 is the queried pair, slots 1.. the other pairs in context order.
  std::vector<int> keys(static_cast<std::size_t>(rv.keys));
  for (int i = 0; i < rv.keys; ++i) keys[static_cast<std::size_t>(i)] = i;
  content.shuffle(keys);
  std::vector<int> vals(static_cast<std::size_t>(rv.keys));
  for (auto& v : vals) v = static_cast<int>(content.uniform(static_cast<uint64_t>(rv.values)));
  std::vector<int> fallback(static_cast<std::size_t>(rv.values));  // candidate fill order past the context's values
  for (int i = 0; i < rv.values; ++i) fallback[static_cast<std::size_t>(i)] = i;
  content.shuffle(fallback);
  std::vector<int> order(static_cast<std::size_t>(K));  // candidate presentation order
  for (int i = 0; i < K; ++i) order[static_cast<std::size_t>(i)] = i;
  content.shuffle(order);

  const int64_t fixed = 1 + 2 + 2 + s.answer_budget;  // BOS, one pair, "?" + key, answer
  if (length < fixed) too_short(s, fixed);
  const int64_t max_length = 1 + 2 * static_cast<int64_t>(rv.keys) + 2 + s.answer_budget;
  if (length > max_length)
    throw TaskDoesNotFit(fmt::format("length: {} tokens exceed what task associative_recall can fill ({} distinct "
                                     "keys make at most {} tokens)",
                                     length, rv.keys, max_length));
  const auto m = static_cast<std::size_t>(std::min<int64_t>((length - 4) / 2, rv.keys));
  vals.resize(m);
  const std::vector<int> original = vals;
  if (control == TaskControl::swap) {
    std::size_t j = 1;
    while (j < m && vals[j] == vals[0]) ++j;
    if (j < m) {
      std::swap(vals[0], vals[j]);
    } else {
      do vals[0] = static_cast<int>(ctl.uniform(static_cast<uint64_t>(rv.values)));
      while (vals[0] == original[0]);
    }
  } else if (control == TaskControl::shuffle) {
    bool changed = false;
    for (int attempt = 0; attempt < 64 && !changed; ++attempt) {
      vals = original;
      ctl.shuffle(vals);
      changed = vals[0] != original[0];
    }
    if (!changed) {  // every pair holds the same value: a fresh one for the queried key
      vals = original;
      do vals[0] = static_cast<int>(ctl.uniform(static_cast<uint64_t>(rv.values)));
      while (vals[0] == original[0]);
    }
  }
  // Candidates: the original value, the controlled one, then values other
  // keys hold in the (uncontrolled) context, then the fallback order.
  std::vector<int> cands{original[0]};
  auto add = [&](int v) {
    if (static_cast<int>(cands.size()) < K && std::find(cands.begin(), cands.end(), v) == cands.end())
      cands.push_back(v);
  };
  add(vals[0]);
  for (std::size_t j = 1; j < m; ++j) add(original[j]);
  for (int v : fallback) add(v);
  const auto& sym = ar.symbols();
  auto tok_id = [&](int32_t train_id) { return recall_ids_[static_cast<std::size_t>(train_id)]; };
  for (int i = 0; i < K; ++i) {
    const int c = cands[static_cast<std::size_t>(order[static_cast<std::size_t>(i)])];
    const int32_t id = rv.first_value + c;
    s.choices.push_back(" " + sym[static_cast<std::size_t>(id)]);
    s.choice_tokens.push_back({tok_id(id)});
    if (c == vals[0]) s.gold = i;
    if (c == original[0]) s.original_gold = i;
  }
  s.equal_length_choices = true;  // one value token, one byte each
  // Context order: the other pairs in slot order, the queried pair at g.
  const auto g = static_cast<std::size_t>(std::llround(depth * static_cast<double>(m - 1)));
  std::vector<int> ck, cv;
  for (std::size_t j = 1, i = 0; i < m; ++i) {
    const std::size_t slot = i == g ? 0 : j++;
    ck.push_back(keys[slot]);
    cv.push_back(vals[slot]);
  }
  if (control == TaskControl::absent) {
    // No evidence, and nothing else changed: the queried pair keeps its slot
    // and its value, but its key becomes one that occurs nowhere else, so the
    // queried key is absent while every candidate value is as present in the
    // context as without the control (the distractors are values other keys
    // hold; the gold value stays in the context). Removing the pair instead
    // took the gold value out of the context and measured how often a model
    // picks a value it has seen, not chance. With all keys in use (the longest
    // length), the slot takes the key of the last other pair, which is dropped.
    if (m < keys.size()) {
      ck[g] = keys[m];
    } else {
      const std::size_t last = g + 1 == ck.size() ? ck.size() - 2 : ck.size() - 1;
      ck[g] = ck[last];
      ck.erase(ck.begin() + static_cast<std::ptrdiff_t>(last));
      cv.erase(cv.begin() + static_cast<std::ptrdiff_t>(last));
    }
  }
  const std::vector<int32_t> train_prompt = ar.recall_prompt(ck, cv, keys[0]);
  s.prompt_tokens.clear();
  for (int32_t t : train_prompt) s.prompt_tokens.push_back(tok_id(t));
  s.prompt_text = ar.text(std::span<const int32_t>(train_prompt).subspan(1));
  s.context_start = 1;
  s.context_tokens = 2 * static_cast<int64_t>(ck.size());
  s.haystack_sentences = static_cast<int64_t>(ck.size());
  if (control == TaskControl::absent) return;
  NeedlePlacement p;
  p.role = "evidence";
  p.text = sym[static_cast<std::size_t>(rv.first_key + keys[0])] + " " +
           sym[static_cast<std::size_t>(rv.first_value + vals[0])];
  p.target_depth = depth;
  p.sentence_index = static_cast<int64_t>(g);
  p.token_position = s.context_start + 2 * static_cast<int64_t>(g);
  p.tokens = 2;
  s.needles.push_back(std::move(p));
  finish_placements(s);
  return;
}

void build_name_recall(TaskContext& x, TaskSample& s, double depth, TaskControl control) {
  const Tokenizer& tok_ = x.tok;
  const Haystack& hay_ = x.hay;
  const TaskOptions& options_ = x.options;
  Rng& content = x.content;
  Rng& hay_rng = x.hay_rng;
  Rng& ctl = x.ctl;
  auto names = names_list();
  content.shuffle(names);
  const auto kind = std::string(kKinds[content.uniform(kKinds.size())]);
  const int K = options_.choices;
  auto encode_name = [&](const std::string& n) {
    return tok_.encode(tok_.adds_prefix_space() ? n : " " + n, false, false);
  };
  // Equal-length candidates: the true name is the first name (in the sample's
  // shuffled order) whose class of (token count, byte length) holds K names of
  // the pool; the distractors are the next names of that class. Then acc and
  // acc_norm divide by the same length and agree. Without such a class (a
  // tokenizer that splits the names unevenly, or K above the class sizes) the
  // first K names, and acc_norm alone removes the length bias.
  std::vector<std::pair<std::size_t, std::size_t>> cls(names.size());
  for (std::size_t i = 0; i < names.size(); ++i) cls[i] = {encode_name(names[i]).size(), names[i].size()};
  std::vector<std::string> cands;
  for (std::size_t i = 0; i < names.size() && cands.empty(); ++i) {
    std::vector<std::string> same;
    for (std::size_t j = i; j < names.size(); ++j)
      if (cls[j] == cls[i]) same.push_back(names[j]);
    if (static_cast<int>(same.size()) >= K) cands.assign(same.begin(), same.begin() + K);
  }
  s.equal_length_choices = !cands.empty();
  if (cands.empty()) cands.assign(names.begin(), names.begin() + K);  // cands[0] = the true name
  std::vector<int> order(static_cast<std::size_t>(K));
  for (int i = 0; i < K; ++i) order[static_cast<std::size_t>(i)] = i;
  content.shuffle(order);  // presentation order, so the gold index is not always 0
  int named = 0;
  if (control == TaskControl::swap) named = 1;
  if (control == TaskControl::shuffle) named = 1 + static_cast<int>(ctl.uniform(static_cast<uint64_t>(K - 1)));
  int max_tokens = 0;
  for (int i = 0; i < K; ++i) {
    const int c = order[static_cast<std::size_t>(i)];
    s.choices.push_back(" " + cands[static_cast<std::size_t>(c)]);
    s.choice_tokens.push_back(encode_name(cands[static_cast<std::size_t>(c)]));
    max_tokens = std::max(max_tokens, static_cast<int>(s.choice_tokens.back().size()));
    if (c == named) s.gold = i;
    if (c == 0) s.original_gold = i;
  }
  s.answer_budget = max_tokens;
  const std::string& name = cands[static_cast<std::size_t>(named)];
  std::vector<NeedleIn> needles;
  if (control != TaskControl::absent)  // absent: the haystack and the question only
    needles.push_back({make_piece(tok_, fmt::format("There was a little {} named {}.", kind, name)), "evidence", depth});
  const Piece query = make_piece(tok_, fmt::format("The little {} was named", kind));
  assemble_haystack(start_tokens(tok_), hay_, s, hay_rng, nullptr, std::move(needles), query);
  return;
}

}  // namespace posenc::detail::tasks
