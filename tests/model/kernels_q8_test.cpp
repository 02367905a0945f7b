// The quantized products: every SIMD path (AVX2, AVX-512 VNNI, AMX) gives the
// scalar reference kernel's bits on awkward shapes, at the int8 extremes and
// for any thread count or batch, and the reference kernel is the exact block
// arithmetic (int8 dot products, fma over blocks in order).
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>

#include <omp.h>

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

namespace {

std::vector<std::byte> quantized(const std::vector<float>& x, int64_t n, int64_t in) {
  std::vector<std::byte> xq(static_cast<std::size_t>(n * (in / 32) * kQ8Bytes));
  quantize_rows_q8_0(x.data(), n, in, xq.data());
  return xq;
}

/// Equal bits, or both NaN (the payload of a NaN is not part of the arithmetic's contract).
bool same(float a, float b) {
  return (std::isnan(a) && std::isnan(b)) || std::memcmp(&a, &b, sizeof a) == 0;
}

}  // namespace

TEST(KernelsQ8, ReferenceIsExactBlockArithmetic) {
  const int64_t out = 3, in = 64;
  const auto w = randn(static_cast<std::size_t>(out * in), 1, 0.1f), x = randn(static_cast<std::size_t>(in), 2, 1.0f);
  const auto wq = ggml_quantize(GgmlType::q8_0, w);
  std::vector<std::byte> xq(static_cast<std::size_t>(in / 32 * kQ8Bytes));
  quantize_rows_q8_0(x.data(), 1, in, xq.data());
  std::vector<float> y(out);
  matmul_q8_reference(xq.data(), 1, in, wq.data(), false, out, y.data(), false);
  // By hand: per block, the int32 dot product times d_w * d_x, accumulated with fma.
  std::vector<float> wd(static_cast<std::size_t>(out * in)), xd(static_cast<std::size_t>(in));
  ggml_dequantize(GgmlType::q8_0, wq, wd);
  ggml_dequantize(GgmlType::q8_0, xq, xd);
  for (int64_t o = 0; o < out; ++o) {
    float acc = 0.0f;
    for (int64_t b = 0; b < in / 32; ++b) {
      int32_t isum = 0;
      const auto* qw = reinterpret_cast<const int8_t*>(wq.data() + (o * (in / 32) + b) * kQ8Bytes + 2);
      const auto* qx = reinterpret_cast<const int8_t*>(xq.data() + b * kQ8Bytes + 2);
      for (int j = 0; j < 32; ++j) isum += qw[j] * qx[j];
      // d_w * d_x from the dequantized values: x = d * q for any q != 0.
      float dw = 0, dx = 0;
      for (int j = 0; j < 32; ++j)
        if (qw[j] != 0) dw = wd[static_cast<std::size_t>(o * in + b * 32 + j)] / static_cast<float>(qw[j]);
      for (int j = 0; j < 32; ++j)
        if (qx[j] != 0) dx = xd[static_cast<std::size_t>(b * 32 + j)] / static_cast<float>(qx[j]);
      acc = std::fma(static_cast<float>(isum), dw * dx, acc);
    }
    EXPECT_EQ(y[static_cast<std::size_t>(o)], acc) << o;
  }
}

// Activation quantization as ggml-cpu's x86 quantize_row_q8_0: scale amax/127
// rounded to fp16, multiplier 127/amax (not 1/d), ties to even.
TEST(KernelsQ8, ActivationQuantizationRoundsTiesToEven) {
  std::vector<float> x(32, 0.0f);
  x[0] = 127.0f;  // amax = 127: d = 1, multiplier 1
  x[1] = 2.5f;    // tie: to even 2 (roundf would give 3)
  x[2] = -3.5f;   // tie: to even -4
  x[3] = 1.4999f;
  std::vector<std::byte> q(kQ8Bytes);
  quantize_rows_q8_0(x.data(), 1, 32, q.data());
  const auto* qs = reinterpret_cast<const int8_t*>(q.data() + 2);
  EXPECT_EQ(qs[0], 127);
  EXPECT_EQ(qs[1], 2);
  EXPECT_EQ(qs[2], -4);
  EXPECT_EQ(qs[3], 1);
  uint16_t h;
  std::memcpy(&h, q.data(), 2);
  EXPECT_EQ(h, 0x3C00);  // fp16 1.0
}

