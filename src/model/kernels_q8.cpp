// Quantized products (ggml's Q8_0 / Q4_0 block formats) with the arithmetic
// of llama.cpp's CPU backend; see kernels.hpp. Compiled with FMA contraction,
// but every rounding that matters is written out (std::fma, explicit casts).
#include <algorithm>
#include <array>
#include <climits>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <cpuid.h>
#include <immintrin.h>
#include <omp.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <fmt/format.h>

// GCC 12 flags the undefined pass-through vectors inside its own AVX-512 intrinsics as uninitialized.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

#include "core/aligned.hpp"
#include "core/parallel.hpp"
#include "core/text.hpp"
#include "model/kernels.hpp"
#include "model/kernels_dense.hpp"
#include "posenc/safetensors.hpp"

namespace posenc::detail {

namespace {

inline float load_fp16(const std::byte* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return f16_to_f32(h);
}

/// Exact int32 dot product of one block of 32 int8 pairs.
inline int32_t block_dot(const int8_t* a, const int8_t* b) {
  int32_t s = 0;
#pragma omp simd reduction(+ : s)
  for (int j = 0; j < kQBlock; ++j) s += static_cast<int32_t>(a[j]) * static_cast<int32_t>(b[j]);
  return s;
}

inline float dot_row(const std::byte* w, bool q4, const std::byte* xq, int64_t blocks) {
  float acc = 0.0f;
  int8_t wq[kQBlock];
  const int wb = q4 ? kQ4Bytes : kQ8Bytes;
  for (int64_t b = 0; b < blocks; ++b) {
    const std::byte* wblk = w + b * wb;
    const std::byte* xblk = xq + b * kQ8Bytes;
    const float d = load_fp16(wblk) * load_fp16(xblk);  // exact: two fp16 significands fit in float
    const int8_t* wv;
    if (q4) {
      const auto* qs = reinterpret_cast<const uint8_t*>(wblk + 2);
      for (int j = 0; j < 16; ++j) {
        wq[j] = static_cast<int8_t>((qs[j] & 0x0F) - 8);
        wq[j + 16] = static_cast<int8_t>((qs[j] >> 4) - 8);
      }
      wv = wq;
    } else {
      wv = reinterpret_cast<const int8_t*>(wblk + 2);
    }
    acc = std::fma(static_cast<float>(block_dot(wv, reinterpret_cast<const int8_t*>(xblk + 2))), d, acc);
  }
  return acc;
}

}  // namespace

void dequantize_q8_0_row(const std::byte* row, int64_t cols, float* out) {
  for (int64_t b = 0; b < cols / kQBlock; ++b) {
    const std::byte* blk = row + b * kQ8Bytes;
    const float d = load_fp16(blk);
    const auto* qs = reinterpret_cast<const int8_t*>(blk + 2);
    for (int j = 0; j < kQBlock; ++j) out[b * kQBlock + j] = static_cast<float>(qs[j]) * d;
  }
}

void dequantize_q4_0_row(const std::byte* row, int64_t cols, float* out) {
  for (int64_t b = 0; b < cols / kQBlock; ++b) {
    const std::byte* blk = row + b * kQ4Bytes;
    const float d = load_fp16(blk);
    const auto* qs = reinterpret_cast<const uint8_t*>(blk + 2);
    for (int j = 0; j < 16; ++j) {
      out[b * kQBlock + j] = static_cast<float>((qs[j] & 0x0F) - 8) * d;
      out[b * kQBlock + j + 16] = static_cast<float>((qs[j] >> 4) - 8) * d;
    }
  }
}

void quantize_rows_q8_0_reference(const float* x, int64_t n, int64_t in, std::byte* out) {
  const int64_t blocks = in / kQBlock;
  for (int64_t r = 0; r < n; ++r)
    for (int64_t b = 0; b < blocks; ++b) {
      const float* xb = x + r * in + b * kQBlock;
      std::byte* ob = out + (r * blocks + b) * kQ8Bytes;
      float amax = 0.0f;
      bool nan = false;
      for (int j = 0; j < kQBlock; ++j) {
        amax = std::max(amax, std::fabs(xb[j]));
        nan |= std::isnan(xb[j]);
      }
      // A non-finite activation (overflowed float32 arithmetic) is carried by
      // the block's scale (NaN, or inf for an infinite amax); converting it to
      // int8 would be undefined behaviour, so its quant is 0.
      const float d = nan ? std::numeric_limits<float>::quiet_NaN() : amax / 127.0f;
      const uint16_t h = f32_to_f16(d);
      std::memcpy(ob, &h, 2);
      const float id = amax != 0.0f ? 127.0f / amax : 0.0f;
      auto* qs = reinterpret_cast<int8_t*>(ob + 2);
      for (int j = 0; j < kQBlock; ++j) {
        const float v = xb[j] * id;
        qs[j] = std::isfinite(v) ? static_cast<int8_t>(std::nearbyint(v)) : int8_t{0};  // nearest, ties to even
      }
    }
}

namespace {

/// quantize_rows_q8_0 for rows [r0, r1) in AVX-512: the same operations lane by lane (|x| maxed with NaN ignored as
/// std::max ignores it, the scale and multiplier in scalar float, x * multiplier rounded to nearest even by
/// vcvtps2dq, non-finite products to 0).
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,f16c"))) void quantize_rows_avx512(const float* x, int64_t r0,
                                                                                      int64_t r1, int64_t in,
                                                                                      std::byte* out) {
  const int64_t blocks = in / kQBlock;
  const __m512 sign = _mm512_set1_ps(-0.0f);
  for (int64_t r = r0; r < r1; ++r)
    for (int64_t b = 0; b < blocks; ++b) {
      const float* xb = x + r * in + b * kQBlock;
      std::byte* ob = out + (r * blocks + b) * kQ8Bytes;
      const __m512 x0 = _mm512_loadu_ps(xb), x1 = _mm512_loadu_ps(xb + 16);
      const __m512 a0 = _mm512_andnot_ps(sign, x0), a1 = _mm512_andnot_ps(sign, x1);
      // maxps returns its second operand when either is NaN: a NaN |x| leaves the running max, as std::max(amax, |x|).
      const __m512 m = _mm512_max_ps(a1, _mm512_max_ps(a0, _mm512_setzero_ps()));
      // The max of 16 lanes of non-NaN values: exact in any order.
      __m256 m8 = _mm256_max_ps(_mm512_castps512_ps256(m), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(m), 1)));
      __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m8), _mm256_extractf128_ps(m8, 1));
      m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
      const float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1)));
      const bool nan = (_mm512_cmp_ps_mask(x0, x0, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(x1, x1, _CMP_UNORD_Q)) != 0;
      const float d = nan ? std::numeric_limits<float>::quiet_NaN() : amax / 127.0f;
      // vcvtps2ph rounds to nearest even as f32_to_f16 does (and quiets a NaN keeping its high payload bits alike).
      const uint16_t h = static_cast<uint16_t>(_cvtss_sh(d, _MM_FROUND_TO_NEAREST_INT));
      std::memcpy(ob, &h, 2);
      const float id = amax != 0.0f ? 127.0f / amax : 0.0f;
      const __m512 v0 = _mm512_mul_ps(x0, _mm512_set1_ps(id)), v1 = _mm512_mul_ps(x1, _mm512_set1_ps(id));
      constexpr int kNonFinite = 0x01 | 0x08 | 0x10 | 0x80;  // QNaN, +inf, -inf, SNaN
      const __m512i q0 = _mm512_maskz_cvt_roundps_epi32(static_cast<__mmask16>(~_mm512_fpclass_ps_mask(v0, kNonFinite)), v0,
                                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      const __m512i q1 = _mm512_maskz_cvt_roundps_epi32(static_cast<__mmask16>(~_mm512_fpclass_ps_mask(v1, kNonFinite)), v1,
                                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(ob + 2), _mm512_cvtepi32_epi8(q0));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(ob + 18), _mm512_cvtepi32_epi8(q1));
    }
}

bool quantize_avx512_supported() {
  static const bool ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  return ok;
}

}  // namespace

void quantize_rows_q8_0(const float* x, int64_t n, int64_t in, std::byte* out) {
  if (dense_kernel() == DenseKernel::reference || !quantize_avx512_supported()) {
    quantize_rows_q8_0_reference(x, n, in, out);
    return;
  }
#pragma omp parallel if (n * in >= (int64_t{1} << 16))
  {
    const int64_t nt = omp_get_num_threads(), me = omp_get_thread_num();
    quantize_rows_avx512(x, n * me / nt, n * (me + 1) / nt, in, out);
  }
}

void matmul_q8_reference(const std::byte* x_q, int64_t n, int64_t in, const std::byte* w, bool q4, int64_t out,
                         float* y, bool accumulate) {
  const int64_t blocks = in / kQBlock;
  const int64_t wrow = blocks * (q4 ? kQ4Bytes : kQ8Bytes);
  const int64_t work = n * in * out;
#pragma omp parallel for collapse(2) schedule(static) if (work > (1 << 18))
  for (int64_t r = 0; r < n; ++r)
    for (int64_t o = 0; o < out; ++o) {
      const float v = dot_row(w + o * wrow, q4, x_q + r * blocks * kQ8Bytes, blocks);
      if (accumulate)
        y[r * out + o] += v;
      else
        y[r * out + o] = v;
    }
}

