// posenc — the synthetic long-context tasks of the evaluation lab.
//
// Every sample is a deterministic function of (seed, task, sample index,
// length, depth, control): the same arguments give byte-identical prompt
// tokens on every run and machine (the generator uses its own splitmix64
// stream, not the implementation-defined std:: distributions).
//
// Haystack tasks (RULER's niah.py / variable_tracking.py, the YaRN/landmark
// passkey, name_recall) fill the context with real text cut at sentence
// boundaries and insert needle sentences at requested depths. The content
// of a sample (needle values, names, keys, the haystack's starting sentence)
// depends only on (seed, task, index), so it stays fixed while only the
// length and the depth move; a longer length continues the same haystack.
//
// Token budget: prompt tokens + answer budget <= length, counted with the real
// tokenizer. A prompt is the concatenation of pieces encoded separately
// (BOS, then sentences/needles/records that each start with a space or a
// newline); the llama2.c vocabularies hold no piece with an inner space or a
// newline, so no merge crosses a piece boundary and the concatenation equals
// Tokenizer::encode(prompt_text, bos=true) exactly (tested for every task).
// This makes the count exact without re-encoding, and lets prompts that share
// a prefix share its KV cache. Not so for a BPE whose pieces end in the space
// marker and that has no pre-tokenizer (TinyStories-656K's tokenizer.json:
// "the▁", "▁and▁"): there a merge would cross a piece boundary,
// so the prompt decodes to prompt_text exactly but its segmentation is not
// encode(prompt_text)'s (tested; the count is still what the model reads).
//
// Depth = the needle's start as a fraction of the context (the haystack region
// between the preamble and the question). The needle goes to the sentence
// boundary whose haystack-token offset is nearest to depth x haystack tokens
// (ties: the earlier boundary). Each sample records the realised depth =
// (needle start - context start) / (context tokens - needle tokens) and the
// needle's token position in the prompt (RULER's token_position_answer).
//
// associative_recall runs a model trained by `posenc train --task
// associative_recall` (train.hpp) on the lab's grid: no haystack and no
// natural text; its prompt is the training format `<bos> k3 7 k12 1 ... ? k3`
// in the model's own symbol vocabulary (the ids are looked up by symbol in
// the tokenizer, which must hold every symbol of
// Task(TrainTaskKind::associative_recall).symbols(), synthetic_tasks.hpp). The context is m
// key-value pairs (records) with m = min(floor((length - 4) / 2), 128): BOS,
// 2m pair tokens, "?", the query key and a one-token answer budget fit in the
// length. Keys are distinct (a per-sample permutation of k0..k127), values
// drawn uniformly from 0..9 per pair, both fixed per (seed, index) so a
// longer length appends pairs. The queried pair goes to record index
// g = round(depth x (m - 1)) (kv_retrieval's rule), the other pairs keep their
// order; realised depth = g / (m - 1). Scored as forced choice: candidates =
// the queried value and K-1 other values, taken first from the values other
// keys hold in the context (first occurrence in pair order), then from the
// rest of 0..9 in a per-sample order; K <= 10.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "posenc/error.hpp"
#include "posenc/tokenizer.hpp"

namespace posenc {

/// Splits one block of text into sentences: a sentence ends after '.', '!' or
/// '?' (plus any closing quotes/brackets) when followed by whitespace and then
/// by something other than a lowercase letter (so `"Hi!" said Tom.` stays one
/// sentence), or at the end of the block. Runs of whitespace (newlines
/// included) become one space; sentences are stripped; empty ones dropped.
std::vector<std::string> split_sentences(std::string_view block);

/// The haystack: real text as a list of sentences with their tokens.
class Haystack {
 public:
  /// Splits `text` into blocks (the ppl protocol's step 1) and each block into
  /// sentences. Sentences containing an ASCII digit or one of `exclude_words`
  /// (whole words, case-sensitive) are dropped, so numeric answers and the
  /// candidate names of name_recall never occur in the haystack by accident.
  /// Each sentence is encoded as it appears after a space in running text.
  /// Throws InvalidArgument if no sentence remains.
  static Haystack build(std::string_view text, const Tokenizer& tokenizer,
                        std::span<const std::string> exclude_words = {});

  std::size_t size() const { return texts_.size(); }
  const std::string& text(std::size_t i) const { return texts_.at(i); }
  /// Tokens of sentence i (no BOS; starts with the space-prefixed first word).
  std::span<const int32_t> tokens(std::size_t i) const;
  int64_t total_tokens() const { return static_cast<int64_t>(tokens_.size()); }
  /// Sentences dropped by the filters.
  int64_t dropped() const { return dropped_; }
  /// The distinct all-lowercase words of 3-10 letters of the kept sentences,
  /// sorted (common_words draws its word lists from them).
  const std::vector<std::string>& words() const { return words_; }

