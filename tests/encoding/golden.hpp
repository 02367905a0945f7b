// Test helpers for the Hugging Face golden vectors in
// ../shared/testdata/hf_reference/*.json (schema: that directory's README.md).
// Comparisons report the case name and the first differing element (its
// multi-dimensional index) with both values.
#pragma once

#include <cmath>
#include <cstdint>
#include <fstream>
#include <limits>
#include <span>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "posenc/scaling.hpp"

namespace posenc::golden {

using json = nlohmann::json;

inline json load(const std::string& file) {
  const std::string path = std::string(POSENC_SHARED_DIR) + "/testdata/hf_reference/" + file;
  std::ifstream in(path);
  if (!in) throw std::runtime_error("cannot open golden file " + path);
  return json::parse(in);
}

/// A nested JSON list flattened in row-major order, with its shape.
struct Tensor {
  std::vector<double> values;
  std::vector<std::size_t> shape;
  std::size_t size() const { return values.size(); }
  std::vector<float> as_float() const {
    return std::vector<float>(values.begin(), values.end());
  }
  std::vector<int64_t> as_int() const {
    std::vector<int64_t> out;
    out.reserve(values.size());
    for (double v : values) out.push_back(static_cast<int64_t>(v));
    return out;
  }
};

namespace detail {
inline void flatten(const json& j, std::size_t depth, Tensor& t) {
  if (j.is_array()) {
    if (t.shape.size() == depth) t.shape.push_back(j.size());
    else if (t.shape[depth] != j.size()) throw std::runtime_error("ragged golden tensor");
    for (const auto& e : j) flatten(e, depth + 1, t);
  } else {
    t.values.push_back(j.get<double>());
  }
}
}  // namespace detail

inline Tensor tensor(const json& j) {
  Tensor t;
  detail::flatten(j, 0, t);
  return t;
}

inline std::string index_string(std::size_t flat, const std::vector<std::size_t>& shape) {
  if (shape.empty()) return fmt::format("[{}]", flat);
  std::vector<std::size_t> idx(shape.size());
  for (std::size_t d = shape.size(); d-- > 0;) {
    idx[d] = flat % shape[d];
    flat /= shape[d];
  }
  return fmt::format("[{}]", fmt::join(idx, ", "));
}

enum class Tol { abs, rel, exact };

/// Compares actual to expected elementwise. abs: |a-e| <= tol; rel: |a-e| <=
/// tol*|e| (or <= tol when e == 0); exact: a == e. Also checks the sizes.
inline ::testing::AssertionResult compare(const std::string& case_name, const std::string& what,
                                          const Tensor& expected, std::span<const double> actual,
                                          Tol mode, double tol) {
  if (expected.size() != actual.size())
    return ::testing::AssertionFailure()
           << "case " << case_name << ", " << what << ": size " << actual.size() << ", expected "
           << expected.size();
  std::size_t bad = 0;
  double worst = 0.0;
  for (std::size_t i = 0; i < actual.size(); ++i) {
    const double e = expected.values[i], a = actual[i];
    const double diff = std::fabs(a - e);
    bool ok = false;
    switch (mode) {
      case Tol::abs: ok = diff <= tol; break;
      case Tol::rel: ok = e == 0.0 ? diff <= tol : diff <= tol * std::fabs(e); break;
      case Tol::exact: ok = a == e; break;
    }
    worst = std::max(worst, diff);
    if (!ok && bad++ == 0) {
      auto r = ::testing::AssertionFailure();
      r << "case " << case_name << ", " << what << index_string(i, expected.shape)
        << ": expected " << fmt::format("{:.10g}", e) << ", got " << fmt::format("{:.10g}", a)
        << " (|diff| " << fmt::format("{:.3g}", diff) << ", tolerance "
        << (mode == Tol::abs ? "abs " : mode == Tol::rel ? "rel " : "exact") << tol << ")";
      return r;
    }
  }
  return ::testing::AssertionSuccess();
}

template <class T>
::testing::AssertionResult compare(const std::string& case_name, const std::string& what,
                                   const Tensor& expected, std::span<const T> actual, Tol mode,
                                   double tol) {
  std::vector<double> a(actual.begin(), actual.end());
  return compare(case_name, what, expected, std::span<const double>(a), mode, tol);
}

template <class T>
::testing::AssertionResult compare(const std::string& case_name, const std::string& what,
                                   const Tensor& expected, const std::vector<T>& actual, Tol mode,
                                   double tol) {
  return compare(case_name, what, expected, std::span<const T>(actual), mode, tol);
}

/// RopeParams from a Hugging Face rope dict (rope_parameters_standardized or
/// a rope_scaling dict). Unknown keys throw, so no parameter is silently dropped.
inline RopeParams rope_params_from_dict(const json& d) {
  RopeParams p;
  auto opt_double = [](const json& v) -> std::optional<double> {
    if (v.is_null()) return std::nullopt;
    return v.get<double>();
  };
  for (const auto& [key, v] : d.items()) {
    if (key == "rope_type" || key == "type") p.rope_type = v.get<std::string>();
    else if (key == "rope_theta") p.rope_theta = v.get<double>();
    else if (key == "factor") p.factor = opt_double(v);
    else if (key == "partial_rotary_factor") p.partial_rotary_factor = opt_double(v);
    else if (key == "original_max_position_embeddings") p.original_max_position_embeddings = v.get<int64_t>();
    else if (key == "attention_factor") p.attention_factor = opt_double(v);
    else if (key == "beta_fast") p.beta_fast = opt_double(v);
    else if (key == "beta_slow") p.beta_slow = opt_double(v);
    else if (key == "mscale") p.mscale = opt_double(v);
    else if (key == "mscale_all_dim") p.mscale_all_dim = opt_double(v);
    else if (key == "truncate") p.truncate = v.get<bool>();
    else if (key == "short_factor") p.short_factor = v.get<std::vector<double>>();
    else if (key == "long_factor") p.long_factor = v.get<std::vector<double>>();
    else if (key == "low_freq_factor") p.low_freq_factor = opt_double(v);
    else if (key == "high_freq_factor") p.high_freq_factor = opt_double(v);
    else throw std::runtime_error("rope dict: unhandled key '" + key + "'");
  }
  if (d.contains("rope_type")) p.rope_type = d["rope_type"].get<std::string>();
  return p;
}

}  // namespace posenc::golden