// ---- AVX2 on the blocks as stored ----

bool q8_avx2_supported() {
  static const bool ok = dense_kernel_supported(DenseKernel::avx2);  // AVX2 + FMA + F16C
  return ok;
}

namespace {

/// Lane p of the result = the sum of v[p]'s eight int32 lanes (exact).
__attribute__((target("avx2"))) inline __m256i sum_lanes8(const __m256i* v) {
  const __m256i a = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
  const __m256i b = _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));
  // a = [partial sums of v0..v3 over lanes 0-3 | over lanes 4-7], b the same for v4..v7
  return _mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20), _mm256_permute2x128_si256(a, b, 0x31));
}

/// The 32 int8 weights of one block: Q8_0 as stored, Q4_0 unpacked to [-8, 7]
/// (low nibbles are weights 0-15, high nibbles 16-31).
template <bool Q4>
__attribute__((target("avx2"))) inline __m256i load_weights(const std::byte* blk) {
  if constexpr (Q4) {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 2));
    const __m256i nib = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), _mm256_set1_epi8(0x0F));
    return _mm256_sub_epi8(nib, _mm256_set1_epi8(8));
  } else {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2));
  }
}

/// Q8 AVX2 tile: activation rows [r0, r0+R) x weight rows [o0, o0+C), R * C == 8,
/// pair (r, c) in lane c * R + r. dx: the rows' scales as float, [blocks][R];
/// dw: the weight rows' scales, [blocks][C], or nullptr for C == 8 (decode: the
/// 8 rows' scales are read from their blocks in the loop, so the rows are
/// streamed once); dx and dw readable 8 floats past their last block.
/// `next`: weight rows to prefetch (the tile after next), or nullptr.
template <int R, int C, bool Q4>
__attribute__((target("avx2,fma,f16c"))) void q8_tile(const std::byte* x_q, int64_t r0, int64_t blocks, const std::byte* w,
                                                 int64_t wrow, int64_t o0, const float* dx, const float* dw,
                                                 const std::byte* next, float* y, int64_t out, bool accumulate) {
  static_assert(R * C == 8);
  constexpr int wb = Q4 ? kQ4Bytes : kQ8Bytes;
  const std::byte* xr[R];
  for (int r = 0; r < R; ++r) xr[r] = x_q + (r0 + r) * blocks * kQ8Bytes;
  const std::byte* wr[C];
  for (int c = 0; c < C; ++c) wr[c] = w + (o0 + c) * wrow;
  alignas(32) int32_t ir[8], ic[8];
  for (int p = 0; p < 8; ++p) {
    ir[p] = p % R;
    ic[p] = p / R;
  }
  const __m256i idx_r = _mm256_load_si256(reinterpret_cast<const __m256i*>(ir));
  const __m256i idx_c = _mm256_load_si256(reinterpret_cast<const __m256i*>(ic));
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    if (next != nullptr)
      for (int c = 0; c < C; ++c) _mm_prefetch(reinterpret_cast<const char*>(next + c * wrow + b * wb), _MM_HINT_T0);
    __m256i xv[R];
    for (int r = 0; r < R; ++r) xv[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr[r] + b * kQ8Bytes + 2));
    __m256i dots[8];
    for (int c = 0; c < C; ++c) {
      const __m256i wv = load_weights<Q4>(wr[c] + b * wb);
      const __m256i aw = _mm256_sign_epi8(wv, wv);  // |w| as u8 (-128 gives 128)
      for (int r = 0; r < R; ++r)
        dots[c * R + r] = _mm256_madd_epi16(_mm256_maddubs_epi16(aw, _mm256_sign_epi8(xv[r], wv)), ones);
    }
    const __m256 isum = _mm256_cvtepi32_ps(sum_lanes8(dots));  // exact: |isum| <= 32 * 127 * 128 < 2^24
    __m256 dwv;
    if constexpr (C == 8) {
      alignas(16) uint16_t h[8];
      for (int c = 0; c < 8; ++c) std::memcpy(&h[c], wr[c] + b * wb, 2);
      dwv = _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(h)));
    } else {
      dwv = _mm256_permutevar8x32_ps(_mm256_loadu_ps(dw + b * C), idx_c);
    }
    const __m256 d = _mm256_mul_ps(dwv, _mm256_permutevar8x32_ps(_mm256_loadu_ps(dx + b * R), idx_r));
    acc = _mm256_fmadd_ps(isum, d, acc);
  }
  alignas(32) float v[8];
  _mm256_store_ps(v, acc);
  for (int c = 0; c < C; ++c)
    for (int r = 0; r < R; ++r) {
      float& dst = y[(r0 + r) * out + o0 + c];
      dst = accumulate ? dst + v[c * R + r] : v[c * R + r];
    }
}

/// Block scales of `rows` rows of blocks starting at `p` (row stride `stride` bytes) as float (F16C, exact),
/// interleaved: dst[b * rows + i].
__attribute__((target("f16c"))) void scales_interleaved(const std::byte* p, int64_t stride, int rows, int64_t blocks,
                                                       int block_bytes, float* dst) {
  for (int i = 0; i < rows; ++i)
    for (int64_t b = 0; b < blocks; ++b) {
      uint16_t h;
      std::memcpy(&h, p + i * stride + b * block_bytes, 2);
      dst[b * rows + i] = _cvtsh_ss(h);
    }
}

template <bool Q4>
void matmul_q8_avx2_impl(const std::byte* x_q, int64_t n, int64_t in, const std::byte* w, int64_t out, float* y,
                         bool accumulate) {
  constexpr int wb = Q4 ? kQ4Bytes : kQ8Bytes;
  constexpr int64_t kRows = 4, kCols = 2, kDecodeCols = 8;
  const int64_t blocks = in / kQBlock, wrow = blocks * wb, xrow = blocks * kQ8Bytes;
  const int64_t row_tiles = n / kRows, rest = n - row_tiles * kRows;
  // The activation scales, per tile of 4 rows ([tile][block][4]) then per row left over ([row][block]),
  // 8 floats of padding for the kernels' 8-wide loads.
  std::vector<float> dx(static_cast<std::size_t>(n * blocks + 8));
  for (int64_t t = 0; t < row_tiles; ++t)
    scales_interleaved(x_q + t * kRows * xrow, xrow, kRows, blocks, kQ8Bytes, dx.data() + t * kRows * blocks);
  for (int64_t r = row_tiles * kRows; r < n; ++r)
    scales_interleaved(x_q + r * xrow, xrow, 1, blocks, kQ8Bytes, dx.data() + r * blocks);
  // Weight rows one tile at a time: pairs of rows for the 4-row tiles, groups of 8 for the rows left
  // over (all of decode); a weight row outside both (out not a multiple of 2 or 8) takes the reference.
  const int64_t pair_tiles = row_tiles > 0 ? out / kCols : 0;
  const int64_t oct_tiles = rest > 0 ? out / kDecodeCols : 0;
  const bool parallel = n * in * out > (int64_t{1} << 20);
  detail::FirstException error;  // std::bad_alloc of a thread's buffer, rethrown after the region
#pragma omp parallel if (parallel)
  {
    std::vector<float> dw;
    error.run([&] { dw.resize(static_cast<std::size_t>(blocks * kCols + 8)); });
    // Every thread meets both loops; one whose buffer failed takes no pair tile (its results are not used).
#pragma omp for schedule(static) nowait
    for (int64_t t = 0; t < pair_tiles; ++t) {
      if (dw.empty()) continue;
      const int64_t o0 = t * kCols;
      scales_interleaved(w + o0 * wrow, wrow, kCols, blocks, wb, dw.data());
      for (int64_t rt = 0; rt < row_tiles; ++rt)
        q8_tile<4, 2, Q4>(x_q, rt * kRows, blocks, w, wrow, o0, dx.data() + rt * kRows * blocks, dw.data(), nullptr, y,
                          out, accumulate);
    }
#pragma omp for schedule(static) nowait
    for (int64_t t = 0; t < oct_tiles; ++t) {
      const int64_t o0 = t * kDecodeCols;
      const std::byte* next = t + 2 < oct_tiles ? w + (o0 + 2 * kDecodeCols) * wrow : nullptr;
      for (int64_t r = row_tiles * kRows; r < n; ++r)
        q8_tile<1, 8, Q4>(x_q, r, blocks, w, wrow, o0, dx.data() + r * blocks, nullptr, next, y, out, accumulate);
    }
  }
  error.rethrow();
  // The weight rows no tile took, for the rows of each kind.
  for (int64_t r = 0; r < n; ++r) {
    const int64_t first = r < row_tiles * kRows ? pair_tiles * kCols : oct_tiles * kDecodeCols;
    for (int64_t o = first; o < out; ++o) {
      const float v = dot_row(w + o * wrow, Q4, x_q + r * xrow, blocks);
      float& dst = y[r * out + o];
      dst = accumulate ? dst + v : v;
    }
  }
}

}  // namespace

