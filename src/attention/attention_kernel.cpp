// posenc — tiled CPU attention (FlashAttention-2 style online softmax).
//
// Vocabulary
//  - row: one (query token, query head) pair. The rows that share a KV head
//    are the query tokens x the `group` heads of its GQA group, numbered
//    token-major: row g -> token g / group, head kvh*group + g % group.
//  - key table: the keys of all KvBlocks flattened once per call (row
//    pointers + positions; empty slots, position < 0, dropped).
//  - tile: up to kBK consecutive keys of the key table (so a tile may span
//    several small paged blocks), with the min/max of its positions.
//
// Two kernels, chosen by the number of rows per KV head:
//  - wide (more than kNarrowMaxRows rows: prefill, chunked prefill, MQA
//    decode): blocks of kBQ = 64 rows live in the SIMD lanes. q is packed
//    transposed, QT[d][row], pre-multiplied by softmax_scale*log2(e). Per tile:
//    S[key][row] = K QTᵀ by a register-blocked micro-kernel (8 keys x 2 row
//    vectors; keys broadcast straight from the cache layout), bias, mask, the
//    online softmax update (per-lane max and sum, base 2), then
//    O[row][:] = corr*O + P V by a second micro-kernel (8 rows x 2 channel
//    vectors) over a contiguous copy of the tile's V rows.
//  - narrow (decode: few rows per KV head): keys in lanes. Each group of 16
//    keys is transposed in registers (16x16 blocks) and every row's scores
//    are fma chains over head_dim; softmax per row over the key lanes; P V
//    with V rows as vectors. Tiles outer, then groups of 16 keys (8 on AVX2),
//    KV heads inner, so cache rows are read in order; threads own contiguous
//    ranges of KV heads, so the [token][kv_head][d] cache streams in order.
//    f16/bf16 blocks are read in place, widened in registers.
// Both exist for AVX-512 (16 lanes, compiled when the build targets it) and
// for AVX2 + FMA (8 lanes: 8x8 transposes in the narrow kernel); without
// either, a portable scalar path (scalar_rows).
// Batch invariance: both kernels perform, for a given row, exactly the same
// operations in the same order (score chains over d, biases with the same
// fused ops, per-tile max, exp2, the canonical tile sum, P·V chains over
// keys), so a row's output does not depend on which kernel ran or which other
// rows shared the call: decode, chunked prefill and prefill agree bit for bit
// over the same keys in the same order.
// Tiles whose keys are all invisible to the block (by position ranges) are
// skipped; fully visible tiles skip the per-element mask. Work items (KV head
// x row block, heaviest first) are shared by OpenMP threads; calls below
// kParallelMinWork multiply-adds never fork. Scratch memory is per thread and
// reused across calls.
//
// This file is compiled with -ffp-contract=fast (FMA allowed).
#include "attention/attention_kernel.hpp"
#include "core/parallel.hpp"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <optional>
#include <string_view>
#include <type_traits>
#include <vector>

#include <fmt/format.h>
#include <omp.h>

#include "encoding/rope_kernels.hpp"
#include "posenc/bias.hpp"
#include "posenc/error.hpp"
#include "posenc/float16.hpp"

#if defined(__AVX512F__) && defined(__AVX512DQ__)
#include <immintrin.h>
#define POSENC_ATTN_AVX512 1
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define POSENC_ATTN_AVX2 1
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif

namespace posenc::detail {

namespace {

constexpr float kLog2e = 1.4426950408889634f;
constexpr int kBQ = 64;  // rows per wide block (4 vectors of 16)
constexpr int kBK = 64;  // keys per tile
#ifndef POSENC_PV_ROWS
#define POSENC_PV_ROWS 8
#define POSENC_PV_VECS 2
#endif
// P·V micro-kernel: kPvRows rows x kPvVecs channel vectors of accumulators.
constexpr int kPvRows = POSENC_PV_ROWS;
constexpr int kPvVecs = POSENC_PV_VECS;
// Calls with fewer multiply-adds than this run on the calling thread.
constexpr double kParallelMinWork = double(1 << 20);

// ---------------------------------------------------------------------------
// Scratch memory: per thread, grown on demand, reused across calls (so a
// decode step allocates nothing).

struct AlignedBuffer {
  float* data = nullptr;
  std::size_t capacity = 0;
  float* get(std::size_t n) {
    if (n > capacity) {
      const std::size_t bytes = (std::max<std::size_t>(n, 16) * sizeof(float) + 63) / 64 * 64;
      auto* grown = static_cast<float*>(std::aligned_alloc(64, bytes));
      if (!grown) throw std::bad_alloc();  // the old buffer and capacity kept: a later call still gets valid memory
      std::free(data);
      data = grown;
      capacity = bytes / sizeof(float);
    }
    return data;
  }
  AlignedBuffer() = default;
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;
  ~AlignedBuffer() { std::free(data); }
};

struct Scratch {
  AlignedBuffer qt, s, o, row, zero, vt;
};

Scratch& thread_scratch() {
  thread_local Scratch scratch;
  return scratch;
}

// ---------------------------------------------------------------------------
// Tiles and the call context.

// Keys of all blocks, flattened (empty slots dropped: they are never
// attended): row pointers at kv head 0 and positions. Tiles are runs of up to
// kBK consecutive entries, so they span small paged blocks. T: the stored
// element, float or uint16_t (the bits of an f16/bf16 block, which only the
// AVX2 narrow kernel reads in place).
template <class T>
struct KeyTableOf {
  std::vector<const T*> k, v;
  std::vector<int64_t> pos;
};

template <class T>
struct TileOf {
  const T* const* k;   // [n] key rows, kv head 0
  const T* const* v;   // [n]
  const int64_t* pos;  // [n], all >= 0
  int n;
  int64_t kmin, kmax;
};
using KeyTable = KeyTableOf<float>;
using Tile = TileOf<float>;

enum class TileClass { skip, full, partial };

struct Ctx {
  const AttentionSpec* spec;
  int H, KVH, D, group;
  int Dp;                 // head_dim rounded up to 16
  int Dv;                 // vectors of 16 per head row
  uint32_t tail_mask;     // lanes of the last vector
  int64_t ks;             // floats between consecutive keys (KVH * D)
  float qscale;           // softmax scale * log2(e)
  const float* q;
  const int64_t* q_pos;
  float* out;
  const QueryRope* rope;
  MaskKind mask;
  int64_t window;
  LogitBias bias;
  std::vector<float> slope_l2e;  // [H]: -slope * log2(e)
  int t5_radius = 0;             // relative positions clamped to [-R, R]
  std::vector<float> t5_lut;     // [H][2R+1], bias * log2(e)
};

template <class T>
TileClass classify(const Ctx& c, int64_t qmin, int64_t qmax, const TileOf<T>& t) {
  switch (c.mask) {
    case MaskKind::none:
      return TileClass::full;
    case MaskKind::causal:
      if (t.kmin > qmax) return TileClass::skip;
      return t.kmax <= qmin ? TileClass::full : TileClass::partial;
    case MaskKind::sliding_window: {
      if (t.kmin > qmax) return TileClass::skip;
      const __int128 w = c.window;
      if (static_cast<__int128>(qmin) - t.kmax >= w) return TileClass::skip;
      const bool full = t.kmax <= qmin && static_cast<__int128>(qmax) - t.kmin < w;
      return full ? TileClass::full : TileClass::partial;
    }
  }
  return TileClass::partial;
}

inline bool visible(const Ctx& c, int64_t qi, int64_t kj) {
  if (kj < 0) return false;
  switch (c.mask) {
    case MaskKind::none: return true;
    case MaskKind::causal: return kj <= qi;
    case MaskKind::sliding_window:
      return kj <= qi && static_cast<__int128>(qi) - kj < c.window;
  }
  return false;
}

/// bias(h, qi, kj) * log2(e), as the kernels add it (log2 domain).
inline float bias_l2e(const Ctx& c, int h, int64_t qi, int64_t kj) {
  if (c.bias == LogitBias::alibi) {
    const int64_t d = qi >= kj ? qi - kj : kj - qi;
    return c.slope_l2e[static_cast<std::size_t>(h)] * static_cast<float>(d);
  }
  if (c.bias == LogitBias::t5) {
    const int64_t R = c.t5_radius;
    const int64_t rel = std::clamp<int64_t>(kj - qi, -R, R);
    return c.t5_lut[static_cast<std::size_t>(h) * static_cast<std::size_t>(2 * R + 1) +
                    static_cast<std::size_t>(rel + R)];
  }
  return 0.0f;
}

/// Query row (token t, head h) into dst[0, Dp): rotated (attention_with_rope),
/// times softmax_scale*log2(e), zero padded.
void load_q_row(const Ctx& c, int64_t t, int h, float* dst) {
  const float* src = c.q + (t * c.H + h) * static_cast<int64_t>(c.D);
  std::memcpy(dst, src, static_cast<std::size_t>(c.D) * sizeof(float));
  if (c.rope) {
    const int64_t np = c.rope->n_pairs;
    rope_rotate_rows(dst, 1, 1, c.D, c.D, c.rope->cos + t * np, c.rope->sin + t * np, 0,
                     c.rope->n_pairs, c.rope->layout, RopeDirection::forward);
  }
  for (int d = 0; d < c.D; ++d) dst[d] *= c.qscale;
  for (int d = c.D; d < c.Dp; ++d) dst[d] = 0.0f;
}

inline void row_of(const Ctx& c, int kvh, int64_t g, int64_t& t, int& h) {
  t = g / c.group;
  h = kvh * c.group + static_cast<int>(g % c.group);
}

/// How the narrow kernels read a stored key or value element, each an exact
/// widening to float32 (the value KvCache::blocks' widening copy holds, so
/// the same bits follow): float32 as is; IEEE binary16 by F16C's vcvtph2ps;
/// bfloat16 by moving its 16 bits to the top of a float32.
struct F32 {
  using T = float;
};
struct F16 {
  using T = uint16_t;
};
struct BF16 {
  using T = uint16_t;
};

/// Most rows per KV head the narrow (decode) kernels take.
constexpr int kNarrowRowsCap = 8;

/// The per-call state of a narrow kernel over the R rows of each KV head in
/// [kvh0, kvh1): the rotated, scaled queries [head][row][Dp], the output
/// accumulators (zero), the running max (-inf), sum (0) and correction per
/// row, a zero key row (the padding lanes' keys), and the rows' positions.
struct NarrowRows {
  int nh = 0;
  std::size_t rows = 0;
  float *qn = nullptr, *on = nullptr, *zero = nullptr, *m = nullptr, *l = nullptr, *corr = nullptr;
  int64_t qpos[kNarrowRowsCap] = {};
  int64_t qmin = std::numeric_limits<int64_t>::max(), qmax = std::numeric_limits<int64_t>::min();
};

[[maybe_unused]] NarrowRows narrow_rows(const Ctx& c, int kvh0, int kvh1, int R, Scratch& sc) {
  NarrowRows n;
  n.nh = kvh1 - kvh0;
  n.rows = static_cast<std::size_t>(n.nh) * R;
  n.qn = sc.qt.get(n.rows * c.Dp);
  n.on = sc.o.get(n.rows * c.Dp);
  const std::size_t zero_len = static_cast<std::size_t>(c.D + c.Dp);  // qk_narrow / qk_narrow8 read 2 heads at once
  n.zero = sc.zero.get(zero_len);
  n.m = sc.row.get(3 * n.rows);
  n.l = n.m + n.rows;
  n.corr = n.l + n.rows;
  std::memset(n.zero, 0, zero_len * sizeof(float));
  for (int r = 0; r < R; ++r) {
    n.qpos[r] = c.q_pos[r / c.group];
    n.qmin = std::min(n.qmin, n.qpos[r]);
    n.qmax = std::max(n.qmax, n.qpos[r]);
  }
  for (int hh = 0; hh < n.nh; ++hh)
    for (int r = 0; r < R; ++r) {
      int64_t t;
      int h;
      row_of(c, kvh0 + hh, r, t, h);
      load_q_row(c, t, h, n.qn + (hh * R + r) * c.Dp);
    }
  for (std::size_t i = 0; i < n.rows; ++i) {
    n.m[i] = -std::numeric_limits<float>::infinity();
    n.l[i] = 0.0f;
  }
  std::memset(n.on, 0, n.rows * c.Dp * sizeof(float));
  return n;
}

/// Biases and the mask on the scores s[R][kBK] of KV head kvh against tile t,
/// with the wide kernels' operations (fma(slope, distance, s) for ALiBi, s +
/// table for T5; masked scores -inf).
template <class T>
void narrow_bias_and_mask(const Ctx& c, int kvh, int R, const int64_t* qpos, const TileOf<T>& t, TileClass cls,
                          float* s) {
  const int n = t.n;
  if (c.bias != LogitBias::none)
    for (int rr = 0; rr < R; ++rr) {
      const int h = kvh * c.group + rr % c.group;
      for (int j = 0; j < n; ++j) {
        float& x = s[rr * kBK + j];
        if (c.bias == LogitBias::alibi) {
          const int64_t d = qpos[rr] >= t.pos[j] ? qpos[rr] - t.pos[j] : t.pos[j] - qpos[rr];
          x = std::fma(c.slope_l2e[static_cast<std::size_t>(h)], static_cast<float>(d), x);
        } else {
          x += bias_l2e(c, h, qpos[rr], t.pos[j]);
        }
      }
    }
  if (cls == TileClass::partial)
    for (int rr = 0; rr < R; ++rr)
      for (int j = 0; j < n; ++j)
        if (!visible(c, qpos[rr], t.pos[j])) s[rr * kBK + j] = -std::numeric_limits<float>::infinity();
}

#ifdef POSENC_ATTN_AVX512

// ---------------------------------------------------------------------------
// Vector helpers.

/// 2^x for x <= 0 (x = -inf gives 0): 2^round(x) * p(f), |f| <= 1/2, with
/// p(f) = 1 + f*q(f), q a degree-5 Chebyshev fit, so p(0) = 1 exactly (no
/// drift when the running max is unchanged) and the relative error is 5e-9
/// before float rounding. Results below 2^-125 (weights negligible next to
/// the row maximum's 1) are exactly 0: producing subnormals would cost a
/// microcode assist per element on masked (-inf) scores.
inline __m512 exp2_ps(__m512 x) {
  const __mmask16 keep = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-125.0f), _CMP_GE_OQ);
  x = _mm512_max_ps(x, _mm512_set1_ps(-125.0f));
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(1.545316294512069e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3390863364671234e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618082557277852e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550357114219078e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650760568126e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931471880262288e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_maskz_scalef_ps(keep, p, n);
}

inline __mmask16 lanes(int n) {
  return n >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << n) - 1u);
}

