// Periods, wrap counts, per-channel inspection, RoFormer decay, ALiBi slopes.
#include <cmath>
#include <filesystem>
#include <numbers>
#include <numeric>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "config/test_util.hpp"
#include "posenc/analysis.hpp"
#include "posenc/config.hpp"
#include "posenc/error.hpp"

namespace POSENC_UNITY_ID {  // this file's own namespace in the tests' unity build (CMakeLists.txt)

using namespace posenc;

namespace {

bool registered(std::string_view rope_type) {
  for (const auto& m : rope_scalings())
    if (m.name == rope_type) return true;
  return false;
}

RopeFrequencies plain(int head_dim, double theta) {
  return default_rope_frequencies(head_dim, head_dim, theta);
}

/// Independent count: channels i with 2π θ^(2i/d) >= L, in double.
std::vector<int> unwrapped_double(int d, double theta, double length, double scale = 1.0) {
  std::vector<int> out;
  for (int i = 0; i < d / 2; ++i)
    if (scale * 2 * std::numbers::pi * std::pow(theta, 2.0 * i / d) >= length) out.push_back(i);
  return out;
}

double mean_bound(std::span<const double> thetas, int a, int b) {
  double s = 0;
  for (int r = a; r <= b; ++r) s += rope_decay_bound(thetas, r);
  return s / (b - a + 1);
}

}  // namespace

TEST(ContextLength, Suffixes) {
  EXPECT_EQ(parse_context_length("4K", "x"), 4096);
  EXPECT_EQ(parse_context_length("32k", "x"), 32768);
  EXPECT_EQ(parse_context_length("128K", "x"), 131072);
  EXPECT_EQ(parse_context_length("1M", "x"), 1048576);
  EXPECT_EQ(parse_context_length("3000", "x"), 3000);
  for (const char* bad : {"", "K", "-4K", "1.5K", "12X", "0", "0K", "4KK", "99999999999999999M"})
    EXPECT_THROW((void)parse_context_length(bad, "--lengths"), ConfigError) << bad;
  try {
    (void)parse_context_length("12X", "--lengths");
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("--lengths"), std::string::npos);
    EXPECT_NE(std::string(e.what()).find("12X"), std::string::npos);
  }
  EXPECT_EQ(format_context_length(131072), "128K");
  EXPECT_EQ(format_context_length(1048576), "1M");
  EXPECT_EQ(format_context_length(3000), "3000");
  EXPECT_EQ(parse_number("5e5", "x"), 500000.0);
  EXPECT_THROW((void)parse_number("abc", "--rope-theta"), ConfigError);
  EXPECT_THROW((void)parse_number("10000x", "--rope-theta"), ConfigError);
}

TEST(Periods, Theta10000AllWrappedAt128K) {
  const WrapCount w = count_wrapped(plain(128, 10000.0), 131072);
  EXPECT_EQ(w.wrapped, 64);
  EXPECT_EQ(w.unwrapped, 0);
  // The slowest channel's period is 2π·10000^(63/64) ≈ 54410 tokens, under 128K
  // but over 32K: exactly how many stay unwrapped at 32K follows from the formula.
  const auto wl = rope_wavelengths(plain(128, 10000.0));
  EXPECT_NEAR(wl[63], 2 * std::numbers::pi * std::pow(10000.0, 63.0 / 64.0), 0.01);
  EXPECT_NEAR(wl[63], 54410.0, 5.0);
  EXPECT_EQ(count_wrapped(plain(128, 10000.0), 32768).unwrapped_channels,
            unwrapped_double(128, 10000.0, 32768));
}

TEST(Periods, Theta500000UnwrappedChannels) {
  const RopeFrequencies f = plain(128, 500000.0);
  const WrapCount at128k = count_wrapped(f, 131072);
  EXPECT_EQ(at128k.unwrapped, 15);
  EXPECT_EQ(at128k.wrapped, 49);
  std::vector<int> expect(15);
  std::iota(expect.begin(), expect.end(), 49);
  EXPECT_EQ(at128k.unwrapped_channels, expect);
  const WrapCount at1m = count_wrapped(f, 1048576);
  EXPECT_EQ(at1m.unwrapped, 5);
  EXPECT_EQ(at1m.unwrapped_channels, (std::vector<int>{59, 60, 61, 62, 63}));
}

