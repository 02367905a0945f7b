// posenc verify: the engine's dumped RoPE tensors against posenc's reference,
// and the catalogue of known mistakes (mistakes.cpp) ranked by how well each,
// re-computed, reproduces the dump. The rules (arrays, layouts, tolerances) are
// stated in include/posenc/verify.hpp.
#include "posenc/verify.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "posenc/config.hpp"
#include "posenc/error.hpp"
#include "posenc/float16.hpp"
#include "posenc/io.hpp"
#include "verify/mistakes.hpp"
#include "verify/shape_text.hpp"

namespace posenc {
using detail::shape_text;

std::string_view to_string(DumpLayout layout) {
  return layout == DumpLayout::tokens_heads_dim ? "tokens,heads,head_dim" : "batch,heads,tokens,head_dim";
}

DumpLayout parse_dump_layout(std::string_view text, std::string_view field) {
  if (text == "tokens,heads,head_dim") return DumpLayout::tokens_heads_dim;
  if (text == "batch,heads,tokens,head_dim") return DumpLayout::batch_heads_tokens_dim;
  throw ConfigError(fmt::format("{}: expected tokens,heads,head_dim or batch,heads,tokens,head_dim (got {})", field,
                                text));
}

// ---- the reference -----------------------------------------------------------

VerifyReference verify_reference_from_json(std::string_view json_text, std::string_view source,
                                           std::optional<RopeLayout> layout) {
  nlohmann::json j = nlohmann::json::parse(json_text, nullptr, false);
  if (j.is_discarded()) throw ConfigError(fmt::format("{}: malformed JSON", source));
  if (!j.is_object())
    throw ConfigError(fmt::format("{}: must be a JSON object (a config.json or a rope_scaling object)", source));
  VerifyReference ref;
  ref.source = std::string(source);
  const bool bare = !j.contains("model_type") && !j.contains("architectures") && !j.contains("num_attention_heads") &&
                    !j.contains("hidden_size");
  if (bare) {
    if (!j.contains("head_dim") || !j["head_dim"].is_number_integer())
      throw ConfigError(fmt::format("{}: head_dim: a bare rope_scaling object needs an integer head_dim (got {})",
                                    source, j.contains("head_dim") ? j["head_dim"].dump() : "nothing"));
    const int64_t head_dim = j["head_dim"].get<int64_t>();
    if (head_dim < 2 || head_dim > config_limits::kMaxHeadDim)
      fail_field<ConfigError>(fmt::format("{}: head_dim", source),
                              fmt::format("must be in [2, {}]", config_limits::kMaxHeadDim), head_dim);
    nlohmann::json inner = j;
    for (const char* key : {"head_dim", "max_position_embeddings", "rotary_dim", "partial_rotary_factor"})
      inner.erase(key);
    if (!inner.contains("rope_type") && !inner.contains("type")) inner["rope_type"] = "default";
    // Wrapped in a minimal Llama config so the one config parser reads it
    // (rope_parameters when it carries rope_theta); the rotated width is set
    // afterwards, since HF's Llama default RoPE ignores partial_rotary_factor.
    nlohmann::json cfg{{"model_type", "llama"}, {"num_attention_heads", 1}, {"hidden_size", head_dim},
                       {"head_dim", head_dim}};
    if (j.contains("max_position_embeddings"))
      cfg["max_position_embeddings"] = j["max_position_embeddings"];
    else if (j.contains("original_max_position_embeddings"))
      cfg["max_position_embeddings"] = j["original_max_position_embeddings"];
    cfg[inner.contains("rope_theta") ? "rope_parameters" : "rope_scaling"] = inner;
    const PositionalSpec ps = parse_positional_spec(cfg.dump(), source);
    ref.params = *ps.rope;
    if (j.contains("rotary_dim")) {
      if (!j["rotary_dim"].is_number_integer())
        fail_field<ConfigError>(fmt::format("{}: rotary_dim", source), "must be an integer", j["rotary_dim"].dump());
      ref.params.rotary_dim = j["rotary_dim"].get<int>();
    } else if (j.contains("partial_rotary_factor")) {
      if (!j["partial_rotary_factor"].is_number())
        fail_field<ConfigError>(fmt::format("{}: partial_rotary_factor", source), "must be a number",
                                j["partial_rotary_factor"].dump());
      ref.params.partial_rotary_factor = j["partial_rotary_factor"].get<double>();
      ref.params.rotary_dim = 0;
    }
    ref.layout = layout.value_or(RopeLayout::half);
    ref.notes.push_back(layout ? "layout: --rope-layout"
                               : "layout half (HF rotate_half): a bare rope_scaling object names no architecture; "
                                 "--rope-layout interleaved for GPT-J/llama2.c-style engines");
  } else {
    const PositionalSpec ps = parse_positional_spec(json_text, source);
    if (ps.family == PositionFamily::mrope)
      throw ConfigError(fmt::format("{}: MRoPE (three position rows) is not checked by verify; give a rope_scaling "
                                    "object of its text RoPE instead",
                                    source));
    if (!ps.rope)
      throw ConfigError(fmt::format("{}: the config describes {} positions, not RoPE", source, to_string(ps.family)));
    ref.params = *ps.rope;
    if (layout) {
      ref.layout = *layout;
      ref.notes.push_back("layout: --rope-layout");
    } else if (ps.layout) {
      ref.layout = *ps.layout;
      std::string why = fmt::format("model_type {}", ps.model_type);
      for (const auto& n : ps.notes)
        if (n.rfind("layout", 0) == 0) why = n;
      ref.notes.push_back(fmt::format("layout {} ({})", to_string(*ps.layout), why));
    } else {
      ref.layout = RopeLayout::half;
      ref.notes.push_back("layout half (HF rotate_half): the config's model_type implies none; --rope-layout to change");
    }
    if (ps.rope_output_half_order)
      ref.notes.push_back("DeepSeek's interleaved-in/half-out: the dump's q_rope is compared in interleaved order");
  }
  (void)compute_rope_frequencies(ref.params);  // validates now, naming the config
  return ref;
}

VerifyReference load_verify_reference(const std::filesystem::path& path, std::optional<RopeLayout> layout) {
  return verify_reference_from_json(read_file(path), path.string(), layout);
}

std::vector<RopeMistakeInfo> rope_mistake_catalogue() {
  std::vector<RopeMistakeInfo> out;
  for (const auto& m : detail::rope_mistakes()) out.push_back({m.id, m.title, m.report});
  return out;
}

// ---- reading the dump ----------------------------------------------------------

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

double unit_roundoff(DumpDtype dtype) {
  switch (dtype) {
    case DumpDtype::f16: return std::ldexp(1.0, -11);
    case DumpDtype::bf16: return std::ldexp(1.0, -8);
    default: return std::ldexp(1.0, -24);
  }
}

/// q/k before and after RoPE, split into batch rows of [tokens, heads, head_dim].
struct QkPair {
  std::string name;          // "q_rope"
  DumpDtype dtype;
  int64_t rows = 0, tokens = 0;
  int heads = 0, head_dim = 0;
  std::vector<float> input;  // [rows][tokens][heads][head_dim]
  std::vector<double> observed;
  double input_max = 0;
};

/// A cos or sin table.
struct Table {
  std::string name;
  DumpDtype dtype;
  int64_t n_rows = 0;
  int width = 0;
  std::vector<double> observed;
  bool rows_are_tokens = false;  // row i = token i of the dump (else position i)
};

struct Dump {
  std::string source;
  std::vector<QkPair> qk;
  std::vector<Table> tables;
  const DumpArray* inv_freq = nullptr;
  std::vector<std::vector<int64_t>> positions;  // [rows][tokens]
};

const DumpArray* find_array(std::span<const DumpArray> arrays, std::string_view name) {
  for (const auto& a : arrays)
    if (a.name == name) return &a;
  return nullptr;
}

[[noreturn]] void dump_fail(std::string_view source, std::string_view array, std::string_view what) {
  throw DumpError(fmt::format("{}: {}: {}", source, array, what));
}

void check_finite(std::string_view source, const DumpArray& a) {
  if (!is_floating(a.dtype))
    dump_fail(source, a.name, fmt::format("must be floating (f64/f32/f16/bf16) (got {})", to_string(a.dtype)));
  for (std::size_t i = 0; i < a.values.size(); ++i)
    if (!std::isfinite(a.values[i])) dump_fail(source, a.name, fmt::format("element {} is not finite (got {})", i, a.values[i]));
}

/// Rows of [tokens, heads, head_dim] from the dump's axis order.
QkPair read_pair(std::string_view source, const DumpArray& before, const DumpArray& after, DumpLayout layout,
                 int head_dim) {
  check_finite(source, before);
  check_finite(source, after);
  const std::size_t rank = layout == DumpLayout::tokens_heads_dim ? 3 : 4;
  if (before.shape.size() != rank)
    dump_fail(source, before.name,
              fmt::format("expected {} axes ({}) (got shape {}); --dump-layout names the axis order", rank,
                          to_string(layout), shape_text(before.shape)));
  if (after.shape != before.shape)
    dump_fail(source, after.name,
              fmt::format("shape {} differs from {}'s {}", shape_text(after.shape), before.name, shape_text(before.shape)));
  QkPair p;
  p.name = after.name;
  p.dtype = after.dtype;
  const auto& s = before.shape;
  if (layout == DumpLayout::tokens_heads_dim) {
    p.rows = 1, p.tokens = s[0], p.heads = static_cast<int>(s[1]), p.head_dim = static_cast<int>(s[2]);
  } else {
    p.rows = s[0], p.heads = static_cast<int>(s[1]), p.tokens = s[2], p.head_dim = static_cast<int>(s[3]);
  }
  if (p.head_dim != head_dim)
    dump_fail(source, before.name,
              fmt::format("head_dim (last axis) {} is not the config's head_dim {} (shape {})", p.head_dim, head_dim,
                          shape_text(s)));
  if (p.rows <= 0 || p.tokens <= 0 || p.heads <= 0)
    dump_fail(source, before.name, fmt::format("empty (shape {})", shape_text(s)));
  const std::size_t n = before.values.size();
  p.input.resize(n);
  p.observed.resize(n);
  const int64_t H = p.heads, T = p.tokens, D = p.head_dim;
  for (int64_t b = 0; b < p.rows; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t t = 0; t < T; ++t)
        for (int64_t d = 0; d < D; ++d) {
          // source index in the dump's order, destination [b][t][h][d]
          const std::size_t src = layout == DumpLayout::tokens_heads_dim
                                      ? static_cast<std::size_t>((t * H + h) * D + d)
                                      : static_cast<std::size_t>(((b * H + h) * T + t) * D + d);
          const std::size_t dst = static_cast<std::size_t>(((b * T + t) * H + h) * D + d);
          p.input[dst] = static_cast<float>(before.values[src]);
          p.observed[dst] = after.values[src];
        }
  for (float x : p.input) p.input_max = std::max(p.input_max, static_cast<double>(std::fabs(x)));
  return p;
}

Dump read_dump(const VerifyReference& ref, std::span<const DumpArray> arrays, std::string_view source,
               DumpLayout layout) {
  Dump d;
  d.source = std::string(source);
  const int head_dim = ref.params.head_dim;
  for (const char* name : {"q", "k"}) {
    const std::string rope = std::string(name) + "_rope";
    const DumpArray* before = find_array(arrays, name);
    const DumpArray* after = find_array(arrays, rope);
    if (!before && !after) continue;
    if (!before || !after)
      dump_fail(source, before ? rope : name, fmt::format("missing: {} needs both {} and {}", name, name, rope));
    d.qk.push_back(read_pair(source, *before, *after, layout, head_dim));
  }
  if (!d.qk.empty()) {
    const DumpArray* pos = find_array(arrays, "position_ids");
    if (!pos) dump_fail(source, "position_ids", "missing: q/k after RoPE need the positions they were rotated at");
    const int64_t rows = d.qk.front().rows, tokens = d.qk.front().tokens;
    for (const auto& p : d.qk)
      if (p.rows != rows || p.tokens != tokens)
        dump_fail(source, p.name, fmt::format("{} rows of {} tokens, {} has {} of {}", p.rows, p.tokens,
                                              d.qk.front().name, rows, tokens));
    std::vector<int64_t> shape = pos->shape;
    while (shape.size() > 1 && shape.front() == 1 && static_cast<int64_t>(shape.size()) > (rows > 1 ? 2 : 1))
      shape.erase(shape.begin());
    const bool shared = shape.size() == 1 && shape[0] == tokens;
    const bool per_row = shape.size() == 2 && shape[0] == rows && shape[1] == tokens;
    if (!shared && !per_row)
      dump_fail(source, "position_ids",
                fmt::format("shape {} does not fit {} row(s) of {} tokens ([tokens] or [batch, tokens])",
                            shape_text(pos->shape), rows, tokens));
    d.positions.assign(static_cast<std::size_t>(rows), std::vector<int64_t>(static_cast<std::size_t>(tokens)));
    for (int64_t b = 0; b < rows; ++b)
      for (int64_t t = 0; t < tokens; ++t) {
        const double v = pos->values[static_cast<std::size_t>(shared ? t : b * tokens + t)];
        if (!(v >= 0) || v != std::floor(v) || v > 9.0e15)
          dump_fail(source, "position_ids",
                    fmt::format("element [{}, {}] must be a non-negative integer (got {})", b, t, v));
        d.positions[static_cast<std::size_t>(b)][static_cast<std::size_t>(t)] = static_cast<int64_t>(v);
      }
  }
  if (d.qk.empty()) {
    // Tables only: position_ids, when given, name the positions of the table rows.
    if (const DumpArray* pos = find_array(arrays, "position_ids")) {
      std::vector<int64_t> row;
      for (std::size_t i = 0; i < pos->values.size(); ++i) {
        const double v = pos->values[i];
        if (!(v >= 0) || v != std::floor(v) || v > 9.0e15)
          dump_fail(source, "position_ids", fmt::format("element {} must be a non-negative integer (got {})", i, v));
        row.push_back(static_cast<int64_t>(v));
      }
      if (!row.empty()) d.positions.push_back(std::move(row));
    }
  }
  for (const char* name : {"cos", "sin"}) {
    const DumpArray* a = find_array(arrays, name);
    if (!a) continue;
    check_finite(source, *a);
    std::vector<int64_t> shape = a->shape;
    while (shape.size() > 2 && shape.front() == 1) shape.erase(shape.begin());
    if (shape.size() == 3) shape = {shape[0] * shape[1], shape[2]};  // HF [batch, tokens, dim]
    if (shape.size() != 2 || shape[0] <= 0 || shape[1] <= 0)
      dump_fail(source, name, fmt::format("expected [positions, rotary_dim] or [positions, rotary_dim/2] (got shape {})",
                                          shape_text(a->shape)));
    Table t;
    t.name = name;
    t.dtype = a->dtype;
    t.n_rows = shape[0];
    t.width = static_cast<int>(shape[1]);
    t.observed = a->values;
    int64_t total = 0;
    for (const auto& row : d.positions) total += static_cast<int64_t>(row.size());
    t.rows_are_tokens = total == t.n_rows;
    d.tables.push_back(std::move(t));
  }
  if (const DumpArray* a = find_array(arrays, "inv_freq")) {
    check_finite(source, *a);
    d.inv_freq = a;
  }
  if (d.qk.empty() && d.tables.empty() && !d.inv_freq) {
    std::vector<std::string> names;
    for (const auto& a : arrays) names.push_back(a.name);
    dump_fail(source, "q_rope",
              fmt::format("nothing to check: no q/q_rope, k/k_rope, cos/sin or inv_freq (has: {})", fmt::join(names, ", ")));
  }
  if (d.positions.empty()) {
    // A table (or inv_freq) alone: rows are positions 0..P-1.
    int64_t rows = 1;
    for (const auto& t : d.tables) rows = std::max(rows, t.n_rows);
    std::vector<int64_t> p(static_cast<std::size_t>(rows));
    std::iota(p.begin(), p.end(), int64_t{0});
    d.positions.push_back(std::move(p));
    for (auto& t : d.tables) t.rows_are_tokens = true;
  }
  return d;
}

// ---- predictions and comparisons -----------------------------------------------

/// What a variant computes for each compared array, in Dump order: qk..., tables..., inv_freq.
struct Prediction {
  std::vector<std::vector<double>> arrays;
  std::vector<bool> valid;    // false: the variant cannot produce this array's shape
  std::vector<bool> doubled;  // tables: width = rotary_dim (two copies of each pair's value), either order
};

std::vector<float> table_for(const detail::RopeVariant& v, std::span<const int64_t> positions, bool sine) {
  const std::size_t n = positions.size() * static_cast<std::size_t>(v.freqs.n_pairs());
  std::vector<float> c(n), s(n);
  rope_cos_sin_with(v.freqs, positions, v.numerics, c, s);
  return sine ? s : c;
}

Prediction predict(const Dump& d, const detail::RopeVariant& v) {
  Prediction out;
  for (const auto& p : d.qk) {
    std::vector<double> pred(p.observed.size());
    std::vector<float> buf(static_cast<std::size_t>(p.tokens * p.heads * p.head_dim));
    const std::size_t stride = buf.size();
    for (int64_t b = 0; b < p.rows; ++b) {
      const auto& pos = v.positions[static_cast<std::size_t>(b)];
      const std::size_t n = pos.size() * static_cast<std::size_t>(v.freqs.n_pairs());
      std::vector<float> c(n), s(n);
      rope_cos_sin_with(v.freqs, pos, v.numerics, c, s);
      const RopeTable table = RopeTable::from_cos_sin(static_cast<int64_t>(pos.size()), v.freqs.n_pairs(), std::move(c),
                                                      std::move(s), AnglePrecision::float32);
      apply_rope(p.input.data() + b * stride, buf.data(), p.tokens, p.heads, p.head_dim, table, v.layout);
      for (std::size_t i = 0; i < stride; ++i) pred[b * stride + i] = buf[i];
    }
    out.arrays.push_back(std::move(pred));
    out.valid.push_back(true);
    out.doubled.push_back(false);
  }
  for (const auto& t : d.tables) {
    const int np = v.freqs.n_pairs();
    std::vector<int64_t> positions;
    if (t.rows_are_tokens) {
      for (const auto& row : v.positions) positions.insert(positions.end(), row.begin(), row.end());
    } else {
      positions.resize(static_cast<std::size_t>(t.n_rows));
      std::iota(positions.begin(), positions.end(), int64_t{0});
    }
    if (static_cast<int64_t>(positions.size()) != t.n_rows || (t.width != np && t.width != 2 * np)) {
      out.arrays.emplace_back();
      out.valid.push_back(false);
      out.doubled.push_back(false);
      continue;
    }
    const std::vector<float> vals = table_for(v, positions, t.name == "sin");
    // Half-order expansion [c0..c(n-1), c0..c(n-1)] (HF's cat(freqs, freqs)); the
    // interleaved one [c0 c0 c1 c1 ...] is tried by compare() through `width`.
    std::vector<double> pred(static_cast<std::size_t>(t.n_rows) * static_cast<std::size_t>(t.width));
    for (int64_t r = 0; r < t.n_rows; ++r)
      for (int col = 0; col < t.width; ++col)
        pred[static_cast<std::size_t>(r * t.width + col)] = vals[static_cast<std::size_t>(r * np + col % np)];
    out.arrays.push_back(std::move(pred));
    out.valid.push_back(true);
    out.doubled.push_back(t.width == 2 * np && t.width != np);
  }
  if (d.inv_freq) {
    const auto& inv = v.freqs.inv_freq;
    std::vector<double> pred(inv.size());
    for (std::size_t i = 0; i < inv.size(); ++i) {
      switch (v.numerics.inv_freq) {
        case NumericDtype::bf16: pred[i] = round_to_bf16(inv[i]); break;
        case NumericDtype::f16: pred[i] = round_to_f16(inv[i]); break;
        case NumericDtype::f64: pred[i] = v.freqs.inv_freq_f64.empty() ? inv[i] : v.freqs.inv_freq_f64[i]; break;
        default: pred[i] = inv[i];
      }
    }
    const bool ok = static_cast<int64_t>(pred.size()) == d.inv_freq->n_elements();
    out.arrays.push_back(ok ? std::move(pred) : std::vector<double>{});
    out.valid.push_back(ok);
    out.doubled.push_back(false);
  }
  return out;
}

/// Tolerance of array `i` of the dump (see verify.hpp).
double tolerance(const Dump& d, std::size_t i, double attention_factor, double factor) {
  const double a = std::max(1.0, attention_factor);
  if (i < d.qk.size()) return factor * 8 * unit_roundoff(d.qk[i].dtype) * a * std::max(1.0, d.qk[i].input_max);
  i -= d.qk.size();
  if (i < d.tables.size()) return factor * 8 * unit_roundoff(d.tables[i].dtype) * a;
  return factor * 8 * std::ldexp(1.0, -24);
}

const std::vector<double>& observed(const Dump& d, std::size_t i) {
  if (i < d.qk.size()) return d.qk[i].observed;
  i -= d.qk.size();
  if (i < d.tables.size()) return d.tables[i].observed;
  return d.inv_freq->values;
}

std::string array_name(const Dump& d, std::size_t i) {
  if (i < d.qk.size()) return d.qk[i].name;
  i -= d.qk.size();
  if (i < d.tables.size()) return d.tables[i].name;
  return "inv_freq";
}

DumpDtype array_dtype(const Dump& d, std::size_t i) {
  if (i < d.qk.size()) return d.qk[i].dtype;
  i -= d.qk.size();
  if (i < d.tables.size()) return d.tables[i].dtype;
  return d.inv_freq->dtype;
}

std::size_t n_arrays(const Dump& d) { return d.qk.size() + d.tables.size() + (d.inv_freq ? 1 : 0); }

/// Table columns in interleaved order [c0 c0 c1 c1 ...] from the half-order prediction.
double table_element(const std::vector<double>& half_pred, int width, std::size_t idx, bool interleaved) {
  if (!interleaved) return half_pred[idx];
  const std::size_t row = idx / static_cast<std::size_t>(width);
  const int col = static_cast<int>(idx % static_cast<std::size_t>(width));
  const int np = width / 2;
  return half_pred[row * static_cast<std::size_t>(width) + static_cast<std::size_t>(col / 2) % static_cast<std::size_t>(np)];
}

/// max |a - b| (relative for inv_freq) of array i; the full profile when `profile` is set.
double compare(const Dump& d, std::size_t i, const std::vector<double>& obs, const std::vector<double>& pred,
               bool doubled, ArrayError* profile) {
  if (obs.size() != pred.size()) {
    if (profile) profile->max_abs = profile->mean_abs = kInf;
    return kInf;
  }
  const bool is_inv = d.inv_freq && i == n_arrays(d) - 1;
  const bool is_table = i >= d.qk.size() && !is_inv;
  const int width = is_table ? d.tables[i - d.qk.size()].width : 0;
  auto run = [&](bool interleaved, ArrayError* prof) {
    double mx = 0, sum = 0;
    int64_t channels = 1, rows = 1, inner = 1;
    std::vector<int64_t> row_pos;
    if (i < d.qk.size()) {
      const auto& p = d.qk[i];
      channels = p.head_dim;
      rows = p.rows * p.tokens;
      inner = p.heads;
    } else if (is_table) {
      channels = width;
      rows = d.tables[i - d.qk.size()].n_rows;
    } else {
      channels = static_cast<int64_t>(obs.size());
    }
    if (prof) {
      prof->channel_max.assign(static_cast<std::size_t>(channels), 0.0);
      prof->channel_mean.assign(static_cast<std::size_t>(channels), 0.0);
      prof->position_max.assign(static_cast<std::size_t>(rows), 0.0);
      prof->position_mean.assign(static_cast<std::size_t>(rows), 0.0);
    }
    const std::size_t per_row = static_cast<std::size_t>(inner * channels);
    for (std::size_t e = 0; e < obs.size(); ++e) {
      const double expected = is_table ? table_element(pred, width, e, interleaved) : pred[e];
      double err = std::fabs(obs[e] - expected);
      if (is_inv) err = expected != 0 ? std::fabs(obs[e] / expected - 1.0) : std::fabs(obs[e]);
      if (std::isnan(err)) err = kInf;
      mx = std::max(mx, err);
      sum += err;
      if (prof) {
        const std::size_t ch = e % static_cast<std::size_t>(channels);
        const std::size_t row = e / per_row;
        prof->channel_max[ch] = std::max(prof->channel_max[ch], err);
        prof->channel_mean[ch] += err;
        prof->position_max[row] = std::max(prof->position_max[row], err);
        prof->position_mean[row] += err;
      }
    }
    if (prof) {
      const double per_channel = static_cast<double>(obs.size()) / static_cast<double>(channels);
      for (double& m : prof->channel_mean) m /= per_channel;
      for (double& m : prof->position_mean) m /= static_cast<double>(per_row);
      prof->max_abs = mx;
      prof->mean_abs = obs.empty() ? 0 : sum / static_cast<double>(obs.size());
    }
    return mx;
  };
  double best = run(false, nullptr);
  bool interleaved = false;
  if (is_table && doubled) {
    const double alt = run(true, nullptr);
    if (alt < best) best = alt, interleaved = true;
  }
  if (profile) run(interleaved, profile);
  return best;
}

struct Scored {
  double score = kInf;     // max over arrays of error / tolerance
  double residual = kInf;  // max error of the primary array
};

Scored score(const Dump& d, const Prediction& pred, const std::vector<std::vector<double>>& target,
             const std::vector<double>& tol, std::size_t primary) {
  Scored s;
  s.score = 0;
  for (std::size_t i = 0; i < n_arrays(d); ++i) {
    const double err = pred.valid[i] ? compare(d, i, target[i], pred.arrays[i], pred.doubled[i], nullptr) : kInf;
    s.score = std::max(s.score, err / tol[i]);
    if (i == primary) s.residual = err;
  }
  return s;
}

nlohmann::json number(double v) { return std::isfinite(v) ? nlohmann::json(v) : nlohmann::json(nullptr); }

std::string fmt_err(double v) { return std::isfinite(v) ? fmt::format("{:.3g}", v) : "inf (shape differs)"; }

}  // namespace

