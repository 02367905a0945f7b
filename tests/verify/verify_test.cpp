// posenc verify: every catalogue entry is recognised as the top hypothesis on
// tensors made with that mistake applied on purpose (through posenc's public
// RoPE API, not through the catalogue's own re-computation), the correct
// implementation passes in f32/f16/bf16, and bad dumps are DumpErrors naming
// the array.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <random>
#include <set>

#include <nlohmann/json.hpp>

#include "posenc/error.hpp"
#include "posenc/float16.hpp"
#include "posenc/rope.hpp"
#include "posenc/scaling.hpp"
#include "posenc/verify.hpp"
#include "../test_support.hpp"
#include "verify/mistakes.hpp"

namespace posenc {
namespace {

constexpr int kHeadDim = 64;
constexpr int kHeads = 2;

std::vector<float> random_q(int64_t tokens, int heads, int head_dim, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> n(0.0f, 1.0f);
  std::vector<float> q(static_cast<std::size_t>(tokens * heads * head_dim));
  for (float& x : q) x = n(rng);
  return q;
}

DumpArray array(std::string name, std::vector<int64_t> shape, const std::vector<float>& v,
                DumpDtype dtype = DumpDtype::f32) {
  DumpArray a;
  a.name = std::move(name);
  a.dtype = dtype;
  a.shape = std::move(shape);
  for (float x : v) {
    const float r = dtype == DumpDtype::bf16 ? round_to_bf16(x) : dtype == DumpDtype::f16 ? round_to_f16(x) : x;
    a.values.push_back(r);
  }
  return a;
}

DumpArray positions_array(const std::vector<int64_t>& p, std::vector<int64_t> shape = {}) {
  DumpArray a;
  a.name = "position_ids";
  a.dtype = DumpDtype::i64;
  a.shape = shape.empty() ? std::vector<int64_t>{static_cast<int64_t>(p.size())} : shape;
  for (int64_t x : p) a.values.push_back(static_cast<double>(x));
  return a;
}

std::vector<int64_t> iota_positions(int64_t n, int64_t start = 0) {
  std::vector<int64_t> p(static_cast<std::size_t>(n));
  for (int64_t i = 0; i < n; ++i) p[static_cast<std::size_t>(i)] = start + i;
  return p;
}

RopeParams llama31_params() {
  RopeParams p;
  p.rope_type = "llama3";
  p.rope_theta = 500000.0;
  p.head_dim = kHeadDim;
  p.factor = 8.0;
  p.low_freq_factor = 1.0;
  p.high_freq_factor = 4.0;
  p.original_max_position_embeddings = 8192;
  p.max_position_embeddings = 131072;
  return p;
}

RopeParams default_params(int rotary_dim = 0) {
  RopeParams p;
  p.rope_theta = 10000.0;
  p.head_dim = kHeadDim;
  p.rotary_dim = rotary_dim;
  return p;
}

RopeParams yarn_params() {
  RopeParams p;
  p.rope_type = "yarn";
  p.rope_theta = 10000.0;
  p.head_dim = kHeadDim;
  p.factor = 16.0;
  p.original_max_position_embeddings = 64;
  p.max_position_embeddings = 1024;
  return p;
}

RopeParams dynamic_params() {
  RopeParams p;
  p.rope_type = "dynamic";
  p.rope_theta = 10000.0;
  p.head_dim = kHeadDim;
  p.factor = 4.0;
  p.max_position_embeddings = 64;
  return p;
}

RopeParams longrope_params() {
  RopeParams p;
  p.rope_type = "longrope";
  p.rope_theta = 10000.0;
  p.head_dim = kHeadDim;
  p.original_max_position_embeddings = 64;
  p.max_position_embeddings = 1024;
  for (int i = 0; i < kHeadDim / 2; ++i) {
    p.short_factor.push_back(1.0 + 0.01 * i);
    p.long_factor.push_back(1.0 + 0.5 * i);
  }
  return p;
}

/// HF's reference frequencies for these positions (the schedule over all of them).
RopeFrequencies scheduled(const RopeParams& p, const std::vector<int64_t>& positions) {
  RopeFrequencySchedule s(p);
  return s.update(positions);
}

/// q rotated by `freqs` at `positions` in float32.
std::vector<float> rotate(std::vector<float> q, const RopeFrequencies& freqs, const std::vector<int64_t>& positions,
                          RopeLayout layout, int heads = kHeads) {
  apply_rope(q.data(), static_cast<int64_t>(positions.size()), heads, freqs, positions, layout,
             AnglePrecision::float32);
  return q;
}

/// q rotated through a table of the given numerics.
std::vector<float> rotate_with(std::vector<float> q, const RopeFrequencies& freqs,
                               const std::vector<int64_t>& positions, RopeLayout layout, RopeNumerics numerics,
                               int heads = kHeads) {
  const std::size_t n = positions.size() * static_cast<std::size_t>(freqs.n_pairs());
  std::vector<float> c(n), s(n);
  rope_cos_sin_with(freqs, positions, numerics, c, s);
  const RopeTable t = RopeTable::from_cos_sin(static_cast<int64_t>(positions.size()), freqs.n_pairs(), c, s,
                                              AnglePrecision::float32);
  apply_rope(q.data(), static_cast<int64_t>(positions.size()), heads, freqs.head_dim, t, layout);
  return q;
}

struct MistakeCase {
  std::string id;       // expected top hypothesis
  RopeParams params;    // the config
  RopeLayout layout = RopeLayout::half;
  std::vector<int64_t> positions;
  /// The engine's (buggy) rotation of q, made with posenc's public API.
  std::function<std::vector<float>(const std::vector<float>& q)> buggy;
};

std::vector<MistakeCase> cases() {
  std::vector<MistakeCase> out;
  const auto P64 = iota_positions(64);
  const auto P_long = iota_positions(48, 8150);  // across Llama-3's original 8192
  {
    MistakeCase c{"layout_swapped", llama31_params(), RopeLayout::half, P_long, {}};
    c.buggy = [c](const std::vector<float>& q) {
      return rotate(q, scheduled(c.params, c.positions), c.positions, RopeLayout::interleaved);
    };
    out.push_back(c);
  }
  {
    MistakeCase c{"rotary_full_instead_of_partial", default_params(16), RopeLayout::half, P64, {}};
    c.buggy = [c](const std::vector<float>& q) {
      return rotate(q, default_rope_frequencies(kHeadDim, kHeadDim, 10000.0), c.positions, c.layout);
    };
    out.push_back(c);
  }
  {
    MistakeCase c{"rotary_partial_instead_of_full", default_params(), RopeLayout::half, P64, {}};
    c.buggy = [c](const std::vector<float>& q) {
      return rotate(q, default_rope_frequencies(kHeadDim, kHeadDim / 2, 10000.0), c.positions, c.layout);
    };
    out.push_back(c);
  }
  {
    MistakeCase c{"rotary_partial_head_dim_exponent", default_params(16), RopeLayout::half, P64, {}};
    c.buggy = [c](const std::vector<float>& q) {
      RopeFrequencies f = default_rope_frequencies(kHeadDim, kHeadDim, 10000.0);
      f.inv_freq.resize(8);  // the first 8 pairs of theta^(-2i/64) on a 16-wide rotary part
      f.inv_freq_f64.clear();  // hand-made frequencies have no double twin
      f.rotary_dim = 16;
      return rotate(q, f, c.positions, c.layout);
    };
    out.push_back(c);
  }
  for (auto [id, power] : {std::pair{"attention_factor_missing", 0.0}, std::pair{"attention_factor_squared", 2.0},
                           std::pair{"attention_factor_sqrt", 0.5}}) {
    MistakeCase c{id, yarn_params(), RopeLayout::half, P64, {}};
    c.buggy = [c, power](const std::vector<float>& q) {
      RopeFrequencies f = scheduled(c.params, c.positions);
      f.attention_factor = std::pow(f.attention_factor, power);
      return rotate(q, f, c.positions, c.layout);
    };
    out.push_back(c);
  }
  {
    MistakeCase c{"dynamic_ntk_wrong_length", dynamic_params(), RopeLayout::half, iota_positions(100), {}};
    c.buggy = [c](const std::vector<float>& q) {
      // vLLM's DynamicNTKScalingRotaryEmbedding: the base at max_position_embeddings x factor.
      return rotate(q, compute_rope_frequencies(c.params, 256), c.positions, c.layout);
    };
    out.push_back(c);
  }
  {
    MistakeCase c{"llama3_bands_missing", llama31_params(), RopeLayout::half, P_long, {}};
    c.buggy = [c](const std::vector<float>& q) {
      return rotate(q, default_rope_frequencies(kHeadDim, kHeadDim, 500000.0), c.positions, c.layout);
    };
    out.push_back(c);
  }
  {
    RopeParams p32 = llama31_params();
    p32.factor = 32.0;  // Llama-3.2-1B
    MistakeCase c{"llama3_bands_wrong", p32, RopeLayout::half, P_long, {}};
    c.buggy = [c](const std::vector<float>& q) {
      RopeParams p8 = c.params;
      p8.factor = 8.0;  // llama-models#241: factor 8 hard-coded
      return rotate(q, compute_rope_frequencies(p8), c.positions, c.layout);
    };
    out.push_back(c);
  }
  {
    MistakeCase c{"yarn_ramp_wrong_space", yarn_params(), RopeLayout::half, P64, {}};
    c.buggy = [c](const std::vector<float>& q) {
      RopeFrequencies f = scheduled(c.params, c.positions);
      f.inv_freq = detail::yarn_inv_freq_variant(c.params, true);
      f.inv_freq_f64.clear();
      return rotate(q, f, c.positions, c.layout);
    };
    out.push_back(c);
  }
  {
    MistakeCase c{"yarn_truncate_ignored", yarn_params(), RopeLayout::half, P64, {}};
    c.params.truncate = false;  // gpt-oss ships truncate false; the engine truncates anyway
    c.buggy = [c](const std::vector<float>& q) {
      RopeParams p = c.params;
      p.truncate = true;
      return rotate(q, compute_rope_frequencies(p), c.positions, c.layout);
    };
    out.push_back(c);
  }
  {
    MistakeCase c{"longrope_factors_swapped", longrope_params(), RopeLayout::half, P64, {}};
    c.buggy = [c](const std::vector<float>& q) {
      RopeParams p = c.params;
      std::swap(p.short_factor, p.long_factor);  // 64 positions <= 64: short is right, long is used
      return rotate(q, scheduled(p, c.positions), c.positions, c.layout);
    };
    out.push_back(c);
  }
  {
    MistakeCase c{"frequency_exponent_off", default_params(), RopeLayout::interleaved, P64, {}};
    c.buggy = [c](const std::vector<float>& q) {
      RopeFrequencies f = default_rope_frequencies(kHeadDim, kHeadDim, 10000.0);
      for (int i = 0; i < kHeadDim / 2; ++i)  // 10000^(-2i/(d-2)): tensor2tensor's half_dim - 1
        f.inv_freq[static_cast<std::size_t>(i)] =
            1.0f / std::pow(10000.0f, static_cast<float>(2 * i) / static_cast<float>(kHeadDim - 2));
      return rotate(q, f, c.positions, c.layout);
    };
    out.push_back(c);
  }
  {
    MistakeCase c{"cos_sin_low_precision", llama31_params(), RopeLayout::half, P_long, {}};
    c.buggy = [c](const std::vector<float>& q) {
      using D = NumericDtype;
      return rotate_with(q, scheduled(c.params, c.positions), c.positions, c.layout, {D::f32, D::f32, D::f32, D::f16});
    };
    out.push_back(c);
  }
  {
    MistakeCase c{"inv_freq_bf16", llama31_params(), RopeLayout::half, P_long, {}};
    c.buggy = [c](const std::vector<float>& q) {
      RopeFrequencies f = scheduled(c.params, c.positions);
      for (float& x : f.inv_freq) x = round_to_bf16(x);  // model.to(torch.bfloat16) on the buffer
      return rotate(q, f, c.positions, c.layout);
    };
    out.push_back(c);
  }
  {
    MistakeCase c{"positions_bf16", llama31_params(), RopeLayout::half, iota_positions(40, 1000), {}};
    c.buggy = [c](const std::vector<float>& q) {
      std::vector<int64_t> rounded;
      for (int64_t p : c.positions) rounded.push_back(static_cast<int64_t>(round_to_bf16(static_cast<float>(p))));
      return rotate(q, scheduled(c.params, c.positions), rounded, c.layout);
    };
    out.push_back(c);
  }
  {
    MistakeCase c{"positions_offset", llama31_params(), RopeLayout::half, iota_positions(40, 10), {}};
    c.buggy = [c](const std::vector<float>& q) {
      std::vector<int64_t> shifted;
      for (int64_t p : c.positions) shifted.push_back(p + 3);
      return rotate(q, scheduled(c.params, c.positions), shifted, c.layout);
    };
    out.push_back(c);
  }
  {
    MistakeCase c{"positions_restart_per_chunk", llama31_params(), RopeLayout::half, iota_positions(48), {}};
    c.buggy = [c](const std::vector<float>& q) {
      std::vector<int64_t> restarted;
      for (int64_t p : c.positions) restarted.push_back(p % 16);
      return rotate(q, scheduled(c.params, c.positions), restarted, c.layout);
    };
    out.push_back(c);
  }
  return out;
}

struct Made {
  std::vector<DumpArray> correct, buggy;
};

Made make_dumps(const MistakeCase& c, DumpDtype dtype = DumpDtype::f32) {
  const int64_t T = static_cast<int64_t>(c.positions.size());
  const std::vector<float> q = random_q(T, kHeads, kHeadDim, 1234);
  const std::vector<int64_t> shape{T, kHeads, kHeadDim};
  const std::vector<float> good = rotate(q, scheduled(c.params, c.positions), c.positions, c.layout);
  Made m;
  m.correct = {array("q", shape, q, dtype), array("q_rope", shape, good, dtype), positions_array(c.positions)};
  m.buggy = {array("q", shape, q, dtype), array("q_rope", shape, c.buggy(q), dtype), positions_array(c.positions)};
  return m;
}

VerifyReference reference_of(const MistakeCase& c) {
  VerifyReference r;
  r.params = c.params;
  r.layout = c.layout;
  r.source = "test:" + c.id;
  return r;
}

TEST(VerifyCatalogue, EveryEntryIsTopOnItsOwnMistakeAndTheCorrectDumpPasses) {
  std::set<std::string> covered;
  for (const auto& c : cases()) {
    SCOPED_TRACE(c.id);
    const Made m = make_dumps(c);
    const VerifyReference ref = reference_of(c);
    const VerifyResult good = verify_rope(ref, m.correct, "correct.npz");
    EXPECT_TRUE(good.pass) << good.summary;
    EXPECT_LE(good.reference_residual, good.errors.front().tolerance);
    const VerifyResult bad = verify_rope(ref, m.buggy, "buggy.npz");
    EXPECT_FALSE(bad.pass) << bad.summary;
    ASSERT_FALSE(bad.hypotheses.empty());
    EXPECT_EQ(bad.hypotheses.front().id, c.id) << format_verify_report(bad);
    EXPECT_TRUE(bad.hypotheses.front().matches()) << format_verify_report(bad);
    EXPECT_NE(bad.summary.find("your output matches"), std::string::npos) << bad.summary;
    // The reference is far off, the hypothesis within the tolerance.
    EXPECT_GT(bad.reference_residual, 10 * bad.hypotheses.front().residual) << bad.summary;
    covered.insert(c.id);
  }
  // Left padding needs the batch layout: its own test below. Every other entry has a case here.
  for (const auto& m : detail::rope_mistakes())
    if (m.id != "positions_count_left_padding") {
      EXPECT_TRUE(covered.count(std::string(m.id))) << m.id;
    }
}

TEST(VerifyCatalogue, LeftPaddingCountedIsTopInTheBatchLayout) {
  // Two rows of 12 tokens, row 0 left-padded by 4: HF's position_ids are cumsum(mask)-1 with pads at 1.
  const int64_t B = 2, T = 12;
  std::vector<int64_t> pos;
  for (int64_t t = 0; t < T; ++t) pos.push_back(t < 4 ? 1 : t - 4);
  for (int64_t t = 0; t < T; ++t) pos.push_back(t);
  const RopeParams params = llama31_params();
  const RopeFrequencies f = scheduled(params, pos);
  const std::vector<float> q = random_q(B * T, kHeads, kHeadDim, 99);  // [b][t][h][d]
  std::vector<float> good, bad;
  for (int64_t b = 0; b < B; ++b) {
    std::vector<float> row(q.begin() + b * T * kHeads * kHeadDim, q.begin() + (b + 1) * T * kHeads * kHeadDim);
    std::vector<int64_t> row_pos(pos.begin() + b * T, pos.begin() + (b + 1) * T);
    auto g = rotate(row, f, row_pos, RopeLayout::half);
    auto w = rotate(row, f, iota_positions(T), RopeLayout::half);  // the padded index
    good.insert(good.end(), g.begin(), g.end());
    bad.insert(bad.end(), w.begin(), w.end());
  }
  // To [batch, heads, tokens, head_dim].
  auto bhtd = [&](const std::vector<float>& btHd) {
    std::vector<float> out(btHd.size());
    for (int64_t b = 0; b < B; ++b)
      for (int64_t t = 0; t < T; ++t)
        for (int h = 0; h < kHeads; ++h)
          for (int d = 0; d < kHeadDim; ++d)
            out[static_cast<std::size_t>(((b * kHeads + h) * T + t) * kHeadDim + d)] =
                btHd[static_cast<std::size_t>(((b * T + t) * kHeads + h) * kHeadDim + d)];
    return out;
  };
  const std::vector<int64_t> shape{B, kHeads, T, kHeadDim};
  VerifyReference ref;
  ref.params = params;
  ref.layout = RopeLayout::half;
  VerifyOptions opt;
  opt.dump_layout = DumpLayout::batch_heads_tokens_dim;
  const std::vector<DumpArray> correct{array("q", shape, bhtd(q)), array("q_rope", shape, bhtd(good)),
                                       positions_array(pos, {B, T})};
  const std::vector<DumpArray> buggy{array("q", shape, bhtd(q)), array("q_rope", shape, bhtd(bad)),
                                     positions_array(pos, {B, T})};
  const VerifyResult g = verify_rope(ref, correct, "padded.npz", opt);
  EXPECT_TRUE(g.pass) << g.summary;
  const VerifyResult r = verify_rope(ref, buggy, "padded.npz", opt);
  EXPECT_FALSE(r.pass);
  ASSERT_FALSE(r.hypotheses.empty());
  EXPECT_EQ(r.hypotheses.front().id, "positions_count_left_padding") << format_verify_report(r);
  EXPECT_TRUE(r.hypotheses.front().matches());
  // A constant offset fits row 0 only: it cannot explain both rows.
  for (const auto& h : r.hypotheses)
    if (h.id == "positions_offset") {
      EXPECT_FALSE(h.matches());
    }
  // By position: row 0's real tokens are wrong, row 1 (no padding) is exact.
  const ArrayError& e = r.errors.front();
  ASSERT_EQ(e.position_max.size(), static_cast<std::size_t>(B * T));
  EXPECT_GT(e.position_max[5], e.tolerance);
  for (int64_t t = 0; t < T; ++t) EXPECT_EQ(e.position_max[static_cast<std::size_t>(T + t)], 0.0);
}

TEST(VerifyCatalogue, EntriesCiteAReportOrSaySoneWasFound) {
  std::set<std::string> ids;
  for (const auto& m : rope_mistake_catalogue()) {
    EXPECT_TRUE(ids.insert(std::string(m.id)).second) << "duplicate id " << m.id;
    const bool url = m.report.rfind("https://github.com/", 0) == 0;
    const bool honest = m.report.rfind("no public report found", 0) == 0;
    EXPECT_TRUE(url || honest) << m.id << ": " << m.report;
  }
  EXPECT_GE(ids.size(), 14u);
}

TEST(VerifyCatalogue, VariantFormulasWithoutTheirKnobsAreTheReference) {
  // The catalogue's own YaRN/Llama-3 re-computations reduce to compute_rope_frequencies bit for bit.
  for (bool truncate : {true, false}) {
    RopeParams p = yarn_params();
    p.truncate = truncate;
    EXPECT_EQ(detail::yarn_inv_freq_variant(p, false), compute_rope_frequencies(p).inv_freq);
  }
  EXPECT_EQ(detail::llama3_inv_freq_variant(llama31_params(), false), compute_rope_frequencies(llama31_params()).inv_freq);
  // The wrong-space ramp: pairs with 2i past the correction range are fully interpolated (divided by factor).
  const RopeParams p = yarn_params();
  const auto wrong = detail::yarn_inv_freq_variant(p, true);
  const auto plain = default_rope_frequencies(kHeadDim, kHeadDim, 10000.0).inv_freq;
  EXPECT_FLOAT_EQ(wrong.back(), plain.back() / 16.0f);
  EXPECT_FLOAT_EQ(wrong.front(), plain.front());
}

TEST(VerifyTolerance, FollowsTheDumpDtype) {
  const auto all = cases();
  const MistakeCase& c = all.front();  // Llama-3.1, positions 8150..8197
  for (DumpDtype dtype : {DumpDtype::f32, DumpDtype::f16, DumpDtype::bf16}) {
    SCOPED_TRACE(std::string(to_string(dtype)));
    const Made m = make_dumps(c, dtype);
    const VerifyResult good = verify_rope(reference_of(c), m.correct, "d");
    EXPECT_TRUE(good.pass) << good.summary;
    const double u = dtype == DumpDtype::f32 ? std::ldexp(1.0, -24)
                     : dtype == DumpDtype::f16 ? std::ldexp(1.0, -11)
                                               : std::ldexp(1.0, -8);
    double qmax = 0;
    for (double x : m.correct[0].values) qmax = std::max(qmax, std::fabs(x));
    EXPECT_DOUBLE_EQ(good.errors.front().tolerance, 8 * u * qmax);
    EXPECT_EQ(good.errors.front().dtype, std::string(to_string(dtype)));
    const VerifyResult bad = verify_rope(reference_of(c), m.buggy, "d");
    EXPECT_FALSE(bad.pass);
    EXPECT_EQ(bad.hypotheses.front().id, "layout_swapped");
  }
  // In bf16 an fp16 cos/sin table is below the dump's own rounding: not testable, and the dump passes.
  const auto lp = std::find_if(all.begin(), all.end(), [](const MistakeCase& x) { return x.id == "cos_sin_low_precision"; });
  const Made m = make_dumps(*lp, DumpDtype::bf16);
  const VerifyResult r = verify_rope(reference_of(*lp), m.buggy, "d");
  EXPECT_TRUE(r.pass) << r.summary;
}

TEST(VerifyTables, CosSinAndInvFreqAreCheckedAndDiagnosed) {
  const RopeParams params = llama31_params();
  const auto pos = iota_positions(16, 8180);
  const RopeFrequencies f = scheduled(params, pos);
  const std::size_t n = pos.size() * static_cast<std::size_t>(f.n_pairs());
  std::vector<float> c(n), s(n);
  rope_cos_sin(f, pos, AnglePrecision::float32, c, s);
  // HF's cos: cat(freqs, freqs) -> [tokens, rotary_dim]
  auto doubled = [&](const std::vector<float>& v) {
    std::vector<float> out;
    for (std::size_t t = 0; t < pos.size(); ++t)
      for (int rep = 0; rep < 2; ++rep)
        for (int i = 0; i < f.n_pairs(); ++i) out.push_back(v[t * static_cast<std::size_t>(f.n_pairs()) + i]);
    return out;
  };
  const std::vector<int64_t> shape{1, 16, kHeadDim};
  VerifyReference ref;
  ref.params = params;
  std::vector<float> bf16_inv;
  for (float x : f.inv_freq) bf16_inv.push_back(round_to_bf16(x));
  const std::vector<DumpArray> good{array("cos", shape, doubled(c)), array("sin", shape, doubled(s)),
                                    array("inv_freq", {f.n_pairs()}, f.inv_freq), positions_array(pos, {1, 16})};
  const VerifyResult g = verify_rope(ref, good, "tables");
  EXPECT_TRUE(g.pass) << format_verify_report(g);
  EXPECT_EQ(g.primary, "cos");
  // bf16 inv_freq (stored as bf16 by model.to(bfloat16)) and the tables made from it: FAIL, diagnosed.
  RopeFrequencies fb = f;
  fb.inv_freq = bf16_inv;
  fb.inv_freq_f64.clear();
  std::vector<float> cb(n), sb(n);
  rope_cos_sin(fb, pos, AnglePrecision::float32, cb, sb);
  const std::vector<DumpArray> bad{array("cos", shape, doubled(cb)), array("sin", shape, doubled(sb)),
                                   array("inv_freq", {f.n_pairs()}, bf16_inv, DumpDtype::bf16),
                                   positions_array(pos, {1, 16})};
  const VerifyResult b = verify_rope(ref, bad, "tables");
  EXPECT_FALSE(b.pass);
  EXPECT_EQ(b.hypotheses.front().id, "inv_freq_bf16") << format_verify_report(b);
  EXPECT_TRUE(b.errors[2].relative);
}

TEST(VerifyReferenceTest, ReadsLlama31ConfigAndBareObjects) {
  const VerifyReference r = load_verify_reference(test::shared_dir() / "configs/llama-3.1-8b.json");
  EXPECT_EQ(r.params.rope_type, "llama3");
  EXPECT_EQ(r.params.head_dim, 128);
  EXPECT_EQ(r.layout, RopeLayout::half);
  EXPECT_DOUBLE_EQ(r.params.rope_theta, 500000.0);
  const VerifyReference b = verify_reference_from_json(
      R"({"rope_type": "yarn", "factor": 4, "original_max_position_embeddings": 4096, "head_dim": 64,
          "rope_theta": 1e6, "partial_rotary_factor": 0.5})",
      "bare.json", RopeLayout::interleaved);
  EXPECT_EQ(b.params.rope_type, "yarn");
  EXPECT_EQ(b.params.effective_rotary_dim(), 32);
  EXPECT_EQ(b.layout, RopeLayout::interleaved);
  EXPECT_DOUBLE_EQ(b.params.rope_theta, 1e6);
  EXPECT_NE(test::message_of<ConfigError>([] { verify_reference_from_json(R"({"rope_type": "default"})", "x.json"); })
                .find("x.json: head_dim"),
            std::string::npos);
  EXPECT_NE(test::message_of<ConfigError>([] {
              verify_reference_from_json(R"({"model_type": "bert", "hidden_size": 64, "num_attention_heads": 1,
                                             "max_position_embeddings": 512})",
                                         "bert.json");
            }).find("not RoPE"),
            std::string::npos);
}