void matmul_q8_avx2(const std::byte* x_q, int64_t n, int64_t in, const std::byte* w, bool q4, int64_t out, float* y,
                    bool accumulate) {
  if (!q8_avx2_supported()) throw std::logic_error("matmul_q8_avx2: this CPU has no AVX2 + FMA + F16C");
  if (n <= 0 || out <= 0) return;
  if (q4)
    matmul_q8_avx2_impl<true>(x_q, n, in, w, out, y, accumulate);
  else
    matmul_q8_avx2_impl<false>(x_q, n, in, w, out, y, accumulate);
}

// ---- AVX-512 VNNI and AMX-INT8, on the blocks as stored ----------------------------------------------------
// Both read the weights where the file keeps them: no copy outlives a call. A panel of 16 weight rows is repacked
// per call into the layout the instructions read (per block: the 16 rows' 32 int8 as 8 groups x 16 rows x 4 bytes,
// which is both _mm512_dpbusd_epi32's operand, made unsigned, and AMX's B tile, signed; the 16 scales as float),
// used by every row of x, and dropped. Decode (one row of x) reads the blocks directly, as runs of rows side by
// side, prefetched as the dense decode's plan for the dtype says (DecodeStreams, kernels_dense.hpp). Every path computes each output as the reference: over the blocks in ascending
// order, acc = fmaf((float) isum, d_w * d_x, acc), isum the exact int32 block dot product; integer sums are exact
// in any order, so the bits are the reference's.

namespace {

constexpr int64_t kPanel = 16;                                  // weight rows per panel
constexpr int64_t kPanelBlockBytes = 8 * 16 * 4 + 16 * 4;  // qs, d (f32)

#define POSENC_TARGET_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,f16c,fma")))
#define POSENC_TARGET_AMX __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,f16c,fma,amx-tile,amx-int8")))

bool cpu_has_vnni() {
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni") && q8_avx2_supported();
}

/// AMX-INT8: CPUID.(EAX=7,ECX=0):EDX bits 24 (AMX-TILE) and 25 (AMX-INT8), and the kernel's permission to use the
/// tile data (Linux 5.16+: arch_prctl ARCH_REQ_XCOMP_PERM, asked once per process).
bool cpu_has_amx() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (__get_cpuid_count(7, 0, &a, &b, &c, &d) == 0) return false;
  if ((d & (1u << 24)) == 0 || (d & (1u << 25)) == 0) return false;
  constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0 && cpu_has_vnni();
}

/// Panel [o0, o0 + rows) (rows <= 16; the others are zero) of W, blocks [0, blocks), into dst (blocks x
/// kPanelBlockBytes, 64-byte aligned). Unsigned (the VNNI panels, dpbusd's u8 operand): the weights + 128 (Q8_0, the
/// sign bit flipped) or + 8 (Q4_0: the nibbles as stored); otherwise (AMX's tdpbssd) the weights themselves.
template <bool Q4, bool Unsigned>
POSENC_TARGET_VNNI void pack_panel(const std::byte* w, int64_t wrow, int64_t o0, int64_t rows, int64_t blocks,
                                   std::byte* dst) {
  constexpr int64_t wb = Q4 ? kQ4Bytes : kQ8Bytes;
  const __mmask16 valid = static_cast<__mmask16>((1u << rows) - 1u);
  // Byte offsets of the 16 rows' blocks (rows past the last one are masked off). A panel spans at most 16 rows of
  // blocks: int32 offsets hold it for rows under 128 MiB.
  const __m512i row_off = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                             _mm512_set1_epi32(static_cast<int32_t>(wrow)));
  const std::byte* base = w + o0 * wrow;
  for (int64_t b = 0; b < blocks; ++b) {
    std::byte* pb = dst + b * kPanelBlockBytes;
    const __m512i off = _mm512_add_epi32(row_off, _mm512_set1_epi32(static_cast<int32_t>(b * wb)));
    // Scales: the first two bytes of each row's block, widened exactly.
    const __m512i dwords = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), valid, off, base, 1);
    _mm512_store_ps(reinterpret_cast<float*>(pb + 512), _mm512_cvtph_ps(_mm512_cvtepi32_epi16(dwords)));
    if constexpr (Q4) {
      for (int k = 0; k < 4; ++k) {  // bytes 4k..4k+3 of the nibbles: weights 4k.. (low) and 16 + 4k.. (high)
        const __m512i v =
            _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), valid, _mm512_add_epi32(off, _mm512_set1_epi32(2 + 4 * k)), base, 1);
        const __m512i bias = _mm512_set1_epi8(Unsigned ? 0 : 8), m = _mm512_set1_epi8(0x0F);
        // The rows past the panel's (masked off: their 4 bytes per lane zero) stay zero.
        const __m512i lo = _mm512_maskz_mov_epi32(valid, _mm512_sub_epi8(_mm512_and_si512(v, m), bias));
        const __m512i hi =
            _mm512_maskz_mov_epi32(valid, _mm512_sub_epi8(_mm512_and_si512(_mm512_srli_epi16(v, 4), m), bias));
        _mm512_store_si512(pb + k * 64, lo);
        _mm512_store_si512(pb + (4 + k) * 64, hi);
      }
    } else {
      for (int g = 0; g < 8; ++g) {
        const __m512i v =
            _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), valid, _mm512_add_epi32(off, _mm512_set1_epi32(2 + 4 * g)), base, 1);
        _mm512_store_si512(pb + g * 64, Unsigned ? _mm512_maskz_xor_epi32(valid, v, _mm512_set1_epi8(static_cast<char>(0x80))) : v);
      }
    }
  }
}

/// What a panel kernel (vnni_panel_rows, amx_panel_tile) does with its results: store them in y, add them to y,
/// or y = silu(y) * result (SwiGLU with y the gate's projection: the up projection's output never stored).
enum class TileEpilogue { store, accumulate, swiglu };

inline TileEpilogue store_or_accumulate(bool accumulate) {
  return accumulate ? TileEpilogue::accumulate : TileEpilogue::store;
}

/// Rows [0, R) of x (xq rows at stride xrow; dxf: their scales as float, xoff: x_offsets_into's, both [R][blocks])
/// against a panel packed unsigned: y[i, 0..cols) (+)= over the blocks, fmaf(isum, d_w * d_x, acc), isum = the
/// dpbusd of the unsigned weights by x (four bytes of x broadcast from memory: no shuffle), started from x's offset.
template <int R>
POSENC_TARGET_VNNI void vnni_panel_rows(const std::byte* xq, int64_t xrow, const float* dxf, const int32_t* xoff,
                                        int64_t blocks, const std::byte* panel, float* y, int64_t ldy, int64_t cols,
                                        TileEpilogue epilogue) {
  __m512 acc[R];
  for (int i = 0; i < R; ++i) acc[i] = _mm512_setzero_ps();
  if (epilogue == TileEpilogue::swiglu)  // the gate's outputs the epilogue reads, while the products run
    for (int i = 0; i < R; ++i) _mm_prefetch(reinterpret_cast<const char*>(y + i * ldy), _MM_HINT_T0);
  for (int64_t b = 0; b < blocks; ++b) {
    const std::byte* pb = panel + b * kPanelBlockBytes;
    const __m512 dw = _mm512_load_ps(reinterpret_cast<const float*>(pb + 512));
    // Each row's sums start from x's offset, sum (w + 128) x - 128 sum x (Q4_0: (w + 8) x - 8 sum x): the exact
    // block dot products.
    __m512i isum[R];
    for (int i = 0; i < R; ++i) isum[i] = _mm512_set1_epi32(xoff[i * blocks + b]);
    for (int g = 0; g < 8; ++g) {
      const __m512i wu = _mm512_load_si512(pb + g * 64);
      for (int i = 0; i < R; ++i) {
        int32_t quad;
        std::memcpy(&quad, xq + i * xrow + b * kQ8Bytes + 2 + 4 * g, 4);
        isum[i] = _mm512_dpbusd_epi32(isum[i], wu, _mm512_set1_epi32(quad));
      }
    }
    for (int i = 0; i < R; ++i) {
      const __m512 dd = _mm512_mul_ps(dw, _mm512_set1_ps(dxf[i * blocks + b]));
      acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[i]), dd, acc[i]);
    }
  }
  const __mmask16 m = static_cast<__mmask16>((1u << cols) - 1u);
  for (int i = 0; i < R; ++i) {
    float* yr = y + i * ldy;
    if (epilogue == TileEpilogue::swiglu) {
      alignas(64) float h3[16];
      _mm512_store_ps(h3, acc[i]);
      swiglu_serial(yr, h3, cols);
      continue;
    }
    __m512 v = acc[i];
    if (epilogue == TileEpilogue::accumulate) v = _mm512_add_ps(_mm512_maskz_loadu_ps(m, yr), v);
    _mm512_mask_storeu_ps(yr, m, v);
  }
}

/// x's block scales as float into dxf, [n][blocks] (exact), resizing it.
void x_scales_into(const std::byte* x_q, int64_t n, int64_t blocks, std::vector<float>& dxf) {
  dxf.resize(static_cast<std::size_t>(n * blocks));
  for (int64_t i = 0; i < n * blocks; ++i) dxf[static_cast<std::size_t>(i)] = load_fp16(x_q + i * kQ8Bytes);
}