VerifyResult verify_rope(const VerifyReference& reference, std::span<const DumpArray> arrays, std::string_view source,
                         const VerifyOptions& options) {
  if (!(options.tolerance_factor > 0) || !std::isfinite(options.tolerance_factor))
    fail_field<InvalidArgument>("tolerance_factor", "must be finite and > 0", options.tolerance_factor);
  const Dump d = read_dump(reference, arrays, source, options.dump_layout);

  detail::MistakeContext ctx;
  ctx.params = reference.params;
  ctx.layout = reference.layout;
  ctx.positions = d.positions;
  for (const auto& row : d.positions) ctx.all_positions.insert(ctx.all_positions.end(), row.begin(), row.end());
  ctx.reference = ctx.scheduled(reference.params);

  VerifyResult r;
  r.source = d.source;
  r.config = reference.source;
  r.notes = reference.notes;
  r.notes.push_back(fmt::format("reference: rope_type {}, rope_theta {:g}, head_dim {}, rotary_dim {}, layout {}, "
                                "attention_factor {:.6g}, cos/sin in float32",
                                reference.params.rope_type, reference.params.rope_theta, ctx.reference.head_dim,
                                ctx.reference.rotary_dim, to_string(reference.layout), ctx.reference.attention_factor));
  const std::size_t n = n_arrays(d);
  std::vector<std::vector<double>> obs(n);
  std::vector<double> tol(n);
  for (std::size_t i = 0; i < n; ++i) {
    obs[i] = observed(d, i);
    tol[i] = tolerance(d, i, ctx.reference.attention_factor, options.tolerance_factor);
  }
  const std::size_t first = 0;  // q_rope, else k_rope, else cos, sin, inv_freq: the Dump order

  const detail::RopeVariant base = ctx.base();
  const Prediction ref_pred = predict(d, base);
  r.reference_score = 0;
  for (std::size_t i = 0; i < n; ++i) {
    ArrayError e;
    e.array = array_name(d, i);
    e.dtype = std::string(to_string(array_dtype(d, i)));
    e.relative = d.inv_freq && i == n - 1;
    e.tolerance = tol[i];
    if (ref_pred.valid[i]) {
      compare(d, i, obs[i], ref_pred.arrays[i], ref_pred.doubled[i], &e);
    } else {
      e.max_abs = e.mean_abs = kInf;
      r.notes.push_back(fmt::format("{}: shape does not fit the reference's rotary_dim {} (n_pairs {})", e.array,
                                    ctx.reference.rotary_dim, ctx.reference.n_pairs()));
    }
    if (d.qk.size() > i) {
      for (const auto& row : d.positions) e.row_position.insert(e.row_position.end(), row.begin(), row.end());
    } else if (i < d.qk.size() + d.tables.size()) {
      const auto& t = d.tables[i - d.qk.size()];
      if (t.rows_are_tokens)
        for (const auto& row : d.positions) e.row_position.insert(e.row_position.end(), row.begin(), row.end());
      else
        for (int64_t p = 0; p < t.n_rows; ++p) e.row_position.push_back(p);
    }
    r.reference_score = std::max(r.reference_score, e.max_abs / e.tolerance);
    if (i == first) r.reference_residual = e.max_abs;
    r.errors.push_back(std::move(e));
  }
  r.pass = r.reference_score <= 1.0;
  // A failing dump is quoted on its worst array (relative to its tolerance).
  std::size_t primary = 0;
  if (!r.pass)
    for (std::size_t i = 1; i < n; ++i)
      if (r.errors[i].max_abs / r.errors[i].tolerance > r.errors[primary].max_abs / r.errors[primary].tolerance)
        primary = i;
  r.primary = array_name(d, primary);
  r.reference_residual = r.errors[primary].max_abs;

  for (const auto& m : detail::rope_mistakes()) {
    std::string why_not;
    std::vector<detail::RopeVariant> variants;
    try {
      variants = m.variants(ctx, why_not);
    } catch (const ConfigError& e) {
      why_not = e.what();
    }
    if (variants.empty()) {
      r.untestable.push_back(fmt::format("{}: {}", m.id, why_not.empty() ? "does not apply" : why_not));
      continue;
    }
    VerifyHypothesis best;
    best.score = kInf;
    best.residual = kInf;
    bool testable = false;
    for (const auto& v : variants) {
      const Prediction pred = predict(d, v);
      // Indistinguishable from the reference on this dump: it says nothing.
      if (score(d, pred, ref_pred.arrays, tol, primary).score <= 1.0) continue;
      testable = true;
      const Scored s = score(d, pred, obs, tol, primary);
      if (s.score < best.score || (s.score == best.score && s.residual < best.residual)) {
        best.score = s.score;
        best.residual = s.residual;
        best.variant = v.detail;
      }
    }
    if (!testable) {
      r.untestable.push_back(fmt::format("{}: gives the reference's tensors on this dump", m.id));
      continue;
    }
    best.id = std::string(m.id);
    best.title = std::string(m.title);
    best.report = std::string(m.report);
    r.hypotheses.push_back(std::move(best));
  }
  std::stable_sort(r.hypotheses.begin(), r.hypotheses.end(),
                   [](const VerifyHypothesis& a, const VerifyHypothesis& b) { return a.score < b.score; });

  const double ptol = tol[primary];
  if (r.pass) {
    r.summary = fmt::format("PASS: {} matches the reference ({} {}, layout {}): max error {} on {} (tolerance {:.3g})",
                            r.source, reference.params.rope_type, r.config, to_string(reference.layout),
                            fmt_err(r.reference_residual), r.primary, ptol);
  } else if (!r.hypotheses.empty() && r.hypotheses.front().matches()) {
    const auto& h = r.hypotheses.front();
    r.summary = fmt::format("FAIL: your output matches `{}`{} to {} on {}; the reference differs by {}", h.title,
                            h.variant.empty() ? "" : fmt::format(" ({})", h.variant), fmt_err(h.residual), r.primary,
                            fmt_err(r.reference_residual));
  } else {
    r.summary = fmt::format("FAIL: the reference differs by {} on {} (tolerance {:.3g}); no catalogued mistake "
                            "explains it{}",
                            fmt_err(r.reference_residual), r.primary, ptol,
                            r.hypotheses.empty()
                                ? std::string()
                                : fmt::format(" (closest: `{}`{}, residual {}, {:.3g}x the tolerance)",
                                              r.hypotheses.front().title,
                                              r.hypotheses.front().variant.empty()
                                                  ? ""
                                                  : fmt::format(" ({})", r.hypotheses.front().variant),
                                              fmt_err(r.hypotheses.front().residual), r.hypotheses.front().score));
  }
  return r;
}

