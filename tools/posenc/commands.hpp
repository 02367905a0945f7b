// The `posenc` CLI: one add_*_command per subcommand (one .cpp each). The CLI
// is thin: it parses flags into the library's typed values and calls it.
#pragma once

#include <CLI/CLI.hpp>

namespace posenc::cli {

// Each registers its subcommand on `app`; the subcommand's callback does the work
// and throws posenc::Error (printed by main, exit 1) on bad input.
void add_ppl_command(CLI::App& app);
void add_generate_command(CLI::App& app);
void add_detect_layout_command(CLI::App& app);
void add_check_cache_command(CLI::App& app);
void add_inspect_command(CLI::App& app);
void add_periods_command(CLI::App& app);
void add_decay_command(CLI::App& app);
void add_eval_command(CLI::App& app);
void add_train_command(CLI::App& app);
void add_study_command(CLI::App& app);
void add_tokenize_command(CLI::App& app);
void add_convert_command(CLI::App& app);
void add_random_model_command(CLI::App& app);
void add_serve_command(CLI::App& app);
void add_verify_command(CLI::App& app);
void add_precision_command(CLI::App& app);

}  // namespace posenc::cli
