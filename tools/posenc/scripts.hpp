// Running the plotting scripts under scripts/ (matplotlib, Agg backend).
#pragma once

#include <string>
#include <vector>

namespace posenc::cli {

/// Runs `python3 <POSENC_SCRIPTS_DIR>/<script> args...` with MPLBACKEND=Agg
/// (interpreter: $POSENC_PYTHON, else /usr/bin/python3 where Debian's
/// matplotlib is, else python3; $POSENC_SCRIPTS_DIR overrides the directory). Throws IoError if the script is missing or exits non-zero.
void run_script(const std::string& script, const std::vector<std::string>& args);

/// The git commit of the source tree the CLI was built from, or "" if unknown.
std::string source_git_hash();

}  // namespace posenc::cli
