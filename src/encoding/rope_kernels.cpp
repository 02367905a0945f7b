// posenc — internal RoPE hot loops (see rope_kernels.hpp for the numerics).
//
// Compiled with -ffp-contract=off like every file outside src/attention: the
// rotation's products and sums stay separate float32 operations, so the
// vector path is bit-identical to the scalar reference loop. The sincos
// polynomial uses explicit FMA intrinsics (its accuracy target is 1 ulp after
// rounding to float, not bit equality with a particular libm).
#include "encoding/rope_kernels.hpp"

#include <cmath>
#include <cstring>
#include <memory>

#if defined(__AVX512F__) && defined(__AVX512DQ__)
#include <immintrin.h>
#define POSENC_ROPE_AVX512 1
// GCC 12 reports its own intrinsic headers' undefined pass-through vectors
// (e.g. in _mm512_cvtpd_ps) as maybe-uninitialized; they are not. (Pushed and popped at the end of the file: in the
// library's unity build the next files of the batch keep the warning.)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

namespace posenc::detail {

namespace {

/// Scalar reference of one row; also the fallback for huge/non-finite angles.
inline void cos_sin_scalar(float inv_freq, int64_t position, AnglePrecision precision, float& c,
                           float& s) {
  if (precision == AnglePrecision::float32) {
    // The float32 angle, then cos/sin in double rounded once to float, as the vector path computes them (the
    // float overloads, cosf/sinf, are not correctly rounded: on a CPU without AVX-512, where this path runs for
    // every lane, they made the table differ from an AVX-512 machine's in the last bit).
    const double angle = static_cast<double>(static_cast<float>(position) * inv_freq);
    c = static_cast<float>(std::cos(angle));
    s = static_cast<float>(std::sin(angle));
  } else {
    const double angle = static_cast<double>(position) * static_cast<double>(inv_freq);
    c = static_cast<float>(std::cos(angle));
    s = static_cast<float>(std::sin(angle));
  }
}

#ifdef POSENC_ROPE_AVX512

// Largest |angle| handled by the vector path; beyond it (or for NaN/inf) the
// lane is recomputed with libm. The three-part reduction is accurate far
// beyond this, the bound only keeps k small and exactly representable.
constexpr double kMaxVectorAngle = 1073741824.0;  // 2^30

/// sin and cos of 8 doubles. Reduction x = k*pi/2 + r with pi/2 split in
/// three doubles (the first product is exact inside the FMA), then fdlibm's
/// __kernel_sin/__kernel_cos minimax polynomials on |r| <= pi/4 (error below
/// 2^-58) and the quadrant k mod 4.
inline void sincos_pd(__m512d x, __m512d& sin_out, __m512d& cos_out) {
  const __m512d two_over_pi = _mm512_set1_pd(0.6366197723675814);
  const __m512d p1 = _mm512_set1_pd(1.5707963267948966);
  const __m512d p2 = _mm512_set1_pd(6.123233995736766e-17);
  const __m512d p3 = _mm512_set1_pd(-1.4973849048591698e-33);
  const __m512d k = _mm512_roundscale_pd(_mm512_mul_pd(x, two_over_pi),
                                         _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512d r = _mm512_fnmadd_pd(k, p1, x);
  r = _mm512_fnmadd_pd(k, p2, r);
  r = _mm512_fnmadd_pd(k, p3, r);
  const __m512d z = _mm512_mul_pd(r, r);

  // sin(r) = r + r*z*(S1 + z*(S2 + ... + z*S6))
  __m512d ps = _mm512_set1_pd(1.58969099521155010221e-10);
  ps = _mm512_fmadd_pd(ps, z, _mm512_set1_pd(-2.50507602534068634195e-08));
  ps = _mm512_fmadd_pd(ps, z, _mm512_set1_pd(2.75573137070700676789e-06));
  ps = _mm512_fmadd_pd(ps, z, _mm512_set1_pd(-1.98412698298579493134e-04));
  ps = _mm512_fmadd_pd(ps, z, _mm512_set1_pd(8.33333333332248946124e-03));
  ps = _mm512_fmadd_pd(ps, z, _mm512_set1_pd(-1.66666666666666324348e-01));
  const __m512d sin_r = _mm512_fmadd_pd(_mm512_mul_pd(r, z), ps, r);

  // cos(r) = 1 - z/2 + z^2*(C1 + z*(C2 + ... + z*C6))
  __m512d pc = _mm512_set1_pd(-1.13596475577881948265e-11);
  pc = _mm512_fmadd_pd(pc, z, _mm512_set1_pd(2.08757232129817482790e-09));
  pc = _mm512_fmadd_pd(pc, z, _mm512_set1_pd(-2.75573143513906633035e-07));
  pc = _mm512_fmadd_pd(pc, z, _mm512_set1_pd(2.48015872894767294178e-05));
  pc = _mm512_fmadd_pd(pc, z, _mm512_set1_pd(-1.38888888888741095749e-03));
  pc = _mm512_fmadd_pd(pc, z, _mm512_set1_pd(4.16666666666666019037e-02));
  const __m512d one_minus_half_z = _mm512_fnmadd_pd(_mm512_set1_pd(0.5), z, _mm512_set1_pd(1.0));
  const __m512d cos_r = _mm512_fmadd_pd(_mm512_mul_pd(z, z), pc, one_minus_half_z);

  // Quadrant q = k mod 4: sin x = (s, c, -s, -c)[q], cos x = (c, -s, -c, s)[q].
  const __m512i q = _mm512_cvtpd_epi64(k);
  const __m512i one = _mm512_set1_epi64(1);
  const __m512i two = _mm512_set1_epi64(2);
  const __mmask8 odd = _mm512_test_epi64_mask(q, one);
  const __mmask8 sin_neg = _mm512_test_epi64_mask(q, two);
  const __mmask8 cos_neg = _mm512_test_epi64_mask(_mm512_add_epi64(q, one), two);
  const __m512d sign = _mm512_set1_pd(-0.0);
  __m512d sv = _mm512_mask_blend_pd(odd, sin_r, cos_r);
  __m512d cv = _mm512_mask_blend_pd(odd, cos_r, sin_r);
  sin_out = _mm512_mask_xor_pd(sv, sin_neg, sv, sign);
  cos_out = _mm512_mask_xor_pd(cv, cos_neg, cv, sign);
}

/// Lanes that the vector path must not handle (|x| too large, inf, NaN).
inline __mmask8 out_of_range(__m512d x) {
  return _mm512_cmp_pd_mask(_mm512_abs_pd(x), _mm512_set1_pd(kMaxVectorAngle), _CMP_NLE_UQ);
}

/// cos/sin of 16 float angles (lanes under `m`), rounded to float.
inline void sincos_16(__m512d lo, __m512d hi, __m512& c, __m512& s, __mmask16& bad) {
  __m512d slo, clo, shi, chi;
  sincos_pd(lo, slo, clo);
  sincos_pd(hi, shi, chi);
  bad = static_cast<__mmask16>(out_of_range(lo) | (static_cast<unsigned>(out_of_range(hi)) << 8));
  c = _mm512_insertf32x8(_mm512_castps256_ps512(_mm512_cvtpd_ps(clo)), _mm512_cvtpd_ps(chi), 1);
  s = _mm512_insertf32x8(_mm512_castps256_ps512(_mm512_cvtpd_ps(slo)), _mm512_cvtpd_ps(shi), 1);
}

inline __mmask16 tail_mask(int n) {
  return n >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << n) - 1u);
}

#endif  // POSENC_ROPE_AVX512

}  // namespace