/// In-place transpose of a 16x16 float block (r[i] lane d -> r[d] lane i).
inline void transpose16(__m512 r[16]) {
  __m512 t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    const __m512d a = _mm512_castps_pd(t[4 * i]), b = _mm512_castps_pd(t[4 * i + 1]);
    const __m512d c = _mm512_castps_pd(t[4 * i + 2]), d = _mm512_castps_pd(t[4 * i + 3]);
    r[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
    r[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
    r[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
    r[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
  }
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0xdd);
    t[i + 8] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0xdd);
  }
  for (int i = 0; i < 8; ++i) {
    r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xdd);
  }
}

// ---------------------------------------------------------------------------
// Wide kernel: rows in lanes.

/// S[i][row] = sum_d K[i][d] * QT[d][row] for MK keys and NV row vectors.
template <int MK, int NV>
inline void qk_micro(const float* __restrict qt, const float* const* k, int64_t off, int D,
                     float* __restrict s) {
  __m512 acc[MK][NV];
#pragma GCC unroll 8
  for (int i = 0; i < MK; ++i)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_setzero_ps();
  const float* kp[MK];
#pragma GCC unroll 8
  for (int i = 0; i < MK; ++i) kp[i] = k[i] + off;
  for (int d = 0; d < D; ++d) {
    __m512 qv[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) qv[v] = _mm512_load_ps(qt + d * kBQ + 16 * v);
#pragma GCC unroll 8
    for (int i = 0; i < MK; ++i) {
      const __m512 b = _mm512_set1_ps(kp[i][d]);
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_fmadd_ps(b, qv[v], acc[i][v]);
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < MK; ++i)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) _mm512_store_ps(s + i * kBQ + 16 * v, acc[i][v]);
}

template <int MK, int NV>
void qk_keys(const float* qt, const float* const* k, int64_t off, int n, int D, float* s) {
  int j = 0;
  for (; j + MK <= n; j += MK) qk_micro<MK, NV>(qt, k + j, off, D, s + j * kBQ);
  const float* const* kr = k + j;
  float* sr = s + j * kBQ;
  switch (n - j) {
    case 0: break;
    case 1: qk_micro<1, NV>(qt, kr, off, D, sr); break;
    case 2: qk_micro<2, NV>(qt, kr, off, D, sr); break;
    case 3: qk_micro<3, NV>(qt, kr, off, D, sr); break;
    case 4: qk_micro<4, NV>(qt, kr, off, D, sr); break;
    case 5: qk_micro<5, NV>(qt, kr, off, D, sr); break;
    case 6: qk_micro<6, NV>(qt, kr, off, D, sr); break;
    default: qk_micro<7, NV>(qt, kr, off, D, sr); break;
  }
}

/// Scores of a tile. Micro-kernel of 8 keys x 2 row vectors (16
/// accumulators): per head_dim step 2 vector loads of QT and 8 broadcasts of
/// K feed 16 FMAs.
template <int NV>
void qk_tile(const float* qt, const float* const* k, int64_t off, int n, int D, float* s) {
  constexpr int MK = 8;
  if constexpr (NV == 1) {
    qk_keys<MK, 1>(qt, k, off, n, D, s);
  } else {
    // Row halves outer: one 32-row slice of QT (D*128 bytes) stays in L1
    // while all keys of the tile stream past it.
#pragma GCC unroll 2
    for (int v0 = 0; v0 < NV; v0 += 2) {
      if (v0 + 2 <= NV)
        qk_keys<MK, 2>(qt + 16 * v0, k, off, n, D, s + 16 * v0);
      else
        qk_keys<MK, 1>(qt + 16 * v0, k, off, n, D, s + 16 * v0);
    }
  }
}

template <int NV>
void add_alibi_wide(float* s, int n, const int64_t* kpos, const int64_t* qpos, const float* slope) {
  for (int j = 0; j < n; ++j) {
    const __m512i kp = _mm512_set1_epi64(kpos[j]);
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) {
      const __m512i dlo = _mm512_abs_epi64(_mm512_sub_epi64(_mm512_loadu_si512(qpos + 16 * v), kp));
      const __m512i dhi =
          _mm512_abs_epi64(_mm512_sub_epi64(_mm512_loadu_si512(qpos + 16 * v + 8), kp));
      const __m512 dist = _mm512_insertf32x8(_mm512_castps256_ps512(_mm512_cvtepi64_ps(dlo)),
                                             _mm512_cvtepi64_ps(dhi), 1);
      float* sp = s + j * kBQ + 16 * v;
      _mm512_store_ps(sp, _mm512_fmadd_ps(_mm512_loadu_ps(slope + 16 * v), dist, _mm512_load_ps(sp)));
    }
  }
}

template <int NV>
void add_t5_wide(float* s, int n, const int64_t* kpos, const int64_t* qpos, const int32_t* lut_off,
                 const float* lut, int64_t radius) {
  const __m512i lo = _mm512_set1_epi64(-radius), hi = _mm512_set1_epi64(radius);
  for (int j = 0; j < n; ++j) {
    const __m512i kp = _mm512_set1_epi64(kpos[j]);
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) {
      // relative_position = key - query, clamped; index = offset(head) + rel + R
      __m512i r0 = _mm512_sub_epi64(kp, _mm512_loadu_si512(qpos + 16 * v));
      __m512i r1 = _mm512_sub_epi64(kp, _mm512_loadu_si512(qpos + 16 * v + 8));
      r0 = _mm512_min_epi64(_mm512_max_epi64(r0, lo), hi);
      r1 = _mm512_min_epi64(_mm512_max_epi64(r1, lo), hi);
      const __m512i rel = _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi64_epi32(r0)),
                                             _mm512_cvtepi64_epi32(r1), 1);
      const __m512i idx = _mm512_add_epi32(rel, _mm512_loadu_si512(lut_off + 16 * v));
      float* sp = s + j * kBQ + 16 * v;
      _mm512_store_ps(sp, _mm512_add_ps(_mm512_load_ps(sp), _mm512_i32gather_ps(idx, lut, 4)));
    }
  }
}

template <int NV>
void mask_wide(const Ctx& c, float* s, int n, const int64_t* kpos, const int64_t* qpos) {
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const __m512i w = _mm512_set1_epi64(c.window);
  for (int j = 0; j < n; ++j) {
    float* sj = s + j * kBQ;
    const __m512i kp = _mm512_set1_epi64(kpos[j]);
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) {
      const __m512i q0 = _mm512_loadu_si512(qpos + 16 * v);
      const __m512i q1 = _mm512_loadu_si512(qpos + 16 * v + 8);
      __mmask8 v0 = _mm512_cmp_epi64_mask(kp, q0, _MM_CMPINT_LE);
      __mmask8 v1 = _mm512_cmp_epi64_mask(kp, q1, _MM_CMPINT_LE);
      if (c.mask == MaskKind::sliding_window) {
        // q - k cannot overflow where k <= q and k >= 0.
        v0 &= _mm512_cmp_epi64_mask(_mm512_sub_epi64(q0, kp), w, _MM_CMPINT_LT);
        v1 &= _mm512_cmp_epi64_mask(_mm512_sub_epi64(q1, kp), w, _MM_CMPINT_LT);
      }
      const __mmask16 vis = static_cast<__mmask16>(v0 | (static_cast<unsigned>(v1) << 8));
      _mm512_store_ps(sj + 16 * v, _mm512_mask_blend_ps(vis, ninf, _mm512_load_ps(sj + 16 * v)));
    }
  }
}

/// The canonical sum of a tile's probabilities P[0..n) (n <= 64), shared by
/// both kernels so their results agree bit for bit:
///   part[k] = P[k] + P[k+16] + P[k+32] + P[k+48]   (left to right, k < 16,
///             absent keys skipped), then part[k] += part[k+w] for w = 8,4,2,1;
///   the sum is part[0].
/// Four short chains and a tree instead of one 64-long dependency chain.
static_assert(kBK == 64, "the canonical tile sum is written for 64-key tiles");

/// Online softmax update over the tile; S becomes P = 2^(S - m_new).
template <int NV>
void softmax_wide(float* s, int n, float* m, float* l, float* corr) {
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 mt[NV];
#pragma GCC unroll 4
  for (int v = 0; v < NV; ++v) mt[v] = ninf;
  for (int j = 0; j < n; ++j)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) mt[v] = _mm512_max_ps(mt[v], _mm512_load_ps(s + j * kBQ + 16 * v));
  __m512 msafe[NV], lsum[NV];
#pragma GCC unroll 4
  for (int v = 0; v < NV; ++v) {
    const __m512 mold = _mm512_load_ps(m + 16 * v);
    const __m512 mnew = _mm512_max_ps(mold, mt[v]);
    // A lane that has seen no visible key keeps m = -inf; subtract 0 there.
    msafe[v] = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(mnew, ninf, _CMP_EQ_OQ), mnew,
                                    _mm512_setzero_ps());
    _mm512_store_ps(corr + 16 * v, exp2_ps(_mm512_sub_ps(mold, msafe[v])));
    _mm512_store_ps(m + 16 * v, mnew);
  }
  for (int j = 0; j < n; ++j)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) {
      float* sp = s + j * kBQ + 16 * v;
      _mm512_store_ps(sp, exp2_ps(_mm512_sub_ps(_mm512_load_ps(sp), msafe[v])));
    }
  // Canonical tile sum (see above), per row lane.
#pragma GCC unroll 4
  for (int v = 0; v < NV; ++v) {
    __m512 part[16];
    for (int k = 0; k < 16; ++k) {
      part[k] = k < n ? _mm512_load_ps(s + k * kBQ + 16 * v) : _mm512_setzero_ps();
      for (int j = k + 16; j < n; j += 16)
        part[k] = _mm512_add_ps(part[k], _mm512_load_ps(s + j * kBQ + 16 * v));
    }
    for (int w = 8; w >= 1; w /= 2)
      for (int k = 0; k < w; ++k) part[k] = _mm512_add_ps(part[k], part[k + w]);
    lsum[v] = part[0];
  }
#pragma GCC unroll 4
  for (int v = 0; v < NV; ++v)
    _mm512_store_ps(l + 16 * v, _mm512_fmadd_ps(_mm512_load_ps(l + 16 * v),
                                                _mm512_load_ps(corr + 16 * v), lsum[v]));
}

/// O[r0+i][16*c0 + ...] = corr * O + sum_j P[j][r0+i] V[j] for MR rows, ND
/// vectors: per output element one product-sum chain over the keys in order
/// (the same chain the decode kernel computes, see narrow_heads).
template <int MR, int ND>
inline void pv_micro(const float* __restrict p, const float* __restrict v, int64_t vs, int n,
                     float* __restrict o, int Dp, const float* corr) {
  __m512 acc[MR][ND];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) {
    const __m512 cr = _mm512_set1_ps(corr[i]);
#pragma GCC unroll 4
    for (int c = 0; c < ND; ++c) acc[i][c] = _mm512_mul_ps(_mm512_load_ps(o + i * Dp + 16 * c), cr);
  }
  for (int j = 0; j < n; ++j) {
    const float* vj = v + j * vs;
    __m512 vv[ND];
#pragma GCC unroll 4
    for (int c = 0; c < ND; ++c) vv[c] = _mm512_load_ps(vj + 16 * c);
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      const __m512 b = _mm512_set1_ps(p[j * kBQ + i]);
#pragma GCC unroll 4
      for (int c = 0; c < ND; ++c) acc[i][c] = _mm512_fmadd_ps(b, vv[c], acc[i][c]);
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
    for (int c = 0; c < ND; ++c) _mm512_store_ps(o + i * Dp + 16 * c, acc[i][c]);
}