/// x's block scales as float, [n][blocks] (exact).
std::vector<float> x_scales(const std::byte* x_q, int64_t n, int64_t blocks) {
  std::vector<float> dxf;
  x_scales_into(x_q, n, blocks, dxf);
  return dxf;
}

/// What a block dot product of x with weights made unsigned (Q8_0: w + 128; Q4_0: the nibble, w + 8) takes to be
/// the exact one: -128 (or -8) times the sum of the block's 32 int8 of x, for each of x's first `blocks` blocks (rows
/// of x are consecutive blocks), into off (resized).
template <bool Q4>
void x_offsets_into(const std::byte* x_q, int64_t blocks, std::vector<int32_t>& off) {
  off.resize(static_cast<std::size_t>(blocks));
  for (int64_t b = 0; b < blocks; ++b) {
    int32_t sum = 0;
    for (int i = 0; i < kQBlock; ++i) sum += static_cast<int8_t>(x_q[b * kQ8Bytes + 2 + i]);
    off[static_cast<std::size_t>(b)] = (Q4 ? -8 : -128) * sum;
  }
}

/// Enough work for a parallel region.
bool q8_parallel(int64_t n, int64_t in, int64_t out) { return n * in * out > (int64_t{1} << 20); }

/// A panel buffer, 64-byte aligned.
struct PanelBuffer {
  explicit PanelBuffer(int64_t blocks) : bytes(static_cast<std::size_t>(blocks * kPanelBlockBytes)) {}
  std::vector<std::byte, AlignedAllocator<std::byte>> bytes;
  std::byte* data() { return bytes.data(); }
};

template <bool Q4>
void matmul_q8_vnni_panels(const std::byte* x_q, int64_t n, int64_t in, const std::byte* w, int64_t out, float* y,
                           TileEpilogue epilogue) {
  constexpr int64_t kR = 4;
  const int64_t blocks = in / kQBlock, xrow = blocks * kQ8Bytes, wrow = blocks * (Q4 ? kQ4Bytes : kQ8Bytes);
  const std::vector<float> dxf = x_scales(x_q, n, blocks);
  std::vector<int32_t> xoff;
  x_offsets_into<Q4>(x_q, n * blocks, xoff);  // x's rows are consecutive blocks
  const int64_t panels = (out + kPanel - 1) / kPanel;
  const bool parallel = q8_parallel(n, in, out);
  // Runs of about an eighth of a thread's share of the panels, to whichever thread asks next: a static share left
  // the threads waiting for each other at the region's end whenever one core ran slower (a virtual machine's core
  // sharing its host; see PanelItems in kernels_dense.cpp). Which thread computes an output does not change its bits.
  const int64_t run = panels_per_item(panels, panels, region_threads(parallel));
  detail::FirstException error;  // std::bad_alloc of a thread's panel, rethrown after the region
#pragma omp parallel if (parallel)
  {
    std::optional<PanelBuffer> panel;
    error.run([&] { panel.emplace(blocks); });
    // Every thread meets the loop; one whose panel failed takes none of its panels (its results are not used).
#pragma omp for schedule(dynamic, run)
    for (int64_t p = 0; p < panels; ++p) {
      if (!panel) continue;
      const int64_t o0 = p * kPanel, cols = std::min(kPanel, out - o0);
      pack_panel<Q4, true>(w, wrow, o0, cols, blocks, panel->data());
      // The next panel's rows towards L2, a slice per group of rows (this thread's next, but at the end of a run).
      const int64_t next_bytes = p + 1 < panels ? std::min(kPanel, out - o0 - kPanel) * wrow : 0;
      const int64_t groups = (n + kR - 1) / kR;
      for (int64_t r0 = 0; r0 < n; r0 += kR) {
        prefetch_l2_part(w + (o0 + kPanel) * wrow, next_bytes, r0 / kR, groups);
        const std::byte* xr = x_q + r0 * xrow;
        const float* dr = dxf.data() + r0 * blocks;
        const int32_t* xo = xoff.data() + r0 * blocks;
        float* yr = y + r0 * out + o0;
        switch (std::min(kR, n - r0)) {
          case 4: vnni_panel_rows<4>(xr, xrow, dr, xo, blocks, panel->data(), yr, out, cols, epilogue); break;
          case 3: vnni_panel_rows<3>(xr, xrow, dr, xo, blocks, panel->data(), yr, out, cols, epilogue); break;
          case 2: vnni_panel_rows<2>(xr, xrow, dr, xo, blocks, panel->data(), yr, out, cols, epilogue); break;
          default: vnni_panel_rows<1>(xr, xrow, dr, xo, blocks, panel->data(), yr, out, cols, epilogue); break;
        }
      }
    }
  }
  error.rethrow();
}

