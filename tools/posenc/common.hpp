// Shared helpers of the CLI subcommands.
#pragma once

#include <cstdint>
#include <cstdio>
#include <optional>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

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
  void add_to(CLI::App& cmd);
};

struct LoadedModel {
  Model model;
  Tokenizer tokenizer;
  std::string tokenizer_source;        ///< the file, or "bundled: ..."
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

/// Parses "256,512,4K,1M" (K = 1024, M = 1048576) into positive integers.
/// Throws ConfigError naming `flag`.
std::vector<int64_t> parse_lengths(const std::string& text, const std::string& flag);

/// Splits "a,b,c" into its non-empty items. Throws ConfigError naming `flag` if empty.
std::vector<std::string> split_list(const std::string& text, const std::string& flag);

/// CLI11 check for an output option, run while the command line is parsed so
/// a bad path fails before any work: the path must not be an existing
/// directory (a file) or must be one (a directory, `directory` = true), and its
/// nearest existing ancestor must be a writable directory (missing parent
/// directories are created when the output is written).
CLI::Validator output_path(bool directory = false);

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

/// `--json [FILE]`: alone (or with "-") prints one JSON object on stdout; with
/// a file name writes it there atomically. Bound to `target` ("" = not given).
CLI::Option* add_json_option(CLI::App* cmd, std::string& target);
/// Writes `j` as add_json_option's `target` says.
void emit_json(const std::string& target, const nlohmann::json& j);

/// One-line description of the model and its positional setup.
std::string describe(const Model& model);

}  // namespace posenc::cli
