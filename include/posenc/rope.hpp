// posenc — Rotary position embedding (RoPE) core: frequencies, cos/sin tables
// and the rotation of q/k in either channel layout.
//
// Source: Su et al., "RoFormer: Enhanced Transformer with Rotary Position
// Embedding" (2021), eq. 13-15. Numerics match Hugging Face transformers
// (modeling_rope_utils.py: inv_freq in float32; LlamaRotaryEmbedding.forward:
// angle = position * inv_freq in float32, cos/sin in float32 multiplied by
// attention_scaling; apply_rotary_pos_emb with rotate_half) and llama2.c
// (run.c forward(): interleaved pairs).
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace posenc {

/// How the channels of a head are paired for rotation. There is no default:
/// every call site names the layout of the weights it works with.
///  - half:        channel i pairs with i + rotary_dim/2 (GPT-NeoX, Hugging
///                 Face rotate_half, Llama/Qwen/Mistral in HF format).
///  - interleaved: channel 2i pairs with 2i+1 (GPT-J, RoFormer, Meta's complex
///                 form, llama2.c checkpoints).
enum class RopeLayout { half, interleaved };

/// How the rotation angle `position * inv_freq` and its cos/sin are formed
/// and stored (each mode is a RopeNumerics preset, rope_numerics(); the
/// stages are defined there). Every mode stores the table as float32 values;
/// bf16/fp16 tables hold values rounded to that dtype.
///  - float32: inv_freq float32 (HF's computation), position cast to float,
///             product and cos/sin in float32, as the reference
///             implementations do. Reproduces them (and what the models were
///             trained with) to the last float32 ulp of cos/sin.
///             RopeNumerics{f32, f32, f32, f32}.
///  - exact:   the same float32 inv_freq, angle formed in double (exact for
///             |position| < 2^29 since inv_freq is a float32), cos/sin in
///             double, then cast to float. Removes the float32 angle rounding
///             (off by up to ~1e-2 at position 1e6) but NOT the float32
///             rounding of inv_freq: relative 6e-8, i.e. ~1.5e-5 in cos/sin
///             below 2048 and ~3e-2 near 2^20 against fp64.
///             RopeNumerics{f32, f64, f64, f32}.
///  - fp64:    the true reference: inv_freq computed in double by the scaling
///             method's formula (RopeFrequencies::inv_freq_f64, filled by
///             compute_rope_frequencies), angle, cos/sin and attention_factor
///             in double, rounded once to float32 (within half a float32 ulp
///             of the exact value). RopeNumerics{f64, f64, f64, f32}; needs
///             inv_freq_f64 (InvalidArgument otherwise).
///  - bf16:    an engine that runs its rotary module in bfloat16: the inv_freq
///             buffer rounded to bf16 (nn.Module.to(torch.bfloat16) rounds
///             floating buffers), positions formed in bf16
///             (`torch.arange(n).type_as(inv_freq)`: exact only up to 256, so
///             257 -> 256, 259 -> 260, ...), the outer product rounded to
///             bf16, cos/sin of that angle stored in bf16. This is Hugging
///             Face's LlamaRotaryEmbedding before v4.38 after model.to(bf16)
///             (transformers#25681), and any float32 module under
///             torch.autocast(bf16), whose matmul rounds both operands and
///             the product (transformers#29285, diffusers#13920); see also
///             gpt-neox#1016, gpt-neox#1003, candle#3520.
///             RopeNumerics{bf16, bf16, bf16, bf16}.
///  - fp16:    the same in IEEE binary16 (model.half(); gpt-neox#1003's fp16
///             reproducer, transformers#25681): positions exact up to 2048
///             (2049 -> 2048), positions above 65504 overflow to inf and give
///             NaN cos/sin (as torch.arange(n, dtype=torch.float16)); inv_freq
///             below 6.1e-5 becomes subnormal (relative error up to 50% near
///             6e-8) or 0. RopeNumerics{f16, f16, f16, f16}.
/// Single-stage variants (only the table, only inv_freq, ...) are listed by
/// posenc::rope_numerics_presets() (precision.hpp) with their bug reports.
enum class AnglePrecision { float32, exact, fp64, bf16, fp16 };

/// Direction of the rotation: forward rotates by +angle, inverse by -angle
/// (the transpose; undoes a forward rotation and is RoPE's backward).
enum class RopeDirection { forward, inverse };

std::string_view to_string(RopeLayout layout);
std::string_view to_string(AnglePrecision precision);
/// Parses "half" or "interleaved". Throws ConfigError naming `field` and the value.
RopeLayout parse_rope_layout(std::string_view text, std::string_view field = "rope_layout");
/// Parses "float32", "exact", "fp64", "bf16" or "fp16". Throws ConfigError
/// naming `field` and the value.
AnglePrecision parse_angle_precision(std::string_view text,
                                     std::string_view field = "angle_precision");

/// The one value every RoPE scaling method produces (see scaling.hpp).
///  - inv_freq: [rotary_dim/2] float32, radians per position for channel pair i.
///  - attention_factor: multiplies cos and sin (Hugging Face's
///    attention_scaling), hence q·k by attention_factor^2. 1 for plain RoPE.
///  - rotary_dim: even, 2 <= rotary_dim <= head_dim; channels at and above
///    rotary_dim pass through unchanged (partial rotary).
///  - rope_type: provenance only ("default", "linear", ...); kernels ignore it.
struct RopeFrequencies {
  int head_dim = 0;
  int rotary_dim = 0;
  std::vector<float> inv_freq;
  double attention_factor = 1.0;
  std::string rope_type = "default";
  /// [rotary_dim/2] the same frequencies computed in double (the formula's true
  /// values): filled by compute_rope_frequencies (each scaling method's double
  /// instantiation) and default_rope_frequencies; empty for frequencies built
  /// by hand (then AnglePrecision::fp64 and RopeNumerics f64 inv_freq throw).
  std::vector<double> inv_freq_f64;

  int n_pairs() const { return rotary_dim / 2; }
  /// Throws InvalidArgument if rotary_dim is odd, exceeds head_dim, does not
  /// match inv_freq's size (or inv_freq_f64's, when that is filled), or if
  /// inv_freq/inv_freq_f64/attention_factor are non-finite.
  void validate() const;
  bool operator==(const RopeFrequencies&) const = default;
};

/// Plain RoPE frequencies: inv_freq[i] = 1 / rope_theta^(2i/rotary_dim), with
/// the power and the reciprocal in float32 as in Hugging Face's
/// `_compute_default_rope_parameters` (inv_freq_f64: the same in double).
/// Throws InvalidArgument for an odd or non-positive rotary_dim, rotary_dim > head_dim or rope_theta <= 0/non-finite.
RopeFrequencies default_rope_frequencies(int head_dim, int rotary_dim, double rope_theta);

/// cos/sin of `position_ids[t] * inv_freq[i]` for t in [0, n), i in [0, n_pairs),
/// each multiplied by attention_factor. Row-major [n_positions, n_pairs] float32.
class RopeTable {
 public:
  RopeTable() = default;
  RopeTable(const RopeFrequencies& freqs, std::span<const int64_t> position_ids,
            AnglePrecision precision);

  /// A table from given cos/sin values, each [n_positions, n_pairs] float32
  /// row-major (already multiplied by any attention factor). For tables the
  /// reference builds another way (RoFormer's float64 sinusoidal table, MRoPE's
  /// per-pair position rows). `precision` is recorded as provenance only.
  /// Throws InvalidArgument if n_pairs <= 0, n_positions < 0 or a size differs.
  static RopeTable from_cos_sin(int64_t n_positions, int n_pairs, std::vector<float> cos,
                                std::vector<float> sin, AnglePrecision precision);

  int64_t n_positions() const { return n_positions_; }
  int n_pairs() const { return n_pairs_; }
  int rotary_dim() const { return 2 * n_pairs_; }
  AnglePrecision precision() const { return precision_; }
  const float* cos_row(int64_t t) const { return cos_.data() + t * n_pairs_; }
  const float* sin_row(int64_t t) const { return sin_.data() + t * n_pairs_; }
  std::span<const float> cos() const { return cos_; }
  std::span<const float> sin() const { return sin_; }

 private:
  int64_t n_positions_ = 0;
  int n_pairs_ = 0;
  AnglePrecision precision_ = AnglePrecision::float32;
  std::vector<float> cos_, sin_;
};

/// Fills cos/sin ([n, n_pairs] float32, row-major) for the given positions.
/// The low-level routine behind RopeTable. Throws InvalidArgument on bad sizes.
void rope_cos_sin(const RopeFrequencies& freqs, std::span<const int64_t> position_ids,
                  AnglePrecision precision, std::span<float> cos, std::span<float> sin);

// ---- numerics of each stage (precision modes, `posenc verify`'s dtype mistakes) ----

/// The dtype one stage of the cos/sin computation is held in.
enum class NumericDtype { f64, f32, bf16, f16 };
std::string_view to_string(NumericDtype dtype);

/// How cos/sin(position * inv_freq) * attention_factor is formed, stage by
/// stage; each stage's value is rounded to its dtype (round to nearest even,
/// float16.hpp) before the next stage uses it:
///  - inv_freq: f32 = freqs.inv_freq as computed; bf16/f16 = those rounded
///    (what model.to(torch.bfloat16) does to a floating inv_freq buffer);
///    f64 = freqs.inv_freq_f64 (must be filled, else InvalidArgument).
///  - position: the position id as a floating value: f64 exact; f32 =
///    float(p) (exact below 2^24); bf16/f16 = float(p) rounded (exact below
///    256 / 2048: positions formed in the activation dtype).
///  - angle: f64 = double(position) * double(inv_freq) in double; otherwise
///    the float32 product float(position) * float(inv_freq), then rounded to
///    bf16/f16 when the angle dtype is one of those.
///  - cos/sin are then evaluated in double from the angle and rounded to
///    float32 (float32 angle: the correctly rounded float32 cos/sin, as
///    PyTorch's float32 cos/sin within 1 ulp); multiplied by attention_factor
///    in float32 (in double when inv_freq is f64 too: the fp64 reference, then
///    rounded to float32); then
///    rounded to `table` (bf16/f16: cos/sin cast to the activation dtype, as
///    HF's `cos.to(dtype=x.dtype)`; f32/f64: stored as float32).
struct RopeNumerics {
  NumericDtype inv_freq = NumericDtype::f32;
  NumericDtype position = NumericDtype::f32;
  NumericDtype angle = NumericDtype::f32;
  NumericDtype table = NumericDtype::f32;
  bool operator==(const RopeNumerics&) const = default;
};

/// "inv_freq=f32 position=f32 angle=f32 table=f32".
std::string to_string(const RopeNumerics& numerics);

/// The numerics of an AnglePrecision mode (see AnglePrecision for each).
RopeNumerics rope_numerics(AnglePrecision precision);

/// Fills cos/sin ([n, n_pairs] float32, row-major) for the positions with the
/// given numerics. For {f32,f32,f32,f32} (AnglePrecision::float32) and
/// {f32,f64,f64,f32} (AnglePrecision::exact) the result is rope_cos_sin's,
/// bit for bit; other numerics take a scalar path (slower: for tables,
/// diagnostics and precision studies, not hot loops). Throws InvalidArgument
/// on bad sizes, or for an f64 inv_freq when freqs.inv_freq_f64 is empty.
void rope_cos_sin_with(const RopeFrequencies& freqs, std::span<const int64_t> position_ids,
                       const RopeNumerics& numerics, std::span<float> cos, std::span<float> sin);

/// The fp64 reference in double: cos/sin(double(position) * inv_freq_f64[i]) *
/// attention_factor, all in double, [n_positions, n_pairs] row-major, for
/// measuring the error of the other modes (AnglePrecision::fp64 is this
/// rounded to float32). Throws InvalidArgument on bad sizes or an empty
/// inv_freq_f64.
void rope_cos_sin_f64(const RopeFrequencies& freqs, std::span<const int64_t> position_ids,
                      std::span<double> cos, std::span<double> sin);

/// Rotates x in place. x: [tokens, heads, head_dim] float32, row-major, where
/// consecutive tokens are `token_stride` floats apart (0 means heads*head_dim).
/// Row t of `table` holds the angles of token t, so table.n_positions() must
/// be >= tokens. Only the first table.rotary_dim() channels of each head rotate.
/// Arithmetic per pair (x0, x1), with c, s from the table:
///   forward: (x0*c - x1*s, x1*c + x0*s); inverse: (x0*c + x1*s, x1*c - x0*s),
/// in float32 without fused multiply-add, as the reference does.
/// Throws InvalidArgument if rotary_dim > head_dim or the table is too short.
void apply_rope(float* x, int64_t tokens, int heads, int head_dim, const RopeTable& table,
                RopeLayout layout, RopeDirection direction = RopeDirection::forward,
                int64_t token_stride = 0);

/// Out-of-place form: reads `in`, writes `out` (same shape, contiguous, may alias).
void apply_rope(const float* in, float* out, int64_t tokens, int heads, int head_dim,
                const RopeTable& table, RopeLayout layout,
                RopeDirection direction = RopeDirection::forward);

/// Convenience: builds the table for `position_ids` ([tokens]) and rotates
/// x ([tokens, heads, freqs.head_dim]) in place (fused: cos/sin a few tokens at
/// a time, per thread). Throws InvalidArgument for a bad shape or frequencies;
/// std::bad_alloc when a thread's buffer cannot be had, x then part-rotated.
void apply_rope(float* x, int64_t tokens, int heads, const RopeFrequencies& freqs,
                std::span<const int64_t> position_ids, RopeLayout layout,
                AnglePrecision precision, RopeDirection direction = RopeDirection::forward);

// ---- layout permutations (src/encoding/rope_layout.cpp) --------------------
//
// Within the first rotary_dim channels of each head (the rest untouched):
//   interleaved order: [a0 b0 a1 b1 ... a(n-1) b(n-1)]   (pair i = channels 2i, 2i+1)
//   half order:        [a0 a1 ... a(n-1) b0 b1 ... b(n-1)] (pair i = channels i, i+n)
// with n = rotary_dim/2. Rotating in one layout then permuting equals
// permuting then rotating in the other, bit for bit.

/// Interleaved -> half order, in place, for x: [rows, head_dim] float32 (rows =
/// tokens*heads, contiguous). DeepSeek-V3's `view(d/2, 2).transpose` step, and
/// the inverse of HF's convert_llama_weights_to_hf q/k permutation.
/// Throws InvalidArgument if rotary_dim is odd, <= 0 or > head_dim.
void rope_interleaved_to_half(float* x, int64_t rows, int head_dim, int rotary_dim);

/// Half -> interleaved order, in place (inverse of rope_interleaved_to_half).
void rope_half_to_interleaved(float* x, int64_t rows, int head_dim, int rotary_dim);

/// DeepSeek-V3's apply_rotary_pos_emb_interleave (HF modeling_deepseek_v3.py):
/// reads x ([tokens, heads, head_dim] float32) as interleaved pairs and leaves
/// the rotated result in *half* order -- a de-interleaving permutation followed
/// by the half-layout rotation. The result is a permutation of the interleaved
/// rotation (RopeLayout::interleaved). Same errors as apply_rope.
void apply_rope_interleaved_in_half_out(float* x, int64_t tokens, int heads, int head_dim,
                                        const RopeTable& table,
                                        RopeDirection direction = RopeDirection::forward);

}  // namespace posenc
