// Internal dense kernels of the model runtime (compiled with FMA contraction).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>
#include <vector>

#include "model/raw_model.hpp"

namespace posenc::detail {

// Products with the weight matrices: kernels_dense.hpp (every stored dtype) and, below, the
// quantized-activation products of Q8_0/Q4_0.

/// out[r, :] = (x[r, :] * (1 / sqrt(mean + eps))) * weight, for n rows of size d, with
/// mean = float(sum of float32 squares accumulated in double / d): llama.cpp's
/// arithmetic (ggml_compute_forward_rms_norm_f32). `out` may alias `x`.
void rmsnorm(const float* x, const float* weight, int64_t n, int d, float eps, float* out);

/// h1 = silu(h1) * h3 elementwise (SwiGLU), count elements: h1 / (1 + expf(-h1)) * h3 in float32, with the
/// libm's expf (glibc's, as llama.cpp's scalar tail): on AVX-512 CPUs whose libm is glibc's FMA expf (checked at
/// first use: swiglu_uses_avx512) 8 lanes at a time with the same bits, otherwise std::exp per element. In
/// parallel (OpenMP) for large counts; the bits do not depend on the thread count.
void swiglu(float* h1, const float* h3, int64_t count);
/// std::exp per element (the reference swiglu is tested against).
void swiglu_reference(float* h1, const float* h3, int64_t count);
/// swiglu on the calling thread alone (no parallel region; the same bits): for kernels that apply it to their own
/// part of the output.
void swiglu_serial(float* h1, const float* h3, int64_t count);
/// Whether swiglu takes its AVX-512 path here.
bool swiglu_uses_avx512();

}  // namespace posenc::detail

