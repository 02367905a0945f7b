#include "posenc/rope.hpp"

#include <algorithm>
#include <cmath>
#include <vector>

#include <fmt/format.h>

#include "core/parallel.hpp"
#include "encoding/rope_kernels.hpp"
#include "posenc/error.hpp"
#include "posenc/float16.hpp"

namespace posenc {

std::string_view to_string(RopeLayout layout) {
  return layout == RopeLayout::half ? "half" : "interleaved";
}

std::string_view to_string(AnglePrecision precision) {
  switch (precision) {
    case AnglePrecision::float32: return "float32";
    case AnglePrecision::exact: return "exact";
    case AnglePrecision::fp64: return "fp64";
    case AnglePrecision::bf16: return "bf16";
    case AnglePrecision::fp16: return "fp16";
  }
  return "?";
}

RopeLayout parse_rope_layout(std::string_view text, std::string_view field) {
  if (text == "half") return RopeLayout::half;
  if (text == "interleaved") return RopeLayout::interleaved;
  throw ConfigError(fmt::format(
      "{}: unknown RoPE layout '{}' (expected 'half' = rotate_half/GPT-NeoX or "
      "'interleaved' = GPT-J/RoFormer/llama2.c)",
      field, text));
}

AnglePrecision parse_angle_precision(std::string_view text, std::string_view field) {
  if (text == "float32") return AnglePrecision::float32;
  if (text == "exact") return AnglePrecision::exact;
  if (text == "fp64") return AnglePrecision::fp64;
  if (text == "bf16") return AnglePrecision::bf16;
  if (text == "fp16") return AnglePrecision::fp16;
  throw ConfigError(fmt::format(
      "{}: unknown angle precision '{}' (expected 'float32', 'exact', 'fp64', 'bf16' or 'fp16')", field, text));
}

void RopeFrequencies::validate() const {
  if (head_dim <= 0) fail_field<InvalidArgument>("head_dim", "must be positive", head_dim);
  if (rotary_dim <= 0 || rotary_dim % 2 != 0)
    fail_field<InvalidArgument>("rotary_dim", "must be a positive even number", rotary_dim);
  if (rotary_dim > head_dim)
    throw InvalidArgument(
        fmt::format("rotary_dim: must not exceed head_dim {} (got {})", head_dim, rotary_dim));
  if (static_cast<int>(inv_freq.size()) != rotary_dim / 2)
    throw InvalidArgument(fmt::format("inv_freq: expected rotary_dim/2 = {} entries (got {})",
                                      rotary_dim / 2, inv_freq.size()));
  for (std::size_t i = 0; i < inv_freq.size(); ++i)
    if (!std::isfinite(inv_freq[i]))
      throw InvalidArgument(fmt::format("inv_freq[{}]: must be finite (got {})", i, inv_freq[i]));
  if (!inv_freq_f64.empty() && inv_freq_f64.size() != inv_freq.size())
    throw InvalidArgument(fmt::format("inv_freq_f64: expected rotary_dim/2 = {} entries or none (got {})",
                                      rotary_dim / 2, inv_freq_f64.size()));
  for (std::size_t i = 0; i < inv_freq_f64.size(); ++i)
    if (!std::isfinite(inv_freq_f64[i]))
      throw InvalidArgument(fmt::format("inv_freq_f64[{}]: must be finite (got {})", i, inv_freq_f64[i]));
  if (!std::isfinite(attention_factor) || attention_factor <= 0)
    fail_field<InvalidArgument>("attention_factor", "must be finite and positive",
                                attention_factor);
}

RopeFrequencies default_rope_frequencies(int head_dim, int rotary_dim, double rope_theta) {
  if (!std::isfinite(rope_theta) || rope_theta <= 0)
    fail_field<InvalidArgument>("rope_theta", "must be finite and positive", rope_theta);
  RopeFrequencies f;
  f.head_dim = head_dim;
  f.rotary_dim = rotary_dim;
  if (rotary_dim <= 0 || rotary_dim % 2 != 0)
    fail_field<InvalidArgument>("rotary_dim", "must be a positive even number", rotary_dim);
  if (rotary_dim > head_dim)
    throw InvalidArgument(
        fmt::format("rotary_dim: must not exceed head_dim {} (got {})", head_dim, rotary_dim));
  f.inv_freq.resize(static_cast<std::size_t>(rotary_dim / 2));
  const float base = static_cast<float>(rope_theta);
  for (int i = 0; i < rotary_dim / 2; ++i) {
    // HF: 1.0 / (base ** (arange(0, dim, 2).float() / dim)), all float32.
    const float exponent = static_cast<float>(2 * i) / static_cast<float>(rotary_dim);
    f.inv_freq[static_cast<std::size_t>(i)] = 1.0f / std::pow(base, exponent);
  }
  f.inv_freq_f64.resize(f.inv_freq.size());
  for (int i = 0; i < rotary_dim / 2; ++i)
    f.inv_freq_f64[static_cast<std::size_t>(i)] =
        1.0 / std::pow(rope_theta, static_cast<double>(2 * i) / static_cast<double>(rotary_dim));
  f.validate();
  return f;
}

void rope_cos_sin(const RopeFrequencies& freqs, std::span<const int64_t> position_ids,
                  AnglePrecision precision, std::span<float> cos, std::span<float> sin) {
  if (precision != AnglePrecision::float32 && precision != AnglePrecision::exact)
    return rope_cos_sin_with(freqs, position_ids, rope_numerics(precision), cos, sin);
  const std::size_t n_pairs = freqs.inv_freq.size();
  const std::size_t need = position_ids.size() * n_pairs;
  if (cos.size() < need || sin.size() < need)
    throw InvalidArgument(fmt::format("rope_cos_sin: output holds {} values, need {}",
                                      std::min(cos.size(), sin.size()), need));
  const float af = static_cast<float>(freqs.attention_factor);
  const bool scale = freqs.attention_factor != 1.0;
  const int np = static_cast<int>(n_pairs);
  const int64_t n = static_cast<int64_t>(position_ids.size());
  // Rows are independent; vectorised sincos per row (rope_kernels.cpp), rows
  // shared out between threads once the table is large enough to pay for it.
#pragma omp parallel for schedule(static) if (n * np >= (1 << 15))
  for (int64_t t = 0; t < n; ++t)
    detail::rope_cos_sin_row(freqs.inv_freq.data(), np, position_ids[static_cast<std::size_t>(t)],
                             precision, af, scale, cos.data() + t * np, sin.data() + t * np);
}

std::string_view to_string(NumericDtype dtype) {
  switch (dtype) {
    case NumericDtype::f64: return "f64";
    case NumericDtype::f32: return "f32";
    case NumericDtype::bf16: return "bf16";
    case NumericDtype::f16: return "f16";
  }
  return "?";
}

std::string to_string(const RopeNumerics& n) {
  return fmt::format("inv_freq={} position={} angle={} table={}", to_string(n.inv_freq), to_string(n.position),
                     to_string(n.angle), to_string(n.table));
}

RopeNumerics rope_numerics(AnglePrecision precision) {
  using D = NumericDtype;
  switch (precision) {
    case AnglePrecision::float32: return {D::f32, D::f32, D::f32, D::f32};
    case AnglePrecision::exact: return {D::f32, D::f64, D::f64, D::f32};
    case AnglePrecision::fp64: return {D::f64, D::f64, D::f64, D::f32};
    case AnglePrecision::bf16: return {D::bf16, D::bf16, D::bf16, D::bf16};
    case AnglePrecision::fp16: return {D::f16, D::f16, D::f16, D::f16};
  }
  return {};
}

void rope_cos_sin_f64(const RopeFrequencies& freqs, std::span<const int64_t> position_ids, std::span<double> cos,
                      std::span<double> sin) {
  const std::size_t n_pairs = freqs.inv_freq_f64.size();
  if (n_pairs == 0 || n_pairs != freqs.inv_freq.size())
    throw InvalidArgument(fmt::format(
        "rope_cos_sin_f64: inv_freq_f64 has {} entries for {} pairs; compute the frequencies with "
        "compute_rope_frequencies (its double-precision twin fills them)",
        n_pairs, freqs.inv_freq.size()));
  const std::size_t need = position_ids.size() * n_pairs;
  if (cos.size() < need || sin.size() < need)
    throw InvalidArgument(fmt::format("rope_cos_sin_f64: output holds {} values, need {}",
                                      std::min(cos.size(), sin.size()), need));
  for (std::size_t t = 0; t < position_ids.size(); ++t)
    for (std::size_t i = 0; i < n_pairs; ++i) {
      const double angle = static_cast<double>(position_ids[t]) * freqs.inv_freq_f64[i];
      cos[t * n_pairs + i] = std::cos(angle) * freqs.attention_factor;
      sin[t * n_pairs + i] = std::sin(angle) * freqs.attention_factor;
    }
}

namespace detail {

void rope_cos_sin_row(const RopeFrequencies& freqs, int64_t position, AnglePrecision precision, float* c, float* s) {
  const int np = freqs.n_pairs();
  if (precision == AnglePrecision::float32 || precision == AnglePrecision::exact) {
    rope_cos_sin_row(freqs.inv_freq.data(), np, position, precision, static_cast<float>(freqs.attention_factor),
                     freqs.attention_factor != 1.0, c, s);
    return;
  }
  const int64_t p[1] = {position};
  rope_cos_sin_with(freqs, p, rope_numerics(precision), std::span<float>(c, static_cast<std::size_t>(np)),
                    std::span<float>(s, static_cast<std::size_t>(np)));
}

}  // namespace detail

namespace {

// x (a float32 value) rounded to `dtype` and widened back; f32/f64 leave it.
float round_stage(float x, NumericDtype dtype) {
  if (dtype == NumericDtype::bf16) return round_to_bf16(x);
  if (dtype == NumericDtype::f16) return round_to_f16(x);
  return x;
}

}  // namespace

void rope_cos_sin_with(const RopeFrequencies& freqs, std::span<const int64_t> position_ids,
                       const RopeNumerics& numerics, std::span<float> cos, std::span<float> sin) {
  constexpr RopeNumerics kFloat32{};
  constexpr RopeNumerics kExact{NumericDtype::f32, NumericDtype::f64, NumericDtype::f64, NumericDtype::f32};
  if (numerics == kFloat32) return rope_cos_sin(freqs, position_ids, AnglePrecision::float32, cos, sin);
  if (numerics == kExact) return rope_cos_sin(freqs, position_ids, AnglePrecision::exact, cos, sin);
  const std::size_t n_pairs = freqs.inv_freq.size();
  const std::size_t need = position_ids.size() * n_pairs;
  if (cos.size() < need || sin.size() < need)
    throw InvalidArgument(fmt::format("rope_cos_sin_with: output holds {} values, need {}",
                                      std::min(cos.size(), sin.size()), need));
  if (numerics.inv_freq == NumericDtype::f64 && freqs.inv_freq_f64.size() != n_pairs)
    throw InvalidArgument(fmt::format(
        "rope_cos_sin_with: inv_freq=f64 needs inv_freq_f64 with {} entries (got {}); compute the "
        "frequencies with the double-precision twin",
        n_pairs, freqs.inv_freq_f64.size()));
  const float af = static_cast<float>(freqs.attention_factor);
  const bool scale = freqs.attention_factor != 1.0;
  for (std::size_t t = 0; t < position_ids.size(); ++t) {
    const int64_t p = position_ids[t];
    for (std::size_t i = 0; i < n_pairs; ++i) {
      double angle;
      if (numerics.angle == NumericDtype::f64) {
        const double inv = numerics.inv_freq == NumericDtype::f64
                               ? freqs.inv_freq_f64[i]
                               : static_cast<double>(round_stage(freqs.inv_freq[i], numerics.inv_freq));
        const double pos = numerics.position == NumericDtype::f64
                               ? static_cast<double>(p)
                               : static_cast<double>(round_stage(static_cast<float>(p), numerics.position));
        angle = pos * inv;
      } else {
        const float inv = numerics.inv_freq == NumericDtype::f64 ? static_cast<float>(freqs.inv_freq_f64[i])
                                                                 : round_stage(freqs.inv_freq[i], numerics.inv_freq);
        const float pos = round_stage(static_cast<float>(p), numerics.position);
        angle = static_cast<double>(round_stage(pos * inv, numerics.angle));
      }
      float c, s;
      if (numerics.angle == NumericDtype::f64 && numerics.inv_freq == NumericDtype::f64) {
        c = static_cast<float>(scale ? std::cos(angle) * freqs.attention_factor : std::cos(angle));
        s = static_cast<float>(scale ? std::sin(angle) * freqs.attention_factor : std::sin(angle));
      } else {
        c = static_cast<float>(std::cos(angle));
        s = static_cast<float>(std::sin(angle));
        if (scale) {
          c *= af;
          s *= af;
        }
      }
      cos[t * n_pairs + i] = round_stage(c, numerics.table);
      sin[t * n_pairs + i] = round_stage(s, numerics.table);
    }
  }
}

RopeTable::RopeTable(const RopeFrequencies& freqs, std::span<const int64_t> position_ids,
                     AnglePrecision precision)
    : n_positions_(static_cast<int64_t>(position_ids.size())),
      n_pairs_(freqs.n_pairs()),
      precision_(precision) {
  freqs.validate();
  cos_.resize(position_ids.size() * static_cast<std::size_t>(n_pairs_));
  sin_.resize(cos_.size());
  rope_cos_sin(freqs, position_ids, precision, cos_, sin_);
}

namespace {

// Rotation of [tokens, heads, head_dim] rows: the vector kernels live in
// rope_kernels.cpp; tokens are shared out between threads when the tensor is
// large enough to amortise the fork (64K floats).
template <RopeLayout L, RopeDirection D>
void rotate_all(float* x, int64_t tokens, int heads, int head_dim, int64_t token_stride,
                const RopeTable& table) {
  const int n_pairs = table.n_pairs();
  if (tokens == 0) return;
  if (tokens * heads * head_dim <= (int64_t{1} << 16) || tokens < 2) {
    detail::rope_rotate_rows(x, tokens, heads, head_dim, token_stride, table.cos_row(0),
                             table.sin_row(0), n_pairs, n_pairs, L, D);
    return;
  }
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < tokens; ++t)
    detail::rope_rotate_rows(x + t * token_stride, 1, heads, head_dim, token_stride,
                             table.cos_row(t), table.sin_row(t), n_pairs, n_pairs, L, D);
}

}  // namespace