template <int ND>
void pv_chunk(const Ctx& c, int nr, const float* p, const float* v, int n, float* o,
              const float* corr) {
  constexpr int MR = kPvRows;
  const int64_t vs = c.Dp;
  int r = 0;
  for (; r + MR <= nr; r += MR) pv_micro<MR, ND>(p + r, v, vs, n, o + r * c.Dp, c.Dp, corr + r);
  float* orr = o + r * c.Dp;
  switch (nr - r) {
    case 0: break;
    case 1: pv_micro<1, ND>(p + r, v, vs, n, orr, c.Dp, corr + r); break;
    case 2: pv_micro<2, ND>(p + r, v, vs, n, orr, c.Dp, corr + r); break;
    case 3: pv_micro<3, ND>(p + r, v, vs, n, orr, c.Dp, corr + r); break;
    case 4: pv_micro<4, ND>(p + r, v, vs, n, orr, c.Dp, corr + r); break;
    case 5: pv_micro<5, ND>(p + r, v, vs, n, orr, c.Dp, corr + r); break;
    case 6: pv_micro<6, ND>(p + r, v, vs, n, orr, c.Dp, corr + r); break;
    default: pv_micro<7, ND>(p + r, v, vs, n, orr, c.Dp, corr + r); break;
  }
}

/// O = corr * O + P V over the tile. vt: the tile's V rows copied contiguous,
/// [n][Dp] (zero padded), so each slice of 2 channel vectors (n*128 bytes)
/// stays in L1 while every row group of the block uses it; the cache's own
/// layout puts rows kv_heads*head_dim floats apart, which maps them all to
/// the same few L1 sets.
void pv_wide(const Ctx& c, int nr, const float* p, const float* vt, int n, float* o,
             const float* corr) {
  static_assert(kPvVecs == 2, "pv_wide handles channel chunks of 2 vectors and a 1-vector tail");
  int c0 = 0;
  for (; c0 + 2 <= c.Dv; c0 += 2) pv_chunk<2>(c, nr, p, vt + 16 * c0, n, o + 16 * c0, corr);
  if (c0 < c.Dv) pv_chunk<1>(c, nr, p, vt + 16 * c0, n, o + 16 * c0, corr);
}

/// Copies the tile's V rows of one KV head to vt [n][Dp], zero padded.
void copy_v_tile(const Ctx& c, const float* const* v, int64_t off, int n, float* vt) {
  const __mmask16 tail = static_cast<__mmask16>(c.tail_mask);
  for (int j = 0; j < n; ++j) {
    const float* src = v[j] + off;
    float* dst = vt + static_cast<int64_t>(j) * c.Dp;
    for (int q = 0; q < c.Dv; ++q) {
      const __mmask16 mk = q == c.Dv - 1 ? tail : static_cast<__mmask16>(0xFFFF);
      _mm512_store_ps(dst + 16 * q, _mm512_maskz_loadu_ps(mk, src + 16 * q));
    }
  }
}

template <int NV>
void wide_tiles(const Ctx& c, int kvh, int nr, std::span<const Tile> tiles, const float* qt,
                float* s, float* o, float* vt, const int64_t* qpos, const float* slope,
                const int32_t* lut_off, int64_t qmin, int64_t qmax, float* m, float* l,
                float* corr) {
  const int64_t head_off = static_cast<int64_t>(kvh) * c.D;
  for (const Tile& t : tiles) {
    const TileClass cls = classify(c, qmin, qmax, t);
    if (cls == TileClass::skip) continue;
    qk_tile<NV>(qt, t.k, head_off, t.n, c.D, s);
    if (c.bias == LogitBias::alibi) add_alibi_wide<NV>(s, t.n, t.pos, qpos, slope);
    if (c.bias == LogitBias::t5)
      add_t5_wide<NV>(s, t.n, t.pos, qpos, lut_off, c.t5_lut.data(), c.t5_radius);
    if (cls == TileClass::partial) mask_wide<NV>(c, s, t.n, t.pos, qpos);
    softmax_wide<NV>(s, t.n, m, l, corr);
    copy_v_tile(c, t.v, head_off, t.n, vt);
    pv_wide(c, nr, s, vt, t.n, o, corr);
  }
}

/// One block of nr <= kBQ rows (starting at row g0) of KV head kvh.
void wide_block(const Ctx& c, int kvh, int64_t g0, int nr, std::span<const Tile> tiles,
                Scratch& sc) {
  const int NV = (nr + 15) / 16;
  float* qt = sc.qt.get(static_cast<std::size_t>(c.D) * kBQ);
  float* s = sc.s.get(static_cast<std::size_t>(kBK) * kBQ);
  float* o = sc.o.get(static_cast<std::size_t>(kBQ) * c.Dp);
  float* row = sc.row.get(static_cast<std::size_t>(c.Dp));
  float* vt = sc.vt.get(static_cast<std::size_t>(kBK) * c.Dp);
  alignas(64) int64_t qpos[kBQ];
  alignas(64) float slope[kBQ];
  alignas(64) int32_t lut_off[kBQ];
  alignas(64) float m[kBQ], l[kBQ], corr[kBQ];
  int64_t qmin = std::numeric_limits<int64_t>::max(), qmax = std::numeric_limits<int64_t>::min();
  const int64_t lut_row = 2 * static_cast<int64_t>(c.t5_radius) + 1;
  // Query rows of a block are head_dim floats each, heads*head_dim apart:
  // fetch them ahead, the hardware prefetchers do not follow such strides.
  constexpr int kAhead = 8;
  auto prefetch_row = [&](int r) {
    int64_t t;
    int h;
    row_of(c, kvh, g0 + r, t, h);
    const char* src = reinterpret_cast<const char*>(c.q + (t * c.H + h) * static_cast<int64_t>(c.D));
    for (int64_t b = 0; b < static_cast<int64_t>(c.D) * 4; b += 64) _mm_prefetch(src + b, _MM_HINT_T0);
  };
  for (int r = 0; r < std::min(nr, kAhead); ++r) prefetch_row(r);
  for (int r = 0; r < nr; ++r) {
    if (r + kAhead < nr) prefetch_row(r + kAhead);
    int64_t t;
    int h;
    row_of(c, kvh, g0 + r, t, h);
    load_q_row(c, t, h, row);
    for (int d = 0; d < c.D; ++d) qt[d * kBQ + r] = row[d];
    qpos[r] = c.q_pos[t];
    qmin = std::min(qmin, qpos[r]);
    qmax = std::max(qmax, qpos[r]);
    slope[r] = c.bias == LogitBias::alibi ? c.slope_l2e[static_cast<std::size_t>(h)] : 0.0f;
    lut_off[r] = static_cast<int32_t>(h * lut_row + c.t5_radius);
  }
  // Padding lanes copy the last row's metadata and have q = 0; never stored.
  for (int r = nr; r < 16 * NV; ++r) {
    for (int d = 0; d < c.D; ++d) qt[d * kBQ + r] = 0.0f;
    qpos[r] = qpos[nr - 1];
    slope[r] = slope[nr - 1];
    lut_off[r] = lut_off[nr - 1];
  }
  for (int r = 0; r < kBQ; ++r) {
    m[r] = -std::numeric_limits<float>::infinity();
    l[r] = 0.0f;
  }
  std::memset(o, 0, static_cast<std::size_t>(nr) * c.Dp * sizeof(float));
  switch (NV) {
    case 1: wide_tiles<1>(c, kvh, nr, tiles, qt, s, o, vt, qpos, slope, lut_off, qmin, qmax, m, l, corr); break;
    case 2: wide_tiles<2>(c, kvh, nr, tiles, qt, s, o, vt, qpos, slope, lut_off, qmin, qmax, m, l, corr); break;
    case 3: wide_tiles<3>(c, kvh, nr, tiles, qt, s, o, vt, qpos, slope, lut_off, qmin, qmax, m, l, corr); break;
    default: wide_tiles<4>(c, kvh, nr, tiles, qt, s, o, vt, qpos, slope, lut_off, qmin, qmax, m, l, corr); break;
  }
  for (int r = 0; r < nr; ++r) {
    int64_t t;
    int h;
    row_of(c, kvh, g0 + r, t, h);
    float* dst = c.out + (t * c.H + h) * static_cast<int64_t>(c.D);
    const __m512 inv = _mm512_set1_ps(l[r] > 0.0f ? 1.0f / l[r] : 0.0f);
    for (int v = 0; v < c.Dv; ++v) {
      const __mmask16 mk = v == c.Dv - 1 ? static_cast<__mmask16>(c.tail_mask) : 0xFFFF;
      _mm512_mask_storeu_ps(dst + 16 * v, mk, _mm512_mul_ps(_mm512_load_ps(o + r * c.Dp + 16 * v), inv));
    }
  }
}

// ---------------------------------------------------------------------------
// Narrow kernel (AVX-512): keys in lanes, for few rows per KV head (decode).
// Groups of 16 keys transposed 16x16 in registers, every row's scores fma
// chains over head_dim, the softmax per row over the key lanes, P V with V
// rows as vectors. Within a tile, groups of 16 keys are outer and KV heads
// inner, for the scores and again for P V (the chains over keys continue from
// one group to the next), so each [token][kv_head][d] cache row is read front
// to back, and f16/bf16 blocks are read in place, widened in registers. (A KV
// head at a time over the tile's 64 keys, and f16/bf16 widened to a float32
// copy per call, as this kernel went before: 726 ms per decode step against a
// 32768-token f16 cache of 32 KV heads on one Sapphire Rapids core, 122 ms for
// the f32 cache of the same values.)

constexpr int kNarrowMaxRows = kNarrowRowsCap;

