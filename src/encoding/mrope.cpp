#include "posenc/mrope.hpp"

#include <climits>

#include <fmt/format.h>

#include "posenc/error.hpp"

namespace posenc {

std::vector<int> mrope_pair_rows(std::span<const int> mrope_section, int n_pairs) {
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
  for (int j = 0; j < 3; ++j) rows.insert(rows.end(), static_cast<std::size_t>(mrope_section[j]), j);
  return rows;
}

RopeTable mrope_table(const RopeFrequencies& freqs, std::span<const int> mrope_section,
                      std::span<const int64_t> position_ids, int64_t tokens,
                      AnglePrecision precision) {
  freqs.validate();
  if (tokens < 0) fail_field<InvalidArgument>("tokens", "must be non-negative", tokens);
  if (tokens > INT64_MAX / 3) fail_field<InvalidArgument>("tokens", "is too large (3 × tokens overflows int64)", tokens);
  if (position_ids.size() != static_cast<std::size_t>(3 * tokens))
    throw InvalidArgument(fmt::format("position_ids: expected [3, {}] = {} values (got {})", tokens,
                                      3 * tokens, position_ids.size()));
  const int n = freqs.n_pairs();
  const std::vector<int> rows = mrope_pair_rows(mrope_section, n);
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
                 AnglePrecision precision, RopeDirection direction) {
  const RopeTable table = mrope_table(freqs, mrope_section, position_ids, tokens, precision);
  apply_rope(x, tokens, heads, freqs.head_dim, table, RopeLayout::half, direction);
}

}  // namespace posenc