 private:
  std::vector<std::string> texts_;
  std::vector<int32_t> tokens_;      // all sentences, concatenated
  std::vector<int64_t> offsets_;     // [size()+1] into tokens_
  int64_t dropped_ = 0;
  std::vector<std::string> words_;
};

/// The evidence controls (design: "shuffle or swap the evidence and check the
/// answer changes accordingly"). The gold answer always follows the evidence.
///  - swap: the answer-bearing value of the evidence is exchanged with a
///    distractor's (name_recall: the needle names the first distractor
///    candidate; niah_multikey and kv_retrieval: the queried key takes a
///    distractor key's value; associative_recall: the queried key's value is
///    exchanged with that of the first other pair holding a different value,
///    a fresh value if none does); tasks without distractors get a fresh value.
///  - shuffle: the answer-bearing value is shuffled (name_recall: the needle
///    names a random distractor; numbers/hex strings/variable names: their
///    characters are permuted into a different string; niah multi-key tasks:
///    values are permuted among the keys; associative_recall: the values are
///    permuted among all pairs of the context, redrawn until the queried key's
///    value changes, which breaks every key->value binding learned in training).
///  - absent (forced-choice tasks only; the runner adds it by itself, one cell
///    per task x scaling x length, no depth axis): the same sample with the
///    evidence removed (name_recall: no needle; associative_recall: the queried
///    pair keeps its slot and value but its key is one absent from the rest of
///    the context - with all keys in use, the key of the last other pair, which
///    is dropped - so every candidate value is as present in the context as
///    without the control), same candidates, gold = the index
///    the uncontrolled sample's gold has. Nothing in the prompt points to the
///    gold, so its accuracy measures the chance level of the task x model x
///    scoring (1/K for an unbiased scoring).
/// Every control sample also records the original (uncontrolled) answer, so a
/// report can show whether the prediction moved with the evidence.
enum class TaskControl { none, swap, shuffle, absent };
std::string_view to_string(TaskControl control);
/// Throws ConfigError naming `field` for an unknown name.
TaskControl parse_task_control(std::string_view text, std::string_view field = "control");

/// Thrown by TaskGenerator::make when a length cannot hold a task's fixed
/// parts (preamble, needles, question) plus its answer budget: with a
/// 512-token vocabulary several RULER templates need more than 256 tokens.
/// The runner records such cells as "does not fit" instead of failing.
/// associative_recall also throws it for lengths above 260 tokens: its 128
/// distinct keys cannot fill more.
class TaskDoesNotFit : public InvalidArgument {
 public:
  using InvalidArgument::InvalidArgument;
};

enum class TaskKind {
  choice,      ///< likelihood (forced choice), lm-evaluation-harness multiple_choice
  generation,  ///< greedy continuation scored by string match
};

struct TaskInfo {
  std::string_view name;
  TaskKind kind;
  bool uses_depth;        ///< false: the depth axis does not apply (one cell per length)
  bool uses_haystack;     ///< false: built without the haystack text (no --haystack needed)
  std::string_view metric;  ///< primary metric: "acc_norm" (forced choice), "all" (RULER string_match_all),
                            ///< "first_integer" (YaRN passkey)
  int answer_budget;      ///< tokens reserved after the prompt (generation: max_new_tokens)
  std::string_view summary;
};

/// All tasks, in a stable order: name_recall, passkey, niah_single,
/// niah_multikey, niah_multivalue, niah_multiquery, variable_tracking,
/// common_words, kv_retrieval, associative_recall.
std::span<const TaskInfo> eval_tasks();
/// Throws ConfigError("tasks: unknown task ... (known: ...)").
const TaskInfo& find_eval_task(std::string_view name);

/// Where one needle landed.
struct NeedlePlacement {
  std::string role;        ///< "evidence" (holds the answer) or "distractor"
  std::string text;
  double target_depth = 0.0;
  int64_t sentence_index = 0;  ///< haystack sentences (or records) before it
  int64_t token_position = 0;  ///< index of its first token in prompt_tokens
  int64_t tokens = 0;
  double depth = 0.0;          ///< realised depth (see the file comment)
};

struct TaskSample {
  std::string task;
  TaskControl control = TaskControl::none;
  uint64_t seed = 0;
  int64_t index = 0;
  int64_t length = 0;
  double depth = 0.0;  ///< requested; -1 for tasks without a depth axis

  std::vector<int32_t> prompt_tokens;  ///< BOS first; what the model reads
  std::string prompt_text;             ///< encode(prompt_text, bos) == prompt_tokens
  int64_t context_start = 0;           ///< first token of the context region
  int64_t context_tokens = 0;          ///< its length (haystack + needles, or records)
  int64_t haystack_start = -1;         ///< first haystack sentence index (-1: no haystack)
  int64_t haystack_sentences = 0;      ///< haystack sentences (or records) used
  std::vector<NeedlePlacement> needles;
  int answer_budget = 0;               ///< prompt_tokens.size() + answer_budget <= length