TEST(Periods, FastestChannelPeriodIsTwoPiForAnyTheta) {
  for (double theta : {100.0, 10000.0, 500000.0, 1e6, 1e8}) {
    const auto wl = rope_wavelengths(plain(128, theta));
    EXPECT_DOUBLE_EQ(wl[0], 2 * std::numbers::pi) << theta;
    EXPECT_LT(wl[0], wl[1]);
  }
}

TEST(Periods, TableMatchesIndependentCount) {
  PeriodsRequest req;
  req.head_dim = 128;
  req.rope_thetas = {10000.0, 500000.0};
  req.lengths = {4096, 32768, 131072, 1048576};
  const auto rows = periods_table(req);
  ASSERT_EQ(rows.size(), 8u);
  std::size_t k = 0;
  for (double theta : req.rope_thetas)
    for (int64_t length : req.lengths) {
      const PeriodRow& r = rows[k++];
      EXPECT_EQ(r.rope_theta, theta);
      EXPECT_EQ(r.length, length);
      EXPECT_EQ(r.rope_type, "default");
      EXPECT_EQ(r.wrapped + r.unwrapped, 64);
      EXPECT_EQ(r.unwrapped_channels, unwrapped_double(128, theta, static_cast<double>(length)))
          << theta << " " << length;
    }
  EXPECT_EQ(rows[2].unwrapped, 0);   // 10000 @ 128K
  EXPECT_EQ(rows[6].unwrapped, 15);  // 500000 @ 128K
  EXPECT_EQ(rows[7].unwrapped, 5);   // 500000 @ 1M
}

TEST(Periods, LinearAndNtkScaling) {
  PeriodsRequest req;
  req.head_dim = 128;
  req.rope_thetas = {500000.0};
  req.lengths = {131072};
  req.rope_types = {"default", "linear", "ntk"};
  req.factor = 4.0;
  const auto rows = periods_table(req);
  ASSERT_EQ(rows.size(), 3u);
  EXPECT_EQ(rows[0].unwrapped, 15);
  // Linear interpolation multiplies every period by 4.
  EXPECT_EQ(rows[1].rope_type, "linear");
  EXPECT_EQ(rows[1].unwrapped_channels, unwrapped_double(128, 500000.0, 131072, 4.0));
  EXPECT_GT(rows[1].unwrapped, rows[0].unwrapped);
  // NTK-aware: base 500000·4^(128/126); fastest channel untouched.
  const double base = 500000.0 * std::pow(4.0, 128.0 / 126.0);
  EXPECT_EQ(rows[2].unwrapped_channels, unwrapped_double(128, base, 131072));
  const auto curves = period_curves(req);
  ASSERT_EQ(curves.size(), 3u);
  EXPECT_DOUBLE_EQ(curves[2].wavelengths[0], 2 * std::numbers::pi);
  for (std::size_t i = 0; i < 64; ++i)
    EXPECT_NEAR(curves[1].wavelengths[i] / curves[0].wavelengths[i], 4.0, 1e-6);
}

TEST(Periods, Llama3ScalingKeepsFastChannels) {
  if (!registered("llama3")) GTEST_SKIP() << "rope_type 'llama3' not registered in this build yet";
  PeriodsRequest req;
  req.head_dim = 128;
  req.rope_thetas = {500000.0};
  req.lengths = {131072};
  req.rope_types = {"default", "llama3"};
  req.factor = 8.0;
  req.original_max_position_embeddings = 8192;
  const auto curves = period_curves(req);
  for (std::size_t i = 0; i < 64; ++i) {
    const double w0 = curves[0].wavelengths[i], w = curves[1].wavelengths[i];
    if (w0 < 8192.0 / 4.0) {
      EXPECT_NEAR(w / w0, 1.0, 1e-6) << i;  // high frequency: kept
    } else if (w0 > 8192.0 / 1.0) {
      EXPECT_NEAR(w / w0, 8.0, 1e-5) << i;  // low frequency: ×factor
    }
  }
  const auto rows = periods_table(req);
  EXPECT_EQ(rows[1].unwrapped_channels,
            count_wrapped(compute_rope_frequencies(periods_params(req, 500000.0, "llama3")),
                          131072)
                .unwrapped_channels);
  EXPECT_GT(rows[1].unwrapped, rows[0].unwrapped);
}

