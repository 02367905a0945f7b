// posenc — absolute position encodings added to the token embeddings:
// sinusoidal tables, learned tables, and NoPE (nothing).
//
// Sources:
//  - sinusoidal: Vaswani et al. 2017, "Attention Is All You Need", §3.5:
//    PE(pos, 2i) = sin(pos / base^(2i/d)), PE(pos, 2i+1) = cos(pos / base^(2i/d)),
//    base = 10000. For any offset k there is a fixed linear map M_k (block
//    diagonal 2x2 rotations by k/base^(2i/d)) with PE(pos+k) = M_k PE(pos),
//    which is why the paper hoped relative positions were easy to attend to.
//  - learned: GPT-2 / BERT `position_embeddings` [max_position_embeddings, d_model].
//  - NoPE: Kazemnejad et al., "The Impact of Positional Encoding on Length
//    Generalization in Transformers", NeurIPS 2023.
// Numerics match Hugging Face transformers (see each function).
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string_view>
#include <vector>

namespace posenc {

/// Column layout of a sinusoidal table.
///  - interleaved:   column 2i = sin, 2i+1 = cos, angle pos / base^(2i/d)
///                   (Vaswani §3.5; HF XLM create_sinusoidal_embeddings,
///                   DistilBERT _create_sinusoidal_embeddings). Computed in
///                   float64 (numpy), stored float32. Odd d: last column sin.
///  - halves:        the same frequencies, sin of the even-column angles in the
///                   first ceil(d/2) columns, cos of the odd-column angles after
///                   them (HF Marian/RoFormer create_weight). float64 -> float32.
///  - tensor2tensor: fairseq/tensor2tensor (HF M2M100/FSMT/Speech2Text
///                   get_embedding): h = d/2 (floor), freq_k =
///                   exp(-k * ln(base)/(h-1)), columns [sin(pos*freq) | cos(pos*freq)],
///                   a zero column appended for odd d, the padding_idx row zeroed;
///                   all float32. Needs d >= 4.
enum class SinusoidalLayout { interleaved, halves, tensor2tensor };

std::string_view to_string(SinusoidalLayout layout);
/// Parses "interleaved", "halves" or "tensor2tensor"; ConfigError naming `field` otherwise.
SinusoidalLayout parse_sinusoidal_layout(std::string_view text,
                                         std::string_view field = "sinusoidal_layout");

/// Sinusoidal encodings of the given positions: [positions.size(), dim]
/// float32, row-major. Row t encodes position positions[t] (any int64; a
/// table is the special case 0..n-1). padding_idx (tensor2tensor only): a row
/// whose position equals it is all zeros, as in the reference table.
/// Throws InvalidArgument if dim <= 0 (< 4 for tensor2tensor), base is not
/// finite and > 1, or padding_idx is given for another layout.
std::vector<float> sinusoidal_encoding(std::span<const int64_t> positions, int dim,
                                       SinusoidalLayout layout, double base = 10000.0,
                                       std::optional<int64_t> padding_idx = std::nullopt);

/// The table for positions 0..num_positions-1: [num_positions, dim] float32.
/// Same errors, plus num_positions < 0.
std::vector<float> sinusoidal_table(int64_t num_positions, int dim, SinusoidalLayout layout,
                                    double base = 10000.0,
                                    std::optional<int64_t> padding_idx = std::nullopt);

/// embeddings[t, :] += sinusoidal_encoding(position_ids)[t, :] (float32 add),
/// without a table: a sinusoid is defined at every position, so there is no
/// upper bound (unlike a learned table). embeddings: [position_ids.size(), d_model].
/// Throws InvalidArgument on a size mismatch and as sinusoidal_encoding.
void add_sinusoidal_encoding(std::span<float> embeddings, int d_model,
                             std::span<const int64_t> position_ids, SinusoidalLayout layout,
                             double base = 10000.0,
                             std::optional<int64_t> padding_idx = std::nullopt);

/// M2M100/FSMT position ids (HF M2M100SinusoidalPositionalEmbedding.
/// create_position_ids_from_input_ids): for input_ids [batch, seq_len]
/// (row-major), non-padding tokens get padding_idx + past_key_values_length +
/// (their count of non-padding tokens so far, from 1); padding tokens get
/// padding_idx. Result [batch, seq_len] int64.
/// Throws InvalidArgument on a size mismatch or negative sizes/past length.
std::vector<int64_t> position_ids_from_input_ids(std::span<const int64_t> input_ids, int64_t batch,
                                                 int64_t seq_len, int64_t padding_idx,
                                                 int64_t past_key_values_length = 0);

/// Learned absolute lookup: out[t, :] = table[position_ids[t], :].
///  - table: [max_position_embeddings, d_model] float32 (row-major)
///  - position_ids: [tokens]; out: [tokens, d_model] float32
/// A position < 0 or >= max_position_embeddings throws PositionError naming
/// the position, its index and the table size -- never a silent read.
/// Throws InvalidArgument if table/out sizes do not match the shape.
void learned_position_lookup(std::span<const float> table, int64_t max_position_embeddings,
                             int d_model, std::span<const int64_t> position_ids, std::span<float> out);

/// How position enters the residual stream at the input.
///  - none: NoPE. Nothing is added: embeddings are returned unchanged, and
///    the causal mask is the only source of order (a causal layer can still
///    infer positions, e.g. by counting; Kazemnejad et al. 2023, Thm. 1).
///  - table: add rows of a position table (learned, or a sinusoidal table
///    from sinusoidal_table) selected by position_ids.
enum class AbsolutePositionEncoding { none, table };

std::string_view to_string(AbsolutePositionEncoding kind);

/// embeddings[t, :] += table[position_ids[t], :] for kind == table (float32,
/// one rounding per add); for kind == none the call only checks the shapes
/// and leaves embeddings untouched (NoPE is an explicit choice, not a missing
/// table). embeddings: [tokens, d_model] with tokens = position_ids.size();
/// table: [table_rows, d_model] (ignored for none).
/// Throws PositionError for a position outside [0, table_rows), InvalidArgument
/// on size mismatches.
void add_absolute_position_encoding(AbsolutePositionEncoding kind, std::span<float> embeddings,
                                    int d_model, std::span<const int64_t> position_ids,
                                    std::span<const float> table, int64_t table_rows);

}  // namespace posenc
