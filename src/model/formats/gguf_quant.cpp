// GGUF tensor encodings: ggml's binary16 / bfloat16 conversions and the Q8_0 /
// Q4_0 block formats (ggml/src/ggml-quants.c, ggml-impl.h at llama.cpp de3ff81),
// written from their definitions; the numerics match ggml's bit for bit.
#include <bit>
#include <cmath>
#include <cstring>

#include <fmt/format.h>

#include "model/formats/gguf_quant.hpp"
#include "posenc/error.hpp"
#include "posenc/float16.hpp"
#include "posenc/gguf.hpp"

namespace posenc {

namespace detail {

// The finite and infinite cases are float16.hpp's (the one conversion; they
// agree with ggml's for every non-NaN float32 and binary16, checked over all
// 2^32 inputs); only NaNs keep ggml's own encoding here.

float gguf_f16_to_f32(uint16_t h) {
  if ((h & 0x7c00u) == 0x7c00u && (h & 0x3ffu) != 0) {
    // NaN: quiet, as ggml's (arithmetic) conversion makes it, payload and sign kept
    const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
    return std::bit_cast<float>(sign | 0x7f800000u | (static_cast<uint32_t>(h & 0x3ffu) << 13) | 0x00400000u);
  }
  return f16_to_f32(h);
}

uint16_t gguf_f32_to_f16(float f) {
  const uint32_t bits = std::bit_cast<uint32_t>(f);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>(((bits >> 16) & 0x8000u) | 0x7e00u);  // NaN
  return f32_to_f16(f);
}

float gguf_bf16_to_f32(uint16_t h) { return bf16_to_f32(h); }

uint16_t gguf_f32_to_bf16(float f) { return f32_to_bf16(f); }  // quiet NaN as ggml_compute_fp32_to_bf16

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