TEST(Periods, RequestErrors) {
  PeriodsRequest req;
  req.rope_thetas = {10000.0};
  req.lengths = {4096};
  req.head_dim = 127;
  EXPECT_THROW(req.validate(), ConfigError);
  req.head_dim = 128;
  req.rope_types = {"linear"};
  EXPECT_THROW(req.validate(), ConfigError);  // factor missing
  req.factor = -1;
  EXPECT_THROW(req.validate(), ConfigError);
  req.rope_types = {"bogus"};
  req.factor = 2;
  EXPECT_THROW(req.validate(), ConfigError);
  req.rope_types = {};
  req.rope_thetas = {-5};
  EXPECT_THROW(req.validate(), ConfigError);
}

TEST(Inspect, DefaultConfigChannels) {
  const PositionalSpec s = load_positional_spec(test::shared_config("tinyllama-1.1b-chat-v1.0.json"));
  const RopeInspection ins = inspect_rope(s, std::nullopt);
  EXPECT_EQ(ins.original_length, 2048);
  EXPECT_EQ(ins.target_length, 2048);
  ASSERT_EQ(ins.channels.size(), 32u);
  const RopeFrequencies d = plain(64, 10000.0);
  for (std::size_t i = 0; i < 32; ++i) {
    const ChannelInfo& c = ins.channels[i];
    EXPECT_EQ(c.i, static_cast<int>(i));
    EXPECT_EQ(c.inv_freq, static_cast<double>(d.inv_freq[i]));
    EXPECT_DOUBLE_EQ(c.wavelength, 2 * std::numbers::pi / d.inv_freq[i]);
    EXPECT_DOUBLE_EQ(c.rotations_original, 2048.0 / c.wavelength);
    EXPECT_EQ(c.wavelength_ratio, 1.0);
  }
  EXPECT_NEAR(ins.channels[0].rotations_original, 2048.0 / (2 * std::numbers::pi), 1e-9);
  const RopeInspection at32k = inspect_rope(s, 32768);
  EXPECT_NEAR(at32k.channels[5].rotations_target, 16 * at32k.channels[5].rotations_original,
              1e-9);
}

TEST(Inspect, LinearRatioEqualsFactor) {
  const PositionalSpec s = parse_positional_spec(R"({"model_type": "llama",
      "num_attention_heads": 4, "hidden_size": 256, "max_position_embeddings": 16384,
      "rope_scaling": {"rope_type": "linear", "factor": 4.0}})");
  const RopeInspection ins = inspect_rope(s, std::nullopt);
  EXPECT_EQ(ins.original_length, 16384);  // no original_max: max_position_embeddings
  for (const auto& c : ins.channels) EXPECT_NEAR(c.wavelength_ratio, 4.0, 1e-6);
}

TEST(Inspect, Phi3RatiosAreTheLongRopeFactors) {
  if (!registered("longrope")) GTEST_SKIP() << "rope_type 'longrope' not registered in this build yet";
  const PositionalSpec s =
      load_positional_spec(test::shared_config("phi-3-mini-128k-instruct.json"));
  const RopeInspection lng = inspect_rope(s, std::nullopt);
  EXPECT_EQ(lng.original_length, 4096);
  EXPECT_EQ(lng.target_length, 131072);
  const RopeInspection sht = inspect_rope(s, 4096);
  for (std::size_t i = 0; i < 48; ++i) {
    EXPECT_NEAR(lng.channels[i].wavelength_ratio, s.rope->long_factor[i],
                2e-6 * s.rope->long_factor[i]);
    EXPECT_NEAR(sht.channels[i].wavelength_ratio, s.rope->short_factor[i],
                2e-6 * s.rope->short_factor[i]);
  }
}

TEST(Inspect, NonRopeSpecIsAnError) {
  const PositionalSpec s = load_positional_spec(test::shared_config("gpt2-large.json"));
  EXPECT_THROW((void)inspect_rope(s, std::nullopt), ConfigError);
}

TEST(Decay, BoundAtZeroIsClosedForm) {
  // r = 0: |S_j| = j, so (1/n) Σ_{j=1}^{n} j = (n + 1) / 2 with n = d/2.
  EXPECT_NEAR(rope_decay_bound(rope_decay_thetas(128, 10000.0), 0.0), 32.5, 1e-12);
  EXPECT_NEAR(rope_decay_bound(rope_decay_thetas(64, 500000.0), 0.0), 16.5, 1e-12);
}

