// Internal: the building blocks every task family uses (pieces, haystack
// assembly, value generators, word lists) and the registry's builder type.
// Not installed; included by src/eval/tasks/*.cpp only.
#pragma once

#include <array>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "eval/rng.hpp"
#include "posenc/synthetic_tasks.hpp"
#include "posenc/tasks.hpp"
#include "posenc/tokenizer.hpp"

namespace posenc::detail::tasks {

using detail::Rng;

bool is_space(char c);

// The training task whose vocabulary and prompt format associative_recall uses (one instance, built on first use;
// TaskGenerator maps its symbols onto the tokenizer, build_associative_recall draws from it).
const Task& recall_task();

// Common TinyStories names (name_recall's candidate pool).
const std::vector<std::string>& names_list();

inline constexpr std::array<std::string_view, 12> kKinds{"girl", "boy",  "dog",  "cat", "bird",  "bunny",
                                                         "bear", "frog", "duck", "fox", "mouse", "puppy"};
inline constexpr std::array<std::string_view, 20> kAdjectives{
    "happy", "big",  "little", "red",  "blue", "shiny",  "soft", "funny", "brave", "quiet",
    "tiny",  "green", "yellow", "kind", "busy", "sleepy", "fast", "old",   "warm",  "bright"};
inline constexpr std::array<std::string_view, 20> kNouns{"ball", "tree", "cat",  "dog", "car", "bird", "house",
                                                         "boat", "flower", "cake", "hat", "box", "park", "fish",
                                                         "star", "toy",  "book", "apple", "kite", "train"};

/// A piece of a prompt: text and its tokens, encoded on its own (see tasks.hpp).
struct Piece {
  std::string text;
  bool newline_led = false;  // starts with '\n' (no leading space)
  std::vector<int32_t> tokens;
};

/// The tokens a prompt starts with: the tokenizer's BOS, when it has one.
std::vector<int32_t> start_tokens(const Tokenizer& tok);
Piece make_piece(const Tokenizer& tok, std::string text, bool newline_led = false);
void append(TaskSample& s, const Piece& p);
void append_sentence(TaskSample& s, const Haystack& hay, std::size_t h);

struct NeedleIn {
  Piece piece;
  std::string role;
  double target = 0.0;
};

[[noreturn]] void too_short(const TaskSample& s, int64_t fixed);
void finish_placements(TaskSample& s);
/// The haystack tasks' common assembly: BOS, preamble, haystack sentences with
/// the needles at their depths, query.
void assemble_haystack(const std::vector<int32_t>& start_ids, const Haystack& hay, TaskSample& s, Rng& hay_rng,
                       const Piece* preamble, std::vector<NeedleIn> needles, const Piece& query);
double evidence_target(double d, std::size_t j, std::size_t n);
std::string digits(Rng& r, int n);
std::string hex8(Rng& r);
std::string permuted(const std::string& s, Rng& r, const std::string& fresh);
std::string join_and(const std::vector<std::string>& v);

/// What a task builder gets: the generator's state and the sample's streams
/// (1 content, 2 haystack, 3 control; keyed by (seed, task, index)).
struct TaskContext {
  const Tokenizer& tok;
  const Haystack& hay;
  const TaskOptions& options;
  std::span<const int32_t> recall_ids;  ///< associative_recall: tokenizer id per training symbol
  const std::string& recall_error;      ///< why the tokenizer cannot run associative_recall ("" = it can)
  const TaskInfo& info;
  uint64_t key;
  Rng content, hay_rng, ctl;
};

/// Fills `s` (task, index, length, depth, metric, answer budget already set).
using TaskBuilder = void (*)(TaskContext& x, TaskSample& s, double depth, TaskControl control);

// One builder per task, by family (src/eval/tasks/<family>.cpp).
// recall.cpp
void build_name_recall(TaskContext& x, TaskSample& s, double depth, TaskControl control);
void build_associative_recall(TaskContext& x, TaskSample& s, double depth, TaskControl control);
// retrieval.cpp
void build_passkey(TaskContext& x, TaskSample& s, double depth, TaskControl control);
void build_niah(TaskContext& x, TaskSample& s, double depth, TaskControl control);
void build_kv_retrieval(TaskContext& x, TaskSample& s, double depth, TaskControl control);
// tracking.cpp
void build_variable_tracking(TaskContext& x, TaskSample& s, double depth, TaskControl control);
// aggregation.cpp
void build_common_words(TaskContext& x, TaskSample& s, double depth, TaskControl control);

}  // namespace posenc::detail::tasks
