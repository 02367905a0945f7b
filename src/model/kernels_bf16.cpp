// Products with F16/BF16 weights on AMX-BF16 tiles: float32 activations and the weights split into bfloat16
// terms (the bf16x3 / bf16x6 algorithms of XLA's dot-algorithm presets BF16_BF16_F32_X3 / _X6), each bf16 product
// exact in float32, accumulated in float32 by tdpbf16ps. See kernels.hpp.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include <cpuid.h>
#include <immintrin.h>
#include <omp.h>
#include <sys/syscall.h>
#include <unistd.h>

// GCC 12 flags the undefined pass-through vectors inside its own AVX-512 intrinsics as uninitialized.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

#include "core/aligned.hpp"
#include "core/parallel.hpp"
#include "model/kernels.hpp"
#include "model/kernels_dense.hpp"
#include "posenc/float16.hpp"

namespace posenc::detail {

std::string_view to_string(Bf16Split s) { return s == Bf16Split::x3 ? "bf16x3" : "bf16x6"; }

namespace {

inline uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float float_of(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
/// f with the low 16 bits of its encoding cleared: a bfloat16 value (truncation, so f - result is exact).
inline float trunc_bf16(float f) { return float_of(bits_of(f) & 0xFFFF0000u); }

/// The stored weight (F16 or BF16) at index i of a row, widened exactly.
inline float weight_at(WeightType t, const std::byte* row, int64_t i) {
  uint16_t h;
  std::memcpy(&h, row + 2 * i, 2);
  return t == WeightType::f16 ? f16_to_f32(h) : bf16_to_f32(h);
}

// ---- which bf16 products each algorithm keeps ----
// x = x0 + x1 + x2 (bf16 terms, x0 = trunc_bf16(x), x1 = trunc_bf16(x - x0), x2 = x - x0 - x1: exact for a normal
// float32 x, whose 24 significand bits are three terms of 8), w = w0 + w1 (w0 = trunc_bf16(w), w1 = w - w0: exact for
// F16's 11 bits; w1 = 0 for BF16). bf16x6: all six x_i w_j (every product of x and w exact); bf16x3: x0 w0, x1 w0,
// x0 w1 (as XLA's X3; the three dropped are under 2^-13 |x w| together).
struct Term {
  int x, w;
};
constexpr Term kX6[] = {{0, 0}, {1, 0}, {2, 0}, {0, 1}, {1, 1}, {2, 1}};
constexpr Term kX3[] = {{0, 0}, {1, 0}, {0, 1}};

}  // namespace

void split_x_bf16(float x, float parts[3]) {
  parts[0] = trunc_bf16(x);
  const float r = x - parts[0];
  parts[1] = trunc_bf16(r);
  parts[2] = trunc_bf16(r - parts[1]);
}

void split_w_bf16(float w, float parts[2]) {
  parts[0] = trunc_bf16(w);
  parts[1] = trunc_bf16(w - parts[0]);
}

void matmul_bf16_split_reference(Bf16Split s, const float* x, int64_t n, const RawMatrix& w, double* y) {
  if (w.type != WeightType::f16 && w.type != WeightType::bf16)
    throw std::logic_error("matmul_bf16_split_reference: F16 or BF16 weights only");
  const int64_t in = w.cols, row_bytes = w.row_bytes();
  const Term* terms = s == Bf16Split::x6 ? kX6 : kX3;
  const int nterms = s == Bf16Split::x6 ? 6 : 3;
  for (int64_t r = 0; r < n; ++r)
    for (int64_t o = 0; o < w.rows; ++o) {
      double acc = 0.0;
      for (int64_t i = 0; i < in; ++i) {
        float xs[3], ws[2];
        split_x_bf16(x[r * in + i], xs);
        split_w_bf16(weight_at(w.type, w.data + o * row_bytes, i), ws);
        for (int t = 0; t < nterms; ++t) acc += static_cast<double>(xs[terms[t].x]) * ws[terms[t].w];
      }
      y[r * w.rows + o] = acc;
    }
}

namespace {

#define POSENC_TARGET_AMXBF16 \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,f16c,fma,amx-tile,amx-bf16")))

/// AMX-BF16: CPUID.(EAX=7,ECX=0):EDX bits 22 (AMX-BF16) and 24 (AMX-TILE), AVX512_BF16 (CPUID.(7,1):EAX bit 5, for
/// the packing's vcvtne2ps2bf16), and the kernel's permission to use the tile data (asked once per process).
bool cpu_has_amx_bf16() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (__get_cpuid_count(7, 0, &a, &b, &c, &d) == 0) return false;
  if ((d & (1u << 22)) == 0 || (d & (1u << 24)) == 0) return false;
  unsigned a1 = 0, b1 = 0, c1 = 0, d1 = 0;
  if (__get_cpuid_count(7, 1, &a1, &b1, &c1, &d1) == 0 || (a1 & (1u << 5)) == 0) return false;
  if (!__builtin_cpu_supports("avx512f") || !__builtin_cpu_supports("avx512bw") ||
      !__builtin_cpu_supports("avx512dq") || !__builtin_cpu_supports("avx512vl"))
    return false;
  constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
}

// Tiles: C[o][r] = sum_k W[o][k] x[r][k], with the weights as A (16 output rows x 32 k, the rows as stored, widened
// and split: no transposition) and x as B (16 k-pairs x 16 rows of x x 2, VNNI order, packed once per call). A tile
// of C is 16 outputs x 16 rows of x; it is transposed into y by the epilogue. Prefill: tmm0..3: C of (panel 0,
// x tile 0), (0, 1), (1, 0), (1, 1); tmm4, tmm5: the two panels' A; tmm6, tmm7: the two x tiles' B. Decode (one x
// tile): tmm0..3: C of four panels; tmm4, tmm5: A, in turns; tmm6: B.
constexpr int64_t kTile = 16;        // rows of x per tile; weight rows per panel
constexpr int64_t kK = 32;           // k per tile product (one 1 KiB tile of bf16)
constexpr int64_t kTileBytes = 1024;
// k blocks per chunk of a prefill panel pair's packed weights (2 panels x 8 x 2 KiB per weight term)
constexpr int64_t kChunk = 8;

POSENC_TARGET_AMXBF16 void amx_bf16_begin() {
  AmxTileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  // GCC 12's _tile_loadconfig tells the compiler it reads 8 bytes of cfg: make the whole 64 visible.
  asm volatile("" : : "m"(cfg) : "memory");
  _tile_loadconfig(&cfg);
}
POSENC_TARGET_AMXBF16 void amx_bf16_end() { _tile_release(); }

/// 16 x 16 transpose of 32-bit lanes, in registers.
POSENC_TARGET_AMXBF16 inline void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int i = 0; i < 16; i += 8)
    for (int j = 0; j < 4; ++j) {
      t[i + j] = _mm512_shuffle_i32x4(r[i + j], r[i + j + 4], 0x88);
      t[i + j + 4] = _mm512_shuffle_i32x4(r[i + j], r[i + j + 4], 0xDD);
    }
  for (int j = 0; j < 8; ++j) {
    r[j] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0x88);
    r[j + 8] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0xDD);
  }
}

