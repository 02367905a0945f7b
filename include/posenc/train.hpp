// posenc — training tiny decoder-only Transformers on synthetic tasks with
// each positional encoding, and measuring their exact-match accuracy by
// input length (the length-generalization study of Kazemnejad et al.,
// "The Impact of Positional Encoding on Length Generalization in
// Transformers", NeurIPS 2023).
//
// The network trained here is exactly the runtime's architecture (model.hpp):
// pre-norm RMSNorm (eps 1e-5), attention with wq/wk/wv/wo [out, in] and no
// biases, softmax scale 1/sqrt(head_dim), SwiGLU w2(silu(w1 x) * w3 x), final
// RMSNorm, untied classifier; so a trained model is saved as a posenc
// checkpoint (checkpoint.hpp) and run by Model::load / `posenc generate`.
// Positions enter through posenc's own kernels (rope.hpp, bias.hpp,
// absolute.hpp) wrapped as autograd functions; training uses libtorch, whose
// types never appear in this header.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

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

// ---- training -----------------------------------------------------------------

struct TrainConfig {
  TrainTaskKind task = TrainTaskKind::copy;
  TrainEncoding pe = TrainEncoding::rope;
  LengthRange train_lengths{8, 32, 1};  ///< input lengths drawn uniformly from the valid ones
  /// associative_recall: queries per training context (Task::training_sequence).
  /// A single query supervises one token per sequence, and RoPE, ALiBi and
  /// learned models all stayed on the "pick any value in the context" plateau
  /// (loss ~0.8) for up to 20000 steps in our runs; with 4 queries RoPE left it
  /// after ~1500 steps, with 8 (and lr 3e-3) after ~700. Evaluation always uses
  /// the single-query format.
  int ar_queries = 8;
  int steps = 3000;
  uint64_t seed = 1;
  int batch_size = 32;
  // Architecture (the runtime's Llama architecture).
  int dim = 64;
  int n_layers = 3;  ///< NoPE needs the third layer for copy (2 layers: 27% at 8 tokens after 3000 steps)
  int n_heads = 4;
  int hidden_dim = 0;  ///< 0 = 2 * dim
  // Encodings.
  double rope_theta = 10000.0;
  double alibi_max_bias = 8.0;
  int t5_num_buckets = 32;
  int t5_max_distance = 128;
  double sinusoidal_base = 10000.0;
  // Optimiser: AdamW (betas 0.9, 0.98; weight decay on matrices only), linear
  // warmup then cosine decay to min_lr_ratio * lr, gradient-norm clipping.
  double lr = 3e-3;  ///< 1e-3 left RoPE copy at 86% exact match at 32 tokens after 3000 steps; 3e-3: 99%
  double weight_decay = 0.01;
  int warmup_steps = 100;
  double min_lr_ratio = 0.1;
  double clip_norm = 1.0;
  /// Length curriculum: over the first `curriculum` fraction of the steps, the
  /// longest input length drawn grows linearly from the shortest valid length
  /// to train_lengths.hi (lengths are drawn uniformly among the valid lengths
  /// up to that bound); afterwards the full range. 0 = off. In [0, 1).
  /// Default 0.5. In the default study (3 seeds, 3000 steps, exact match
  /// pooled over lengths 8-32) it lifted copy for the absolute encodings
  /// (learned 91.5% -> 97.3%, sinusoidal 90.9% -> 98.7%) but cost them reverse
  /// (learned 94.5% -> 78.3%, sinusoidal 90.8% -> 64.4%: the positions near
  /// the end of the context train only in the second half); see
  /// default_recipe for associative recall. Also cheaper: the first half
  /// mostly trains short sequences.
  double curriculum = 0.5;
  /// torch (and OpenMP) threads; results are deterministic for a given
  /// (seed, threads). 0 = leave the current setting. Default 1: at these sizes
  /// a second thread did not make a step faster (24-27 ms/step either way with
  /// OMP_WAIT_POLICY=passive on this 2-core machine), and with OpenMP's default
  /// spin-waiting, 2 threads took 100-260 ms/step whenever another process
  /// used the cores.
  int threads = 1;
  /// Where the posenc checkpoint is written (atomically). Empty = not saved.
  std::filesystem::path out;
};

