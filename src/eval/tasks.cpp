#include "posenc/tasks.hpp"

#include <algorithm>
#include <array>
#include <cctype>
#include <cmath>
#include <set>
#include <unordered_map>
#include <unordered_set>

#include <fmt/format.h>

#include "eval/rng.hpp"
#include "core/parallel.hpp"
#include "posenc/error.hpp"
#include "posenc/perplexity.hpp"
#include "posenc/train.hpp"

namespace posenc {

using detail::Rng;

// ---------------------------------------------------------------- sentences

namespace {

bool is_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f'; }

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

// ---------------------------------------------------------------- controls, registry

std::string_view to_string(TaskControl c) {
  switch (c) {
    case TaskControl::none: return "none";
    case TaskControl::swap: return "swap";
    case TaskControl::shuffle: return "shuffle";
  }
  return "?";
}

TaskControl parse_task_control(std::string_view text, std::string_view field) {
  if (text == "none") return TaskControl::none;
  if (text == "swap") return TaskControl::swap;
  if (text == "shuffle") return TaskControl::shuffle;
  throw ConfigError(fmt::format("{}: unknown control '{}' (known: none, swap, shuffle)", field, text));
}

namespace {

constexpr std::array kTasks{
    TaskInfo{"name_recall", TaskKind::choice, true, true, "choice", 0,
             "needle 'There was a little <kind> named <Name>.' at the depth; the prompt ends 'The little <kind> was "
             "named'; candidates = the name + K-1 other common TinyStories names absent from the context; argmax of "
             "summed log-prob"},
    TaskInfo{"passkey", TaskKind::generation, true, true, "first_integer", 8,
             "landmark/YaRN passkey: 'The pass key is N. Remember it. N is the pass key.' (N: 5 digits) / 'What is "
             "the pass key? The pass key is'; the first integer of the reply must equal N (short preamble)"},
    TaskInfo{"niah_single", TaskKind::generation, true, true, "all", 16,
             "RULER niah_single_2 on TinyStories: 'One of the special magic numbers for <adj-noun> is: <7 digits>.' "
             "(RULER needle, shortened preamble/question)"},
    TaskInfo{"niah_multikey", TaskKind::generation, true, true, "all", 16,
             "RULER niah_multikey_1: the queried key's number among 3 distractor keys' needles"},
    TaskInfo{"niah_multivalue", TaskKind::generation, true, true, "all", 48,
             "RULER niah_multivalue: all 4 numbers of one key"},
    TaskInfo{"niah_multiquery", TaskKind::generation, true, true, "all", 48,
             "RULER niah_multiquery: the numbers of 4 queried keys"},
    TaskInfo{"variable_tracking", TaskKind::generation, true, true, "all", 40,
             "RULER vt: 'VAR A = 12345.' then 4 hops 'VAR B = VAR A.' (evidence spread from the depth to the end); all "
             "5 names bound to the value (no one-shot example)"},
    TaskInfo{"common_words", TaskKind::generation, false, true, "all", 40,
             "RULER cwe, reduced: 5 words repeated 4 times in a numbered list of otherwise unique haystack words "
             "fitted to the length; all 5 must be named (no depth axis)"},
    TaskInfo{"kv_retrieval", TaskKind::generation, true, false, "all", 16,
             "lost-in-the-middle kv retrieval with 8-hex-digit keys/values (UUIDs cost ~30 tokens each here), one "
             "JSON record per line fitted to the length; the queried pair at index round(depth x (n-1))"},
    TaskInfo{"associative_recall", TaskKind::choice, true, false, "choice", 1,
             "the trained associative-recall format in the model's own vocabulary (posenc train --task "
             "associative_recall): '<bos> k3 7 k12 1 ... ? kq', m = min((length-4)/2, 128) pairs with distinct keys, "
             "the queried pair at index round(depth x (m-1)); forced choice: the queried value vs K-1 other values "
             "held by other keys in the context (K <= 10); no haystack"},
};

}  // namespace

std::span<const TaskInfo> eval_tasks() { return kTasks; }

const TaskInfo& find_eval_task(std::string_view name) {
  for (const auto& t : kTasks)
    if (t.name == name) return t;
  std::string known;
  for (const auto& t : kTasks) known += (known.empty() ? "" : ", ") + std::string(t.name);
  throw ConfigError(fmt::format("tasks: unknown task '{}' (known: {})", name, known));
}

// ---------------------------------------------------------------- word lists

namespace {

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

constexpr std::array<std::string_view, 12> kKinds{"girl", "boy",  "dog",  "cat", "bird",  "bunny",
                                                  "bear", "frog", "duck", "fox", "mouse", "puppy"};

constexpr std::array<std::string_view, 20> kAdjectives{"happy", "big",   "little", "red",   "blue",  "shiny", "soft",
                                                       "funny", "brave", "quiet",  "tiny",  "green", "yellow", "kind",
                                                       "busy",  "sleepy", "fast",  "old",   "warm",  "bright"};
constexpr std::array<std::string_view, 20> kNouns{"ball", "tree", "cat",  "dog",  "car",  "bird", "house",
                                                  "boat", "flower", "cake", "hat", "box", "park", "fish",
                                                  "star", "toy",  "book", "apple", "kite", "train"};

// ---------------------------------------------------------------- pieces

struct Piece {
  std::string text;
  bool newline_led = false;  // starts with '\n' (no leading space)
  std::vector<int32_t> tokens;
};

/// The tokens a prompt starts with: the tokenizer's BOS, when it has one.
std::vector<int32_t> start_tokens(const Tokenizer& tok) {
  return tok.bos_id() ? std::vector<int32_t>{*tok.bos_id()} : std::vector<int32_t>{};
}

Piece make_piece(const Tokenizer& tok, std::string text, bool newline_led = false) {
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

struct NeedleIn {
  Piece piece;
  std::string role;
  double target = 0.0;
};

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

}  // namespace

std::span<const std::string> TaskGenerator::candidate_names() { return names_list(); }

namespace {

// The training task whose vocabulary and prompt format associative_recall uses.
const Task& recall_task() {
  static const Task t(TrainTaskKind::associative_recall);
  return t;
}

}  // namespace

TaskGenerator::TaskGenerator(const Tokenizer& tokenizer, const Haystack& haystack, const TaskOptions& options)
    : tok_(tokenizer), hay_(haystack), options_(options) {
  if (options.choices < 2 || options.choices > 16)
    fail_field<InvalidArgument>("choices", "must be in [2, 16]", options.choices);
  // associative_recall: map the training vocabulary onto the tokenizer by symbol.
  const auto& symbols = recall_task().symbols();
  if (!tok_.is_symbolic()) {
    recall_error_ = fmt::format(
        "tasks: associative_recall needs a model trained by `posenc train --task associative_recall` (its embedded "
        "symbol vocabulary of {} symbols: k0..k127, 0..9, ?); this tokenizer is a llama2.c BPE vocabulary of {} pieces",
        symbols.size(), tok_.vocab_size());
    return;
  }
  std::unordered_map<std::string_view, int32_t> id_of;
  for (int32_t i = 0; i < tok_.vocab_size(); ++i) id_of.emplace(tok_.piece(i), i);
  std::vector<std::string> missing;
  recall_ids_.assign(symbols.size(), -1);
  for (std::size_t i = 0; i < symbols.size(); ++i) {
    auto it = id_of.find(symbols[i]);
    if (it == id_of.end())
      missing.push_back(symbols[i]);
    else
      recall_ids_[i] = it->second;
  }
  if (!missing.empty()) {
    std::string list;
    for (std::size_t i = 0; i < missing.size() && i < 8; ++i) list += (i ? ", " : "") + missing[i];
    if (missing.size() > 8) list += ", ...";
    recall_error_ = fmt::format(
        "tasks: associative_recall needs the associative-recall vocabulary (posenc train --task associative_recall); "
        "the model's symbol vocabulary ({} symbols) lacks {} of its {} symbols: {}",
        tok_.vocab_size(), missing.size(), symbols.size(), list);
    recall_ids_.clear();
  }
}

TaskSample TaskGenerator::make(std::string_view task, int64_t index, int64_t length, double depth,
                               TaskControl control) const {
  const TaskInfo& info = find_eval_task(task);
  if (index < 0) fail_field<InvalidArgument>("sample index", "must be >= 0", index);
  if (length <= 0) fail_field<InvalidArgument>("length", "must be positive", length);
  if (info.uses_depth && !(depth >= 0.0 && depth <= 1.0)) fail_field<InvalidArgument>("depth", "must be in [0, 1]", depth);
  TaskSample s;
  s.task = std::string(info.name);
  s.control = control;
  s.seed = options_.seed;
  s.index = index;
  s.length = length;
  s.depth = info.uses_depth ? depth : -1.0;
  s.metric = std::string(info.metric);
  s.answer_budget = info.answer_budget;
  if (info.uses_haystack && hay_.size() == 0)
    throw InvalidArgument(fmt::format("haystack: task {} needs a haystack text (--haystack); this one is empty", info.name));
  const uint64_t key = detail::mix(detail::mix(options_.seed, detail::fnv1a64(info.name)), static_cast<uint64_t>(index));
  Rng content(detail::mix(key, 1)), hay_rng(detail::mix(key, 2)), ctl(detail::mix(key, 3));

  if (info.name == "associative_recall") {
    if (!recall_error_.empty()) throw ConfigError(recall_error_);
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
    // Context order: the other pairs in slot order, the queried pair at g.
    const auto g = static_cast<std::size_t>(std::llround(depth * static_cast<double>(m - 1)));
    std::vector<int> ck, cv;
    for (std::size_t j = 1, i = 0; i < m; ++i) {
      const std::size_t slot = i == g ? 0 : j++;
      ck.push_back(keys[slot]);
      cv.push_back(vals[slot]);
    }
    const std::vector<int32_t> train_prompt = ar.recall_prompt(ck, cv, keys[0]);
    s.prompt_tokens.clear();
    for (int32_t t : train_prompt) s.prompt_tokens.push_back(tok_id(t));
    s.prompt_text = ar.text(std::span<const int32_t>(train_prompt).subspan(1));
    s.context_start = 1;
    s.context_tokens = 2 * static_cast<int64_t>(m);
    s.haystack_sentences = static_cast<int64_t>(m);
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
    return s;
  }

  if (info.name == "name_recall") {
    auto names = names_list();
    content.shuffle(names);
    const auto kind = std::string(kKinds[content.uniform(kKinds.size())]);
    const int K = options_.choices;
    std::vector<std::string> cands(names.begin(), names.begin() + K);  // cands[0] = the true name
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
      s.choice_tokens.push_back(tok_.encode(tok_.adds_prefix_space() ? cands[static_cast<std::size_t>(c)]
                                                                        : " " + cands[static_cast<std::size_t>(c)],
                                                   false, false));
      max_tokens = std::max(max_tokens, static_cast<int>(s.choice_tokens.back().size()));
      if (c == named) s.gold = i;
      if (c == 0) s.original_gold = i;
    }
    s.answer_budget = max_tokens;
    const std::string& name = cands[static_cast<std::size_t>(named)];
    std::vector<NeedleIn> needles{
        {make_piece(tok_, fmt::format("There was a little {} named {}.", kind, name)), "evidence", depth}};
    const Piece query = make_piece(tok_, fmt::format("The little {} was named", kind));
    assemble_haystack(start_tokens(tok_), hay_, s, hay_rng, nullptr, std::move(needles), query);
    return s;
  }