/// The two float32 halves (16 each) of 32 values as 32 bf16, in order (the values are bf16 already: exact).
POSENC_TARGET_AMXBF16 inline __m512i to_bf16(__m512 lo, __m512 hi) {
  return reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo));
}
POSENC_TARGET_AMXBF16 inline __m512 trunc16(__m512 v) {
  return _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(v), _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

/// One k block of a weight row: 32 stored F16/BF16 values at src (those outside m zero) as A tile row(s): the
/// value itself for BF16 (at a), or for F16 its two bf16 terms, at a and a + term_stride.
POSENC_TARGET_AMXBF16 inline void split_w_block(const std::byte* src, __mmask32 m, bool f16, std::byte* a,
                                                int64_t term_stride) {
  const __m512i raw = _mm512_maskz_loadu_epi16(m, src);
  if (!f16) {  // BF16: the stored value is the only term
    _mm512_store_si512(a, raw);
    return;
  }
  const __m512 lo = _mm512_cvtph_ps(_mm512_castsi512_si256(raw));
  const __m512 hi = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(raw, 1));
  const __m512 lo0 = trunc16(lo), hi0 = trunc16(hi);
  _mm512_store_si512(a, to_bf16(lo0, hi0));
  _mm512_store_si512(a + term_stride, to_bf16(_mm512_sub_ps(lo, lo0), _mm512_sub_ps(hi, hi0)));
}