void rope_cos_sin_row(const float* inv_freq, int n_pairs, int64_t position,
                      AnglePrecision precision, float attention_factor, bool scale, float* c,
                      float* s) {
#ifdef POSENC_ROPE_AVX512
  const __m512 pf = _mm512_set1_ps(static_cast<float>(position));
  const __m512d pd = _mm512_set1_pd(static_cast<double>(position));
  const __m512 af = _mm512_set1_ps(attention_factor);
  for (int i = 0; i < n_pairs; i += 16) {
    const __mmask16 m = tail_mask(n_pairs - i);
    const __m512 f = _mm512_maskz_loadu_ps(m, inv_freq + i);
    __m512d lo, hi;
    if (precision == AnglePrecision::float32) {
      const __m512 angle = _mm512_mul_ps(pf, f);  // float32 product, as the reference
      lo = _mm512_cvtps_pd(_mm512_castps512_ps256(angle));
      hi = _mm512_cvtps_pd(_mm512_extractf32x8_ps(angle, 1));
    } else {
      lo = _mm512_mul_pd(pd, _mm512_cvtps_pd(_mm512_castps512_ps256(f)));
      hi = _mm512_mul_pd(pd, _mm512_cvtps_pd(_mm512_extractf32x8_ps(f, 1)));
    }
    __m512 cv, sv;
    __mmask16 bad;
    sincos_16(lo, hi, cv, sv, bad);
    if (scale) {
      cv = _mm512_mul_ps(cv, af);
      sv = _mm512_mul_ps(sv, af);
    }
    _mm512_mask_storeu_ps(c + i, m, cv);
    _mm512_mask_storeu_ps(s + i, m, sv);
    bad &= m;
    while (bad) {
      const int lane = __builtin_ctz(bad);
      bad &= static_cast<__mmask16>(bad - 1);
      float cc, ss;
      cos_sin_scalar(inv_freq[i + lane], position, precision, cc, ss);
      if (scale) {
        cc *= attention_factor;
        ss *= attention_factor;
      }
      c[i + lane] = cc;
      s[i + lane] = ss;
    }
  }
#else
  for (int i = 0; i < n_pairs; ++i) {
    cos_sin_scalar(inv_freq[i], position, precision, c[i], s[i]);
    if (scale) {
      c[i] *= attention_factor;
      s[i] *= attention_factor;
    }
  }
#endif
}

