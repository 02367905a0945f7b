#include "posenc/mrope.hpp"

#include <algorithm>
#include <climits>
#include <cmath>

#include <fmt/format.h>

#include "posenc/error.hpp"

namespace posenc {

std::string_view to_string(MropeMapping mapping) {
  return mapping == MropeMapping::chunked ? "chunked" : "interleaved";
}

MropeMapping parse_mrope_mapping(std::string_view text, std::string_view field) {
  if (text == "chunked") return MropeMapping::chunked;
  if (text == "interleaved") return MropeMapping::interleaved;
  throw ConfigError(fmt::format("{}: must be chunked or interleaved (got '{}')", field, text));
}

std::vector<int> mrope_pair_rows(std::span<const int> mrope_section, int n_pairs, MropeMapping mapping) {
  if (mrope_section.size() != 3)
    throw ConfigError(fmt::format(
        "mrope_section: expected 3 entries (temporal, height, width) (got {})", mrope_section.size()));
  int64_t total = 0;  // int64: three int entries cannot overflow it (an int sum could)
  for (std::size_t j = 0; j < mrope_section.size(); ++j) {
    if (mrope_section[j] < 0)
      fail_field<ConfigError>(fmt::format("mrope_section[{}]", j), "must be non-negative",
                              mrope_section[j]);
    total += mrope_section[j];
  }
  if (total != n_pairs)
    throw ConfigError(fmt::format(
        "mrope_section: entries [{}, {}, {}] sum to {}, expected rotary_dim/2 = {}", mrope_section[0],
        mrope_section[1], mrope_section[2], total, n_pairs));
  std::vector<int> rows;
  rows.reserve(static_cast<std::size_t>(n_pairs));
  if (mapping == MropeMapping::chunked) {
    for (int j = 0; j < 3; ++j) rows.insert(rows.end(), static_cast<std::size_t>(mrope_section[j]), j);
    return rows;
  }
  // Interleaved (Qwen3-VL apply_interleaved_mrope): start from the temporal row
  // everywhere, then pairs 1, 4, 7, ... below 3*s_h take the height row and
  // pairs 2, 5, 8, ... below 3*s_w the width row.
  const int64_t s_h = mrope_section[1], s_w = mrope_section[2];
  if (s_h > 0 && 3 * s_h - 2 >= n_pairs)
    throw ConfigError(fmt::format(
        "mrope_section: interleaved height budget {} needs pair {} but there are {} pairs (sections [{}, {}, {}])",
        s_h, 3 * s_h - 2, n_pairs, mrope_section[0], mrope_section[1], mrope_section[2]));
  if (s_w > 0 && 3 * s_w - 1 >= n_pairs)
    throw ConfigError(fmt::format(
        "mrope_section: interleaved width budget {} needs pair {} but there are {} pairs (sections [{}, {}, {}])",
        s_w, 3 * s_w - 1, n_pairs, mrope_section[0], mrope_section[1], mrope_section[2]));
  for (int i = 0; i < n_pairs; ++i) {
    int row = 0;
    if (i % 3 == 1 && i < 3 * s_h) row = 1;
    if (i % 3 == 2 && i < 3 * s_w) row = 2;
    rows.push_back(row);
  }
  return rows;
}

RopeTable mrope_table(const RopeFrequencies& freqs, std::span<const int> mrope_section,
                      std::span<const int64_t> position_ids, int64_t tokens,
                      AnglePrecision precision, MropeMapping mapping) {
  freqs.validate();
  if (tokens < 0) fail_field<InvalidArgument>("tokens", "must be non-negative", tokens);
  if (tokens > INT64_MAX / 3) fail_field<InvalidArgument>("tokens", "is too large (3 × tokens overflows int64)", tokens);
  if (position_ids.size() != static_cast<std::size_t>(3 * tokens))
    throw InvalidArgument(fmt::format("position_ids: expected [3, {}] = {} values (got {})", tokens,
                                      3 * tokens, position_ids.size()));
  const int n = freqs.n_pairs();
  const std::vector<int> rows = mrope_pair_rows(mrope_section, n, mapping);
  const std::size_t cells = static_cast<std::size_t>(tokens) * static_cast<std::size_t>(n);
  // One plain table per position row, then pick each pair's row.
  std::array<std::vector<float>, 3> cos_rows, sin_rows;
  for (int r = 0; r < 3; ++r) {
    cos_rows[r].resize(cells);
    sin_rows[r].resize(cells);
    rope_cos_sin(freqs, position_ids.subspan(static_cast<std::size_t>(r * tokens), static_cast<std::size_t>(tokens)),
                 precision, cos_rows[r], sin_rows[r]);
  }
  std::vector<float> cos(cells), sin(cells);
  for (int64_t t = 0; t < tokens; ++t)
    for (int i = 0; i < n; ++i) {
      const std::size_t k = static_cast<std::size_t>(t) * static_cast<std::size_t>(n) + static_cast<std::size_t>(i);
      cos[k] = cos_rows[rows[static_cast<std::size_t>(i)]][k];
      sin[k] = sin_rows[rows[static_cast<std::size_t>(i)]][k];
    }
  return RopeTable::from_cos_sin(tokens, n, std::move(cos), std::move(sin), precision);
}

void apply_mrope(float* x, int64_t tokens, int heads, const RopeFrequencies& freqs,
                 std::span<const int> mrope_section, std::span<const int64_t> position_ids,
                 AnglePrecision precision, RopeDirection direction, MropeMapping mapping) {
  const RopeTable table = mrope_table(freqs, mrope_section, position_ids, tokens, precision, mapping);
  apply_rope(x, tokens, heads, freqs.head_dim, table, RopeLayout::half, direction);
}

namespace {

constexpr int64_t kMaxMropeId = int64_t{1} << 53;

const char* kind_name(MropeSpanKind k) {
  switch (k) {
    case MropeSpanKind::text: return "text";
    case MropeSpanKind::image: return "image";
    case MropeSpanKind::video: return "video";
  }
  return "?";
}

/// Temporal id of grid step k of a vision span (MropeTemporalRule).
int64_t temporal_id(const MropeSpan& s, int64_t k, const MropeVisionConfig& c) {
  if (c.rule == MropeTemporalRule::qwen2_vl) return k;
  if (s.kind == MropeSpanKind::image) return 0;  // Qwen2.5-VL: second_per_grid_t = 0 for images
  // float32 as torch: arange(t) (int64) * second_per_grid_t (float32 tensor) -> float32,
  // then * tokens_per_second, then .long() (truncation toward zero).
  const float step = static_cast<float>(k) * static_cast<float>(s.second_per_grid_t);
  const float t = step * static_cast<float>(c.tokens_per_second);
  return static_cast<int64_t>(t);
}

}  // namespace

MropePositionIds mrope_position_ids(std::span<const MropeSpan> spans, const MropeVisionConfig& config) {
  const int64_t m = config.spatial_merge_size;
  if (m < 1) fail_field<InvalidArgument>("spatial_merge_size", "must be >= 1", m);
  if (config.rule == MropeTemporalRule::qwen2_5_vl &&
      (!std::isfinite(config.tokens_per_second) || config.tokens_per_second < 0))
    fail_field<InvalidArgument>("tokens_per_second", "must be finite and >= 0", config.tokens_per_second);
  // Validate and count first, so that nothing is allocated for a bad list.
  int64_t n = 0;
  for (std::size_t i = 0; i < spans.size(); ++i) {
    const MropeSpan& s = spans[i];
    const std::string at = fmt::format("spans[{}] ({})", i, kind_name(s.kind));
    int64_t len = 0;
    if (s.kind == MropeSpanKind::text) {
      if (s.tokens < 0) fail_field<InvalidArgument>(at + ".tokens", "must be >= 0", s.tokens);
      len = s.tokens;
    } else {
      for (auto [name, v] : {std::pair{"grid_t", s.grid_t}, std::pair{"grid_h", s.grid_h}, std::pair{"grid_w", s.grid_w}})
        if (v <= 0 || v > kMaxMropeId) fail_field<InvalidArgument>(at + "." + name, "must be in [1, 2^53]", v);
      if (s.grid_h % m != 0)
        fail_field<InvalidArgument>(at + ".grid_h", fmt::format("must be divisible by spatial_merge_size {}", m), s.grid_h);
      if (s.grid_w % m != 0)
        fail_field<InvalidArgument>(at + ".grid_w", fmt::format("must be divisible by spatial_merge_size {}", m), s.grid_w);
      if (s.kind == MropeSpanKind::video && (!std::isfinite(s.second_per_grid_t) || s.second_per_grid_t < 0))
        fail_field<InvalidArgument>(at + ".second_per_grid_t", "must be finite and >= 0", s.second_per_grid_t);
      const int64_t gh = s.grid_h / m, gw = s.grid_w / m;
      if (gh > kMaxMropeId / gw || s.grid_t > kMaxMropeId / (gh * gw))
        throw InvalidArgument(fmt::format("{}: grid {} x {} x {} holds more than 2^53 tokens", at, s.grid_t, gh, gw));
      len = s.grid_t * gh * gw;
    }
    if (len > kMaxMropeId - n)
      throw InvalidArgument(fmt::format("{}: the sequence would pass 2^53 tokens", at));
    n += len;
  }
  MropePositionIds out;
  out.tokens = n;
  out.position_ids.assign(static_cast<std::size_t>(3 * n), 0);
  int64_t* row_t = out.position_ids.data();
  int64_t* row_h = row_t + n;
  int64_t* row_w = row_h + n;
  int64_t j = 0;       // token index
  int64_t next = 0;    // where the next span starts: max id so far + 1
  for (std::size_t i = 0; i < spans.size(); ++i) {
    const MropeSpan& s = spans[i];
    if (s.kind == MropeSpanKind::text) {
      for (int64_t k = 0; k < s.tokens; ++k, ++j) row_t[j] = row_h[j] = row_w[j] = next + k;
      next += s.tokens;
      continue;
    }
    const int64_t gh = s.grid_h / m, gw = s.grid_w / m;
    int64_t max_id = next - 1;
    for (int64_t k = 0; k < s.grid_t; ++k) {
      const int64_t tid = temporal_id(s, k, config);
      if (tid > kMaxMropeId - next)
        throw InvalidArgument(fmt::format("spans[{}] (video): temporal id {} passes 2^53", i, tid));
      for (int64_t y = 0; y < gh; ++y)
        for (int64_t x = 0; x < gw; ++x, ++j) {
          row_t[j] = next + tid;
          row_h[j] = next + y;
          row_w[j] = next + x;
          max_id = std::max({max_id, row_t[j], row_h[j], row_w[j]});
        }
    }
    next = max_id + 1;
  }
  out.rope_delta = next - n;  // next = max + 1 (0 when empty)
  return out;
}

}  // namespace posenc
