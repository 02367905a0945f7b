// posenc Python bindings — the extension module posenc._posenc: exceptions mapped from posenc/error.hpp, the
// analysis functions (inspect, periods), and the registration of the other binding files. The public API is
// re-exported (with small conveniences) by python/posenc/__init__.py.
#include <optional>
#include <string>
#include <variant>

#include <fmt/format.h>
#include <pybind11/stl.h>

#include "arrays.hpp"
#include "bindings.hpp"
#include "posenc/analysis.hpp"
#include "posenc/config.hpp"
#include "posenc/error.hpp"
#include "posenc/inspect_json.hpp"
#include "posenc/threads.hpp"
#include "posenc/version.hpp"

namespace posenc::python {

namespace {

int64_t context_length(const py::handle& v, const char* field) {
  if (py::isinstance<py::str>(v)) return parse_context_length(v.cast<std::string>(), field);
  if (py::isinstance<py::bool_>(v) || !py::isinstance<py::int_>(v))
    throw py::type_error(fmt::format("{}: expected an int or a length such as \"128K\"", field));
  int64_t n = 0;
  try {
    n = v.cast<int64_t>();
  } catch (const py::cast_error&) {
    throw py::value_error(fmt::format("{}: {} does not fit int64", field, py::repr(v).cast<std::string>()));
  }
  if (n <= 0) fail_field<ConfigError>(field, "must be positive", n);
  return n;
}

/// v as a T, a TypeError naming the argument otherwise (pybind11's own says "Unable to cast Python instance").
template <class T>
T cast_arg(const py::handle& v, const char* name, const char* expected) {
  try {
    return v.cast<T>();
  } catch (const py::cast_error&) {
    throw py::type_error(fmt::format("{}: expected {}, got {} ({})", name, expected,
                                     py::str(py::type::of(v).attr("__name__")).cast<std::string>(),
                                     py::repr(v).cast<std::string>()));
  }
}

/// A scalar or a list/tuple of them, as a list.
std::vector<py::handle> as_list(const py::handle& v) {
  std::vector<py::handle> out;
  if (py::isinstance<py::list>(v) || py::isinstance<py::tuple>(v))
    for (auto e : v) out.push_back(e);
  else
    out.push_back(v);
  return out;
}

}  // namespace

void bind_errors(py::module_& m) {
  // The base first: pybind11 tries translators from the last registered, so each subclass is matched before Error.
  static py::exception<Error> error(m, "Error", PyExc_RuntimeError);
  error.doc() = "Base of every posenc error (posenc::Error). The message names the field or file and the bad value.";
  auto sub = [&](const char* name, const char* doc) {
    py::object cls = py::reinterpret_steal<py::object>(
        PyErr_NewExceptionWithDoc(fmt::format("posenc.{}", name).c_str(), doc, error.ptr(), nullptr));
    if (!cls) throw py::error_already_set();
    m.attr(name) = cls;
    return cls;
  };
  static py::object config = sub("ConfigError", "A configuration value (config.json field, argument) is missing, malformed or out of range.");
  static py::object checkpoint = sub("CheckpointError", "A checkpoint file is truncated, empty or inconsistent.");
  static py::object tokenizer = sub("TokenizerError", "A tokenizer file is malformed or does not fit the model.");
  static py::object position = sub("PositionError", "A position id is outside the range an encoding or table supports.");
  static py::object invalid = sub("InvalidArgument", "An argument to a library call is inconsistent (shape, odd rotary_dim, ...).");
  static py::object io = sub("IoError", "A file could not be read or written.");
  static py::object cache = sub("CacheError", "A KV-cache operation would break position semantics.");
  static py::object data = sub("DataError", "A file posenc wrote and reads back (eval run directory, study) is malformed.");
  static py::object dump = sub("DumpError", "A tensor dump given to posenc.verify (.npy, .npz, safetensors) is malformed or lacks an array.");
  static py::object numeric = sub("NumericError", "A forward pass gave a NaN or infinite logit (float32 overflowed in the model): nothing can be scored or sampled from it.");
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const ConfigError& e) {
      PyErr_SetString(config.ptr(), e.what());
    } catch (const CheckpointError& e) {
      PyErr_SetString(checkpoint.ptr(), e.what());
    } catch (const TokenizerError& e) {
      PyErr_SetString(tokenizer.ptr(), e.what());
    } catch (const PositionError& e) {
      PyErr_SetString(position.ptr(), e.what());
    } catch (const InvalidArgument& e) {
      PyErr_SetString(invalid.ptr(), e.what());
    } catch (const IoError& e) {
      PyErr_SetString(io.ptr(), e.what());
    } catch (const CacheError& e) {
      PyErr_SetString(cache.ptr(), e.what());
    } catch (const DataError& e) {
      PyErr_SetString(data.ptr(), e.what());
    } catch (const DumpError& e) {
      PyErr_SetString(dump.ptr(), e.what());
    } catch (const NumericError& e) {
      PyErr_SetString(numeric.ptr(), e.what());
    } catch (const Error& e) {
      PyErr_SetString(error.ptr(), e.what());
    }
  });
}

