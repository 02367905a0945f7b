// posenc Python bindings — posenc.verify (posenc/verify.hpp): an engine's dumped RoPE tensors, from files or
// numpy arrays, against posenc's reference for a config. Thin: the checks and the catalogue are the library's.
#include <optional>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <pybind11/numpy.h>
#include <nlohmann/json.hpp>
#include <pybind11/stl.h>

#include "bindings.hpp"
#include "posenc/error.hpp"
#include "posenc/tensor_dump.hpp"
#include "posenc/verify.hpp"

namespace posenc::python {

namespace {

DumpArray from_numpy(const std::string& name, const py::handle& obj) {
  if (!py::isinstance<py::array>(obj))
    throw py::type_error(fmt::format("arrays['{}']: expected a numpy array, got {}", name,
                                     py::str(py::type::of(obj).attr("__name__")).cast<std::string>()));
  const py::array a = py::reinterpret_borrow<py::array>(obj);
  const char kind = a.dtype().kind();
  const auto size = a.dtype().itemsize();
  DumpArray out;
  out.name = name;
  if (kind == 'f' && size == 8) out.dtype = DumpDtype::f64;
  else if (kind == 'f' && size == 4) out.dtype = DumpDtype::f32;
  else if (kind == 'f' && size == 2) out.dtype = DumpDtype::f16;
  else if (kind == 'i' && size == 8) out.dtype = DumpDtype::i64;
  else if (kind == 'i' && size == 4) out.dtype = DumpDtype::i32;
  else
    throw py::type_error(fmt::format("arrays['{}']: dtype {} is not float64/float32/float16/int64/int32 "
                                     "(bfloat16: pass float32 or a safetensors file)",
                                     name, py::str(a.dtype()).cast<std::string>()));
  for (py::ssize_t i = 0; i < a.ndim(); ++i) out.shape.push_back(static_cast<int64_t>(a.shape(i)));
  const auto values = py::array_t<double, py::array::c_style | py::array::forcecast>::ensure(a);
  if (!values) throw py::error_already_set();
  out.values.assign(values.data(), values.data() + values.size());
  return out;
}

std::string verify_json(const std::optional<std::string>& config_path, const std::optional<std::string>& config_text,
                        const py::object& dump, const py::object& arrays,
                        const std::string& dump_layout, const std::optional<std::string>& rope_layout,
                        double tolerance_factor) {
  VerifyOptions options;
  options.dump_layout = parse_dump_layout(dump_layout, "dump_layout");
  options.tolerance_factor = tolerance_factor;
  std::optional<RopeLayout> layout;
  if (rope_layout) layout = parse_rope_layout(*rope_layout, "rope_layout");
  const VerifyReference ref = config_text ? verify_reference_from_json(*config_text, "<dict>", layout)
                                          : load_verify_reference(config_path.value_or(""), layout);
  std::vector<DumpArray> in_memory;
  std::string source = "<arrays>";
  std::optional<TensorDump> files;
  if (!dump.is_none()) {
    std::vector<std::string> paths;
    if (py::isinstance<py::str>(dump) || py::hasattr(dump, "__fspath__"))
      paths.push_back(py::str(dump).cast<std::string>());
    else
      for (auto p : dump) paths.push_back(py::str(p).cast<std::string>());
    if (paths.empty()) throw py::value_error("dump: an empty list of files");
    files = TensorDump::open(paths.front());
    for (std::size_t i = 1; i < paths.size(); ++i) files->merge(TensorDump::open(paths[i]));
  }
  if (!arrays.is_none()) {
    if (!py::isinstance<py::dict>(arrays)) throw py::type_error("arrays: expected a dict of name -> numpy array");
    for (auto [k, v] : py::reinterpret_borrow<py::dict>(arrays)) in_memory.push_back(from_numpy(py::str(k), v));
  }
  if (files && !in_memory.empty()) throw py::value_error("give dump (files) or arrays (numpy), not both");
  if (!files && in_memory.empty()) throw py::value_error("nothing to verify: give dump=path(s) or arrays={name: array}");
  VerifyResult r;
  {
    py::gil_scoped_release release;
    r = files ? verify_rope(ref, *files, options) : verify_rope(ref, in_memory, source, options);
  }
  std::string j = verify_result_json(r);
  // The human report too, for printing.
  j.insert(j.size() - 1, fmt::format(",\n  \"report\": {}\n", nlohmann::json(format_verify_report(r)).dump()));
  return j;
}

}  // namespace

void bind_verify(py::module_& m) {
  m.def("_verify_json", &verify_json, py::arg("config_path"), py::arg("config_text"), py::arg("dump") = py::none(), py::arg("arrays") = py::none(),
        py::arg("dump_layout") = "tokens,heads,head_dim", py::arg("rope_layout") = py::none(),
        py::arg("tolerance_factor") = 1.0,
        "posenc.verify's engine: the result as JSON text (posenc.verify returns it as a dict).");
  m.def("_rope_mistakes", [] {
    py::list out;
    for (const auto& e : rope_mistake_catalogue())
      out.append(py::dict(py::arg("id") = std::string(e.id), py::arg("title") = std::string(e.title),
                          py::arg("report") = std::string(e.report)));
    return out;
  });
}

}  // namespace posenc::python