  // Forced choice: candidates (continuations of the prompt) and the gold index.
  std::vector<std::string> choices;               ///< as text, with their leading space
  std::vector<std::vector<int32_t>> choice_tokens;
  /// [choices] UTF-8 bytes of each candidate without its leading delimiter
  /// space (candidate_bytes): acc_norm's divisor.
  std::vector<int64_t> choice_bytes;
  /// name_recall: every candidate has the same token count and byte length, so
  /// acc and acc_norm pick the same candidate (false when the name pool holds
  /// no K such names under this tokenizer); true for associative_recall.
  bool equal_length_choices = false;
  int gold = -1;
  int original_gold = -1;  ///< gold of the same sample without the control

  // Generation: every string of `answers` must occur in the prediction.
  std::vector<std::string> answers;
  std::vector<std::string> original_answers;
  std::string metric;
};

struct TaskOptions {
  uint64_t seed = 42;
  int choices = 4;  ///< K candidates for forced-choice tasks, in [2, 16]
};

/// Makes samples from one haystack. Thread-safe (const).
class TaskGenerator {
 public:
  /// Throws InvalidArgument for choices outside [2, 16]. `haystack` may be
  /// empty (Haystack{}) when only tasks with uses_haystack = false are made.
  TaskGenerator(const Tokenizer& tokenizer, const Haystack& haystack, const TaskOptions& options);

  /// Sample `index` of `task` at `length` tokens and `depth` in [0, 1] (ignored
  /// by tasks without a depth axis). Throws ConfigError for an unknown task,
  /// InvalidArgument for depth outside [0, 1], TaskDoesNotFit for a length too
  /// short to hold the task's fixed parts and answer budget (naming the task
  /// and both numbers), InvalidArgument for a haystack task on an empty
  /// haystack. associative_recall: ConfigError naming the task and the missing
  /// symbols if the tokenizer lacks the associative-recall vocabulary,
  /// InvalidArgument if choices > 10 (it has 10 values).
  TaskSample make(std::string_view task, int64_t index, int64_t length, double depth,
                  TaskControl control = TaskControl::none) const;

  /// The names name_recall draws its candidates from (to filter a haystack).
  static std::span<const std::string> candidate_names();

  const TaskOptions& options() const { return options_; }

 private:
  const Tokenizer& tok_;
  const Haystack& hay_;
  TaskOptions options_;
  // associative_recall: tokenizer id of each symbol of the training task's
  // vocabulary (index = the task's id), or why the tokenizer cannot run it.
  std::vector<int32_t> recall_ids_;
  std::string recall_error_;
};

// ---------------------------------------------------------------- scoring (src/eval/tasks/scoring.cpp)

/// The forced-choice metrics, as lm-evaluation-harness multiple_choice:
///  - "acc": argmax of the summed log-probability of the candidate's tokens;
///  - "acc_norm": argmax of that sum divided by the candidate's length in UTF-8
///    bytes without the delimiter space (lm-eval divides by len(choice), the
///    characters, which equal bytes for the ASCII candidates here). Not biased
///    towards candidates with fewer tokens; the primary metric.
/// Ties go to the first candidate.
inline constexpr std::string_view kChoiceMetrics[] = {"acc_norm", "acc"};

/// Bytes of a candidate text without one leading space.
int64_t candidate_bytes(std::string_view choice);

struct ChoiceScore {
  int acc = -1;       ///< predicted index under "acc"
  int acc_norm = -1;  ///< predicted index under "acc_norm"
  int predicted(std::string_view metric) const;  ///< by metric name; InvalidArgument for another name
};

/// logprobs [K] summed log-probabilities (nats), bytes [K] candidate_bytes.
/// Throws InvalidArgument for empty or different-sized inputs or a byte
/// length < 1.
ChoiceScore score_choice(std::span<const double> logprobs, std::span<const int64_t> bytes);

/// RULER's prediction normalisation: strip surrounding whitespace, control
/// characters (0x00-0x1F) become '\n'.
std::string normalize_prediction(std::string_view prediction);

struct GenerationScore {
  bool correct = false;
  double score = 0.0;  ///< fraction of answers found (RULER string_match_all per sample)
};

/// Scores a greedy continuation. metric "all": case-insensitive substring
/// match of every answer in the normalised prediction (correct = all found;
/// score = fraction found; RULER string_match_all). "first_integer": the
/// first run of ASCII digits in the prediction equals answers[0] (YaRN /
/// landmark passkey). Throws InvalidArgument for another metric.
GenerationScore score_generation(std::string_view metric, std::string_view prediction,
                                 std::span<const std::string> answers);

}  // namespace posenc
