// Scaling methods: properties (HF test_modeling_rope_utils.py style), typed
// errors naming the field, and the forward-path schedule (dynamic/longrope).
#include <cmath>
#include <limits>
#include <numbers>
#include <string>

#include <gtest/gtest.h>

#include "posenc/error.hpp"
#include "posenc/scaling.hpp"

namespace POSENC_UNITY_ID {  // this file's own namespace in the tests' unity build (CMakeLists.txt)

using namespace posenc;

namespace {

RopeParams llama_params(int head_dim = 128, double theta = 10000.0) {
  RopeParams p;
  p.head_dim = head_dim;
  p.rope_theta = theta;
  p.max_position_embeddings = 4096;
  return p;
}

std::vector<float> default_inv(const RopeParams& base) {
  RopeParams d = base;
  d.rope_type = "default";
  return compute_rope_frequencies(d).inv_freq;
}

// Expects a ConfigError whose message contains every needle.
void expect_config_error(const RopeParams& p, std::initializer_list<std::string> needles,
                         std::optional<int64_t> seq_len = std::nullopt) {
  try {
    compute_rope_frequencies(p, seq_len);
    ADD_FAILURE() << "expected ConfigError for rope_type " << p.rope_type;
  } catch (const ConfigError& e) {
    const std::string msg = e.what();
    for (const auto& n : needles) EXPECT_NE(msg.find(n), std::string::npos) << "message: " << msg << "\nmissing: " << n;
  }
}

}  // namespace

TEST(Scaling, RegistryNamesAndSeqLenDependence) {
  std::vector<std::string> names;
  for (const auto& m : rope_scalings()) {
    names.emplace_back(m.name);
    EXPECT_EQ(m.depends_on_seq_len, m.name == "dynamic" || m.name == "longrope") << m.name;
    EXPECT_EQ(&find_rope_scaling(m.name), &m);
  }
  EXPECT_EQ(names, (std::vector<std::string>{"default", "linear", "ntk", "dynamic", "yarn", "longrope",
                                             "llama3", "proportional"}));
}

TEST(Scaling, LinearIsDefaultOverFactorForEveryFactor) {
  for (double s : {1.0, 1.5, 2.0, 8.0, 40.0}) {
    RopeParams p = llama_params();
    p.rope_type = "linear";
    p.factor = s;
    const auto d = default_inv(p);
    const auto l = compute_rope_frequencies(p).inv_freq;
    for (std::size_t i = 0; i < d.size(); ++i) EXPECT_EQ(l[i], d[i] / static_cast<float>(s));
  }
}

TEST(Scaling, DynamicEqualsDefaultAtOrBelowOriginalLength) {
  for (double s : {1.5, 1.7, 2.0, 4.0, 8.0}) {
    RopeParams p = llama_params(64, 500000.0);
    p.rope_type = "dynamic";
    p.factor = s;
    const auto d = default_inv(p);
    for (std::optional<int64_t> len : {std::optional<int64_t>{}, std::optional<int64_t>{1},
                                       std::optional<int64_t>{2048}, std::optional<int64_t>{4096}})
      EXPECT_EQ(compute_rope_frequencies(p, len).inv_freq, d) << "factor " << s;
    // Above it every channel but the first rotates slower, monotonically in the length.
    const auto a = compute_rope_frequencies(p, 8192).inv_freq;
    const auto b = compute_rope_frequencies(p, 16384).inv_freq;
    EXPECT_EQ(a[0], 1.0f);
    for (std::size_t i = 1; i < d.size(); ++i) {
      EXPECT_LT(a[i], d[i]);
      EXPECT_LT(b[i], a[i]);
    }
  }
}

TEST(Scaling, YarnLiesBetweenInterpolationAndExtrapolation) {
  struct Cfg { int dim; double theta; double factor; int64_t orig; std::optional<double> bf, bs; };
  for (const Cfg& c : {Cfg{128, 10000.0, 4.0, 4096, {}, {}}, Cfg{64, 1e6, 2.0, 4096, 16.0, 0.5},
                       Cfg{64, 10000.0, 40.0, 4096, 32.0, 1.0}, Cfg{64, 150000.0, 32.0, 4096, {}, {}}}) {
    RopeParams p = llama_params(c.dim, c.theta);
    p.rope_type = "yarn";
    p.factor = c.factor;
    p.original_max_position_embeddings = c.orig;
    p.beta_fast = c.bf;
    p.beta_slow = c.bs;
    const auto d = default_inv(p);
    const auto y = compute_rope_frequencies(p).inv_freq;
    const float s = static_cast<float>(c.factor);
    for (std::size_t i = 0; i < d.size(); ++i) {
      const float lo = 1.0f / (s * (1.0f / d[i]));  // HF's interpolation 1/(s*pos_freq)
      EXPECT_GE(y[i], std::nextafter(std::min(lo, d[i] / s), 0.0f)) << "dim " << c.dim << " i " << i;
      EXPECT_LE(y[i], std::nextafter(d[i], 1.0f)) << "dim " << c.dim << " i " << i;
    }
    EXPECT_EQ(y.front(), d.front());                   // fastest channel extrapolates
    EXPECT_NEAR(y.back(), d.back() / s, 1e-7 * d.back());  // slowest interpolates
  }
  // A huge beta_fast pulls the ramp's start (low) down to channel 0: only
  // channel 0 keeps its frequency, every other channel is (partly)
  // interpolated, fully from high = ceil(d ln(orig/2pi) / (2 ln theta)) on.
  RopeParams p = llama_params(64);
  p.rope_type = "yarn";
  p.factor = 10.0;
  p.original_max_position_embeddings = 4096;
  p.beta_fast = 1e9;
  const auto d = default_inv(p);
  const auto y = compute_rope_frequencies(p).inv_freq;
  const int high = static_cast<int>(std::ceil(64 * std::log(4096 / (2 * std::numbers::pi)) / (2 * std::log(10000.0))));
  ASSERT_LT(high, 32);
  EXPECT_EQ(y[0], d[0]);
  for (std::size_t i = 1; i < y.size(); ++i) {
    EXPECT_LT(y[i], d[i]) << i;
    if (static_cast<int>(i) >= high) {
      EXPECT_NEAR(y[i], d[i] / 10.0f, 1e-6 * d[i]) << i;
    }
  }
}

TEST(Scaling, YarnAttentionFactorRules) {
  RopeParams p = llama_params(64);
  p.rope_type = "yarn";
  p.original_max_position_embeddings = 4096;
  p.factor = 40.0;
  EXPECT_DOUBLE_EQ(compute_rope_frequencies(p).attention_factor, 0.1 * std::log(40.0) + 1.0);
  p.mscale = 0.707;  // lone mscale: ignored
  EXPECT_DOUBLE_EQ(compute_rope_frequencies(p).attention_factor, 0.1 * std::log(40.0) + 1.0);
  p.mscale_all_dim = 0.707;  // both equal: ratio 1
  EXPECT_DOUBLE_EQ(compute_rope_frequencies(p).attention_factor, 1.0);
  p.attention_factor = 1.25;  // explicit wins
  EXPECT_DOUBLE_EQ(compute_rope_frequencies(p).attention_factor, 1.25);
  // DeepSeek softmax scale: qk_head_dim^-0.5 * g(40, mscale_all_dim)^2
  const double g = 0.1 * 0.707 * std::log(40.0) + 1.0;
  EXPECT_DOUBLE_EQ(deepseek_yarn_softmax_scale(192, p), std::pow(192.0, -0.5) * g * g);
  p.factor.reset();  // factor from max_position_embeddings / original
  p.attention_factor.reset();
  p.mscale.reset();
  p.mscale_all_dim.reset();
  p.max_position_embeddings = 32768;
  EXPECT_DOUBLE_EQ(compute_rope_frequencies(p).attention_factor, 0.1 * std::log(8.0) + 1.0);
}

TEST(Scaling, Llama3KeepsHighFrequencyAndDividesLowFrequency) {
  RopeParams p = llama_params(128, 500000.0);
  p.rope_type = "llama3";
  p.factor = 8.0;
  p.low_freq_factor = 1.0;
  p.high_freq_factor = 4.0;
  p.original_max_position_embeddings = 8192;
  const auto d = default_inv(p);
  const auto l = compute_rope_frequencies(p).inv_freq;
  int high = 0, low = 0, medium = 0;
  for (std::size_t i = 0; i < d.size(); ++i) {
    const double wavelen = 2 * std::numbers::pi / d[i];
    if (wavelen < 8192.0 / 4.0) {
      EXPECT_EQ(l[i], d[i]) << "high-frequency channel " << i << " must be unchanged";
      ++high;
    } else if (wavelen > 8192.0 / 1.0) {
      EXPECT_EQ(l[i], d[i] / 8.0f) << "low-frequency channel " << i;
      ++low;
    } else {
      EXPECT_LE(l[i], d[i]);
      EXPECT_GE(l[i], d[i] / 8.0f);
      ++medium;
    }
  }
  EXPECT_GT(high, 0);
  EXPECT_GT(low, 0);
  EXPECT_GT(medium, 0);
}

TEST(Scaling, ProportionalSpansHeadWithZeroTail) {
  RopeParams p = llama_params(64, 1e6);
  p.rope_type = "proportional";
  p.partial_rotary_factor = 0.25;
  const RopeFrequencies f = compute_rope_frequencies(p);
  EXPECT_EQ(f.rotary_dim, 64);
  ASSERT_EQ(f.inv_freq.size(), 32u);
  RopeParams full = llama_params(64, 1e6);
  const auto d = compute_rope_frequencies(full).inv_freq;
  for (std::size_t i = 0; i < 32; ++i) EXPECT_EQ(f.inv_freq[i], i < 8 ? d[i] : 0.0f) << i;
  p.factor = 2.0;
  EXPECT_EQ(compute_rope_frequencies(p).inv_freq[1], d[1] / 2.0f);
  p.partial_rotary_factor = 0.0;  // allowed: no rotation at all
  for (float v : compute_rope_frequencies(p).inv_freq) EXPECT_EQ(v, 0.0f);
}

TEST(Scaling, LongropeSwitchesStrictlyAboveOriginal) {
  RopeParams p = llama_params(16);
  p.rope_type = "longrope";
  p.max_position_embeddings = 131072;
  p.original_max_position_embeddings = 4096;
  p.short_factor = {1, 1, 1, 1, 1, 1, 1, 1};
  p.long_factor = {1, 2, 3, 4, 5, 6, 7, 8};
  const auto d = default_inv(p);
  for (std::optional<int64_t> len : {std::optional<int64_t>{}, std::optional<int64_t>{0},
                                     std::optional<int64_t>{4096}})
    EXPECT_EQ(compute_rope_frequencies(p, len).inv_freq, d);
  const auto l = compute_rope_frequencies(p, 4097).inv_freq;
  for (std::size_t i = 0; i < d.size(); ++i) EXPECT_NEAR(l[i], d[i] / static_cast<float>(i + 1), 1e-6 * d[i]) << i;
  EXPECT_DOUBLE_EQ(compute_rope_frequencies(p).attention_factor,
                   std::sqrt(1 + std::log(32.0) / std::log(4096.0)));
}

TEST(ScalingErrors, NameTheFieldAndValue) {
  RopeParams p = llama_params(96);
  p.rope_type = "longrope";
  p.original_max_position_embeddings = 4096;
  p.short_factor.assign(48, 1.0);
  p.long_factor.assign(47, 1.0);
  expect_config_error(p, {"rope_scaling.long_factor: expected 48 entries", "got 47"});
  p.long_factor.assign(48, 1.0);
  p.short_factor[3] = -1.0;
  expect_config_error(p, {"rope_scaling.short_factor[3]", "-1"});
  p.short_factor.clear();
  expect_config_error(p, {"rope_scaling.short_factor", "missing"});

  for (const char* type : {"linear", "dynamic", "yarn", "llama3", "ntk"}) {
    RopeParams q = llama_params();
    q.rope_type = type;
    q.original_max_position_embeddings = 1024;
    q.low_freq_factor = 1.0;
    q.high_freq_factor = 4.0;
    for (double bad : {0.0, -2.0, std::nan(""), std::numeric_limits<double>::infinity()}) {
      q.factor = bad;
      expect_config_error(q, {"rope_scaling.factor", "must be finite and > 0"});
    }
  }
  RopeParams q = llama_params();
  q.rope_type = "llama3";
  q.factor = 8.0;
  q.high_freq_factor = 4.0;
  expect_config_error(q, {"rope_scaling.low_freq_factor", "missing"});
  q.low_freq_factor = 5.0;  // high < low; high == low is Llama 4's step (ConfigForms.Llama4...)
  expect_config_error(q, {"rope_scaling.high_freq_factor", "low_freq_factor"});

  RopeParams y = llama_params();
  y.rope_type = "yarn";
  y.factor = 4.0;
  y.beta_fast = 1.0;
  y.beta_slow = 32.0;
  expect_config_error(y, {"rope_scaling.beta_fast", "beta_slow"});
  y.beta_fast.reset();
  y.beta_slow.reset();
  y.attention_factor = -1.0;
  expect_config_error(y, {"rope_scaling.attention_factor", "-1"});
  y.attention_factor.reset();
  y.factor.reset();
  y.max_position_embeddings.reset();
  y.original_max_position_embeddings = 4096;
  expect_config_error(y, {"rope_scaling.factor", "max_position_embeddings"});

  RopeParams dyn = llama_params();
  dyn.rope_type = "dynamic";
  dyn.factor = 2.0;
  dyn.max_position_embeddings.reset();
  expect_config_error(dyn, {"max_position_embeddings", "missing"});

  RopeParams prf = llama_params(64);
  prf.partial_rotary_factor = 1.5;
  expect_config_error(prf, {"partial_rotary_factor", "1.5"});
  prf.partial_rotary_factor = 0.3;  // 64*0.3 = 19: odd
  expect_config_error(prf, {"rotary_dim", "19"});
  prf.partial_rotary_factor = 0.5;
  prf.rotary_dim = 16;
  expect_config_error(prf, {"rotary_dim", "disagrees", "32"});

  RopeParams prop = llama_params(64);
  prop.rope_type = "proportional";
  prop.rotary_dim = 16;
  expect_config_error(prop, {"rotary_dim", "proportional"});

  RopeParams neg = llama_params();
  expect_config_error(neg, {"seq_len", "-1"}, -1);
  neg.rope_theta = 0;
  expect_config_error(neg, {"rope_theta"});
}

TEST(RopeSchedule, DynamicGrowsAndResetsLikeHuggingFace) {
  RopeParams p;
  p.rope_type = "dynamic";
  p.factor = 2.0;
  p.head_dim = 16;
  p.max_position_embeddings = 32;
  RopeFrequencySchedule s(p);
  EXPECT_TRUE(s.depends_on_seq_len());
  const auto original = s.current().inv_freq;
  EXPECT_EQ(s.generation(), 0u);
  s.update(std::vector<int64_t>{0, 5, 31});  // L = 32: no change
  EXPECT_EQ(s.current().inv_freq, original);
  EXPECT_EQ(s.generation(), 0u);
  s.update(std::vector<int64_t>{0, 99});  // L = 100: growth
  EXPECT_EQ(s.max_seq_len_cached(), 100);
  EXPECT_EQ(s.generation(), 1u);
  const auto grown = s.current().inv_freq;
  EXPECT_LT(grown[1], original[1]);
  // The forward path's float32 base' (not the direct call's double one).
  EXPECT_EQ(grown, dynamic_ntk_frequencies(p, 100, DynamicNtkArithmetic::tensor_float32).inv_freq);
  {
    // At L = 64 the two arithmetics differ in the last ulp of some channels
    // (rope_forward.json dynamic_above_max_recomputes); the schedule uses float32.
    RopeFrequencySchedule fresh(p);
    const auto f32 = dynamic_ntk_frequencies(p, 64, DynamicNtkArithmetic::tensor_float32).inv_freq;
    EXPECT_NE(f32, dynamic_ntk_frequencies(p, 64, DynamicNtkArithmetic::python_double).inv_freq);
    EXPECT_EQ(fresh.update_for_length(64).inv_freq, f32);
  }
  s.update(std::vector<int64_t>{40});  // L = 41: not > 100, not < 32: keep
  EXPECT_EQ(s.current().inv_freq, grown);
  s.update(std::vector<int64_t>{50});  // keep
  EXPECT_EQ(s.generation(), 1u);
  s.update(std::vector<int64_t>{2});  // L = 3 < 32 after growth: reset
  EXPECT_EQ(s.current().inv_freq, original);
  EXPECT_EQ(s.max_seq_len_cached(), 32);
  EXPECT_EQ(s.generation(), 2u);
  EXPECT_THROW(s.update(std::vector<int64_t>{}), PositionError);
  EXPECT_THROW(s.update(std::vector<int64_t>{3, -1}), PositionError);
}

TEST(RopeSchedule, LongropeSwitchesAndKeepsAttentionScaling) {
  RopeParams p;
  p.rope_type = "longrope";
  p.head_dim = 16;
  p.max_position_embeddings = 512;
  p.original_max_position_embeddings = 64;
  p.short_factor = {1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.1, 3.8};
  p.long_factor = {1.0, 1.5, 2.2, 3.0, 4.5, 6.0, 8.0, 10.0};
  RopeFrequencySchedule s(p);
  const RopeFrequencies shorts = s.current();
  EXPECT_EQ(s.update(std::vector<int64_t>{63}).inv_freq, shorts.inv_freq);  // L = 64: short
  const RopeFrequencies longs = s.update(std::vector<int64_t>{64});          // L = 65: long
  EXPECT_EQ(longs.inv_freq, compute_rope_frequencies(p, 65).inv_freq);
  EXPECT_EQ(longs.attention_factor, shorts.attention_factor);
  EXPECT_EQ(s.generation(), 1u);
  EXPECT_EQ(s.update(std::vector<int64_t>{1}).inv_freq, shorts.inv_freq);  // back to short
  EXPECT_EQ(s.generation(), 2u);
}

TEST(RopeSchedule, StaticTypesNeverChange) {
  RopeParams p;
  p.rope_type = "yarn";
  p.head_dim = 32;
  p.factor = 4.0;
  p.original_max_position_embeddings = 64;
  p.max_position_embeddings = 256;
  RopeFrequencySchedule s(p);
  EXPECT_FALSE(s.depends_on_seq_len());
  const RopeFrequencies f = s.current();
  for (int64_t len : {1, 64, 65, 1000000}) EXPECT_EQ(s.update_for_length(len), f);
  EXPECT_EQ(s.generation(), 0u);
}

}  // namespace POSENC_UNITY_ID