void apply_rope(float* x, int64_t tokens, int heads, int head_dim, const RopeTable& table,
                RopeLayout layout, RopeDirection direction, int64_t token_stride) {
  if (table.rotary_dim() > head_dim)
    throw InvalidArgument(fmt::format("apply_rope: rotary_dim {} exceeds head_dim {}",
                                      table.rotary_dim(), head_dim));
  if (table.n_positions() < tokens)
    throw InvalidArgument(fmt::format("apply_rope: table holds {} positions for {} tokens",
                                      table.n_positions(), tokens));
  if (tokens < 0 || heads <= 0 || head_dim <= 0)
    throw InvalidArgument(fmt::format("apply_rope: bad shape [{}, {}, {}]", tokens, heads, head_dim));
  if (token_stride == 0) token_stride = static_cast<int64_t>(heads) * head_dim;
  if (token_stride < static_cast<int64_t>(heads) * head_dim)
    throw InvalidArgument(fmt::format("apply_rope: token_stride {} < heads*head_dim {}",
                                      token_stride, heads * head_dim));
  const bool fwd = direction == RopeDirection::forward;
  if (layout == RopeLayout::half) {
    fwd ? rotate_all<RopeLayout::half, RopeDirection::forward>(x, tokens, heads, head_dim, token_stride, table)
        : rotate_all<RopeLayout::half, RopeDirection::inverse>(x, tokens, heads, head_dim, token_stride, table);
  } else {
    fwd ? rotate_all<RopeLayout::interleaved, RopeDirection::forward>(x, tokens, heads, head_dim, token_stride, table)
        : rotate_all<RopeLayout::interleaved, RopeDirection::inverse>(x, tokens, heads, head_dim, token_stride, table);
  }
}

