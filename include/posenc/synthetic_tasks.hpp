// posenc — the synthetic tasks of the length-generalization study (copy,
// reverse, addition, sort, associative recall; Kazemnejad et al., "The Impact
// of Positional Encoding on Length Generalization in Transformers", NeurIPS
// 2023), their deterministic sampler, the names of the encodings compared, and
// exact-match evaluation of a model on them with the posenc runtime.
//
// Part of posenc::core (no libtorch): the evaluation lab's associative_recall
// task (tasks.hpp) draws its prompts from Task, and a model trained by
// `posenc train` (posenc::train, train.hpp) is evaluated here.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "posenc/family.hpp"
#include "posenc/model.hpp"

namespace posenc {

// ---- deterministic sampling -------------------------------------------------

/// SplitMix64 (Steele, Lea & Flood 2014): the same stream on every platform
/// and standard library, unlike std::uniform_int_distribution.
class SampleRng {
 public:
  explicit SampleRng(uint64_t seed) : state_(seed) {}
  uint64_t next();
  /// Uniform in [0, n) by rejection (no modulo bias). Throws InvalidArgument for n == 0.
  uint64_t below(uint64_t n);

 private:
  uint64_t state_;
};

/// A stream seed derived from a seed and labels (FNV-1a of the labels mixed
/// with the seed through SplitMix64), so training data, evaluation data and
/// each (task, length) get independent streams.
uint64_t derive_seed(uint64_t seed, std::string_view label, int64_t index = 0);

// ---- tasks --------------------------------------------------------------------

/// The synthetic tasks. Every sample is prompt = <bos> input... <sep> and
/// answer = output... <eos>; the length of a sample is the number of input
/// tokens (after <bos>, before <sep>). associative_recall has no separator.
///  - copy:               input x1..xn (letters a..z), output x1..xn.
///  - reverse:            input x1..xn, output xn..x1.
///  - addition:           input a "+" b with a, b decimal digit strings written
///                        least-significant digit first (lengths ceil((n-1)/2) and
///                        floor((n-1)/2), leading zeros allowed), output a+b
///                        least-significant first with max(len a, len b)+1
///                        digits (the last is the carry, possibly 0). n >= 3.
///  - sort:               input x1..xn (letters a..z), output sorted ascending.
///  - associative_recall: input k1 v1 ... km vm "?" kq with distinct keys
///                        (k0..k127) and values (digits 0..9), kq one of the
///                        keys; output its value. n = 2m + 2, even, 4 <= n <= 256.
///                        The prompt ends with the query key (no separator), so
///                        the lookup is the induction pattern "find the earlier
///                        occurrence of this token, emit what followed it"; with a
///                        separator after kq, no encoding learned the task in our
///                        runs (the query key would first have to be fetched from
///                        the previous position).
/// The separator is "=" for addition and ">" for copy, reverse and sort.
enum class TrainTaskKind { copy, reverse, addition, sort, associative_recall };
inline constexpr TrainTaskKind kTrainTaskKinds[] = {TrainTaskKind::copy, TrainTaskKind::reverse, TrainTaskKind::addition,
                                                    TrainTaskKind::sort, TrainTaskKind::associative_recall};
std::string_view to_string(TrainTaskKind kind);
/// Parses the names above. Throws ConfigError naming `field` and the value.
TrainTaskKind parse_task_kind(std::string_view text, std::string_view field = "--task");

struct TrainSample {
  std::vector<int32_t> prompt;  ///< <bos>, input tokens, separator (none for associative_recall)
  std::vector<int32_t> answer;  ///< output tokens, then <eos>
  int input_length = 0;
};

/// A training sequence: every token the model reads, plus the last one, with
/// the answer tokens (the loss targets) marked.
struct TrainingSequence {
  std::vector<int32_t> tokens;
  std::vector<uint8_t> is_answer;  ///< [tokens.size()]: 1 where the token is an answer token
};

class Task {
 public:
  explicit Task(TrainTaskKind kind);
  TrainTaskKind kind() const { return kind_; }
  std::string_view name() const { return to_string(kind_); }
  /// The vocabulary: "<pad>", "<bos>", "<eos>", then the task's symbols
  /// (Tokenizer::from_symbols accepts it).
  const std::vector<std::string>& symbols() const { return symbols_; }
  int vocab_size() const { return static_cast<int>(symbols_.size()); }
  /// Whether a sample with n input tokens exists.
  bool valid_length(int n) const;
  /// The largest valid length <= n (0 if none).
  int round_length(int n) const;
  /// Valid lengths in [lo, hi], ascending.
  std::vector<int> lengths_in(int lo, int hi) const;
  /// Tokens of the answer (with <eos>) for input length n.
  int answer_length(int n) const;
  /// Positions a model reads to produce the whole answer of a length-n sample:
  /// prompt + answer - 1 (the final <eos> is never fed back).
  int64_t positions_needed(int n) const;
  /// One sample with exactly n input tokens, drawn from `rng`.
  /// Throws InvalidArgument if n is not a valid length.
  TrainSample sample(SampleRng& rng, int n) const;
  /// A training sequence for input length n: sample(rng, n) as prompt +
  /// answer; for associative_recall with `queries` > 1, min(queries, m) - 1
  /// further blocks "? kq v <eos>" follow, each querying another key of the
  /// same context (multi-query associative recall, MQAR: Arora et al. 2023,
  /// "Zoology"), so one context supervises several lookups. The prefix up to
  /// the first <eos> is exactly sample(rng, n). Other tasks ignore `queries`.
  TrainingSequence training_sequence(SampleRng& rng, int n, int queries = 1) const;
  /// Positions a model reads for training_sequence(n, queries) (tokens - 1).
  int64_t training_positions(int n, int queries = 1) const;
  /// Whitespace-separated symbols of `tokens` (for messages and prompts).
  std::string text(std::span<const int32_t> tokens) const;

