// The retrieval family: passkey, RULER niah_*, kv_retrieval.
#include <algorithm>
#include <array>
#include <cctype>
#include <cmath>
#include <set>

#include <fmt/format.h>

#include "eval/tasks/task_kit.hpp"
#include "posenc/error.hpp"

namespace posenc::detail::tasks {

void build_passkey(TaskContext& x, TaskSample& s, double depth, TaskControl control) {
  const Tokenizer& tok_ = x.tok;
  const Haystack& hay_ = x.hay;
  Rng& content = x.content;
  Rng& hay_rng = x.hay_rng;
  Rng& ctl = x.ctl;
  const std::string key = digits(content, 5);
  std::string used = key;
  if (control == TaskControl::swap) {
    do used = digits(ctl, 5);
    while (used == key);
  } else if (control == TaskControl::shuffle) {
    std::string fresh;
    do fresh = digits(ctl, 5);
    while (fresh == key);
    used = permuted(key, ctl, fresh);
  }
  s.answers = {used};
  s.original_answers = {key};
  const Piece pre = make_piece(tok_,
                               "There is a pass key hidden in this text. Find it and remember it.");
  std::vector<NeedleIn> needles{
      {make_piece(tok_, fmt::format("The pass key is {0}. Remember it. {0} is the pass key.", used)), "evidence",
       depth}};
  const Piece query = make_piece(tok_, "What is the pass key? The pass key is");
  assemble_haystack(start_tokens(tok_), hay_, s, hay_rng, &pre, std::move(needles), query);
  return;
}

void build_niah(TaskContext& x, TaskSample& s, double depth, TaskControl control) {
  const Tokenizer& tok_ = x.tok;
  const Haystack& hay_ = x.hay;
  const TaskInfo& info = x.info;
  Rng& content = x.content;
  Rng& hay_rng = x.hay_rng;
  Rng& ctl = x.ctl;
  int nk = 1, nv = 1, nq = 1;
  if (info.name == "niah_multikey") nk = 4;
  if (info.name == "niah_multivalue") nv = 4;
  if (info.name == "niah_multiquery") nk = nq = 4;
  // Distinct adjective-noun keys.
  std::vector<std::string> keys;
  while (static_cast<int>(keys.size()) < nk) {
    std::string k = fmt::format("{}-{}", kAdjectives[content.uniform(kAdjectives.size())],
                                kNouns[content.uniform(kNouns.size())]);
    if (std::find(keys.begin(), keys.end(), k) == keys.end()) keys.push_back(std::move(k));
  }
  std::vector<std::vector<std::string>> values(static_cast<std::size_t>(nk));
  std::set<std::string> seen;
  for (auto& vs : values)
    while (static_cast<int>(vs.size()) < nv) {
      std::string v = digits(content, 7);
      if (seen.insert(v).second) vs.push_back(std::move(v));
    }
  std::vector<double> distractor_depth(static_cast<std::size_t>(nk));
  for (auto& d : distractor_depth) d = content.uniform01();
  // queried keys: the first nq (keys are random already)
  const auto original = values;
  if (control == TaskControl::swap) {
    if (nk > nq) {
      std::swap(values[0], values[static_cast<std::size_t>(nq)]);  // queried key 0 takes a distractor's value
    } else {
      for (auto& vs : values)
        for (auto& v : vs) {
          std::string f;
          do f = digits(ctl, 7);
          while (seen.count(f));
          seen.insert(f);
          v = f;
        }
    }
  } else if (control == TaskControl::shuffle) {
    if (nk > 1) {
      // A random derangement of the value lists among the keys.
      std::vector<std::size_t> perm(static_cast<std::size_t>(nk));
      for (;;) {
        for (std::size_t i = 0; i < perm.size(); ++i) perm[i] = i;
        ctl.shuffle(perm);
        bool ok = true;
        for (std::size_t i = 0; i < perm.size(); ++i) ok = ok && perm[i] != i;
        if (ok) break;
      }
      for (std::size_t i = 0; i < perm.size(); ++i) values[i] = original[perm[i]];
    } else {
      for (auto& v : values[0]) v = permuted(v, ctl, digits(ctl, 7));
    }
  }
  std::vector<std::string> queried(keys.begin(), keys.begin() + nq);
  for (int q = 0; q < nq; ++q) {
    for (const auto& v : values[static_cast<std::size_t>(q)]) s.answers.push_back(v);
    for (const auto& v : original[static_cast<std::size_t>(q)]) s.original_answers.push_back(v);
  }
  const int n_evidence = nq * nv;
  std::vector<NeedleIn> needles;
  int e = 0;
  for (int k = 0; k < nk; ++k)
    for (const auto& v : values[static_cast<std::size_t>(k)]) {
      const bool evidence = k < nq;
      const double t = evidence ? evidence_target(depth, static_cast<std::size_t>(e++), static_cast<std::size_t>(n_evidence))
                                : distractor_depth[static_cast<std::size_t>(k)];
      needles.push_back({make_piece(tok_, fmt::format("One of the special magic numbers for {} is: {}.", keys[static_cast<std::size_t>(k)], v)),
                         evidence ? "evidence" : "distractor", t});
    }
  const Piece pre = make_piece(tok_,
                               "Special magic numbers are hidden in the following text. Memorize them.");
  const std::string q = join_and(queried);
  const Piece query = make_piece(
      tok_, nq * nv == 1
                ? fmt::format("What is the special magic number for {0}? The special magic number for {0} is", q)
                : fmt::format("What are all the special magic numbers for {0}? The special magic numbers for {0} are",
                              q));
  assemble_haystack(start_tokens(tok_), hay_, s, hay_rng, &pre, std::move(needles), query);
  return;
}

void build_kv_retrieval(TaskContext& x, TaskSample& s, double depth, TaskControl control) {
  const Tokenizer& tok_ = x.tok;
  const int64_t length = s.length;
  Rng& content = x.content;
  Rng& ctl = x.ctl;
  // Records: 0 = the queried pair; 1.. = distractors, in a fixed order.
  std::set<std::string> seen;
  auto fresh = [&](Rng& r) {
    std::string h;
    do h = hex8(r);
    while (!seen.insert(h).second);
    return h;
  };
  const std::string gold_key = fresh(content), gold_value = fresh(content);
  std::vector<std::pair<std::string, std::string>> distractors;
  auto distractor = [&](std::size_t i) -> const std::pair<std::string, std::string>& {
    while (distractors.size() <= i) {
      std::string k = fresh(content);
      std::string v = fresh(content);
      distractors.emplace_back(std::move(k), std::move(v));
    }
    return distractors[i];
  };
  std::string value = gold_value;
  bool swapped = false;
  if (control == TaskControl::shuffle) value = permuted(gold_value, ctl, hex8(ctl));
  const Piece pre = make_piece(tok_,
                               "Extract the value corresponding to the specified key in the JSON object below.\n\n"
                               "JSON data:\n{");
  const Piece query = make_piece(tok_, fmt::format("\n\nKey: \"{}\"\nCorresponding value:", gold_key), true);
  auto record = [&](const std::string& k, const std::string& v, bool last) {
    return make_piece(tok_, fmt::format("\n\"{}\": \"{}\"{}", k, v, last ? "}" : ","), true);
  };
  // Fit: the largest number of records n (1 + n-1 distractors) within the length.
  const int64_t fixed = 1 + static_cast<int64_t>(pre.tokens.size() + query.tokens.size()) + s.answer_budget;
  int64_t total = fixed;
  std::vector<Piece> rec;  // distractor records, non-last form
  for (;;) {
    const auto& d = distractor(rec.size());
    Piece p = record(d.first, d.second, false);
    // Worst case for the closing record: +1 token for '}' vs ','.
    const int64_t gold_len = static_cast<int64_t>(record(gold_key, value, false).tokens.size()) + 1;
    if (total + static_cast<int64_t>(p.tokens.size()) + gold_len > length) break;
    total += static_cast<int64_t>(p.tokens.size());
    rec.push_back(std::move(p));
    if (rec.size() > 100000) break;
  }
  const int64_t n = static_cast<int64_t>(rec.size()) + 1;
  {
    const int64_t need = fixed + static_cast<int64_t>(record(gold_key, value, false).tokens.size()) + 1;
    if (need > length) too_short(s, need);
  }
  if (control == TaskControl::swap && n > 1) {
    // The queried key takes the first distractor's value (and vice versa).
    value = distractors[0].second;
    distractors[0].second = gold_value;
    rec[0] = record(distractors[0].first, distractors[0].second, false);
    swapped = true;
  } else if (control == TaskControl::swap) {
    value = fresh(ctl);
  }
  (void)swapped;
  s.answers = {value};
  s.original_answers = {gold_value};
  const int64_t g = std::llround(depth * static_cast<double>(n - 1));
  s.prompt_tokens = start_tokens(tok_);
  s.prompt_text.clear();
  append(s, pre);
  s.context_start = static_cast<int64_t>(s.prompt_tokens.size());
  int64_t di = 0;
  for (int64_t i = 0; i < n; ++i) {
    const bool last = i == n - 1;
    if (i == g) {
      NeedlePlacement p;
      p.role = "evidence";
      const Piece gp = record(gold_key, value, last);
      p.text = gp.text.substr(1);
      p.target_depth = depth;
      p.sentence_index = i;
      p.token_position = static_cast<int64_t>(s.prompt_tokens.size());
      p.tokens = static_cast<int64_t>(gp.tokens.size());
      s.needles.push_back(std::move(p));
      append(s, gp);
    } else {
      const auto& d = distractors[static_cast<std::size_t>(di++)];
      append(s, last ? record(d.first, d.second, true) : rec[static_cast<std::size_t>(di - 1)]);
    }
  }
  s.context_tokens = static_cast<int64_t>(s.prompt_tokens.size()) - s.context_start;
  s.haystack_sentences = n;
  append(s, query);
  // Realised depth for kv_retrieval: the record index over n-1 (lost-in-the-middle's gold index).
  finish_placements(s);
  if (static_cast<int64_t>(s.prompt_tokens.size()) + s.answer_budget > length) too_short(s, static_cast<int64_t>(s.prompt_tokens.size()) + s.answer_budget);
  return;
}

}  // namespace posenc::detail::tasks