/// Lane j of the result = the sum of v[j]'s eight int32 lanes (exact, so in any order): three levels of in-lane
/// unpacks and adds in 256 bits, then one insert. (The same sums formed in 512 bits took 23 shuffles of 512 bits,
/// each two 256-bit halves on Zen 4, against 29 of 256 bits here.)
POSENC_TARGET_VNNI inline __m512i sum_lanes8x16(const __m256i* v) {
  __m256i t[8], u[4], w[2];
  for (int i = 0; i < 8; ++i)  // v[2i], v[2i+1] as a, b: [a0+a2, b0+b2, a1+a3, b1+b3 | a4+a6, b4+b6, a5+a7, b5+b7]
    t[i] = _mm256_add_epi32(_mm256_unpacklo_epi32(v[2 * i], v[2 * i + 1]),
                            _mm256_unpackhi_epi32(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i)  // v[4i .. 4i+3]: [the sums of their lanes 0-3 | of their lanes 4-7]
    u[i] = _mm256_add_epi32(_mm256_unpacklo_epi64(t[2 * i], t[2 * i + 1]),
                            _mm256_unpackhi_epi64(t[2 * i], t[2 * i + 1]));
  for (int i = 0; i < 2; ++i)  // v[8i .. 8i+7]'s sums in order
    w[i] = _mm256_add_epi32(_mm256_permute2x128_si256(u[2 * i], u[2 * i + 1], 0x20),
                            _mm256_permute2x128_si256(u[2 * i], u[2 * i + 1], 0x31));
  return _mm512_inserti64x4(_mm512_castsi256_si512(w[0]), w[1], 1);
}

/// Lane i of the result = lane (i + K) mod 16 of v.
template <int K>
POSENC_TARGET_VNNI inline __m512 rotate_lanes(__m512 v) {
  if constexpr (K % 16 == 0)
    return v;
  else
    return _mm512_castsi512_ps(_mm512_alignr_epi32(_mm512_castps_si512(v), _mm512_castps_si512(v), K % 16));
}

/// acc (lanes 0..R-1) += the products of blocks s = 0 .. steps-1 in order, block s's R lanes at s * R of isum and
/// scale moved down to 0..R-1. (A function, not a lambda: clang does not give a lambda its caller's target
/// attribute, and the AVX-512 intrinsics would not inline into it.)
template <int R, int... Ss>
POSENC_TARGET_VNNI inline __m512 fma_blocks_in_order(__m512 isum, __m512 scale, __m512 acc, int steps,
                                                     std::integer_sequence<int, Ss...>) {
  ((Ss < steps ? (acc = _mm512_fmadd_ps(rotate_lanes<Ss * R>(isum), rotate_lanes<Ss * R>(scale), acc), 0) : 0), ...);
  return acc;
}

/// A decode step's end (vnni_decode_tile_q4; vnni_decode_tile writes the same out): acc (lanes 0..R-1: rows
/// 0..R-1) += the products of blocks b0 .. b0 + steps - 1 in block order, from their exact sums isum (lane s * R +
/// j: block b0 + s, row j; without x's offsets) and the weights' scales hq (fp16 bits, lane i at bits 16 * (i % 4)
/// of hq[i / 4]).
template <int R>
POSENC_TARGET_VNNI inline __m512 finish_decode_step(__m512i isum, const uint64_t* hq, const float* dxf,
                                                    const int32_t* xoff, int64_t b0, int steps, __m512 acc) {
  constexpr int S = 16 / R;
  // Lane s * R + j takes x's scale and offset of block b0 + s (the blocks past the row's end: 0, read from no
  // memory).
  const __m512i lane_block = _mm512_setr_epi32(0 / R, 1 / R, 2 / R, 3 / R, 4 / R, 5 / R, 6 / R, 7 / R, 8 / R, 9 / R,
                                               10 / R, 11 / R, 12 / R, 13 / R, 14 / R, 15 / R);
  const __mmask16 live = static_cast<__mmask16>((1u << steps) - 1);
  const __m512i off = _mm512_permutexvar_epi32(lane_block, _mm512_maskz_loadu_epi32(live, xoff + b0));
  // The block dot products, exact integers (|sum| <= 32 * 255 * 128 before the offset) converted exactly: |sum|
  // <= 32 * 128 * 128 < 2^24.
  const __m512 sum = _mm512_cvtepi32_ps(_mm512_add_epi32(isum, off));
  const __m512 dw = _mm512_cvtph_ps(_mm256_set_epi64x(static_cast<long long>(hq[3]), static_cast<long long>(hq[2]),
                                                      static_cast<long long>(hq[1]), static_cast<long long>(hq[0])));
  const __m512 dx = _mm512_permutexvar_ps(lane_block, _mm512_maskz_loadu_ps(live, dxf + b0));
  const __m512 scale = _mm512_mul_ps(dw, dx);  // d_w * d_x, as the reference
  return fma_blocks_in_order<R>(sum, scale, acc, steps, std::make_integer_sequence<int, S>{});
}

/// The R results of a decode tile (acc's lanes 0..R-1) to y[j * stride], stored or added.
template <int R>
POSENC_TARGET_VNNI inline void store_decode_tile(__m512 acc, float* y, int64_t stride, bool accumulate) {
  alignas(64) float v[16];
  _mm512_store_ps(v, acc);
  for (int j = 0; j < R; ++j) y[j * stride] = accumulate ? y[j * stride] + v[j] : v[j];
}

/// Decode, Q8_0: one row of x (xq; dxf: its scales as float; xoff: x_offsets_into's) against the R rows o_j = o_0 +
/// j * stride (w: row o_0), S = 16 / R blocks at a time; outputs to y[j * stride]. Per row and block one 256-bit
/// dpbusd of the weights made unsigned (w + 128, the sign bit flipped) by x (s8); the 16 block sums of a step (lane
/// s * R + j: block b0 + s, row j) are reduced at once (sum_lanes8x16), x's offsets added (exact integers: the
/// block dot products), and each row's S fmas then run in block order in lanes 0..R-1 (the other lanes' values are
/// not used). Prefetch: each row's line `ahead` bytes ahead, once per 64 bytes of the row (the plan's;
/// kernels_dense.hpp). The step's end is written out here rather than shared with vnni_decode_tile_q4
/// (finish_decode_step): with the shared one the loop's instructions were the same but for register allocation,
/// and the 487M Q8_0 model decoded 0.4-5.5% slower at one thread in each of nine alternations (Zen 4). Tried and
/// slower: vnni_decode_tile_q4's layout, two rows' halves per vector (from L2 32.3 against 35.2 GB/s by inserts,
/// 31.1 against 35.7 by blends of overlapping loads).
template <int R, bool Prefetch>
POSENC_TARGET_VNNI void vnni_decode_tile(const std::byte* xq, const float* dxf, const int32_t* xoff, int64_t blocks,
                                         const std::byte* w, int64_t wrow, int64_t stride, float* y, bool accumulate,
                                         int64_t ahead) {
  static_assert(R == 2 || R == 4 || R == 8 || R == 16);
  constexpr int S = 16 / R;
  constexpr int64_t wb = kQ8Bytes;
  __m512 acc = _mm512_setzero_ps();
  for (int64_t b0 = 0; b0 < blocks; b0 += S) {
    const int steps = static_cast<int>(std::min<int64_t>(S, blocks - b0));
    __m256i part[16];
    // The 16 weight scales (fp16 bits), four to a 64-bit word in lane order, assembled in general registers: stored
    // as 16 halfs and loaded as one vector they stalled the loop on a failed store-to-load forward (measured with the
    // plan of 4 runs: 34.7 GB/s against 42 with the scales left out); gathered (vpgatherdd), 28.5 against 35.5.
    uint64_t hq[4] = {0, 0, 0, 0};
#pragma GCC unroll 8
    for (int s = 0; s < S; ++s) {
      if (s >= steps) {  // the last step of a row whose blocks are not a multiple of S: zero sums, zero scales
#pragma GCC unroll 16
        for (int j = 0; j < R; ++j) part[s * R + j] = _mm256_setzero_si256();
        continue;
      }
      const int64_t b = b0 + s;
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + b * kQ8Bytes + 2));
      const bool prefetch = Prefetch && (b * wb) % 64 + wb >= 64;
#pragma GCC unroll 16
      for (int j = 0; j < R; ++j) {
        const std::byte* blk = w + j * stride * wrow + b * wb;
        if (prefetch)  // the address as an integer: it may lie past the matrix (a prefetch does not fault)
          _mm_prefetch(reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(blk) +
                                                     static_cast<uintptr_t>(ahead + wb - 1)),
                       _MM_HINT_T0);
        uint16_t h;
        std::memcpy(&h, blk, 2);
        hq[(s * R + j) / 4] |= uint64_t{h} << (16 * ((s * R + j) % 4));
        const __m256i wu = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2)),
                                            _mm256_set1_epi8(static_cast<char>(0x80)));  // w + 128, as u8
        part[s * R + j] = _mm256_dpbusd_epi32(_mm256_setzero_si256(), wu, xv);
      }
    }
    // Lane s * R + j takes x's scale and offset of block b0 + s (the blocks past the row's end: 0, read from no
    // memory).
    const __m512i lane_block = _mm512_setr_epi32(0 / R, 1 / R, 2 / R, 3 / R, 4 / R, 5 / R, 6 / R, 7 / R, 8 / R, 9 / R,
                                                 10 / R, 11 / R, 12 / R, 13 / R, 14 / R, 15 / R);
    const __mmask16 live = static_cast<__mmask16>((1u << steps) - 1);
    const __m512i off = _mm512_permutexvar_epi32(lane_block, _mm512_maskz_loadu_epi32(live, xoff + b0));
    // The block dot products, exact integers (|sum| <= 32 * 255 * 128 before the offset) converted exactly: |isum|
    // <= 32 * 128 * 128 < 2^24.
    const __m512 isum = _mm512_cvtepi32_ps(_mm512_add_epi32(sum_lanes8x16(part), off));
    const __m512 dw = _mm512_cvtph_ps(_mm256_set_epi64x(static_cast<long long>(hq[3]), static_cast<long long>(hq[2]),
                                                        static_cast<long long>(hq[1]), static_cast<long long>(hq[0])));
    const __m512 dx = _mm512_permutexvar_ps(lane_block, _mm512_maskz_loadu_ps(live, dxf + b0));
    const __m512 scale = _mm512_mul_ps(dw, dx);  // d_w * d_x, as the reference
    acc = fma_blocks_in_order<R>(isum, scale, acc, steps, std::make_integer_sequence<int, S>{});
  }
  alignas(64) float v[16];
  _mm512_store_ps(v, acc);
  for (int j = 0; j < R; ++j) y[j * stride] = accumulate ? y[j * stride] + v[j] : v[j];
}

/// Lane i of the result = the sum of the four int32 of 128-bit half (i / 4) % 2 of v[(i / 8) * 4 + i % 4] (8
/// vectors, 16 halves; exact, so in any order): two levels of in-lane unpacks and adds, then one insert (13
/// shuffles of 256 bits for 16 sums, against sum_lanes8x16's 29).
POSENC_TARGET_VNNI inline __m512i sum_quads8x2(const __m256i* v) {
  __m256i t[4], u[2];
  for (int i = 0; i < 4; ++i)  // in each half, of a = v[2i], b = v[2i+1]: [a0+a2, b0+b2, a1+a3, b1+b3]
    t[i] = _mm256_add_epi32(_mm256_unpacklo_epi32(v[2 * i], v[2 * i + 1]),
                            _mm256_unpackhi_epi32(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 2; ++i)  // in each half, the sums of v[4i], ..., v[4i+3] in order
    u[i] = _mm256_add_epi32(_mm256_unpacklo_epi64(t[2 * i], t[2 * i + 1]),
                            _mm256_unpackhi_epi64(t[2 * i], t[2 * i + 1]));
  return _mm512_inserti64x4(_mm512_castsi256_si512(u[0]), u[1], 1);
}

/// Decode, Q4_0: as vnni_decode_tile, with the two halves of a block (weights 0-15: the low nibbles of its 16
/// bytes; 16-31: the high ones) summed into the same four int32: rows 2p and 2p + 1 side by side in one vector (row
/// 2p's 16 bytes in the low 128 bits, 2p + 1's in the high), two dpbusd (the low nibbles by x's weights 0-15, the
/// high by 16-31, each broadcast to both 128-bit lanes) into it. The reduction then starts from 4 int32 per row and
/// block, not 8 (sum_quads8x2), and a permute puts the sums in vnni_decode_tile's lanes: the same exact integers,
/// the same fmas, so the same bits. From L2 (BM_MatmulDecodeCached, Zen 4) 18.2-18.3 GB/s against 16.4-16.5 with one
/// 32-byte vector per row and block; the 487M Q4_0 model's decode in q8_activations, old and new alternated three
/// times, 64.7-65.7 -> 72.3-73.4 tokens/s at one thread (bench/vnni_raw/zen4-q4).
template <int R, bool Prefetch>
POSENC_TARGET_VNNI void vnni_decode_tile_q4(const std::byte* xq, const float* dxf, const int32_t* xoff, int64_t blocks,
                                            const std::byte* w, int64_t wrow, int64_t stride, float* y,
                                            bool accumulate, int64_t ahead) {
  static_assert(R == 2 || R == 4 || R == 8 || R == 16);
  constexpr int S = 16 / R, P = R / 2;  // blocks a step, row pairs
  constexpr int64_t wb = kQ4Bytes;
  // Lane s * R + j (block b0 + s, row j) takes lane i of sum_quads8x2's result: i's vector is q = (i / 8) * 4 + i %
  // 4 = s * P + p (rows 2p and 2p + 1 of block b0 + s), its half (i / 4) % 2 the row's parity.
  static constexpr std::array<int32_t, 16> kFrom = [] {
    std::array<int32_t, 16> from{};
    for (int i = 0; i < 16; ++i) {
      const int q = (i / 8) * 4 + i % 4, half = (i / 4) % 2;
      from[static_cast<std::size_t>((q / P) * R + (q % P) * 2 + half)] = i;
    }
    return from;
  }();
  const __m512i from = _mm512_loadu_si512(kFrom.data());
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  __m512 acc = _mm512_setzero_ps();
  for (int64_t b0 = 0; b0 < blocks; b0 += S) {
    const int steps = static_cast<int>(std::min<int64_t>(S, blocks - b0));
    __m256i part[8];
    uint64_t hq[4] = {0, 0, 0, 0};  // the 16 weight scales, as vnni_decode_tile
#pragma GCC unroll 8
    for (int s = 0; s < S; ++s) {
      if (s >= steps) {  // past the row's end: zero sums, zero scales
#pragma GCC unroll 8
        for (int p = 0; p < P; ++p) part[s * P + p] = _mm256_setzero_si256();
        continue;
      }
      const int64_t b = b0 + s;
      // x's weights 0-15 and 16-31, each in both 128-bit lanes (broadcast loads: no shuffle).
      const __m256i x_lo =
          _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(xq + b * kQ8Bytes + 2)));
      const __m256i x_hi =
          _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(xq + b * kQ8Bytes + 18)));
      const bool prefetch = Prefetch && (b * wb) % 64 + wb >= 64;