/// 16 consecutive elements at p, widened exactly.
template <class E>
inline __m512 load16(const typename E::T* p) {
  if constexpr (std::is_same_v<E, F32>) {
    return _mm512_loadu_ps(p);
  } else {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    if constexpr (std::is_same_v<E, F16>)
      return _mm512_cvtph_ps(h);
    else
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
}

/// The lanes of m at p widened, zeros (+0.0) elsewhere; reads only those lanes.
template <class E>
inline __m512 load16_mask(__mmask16 m, const typename E::T* p) {
  if constexpr (std::is_same_v<E, F32>) {
    return _mm512_maskz_loadu_ps(m, p);
  } else {
    const __m256i h = _mm256_maskz_loadu_epi16(m, p);
    if constexpr (std::is_same_v<E, F16>)
      return _mm512_cvtph_ps(h);
    else
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
}

/// O[i][16*c0 + ...] = corr * O + sum_j P[i][j] V[j] for MR rows, ND vectors
/// and the n <= 16 keys of one group (without the corr * when not `first`:
/// the tile's later groups continue the chains), one product-sum chain per
/// element over the keys in order: the chain pv_micro computes for the same
/// row in the wide kernel.
template <int MR, int ND, class E>
inline void pv_narrow_micro(const float* p /*[MR][kBK]*/, const typename E::T* const* v, int64_t off, int n,
                            float* o /*[MR][Dp]*/, int Dp, const float* corr, bool first, __mmask16 last) {
  __m512 acc[MR][ND];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) {
    const __m512 cr = _mm512_set1_ps(corr[i]);
#pragma GCC unroll 8
    for (int cc = 0; cc < ND; ++cc) {
      const __m512 ov = _mm512_load_ps(o + i * Dp + 16 * cc);
      acc[i][cc] = first ? _mm512_mul_ps(ov, cr) : ov;
    }
  }
  for (int j = 0; j < n; ++j) {
    const typename E::T* vj = v[j] + off;
    __m512 vv[ND];
#pragma GCC unroll 8
    for (int cc = 0; cc < ND; ++cc)
      vv[cc] = cc == ND - 1 ? load16_mask<E>(last, vj + 16 * cc) : load16<E>(vj + 16 * cc);
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      const __m512 b = _mm512_set1_ps(p[i * kBK + j]);
#pragma GCC unroll 8
      for (int cc = 0; cc < ND; ++cc) acc[i][cc] = _mm512_fmadd_ps(b, vv[cc], acc[i][cc]);
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 8
    for (int cc = 0; cc < ND; ++cc) _mm512_store_ps(o + i * Dp + 16 * cc, acc[i][cc]);
}

/// Rows r0.. r0+MR-1 (MR <= 8) against a group of n <= 16 keys, with as many
/// channel vectors per pass as keep MR*ND <= 16 accumulators.
template <int MR, class E>
void pv_narrow_rows(const Ctx& c, const float* p, const typename E::T* const* v, int64_t off, int n, float* o,
                    const float* corr, bool first) {
  constexpr int kMaxNd = MR >= 8 ? 2 : MR >= 4 ? 4 : 8;
  for (int c0 = 0; c0 < c.Dv; c0 += kMaxNd) {
    const int nd = std::min(kMaxNd, c.Dv - c0);
    const __mmask16 last = c0 + nd == c.Dv ? static_cast<__mmask16>(c.tail_mask) : 0xFFFF;
    const int64_t oc = off + 16 * c0;
    float* op = o + 16 * c0;
    switch (nd) {
      case 1: pv_narrow_micro<MR, 1, E>(p, v, oc, n, op, c.Dp, corr, first, last); break;
      case 2: pv_narrow_micro<MR, 2, E>(p, v, oc, n, op, c.Dp, corr, first, last); break;
      case 3: pv_narrow_micro<MR, (kMaxNd >= 3 ? 3 : 1), E>(p, v, oc, n, op, c.Dp, corr, first, last); break;
      case 4: pv_narrow_micro<MR, (kMaxNd >= 4 ? 4 : 1), E>(p, v, oc, n, op, c.Dp, corr, first, last); break;
      case 5: pv_narrow_micro<MR, (kMaxNd >= 5 ? 5 : 1), E>(p, v, oc, n, op, c.Dp, corr, first, last); break;
      case 6: pv_narrow_micro<MR, (kMaxNd >= 6 ? 6 : 1), E>(p, v, oc, n, op, c.Dp, corr, first, last); break;
      case 7: pv_narrow_micro<MR, (kMaxNd >= 7 ? 7 : 1), E>(p, v, oc, n, op, c.Dp, corr, first, last); break;
      default: pv_narrow_micro<MR, (kMaxNd >= 8 ? 8 : 1), E>(p, v, oc, n, op, c.Dp, corr, first, last); break;
    }
  }
}

/// Scores of the R rows of each of NH consecutive KV heads against the group
/// of 16 keys at jg (cut at the tile's end), keys in lanes:
///   s[h][r][j] = fma chain over d = 0..D-1 of q[h][r][d] * K[j][head h][d].
/// The chain and its order are those of qk_micro for the same (row, key), so
/// the scores are bit-identical to the wide kernel's. The NH * R chains are
/// independent: two heads at once for R = 1 keep two FMA chains in flight.
/// head_off: channels from a key row's start to the first head; zero: a zero
/// key row of at least (NH - 1) * D + Dp elements (the padding lanes' keys).
template <int R, int NH, class E>
void qk_narrow(const Ctx& c, const TileOf<typename E::T>& t, int jg, int64_t head_off, const typename E::T* zero,
               const float* q /*[NH][R][Dp]*/, float* s /*[NH][R][kBK]*/) {
  const int cnt = std::min(16, t.n - jg);
  const typename E::T* kp[16];
  for (int i = 0; i < 16; ++i) kp[i] = i < cnt ? t.k[jg + i] + head_off : zero;
  __m512 acc[NH][R];
#pragma GCC unroll 8
  for (int h = 0; h < NH; ++h)
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) acc[h][r] = _mm512_setzero_ps();
  for (int d0 = 0; d0 < c.D; d0 += 16) {
    const int dn = std::min(16, c.D - d0);
#pragma GCC unroll 4
    for (int h = 0; h < NH; ++h) {
      const int64_t o = static_cast<int64_t>(h) * c.D + d0;
      const float* qh = q + h * R * c.Dp + d0;
      __m512 kt[16];
      if (dn == 16) {
#pragma GCC unroll 16
        for (int i = 0; i < 16; ++i) kt[i] = load16<E>(kp[i] + o);
        transpose16(kt);
#pragma GCC unroll 16
        for (int dd = 0; dd < 16; ++dd)
#pragma GCC unroll 8
          for (int r = 0; r < R; ++r)
            acc[h][r] = _mm512_fmadd_ps(kt[dd], _mm512_set1_ps(qh[r * c.Dp + dd]), acc[h][r]);
      } else {
        const __mmask16 dm = static_cast<__mmask16>(c.tail_mask);
#pragma GCC unroll 16
        for (int i = 0; i < 16; ++i) kt[i] = load16_mask<E>(dm, kp[i] + o);
        transpose16(kt);
        for (int dd = 0; dd < dn; ++dd)
#pragma GCC unroll 8
          for (int r = 0; r < R; ++r)
            acc[h][r] = _mm512_fmadd_ps(kt[dd], _mm512_set1_ps(qh[r * c.Dp + dd]), acc[h][r]);
      }
    }
  }
#pragma GCC unroll 4
  for (int h = 0; h < NH; ++h)
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(s + (h * R + r) * kBK + jg, acc[h][r]);
}

/// Software prefetch for the narrow kernel's f16/bf16 caches. Each of its passes over a tile (the scores over K,
/// then P V over V) takes (group of 16 keys, KV head) items in order, each the head's D elements of 16 key rows:
/// 16 short runs at the cache's row stride (kv_heads * head_dim elements), too many and too short for a hardware
/// prefetcher to follow. At item (jg, hh) the item kNarrowAhead heads later is prefetched towards L2: in the next
/// group after the last head, in the next pass's first groups after the last group (V's after K's, the next
/// tile's K after V). Measured on a Zen 5 core (BM_AttentionDecodeLong: one query token against a 32768-token
/// cache of 32 KV heads, head_dim 128, binaries alternated three times): f16 30.5-32.5 -> 37.8-38.2 decode steps/s
/// at one thread and 53.3-53.8 -> 53.0-57.6 at two; 4 ahead beat 6 and 8-24, and prefetcht1 beat prefetcht0; the
/// float32 cache (twice the lines per item) went 17.9-19.9 -> 17.2-17.8, so it is left to the hardware.
/// Prefetches change no bit.
constexpr int kNarrowAhead = 4;

template <class T>
struct NarrowPrefetch {
  int64_t D;  // head_dim (elements per head in a row)
  int kvh0, nh;
  /// (rows, n): this pass's key or value rows; (next, next_n): the next pass's (next null: none).
  void item(const T* const* rows, int n, const T* const* next, int next_n, int jg, int hh) const {
    if constexpr (sizeof(T) != 2) return;  // float32 caches: measured slower with it (above)
    int h = hh + kNarrowAhead, g = jg;
    while (h >= nh) {
      h -= nh;
      g += 16;
    }
    if (g >= n) {
      g -= (n + 15) / 16 * 16;
      rows = next;
      n = next_n;
      if (rows == nullptr || g >= n) return;
    }
    const int cnt = std::min(16, n - g);
    const int64_t off = static_cast<int64_t>(kvh0 + h) * D;
    for (int i = 0; i < cnt; ++i) {
      const auto p = reinterpret_cast<uintptr_t>(rows[g + i] + off);
      const uintptr_t end = p + static_cast<uintptr_t>(D) * sizeof(T);
      // prefetcht1 as an asm statement: GCC 12 takes a function whose only effects are _mm_prefetch for a pure one
      // and drops its calls (this one's whole body went, until written so).
      for (uintptr_t l = p & ~uintptr_t{63}; l < end; l += 64)
        asm volatile("prefetcht1 %0" : : "m"(*reinterpret_cast<const char*>(l)));
    }
  }
};

/// The scores of every head in [kvh0, kvh0 + nh) against the group of 16 keys
/// at jg: two heads at a time for R = 1 (a decode step without GQA), one for
/// R >= 2, whose R rows are chains enough.
template <int R, class E>
void qk_narrow_heads(const Ctx& c, const TileOf<typename E::T>& t, int jg, int kvh0, int nh,
                     const typename E::T* zero, const float* qn /*[nh][R][Dp]*/, float* sh /*[nh][R][kBK]*/,
                     const NarrowPrefetch<typename E::T>& pf) {
  constexpr int NH = R == 1 ? 2 : 1;
  int hh = 0;
  for (; hh + NH <= nh; hh += NH) {
    for (int i = 0; i < NH; ++i) pf.item(t.k, t.n, t.v, t.n, jg, hh + i);
    qk_narrow<R, NH, E>(c, t, jg, static_cast<int64_t>(kvh0 + hh) * c.D, zero, qn + hh * R * c.Dp,
                        sh + hh * R * kBK);
  }
  for (; hh < nh; ++hh) {
    pf.item(t.k, t.n, t.v, t.n, jg, hh);
    qk_narrow<R, 1, E>(c, t, jg, static_cast<int64_t>(kvh0 + hh) * c.D, zero, qn + hh * R * c.Dp,
                       sh + hh * R * kBK);
  }
}

/// All R (<= kNarrowMaxRows) rows of the KV heads [kvh0, kvh1), over tiles of
/// float32, f16 or bf16 keys and values (E).
///
/// Batch invariance: for every row this computes exactly the operations the
/// wide kernel performs for that row (same score chains, same masks and
/// biases with the same fused operations, same running max per tile, same
/// exp2, same sequential sums, same P·V chains), so a token decoded against a
/// cache gets bit-for-bit the output it gets inside a prefill over the same
/// keys in the same order (for finite scores; and the f16/bf16 elements are
/// the values of the widened copy the wide kernel reads).
template <class E>
void narrow_heads(const Ctx& c, int kvh0, int kvh1, int R, std::span<const TileOf<typename E::T>> tiles,
                  Scratch& sc) {
  const NarrowRows nr = narrow_rows(c, kvh0, kvh1, R, sc);
  const int nh = nr.nh;
  float *qn = nr.qn, *on = nr.on, *m = nr.m, *l = nr.l, *corr = nr.corr;
  // The padding lanes' key row: zero bits, +0.0 in every stored format.
  const auto* zero = reinterpret_cast<const typename E::T*>(nr.zero);
  const int64_t* qpos = nr.qpos;
  const int64_t qmin = nr.qmin, qmax = nr.qmax;
  float* sh = sc.s.get(nr.rows * kBK);  // [head][row][key] scores, then P, of one tile
  const __mmask16 tail = static_cast<__mmask16>(c.tail_mask);
  const float ninf = -std::numeric_limits<float>::infinity();
  const NarrowPrefetch<typename E::T> pf{c.D, kvh0, nh};
  for (std::size_t ti = 0; ti < tiles.size(); ++ti) {
    const TileOf<typename E::T>& t = tiles[ti];
    const TileClass cls = classify(c, qmin, qmax, t);
    if (cls == TileClass::skip) continue;
    const int n = t.n;
    // The next tile the kernel reads (for the prefetch at the end of this one's P V pass).
    const TileOf<typename E::T>* next = nullptr;
    for (std::size_t tj = ti + 1; tj < tiles.size() && next == nullptr; ++tj)
      if (classify(c, qmin, qmax, tiles[tj]) != TileClass::skip) next = &tiles[tj];
    // Scores, 16 keys at a time for every head: each key row (kv_heads *
    // head_dim elements) is read in order, as the P V pass below reads V.
    for (int jg = 0; jg < n; jg += 16)
      switch (R) {
        case 1: qk_narrow_heads<1, E>(c, t, jg, kvh0, nh, zero, qn, sh, pf); break;
        case 2: qk_narrow_heads<2, E>(c, t, jg, kvh0, nh, zero, qn, sh, pf); break;
        case 3: qk_narrow_heads<3, E>(c, t, jg, kvh0, nh, zero, qn, sh, pf); break;
        case 4: qk_narrow_heads<4, E>(c, t, jg, kvh0, nh, zero, qn, sh, pf); break;
        case 5: qk_narrow_heads<5, E>(c, t, jg, kvh0, nh, zero, qn, sh, pf); break;
        case 6: qk_narrow_heads<6, E>(c, t, jg, kvh0, nh, zero, qn, sh, pf); break;
        case 7: qk_narrow_heads<7, E>(c, t, jg, kvh0, nh, zero, qn, sh, pf); break;
        default: qk_narrow_heads<8, E>(c, t, jg, kvh0, nh, zero, qn, sh, pf); break;
      }
    for (int hh = 0; hh < nh; ++hh) {
      const int kvh = kvh0 + hh;
      float* sn = sh + hh * R * kBK;
      float* mh = m + hh * R;
      float* lh = l + hh * R;
      float* ch = corr + hh * R;
      narrow_bias_and_mask(c, kvh, R, qpos, t, cls, sn);
      // Online softmax per row: tile max, exp2 of the same arguments, the sum
      // in key order, l = fma(l, corr, sum) -- as softmax_wide per lane.
      for (int rr = 0; rr < R; ++rr) {
        float* sr = sn + rr * kBK;
        __m512 mv = _mm512_set1_ps(ninf);
        for (int j = 0; j < n; j += 16)
          mv = _mm512_max_ps(mv, _mm512_mask_loadu_ps(_mm512_set1_ps(ninf), lanes(n - j), sr + j));
        const float mt = _mm512_reduce_max_ps(mv);  // max is exact in any order
        const float mnew = std::max(mh[rr], mt);
        const float msafe = mnew == ninf ? 0.0f : mnew;
        ch[rr] = _mm_cvtss_f32(_mm512_castps512_ps128(exp2_ps(_mm512_set1_ps(mh[rr] - msafe))));
        mh[rr] = mnew;
        const __m512 ms = _mm512_set1_ps(msafe);
        // P, and the canonical tile sum: lane k of `acc` is part[k] (keys
        // k, k+16, ... added left to right), then the w = 8,4,2,1 tree.
        __m512 acc = _mm512_setzero_ps();
        for (int j = 0; j < n; j += 16) {
          const __mmask16 mk = lanes(n - j);
          const __m512 p = exp2_ps(_mm512_sub_ps(_mm512_loadu_ps(sr + j), ms));
          _mm512_storeu_ps(sr + j, p);
          acc = j == 0 ? _mm512_maskz_mov_ps(mk, p) : _mm512_mask_add_ps(acc, mk, acc, p);
        }
        alignas(64) float part[16];
        _mm512_store_ps(part, acc);
        for (int w = 8; w >= 1; w /= 2)
          for (int k = 0; k < w; ++k) part[k] = part[k] + part[k + w];
        lh[rr] = std::fma(lh[rr], ch[rr], part[0]);
      }
    }
    // O = corr * O + P V, 16 keys at a time for every head (the chains over
    // the keys continue in order from one group to the next).
    for (int jg = 0; jg < n; jg += 16) {
      const int cnt = std::min(16, n - jg);
      const bool first = jg == 0;
      for (int hh = 0; hh < nh; ++hh) {
        pf.item(t.v, n, next != nullptr ? next->k : nullptr, next != nullptr ? next->n : 0, jg, hh);
        const int64_t head_off = static_cast<int64_t>(kvh0 + hh) * c.D;
        const float* sn = sh + hh * R * kBK + jg;
        float* oh = on + hh * R * c.Dp;
        const float* ch = corr + hh * R;
        if (c.Dv == 1) {
          // Short rows: all rows in one pass, more independent chains.
          switch (R) {
            case 1: pv_narrow_rows<1, E>(c, sn, t.v + jg, head_off, cnt, oh, ch, first); break;
            case 2: pv_narrow_rows<2, E>(c, sn, t.v + jg, head_off, cnt, oh, ch, first); break;
            case 3: pv_narrow_rows<3, E>(c, sn, t.v + jg, head_off, cnt, oh, ch, first); break;
            case 4: pv_narrow_rows<4, E>(c, sn, t.v + jg, head_off, cnt, oh, ch, first); break;
            case 5: pv_narrow_rows<5, E>(c, sn, t.v + jg, head_off, cnt, oh, ch, first); break;
            case 6: pv_narrow_rows<6, E>(c, sn, t.v + jg, head_off, cnt, oh, ch, first); break;
            case 7: pv_narrow_rows<7, E>(c, sn, t.v + jg, head_off, cnt, oh, ch, first); break;
            default: pv_narrow_rows<8, E>(c, sn, t.v + jg, head_off, cnt, oh, ch, first); break;
          }
          continue;
        }
        int r2 = 0;
        for (; r2 + 2 <= R; r2 += 2)
          pv_narrow_rows<2, E>(c, sn + r2 * kBK, t.v + jg, head_off, cnt, oh + r2 * c.Dp, ch + r2, first);
        if (r2 < R) pv_narrow_rows<1, E>(c, sn + r2 * kBK, t.v + jg, head_off, cnt, oh + r2 * c.Dp, ch + r2, first);
      }
    }
  }
  for (int hh = 0; hh < nh; ++hh)
    for (int r = 0; r < R; ++r) {
      int64_t t;
      int h;
      row_of(c, kvh0 + hh, r, t, h);
      float* dst = c.out + (t * c.H + h) * static_cast<int64_t>(c.D);
      const float lr = l[hh * R + r];
      const __m512 inv = _mm512_set1_ps(lr > 0.0f ? 1.0f / lr : 0.0f);
      const float* src = on + (hh * R + r) * c.Dp;
      for (int v = 0; v < c.Dv; ++v) {
        const __mmask16 mk = v == c.Dv - 1 ? tail : static_cast<__mmask16>(0xFFFF);
        _mm512_mask_storeu_ps(dst + 16 * v, mk, _mm512_mul_ps(_mm512_load_ps(src + 16 * v), inv));
      }
    }
}

#elif defined(POSENC_ATTN_AVX2)

// ---------------------------------------------------------------------------
// AVX2 + FMA: the wide kernel with rows in 8-lane vectors, and the narrow
// one (below) for decode's few rows per KV head. Per row both perform the
// AVX-512 kernels' operations in their order (score chains over d, the same
// exp2 to the bit, the canonical tile sum, P·V chains over keys), so results
// agree with an AVX-512 build and decode, chunked prefill and prefill agree
// bit for bit.

/// 2^x for x <= 0 (x = -inf or NaN gives 0): exp2_ps of the AVX-512 kernels,
/// bit for bit. 2^n is built from its exponent bits (n in [-125, 0], so the
/// product p * 2^n is exact and normal, as _mm512_scalef_ps's is).
inline __m256 exp2_ps8(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-125.0f);
  const __m256 keep = _mm256_cmp_ps(x, lo, _CMP_GE_OQ);
  x = _mm256_max_ps(x, lo);
  const __m256 n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(x, n);
  __m256 p = _mm256_set1_ps(1.545316294512069e-4f);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.3390863364671234e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.618082557277852e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.550357114219078e-2f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.4022650760568126e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.931471880262288e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(keep, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

/// S[i][row] = sum_d K[i][d] * QT[d][row] for MK keys and NV row vectors.
template <int MK, int NV>
inline void qk_micro8(const float* __restrict qt, const float* const* k, int64_t off, int D,
                      float* __restrict s) {
  __m256 acc[MK][NV];
#pragma GCC unroll 8
  for (int i = 0; i < MK; ++i)
#pragma GCC unroll 2
    for (int v = 0; v < NV; ++v) acc[i][v] = _mm256_setzero_ps();
  const float* kp[MK];
#pragma GCC unroll 8
  for (int i = 0; i < MK; ++i) kp[i] = k[i] + off;
  for (int d = 0; d < D; ++d) {
    __m256 qv[NV];
#pragma GCC unroll 2
    for (int v = 0; v < NV; ++v) qv[v] = _mm256_load_ps(qt + d * kBQ + 8 * v);
#pragma GCC unroll 8
    for (int i = 0; i < MK; ++i) {
      const __m256 b = _mm256_broadcast_ss(kp[i] + d);
#pragma GCC unroll 2
      for (int v = 0; v < NV; ++v) acc[i][v] = _mm256_fmadd_ps(b, qv[v], acc[i][v]);
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < MK; ++i)
#pragma GCC unroll 2
    for (int v = 0; v < NV; ++v) _mm256_store_ps(s + i * kBQ + 8 * v, acc[i][v]);
}

/// Keys in groups of 6 (12 accumulators of 16 ymm registers), then the rest.
template <int NV>
void qk_keys8(const float* qt, const float* const* k, int64_t off, int n, int D, float* s) {
  constexpr int MK = 6;
  int j = 0;
  for (; j + MK <= n; j += MK) qk_micro8<MK, NV>(qt, k + j, off, D, s + j * kBQ);
  const float* const* kr = k + j;
  float* sr = s + j * kBQ;
  switch (n - j) {
    case 0: break;
    case 1: qk_micro8<1, NV>(qt, kr, off, D, sr); break;
    case 2: qk_micro8<2, NV>(qt, kr, off, D, sr); break;
    case 3: qk_micro8<3, NV>(qt, kr, off, D, sr); break;
    case 4: qk_micro8<4, NV>(qt, kr, off, D, sr); break;
    default: qk_micro8<5, NV>(qt, kr, off, D, sr); break;
  }
}

/// Scores of a tile, 16 rows (two vectors) at a time: that slice of QT
/// (D*64 bytes) stays in L1 while the tile's keys stream past it.
template <int NV>
void qk_tile8(const float* qt, const float* const* k, int64_t off, int n, int D, float* s) {
#pragma GCC unroll 4
  for (int v0 = 0; v0 < NV; v0 += 2) {
    if (v0 + 2 <= NV)
      qk_keys8<2>(qt + 8 * v0, k, off, n, D, s + 8 * v0);
    else
      qk_keys8<1>(qt + 8 * v0, k, off, n, D, s + 8 * v0);
  }
}

/// ALiBi/T5 biases and the mask, one score at a time with the AVX-512
/// kernels' operations (fma(slope, distance, s) for ALiBi, s + table for T5).
void bias_and_mask8(const Ctx& c, float* s, int nr, const Tile& t, bool mask, const int64_t* qpos,
                    const int* head) {
  const float ninf = -std::numeric_limits<float>::infinity();
  for (int j = 0; j < t.n; ++j) {
    float* sj = s + j * kBQ;
    const int64_t kj = t.pos[j];
    for (int r = 0; r < nr; ++r) {
      if (c.bias == LogitBias::alibi) {
        const int64_t d = qpos[r] >= kj ? qpos[r] - kj : kj - qpos[r];
        sj[r] = std::fma(c.slope_l2e[static_cast<std::size_t>(head[r])], static_cast<float>(d), sj[r]);
      } else if (c.bias == LogitBias::t5) {
        sj[r] += bias_l2e(c, head[r], qpos[r], kj);
      }
      if (mask && !visible(c, qpos[r], kj)) sj[r] = ninf;
    }
  }
}

/// Online softmax update over the tile; S becomes P = 2^(S - m_new).
template <int NV>
void softmax_wide8(float* s, int n, float* m, float* l, float* corr) {
  const __m256 ninf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  __m256 mt[NV];
#pragma GCC unroll 8
  for (int v = 0; v < NV; ++v) mt[v] = ninf;
  for (int j = 0; j < n; ++j)
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) mt[v] = _mm256_max_ps(mt[v], _mm256_load_ps(s + j * kBQ + 8 * v));
  __m256 msafe[NV];
#pragma GCC unroll 8
  for (int v = 0; v < NV; ++v) {
    const __m256 mold = _mm256_load_ps(m + 8 * v);
    const __m256 mnew = _mm256_max_ps(mold, mt[v]);
    // A lane that has seen no visible key keeps m = -inf; subtract 0 there.
    msafe[v] = _mm256_andnot_ps(_mm256_cmp_ps(mnew, ninf, _CMP_EQ_OQ), mnew);
    _mm256_store_ps(corr + 8 * v, exp2_ps8(_mm256_sub_ps(mold, msafe[v])));
    _mm256_store_ps(m + 8 * v, mnew);
  }
  for (int j = 0; j < n; ++j)
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) {
      float* sp = s + j * kBQ + 8 * v;
      _mm256_store_ps(sp, exp2_ps8(_mm256_sub_ps(_mm256_load_ps(sp), msafe[v])));
    }
  // The canonical tile sum (part[k] = P[k] + P[k+16] + ..., then the
  // w = 8, 4, 2, 1 tree), per row lane.
  for (int v = 0; v < NV; ++v) {
    __m256 part[16];
    for (int k = 0; k < 16; ++k) {
      part[k] = k < n ? _mm256_load_ps(s + k * kBQ + 8 * v) : _mm256_setzero_ps();
      for (int j = k + 16; j < n; j += 16) part[k] = _mm256_add_ps(part[k], _mm256_load_ps(s + j * kBQ + 8 * v));
    }
    for (int w = 8; w >= 1; w /= 2)
      for (int k = 0; k < w; ++k) part[k] = _mm256_add_ps(part[k], part[k + w]);
    _mm256_store_ps(l + 8 * v, _mm256_fmadd_ps(_mm256_load_ps(l + 8 * v), _mm256_load_ps(corr + 8 * v), part[0]));
  }
}

/// O[r0+i][8*c0 + ...] = corr * O + sum_j P[j][r0+i] V[j] for MR rows and ND
/// channel vectors: one product-sum chain per element over the keys in order.
template <int MR, int ND>
inline void pv_micro8(const float* __restrict p, const float* __restrict v, int64_t vs, int n,
                      float* __restrict o, int Dp, const float* corr) {
  __m256 acc[MR][ND];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) {
    const __m256 cr = _mm256_set1_ps(corr[i]);
#pragma GCC unroll 2
    for (int cc = 0; cc < ND; ++cc) acc[i][cc] = _mm256_mul_ps(_mm256_load_ps(o + i * Dp + 8 * cc), cr);
  }
  for (int j = 0; j < n; ++j) {
    const float* vj = v + j * vs;
    __m256 vv[ND];
#pragma GCC unroll 2
    for (int cc = 0; cc < ND; ++cc) vv[cc] = _mm256_load_ps(vj + 8 * cc);
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      const __m256 b = _mm256_broadcast_ss(p + j * kBQ + i);
#pragma GCC unroll 2
      for (int cc = 0; cc < ND; ++cc) acc[i][cc] = _mm256_fmadd_ps(b, vv[cc], acc[i][cc]);
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 2
    for (int cc = 0; cc < ND; ++cc) _mm256_store_ps(o + i * Dp + 8 * cc, acc[i][cc]);
}

/// O = corr * O + P V over the tile, in slices of 16 channels (Dp is a
/// multiple of 16) and groups of 6 rows. vt: the tile's V rows, [n][Dp].
void pv_wide8(const Ctx& c, int nr, const float* p, const float* vt, int n, float* o,
              const float* corr) {
  constexpr int MR = 6, ND = 2;
  const int64_t vs = c.Dp;
  for (int c0 = 0; c0 < c.Dp; c0 += 8 * ND) {
    const float* v = vt + c0;
    int r = 0;
    for (; r + MR <= nr; r += MR) pv_micro8<MR, ND>(p + r, v, vs, n, o + r * c.Dp + c0, c.Dp, corr + r);
    float* orr = o + r * c.Dp + c0;
    switch (nr - r) {
      case 0: break;
      case 1: pv_micro8<1, ND>(p + r, v, vs, n, orr, c.Dp, corr + r); break;
      case 2: pv_micro8<2, ND>(p + r, v, vs, n, orr, c.Dp, corr + r); break;
      case 3: pv_micro8<3, ND>(p + r, v, vs, n, orr, c.Dp, corr + r); break;
      case 4: pv_micro8<4, ND>(p + r, v, vs, n, orr, c.Dp, corr + r); break;
      default: pv_micro8<5, ND>(p + r, v, vs, n, orr, c.Dp, corr + r); break;
    }
  }
}

/// Copies the tile's V rows of one KV head to vt [n][Dp], zero padded.
void copy_v_tile8(const Ctx& c, const float* const* v, int64_t off, int n, float* vt) {
  for (int j = 0; j < n; ++j) {
    float* dst = vt + static_cast<int64_t>(j) * c.Dp;
    std::memcpy(dst, v[j] + off, static_cast<std::size_t>(c.D) * sizeof(float));
    std::fill(dst + c.D, dst + c.Dp, 0.0f);
  }
}

template <int NV>
void wide_tiles8(const Ctx& c, int kvh, int nr, std::span<const Tile> tiles, const float* qt,
                 float* s, float* o, float* vt, const int64_t* qpos, const int* head, int64_t qmin,
                 int64_t qmax, float* m, float* l, float* corr) {
  const int64_t head_off = static_cast<int64_t>(kvh) * c.D;
  for (const Tile& t : tiles) {
    const TileClass cls = classify(c, qmin, qmax, t);
    if (cls == TileClass::skip) continue;
    qk_tile8<NV>(qt, t.k, head_off, t.n, c.D, s);
    if (c.bias != LogitBias::none || cls == TileClass::partial)
      bias_and_mask8(c, s, nr, t, cls == TileClass::partial, qpos, head);
    softmax_wide8<NV>(s, t.n, m, l, corr);
    copy_v_tile8(c, t.v, head_off, t.n, vt);
    pv_wide8(c, nr, s, vt, t.n, o, corr);
  }
}

/// One block of nr <= kBQ rows (starting at row g0) of KV head kvh.
void wide_block(const Ctx& c, int kvh, int64_t g0, int nr, std::span<const Tile> tiles,
                Scratch& sc) {
  const int NV = (nr + 7) / 8;
  float* qt = sc.qt.get(static_cast<std::size_t>(c.D) * kBQ);
  float* s = sc.s.get(static_cast<std::size_t>(kBK) * kBQ);
  float* o = sc.o.get(static_cast<std::size_t>(kBQ) * c.Dp);
  float* row = sc.row.get(static_cast<std::size_t>(c.Dp));
  float* vt = sc.vt.get(static_cast<std::size_t>(kBK) * c.Dp);
  alignas(64) int64_t qpos[kBQ];
  alignas(64) int head[kBQ];
  alignas(64) float m[kBQ], l[kBQ], corr[kBQ];
  int64_t qmin = std::numeric_limits<int64_t>::max(), qmax = std::numeric_limits<int64_t>::min();
  for (int r = 0; r < nr; ++r) {
    int64_t t;
    row_of(c, kvh, g0 + r, t, head[r]);
    load_q_row(c, t, head[r], row);
    for (int d = 0; d < c.D; ++d) qt[d * kBQ + r] = row[d];
    qpos[r] = c.q_pos[t];
    qmin = std::min(qmin, qpos[r]);
    qmax = std::max(qmax, qpos[r]);
  }
  // Padding lanes have q = 0 (scores 0, never masked); never stored.
  for (int r = nr; r < 8 * NV; ++r)
    for (int d = 0; d < c.D; ++d) qt[d * kBQ + r] = 0.0f;
  for (int r = 0; r < kBQ; ++r) {
    m[r] = -std::numeric_limits<float>::infinity();
    l[r] = 0.0f;
  }
  std::memset(o, 0, static_cast<std::size_t>(nr) * c.Dp * sizeof(float));
  switch (NV) {
    case 1: wide_tiles8<1>(c, kvh, nr, tiles, qt, s, o, vt, qpos, head, qmin, qmax, m, l, corr); break;
    case 2: wide_tiles8<2>(c, kvh, nr, tiles, qt, s, o, vt, qpos, head, qmin, qmax, m, l, corr); break;
    case 3: wide_tiles8<3>(c, kvh, nr, tiles, qt, s, o, vt, qpos, head, qmin, qmax, m, l, corr); break;
    case 4: wide_tiles8<4>(c, kvh, nr, tiles, qt, s, o, vt, qpos, head, qmin, qmax, m, l, corr); break;
    case 5: wide_tiles8<5>(c, kvh, nr, tiles, qt, s, o, vt, qpos, head, qmin, qmax, m, l, corr); break;
    case 6: wide_tiles8<6>(c, kvh, nr, tiles, qt, s, o, vt, qpos, head, qmin, qmax, m, l, corr); break;
    case 7: wide_tiles8<7>(c, kvh, nr, tiles, qt, s, o, vt, qpos, head, qmin, qmax, m, l, corr); break;
    default: wide_tiles8<8>(c, kvh, nr, tiles, qt, s, o, vt, qpos, head, qmin, qmax, m, l, corr); break;
  }
  for (int r = 0; r < nr; ++r) {
    int64_t t;
    int h;
    row_of(c, kvh, g0 + r, t, h);
    float* dst = c.out + (t * c.H + h) * static_cast<int64_t>(c.D);
    const float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
    const float* src = o + r * c.Dp;
    for (int d = 0; d < c.D; ++d) dst[d] = src[d] * inv;
  }
}

// ---------------------------------------------------------------------------
// Narrow kernel (AVX2): keys in lanes, for few rows per KV head (decode). The
// AVX-512 narrow kernel with 8 lanes: groups of 8 keys transposed 8x8 in
// registers, every row's scores fma chains over head_dim, the softmax per row
// over the key lanes, P V with V rows as vectors. Within a tile, groups of 8
// keys are outer and KV heads inner, for the scores and again for P V, so
// each [token][kv_head][d] cache row is read front to back: 8 sequential
// streams (a KV head at a time over the tile's 64 keys, as the AVX-512
// kernel went then, measured 7.4-8.5 GB/s on Zen 3 against 13.4-15.2 this
// way, with the DRAM read rate at 14-16 GB/s; the wide kernel, 2.95 GB/s).

constexpr int kNarrowMaxRows = kNarrowRowsCap;

/// Lanes [0, n) set, n in [0, 8] (a _mm256_maskload_ps mask).
inline __m256i lanes8(int n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

/// In-place transpose of an 8x8 float block (r[i] lane d -> r[d] lane i).
[[gnu::always_inline]] inline void transpose8(__m256 r[8]) {
  __m256 t[8], u[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);      // a0 b0 a1 b1 | a4 b4 a5 b5
    t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);  // a2 b2 a3 b3 | a6 b6 a7 b7
  }
  for (int i = 0; i < 2; ++i) {
    u[4 * i] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(1, 0, 1, 0));          // column 0 | 4
    u[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(3, 2, 3, 2));      // 1 | 5
    u[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(1, 0, 1, 0));  // 2 | 6
    u[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(3, 2, 3, 2));  // 3 | 7
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm256_permute2f128_ps(u[i], u[4 + i], 0x20);
    r[i + 4] = _mm256_permute2f128_ps(u[i], u[4 + i], 0x31);
  }
}

