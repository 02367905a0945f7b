// The products with weights as stored (kernels_dense.hpp): for every dtype the
// AVX2 and AVX-512 paths give the scalar reference's bits on awkward shapes (rows not a
// multiple of 16, weight rows not a multiple of the tiles, 1..9 rows of x and prefill's blocks,
// accumulating or not, one thread or two); the reference itself is within the
// stated float32 bound of a double-precision dot product of the same widened
// weights, and its widened weights are ggml's dequantized values.
#include <omp.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <tuple>

#include <gtest/gtest.h>

#include "model/kernels.hpp"
#include "model/kernels_dense.hpp"
#include "posenc/float16.hpp"
#include "posenc/gguf.hpp"
#include "stored_matrix.hpp"

namespace POSENC_UNITY_ID {  // this file's own namespace in the tests' unity build (CMakeLists.txt)

using namespace posenc;
using namespace posenc::detail;
using posenc::test::randn;
using posenc::test::StoredMatrix;

namespace {

const WeightType kTypes[] = {WeightType::f32, WeightType::f16, WeightType::bf16, WeightType::q8_0, WeightType::q4_0};

bool quantized(WeightType t) { return t == WeightType::q8_0 || t == WeightType::q4_0; }

/// Path k against the scalar reference on one shape, y (+)= x W^T both without and with accumulating onto
/// the same random y: the same bits, or a failure naming the shape.
::testing::AssertionResult path_equals_reference(DenseKernel k, WeightType t, int64_t n, int64_t out, int64_t in,
                                                 uint32_t w_seed, uint32_t x_seed, uint32_t y_seed) {
  const StoredMatrix w(t, out, in, w_seed);
  const auto x = randn(static_cast<std::size_t>(n * in), x_seed, 1.0f);
  for (bool acc : {false, true}) {
    const auto y0 = randn(static_cast<std::size_t>(n * out), y_seed, 1.0f);
    std::vector<float> fast = y0, ref = y0;
    matmul_w_with(k, x.data(), n, w.m, fast.data(), acc);
    matmul_w_reference(x.data(), n, w.m, ref.data(), acc);
    if (std::memcmp(fast.data(), ref.data(), fast.size() * sizeof(float)) != 0)
      return ::testing::AssertionFailure() << to_string(t) << " n " << n << " out " << out << " in " << in
                                           << " accumulate " << acc;
  }
  return ::testing::AssertionSuccess();
}

}  // namespace

class KernelsDensePath : public ::testing::TestWithParam<DenseKernel> {};

TEST_P(KernelsDensePath, EqualsTheReferenceBitForBitOnAwkwardShapes) {
  const DenseKernel k = GetParam();
  if (!dense_kernel_supported(k)) GTEST_SKIP() << "this CPU cannot run the " << to_string(k) << " path";
  int cases = 0;
  for (WeightType t : kTypes) {
    const std::vector<int64_t> ins = quantized(t) ? std::vector<int64_t>{32, 96, 160, 1056}
                                                  : std::vector<int64_t>{1, 7, 15, 16, 17, 32, 33, 48, 100, 1029, 1040};
    for (int64_t in : ins)
      for (int64_t out : {1, 3, 4, 5, 13, 37})  // 37: AVX-512 decode's two runs of 16 rows and 5 rows left over
        for (int64_t n : {1, 2, 3, 4, 5, 9}) {
          ASSERT_TRUE(path_equals_reference(k, t, n, out, in, static_cast<uint32_t>(in * 131 + out * 7 + n),
                                            static_cast<uint32_t>(n + 1000), 77));
          cases += 2;  // without and with accumulating
        }
  }
  EXPECT_EQ(cases, 3 * 11 * 6 * 6 * 2 + 2 * 4 * 6 * 6 * 2);
}

TEST_P(KernelsDensePath, EqualsTheReferenceBitForBitAcrossPrefillBlocks) {
  // Prefill shapes for the panel paths. AVX2: x rows past one block (at most 64 rows for rows of 1024 weights or
  // more, balanced: 133 rows are blocks of 44, 44 and 45, 200 rows 48, 52, 48 and 52, 400 rows seven of 56-60), rows
  // of 66 and 304 chunks (segments of 64 chunks and blocks of 32, the last partial), weight rows not a multiple of the
  // 3-row panel, x rows not a multiple of the tile, and products large enough for the parallel region (the threads
  // taking runs of panels in turn, each run across segments). AVX-512 (8-row panels, 3-row tiles, blocks of 64 chunks): rows of 66 and
  // 304 chunks (2 and 5 blocks of chunks, the last partial), x rows past a block of rows on a 2 MiB L2 (a cap of 255
  // rows plus 63 for rows of up to 64 chunks: 400 rows are blocks of 201 and 199; 126 plus 31 for longer ones: 200
  // rows are blocks of 99 and 101, 133 rows one block), weight rows not a multiple of 8 (a last panel of 4, 5 or 7),
  // x rows not a multiple of 3, and 200 x 300 x 1056 for two blocks of rows, each over runs of panels of at most a
  // group (10 panels at 34 tiles) that the threads take in turn. On AMD the budget is at least 2 MiB of rows
  // (x_block_budget_bytes: caps of 510 + 127 and 255 + 63 rows): 700 rows of 1024 weights are blocks of 351 and
  // 349 there (three blocks on a 2 MiB L2), 400 rows of 1056 blocks of 201 and 199.
  const DenseKernel k = GetParam();
  if (!dense_kernel_supported(k)) GTEST_SKIP() << "this CPU cannot run the " << to_string(k) << " path";
  for (WeightType t : kTypes)
    for (auto [n, out, in] : {std::tuple<int64_t, int64_t, int64_t>{67, 7, 1056}, {29, 5, 4864}, {8, 3, 1056}, {133, 20, 1056},
                                 {70, 7, 4864}, {133, 300, 1056}, {256, 13, 1024},
                                 {200, 20, 1056}, {400, 13, 1024}, {200, 300, 1056}, {700, 13, 1024},
                                 {400, 13, 1056}})
      ASSERT_TRUE(path_equals_reference(k, t, n, out, in, static_cast<uint32_t>(in + out + n),
                                        static_cast<uint32_t>(n + 2000), 78));
}

// Non-finite values take the reference's path through every kernel: NaN and inf in x, in F32/F16/BF16 weights and
// in Q8_0/Q4_0 block scales, for decode (one row; 20 weight rows on two threads: fewer than 16 a thread, the plain
// tiles), small batches and prefill panels. NaN payloads are not part of the contract (F16C quiets them).
TEST_P(KernelsDensePath, NonFiniteValuesGiveTheReferenceBits) {
  const DenseKernel k = GetParam();
  if (!dense_kernel_supported(k)) GTEST_SKIP() << "this CPU cannot run the " << to_string(k) << " path";
  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  for (WeightType t : kTypes)
    for (auto [n, out, in] : {std::tuple<int64_t, int64_t, int64_t>{1, 37, 64}, {1, 20, 16384}, {3, 37, 1040},
                              {40, 37, 1056}}) {
      if (quantized(t) && in % 32 != 0) continue;
      StoredMatrix w(t, out, in, static_cast<uint32_t>(in + out));
      auto x = randn(static_cast<std::size_t>(n * in), static_cast<uint32_t>(n + 5), 1.0f);
      x[static_cast<std::size_t>(in / 3)] = nan;  // row 0
      if (n > 2) x[static_cast<std::size_t>(2 * in + 5)] = inf;
      // Weights: row 3 gets a NaN, row 5 an inf (as stored values, or as block scales).
      auto poke = [&](int64_t row, float v) {
        std::byte* r = w.bytes.data() + row * w.m.row_bytes();
        if (t == WeightType::f32) {
          std::memcpy(r + 4 * 7, &v, 4);
        } else if (t == WeightType::f16 || t == WeightType::bf16) {
          const uint16_t h = t == WeightType::f16 ? f32_to_f16(v) : f32_to_bf16(v);
          std::memcpy(r + 2 * 7, &h, 2);
        } else {
          const uint16_t h = f32_to_f16(v);
          std::memcpy(r, &h, 2);  // the first block's scale
        }
      };
      poke(3, nan);
      poke(5, inf);
      std::vector<float> fast(static_cast<std::size_t>(n * out)), ref(fast.size());
      matmul_w_with(k, x.data(), n, w.m, fast.data(), false);
      matmul_w_reference(x.data(), n, w.m, ref.data(), false);
      int nonfinite = 0;
      for (std::size_t i = 0; i < ref.size(); ++i) {
        const bool both_nan = std::isnan(fast[i]) && std::isnan(ref[i]);
        ASSERT_TRUE(both_nan || std::memcmp(&fast[i], &ref[i], sizeof(float)) == 0)
            << to_string(t) << " n " << n << " out " << out << " in " << in << " element " << i << ": " << fast[i]
            << " vs " << ref[i];
        nonfinite += !std::isfinite(ref[i]);
      }
      EXPECT_GE(nonfinite, out + 2 * (n - 1)) << to_string(t);  // row 0 of x, weight rows 3 and 5 of the others
    }
}

// Every fp16 bit pattern as a Q8_0/Q4_0 block scale (65,536 blocks: 2,048 rows of 32 blocks, block i's scale the
// pattern i: ±0, the subnormals, every normal exponent, ±inf and the NaNs), in decode (one row of x, the AVX-512
// decode widens a normal scale by integer arithmetic, the others by vcvtph2ps) and in a small batch: the
// reference's bits, NaN against NaN.
TEST_P(KernelsDensePath, EveryFp16BlockScaleGivesTheReferenceBits) {
  const DenseKernel k = GetParam();
  if (!dense_kernel_supported(k)) GTEST_SKIP() << "this CPU cannot run the " << to_string(k) << " path";
  const int64_t out = 2048, in = 1024;
  for (WeightType t : {WeightType::q8_0, WeightType::q4_0}) {
    StoredMatrix w(t, out, in, 91);
    const int64_t block_bytes = t == WeightType::q8_0 ? 34 : 18;
    for (int64_t b = 0; b < out * in / 32; ++b) {
      const auto h = static_cast<uint16_t>(b);
      std::memcpy(w.bytes.data() + b * block_bytes, &h, 2);
    }
    for (int64_t n : {1, 2}) {
      const auto x = randn(static_cast<std::size_t>(n * in), static_cast<uint32_t>(n + 17), 1.0f);
      std::vector<float> fast(static_cast<std::size_t>(n * out)), ref(fast.size());
      matmul_w_with(k, x.data(), n, w.m, fast.data(), false);
      matmul_w_reference(x.data(), n, w.m, ref.data(), false);
      int finite = 0, subnormal_rows = 0;
      for (std::size_t i = 0; i < ref.size(); ++i) {
        const bool both_nan = std::isnan(fast[i]) && std::isnan(ref[i]);
        ASSERT_TRUE(both_nan || std::memcmp(&fast[i], &ref[i], sizeof(float)) == 0)
            << to_string(t) << " n " << n << " element " << i << " (scales 0x" << std::hex << (i % out) * 32
            << "-0x" << (i % out) * 32 + 31 << std::dec << "): " << fast[i] << " vs " << ref[i];
        finite += std::isfinite(ref[i]);
        subnormal_rows += (i % out) < 32 && ref[i] != 0.0f;  // rows of subnormal scales: small, not zero
      }
      // Rows 992-1023 and 2016-2047 hold the scales of exponent 31 (inf, NaN); the other 1,984 rows are finite.
      EXPECT_EQ(finite, n * (out - 64)) << to_string(t);
      EXPECT_GE(subnormal_rows, n * 31) << to_string(t);
    }
  }
}

// The rows above with an inf scale also hold NaN scales, so they are NaN whatever an inf becomes. Here each
// non-finite scale has a row to itself, its block's weights all +1 or all -1 and x positive: a +inf scale must give
// +inf, -inf must give -inf (with weights -1: +inf), a NaN scale NaN, in decode (64 rows: every row in a decode run
// on one or two threads) and in a batch of 2.
TEST_P(KernelsDensePath, AnInfOrNanBlockScaleAloneGivesTheReferenceBits) {
  const DenseKernel k = GetParam();
  if (!dense_kernel_supported(k)) GTEST_SKIP() << "this CPU cannot run the " << to_string(k) << " path";
  const int64_t out = 64, in = 1024;
  struct Case {
    int64_t row, block;
    uint16_t scale;
    int sign;  // the block's weights
    float expected;
  };
  const float inf = std::numeric_limits<float>::infinity();
  const Case cases[] = {{3, 5, 0x7c00, +1, inf},  {9, 0, 0xfc00, +1, -inf}, {17, 31, 0xfc00, -1, inf},
                        {40, 12, 0x7c00, -1, -inf}, {50, 7, 0x7e00, +1, std::numeric_limits<float>::quiet_NaN()}};
  for (WeightType t : {WeightType::q8_0, WeightType::q4_0}) {
    StoredMatrix w(t, out, in, 92);
    const int64_t block_bytes = t == WeightType::q8_0 ? 34 : 18;
    for (const Case& c : cases) {
      std::byte* blk = w.bytes.data() + c.row * w.m.row_bytes() + c.block * block_bytes;
      std::memcpy(blk, &c.scale, 2);
      // Q8_0: int8 +1 / -1; Q4_0: nibbles 9 / 7 (n - 8 = +1 / -1), both halves of each byte.
      const int q = t == WeightType::q8_0 ? (c.sign > 0 ? 0x01 : 0xff) : (c.sign > 0 ? 0x99 : 0x77);
      std::memset(blk + 2, q, static_cast<std::size_t>(block_bytes - 2));
    }
    for (int64_t n : {1, 2}) {
      auto x = randn(static_cast<std::size_t>(n * in), static_cast<uint32_t>(n + 31), 1.0f);
      for (float& v : x) v = std::fabs(v) + 0.25f;
      std::vector<float> fast(static_cast<std::size_t>(n * out)), ref(fast.size());
      matmul_w_with(k, x.data(), n, w.m, fast.data(), false);
      matmul_w_reference(x.data(), n, w.m, ref.data(), false);
      for (std::size_t i = 0; i < ref.size(); ++i) {
        const bool both_nan = std::isnan(fast[i]) && std::isnan(ref[i]);
        ASSERT_TRUE(both_nan || std::memcmp(&fast[i], &ref[i], sizeof(float)) == 0)
            << to_string(t) << " n " << n << " row " << i % out << ": " << fast[i] << " vs " << ref[i];
      }
      for (const Case& c : cases)
        for (int64_t r = 0; r < n; ++r) {
          const float v = ref[static_cast<std::size_t>(r * out + c.row)];
          if (std::isnan(c.expected))
            EXPECT_TRUE(std::isnan(v)) << to_string(t) << " row " << c.row;
          else
            EXPECT_EQ(v, c.expected) << to_string(t) << " row " << c.row;  // the case is what it claims to be
        }
      int finite = 0;
      for (float v : ref) finite += std::isfinite(v);
      EXPECT_EQ(finite, n * (out - 5)) << to_string(t);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Paths, KernelsDensePath, ::testing::Values(DenseKernel::avx2, DenseKernel::avx512),
                         [](const auto& info) { return std::string(to_string(info.param)); });

// Decode (one row of x) reads a thread's weight rows as runs side by side, as the CPU's DecodeStreams plan says
// (on Zen 4 4 runs, 256 bytes ahead for F16 and 512 for Q8_0; on other AMD CPUs 2 runs 4 KiB ahead for F16 and 4
// runs 3 KiB ahead for Q8_0; elsewhere 8 or 16 runs prefetched 1 KiB ahead), on the AVX-512 and the
// AVX2 paths alike: every plan gives the
// reference's bits, for every dtype, with rows that are not a multiple of the runs (left over rows one at a time),
// fewer rows than runs, rows of one chunk and long rows, prefetches past the matrix's end, on one and two threads;
// the plans differ only in speed. A plan that is not one throws, and POSENC_DECODE_STREAMS's forms parse to the
// plans they name.
TEST(KernelsDenseDecodePlans, EveryPlanGivesTheReferenceBits) {
  std::vector<DenseKernel> paths;
  for (DenseKernel k : {DenseKernel::avx2, DenseKernel::avx512})
    if (dense_kernel_supported(k)) paths.push_back(k);
  if (paths.empty()) GTEST_SKIP() << "this CPU runs neither the avx2 nor the avx512 path";
  const int before = omp_get_max_threads();
  int cases = 0;
  for (DenseKernel k : paths)
  for (int runs : {2, 4, 8, 16})
    for (int prefetch_bytes : {0, 64, 1024, 3072}) {
      const DecodeStreams plan{runs, prefetch_bytes};
      ASSERT_TRUE(decode_streams_valid(plan));
      for (WeightType t : kTypes)
        for (auto [out, in] : {std::pair<int64_t, int64_t>{1, 32}, {3, 64}, {17, 32}, {33, 1056}, {70, 160},
                               {127, 4896}, {600, 512}})
          for (int threads : {1, 2}) {
            omp_set_num_threads(threads);
            const StoredMatrix w(t, out, in, static_cast<uint32_t>(out * 7 + in));
            const auto x = randn(static_cast<std::size_t>(in), static_cast<uint32_t>(in + runs), 1.0f);
            for (bool acc : {false, true}) {
              const auto y0 = randn(static_cast<std::size_t>(out), static_cast<uint32_t>(out + 3), 1.0f);
              std::vector<float> fast = y0, ref = y0;
              matmul_w_with(k, plan, x.data(), 1, w.m, fast.data(), acc);
              matmul_w_reference(x.data(), 1, w.m, ref.data(), acc);
              ASSERT_EQ(std::memcmp(fast.data(), ref.data(), fast.size() * sizeof(float)), 0)
                  << to_string(k) << " " << to_string(plan) << " " << to_string(t) << " out " << out << " in " << in << " threads "
                  << threads << " accumulate " << acc;
              ++cases;
            }
          }
    }
  omp_set_num_threads(before);
  EXPECT_EQ(cases, static_cast<int>(paths.size()) * 16 * 5 * 7 * 2 * 2);
  const std::vector<float> x(32, 1.0f);
  std::vector<float> y(3);
  const StoredMatrix w(WeightType::f16, 3, 32, 1);
  for (DecodeStreams bad : {DecodeStreams{3, 0}, DecodeStreams{0, 1024}, DecodeStreams{32, 0}, DecodeStreams{4, 1},
                            DecodeStreams{4, 100}, DecodeStreams{4, -64}, DecodeStreams{4, 65600}}) {
    EXPECT_FALSE(decode_streams_valid(bad));
    for (DenseKernel k : paths)
      EXPECT_THROW(matmul_w_with(k, bad, x.data(), 1, w.m, y.data(), false), std::logic_error) << to_string(k);
  }
  // The message names both fields as given (a negative distance was printed as the valid plan "4").
  try {
    matmul_w_with(paths.front(), DecodeStreams{4, -64}, x.data(), 1, w.m, y.data(), false);
    ADD_FAILURE() << "no exception";
  } catch (const std::logic_error& e) {
    EXPECT_NE(std::string(e.what()).find("runs 4, prefetch_bytes -64 is not a decode plan"), std::string::npos)
        << e.what();
  }
  for (WeightType t : kTypes)
    for (DenseKernel k : {DenseKernel::avx2, DenseKernel::avx512})
      EXPECT_TRUE(decode_streams_valid(decode_streams(t, k))) << to_string(t) << " " << to_string(k);
  EXPECT_EQ(to_string(DecodeStreams{16, 1024}), "16:prefetch=1024");
  EXPECT_EQ(to_string(DecodeStreams{2, 0}), "2");
  const auto same = [](std::optional<DecodeStreams> a, DecodeStreams b) {
    return a && a->runs == b.runs && a->prefetch_bytes == b.prefetch_bytes;
  };
  EXPECT_TRUE(same(parse_decode_streams("2"), {2, 0}));
  EXPECT_TRUE(same(parse_decode_streams("16:prefetch"), {16, 1024}));
  EXPECT_TRUE(same(parse_decode_streams("4:prefetch=3072"), {4, 3072}));
  EXPECT_TRUE(same(parse_decode_streams("8:prefetch=65536"), {8, 65536}));
  for (const char* bad : {"", "3", "32", "-4", "+4", " 4", "4 ", "4:", "4:pre", "4:prefetch=", "4:prefetch=0",
                          "4:prefetch=100", "4:prefetch=65600", "4:prefetch=3072x", "4:prefetch=-64",
                          "4:prefetch=99999999999999999999", "4:prefetch:prefetch", "prefetch", "4:Prefetch", "04",
                          "016:prefetch=1024", "4:prefetch=03072", "4:prefetch=001024"})
    EXPECT_FALSE(parse_decode_streams(bad).has_value()) << "'" << bad << "'";
  for (WeightType t : kTypes)
    for (DenseKernel k : {DenseKernel::avx2, DenseKernel::avx512}) {
      const DecodeStreams d = decode_streams(t, k);
      EXPECT_TRUE(same(parse_decode_streams(to_string(d)), d)) << to_string(t);
    }
  // The benchmarks' override (BM_DecodePlans): every type takes it until it is lifted, then the CPU's plans again;
  // a plan that is not valid is refused and changes nothing.
  const DecodeStreams f16 = decode_streams(WeightType::f16, DenseKernel::avx512),
                      q8 = decode_streams(WeightType::q8_0, DenseKernel::avx512);
  EXPECT_THROW(set_decode_streams_for_benchmark(DecodeStreams{3, 0}), std::logic_error);
  EXPECT_TRUE(same(decode_streams(WeightType::f16, DenseKernel::avx512), f16));
  set_decode_streams_for_benchmark(DecodeStreams{16, 192});
  for (WeightType t : kTypes)
    EXPECT_TRUE(same(decode_streams(t, DenseKernel::avx2), {16, 192})) << to_string(t);
  set_decode_streams_for_benchmark(std::nullopt);
  EXPECT_TRUE(same(decode_streams(WeightType::f16, DenseKernel::avx512), f16));
  EXPECT_TRUE(same(decode_streams(WeightType::q8_0, DenseKernel::avx512), q8));
}

// The prefill paths' blocks of x rows (and AMX's blocks of tiles): they cover [0, n) in order, each a multiple of
// the tile but the last, none empty, none larger than max_size() nor than cap + slack (rounded up to the tile), sizes
// within two tiles of each other (no short remainder), and as few as the budget allows.
TEST(KernelsDense, BalancedBlocksCoverTheRowsWithoutAShortRemainder) {
  // AVX-512 (cap 255 rows for rows of 1024 weights, a quarter more allowed): a 256-token prompt is one block, not
  // 255 + 1; the down projection's (cap 126) two blocks of 129 and 127, not 126 + 126 + 4.
  EXPECT_EQ(BalancedBlocks(256, 255, 3, 63).count, 1);
  EXPECT_EQ(BalancedBlocks(318, 255, 3, 63).count, 1);
  EXPECT_EQ(BalancedBlocks(319, 255, 3, 63).count, 2);
  EXPECT_EQ(BalancedBlocks(382, 255, 3, 63).begin(1), 192);
  EXPECT_EQ(BalancedBlocks(256, 126, 3, 31).count, 2);
  EXPECT_EQ(BalancedBlocks(256, 126, 3, 31).begin(1), 129);
  // AMX: 16 tiles of a 256-row prompt on 4864-weight rows (cap 13 tiles) are one block, not 13 + 3.
  EXPECT_EQ(BalancedBlocks(16, 13, 1, 3).count, 1);
  // AVX2 (cap 64 rows, no slack): never more than 64 rows; 65 rows are 32 + 33, 133 rows 44 + 44 + 45.
  EXPECT_EQ(BalancedBlocks(64, 64, 4, 0).count, 1);
  EXPECT_EQ(BalancedBlocks(65, 64, 4, 0).begin(1), 32);
  const BalancedBlocks b133(133, 64, 4, 0);
  EXPECT_EQ(b133.count, 3);
  EXPECT_EQ(b133.begin(1), 44);
  EXPECT_EQ(b133.begin(2), 88);
  EXPECT_EQ(b133.max_size(), 48);
  int checked = 0;
  for (int64_t cap : {1, 2, 3, 16, 64, 126, 255, 1000})
    for (int64_t multiple : {1, 3, 4, 16})
      for (int64_t slack : {int64_t{0}, cap / 4, cap})
        for (int64_t n = 1; n <= 1200; n += 7) {
          const BalancedBlocks b(n, cap, multiple, slack);
          ASSERT_GE(b.count, 1);
          EXPECT_EQ(b.begin(0), 0);
          EXPECT_EQ(b.begin(b.count), n);
          int64_t lo = n, hi = 0;
          for (int64_t i = 0; i < b.count; ++i) {
            const int64_t size = b.begin(i + 1) - b.begin(i);
            ASSERT_GT(size, 0) << n << " " << cap << " " << multiple << " block " << i;
            ASSERT_LE(size, b.max_size());
            if (i + 1 < b.count) {
              EXPECT_EQ(size % multiple, 0);
            }
            lo = std::min(lo, size);
            hi = std::max(hi, size);
          }
          EXPECT_LT(hi - lo, 2 * multiple) << n << " " << cap << " " << multiple;
          const int64_t limit = (cap + slack + multiple - 1) / multiple * multiple;
          EXPECT_LE(b.max_size(), limit) << n << " " << cap << " " << multiple << " " << slack;
          if (slack == 0 && cap % multiple == 0) {
            EXPECT_LE(b.max_size(), cap) << n << " " << cap << " " << multiple;
          }
          // As few blocks as the budget allows: one block fewer would not hold n (or would be one per tile).
          if (b.count > 1 && b.count < (n + multiple - 1) / multiple) {
            EXPECT_LT((b.count - 1) * (cap + slack), n) << n << " " << cap << " " << multiple << " " << slack;
          }
          ++checked;
        }
  EXPECT_EQ(checked, 8 * 4 * 3 * 172);
}

TEST(KernelsDense, DispatchTakesTheWidestPathThisCpuRuns) {
  const DenseKernel want = dense_kernel_supported(DenseKernel::avx512) ? DenseKernel::avx512
                           : dense_kernel_supported(DenseKernel::avx2) ? DenseKernel::avx2
                                                                        : DenseKernel::reference;
  if (std::getenv("POSENC_DENSE_KERNEL") != nullptr) GTEST_SKIP() << "POSENC_DENSE_KERNEL is set";
  EXPECT_EQ(dense_kernel(), want) << to_string(dense_kernel());
  RecordProperty("dense_kernel", std::string(to_string(dense_kernel())));
}

TEST(KernelsDense, ThreadsAndBatchingDoNotChangeABit) {
  // A product big enough for the parallel region (1024 x 1024 weights), run with one, two and three threads (the
  // panels' runs go to whichever thread asks first: more threads than cores interleave them differently each
  // time), and each row of x alone: the same bits (decode == prefill, a batch == its rows).
  for (WeightType t : {WeightType::f16, WeightType::q4_0}) {
    const int64_t out = 1024 + 3, in = 1024, n = 6;
    const StoredMatrix w(t, out, in, 5);
    const auto x = randn(static_cast<std::size_t>(n * in), 6, 1.0f);
    std::vector<float> one(static_cast<std::size_t>(n * out)), more(one.size()), rows(one.size());
    const int before = omp_get_max_threads();
    omp_set_num_threads(1);
    matmul_w(x.data(), n, w.m, one.data(), false);
    for (DenseKernel k : {DenseKernel::avx2, DenseKernel::avx512})
      for (int threads : {1, 2, 3}) {
        if (!dense_kernel_supported(k)) continue;
        omp_set_num_threads(threads);
        std::fill(more.begin(), more.end(), std::nanf(""));
        matmul_w_with(k, x.data(), n, w.m, more.data(), false);
        EXPECT_EQ(std::memcmp(one.data(), more.data(), one.size() * sizeof(float)), 0)
            << to_string(t) << " " << to_string(k) << " threads " << threads;
      }
    for (int64_t r = 0; r < n; ++r) matmul_w(x.data() + r * in, 1, w.m, rows.data() + r * out, false);
    omp_set_num_threads(before);
    EXPECT_EQ(std::memcmp(one.data(), rows.data(), one.size() * sizeof(float)), 0) << to_string(t);
  }
}

TEST(KernelsDense, ReferenceIsWithinTheFloat32BoundOfAnExactDot) {
  // The widened weights are the stored values exactly (RawMatrix::row_to_f32: ggml's dequantization), and the
  // 16-lane float32 sum is within (ceil(in / 16) + 5) * 2^-24 * sum |x_i w_i| of the double-precision dot.
  for (WeightType t : kTypes) {
    const int64_t out = 9, in = quantized(t) ? 4096 : 4099, n = 3;
    const StoredMatrix w(t, out, in, 11);
    const auto x = randn(static_cast<std::size_t>(n * in), 12, 1.0f);
    std::vector<float> y(static_cast<std::size_t>(n * out));
    matmul_w_reference(x.data(), n, w.m, y.data(), false);
    const std::vector<float> wf = w.m.to_f32();
    const double u = std::ldexp(1.0, -24), lanes = std::ceil(static_cast<double>(in) / 16.0);
    double worst = 0.0;
    for (int64_t r = 0; r < n; ++r)
      for (int64_t o = 0; o < out; ++o) {
        double exact = 0.0, mag = 0.0;
        for (int64_t i = 0; i < in; ++i) {
          const double p = static_cast<double>(x[static_cast<std::size_t>(r * in + i)]) *
                           wf[static_cast<std::size_t>(o * in + i)];
          exact += p;
          mag += std::fabs(p);
        }
        const double err = std::fabs(y[static_cast<std::size_t>(r * out + o)] - exact);
        EXPECT_LE(err, (lanes + 5) * u * mag) << to_string(t) << " row " << r << " out " << o;
        worst = std::max(worst, err / mag);
      }
    EXPECT_GT(worst, 0.0) << "float32 rounding must show somewhere: the test would not see a float64 path";
  }
}

TEST(KernelsDense, WidenedWeightsAreGgmlsDequantizedValues) {
  // Q8_0: d * q; Q4_0: d * (nibble - 8); F16/BF16: IEEE widening. A product with a one-hot x reads one weight.
  for (WeightType t : kTypes) {
    const int64_t out = 5, in = 64;
    const StoredMatrix w(t, out, in, 21);
    const std::vector<float> wf = w.m.to_f32();
    for (int64_t i : {0, 1, 15, 16, 31, 32, 47, 63}) {
      std::vector<float> x(static_cast<std::size_t>(in), 0.0f), y(static_cast<std::size_t>(out));
      x[static_cast<std::size_t>(i)] = 1.0f;
      matmul_w(x.data(), 1, w.m, y.data(), false);
      for (int64_t o = 0; o < out; ++o)
        EXPECT_EQ(y[static_cast<std::size_t>(o)], wf[static_cast<std::size_t>(o * in + i)])
            << to_string(t) << " [" << o << ", " << i << "]";
    }
  }
}

}  // namespace POSENC_UNITY_ID
