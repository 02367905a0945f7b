// Shared helpers of the CLI subcommands.
#pragma once

#include <cstdint>
#include <cstdio>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "posenc/error.hpp"
#include "posenc/gguf.hpp"
#include "posenc/model.hpp"
#include "posenc/tokenizer.hpp"
#include "posenc/train.hpp"

namespace posenc::cli {

/// --model / --tokenizer and the positional overrides (--config, --rope-theta,
/// --rope-layout, --angle-precision, --trained-context) and --quantized-matmul,
/// shared by every command that runs the model.
struct ModelArgs {
  std::string model_path;
  std::string tokenizer_path;
  std::string config_path;  // --config: config.json or a bare rope_scaling object
  std::optional<double> rope_theta;
  std::string rope_layout;  // empty = the loader's
  std::string angle_precision = "float32";
  std::optional<int64_t> trained_context;
  std::string quantized_matmul = "dequantize";
  std::string dense_matmul = "float32";
  /// No tokenizer needed (check-cache without --text feeds token ids): a model that brings none loads with an
  /// empty LoadedModel::tokenizer and tokenizer_source "" instead of "--tokenizer: required". A --tokenizer given
  /// is still loaded and checked.
  bool tokenizer_optional = false;
  // Bounds on positions (issue 16 finding 4): --max-position N makes a position id > N a PositionError (exit 1);
  // load_model installs the warning printed once past the trained context x the rope_scaling factor.
  std::optional<int64_t> max_position;
  /// --kv-dtype (commands that build a KV cache: generate, ppl, eval, serve, check-cache): f32, f16 or bf16,
  /// applied by load_model with Model::set_kv_cache_dtype.
  std::string kv_dtype = "f32";
  /// The model flags. `runs_model` false (convert, which only reads and writes weights) leaves out the flags of
  /// running it: --quantized-matmul and --max-position (convert listed both and ignored them).
  void add_to(CLI::App& cmd, bool runs_model = true);
  void add_kv_dtype_to(CLI::App& cmd);
};

/// The position warning of this process (Model::set_position_warning, installed by load_model: printed once to
/// stderr as "posenc: warning: ..."), as JSON for a command's --json output: null when positions stayed inside
/// trained_position_bound, else {position, bound, trained_context, factor, message}.
nlohmann::json position_warning_json();

/// kernel_info() as JSON for a command's --json output: {dense_kernel, q8_kernel, decode_plan_dense,
/// decode_plan_blocks (null when no decode with a plan runs), threads}.
nlohmann::json kernels_json();

struct LoadedModel {
  Model model;
  Tokenizer tokenizer;
  std::string tokenizer_source;        ///< the file, or "bundled: ...", or "" (none: ModelArgs::tokenizer_optional)
  std::vector<std::string> overrides;  ///< one line per applied override
};

/// A tokenizer file by its content: a directory holding tokenizer.json, a
/// tokenizer.json (JSON text), or a llama2.c tokenizer. Throws posenc::Error.
Tokenizer load_tokenizer_file(const std::string& path);

/// Loads the model (any format) and its tokenizer (--tokenizer, else the one
/// the model brings), checks that the tokenizer's ids fit the model, applies
/// the positional overrides. Throws posenc::Error.
LoadedModel load_model(const ModelArgs& args);

/// Prints the model's provenance (format, weights, layout and why, trained
/// context and its source, tokenizer, overrides) to `out`, one item a line.
void print_model_header(std::FILE* out, const LoadedModel& m, const ModelArgs& args);

/// A bad flag value found after CLI11 parsed the command line (a list item
/// that is not a length, a length out of range): a usage error, exit 2 like the
/// values CLI11's validators refuse. Bad file contents stay ConfigError & co.,
/// exit 1.
class UsageError : public ConfigError {
 public:
  using ConfigError::ConfigError;
};

/// Runs f, turning a ConfigError about flag values (from a library parser of a
/// flag's text, or a check of flag values only) into a UsageError (exit 2).
template <class F>
auto as_usage_error(F&& f) -> decltype(f()) {
  try {
    return f();
  } catch (const UsageError&) {
    throw;
  } catch (const ConfigError& e) {
    throw UsageError(e.what());
  }
}

/// Exit codes (README "Exit codes", `posenc --help`): 0 success; 2 the command
/// line is rejected (unknown, renamed or missing option, a flag value
/// malformed or out of its range, an empty list item, an output path that is a
/// directory, in a directory that does not exist, or not writable); 1
/// everything found in the inputs while running (a file missing, unreadable,
/// not a regular file, or with bad contents; a check that failed).
inline constexpr const char* kExitCodeRule =
    "Exit codes: 0 success; 2 the command line is rejected (unknown, renamed or missing option, a flag value "
    "malformed or out of its range, an empty list item or value, a flag the model cannot take, an output path that "
    "is a directory or an existing non-regular file, in a directory that does not exist, or not writable); 1 a problem found in the inputs while running (a file missing, unreadable, "
    "not a regular file, or with bad contents) or a failed check.";

/// The environment variables posenc reads (`posenc --help`'s footer).
inline constexpr const char* kEnvironment =
    "Environment: OMP_NUM_THREADS (threads; empty runs as unset, after libgomp's own warning; not a count, or past "
    "the bound, exits 2 before the command runs); "
    "POSENC_DENSE_KERNEL=reference|avx2|avx512 and POSENC_Q8_KERNEL=reference|avx2|avx512_vnni|amx (ask for a "
    "matrix-product path; the same bits on every path); POSENC_DECODE_STREAMS=2|4|8|16[:prefetch[=BYTES]] (how the "
    "AVX-512 and AVX2 decodes read a matrix: runs of rows side by side, software-prefetched BYTES ahead (1024 when not given) "
    "or not; default by CPU vendor, family and dtype; the same bits). A path or plan this CPU cannot run, or an unknown "
    "value, is reported on stderr once and the default runs. Plots: POSENC_PYTHON (the interpreter; default "
    "/usr/bin/python3), POSENC_SCRIPTS_DIR (the plot scripts; default the build's or installed scripts/).";

/// The conventions every subcommand follows (README "Command-line conventions", `posenc --help`).
inline constexpr const char* kCliConvention =
    "Conventions: output files are --json FILE / --csv FILE ('-' = stdout, which then carries only that output; "
    "files are written atomically into an existing directory); --out DIR creates the directory. Lists are "
    "comma-separated without empty items; lengths take K = 1024, M = 1048576. One name per concept: --context "
    "(lengths), --rope-scaling / --rope-factor, --max-tokens (new tokens to generate), --scored-tokens (tokens "
    "scored). Text inputs (--text, --haystack, --prompt, --prompt-file) are UTF-8: invalid UTF-8 is refused, naming "
    "the byte offset of the first invalid sequence.";

/// CLI11 check: a decimal integer in [lo, hi] ("must be an integer in [lo, hi] (got 'x')").
/// Used for every integer flag so that -1, 10^20 or INT64_MAX is refused at parse time (exit 2)
/// instead of wrapping, saturating or failing later.
CLI::Validator int_in(int64_t lo, int64_t hi);
/// CLI11 transform for a flag that takes one length in tokens: int_in's check, with K = 1024 and M = 1048576 (either
/// case) as in length lists ("4K" is 4096), the text replaced by the integer; the message names the text as given
/// ("must be an integer in [lo, hi] (got '2M')").
CLI::Validator length_in(int64_t lo, int64_t hi);

/// The most OpenMP threads a command runs with: posenc::max_omp_threads() (threads.hpp).
int max_threads();

/// posenc::check_omp_threads_in_use() before any parallel region runs, its InvalidArgument as a UsageError (exit 2).
void check_thread_environment();
/// --type of convert and random-model: f32, f16, bf16, q8_0 or q4_0, in any case (another value: exit 2 naming them).
void add_weight_type_option(CLI::App& cmd, std::string& type);
/// The GgmlType of a value add_weight_type_option took.
GgmlType weight_type_of(const std::string& type);

/// CLI11 check: a value that must be given when the option is (CLI11 reads --opt '' as "not set").
CLI::Validator non_empty();
/// CLI11 check: a seed, a decimal integer in [0, 2^64 - 1] ("-1" would wrap to 2^64 - 1).
CLI::Validator seed_value();
/// CLI11 check: a finite number in [lo, hi] (nan, inf and out-of-range values refused).
CLI::Validator finite_in(double lo, double hi);
/// CLI11 check: a finite number > lo and <= hi.
CLI::Validator finite_above(double lo, double hi);

/// --rope-factor's range, [1e-6, 1e6]: the upper bound is config.json's (config_limits::kMaxRopeFactor); below the
/// lower one the scaled inverse frequencies overflow float32 (--rope-factor 1e-300 passed the flag's check and
/// failed later as "inv_freq[0]: must be finite", exit 1, naming no flag).
inline constexpr double kMinRopeFactorFlag = 1e-6;
inline constexpr double kMaxRopeFactorFlag = 1e6;
/// --rope-theta's range: from float32's smallest normal number (the reference forms inv_freq in float32, where a
/// smaller base is 0 or subnormal and its powers overflow) to 1e30.
inline constexpr double kMinRopeThetaFlag = 1.17549435082228750797e-38;  // std::numeric_limits<float>::min()
inline constexpr double kMaxRopeThetaFlag = 1e30;

/// A text input the help documents as UTF-8 (--text, --haystack, --prompt-file): read_file, then require_utf8
/// naming "<flag> <path>" and the byte offset of the first invalid sequence (InvalidArgument, exit 1). The
/// tokenizers take any bytes, each as its reference does, so three formats of one model gave three different token
/// streams for the same bytes; the CLI holds its inputs to what it documents.
std::string read_text_input(const std::string& path, const std::string& flag);

/// A text given on the command line (--prompt): UsageError (exit 2) naming `flag` and the byte offset when it is
/// not valid UTF-8.
void require_utf8_flag(const std::string& text, const std::string& flag);
/// CLI11 check of the same, while the command line is parsed (before any model is loaded).
CLI::Validator utf8_value();

/// --prompt TEXT / --prompt-file FILE (read with read_file: a regular file, no size limit below 4 GiB): the
/// command-line limit of 128 KiB per argument does not bound a prompt. Exactly one is required when
/// `required`.
struct PromptArgs {
  std::string prompt;
  std::string prompt_file;
  CLI::Option* prompt_option = nullptr;
  CLI::Option* file_option = nullptr;
  void add_to(CLI::App& cmd, bool required);
  bool given() const;
  /// The prompt text (the file's contents for --prompt-file), checked to be UTF-8. Throws IoError naming the file,
  /// InvalidArgument for a file that is not UTF-8, UsageError for such a --prompt.
  std::string text() const;
};

/// Parses "256,512,4K,1M" (K = 1024, M = 1048576) into integers in [lo, hi] (the range the command takes: ppl's
/// windows [2, 1048576], eval's lengths [8, 1048576]). Throws UsageError "<flag>: a length must be an integer in
/// [lo, hi] (got '<item>')" for an item out of that range, or naming a malformed or empty item (split_list).
std::vector<int64_t> parse_lengths(const std::string& text, const std::string& flag, int64_t lo = 1,
                                   int64_t hi = int64_t{1} << 40);

/// CLI11 check of a length list (parse_lengths with [lo, hi]) while the command line is parsed, so a length out of
/// the command's range is refused once, with the one message of parse_lengths, before anything is loaded.
CLI::Validator lengths_in(const std::string& flag, int64_t lo, int64_t hi);

/// The window lengths `posenc ppl --context` and detect-layout take (evaluate_perplexity's range).
inline constexpr int64_t kMinWindow = 2;
inline constexpr int64_t kMaxWindow = int64_t{1} << 20;

/// Splits "a,b,c" into its items (surrounding blanks trimmed). Throws UsageError naming `flag` when the text is
/// empty or an item is ("256,,512", "default,": a typo that must not shrink the list silently).
std::vector<std::string> split_list(const std::string& text, const std::string& flag);

/// CLI11 check for an output option, run while the command line is parsed so
/// a bad path fails before any work. A FILE (`directory` = false): not an
/// existing directory, and its parent directory must exist and be writable
/// (no directory is created for a file: `--json /nonexistdir/x.json` names
/// /nonexistdir). A DIR (`directory` = true): an existing directory must be
/// writable; a missing one is created with its missing parents, so its nearest
/// existing ancestor must be a writable directory.
/// A FILE that exists must be a regular file (or a symlink to one): a device, FIFO or socket would be replaced
/// by the atomic rename. "-" is refused unless `stdout_ok` (the --json / --csv options of add_output_option).
CLI::Validator output_path(bool directory = false, bool stdout_ok = false);

/// The --steps / --lr / --batch-size / --curriculum options a task recipe yields to: a field
/// the user gave explicitly is removed from the recipe.
struct RecipeFlags {
  CLI::Option* steps = nullptr;
  CLI::Option* lr = nullptr;
  CLI::Option* batch_size = nullptr;
  CLI::Option* curriculum = nullptr;
  TaskRecipe without_explicit(TaskRecipe recipe) const;
};

/// Adds --curriculum (TrainConfig::curriculum; must be a number) bound to
/// `value`; `scope` is appended to its help text (e.g. "(every task)").
CLI::Option* add_curriculum_option(CLI::App* cmd, double& value, const std::string& scope = "");

/// An output file option, `--json FILE` / `--csv FILE` on every command: the value is required, "-" writes to
/// stdout, anything else is a file written atomically whose parent directory must exist (output_path). A bare
/// `--json` (the old switch of inspect/periods, the old optional value of check-cache/detect-layout) is refused
/// naming the new form. `what` describes the contents for --help. Bound to `target` ("" = not given).
CLI::Option* add_output_option(CLI::App* cmd, const std::string& name, std::string& target, const std::string& what);
/// `--json FILE` (add_output_option).
CLI::Option* add_json_option(CLI::App* cmd, std::string& target, const std::string& what = "the result as JSON");
/// Writes `text` where an output option's `target` says: nothing for "", stdout for "-" (the data stream of a
/// live StdoutForData), else the file, atomically. Throws IoError naming the file.
void write_output(const std::string& target, std::string_view text);
/// write_output of `j` as indented JSON and a newline.
void emit_json(const std::string& target, const nlohmann::json& j);
void emit_json(const std::string& target, const nlohmann::ordered_json& j);

/// Throws UsageError naming both flags when two of `targets` (output options' values, "" = not given, "-" =
/// stdout) are the same file (`ppl --json X --plot X`).
void distinct_outputs(const std::vector<std::string>& targets, const std::vector<std::string>& names);

/// distinct_outputs, then true when one of `targets` (output options' values) is "-". Two or more "-" is a UsageError naming their flags
/// (`names[i]` is the flag of `targets[i]`): stdout carries one output.
bool output_to_stdout(const std::vector<std::string>& targets, const std::vector<std::string>& names);

/// While alive, when one of `targets` is "-" (output_to_stdout): stdout carries only that output, and what the
/// command prints on stdout otherwise (the ppl table, generated text) goes to stderr.
class StdoutForData {
 public:
  StdoutForData(const std::vector<std::string>& targets, const std::vector<std::string>& names);
  ~StdoutForData();
  StdoutForData(const StdoutForData&) = delete;
  StdoutForData& operator=(const StdoutForData&) = delete;
  /// True when one output goes to stdout.
  bool active() const { return saved_fd_ >= 0; }

