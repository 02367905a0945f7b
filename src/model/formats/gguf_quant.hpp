// posenc — internal: ggml's scalar conversions (binary16, bfloat16) used by the
// GGUF reader/writer (src/model/formats/gguf*.cpp).
//
// Thin wrappers over include/posenc/float16.hpp (the same numerics for every
// finite and infinite value); they keep ggml's NaN encodings, which the GGUF
// tests pin.
#pragma once

#include <cstdint>

namespace posenc::detail {

/// IEEE binary16 bits -> float32, exact (every binary16 is a float32), as
/// ggml_compute_fp16_to_fp32; a NaN comes back quiet (bit 22 set) with its payload.
float gguf_f16_to_f32(uint16_t h);
/// float32 -> binary16 bits, round to nearest even, as ggml_compute_fp32_to_fp16:
/// overflow (>= 65520 in magnitude) -> inf, NaN -> 0x7e00 with the sign kept.
uint16_t gguf_f32_to_f16(float f);
/// bfloat16 bits -> float32 (the bits shifted up), as ggml_compute_bf16_to_fp32.
float gguf_bf16_to_f32(uint16_t h);
/// float32 -> bfloat16 bits, round to nearest even, NaN made quiet, as ggml_compute_fp32_to_bf16.
uint16_t gguf_f32_to_bf16(float f);

}  // namespace posenc::detail
