// Precision modes against references computed here independently, in long
// double (inv_freq from the formula, cos/sin of the long-double angle), and
// the collisions against the integer limits of bf16 / fp16 / float32 (256,
// 2048, 2^24) counted analytically; then `posenc precision` end to end on
// Llama-3.1-8B's config.
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <map>
#include <numbers>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "config/test_util.hpp"
#include "posenc/config.hpp"
#include "posenc/error.hpp"
#include "posenc/precision.hpp"
#include "posenc/rope.hpp"
#include "posenc/scaling.hpp"

namespace POSENC_UNITY_ID {  // this file's own namespace in the tests' unity build (CMakeLists.txt)

using namespace posenc;
using posenc::test::CliResult;
using posenc::test::run_cli;
using posenc::test::ScratchDir;
using posenc::test::shared_config;
using json = nlohmann::json;

namespace {

RopeParams llama31() {
  return *load_positional_spec(shared_config("llama-3.1-8b.json")).rope;
}

// Llama 3.1's frequencies in long double, from Meta's apply_scaling written out
// here (not posenc's code): theta 500000, d 128, factor 8, low 1, high 4, 8192.
std::vector<long double> llama31_inv_freq_ld() {
  std::vector<long double> inv;
  const long double pi = std::numbers::pi_v<long double>;
  for (int i = 0; i < 64; ++i) {
    const long double f = 1.0L / std::pow(500000.0L, static_cast<long double>(2 * i) / 128.0L);
    const long double wavelen = 2 * pi / f;
    const long double low_wavelen = 8192.0L / 1.0L, high_wavelen = 8192.0L / 4.0L;
    long double v;
    if (wavelen < high_wavelen) {
      v = f;
    } else if (wavelen > low_wavelen) {
      v = f / 8.0L;
    } else {
      const long double smooth = (8192.0L / wavelen - 1.0L) / (4.0L - 1.0L);
      v = (1 - smooth) * f / 8.0L + smooth * f;
    }
    inv.push_back(v);
  }
  return inv;
}

std::vector<int64_t> spread(int64_t lo, int64_t hi, int n) {
  std::vector<int64_t> p;
  for (int k = 0; k < n; ++k) p.push_back(lo + (hi - lo) * k / (n - 1));
  return p;
}

// max |table - cos/sin_ld(p * inv_ld)| over positions and pairs.
double max_error_ld(const std::vector<float>& c, const std::vector<float>& s, const std::vector<int64_t>& pos,
                    const std::vector<long double>& inv) {
  double worst = 0;
  for (std::size_t t = 0; t < pos.size(); ++t)
    for (std::size_t i = 0; i < inv.size(); ++i) {
      const long double a = static_cast<long double>(pos[t]) * inv[i];
      worst = std::max({worst, static_cast<double>(std::fabs(c[t * inv.size() + i] - std::cos(a))),
                        static_cast<double>(std::fabs(s[t * inv.size() + i] - std::sin(a)))});
    }
  return worst;
}

std::pair<std::vector<float>, std::vector<float>> table(const RopeFrequencies& f, const std::vector<int64_t>& pos,
                                                        AnglePrecision p) {
  std::vector<float> c(pos.size() * f.inv_freq.size()), s(c.size());
  rope_cos_sin(f, pos, p, c, s);
  return {c, s};
}

}  // namespace

TEST(PrecisionModes, Fp64TwinMatchesLongDoubleFormula) {
  const RopeFrequencies f = compute_rope_frequencies(llama31());
  const auto inv = llama31_inv_freq_ld();
  ASSERT_EQ(f.inv_freq_f64.size(), inv.size());
  double worst_rel = 0, worst_rel_f32 = 0;
  for (std::size_t i = 0; i < inv.size(); ++i) {
    worst_rel = std::max(worst_rel, static_cast<double>(std::fabs(f.inv_freq_f64[i] - inv[i]) / inv[i]));
    worst_rel_f32 = std::max(worst_rel_f32, static_cast<double>(std::fabs(f.inv_freq[i] - inv[i]) / inv[i]));
  }
  EXPECT_LT(worst_rel, 1e-14);      // double's rounding, a few operations
  EXPECT_GT(worst_rel_f32, 5e-8);   // float32's is 10^8 times larger
  EXPECT_LT(worst_rel_f32, 1e-6);
  // cos/sin in double and the fp64 table, to 2^20.
  std::vector<int64_t> pos = spread(0, 1 << 20, 2001);
  for (int64_t p = 0; p < 300; ++p) pos.push_back(p);
  std::vector<double> c(pos.size() * 64), s(c.size());
  rope_cos_sin_f64(f, pos, c, s);
  double worst = 0;
  for (std::size_t t = 0; t < pos.size(); ++t)
    for (std::size_t i = 0; i < 64; ++i) {
      const long double a = static_cast<long double>(pos[t]) * inv[i];
      worst = std::max({worst, static_cast<double>(std::fabs(c[t * 64 + i] - std::cos(a))),
                        static_cast<double>(std::fabs(s[t * 64 + i] - std::sin(a)))});
    }
  EXPECT_LT(worst, 1e-9);  // the angle's double rounding: 2^20 * 1e-16 relative
  const auto [fc, fs] = table(f, pos, AnglePrecision::fp64);
  const double e64 = max_error_ld(fc, fs, pos, inv);
  EXPECT_LT(e64, 6.1e-8);  // half a float32 ulp of values <= 1
  EXPECT_GT(e64, 0.0);
}

TEST(PrecisionModes, EveryScalingHasADoubleTwin) {
  for (const auto& m : rope_scalings()) {
    RopeParams p;
    p.rope_type = std::string(m.name);
    p.head_dim = 64;
    p.rope_theta = 10000;
    p.factor = 4.0;
    p.original_max_position_embeddings = 2048;
    p.max_position_embeddings = 8192;
    p.low_freq_factor = 1.0;
    p.high_freq_factor = 4.0;
    if (m.name == "longrope") {
      p.short_factor.assign(32, 1.5);
      p.long_factor.assign(32, 3.0);
    }
    if (m.name == "proportional") p.partial_rotary_factor = 0.5;
    for (std::optional<int64_t> len : {std::optional<int64_t>{}, std::optional<int64_t>{16384}}) {
      const RopeFrequencies f = compute_rope_frequencies(p, len);
      ASSERT_EQ(f.inv_freq_f64.size(), f.inv_freq.size()) << m.name;
      for (std::size_t i = 0; i < f.inv_freq.size(); ++i) {
        const double want = f.inv_freq_f64[i];
        EXPECT_NEAR(f.inv_freq[i], want, 1e-6 * want) << m.name << " pair " << i;
      }
    }
  }
  // dynamic's tensor_float32 arithmetic keeps the double formula as its twin.
  RopeParams d;
  d.rope_type = "dynamic";
  d.head_dim = 64;
  d.factor = 2.0;
  d.max_position_embeddings = 2048;
  EXPECT_EQ(dynamic_ntk_frequencies(d, 5000, DynamicNtkArithmetic::tensor_float32).inv_freq_f64,
            compute_rope_frequencies(d, 5000).inv_freq_f64);
}

// The README's figures: `exact` keeps float32 inv_freq, so its error against
// fp64 is that of the frequencies times the position, |p * (inv_f32 - inv)|:
// the bound is computed here from the long-double frequencies, and the
// measured error must reach a good part of it (dense positions hit sin ~ 1).
TEST(PrecisionModes, ExactIsOffFp64ByItsFloat32InvFreq) {
  const RopeFrequencies f = compute_rope_frequencies(llama31());
  const auto inv = llama31_inv_freq_ld();
  long double worst_delta = 0;  // max_i |inv_f32 - inv| * (largest angle reachable is far below pi/delta)
  for (std::size_t i = 0; i < inv.size(); ++i) worst_delta = std::max(worst_delta, std::fabs(f.inv_freq[i] - inv[i]));
  std::vector<int64_t> low;
  for (int64_t p = 0; p < 2048; ++p) low.push_back(p);
  const std::vector<int64_t> high = spread((1 << 20) - 4096, 1 << 20, 4097);
  const auto [lc, ls] = table(f, low, AnglePrecision::exact);
  const auto [hc, hs] = table(f, high, AnglePrecision::exact);
  const double e_low = max_error_ld(lc, ls, low, inv), e_high = max_error_ld(hc, hs, high, inv);
  // Per pair the bound is p*|delta_i|; the max over pairs is below 2047*worst_delta.
  const double bound_low = static_cast<double>(2047 * worst_delta) + 6e-8;
  const double bound_high = static_cast<double>((1 << 20) * worst_delta) + 6e-8;
  EXPECT_LE(e_low, bound_low);
  EXPECT_LE(e_high, bound_high);
  EXPECT_GT(e_low, 1e-5);   // README: ~8e-5 below 2048 for Llama 3.1
  EXPECT_LT(e_low, 2e-4);
  EXPECT_GT(e_high, 1e-2);  // README: a few 1e-2 near 2^20
  EXPECT_LT(e_high, 1e-1);
  // fp64 is within float32 rounding everywhere.
  const auto [pc, ps] = table(f, high, AnglePrecision::fp64);
  EXPECT_LT(max_error_ld(pc, ps, high, inv), 6.1e-8);
  std::printf("exact vs fp64: %.3g below 2048 (bound %.3g), %.3g near 2^20 (bound %.3g)\n", e_low, bound_low, e_high,
              bound_high);
}

TEST(PrecisionModes, AnglePrecisionNamesAndNumerics) {
  for (AnglePrecision p : {AnglePrecision::float32, AnglePrecision::exact, AnglePrecision::fp64,
                           AnglePrecision::bf16, AnglePrecision::fp16})
    EXPECT_EQ(parse_angle_precision(to_string(p)), p);
  EXPECT_THROW(parse_angle_precision("bfloat16"), ConfigError);
  EXPECT_EQ(rope_numerics(AnglePrecision::bf16),
            (RopeNumerics{NumericDtype::bf16, NumericDtype::bf16, NumericDtype::bf16, NumericDtype::bf16}));
  // fp64 needs the twin: frequencies made by hand have none.
  RopeFrequencies f = default_rope_frequencies(8, 8, 10000.0);
  f.inv_freq_f64.clear();
  const std::vector<int64_t> pos{1, 2};
  EXPECT_THROW(RopeTable(f, pos, AnglePrecision::fp64), InvalidArgument);
  EXPECT_NO_THROW(RopeTable(f, pos, AnglePrecision::bf16));
}

// The modes reach every path that builds angles: RopeTable, the fused
// apply_rope, and attention's per-row kernel agree bit for bit.
TEST(PrecisionModes, FusedApplyRopeMatchesTable) {
  const RopeFrequencies f = compute_rope_frequencies(llama31());
  const std::vector<int64_t> pos = spread(0, 300000, 40);
  std::vector<float> x(pos.size() * 2 * 128);
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = std::sin(0.37f * static_cast<float>(i));
  for (AnglePrecision p : {AnglePrecision::fp64, AnglePrecision::bf16, AnglePrecision::fp16}) {
    std::vector<float> a = x, b = x;
    apply_rope(a.data(), static_cast<int64_t>(pos.size()), 2, f, pos, RopeLayout::half, p);
    const RopeTable t(f, pos, p);
    apply_rope(b.data(), static_cast<int64_t>(pos.size()), 2, 128, t, RopeLayout::half);
    std::size_t diff = 0;
    for (std::size_t i = 0; i < a.size(); ++i)
      diff += std::bit_cast<uint32_t>(a[i]) != std::bit_cast<uint32_t>(b[i]);
    EXPECT_EQ(diff, 0u) << to_string(p);
  }
}

TEST(PrecisionCollisions, IntegerLimitsOfEachDtype) {
  const RopeFrequencies f = compute_rope_frequencies(llama31());
  using D = NumericDtype;
  int64_t count = 0;
  // bf16 positions: 8 significant bits, so 0..256 are exact and 257 rounds to 256.
  auto first = rope_row_collisions(f, {D::f32, D::bf16, D::f32, D::f32}, 0, 1024, 4, &count);
  ASSERT_FALSE(first.empty());
  EXPECT_EQ(first.front(), 257);
  EXPECT_EQ(first, (std::vector<int64_t>{257, 260, 261, 264}));  // ties to even: 259 -> 260, 261 -> 260
  // [0, 1024] holds 513 bf16 values (0..256, then 128 per octave, and 1024): 1025 - 513 positions collide.
  EXPECT_EQ(count, 1025 - 513);
  // The whole module in bf16 collides at the same place; fp16 at 2049; float32 at 2^24 + 1.
  EXPECT_EQ(rope_row_collisions(f, rope_numerics(AnglePrecision::bf16), 0, 4096, 1).front(), 257);
  EXPECT_EQ(rope_row_collisions(f, {D::f32, D::f16, D::f32, D::f32}, 0, 4096, 1).front(), 2049);
  EXPECT_EQ(rope_row_collisions(f, rope_numerics(AnglePrecision::fp16), 0, 4096, 1).front(), 2049);
  const int64_t two24 = int64_t{1} << 24;
  EXPECT_EQ(rope_row_collisions(f, rope_numerics(AnglePrecision::float32), two24 - 100, two24 + 100, 1).front(),
            two24 + 1);
  // Double positions and float32 ones below 2^24 never collide.
  EXPECT_TRUE(rope_row_collisions(f, rope_numerics(AnglePrecision::fp64), two24 - 100, two24 + 100, 1).empty());
  EXPECT_TRUE(rope_row_collisions(f, rope_numerics(AnglePrecision::float32), 0, 1 << 20, 1, &count).empty());
  EXPECT_EQ(count, 0);
}

TEST(PrecisionReport, BucketsAndFigures) {
  const auto b = precision_buckets(0, 1 << 20);
  ASSERT_EQ(b.size(), 18u);
  EXPECT_EQ(b.front(), (std::pair<int64_t, int64_t>{0, 15}));
  EXPECT_EQ(b[1], (std::pair<int64_t, int64_t>{16, 31}));
  EXPECT_EQ(b[16], (std::pair<int64_t, int64_t>{1 << 19, (1 << 20) - 1}));
  EXPECT_EQ(b.back(), (std::pair<int64_t, int64_t>{1 << 20, 1 << 20}));
  EXPECT_EQ(precision_buckets(100, 200).front(), (std::pair<int64_t, int64_t>{100, 127}));

  const RopeFrequencies f = compute_rope_frequencies(llama31());
  PrecisionOptions o;
  o.last_position = 1 << 16;
  o.modes = {"float32", "exact", "bf16", "bf16-table", "fp16"};
  o.samples_per_bucket = 64;
  const PrecisionReport rep = rope_precision_report(f, o);
  ASSERT_EQ(rep.modes.size(), 5u);
  const auto& fl = rep.modes[0];
  const auto& ex = rep.modes[1];
  const auto& bf = rep.modes[2];
  const auto& bt = rep.modes[3];
  const auto& fp = rep.modes[4];
  // Position 0: cos 1, sin 0 in every mode: no error.
  EXPECT_EQ(fl.buckets[0].lo, 0);
  // float32 grows with the angle; exact stays below it; the bf16 table is
  // bounded by half a bf16 ulp of 1 (2^-9) plus float32's error.
  // (2^16 itself is a power of two: its float32 product is exact, so compare the bucket below.)
  const auto& top_fl = fl.buckets[fl.buckets.size() - 2];
  const auto& top_ex = ex.buckets[ex.buckets.size() - 2];
  EXPECT_GT(top_fl.cos_sin_max, top_ex.cos_sin_max);
  EXPECT_GT(fl.buckets.back().cos_sin_max, fl.buckets[2].cos_sin_max);
  for (const auto& bk : bt.buckets) EXPECT_LE(bk.cos_sin_max, 0x1p-9 + 1e-2) << bk.lo;
  EXPECT_GT(bt.buckets[1].cos_sin_max, 1e-3);  // a bf16 table is off by ~2^-9 at once
  // The bf16 module has lost the angle entirely at 2^16: errors of order 1.
  EXPECT_GT(bf.buckets.back().cos_sin_max, 0.5);
  EXPECT_GT(bf.buckets.back().score_max, 1e-2);
  EXPECT_EQ(bf.first_collision, 257);
  EXPECT_EQ(fp.first_collision, 2049);
  EXPECT_FALSE(fl.first_collision.has_value());
  // fp16 positions above 65504 are inf: the last bucket (65536) is non-finite.
  EXPECT_GT(fp.buckets.back().non_finite, 0);
  EXPECT_TRUE(std::isnan(fp.buckets.back().cos_sin_max));  // nothing finite left to measure
  // Scores of unit vectors: errors are bounded by 2 (|q·k| <= 1 each).
  for (const auto& m : rep.modes)
    for (const auto& bk : m.buckets)
      if (!std::isnan(bk.score_max)) {
        EXPECT_LE(bk.score_max, 2.0) << m.name;
      }

  const json j = json::parse(precision_report_json(rep));
  EXPECT_EQ(j.at("schema"), "posenc.precision/1");
  EXPECT_EQ(j.at("modes").size(), 5u);
  EXPECT_EQ(j.at("modes")[2].at("first_collision"), 257);
  EXPECT_FALSE(j.at("modes")[2].at("sources").empty());
  EXPECT_NE(format_precision_report(rep).find("bf16-table"), std::string::npos);
  EXPECT_THROW(find_rope_numerics_preset("bf15"), ConfigError);
}

TEST(CliPrecision, Llama31EndToEnd) {
  ScratchDir dir;
  const auto out = dir / "precision.json";
  const auto png = dir / "precision.png";
  // Five modes keep the scan of 2^20 positions to a few seconds.
  const CliResult r = run_cli({"precision", "--config", shared_config("llama-3.1-8b.json").string(), "--positions",
                               "0:1M", "--samples", "64", "--modes", "float32,exact,bf16,fp16,bf16-positions",
                               "--json", out.string(), "--plot", png.string()});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("collisions"), std::string::npos) << r.out;
  const json j = json::parse(posenc::test::slurp(out));
  EXPECT_EQ(j.at("rope").at("rope_type"), "llama3");
  EXPECT_EQ(j.at("options").at("last_position"), 1 << 20);
  std::map<std::string, json> modes;
  for (const auto& m : j.at("modes")) modes[m.at("name").get<std::string>()] = m;
  EXPECT_EQ(modes.at("bf16").at("first_collision"), 257);
  EXPECT_EQ(modes.at("bf16-positions").at("first_collision"), 257);
  EXPECT_EQ(modes.at("fp16").at("first_collision"), 2049);
  EXPECT_TRUE(modes.at("float32").at("first_collision").is_null());
  EXPECT_TRUE(modes.at("exact").at("first_collision").is_null());
  // exact against fp64 near 2^20: the float32 inv_freq's ~3e-2.
  const double top = modes.at("exact").at("buckets").back().at("cos_sin_max").get<double>();
  EXPECT_GT(top, 5e-3);
  EXPECT_LT(top, 1e-1);
  const std::string head = posenc::test::slurp(png).substr(0, 8);
  EXPECT_EQ(head, std::string("\x89PNG\r\n\x1a\n", 8));
  // Bad input.
  const CliResult bad = run_cli({"precision", "--config", shared_config("llama-3.1-8b.json").string(), "--modes",
                                 "bf17"});
  EXPECT_EQ(bad.exit_code, 2);
  EXPECT_NE(bad.err.find("bf17"), std::string::npos) << bad.err;
  const CliResult no_rope = run_cli({"precision", "--config", shared_config("gpt2-large.json").string()});
  EXPECT_EQ(no_rope.exit_code, 1);
  EXPECT_NE(no_rope.err.find("no RoPE"), std::string::npos) << no_rope.err;
}

}  // namespace POSENC_UNITY_ID