TEST(VerifyErrors, BadDumpsAreDumpErrorsNamingTheArray) {
  const auto c = cases().front();
  const Made m = make_dumps(c);
  const VerifyReference ref = reference_of(c);
  auto msg = [&](std::vector<DumpArray> arrays, VerifyOptions o = {}) {
    return test::message_of<DumpError>([&] { verify_rope(ref, arrays, "d.npz", o); });
  };
  EXPECT_NE(msg({m.correct[0], m.correct[2]}).find("d.npz: q_rope: missing"), std::string::npos);
  EXPECT_NE(msg({m.correct[0], m.correct[1]}).find("d.npz: position_ids: missing"), std::string::npos);
  VerifyOptions batch;
  batch.dump_layout = DumpLayout::batch_heads_tokens_dim;
  EXPECT_NE(msg(m.correct, batch).find("expected 4 axes"), std::string::npos);
  auto neg = m.correct;
  neg[2].values[3] = -1;
  EXPECT_NE(msg(neg).find("d.npz: position_ids: element [0, 3] must be a non-negative integer (got -1)"),
            std::string::npos);
  auto nan = m.correct;
  nan[1].values[7] = std::nan("");
  EXPECT_NE(msg(nan).find("d.npz: q_rope: element 7 is not finite"), std::string::npos);
  auto wide = m.correct;
  for (int i : {0, 1}) wide[static_cast<std::size_t>(i)].shape = {48, 4, 64};
  wide[0].shape = {48, 1, 256};
  wide[1].shape = {48, 1, 256};
  EXPECT_NE(msg(wide).find("head_dim (last axis) 256 is not the config's head_dim 64"), std::string::npos);
  auto short_pos = m.correct;
  short_pos[2] = positions_array(iota_positions(5));
  EXPECT_NE(msg(short_pos).find("position_ids: shape [5] does not fit"), std::string::npos);
  EXPECT_NE(msg({positions_array(iota_positions(5))}).find("nothing to check"), std::string::npos);
}

TEST(VerifyReport, JsonAndTextCarryTheVerdictAndTheRanking) {
  const auto all = cases();
  const auto it = std::find_if(all.begin(), all.end(), [](const MistakeCase& x) { return x.id == "attention_factor_squared"; });
  const Made m = make_dumps(*it);
  const VerifyResult r = verify_rope(reference_of(*it), m.buggy, "buggy.npz");
  const auto j = nlohmann::json::parse(verify_result_json(r));
  EXPECT_FALSE(j["pass"].get<bool>());
  EXPECT_EQ(j["hypotheses"][0]["id"], "attention_factor_squared");
  EXPECT_TRUE(j["hypotheses"][0]["matches"].get<bool>());
  EXPECT_EQ(j["errors"][0]["by_channel"]["max"].size(), static_cast<std::size_t>(kHeadDim));
  EXPECT_EQ(j["errors"][0]["by_position"]["position"].size(), 64u);
  const std::string text = format_verify_report(r);
  EXPECT_NE(text.find("by channel"), std::string::npos);
  EXPECT_NE(text.find("https://github.com/sgl-project/sglang/pull/33558"), std::string::npos);
}

}  // namespace
}  // namespace posenc
