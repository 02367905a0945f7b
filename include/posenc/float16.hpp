// posenc — IEEE binary16 ("fp16", "half") and bfloat16 conversions.
//
// Used by the readers of F16/BF16 tensors (safetensors, .npy/.npz dumps), by
// the precision modes of the RoPE tables and by the mistake catalogue of
// `posenc verify`. Numerics: round to nearest, ties to even, as PyTorch's
// `tensor.to(torch.float16 / torch.bfloat16)`, numpy's astype(float16) and
// ggml's ggml_compute_fp32_to_fp16 / _bf16 for every finite and infinite
// input. binary16 overflow (|x| >= 65520) gives inf. NaN stays NaN (quiet).
#pragma once

#include <cstdint>

namespace posenc {

/// binary16 bits -> float32, exactly (every binary16 value is a float32).
float f16_to_f32(uint16_t h);
/// bfloat16 bits -> float32, exactly (the bits shifted up by 16).
float bf16_to_f32(uint16_t h);
/// float32 -> binary16 bits, round to nearest even; NaN keeps its sign and
/// the high payload bits with the quiet bit set.
uint16_t f32_to_f16(float f);
/// float32 -> bfloat16 bits, round to nearest even; NaN made quiet.
uint16_t f32_to_bf16(float f);

/// x rounded to the nearest binary16 value and widened back to float32
/// (what storing a float32 tensor as torch.float16 and reading it does).
inline float round_to_f16(float x) { return f16_to_f32(f32_to_f16(x)); }
/// x rounded to the nearest bfloat16 value and widened back to float32.
inline float round_to_bf16(float x) { return bf16_to_f32(f32_to_bf16(x)); }

}  // namespace posenc