namespace posenc::detail {

// ---- ggml block formats (ggml-common.h): 32 weights per block ----
constexpr int kQBlock = 32;
constexpr int kQ8Bytes = 34;  ///< block_q8_0: fp16 d, int8 qs[32]; x = d * q
constexpr int kQ4Bytes = 18;  ///< block_q4_0: fp16 d, uint8 qs[16]; x_j = d * ((qs[j] & 15) - 8), x_{j+16} = d * ((qs[j] >> 4) - 8)

/// One Q8_0 / Q4_0 row of `cols` weights (cols % 32 == 0) to float32, as ggml's
/// dequantize_row_q8_0 / dequantize_row_q4_0.
void dequantize_q8_0_row(const std::byte* row, int64_t cols, float* out);
void dequantize_q4_0_row(const std::byte* row, int64_t cols, float* out);

/// Activations quantized as ggml-cpu's x86 quantize_row_q8_0 does (the
/// arithmetic of llama.cpp's products with Q8_0/Q4_0 weights): per block of
/// 32, amax = max|x|, d = fp16(amax / 127), q = round-half-even(x * (127 / amax)).
/// x: [n, in] (in % 32 == 0); out: n * in/32 blocks of 34 bytes.
/// Runs an AVX-512 version (the same bits, in parallel over rows) when the CPU has it and dense_kernel() is not
/// DenseKernel::reference.
void quantize_rows_q8_0(const float* x, int64_t n, int64_t in, std::byte* out);
/// The same in scalar C++ (the reference the AVX-512 version is tested against).
void quantize_rows_q8_0_reference(const float* x, int64_t n, int64_t in, std::byte* out);

/// Which implementation matmul_q8 runs on this CPU.
enum class Q8Kernel {
  reference,    ///< matmul_q8_reference (any x86-64)
  avx2,         ///< matmul_q8_avx2 (AVX2 + FMA + F16C)
  avx512_vnni,  ///< AVX-512 VNNI: one row of x (decode) against 16 runs of weight rows read side by side, one
                ///< 256-bit dpbusd per row and block; more rows against panels of 16 weight rows repacked per
                ///< call (8 x 16 x 4 int8 per block) and dpbusd on x + 128
  amx,          ///< AMX-INT8 for n >= kAmxMinRows rows (one tdpbssd per block of 16 rows of x by a panel's 16
                ///< weight rows, the block sums' epilogue in AVX-512), avx512_vnni below
};
/// Rows of x from which the amx path uses AMX.
constexpr int64_t kAmxMinRows = 16;
std::string_view to_string(Q8Kernel k);
/// Whether this CPU (and, for amx, the kernel: Linux's arch_prctl permission for the tile data) runs path k.
bool q8_kernel_supported(Q8Kernel k);
/// The path matmul_q8 dispatches to, chosen once: reference when dense_kernel() is (POSENC_DENSE_KERNEL=
/// reference), otherwise the widest this CPU runs (amx, avx512_vnni, avx2, reference); the environment variable
/// POSENC_Q8_KERNEL=reference|avx2|avx512_vnni|amx asks for one (one this CPU lacks is reported on stderr once
/// and the widest runs instead).
Q8Kernel q8_kernel();

/// y[n, out] (+)= x_q[n, in] · W[out, in]^T for W in Q8_0 or Q4_0 blocks and x
/// quantized by quantize_rows_q8_0: over the blocks in ascending order,
/// acc = fmaf((float) isum, d_w * d_x, acc) with isum the exact int32 block dot
/// product — the order of llama.cpp's AMX/VNNI kernels (ggml-cpu/amx/mmq.cpp,
/// the path its x86 builds take on CPUs with AMX; its AVX2 vec_dot keeps eight
/// partial lanes instead and differs in the last bits). Every path gives the
/// same bits (and so does a row alone or in a batch, on any thread count)
/// for x's int8 in [-127, 127], the range quantize_rows_q8_0 writes (the AVX2
/// path's sign trick, like ggml's, cannot negate -128; the others are exact
/// for -128 too). The weights may hold any int8, -128 included.
/// `q4` selects the weight format; W is read where it lies (no copy outlives
/// the call). Runs the q8_kernel() path.
void matmul_q8(const std::byte* x_q, int64_t n, int64_t in, const std::byte* w, bool q4, int64_t out, float* y,
               bool accumulate);
/// matmul_q8 through path k (tests and benchmarks compare the paths). Throws std::logic_error when this CPU
/// cannot run k.
void matmul_q8_with(Q8Kernel k, const std::byte* x_q, int64_t n, int64_t in, const std::byte* w, bool q4, int64_t out,
                    float* y, bool accumulate);
struct DecodeStreams;  // kernels_dense.hpp
/// matmul_q8_with reading the weights for one row of x (decode) as `plan` says (the avx512_vnni and amx paths'
/// decode; the others ignore it; matmul_q8 takes decode_streams(Q8_0 or Q4_0, avx512)). The same bits in every plan.
/// Throws std::logic_error when this CPU cannot run k or the plan is not one of decode_streams_valid's.
void matmul_q8_with(Q8Kernel k, DecodeStreams plan, const std::byte* x_q, int64_t n, int64_t in,
                    const std::byte* w, bool q4, int64_t out, float* y, bool accumulate);
/// Whether matmul_q8_decode_rows runs rows of `in` weights (Q4_0 when q4, else Q8_0) on this CPU: q8_kernel() is
/// avx512_vnni or amx (whose one-row product is the VNNI decode) and in a positive multiple of 32 whose 16 rows
/// stay under 2^31 bytes (longer rows take another path in matmul_q8).
bool q8_decode_rows_supported(int64_t in, bool q4);
/// The rows [first, last) of matmul_q8(x_q, 1, in, w, q4, out, y, accumulate), on the calling thread, read as
/// decode_streams(Q8_0 or Q4_0) says; each output the same bits as matmul_q8's. For a team the caller keeps:
/// threads given disjoint ranges may run at once; nothing is synchronised. Throws std::logic_error when
/// !q8_decode_rows_supported(in, q4) or the range is not one of the matrix's rows (0 <= first <= last <= out).
void matmul_q8_decode_rows(const std::byte* x_q, int64_t in, const std::byte* w, bool q4, int64_t out, float* y,
                           bool accumulate, int64_t first, int64_t last);
/// h1[n, out] = silu(h1) * (x_q[n, in] · W[out, in]^T), the same bits as matmul_q8 into h3 followed by
/// swiglu(h1, h3, n * out): SwiGLU with h1 the gate projection's output and W the up projection. On the amx path
/// (n >= kAmxMinRows) the SwiGLU is the epilogue of each 16 x 16 tile, so the up projection's [n, out] float32
/// output is never written nor read back (a prefill's SwiGLU pass ran at DRAM speed: 6% of a Q8_0 q8_activations
/// prefill of the 487M model) and h3 is not touched; the other paths store the product in h3 ([n, out] float32
/// scratch, the caller's) and call swiglu.
void matmul_q8_swiglu(const std::byte* x_q, int64_t n, int64_t in, const std::byte* w, bool q4, int64_t out,
                      float* h1, float* h3);
/// matmul_q8_swiglu through path k. Throws std::logic_error when this CPU cannot run k.
void matmul_q8_swiglu_with(Q8Kernel k, const std::byte* x_q, int64_t n, int64_t in, const std::byte* w, bool q4,
                           int64_t out, float* h1, float* h3);
/// The same arithmetic in scalar C++: the reference the SIMD paths are tested against.
void matmul_q8_reference(const std::byte* x_q, int64_t n, int64_t in, const std::byte* w, bool q4, int64_t out,
                         float* y, bool accumulate);
/// True when this CPU runs matmul_q8_avx2 (AVX2 + FMA + F16C).
bool q8_avx2_supported();
/// AVX2 on the blocks as stored: tiles of 4 activation rows x 2 weight rows
/// (1 x 8 for the rows left over and for decode), each block's 8 exact int32
/// dot products from _mm256_maddubs_epi16 / _mm256_madd_epi16 on |w| and
/// sign(x, w), then one fma per pair and block in an 8-lane float accumulator.
/// Parallel (OpenMP) over weight tiles for big products. Throws
/// std::logic_error when the CPU lacks AVX2/FMA/F16C.
void matmul_q8_avx2(const std::byte* x_q, int64_t n, int64_t in, const std::byte* w, bool q4, int64_t out, float* y,
                    bool accumulate);

// ---- F16/BF16 weights on AMX-BF16 (kernels_bf16.cpp) ----

/// Which bf16 products approximate each product x * w of a float32 activation and an F16/BF16 weight. x is split
/// into three bfloat16 terms x = x0 + x1 + x2 (x0 = x with the low 16 bits of its encoding cleared, x1 the same of
/// x - x0, x2 = x - x0 - x1; exact for normal floats: 24 significand bits, 8 per term), w into two, w = w0 + w1
/// (exact for F16's 11 bits; w1 = 0 for BF16 weights). Each bf16 product is exact in float32.
///  - x6: all six x_i w_j: x * w exactly (XLA's BF16_BF16_F32_X6 keeps six of nine; here w has only two terms);
///  - x3: x0 w0 + x1 w0 + x0 w1 (XLA's BF16_BF16_F32_X3): the dropped x1 w1, x2 w0, x2 w1 are under 2^-14,
///    2^-15 and 2^-22 of |x w| (|x1| < 2^-7 |x|, |x2| < 2^-15 |x|, |w1| < 2^-7 |w|), 2^-13 |x w| in all.
/// The sums are AMX's: tdpbf16ps accumulates in float32 with its own rounding (not a sequence of IEEE adds:
/// measured, no scalar order reproduces it), so the bits are this hardware's, the same for a row alone or in a
/// batch, in any tile position and on any thread count. bf16 terms below 2^-126 (x under about 2^-110) are
/// flushed to zero, as tdpbf16ps does with bf16 denormals; a non-finite x or w gives NaN.
enum class Bf16Split { x3, x6 };
std::string_view to_string(Bf16Split s);
/// Whether this CPU (and Linux's arch_prctl permission for the tile data) runs the AMX-BF16 products; false
/// when dense_kernel() is DenseKernel::reference (POSENC_DENSE_KERNEL=reference: no SIMD path at all).
bool amx_bf16_supported();
/// The terms of x (3) and of w (2) as Bf16Split describes, as float32 values.
void split_x_bf16(float x, float parts[3]);
void split_w_bf16(float w, float parts[2]);
/// y[n, w.rows] (+)= x[n, w.cols] · W^T for W in F16 or BF16 ([out, in] as stored, read where it lies: each panel of
/// 32 weight rows is widened and split per chunk of 256 k into a buffer the tiles read, then dropped). x, y
/// row-major float32 with row strides w.cols and w.rows; y must not alias x. Any n (decode runs the same tiles,
/// so a row's bits do not depend on n), any w.cols (the last k block padded with zeros). Allocates the split x for
/// the call: n * ceil(w.cols / 32) * 32 * (6 for x6, 4 for x3) bytes. In parallel (OpenMP)
/// over pairs of panels for large products. Throws std::logic_error for other weight types or when
/// amx_bf16_supported() is false.
void matmul_bf16_split(Bf16Split s, const float* x, int64_t n, const RawMatrix& w, float* y, bool accumulate);
/// h1[n, w.rows] = silu(h1) * (x · W^T): the SwiGLU applied to each tile of matmul_bf16_split's result as it is
/// written (the same bits as matmul_bf16_split into h3 then swiglu(h1, h3, n * w.rows)).
void matmul_bf16_split_swiglu(Bf16Split s, const float* x, int64_t n, const RawMatrix& w, float* h1);
/// The sum over i of the kept products of x[r, i] and W[o, i]'s terms, in double (exact for rows of up to 2^20
/// terms of moderate range): what matmul_bf16_split computes before float32 rounding of its sums; the tests bound
/// the kernel's distance to it.
void matmul_bf16_split_reference(Bf16Split s, const float* x, int64_t n, const RawMatrix& w, double* y);

/// y[r, :] += bias for n rows of width d.
void add_bias(float* y, int64_t n, int64_t d, const float* bias);

}  // namespace posenc::detail
