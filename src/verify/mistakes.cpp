// The catalogue of known RoPE mistakes `posenc verify` tests a dump against.
// One table (kMistakes, at the end); each entry = id, title, the public bug
// report it comes from (searched in the issue trackers of the projects where it
// happened; an entry without one says so), and a function that re-computes the
// engine's RoPE with the mistake applied. Adding a mistake is one entry here
// plus its test in tests/verify/verify_test.cpp.
#include "verify/mistakes.hpp"

#include <algorithm>
#include <cmath>
#include <numbers>
#include <set>

#include <fmt/format.h>

#include "encoding/scaling/methods.hpp"
#include "posenc/error.hpp"

namespace posenc::detail {

RopeVariant MistakeContext::base() const {
  RopeVariant v;
  v.freqs = reference;
  v.numerics = RopeNumerics{};  // AnglePrecision::float32: HF's float32 path
  v.layout = layout;
  v.positions = positions;
  return v;
}

RopeFrequencies MistakeContext::scheduled(const RopeParams& p) const {
  RopeFrequencySchedule schedule(p);
  return schedule.update(all_positions);
}

std::vector<float> llama3_inv_freq_variant(const RopeParams& p, bool wavelength_smooth) {
  const double factor = require_factor(p);
  const double low = require_positive(p, p.low_freq_factor, "low_freq_factor");
  const double high = require_positive(p, p.high_freq_factor, "high_freq_factor");
  const int64_t orig = original_max_position(p);
  const int dim = resolve_rotary_dim(p);
  std::vector<float> inv = default_inv_freq<float>(dim / 2, dim, p.rope_theta);
  // As src/encoding/scaling/llama3.cpp (float32, torch's scalar/tensor order), with the knobs.
  const float low_wavelen = static_cast<float>(static_cast<double>(orig) / low);
  const float high_wavelen = static_cast<float>(static_cast<double>(orig) / high);
  const float two_pi = static_cast<float>(2 * std::numbers::pi);
  const float f = static_cast<float>(factor);
  const float lo = static_cast<float>(low);
  const float span = static_cast<float>(high - low);
  const float ctx = static_cast<float>(orig);
  for (float& x : inv) {
    const float wavelen = (1.0f / x) * two_pi;
    float scaled = wavelen > low_wavelen ? x / f : x;
    const bool medium = !(wavelen < high_wavelen) && !(wavelen > low_wavelen);
    if (medium && span > 0) {
      // The mistake: the blend weight linear in wavelength, 1 at high_wavelen, 0 at low_wavelen.
      const float smooth = wavelength_smooth ? (low_wavelen - wavelen) / (low_wavelen - high_wavelen)
                                     : ((1.0f / wavelen) * ctx - lo) / span;
      scaled = (1.0f - smooth) * scaled / f + smooth * scaled;
    }
    x = scaled;
  }
  return inv;
}

std::vector<float> yarn_inv_freq_variant(const RopeParams& p, bool ramp_over_channels) {
  // As src/encoding/scaling/yarn.cpp (HF _compute_yarn_parameters), with the knobs.
  const int dim = resolve_rotary_dim(p);
  const int64_t orig = original_max_position(p);
  const double factor = factor_or_context_ratio(p, orig);
  const double beta_fast = p.beta_fast && *p.beta_fast != 0.0 ? *p.beta_fast : 32.0;
  const double beta_slow = p.beta_slow && *p.beta_slow != 0.0 ? *p.beta_slow : 1.0;
  auto correction_dim = [&](double rotations) {
    return (dim * std::log(static_cast<double>(orig) / (rotations * 2 * std::numbers::pi))) /
           (2 * std::log(p.rope_theta));
  };
  double low = correction_dim(beta_fast);
  double high = correction_dim(beta_slow);
  if (p.truncate.value_or(true)) {
    low = std::floor(low);
    high = std::ceil(high);
  }
  low = std::max(low, 0.0);
  high = std::min(high, static_cast<double>(dim - 1));
  if (low == high) high += 0.001;
  const float ramp_lo = static_cast<float>(low);
  const float ramp_span = static_cast<float>(high - low);
  const int n = dim / 2;
  const float b = static_cast<float>(p.rope_theta);
  const float s = static_cast<float>(factor);
  std::vector<float> inv(static_cast<std::size_t>(n));
  for (int i = 0; i < n; ++i) {
    const float pos_freq = std::pow(b, static_cast<float>(2 * i) / static_cast<float>(dim));
    const float extrapolation = 1.0f / pos_freq;
    const float interpolation = 1.0f / (s * pos_freq);
    const float index = static_cast<float>(ramp_over_channels ? 2 * i : i);
    const float ramp = std::clamp((index - ramp_lo) / ramp_span, 0.0f, 1.0f);
    const float extrapolation_factor = 1.0f - ramp;
    const float keep = 1.0f - extrapolation_factor;
    inv[static_cast<std::size_t>(i)] = interpolation * keep + extrapolation * extrapolation_factor;
  }
  return inv;
}

namespace {

using Variants = std::vector<RopeVariant>;

RopeVariant with_inv_freq(const MistakeContext& ctx, std::vector<float> inv, std::string detail) {
  RopeVariant v = ctx.base();
  v.freqs.inv_freq = std::move(inv);
  v.freqs.inv_freq_f64.clear();
  v.detail = std::move(detail);
  return v;
}

bool scaled_attention(const MistakeContext& ctx, std::string& why) {
  if (ctx.reference.attention_factor == 1.0) {
    why = fmt::format("attention_factor is 1 for rope_type {}", ctx.params.rope_type);
    return false;
  }
  return true;
}

Variants layout_swapped(const MistakeContext& ctx, std::string&) {
  RopeVariant v = ctx.base();
  v.layout = ctx.layout == RopeLayout::half ? RopeLayout::interleaved : RopeLayout::half;
  v.detail = fmt::format("{} pairing instead of {}", to_string(v.layout), to_string(ctx.layout));
  return {v};
}

Variants rotary_full_instead_of_partial(const MistakeContext& ctx, std::string& why) {
  if (ctx.reference.rotary_dim == ctx.reference.head_dim) {
    why = "the config rotates the full head";
    return {};
  }
  RopeParams p = ctx.params;
  p.rotary_dim = p.head_dim;
  p.partial_rotary_factor.reset();
  RopeVariant v = ctx.base();
  v.freqs = ctx.scheduled(p);
  v.detail = fmt::format("rotary_dim {} instead of {}", p.head_dim, ctx.reference.rotary_dim);
  return {v};
}

Variants rotary_partial_instead_of_full(const MistakeContext& ctx, std::string& why) {
  if (ctx.reference.rotary_dim != ctx.reference.head_dim) {
    why = "the config already rotates part of the head";
    return {};
  }
  Variants out;
  for (int div : {2, 4}) {
    const int width = ctx.reference.head_dim / div;
    if (width < 2 || width % 2 != 0) continue;
    RopeParams p = ctx.params;
    p.rotary_dim = width;
    p.partial_rotary_factor.reset();
    if (!p.short_factor.empty() || !p.long_factor.empty()) continue;  // longrope lists are sized for the full width
    RopeVariant v = ctx.base();
    v.freqs = ctx.scheduled(p);
    v.detail = fmt::format("rotary_dim {} instead of {}", width, ctx.reference.head_dim);
    out.push_back(std::move(v));
  }
  if (out.empty()) why = "no narrower even width";
  return out;
}

Variants rotary_partial_head_dim_exponent(const MistakeContext& ctx, std::string& why) {
  if (ctx.reference.rotary_dim == ctx.reference.head_dim) {
    why = "the config rotates the full head";
    return {};
  }
  if (ctx.params.rope_type != "default") {
    why = fmt::format("checked for rope_type default only (got {})", ctx.params.rope_type);
    return {};
  }
  // theta^(-2i/head_dim) over the rotary pairs instead of theta^(-2i/rotary_dim).
  const int n = ctx.reference.n_pairs();
  return {with_inv_freq(ctx, default_inv_freq<float>(n, ctx.reference.head_dim, ctx.params.rope_theta),
                        fmt::format("exponent 2i/{} instead of 2i/{}", ctx.reference.head_dim, ctx.reference.rotary_dim))};
}

Variants attention_factor_missing(const MistakeContext& ctx, std::string& why) {
  if (!scaled_attention(ctx, why)) return {};
  RopeVariant v = ctx.base();
  v.freqs.attention_factor = 1.0;
  v.detail = fmt::format("1 instead of {:.6g}", ctx.reference.attention_factor);
  return {v};
}

Variants attention_factor_squared(const MistakeContext& ctx, std::string& why) {
  if (!scaled_attention(ctx, why)) return {};
  RopeVariant v = ctx.base();
  const double a = ctx.reference.attention_factor;
  v.freqs.attention_factor = a * a;
  v.detail = fmt::format("{:.6g} instead of {:.6g}", a * a, a);
  return {v};
}

Variants attention_factor_sqrt(const MistakeContext& ctx, std::string& why) {
  if (!scaled_attention(ctx, why)) return {};
  RopeVariant v = ctx.base();
  const double a = ctx.reference.attention_factor;
  v.freqs.attention_factor = std::sqrt(a);
  v.detail = fmt::format("{:.6g} instead of {:.6g}", std::sqrt(a), a);
  return {v};
}

Variants dynamic_ntk_wrong_length(const MistakeContext& ctx, std::string& why) {
  if (ctx.params.rope_type != "dynamic") {
    why = fmt::format("rope_type is {}, not dynamic", ctx.params.rope_type);
    return {};
  }
  const RopeParams& p = ctx.params;
  const int64_t max_pos = require_max_position_embeddings(p);
  const double factor = require_factor(p);
  const int64_t seq_len = *std::max_element(ctx.all_positions.begin(), ctx.all_positions.end()) + 1;
  std::set<int64_t> lengths;
  Variants out;
  auto add = [&](int64_t L, std::string label) {
    if (L <= 0 || L == seq_len || !lengths.insert(L).second) return;
    RopeVariant v = ctx.base();
    v.freqs = dynamic_ntk_frequencies(p, L, DynamicNtkArithmetic::python_double);
    v.detail = fmt::format("L = {} ({}) instead of max(position_ids)+1 = {}", L, std::move(label), seq_len);
    out.push_back(std::move(v));
  };
  add(static_cast<int64_t>(std::llround(factor * static_cast<double>(max_pos))), "factor x max_position_embeddings");
  add(seq_len - 1, "max(position_ids), no +1");
  int64_t longest_row = 0;
  for (const auto& row : ctx.positions) longest_row = std::max<int64_t>(longest_row, static_cast<int64_t>(row.size()));
  add(longest_row, "tokens of this call");
  add(max_pos, "never updated");
  if (out.empty()) why = "every candidate length equals max(position_ids)+1";
  return out;
}

Variants llama3_bands_missing(const MistakeContext& ctx, std::string& why) {
  if (ctx.params.rope_type != "llama3") {
    why = fmt::format("rope_type is {}, not llama3", ctx.params.rope_type);
    return {};
  }
  const int n = ctx.reference.n_pairs();
  return {with_inv_freq(ctx, default_inv_freq<float>(n, ctx.reference.rotary_dim, ctx.params.rope_theta),
                        "plain rope_theta frequencies")};
}

Variants llama3_bands_wrong(const MistakeContext& ctx, std::string& why) {
  if (ctx.params.rope_type != "llama3") {
    why = fmt::format("rope_type is {}, not llama3", ctx.params.rope_type);
    return {};
  }
  Variants out;
  std::vector<float> divided = default_inv_freq<float>(ctx.reference.n_pairs(), ctx.reference.rotary_dim, ctx.params.rope_theta);
  const float f = static_cast<float>(require_factor(ctx.params));
  for (float& x : divided) x = x / f;  // linear scaling of every band (HF's linear type, float32)
  out.push_back(with_inv_freq(ctx, std::move(divided), "every band divided by factor"));
  out.push_back(with_inv_freq(ctx, llama3_inv_freq_variant(ctx.params, true), "smooth factor linear in wavelength"));
  if (ctx.params.factor && *ctx.params.factor != 8.0) {
    RopeParams eight = ctx.params;
    eight.factor = 8.0;
    out.push_back(with_inv_freq(ctx, compute_rope_frequencies(eight).inv_freq,
                                fmt::format("factor 8 hard-coded instead of {:g}", *ctx.params.factor)));
  }
  return out;
}

Variants yarn_ramp_wrong_space(const MistakeContext& ctx, std::string& why) {
  if (ctx.params.rope_type != "yarn") {
    why = fmt::format("rope_type is {}, not yarn", ctx.params.rope_type);
    return {};
  }
  return {with_inv_freq(ctx, yarn_inv_freq_variant(ctx.params, true),
                        "ramp at channel index 2i instead of pair index i")};
}

Variants yarn_truncate_ignored(const MistakeContext& ctx, std::string& why) {
  if (ctx.params.rope_type != "yarn") {
    why = fmt::format("rope_type is {}, not yarn", ctx.params.rope_type);
    return {};
  }
  const bool truncate = ctx.params.truncate.value_or(true);
  RopeParams flipped = ctx.params;
  flipped.truncate = !truncate;
  return {with_inv_freq(ctx, compute_rope_frequencies(flipped).inv_freq,
                        truncate ? "correction range not rounded (truncate true ignored)"
                                 : "correction range rounded (truncate false ignored)")};
}

Variants longrope_swapped(const MistakeContext& ctx, std::string& why) {
  if (ctx.params.rope_type != "longrope") {
    why = fmt::format("rope_type is {}, not longrope", ctx.params.rope_type);
    return {};
  }
  RopeParams p = ctx.params;
  std::swap(p.short_factor, p.long_factor);
  RopeVariant v = ctx.base();
  const double af = v.freqs.attention_factor;
  v.freqs = ctx.scheduled(p);
  v.freqs.attention_factor = af;
  const int64_t orig = original_max_position(ctx.params);
  const int64_t seq_len = *std::max_element(ctx.all_positions.begin(), ctx.all_positions.end()) + 1;
  v.detail = seq_len > orig ? "short_factor used past original_max_position_embeddings"
                            : "long_factor used within original_max_position_embeddings";
  return {v};
}

Variants frequency_exponent_off(const MistakeContext& ctx, std::string& why) {
  if (ctx.params.rope_type != "default" && ctx.params.rope_type != "linear") {
    why = fmt::format("checked for rope_type default/linear only (got {})", ctx.params.rope_type);
    return {};
  }
  const int n = ctx.reference.n_pairs();
  const int d = ctx.reference.rotary_dim;
  if (d <= 2) {
    why = "rotary_dim 2 has one frequency";
    return {};
  }
  std::vector<float> inv = default_inv_freq<float>(n, d - 2, ctx.params.rope_theta);
  if (ctx.params.rope_type == "linear") {
    const float f = static_cast<float>(require_factor(ctx.params));
    for (float& x : inv) x = x / f;
  }
  return {with_inv_freq(ctx, std::move(inv), fmt::format("exponent 2i/{} instead of 2i/{}", d - 2, d))};
}

RopeVariant numerics_variant(const MistakeContext& ctx, RopeNumerics numerics) {
  RopeVariant v = ctx.base();
  v.numerics = numerics;
  v.detail = to_string(numerics);
  return v;
}

Variants cos_sin_low_precision(const MistakeContext& ctx, std::string&) {
  using D = NumericDtype;
  return {numerics_variant(ctx, {D::f32, D::f32, D::f32, D::f16}),
          numerics_variant(ctx, {D::f32, D::f32, D::f32, D::bf16}),
          numerics_variant(ctx, {D::f32, D::f32, D::f16, D::f32}),
          numerics_variant(ctx, {D::f32, D::f32, D::bf16, D::f32}),
          numerics_variant(ctx, {D::f16, D::f16, D::f16, D::f16}),
          numerics_variant(ctx, {D::bf16, D::bf16, D::bf16, D::bf16})};
}

Variants inv_freq_low_precision(const MistakeContext& ctx, std::string&) {
  using D = NumericDtype;
  return {numerics_variant(ctx, {D::bf16, D::f32, D::f32, D::f32}),
          numerics_variant(ctx, {D::f16, D::f32, D::f32, D::f32})};
}

Variants positions_low_precision(const MistakeContext& ctx, std::string&) {
  using D = NumericDtype;
  return {numerics_variant(ctx, {D::f32, D::bf16, D::f32, D::f32}),
          numerics_variant(ctx, {D::f32, D::f16, D::f32, D::f32})};
}

Variants positions_offset(const MistakeContext& ctx, std::string&) {
  Variants out;
  int64_t min_pos = 0;
  if (!ctx.all_positions.empty()) min_pos = *std::min_element(ctx.all_positions.begin(), ctx.all_positions.end());
  for (int64_t k = -16; k <= 16; ++k) {
    if (k == 0 || min_pos + k < 0) continue;
    RopeVariant v = ctx.base();
    for (auto& row : v.positions)
      for (int64_t& p : row) p += k;
    v.detail = fmt::format("offset {:+d}", k);
    out.push_back(std::move(v));
  }
  return out;
}

Variants positions_restart_per_chunk(const MistakeContext& ctx, std::string& why) {
  int64_t tokens = 0;
  for (const auto& row : ctx.positions) tokens = std::max<int64_t>(tokens, static_cast<int64_t>(row.size()));
  std::set<int64_t> chunks;
  for (int64_t c = 2; c < tokens && c <= 64; ++c) chunks.insert(c);
  for (int64_t c = 64; c < tokens && chunks.size() < 256; c += 16) chunks.insert(c);
  Variants out;
  for (int64_t c : chunks) {
    RopeVariant v = ctx.base();
    for (auto& row : v.positions) {
      const std::vector<int64_t> orig = row;
      for (std::size_t t = 0; t < row.size(); ++t) row[t] = orig[t] - orig[t - t % static_cast<std::size_t>(c)];
    }
    v.detail = fmt::format("chunks of {} tokens", c);
    out.push_back(std::move(v));
  }
  if (out.empty()) why = "fewer than 3 tokens per row";
  return out;
}

Variants positions_count_left_padding(const MistakeContext& ctx, std::string&) {
  RopeVariant v = ctx.base();
  for (auto& row : v.positions)
    for (std::size_t t = 0; t < row.size(); ++t) row[t] = static_cast<int64_t>(t);
  v.detail = "positions 0..T-1 of the padded row instead of position_ids";
  return {v};
}

constexpr RopeMistake kMistakes[] = {
    {"layout_swapped", "rotate_half and interleaved pairing swapped",
     "https://github.com/ggml-org/llama.cpp/pull/13260 (PLaMo ran with the wrong rope type for over a year); "
     "https://github.com/NeuraLegion/shainet/pull/111 (interleaved pairs on HF Llama weights)",
     layout_swapped},
    {"rotary_full_instead_of_partial", "full head rotated where the config rotates a part (partial_rotary_factor ignored)",
     "https://github.com/AI-Hypercomputer/maxtext/issues/4616", rotary_full_instead_of_partial},
    {"rotary_partial_instead_of_full", "part of the head rotated where the config rotates all of it",
     "no public report found; the converse of maxtext#4616 (e.g. a Llama config's partial_rotary_factor, which HF's "
     "Llama ignores, honoured by an engine)",
     rotary_partial_instead_of_full},
    {"rotary_partial_head_dim_exponent", "partial rotary with frequencies over head_dim instead of rotary_dim",
     "https://github.com/pie-project/pie/pull/603", rotary_partial_head_dim_exponent},
    {"attention_factor_missing", "attention_factor (YaRN/LongRoPE mscale) not applied to cos/sin",
     "https://github.com/turboderp-org/exllamav3/issues/259", attention_factor_missing},
    {"attention_factor_squared", "attention_factor applied twice (squared)",
     "https://github.com/sgl-project/sglang/pull/33558", attention_factor_squared},
    {"attention_factor_sqrt", "sqrt(attention_factor) on cos/sin (the factor taken for the q.k scale and split over q and k)",
     "no public report found", attention_factor_sqrt},
    {"dynamic_ntk_wrong_length", "dynamic NTK base evaluated at the wrong length",
     "https://github.com/vllm-project/vllm/issues/41236 (also vllm#5093)", dynamic_ntk_wrong_length},
    {"llama3_bands_missing", "Llama-3 frequency bands missing (rope_scaling ignored)",
     "https://github.com/lablup/mlxcel/issues/1355 (also transformers#32330: the unscaled inv_freq returned)",
     llama3_bands_missing},
    {"llama3_bands_wrong", "Llama-3 frequency bands wrong",
     "https://github.com/meta-llama/llama-models/issues/241 (factor 8 hard-coded where the config says 32)",
     llama3_bands_wrong},
    {"yarn_ramp_wrong_space", "YaRN ramp evaluated in the wrong index space",
     "https://github.com/jquesnelle/yarn/issues/65", yarn_ramp_wrong_space},
    {"yarn_truncate_ignored", "YaRN truncate ignored", "https://github.com/sgl-project/sglang/pull/14270",
     yarn_truncate_ignored},
    {"longrope_factors_swapped", "LongRoPE short_factor/long_factor swapped",
     "https://github.com/lablup/mlxcel/issues/1358 (also llama.cpp#6849, mistral.rs selecting by offsets)",
     longrope_swapped},
    {"frequency_exponent_off", "sinusoidal frequency exponent off by one pair (2i/(d-2), tensor2tensor's half_dim-1)",
     "https://github.com/hojonathanho/diffusion/issues/15", frequency_exponent_off},
    {"cos_sin_low_precision", "angle or cos/sin table in fp16/bf16",
     "https://github.com/EleutherAI/gpt-neox/issues/1003 (fp16/bf16 tables); "
     "https://github.com/KellerJordan/modded-nanogpt/issues/39 (bf16 cos/sin)",
     cos_sin_low_precision},
    {"inv_freq_bf16", "inverse frequencies held in bf16/fp16 (model.to(bfloat16) casting the inv_freq buffer)",
     "https://github.com/huggingface/transformers/issues/29496 (also Megatron-LM#744, sglang-jax#1472)",
     inv_freq_low_precision},
    {"positions_bf16", "positions formed in bf16/fp16", "https://github.com/huggingface/diffusers/issues/13920",
     positions_low_precision},
    {"positions_offset", "positions offset by a constant",
     "https://github.com/mlx-node/mlx-node/pull/33 (the closest report found: a rope offset counted twice "
     "in chunked prefill)",
     positions_offset},
    {"positions_restart_per_chunk", "positions restarted per chunk",
     "https://github.com/huggingface/transformers/issues/43082", positions_restart_per_chunk},
    {"positions_count_left_padding", "positions counting left padding",
     "https://github.com/unslothai/unsloth/pull/3795 (issue unsloth#3699)", positions_count_left_padding},
};

}  // namespace

std::span<const RopeMistake> rope_mistakes() { return kMistakes; }

}  // namespace posenc::detail