VerifyResult verify_rope(const VerifyReference& reference, const TensorDump& dump, const VerifyOptions& options) {
  return verify_rope(reference, dump.arrays(), dump.source(), options);
}

std::string format_verify_report(const VerifyResult& r) {
  std::string out = r.summary + "\n";
  out += fmt::format("dump: {}\nconfig: {}\n", r.source, r.config);
  for (const auto& n : r.notes) out += fmt::format("  {}\n", n);
  constexpr std::size_t kWorst = 6;
  for (const auto& e : r.errors) {
    out += fmt::format("{} ({}): {}max {} mean {} tolerance {:.3g} -> {}\n", e.array, e.dtype,
                       e.relative ? "relative " : "", fmt_err(e.max_abs), fmt_err(e.mean_abs), e.tolerance,
                       e.within() ? "within" : "OUT");
    if (e.within() || !std::isfinite(e.max_abs)) continue;
    auto worst = [&](const std::vector<double>& mx, const std::vector<double>& mean, auto label) {
      std::vector<std::size_t> idx(mx.size());
      std::iota(idx.begin(), idx.end(), std::size_t{0});
      std::stable_sort(idx.begin(), idx.end(), [&](std::size_t a, std::size_t b) { return mx[a] > mx[b]; });
      idx.resize(std::min(idx.size(), kWorst));
      for (std::size_t i : idx) out += fmt::format("    {}: max {:.3g} mean {:.3g}\n", label(i), mx[i], mean[i]);
    };
    out += "  by channel (worst):\n";
    worst(e.channel_max, e.channel_mean, [](std::size_t i) { return fmt::format("channel {:4d}", i); });
    if (!e.position_max.empty()) {
      out += "  by position (worst):\n";
      worst(e.position_max, e.position_mean, [&](std::size_t i) {
        return fmt::format("row {:4d} (position {})", i, i < e.row_position.size() ? e.row_position[i] : int64_t(i));
      });
    }
  }
  if (!r.pass) {
    out += "hypotheses (best first; score = error / tolerance, <= 1 matches):\n";
    std::size_t rank = 0;
    for (const auto& h : r.hypotheses) {
      if (++rank > 10) break;
      out += fmt::format("  {:2d}. {:<32} residual {:<10} score {:<10.3g}{}\n", rank, h.id, fmt_err(h.residual),
                         h.score, h.variant.empty() ? "" : " " + h.variant);
      if (rank <= 3) out += fmt::format("      {}; report: {}\n", h.title, h.report);
    }
    out += fmt::format("not testable on this dump: {}\n", r.untestable.size());
    for (const auto& u : r.untestable) out += fmt::format("  {}\n", u);
  }
  return out;
}