namespace {

template <RopeLayout L, RopeDirection D>
void rotate_head_scalar(float* __restrict x, const float* __restrict c, const float* __restrict s,
                        int n_pairs, int first_pair) {
  for (int i = first_pair; i < n_pairs; ++i) {
    float* p0;
    float* p1;
    if constexpr (L == RopeLayout::interleaved) {
      p0 = x + 2 * i;
      p1 = x + 2 * i + 1;
    } else {
      p0 = x + i;
      p1 = x + i + n_pairs;
    }
    const float x0 = *p0, x1 = *p1;
    if constexpr (D == RopeDirection::forward) {
      *p0 = x0 * c[i] - x1 * s[i];
      *p1 = x1 * c[i] + x0 * s[i];
    } else {
      *p0 = x0 * c[i] + x1 * s[i];
      *p1 = x1 * c[i] - x0 * s[i];
    }
  }
}

#ifdef POSENC_ROPE_AVX512

/// half layout: x0 = x[i], x1 = x[i + n_pairs]. 16 pairs per step, masked tail.
template <RopeDirection D>
void rotate_token_half(float* row, int heads, int head_dim, const float* c, const float* s,
                       int n_pairs) {
  for (int h = 0; h < heads; ++h) {
    float* x = row + static_cast<int64_t>(h) * head_dim;
    for (int i = 0; i < n_pairs; i += 16) {
      const __mmask16 m = tail_mask(n_pairs - i);
      const __m512 cv = _mm512_maskz_loadu_ps(m, c + i);
      const __m512 sv = _mm512_maskz_loadu_ps(m, s + i);
      const __m512 x0 = _mm512_maskz_loadu_ps(m, x + i);
      const __m512 x1 = _mm512_maskz_loadu_ps(m, x + i + n_pairs);
      __m512 o0, o1;
      if constexpr (D == RopeDirection::forward) {
        o0 = _mm512_sub_ps(_mm512_mul_ps(x0, cv), _mm512_mul_ps(x1, sv));
        o1 = _mm512_add_ps(_mm512_mul_ps(x1, cv), _mm512_mul_ps(x0, sv));
      } else {
        o0 = _mm512_add_ps(_mm512_mul_ps(x0, cv), _mm512_mul_ps(x1, sv));
        o1 = _mm512_sub_ps(_mm512_mul_ps(x1, cv), _mm512_mul_ps(x0, sv));
      }
      _mm512_mask_storeu_ps(x + i, m, o0);
      _mm512_mask_storeu_ps(x + i + n_pairs, m, o1);
    }
  }
}

/// interleaved layout: pairs (x[2i], x[2i+1]) adjacent. With cos duplicated
/// per pair and sin duplicated with the sign of its term,
///   out = x*cdup + swap_pairs(x)*ssigned
/// is exactly (x0*c - x1*s, x1*c + x0*s) (a + (-b) == a - b in IEEE).
template <RopeDirection D>
void rotate_token_interleaved(float* row, int heads, int head_dim, const float* c, const float* s,
                              int n_pairs, float* cdup, float* sdup) {
  const int width = 2 * n_pairs;
  const __m512i idx_lo = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
  const __m512i idx_hi = _mm512_setr_epi32(8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13, 14, 14, 15, 15);
  // forward: even lanes get -s, odd lanes +s; inverse the opposite.
  const __m512 sign = D == RopeDirection::forward
                          ? _mm512_castsi512_ps(_mm512_set1_epi64(0x0000000080000000LL))
                          : _mm512_castsi512_ps(_mm512_set1_epi64(static_cast<long long>(0x8000000000000000ULL)));
  for (int i = 0; i < n_pairs; i += 16) {
    const __mmask16 m = tail_mask(n_pairs - i);
    const __m512 cv = _mm512_maskz_loadu_ps(m, c + i);
    const __m512 sv = _mm512_maskz_loadu_ps(m, s + i);
    _mm512_storeu_ps(cdup + 2 * i, _mm512_permutexvar_ps(idx_lo, cv));
    _mm512_storeu_ps(cdup + 2 * i + 16, _mm512_permutexvar_ps(idx_hi, cv));
    _mm512_storeu_ps(sdup + 2 * i, _mm512_xor_ps(_mm512_permutexvar_ps(idx_lo, sv), sign));
    _mm512_storeu_ps(sdup + 2 * i + 16, _mm512_xor_ps(_mm512_permutexvar_ps(idx_hi, sv), sign));
  }
  for (int h = 0; h < heads; ++h) {
    float* x = row + static_cast<int64_t>(h) * head_dim;
    for (int i = 0; i < width; i += 16) {
      const __mmask16 m = tail_mask(width - i);
      const __m512 xv = _mm512_maskz_loadu_ps(m, x + i);
      const __m512 sw = _mm512_permute_ps(xv, 0xB1);  // (x1, x0) per pair
      const __m512 o =
          _mm512_add_ps(_mm512_mul_ps(xv, _mm512_loadu_ps(cdup + i)), _mm512_mul_ps(sw, _mm512_loadu_ps(sdup + i)));
      _mm512_mask_storeu_ps(x + i, m, o);
    }
  }
}

#endif  // POSENC_ROPE_AVX512

template <RopeLayout L, RopeDirection D>
void rotate_rows_impl(float* x, int64_t tokens, int heads, int head_dim, int64_t token_stride,
                      const float* cos, const float* sin, int64_t table_stride, int n_pairs) {
#ifdef POSENC_ROPE_AVX512
  // cos/sin duplicated per pair for the interleaved layout (n_pairs rounded up to 16).
  constexpr int kStackPairs = 512;
  alignas(64) float cdup_stack[2 * kStackPairs], sdup_stack[2 * kStackPairs];
  float* cdup = cdup_stack;
  float* sdup = sdup_stack;
  std::unique_ptr<float[]> heap;
  if constexpr (L == RopeLayout::interleaved) {
    const int padded = (n_pairs + 15) / 16 * 16;
    if (padded > kStackPairs) {
      heap.reset(new float[4 * static_cast<std::size_t>(padded)]);
      cdup = heap.get();
      sdup = heap.get() + 2 * padded;
    }
  }
  for (int64_t t = 0; t < tokens; ++t) {
    float* row = x + t * token_stride;
    const float* c = cos + t * table_stride;
    const float* s = sin + t * table_stride;
    if constexpr (L == RopeLayout::half)
      rotate_token_half<D>(row, heads, head_dim, c, s, n_pairs);
    else
      rotate_token_interleaved<D>(row, heads, head_dim, c, s, n_pairs, cdup, sdup);
  }
#else
  for (int64_t t = 0; t < tokens; ++t) {
    float* row = x + t * token_stride;
    const float* c = cos + t * table_stride;
    const float* s = sin + t * table_stride;
    for (int h = 0; h < heads; ++h)
      rotate_head_scalar<L, D>(row + static_cast<int64_t>(h) * head_dim, c, s, n_pairs, 0);
  }
#endif
}

}  // namespace

void rope_rotate_rows(float* x, int64_t tokens, int heads, int head_dim, int64_t token_stride,
                      const float* cos, const float* sin, int64_t table_stride, int n_pairs,
                      RopeLayout layout, RopeDirection direction) {
  const bool fwd = direction == RopeDirection::forward;
  if (layout == RopeLayout::half) {
    fwd ? rotate_rows_impl<RopeLayout::half, RopeDirection::forward>(
              x, tokens, heads, head_dim, token_stride, cos, sin, table_stride, n_pairs)
        : rotate_rows_impl<RopeLayout::half, RopeDirection::inverse>(
              x, tokens, heads, head_dim, token_stride, cos, sin, table_stride, n_pairs);
  } else {
    fwd ? rotate_rows_impl<RopeLayout::interleaved, RopeDirection::forward>(
              x, tokens, heads, head_dim, token_stride, cos, sin, table_stride, n_pairs)
        : rotate_rows_impl<RopeLayout::interleaved, RopeDirection::inverse>(
              x, tokens, heads, head_dim, token_stride, cos, sin, table_stride, n_pairs);
  }
}

}  // namespace posenc::detail

#ifdef POSENC_ROPE_AVX512
#pragma GCC diagnostic pop
#endif