/// 8 consecutive elements at p, widened.
template <class E>
inline __m256 load8(const typename E::T* p) {
  if constexpr (std::is_same_v<E, F32>) {
    return _mm256_loadu_ps(p);
  } else {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    if constexpr (std::is_same_v<E, F16>)
      return _mm256_cvtph_ps(h);
    else
      return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
}

/// The first n (1..7) elements at p widened, zeros in the other lanes; reads only those n.
template <class E>
inline __m256 load8_first(const typename E::T* p, int n) {
  if constexpr (std::is_same_v<E, F32>) {
    return _mm256_maskload_ps(p, lanes8(n));
  } else {
    alignas(16) uint16_t b[8] = {};  // +0.0 in both 16-bit formats
    std::memcpy(b, p, static_cast<std::size_t>(n) * sizeof(uint16_t));
    return load8<E>(b);
  }
}

/// Scores of the R rows of each of NH consecutive KV heads against the group of 8 keys at jg (cut at the
/// tile's end), keys in lanes:
///   s[h][r][j] = fma chain over d = 0..D-1 of q[h][r][d] * K[j][head h][d],
/// the chain qk_micro8 computes for the same (row, key): the same bits. The NH * R chains are independent;
/// several heads at once keep the FMA unit busy where one head of R = 1 row would wait on a single chain's
/// latency (4 cycles per FMA: the bound once the keys are 16-bit and half the bytes come in).
/// head_off: channels from a key row's start to the first head; zero: a zero key row of at least
/// (NH - 1) * D + Dp elements (the padding lanes' keys).
template <int R, int NH, class E>
void qk_narrow8(const Ctx& c, const TileOf<typename E::T>& t, int jg, int64_t head_off, const typename E::T* zero,
                const float* q /*[NH][R][Dp]*/, float* s /*[NH][R][kBK]*/) {
  const int cnt = std::min(8, t.n - jg);
  const typename E::T* kp[8];
  for (int i = 0; i < 8; ++i) kp[i] = i < cnt ? t.k[jg + i] + head_off : zero;
  __m256 acc[NH][R];
#pragma GCC unroll 8
  for (int h = 0; h < NH; ++h)
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) acc[h][r] = _mm256_setzero_ps();
  for (int d0 = 0; d0 < c.D; d0 += 8) {
    const int dn = std::min(8, c.D - d0);
#pragma GCC unroll 4
    for (int h = 0; h < NH; ++h) {
      const int64_t o = static_cast<int64_t>(h) * c.D + d0;
      __m256 kt[8];
      const float* qh = q + h * R * c.Dp + d0;
      if (dn == 8) {
#pragma GCC unroll 8
        for (int i = 0; i < 8; ++i) kt[i] = load8<E>(kp[i] + o);
        transpose8(kt);
#pragma GCC unroll 8
        for (int dd = 0; dd < 8; ++dd)
#pragma GCC unroll 8
          for (int r = 0; r < R; ++r)
            acc[h][r] = _mm256_fmadd_ps(kt[dd], _mm256_broadcast_ss(qh + r * c.Dp + dd), acc[h][r]);
      } else {
        for (int i = 0; i < 8; ++i) kt[i] = load8_first<E>(kp[i] + o, dn);
        transpose8(kt);
        for (int dd = 0; dd < dn; ++dd)
#pragma GCC unroll 8
          for (int r = 0; r < R; ++r)
            acc[h][r] = _mm256_fmadd_ps(kt[dd], _mm256_broadcast_ss(qh + r * c.Dp + dd), acc[h][r]);
      }
    }
  }
#pragma GCC unroll 4
  for (int h = 0; h < NH; ++h)
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) _mm256_storeu_ps(s + (h * R + r) * kBK + jg, acc[h][r]);
}

