// posenc Python bindings — declarations shared by the binding files (module.cpp defines the module).
#pragma once

#include <optional>
#include <string>
#include <vector>

#include <pybind11/pybind11.h>

#include "posenc/mrope.hpp"
#include "posenc/rope.hpp"

namespace posenc::python {

namespace py = pybind11;

/// What posenc.rope_frequencies returns: the frequencies the kernels use plus what the config says about their use
/// (layout, M-RoPE section); `layout` is empty when the source does not imply one (hand-built frequencies).
struct Frequencies {
  RopeFrequencies freqs;
  std::optional<std::string> layout;  ///< "half", "interleaved", "interleaved_in_half_out"
  std::vector<int> mrope_section;     ///< [t, h, w] pairs per position row (M-RoPE configs only)
  std::optional<std::string> mrope_mapping;  ///< "chunked" / "interleaved" (M-RoPE configs only)
};

/// The freqs argument as posenc.RopeFrequencies; a TypeError naming it otherwise (pybind11's own overload error
/// prints every argument, e.g. a whole [tokens, heads, head_dim] array, and names none).
inline const Frequencies& freqs_arg(const py::handle& obj) {
  try {
    if (!obj.is_none()) return obj.cast<const Frequencies&>();  // None would be a reference_cast_error (no subclass)
  } catch (const py::cast_error&) {
  }
  std::string got = py::str(py::type::of(obj).attr("__name__")).cast<std::string>();
  if (py::isinstance<py::dict>(obj) || py::isinstance<py::str>(obj))
    got += " (pass a config dict or path to posenc.rope_frequencies first)";
  throw py::type_error("freqs: expected a posenc.RopeFrequencies (posenc.rope_frequencies(config), "
                       "posenc.RopeFrequencies.default(head_dim), Model.rope), got " + got);
}

void bind_errors(py::module_& m);
void bind_rope(py::module_& m);
void bind_bias(py::module_& m);
void bind_analysis(py::module_& m);
void bind_model(py::module_& m);
void bind_bench(py::module_& m);
void bind_verify(py::module_& m);

}  // namespace posenc::python