#pragma GCC unroll 8
      for (int p = 0; p < P; ++p) {
        const std::byte* blk0 = w + 2 * p * stride * wrow + b * wb;
        const std::byte* blk1 = blk0 + stride * wrow;
        if (prefetch) {
          prefetch_ahead(blk0, ahead + wb - 1);
          prefetch_ahead(blk1, ahead + wb - 1);
        }
        uint16_t h0, h1;
        std::memcpy(&h0, blk0, 2);
        std::memcpy(&h1, blk1, 2);
        const int lane = s * R + 2 * p;  // row 2p's; 2p + 1's is the next (lane is even: one 64-bit word)
        hq[lane / 4] |= (uint64_t{h0} | uint64_t{h1} << 16) << (16 * (lane % 4));
        // The nibbles are the weights + 8, as u8.
        const __m256i both = _mm256_inserti128_si256(
            _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk0 + 2))),
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk1 + 2)), 1);
        const __m256i lo = _mm256_and_si256(both, nibble), hi = _mm256_and_si256(_mm256_srli_epi16(both, 4), nibble);
        part[s * P + p] = _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), lo, x_lo), hi, x_hi);
      }
    }
    acc = finish_decode_step<R>(_mm512_permutexvar_epi32(from, sum_quads8x2(part)), hq, dxf, xoff, b0, steps, acc);
  }
  store_decode_tile<R>(acc, y, stride, accumulate);
}

/// The rows [r0, r1) as R runs of `stride` consecutive rows read side by side (the dense decode's DecodeStreams
/// plan), then the rows left over one at a time.
template <bool Q4, int R, bool Prefetch>
void vnni_decode_rows(const std::byte* x_q, const float* dxf, const int32_t* xoff, int64_t blocks, const std::byte* w,
                      float* y, bool accumulate, int64_t ahead, int64_t r0, int64_t r1) {
  const int64_t wrow = blocks * (Q4 ? kQ4Bytes : kQ8Bytes), stride = (r1 - r0) / R;
  for (int64_t g = 0; g < stride; ++g)
    if constexpr (Q4)
      vnni_decode_tile_q4<R, Prefetch>(x_q, dxf, xoff, blocks, w + (r0 + g) * wrow, wrow, stride, y + r0 + g,
                                       accumulate, ahead);
    else
      vnni_decode_tile<R, Prefetch>(x_q, dxf, xoff, blocks, w + (r0 + g) * wrow, wrow, stride, y + r0 + g, accumulate,
                                    ahead);
  for (int64_t o = r0 + stride * R; o < r1; ++o) {
    const float v = dot_row(w + o * wrow, Q4, x_q, blocks);
    y[o] = accumulate ? y[o] + v : v;
  }
}

/// Each thread of its own region a contiguous share of the rows; or, with `rows` (first >= 0), only the rows
/// [first, second), on the calling thread.
template <bool Q4, int R, bool Prefetch>
void matmul_q8_vnni_decode_runs(const std::byte* x_q, int64_t in, const std::byte* w, int64_t out, float* y,
                                bool accumulate, int64_t ahead, std::pair<int64_t, int64_t> rows) {
  const int64_t blocks = in / kQBlock, wrow = blocks * (Q4 ? kQ4Bytes : kQ8Bytes);
  if (rows.first >= 0) {
    // Called inside the caller's parallel region (a decode team): x's scales in a buffer of this thread's, sized
    // once, not a fresh vector per call.
    thread_local std::vector<float> dxf;
    thread_local std::vector<int32_t> xoff;
    x_scales_into(x_q, 1, blocks, dxf);
    x_offsets_into<Q4>(x_q, blocks, xoff);
    vnni_decode_rows<Q4, R, Prefetch>(x_q, dxf.data(), xoff.data(), blocks, w, y, accumulate, ahead, rows.first,
                                      rows.second);
    return;
  }
  const std::vector<float> dxf = x_scales(x_q, 1, blocks);
  std::vector<int32_t> xoff;
  x_offsets_into<Q4>(x_q, blocks, xoff);
#pragma omp parallel if (out * wrow >= (int64_t{1} << 17))
  {
    const int64_t nt = omp_get_num_threads(), me = omp_get_thread_num();
    vnni_decode_rows<Q4, R, Prefetch>(x_q, dxf.data(), xoff.data(), blocks, w, y, accumulate, ahead, out * me / nt,
                                      out * (me + 1) / nt);
  }
}

template <bool Q4>
void matmul_q8_vnni_decode(DecodeStreams plan, const std::byte* x_q, int64_t in, const std::byte* w, int64_t out,
                           float* y, bool accumulate, std::pair<int64_t, int64_t> rows = {-1, -1}) {
#define POSENC_VNNI_DECODE_RUNS(R)                                                                            \
  case R:                                                                                                     \
    if (plan.prefetch_bytes > 0)                                                                              \
      matmul_q8_vnni_decode_runs<Q4, R, true>(x_q, in, w, out, y, accumulate, plan.prefetch_bytes, rows);     \
    else                                                                                                      \
      matmul_q8_vnni_decode_runs<Q4, R, false>(x_q, in, w, out, y, accumulate, 0, rows);                      \
    return;
  switch (plan.runs) {
    POSENC_VNNI_DECODE_RUNS(2)
    POSENC_VNNI_DECODE_RUNS(4)
    POSENC_VNNI_DECODE_RUNS(8)
    POSENC_VNNI_DECODE_RUNS(16)
    default: throw std::logic_error(fmt::format("q8 decode: {} runs is not a plan (2, 4, 8 or 16)", plan.runs));
  }
#undef POSENC_VNNI_DECODE_RUNS
}

void matmul_q8_vnni(DecodeStreams plan, const std::byte* x_q, int64_t n, int64_t in, const std::byte* w, bool q4,
                    int64_t out, float* y, bool accumulate) {
  if (n == 1) {
    if (q4)
      matmul_q8_vnni_decode<true>(plan, x_q, in, w, out, y, accumulate);
    else
      matmul_q8_vnni_decode<false>(plan, x_q, in, w, out, y, accumulate);
  } else if (q4) {
    matmul_q8_vnni_panels<true>(x_q, n, in, w, out, y, store_or_accumulate(accumulate));
  } else {
    matmul_q8_vnni_panels<false>(x_q, n, in, w, out, y, store_or_accumulate(accumulate));
  }
}

// ---- AMX-INT8 ----
// Per block, one tdpbssd of a 16 x 32 int8 tile of x (16 rows, one block each, repacked per call so that the
// tileloadd reads 512 contiguous bytes) by the panel's 8 x 64 block (16 weight rows) gives the 16 x 16 exact int32
// block dot products; the AVX-512 epilogue then takes acc = fmaf((float) isum, d_w * d_x, acc) per row of x (16
// outputs in a zmm), a group of blocks behind the products.

/// Blocks per group of the pipeline (4 KiB of int32 sums each; measured 4, 8, 16 on the 487M shapes: 4 best, by a
/// few percent).
constexpr int64_t kAmxGroup = 4;