/// x tile t (rows [16t, 16t + 16) of x, those past n zero), k block kb, as `nx` B tiles (x0, x1[, x2]) at dst:
/// tile c, row p (k pair), lane r = (x_c[r][32kb + 2p], x_c[r][32kb + 2p + 1]).
POSENC_TARGET_AMXBF16 void pack_x_block(const float* x, int64_t n, int64_t in, int64_t t, int64_t kb, int nx,
                                        std::byte* dst) {
  __m512i parts[3][16];
  const int64_t k0 = kb * kK;
  const __mmask16 m0 = k0 + 16 <= in ? 0xFFFF : k0 >= in ? 0 : static_cast<__mmask16>((1u << (in - k0)) - 1u);
  const __mmask16 m1 = k0 + 32 <= in ? 0xFFFF : k0 + 16 >= in ? 0 : static_cast<__mmask16>((1u << (in - k0 - 16)) - 1u);
  for (int r = 0; r < 16; ++r) {
    const int64_t row = t * kTile + r;
    __m512 a = _mm512_setzero_ps(), b = _mm512_setzero_ps();
    if (row < n) {
      a = _mm512_maskz_loadu_ps(m0, x + row * in + k0);
      b = _mm512_maskz_loadu_ps(m1, x + row * in + k0 + 16);
    }
    const __m512 a0 = trunc16(a), b0 = trunc16(b);
    parts[0][r] = to_bf16(a0, b0);
    const __m512 ar = _mm512_sub_ps(a, a0), br = _mm512_sub_ps(b, b0);
    const __m512 a1 = trunc16(ar), b1 = trunc16(br);
    parts[1][r] = to_bf16(a1, b1);
    if (nx == 3) parts[2][r] = to_bf16(trunc16(_mm512_sub_ps(ar, a1)), trunc16(_mm512_sub_ps(br, b1)));
  }
  for (int c = 0; c < nx; ++c) {
    transpose16(parts[c]);
    for (int p = 0; p < 16; ++p) _mm512_store_si512(dst + c * kTileBytes + p * 64, parts[c][p]);
  }
}

/// Weight rows [o0, o0 + 16 panels) (rows past `out` zero), k blocks [kb0, kb1), as A tiles at dst:
/// [kb - kb0][w term][panel][16 rows][32 bf16] (prefill). A row's blocks are read one after the other, and the
/// next chunk's bytes of the same rows (or, at the last chunk, the first chunk of the next panels) are
/// prefetched towards L2 as they go.
POSENC_TARGET_AMXBF16 void pack_w_chunk(const RawMatrix& w, int64_t o0, int panels, int64_t kb0, int64_t kb1, int nw,
                                        std::byte* dst, int r0 = 0, int r1 = -1) {
  const int64_t in = w.cols, row_bytes = w.row_bytes(), kblocks = (in + kK - 1) / kK;
  const bool f16 = w.type == WeightType::f16;
  const int64_t chunk_bytes = std::min<int64_t>((kb1 - kb0) * kK * 2, row_bytes - kb0 * kK * 2);
  const bool last = kb1 >= kblocks;
  if (r1 < 0) r1 = panels * static_cast<int>(kTile);
  for (int i = r0; i < r1; ++i) {
    const int64_t o = o0 + i;
    if (o >= w.rows) {
      for (int64_t kb = kb0; kb < kb1; ++kb) {
        std::byte* a0 = dst + (kb - kb0) * nw * panels * kTileBytes + (i / kTile) * kTileBytes + (i % kTile) * 64;
        _mm512_store_si512(a0, _mm512_setzero_si512());
        if (nw == 2) _mm512_store_si512(a0 + panels * kTileBytes, _mm512_setzero_si512());
      }
      continue;
    }
    const std::byte* row = w.data + o * row_bytes;
    // Next: the following chunk of this row, or the first chunk of the row a group further.
    const int64_t next_row = last ? o + panels * kTile : o;
    if (next_row < w.rows) {
      const std::byte* nxt = w.data + next_row * row_bytes + (last ? 0 : kb1 * kK * 2);
      const int64_t nbytes = last ? std::min<int64_t>(chunk_bytes, row_bytes) : std::min<int64_t>(chunk_bytes, row_bytes - kb1 * kK * 2);
      for (int64_t l = 0; l < nbytes; l += 64) __builtin_prefetch(nxt + l, 0, 2);
    }
    for (int64_t kb = kb0; kb < kb1; ++kb) {
      const int64_t k0 = kb * kK;
      const __mmask32 m = k0 + 32 <= in ? 0xFFFFFFFFu : static_cast<__mmask32>((1u << (in - k0)) - 1u);
      std::byte* a0 = dst + (kb - kb0) * nw * panels * kTileBytes + (i / kTile) * kTileBytes + (i % kTile) * 64;
      split_w_block(row + k0 * 2, m, f16, a0, panels * kTileBytes);
    }
  }
}