/// Most KV heads qk_narrow8 takes at once (the zero key row covers them).
constexpr int kNarrowHeadsAtOnce = 2;

/// The scores of every head in [kvh0, kvh0 + nh) against the group of 8 keys at jg: two heads at a time
/// for R = 1 (a decode step without GQA: 32 KV heads x 32768 f16 keys, 40 -> 33 ns per key and head with
/// the keys in L3, 72 -> 67 from DRAM; four heads at once spilled and read 32 interleaved streams: slower,
/// 4 for f32 in L3 twice as slow), one for R >= 2, whose R rows are chains enough.
template <int R, class E>
void qk_narrow_heads8(const Ctx& c, const TileOf<typename E::T>& t, int jg, int kvh0, int nh,
                      const typename E::T* zero, const float* qn /*[nh][R][Dp]*/, float* sh /*[nh][R][kBK]*/) {
  constexpr int NH = R == 1 ? kNarrowHeadsAtOnce : 1;
  int hh = 0;
  for (; hh + NH <= nh; hh += NH)
    qk_narrow8<R, NH, E>(c, t, jg, static_cast<int64_t>(kvh0 + hh) * c.D, zero, qn + hh * R * c.Dp,
                         sh + hh * R * kBK);
  for (; hh < nh; ++hh)
    qk_narrow8<R, 1, E>(c, t, jg, static_cast<int64_t>(kvh0 + hh) * c.D, zero, qn + hh * R * c.Dp,
                        sh + hh * R * kBK);
}

/// O[i][8*c0 + ...] = corr * O + sum_j P[i][j] V[j] for MR rows and ND
/// vectors (without the corr * when not `first`: a later group of the tile's
/// keys continues the chains), one product-sum chain per element over the
/// keys in order: the chain pv_micro8 computes for the same row. The last
/// vector of a head row holds only its first `rem` channels under `tail`
/// (head_dim not a multiple of 8).
template <int MR, int ND, class E>
inline void pv_narrow_micro8(const float* p /*[MR][kBK]*/, const typename E::T* const* v, int64_t off,
                             int n, float* o /*[MR][Dp]*/, int Dp, const float* corr, bool first,
                             bool tail, int rem) {
  __m256 acc[MR][ND];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) {
    const __m256 cr = _mm256_set1_ps(corr[i]);
#pragma GCC unroll 8
    for (int cc = 0; cc < ND; ++cc) {
      const __m256 ov = _mm256_load_ps(o + i * Dp + 8 * cc);
      acc[i][cc] = first ? _mm256_mul_ps(ov, cr) : ov;
    }
  }
  for (int j = 0; j < n; ++j) {
    const typename E::T* vj = v[j] + off;
    __m256 vv[ND];
#pragma GCC unroll 8
    for (int cc = 0; cc < ND; ++cc)
      vv[cc] = tail && cc == ND - 1 ? load8_first<E>(vj + 8 * cc, rem) : load8<E>(vj + 8 * cc);
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      const __m256 b = _mm256_broadcast_ss(p + i * kBK + j);
#pragma GCC unroll 8
      for (int cc = 0; cc < ND; ++cc) acc[i][cc] = _mm256_fmadd_ps(b, vv[cc], acc[i][cc]);
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 8
    for (int cc = 0; cc < ND; ++cc) _mm256_store_ps(o + i * Dp + 8 * cc, acc[i][cc]);
}

