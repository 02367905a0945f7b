// The shared parts of every task: sentences, the haystack, prompt pieces and
// their assembly, value generators.
#include "posenc/tasks.hpp"

#include <algorithm>
#include <array>
#include <cctype>
#include <cmath>
#include <set>

#include <fmt/format.h>

#include "eval/tasks/task_kit.hpp"
#include "posenc/error.hpp"
#include "core/parallel.hpp"
#include "posenc/perplexity.hpp"

namespace posenc {

namespace detail::tasks {
bool is_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f'; }
}  // namespace detail::tasks

using detail::tasks::is_space;

// ---------------------------------------------------------------- sentences

namespace {

// Closing characters that may follow a sentence terminator: ASCII quotes and
// brackets, and the UTF-8 right double/single quotes (U+201D, U+2019).
std::size_t closing_run(std::string_view s, std::size_t i) {
  std::size_t j = i;
  for (;;) {
    if (j < s.size() && (s[j] == '"' || s[j] == '\'' || s[j] == ')' || s[j] == ']')) {
      ++j;
    } else if (j + 2 < s.size() + 0 && static_cast<unsigned char>(s[j]) == 0xE2 &&
               static_cast<unsigned char>(s[j + 1]) == 0x80 &&
               (static_cast<unsigned char>(s[j + 2]) == 0x9D || static_cast<unsigned char>(s[j + 2]) == 0x99)) {
      j += 3;
    } else {
      return j;
    }
  }
}

std::string collapse(std::string_view s) {
  std::string out;
  bool ws = false;
  for (char c : s) {
    if (is_space(c)) {
      ws = true;
      continue;
    }
    if (ws && !out.empty()) out += ' ';
    ws = false;
    out += c;
  }
  return out;
}

}  // namespace

std::vector<std::string> split_sentences(std::string_view block) {
  std::vector<std::string> out;
  std::size_t start = 0;
  auto emit = [&](std::size_t end) {
    std::string s = collapse(block.substr(start, end - start));
    if (!s.empty()) out.push_back(std::move(s));
    start = end;
  };
  for (std::size_t i = 0; i < block.size(); ++i) {
    const char c = block[i];
    if (c != '.' && c != '!' && c != '?') continue;
    std::size_t j = closing_run(block, i + 1);
    if (j < block.size() && !is_space(block[j])) continue;  // "3.5", "e.g.x", "Hi!said"
    std::size_t k = j;
    while (k < block.size() && is_space(block[k])) ++k;
    if (k < block.size() && std::islower(static_cast<unsigned char>(block[k]))) continue;  // "Hi!" said Tom.
    emit(j);
    i = j > 0 ? j - 1 : 0;
  }
  emit(block.size());
  return out;
}

// ---------------------------------------------------------------- haystack

namespace {

bool has_word(std::string_view s, const std::string& w) {
  std::size_t pos = 0;
  while ((pos = s.find(w, pos)) != std::string_view::npos) {
    const bool left = pos == 0 || !std::isalpha(static_cast<unsigned char>(s[pos - 1]));
    const std::size_t e = pos + w.size();
    const bool right = e >= s.size() || !std::isalpha(static_cast<unsigned char>(s[e]));
    if (left && right) return true;
    pos = e;
  }
  return false;
}

}  // namespace

Haystack Haystack::build(std::string_view text, const Tokenizer& tokenizer, std::span<const std::string> exclude) {
  Haystack h;
  for (const auto& block : split_blocks(text))
    for (auto& s : split_sentences(block)) {
      const bool digit = std::any_of(s.begin(), s.end(), [](char c) { return c >= '0' && c <= '9'; });
      const bool word = std::any_of(exclude.begin(), exclude.end(), [&](const std::string& w) { return has_word(s, w); });
      if (digit || word) {
        ++h.dropped_;
        continue;
      }
      h.texts_.push_back(std::move(s));
    }
  if (h.texts_.empty()) throw InvalidArgument("haystack: the text holds no usable sentence");
  std::vector<std::vector<int32_t>> toks(h.texts_.size());
  detail::FirstException error;  // e.g. TokenizerError for a piece outside the vocabulary
#pragma omp parallel for schedule(dynamic, 64)
  for (std::size_t i = 0; i < h.texts_.size(); ++i) error.run([&] {
    // Sentences are joined with spaces: a tokenizer without a dummy prefix must see that space.
    toks[i] = tokenizer.encode(tokenizer.adds_prefix_space() ? h.texts_[i] : " " + h.texts_[i], false, false);
  });
  error.rethrow();
  std::set<std::string> words;
  for (const auto& t : h.texts_) {
    std::size_t p = 0;
    while (p < t.size()) {
      while (p < t.size() && !std::isalpha(static_cast<unsigned char>(t[p]))) ++p;
      std::size_t q = p;
      while (q < t.size() && std::isalpha(static_cast<unsigned char>(t[q]))) ++q;
      const std::string_view w(t.data() + p, q - p);
      if (w.size() >= 3 && w.size() <= 10 && std::all_of(w.begin(), w.end(), [](char c) { return c >= 'a' && c <= 'z'; }))
        words.emplace(w);
      p = q;
    }
  }
  h.words_.assign(words.begin(), words.end());
  h.offsets_.reserve(toks.size() + 1);
  h.offsets_.push_back(0);
  for (const auto& t : toks) {
    h.tokens_.insert(h.tokens_.end(), t.begin(), t.end());
    h.offsets_.push_back(static_cast<int64_t>(h.tokens_.size()));
  }
  return h;
}

std::span<const int32_t> Haystack::tokens(std::size_t i) const {
  if (i >= texts_.size()) fail_field<InvalidArgument>("haystack sentence", "index out of range", i);
  return std::span<const int32_t>(tokens_).subspan(static_cast<std::size_t>(offsets_[i]),
                                                   static_cast<std::size_t>(offsets_[i + 1] - offsets_[i]));
}

// ---------------------------------------------------------------- controls

std::string_view to_string(TaskControl c) {
  switch (c) {
    case TaskControl::none: return "none";
    case TaskControl::swap: return "swap";
    case TaskControl::shuffle: return "shuffle";
    case TaskControl::absent: return "absent";
  }
  return "?";
}

TaskControl parse_task_control(std::string_view text, std::string_view field) {
  if (text == "none") return TaskControl::none;
  if (text == "swap") return TaskControl::swap;
  if (text == "shuffle") return TaskControl::shuffle;
  if (text == "absent") return TaskControl::absent;
  throw ConfigError(fmt::format("{}: unknown control '{}' (known: none, swap, shuffle, absent)", field, text));
}

namespace detail::tasks {

// ---------------------------------------------------------------- word lists

// Common TinyStories names: the model knows them as character names (several
// are single tokens), so it can copy one from the context. Haystack sentences
// mentioning any of them are dropped (Haystack::build's exclude list), so the
// true name occurs only in the needle and the K-1 distractors nowhere.
const std::vector<std::string>& names_list() {
  static const std::vector<std::string> v{"Lily", "Tom",   "Ben",   "Sue",   "Max",  "Sam",  "Anna", "Mia",
                                          "Jack", "Lucy",  "Sara",  "Bob",   "Amy",  "Jane", "Billy", "Molly",
                                          "Daisy", "Emma", "Jill",  "Joe",   "Mark", "Timmy", "Tim",  "Kitty"};
  return v;
}

// ---------------------------------------------------------------- pieces

/// The tokens a prompt starts with: the tokenizer's BOS, when it has one.
std::vector<int32_t> start_tokens(const Tokenizer& tok) {
  return tok.bos_id() ? std::vector<int32_t>{*tok.bos_id()} : std::vector<int32_t>{};
}

Piece make_piece(const Tokenizer& tok, std::string text, bool newline_led) {
  Piece p;
  p.newline_led = newline_led;
  if (newline_led) {
    if (text.empty() || text.front() != '\n')
      throw InvalidArgument("task template: a newline-led piece must start with '\\n'");
    if (tok.adds_prefix_space()) {
      // encode() adds the dummy-prefix space token, which cannot merge with the
      // newline token that follows; drop it.
      auto t = tok.encode(text, false, false);
      const auto nl = tok.encode("\n", false, false);  // [dummy prefix, newline]
      if (t.size() < 2 || nl.size() != 2 || t.front() != nl.front())
        throw TokenizerError("task template: unexpected encoding of a newline-led piece");
      p.tokens.assign(t.begin() + 1, t.end());
    } else {
      p.tokens = tok.encode(text, false, false);
    }
  } else {
    if (text.empty() || is_space(text.front())) throw InvalidArgument("task template: empty or space-led piece");
    // Pieces are joined with a space (append): a tokenizer without a dummy
    // prefix (byte-level BPE) must see that space to give the same tokens.
    p.tokens = tok.encode(tok.adds_prefix_space() ? text : " " + text, false, false);
  }
  p.text = std::move(text);
  return p;
}

void append(TaskSample& s, const Piece& p) {
  if (p.newline_led || s.prompt_text.empty())
    s.prompt_text += p.text;
  else
    s.prompt_text += " " + p.text;
  s.prompt_tokens.insert(s.prompt_tokens.end(), p.tokens.begin(), p.tokens.end());
}

void append_sentence(TaskSample& s, const Haystack& hay, std::size_t h) {
  if (!s.prompt_text.empty()) s.prompt_text += ' ';
  s.prompt_text += hay.text(h);
  const auto t = hay.tokens(h);
  s.prompt_tokens.insert(s.prompt_tokens.end(), t.begin(), t.end());
}

[[noreturn]] void too_short(const TaskSample& s, int64_t fixed) {
  throw TaskDoesNotFit(fmt::format(
      "length: {} tokens cannot hold task {} (its fixed parts and answer budget take {} tokens)", s.length, s.task,
      fixed));
}

// Nearest boundary k in [0, N] to target offset t over prefix sums cum[0..N].
int64_t nearest_boundary(const std::vector<int64_t>& cum, double t) {
  auto it = std::lower_bound(cum.begin(), cum.end(), t, [](int64_t a, double b) { return static_cast<double>(a) < b; });
  int64_t k = it - cum.begin();
  if (k >= static_cast<int64_t>(cum.size())) return static_cast<int64_t>(cum.size()) - 1;
  if (k > 0 && t - static_cast<double>(cum[static_cast<std::size_t>(k - 1)]) <=
                   static_cast<double>(cum[static_cast<std::size_t>(k)]) - t)
    --k;
  return k;
}

void finish_placements(TaskSample& s) {
  for (auto& n : s.needles) {
    const int64_t denom = s.context_tokens - n.tokens;
    n.depth = denom > 0 ? static_cast<double>(n.token_position - s.context_start) / static_cast<double>(denom) : 0.0;
  }
}

// The haystack tasks' common assembly: BOS, preamble, haystack sentences with
// the needles at their depths, query.
void assemble_haystack(const std::vector<int32_t>& start_ids, const Haystack& hay, TaskSample& s, Rng& hay_rng, const Piece* preamble,
                       std::vector<NeedleIn> needles, const Piece& query) {
  int64_t fixed = static_cast<int64_t>(start_ids.size() + query.tokens.size()) + s.answer_budget;
  if (preamble) fixed += static_cast<int64_t>(preamble->tokens.size());
  for (const auto& n : needles) fixed += static_cast<int64_t>(n.piece.tokens.size());
  if (fixed > s.length) too_short(s, fixed);
  const int64_t budget = s.length - fixed;
  const std::size_t start = static_cast<std::size_t>(hay_rng.uniform(hay.size()));
  std::vector<std::size_t> idx;
  std::vector<int64_t> cum{0};
  for (std::size_t j = 0; j < hay.size(); ++j) {
    const std::size_t h = (start + j) % hay.size();
    const auto t = static_cast<int64_t>(hay.tokens(h).size());
    if (cum.back() + t > budget) break;
    idx.push_back(h);
    cum.push_back(cum.back() + t);
  }
  const double H = static_cast<double>(cum.back());
  std::vector<int64_t> boundary(needles.size());
  for (std::size_t i = 0; i < needles.size(); ++i) boundary[i] = nearest_boundary(cum, needles[i].target * H);
  std::vector<std::size_t> order(needles.size());
  for (std::size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) {
    if (boundary[a] != boundary[b]) return boundary[a] < boundary[b];
    return needles[a].target < needles[b].target;
  });

