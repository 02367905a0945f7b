// posenc — the long-context evaluation lab: tasks x lengths x depths x RoPE
// scalings on a real model, with Wilson intervals, effective context,
// controls, a perplexity matrix, resumable/shardable runs and reports.
//
// Protocol (what a number in summary.json means):
//  - A cell is (task, control, rope_scaling, length, depth); its n samples are
//    sample indices 0..n-1 of tasks.hpp's generator (content fixed per index).
//  - Forced-choice tasks are scored like lm-evaluation-harness multiple_choice,
//    both ways (tasks.hpp score_choice): acc = argmax of each candidate's
//    summed log-probability of its tokens after the prompt, acc_norm = argmax
//    of that sum / the candidate's UTF-8 bytes (first on ties). acc_norm is the
//    primary metric (a cell's correct/accuracy/ci_*): acc favours candidates
//    with fewer tokens. The prompt is prefilled once; each candidate runs on a
//    KV-cache fork of it.
//  - Chance is measured, not assumed: every forced-choice task also runs the
//    control "absent" (the evidence removed; one cell per task x scaling x
//    length), whose accuracy is the chance level of that task x model x
//    metric. The effective context's gate ("the short baseline beats chance
//    significantly") compares the baseline's Wilson lower bound with the upper
//    Wilson bound of that measured level, pooled over the run's lengths.
//  - Generation tasks: greedy decoding (argmax, lowest id on ties) of at most
//    the task's answer budget of tokens, stopping at BOS/EOS; scored by
//    score_generation() (RULER's string_match_all, YaRN's first integer for
//    passkey). A sample is correct when every gold string is matched.
//  - Encodings: rope_setup_for_context(model, trained context, scaling, L,
//    --rope-factor) with L = the cell's length; methods whose frequencies
//    depend on the sequence length (dynamic) are frozen at seq_len = L for the
//    whole sample (prompt, candidates and generated tokens), so every cached
//    key and every query use one rotation.
//  - Prompts of one sample at several depths share their common prefix
//    through KV-cache forks (they differ only from the earliest needle on).
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "posenc/json_file.hpp"
#include "posenc/model.hpp"
#include "posenc/stats.hpp"
#include "posenc/tasks.hpp"
#include "posenc/tokenizer.hpp"

