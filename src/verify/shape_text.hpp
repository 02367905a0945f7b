// Internal: a tensor shape as messages print it ("[2, 16, 64]"), for the dump reader
// (tensor_dump.cpp) and `posenc verify` (verify.cpp).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace posenc::detail {

std::string shape_text(const std::vector<int64_t>& shape);

}  // namespace posenc::detail
