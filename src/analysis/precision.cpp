// The cost of each precision mode of RoPE's cos/sin, by position (see
// include/posenc/precision.hpp). Every table comes from rope_cos_sin_with (the
// one rounding path), every reference from rope_cos_sin_f64.
#include "posenc/precision.hpp"

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <limits>
#include <random>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "core/parallel.hpp"
#include "posenc/error.hpp"

namespace posenc {

namespace {

using D = NumericDtype;

constexpr std::array kPresets{
    RopeNumericsPreset{"float32", {D::f32, D::f32, D::f32, D::f32},
                       "float32 inv_freq, positions, product and cos/sin (HF with autocast off, llama.cpp): what "
                       "models are trained and served with",
                       ""},
    RopeNumericsPreset{"exact", {D::f32, D::f64, D::f64, D::f32},
                       "float32 inv_freq, angle and cos/sin in double (posenc --angle-precision exact)", ""},
    RopeNumericsPreset{"fp64", {D::f64, D::f64, D::f64, D::f32},
                       "inv_freq, angle and cos/sin in double, stored as float32 (the reference)", ""},
    RopeNumericsPreset{
        "bf16", {D::bf16, D::bf16, D::bf16, D::bf16},
        "rotary module run in bf16: inv_freq buffer cast by model.to(bf16), positions arange().type_as(inv_freq), "
        "bf16 product, bf16 cos/sin table (HF before v4.38; any module under torch.autocast(bf16))",
        "https://github.com/huggingface/transformers/issues/25681 "
        "https://github.com/huggingface/transformers/pull/29285 https://github.com/EleutherAI/gpt-neox/pull/1016 "
        "https://github.com/huggingface/diffusers/issues/13920 https://github.com/huggingface/candle/pull/3520"},
    RopeNumericsPreset{"fp16", {D::f16, D::f16, D::f16, D::f16},
                       "rotary module run in fp16 (model.half()): every stage in binary16; positions > 65504 are inf",
                       "https://github.com/EleutherAI/gpt-neox/issues/1003 "
                       "https://github.com/huggingface/transformers/issues/25681"},
    RopeNumericsPreset{"bf16-table", {D::f32, D::f32, D::f32, D::bf16},
                       "cos/sin computed in float32, stored in bf16 (HF's cos.to(x.dtype); a cos_sin_cache kept in "
                       "the model dtype)",
                       "https://github.com/vllm-project/vllm/issues/863 "
                       "https://github.com/KellerJordan/modded-nanogpt/issues/39 "
                       "https://github.com/Dao-AILab/flash-attention/issues/823 "
                       "https://github.com/sgl-project/sglang/pull/33117"},
    RopeNumericsPreset{"fp16-table", {D::f32, D::f32, D::f32, D::f16},
                       "cos/sin computed in float32, stored in fp16",
                       "https://github.com/vllm-project/vllm/issues/863 "
                       "https://github.com/Dao-AILab/flash-attention/issues/823"},
    RopeNumericsPreset{"bf16-inv_freq", {D::bf16, D::f32, D::f32, D::f32},
                       "inv_freq buffer rounded to bf16 by a model-wide cast, then upcast (.float()) and used in "
                       "float32",
                       "https://github.com/huggingface/transformers/issues/29496 "
                       "https://github.com/sgl-project/sglang-jax/issues/1472 "
                       "https://github.com/NVIDIA-NeMo/Automodel/pull/2549 https://github.com/NVIDIA/Megatron-LM/issues/744"},
    RopeNumericsPreset{"fp16-inv_freq", {D::f16, D::f32, D::f32, D::f32},
                       "inv_freq buffer rounded to fp16 (model.half()), then used in float32",
                       "https://github.com/NVIDIA/Megatron-LM/issues/744"},
    RopeNumericsPreset{"bf16-positions", {D::f32, D::bf16, D::f32, D::f32},
                       "position ids formed in bf16 (arange in the activation dtype), the rest float32",
                       "https://github.com/EleutherAI/gpt-neox/pull/1016 https://github.com/nkalyanv99/UNI-D2/pull/6"},
    RopeNumericsPreset{"bf16-angle", {D::f32, D::f32, D::bf16, D::f32},
                       "float32 product rounded to bf16 before cos/sin (freqs.to(dtype))",
                       "https://github.com/EleutherAI/gpt-neox/issues/1003"},
    RopeNumericsPreset{"fp16-angle", {D::f32, D::f32, D::f16, D::f32},
                       "float32 product rounded to fp16 before cos/sin",
                       "https://github.com/EleutherAI/gpt-neox/issues/1003"},
};

std::optional<int64_t> position_limit(NumericDtype d) {
  switch (d) {
    case D::bf16: return int64_t{257};
    case D::f16: return int64_t{2049};
    case D::f32: return (int64_t{1} << 24) + 1;
    case D::f64: return std::nullopt;
  }
  return std::nullopt;
}

struct Rows {
  std::vector<float> cos, sin;
};

Rows rows_with(const RopeFrequencies& f, std::span<const int64_t> pos, const RopeNumerics& n) {
  Rows r{std::vector<float>(pos.size() * f.inv_freq.size()), std::vector<float>(pos.size() * f.inv_freq.size())};
  rope_cos_sin_with(f, pos, n, r.cos, r.sin);
  return r;
}

bool same_bits(float a, float b) { return std::bit_cast<uint32_t>(a) == std::bit_cast<uint32_t>(b); }

// x ([heads, head_dim] double) rotated by double cos/sin rows in `layout`.
void rotate_f64(const double* x, double* out, int heads, int head_dim, int n_pairs, const double* c, const double* s,
                RopeLayout layout) {
  for (int h = 0; h < heads; ++h) {
    const double* xi = x + static_cast<std::ptrdiff_t>(h) * head_dim;
    double* o = out + static_cast<std::ptrdiff_t>(h) * head_dim;
    std::copy(xi, xi + head_dim, o);
    for (int i = 0; i < n_pairs; ++i) {
      const int a = layout == RopeLayout::half ? i : 2 * i;
      const int b = layout == RopeLayout::half ? i + n_pairs : 2 * i + 1;
      o[a] = xi[a] * c[i] - xi[b] * s[i];
      o[b] = xi[b] * c[i] + xi[a] * s[i];
    }
  }
}

// Evenly spaced sample of [lo, hi], both ends, at most n values (all when fewer).
std::vector<int64_t> sample(int64_t lo, int64_t hi, int n) {
  std::vector<int64_t> out;
  const int64_t size = hi - lo + 1;
  if (size <= n) {
    for (int64_t p = lo; p <= hi; ++p) out.push_back(p);
    return out;
  }
  for (int k = 0; k < n; ++k) {
    const int64_t p = lo + static_cast<int64_t>(std::llround(static_cast<long double>(k) * (hi - lo) / (n - 1)));
    if (out.empty() || out.back() != p) out.push_back(p);
  }
  return out;
}

PrecisionBucket measure_bucket(const RopeFrequencies& f, const RopeNumerics& numerics, int64_t lo, int64_t hi,
                               const PrecisionOptions& opt, const std::vector<float>& q, const std::vector<float>& k) {
  PrecisionBucket b;
  b.lo = lo;
  b.hi = hi;
  const std::vector<int64_t> ps = sample(lo, hi, opt.samples_per_bucket);
  b.positions = static_cast<int64_t>(ps.size());
  // Rows: the sampled positions, then p - delta for each (p, delta) with p >= delta.
  std::vector<int64_t> rows = ps;
  struct Pair {
    std::size_t q_row, k_row;
  };
  std::vector<Pair> pairs;
  for (std::size_t j = 0; j < ps.size(); ++j)
    for (int64_t d : opt.deltas)
      if (ps[j] - d >= 0) {
        if (d == 0) {
          pairs.push_back({j, j});
        } else {
          pairs.push_back({j, rows.size()});
          rows.push_back(ps[j] - d);
        }
      }
  const std::size_t np = f.inv_freq.size();
  const Rows got = rows_with(f, rows, numerics);
  std::vector<double> rc(rows.size() * np), rs(rows.size() * np);
  rope_cos_sin_f64(f, rows, rc, rs);

  double sum = 0;
  int64_t n = 0;
  for (std::size_t j = 0; j < ps.size() * np; ++j)
    for (const auto& [g, r] : {std::pair{got.cos[j], rc[j]}, std::pair{got.sin[j], rs[j]}}) {
      if (!std::isfinite(g)) {
        ++b.non_finite;
        continue;
      }
      const double e = std::fabs(static_cast<double>(g) - r);
      b.cos_sin_max = std::max(b.cos_sin_max, e);
      sum += e;
      ++n;
    }
  constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
  b.cos_sin_mean = n ? sum / static_cast<double>(n) : 0.0;
  if (n == 0 && b.non_finite > 0) b.cos_sin_max = b.cos_sin_mean = kNaN;  // nothing finite to measure

  // q·k: float32 rotation by the mode's table (apply_rope), dot in double.
  const int heads = opt.heads, hd = f.head_dim;
  const auto nrows = static_cast<int64_t>(rows.size());
  const std::size_t stride = static_cast<std::size_t>(heads) * static_cast<std::size_t>(hd);
  std::vector<float> qr(rows.size() * stride), kr(rows.size() * stride);
  for (std::size_t r = 0; r < rows.size(); ++r) {
    std::copy(q.begin(), q.end(), qr.begin() + static_cast<std::ptrdiff_t>(r * stride));
    std::copy(k.begin(), k.end(), kr.begin() + static_cast<std::ptrdiff_t>(r * stride));
  }
  const RopeTable table =
      RopeTable::from_cos_sin(nrows, static_cast<int>(np), got.cos, got.sin, AnglePrecision::float32);
  apply_rope(qr.data(), nrows, heads, hd, table, opt.layout);
  apply_rope(kr.data(), nrows, heads, hd, table, opt.layout);
  const std::vector<double> qd(q.begin(), q.end()), kd(k.begin(), k.end());
  std::vector<double> qref(stride), kref(stride);
  sum = 0;
  n = 0;
  for (const Pair& pr : pairs) {
    rotate_f64(qd.data(), qref.data(), heads, hd, static_cast<int>(np), rc.data() + pr.q_row * np,
               rs.data() + pr.q_row * np, opt.layout);
    rotate_f64(kd.data(), kref.data(), heads, hd, static_cast<int>(np), rc.data() + pr.k_row * np,
               rs.data() + pr.k_row * np, opt.layout);
    for (int h = 0; h < heads; ++h) {
      double s_got = 0, s_ref = 0;
      const std::size_t o = static_cast<std::size_t>(h) * static_cast<std::size_t>(hd);
      for (int c = 0; c < hd; ++c) {
        s_got += static_cast<double>(qr[pr.q_row * stride + o + static_cast<std::size_t>(c)]) *
                 static_cast<double>(kr[pr.k_row * stride + o + static_cast<std::size_t>(c)]);
        s_ref += qref[o + static_cast<std::size_t>(c)] * kref[o + static_cast<std::size_t>(c)];
      }
      if (!std::isfinite(s_got)) continue;
      const double e = std::fabs(s_got - s_ref);
      b.score_max = std::max(b.score_max, e);
      sum += e;
      ++n;
    }
  }
  b.score_mean = n ? sum / static_cast<double>(n) : 0.0;
  if (n == 0 && b.non_finite > 0) b.score_max = b.score_mean = kNaN;
  return b;
}

// Unit vectors [heads, head_dim], normal draws normalised per head.
std::vector<float> unit_vectors(int heads, int head_dim, std::mt19937_64& rng) {
  std::normal_distribution<double> normal(0.0, 1.0);
  std::vector<float> v(static_cast<std::size_t>(heads) * static_cast<std::size_t>(head_dim));
  for (int h = 0; h < heads; ++h) {
    std::vector<double> x(static_cast<std::size_t>(head_dim));
    double norm = 0;
    for (double& e : x) {
      e = normal(rng);
      norm += e * e;
    }
    norm = std::sqrt(norm);
    for (int c = 0; c < head_dim; ++c)
      v[static_cast<std::size_t>(h * head_dim + c)] = static_cast<float>(x[static_cast<std::size_t>(c)] / norm);
  }
  return v;
}

std::string fmt_err(double e) { return std::isnan(e) ? "nan" : e == 0 ? "0" : fmt::format("{:.1e}", e); }

}  // namespace

std::span<const RopeNumericsPreset> rope_numerics_presets() { return kPresets; }

const RopeNumericsPreset& find_rope_numerics_preset(std::string_view name, std::string_view field) {
  for (const auto& p : kPresets)
    if (p.name == name) return p;
  std::string known;
  for (const auto& p : kPresets) known += (known.empty() ? "" : ", ") + std::string(p.name);
  throw ConfigError(fmt::format("{}: unknown precision mode '{}' (known: {})", field, name, known));
}

std::vector<std::pair<int64_t, int64_t>> precision_buckets(int64_t first, int64_t last) {
  std::vector<std::pair<int64_t, int64_t>> out;
  int64_t lo = first;
  while (lo <= last) {
    int64_t hi = lo < 16 ? 15 : (int64_t{1} << (std::bit_width(static_cast<uint64_t>(lo)))) - 1;
    hi = std::min(hi, last);
    out.emplace_back(lo, hi);
    lo = hi + 1;
  }
  return out;
}

std::vector<int64_t> rope_row_collisions(const RopeFrequencies& freqs, const RopeNumerics& numerics, int64_t first,
                                         int64_t last, std::size_t limit, int64_t* count) {
  if (first < 0 || last < first)
    throw InvalidArgument(fmt::format("rope_row_collisions: bad range [{}, {}]", first, last));
  freqs.validate();
  const std::size_t np = freqs.inv_freq.size();
  // The first pair alone: a row can only equal its predecessor where this pair does.
  RopeFrequencies f0 = freqs;
  f0.rotary_dim = 2;
  // (erase rather than resize(1): GCC 12 warns of resize's unused growth path, -Warray-bounds)
  if (f0.inv_freq.size() > 1) f0.inv_freq.erase(f0.inv_freq.begin() + 1, f0.inv_freq.end());
  if (f0.inv_freq_f64.size() > 1) f0.inv_freq_f64.erase(f0.inv_freq_f64.begin() + 1, f0.inv_freq_f64.end());
  constexpr int64_t kChunk = 1 << 16;
  const int64_t n_chunks = (last - first + kChunk - 1) / kChunk;  // positions first+1..last
  struct ChunkResult {
    std::vector<int64_t> first;  // up to `limit` colliding positions, ascending
    int64_t count = 0;
  };
  std::vector<ChunkResult> results(static_cast<std::size_t>(n_chunks));
  // Chunks are independent (each starts with its predecessor row); merged in order below.
  detail::FirstException error;  // std::bad_alloc, rethrown after the region
#pragma omp parallel for schedule(dynamic) if (n_chunks > 1)
  for (int64_t ci = 0; ci < n_chunks; ++ci) {
    error.run([&] {
      ChunkResult& res = results[static_cast<std::size_t>(ci)];
      const int64_t a = first + 1 + ci * kChunk;
      const int64_t b = std::min(last, a + kChunk - 1);
      std::vector<int64_t> pos;
      for (int64_t p = a - 1; p <= b; ++p) pos.push_back(p);
      const Rows r0 = rows_with(f0, pos, numerics);
      std::vector<std::size_t> cand;  // indices j (position pos[j]) whose pair 0 equals pos[j-1]'s
      for (std::size_t j = 1; j < pos.size(); ++j)
        if (same_bits(r0.cos[j], r0.cos[j - 1]) && same_bits(r0.sin[j], r0.sin[j - 1])) cand.push_back(j);
      if (cand.empty()) return;
      auto full_equal = [&](const Rows& r, std::size_t j, std::size_t i) {  // row j vs row i
        for (std::size_t c = 0; c < np; ++c)
          if (!same_bits(r.cos[j * np + c], r.cos[i * np + c]) || !same_bits(r.sin[j * np + c], r.sin[i * np + c]))
            return false;
        return true;
      };
      auto hit = [&](int64_t p) {
        ++res.count;
        if (res.first.size() < limit) res.first.push_back(p);
      };
      if (cand.size() * 8 > pos.size()) {  // many: the whole chunk in full
        const Rows r = rows_with(freqs, pos, numerics);
        for (std::size_t j : cand)
          if (full_equal(r, j, j - 1)) hit(pos[j]);
      } else {
        std::vector<int64_t> two;
        for (std::size_t j : cand) two.insert(two.end(), {pos[j - 1], pos[j]});
        const Rows r = rows_with(freqs, two, numerics);
        for (std::size_t k = 0; k < cand.size(); ++k)
          if (full_equal(r, 2 * k + 1, 2 * k)) hit(pos[cand[k]]);
      }
    });
  }
  error.rethrow();
  std::vector<int64_t> out;
  int64_t total = 0;
  for (const ChunkResult& res : results) {
    total += res.count;
    for (int64_t p : res.first)
      if (out.size() < limit) out.push_back(p);
  }
  if (count) *count = total;
  return out;
}

PrecisionReport rope_precision_report(const RopeFrequencies& freqs, const PrecisionOptions& options) {
  freqs.validate();
  if (freqs.inv_freq_f64.empty())
    throw InvalidArgument(
        "rope_precision_report: frequencies without inv_freq_f64 (compute them with compute_rope_frequencies)");
  const PrecisionOptions& o = options;
  if (o.first_position < 0 || o.last_position < o.first_position || o.last_position >= (int64_t{1} << 40))
    throw InvalidArgument(fmt::format("positions: need 0 <= first <= last < 2^40 (got {}:{})", o.first_position,
                                      o.last_position));
  if (o.heads < 1 || o.heads > 1024) fail_field<InvalidArgument>("heads", "must be in [1, 1024]", o.heads);
  if (o.samples_per_bucket < 2)
    fail_field<InvalidArgument>("samples_per_bucket", "must be >= 2", o.samples_per_bucket);
  for (int64_t d : o.deltas)
    if (d < 0) fail_field<InvalidArgument>("deltas", "must be non-negative", d);

  std::vector<const RopeNumericsPreset*> modes;
  if (o.modes.empty()) {
    for (const auto& p : kPresets)
      if (p.name != "fp64") modes.push_back(&p);
  } else {
    for (const auto& m : o.modes) modes.push_back(&find_rope_numerics_preset(m, "modes"));
  }

  PrecisionReport rep;
  rep.freqs = freqs;
  rep.options = o;
  std::mt19937_64 rng(o.seed);
  const std::vector<float> q = unit_vectors(o.heads, freqs.head_dim, rng);
  const std::vector<float> k = unit_vectors(o.heads, freqs.head_dim, rng);
  const auto buckets = precision_buckets(o.first_position, o.last_position);
  for (const RopeNumericsPreset* p : modes) {
    PrecisionMode m;
    m.name = std::string(p->name);
    m.numerics = p->numerics;
    m.description = std::string(p->description);
    m.sources = std::string(p->sources);
    m.position_limit = position_limit(p->numerics.position);
    for (const auto& [lo, hi] : buckets) m.buckets.push_back(measure_bucket(freqs, p->numerics, lo, hi, o, q, k));
    if (o.scan_collisions) {
      const auto first = rope_row_collisions(freqs, p->numerics, o.first_position, o.last_position, 1, &m.collisions);
      if (!first.empty()) m.first_collision = first.front();
      m.scanned = true;
    }
    rep.modes.push_back(std::move(m));
  }
  return rep;
}

std::string format_precision_report(const PrecisionReport& rep) {
  const auto& f = rep.freqs;
  const auto& o = rep.options;
  std::string out = fmt::format(
      "RoPE {} head_dim {} rotary_dim {} attention_factor {:g}; positions {}..{}; errors against fp64 (inv_freq, "
      "angle, cos/sin in double)\n",
      f.rope_type, f.head_dim, f.rotary_dim, f.attention_factor, o.first_position, o.last_position);
  auto header = [&](std::string_view what) {
    out += fmt::format("\n{}\n{:>17}", what, "positions");
    for (const auto& m : rep.modes) out += fmt::format(" {:>14}", m.name);
    out += "\n";
  };
  auto rows = [&](auto value) {
    if (rep.modes.empty()) return;
    for (std::size_t b = 0; b < rep.modes.front().buckets.size(); ++b) {
      const auto& bk = rep.modes.front().buckets[b];
      out += fmt::format("{:>17}", fmt::format("{}-{}", bk.lo, bk.hi));
      for (const auto& m : rep.modes) out += fmt::format(" {:>14}", value(m.buckets[b]));
      out += "\n";
    }
  };
  header(fmt::format("max |cos/sin - fp64| ({} sampled positions per bucket, every pair)", o.samples_per_bucket));
  rows([](const PrecisionBucket& b) { return fmt_err(b.cos_sin_max) + (b.non_finite ? "*" : ""); });
  out += "  * some entries inf/NaN (fp16 past 65504), left out of the max; counts in --json (non_finite)\n";
  const std::string deltas = fmt::format("{}", fmt::join(o.deltas, ","));
  header(fmt::format("max |q·k - fp64 q·k| (unit q, k; {} heads; q at p, k at p-Δ, Δ in {{{}}})", o.heads, deltas));
  rows([](const PrecisionBucket& b) { return fmt_err(b.score_max); });
  out += fmt::format(
      "\ncollisions: first position p whose table row (cos and sin of every pair, as stored) is bit-identical to row "
      "p-1's\n{:>14} {:>14} {:>14} {:>16}  {}\n",
      "mode", "first", "positions", "position limit", "numerics");
  for (const auto& m : rep.modes) {
    const std::string first = !m.scanned ? "not scanned" : m.first_collision ? std::to_string(*m.first_collision) : "none";
    out += fmt::format("{:>14} {:>14} {:>14} {:>16}  {}\n", m.name, first, m.scanned ? std::to_string(m.collisions) : "-",
                       m.position_limit ? std::to_string(*m.position_limit) : "-", to_string(m.numerics));
  }
  out += "position limit: first position the position dtype cannot hold (2^m + 1 for m significant bits)\n";
  return out;
}

std::string precision_report_json(const PrecisionReport& rep) {
  using json = nlohmann::ordered_json;
  const auto& f = rep.freqs;
  const auto& o = rep.options;
  json j;
  j["schema"] = "posenc.precision/1";
  j["rope"] = {{"rope_type", f.rope_type}, {"head_dim", f.head_dim},         {"rotary_dim", f.rotary_dim},
               {"attention_factor", f.attention_factor}, {"inv_freq", f.inv_freq}, {"inv_freq_f64", f.inv_freq_f64}};
  j["options"] = {{"first_position", o.first_position}, {"last_position", o.last_position},
                  {"samples_per_bucket", o.samples_per_bucket}, {"heads", o.heads},
                  {"deltas", o.deltas}, {"layout", std::string(to_string(o.layout))},
                  {"seed", o.seed}};
  j["reference"] = "fp64: inv_freq, angle and cos/sin in double";
  json modes = json::array();
  for (const auto& m : rep.modes) {
    json jm;
    jm["name"] = m.name;
    jm["numerics"] = {{"inv_freq", std::string(to_string(m.numerics.inv_freq))},
                      {"position", std::string(to_string(m.numerics.position))},
                      {"angle", std::string(to_string(m.numerics.angle))},
                      {"table", std::string(to_string(m.numerics.table))}};
    jm["description"] = m.description;
    json src = json::array();
    std::string_view s = m.sources;
    while (!s.empty()) {
      const auto sp = s.find(' ');
      src.push_back(std::string(s.substr(0, sp)));
      s = sp == std::string_view::npos ? std::string_view{} : s.substr(sp + 1);
    }
    jm["sources"] = src;
    json bs = json::array();
    for (const auto& b : m.buckets)
      bs.push_back({{"lo", b.lo}, {"hi", b.hi}, {"positions", b.positions}, {"cos_sin_max", b.cos_sin_max},
                    {"cos_sin_mean", b.cos_sin_mean}, {"score_max", b.score_max}, {"score_mean", b.score_mean},
                    {"non_finite", b.non_finite}});
    jm["buckets"] = bs;
    jm["collisions_scanned"] = m.scanned;
    jm["first_collision"] = m.first_collision ? json(*m.first_collision) : json(nullptr);
    jm["collisions"] = m.collisions;
    jm["position_limit"] = m.position_limit ? json(*m.position_limit) : json(nullptr);
    modes.push_back(std::move(jm));
  }
  j["modes"] = modes;
  return j.dump(2) + "\n";
}

}  // namespace posenc