/// The packing of the chunk after the one the tiles are running on, spread over their k blocks (its rows in
/// `parts` slices): the tdpbf16ps of one chunk run on the AMX unit while the vector ports widen and split the next
/// (packed in turn, the packing was 24% of a bf16x6 prefill and most of a decode).
struct PackJob {
  const RawMatrix* w = nullptr;  // nullptr: nothing to pack
  int64_t o0 = 0, kb0 = 0, kb1 = 0;
  int panels = 0, nw = 0;
  std::byte* dst = nullptr;
  void run() const {
    if (w != nullptr) pack_w_chunk(*w, o0, panels, kb0, kb1, nw, dst);
  }
  void slice(int64_t part, int64_t parts) const {
    if (w == nullptr) return;
    const int64_t rows = panels * kTile;
    pack_w_chunk(*w, o0, panels, kb0, kb1, nw, dst, static_cast<int>(rows * part / parts),
                 static_cast<int>(rows * (part + 1) / parts));
  }
};

enum class Epilogue { store, accumulate, swiglu };

/// The products of one chunk for a panel pair and one or two x tiles (Two: x tiles xb and xb + tile stride),
/// added to the C tiles in ct (ct[0..3] as tmm0..3, 16 x 16 float32 each; zero first when `first`).
template <bool Two, Bf16Split S>
POSENC_TARGET_AMXBF16 void tile_chunk(const std::byte* wa, const std::byte* xb0, const std::byte* xb1, int64_t blocks,
                                      int nw, int nx, bool first, float* ct, const PackJob& job, int64_t part0,
                                      int64_t parts) {
  if (first) {
    _tile_zero(0);
    _tile_zero(2);
    if constexpr (Two) {
      _tile_zero(1);
      _tile_zero(3);
    }
  } else {
    _tile_loadd(0, ct, 64);
    _tile_loadd(2, ct + 512, 64);
    if constexpr (Two) {
      _tile_loadd(1, ct + 256, 64);
      _tile_loadd(3, ct + 768, 64);
    }
  }
  const int64_t xstride = nx * kTileBytes;
  for (int64_t b = 0; b < blocks; ++b) {
    const std::byte* a = wa + b * nw * 2 * kTileBytes;
    const std::byte* x0 = xb0 + b * xstride;
    const std::byte* x1 = xb1 + b * xstride;
#define POSENC_BF16_TERMS(XT)                       \
  _tile_loadd(6, x0 + (XT) * kTileBytes, 64);       \
  if constexpr (Two) _tile_loadd(7, x1 + (XT) * kTileBytes, 64); \
  _tile_dpbf16ps(0, 4, 6);                          \
  _tile_dpbf16ps(2, 5, 6);                          \
  if constexpr (Two) {                              \
    _tile_dpbf16ps(1, 4, 7);                        \
    _tile_dpbf16ps(3, 5, 7);                        \
  }
    // weight term 0 against x terms 0, 1 (, 2)
    _tile_loadd(4, a, 64);
    _tile_loadd(5, a + kTileBytes, 64);
    POSENC_BF16_TERMS(0)
    POSENC_BF16_TERMS(1)
    if constexpr (S == Bf16Split::x6) {
      POSENC_BF16_TERMS(2)
    }
    if (nw == 2) {  // weight term 1 (F16) against x terms 0 (, 1, 2)
      _tile_loadd(4, a + 2 * kTileBytes, 64);
      _tile_loadd(5, a + 3 * kTileBytes, 64);
      POSENC_BF16_TERMS(0)
      if constexpr (S == Bf16Split::x6) {
        POSENC_BF16_TERMS(1)
        POSENC_BF16_TERMS(2)
      }
    }
#undef POSENC_BF16_TERMS
    job.slice(part0 + b, parts);
  }
  _tile_stored(0, ct, 64);
  _tile_stored(2, ct + 512, 64);
  if constexpr (Two) {
    _tile_stored(1, ct + 256, 64);
    _tile_stored(3, ct + 768, 64);
  }
}

