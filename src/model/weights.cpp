// RawMatrix conversions: every stored dtype to float32, exactly.
#include <cmath>
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

GgmlType ggml_type(WeightType t) {
  switch (t) {
    case WeightType::f32: return GgmlType::f32;
    case WeightType::f16: return GgmlType::f16;
    case WeightType::bf16: return GgmlType::bf16;
    case WeightType::q8_0: return GgmlType::q8_0;
    case WeightType::q4_0: return GgmlType::q4_0;
  }
  return GgmlType::f32;
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

void check_finite(const std::string& file, const RawMatrix& m) {
  auto fail = [&](int64_t r, int64_t c, float v, std::string_view what) {
    throw CheckpointError(fmt::format("{}: tensor {}: {} [{}, {}] is not finite ({})", file, m.name, what, r, c, v));
  };
  for (int64_t r = 0; r < m.rows; ++r) {
    const std::byte* p = m.data + r * m.row_bytes();
    switch (m.type) {
      case WeightType::f32:
        for (int64_t i = 0; i < m.cols; ++i) {
          float v;
          std::memcpy(&v, p + 4 * i, 4);
          if (!std::isfinite(v)) fail(r, i, v, "element");
        }
        break;
      case WeightType::f16:
      case WeightType::bf16:
        for (int64_t i = 0; i < m.cols; ++i) {
          uint16_t h;
          std::memcpy(&h, p + 2 * i, 2);
          const bool bad = m.type == WeightType::f16 ? (h & 0x7c00u) == 0x7c00u : (h & 0x7f80u) == 0x7f80u;
          if (bad) fail(r, i, m.type == WeightType::f16 ? f16_to_f32(h) : bf16_to_f32(h), "element");
        }
        break;
      case WeightType::q8_0:
      case WeightType::q4_0: {
        const int64_t block_bytes = m.type == WeightType::q8_0 ? kQ8Bytes : kQ4Bytes;
        for (int64_t b = 0; b < m.cols / kQBlock; ++b) {
          uint16_t h;
          std::memcpy(&h, p + b * block_bytes, 2);
          if ((h & 0x7c00u) == 0x7c00u) fail(r, b * kQBlock, f16_to_f32(h), "the scale of the block at");
        }
        break;
      }
    }
  }
}

RawMatrix f32_matrix(const float* p, int64_t rows, int64_t cols, std::string name) {
  return {WeightType::f32, reinterpret_cast<const std::byte*>(p), rows, cols, std::move(name)};
}

const float* RawModel::own(std::vector<float> v) {
  owned.push_back(std::move(v));
  return owned.back().data();
}

}  // namespace posenc::detail