 private:
  int saved_fd_ = -1;
};

/// A flag that was renamed or removed: hidden from --help; its use (with or without a value) is a usage error
/// (exit 2) saying what to write instead, e.g. add_renamed_option(cmd, "--lengths", "renamed --context").
void add_renamed_option(CLI::App* cmd, const std::string& old_name, const std::string& instead);

/// The options of `cmd` that ->required() marks (REQUIRED in --help) but that `sub`, a subcommand sharing `cmd`
/// (`eval report`, `study report`), does not need: they stop being required once `sub` is on the command line.
void not_required_with(CLI::App* sub, const std::vector<CLI::Option*>& options);

/// "posenc 0.1.0 (git 1a2b3c4d, v0.1.0-12-g1a2b3c4d)": the CMake project version and the commit the build was
/// configured from ("unknown" outside a git checkout).
std::string version_text();

/// `name` is a RoPE scaling of the registry or "native"; else a UsageError naming `flag` and the known names.
void check_rope_scaling_name(const std::string& name, const std::string& flag = "--rope-scaling");

/// A window length past a learned-absolute model's position table: UsageError naming `flag`, the length and the
/// table size (check-cache's --length, ppl's and eval's --context). Other families: nothing.
void check_learned_table(const Model& model, const std::string& model_path, int64_t length, const std::string& flag);

/// --rope-factor given for a model without RoPE: UsageError "--rope-factor: the model has no RoPE (alibi
/// positions)".
void check_rope_factor_applies(const Model& model, const std::optional<double>& rope_factor);

/// One-line description of the model and its positional setup.
std::string describe(const Model& model);

/// A tokenizer that cannot be used (Tokenizer::usable): TokenizerError with its reason, which names its file and
/// says what to pass instead; `bundled` (the model's own) leads it with "the tokenizer this model brings cannot be
/// used: ".
void require_usable_tokenizer(const Tokenizer& tok, bool bundled);

}  // namespace posenc::cli
