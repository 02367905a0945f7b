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
// types never appear in this header. Part of posenc::train (built with
// -DPOSENC_WITH_TRAIN=ON); the tasks, their sampler and the exact-match
// evaluation are posenc::core's (synthetic_tasks.hpp).
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "posenc/model.hpp"
#include "posenc/synthetic_tasks.hpp"

namespace posenc {

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

}  // namespace posenc