/// C (16 outputs x 16 rows of x, float32) transposed into y rows [0, rows) and columns [0, cols).
POSENC_TARGET_AMXBF16 void write_tile(const float* c, float* y, int64_t ldy, int rows, int cols, Epilogue e) {
  __m512i r[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_load_si512(c + 16 * i);
  transpose16(r);
  const __mmask16 m = static_cast<__mmask16>((1u << cols) - 1u);
  for (int i = 0; i < rows; ++i) {
    float* yr = y + i * ldy;
    __m512 v = _mm512_castsi512_ps(r[i]);
    if (e == Epilogue::swiglu) {
      alignas(64) float h3[16];
      _mm512_store_ps(h3, v);
      swiglu_serial(yr, h3, cols);
      continue;
    }
    if (e == Epilogue::accumulate) v = _mm512_add_ps(_mm512_maskz_loadu_ps(m, yr), v);
    _mm512_mask_storeu_ps(yr, m, v);
  }
}

// ---- Decode: one tile of x (n <= 16) ------------------------------------------------------------------------
// A decode streams each weight once: it is bound by reading and widening the rows, not by the tiles (with the
// widening left out, the tiles alone ran at 22-31 GB/s of F16 weights on one core; the widening alone at 6-8).
// Here a thread's rows go 64 at a time (four panels, so that each x tile loaded serves four products), each k
// block of the 64 rows widened and split into an L1 buffer while the tiles run on the block before (a slice of the
// rows after each group of four products), and each row prefetched kDecodeAhead blocks ahead (the next group's
// rows near the end of a row) in runs of kDecodeBurst lines. Against the former decode (four panels too, in chunks
// of 8 blocks: 2 x 64 KiB of A tiles, past L1, and each row prefetched one chunk ahead): 1.1-1.2x on one thread.
// Measured and not kept: the 64 rows as 64 runs of consecutive rows read side by side (as the AVX-512 decode's
// 16 streams; slower at 64), and one panel of 16 rows at a time, its rows read from end to end (0.7x). A C row
// depends only on its own A row, and each output's products are summed in tile_chunk's order: prefill's bits.

constexpr int kDecodePanels = 4;
constexpr int64_t kDecodeRows = kDecodePanels * kTile;
constexpr int64_t kDecodeAhead = 8;  ///< k blocks (of 64 bytes of F16/BF16 per row) a row is prefetched ahead
constexpr int64_t kDecodeBurst = 4;  ///< lines per prefetch run (measured 1, 4, 8, 16: 4)

/// Rows [o0 + j0, o0 + j1) (of the group of 64 at o0; those at or past r1 zero), k block kb, as A tiles at dst:
/// [w term][panel][16 rows][32 bf16], row j at j * 64; and the line kDecodeAhead blocks later in the order the
/// blocks are taken prefetched.
POSENC_TARGET_AMXBF16 void pack_w_rows(const RawMatrix& w, int64_t o0, int64_t r1, int64_t kb, int j0, int j1,
                                       std::byte* dst) {
  const int64_t in = w.cols, rb = w.row_bytes(), k0 = kb * kK, kblocks = (in + kK - 1) / kK;
  const bool f16 = w.type == WeightType::f16;
  const __mmask32 m = k0 + 32 <= in ? 0xFFFFFFFFu : static_cast<__mmask32>((1u << (in - k0)) - 1u);
  // The block kDecodeAhead on: this row's, or the next group's row's.
  const bool wraps = kb + kDecodeAhead >= kblocks;
  const int64_t pkb = wraps ? kb + kDecodeAhead - kblocks : kb + kDecodeAhead, po0 = wraps ? o0 + kDecodeRows : o0;
  const bool prefetch = pkb % kDecodeBurst == 0 && pkb < kblocks;
  constexpr int64_t kTermBytes = kDecodePanels * kTileBytes;
  for (int j = j0; j < j1; ++j) {
    std::byte* a = dst + j * 64;
    if (prefetch && po0 + j < r1)
      for (int64_t l = 0; l < kDecodeBurst && pkb + l < kblocks; ++l)
        _mm_prefetch(reinterpret_cast<const char*>(w.data + (po0 + j) * rb + (pkb + l) * kK * 2), _MM_HINT_T0);
    if (o0 + j >= r1) {
      _mm512_store_si512(a, _mm512_setzero_si512());
      if (f16) _mm512_store_si512(a + kTermBytes, _mm512_setzero_si512());
      continue;
    }
    split_w_block(w.data + (o0 + j) * rb + k0 * 2, m, f16, a, kTermBytes);
  }
}

/// Rows [r0, r1) of y[n, out] (n <= 16) from the one x tile xb ([k block][x term][1 KiB]).
template <Bf16Split S>
POSENC_TARGET_AMXBF16 void decode_rows(const std::byte* xb, int64_t n, const RawMatrix& w, float* y, Epilogue e,
                                       int64_t r0, int64_t r1) {
  if (r0 >= r1) return;
  const int nw = w.type == WeightType::f16 ? 2 : 1, nx = S == Bf16Split::x6 ? 3 : 2;
  const int64_t kblocks = (w.cols + kK - 1) / kK, out = w.rows;
  // The (w term, x term) products of a block in tile_chunk's order.
  int wt[6], xt[6], terms = 0;
  for (int a = 0; a < nw; ++a)
    for (int b = 0; b < nx; ++b)
      if (S == Bf16Split::x6 || a + b < 2) {
        wt[terms] = a;
        xt[terms++] = b;
      }
  alignas(64) std::byte buf[2][2 * kDecodePanels * kTileBytes];
  alignas(64) float ct[kDecodePanels * 256];
  pack_w_rows(w, r0, r1, 0, 0, static_cast<int>(kDecodeRows), buf[0]);
  int cur = 0;
  for (int64_t o0 = r0; o0 < r1; o0 += kDecodeRows) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t kb = 0; kb < kblocks; ++kb) {
      // The block packed meanwhile: the next of these rows, or the first of the next group's.
      const int64_t no0 = kb + 1 < kblocks ? o0 : o0 + kDecodeRows, nkb = kb + 1 < kblocks ? kb + 1 : 0;
      const std::byte* a = buf[cur];
      const std::byte* xk = xb + kb * nx * kTileBytes;
      for (int s = 0; s < terms; ++s) {
        const std::byte* at = a + wt[s] * kDecodePanels * kTileBytes;
        _tile_loadd(6, xk + xt[s] * kTileBytes, 64);
        _tile_loadd(4, at, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_loadd(5, at + kTileBytes, 64);
        _tile_dpbf16ps(1, 5, 6);
        _tile_loadd(4, at + 2 * kTileBytes, 64);
        _tile_dpbf16ps(2, 4, 6);
        _tile_loadd(5, at + 3 * kTileBytes, 64);
        _tile_dpbf16ps(3, 5, 6);
        if (no0 < r1)
          pack_w_rows(w, no0, r1, nkb, static_cast<int>(kDecodeRows * s / terms),
                      static_cast<int>(kDecodeRows * (s + 1) / terms), buf[cur ^ 1]);
      }
      cur ^= 1;
    }
    _tile_stored(0, ct, 64);
    _tile_stored(1, ct + 256, 64);
    _tile_stored(2, ct + 512, 64);
    _tile_stored(3, ct + 768, 64);
    // C of panel q, row i (weight row o0 + 16 q + i), column r (row r of x): ct[(16 q + i) * 16 + r].
    const int64_t count = std::min(kDecodeRows, r1 - o0);
    for (int64_t r = 0; r < n; ++r) {
      float* yr = y + r * out + o0;
      alignas(64) float h3[kDecodeRows];
      for (int64_t j = 0; j < count; ++j) {
        const float v = ct[j * 16 + r];
        if (e == Epilogue::store)
          yr[j] = v;
        else if (e == Epilogue::accumulate)
          yr[j] += v;
        else
          h3[j] = v;
      }
      if (e == Epilogue::swiglu) swiglu_serial(yr, h3, count);  // element by element: write_tile's bits
    }
  }
}

