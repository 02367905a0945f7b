// posenc — the version of the library.
#pragma once

#include <string_view>

namespace posenc {

/// The version of the posenc library linked into the program, "MAJOR.MINOR.PATCH" (e.g. "0.1.0"): the CMake
/// project version (`project(posenc VERSION ...)` in the root CMakeLists.txt) it was built with. The same string
/// is the version of the installed CMake package (posencConfigVersion.cmake, so `find_package(posenc 0.1)`
/// checks it) and the first word after "posenc " in `posenc --version`. Static storage; never throws.
std::string_view version() noexcept;

}  // namespace posenc
