// posenc — checked 64-bit integer arithmetic for sizes read from files and flags.
//
// Every size a config, checkpoint header or command-line flag gives is combined
// through these helpers: the result is computed in int64 with the compiler's
// overflow builtins, and an overflow (or a result outside the caller's range)
// throws E naming the field and the operands instead of wrapping (signed
// overflow is undefined behaviour; a wrapped size is a wrong allocation).
#pragma once

#include <cstdint>
#include <string_view>

#include <fmt/format.h>

namespace posenc {

/// a + b; throws E("<field>: <a> + <b> overflows int64") on overflow.
template <class E>
int64_t checked_add(int64_t a, int64_t b, std::string_view field) {
  int64_t r = 0;
  if (__builtin_add_overflow(a, b, &r)) throw E(fmt::format("{}: {} + {} overflows int64", field, a, b));
  return r;
}

/// a * b; throws E("<field>: <a> × <b> overflows int64") on overflow.
template <class E>
int64_t checked_mul(int64_t a, int64_t b, std::string_view field) {
  int64_t r = 0;
  if (__builtin_mul_overflow(a, b, &r)) throw E(fmt::format("{}: {} × {} overflows int64", field, a, b));
  return r;
}

/// `value` when it lies in [lo, hi], else throws E("<field>: must be in [lo, hi] (got value)").
template <class E>
int64_t checked_range(int64_t value, int64_t lo, int64_t hi, std::string_view field) {
  if (value < lo || value > hi) throw E(fmt::format("{}: must be in [{}, {}] (got {})", field, lo, hi, value));
  return value;
}

}  // namespace posenc