// The AVX-512 activation quantizer gives the scalar one's bytes: random rows of several scales, exact ties
// (x * 127 / amax = k + 0.5), zeros, subnormals, all-zero blocks, and blocks with inf, -inf or NaN.
TEST(KernelsQ8, QuantizerGivesTheReferenceBytes) {
  const int64_t n = 41, in = 2048;  // 84K elements: the AVX-512 quantizer's rows shared by the threads
  auto x = randn(static_cast<std::size_t>(n * in), 17, 1.0f);
  for (int64_t r = 0; r < n; ++r)
    for (int64_t j = 0; j < in; ++j) x[static_cast<std::size_t>(r * in + j)] *= std::ldexp(1.0f, static_cast<int>(r % 9) * 8 - 40);
  for (int j = 0; j < 32; ++j) {
    x[static_cast<std::size_t>(1 * in + j)] = j == 0 ? 127.0f : static_cast<float>(j % 7) + 0.5f;  // ties
    x[static_cast<std::size_t>(2 * in + j)] = 0.0f;
    x[static_cast<std::size_t>(3 * in + j)] = std::numeric_limits<float>::denorm_min() * static_cast<float>(j);
  }
  x[static_cast<std::size_t>(4 * in + 5)] = std::numeric_limits<float>::infinity();
  x[static_cast<std::size_t>(5 * in + 40)] = -std::numeric_limits<float>::infinity();
  x[static_cast<std::size_t>(6 * in + 70)] = std::numeric_limits<float>::quiet_NaN();
  x[static_cast<std::size_t>(7 * in + 100)] = -std::numeric_limits<float>::quiet_NaN();
  x[static_cast<std::size_t>(7 * in + 101)] = std::numeric_limits<float>::infinity();
  std::vector<std::byte> a(static_cast<std::size_t>(n * (in / 32) * kQ8Bytes)), b(a.size(), std::byte{0x55});
  quantize_rows_q8_0_reference(x.data(), n, in, a.data());
  quantize_rows_q8_0(x.data(), n, in, b.data());
  for (std::size_t i = 0; i < a.size(); ++i)
    ASSERT_EQ(a[i], b[i]) << "byte " << i << " (row " << i / (in / 32 * kQ8Bytes) << ")";
}

// Every SIMD path reads the blocks where they lie and must give the reference's bits on every shape that exercises
// its edges, accumulating or not. AVX2: tiles of 4 rows x 2 weight rows, 1 x 8 for the rows left over, the
// reference for the weight rows no tile takes. AVX-512 VNNI: one row against 16 runs of weight rows per thread
// (2048 rows: 64 rows per run on two threads; 17, 26: a run of 1 and rows left over), panels of 16 weight rows
// for 2 or more (the last panel partial: 1..15 rows). AMX: 16 rows of x or more in tiles of 16 (17, 33: a partial
// last tile padded with zero rows), below that the VNNI path.
class KernelsQ8Path : public ::testing::TestWithParam<Q8Kernel> {};