/// A task's departures from TrainConfig's common defaults: the settings a task
/// needs to be learned within the study's budget. Unset fields keep the
/// common value.
struct TaskRecipe {
  std::optional<double> lr;
  std::optional<int> steps;
  std::optional<int> batch_size;
  std::optional<double> curriculum;  ///< TrainConfig::curriculum
  bool empty() const { return !lr && !steps && !batch_size && !curriculum; }
  bool operator==(const TaskRecipe&) const = default;
};

/// posenc's default recipe for `task` (empty where the common defaults learn
/// it). associative_recall: lr 1e-3 and 6000 steps (with the common length
/// curriculum over the first half).
/// Without a curriculum, models sit on the "emit any value of the context"
/// plateau (loss ~0.65, ~30% exact match) for thousands of steps and whether
/// they leave it is a matter of the seed: with lr 1e-3 and 4000 steps, NoPE
/// reached 97/68/33% (seeds 1/2/3), RoPE 99.5/99.5/30%, learned 28-32% on all
/// three; with the common lr 3e-3 full RoPE, learned and sinusoidal never left
/// it in 3000 steps; 6000 steps without a curriculum left learned (seed 1) at
/// 18-30%. With the length curriculum (3-pair contexts first, the longest
/// length reached half-way) learned seed 1 and RoPE seed 3 both left the
/// plateau near step 2000 (loss 0.3 -> 0.02 by step 2500, 4e-4 at 4500);
/// sinusoidal seed 1 did not by step 3800. In the default study (seeds
/// 1/2/3) this recipe gave T5 100/100/100%, ALiBi 99.5/99.2/99.2%, RoPE
/// 99.8/100/100%, rope25 100/100/100%, learned 100/97.8/32.5%, NoPE
/// 72.8/72.5/73.2% (95-98% with 3 pairs, 50-55% with 15) and sinusoidal
/// 27.8/29.5/30.8% (still on the plateau). Short contexts have few
/// distractors: guessing among 3 values pays less than retrieving, so the
/// retrieval circuit forms first where it is easiest.
TaskRecipe default_recipe(TrainTaskKind task);
/// default_recipe() of every task whose recipe is not empty.
std::map<TrainTaskKind, TaskRecipe> default_recipes();
/// Parses "lr=1e-3,steps=6000,batch-size=16,curriculum=0.5" (any subset, any
/// order) or "none" (the empty recipe). Throws ConfigError naming `field` and
/// the bad entry (unknown key, key given twice, unparsable or out-of-range
/// value: lr in (0, kMaxLr], steps and batch-size >= 1, curriculum in [0, 1)).
TaskRecipe parse_task_recipe(std::string_view text, std::string_view field);
/// "lr=0.001,steps=6000,batch-size=16,curriculum=0.5" (set fields only;
/// "none" if empty).
std::string to_string(const TaskRecipe& recipe);
/// Sets config's lr / steps / batch_size / curriculum from the recipe's set fields.
void apply_recipe(TrainConfig& config, const TaskRecipe& recipe);
/// Overwrites the fields of `into` that `recipe` sets (the others stay).
void merge_recipe(TaskRecipe& into, const TaskRecipe& recipe);
/// The largest learning rate accepted (--lr, recipes): AdamW steps beyond it
/// are meaningless, and torch's float32 optimizer state overflows near 3e38.
inline constexpr double kMaxLr = 10.0;

struct TrainProgress {
  int step = 0;  ///< steps done
  int steps = 0;
  double loss = 0.0;  ///< mean loss over the steps since the last report
  double lr = 0.0;
  double seconds = 0.0;
};

struct TrainResult {
  double seconds = 0.0;              ///< wall time of the training loop
  double final_loss = 0.0;           ///< mean answer-token loss over the last 100 steps (nats)
  int64_t trained_context = 0;       ///< max positions read in training = max_position_embeddings
  int64_t parameters = 0;
  std::vector<std::pair<int, double>> loss_curve;  ///< (step, mean loss of the preceding window)
  std::string metadata_json;         ///< what the checkpoint's metadata holds
};

