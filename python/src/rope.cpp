// posenc Python bindings — RoPE: frequencies from a config, cos/sin tables, the rotation of [tokens, heads,
// head_dim] arrays in either layout (partial rotary included), M-RoPE, and the frequency schedule of the
// length-dependent scalings. Thin wrappers over posenc/rope.hpp, scaling.hpp, mrope.hpp and config.hpp: every
// number comes from the library's kernels; this file checks the numpy arguments and releases the GIL around them.
#include <cstring>
#include <vector>
#include <optional>
#include <string>

#include <fmt/format.h>
#include <pybind11/stl.h>

#include "arrays.hpp"
#include "bindings.hpp"
#include "posenc/config.hpp"
#include "posenc/error.hpp"
#include "posenc/mrope.hpp"
#include "posenc/rope.hpp"
#include "posenc/scaling.hpp"

namespace posenc::python {

namespace {

RopeDirection parse_direction(const std::string& text) {
  if (text == "forward") return RopeDirection::forward;
  if (text == "inverse") return RopeDirection::inverse;
  fail_field<ConfigError>("direction", "must be \"forward\" or \"inverse\"", text);
}

/// The layout argument: "half", "interleaved" or "interleaved_in_half_out" (DeepSeek-V3); None takes the
/// frequencies' own layout (that of their config).
std::string resolve_layout(const std::optional<std::string>& layout, const Frequencies& f) {
  if (layout) {
    if (*layout != "half" && *layout != "interleaved" && *layout != "interleaved_in_half_out")
      fail_field<ConfigError>("layout", "must be \"half\", \"interleaved\" or \"interleaved_in_half_out\"", *layout);
    return *layout;
  }
  if (!f.layout)
    throw ConfigError("layout: required: these frequencies carry no layout (they were not read from a config "
                      "that implies one); pass layout=\"half\" or layout=\"interleaved\"");
  return *f.layout;
}

RopeParams params_from_kwargs(const py::kwargs& kw) {
  RopeParams p;
  auto opt_double = [](const py::handle& v) -> std::optional<double> {
    if (v.is_none()) return std::nullopt;
    return v.cast<double>();
  };
  for (auto item : kw) {
    const std::string key = py::str(item.first);
    const py::handle v = item.second;
    try {
      if (key == "rope_type" || key == "type") p.rope_type = v.cast<std::string>();
      else if (key == "rope_theta") p.rope_theta = v.cast<double>();
      else if (key == "head_dim") p.head_dim = v.cast<int>();
      else if (key == "rotary_dim") p.rotary_dim = v.is_none() ? 0 : v.cast<int>();
      else if (key == "partial_rotary_factor") p.partial_rotary_factor = opt_double(v);
      else if (key == "factor") p.factor = opt_double(v);
      else if (key == "original_max_position_embeddings")
        p.original_max_position_embeddings = v.is_none() ? std::nullopt : std::optional<int64_t>(v.cast<int64_t>());
      else if (key == "max_position_embeddings")
        p.max_position_embeddings = v.is_none() ? std::nullopt : std::optional<int64_t>(v.cast<int64_t>());
      else if (key == "attention_factor") p.attention_factor = opt_double(v);
      else if (key == "beta_fast") p.beta_fast = opt_double(v);
      else if (key == "beta_slow") p.beta_slow = opt_double(v);
      else if (key == "mscale") p.mscale = opt_double(v);
      else if (key == "mscale_all_dim") p.mscale_all_dim = opt_double(v);
      else if (key == "truncate") p.truncate = v.is_none() ? std::nullopt : std::optional<bool>(v.cast<bool>());
      else if (key == "short_factor") p.short_factor = v.is_none() ? std::vector<double>{} : v.cast<std::vector<double>>();
      else if (key == "long_factor") p.long_factor = v.is_none() ? std::vector<double>{} : v.cast<std::vector<double>>();
      else if (key == "low_freq_factor") p.low_freq_factor = opt_double(v);
      else if (key == "high_freq_factor") p.high_freq_factor = opt_double(v);
      else
        throw ConfigError(fmt::format("RopeParams: unknown parameter {} (known: rope_type, rope_theta, head_dim, "
                                      "rotary_dim, partial_rotary_factor, factor, original_max_position_embeddings, "
                                      "max_position_embeddings, attention_factor, beta_fast, beta_slow, mscale, "
                                      "mscale_all_dim, truncate, short_factor, long_factor, low_freq_factor, "
                                      "high_freq_factor)",
                                      key));
    } catch (const py::cast_error&) {
      throw py::type_error(fmt::format("RopeParams: {}: wrong type ({})", key,
                                       py::str(py::type::of(v).attr("__name__")).cast<std::string>()));
    }
  }
  return p;
}

py::dict params_dict(const RopeParams& p) {
  py::dict d;
  d["rope_type"] = p.rope_type;
  d["rope_theta"] = p.rope_theta;
  d["head_dim"] = p.head_dim;
  d["rotary_dim"] = p.effective_rotary_dim();
  auto put = [&](const char* k, const auto& v) {
    if (v) d[k] = *v;
  };
  put("partial_rotary_factor", p.partial_rotary_factor);
  put("factor", p.factor);
  put("original_max_position_embeddings", p.original_max_position_embeddings);
  put("max_position_embeddings", p.max_position_embeddings);
  put("attention_factor", p.attention_factor);
  put("beta_fast", p.beta_fast);
  put("beta_slow", p.beta_slow);
  put("mscale", p.mscale);
  put("mscale_all_dim", p.mscale_all_dim);
  put("truncate", p.truncate);
  if (!p.short_factor.empty()) d["short_factor"] = p.short_factor;
  if (!p.long_factor.empty()) d["long_factor"] = p.long_factor;
  put("low_freq_factor", p.low_freq_factor);
  put("high_freq_factor", p.high_freq_factor);
  return d;
}

Frequencies from_spec(const PositionalSpec& spec, std::optional<int64_t> seq_len) {
  if (!spec.rope)
    throw ConfigError(fmt::format("{}: family {} has no RoPE frequencies", spec.source, to_string(spec.family)));
  Frequencies f;
  {
    py::gil_scoped_release release;
    f.freqs = compute_rope_frequencies(*spec.rope, seq_len);
  }
  if (spec.layout) f.layout = layout_name(spec);
  f.mrope_section = spec.mrope_section;
  if (!spec.mrope_section.empty()) f.mrope_mapping = spec.mrope_interleaved ? "interleaved" : "chunked";
  return f;
}

/// x checked for apply_rope: float32 [tokens, heads, head_dim], the heads and head_dim axes packed (stride 4 and
/// 4*head_dim bytes); the token axis may be strided (a view of a fused qkv buffer). Returns the token stride in floats.
int64_t check_rope_input(const py::array& x, const char* name) {
  const py::ssize_t heads = x.shape(1), head_dim = x.shape(2);
  if (x.size() == 0) return heads * head_dim;  // numpy gives zero-size arrays strides (0, 0, 0): nothing to read
  const bool inner_ok = (x.strides(2) == 4 || head_dim <= 1) && (x.strides(1) == 4 * head_dim || heads <= 1);
  const bool outer_ok = x.shape(0) <= 1 || (x.strides(0) > 0 && x.strides(0) % 4 == 0 &&
                                             x.strides(0) >= 4 * heads * head_dim);
  if (!inner_ok || !outer_ok)
    throw py::value_error(fmt::format(
        "{}: the heads and head_dim axes must be contiguous (strides ({}, {}) bytes for a [tokens, heads, head_dim] "
        "float32 array, the token axis may be strided), got strides {} for shape {}; pass numpy.ascontiguousarray({})",
        name, 4 * head_dim, 4, py::str(x.attr("strides")).cast<std::string>(), shape_string(x), name));
  return x.shape(0) <= 1 ? heads * head_dim : x.strides(0) / 4;
}

/// The output array of a rotation: a new one, or `out` checked (same shape, float32, C-contiguous, writeable),
/// or x itself (in place). Sets *in_place when the result is x's own memory.
py::array output_for(const py::array& x, const py::object& out, bool* in_place) {
  *in_place = false;
  if (out.is_none()) return new_float32({x.shape(0), x.shape(1), x.shape(2)});
  py::array o = require_float32(out, "out", 3, "[tokens, heads, head_dim]");
  for (int d = 0; d < 3; ++d)
    if (o.shape(d) != x.shape(d))
      throw py::value_error(fmt::format("out: shape {} differs from x's {}", shape_string(o), shape_string(x)));
  require_writeable(o, "out");
  if (o.data() == x.data() && o.strides(0) == x.strides(0) && o.strides(1) == x.strides(1) &&
      o.strides(2) == x.strides(2)) {
    *in_place = true;
    return o;
  }
  require_c_contiguous(o, "out");
  return o;
}

/// Copies the rows of x (token stride `stride` floats) into the C-contiguous `dst`.
void copy_rows(const float* x, int64_t stride, int64_t tokens, int64_t row, float* dst) {
  for (int64_t t = 0; t < tokens; ++t) std::memcpy(dst + t * row, x + t * stride, static_cast<std::size_t>(row) * 4);
}

/// The rotation with a ready table, into `out` (or in place), without the GIL.
py::array rotate(const py::array& x, const RopeTable& table, const std::string& layout, RopeDirection direction,
                 const py::object& out) {
  const int64_t stride = check_rope_input(x, "x");
  const int64_t tokens = x.shape(0);
  const int heads = static_cast<int>(x.shape(1)), head_dim = static_cast<int>(x.shape(2));
  if (table.n_positions() < tokens)
    throw py::value_error(fmt::format("position_ids: {} positions for {} tokens of x", table.n_positions(), tokens));
  bool in_place = false;
  py::array o = output_for(x, out, &in_place);
  if (in_place) require_writeable(x, "x");
  if (x.size() == 0) return o;  // no tokens or no heads: nothing to rotate
  if (layout == "interleaved_in_half_out" && in_place && stride != static_cast<int64_t>(heads) * head_dim)
    throw py::value_error("x: interleaved_in_half_out in place needs a C-contiguous x (token stride heads*head_dim)");
  const float* src = static_cast<const float*>(x.data());
  float* dst = static_cast<float*>(o.mutable_data());
  const int64_t row = static_cast<int64_t>(heads) * head_dim;
  // out= a different view of x's memory (e.g. the same buffer shifted by a token): the row copies below would read
  // rows already overwritten, so x is first copied aside.
  std::vector<float> aside;
  int64_t src_stride = stride;
  if (!in_place) {
    const char* xb = static_cast<const char*>(x.data());
    const char* xe = xb + ((tokens - 1) * stride + row) * 4;
    const char* ob = static_cast<const char*>(o.data());
    const char* oe = ob + tokens * row * 4;
    if (xb < oe && ob < xe) {
      aside.resize(static_cast<std::size_t>(tokens * row));
      copy_rows(src, stride, tokens, row, aside.data());
      src = aside.data();
      src_stride = row;
    }
  }
  {
    py::gil_scoped_release release;
    if (layout == "interleaved_in_half_out") {
      if (!in_place) copy_rows(src, src_stride, tokens, row, dst);
      apply_rope_interleaved_in_half_out(dst, tokens, heads, head_dim, table, direction);
    } else {
      const RopeLayout l = parse_rope_layout(layout, "layout");
      if (in_place) {
        apply_rope(dst, tokens, heads, head_dim, table, l, direction, stride);
      } else if (src_stride == row) {
        apply_rope(src, dst, tokens, heads, head_dim, table, l, direction);
      } else {
        copy_rows(src, src_stride, tokens, row, dst);
        apply_rope(dst, tokens, heads, head_dim, table, l, direction);
      }
    }
  }
  return o;
}

void check_head_dim(const py::array& x, const RopeFrequencies& f) {
  if (x.shape(2) != f.head_dim)
    throw py::value_error(fmt::format("x: head_dim (shape[2]) is {}, freqs.head_dim is {}", x.shape(2), f.head_dim));
}

py::array_t<float> inv_freq_view(const Frequencies& self, py::handle owner) {
  py::array_t<float> a(static_cast<py::ssize_t>(self.freqs.inv_freq.size()), self.freqs.inv_freq.data(), owner);
  py::detail::array_proxy(a.ptr())->flags &= ~py::detail::npy_api::NPY_ARRAY_WRITEABLE_;
  return a;
}

}  // namespace

void bind_rope(py::module_& m) {
  py::class_<RopeParams>(m, "RopeParams", R"doc(
Typed RoPE parameters (Hugging Face's names), as a config.json's rope_scaling / rope_parameters carries them.

RopeParams(rope_type="default", rope_theta=10000.0, head_dim=..., rotary_dim=0, partial_rotary_factor=None,
factor=None, original_max_position_embeddings=None, max_position_embeddings=None, attention_factor=None,
beta_fast=None, beta_slow=None, mscale=None, mscale_all_dim=None, truncate=None, short_factor=None,
long_factor=None, low_freq_factor=None, high_freq_factor=None); ``type`` is accepted for rope_type (legacy key).
An unknown keyword raises posenc.ConfigError naming it. Pass to posenc.rope_frequencies.)doc")
      .def(py::init([](py::kwargs kw) { return params_from_kwargs(kw); }))
      .def("to_dict", &params_dict, "The parameters that are set, as a dict.")
      .def_readwrite("rope_type", &RopeParams::rope_type)
      .def_readwrite("rope_theta", &RopeParams::rope_theta)
      .def_readwrite("head_dim", &RopeParams::head_dim)
      .def_property_readonly("rotary_dim", &RopeParams::effective_rotary_dim,
                             "Rotated width: rotary_dim, else int(head_dim * partial_rotary_factor), else head_dim.")
      .def("__repr__", [](const RopeParams& p) { return "posenc.RopeParams(**" + py::repr(params_dict(p)).cast<std::string>() + ")"; });

  py::class_<Frequencies>(m, "RopeFrequencies", R"doc(
RoPE frequencies as the kernels use them.

Attributes: inv_freq ([rotary_dim/2] float32, radians per position, read-only view), attention_factor (float,
multiplies cos and sin: Hugging Face's attention_scaling), head_dim, rotary_dim (channels >= rotary_dim pass
through), rope_type (provenance), layout ("half", "interleaved", "interleaved_in_half_out" or None when the source
implies none), mrope_section / mrope_mapping (M-RoPE configs).

RopeFrequencies(inv_freq, head_dim, rotary_dim=None, attention_factor=1.0, rope_type="custom", layout=None) builds
them from given values (rotary_dim defaults to 2*len(inv_freq)); posenc.InvalidArgument if inconsistent.)doc")
      .def(py::init([](py::handle inv_freq, int head_dim, std::optional<int> rotary_dim, double attention_factor,
                       std::string rope_type, std::optional<std::string> layout) {
             py::array a = py::array_t<float, py::array::c_style | py::array::forcecast>::ensure(inv_freq);
             if (!a || a.ndim() != 1) throw py::value_error("inv_freq: expected a 1-D array of floats");
             Frequencies f;
             const float* p = static_cast<const float*>(a.data());
             f.freqs.inv_freq.assign(p, p + a.size());
             f.freqs.head_dim = head_dim;
             f.freqs.rotary_dim = rotary_dim.value_or(static_cast<int>(2 * a.size()));
             f.freqs.attention_factor = attention_factor;
             f.freqs.rope_type = std::move(rope_type);
             f.freqs.validate();
             if (layout) f.layout = resolve_layout(layout, f);
             return f;
           }),
           py::arg("inv_freq"), py::arg("head_dim"), py::arg("rotary_dim") = py::none(),
           py::arg("attention_factor") = 1.0, py::arg("rope_type") = "custom", py::arg("layout") = py::none())
      .def_static(
          "default",
          [](int head_dim, std::optional<int> rotary_dim, double rope_theta, std::optional<std::string> layout) {
            Frequencies f;
            f.freqs = default_rope_frequencies(head_dim, rotary_dim.value_or(head_dim), rope_theta);
            if (layout) f.layout = resolve_layout(layout, f);
            return f;
          },
          py::arg("head_dim"), py::arg("rotary_dim") = py::none(), py::arg("rope_theta") = 10000.0,
          py::arg("layout") = py::none(),
          "Plain RoPE: inv_freq[i] = 1 / rope_theta^(2i/rotary_dim) in float32 (HF _compute_default_rope_parameters).")
      .def_property_readonly("inv_freq", [](py::object self) { return inv_freq_view(self.cast<const Frequencies&>(), self); })
      .def_property_readonly("attention_factor", [](const Frequencies& f) { return f.freqs.attention_factor; })
      .def_property_readonly("head_dim", [](const Frequencies& f) { return f.freqs.head_dim; })
      .def_property_readonly("rotary_dim", [](const Frequencies& f) { return f.freqs.rotary_dim; })
      .def_property_readonly("n_pairs", [](const Frequencies& f) { return f.freqs.n_pairs(); })
      .def_property_readonly("rope_type", [](const Frequencies& f) { return f.freqs.rope_type; })
      .def_property_readonly("layout", [](const Frequencies& f) { return f.layout; })
      .def_property_readonly("mrope_section", [](const Frequencies& f) { return f.mrope_section; })
      .def_property_readonly("mrope_mapping", [](const Frequencies& f) { return f.mrope_mapping; })
      .def("__repr__", [](const Frequencies& f) {
        return fmt::format("posenc.RopeFrequencies(rope_type='{}', head_dim={}, rotary_dim={}, attention_factor={}, "
                           "layout={})",
                           f.freqs.rope_type, f.freqs.head_dim, f.freqs.rotary_dim, f.freqs.attention_factor,
                           f.layout ? "'" + *f.layout + "'" : "None");
      });

  m.def(
      "_rope_frequencies_params",
      [](const RopeParams& p, std::optional<int64_t> seq_len) {
        Frequencies f;
        py::gil_scoped_release release;
        f.freqs = compute_rope_frequencies(p, seq_len);
        return f;
      },
      py::arg("params"), py::arg("seq_len") = py::none());
  m.def(
      "_rope_frequencies_config_text",
      [](const std::string& text, const std::string& source, std::optional<int64_t> seq_len, bool lenient) {
        ConfigOptions o;
        o.lenient = lenient;
        return from_spec(parse_positional_spec(text, source, o), seq_len);
      },
      py::arg("text"), py::arg("source"), py::arg("seq_len"), py::arg("lenient"));
  m.def(
      "_rope_frequencies_config_path",
      [](const std::string& path, std::optional<int64_t> seq_len, bool lenient) {
        ConfigOptions o;
        o.lenient = lenient;
        return from_spec(load_positional_spec(path, o), seq_len);
      },
      py::arg("path"), py::arg("seq_len"), py::arg("lenient"));
  m.def(
      "_rope_params_config_path",
      [](const std::string& path, bool lenient) {
        ConfigOptions o;
        o.lenient = lenient;
        const PositionalSpec spec = load_positional_spec(path, o);
        if (!spec.rope)
          throw ConfigError(fmt::format("{}: family {} has no RoPE parameters", spec.source, to_string(spec.family)));
        return *spec.rope;
      },
      py::arg("path"), py::arg("lenient"));

  m.def(
      "rope_cos_sin",
      [](py::handle freqs, py::handle position_ids, const std::string& precision) {
        const Frequencies& f = freqs_arg(freqs);
        const auto pos = require_integers<int64_t>(position_ids, "position_ids");
        if (pos.ndim() != 1)
          throw py::value_error(fmt::format("position_ids: expected a [tokens] array, got shape {}", shape_string(pos)));
        const AnglePrecision prec = parse_angle_precision(precision, "precision");
        const py::ssize_t n = pos.shape(0), pairs = f.freqs.n_pairs();
        py::array_t<float> cos({n, pairs}), sin({n, pairs});
        std::span<const int64_t> ids(pos.data(), static_cast<std::size_t>(n));
        std::span<float> c(cos.mutable_data(), static_cast<std::size_t>(n * pairs));
        std::span<float> s(sin.mutable_data(), static_cast<std::size_t>(n * pairs));
        {
          py::gil_scoped_release release;
          posenc::rope_cos_sin(f.freqs, ids, prec, c, s);
        }
        return py::make_tuple(cos, sin);
      },
      py::arg("freqs"), py::arg("position_ids"), py::arg("precision") = "float32", R"doc(
cos/sin of position_ids[t] * inv_freq[i], each multiplied by freqs.attention_factor.

freqs: posenc.RopeFrequencies; position_ids: [tokens] integers (int64); precision: "float32" (the angle and cos/sin
in float32, as Hugging Face and the checkpoints' training: bit-exact with transformers), "exact" (angle in double,
for very large positions), "fp64" (inv_freq in double too: the reference), "bf16" or "fp16" (every stage in that
dtype, as a rotary module cast to it; see posenc's AnglePrecision). Returns (cos, sin), each [tokens, rotary_dim/2] float32 (one value per channel pair;
Hugging Face's [tokens, rotary_dim] table is numpy.concatenate([cos, cos], -1) in the half layout).
Errors: TypeError (freqs not a posenc.RopeFrequencies, position_ids not integers), ValueError (position_ids not
[tokens], a uint64 value past int64), posenc.ConfigError (precision name).)doc");

  m.def(
      "apply_rope",
      [](py::handle x_obj, py::handle position_ids, py::handle freqs, std::optional<std::string> layout,
         const std::string& precision, const std::string& direction, py::object out) {
        const Frequencies& f = freqs_arg(freqs);
        const py::array x = require_float32(x_obj, "x", 3, "[tokens, heads, head_dim]");
        check_head_dim(x, f.freqs);
        const auto pos = require_integers<int64_t>(position_ids, "position_ids");
        if (pos.ndim() != 1 || pos.shape(0) != x.shape(0))
          throw py::value_error(fmt::format("position_ids: expected shape ({},) (one per token of x), got {}",
                                            x.shape(0), shape_string(pos)));
        const std::string l = resolve_layout(layout, f);
        const AnglePrecision prec = parse_angle_precision(precision, "precision");
        const RopeDirection dir = parse_direction(direction);
        std::span<const int64_t> ids(pos.data(), static_cast<std::size_t>(pos.shape(0)));
        RopeTable table;
        {
          py::gil_scoped_release release;
          table = RopeTable(f.freqs, ids, prec);
        }
        return rotate(x, table, l, dir, out);
      },
      py::arg("x"), py::arg("position_ids"), py::arg("freqs"), py::arg("layout") = py::none(),
      py::arg("precision") = "float32", py::arg("direction") = "forward", py::arg("out") = py::none(), R"doc(
Rotates q or k by RoPE (Su et al. 2021), Hugging Face's numerics (float32, no fused multiply-add).

x: [tokens, heads, head_dim] float32; the heads and head_dim axes contiguous, the token axis may be strided (e.g.
q = qkv[:, :n_heads] of a fused buffer). head_dim must equal freqs.head_dim; only the first freqs.rotary_dim
channels of each head rotate (partial rotary), the rest are copied.
position_ids: [tokens] integers. freqs: posenc.RopeFrequencies.
layout: "half" (channel i pairs with i + rotary_dim/2: rotate_half, Llama/Qwen/Mistral in HF format),
"interleaved" (2i with 2i+1: GPT-J, llama2.c, Meta), "interleaved_in_half_out" (DeepSeek-V3); None = freqs.layout.
precision: "float32", "exact", "fp64", "bf16" or "fp16" (see rope_cos_sin). direction: "forward" or "inverse" (the transpose).
out: None (a new [tokens, heads, head_dim] float32 array), an array of x's shape, or x itself (in place, no copy).
An empty x (0 tokens or 0 heads) gives an empty array; out may overlap x in another view (x is then read first).
Returns the rotated array. Errors: TypeError (x/out dtype, freqs not a posenc.RopeFrequencies, non-integer
position_ids), ValueError (shapes, strides, read-only out, head_dim != freqs.head_dim, a uint64 position past int64),
posenc.ConfigError (layout/precision/direction names, no layout given or implied), posenc.InvalidArgument
(inconsistent frequencies).)doc");

  m.def(
      "apply_rope_cos_sin",
      [](py::handle x_obj, py::handle cos_obj, py::handle sin_obj, const std::string& layout,
         const std::string& direction, py::object out) {
        const py::array x = require_float32(x_obj, "x", 3, "[tokens, heads, head_dim]");
        const py::array c = require_float32(cos_obj, "cos", 2, "[tokens, rotary_dim/2]");
        const py::array s = require_float32(sin_obj, "sin", 2, "[tokens, rotary_dim/2]");
        require_c_contiguous(c, "cos");
        require_c_contiguous(s, "sin");
        if (c.shape(0) != s.shape(0) || c.shape(1) != s.shape(1))
          throw py::value_error(fmt::format("sin: shape {} differs from cos's {}", shape_string(s), shape_string(c)));
        if (2 * c.shape(1) > x.shape(2))
          throw py::value_error(fmt::format("cos: {} pairs rotate {} channels, more than x's head_dim {}", c.shape(1),
                                            2 * c.shape(1), x.shape(2)));
        const float* cp = static_cast<const float*>(c.data());
        const float* sp = static_cast<const float*>(s.data());
        const RopeTable table = RopeTable::from_cos_sin(c.shape(0), static_cast<int>(c.shape(1)),
                                                        std::vector<float>(cp, cp + c.size()),
                                                        std::vector<float>(sp, sp + s.size()), AnglePrecision::exact);
        Frequencies none;
        return rotate(x, table, resolve_layout(layout, none), parse_direction(direction), out);
      },
      py::arg("x"), py::arg("cos"), py::arg("sin"), py::arg("layout"), py::arg("direction") = "forward",
      py::arg("out") = py::none(), R"doc(
Rotates x with given cos/sin tables (e.g. RoFormer's float64 sinusoidal table, or rope_cos_sin's output).

x: [tokens, heads, head_dim] float32 (as apply_rope); cos, sin: [tokens, rotary_dim/2] float32, C-contiguous,
already multiplied by any attention factor; layout and out as apply_rope. Errors: TypeError (dtype), ValueError
(shapes, strides, fewer cos rows than tokens, 2*pairs > head_dim), posenc.ConfigError (layout),
posenc.InvalidArgument (0 pairs).)doc");

  m.def(
      "mrope_cos_sin",
      [](py::handle freqs, py::handle position_ids, std::optional<std::vector<int>> mrope_section,
         const std::string& precision, std::optional<std::string> mapping) {
        const Frequencies& f = freqs_arg(freqs);
        const auto pos = require_integers<int64_t>(position_ids, "position_ids");
        if (pos.ndim() != 2 || pos.shape(0) != 3)
          throw py::value_error(fmt::format("position_ids: expected a [3, tokens] array (rows t, h, w), got shape {}",
                                            shape_string(pos)));
        const std::vector<int> section = mrope_section.value_or(f.mrope_section);
        const MropeMapping map = parse_mrope_mapping(mapping.value_or(f.mrope_mapping.value_or("chunked")), "mapping");
        const AnglePrecision prec = parse_angle_precision(precision, "precision");
        const int64_t tokens = pos.shape(1);
        std::span<const int64_t> ids(pos.data(), static_cast<std::size_t>(pos.size()));
        RopeTable t;
        {
          py::gil_scoped_release release;
          t = mrope_table(f.freqs, section, ids, tokens, prec, map);
        }
        std::vector<float> c(t.cos().begin(), t.cos().end()), s(t.sin().begin(), t.sin().end());
        return py::make_tuple(vector_to_numpy(std::move(c), {tokens, t.n_pairs()}),
                              vector_to_numpy(std::move(s), {tokens, t.n_pairs()}));
      },
      py::arg("freqs"), py::arg("position_ids"), py::arg("mrope_section") = py::none(),
      py::arg("precision") = "float32", py::arg("mapping") = py::none(), R"doc(
M-RoPE (Qwen2-VL) cos/sin: pair i rotates by position_ids[row(i), t] * inv_freq[i].

position_ids: [3, tokens] integers (rows temporal, height, width); mrope_section: [s_t, s_h, s_w] summing to
rotary_dim/2 (default freqs.mrope_section); mapping: "chunked" (Qwen2-VL) or "interleaved" (Qwen3-VL), default
freqs.mrope_mapping or chunked. Returns (cos, sin), each [tokens, rotary_dim/2] float32.
Errors: TypeError (freqs, non-integer position_ids), ValueError (position_ids not [3, tokens]), posenc.ConfigError
(mrope_section not 3 non-negative entries summing to rotary_dim/2, mapping/precision names).)doc");

  m.def(
      "apply_mrope",
      [](py::handle x_obj, py::handle position_ids, py::handle freqs, std::optional<std::vector<int>> mrope_section,
         const std::string& precision, const std::string& direction, std::optional<std::string> mapping,
         py::object out) {
        const Frequencies& f = freqs_arg(freqs);
        const py::array x = require_float32(x_obj, "x", 3, "[tokens, heads, head_dim]");
        check_head_dim(x, f.freqs);
        const auto pos = require_integers<int64_t>(position_ids, "position_ids");
        if (pos.ndim() != 2 || pos.shape(0) != 3 || pos.shape(1) != x.shape(0))
          throw py::value_error(fmt::format("position_ids: expected shape (3, {}) (rows t, h, w per token of x), got {}",
                                            x.shape(0), shape_string(pos)));
        const std::vector<int> section = mrope_section.value_or(f.mrope_section);
        const MropeMapping map = parse_mrope_mapping(mapping.value_or(f.mrope_mapping.value_or("chunked")), "mapping");
        const AnglePrecision prec = parse_angle_precision(precision, "precision");
        const RopeDirection dir = parse_direction(direction);
        std::span<const int64_t> ids(pos.data(), static_cast<std::size_t>(pos.size()));
        RopeTable table;
        {
          py::gil_scoped_release release;
          table = mrope_table(f.freqs, section, ids, x.shape(0), prec, map);
        }
        return rotate(x, table, "half", dir, out);  // M-RoPE is half layout only (Qwen2-VL, Qwen3-VL)
      },
      py::arg("x"), py::arg("position_ids"), py::arg("freqs"), py::arg("mrope_section") = py::none(),
      py::arg("precision") = "float32", py::arg("direction") = "forward", py::arg("mapping") = py::none(),
      py::arg("out") = py::none(), R"doc(
Rotates x by M-RoPE (Qwen2-VL's apply_multimodal_rotary_pos_emb; half layout).

x: [tokens, heads, head_dim] float32 (as apply_rope); position_ids: [3, tokens] integers (rows t, h, w);
mrope_section / mapping as mrope_cos_sin; out as apply_rope. With three equal rows this is apply_rope.
Errors: those of apply_rope and mrope_cos_sin.)doc");

  py::class_<RopeFrequencySchedule>(m, "RopeSchedule", R"doc(
The frequency update Hugging Face runs inside the rotary module's forward (dynamic_rope_update): dynamic NTK
recomputes when max(position_ids)+1 grows past the cached length (and resets below the original), LongRoPE switches
to the long factors past original_max_position_embeddings; other types never change.

RopeSchedule(params: posenc.RopeParams). update(position_ids) -> RopeFrequencies in effect for that forward call.
Errors: posenc.ConfigError (invalid params), posenc.PositionError (empty or negative position_ids).)doc")
      .def(py::init<RopeParams>(), py::arg("params"))
      .def(
          "update",
          [](RopeFrequencySchedule& s, py::handle position_ids) {
            const auto pos = require_integers<int64_t>(position_ids, "position_ids");
            std::span<const int64_t> ids(pos.data(), static_cast<std::size_t>(pos.size()));
            Frequencies f;
            f.freqs = s.update(ids);
            return f;
          },
          py::arg("position_ids"), "Runs the update for a forward call with these position ids (any shape).")
      .def_property_readonly("current", [](const RopeFrequencySchedule& s) { return Frequencies{s.current(), {}, {}, {}}; })
      .def_property_readonly("max_seq_len_cached", &RopeFrequencySchedule::max_seq_len_cached)
      .def_property_readonly("generation", &RopeFrequencySchedule::generation)
      .def_property_readonly("depends_on_seq_len", &RopeFrequencySchedule::depends_on_seq_len);

  m.def("rope_types", [] {
    py::list out;
    for (const auto& s : rope_scalings())
      out.append(py::dict(py::arg("name") = std::string(s.name), py::arg("summary") = std::string(s.summary),
                          py::arg("depends_on_seq_len") = s.depends_on_seq_len));
    return out;
  }, "The registered RoPE scalings: [{name, summary, depends_on_seq_len}].");
}

}  // namespace posenc::python
