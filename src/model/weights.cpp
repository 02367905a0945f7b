// RawMatrix conversions: every stored dtype to float32, exactly.
#include <cstring>

#include <fmt/format.h>

#include "model/kernels.hpp"
#include "model/raw_model.hpp"
#include "posenc/error.hpp"
#include "posenc/safetensors.hpp"

namespace posenc::detail {

std::string_view to_string(WeightType t) {
  switch (t) {
    case WeightType::f32: return "F32";
    case WeightType::f16: return "F16";
    case WeightType::bf16: return "BF16";
    case WeightType::q8_0: return "Q8_0";
    case WeightType::q4_0: return "Q4_0";
  }
  return "?";
}

int64_t RawMatrix::row_bytes() const {
  switch (type) {
    case WeightType::f32: return cols * 4;
    case WeightType::f16:
    case WeightType::bf16: return cols * 2;
    case WeightType::q8_0: return cols / kQBlock * kQ8Bytes;
    case WeightType::q4_0: return cols / kQBlock * kQ4Bytes;
  }
  return 0;
}

void RawMatrix::row_to_f32(int64_t r, float* out) const {
  const std::byte* p = data + r * row_bytes();
  switch (type) {
    case WeightType::f32: std::memcpy(out, p, static_cast<std::size_t>(cols) * 4); return;
    case WeightType::f16:
    case WeightType::bf16:
      for (int64_t i = 0; i < cols; ++i) {
        uint16_t h;
        std::memcpy(&h, p + 2 * i, 2);
        out[i] = type == WeightType::f16 ? f16_to_f32(h) : bf16_to_f32(h);
      }
      return;
    case WeightType::q8_0: dequantize_q8_0_row(p, cols, out); return;
    case WeightType::q4_0: dequantize_q4_0_row(p, cols, out); return;
  }
}

std::vector<float> RawMatrix::to_f32() const {
  std::vector<float> out(static_cast<std::size_t>(rows * cols));
  for (int64_t r = 0; r < rows; ++r) row_to_f32(r, out.data() + r * cols);
  return out;
}

RawMatrix f32_matrix(const float* p, int64_t rows, int64_t cols, std::string name) {
  return {WeightType::f32, reinterpret_cast<const std::byte*>(p), rows, cols, std::move(name)};
}

const float* RawModel::own(std::vector<float> v) {
  owned.push_back(std::move(v));
  return owned.back().data();
}

}  // namespace posenc::detail
