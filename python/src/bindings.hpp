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

void bind_errors(py::module_& m);
void bind_rope(py::module_& m);
void bind_bias(py::module_& m);
void bind_analysis(py::module_& m);
void bind_model(py::module_& m);
void bind_bench(py::module_& m);

}  // namespace posenc::python