  if (info.name == "passkey") {
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
    return s;
  }

  if (info.name.substr(0, 5) == "niah_") {
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
    return s;
  }

  if (info.name == "variable_tracking") {
    auto name5 = [](Rng& r) {
      std::string n;
      for (int i = 0; i < 5; ++i) n += static_cast<char>('A' + r.uniform(26));
      return n;
    };
    std::vector<std::string> names;
    while (names.size() < 5) {
      std::string n = name5(content);
      if (std::find(names.begin(), names.end(), n) == names.end()) names.push_back(std::move(n));
    }
    const std::string value = digits(content, 5);
    const auto original = names;
    if (control == TaskControl::swap) {
      std::vector<std::string> fresh;
      while (fresh.size() < 5) {
        std::string n = name5(ctl);
        if (std::find(original.begin(), original.end(), n) == original.end() &&
            std::find(fresh.begin(), fresh.end(), n) == fresh.end())
          fresh.push_back(std::move(n));
      }
      names = fresh;
    } else if (control == TaskControl::shuffle) {
      for (auto& n : names) n = permuted(n, ctl, name5(ctl));
    }
    s.answers = names;
    s.original_answers = original;
    std::vector<NeedleIn> needles;
    for (std::size_t i = 0; i < names.size(); ++i) {
      const std::string text = i == 0 ? fmt::format("VAR {} = {}.", names[0], value)
                                      : fmt::format("VAR {} = VAR {}.", names[i], names[i - 1]);
      needles.push_back({make_piece(tok_, text), "evidence", evidence_target(depth, i, names.size())});
    }
    const Piece pre = make_piece(tok_, "Memorize and track the chain of variable assignment hidden in the following text.");
    const Piece query = make_piece(
        tok_, fmt::format("Question: Which variables are assigned the value {0}? Answer: The variables assigned the "
                          "value {0} are:",
                          value));
    assemble_haystack(start_tokens(tok_), hay_, s, hay_rng, &pre, std::move(needles), query);
    return s;
  }