/// Memory for a call's x tiles: this thread's grow-only buffer when they fit in kKeptXBytes (a decode's: a fresh
/// allocation per call is mmap'd past glibc's threshold and page-faulted in again, 114 faults per product by rows
/// of 4864 weights: page faults were 6-11% of a BM_MatmulDecode profile), else `own` (a long prompt's, freed
/// after the call). At most 8 MiB kept per thread.
constexpr std::size_t kKeptXBytes = std::size_t{8} << 20;
std::byte* x_tiles_buffer(std::size_t bytes, std::unique_ptr<std::byte[], FreeDeleter>& own) {
  if (bytes > kKeptXBytes) {
    own = aligned_uninitialized<std::byte>(bytes);
    return own.get();
  }
  thread_local std::unique_ptr<std::byte[], FreeDeleter> kept;
  thread_local std::size_t capacity = 0;
  if (bytes > capacity) {
    kept = aligned_uninitialized<std::byte>(bytes);
    capacity = bytes;
  }
  return kept.get();
}

template <Bf16Split S>
void matmul_amx_bf16(const float* x, int64_t n, const RawMatrix& w, float* y, Epilogue e) {
  const int64_t in = w.cols, out = w.rows;
  const int nw = w.type == WeightType::f16 ? 2 : 1, nx = S == Bf16Split::x6 ? 3 : 2;
  const int64_t kblocks = (in + kK - 1) / kK, tiles = (n + kTile - 1) / kTile;
  // x as B tiles, [tile][k block][x term][1 KiB], once per call.
  const int64_t tile_bytes = kblocks * nx * kTileBytes;
  std::unique_ptr<std::byte[], FreeDeleter> xb_own;
  std::byte* const xb = x_tiles_buffer(static_cast<std::size_t>(tiles * tile_bytes), xb_own);
#pragma omp parallel for schedule(static) collapse(2) if (n * in >= (int64_t{1} << 16))
  for (int64_t t = 0; t < tiles; ++t)
    for (int64_t kb = 0; kb < kblocks; ++kb) pack_x_block(x, n, in, t, kb, nx, xb + t * tile_bytes + kb * nx * kTileBytes);
  if (tiles == 1) {  // decode: threads as the other kernels' (a 1024 x 1024 matrix is 2 MiB of F16 streamed once)
#pragma omp parallel if (parallel_pays(n, w))
    {
      amx_bf16_begin();
      const int64_t nt = omp_get_num_threads(), me = omp_get_thread_num();
      decode_rows<S>(xb, n, w, y, e, out * me / nt, out * (me + 1) / nt);
      amx_bf16_end();
    }
    return;
  }
  const bool parallel = n * in * out > (int64_t{1} << 20);
  // Panels two at a time against pairs of x tiles.
  constexpr int g = 2;
  const int64_t groups = (out + g * kTile - 1) / (g * kTile);
  const int64_t threads = region_threads(parallel);
  const int64_t groups_per_thread = (groups + threads - 1) / threads;
  // Blocking. The x tiles of a block, over the k blocks of a super-chunk, are read from L2 by every panel group's
  // tiles: at most 1 MiB of them. When a block of all k fits (every tile, or enough tiles), one pass of the panel
  // groups does the block and the C tiles of one group at a time are kept (ct). Otherwise (rows of 4864 weights:
  // 456 KiB of bf16x6 terms per tile, so blocks of 2 tiles, and every panel was widened again for each of 8 blocks:
  // 168 GFLOP/s against 270 on rows of 1024) k is split into super-chunks and the C tiles of all the thread's
  // groups are kept between them (at most 4 MiB: tiles per block bounded by that), so that each panel is widened
  // once per block of tiles.
  constexpr int64_t kXBlockBytes = int64_t{1} << 20, kCtBytes = int64_t{4} << 20;
  const int64_t tile_cap = std::max<int64_t>(1, kXBlockBytes / tile_bytes);
  int64_t block_tiles = tiles, kc = kblocks;
  if (tile_cap < tiles) {
    const int64_t ct_per_tile = kTile * groups_per_thread * g * kTile * 4;
    block_tiles = std::clamp<int64_t>(kCtBytes / ct_per_tile, 1, tiles);
    kc = std::max<int64_t>(kChunk, kXBlockBytes / (block_tiles * nx * kTileBytes) / kChunk * kChunk);
    if (kc >= kblocks) {  // the ct budget leaves blocks small enough for all of k after all
      kc = kblocks;
      block_tiles = tile_cap;
    }
  }
  const bool persist = kc < kblocks;  // C kept across super-chunks for every group of the thread
  const BalancedBlocks tile_blocks(tiles, block_tiles, 1, persist ? 0 : block_tiles / 4);
  const int64_t slots = (tile_blocks.max_size() + 1) / 2 * 1024;  // floats of C per group: 4 tiles per pair of x tiles
  detail::FirstException error;  // std::bad_alloc of a thread's buffers, rethrown after the region
#pragma omp parallel if (parallel)
  {
    amx_bf16_begin();
    error.run([&] {
      const int64_t nt = omp_get_num_threads(), me = omp_get_thread_num();
      const int64_t p0 = groups * me / nt, p1 = groups * (me + 1) / nt;
      const int64_t wa_bytes = kChunk * nw * g * kTileBytes;
      const auto wa = aligned_uninitialized<std::byte>(static_cast<std::size_t>(2 * wa_bytes));
      const auto ct =
          aligned_uninitialized<float>(static_cast<std::size_t>((persist ? std::max<int64_t>(1, p1 - p0) : 1) * slots));
      // C of group p into y, tiles [t0, t1) of the block.
      auto write_group = [&](int64_t p, const float* cg, int64_t t0, int64_t t1) {
        const int64_t o0 = p * g * kTile;
        for (int64_t t = t0; t < t1; ++t) {
          const int rows = static_cast<int>(std::min<int64_t>(kTile, n - t * kTile));
          // The pair (t, t + 1) from an even offset holds [C(p0, t0), C(p0, t1), C(p1, t0), C(p1, t1)].
          const int64_t pair_base = (t - t0) / 2 * 2, which = (t - t0) % 2;
          for (int q = 0; q < g; ++q) {
            const int64_t oq = o0 + q * kTile;
            if (oq >= out) break;
            const int cols = static_cast<int>(std::min<int64_t>(kTile, out - oq));
            const float* c = cg + pair_base * 512 + q * 512 + which * 256;
            write_tile(c, y + t * kTile * out + oq, out, rows, cols, e);
          }
        }
      };
      // This thread's chunks in order (tile block, super-chunk, group, chunk of k), each packed while the tiles of the
      // one before it run (two buffers, taking turns).
      struct Step {
        int64_t bi, p, kb0, kb1;
        bool group_end, block_end;
      };
      std::vector<Step> steps;
      for (int64_t bi = 0; bi < tile_blocks.count; ++bi)
        for (int64_t ks0 = 0; ks0 < kblocks; ks0 += kc) {
          const int64_t ks1 = std::min(kblocks, ks0 + kc);
          for (int64_t p = p0; p < p1; ++p)
            for (int64_t kb0 = ks0; kb0 < ks1; kb0 += kChunk) {
              const int64_t kb1 = std::min(ks1, kb0 + kChunk);
              steps.push_back({bi, p, kb0, kb1, kb1 == ks1, ks1 == kblocks && p == p1 - 1 && kb1 == ks1});
            }
        }
      auto job_of = [&](std::size_t j) {
        PackJob job;
        if (j < steps.size()) {
          job.w = &w;
          job.o0 = steps[j].p * g * kTile;
          job.kb0 = steps[j].kb0;
          job.kb1 = steps[j].kb1;
          job.panels = g;
          job.nw = nw;
          job.dst = wa.get() + static_cast<int64_t>(j % 2) * wa_bytes;
        }
        return job;
      };
      if (!steps.empty()) job_of(0).run();
      for (std::size_t j = 0; j < steps.size(); ++j) {
        const Step& st = steps[j];
        const int64_t t0 = tile_blocks.begin(st.bi), t1 = tile_blocks.begin(st.bi + 1);
        const std::byte* a = wa.get() + static_cast<int64_t>(j % 2) * wa_bytes;
        const PackJob next = job_of(j + 1);
        float* cg = ct.get() + (persist ? (st.p - p0) * slots : 0);
        const int64_t calls = (t1 - t0 + 1) / 2, blocks = st.kb1 - st.kb0;
        for (int64_t t = t0; t < t1; t += 2) {
          const std::byte* x0 = xb + t * tile_bytes + st.kb0 * nx * kTileBytes;
          float* c = cg + (t - t0) * 512;
          const int64_t part0 = (t - t0) / 2 * blocks, parts = calls * blocks;
          if (t + 1 < t1)
            tile_chunk<true, S>(a, x0, x0 + tile_bytes, blocks, nw, nx, st.kb0 == 0, c, next, part0, parts);
          else
            tile_chunk<false, S>(a, x0, x0, blocks, nw, nx, st.kb0 == 0, c, next, part0, parts);
        }
        if (!persist && st.group_end) write_group(st.p, cg, t0, t1);
        if (persist && st.block_end)
          for (int64_t p = p0; p < p1; ++p) write_group(p, ct.get() + (p - p0) * slots, t0, t1);
      }
    });
    amx_bf16_end();
  }
  error.rethrow();
}