/// How many of `lengths` (the task's valid training lengths, ascending) the
/// 0-based step `step` draws from under config.curriculum: all of them once
/// step >= curriculum * steps; before that, those up to a bound that grows
/// linearly from lengths.front() (step 0) to lengths.back(), and at least one.
/// 0 for an empty list.
std::size_t curriculum_count(const TrainConfig& config, const std::vector<int>& lengths, int step);

/// Checks the hyper-parameters of `config` (steps, batch size, dimensions,
/// heads dividing dim with an even head_dim, rope25's head_dim multiple of 8,
/// lr, weight decay, warmup, clipping, threads, ar_queries) without training.
/// Throws ConfigError naming the CLI flag and the value.
void validate_train_config(const TrainConfig& config);

/// Trains a model per `config` and, if config.out is set, saves it as a posenc
/// checkpoint with the task's symbols and metadata (task, pe, seed, steps,
/// train_lengths, timing, loss curve). Loss: mean cross-entropy over the
/// answer tokens only (prompt tokens are context, not targets).
/// Deterministic: torch::manual_seed(seed) for the initial weights, a
/// SampleRng stream derived from the seed for the data, fixed thread count.
/// `on_progress` is called every `report_every` steps.
/// Throws ConfigError for bad hyper-parameters (naming the field), IoError on write failure
/// or when the libtorch half of the trainer (libposenc_torch.so, loaded on first use) cannot be loaded.
TrainResult train_model(const TrainConfig& config,
                        const std::function<void(const TrainProgress&)>& on_progress = {},
                        int report_every = 100);

/// The checkpoint config a TrainConfig produces (dimensions, positional setup,
/// max_position_embeddings = trained context).
ModelConfig model_config_for(const TrainConfig& config);
PositionalConfig positional_config_for(const TrainConfig& config);
/// Max positions any training sequence reads (the trained context).
int64_t trained_context_for(const Task& task, LengthRange train_lengths, int ar_queries = 1);

// ---- the BLAS under torch -------------------------------------------------------

/// Debian's OpenBLAS 0.3.21 (DYNAMIC_ARCH) picks slow kernels on recent Xeons:
/// it reports Cooper Lake CPUs as "Cooperlake" but runs generic SSE3-era
/// kernels (OpenBLAS PR #3806 fixed that later), and CPUs it does not know
/// (Emerald Rapids, family 6 model 207) fall back to "Prescott". Either way
/// sgemm runs SSE3 code: a training step of the study's model took 81 ms
/// instead of 35 ms with the SkylakeX (AVX-512) kernels on an Emerald Rapids
/// core. The kernels are chosen when the library loads, from the environment
/// variable OPENBLAS_CORETYPE.
///
/// fast_openblas_coretype(reported) returns the core type to force for the
/// core name the loaded OpenBLAS reported: "SkylakeX" when that name is
/// "Cooperlake" or "Prescott" and the CPU has AVX-512 F/BW/VL/DQ, "Haswell"
/// when it has AVX2 and FMA; nullptr otherwise (nothing to fix).
const char* fast_openblas_coretype(const char* reported);

/// If the loaded OpenBLAS reports a slow core (fast_openblas_coretype) and
/// OPENBLAS_CORETYPE is unset, this sets it (plus OPENBLAS_NUM_THREADS=1, see
/// set_openblas_threads) and re-executes the current program with the same
/// arguments (/proc/self/exe, /proc/self/cmdline); it does not return then.
/// Otherwise (another BLAS, a fast core, variable already set, exec failure)
/// it returns false. Loads the trainer's libtorch module first (OpenBLAS comes
/// with libtorch); throws IoError when it cannot.
bool reexec_for_fast_openblas();

/// openblas_set_num_threads(n) when the loaded BLAS is OpenBLAS (looked up
/// with dlsym); returns whether it was. The trainer uses 1: its matrices are
/// small, and OpenBLAS's own threads would compete with torch's.
bool set_openblas_threads(int n);

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