  s.haystack_start = static_cast<int64_t>(start);
  s.haystack_sentences = static_cast<int64_t>(idx.size());
  s.prompt_tokens = start_ids;
  s.prompt_text.clear();
  if (preamble) append(s, *preamble);
  s.context_start = static_cast<int64_t>(s.prompt_tokens.size());
  std::size_t next = 0;
  for (std::size_t k = 0; k <= idx.size(); ++k) {
    while (next < order.size() && boundary[order[next]] == static_cast<int64_t>(k)) {
      const auto& n = needles[order[next]];
      NeedlePlacement p;
      p.role = n.role;
      p.text = n.piece.text;
      p.target_depth = n.target;
      p.sentence_index = static_cast<int64_t>(k);
      p.token_position = static_cast<int64_t>(s.prompt_tokens.size());
      p.tokens = static_cast<int64_t>(n.piece.tokens.size());
      s.needles.push_back(std::move(p));
      append(s, n.piece);
      ++next;
    }
    if (k < idx.size()) append_sentence(s, hay, idx[k]);
  }
  s.context_tokens = static_cast<int64_t>(s.prompt_tokens.size()) - s.context_start;
  append(s, query);
  finish_placements(s);
}

// Evidence needles: the first at depth d, the others evenly spaced after it
// (gkamradt's multi-needle rule: every (1 - d) / n after the first).
double evidence_target(double d, std::size_t j, std::size_t n) {
  return d + (1.0 - d) * static_cast<double>(j) / static_cast<double>(n);
}

std::string digits(Rng& r, int n) {
  std::string s;
  s += static_cast<char>('1' + r.uniform(9));
  for (int i = 1; i < n; ++i) s += static_cast<char>('0' + r.uniform(10));
  return s;
}

std::string hex8(Rng& r) {
  static constexpr char kHex[] = "0123456789abcdef";
  std::string s;
  for (int i = 0; i < 8; ++i) s += kHex[r.uniform(16)];
  return s;
}

// A permutation of the characters of s that differs from s (numbers keep a
// non-zero first digit); if none exists, `fresh` is returned.
std::string permuted(const std::string& s, Rng& r, const std::string& fresh) {
  for (int attempt = 0; attempt < 64; ++attempt) {
    std::vector<char> c(s.begin(), s.end());
    r.shuffle(c);
    std::string t(c.begin(), c.end());
    if (t != s && !(std::isdigit(static_cast<unsigned char>(s[0])) && t[0] == '0')) return t;
  }
  return fresh;
}

std::string join_and(const std::vector<std::string>& v) {
  if (v.size() == 1) return v[0];
  std::string s;
  for (std::size_t i = 0; i + 1 < v.size(); ++i) s += v[i] + ", ";
  return s + "and " + v.back();
}

}  // namespace detail::tasks

}  // namespace posenc