/// The products of blocks [g0, g1) of a tile of x (xa) by a panel into c[b - g0]. Tiles (GCC's _tile_* macros take
/// literal numbers): tmm0..tmm3 take turns as C, so that a group's four products are in flight; tmm6 is x's A,
/// tmm7 the panel's B.
POSENC_TARGET_AMX inline void amx_products(const std::byte* xa, const std::byte* panel, int64_t g0, int64_t g1,
                                           int32_t (*c)[16][16]) {
#define POSENC_AMX_BLOCK(C)                              \
  _tile_zero(C);                                         \
  _tile_loadd(6, xa + b * 512, kQBlock);                 \
  _tile_loadd(7, panel + b * kPanelBlockBytes, 64);      \
  _tile_dpbssd(C, 6, 7);                                 \
  _tile_stored(C, c[b - g0], 64);
  for (int64_t b = g0; b < g1; ++b) {
    switch ((b - g0) % 4) {
      case 0: POSENC_AMX_BLOCK(0) break;
      case 1: POSENC_AMX_BLOCK(1) break;
      case 2: POSENC_AMX_BLOCK(2) break;
      default: POSENC_AMX_BLOCK(3) break;
    }
  }
#undef POSENC_AMX_BLOCK
}

/// A tile of 16 rows of x (xa: [block][16][32] int8, dxf [16][blocks]) against a packed panel: y[i, 0..cols) (+)=.
/// Software-pipelined by groups of kAmxGroup blocks: the next group's products are issued (tdpbssd, then
/// tilestored into a buffer) before this group's epilogues run (acc = fmaf(isum, d_w d_x, acc) per row, in
/// AVX-512), so the AMX unit and the vector ports work at the same time. With the epilogue of each block right
/// after its own tilestored, the loads waited on that store (and it on tdpbssd) every block (measured: 40% of the
/// time at the instruction after tilestored).
POSENC_TARGET_AMX void amx_panel_tile(const std::byte* xa, const float* dxf, int64_t blocks, const std::byte* panel,
                                      int rows, float* y, int64_t ldy, int64_t cols, TileEpilogue epilogue,
                                      const PrefetchSlice& next) {
  __m512 acc[16];
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
  if (epilogue == TileEpilogue::swiglu)  // the gate's outputs this tile's epilogue reads, while its products run
    for (int i = 0; i < rows; ++i) _mm_prefetch(reinterpret_cast<const char*>(y + i * ldy), _MM_HINT_T0);
  alignas(64) int32_t c[2][kAmxGroup][16][16];
  if (blocks > 0) amx_products(xa, panel, 0, std::min(blocks, kAmxGroup), c[0]);
  for (int64_t g0 = 0, gi = 0; g0 < blocks; g0 += kAmxGroup, ++gi) {
    const int64_t g1 = std::min(blocks, g0 + kAmxGroup);
    if (g1 < blocks) amx_products(xa, panel, g1, std::min(blocks, g1 + kAmxGroup), c[(gi + 1) & 1]);
    const int32_t(*cb)[16][16] = c[gi & 1];
    for (int64_t b = g0; b < g1; ++b) {
      next.issue(b, blocks);
      const __m512 dw = _mm512_load_ps(reinterpret_cast<const float*>(panel + b * kPanelBlockBytes + 512));
#pragma GCC unroll 16
      for (int i = 0; i < 16; ++i)
        acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(cb[b - g0][i])),
                                 _mm512_mul_ps(dw, _mm512_set1_ps(dxf[i * blocks + b])), acc[i]);
    }
  }
  const __mmask16 m = static_cast<__mmask16>((1u << cols) - 1u);
  if (epilogue == TileEpilogue::swiglu) {
    for (int i = 0; i < rows; ++i) {  // y = silu(y) * (x W^T), as swiglu(y, h3) would on the stored h3
      alignas(64) float h3[16];
      _mm512_store_ps(h3, acc[i]);
      swiglu_serial(y + i * ldy, h3, cols);
    }
    return;
  }
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i) {
    if (i >= rows) break;
    float* yr = y + i * ldy;
    __m512 v = acc[i];
    if (epilogue == TileEpilogue::accumulate) v = _mm512_add_ps(_mm512_maskz_loadu_ps(m, yr), v);
    _mm512_mask_storeu_ps(yr, m, v);
  }
}

POSENC_TARGET_AMX void amx_int8_begin() {
  AmxTileConfig cfg;
  for (int t = 0; t < 4; ++t) {  // C: 16 rows of 16 int32
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  cfg.rows[6] = 16;  // A: 16 rows of x, one block (32 int8) each
  cfg.colsb[6] = kQBlock;
  cfg.rows[7] = kQBlock / 4;  // B: a block of 16 weight rows, 8 groups of 16 x 4 int8
  cfg.colsb[7] = 64;
  // GCC 12's _tile_loadconfig tells the compiler it reads 8 bytes of cfg: make the whole 64 visible, or the
  // stores above may be dropped as dead (seen in a standalone -O2 compile of this function).
  asm volatile("" : : "m"(cfg) : "memory");
  _tile_loadconfig(&cfg);
}
POSENC_TARGET_AMX void amx_int8_end() { _tile_release(); }

/// Row r of the A tiles and their scales (see matmul_q8_amx_impl) from row `src` of x_q, or zeros (src < 0).
POSENC_TARGET_AMX void amx_x_row(const std::byte* x_q, int64_t src, int64_t r, int64_t blocks, std::byte* xa,
                                 float* dxf) {
  const int64_t xrow = blocks * kQ8Bytes;
  std::byte* dst = xa + (r / 16 * blocks * 16 + r % 16) * kQBlock;  // block b at dst + b * 512
  if (src < 0) {
    for (int64_t b = 0; b < blocks; ++b) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + b * 512), _mm256_setzero_si256());
      dxf[r * blocks + b] = 0.0f;
    }
    return;
  }
  for (int64_t b = 0; b < blocks; ++b) {
    const std::byte* blk = x_q + src * xrow + b * kQ8Bytes;
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + b * 512),
                        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2)));
    uint16_t h;
    std::memcpy(&h, blk, 2);
    dxf[r * blocks + b] = _cvtsh_ss(h);  // vcvtph2ps: exact, as f16_to_f32
  }
}

template <bool Q4>
void matmul_q8_amx_impl(const std::byte* x_q, int64_t n, int64_t in, const std::byte* w, int64_t out, float* y,
                        TileEpilogue epilogue) {
  const int64_t blocks = in / kQBlock, wrow = blocks * (Q4 ? kQ4Bytes : kQ8Bytes);
  const int64_t tiles = (n + 15) / 16;
  // x as A tiles, [tile][block][16 rows][32 int8] (rows past n zero, their outputs dropped): each tileloadd then
  // reads 512 contiguous bytes, not 16 rows' 32 bytes at x's row stride, half of them across two cache lines
  // (measured: 500 -> 556 GFLOP/s on 4864 x 1024). The scales as float, [tile * 16 + row][block] (0 past n).
  // Written in full, not zeroed first (the memset of the down projection's 1.2 MB was 1% of a prefill).
  const auto xa = aligned_uninitialized<std::byte>(static_cast<std::size_t>(tiles * blocks * 512));
  const auto dxf = aligned_uninitialized<float>(static_cast<std::size_t>(tiles * 16 * blocks));
#pragma omp parallel for schedule(static) if (n * in >= (int64_t{1} << 16))
  for (int64_t r = 0; r < tiles * 16; ++r) amx_x_row(x_q, r < n ? r : -1, r, blocks, xa.get(), dxf.get());
  // Tiles of x a block at a time (a block's A tiles in half of a 2 MiB L2, a quarter more allowed and the blocks
  // balanced: the down projection's 16 tiles of a 256-token prompt were blocks of 13 and 3, now one of 16, 1.2 MiB),
  // panels inside it: each panel is repacked once per block of tiles.
  const int64_t tile_cap = std::max<int64_t>(1, (int64_t{1} << 20) / (blocks * 512));
  const BalancedBlocks tile_blocks(tiles, tile_cap, 1, tile_cap / 4);
  const int64_t panels = (out + kPanel - 1) / kPanel;
  detail::FirstException error;  // std::bad_alloc of a thread's panel, rethrown after the region
#pragma omp parallel if (q8_parallel(n, in, out))
  {
    amx_int8_begin();
    error.run([&] {
      PanelBuffer panel(blocks);
      const int64_t nt = omp_get_num_threads(), me = omp_get_thread_num();
      const int64_t p0 = panels * me / nt, p1 = panels * (me + 1) / nt;
      for (int64_t bi = 0; bi < tile_blocks.count; ++bi)
        for (int64_t p = p0; p < p1; ++p) {
          const int64_t o0 = p * kPanel, cols = std::min(kPanel, out - o0);
          pack_panel<Q4, false>(w, wrow, o0, cols, blocks, panel.data());
          // The next panel's rows (contiguous in w) towards L2, a slice per tile.
          const int64_t t0 = tile_blocks.begin(bi), t1 = tile_blocks.begin(bi + 1);
          const int64_t next_bytes = p + 1 < p1 ? std::min(kPanel, out - o0 - kPanel) * wrow : 0;
          for (int64_t t = t0; t < t1; ++t) {
            const int rows = static_cast<int>(std::min<int64_t>(16, n - t * 16));
            amx_panel_tile(xa.get() + t * blocks * 512, dxf.get() + t * 16 * blocks, blocks, panel.data(), rows,
                           y + t * 16 * out + o0, out, cols, epilogue,
                           {w + (o0 + kPanel) * wrow, next_bytes, t - t0, t1 - t0});
          }
        }
    });
    amx_int8_end();
  }
  error.rethrow();
}

}  // namespace

