// posenc Python bindings — numpy argument checks shared by the binding files.
// Every check names the Python argument and says what was expected and what was given; dtype errors are
// TypeError, shape/stride errors ValueError (as numpy's own).
#pragma once

#include <cstdint>
#include <initializer_list>
#include <utility>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

namespace posenc::python {

namespace py = pybind11;

/// "(4, 32, 128)" for a shape.
inline std::string shape_string(const py::array& a) {
  std::string s = "(";
  for (py::ssize_t i = 0; i < a.ndim(); ++i) s += fmt::format("{}{}", i ? ", " : "", a.shape(i));
  return s + (a.ndim() == 1 ? ",)" : ")");
}

inline std::string dtype_string(const py::array& a) { return py::str(a.dtype()).cast<std::string>(); }

/// `obj` as a numpy array without converting it (TypeError naming `name` if it is not one).
inline py::array require_ndarray(const py::handle& obj, const char* name) {
  if (!py::isinstance<py::array>(obj))
    throw py::type_error(fmt::format("{}: expected a numpy.ndarray, got {}", name,
                                     py::str(py::type::of(obj).attr("__name__")).cast<std::string>()));
  return py::reinterpret_borrow<py::array>(obj);
}

/// A float32 ndarray with `ndim` axes: no conversion, no copy (TypeError for another dtype, ValueError for another
/// number of axes). `what` describes the axes for the message ("[tokens, heads, head_dim]").
inline py::array require_float32(const py::handle& obj, const char* name, py::ssize_t ndim, const char* what) {
  py::array a = require_ndarray(obj, name);
  if (!a.dtype().is(py::dtype::of<float>()))
    throw py::type_error(fmt::format("{}: expected dtype float32, got {} (convert with .astype(numpy.float32))", name,
                                     dtype_string(a)));
  if (a.ndim() != ndim)
    throw py::value_error(fmt::format("{}: expected a {} array ({} axes), got shape {}", name, what, ndim,
                                      shape_string(a)));
  return a;
}

/// True when the array's elements are laid out row-major without gaps.
inline bool c_contiguous(const py::array& a) { return (a.flags() & py::array::c_style) != 0; }

inline void require_c_contiguous(const py::array& a, const char* name) {
  if (!c_contiguous(a))
    throw py::value_error(fmt::format("{}: expected a C-contiguous array, got strides {} for shape {} (pass "
                                      "numpy.ascontiguousarray({}))",
                                      name, py::str(a.attr("strides")).cast<std::string>(), shape_string(a), name));
}

inline void require_writeable(const py::array& a, const char* name) {
  if (!a.writeable()) throw py::value_error(fmt::format("{}: the array is read-only", name));
}

/// Integer ids (position ids, token ids, masks) as a C-contiguous array of T. Lists and tuples are converted;
/// an ndarray must have an integer dtype (TypeError otherwise: a float position is a bug, not a value to
/// truncate). Zero-copy when it already is a C-contiguous array of T.
template <class T>
using c_array = py::array_t<T, py::array::c_style | py::array::forcecast>;

template <class T>
c_array<T> require_integers(const py::handle& obj, const char* name) {
  py::array a = py::isinstance<py::array>(obj) ? py::reinterpret_borrow<py::array>(obj) : py::array::ensure(obj);
  if (!a) {
    PyErr_Clear();
    throw py::type_error(fmt::format("{}: expected an integer array or a sequence of integers", name));
  }
  const char kind = a.dtype().kind();
  if (a.size() > 0 && kind != 'i' && kind != 'u')
    throw py::type_error(fmt::format("{}: expected an integer dtype (int64), got {}", name, dtype_string(a)));
  // numpy's cast of uint64 to int64 wraps (2**63 -> -2**63): refuse what does not fit instead of using another value.
  if (kind == 'u' && a.itemsize() == 8 && a.size() > 0) {
    const auto u = c_array<uint64_t>::ensure(a);
    for (py::ssize_t i = 0; i < u.size(); ++i)
      if (u.data()[i] > static_cast<uint64_t>(INT64_MAX))
        throw py::value_error(fmt::format("{}: value {} (uint64) at flat index {} does not fit int64", name,
                                          u.data()[i], i));
  }
  return c_array<T>::ensure(a);
}

/// Checks that an output of the given axes (name, length) has a byte size that fits (<= 2^62 bytes of `itemsize`
/// elements): the core computes q_len * k_len * heads in 64 bits, which wraps for lengths near 2^31..2^62 and then
/// writes past a small vector. Negative lengths are left to the core's own checks. ValueError naming the axes.
inline void check_output_size(std::initializer_list<std::pair<const char*, int64_t>> axes, int64_t itemsize) {
  int64_t n = itemsize;
  bool overflow = false;
  for (const auto& [name, len] : axes) {
    if (len < 0) return;
    overflow = overflow || __builtin_mul_overflow(n, len, &n) || n > (int64_t{1} << 62);
  }
  if (!overflow) return;
  std::string dims;
  for (const auto& [name, len] : axes) dims += fmt::format("{}{} {}", dims.empty() ? "" : " x ", name, len);
  throw py::value_error(fmt::format("{}: the output of {}-byte elements would exceed 2^62 bytes", dims, itemsize));
}

/// A new C-contiguous float32 array of the given shape.
inline py::array_t<float> new_float32(std::vector<py::ssize_t> shape) { return py::array_t<float>(shape); }

/// A copy of a vector as a new 1-D numpy array.
template <class T>
py::array_t<T> to_numpy(const std::vector<T>& v) {
  py::array_t<T> out(static_cast<py::ssize_t>(v.size()));
  std::copy(v.begin(), v.end(), out.mutable_data());
  return out;
}

/// A vector moved into a numpy array of the given shape without a copy: the array owns the vector.
template <class T>
py::array_t<T> vector_to_numpy(std::vector<T>&& v, std::vector<py::ssize_t> shape) {
  auto* owner = new std::vector<T>(std::move(v));
  py::capsule free_when_done(owner, [](void* p) { delete static_cast<std::vector<T>*>(p); });
  return py::array_t<T>(shape, owner->data(), free_when_done);
}

}  // namespace posenc::python