/// Rows r0.. r0+MR-1 (MR <= 2 here) against a group of n <= 8 keys, as many
/// channel vectors per pass as fit 16 ymm registers.
template <int MR, class E>
void pv_narrow_rows8(const Ctx& c, const float* p, const typename E::T* const* v, int64_t off, int n,
                     float* o, const float* corr, bool first) {
  constexpr int kMaxNd = MR >= 2 ? 4 : 8;
  const int dv = (c.D + 7) / 8;  // vectors of 8 channels holding head_dim
  const int rem = c.D - 8 * (dv - 1);
  for (int c0 = 0; c0 < dv; c0 += kMaxNd) {
    const int nd = std::min(kMaxNd, dv - c0);
    const bool tail = c0 + nd == dv && rem < 8;
    const int64_t oc = off + 8 * c0;
    float* op = o + 8 * c0;
    switch (nd) {
      case 1: pv_narrow_micro8<MR, 1, E>(p, v, oc, n, op, c.Dp, corr, first, tail, rem); break;
      case 2: pv_narrow_micro8<MR, 2, E>(p, v, oc, n, op, c.Dp, corr, first, tail, rem); break;
      case 3: pv_narrow_micro8<MR, 3, E>(p, v, oc, n, op, c.Dp, corr, first, tail, rem); break;
      case 4: pv_narrow_micro8<MR, 4, E>(p, v, oc, n, op, c.Dp, corr, first, tail, rem); break;
      case 5: pv_narrow_micro8<MR, (kMaxNd >= 5 ? 5 : 1), E>(p, v, oc, n, op, c.Dp, corr, first, tail, rem); break;
      case 6: pv_narrow_micro8<MR, (kMaxNd >= 6 ? 6 : 1), E>(p, v, oc, n, op, c.Dp, corr, first, tail, rem); break;
      case 7: pv_narrow_micro8<MR, (kMaxNd >= 7 ? 7 : 1), E>(p, v, oc, n, op, c.Dp, corr, first, tail, rem); break;
      default: pv_narrow_micro8<MR, (kMaxNd >= 8 ? 8 : 1), E>(p, v, oc, n, op, c.Dp, corr, first, tail, rem); break;
    }
  }
}

/// All R (<= kNarrowMaxRows) rows of the KV heads [kvh0, kvh1): for every row
/// exactly the operations of the wide kernel (wide_block) for that row, so
/// decode against a cache gives bit for bit the output of the same row inside
/// a prefill over the same keys in the same order (for finite scores: a NaN
/// score, from a non-finite q or key, takes the tile max apart differently
/// here, std::max, than _mm256_max_ps does there, as in the AVX-512 kernels).
template <class E>
void narrow_heads(const Ctx& c, int kvh0, int kvh1, int R, std::span<const TileOf<typename E::T>> tiles,
                  Scratch& sc) {
  const NarrowRows nr = narrow_rows(c, kvh0, kvh1, R, sc);
  const int nh = nr.nh;
  float *qn = nr.qn, *on = nr.on, *m = nr.m, *l = nr.l, *corr = nr.corr;
  // The padding lanes' key row: zero bits, +0.0 in every stored format.
  const auto* zero = reinterpret_cast<const typename E::T*>(nr.zero);
  const int64_t* qpos = nr.qpos;
  const int64_t qmin = nr.qmin, qmax = nr.qmax;
  float* sh = sc.s.get(nr.rows * kBK);  // [head][row][key] scores, then P, of one tile
  const float ninf = -std::numeric_limits<float>::infinity();
  for (const TileOf<typename E::T>& t : tiles) {
    const TileClass cls = classify(c, qmin, qmax, t);
    if (cls == TileClass::skip) continue;
    const int n = t.n;
    // Scores, 8 keys at a time for every head: each key row (kv_heads *
    // head_dim floats) is read in order, as the P V pass below reads V.
    for (int jg = 0; jg < n; jg += 8)
      switch (R) {
        case 1: qk_narrow_heads8<1, E>(c, t, jg, kvh0, nh, zero, qn, sh); break;
        case 2: qk_narrow_heads8<2, E>(c, t, jg, kvh0, nh, zero, qn, sh); break;
        case 3: qk_narrow_heads8<3, E>(c, t, jg, kvh0, nh, zero, qn, sh); break;
        case 4: qk_narrow_heads8<4, E>(c, t, jg, kvh0, nh, zero, qn, sh); break;
        case 5: qk_narrow_heads8<5, E>(c, t, jg, kvh0, nh, zero, qn, sh); break;
        case 6: qk_narrow_heads8<6, E>(c, t, jg, kvh0, nh, zero, qn, sh); break;
        case 7: qk_narrow_heads8<7, E>(c, t, jg, kvh0, nh, zero, qn, sh); break;
        default: qk_narrow_heads8<8, E>(c, t, jg, kvh0, nh, zero, qn, sh); break;
      }
    for (int hh = 0; hh < nh; ++hh) {
      const int kvh = kvh0 + hh;
      float* sn = sh + hh * R * kBK;
      float* mh = m + hh * R;
      float* lh = l + hh * R;
      float* ch = corr + hh * R;
      narrow_bias_and_mask(c, kvh, R, qpos, t, cls, sn);
      // Online softmax per row, as softmax_wide8 per lane: the tile max, exp2
      // of the same arguments, the canonical tile sum (part[k] = P[k] +
      // P[k+16] + ..., lanes 0-7 in a0 and 8-15 in a1; then the w = 8, 4, 2, 1
      // tree), l = fma(l, corr, sum).
      for (int rr = 0; rr < R; ++rr) {
        float* sr = sn + rr * kBK;
        __m256 mv = _mm256_set1_ps(ninf);
        for (int j = 0; j < n; j += 8) {
          const int cnt = std::min(8, n - j);
          __m256 x = _mm256_loadu_ps(sr + j);
          if (cnt < 8) x = _mm256_blendv_ps(_mm256_set1_ps(ninf), x, _mm256_castsi256_ps(lanes8(cnt)));
          mv = _mm256_max_ps(mv, x);
        }
        alignas(32) float lane[8];
        _mm256_store_ps(lane, mv);
        float mt = lane[0];
        for (int k = 1; k < 8; ++k) mt = std::max(mt, lane[k]);  // max is exact in any order
        const float mnew = std::max(mh[rr], mt);
        const float msafe = mnew == ninf ? 0.0f : mnew;
        ch[rr] = _mm256_cvtss_f32(exp2_ps8(_mm256_set1_ps(mh[rr] - msafe)));
        mh[rr] = mnew;
        const __m256 ms = _mm256_set1_ps(msafe);
        __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
        for (int j = 0; j < n; j += 8) {
          const int cnt = std::min(8, n - j);
          __m256 p = exp2_ps8(_mm256_sub_ps(_mm256_loadu_ps(sr + j), ms));
          _mm256_storeu_ps(sr + j, p);
          if (cnt < 8) p = _mm256_and_ps(p, _mm256_castsi256_ps(lanes8(cnt)));  // keys past the tile add nothing
          if ((j / 8) % 2 == 0)
            a0 = _mm256_add_ps(a0, p);
          else
            a1 = _mm256_add_ps(a1, p);
        }
        alignas(32) float part[8];
        _mm256_store_ps(part, _mm256_add_ps(a0, a1));
        for (int w = 4; w >= 1; w /= 2)
          for (int k = 0; k < w; ++k) part[k] = part[k] + part[k + w];
        lh[rr] = std::fma(lh[rr], ch[rr], part[0]);
      }
    }
    // O = corr * O + P V, 8 keys at a time for every head (the chains over
    // the keys continue in order from one group to the next).
    for (int jg = 0; jg < n; jg += 8) {
      const int cnt = std::min(8, n - jg);
      for (int hh = 0; hh < nh; ++hh) {
        const int64_t head_off = static_cast<int64_t>(kvh0 + hh) * c.D;
        const float* sn = sh + hh * R * kBK + jg;
        float* oh = on + hh * R * c.Dp;
        const float* ch = corr + hh * R;
        int r2 = 0;
        for (; r2 + 2 <= R; r2 += 2)
          pv_narrow_rows8<2, E>(c, sn + r2 * kBK, t.v + jg, head_off, cnt, oh + r2 * c.Dp, ch + r2, jg == 0);
        if (r2 < R) pv_narrow_rows8<1, E>(c, sn + r2 * kBK, t.v + jg, head_off, cnt, oh + r2 * c.Dp, ch + r2, jg == 0);
      }
    }
  }
  for (int hh = 0; hh < nh; ++hh)
    for (int r = 0; r < R; ++r) {
      int64_t t;
      int h;
      row_of(c, kvh0 + hh, r, t, h);
      float* dst = c.out + (t * c.H + h) * static_cast<int64_t>(c.D);
      const float lr = l[hh * R + r];
      const float inv = lr > 0.0f ? 1.0f / lr : 0.0f;
      const float* src = on + (hh * R + r) * c.Dp;
      for (int d = 0; d < c.D; ++d) dst[d] = src[d] * inv;
    }
}

#else  // neither AVX-512 nor AVX2

constexpr int kNarrowMaxRows = 0;

#endif

/// Portable path (neither AVX-512 nor AVX2): one row at a time, same tiles and masks,
/// online softmax in base 2. Used for every row when the vector kernels are
/// not compiled in.
[[maybe_unused]] void scalar_rows(const Ctx& c, int kvh, int64_t g0, int nr,
                                  std::span<const Tile> tiles, Scratch& sc) {
  float* qrow = sc.qt.get(static_cast<std::size_t>(c.Dp));
  float* acc = sc.o.get(static_cast<std::size_t>(c.Dp));
  const int64_t head_off = static_cast<int64_t>(kvh) * c.D;
  for (int r = 0; r < nr; ++r) {
    int64_t t;
    int h;
    row_of(c, kvh, g0 + r, t, h);
    load_q_row(c, t, h, qrow);
    const int64_t qi = c.q_pos[t];
    float m = -std::numeric_limits<float>::infinity(), l = 0.0f;
    std::fill(acc, acc + c.D, 0.0f);
    for (const Tile& tile : tiles) {
      const TileClass cls = classify(c, qi, qi, tile);
      if (cls == TileClass::skip) continue;
      for (int j = 0; j < tile.n; ++j) {
        if (cls == TileClass::partial && !visible(c, qi, tile.pos[j])) continue;
        const float* kr = tile.k[j] + head_off;
        float dot = 0.0f;
        for (int d = 0; d < c.D; ++d) dot += qrow[d] * kr[d];
        const float x = dot + bias_l2e(c, h, qi, tile.pos[j]);
        const float* vr = tile.v[j] + head_off;
        const float mnew = std::max(m, x);
        const float cr = std::exp2(m - mnew), p = std::exp2(x - mnew);
        l = l * cr + p;
        for (int d = 0; d < c.D; ++d) acc[d] = acc[d] * cr + p * vr[d];
        m = mnew;
      }
    }
    float* dst = c.out + (t * c.H + h) * static_cast<int64_t>(c.D);
    const float inv = l > 0.0f ? 1.0f / l : 0.0f;
    for (int d = 0; d < c.D; ++d) dst[d] = acc[d] * inv;
  }
}

/// Flattens the blocks into `keys` and cuts it into tiles. With sort_keys,
/// keys that are not already in position order (shuffled pages) are sorted
/// by position first, so that tiles cover narrow position ranges and masks
/// can skip or leave them unmasked; the order of keys does not change the
/// result beyond float rounding.
/// T = float reads the blocks' k/v, T = uint16_t their k16/v16 (blocks of one 16-bit dtype).
template <class T>
void build_tiles(std::span<const KvBlock> kv, int64_t ks, bool sort_keys, KeyTableOf<T>& keys,
                 std::vector<TileOf<T>>& tiles) {
  int64_t total = 0;
  for (const KvBlock& b : kv) total += b.n_tokens;
  if (static_cast<int64_t>(keys.pos.size()) < total) {
    keys.k.resize(static_cast<std::size_t>(total));
    keys.v.resize(static_cast<std::size_t>(total));
    keys.pos.resize(static_cast<std::size_t>(total));
  }
  tiles.clear();
  int64_t n_keys = 0;
  for (const KvBlock& b : kv) {
    const T* k;
    const T* v;
    if constexpr (std::is_same_v<T, float>) {
      k = b.k;
      v = b.v;
    } else {
      k = b.k16;
      v = b.v16;
    }
    for (int64_t j = 0; j < b.n_tokens; ++j, k += ks, v += ks) {
      const int64_t p = b.position_ids[j];
      keys.k[static_cast<std::size_t>(n_keys)] = k;
      keys.v[static_cast<std::size_t>(n_keys)] = v;
      keys.pos[static_cast<std::size_t>(n_keys)] = p;
      n_keys += p >= 0;  // empty slots are overwritten by the next key
    }
  }
  if (sort_keys && !std::is_sorted(keys.pos.begin(), keys.pos.begin() + n_keys)) {
    std::vector<int32_t> order(static_cast<std::size_t>(n_keys));
    for (int64_t i = 0; i < n_keys; ++i) order[static_cast<std::size_t>(i)] = static_cast<int32_t>(i);
    std::stable_sort(order.begin(), order.end(),
                     [&](int32_t a, int32_t b) { return keys.pos[static_cast<std::size_t>(a)] < keys.pos[static_cast<std::size_t>(b)]; });
    std::vector<const T*> k2(static_cast<std::size_t>(n_keys)), v2(k2.size());
    std::vector<int64_t> p2(k2.size());
    for (std::size_t i = 0; i < k2.size(); ++i) {
      const auto o = static_cast<std::size_t>(order[i]);
      k2[i] = keys.k[o];
      v2[i] = keys.v[o];
      p2[i] = keys.pos[o];
    }
    std::copy(k2.begin(), k2.end(), keys.k.begin());
    std::copy(v2.begin(), v2.end(), keys.v.begin());
    std::copy(p2.begin(), p2.end(), keys.pos.begin());
  }
  for (int64_t j0 = 0; j0 < n_keys; j0 += kBK) {
    const int n = static_cast<int>(std::min<int64_t>(kBK, n_keys - j0));
    TileOf<T> t{keys.k.data() + j0, keys.v.data() + j0, keys.pos.data() + j0, n,
           std::numeric_limits<int64_t>::max(), std::numeric_limits<int64_t>::min()};
    for (int j = 0; j < n; ++j) {
      t.kmin = std::min(t.kmin, t.pos[j]);
      t.kmax = std::max(t.kmax, t.pos[j]);
    }
    tiles.push_back(t);
  }
}

}  // namespace