std::string_view to_string(Q8Kernel k) {
  switch (k) {
    case Q8Kernel::reference: return "reference";
    case Q8Kernel::avx2: return "avx2";
    case Q8Kernel::avx512_vnni: return "avx512_vnni";
    case Q8Kernel::amx: return "amx";
  }
  return "?";
}

bool q8_kernel_supported(Q8Kernel k) {
  static const bool vnni = cpu_has_vnni(), amx = cpu_has_amx();
  switch (k) {
    case Q8Kernel::reference: return true;
    case Q8Kernel::avx2: return q8_avx2_supported();
    case Q8Kernel::avx512_vnni: return vnni;
    case Q8Kernel::amx: return amx;
  }
  return false;
}

Q8Kernel q8_kernel() {
  static const Q8Kernel k = [] {
    if (dense_kernel() == DenseKernel::reference) return Q8Kernel::reference;
    const char* env = std::getenv("POSENC_Q8_KERNEL");
    const std::string want = env != nullptr ? env : "";
    for (Q8Kernel c : {Q8Kernel::amx, Q8Kernel::avx512_vnni, Q8Kernel::avx2, Q8Kernel::reference})
      if (q8_kernel_supported(c) && (want.empty() || want == to_string(c))) return c;
    const Q8Kernel best = q8_kernel_supported(Q8Kernel::amx)           ? Q8Kernel::amx
                          : q8_kernel_supported(Q8Kernel::avx512_vnni) ? Q8Kernel::avx512_vnni
                          : q8_kernel_supported(Q8Kernel::avx2)        ? Q8Kernel::avx2
                                                                       : Q8Kernel::reference;
    std::string runs;
    for (Q8Kernel c : {Q8Kernel::reference, Q8Kernel::avx2, Q8Kernel::avx512_vnni, Q8Kernel::amx})
      if (q8_kernel_supported(c)) runs += (runs.empty() ? "" : ", ") + std::string(to_string(c));
    std::fprintf(stderr,
                 "posenc: POSENC_Q8_KERNEL=%s is not a path this CPU runs (it runs %s; the paths are reference, avx2, "
                 "avx512_vnni and amx); using %s\n",
                 detail::escaped(want).c_str(), runs.c_str(), std::string(to_string(best)).c_str());
    return best;
  }();
  return k;
}

void matmul_q8_with(Q8Kernel k, const std::byte* x_q, int64_t n, int64_t in, const std::byte* w, bool q4, int64_t out,
                    float* y, bool accumulate) {
  // Only a VNNI/AMX decode takes a plan (and only then is a bad POSENC_DECODE_STREAMS reported).
  const bool decode = n == 1 && (k == Q8Kernel::avx512_vnni || k == Q8Kernel::amx);
  matmul_q8_with(k, decode ? decode_streams(q4 ? WeightType::q4_0 : WeightType::q8_0, DenseKernel::avx512) : DecodeStreams{}, x_q, n, in,
                 w, q4, out, y, accumulate);
}

void matmul_q8_with(Q8Kernel k, DecodeStreams plan, const std::byte* x_q, int64_t n, int64_t in, const std::byte* w,
                    bool q4, int64_t out, float* y, bool accumulate) {
  if (!decode_streams_valid(plan))
    throw std::logic_error("matmul_q8_with: " + describe_invalid(plan));
  if (!q8_kernel_supported(k))
    throw std::logic_error(fmt::format("matmul_q8_with: this CPU cannot run the {} path", to_string(k)));
  if (n <= 0 || out <= 0) return;
  // The panel repacking gathers a panel's 16 rows with int32 byte offsets: rows of 128 MiB or more (and rows of no
  // blocks) take the AVX2 or scalar path.
  const int64_t wrow = in / kQBlock * (q4 ? kQ4Bytes : kQ8Bytes);
  if ((k == Q8Kernel::avx512_vnni || k == Q8Kernel::amx) && (in <= 0 || 16 * wrow > INT32_MAX))
    k = q8_avx2_supported() && in > 0 ? Q8Kernel::avx2 : Q8Kernel::reference;
  switch (k) {
    case Q8Kernel::reference: matmul_q8_reference(x_q, n, in, w, q4, out, y, accumulate); return;
    case Q8Kernel::avx2: matmul_q8_avx2(x_q, n, in, w, q4, out, y, accumulate); return;
    case Q8Kernel::avx512_vnni: matmul_q8_vnni(plan, x_q, n, in, w, q4, out, y, accumulate); return;
    case Q8Kernel::amx:
      if (n < kAmxMinRows)
        matmul_q8_vnni(plan, x_q, n, in, w, q4, out, y, accumulate);
      else if (q4)
        matmul_q8_amx_impl<true>(x_q, n, in, w, out, y, store_or_accumulate(accumulate));
      else
        matmul_q8_amx_impl<false>(x_q, n, in, w, out, y, store_or_accumulate(accumulate));
      return;
  }
}

void matmul_q8_swiglu_with(Q8Kernel k, const std::byte* x_q, int64_t n, int64_t in, const std::byte* w, bool q4,
                           int64_t out, float* h1, float* h3) {
  if (!q8_kernel_supported(k))
    throw std::logic_error(fmt::format("matmul_q8_swiglu_with: this CPU cannot run the {} path", to_string(k)));
  if (n <= 0 || out <= 0) return;
  // The tile epilogues' SwiGLU asks swiglu_uses_avx512() inside the parallel regions; its first call checks expf
  // against libm with a buffer (std::bad_alloc there would leave a region): made here, outside them.
  swiglu_uses_avx512();
  const int64_t wrow = in / kQBlock * (q4 ? kQ4Bytes : kQ8Bytes);
  const bool panels = (k == Q8Kernel::amx || k == Q8Kernel::avx512_vnni) && in > 0 && 16 * wrow <= INT32_MAX;
  if (panels && k == Q8Kernel::amx && n >= kAmxMinRows) {
    if (q4)
      matmul_q8_amx_impl<true>(x_q, n, in, w, out, h1, TileEpilogue::swiglu);
    else
      matmul_q8_amx_impl<false>(x_q, n, in, w, out, h1, TileEpilogue::swiglu);
    return;
  }
  if (panels && n >= 2) {  // VNNI panels (and amx below kAmxMinRows rows, which takes them)
    if (q4)
      matmul_q8_vnni_panels<true>(x_q, n, in, w, out, h1, TileEpilogue::swiglu);
    else
      matmul_q8_vnni_panels<false>(x_q, n, in, w, out, h1, TileEpilogue::swiglu);
    return;
  }
  matmul_q8_with(k, x_q, n, in, w, q4, out, h3, false);
  swiglu(h1, h3, n * out);
}

void matmul_q8_swiglu(const std::byte* x_q, int64_t n, int64_t in, const std::byte* w, bool q4, int64_t out,
                      float* h1, float* h3) {
  matmul_q8_swiglu_with(q8_kernel(), x_q, n, in, w, q4, out, h1, h3);
}

void matmul_q8(const std::byte* x_q, int64_t n, int64_t in, const std::byte* w, bool q4, int64_t out, float* y,
               bool accumulate) {
  matmul_q8_with(q8_kernel(), x_q, n, in, w, q4, out, y, accumulate);
}

bool q8_decode_rows_supported(int64_t in, bool q4) {
  const Q8Kernel k = q8_kernel();
  const int64_t wrow = in / kQBlock * (q4 ? kQ4Bytes : kQ8Bytes);
  return (k == Q8Kernel::avx512_vnni || k == Q8Kernel::amx) && in > 0 && in % kQBlock == 0 && 16 * wrow <= INT32_MAX;
}

void matmul_q8_decode_rows(const std::byte* x_q, int64_t in, const std::byte* w, bool q4, int64_t out, float* y,
                           bool accumulate, int64_t first, int64_t last) {
  if (!q8_decode_rows_supported(in, q4))
    throw std::logic_error(fmt::format("matmul_q8_decode_rows: rows of {} weights on the {} path have no row-range "
                                       "decode", in, to_string(q8_kernel())));
  if (first < 0 || first > last || last > out)
    throw std::logic_error(
        fmt::format("matmul_q8_decode_rows: rows [{}, {}) are not rows of a matrix of {}", first, last, out));
  if (first == last) return;
  const DecodeStreams plan = decode_streams(q4 ? WeightType::q4_0 : WeightType::q8_0, DenseKernel::avx512);
  if (q4)
    matmul_q8_vnni_decode<true>(plan, x_q, in, w, out, y, accumulate, {first, last});
  else
    matmul_q8_vnni_decode<false>(plan, x_q, in, w, out, y, accumulate, {first, last});
}

void add_bias(float* y, int64_t n, int64_t d, const float* bias) {
  for (int64_t r = 0; r < n; ++r)
#pragma omp simd
    for (int64_t j = 0; j < d; ++j) y[r * d + j] += bias[j];
}

}  // namespace posenc::detail