TEST_P(KernelsQ8Path, GivesTheReferenceBits) {
  const Q8Kernel k = GetParam();
  if (!q8_kernel_supported(k)) GTEST_SKIP() << "this CPU cannot run the " << to_string(k) << " path";
  int checked = 0;
  for (bool q4 : {false, true})
    for (int64_t out : {1, 2, 3, 7, 8, 9, 15, 16, 17, 26, 2048})
      for (int64_t in : {32, 96, 160, 384})  // 1, 3, 5, 12 blocks: AMX's pipeline of 4-block groups, partial or not
        for (int64_t n : {1, 2, 3, 4, 5, 7, 8, 9, 13, 16, 17, 33}) {
          const auto w = randn(static_cast<std::size_t>(out * in), static_cast<uint32_t>(out * 7 + in), 0.05f);
          const auto wq = ggml_quantize(q4 ? GgmlType::q4_0 : GgmlType::q8_0, w);
          const auto xq = quantized(randn(static_cast<std::size_t>(n * in), static_cast<uint32_t>(n + 99), 2.0f), n, in);
          for (bool acc : {false, true}) {
            std::vector<float> a(static_cast<std::size_t>(n * out), 0.5f), b = a;
            matmul_q8_reference(xq.data(), n, in, wq.data(), q4, out, a.data(), acc);
            matmul_q8_with(k, xq.data(), n, in, wq.data(), q4, out, b.data(), acc);
            ASSERT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0)
                << to_string(k) << " q4 " << q4 << " out " << out << " in " << in << " n " << n << " acc " << acc;
            ++checked;
          }
        }
  EXPECT_EQ(checked, 2 * 11 * 4 * 12 * 2);
}

// The extremes of the int8 arithmetic: weights of -128 (a Q8_0 file may hold them; ggml's quantizer does not
// write them) against activations of +-127 give the largest pair sums _mm256_maddubs_epi16 sees (2 * 128 * 127,
// below its int16 saturation) and the largest |w| VNNI's unsigned operand takes (|-128| = 128), and a block whose
// activations overflowed carries a NaN/inf scale. 5 rows (VNNI panels, AVX2 tiles), 1 row (decode) and 18 rows
// (AMX).
TEST_P(KernelsQ8Path, ExtremesAndNonFinite) {
  const Q8Kernel k = GetParam();
  if (!q8_kernel_supported(k)) GTEST_SKIP() << "this CPU cannot run the " << to_string(k) << " path";
  const int64_t out = 16, in = 64, n = 18;
  std::vector<std::byte> wq(static_cast<std::size_t>(out * (in / 32) * kQ8Bytes));
  for (int64_t blk = 0; blk < out * (in / 32); ++blk) {
    std::byte* p = wq.data() + blk * kQ8Bytes;
    const uint16_t d = 0x3C00;  // 1.0
    std::memcpy(p, &d, 2);
    for (int j = 0; j < 32; ++j) p[2 + j] = static_cast<std::byte>(j % 3 == 0 ? 0x80 : (blk + j) % 2 ? 0x7F : 0x81);
  }
  // Weight row 9's second block has a NaN scale, row 11's an infinite one.
  const uint16_t nan_h = 0x7E00, inf_h = 0x7C00;
  std::memcpy(wq.data() + (9 * (in / 32) + 1) * kQ8Bytes, &nan_h, 2);
  std::memcpy(wq.data() + (11 * (in / 32) + 1) * kQ8Bytes, &inf_h, 2);
  std::vector<float> x(static_cast<std::size_t>(n * in));
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = (i % 5 == 0) ? -1.0f : 1.0f;  // quantizes to +-127
  x[2 * in + 40] = std::numeric_limits<float>::infinity();
  x[3 * in + 3] = std::numeric_limits<float>::quiet_NaN();
  const auto xq = quantized(x, n, in);
  for (int64_t rows : {int64_t{5}, int64_t{1}, n}) {
    std::vector<float> a(static_cast<std::size_t>(rows * out)), b(a.size());
    matmul_q8_reference(xq.data(), rows, in, wq.data(), false, out, a.data(), false);
    matmul_q8_with(k, xq.data(), rows, in, wq.data(), false, out, b.data(), false);
    int nonfinite = 0;
    for (std::size_t i = 0; i < a.size(); ++i) {
      EXPECT_TRUE(same(a[i], b[i])) << rows << " rows, " << i << ": " << a[i] << " vs " << b[i];
      nonfinite += !std::isfinite(a[i]);
    }
    // Rows 2 and 3 of x, and weight rows 9 and 11 of the others.
    EXPECT_EQ(nonfinite, rows > 3 ? 2 * out + 2 * (rows - 2) : 2 * rows) << rows;
    // Row 0, weight row 0, by hand: the exact int32 block sums (every pair +-127 * -128 or +-127 * +-127), each
    // times d_w * d_x = 1 * fp16(1/127), fma'd over the two blocks.
    const float dx = f16_to_f32(f32_to_f16(1.0f / 127.0f));
    float expect = 0.0f;
    for (int blk = 0; blk < in / 32; ++blk) {
      int32_t isum = 0;
      for (int kk = 0; kk < 32; ++kk) {
        const int j = blk * 32 + kk;
        const int wv = kk % 3 == 0 ? -128 : (blk + kk) % 2 ? 127 : -127;
        isum += wv * (j % 5 == 0 ? -127 : 127);
      }
      expect = std::fma(static_cast<float>(isum), dx, expect);
    }
    EXPECT_EQ(b[0], expect) << rows;
  }
}

