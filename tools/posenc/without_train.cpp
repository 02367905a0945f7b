// posenc train / posenc study in a build without the training part (-DPOSENC_WITH_TRAIN=OFF, no libtorch):
// the subcommands exist so that calling them says why they do nothing, instead of "unknown subcommand".
// Compiled only in that configuration (the root CMakeLists.txt swaps it for train.cpp and study.cpp).
#include <string>

#include <fmt/format.h>

#include "commands.hpp"
#include "common.hpp"

namespace posenc::cli {

namespace {

/// A subcommand that accepts any arguments and fails with a usage error (exit 2) naming the build option.
void add_unavailable_command(CLI::App& app, const std::string& name, const std::string& what) {
  CLI::App* cmd = app.add_subcommand(name, what + " (not in this build: configure with -DPOSENC_WITH_TRAIN=ON)");
  cmd->allow_extras();
  cmd->prefix_command();  // everything after the name, flags included, is left unparsed
  cmd->callback([name] {
    throw UsageError(fmt::format("{}: this posenc was built without the training part; reconfigure with "
                                 "-DPOSENC_WITH_TRAIN=ON (needs libtorch, Debian libtorch-dev) to use `posenc {}`",
                                 name, name));
  });
}

}  // namespace

void add_train_command(CLI::App& app) {
  add_unavailable_command(app, "train",
                          "Train a tiny Transformer on a synthetic task (libtorch) and save it as a posenc checkpoint");
}

void add_study_command(CLI::App& app) {
  add_unavailable_command(
      app, "study", "Length-generalization study: train every (task, encoding, seed), evaluate by length (resumable)");
}

}  // namespace posenc::cli
