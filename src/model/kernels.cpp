#include "model/kernels.hpp"

#include <immintrin.h>
#include <omp.h>

// GCC 12 flags the undefined pass-through vectors inside its own AVX-512 intrinsics as uninitialized.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <vector>

namespace posenc::detail {

void rmsnorm(const float* x, const float* weight, int64_t n, int d, float eps, float* out) {
  // The sum of squares in double, as llama.cpp's ggml_compute_forward_rms_norm_f32 (float32 squares, double sum in
  // order, float mean). The float32 alternatives (HF's, llama2.c's) differ from it in the last bit, and with Q8_0
  // activations a last-bit difference before the first quantization (frequent exact ties) costs ~3e-3 nats of
  // agreement with llama.cpp. Each row's sum is one chain of additions (4 cycles each), so rows go kRows at a time,
  // their chains interleaved: the same additions in the same order per row, overlapped (a 256-token prefill's norms
  // were ~0.8% of its samples with one chain at a time).
  constexpr int64_t kRows = 8;
  const auto rows = [&](int64_t r0, int64_t r1) {
    double sum[kRows] = {};
    const int64_t m = r1 - r0;
    const float* xr = x + r0 * d;
    if (m == kRows) {
      for (int j = 0; j < d; ++j)
#pragma GCC unroll 8
        for (int64_t i = 0; i < kRows; ++i) sum[i] += static_cast<double>(xr[i * d + j] * xr[i * d + j]);
    } else {
      for (int j = 0; j < d; ++j)
        for (int64_t i = 0; i < m; ++i) sum[i] += static_cast<double>(xr[i * d + j] * xr[i * d + j]);
    }
    for (int64_t i = 0; i < m; ++i) {
      const float mean = static_cast<float>(sum[i] / d);
      const float inv = 1.0f / std::sqrt(mean + eps);
      const float* xi = xr + i * d;
      float* o = out + (r0 + i) * d;
      for (int j = 0; j < d; ++j) o[j] = (xi[j] * inv) * weight[j];
    }
  };
  // Rows (groups of rows) to threads, so threads change no bit; a 256-token prefill's norms on one thread were 0.75%
  // of its samples on two threads, the other thread waiting. A small call (decode's one row) opens no region at all:
  // even an if(false) region costs 0.1-0.2 us, 0.4 us nested inside the decode team's `omp single`.
  const int64_t groups = (n + kRows - 1) / kRows;
  if (n * d < (int64_t{1} << 16)) {
    for (int64_t g = 0; g < groups; ++g) rows(g * kRows, std::min(n, (g + 1) * kRows));
    return;
  }
#pragma omp parallel for schedule(static)
  for (int64_t g = 0; g < groups; ++g) rows(g * kRows, std::min(n, (g + 1) * kRows));
}

namespace {

// ---- glibc's expf, 8 lanes at a time ----
// glibc's expf on x86-64 with FMA (__expf_fma, sysdeps/ieee754/flt-32/e_expf.c built with FMA contraction; the
// variant its IFUNC picks on every CPU with AVX2 and FMA): in double, z = InvLn2N * x + Shift (fused),
// k = the low bits of z, kd = z - Shift, r = InvLn2N * x - kd (fused), s = 2^(k/32) from a 32-entry table with k's
// high bits added to the exponent, p = (C0 r + C1) r^2 + (C2 r + 1) (three fused), then (float)(p * s). The same
// operations in AVX-512 give the same bits; inputs with |x| >= 88 (or NaN, inf), where glibc takes its
// overflow/underflow paths, go through std::exp. The constants are glibc's __exp2f_data (2.36, read from libm);
// expf_avx512_matches_libm() checks them against the libm in use before anything relies on them.
constexpr uint64_t kExp2fTab[32] = {
    0x3ff0000000000000, 0x3fefd9b0d3158574, 0x3fefb5586cf9890f, 0x3fef9301d0125b51, 0x3fef72b83c7d517b,
    0x3fef54873168b9aa, 0x3fef387a6e756238, 0x3fef1e9df51fdee1, 0x3fef06fe0a31b715, 0x3feef1a7373aa9cb,
    0x3feedea64c123422, 0x3feece086061892d, 0x3feebfdad5362a27, 0x3feeb42b569d4f82, 0x3feeab07dd485429,
    0x3feea47eb03a5585, 0x3feea09e667f3bcd, 0x3fee9f75e8ec5f74, 0x3feea11473eb0187, 0x3feea589994cce13,
    0x3feeace5422aa0db, 0x3feeb737b0cdc5e5, 0x3feec49182a3f090, 0x3feed503b23e255d, 0x3feee89f995ad3ad,
    0x3feeff76f2fb5e47, 0x3fef199bdd85529c, 0x3fef3720dcef9069, 0x3fef5818dcfba487, 0x3fef7c97337b9b5f,
    0x3fefa4afa2a490da, 0x3fefd0765b6e4540};
constexpr uint64_t kInvLn2N = 0x40471547652b82fe, kShift = 0x4338000000000000;
constexpr uint64_t kC0 = 0x3ebc6af84b912394, kC1 = 0x3f2ebfce50fac4f3, kC2 = 0x3f962e42ff0c52d6;

#define POSENC_TARGET_EXP __attribute__((target("avx512f,avx512dq,avx512vl,fma")))

/// expf of 8 floats as glibc computes each (lanes with |x| >= 88, NaN or inf are wrong here: the caller sends them
/// to std::exp).
POSENC_TARGET_EXP inline __m256 expf8(__m256 x) {
  const __m512d xd = _mm512_cvtps_pd(x);
  const __m512d inv = _mm512_castsi512_pd(_mm512_set1_epi64(static_cast<int64_t>(kInvLn2N)));
  const __m512d shift = _mm512_castsi512_pd(_mm512_set1_epi64(static_cast<int64_t>(kShift)));
  const __m512d z = _mm512_fmadd_pd(inv, xd, shift);
  const __m512i ki = _mm512_castpd_si512(z);
  const __m512d kd = _mm512_sub_pd(z, shift);
  const __m512d r = _mm512_fmsub_pd(inv, xd, kd);
  // T[k & 31] by two 16-entry permutes and a blend on bit 4 (a gather costs more).
  const __m512d t0 = _mm512_loadu_pd(reinterpret_cast<const double*>(kExp2fTab));
  const __m512d t1 = _mm512_loadu_pd(reinterpret_cast<const double*>(kExp2fTab + 8));
  const __m512d t2 = _mm512_loadu_pd(reinterpret_cast<const double*>(kExp2fTab + 16));
  const __m512d t3 = _mm512_loadu_pd(reinterpret_cast<const double*>(kExp2fTab + 24));
  const __mmask8 high = _mm512_test_epi64_mask(ki, _mm512_set1_epi64(16));
  const __m512d tab = _mm512_mask_blend_pd(high, _mm512_permutex2var_pd(t0, ki, t1), _mm512_permutex2var_pd(t2, ki, t3));
  const __m512i t = _mm512_add_epi64(_mm512_castpd_si512(tab), _mm512_slli_epi64(ki, 47));
  const __m512d c0 = _mm512_castsi512_pd(_mm512_set1_epi64(static_cast<int64_t>(kC0)));
  const __m512d c1 = _mm512_castsi512_pd(_mm512_set1_epi64(static_cast<int64_t>(kC1)));
  const __m512d c2 = _mm512_castsi512_pd(_mm512_set1_epi64(static_cast<int64_t>(kC2)));
  const __m512d zz = _mm512_fmadd_pd(c0, r, c1);
  const __m512d r2 = _mm512_mul_pd(r, r);
  __m512d y = _mm512_fmadd_pd(c2, r, _mm512_set1_pd(1.0));
  y = _mm512_fmadd_pd(zz, r2, y);
  return _mm512_cvtpd_ps(_mm512_mul_pd(y, _mm512_castsi512_pd(t)));
}

/// Lanes where glibc leaves the main path: |x| >= 88 (top 12 bits of |x| >= 0x42b), NaN, inf.
POSENC_TARGET_EXP inline __mmask8 expf8_special(__m256 x) {
  const __m256i top = _mm256_and_si256(_mm256_srli_epi32(_mm256_castps_si256(x), 20), _mm256_set1_epi32(0x7ff));
  return _mm256_cmpgt_epi32_mask(top, _mm256_set1_epi32(0x42a));
}

POSENC_TARGET_EXP void swiglu_avx512(float* h1, const float* h3, int64_t lo, int64_t hi) {
  const __m256 one = _mm256_set1_ps(1.0f);
  int64_t i = lo;
  for (; i + 8 <= hi; i += 8) {
    const __m256 v = _mm256_loadu_ps(h1 + i);
    const __m256 nv = _mm256_xor_ps(v, _mm256_set1_ps(-0.0f));
    __m256 e = expf8(nv);
    if (const __mmask8 sp = expf8_special(nv); sp != 0) {
      alignas(32) float ev[8], xv[8];
      _mm256_store_ps(ev, e);
      _mm256_store_ps(xv, nv);
      for (int k = 0; k < 8; ++k)
        if ((sp >> k) & 1) ev[k] = std::exp(xv[k]);
      e = _mm256_load_ps(ev);
    }
    _mm256_storeu_ps(h1 + i, _mm256_mul_ps(_mm256_div_ps(v, _mm256_add_ps(one, e)), _mm256_loadu_ps(h3 + i)));
  }
  for (; i < hi; ++i) {
    const float v = h1[i];
    h1[i] = v / (1.0f + std::exp(-v)) * h3[i];
  }
}

/// expf8 against std::exp on inputs across the main path's range (every 2^-7 step of [-88, 88] and a spread of
/// bit patterns): true when every result has the same bits. False on a libm with another algorithm (or without
/// FMA: glibc's SSE2 variant rounds differently), and swiglu then stays with std::exp.
POSENC_TARGET_EXP bool expf_avx512_matches_libm() {
  std::vector<float> xs;
  for (int k = -88 * 128; k < 88 * 128; ++k) xs.push_back(static_cast<float>(k) / 128.0f);
  for (uint32_t b = 0; b < 0x42b00000u; b += 0x00010001u) {
    xs.push_back(std::bit_cast<float>(b));
    xs.push_back(-std::bit_cast<float>(b));
  }
  while (xs.size() % 8 != 0) xs.push_back(0.0f);
  for (std::size_t i = 0; i < xs.size(); i += 8) {
    alignas(32) float out[8];
    _mm256_store_ps(out, expf8(_mm256_loadu_ps(xs.data() + i)));
    for (int k = 0; k < 8; ++k) {
      const float ref = std::exp(xs[i + static_cast<std::size_t>(k)]);
      if (std::bit_cast<uint32_t>(ref) != std::bit_cast<uint32_t>(out[k])) return false;
    }
  }
  return true;
}

}  // namespace

bool swiglu_uses_avx512() {
  static const bool ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") &&
                         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("fma") &&
                         expf_avx512_matches_libm();
  return ok;
}

void swiglu_reference(float* h1, const float* h3, int64_t count) {
  for (int64_t i = 0; i < count; ++i) {
    const float v = h1[i];
    h1[i] = v / (1.0f + std::exp(-v)) * h3[i];
  }
}

void swiglu_serial(float* h1, const float* h3, int64_t count) {
  if (swiglu_uses_avx512())
    swiglu_avx512(h1, h3, 0, count);
  else
    swiglu_reference(h1, h3, count);
}

void swiglu(float* h1, const float* h3, int64_t count) {
  // Element by element, so threads change no bit; a prefill's 256 x 4864 elements took 5% of an F16 forward and
  // 13% of a Q8_0 one on one core with std::exp, and 16% on two before they shared them.
  const bool vec = swiglu_uses_avx512();
#pragma omp parallel if (count >= (int64_t{1} << 16))
  {
    const int64_t nt = omp_get_num_threads(), me = omp_get_thread_num();
    const int64_t lo = count * me / nt / 8 * 8, hi = me + 1 == nt ? count : count * (me + 1) / nt / 8 * 8;
    if (vec)
      swiglu_avx512(h1, h3, lo, hi);
    else
      swiglu_reference(h1 + lo, h3 + lo, hi - lo);
  }
}

}  // namespace posenc::detail