// Q4_0 at its extremes: nibbles 0 and 15 (weights -8 and 7) against activations of +-127, on every path, 5 rows
// (VNNI panels, AVX2 tiles), 1 row (decode) and 18 rows (AMX); checked by hand for one output as well.
TEST_P(KernelsQ8Path, Q4ExtremesGiveTheReferenceBits) {
  const Q8Kernel k = GetParam();
  if (!q8_kernel_supported(k)) GTEST_SKIP() << "this CPU cannot run the " << to_string(k) << " path";
  const int64_t out = 19, in = 96, n = 18;
  std::vector<std::byte> wq(static_cast<std::size_t>(out * (in / 32) * kQ4Bytes));
  for (int64_t blk = 0; blk < out * (in / 32); ++blk) {
    std::byte* p = wq.data() + blk * kQ4Bytes;
    const uint16_t d = 0x3C00;  // 1.0
    std::memcpy(p, &d, 2);
    // Byte j: weight j in the low nibble, weight 16 + j in the high one.
    for (int j = 0; j < 16; ++j) p[2 + j] = static_cast<std::byte>((j + blk) % 3 == 0 ? 0xF0 : (j + blk) % 3 == 1 ? 0x0F : 0x00);
  }
  std::vector<float> x(static_cast<std::size_t>(n * in));
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = (i % 7 < 3) ? -1.0f : 1.0f;  // quantizes to +-127
  const auto xq = quantized(x, n, in);
  const auto weight = [&](int64_t row, int64_t col) {  // the Q4_0 value, by hand
    const int64_t blk = row * (in / 32) + col / 32, j = col % 32;
    const auto byte = static_cast<uint8_t>(wq[static_cast<std::size_t>(blk * kQ4Bytes + 2 + j % 16)]);
    return (j < 16 ? byte & 0x0F : byte >> 4) - 8;
  };
  for (int64_t rows : {int64_t{5}, int64_t{1}, n}) {
    std::vector<float> a(static_cast<std::size_t>(rows * out)), b(a.size());
    matmul_q8_reference(xq.data(), rows, in, wq.data(), true, out, a.data(), false);
    matmul_q8_with(k, xq.data(), rows, in, wq.data(), true, out, b.data(), false);
    EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0) << to_string(k) << " " << rows << " rows";
    const float dx = f16_to_f32(f32_to_f16(1.0f / 127.0f));
    float expect = 0.0f;  // x row 0 by weight row 4
    for (int64_t blk = 0; blk < in / 32; ++blk) {
      int32_t isum = 0;
      for (int64_t j = blk * 32; j < blk * 32 + 32; ++j) isum += weight(4, j) * (j % 7 < 3 ? -127 : 127);
      expect = std::fma(static_cast<float>(isum), dx, expect);
    }
    EXPECT_EQ(b[4], expect) << to_string(k) << " " << rows << " rows";
  }
}

