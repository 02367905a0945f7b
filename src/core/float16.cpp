// IEEE binary16 and bfloat16 conversions (see include/posenc/float16.hpp).
#include "posenc/float16.hpp"

#include <bit>
#include <cstdint>

namespace posenc {

float f16_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (mant << 13);  // inf, or NaN with its payload
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (mant << 13);  // rebias 15 -> 127
  } else if (mant == 0) {
    bits = sign;  // +-0
  } else {
    // Subnormal half mant * 2^-24: normalize into a float32 normal.
    exp = 113;
    while ((mant & 0x400u) == 0) {
      mant <<= 1;
      --exp;
    }
    bits = sign | (exp << 23) | ((mant & 0x3ffu) << 13);
  }
  return std::bit_cast<float>(bits);
}

float bf16_to_f32(uint16_t h) { return std::bit_cast<float>(static_cast<uint32_t>(h) << 16); }

uint16_t f32_to_f16(float f) {
  const uint32_t x = std::bit_cast<uint32_t>(f);
  const auto sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  const uint32_t exp = (x >> 23) & 0xffu;
  const uint32_t mant = x & 0x7fffffu;
  if (exp == 0xff)  // inf; NaN stays NaN (quiet bit set, high payload bits kept)
    return static_cast<uint16_t>(sign | 0x7c00u | (mant != 0 ? 0x200u | (mant >> 13) : 0u));
  const int e = static_cast<int>(exp) - 127 + 15;             // half's biased exponent
  if (e >= 31) return static_cast<uint16_t>(sign | 0x7c00u);  // overflow: inf
  uint32_t h, rem, half;
  if (e >= 1) {
    h = (static_cast<uint32_t>(e) << 10) | (mant >> 13);
    rem = mant & 0x1fffu;
    half = 0x1000u;
  } else {
    if (e < -10) return sign;  // below half the smallest subnormal (2^-25): rounds to zero
    // Subnormal result: value = M * 2^(exp-150) with M the 24-bit significand; in units of 2^-24 that is M >> (14 - e).
    const uint32_t m = mant | 0x800000u;
    const int shift = 14 - e;  // 14..24
    h = m >> shift;
    rem = m & ((1u << shift) - 1u);
    half = 1u << (shift - 1);
  }
  if (rem > half || (rem == half && (h & 1u) != 0)) ++h;  // nearest, ties to even; a carry moves into the exponent
  return static_cast<uint16_t>(sign | h);
}

uint16_t f32_to_bf16(float f) {
  const uint32_t bits = std::bit_cast<uint32_t>(f);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40u);  // quiet NaN
  return static_cast<uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);  // nearest, ties to even
}

}  // namespace posenc
