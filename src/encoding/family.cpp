#include "posenc/family.hpp"

#include <fmt/format.h>

#include "posenc/error.hpp"

namespace posenc {

namespace {
constexpr PositionFamily kAll[] = {PositionFamily::nope,    PositionFamily::learned_absolute, PositionFamily::sinusoidal,
                                   PositionFamily::t5_bias, PositionFamily::alibi,            PositionFamily::rope,
                                   PositionFamily::mrope};
}

std::string_view to_string(PositionFamily family) {
  switch (family) {
    case PositionFamily::nope: return "nope";
    case PositionFamily::learned_absolute: return "learned_absolute";
    case PositionFamily::sinusoidal: return "sinusoidal";
    case PositionFamily::t5_bias: return "t5_bias";
    case PositionFamily::alibi: return "alibi";
    case PositionFamily::rope: return "rope";
    case PositionFamily::mrope: return "mrope";
  }
  return "?";
}

PositionFamily parse_position_family(std::string_view text, std::string_view field) {
  for (PositionFamily f : kAll)
    if (to_string(f) == text) return f;
  throw ConfigError(fmt::format(
      "{}: unknown positional family '{}' (known: nope, learned_absolute, sinusoidal, t5_bias, alibi, rope, mrope)",
      field, text));
}

}  // namespace posenc