// The same bits whatever the thread count, and a row alone (decode's kernels) gives what it gives in a batch
// (the tiles, panels or AMX tiles): the batch invariance the runtime's decode = prefill rests on.
TEST_P(KernelsQ8Path, ThreadAndBatchInvariant) {
  const Q8Kernel k = GetParam();
  if (!q8_kernel_supported(k)) GTEST_SKIP() << "this CPU cannot run the " << to_string(k) << " path";
  const int64_t out = 1032, in = 1024, n = 20;
  for (bool q4 : {false, true}) {
    const auto wq = ggml_quantize(q4 ? GgmlType::q4_0 : GgmlType::q8_0, randn(static_cast<std::size_t>(out * in), 5, 0.05f));
    const auto xq = quantized(randn(static_cast<std::size_t>(n * in), 6, 1.0f), n, in);
    std::vector<float> one(static_cast<std::size_t>(n * out)), two(one.size()), alone(one.size());
    const int threads = omp_get_max_threads();
    omp_set_num_threads(1);
    matmul_q8_with(k, xq.data(), n, in, wq.data(), q4, out, one.data(), false);
    for (int more : {2, 3}) {  // the VNNI panels' runs go to whichever thread asks first
      omp_set_num_threads(more);
      std::fill(two.begin(), two.end(), std::nanf(""));
      matmul_q8_with(k, xq.data(), n, in, wq.data(), q4, out, two.data(), false);
      EXPECT_EQ(std::memcmp(one.data(), two.data(), one.size() * sizeof(float)), 0) << q4 << " threads " << more;
    }
    for (int64_t r = 0; r < n; ++r)
      matmul_q8_with(k, xq.data() + r * (in / 32) * kQ8Bytes, 1, in, wq.data(), q4, out, alone.data() + r * out, false);
    omp_set_num_threads(threads);
    EXPECT_EQ(std::memcmp(one.data(), alone.data(), one.size() * sizeof(float)), 0) << q4;
  }
}

// Shapes of real size: AMX with more tiles of x than one block of them holds (4864-weight rows: a block holds 13
// tiles of 16 rows; 256 rows of x are 16 tiles, one balanced block; 410 rows are 26 tiles, the last of 10 rows, in two
// blocks of 13, each panel repacked per block), and decode on two threads with fewer than 16 weight rows each
// (the rows left over go one at a time) and with runs of 16.
TEST_P(KernelsQ8Path, RealSizeShapesGiveTheReferenceBits) {
  const Q8Kernel k = GetParam();
  if (!q8_kernel_supported(k)) GTEST_SKIP() << "this CPU cannot run the " << to_string(k) << " path";
  for (auto [n, out, in] : {std::tuple<int64_t, int64_t, int64_t>{256, 17, 4864}, {410, 17, 4864}, {1, 20, 16384},
                                 {1, 70, 4096}}) {
    const auto wq = ggml_quantize(GgmlType::q8_0, randn(static_cast<std::size_t>(out * in), static_cast<uint32_t>(out), 0.05f));
    const auto xq = quantized(randn(static_cast<std::size_t>(n * in), static_cast<uint32_t>(n), 1.0f), n, in);
    std::vector<float> a(static_cast<std::size_t>(n * out)), b(a.size());
    matmul_q8_reference(xq.data(), n, in, wq.data(), false, out, a.data(), false);
    const int threads = omp_get_max_threads();
    omp_set_num_threads(2);
    matmul_q8_with(k, xq.data(), n, in, wq.data(), false, out, b.data(), false);
    omp_set_num_threads(threads);
    EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0) << n << " x " << out << " x " << in;
  }
}

