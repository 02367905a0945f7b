#include "posenc/absolute.hpp"
#include "posenc/checked.hpp"

#include <cmath>

#include <fmt/format.h>

#include "posenc/error.hpp"

namespace posenc {

std::string_view to_string(SinusoidalLayout layout) {
  switch (layout) {
    case SinusoidalLayout::interleaved: return "interleaved";
    case SinusoidalLayout::halves: return "halves";
    case SinusoidalLayout::tensor2tensor: return "tensor2tensor";
  }
  return "?";
}

SinusoidalLayout parse_sinusoidal_layout(std::string_view text, std::string_view field) {
  if (text == "interleaved") return SinusoidalLayout::interleaved;
  if (text == "halves") return SinusoidalLayout::halves;
  if (text == "tensor2tensor") return SinusoidalLayout::tensor2tensor;
  throw ConfigError(fmt::format(
      "{}: unknown sinusoidal layout '{}' (expected 'interleaved' = XLM/DistilBERT, 'halves' = "
      "Marian/RoFormer, 'tensor2tensor' = M2M100/FSMT)",
      field, text));
}

std::string_view to_string(AbsolutePositionEncoding kind) {
  return kind == AbsolutePositionEncoding::none ? "none" : "table";
}

std::vector<float> sinusoidal_encoding(std::span<const int64_t> positions, int dim,
                                       SinusoidalLayout layout, double base,
                                       std::optional<int64_t> padding_idx) {
  if (dim <= 0) fail_field<InvalidArgument>("dim", "must be positive", dim);
  if (!std::isfinite(base) || base <= 1.0)
    fail_field<InvalidArgument>("base", "must be finite and > 1", base);
  if (padding_idx && layout != SinusoidalLayout::tensor2tensor)
    throw InvalidArgument(fmt::format(
        "padding_idx: only the tensor2tensor layout zeroes a padding row (got {} with layout {})",
        *padding_idx, to_string(layout)));
  const std::size_t d = static_cast<std::size_t>(dim);
  std::vector<float> out(positions.size() * d, 0.0f);

  if (layout == SinusoidalLayout::tensor2tensor) {
    const int half = dim / 2;
    if (half - 1 <= 0)
      fail_field<InvalidArgument>("dim", "tensor2tensor sinusoids need dim >= 4", dim);
    // emb = log(base) / (half_dim - 1); freq = exp(arange(half_dim).float() * -emb), float32.
    const double emb = std::log(base) / (half - 1);
    const float neg = static_cast<float>(-emb);
    std::vector<float> freq(static_cast<std::size_t>(half));
    for (int k = 0; k < half; ++k) freq[static_cast<std::size_t>(k)] = std::exp(static_cast<float>(k) * neg);
    for (std::size_t t = 0; t < positions.size(); ++t) {
      float* row = out.data() + t * d;
      if (padding_idx && positions[t] == *padding_idx) continue;  // zero row
      const float p = static_cast<float>(positions[t]);
      for (int k = 0; k < half; ++k) {
        const float a = p * freq[static_cast<std::size_t>(k)];
        row[k] = std::sin(a);
        row[half + k] = std::cos(a);
      }
      // odd dim: the appended column stays 0
    }
    return out;
  }

  // XLM / Marian: position_enc[pos, j] = pos / np.power(base, 2 * (j // 2) / dim), float64.
  std::vector<double> div(d);
  for (int j = 0; j < dim; ++j)
    div[static_cast<std::size_t>(j)] = std::pow(base, static_cast<double>(2 * (j / 2)) / dim);
  const int sentinel = (dim + 1) / 2;  // Marian: number of sin columns
  for (std::size_t t = 0; t < positions.size(); ++t) {
    float* row = out.data() + t * d;
    const double p = static_cast<double>(positions[t]);
    for (int j = 0; j < dim; ++j) {
      const double angle = p / div[static_cast<std::size_t>(j)];
      const bool even = j % 2 == 0;
      const float v = static_cast<float>(even ? std::sin(angle) : std::cos(angle));
      if (layout == SinusoidalLayout::interleaved) {
        row[j] = v;
      } else {
        row[even ? j / 2 : sentinel + j / 2] = v;
      }
    }
  }
  return out;
}

std::vector<float> sinusoidal_table(int64_t num_positions, int dim, SinusoidalLayout layout,
                                    double base, std::optional<int64_t> padding_idx) {
  if (num_positions < 0)
    fail_field<InvalidArgument>("num_positions", "must be non-negative", num_positions);
  std::vector<int64_t> positions(static_cast<std::size_t>(num_positions));
  for (int64_t i = 0; i < num_positions; ++i) positions[static_cast<std::size_t>(i)] = i;
  return sinusoidal_encoding(positions, dim, layout, base, padding_idx);
}

void add_sinusoidal_encoding(std::span<float> embeddings, int d_model,
                             std::span<const int64_t> position_ids, SinusoidalLayout layout,
                             double base, std::optional<int64_t> padding_idx) {
  if (d_model <= 0) fail_field<InvalidArgument>("d_model", "must be positive", d_model);
  if (embeddings.size() != position_ids.size() * static_cast<std::size_t>(d_model))
    throw InvalidArgument(fmt::format("embeddings: expected [{}, {}] = {} values (got {})",
                                      position_ids.size(), d_model,
                                      position_ids.size() * static_cast<std::size_t>(d_model),
                                      embeddings.size()));
  const std::vector<float> pe = sinusoidal_encoding(position_ids, d_model, layout, base, padding_idx);
  for (std::size_t i = 0; i < pe.size(); ++i) embeddings[i] += pe[i];
}

std::vector<int64_t> position_ids_from_input_ids(std::span<const int64_t> input_ids, int64_t batch,
                                                 int64_t seq_len, int64_t padding_idx,
                                                 int64_t past_key_values_length) {
  if (batch < 0 || seq_len < 0)
    throw InvalidArgument(fmt::format("input_ids: bad shape [{}, {}]", batch, seq_len));
  const int64_t n_ids = checked_mul<InvalidArgument>(batch, seq_len, "input_ids: batch x seq_len");
  if (input_ids.size() != static_cast<std::size_t>(n_ids))
    throw InvalidArgument(fmt::format("input_ids: expected [{}, {}] = {} values (got {})", batch,
                                      seq_len, n_ids, input_ids.size()));
  if (past_key_values_length < 0)
    fail_field<InvalidArgument>("past_key_values_length", "must be non-negative",
                                past_key_values_length);
  // The largest position written, seq_len + past_key_values_length + padding_idx, must not wrap.
  (void)checked_add<InvalidArgument>(
      checked_add<InvalidArgument>(seq_len, past_key_values_length, "position_ids: seq_len + past_key_values_length"),
      padding_idx, "position_ids: seq_len + past_key_values_length + padding_idx");
  std::vector<int64_t> out(input_ids.size());
  for (int64_t b = 0; b < batch; ++b) {
    int64_t count = 0;
    for (int64_t j = 0; j < seq_len; ++j) {
      const std::size_t k = static_cast<std::size_t>(b * seq_len + j);
      const int64_t mask = input_ids[k] != padding_idx ? 1 : 0;
      count += mask;
      // (cumsum(mask) + past_key_values_length) * mask + padding_idx
      out[k] = (count + past_key_values_length) * mask + padding_idx;
    }
  }
  return out;
}

namespace {

void check_rows(std::span<const float> table, int64_t rows, int d_model, const char* what) {
  if (d_model <= 0) fail_field<InvalidArgument>("d_model", "must be positive", d_model);
  if (rows < 0) fail_field<InvalidArgument>(what, "must be non-negative", rows);
  if (table.size() != static_cast<std::size_t>(rows) * static_cast<std::size_t>(d_model))
    throw InvalidArgument(fmt::format("position table: expected [{}, {}] = {} values (got {})", rows,
                                      d_model, static_cast<std::size_t>(rows) * static_cast<std::size_t>(d_model),
                                      table.size()));
}

void check_position(int64_t position, std::size_t index, int64_t rows) {
  if (position < 0 || position >= rows)
    throw PositionError(fmt::format(
        "position_ids[{}]: position {} is outside the position table of {} rows "
        "(max_position_embeddings); valid positions are 0..{}",
        index, position, rows, rows - 1));
}

}  // namespace

void learned_position_lookup(std::span<const float> table, int64_t max_position_embeddings,
                             int d_model, std::span<const int64_t> position_ids, std::span<float> out) {
  check_rows(table, max_position_embeddings, d_model, "max_position_embeddings");
  const std::size_t d = static_cast<std::size_t>(d_model);
  if (out.size() != position_ids.size() * d)
    throw InvalidArgument(fmt::format("learned_position_lookup: out holds {} values, expected {}",
                                      out.size(), position_ids.size() * d));
  for (std::size_t t = 0; t < position_ids.size(); ++t) check_position(position_ids[t], t, max_position_embeddings);
  for (std::size_t t = 0; t < position_ids.size(); ++t) {
    const float* src = table.data() + static_cast<std::size_t>(position_ids[t]) * d;
    std::copy(src, src + d, out.data() + t * d);
  }
}

void add_absolute_position_encoding(AbsolutePositionEncoding kind, std::span<float> embeddings,
                                    int d_model, std::span<const int64_t> position_ids,
                                    std::span<const float> table, int64_t table_rows) {
  if (d_model <= 0) fail_field<InvalidArgument>("d_model", "must be positive", d_model);
  const std::size_t d = static_cast<std::size_t>(d_model);
  if (embeddings.size() != position_ids.size() * d)
    throw InvalidArgument(fmt::format("embeddings: expected [{}, {}] = {} values (got {})",
                                      position_ids.size(), d_model, position_ids.size() * d,
                                      embeddings.size()));
  if (kind == AbsolutePositionEncoding::none) return;  // NoPE: identity by definition
  check_rows(table, table_rows, d_model, "table_rows");
  for (std::size_t t = 0; t < position_ids.size(); ++t) check_position(position_ids[t], t, table_rows);
  for (std::size_t t = 0; t < position_ids.size(); ++t) {
    const float* src = table.data() + static_cast<std::size_t>(position_ids[t]) * d;
    float* dst = embeddings.data() + t * d;
    for (std::size_t c = 0; c < d; ++c) dst[c] += src[c];
  }
}

}  // namespace posenc