  /// associative_recall's vocabulary layout: ids (indices into symbols()) of
  /// the keys k0..k{keys-1}, the values "0".."9" and the query mark "?".
  /// Throws InvalidArgument for any other task.
  struct RecallVocabulary {
    int32_t first_key = 0;
    int keys = 0;
    int32_t first_value = 0;
    int values = 0;
    int32_t query = 0;
  };
  RecallVocabulary recall_vocabulary() const;
  /// The associative_recall prompt in this task's ids: <bos>, then key_i value_i
  /// for each pair, then "?" and the query key (no separator; what sample()
  /// produces). Keys are indices in [0, keys), values in [0, values).
  /// Throws InvalidArgument for another task, mismatched sizes or an index
  /// out of range (naming it).
  std::vector<int32_t> recall_prompt(std::span<const int> keys, std::span<const int> values, int query_key) const;

 private:
  TrainTaskKind kind_;
  std::vector<std::string> symbols_;
  int32_t sep_ = 0;
  int32_t first_symbol_ = 3;  // first letter / digit / key id
  int32_t query_ = 0;         // associative recall "?"
  int32_t plus_ = 0;          // addition "+"
  int32_t first_value_ = 0;   // associative recall: first value id
};

// ---- positional encodings of the trainer --------------------------------------

/// The encodings compared (CLI names in parentheses):
///  - nope (nope), learned absolute (learned), sinusoidal absolute (sinusoidal),
///    T5 relative bias (t5), ALiBi (alibi), RoPE on every channel (rope) and
///    RoPE on 25% of each head's channels (rope25; Kazemnejad et al. rotate
///    rotary_dim = head_dim/4, GPT-J pairing = RopeLayout::interleaved).
enum class TrainEncoding { nope, learned, sinusoidal, t5, alibi, rope, rope25 };
std::string_view to_string(TrainEncoding pe);
/// Parses the CLI names. Throws ConfigError naming `field` and the value.
TrainEncoding parse_train_encoding(std::string_view text, std::string_view field = "--pe");
PositionFamily family_of(TrainEncoding pe);

/// An inclusive range of input lengths, written "lo:hi" (or "lo:hi:step" for
/// test lengths; step defaults to 8 there).
struct LengthRange {
  int lo = 8;
  int hi = 32;
  int step = 8;
  bool operator==(const LengthRange&) const = default;
};
/// Parses "lo:hi" or "lo:hi:step" (1 <= lo <= hi <= 4096, step >= 1).
/// Throws ConfigError naming `field`.
LengthRange parse_length_range(std::string_view text, std::string_view field, int default_step = 8);

// ---- evaluation with the runtime ----------------------------------------------

/// Exact-match accuracy of greedy decoding at one input length.
struct ExactMatchCell {
  int input_length = 0;
  int64_t samples = 0;
  int64_t correct = 0;
  bool can_run = true;   ///< false: the model cannot process this length (learned table)
  std::string note;      ///< why it cannot run (the PositionError message)
  double accuracy() const { return samples > 0 ? static_cast<double>(correct) / static_cast<double>(samples) : 0.0; }
};

struct ExactMatchOptions {
  std::vector<int> lengths;        ///< input lengths (each rounded down to a valid one)
  int samples = 100;               ///< per length
  uint64_t seed = 1;               ///< evaluation data stream (independent of training data)
  /// RoPE scaling applied per length through rope_setup_for_context with
  /// trained context = max_position_embeddings and context =
  /// positions_needed(length): "default" (none), "linear", "ntk", "yarn",
  /// "dynamic" (recomputed per forward; cached keys re-rotated), ...
  std::string rope_scaling = "default";
  int batch = 128;                 ///< sequences decoded together
};

/// Greedy decoding with the posenc runtime (KV cache, batched): a sample is
/// correct iff the generated tokens equal the answer, <eos> included. Decoding
/// of a sample stops at its first wrong token (the outcome is then decided).
/// A learned table too short for a length is recorded as can_run = false with
/// the PositionError message. Throws InvalidArgument if the model's vocabulary
/// does not match the task's, or a scaling is given for a non-RoPE model.
std::vector<ExactMatchCell> evaluate_exact_match(const Model& model, const Task& task,
                                                 const ExactMatchOptions& options);

/// Greedy continuation of `prompt` by the runtime (at most max_new tokens,
/// stopping after <eos>), for tests and inspection.
std::vector<int32_t> greedy_answer(const Model& model, std::span<const int32_t> prompt, int max_new);

}  // namespace posenc