// matmul_q8_swiglu: h1 = silu(h1) * (x W^T) with the bits of the product stored and swiglu run on it (AMX applies
// it in each tile's epilogue; the other paths run the two steps). Gate values across expf's special range (|h1| >=
// 88, where the vector expf hands the lane to libm), zeros, infinities and a NaN; tiles partial in rows (17, 33)
// and columns (1, 15, 17, 40), 1..5 blocks, on one and two threads.
TEST_P(KernelsQ8Path, SwigluEpilogueGivesTheUnfusedBits) {
  const Q8Kernel k = GetParam();
  if (!q8_kernel_supported(k)) GTEST_SKIP() << "this CPU cannot run the " << to_string(k) << " path";
  int checked = 0;
  const int threads = omp_get_max_threads();
  for (bool q4 : {false, true})
    for (auto [n, out, in] : {std::tuple<int64_t, int64_t, int64_t>{1, 17, 64}, {5, 40, 160}, {16, 16, 32},
                              {17, 1, 96}, {33, 15, 160}, {33, 40, 64}, {256, 48, 1024}, {40, 17, 4864}}) {
      const auto wq = ggml_quantize(q4 ? GgmlType::q4_0 : GgmlType::q8_0,
                                    randn(static_cast<std::size_t>(out * in), static_cast<uint32_t>(out + in), 0.05f));
      const auto xq = quantized(randn(static_cast<std::size_t>(n * in), static_cast<uint32_t>(n * 3), 1.5f), n, in);
      auto gate = randn(static_cast<std::size_t>(n * out), static_cast<uint32_t>(n + out), 30.0f);
      gate[0] = 0.0f;
      if (gate.size() > 3) {
        gate[1] = std::numeric_limits<float>::infinity();
        gate[2] = -std::numeric_limits<float>::infinity();
        gate[3] = std::numeric_limits<float>::quiet_NaN();
      }
      std::vector<float> h3(gate.size()), want = gate;
      matmul_q8_reference(xq.data(), n, in, wq.data(), q4, out, h3.data(), false);
      swiglu_reference(want.data(), h3.data(), static_cast<int64_t>(want.size()));
      int big = 0;
      for (float g : gate) big += std::fabs(g) >= 88.0f;
      if (gate.size() >= 100) {
        EXPECT_GT(big, 0) << "no gate value in expf's special range";
      }
      for (int t : {1, 2}) {
        omp_set_num_threads(t);
        std::vector<float> got = gate, scratch(got.size());
        matmul_q8_swiglu_with(k, xq.data(), n, in, wq.data(), q4, out, got.data(), scratch.data());
        for (std::size_t i = 0; i < got.size(); ++i)
          ASSERT_TRUE(same(want[i], got[i])) << to_string(k) << " q4 " << q4 << " " << n << " x " << out << " x " << in
                                             << ", " << t << " threads, element " << i << ": " << got[i] << " vs "
                                             << want[i];
        ++checked;
      }
    }
  omp_set_num_threads(threads);
  EXPECT_EQ(checked, 2 * 8 * 2);
}

INSTANTIATE_TEST_SUITE_P(Paths, KernelsQ8Path, ::testing::Values(Q8Kernel::avx2, Q8Kernel::avx512_vnni, Q8Kernel::amx),
                         [](const auto& info) { return std::string(to_string(info.param)); });

TEST(KernelsQ8, DispatchTakesTheWidestPathThisCpuRuns) {
  if (std::getenv("POSENC_Q8_KERNEL") != nullptr || std::getenv("POSENC_DENSE_KERNEL") != nullptr)
    GTEST_SKIP() << "POSENC_Q8_KERNEL or POSENC_DENSE_KERNEL is set";
  Q8Kernel want = Q8Kernel::reference;
  for (Q8Kernel k : {Q8Kernel::avx2, Q8Kernel::avx512_vnni, Q8Kernel::amx})
    if (q8_kernel_supported(k)) want = k;
  EXPECT_EQ(q8_kernel(), want) << to_string(q8_kernel());
  RecordProperty("q8_kernel", std::string(to_string(q8_kernel())));
}