void bind_analysis(py::module_& m) {
  m.def(
      "_inspect_json",
      [](const std::optional<std::string>& path, const std::optional<std::string>& text, const std::string& source,
         py::object seq_len_obj, bool lenient) {
        std::optional<int64_t> seq_len;
        if (!seq_len_obj.is_none()) seq_len = context_length(seq_len_obj, "seq_len");
        std::string out;
        {
          py::gil_scoped_release release;
          ConfigOptions co;
          co.lenient = lenient;
          const PositionalSpec spec = path ? load_positional_spec(*path, co) : parse_positional_spec(*text, source, co);
          std::optional<RopeInspection> ins;
          if (spec.rope) ins = inspect_rope(spec, seq_len);
          out = inspect_json(spec, ins).dump();
        }
        return out;
      },
      py::arg("path"), py::arg("text"), py::arg("source"), py::arg("seq_len"), py::arg("lenient"));

  m.def(
      "periods",
      [](int head_dim, py::handle rope_theta, py::handle context, py::object rope_scaling, std::optional<double> factor,
         py::object original_max_position_embeddings, double low_freq_factor, double high_freq_factor,
         int rotary_dim) {
        PeriodsRequest req;
        req.head_dim = head_dim;
        req.rotary_dim = rotary_dim;
        for (auto t : as_list(rope_theta))
          req.rope_thetas.push_back(cast_arg<double>(t, "rope_theta", "a number or a list of numbers"));
        for (auto l : as_list(context)) req.lengths.push_back(context_length(l, "context"));
        if (!rope_scaling.is_none())
          for (auto s : as_list(rope_scaling))
            req.rope_types.push_back(cast_arg<std::string>(s, "rope_scaling", "a rope_type name or a list of them"));
        req.factor = factor;
        for (const auto& rt : req.rope_types)
          if (rt != "default" && !req.factor) fail_field<ConfigError>("factor", "required with rope_scaling", rt);
        if (!original_max_position_embeddings.is_none())
          req.original_max_position_embeddings =
              context_length(original_max_position_embeddings, "original_max_position_embeddings");
        req.low_freq_factor = low_freq_factor;
        req.high_freq_factor = high_freq_factor;
        std::vector<PeriodRow> rows;
        {
          py::gil_scoped_release release;
          rows = periods_table(req);
        }
        py::list out;
        for (const auto& r : rows) {
          py::dict d;
          d["rope_theta"] = r.rope_theta;
          d["head_dim"] = r.head_dim;
          if (req.has_rope_type()) d["rope_type"] = r.rope_type;
          d["length"] = r.length;
          d["wrapped"] = r.wrapped;
          d["unwrapped"] = r.unwrapped;
          d["unwrapped_channels"] = r.unwrapped_channels;
          out.append(d);
        }
        return out;
      },
      py::arg("head_dim") = 128, py::arg("rope_theta") = 10000.0, py::arg("context") = py::make_tuple("4K", "32K", "128K", "1M"),
      py::arg("rope_scaling") = py::none(), py::arg("factor") = py::none(),
      py::arg("original_max_position_embeddings") = py::none(), py::arg("low_freq_factor") = 1.0,
      py::arg("high_freq_factor") = 4.0, py::arg("rotary_dim") = 0, R"doc(
Which RoPE channels wrap (period 2*pi/inv_freq < length) at each length: the rows of `posenc periods --json`.

rope_theta: a number or a list; context: lengths (ints or "128K"/"1M" strings); rope_scaling: None (plain RoPE) or
rope_type names ("linear", "ntk", "dynamic", "yarn", "llama3", ...), which need factor (and
original_max_position_embeddings for dynamic/yarn/llama3). Returns [{rope_theta, head_dim, [rope_type,] length,
wrapped, unwrapped, unwrapped_channels}], theta outer, scaling, length inner. Errors: TypeError (a rope_theta that
is not a number, a rope_scaling that is not a str, a context that is not an int/str), ValueError (a length past
int64), posenc.ConfigError (head_dim/rotary_dim/rope_theta/factor out of range, unknown rope_scaling, missing
factor or original_max_position_embeddings).)doc");

  m.def(
      "rope_wavelengths",
      [](py::handle f) { return to_numpy(rope_wavelengths(freqs_arg(f).freqs)); }, py::arg("freqs"),
      "Wavelength 2*pi/inv_freq of each channel pair in tokens, [rotary_dim/2] float64 (inf for inv_freq 0). "
      "Errors: TypeError (freqs not a posenc.RopeFrequencies).");

  m.def(
      "parse_context_length", [](const std::string& text) { return parse_context_length(text, "length"); },
      py::arg("text"), "\"128K\" -> 131072, \"1M\" -> 1048576, \"4096\" -> 4096 (posenc.ConfigError otherwise).");
}

}  // namespace posenc::python

PYBIND11_MODULE(_posenc, m) {
  namespace py = pybind11;
  m.doc() = "posenc's C++ core (positional encodings, model runtime): the extension behind the posenc package.";
  // Before any parallel region: libgomp crashes on an absurd OMP_NUM_THREADS (the import fails with ImportError
  // naming it instead, as the CLI exits 2), also on a second import after os.environ was fixed (libgomp kept the
  // value it read at start-up).
  posenc::check_omp_threads_in_use();
  m.attr("__version__") = std::string(posenc::version());  // the CMake project version
  posenc::python::bind_errors(m);
  posenc::python::bind_rope(m);
  posenc::python::bind_bias(m);
  posenc::python::bind_analysis(m);
  posenc::python::bind_model(m);
  posenc::python::bind_bench(m);
  posenc::python::bind_verify(m);
}
