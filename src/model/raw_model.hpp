// Internal: a checkpoint's tensors as views into its memory map, before the
// runtime's own layout (transposed matrices) is built. One reader per format.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "posenc/io.hpp"
#include "posenc/model.hpp"

namespace posenc::detail {

struct RawLayer {
  const float* attention_norm = nullptr;  // [dim]
  const float* wq = nullptr;              // [dim, dim]        (out, in)
  const float* wk = nullptr;              // [kv_dim, dim]
  const float* wv = nullptr;              // [kv_dim, dim]
  const float* wo = nullptr;              // [dim, dim]
  const float* ffn_norm = nullptr;        // [dim]
  const float* w1 = nullptr;              // [hidden, dim]
  const float* w2 = nullptr;              // [dim, hidden]
  const float* w3 = nullptr;              // [hidden, dim]
};

struct RawModel {
  MappedFile file;
  ModelConfig cfg;
  PositionalConfig positional;
  const float* tok_embeddings = nullptr;  // [vocab, dim]
  std::vector<RawLayer> layers;
  const float* norm = nullptr;            // [dim]
  const float* output = nullptr;          // [vocab, dim] (== tok_embeddings when shared)
  const float* pos_embeddings = nullptr;  // [pos_rows, dim] (learned)
  int64_t pos_rows = 0;
  const float* t5_bias = nullptr;         // [num_buckets, n_heads] (t5_bias)
  std::vector<std::string> symbols;
  std::string metadata_json = "{}";
};

/// llama2.c legacy checkpoints (see Model::load_llama2c).
RawModel read_llama2c(const std::filesystem::path& path);
/// posenc checkpoints (see checkpoint.hpp).
RawModel read_posenc(const std::filesystem::path& path);

/// Shared validation of architecture sizes; throws CheckpointError prefixed with `name`.
void validate_config(const std::string& name, ModelConfig& cfg);
/// Throws CheckpointError if any of the n floats is not finite, naming the tensor.
void check_finite(const std::string& name, const std::string& tensor, const float* p, uint64_t n);

}  // namespace posenc::detail
