// posenc Python bindings — ALiBi slopes and biases, T5 relative position buckets, sinusoidal tables
// (posenc/bias.hpp, posenc/absolute.hpp). Thin wrappers: the numbers are the library's.
#include <optional>
#include <string>

#include <fmt/format.h>
#include <pybind11/stl.h>

#include "arrays.hpp"
#include "bindings.hpp"
#include "posenc/absolute.hpp"
#include "posenc/bias.hpp"
#include "posenc/error.hpp"

namespace posenc::python {

namespace {

AlibiForm parse_form(const std::string& s) {
  if (s == "causal") return AlibiForm::causal;
  if (s == "symmetric") return AlibiForm::symmetric;
  fail_field<ConfigError>("form", "must be \"causal\" or \"symmetric\"", s);
}

}  // namespace

void bind_bias(py::module_& m) {
  m.def(
      "alibi_slopes",
      [](int n_heads, double max_bias, const std::string& convention) {
        if (convention != "llama.cpp" && convention != "bloom" && convention != "falcon" && convention != "mpt")
          fail_field<ConfigError>("convention", "must be \"llama.cpp\", \"bloom\", \"falcon\" or \"mpt\"", convention);
        std::vector<float> s;
        {
          py::gil_scoped_release release;
          if (convention == "llama.cpp") s = alibi_slopes(n_heads, max_bias);
          else if (convention == "bloom") s = bloom_alibi_slopes(n_heads);
          else if (convention == "falcon") s = falcon_alibi_slopes(n_heads);
          else s = mpt_alibi_slopes(n_heads, max_bias);
        }
        return to_numpy(s);
      },
      py::arg("n_heads"), py::arg("max_bias") = 8.0, py::arg("convention") = "llama.cpp", R"doc(
ALiBi head slopes m_h (Press et al. 2022), [n_heads] float32.

convention: "llama.cpp" (2^(-max_bias/p)^(h+1), the paper's interleaving for non-powers of two, in double),
"bloom" (HF build_alibi_tensor's float32 pow, bit for bit; max_bias ignored: 8), "falcon" (BLOOM's rounded to
bfloat16), "mpt" (HF build_mpt_alibi_tensor, max_bias = alibi_bias_max). posenc.InvalidArgument for n_heads <= 0
or a non-positive max_bias, posenc.ConfigError for an unknown convention.)doc");

  m.def(
      "alibi_bias",
      [](py::handle slopes_obj, int64_t q_len, int64_t k_len, int64_t query_offset, const std::string& form) {
        const py::array sl = require_float32(slopes_obj, "slopes", 1, "[heads]");
        require_c_contiguous(sl, "slopes");
        std::span<const float> s(static_cast<const float*>(sl.data()), static_cast<std::size_t>(sl.size()));
        const AlibiForm f = parse_form(form);
        check_output_size({{"heads", sl.shape(0)}, {"q_len", q_len}, {"k_len", k_len}}, 4);
        std::vector<float> out;
        {
          py::gil_scoped_release release;
          out = posenc::alibi_bias(s, q_len, k_len, query_offset, f);
        }
        return vector_to_numpy(std::move(out), {sl.shape(0), q_len, k_len});
      },
      py::arg("slopes"), py::arg("q_len"), py::arg("k_len"), py::arg("query_offset") = 0, py::arg("form") = "causal",
      R"doc(
ALiBi bias added to the attention logits, [heads, q_len, k_len] float32: -m_h * (i - j) ("causal") or
-m_h * |i - j| ("symmetric") for queries at positions query_offset .. query_offset+q_len-1 and keys at 0 .. k_len-1.
slopes: [heads] float32 (alibi_slopes). Errors: TypeError/ValueError (slopes dtype, shape), posenc.InvalidArgument
(negative lengths or offset, no slopes), ValueError (an output past 2^62 bytes), posenc.ConfigError (form).)doc");

  m.def(
      "bloom_alibi_tensor",
      [](py::handle mask_obj, int n_heads, const std::string& style) {
        const auto mask = require_integers<int64_t>(mask_obj, "attention_mask");
        if (mask.ndim() != 2)
          throw py::value_error(fmt::format("attention_mask: expected a [batch, seq_len] array, got shape {}",
                                            shape_string(mask)));
        AlibiTensorStyle st = AlibiTensorStyle::bloom;
        if (style == "bloom") st = AlibiTensorStyle::bloom;
        else if (style == "falcon") st = AlibiTensorStyle::falcon;
        else fail_field<ConfigError>("style", "must be \"bloom\" or \"falcon\"", style);
        const int64_t batch = mask.shape(0), seq = mask.shape(1);
        check_output_size({{"batch", batch}, {"n_heads", n_heads}, {"seq_len", seq}}, 4);
        std::span<const int64_t> ms(mask.data(), static_cast<std::size_t>(mask.size()));
        std::vector<float> out;
        {
          py::gil_scoped_release release;
          out = build_bloom_alibi_tensor(ms, batch, seq, n_heads, st);
        }
        return vector_to_numpy(std::move(out), {batch * n_heads, 1, seq});
      },
      py::arg("attention_mask"), py::arg("n_heads"), py::arg("style") = "bloom", R"doc(
BLOOM / Falcon build_alibi_tensor: attention_mask [batch, seq_len] of 0/1 integers -> [batch*n_heads, 1, seq_len]
float32, slope[h] * key_index (padding-aware). style "falcon" rounds slopes and products to bfloat16.
Errors: TypeError/ValueError (mask dtype, shape), posenc.InvalidArgument (n_heads <= 0, mask values not 0/1),
posenc.ConfigError (style).)doc");

  m.def(
      "mpt_alibi_tensor",
      [](int n_heads, int64_t seq_len, double alibi_bias_max) {
        check_output_size({{"n_heads", n_heads}, {"seq_len", seq_len}}, 4);
        std::vector<float> out;
        {
          py::gil_scoped_release release;
          out = build_mpt_alibi_tensor(n_heads, seq_len, alibi_bias_max);
        }
        return vector_to_numpy(std::move(out), {n_heads, 1, seq_len});
      },
      py::arg("n_heads"), py::arg("seq_len"), py::arg("alibi_bias_max") = 8.0,
      "MPT build_mpt_alibi_tensor: [n_heads, 1, seq_len] float32, slope[h] * (j - (seq_len-1)). Errors: "
      "posenc.InvalidArgument (n_heads <= 0, seq_len < 0, alibi_bias_max not finite and > 0), ValueError (an output "
      "past 2^62 bytes).");

  m.def(
      "t5_relative_buckets",
      [](int64_t q_len, int64_t k_len, int64_t query_offset, bool bidirectional, int num_buckets, int max_distance) {
        check_output_size({{"q_len", q_len}, {"k_len", k_len}}, 4);
        std::vector<int> out;
        {
          py::gil_scoped_release release;
          out = t5_relative_position_buckets(q_len, k_len, query_offset, bidirectional, num_buckets, max_distance);
        }
        std::vector<int32_t> o(out.begin(), out.end());
        return vector_to_numpy(std::move(o), {q_len, k_len});
      },
      py::arg("q_len"), py::arg("k_len"), py::arg("query_offset") = 0, py::arg("bidirectional") = true,
      py::arg("num_buckets") = 32, py::arg("max_distance") = 128, R"doc(
T5 relative position buckets (HF T5Attention._relative_position_bucket on compute_bias's matrix), [q_len, k_len]
int32: query t at position query_offset + t, key j at position j, relative position j - (query_offset + t).
bidirectional: True for encoder self-attention, False for the decoder's causal buckets.
Errors: posenc.InvalidArgument (negative lengths or offset, num_buckets < 4 bidirectional / < 2 causal,
max_distance <= num_buckets/2), ValueError (an output past 2^62 bytes).)doc");

  m.def(
      "t5_relative_position_bucket",
      [](py::handle rel_obj, bool bidirectional, int num_buckets, int max_distance) {
        const auto rel = require_integers<int64_t>(rel_obj, "relative_position");
        std::vector<py::ssize_t> shape(rel.shape(), rel.shape() + rel.ndim());
        py::array_t<int32_t> out(shape);
        const int64_t* r = rel.data();
        int32_t* o = out.mutable_data();
        const py::ssize_t n = rel.size();
        {
          py::gil_scoped_release release;
          for (py::ssize_t i = 0; i < n; ++i) o[i] = t5_relative_position_bucket(r[i], bidirectional, num_buckets, max_distance);
        }
        return out;
      },
      py::arg("relative_position"), py::arg("bidirectional") = true, py::arg("num_buckets") = 32,
      py::arg("max_distance") = 128,
      "The T5 bucket of each relative position (key - query), any shape of integers -> int32 of the same shape. "
      "Errors: TypeError (not integers), posenc.InvalidArgument (num_buckets, max_distance as t5_relative_buckets).");

  m.def(
      "t5_relative_position_bias",
      [](py::handle table_obj, int64_t q_len, int64_t k_len, int64_t query_offset, bool bidirectional,
         int max_distance) {
        const py::array t = require_float32(table_obj, "table", 2, "[num_buckets, heads]");
        require_c_contiguous(t, "table");
        const int num_buckets = static_cast<int>(t.shape(0)), heads = static_cast<int>(t.shape(1));
        std::span<const float> ts(static_cast<const float*>(t.data()), static_cast<std::size_t>(t.size()));
        check_output_size({{"heads", heads}, {"q_len", q_len}, {"k_len", k_len}}, 4);
        std::vector<float> out;
        {
          py::gil_scoped_release release;
          out = posenc::t5_relative_position_bias(ts, num_buckets, heads, q_len, k_len, query_offset, bidirectional,
                                                  max_distance);
        }
        return vector_to_numpy(std::move(out), {heads, q_len, k_len});
      },
      py::arg("table"), py::arg("q_len"), py::arg("k_len"), py::arg("query_offset") = 0,
      py::arg("bidirectional") = true, py::arg("max_distance") = 128,
      "T5 bias [heads, q_len, k_len] float32 from the learned table [num_buckets, heads] float32 "
      "(HF relative_attention_bias.weight; T5Attention.compute_bias). Errors: TypeError/ValueError (table dtype, "
      "shape), posenc.InvalidArgument (as t5_relative_buckets), ValueError (an output past 2^62 bytes).");

  m.def(
      "sinusoidal_table",
      [](int64_t num_positions, int dim, const std::string& layout, double base, std::optional<int64_t> padding_idx) {
        const SinusoidalLayout l = parse_sinusoidal_layout(layout, "layout");
        check_output_size({{"num_positions", num_positions}, {"dim", dim}}, 4);
        std::vector<float> out;
        {
          py::gil_scoped_release release;
          out = posenc::sinusoidal_table(num_positions, dim, l, base, padding_idx);
        }
        return vector_to_numpy(std::move(out), {num_positions, dim});
      },
      py::arg("num_positions"), py::arg("dim"), py::arg("layout") = "interleaved", py::arg("base") = 10000.0,
      py::arg("padding_idx") = py::none(), R"doc(
Sinusoidal position table (Vaswani et al. 2017, §3.5), [num_positions, dim] float32.

layout: "interleaved" (column 2i sin, 2i+1 cos: XLM, DistilBERT), "halves" (sin | cos: Marian, RoFormer),
"tensor2tensor" (fairseq/M2M100/FSMT: ln(base)/(h-1) exponent, zero padding_idx row, zero column for odd dim).
Errors: posenc.InvalidArgument (num_positions < 0, dim <= 0, base not finite and > 1), posenc.ConfigError
(layout), ValueError (an output past 2^62 bytes).)doc");

  m.def(
      "sinusoidal_encoding",
      [](py::handle pos_obj, int dim, const std::string& layout, double base, std::optional<int64_t> padding_idx) {
        const auto pos = require_integers<int64_t>(pos_obj, "positions");
        if (pos.ndim() != 1)
          throw py::value_error(fmt::format("positions: expected a [n] array, got shape {}", shape_string(pos)));
        const SinusoidalLayout l = parse_sinusoidal_layout(layout, "layout");
        std::span<const int64_t> p(pos.data(), static_cast<std::size_t>(pos.size()));
        std::vector<float> out;
        {
          py::gil_scoped_release release;
          out = posenc::sinusoidal_encoding(p, dim, l, base, padding_idx);
        }
        return vector_to_numpy(std::move(out), {pos.shape(0), dim});
      },
      py::arg("positions"), py::arg("dim"), py::arg("layout") = "interleaved", py::arg("base") = 10000.0,
      py::arg("padding_idx") = py::none(),
      "Sinusoidal encodings of arbitrary positions ([n] integers) -> [n, dim] float32 (layouts as sinusoidal_table). "
      "Errors: TypeError (not integers), ValueError (not [n]), posenc.InvalidArgument (dim, base).");

  m.def(
      "position_ids_from_input_ids",
      [](py::handle ids_obj, int64_t padding_idx, int64_t past_key_values_length) {
        const auto ids = require_integers<int64_t>(ids_obj, "input_ids");
        if (ids.ndim() != 2)
          throw py::value_error(fmt::format("input_ids: expected a [batch, seq_len] array, got shape {}", shape_string(ids)));
        std::span<const int64_t> s(ids.data(), static_cast<std::size_t>(ids.size()));
        std::vector<int64_t> out;
        {
          py::gil_scoped_release release;
          out = posenc::position_ids_from_input_ids(s, ids.shape(0), ids.shape(1), padding_idx, past_key_values_length);
        }
        return vector_to_numpy(std::move(out), {ids.shape(0), ids.shape(1)});
      },
      py::arg("input_ids"), py::arg("padding_idx"), py::arg("past_key_values_length") = 0,
      "M2M100/FSMT position ids (HF create_position_ids_from_input_ids): [batch, seq_len] int64. Errors: TypeError "
      "(not integers), ValueError (not [batch, seq_len]), posenc.InvalidArgument (negative past_key_values_length).");
}

}  // namespace posenc::python
