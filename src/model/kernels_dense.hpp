// Internal: products with a weight matrix read as it is stored (F32, F16, BF16,
// Q8_0, Q4_0, row-major [out, in] as nn.Linear and GGUF keep it), for the
// model runtime's projections. No copy, no transposition, no float32 expansion:
// each weight is widened to float32 in registers as it is read.
#pragma once

#include <xmmintrin.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "model/raw_model.hpp"

namespace posenc::detail {

/// The arithmetic of every path below, the same for each output y[r, o] and
/// independent of n, of the row's place in a tile and of the thread count (so
/// that decode equals prefill and a batch equals its rows run alone, bit for bit):
///  - w_i is the stored weight widened exactly to float32 (F16/BF16 by IEEE
///    widening, Q8_0/Q4_0 as d * q, which float32 holds exactly: ggml's
///    dequantize_row_q8_0 / q4_0 values);
///  - 16 lanes: lane k accumulates acc_k = fma(x_i, w_i, acc_k) over the i = 16c + k
///    in ascending c, starting from +0 (a chunk past the row's end contributes fma(0, 0, acc_k));
///  - the lanes are summed as a fixed tree: a_k + a_{k+8} (k < 8), then + 4 apart,
///    then + 2 apart, then the last two;
///  - y = that sum, or y + that sum when accumulating.
/// The float32 sum differs from a sequential one (HF's, for instance) in the
/// last bits only: for a row of `in` terms its error is at most about
/// (in / 16 + 4) * 2^-24 * sum_i |x_i w_i|.

/// Which implementation matmul_w runs on this CPU.
enum class DenseKernel {
  reference,  ///< the scalar loops of matmul_w_reference (any x86-64)
  avx2,       ///< AVX2 + FMA + F16C: two 8-lane halves per accumulator, tiles of 2 x rows by 3 weight rows;
              ///< for n >= 4 rows of a multiple of 16 (prefill), 3-row weight panels widened once per block of
              ///< up to 64 x rows (per 1024-weight segment) and tiles of 4 x rows by 3, one half of the lanes per
              ///< pass
  avx512,     ///< AVX-512 F/BW/VL + F16C: 16-lane accumulators, tiles of 4 x rows by 4 weight rows; for rows
              ///< of a multiple of 16: one row of x (decode) against runs of a thread's weight rows read side
              ///< by side (decode_streams(w.type, k)), and for n >= 6 (prefill) 8-row weight panels widened once per block of x rows (about
              ///< the rows that fill half of the L2, on AMD at least 2 MiB of them, the blocks balanced) and tiles of 3 x rows by 8
};
std::string_view to_string(DenseKernel k);
/// Whether this CPU runs path k (cpuid, through __builtin_cpu_supports).
bool dense_kernel_supported(DenseKernel k);
/// The path matmul_w dispatches to, chosen once: the widest this CPU supports
/// (avx512, then avx2, then reference). The environment variable
/// POSENC_DENSE_KERNEL=reference|avx2|avx512 asks for a path; one this CPU
/// lacks (or an unknown name) is reported on stderr once and the widest
/// supported path runs instead.
DenseKernel dense_kernel();

/// How the AVX-512 path reads a matrix for one row of x (decode, memory-bound): each thread's rows as `runs` runs
/// of consecutive rows read side by side (one accumulator per run), each run's lines software-prefetched (prefetcht0)
/// `prefetch_bytes` ahead, or not at all when 0. Which is fastest depends on the hardware prefetchers and, for
/// Q8_0/Q4_0, on the instructions per byte. Measured (BM_MatmulDecode and BM_RealDecode on the 487M model, one
/// thread): a Sapphire Rapids-class core read F16 at 12.9 GB/s as 4 adjacent rows, 14.5 as 16 runs prefetched 1 KiB
/// ahead (of a 14.1 GB/s DRAM read rate), and on a later such Xeon (480 MiB of L3) the model's F16 decode ran at
/// 17.3-17.7 tokens/s as 8 runs against 14.5-15.1 as 16 (33.0-33.7 against 31.7-32.1 at two threads), Q8_0 alike at
/// one thread and 3-6% slower as 8 runs at two; a Zen 5 core reads F16 best as 2 runs prefetched 4 KiB ahead and
/// Q8_0 as 4 runs prefetched 3 KiB ahead (the model's Q8_0 decode 69.5 tokens/s with 8 runs 1 KiB ahead, 81 with
/// 4 runs 3 KiB ahead; kernels_dense.cpp gives the figures). The plan changes no bit: each
/// output's lanes take the same fmas in the same order whatever run it is in.
struct DecodeStreams {
  int runs = 16;              ///< 2, 4, 8 or 16
  int prefetch_bytes = 1024;  ///< 0 (no software prefetch) or a multiple of 64 in [64, 65536]
};
/// "16:prefetch=1024", "2", ... (the form POSENC_DECODE_STREAMS takes).
std::string to_string(DecodeStreams s);
/// "runs R, prefetch_bytes P is not a decode plan (...the rule...)": the message for a plan that is not valid.
std::string describe_invalid(DecodeStreams s);
bool decode_streams_valid(DecodeStreams s);
/// The plan a POSENC_DECODE_STREAMS value names: "R" (no software prefetch), "R:prefetch" (1 KiB ahead) or
/// "R:prefetch=BYTES", R one of 2, 4, 8, 16, numbers without a leading zero; nullopt for anything else (not a
/// valid plan included).
std::optional<DecodeStreams> parse_decode_streams(std::string_view text);
/// The plan path k (avx512 or avx2; the VNNI/AMX decodes take avx512's) uses to decode weights of type t, from the
/// CPU vendor (cpuid leaf 0) and family (leaf 1): on AMD Zen 4 (family 25 with AVX-512) {4, 256 bytes} for
/// F32/F16/BF16 and {4, 512 bytes} for Q8_0/Q4_0 (measured with BM_DecodePlans, the plans taking a decode's tokens
/// in turn, two at a time, in one process; bench/decode_plans_raw/zen4; the 487M models, tokens/s at one thread /
/// two, two runs: F16 26.97 and 23.70 / 44.69 and 40.22
/// against 22.34 and 19.57 / 36.51 and 32.07 in Zen 5's {2, 4 KiB}; Q8_0 34.25 and 33.64 / 60.33 and 61.72 against
/// 33.23 and 33.19 / 57.13 and 60.36 in {4, 3 KiB}; q8_activations 43.36 and 40.99 / 50.72 and 56.16 against 40.41
/// and 35.11 / 45.82 and 51.57; 8 or 16 runs, or prefetches 1 KiB or more ahead, slower; the AVX2 path alike: F16
/// 28.95 against 24.74, Q8_0 32.56 against 31.57 at one thread); on other AMD CPUs (Zen 5, and the unmeasured Zen
/// 3 and older) {2, 4 KiB} for F32/F16/BF16 and {4, 3 KiB} for Q8_0/Q4_0; on any other CPU {8, 1 KiB} for
/// F32/F16/BF16 and, for Q8_0/Q4_0, {16, 1 KiB} in AVX-512 and {8, 1 KiB} in AVX2
/// (measured on Sapphire Rapids-class Xeons, the AVX2 decode of a haswell build, 487M models, two alternations: Q8_0
/// 30.4-31.2 tokens/s as 8 runs against 27.9-28.7 as 16 at one thread, 59.0 against 55.3-57.3 at two; Q4_0
/// 28.5 against 25.5-26.1 and 52.2-55.0 against 46.4-49.8; F16 as 4 runs 3 KiB ahead 16.3-16.5 against 15.9-16.0
/// as 8, alike at two threads: kept; on Zen 5 the AVX2 decode reads best with AMD's plans too: the 487M F16 model at
/// one thread 44.0 tokens/s, against 34.5-39.7 in the other plans). The
/// environment variable POSENC_DECODE_STREAMS (parse_decode_streams's forms) asks for one plan for every type;
/// anything else is reported on stderr once (when a decode first asks: the float32 products' avx512 and avx2 paths
/// and the q8_activations avx512_vnni/amx paths take the plan, the others have none) and the CPU's plans run.
DecodeStreams decode_streams(WeightType t, DenseKernel k);
/// Makes decode_streams return `plan` for every type from now on (std::nullopt: the plans above again), for
/// benchmarks that alternate plans, a few tokens each, in one process (BM_DecodePlans): the host's read rate moves
/// within minutes, so plans measured in separate runs could not be told apart. Takes effect at the next product;
/// not for use while another thread decodes. Throws std::logic_error for a plan that is not decode_streams_valid.
void set_decode_streams_for_benchmark(std::optional<DecodeStreams> plan);

/// y[n, w.rows] (+)= x[n, w.cols] · W^T, W as stored (any WeightType; Q8_0/Q4_0
/// need w.cols % 32 == 0, as their blocks do). x, y row-major float32 with row
/// strides w.cols and w.rows; y must not alias x. Runs the dense_kernel()
/// path, in parallel over blocks of weight rows (OpenMP) when the product is
/// large enough to pay for a parallel region; the result does not depend on
/// the path or the thread count (bit for bit).
void matmul_w(const float* x, int64_t n, const RawMatrix& w, float* y, bool accumulate);

/// The same arithmetic in plain scalar C++ (one thread): the reference the
/// SIMD paths are tested against, and the path on CPUs without AVX2.
void matmul_w_reference(const float* x, int64_t n, const RawMatrix& w, float* y, bool accumulate);

/// matmul_w through path k (tests and benchmarks compare the paths). Throws
/// std::logic_error when this CPU cannot run k.
void matmul_w_with(DenseKernel k, const float* x, int64_t n, const RawMatrix& w, float* y, bool accumulate);

/// matmul_w_with through decode plan `plan` (for the avx512 and avx2 paths; the reference ignores it). Throws
/// std::logic_error when this CPU cannot run k or the plan is not one of decode_streams_valid's.
void matmul_w_with(DenseKernel k, DecodeStreams plan, const float* x, int64_t n, const RawMatrix& w, float* y,
                   bool accumulate);

/// Whether a product of n rows of x by w is big enough for threads (kernels_dense.cpp says why).
bool parallel_pays(int64_t n, const RawMatrix& w);

/// Whether matmul_w_decode_rows runs w on this CPU: the avx512 or avx2 path (dense_kernel()) and w.cols a positive
/// multiple of 16 (the one-row product matmul_w's decode runs).
bool decode_rows_supported(const RawMatrix& w);

/// The rows [first, last) of matmul_w(x, 1, w, y, accumulate), on the calling thread: y[r] (+)= x[w.cols] · W[r]^T,
/// read as decode_streams(w.type, dense_kernel()) says (its runs within these rows); each output the same bits as matmul_w's.
/// For a team the caller keeps (its own parallel region): threads given disjoint ranges may run at once, and
/// nothing is synchronised (the caller's barrier is, before y is read). Throws std::logic_error when
/// !decode_rows_supported(w) or the range is not one of w's rows (0 <= first <= last <= w.rows).
void matmul_w_decode_rows(const float* x, const RawMatrix& w, float* y, bool accumulate, int64_t first, int64_t last);

/// n items (rows or tiles of x) taken a block at a time, when `cap` of them fill the cache budget and a block may
/// hold `slack` more: ceil(n / (cap + slack)) blocks (at least one) whose sizes are multiples of `multiple` (the
/// kernel's tile; the last block takes what is left) and differ by at most one multiple (two for the last), so that
/// no block is a short remainder that costs a whole pass over the weights. With blocks of cap, a 256-token prompt
/// against a cap of 255 rows made a block of one row, which widened every weight of the matrix a second time for it
/// (the down projection's 126 + 126 + 4 rows, AMX's 13 + 3 tiles; measured: the 487M model's F16 prefill 3-9% and
/// its Q8_0 q8_activations prefill 2.5-6% faster balanced). No block holds more than cap + slack items rounded up
/// to the multiple; with no slack and cap a multiple, none more than cap. Block i is [begin(i), begin(i + 1)),
/// i < count. n, cap, multiple > 0, slack >= 0.
struct BalancedBlocks {
  int64_t n, multiple, units, count;
  constexpr BalancedBlocks(int64_t n_, int64_t cap, int64_t multiple_, int64_t slack)
      : n(n_), multiple(multiple_), units((n_ + multiple_ - 1) / multiple_),
        count(std::max<int64_t>(1, std::min((n_ + cap + slack - 1) / (cap + slack), units))) {}
  constexpr int64_t begin(int64_t i) const { return std::min(n, i * units / count * multiple); }
  /// No block is larger: ceil(units / count) multiples.
  constexpr int64_t max_size() const { return (units + count - 1) / count * multiple; }
};

/// prefetcht0 of the line `ahead` bytes past p, which may lie past the end of the matrix (a prefetch does not
/// fault): the address is formed as an integer, not by pointer arithmetic past the array. The decode loops' one
/// prefetch (the AVX-512 and AVX2 float32 products, the VNNI Q4_0 tile).
inline void prefetch_ahead(const std::byte* p, int64_t ahead) {
  _mm_prefetch(reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(p) + static_cast<uintptr_t>(ahead)),
               _MM_HINT_T0);
}