std::string verify_result_json(const VerifyResult& r) {
  nlohmann::json j;
  j["pass"] = r.pass;
  j["summary"] = r.summary;
  j["dump"] = r.source;
  j["config"] = r.config;
  j["primary"] = r.primary;
  j["reference_residual"] = number(r.reference_residual);
  j["reference_score"] = number(r.reference_score);
  j["notes"] = r.notes;
  j["errors"] = nlohmann::json::array();
  for (const auto& e : r.errors) {
    nlohmann::json a{{"array", e.array},       {"dtype", e.dtype},         {"relative", e.relative},
                     {"max", number(e.max_abs)}, {"mean", number(e.mean_abs)}, {"tolerance", e.tolerance},
                     {"within", e.within()}};
    auto numbers = [](const std::vector<double>& v) {
      nlohmann::json out = nlohmann::json::array();
      for (double x : v) out.push_back(number(x));
      return out;
    };
    a["by_channel"] = {{"max", numbers(e.channel_max)}, {"mean", numbers(e.channel_mean)}};
    a["by_position"] = {{"position", e.row_position}, {"max", numbers(e.position_max)}, {"mean", numbers(e.position_mean)}};
    j["errors"].push_back(std::move(a));
  }
  j["hypotheses"] = nlohmann::json::array();
  for (const auto& h : r.hypotheses)
    j["hypotheses"].push_back({{"id", h.id},
                               {"title", h.title},
                               {"variant", h.variant},
                               {"report", h.report},
                               {"residual", number(h.residual)},
                               {"score", number(h.score)},
                               {"matches", h.matches()}});
  j["untestable"] = r.untestable;
  return j.dump(2);
}

}  // namespace posenc