void check_args(const RawMatrix& w, const char* who) {
  if (w.type != WeightType::f16 && w.type != WeightType::bf16)
    throw std::logic_error(std::string(who) + ": F16 or BF16 weights only");
  if (!amx_bf16_supported()) throw std::logic_error(std::string(who) + ": this CPU has no AMX-BF16");
}

void dispatch(Bf16Split s, const float* x, int64_t n, const RawMatrix& w, float* y, Epilogue e) {
  if (n <= 0 || w.rows <= 0) return;
  if (w.cols <= 0) {  // empty sums: every product is 0 (no tiles: their blocking divides by the row's size)
    const std::vector<float> zeros(static_cast<std::size_t>(w.rows), 0.0f);
    for (int64_t r = 0; r < n; ++r) {
      float* yr = y + r * w.rows;
      if (e == Epilogue::store)
        std::fill(yr, yr + w.rows, 0.0f);
      else if (e == Epilogue::accumulate)
        for (int64_t o = 0; o < w.rows; ++o) yr[o] += 0.0f;
      else
        swiglu_serial(yr, zeros.data(), w.rows);
    }
    return;
  }
  if (s == Bf16Split::x6)
    matmul_amx_bf16<Bf16Split::x6>(x, n, w, y, e);
  else
    matmul_amx_bf16<Bf16Split::x3>(x, n, w, y, e);
}

}  // namespace

bool amx_bf16_supported() {
  static const bool ok = dense_kernel() != DenseKernel::reference && cpu_has_amx_bf16();
  return ok;
}

void matmul_bf16_split(Bf16Split s, const float* x, int64_t n, const RawMatrix& w, float* y, bool accumulate) {
  check_args(w, "matmul_bf16_split");
  dispatch(s, x, n, w, y, accumulate ? Epilogue::accumulate : Epilogue::store);
}

void matmul_bf16_split_swiglu(Bf16Split s, const float* x, int64_t n, const RawMatrix& w, float* h1) {
  check_args(w, "matmul_bf16_split_swiglu");
  swiglu_uses_avx512();  // its first call allocates: outside the regions whose tile epilogues ask it
  dispatch(s, x, n, w, h1, Epilogue::swiglu);
}

}  // namespace posenc::detail