void apply_rope(const float* in, float* out, int64_t tokens, int heads, int head_dim,
                const RopeTable& table, RopeLayout layout, RopeDirection direction) {
  const std::size_t n = static_cast<std::size_t>(tokens) * static_cast<std::size_t>(heads) *
                        static_cast<std::size_t>(head_dim);
  if (in != out) std::copy(in, in + n, out);
  apply_rope(out, tokens, heads, head_dim, table, layout, direction);
}

void apply_rope(float* x, int64_t tokens, int heads, const RopeFrequencies& freqs,
                std::span<const int64_t> position_ids, RopeLayout layout,
                AnglePrecision precision, RopeDirection direction) {
  if (static_cast<int64_t>(position_ids.size()) != tokens)
    throw InvalidArgument(fmt::format("apply_rope: position_ids has {} entries for {} tokens",
                                      position_ids.size(), tokens));
  if (tokens < 0 || heads <= 0)
    throw InvalidArgument(fmt::format("apply_rope: bad shape [{}, {}, {}]", tokens, heads,
                                      freqs.head_dim));
  freqs.validate();
  // Fused: cos/sin of a few tokens at a time go to a per-thread buffer and
  // are shared by all heads of those tokens, so no [tokens, n_pairs] table is
  // written and read back. Same numerics as RopeTable + apply_rope.
  const int np = freqs.n_pairs();
  const int head_dim = freqs.head_dim;
  const int64_t stride = static_cast<int64_t>(heads) * head_dim;
  constexpr int64_t kChunk = 8;
  const int64_t n_chunks = (tokens + kChunk - 1) / kChunk;
  const bool parallel = tokens * stride > (int64_t{1} << 16) && n_chunks > 1;
  detail::FirstException error;  // std::bad_alloc of a thread's buffer, rethrown after the region
#pragma omp parallel if (parallel)
  {
    std::vector<float> cs;
    error.run([&] { cs.resize(static_cast<std::size_t>(2 * kChunk * np)); });
    float* c = cs.data();
    float* s = cs.data() + kChunk * np;
    // Every thread meets the loop; one whose buffer failed rotates nothing (x is then left part-rotated).
#pragma omp for schedule(static)
    for (int64_t chunk = 0; chunk < n_chunks; ++chunk) {
      if (cs.empty()) continue;
      const int64_t t0 = chunk * kChunk;
      const int64_t nt = std::min(kChunk, tokens - t0);
      for (int64_t i = 0; i < nt; ++i)
        detail::rope_cos_sin_row(freqs, position_ids[static_cast<std::size_t>(t0 + i)], precision, c + i * np,
                                 s + i * np);
      detail::rope_rotate_rows(x + t0 * stride, nt, heads, head_dim, stride, c, s, np, np, layout,
                               direction);
    }
  }
  error.rethrow();
}

}  // namespace posenc