  if (info.name == "common_words") {
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
    return s;
  }

  if (info.name == "kv_retrieval") {
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
    return s;
  }
  throw ConfigError(fmt::format("tasks: task '{}' has no generator", info.name));
}

// ---------------------------------------------------------------- scoring

std::string normalize_prediction(std::string_view p) {
  std::string s(p);
  for (char& c : s)
    if (static_cast<unsigned char>(c) < 0x20) c = '\n';
  std::size_t b = 0, e = s.size();
  while (b < e && is_space(s[b])) ++b;
  while (e > b && is_space(s[e - 1])) --e;
  return s.substr(b, e - b);
}

GenerationScore score_generation(std::string_view metric, std::string_view prediction,
                                 std::span<const std::string> answers) {
  GenerationScore g;
  if (answers.empty()) throw InvalidArgument("score_generation: no answers");
  auto lower = [](std::string s) {
    for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    return s;
  };
  const std::string pred = lower(normalize_prediction(prediction));
  if (metric == "all") {
    int found = 0;
    for (const auto& a : answers) found += pred.find(lower(a)) != std::string::npos ? 1 : 0;
    g.score = static_cast<double>(found) / static_cast<double>(answers.size());
    g.correct = found == static_cast<int>(answers.size());
    return g;
  }
  if (metric == "first_integer") {
    std::size_t b = 0;
    while (b < pred.size() && !std::isdigit(static_cast<unsigned char>(pred[b]))) ++b;
    std::size_t e = b;
    while (e < pred.size() && std::isdigit(static_cast<unsigned char>(pred[e]))) ++e;
    g.correct = e > b && pred.substr(b, e - b) == answers[0];
    g.score = g.correct ? 1.0 : 0.0;
    return g;
  }
  throw InvalidArgument(fmt::format("metric: unknown generation metric '{}' (known: all, first_integer)", metric));
}

}  // namespace posenc
