// The task registry: every task's description and its builder, and the
// generator that dispatches to them.
#include "posenc/tasks.hpp"

#include <algorithm>
#include <array>
#include <cctype>
#include <cmath>
#include <set>

#include <fmt/format.h>

#include "eval/tasks/task_kit.hpp"
#include "posenc/error.hpp"
#include <unordered_map>
#include "posenc/synthetic_tasks.hpp"

namespace posenc {

using namespace detail::tasks;

namespace {

constexpr std::array kTasks{
    TaskInfo{"name_recall", TaskKind::choice, true, true, "acc_norm", 0,
             "needle 'There was a little <kind> named <Name>.' at the depth; the prompt ends 'The little <kind> was "
             "named'; candidates = the name + K-1 other common TinyStories names absent from the context, of the same "
             "token count and byte length as the name when the pool holds K such names; acc_norm (log-prob / bytes) "
             "and acc (summed log-prob)"},
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
    TaskInfo{"associative_recall", TaskKind::choice, true, false, "acc_norm", 1,
             "the trained associative-recall format in the model's own vocabulary (posenc train --task "
             "associative_recall): '<bos> k3 7 k12 1 ... ? kq', m = min((length-4)/2, 128) pairs with distinct keys, "
             "the queried pair at index round(depth x (m-1)); forced choice: the queried value vs K-1 other values "
             "held by other keys in the context (K <= 10); no haystack"},
};

// The builder of kTasks[i] (same order).
constexpr std::array<TaskBuilder, kTasks.size()> kBuilders{
    build_name_recall, build_passkey, build_niah,         build_niah,         build_niah,
    build_niah,        build_variable_tracking, build_common_words, build_kv_retrieval, build_associative_recall};

}  // namespace

std::span<const TaskInfo> eval_tasks() { return kTasks; }

const TaskInfo& find_eval_task(std::string_view name) {
  for (const auto& t : kTasks)
    if (t.name == name) return t;
  std::string known;
  for (const auto& t : kTasks) known += (known.empty() ? "" : ", ") + std::string(t.name);
  throw ConfigError(fmt::format("tasks: unknown task '{}' (known: {})", name, known));
}

std::span<const std::string> TaskGenerator::candidate_names() { return names_list(); }

TaskGenerator::TaskGenerator(const Tokenizer& tokenizer, const Haystack& haystack, const TaskOptions& options)
    : tok_(tokenizer), hay_(haystack), options_(options) {
  if (options.choices < 2 || options.choices > 16)
    fail_field<InvalidArgument>("choices", "must be in [2, 16]", options.choices);
  // associative_recall: map the training vocabulary onto the tokenizer by symbol.
  const auto& symbols = detail::tasks::recall_task().symbols();
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
  if (control == TaskControl::absent && info.kind != TaskKind::choice)
    throw InvalidArgument(fmt::format("control: absent measures the chance level of forced-choice tasks; task {} is "
                                      "scored by generation",
                                      info.name));
  if (index < 0) fail_field<InvalidArgument>("sample index", "must be >= 0", index);
  if (length <= 0) fail_field<InvalidArgument>("length", "must be positive", length);
  if (info.uses_depth && !(depth >= 0.0 && depth <= 1.0)) fail_field<InvalidArgument>("depth", "must be in [0, 1]", depth);
  TaskSample s;
  s.task = std::string(info.name);
  s.control = control;
  s.seed = options_.seed;
  s.index = index;
  s.length = length;
  s.depth = info.uses_depth && control != TaskControl::absent ? depth : -1.0;
  s.metric = std::string(info.metric);
  s.answer_budget = info.answer_budget;
  if (info.uses_haystack && hay_.size() == 0)
    throw InvalidArgument(fmt::format("haystack: task {} needs a haystack text (--haystack); this one is empty", info.name));
  const uint64_t key = detail::mix(detail::mix(options_.seed, detail::fnv1a64(info.name)), static_cast<uint64_t>(index));
  TaskContext x{tok_, hay_, options_, recall_ids_, recall_error_, info, key,
                Rng(detail::mix(key, 1)), Rng(detail::mix(key, 2)), Rng(detail::mix(key, 3))};
  kBuilders[static_cast<std::size_t>(&info - kTasks.data())](x, s, s.depth < 0 ? 0.0 : depth, control);
  for (const auto& c : s.choices) s.choice_bytes.push_back(candidate_bytes(c));
  return s;
}

}  // namespace posenc
