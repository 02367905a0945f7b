// posenc::version(): the CMake project version, given by the build as POSENC_VERSION_STRING.
#include "posenc/version.hpp"

#ifndef POSENC_VERSION_STRING
#error "POSENC_VERSION_STRING (the CMake PROJECT_VERSION) must be defined when compiling src/core/version.cpp"
#endif

namespace posenc {

std::string_view version() noexcept { return POSENC_VERSION_STRING; }

}  // namespace posenc