TEST(Decay, DecaysWithDistance) {
  const auto th = rope_decay_thetas(128, 10000.0);
  // Reference values from an independent numpy evaluation of the same sum.
  EXPECT_NEAR(rope_decay_bound(th, 1), 31.538166142658085, 1e-9);
  EXPECT_NEAR(rope_decay_bound(th, 100), 10.227329948505133, 1e-9);
  EXPECT_NEAR(rope_decay_bound(th, 1000), 4.470761034248737, 1e-9);
  const double m1 = mean_bound(th, 1, 10), m2 = mean_bound(th, 10, 100),
               m3 = mean_bound(th, 100, 1000), m4 = mean_bound(th, 1000, 2000);
  EXPECT_NEAR(m1, 22.67907833592302, 1e-9);
  EXPECT_NEAR(m2, 12.071680839960448, 1e-9);
  EXPECT_NEAR(m3, 6.696102900431748, 1e-9);
  EXPECT_NEAR(m4, 5.328148437627137, 1e-9);
  EXPECT_GT(m1, m2);
  EXPECT_GT(m2, m3);
  EXPECT_GT(m3, m4);
}

TEST(Decay, GridAndCurve) {
  const auto g = decay_grid(65536);
  ASSERT_GT(g.size(), 1025u);
  for (int64_t r = 0; r <= 1024; ++r) EXPECT_EQ(g[static_cast<std::size_t>(r)], r);
  EXPECT_EQ(g.back(), 65536);
  for (std::size_t i = 1; i < g.size(); ++i) EXPECT_LT(g[i - 1], g[i]);
  // 200 per decade over 1024 → 65536 (1.806 decades): about 361 extra points.
  EXPECT_NEAR(static_cast<double>(g.size() - 1025), 361.0, 2.0);
  const auto small = decay_grid(10);
  EXPECT_EQ(small.size(), 11u);
  const auto c = rope_decay_curve(128, 10000.0, 2000);
  EXPECT_EQ(c.front().distance, 0);
  EXPECT_NEAR(c.front().bound, 32.5, 1e-12);
  EXPECT_EQ(c.back().distance, 2000);
  EXPECT_THROW((void)rope_decay_curve(127, 10000.0, 100), ConfigError);
  EXPECT_THROW((void)rope_decay_curve(128, -1.0, 100), ConfigError);
  EXPECT_THROW((void)rope_decay_curve(128, 10000.0, 0), ConfigError);
}

TEST(AlibiSlopes, MatchHuggingFaceMptAndBloom) {
  const auto path =
      std::filesystem::path(POSENC_SHARED_DIR) / "testdata" / "hf_reference" / "alibi.json";
  const auto doc = nlohmann::json::parse(test::slurp(path));
  int mpt = 0, bloom = 0;
  for (const auto& c : doc.at("cases")) {
    const std::string name = c.at("name");
    if (!c.at("outputs").contains("slopes")) continue;
    const int n = c.at("inputs").at("num_heads");
    std::vector<float> got;
    if (name.starts_with("mpt_")) {
      got = alibi_slopes_for({AlibiConvention::mpt, c.at("inputs").at("alibi_bias_max").get<double>()}, n);
      ++mpt;
    } else if (name.starts_with("bloom_")) {
      got = alibi_slopes_for({AlibiConvention::bloom, 8.0}, n);
      ++bloom;
    } else {
      continue;
    }
    const auto want = c.at("outputs").at("slopes").get<std::vector<double>>();
    ASSERT_EQ(got.size(), want.size()) << name;
    // MPT: same float32 steps as the reference, so within an ulp. BLOOM: the
    // reference raises a float32 base to the power k in float32 (error grows
    // with k, ~4e-7 relative at k = 64) while bias.hpp works in double.
    const double tol = name.starts_with("mpt_") ? 1.2e-7 : 1e-6;
    for (std::size_t h = 0; h < want.size(); ++h)
      EXPECT_NEAR(got[h], want[h], tol * want[h]) << name << " head " << h;
  }
  EXPECT_EQ(mpt, 14);
  EXPECT_EQ(bloom, 12);
  // MPT's even-then-odd ordering over the next power of two reproduces BLOOM's
  // interleaving rule: same slopes up to float32 rounding, also for max_bias != 8.
  for (int n : {3, 12, 20, 40, 71}) {
    const auto a = alibi_slopes_for({AlibiConvention::mpt, 6.0}, n);
    const auto b = alibi_slopes_for({AlibiConvention::bloom, 6.0}, n);
    for (int h = 0; h < n; ++h) EXPECT_NEAR(a[h], b[h], 2e-7 * b[h]) << n << " " << h;
  }
}

}  // namespace POSENC_UNITY_ID
