// Running the matplotlib scripts under scripts/ (Agg backend). The library
// never spawns processes; the CLI does, here.
#pragma once

#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

namespace posenc::cli {

/// Runs `<python> <scripts dir>/<script> args...` with MPLBACKEND=Agg.
/// Interpreter: $POSENC_PYTHON, else /usr/bin/python3 (where Debian's
/// python3-matplotlib lives; a pyenv/venv python3 earlier on PATH may lack
/// it), else python3. Scripts dir: $POSENC_SCRIPTS_DIR, else <program dir>/
/// ../share/posenc/scripts when it exists (an installed CLI, found through
/// /proc/self/exe), else the source tree's scripts/. The script's output is
/// captured; throws IoError with its last
/// 2000 characters if the script is missing or exits non-zero.
void run_script(const std::string& script, const std::vector<std::string>& args);

/// Writes `data_json` to a temporary file, runs `script data.json out_png`,
/// removes the temporary file. The scripts write the PNG to a temporary file
/// next to out_png and rename it, so out_png is never partial.
void run_plot(const std::string& script, std::string_view data_json, const std::filesystem::path& out_png);

/// The git commit of the source tree the CLI was built from ($POSENC_SCRIPTS_DIR/.., else the
/// build's source directory; never the installed share/posenc), or "" if unknown.
std::string source_git_hash();

}  // namespace posenc::cli