/// The threads of an OpenMP region that runs when `parallel` (1 when it runs serially): region_thread_count() or 1.
int64_t region_threads(bool parallel);

/// How many consecutive panels a work item of a prefill product holds when the items go to whichever thread asks
/// next: about an eighth of a thread's share of `panels` (a run long enough that the next panel's prefetch goes on
/// as in a static share; short enough that a slower thread leaves little for the others to wait on), at least 1
/// and at most `cap`. `threads` is the region's thread count (1 when it runs serially). The F32/F16/BF16 panels
/// (PanelItems in kernels_dense.cpp) and the VNNI panels of q8_activations (kernels_q8.cpp) share this rule.
constexpr int64_t panels_per_item(int64_t panels, int64_t cap, int64_t threads) {
  return std::clamp<int64_t>(panels / (std::max<int64_t>(threads, 1) * 8), 1, std::max<int64_t>(cap, 1));
}

/// The 64-byte operand of ldtilecfg (palette 1): per tile register, its rows and bytes per row (the AMX-INT8 and
/// AMX-BF16 kernels configure their 8 tiles with it).
struct alignas(64) AmxTileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

/// Slice `part` of `parts` equal slices of the bytes [p, p + bytes) prefetched towards L2, one prefetcht1 per
/// cache line (the slices together touch each line once). A prefill kernel spreads the next panel's weights over
/// the tiles it runs on the current one, so that they arrive from DRAM while the tiles compute instead of
/// stalling the next panel's repacking (measured on the 487M Q8_0 model, one thread: 9% of a q8_activations prefill
/// was the AMX repacking waiting on its loads). 0 <= part < parts.
inline void prefetch_l2_part(const std::byte* p, int64_t bytes, int64_t part, int64_t parts) {
  const int64_t lines = (bytes + 63) / 64;
  for (int64_t l = lines * part / parts, end = lines * (part + 1) / parts; l < end; ++l)
    __builtin_prefetch(p + l * 64, 0, 2);
}

/// Slice `part` of `parts` of [p, p + bytes), itself prefetched a sub-slice at a time: issue(i, count) takes the
/// i-th of count, so that a tile's loop spreads its prefetches over its iterations (a burst of them stalled on the
/// line fill buffers: measured, 8% of an AMX prefill's samples on the burst's prefetcht1).
struct PrefetchSlice {
  const std::byte* p;
  int64_t bytes, part, parts;
  void issue(int64_t i, int64_t count) const {
    prefetch_l2_part(p, bytes, part * count + i, parts * count);
  }
};

}  // namespace posenc::detail
