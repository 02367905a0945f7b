// GGUF tensor encodings: ggml's binary16 / bfloat16 conversions and the Q8_0 /
// Q4_0 block formats (ggml/src/ggml-quants.c, ggml-impl.h at llama.cpp de3ff81),
// written from their definitions; the numerics match ggml's bit for bit.
#include <bit>
#include <cmath>
#include <cstring>

#include <fmt/format.h>

#include "model/formats/gguf_quant.hpp"
#include "posenc/error.hpp"
#include "posenc/gguf.hpp"

namespace posenc {

namespace detail {

float gguf_f16_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t mant = h & 0x3ffu;
  if (exp == 0) {
    // zero or subnormal: mant * 2^-24, exact in float32
    const float mag = static_cast<float>(mant) * 0x1.0p-24f;
    return std::bit_cast<float>(sign | std::bit_cast<uint32_t>(mag));
  }
  if (exp == 0x1f) {
    uint32_t bits = sign | 0x7f800000u | (mant << 13);
    if (mant != 0) bits |= 0x00400000u;  // NaN: quiet, as ggml's (arithmetic) conversion makes it
    return std::bit_cast<float>(bits);
  }
  return std::bit_cast<float>(sign | ((exp + 112u) << 23) | (mant << 13));
}

uint16_t gguf_f32_to_f16(float f) {
  const uint32_t bits = std::bit_cast<uint32_t>(f);
  const auto sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  const uint32_t mag = bits & 0x7fffffffu;
  if (mag > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);  // NaN
  // 65520 (0x477ff000) is the midpoint between 65504, the largest binary16, and
  // 65536; it rounds to even, i.e. up, so everything from there on is infinity.
  if (mag >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);
  const uint32_t e = mag >> 23;  // biased float32 exponent
  if (e < 113) {
    // result is a binary16 subnormal (or zero, or the smallest normal after rounding):
    // q = round_half_even(|f| * 2^24) = round_half_even(significand >> (126 - e))
    if (e < 102) return sign;  // |f| < 2^-25: rounds to zero (2^-25 itself ties to even zero)
    const uint32_t sig = (mag & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126 - e;  // 14..24
    uint32_t q = sig >> shift;
    const uint32_t rem = sig & ((1u << shift) - 1);
    const uint32_t half = 1u << (shift - 1);
    if (rem > half || (rem == half && (q & 1u))) ++q;
    return static_cast<uint16_t>(sign | q);
  }
  // normal: keep 10 of the 23 mantissa bits, round the 13 dropped ones to nearest even;
  // a carry out of the mantissa correctly bumps the exponent.
  uint32_t q = ((e - 112) << 10) | ((mag >> 13) & 0x3ffu);
  const uint32_t rem = mag & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (q & 1u))) ++q;
  return static_cast<uint16_t>(sign | q);
}

float gguf_bf16_to_f32(uint16_t h) { return std::bit_cast<float>(static_cast<uint32_t>(h) << 16); }

uint16_t gguf_f32_to_bf16(float f) {
  const uint32_t bits = std::bit_cast<uint32_t>(f);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40u);  // quiet NaN
  return static_cast<uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

}  // namespace detail

namespace {

constexpr int64_t kQK = 32;  // elements per Q8_0 / Q4_0 block

uint16_t load_u16(const std::byte* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}
void store_u16(std::byte* p, uint16_t v) { std::memcpy(p, &v, 2); }

/// float -> int8 as ggml's `(int8_t)x` / `y = roundf(x)` compiles on x86-64
/// (cvttss2si to int32, then the low byte), without the C undefined behaviour
/// for values outside int8: NaN and |x| >= 2^31 give 0. Finite inputs of the
/// quantizers only reach this with values well inside [-128, 127].
int8_t to_int8_trunc(float x) {
  if (!(std::fabs(x) < 2147483648.0f)) return 0;
  return static_cast<int8_t>(static_cast<int32_t>(x));  // C++20: modular narrowing
}

void quantize_q8_0(std::span<const float> x, std::byte* y) {
  const int64_t nb = static_cast<int64_t>(x.size()) / kQK;
  for (int64_t i = 0; i < nb; ++i) {
    const float* b = x.data() + i * kQK;
    float amax = 0.0f;
    for (int j = 0; j < kQK; ++j) {
      const float a = std::fabs(b[j]);
      amax = amax > a ? amax : a;  // ggml's MAX(amax, a), NaN handling included
    }
    const float d = amax / 127.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    std::byte* out = y + i * 34;
    store_u16(out, detail::gguf_f32_to_f16(d));
    for (int j = 0; j < kQK; ++j) out[2 + j] = static_cast<std::byte>(to_int8_trunc(std::roundf(b[j] * id)));
  }
}

void quantize_q4_0(std::span<const float> x, std::byte* y) {
  const int64_t nb = static_cast<int64_t>(x.size()) / kQK;
  for (int64_t i = 0; i < nb; ++i) {
    const float* b = x.data() + i * kQK;
    float amax = 0.0f, max = 0.0f;  // largest magnitude and the signed value that has it (first one wins)
    for (int j = 0; j < kQK; ++j) {
      if (amax < std::fabs(b[j])) {
        amax = std::fabs(b[j]);
        max = b[j];
      }
    }
    const float d = max / -8.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    std::byte* out = y + i * 18;
    store_u16(out, detail::gguf_f32_to_f16(d));
    for (int j = 0; j < kQK / 2; ++j) {
      // two statements, so that no compiler contracts x*id + 8.5 into one fused multiply-add
      const float x0 = b[j] * id, x1 = b[kQK / 2 + j] * id;
      const int8_t a = to_int8_trunc(x0 + 8.5f), c = to_int8_trunc(x1 + 8.5f);
      const auto q0 = static_cast<uint8_t>(a < 15 ? a : 15), q1 = static_cast<uint8_t>(c < 15 ? c : 15);
      out[2 + j] = static_cast<std::byte>(static_cast<uint8_t>(q0 | (q1 << 4)));
    }
  }
}

}  // namespace

