// Running the plotting scripts under scripts/ (matplotlib, Agg backend).
#pragma once

#include <string>
#include <vector>

namespace posenc::cli {

/// Runs `python3 <POSENC_SCRIPTS_DIR>/<script> args...` with MPLBACKEND=Agg
/// (POSENC_PYTHON overrides the interpreter, POSENC_SCRIPTS_DIR the directory
/// at run time). Throws IoError if the script is missing or exits non-zero.
void run_script(const std::string& script, const std::vector<std::string>& args);

/// The git commit of the source tree the CLI was built from, or "" if unknown.
std::string source_git_hash();

}  // namespace posenc::cli