// Decode on the VNNI path reads the weights as the dtype's DecodeStreams plan says (kernels_dense.hpp): R runs of
// rows side by side, 16 / R blocks reduced at once, the last step partial when the blocks are not a multiple of
// 16 / R (1, 3, 5, 7, 9 and 33 blocks), rows not a multiple of R (left over rows one at a time), fewer rows than
// runs, prefetches past the matrix's end, Q8_0 and Q4_0, one and two threads, accumulate or not: the reference's
// bits in every plan, with x scales of every magnitude (rows scaled by 1e-3 .. 1e3) and weights at the int8 extremes.
TEST(KernelsQ8DecodePlans, EveryPlanGivesTheReferenceBits) {
  if (!q8_kernel_supported(Q8Kernel::avx512_vnni)) GTEST_SKIP() << "this CPU cannot run the avx512_vnni path";
  const int before = omp_get_max_threads();
  int cases = 0;
  for (int runs : {2, 4, 8, 16})
    for (int prefetch_bytes : {0, 64, 3072}) {
      const DecodeStreams plan{runs, prefetch_bytes};
      for (bool q4 : {false, true})
        for (auto [out, in] : {std::pair<int64_t, int64_t>{1, 32}, {3, 96}, {17, 160}, {33, 224}, {70, 288},
                               {127, 1056}, {600, 256}})
          for (int threads : {1, 2}) {
            omp_set_num_threads(threads);
            auto wf = randn(static_cast<std::size_t>(out * in), static_cast<uint32_t>(out * 7 + in), 0.05f);
            for (std::size_t i = 0; i < wf.size(); i += 37) wf[i] = i % 2 ? 10.0f : -10.0f;  // int8 extremes
            auto wq = ggml_quantize(q4 ? GgmlType::q4_0 : GgmlType::q8_0, wf);
            if (!q4)  // -128, which a Q8_0 file may hold and ggml's quantizer does not write
              for (std::size_t blk = 0; blk < wq.size() / kQ8Bytes; ++blk)
                wq[blk * kQ8Bytes + 2 + blk % 32] = std::byte{0x80};
            auto x = randn(static_cast<std::size_t>(in), static_cast<uint32_t>(in + runs), 1.0f);
            for (int64_t b = 0; b < in / 32; ++b)
              for (int64_t i = 0; i < 32; ++i)
                x[static_cast<std::size_t>(b * 32 + i)] *= std::pow(10.0f, static_cast<float>(b % 7) - 3.0f);
            const auto xq = quantized(x, 1, in);
            for (bool acc : {false, true}) {
              const auto y0 = randn(static_cast<std::size_t>(out), static_cast<uint32_t>(out + 3), 1.0f);
              std::vector<float> fast = y0, ref = y0;
              matmul_q8_with(Q8Kernel::avx512_vnni, plan, xq.data(), 1, in, wq.data(), q4, out, fast.data(), acc);
              matmul_q8_reference(xq.data(), 1, in, wq.data(), q4, out, ref.data(), acc);
              ASSERT_EQ(std::memcmp(fast.data(), ref.data(), fast.size() * sizeof(float)), 0)
                  << to_string(plan) << (q4 ? " Q4_0" : " Q8_0") << " out " << out << " in " << in << " threads "
                  << threads << " accumulate " << acc;
              ++cases;
            }
          }
    }
  omp_set_num_threads(before);
  EXPECT_EQ(cases, 12 * 2 * 7 * 2 * 2);
  const std::vector<std::byte> wq(34), xq(34);
  std::vector<float> y(1);
  EXPECT_THROW(matmul_q8_with(Q8Kernel::avx512_vnni, DecodeStreams{3, 0}, xq.data(), 1, 32, wq.data(), false, 1,
                              y.data(), false),
               std::logic_error);
}

}  // namespace POSENC_UNITY_ID