void ggml_dequantize(GgmlType type, std::span<const std::byte> src, std::span<float> dst) {
  if (!ggml_type_supported(static_cast<uint32_t>(type)))
    throw CheckpointError(fmt::format("ggml_dequantize: ggml type {} is not supported (supported: f32, f16, bf16, "
                                      "q8_0, q4_0)",
                                      ggml_type_name(static_cast<uint32_t>(type))));
  const auto [block, block_bytes] = ggml_block_shape(type);
  const auto n = static_cast<int64_t>(dst.size());
  const std::string name = ggml_type_name(static_cast<uint32_t>(type));
  if (n % block != 0)
    throw CheckpointError(fmt::format("ggml_dequantize: the element count must be a multiple of the {} block size {} "
                                      "(got {})",
                                      name, block, dst.size()));
  if (static_cast<uint64_t>(n / block) * static_cast<uint64_t>(block_bytes) != src.size())
    throw CheckpointError(fmt::format("ggml_dequantize: {} {} elements take {} bytes (got {} bytes)", dst.size(), name,
                                      n / block * block_bytes, src.size()));
  const std::byte* s = src.data();
  float* y = dst.data();
  switch (type) {
    case GgmlType::f32:
      if (n > 0) std::memcpy(y, s, src.size());
      break;
    case GgmlType::f16:
      for (int64_t i = 0; i < n; ++i) y[i] = detail::gguf_f16_to_f32(load_u16(s + 2 * i));
      break;
    case GgmlType::bf16:
      for (int64_t i = 0; i < n; ++i) y[i] = detail::gguf_bf16_to_f32(load_u16(s + 2 * i));
      break;
    case GgmlType::q8_0:
      for (int64_t i = 0; i < n / kQK; ++i) {
        const std::byte* b = s + i * 34;
        const float d = detail::gguf_f16_to_f32(load_u16(b));
        for (int j = 0; j < kQK; ++j) y[i * kQK + j] = static_cast<float>(static_cast<int8_t>(b[2 + j])) * d;
      }
      break;
    case GgmlType::q4_0:
      for (int64_t i = 0; i < n / kQK; ++i) {
        const std::byte* b = s + i * 18;
        const float d = detail::gguf_f16_to_f32(load_u16(b));
        for (int j = 0; j < kQK / 2; ++j) {
          const auto q = static_cast<uint8_t>(b[2 + j]);
          y[i * kQK + j] = static_cast<float>((q & 0x0f) - 8) * d;
          y[i * kQK + j + kQK / 2] = static_cast<float>((q >> 4) - 8) * d;
        }
      }
      break;
    default: break;  // unreachable: refused above
  }
}

std::vector<std::byte> ggml_quantize(GgmlType type, std::span<const float> src) {
  const auto t = static_cast<uint32_t>(type);
  if (!ggml_type_supported(t))
    throw InvalidArgument(fmt::format("ggml_quantize: ggml type {} is not supported (supported: f32, f16, bf16, "
                                      "q8_0, q4_0)",
                                      ggml_type_name(t)));
  const auto [block, block_bytes] = ggml_block_shape(type);
  const auto n = static_cast<int64_t>(src.size());
  if (n % block != 0)
    throw InvalidArgument(fmt::format("ggml_quantize: the number of values must be a multiple of the {} block size {} "
                                      "(got {})",
                                      ggml_type_name(t), block, src.size()));
  std::vector<std::byte> out(static_cast<std::size_t>(n / block * block_bytes));
  std::byte* y = out.data();
  switch (type) {
    case GgmlType::f32:
      if (n > 0) std::memcpy(y, src.data(), out.size());
      break;
    case GgmlType::f16:
      for (int64_t i = 0; i < n; ++i) store_u16(y + 2 * i, detail::gguf_f32_to_f16(src[static_cast<std::size_t>(i)]));
      break;
    case GgmlType::bf16:
      for (int64_t i = 0; i < n; ++i) store_u16(y + 2 * i, detail::gguf_f32_to_bf16(src[static_cast<std::size_t>(i)]));
      break;
    case GgmlType::q8_0: quantize_q8_0(src, y); break;
    case GgmlType::q4_0: quantize_q4_0(src, y); break;
    default: break;
  }
  return out;
}

}  // namespace posenc
