// posenc Python bindings — timing of the C++ kernel behind posenc.apply_rope, in the calling process, on the caller's
// numpy arrays: the reference bench/python_apply_rope.py compares the binding's time against. Same work per call as
// posenc.apply_rope: the cos/sin table from the position ids, then the rotation (out of place, or in place).
#include <chrono>
#include <string>

#include <fmt/format.h>
#include <pybind11/stl.h>

#include "arrays.hpp"
#include "bindings.hpp"
#include "posenc/rope.hpp"

namespace posenc::python {

void bind_bench(py::module_& m) {
  m.def(
      "_bench_apply_rope_cpp",
      [](py::handle x_obj, py::handle position_ids, const Frequencies& f, const std::string& layout, py::handle out_obj,
         int repeats) {
        const py::array x = require_float32(x_obj, "x", 3, "[tokens, heads, head_dim]");
        require_c_contiguous(x, "x");
        py::array out = require_float32(out_obj, "out", 3, "[tokens, heads, head_dim]");
        require_c_contiguous(out, "out");
        require_writeable(out, "out");
        if (out.size() != x.size()) throw py::value_error("out: size differs from x's");
        const auto pos = require_integers<int64_t>(position_ids, "position_ids");
        if (pos.ndim() != 1 || pos.shape(0) != x.shape(0)) throw py::value_error("position_ids: one per token of x");
        const RopeLayout l = parse_rope_layout(layout, "layout");
        const bool in_place = out.data() == x.data();
        const float* src = static_cast<const float*>(x.data());
        float* dst = static_cast<float*>(out.mutable_data());
        const int64_t tokens = x.shape(0);
        const int heads = static_cast<int>(x.shape(1)), head_dim = static_cast<int>(x.shape(2));
        std::span<const int64_t> ids(pos.data(), static_cast<std::size_t>(tokens));
        std::vector<double> seconds;
        {
          py::gil_scoped_release release;
          for (int r = 0; r < repeats; ++r) {
            const auto t0 = std::chrono::steady_clock::now();
            const RopeTable table(f.freqs, ids, AnglePrecision::float32);
            if (in_place)
              apply_rope(dst, tokens, heads, head_dim, table, l);
            else
              apply_rope(src, dst, tokens, heads, head_dim, table, l);
            seconds.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
          }
        }
        return seconds;
      },
      py::arg("x"), py::arg("position_ids"), py::arg("freqs"), py::arg("layout"), py::arg("out"), py::arg("repeats"),
      "Seconds per call of the C++ table + rotation on x into out (in place when out is x), timed in C++ "
      "(benchmark support; not part of the API).");
}

}  // namespace posenc::python