int64_t check_kv_blocks(std::span<const KvBlock> kv, std::string_view caller) {
  int64_t kv_tokens = 0;
  for (std::size_t i = 0; i < kv.size(); ++i) {
    const KvBlock& b = kv[i];
    if (b.n_tokens < 0)
      throw InvalidArgument(fmt::format("{}: kv[{}].n_tokens must be >= 0 (got {})", caller, i, b.n_tokens));
    if (b.dtype != KvCacheDtype::f32 && b.dtype != KvCacheDtype::f16 && b.dtype != KvCacheDtype::bf16)
      throw InvalidArgument(fmt::format("{}: kv[{}].dtype must be f32, f16 or bf16 (got {})", caller, i,
                                        static_cast<int>(b.dtype)));
    if (b.n_tokens == 0) continue;
    const char* dtype = b.dtype == KvCacheDtype::f32 ? "f32" : b.dtype == KvCacheDtype::f16 ? "f16" : "bf16";
    const bool f32 = b.dtype == KvCacheDtype::f32;
    const char* null_field = !b.position_ids          ? "position_ids"
                             : f32 && !b.k           ? "k"
                             : f32 && !b.v           ? "v"
                             : !f32 && !b.k16        ? "k16"
                             : !f32 && !b.v16        ? "v16"
                                                     : nullptr;
    if (null_field)
      throw InvalidArgument(fmt::format("{}: kv[{}].{} is null (a block of {} tokens, dtype {}{})", caller, i,
                                        null_field, b.n_tokens, dtype,
                                        f32 ? "" : ": 16-bit blocks carry their data in k16/v16"));
    kv_tokens += b.n_tokens;
  }
  return kv_tokens;
}

std::span<const KvBlock> widen_kv_blocks(std::span<const KvBlock> kv, int64_t row, std::vector<float>& storage,
                                         std::vector<KvBlock>& widened, int64_t first, int64_t count) {
  if (count < 0) count = row - first;
  std::size_t need = 0;
  for (const KvBlock& b : kv)
    if (b.dtype != KvCacheDtype::f32) need += 2 * static_cast<std::size_t>(b.n_tokens) * static_cast<std::size_t>(row);
  if (need == 0) return kv;
  storage.resize(need);  // before taking pointers into it
  widened.assign(kv.begin(), kv.end());
  const auto widen = [](KvCacheDtype dtype, const uint16_t* src, float* out, std::size_t n) {
    std::size_t i = 0;
#if (defined(POSENC_ATTN_AVX2) || defined(POSENC_ATTN_AVX512)) && defined(__F16C__)
    if (dtype == KvCacheDtype::f16)
      for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
#endif
    for (; i < n; ++i) out[i] = dtype == KvCacheDtype::f16 ? f16_to_f32(src[i]) : bf16_to_f32(src[i]);
  };
  const bool whole = first == 0 && count == row;
  float* dst = storage.data();
  for (KvBlock& b : widened) {
    if (b.dtype == KvCacheDtype::f32) continue;
    const std::size_t n = static_cast<std::size_t>(b.n_tokens) * static_cast<std::size_t>(row);
    for (int kv_i = 0; kv_i < 2; ++kv_i) {
      const uint16_t* src = kv_i == 0 ? b.k16 : b.v16;
      float* out = dst + kv_i * n;
      if (whole) {
        widen(b.dtype, src, out, n);
      } else {
        for (int64_t j = 0; j < b.n_tokens; ++j)
          widen(b.dtype, src + j * row + first, out + j * row + first, static_cast<std::size_t>(count));
      }
    }
    b.k = dst;
    b.v = dst + n;
    b.dtype = KvCacheDtype::f32;
    b.k16 = b.v16 = nullptr;
    dst += 2 * n;
  }
  return widened;
}

bool reads_16bit_blocks_in_place(int64_t rows) {
#if defined(POSENC_ATTN_AVX512) || (defined(POSENC_ATTN_AVX2) && defined(__F16C__))
  return rows <= kNarrowMaxRows;
#else
  (void)rows;
  return false;
#endif
}

void attention_kernel(const AttentionSpec& spec, const float* q,
                      std::span<const int64_t> q_position_ids, std::span<const KvBlock> kv,
                      float* out, const AttentionOptions& options, const QueryRope* q_rope) {
  spec.validate();
  if (options.num_threads < 0)
    fail_field<InvalidArgument>("num_threads", "must be >= 0", options.num_threads);
  const int kv_begin = options.kv_head_begin;
  const int kv_end = options.kv_head_end < 0 ? spec.kv_heads : options.kv_head_end;
  if (kv_begin < 0 || kv_begin > kv_end || kv_end > spec.kv_heads || options.kv_head_end < -1)
    throw InvalidArgument(fmt::format("attention_forward: kv_head_begin {} / kv_head_end {}: must satisfy 0 <= "
                                      "kv_head_begin <= kv_head_end <= num_key_value_heads ({}; -1: all)",
                                      options.kv_head_begin, options.kv_head_end, spec.kv_heads));
  const int64_t q_tokens = static_cast<int64_t>(q_position_ids.size());
  if (q_tokens == 0) return;
  if (!q || !out)
    throw InvalidArgument("attention_forward: q and out must not be null when q_tokens > 0");
  const int64_t kv_tokens = check_kv_blocks(kv, "attention_forward");
  if (kv_begin == kv_end) return;
  const int kv_range = kv_end - kv_begin;

  Ctx c;
  c.spec = &spec;
  c.H = spec.heads;
  c.KVH = spec.kv_heads;
  c.D = spec.head_dim;
  c.group = spec.heads / spec.kv_heads;
  c.Dp = (c.D + 15) / 16 * 16;
  c.Dv = c.Dp / 16;
  c.tail_mask = c.D % 16 == 0 ? 0xFFFFu : (1u << (c.D % 16)) - 1u;
  c.ks = static_cast<int64_t>(c.KVH) * c.D;
  c.qscale = spec.effective_scale() * kLog2e;
  c.q = q;
  c.q_pos = q_position_ids.data();
  c.out = out;
  c.rope = q_rope;
  c.mask = spec.mask;
  c.window = spec.sliding_window;
  c.bias = spec.bias;
  if (c.bias == LogitBias::alibi) {
    c.slope_l2e.resize(static_cast<std::size_t>(c.H));
    for (int h = 0; h < c.H; ++h)
      c.slope_l2e[static_cast<std::size_t>(h)] = -spec.alibi_slopes[static_cast<std::size_t>(h)] * kLog2e;
  }
  if (c.bias == LogitBias::t5) {
    // The bucket is constant once |relative position| >= max_distance (it is
    // capped at the last bucket), so a table over [-R, R] covers every offset.
    const int R = std::max(spec.t5.max_distance, 1);
    c.t5_radius = R;
    std::vector<int> bucket(static_cast<std::size_t>(2 * R + 1));
    for (int rel = -R; rel <= R; ++rel)
      bucket[static_cast<std::size_t>(rel + R)] = t5_relative_position_bucket(
          rel, spec.t5.bidirectional, spec.t5.num_buckets, spec.t5.max_distance);
    c.t5_lut.resize(static_cast<std::size_t>(c.H) * bucket.size());
    for (int h = 0; h < c.H; ++h)
      for (std::size_t i = 0; i < bucket.size(); ++i)
        c.t5_lut[static_cast<std::size_t>(h) * bucket.size() + i] =
            spec.t5.table[static_cast<std::size_t>(bucket[i]) * static_cast<std::size_t>(c.H) +
                          static_cast<std::size_t>(h)] *
            kLog2e;
  }

  // Sorting pays off when a mask hides keys. It does not depend on the number
  // of queries, so a row's result stays independent of the rest of the call
  // (decode and prefill see the same key order, hence the same tiles).
  const bool sort_keys = spec.mask != MaskKind::none && kv_tokens <= INT32_MAX;
  const int64_t rows = q_tokens * c.group;  // per KV head
  const double work = static_cast<double>(q_tokens) * c.group * kv_range * static_cast<double>(kv_tokens) * c.D;
  int threads = options.num_threads > 0 ? options.num_threads : omp_get_max_threads();
  if (work < kParallelMinWork || omp_in_parallel()) threads = 1;

#if defined(POSENC_ATTN_AVX512) || defined(POSENC_ATTN_AVX2)
  // The narrow kernel over tiles of element type T, one item per thread: a contiguous range of KV heads each.
  auto run_narrow = [&]<class E>(std::span<const TileOf<typename E::T>> tiles) {
    const int n_items = std::min(threads, kv_range);
    auto run = [&](int item) {
      const int h0 = kv_begin + static_cast<int>(static_cast<int64_t>(kv_range) * item / n_items);
      const int h1 = kv_begin + static_cast<int>(static_cast<int64_t>(kv_range) * (item + 1) / n_items);
      narrow_heads<E>(c, h0, h1, static_cast<int>(rows), tiles, thread_scratch());
    };
    if (n_items <= 1) {
      run(0);
    } else {
      FirstException error;  // std::bad_alloc of a thread's scratch, rethrown after the region
#pragma omp parallel for schedule(static, 1) num_threads(n_items)
      for (int i = 0; i < n_items; ++i) error.run([&] { run(i); });
      error.rethrow();
    }
  };
#endif
#if defined(POSENC_ATTN_AVX512) || (defined(POSENC_ATTN_AVX2) && defined(__F16C__))
  // Decode over f16/bf16 blocks (all of one dtype): the narrow kernels read them in place, 2 bytes per
  // element streamed instead of a float32 copy written and read back.
  if (rows <= kNarrowMaxRows) {
    std::optional<KvCacheDtype> stored;
    bool one_dtype = true;
    for (const KvBlock& b : kv) {
      if (b.n_tokens == 0) continue;
      if (stored && *stored != b.dtype) one_dtype = false;
      stored = b.dtype;
    }
    if (stored && *stored != KvCacheDtype::f32 && one_dtype) {
      thread_local KeyTableOf<uint16_t> key_table16;
      thread_local std::vector<TileOf<uint16_t>> tile_storage16;
      build_tiles(kv, c.ks, sort_keys, key_table16, tile_storage16);
      const std::span<const TileOf<uint16_t>> tiles16(tile_storage16);
      if (*stored == KvCacheDtype::f16)
        run_narrow.template operator()<F16>(tiles16);
      else
        run_narrow.template operator()<BF16>(tiles16);
      return;
    }
  }
#endif
  // Every other call over f16/bf16 blocks reads an exact float32 copy of them (per thread, reused).
  thread_local std::vector<float> widened_storage;
  thread_local std::vector<KvBlock> widened_blocks;
  // Only the channels of the heads the call computes (the decode team's threads each widen their own, while the
  // others may still be appending theirs).
  kv = widen_kv_blocks(kv, c.ks, widened_storage, widened_blocks, static_cast<int64_t>(kv_begin) * c.D,
                       static_cast<int64_t>(kv_range) * c.D);

  thread_local KeyTable key_table;
  thread_local std::vector<Tile> tile_storage;
  build_tiles(kv, c.ks, sort_keys, key_table, tile_storage);
  const std::span<const Tile> tiles(tile_storage);

#if defined(POSENC_ATTN_AVX512) || defined(POSENC_ATTN_AVX2)
  if (rows <= kNarrowMaxRows) {
    run_narrow.template operator()<F32>(tiles);
    return;
  }
#endif
  const int64_t n_blocks = (rows + kBQ - 1) / kBQ;
  const int64_t n_items = n_blocks * kv_range;
  threads = static_cast<int>(std::min<int64_t>(threads, n_items));
  auto run_item = [&](int64_t item) {
    // Heaviest first: with causal masks the last row blocks see the most keys.
    const int64_t block = n_blocks - 1 - item / kv_range;
    const int kvh = kv_begin + static_cast<int>(item % kv_range);
    const int64_t g0 = block * kBQ;
    const int nr = static_cast<int>(std::min<int64_t>(kBQ, rows - g0));
    Scratch& sc = thread_scratch();
#if defined(POSENC_ATTN_AVX512) || defined(POSENC_ATTN_AVX2)
    wide_block(c, kvh, g0, nr, tiles, sc);
#else
    scalar_rows(c, kvh, g0, nr, tiles, sc);
#endif
  };
  if (threads <= 1) {
    for (int64_t i = 0; i < n_items; ++i) run_item(i);
  } else {
    FirstException error;  // std::bad_alloc of a thread's scratch, rethrown after the region
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int64_t i = 0; i < n_items; ++i) error.run([&] { run_item(i); });
    error.rethrow();
  }
}

}  // namespace posenc::detail
