// Random inputs of the kernel tests: normal floats, and a weight matrix stored in one of the runtime's dtypes
// (ggml's encoders), as the model loaders hand them to the kernels.
#pragma once

#include <cstdint>
#include <random>
#include <vector>

#include "model/raw_model.hpp"
#include "posenc/gguf.hpp"

namespace posenc::test {

/// n floats from N(0, scale^2), reproducible from the seed.
inline std::vector<float> randn(std::size_t n, uint32_t seed, float scale) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

/// A [rows, cols] matrix of random weights N(0, scale^2) stored as `t`.
struct StoredMatrix {
  std::vector<std::byte> bytes;
  detail::RawMatrix m;
  StoredMatrix(detail::WeightType t, int64_t rows, int64_t cols, uint32_t seed, float scale = 0.05f) {
    bytes = ggml_quantize(ggml_type(t), randn(static_cast<std::size_t>(rows * cols), seed, scale));
    m.type = t;
    m.data = bytes.data();
    m.rows = rows;
    m.cols = cols;
    m.name = "test";
  }
};

}  // namespace posenc::test
