// rope_cos_sin_with: the stage-by-stage numerics (RopeNumerics) behind the
// precision modes and verify's dtype mistakes.
//  - its scalar path agrees bit for bit with the vector kernels of
//    rope_cos_sin when it is asked for the same numerics by another spelling
//    (table f64 = stored as float32, so {f32,f32,f32,f64} is float32 mode and
//    {f32,f64,f64,f64} is exact mode, but neither is the fast-path preset);
//  - every stage is checked against an independent long-double computation
//    (angle and cos/sin in long double from the stage's rounded inputs), within
//    the bound of the stage's last rounding.
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include <gtest/gtest.h>

#include "posenc/error.hpp"
#include "posenc/float16.hpp"
#include "posenc/rope.hpp"
#include "posenc/scaling.hpp"

namespace POSENC_UNITY_ID {  // this file's own namespace in the tests' unity build (CMakeLists.txt)

using namespace posenc;

namespace {

std::vector<int64_t> many_positions() {
  std::vector<int64_t> p;
  for (int64_t i = 0; i < 4200; ++i) p.push_back(i);
  std::mt19937_64 rng(18);
  std::uniform_int_distribution<int64_t> far(0, int64_t{1} << 24);
  for (int i = 0; i < 3000; ++i) p.push_back(far(rng));
  for (int64_t c : {int64_t{1} << 20, int64_t{1'000'000}, (int64_t{1} << 24) - 1, int64_t{1} << 24})
    for (int64_t d = -3; d <= 3; ++d) p.push_back(c + d);
  return p;
}

RopeParams llama31() {
  RopeParams p;
  p.rope_type = "llama3";
  p.rope_theta = 500000.0;
  p.head_dim = 128;
  p.factor = 8.0;
  p.low_freq_factor = 1.0;
  p.high_freq_factor = 4.0;
  p.original_max_position_embeddings = 8192;
  p.max_position_embeddings = 131072;
  return p;
}

struct Table {
  std::vector<float> cos, sin;
};

Table with(const RopeFrequencies& f, const std::vector<int64_t>& pos, const RopeNumerics& n) {
  Table t{std::vector<float>(pos.size() * f.inv_freq.size()), std::vector<float>(pos.size() * f.inv_freq.size())};
  rope_cos_sin_with(f, pos, n, t.cos, t.sin);
  return t;
}

Table plain(const RopeFrequencies& f, const std::vector<int64_t>& pos, AnglePrecision prec) {
  Table t{std::vector<float>(pos.size() * f.inv_freq.size()), std::vector<float>(pos.size() * f.inv_freq.size())};
  rope_cos_sin(f, pos, prec, t.cos, t.sin);
  return t;
}

// Number of entries that differ in their bits.
std::size_t bit_differences(const Table& a, const Table& b) {
  std::size_t n = 0;
  for (std::size_t i = 0; i < a.cos.size(); ++i) n += (a.cos[i] != b.cos[i]) + (a.sin[i] != b.sin[i]);
  return n;
}

}  // namespace

TEST(RopeNumerics, PresetsAreRopeCosSinBitForBit) {
  const std::vector<int64_t> pos = many_positions();
  for (const RopeFrequencies& f : {default_rope_frequencies(128, 128, 500000.0), compute_rope_frequencies(llama31()),
                                   default_rope_frequencies(64, 32, 10000.0)}) {
    const RopeNumerics f32{};
    const RopeNumerics exact{NumericDtype::f32, NumericDtype::f64, NumericDtype::f64, NumericDtype::f32};
    EXPECT_EQ(bit_differences(with(f, pos, f32), plain(f, pos, AnglePrecision::float32)), 0u);
    EXPECT_EQ(bit_differences(with(f, pos, exact), plain(f, pos, AnglePrecision::exact)), 0u);
    // The same numerics spelled differently take the scalar path; it must
    // reproduce the vector kernels (double sincos rounded once to float).
    const RopeNumerics f32_scalar{NumericDtype::f32, NumericDtype::f32, NumericDtype::f32, NumericDtype::f64};
    const RopeNumerics exact_scalar{NumericDtype::f32, NumericDtype::f64, NumericDtype::f64, NumericDtype::f64};
    EXPECT_EQ(bit_differences(with(f, pos, f32_scalar), plain(f, pos, AnglePrecision::float32)), 0u);
    EXPECT_EQ(bit_differences(with(f, pos, exact_scalar), plain(f, pos, AnglePrecision::exact)), 0u);
  }
}

TEST(RopeNumerics, AttentionFactorPathsAgree) {
  RopeParams p;
  p.rope_type = "yarn";
  p.rope_theta = 10000.0;
  p.head_dim = 64;
  p.factor = 4.0;
  p.original_max_position_embeddings = 4096;
  const RopeFrequencies f = compute_rope_frequencies(p);
  ASSERT_NE(f.attention_factor, 1.0);
  const std::vector<int64_t> pos = many_positions();
  const RopeNumerics f32_scalar{NumericDtype::f32, NumericDtype::f32, NumericDtype::f32, NumericDtype::f64};
  EXPECT_EQ(bit_differences(with(f, pos, f32_scalar), plain(f, pos, AnglePrecision::float32)), 0u);
}

// Each stage against long double: the stage inputs are rounded with
// float16.hpp (the one conversion), the rest is evaluated in long double, and
// the result must be within the last rounding of the stage (float32 or
// bf16/f16 of cos/sin) plus the float32 angle rounding where there is one.
TEST(RopeNumerics, StagesMatchLongDoubleReference) {
  const RopeFrequencies f = compute_rope_frequencies(llama31());
  std::vector<int64_t> pos;
  for (int64_t i = 0; i < 3000; ++i) pos.push_back(i * 37);
  struct Case {
    RopeNumerics n;
    double tol;
  };
  using D = NumericDtype;
  const std::vector<Case> cases{
      // inv_freq bf16, rest as float32 with an exact angle: only cos/sin's final rounding.
      {{D::bf16, D::f64, D::f64, D::f32}, 6e-8},
      {{D::f16, D::f64, D::f64, D::f32}, 6e-8},
      // bf16 positions with an exact product.
      {{D::f32, D::bf16, D::f64, D::f32}, 6e-8},
      {{D::f32, D::f16, D::f64, D::f32}, 6e-8},
      // bf16/f16 table: half a bf16 (f16) ulp of a value <= 1, plus float32's.
      {{D::f32, D::f64, D::f64, D::bf16}, 0x1p-9 + 6e-8},
      {{D::f32, D::f64, D::f64, D::f16}, 0x1p-12 + 6e-8},
  };
  for (const Case& c : cases) {
    const Table t = with(f, pos, c.n);
    double worst = 0;
    for (std::size_t k = 0; k < pos.size(); ++k)
      for (std::size_t i = 0; i < f.inv_freq.size(); ++i) {
        long double inv = f.inv_freq[i];
        if (c.n.inv_freq == D::bf16) inv = round_to_bf16(f.inv_freq[i]);
        if (c.n.inv_freq == D::f16) inv = round_to_f16(f.inv_freq[i]);
        long double p = static_cast<long double>(pos[k]);
        if (c.n.position == D::bf16) p = round_to_bf16(static_cast<float>(pos[k]));
        if (c.n.position == D::f16) p = round_to_f16(static_cast<float>(pos[k]));
        const long double a = p * inv;
        const std::size_t j = k * f.inv_freq.size() + i;
        worst = std::max({worst, static_cast<double>(std::fabs(t.cos[j] - std::cos(a))),
                          static_cast<double>(std::fabs(t.sin[j] - std::sin(a)))});
      }
    EXPECT_LT(worst, c.tol) << to_string(c.n);
    EXPECT_GT(worst, 0.0) << to_string(c.n);
  }
}

TEST(RopeNumerics, RoundedAngleStages) {
  // angle bf16: float32 product rounded to bf16 (8 significant bits). The
  // reference rounds the long-double product the same way: equal to float32's
  // product except at a rounding tie, so compare on the angle bound instead.
  const RopeFrequencies f = default_rope_frequencies(128, 128, 500000.0);
  std::vector<int64_t> pos;
  for (int64_t i = 0; i < 2000; ++i) pos.push_back(i * 101);
  using D = NumericDtype;
  for (D angle : {D::bf16, D::f16}) {
    const Table t = with(f, pos, RopeNumerics{D::f32, D::f32, angle, D::f32});
    const double rel = angle == D::bf16 ? 0x1p-8 : 0x1p-11;  // half an ulp, relative
    double worst_excess = 0;
    for (std::size_t k = 0; k < pos.size(); ++k)
      for (std::size_t i = 0; i < f.inv_freq.size(); ++i) {
        const long double a = static_cast<long double>(pos[k]) * f.inv_freq[i];
        const std::size_t j = k * f.inv_freq.size() + i;
        // |cos(a') - cos(a)| <= |a' - a| <= rel*|a| (+ float32 product and cos rounding).
        const double bound = rel * static_cast<double>(a) * (1 + 1e-6) + 1.2e-7;
        worst_excess = std::max(worst_excess, static_cast<double>(std::fabs(t.cos[j] - std::cos(a))) - bound);
        worst_excess = std::max(worst_excess, static_cast<double>(std::fabs(t.sin[j] - std::sin(a))) - bound);
      }
    EXPECT_LE(worst_excess, 0.0) << to_string(angle);
  }
  // Positions collide where the dtype runs out of integers: 257 -> 256 in
  // bf16, 2049 -> 2048 in f16, 2^24+1 -> 2^24 in float32.
  for (auto [dtype, first] : {std::pair{D::bf16, int64_t{257}}, std::pair{D::f16, int64_t{2049}},
                              std::pair{D::f32, (int64_t{1} << 24) + 1}}) {
    const std::vector<int64_t> p{first - 2, first - 1, first};
    const Table t = with(f, p, RopeNumerics{D::f32, dtype, D::f64, D::f64});
    const std::size_t n = f.inv_freq.size();
    EXPECT_NE(t.cos[0], t.cos[n]) << to_string(dtype);  // first-2 and first-1 are distinct
    for (std::size_t i = 0; i < n; ++i) {
      EXPECT_EQ(t.cos[n + i], t.cos[2 * n + i]) << to_string(dtype) << " pair " << i;
      EXPECT_EQ(t.sin[n + i], t.sin[2 * n + i]) << to_string(dtype) << " pair " << i;
    }
  }
}

TEST(RopeNumerics, F64InvFreqNeedsTheTwin) {
  RopeFrequencies f = default_rope_frequencies(8, 8, 10000.0);
  f.inv_freq_f64.clear();
  std::vector<float> c(4), s(4);
  const std::vector<int64_t> pos{3};
  EXPECT_THROW(rope_cos_sin_with(f, pos, RopeNumerics{NumericDtype::f64, NumericDtype::f64, NumericDtype::f64,
                                                      NumericDtype::f32},
                                 c, s),
               InvalidArgument);
  std::vector<float> small(3);
  EXPECT_THROW(rope_cos_sin_with(f, pos, RopeNumerics{NumericDtype::bf16}, small, s), InvalidArgument);
}

}  // namespace POSENC_UNITY_ID
