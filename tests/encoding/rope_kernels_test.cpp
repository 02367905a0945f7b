// The vectorised RoPE paths (src/encoding/rope_kernels.cpp) against plain
// scalar references: cos/sin within 1 ulp of libm's float cos/sin of the
// float32 angle, exact mode within 1e-6 of long double, rotations
// bit-identical to the reference loop (float32 products, no FMA).
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include <gtest/gtest.h>

#include "posenc/error.hpp"
#include "posenc/rope.hpp"

namespace POSENC_UNITY_ID {  // this file's own namespace in the tests' unity build (CMakeLists.txt)

using namespace posenc;

namespace {

// Distance in units in the last place between two finite floats.
int64_t ulp_distance(float a, float b) {
  auto ordered = [](float f) {
    int32_t i;
    std::memcpy(&i, &f, sizeof i);
    return i < 0 ? int64_t{INT32_MIN} - i : int64_t{i};
  };
  const int64_t d = ordered(a) - ordered(b);
  return d < 0 ? -d : d;
}

std::vector<int64_t> many_positions() {
  std::vector<int64_t> pos;
  for (int64_t p = 0; p < 4096; ++p) pos.push_back(p);
  std::mt19937_64 rng(7);
  std::uniform_int_distribution<int64_t> big(0, 2'000'000), huge(0, int64_t{1} << 31);
  for (int i = 0; i < 2000; ++i) pos.push_back(big(rng));
  for (int i = 0; i < 300; ++i) pos.push_back(huge(rng));
  for (int64_t p : {int64_t{-1}, int64_t{-4095}, int64_t{1} << 24, (int64_t{1} << 24) + 1,
                    int64_t{1} << 40, -(int64_t{1} << 35), int64_t{INT64_MAX}})
    pos.push_back(p);
  return pos;
}

RopeFrequencies random_frequencies(int n_pairs, uint32_t seed) {
  RopeFrequencies f;
  f.head_dim = 2 * n_pairs;
  f.rotary_dim = 2 * n_pairs;
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> e(-20.0f, 2.0f);
  for (int i = 0; i < n_pairs; ++i) f.inv_freq.push_back(std::exp2(e(rng)));
  return f;
}

}  // namespace

TEST(RopeKernels, Float32CosSinWithinOneUlpOfLibm) {
  const auto pos = many_positions();
  int64_t total = 0, exact = 0;
  for (const RopeFrequencies& f :
       {default_rope_frequencies(128, 128, 10000.0), default_rope_frequencies(80, 80, 500000.0),
        random_frequencies(37, 3)}) {
    RopeTable table(f, pos, AnglePrecision::float32);
    for (std::size_t t = 0; t < pos.size(); ++t) {
      for (int i = 0; i < f.n_pairs(); ++i) {
        const float angle = static_cast<float>(pos[t]) * f.inv_freq[static_cast<std::size_t>(i)];
        const float c = table.cos_row(static_cast<int64_t>(t))[i];
        const float s = table.sin_row(static_cast<int64_t>(t))[i];
        ASSERT_LE(ulp_distance(c, std::cos(angle)), 1)
            << "cos, position " << pos[t] << " pair " << i << " angle " << angle;
        ASSERT_LE(ulp_distance(s, std::sin(angle)), 1)
            << "sin, position " << pos[t] << " pair " << i << " angle " << angle;
        total += 2;
        exact += (c == std::cos(angle)) + (s == std::sin(angle));
        // Where they differ, ours is the correctly rounded value (glibc's
        // cosf/sinf are within ~0.56 ulp, not always correctly rounded).
        if (c != std::cos(angle)) {
          ASSERT_EQ(c, static_cast<float>(std::cos(static_cast<long double>(angle))));
        }
        if (s != std::sin(angle)) {
          ASSERT_EQ(s, static_cast<float>(std::sin(static_cast<long double>(angle))));
        }
      }
    }
  }
  // Measured: about 98.8% bit-identical to libm, the rest 1 ulp apart.
  EXPECT_GT(static_cast<double>(exact) / static_cast<double>(total), 0.97) << exact << "/" << total;
}

TEST(RopeKernels, ExactCosSinWithinOneMillionthOfLongDouble) {
  const auto pos = many_positions();
  for (const RopeFrequencies& f :
       {default_rope_frequencies(128, 128, 10000.0), random_frequencies(21, 5)}) {
    RopeTable table(f, pos, AnglePrecision::exact);
    double worst = 0;
    for (std::size_t t = 0; t < pos.size(); ++t) {
      for (int i = 0; i < f.n_pairs(); ++i) {
        const long double angle = static_cast<long double>(static_cast<double>(pos[t]) *
                                                           f.inv_freq[static_cast<std::size_t>(i)]);
        const double dc = std::fabs(static_cast<double>(table.cos_row(static_cast<int64_t>(t))[i] -
                                                        std::cos(angle)));
        const double ds = std::fabs(static_cast<double>(table.sin_row(static_cast<int64_t>(t))[i] -
                                                        std::sin(angle)));
        worst = std::max({worst, dc, ds});
      }
    }
    EXPECT_LE(worst, 1e-6);
  }
}

TEST(RopeKernels, AttentionFactorScalesCosAndSinInFloat32) {
  RopeFrequencies f = default_rope_frequencies(64, 64, 10000.0);
  f.attention_factor = 1.2231435513142097;  // YaRN's 0.1 ln(8) + 1
  const std::vector<int64_t> pos{0, 1, 17, 4095, 70000};
  RopeTable scaled(f, pos, AnglePrecision::float32);
  f.attention_factor = 1.0;
  RopeTable plain(f, pos, AnglePrecision::float32);
  const float af = static_cast<float>(1.2231435513142097);
  for (std::size_t i = 0; i < plain.cos().size(); ++i) {
    EXPECT_EQ(scaled.cos()[i], plain.cos()[i] * af);
    EXPECT_EQ(scaled.sin()[i], plain.sin()[i] * af);
  }
}

namespace {

// The reference rotation, written out as rope.hpp documents it.
void reference_rotate(std::vector<float>& x, int64_t tokens, int heads, int head_dim,
                      int64_t stride, const RopeTable& table, RopeLayout layout,
                      RopeDirection direction) {
  const int np = table.n_pairs();
  for (int64_t t = 0; t < tokens; ++t)
    for (int h = 0; h < heads; ++h)
      for (int i = 0; i < np; ++i) {
        float* head = x.data() + t * stride + static_cast<int64_t>(h) * head_dim;
        float& a = layout == RopeLayout::half ? head[i] : head[2 * i];
        float& b = layout == RopeLayout::half ? head[i + np] : head[2 * i + 1];
        const float c = table.cos_row(t)[i], s = table.sin_row(t)[i];
        const float x0 = a, x1 = b;
        if (direction == RopeDirection::forward) {
          a = x0 * c - x1 * s;
          b = x1 * c + x0 * s;
        } else {
          a = x0 * c + x1 * s;
          b = x1 * c - x0 * s;
        }
      }
}

}  // namespace

TEST(RopeKernels, RotationsAreBitIdenticalToTheReferenceLoop) {
  struct Shape {
    int64_t tokens;
    int heads, head_dim, rotary_dim;
    int64_t extra_stride;
  };
  // head_dim 8 (one masked vector), 80 with rotary 24 (12 pairs: masked tail),
  // 128 full, 64 partial, 256, a padded token stride, many tokens (threaded).
  const Shape shapes[] = {{3, 2, 8, 8, 0},      {5, 3, 80, 24, 0},   {7, 4, 128, 128, 0},
                          {9, 2, 64, 32, 0},    {2, 1, 256, 256, 0}, {6, 3, 64, 64, 40},
                          {300, 8, 64, 64, 0},  {33, 5, 96, 96, 0},  {1, 1, 2, 2, 0}};
  std::mt19937 rng(11);
  std::normal_distribution<float> nd;
  for (const Shape& sh : shapes) {
    for (auto layout : {RopeLayout::half, RopeLayout::interleaved}) {
      for (auto dir : {RopeDirection::forward, RopeDirection::inverse}) {
        for (auto precision : {AnglePrecision::float32, AnglePrecision::exact}) {
          RopeFrequencies f = default_rope_frequencies(sh.head_dim, sh.rotary_dim, 10000.0);
          std::vector<int64_t> pos(static_cast<std::size_t>(sh.tokens));
          for (auto& p : pos) p = std::uniform_int_distribution<int64_t>(0, 100000)(rng);
          const int64_t dense = static_cast<int64_t>(sh.heads) * sh.head_dim;
          const int64_t stride = dense + sh.extra_stride;
          std::vector<float> x(static_cast<std::size_t>(sh.tokens * stride));
          for (auto& v : x) v = nd(rng);
          RopeTable table(f, pos, precision);
          auto expect = x;
          reference_rotate(expect, sh.tokens, sh.heads, sh.head_dim, stride, table, layout, dir);
          // Table path with an explicit token stride: bit-identical, padding untouched.
          auto got = x;
          apply_rope(got.data(), sh.tokens, sh.heads, sh.head_dim, table, layout, dir, stride);
          ASSERT_EQ(got, expect) << "table path, head_dim " << sh.head_dim << " layout "
                                 << to_string(layout);
          if (sh.extra_stride == 0) {
            // Fused positions path (cos/sin computed on the fly).
            auto fused = x;
            apply_rope(fused.data(), sh.tokens, sh.heads, f, pos, layout, precision, dir);
            ASSERT_EQ(fused, expect) << "fused path, head_dim " << sh.head_dim << " layout "
                                     << to_string(layout);
            // Out-of-place form.
            std::vector<float> out(x.size());
            apply_rope(x.data(), out.data(), sh.tokens, sh.heads, sh.head_dim, table, layout, dir);
            ASSERT_EQ(out, expect);
          }
        }
      }
    }
  }
}

TEST(RopeKernels, FusedPathChecksItsArguments) {
  RopeFrequencies f = default_rope_frequencies(64, 64, 10000.0);
  std::vector<float> x(2 * 64);
  std::vector<int64_t> pos{0, 1};
  EXPECT_THROW(apply_rope(x.data(), 2, 0, f, pos, RopeLayout::half, AnglePrecision::float32),
               InvalidArgument);
  f.rotary_dim = 66;
  EXPECT_THROW(apply_rope(x.data(), 2, 1, f, pos, RopeLayout::half, AnglePrecision::float32),
               InvalidArgument);
}

}  // namespace POSENC_UNITY_ID