namespace posenc {

// ---------------------------------------------------------------- scoring one sample

/// What the model did on one sample.
struct SampleOutcome {
  // forced choice
  std::vector<double> logprobs;  ///< [choices] summed log-probability (nats) of each candidate
  int predicted = -1;            ///< prediction under the primary metric (acc_norm)
  int predicted_acc = -1;        ///< prediction under acc (argmax of logprobs)
  bool correct_acc = false;      ///< predicted_acc == gold
  // generation
  std::vector<int32_t> new_tokens;
  int64_t generated_tokens = -1;  ///< eval --endpoint: the server's usage.completion_tokens (new_tokens stays empty)
  std::string prediction;  ///< decoded continuation
  double score = 0.0;      ///< fraction of gold strings matched (1/0 for choice)
  bool correct = false;    ///< under the primary metric
  bool kept_original = false;  ///< (controls) the prediction matches the uncontrolled answer
};

/// The RoPE setup used for a cell: rope_setup_for_context() at `length`, with
/// length-dependent methods frozen at seq_len = length (see the file comment).
RopeSetup eval_rope_setup(const Model& model, std::string_view rope_scaling, int64_t length,
                          std::optional<double> rope_factor);

/// Runs `samples` through `model` (its current RopeSetup) on the calling
/// thread, sharing the KV cache of common prompt prefixes between consecutive
/// samples (best when they are one sample index at increasing depths).
/// Throws InvalidArgument if a prompt plus its answer budget exceeds the
/// sample's length or a candidate list is empty, NumericError for logits that
/// are not finite (as score_candidates and greedy_continue).
std::vector<SampleOutcome> evaluate_samples(const Model& model, const Tokenizer& tokenizer,
                                            std::span<const TaskSample> samples);

/// The outcome of a forced-choice sample from its candidates' summed
/// log-probabilities (nats, [choices], the order of s.choices): acc and
/// acc_norm predictions by score_choice, correct under both, kept_original.
/// The scoring of evaluate_samples, shared by the endpoint client. Throws
/// InvalidArgument when logprobs does not hold one value per candidate.
SampleOutcome choice_outcome(const TaskSample& s, std::vector<double> logprobs);

/// The outcome of a generation sample from its decoded continuation:
/// score_generation against s.answers (and s.original_answers for controls).
/// new_tokens is left empty (the caller fills it when it has the ids).
SampleOutcome generation_outcome(const TaskSample& s, std::string prediction);

/// Forced choice on a prompt whose last-token logits are `last_logits` and
/// whose KV state is sequence `seq` of `cache`: summed log-probabilities of
/// each candidate (one fork of `seq` per multi-token candidate, one batched
/// forward for all of them). `seq` is left unchanged. Throws NumericError
/// naming the row (the context's last position, or a candidate and its token)
/// when logits are not finite (float32 overflowed in the model).
std::vector<double> score_candidates(const Model& model, KvCache& cache, KvCache::SeqId seq,
                                     std::span<const float> last_logits,
                                     std::span<const std::vector<int32_t>> candidates);

/// Greedy continuation of sequence `seq` whose last-token logits are given:
/// at most max_new_tokens, stopping before any of `stop_ids` (the tokenizer's
/// BOS and EOS). Appends to `seq`. Throws NumericError naming the step when
/// the logits are not finite.
std::vector<int32_t> greedy_continue(const Model& model, KvCache& cache, KvCache::SeqId seq,
                                     std::vector<float> last_logits, int max_new_tokens,
                                     std::span<const int32_t> stop_ids);

// ---------------------------------------------------------------- runs

/// The range of an eval length (EvalConfig::lengths, `posenc eval --context`).
inline constexpr int64_t kMinEvalLength = 8;
inline constexpr int64_t kMaxEvalLength = int64_t{1} << 20;

struct EvalConfig {
  std::string model_path;
  std::string tokenizer_path;
  std::string haystack_path;
  std::vector<std::string> tasks;
  std::vector<int64_t> lengths;        ///< strictly increasing after normalisation
  /// The lengths are the defaults (default_eval_lengths, the CLI without --context): those longer than the
  /// perplexity text are left out of the perplexity matrix with a note (stderr, run.json config.ppl_note); lengths
  /// asked for (false) longer than the text are refused (InvalidArgument naming the length and the token count),
  /// as `posenc ppl` does. The task cells run at every length either way.
  bool default_lengths = false;
  std::vector<double> depths;          ///< in [0, 1], sorted, distinct
  int64_t samples = 50;
  std::vector<std::string> rope_scalings{"default"};
  /// eval --endpoint: rope_scalings holds the endpoints' labels (scaling is the
  /// server's business), each one path component of [A-Za-z0-9._-].
  bool scaling_labels = false;
  std::optional<double> rope_factor;
  std::vector<TaskControl> controls{TaskControl::none};
  uint64_t seed = 42;
  int choices = 4;
  double threshold = 0.85;     ///< effective context: accuracy >= threshold x baseline
  double min_baseline = 0.0;   ///< also required of the baseline (besides beating chance significantly)
  int64_t ppl_tokens = 32768;  ///< perplexity matrix: tokens per (scaling, length); -1 = skip, 0 = whole text
  int shard_index = 0;
  int shard_count = 1;
  bool log_prompts = false;    ///< samples.jsonl also holds each prompt's text
  std::filesystem::path out;   ///< the run goes to out/<run_id>/
  std::string command_line;    ///< for run.json
  std::string git_hash;        ///< for run.json (empty = unknown)
};

/// The default --lengths of a model trained at T tokens (Model::trained_context):
/// T/2, T, 2T, 4T, 8T, each at least 8 (the lab's minimum), distinct; for a
/// learned absolute table (family learned_absolute) the lengths past the table
/// (config max_position_embeddings) are dropped, since the table has no row for
/// them. Throws InvalidArgument for T < 1.
std::vector<int64_t> default_eval_lengths(const Model& model);

/// The default --tasks for `tokenizer`: associative_recall when it holds that
/// task's symbol vocabulary (a `posenc train --task associative_recall` model),
/// else name_recall (natural text; needs --haystack). Throws ConfigError for a
/// symbol vocabulary of another training task, naming it: no eval task reads
/// its symbols.
std::vector<std::string> default_eval_tasks(const Tokenizer& tokenizer);

/// Checks and normalises (sorts lengths/depths, rejects duplicates, unknown
/// tasks/scalings, samples < 1, bad shard). Throws ConfigError naming the flag.
void validate_eval_config(EvalConfig& config);

/// The run id: 16 hex digits of a hash of every argument that changes a
/// result (contents of model/tokenizer/haystack files, tasks, lengths, depths,
/// samples, scalings, rope factor, controls, seed, choices, ppl tokens,
/// RoPE layout and angle precision, the task generator version). Not hashed:
/// --shard, --out, --threshold/--min-baseline (they only change the summary,
/// which is recomputed), --log-prompts.
std::string eval_run_id(const EvalConfig& config, const Model& model);

struct EvalProgress {
  int64_t cells_done = 0;     ///< including cells found on disk
  int64_t cells_total = 0;    ///< of this shard
  int64_t ppl_done = 0;       ///< perplexity results (scaling x length) done, including those found on disk
  int64_t ppl_total = 0;      ///< of this shard (they run after the cells)
  int64_t samples_done = 0;   ///< computed by this invocation
  double seconds = 0.0;
  double eta_seconds = -1.0;  ///< -1 = unknown
  std::string current;        ///< the unit in progress
};

struct EvalRunResult {
  std::filesystem::path run_dir;
  std::string run_id;
  int64_t cells_total = 0;     ///< all cells of the run (all shards)
  int64_t cells_present = 0;   ///< on disk after this invocation
  int64_t cells_computed = 0;  ///< by this invocation
  int64_t groups_reused = 0;   ///< groups whose encoding was bit-identical to one computed before
                               ///< (e.g. linear at L <= trained context = default): outcomes reused
  int64_t samples_computed = 0;
  double seconds = 0.0;
};

/// Runs (or resumes) the evaluation: every missing cell of this shard is
/// computed and persisted atomically as cells/<cell>.json the moment its
/// group (one task/control/scaling/length, all depths) finishes; cells already
/// on disk are not redone unless they fail their checks (coordinates, counts,
/// checksum: recomputed, with a warning on stderr naming the file). The run
/// directory is locked (flock on <run dir>/.lock; a second process fails at
/// once with IoError naming it) and stale write_file_atomic temporaries
/// (*.tmp.<pid>.<n>) in it are removed. Then writes samples.jsonl, summary.json,
/// summary.csv, ppl.json and run.json (atomically) from every cell present.
/// The perplexity matrix scores the haystack text at each length the text
/// holds: a length longer than the text is refused before anything is written
/// (InvalidArgument naming the length and the text's token count), or, for
/// default lengths (EvalConfig::default_lengths), left out of the matrix with a
/// note on stderr (run.json config.ppl_lengths, config.ppl_note).
/// `model` carries the base RoPE setup (layout, precision); `haystack_text`
/// is the haystack file's contents. Samples run in parallel over the OpenMP
/// threads (one KV cache per thread). Test-only: the environment variable
/// POSENC_EVAL_TEST_GROUP_DELAY_MS=n pauses n ms after each persisted group.
EvalRunResult run_eval(const Model& model, const Tokenizer& tokenizer, std::string_view haystack_text,
                       EvalConfig config, const std::function<void(const EvalProgress&)>& on_progress = {});

/// The run directory of `dir`: dir itself if it holds run.json, else the run
/// named by dir/LATEST, which must name a direct child (one path component of
/// [A-Za-z0-9._-], not "." or ".."; else DataError naming LATEST). Throws
/// IoError if neither exists.
std::filesystem::path resolve_run_dir(const std::filesystem::path& dir);

/// Recomputes summary.json/summary.csv/samples.jsonl of a run directory from
/// its cell files (e.g. with another threshold). Returns the summary. Every
/// file is checked first (run.json's axes and run id; each cell's and
/// perplexity file's coordinates, counts and checksum): DataError naming the
/// file and key, and nothing is written.
nlohmann::json rebuild_eval_outputs(const std::filesystem::path& run_dir, std::optional<double> threshold = {},
                                    std::optional<double> min_baseline = {});

/// What resuming the run directory `dir` (or the run its LATEST names) would
/// recompute: every cell and perplexity result of run.json's axes that is
/// missing, or present but not what its name says (coordinates, sample count,
/// `correct`, checksum: the checks `eval report` and `eval merge` make), one
/// "<file>: <reason>" each. Throws DataError for a malformed run.json.
std::vector<std::string> eval_resume_plan(const std::filesystem::path& dir);

/// The checksum a cell or perplexity file of a run directory carries in its
/// "checksum" member: "fnv1a64:" + 16 hex digits of the FNV-1a 64 hash of the
/// file's JSON without "checksum", dumped compactly (nlohmann dump(), keys
/// sorted). A file whose checksum does not match was edited or damaged:
/// resume recomputes it, report and merge refuse it.
std::string eval_file_checksum(const nlohmann::json& file);

/// Combines the cell files of several runs of the same run id (shards) into
/// out/<run_id>/ and writes its outputs; the result equals the unsharded run.
/// Throws ConfigError if the run ids differ, IoError on unreadable inputs,
/// InvalidArgument if two inputs hold different results for the same cell,
/// DataError for a run id that is not one path component or a cell or
/// perplexity file that fails its checks (see eval_resume_plan). Holds the
/// output run directory's lock (<out>/<run id>/.lock) while it writes.
std::filesystem::path merge_eval_runs(std::span<const std::filesystem::path> inputs, const std::filesystem::path& out);

/// The report's text table: per (task, control, scaling) the depth-averaged
/// accuracy at each length with its cells' Wilson range, the baseline,
/// threshold and effective context (or "not solvable by this model"), and
/// the controls' follow rates.
std::string format_eval_summary(const nlohmann::json& summary);
/// The same table from a summary read back from disk (summary.json): a
/// malformed summary is a DataError naming the file and key.
std::string format_eval_summary(const JsonView& summary);

}  // namespace posenc
