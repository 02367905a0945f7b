// binary16 / bfloat16 conversions of the GGUF module, against their definition
// (every binary16 value; nearest-even rounding checked value by value) and, where
// the CPU has F16C, against the hardware conversion (vcvtps2ph with round-to-nearest).
#include <bit>
#include <cmath>
#include <vector>

#include <gtest/gtest.h>

#if defined(__F16C__)
#include <immintrin.h>
#endif

#include "model/formats/gguf_quant.hpp"

namespace POSENC_UNITY_ID {  // this file's own namespace in the tests' unity build (CMakeLists.txt)

using posenc::detail::gguf_bf16_to_f32;
using posenc::detail::gguf_f16_to_f32;
using posenc::detail::gguf_f32_to_bf16;
using posenc::detail::gguf_f32_to_f16;

namespace {

/// The value of a finite binary16 magnitude (no sign), from the definition.
double half_value(uint32_t h) {
  const int exp = static_cast<int>((h >> 10) & 0x1f);
  const int mant = static_cast<int>(h & 0x3ff);
  if (exp == 0) return std::ldexp(mant, -24);
  if (h == 0x7c00) return 65536.0;  // where the next binary16 after 65504 would be (for the rounding check)
  return std::ldexp(1024 + mant, exp - 25);
}

/// float32 bit patterns that cover every binary16 rounding situation: every
/// combination of sign, exponent and the top 10 mantissa bits, with the 13
/// dropped bits at 0, 1, just below/at/above the midpoint and all ones; plus a
/// stride through all 2^32 patterns (reaching the subnormal range's deeper bits).
std::vector<uint32_t> sample_bits() {
  std::vector<uint32_t> out;
  const uint32_t lows[] = {0x0000, 0x0001, 0x0fff, 0x1000, 0x1001, 0x1555, 0x1fff};
  for (uint32_t hi = 0; hi < (1u << 19); ++hi)
    for (uint32_t lo : lows) out.push_back((hi << 13) | lo);
  for (uint64_t b = 0; b < (uint64_t{1} << 32); b += 40009) out.push_back(static_cast<uint32_t>(b));
  return out;
}

}  // namespace

TEST(GgufHalf, F16ToF32IsExactForEveryValue) {
  for (uint32_t h = 0; h < 65536; ++h) {
    const float f = gguf_f16_to_f32(static_cast<uint16_t>(h));
    const uint32_t bits = std::bit_cast<uint32_t>(f);
    const bool neg = (h & 0x8000) != 0;
    const uint32_t mag = h & 0x7fff;
    ASSERT_EQ((bits >> 31) != 0, neg) << h;
    if (mag > 0x7c00) {  // NaN: quiet, payload kept
      ASSERT_EQ(bits & 0x7fffffffu, 0x7f800000u | 0x00400000u | ((mag & 0x3ff) << 13)) << h;
    } else if (mag == 0x7c00) {
      ASSERT_TRUE(std::isinf(f)) << h;
    } else {
      ASSERT_EQ(static_cast<double>(std::fabs(f)), half_value(mag)) << h;
    }
  }
}

TEST(GgufHalf, F32ToF16RoundTripsEveryHalf) {
  for (uint32_t h = 0; h < 65536; ++h) {
    if ((h & 0x7fff) > 0x7c00) continue;  // NaN payloads are not kept (ggml writes 0x7e00)
    ASSERT_EQ(gguf_f32_to_f16(gguf_f16_to_f32(static_cast<uint16_t>(h))), h) << h;
  }
}

TEST(GgufHalf, F32ToF16RoundsToNearestEven) {
  int64_t ties = 0, checked = 0;
  for (uint32_t bits : sample_bits()) {
    const float x = std::bit_cast<float>(bits);
    const uint16_t h = gguf_f32_to_f16(x);
    if (std::isnan(x)) {
      ASSERT_EQ(h, std::signbit(x) ? 0xfe00 : 0x7e00) << std::hex << bits;
      continue;
    }
    ASSERT_EQ((h & 0x8000) != 0, std::signbit(x)) << std::hex << bits;
    const double a = std::fabs(static_cast<double>(x));
    const uint32_t m = h & 0x7fff;
    if (a >= 65520.0) {
      ASSERT_EQ(m, 0x7c00u) << std::hex << bits;
      continue;
    }
    ASSERT_LT(m, 0x7c00u) << std::hex << bits;
    const double v = half_value(m);
    const double err = std::fabs(a - v);
    const double up = std::fabs(a - half_value(m + 1));
    ASSERT_LE(err, up) << std::hex << bits;
    if (m > 0) {
      const double down = std::fabs(a - half_value(m - 1));
      ASSERT_LE(err, down) << std::hex << bits;
      if (err == down) {
        ASSERT_EQ(m % 2, 0u) << "tie not to even: " << std::hex << bits;
      }
      ties += err == down;
    }
    if (err == up) {
      ASSERT_EQ(m % 2, 0u) << "tie not to even: " << std::hex << bits;
    }
    ties += err == up;
    ++checked;
  }
  EXPECT_GT(checked, 2'000'000);  // the finite values below 65520 of the sample
  EXPECT_GT(ties, 60'000);  // the midpoints were reached (61440 normal ones alone)
}

TEST(GgufHalf, MatchesHardwareF16C) {
#if defined(__F16C__)
  for (uint32_t bits : sample_bits()) {
    const float x = std::bit_cast<float>(bits);
    if (std::isnan(x)) continue;  // the hardware keeps NaN payloads, ggml's reference writes 0x7e00
    ASSERT_EQ(gguf_f32_to_f16(x), _cvtss_sh(x, _MM_FROUND_TO_NEAREST_INT)) << std::hex << bits;
  }
  for (uint32_t h = 0; h < 65536; ++h)
    ASSERT_EQ(std::bit_cast<uint32_t>(gguf_f16_to_f32(static_cast<uint16_t>(h))),
              std::bit_cast<uint32_t>(_cvtsh_ss(static_cast<unsigned short>(h))))
        << h;
#else
  GTEST_SKIP() << "not compiled with F16C (-march=native on a CPU without it, or another target)";
#endif
}

TEST(GgufHalf, BFloat16) {
  for (uint32_t h = 0; h < 65536; ++h)
    ASSERT_EQ(std::bit_cast<uint32_t>(gguf_bf16_to_f32(static_cast<uint16_t>(h))), h << 16) << h;
  auto bf = [](uint32_t bits) { return gguf_f32_to_bf16(std::bit_cast<float>(bits)); };
  EXPECT_EQ(bf(0x3f800000), 0x3f80);  // 1.0
  EXPECT_EQ(bf(0x3f808000), 0x3f80);  // tie, even below
  EXPECT_EQ(bf(0x3f818000), 0x3f82);  // tie, even above
  EXPECT_EQ(bf(0x3f808001), 0x3f81);  // above the midpoint
  EXPECT_EQ(bf(0x7f7fffff), 0x7f80);  // FLT_MAX rounds to inf
  EXPECT_EQ(bf(0x7f800001), 0x7fc0);  // signalling NaN made quiet
  EXPECT_EQ(bf(0xffc00001), 0xffc0);
  EXPECT_EQ(bf(0x80000000), 0x8000);
  // every bfloat16 survives the round trip (NaNs quiet already)
  for (uint32_t h = 0; h < 65536; ++h) {
    if ((h & 0x7fff) > 0x7f80 && (h & 0x40) == 0) continue;
    ASSERT_EQ(gguf_f32_to_bf16(gguf_bf16_to_f32(static_cast<uint16_t>(h))), h) << h;
  }
}

}  // namespace POSENC_UNITY_ID
