// Internal: a checkpoint's tensors as views into its memory maps (or into
// buffers the loader converted), before the runtime's own layout is built.
// One reader per format (src/model/formats/); Model::build turns any of them
// into the same in-memory model.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "posenc/gguf.hpp"
#include "posenc/io.hpp"
#include "posenc/model.hpp"
#include "posenc/tokenizer.hpp"

namespace posenc::detail {

/// How a weight matrix is stored. q8_0: blocks of 32 (fp16 d, 32 int8);
/// q4_0: blocks of 32 (fp16 d, 16 bytes of nibbles), ggml's layouts.
enum class WeightType { f32, f16, bf16, q8_0, q4_0 };
std::string_view to_string(WeightType t);
/// The ggml type that stores a weight as `t` stores it (the same bytes per block).
GgmlType ggml_type(WeightType t);

/// A [rows, cols] row-major matrix (rows = out features, cols = in features,
/// as PyTorch's nn.Linear stores it); quantized types are blocked along cols.
/// `data` points into a memory map or a RawModel-owned buffer.
struct RawMatrix {
  WeightType type = WeightType::f32;
  const std::byte* data = nullptr;
  int64_t rows = 0, cols = 0;
  std::string name;  ///< the file's tensor name, for messages
  bool empty() const { return data == nullptr; }
  /// Bytes of one row.
  int64_t row_bytes() const;
  /// The whole matrix as float32 [rows, cols] (exact conversion / dequantization).
  std::vector<float> to_f32() const;
  /// Row r as float32 into out[cols].
  void row_to_f32(int64_t r, float* out) const;
};

struct RawLayer {
  const float* attention_norm = nullptr;  // [dim]
  RawMatrix wq;                           // [n_heads*head_dim, dim]
  RawMatrix wk;                           // [kv_dim, dim]
  RawMatrix wv;                           // [kv_dim, dim]
  RawMatrix wo;                           // [dim, n_heads*head_dim]
  const float* bq = nullptr;              // [n_heads*head_dim] (qkv_bias)
  const float* bk = nullptr;              // [kv_dim]
  const float* bv = nullptr;              // [kv_dim]
  const float* bo = nullptr;              // [dim] (o_bias)
  const float* q_norm = nullptr;          // [head_dim] (qk_norm)
  const float* k_norm = nullptr;          // [head_dim]
  const float* ffn_norm = nullptr;        // [dim]
  RawMatrix w1;                           // gate [hidden, dim]
  RawMatrix w2;                           // down [dim, hidden]
  RawMatrix w3;                           // up   [hidden, dim]
  const float* b1 = nullptr;              // [hidden] (mlp_bias)
  const float* b2 = nullptr;              // [dim]
  const float* b3 = nullptr;              // [hidden]
};

struct RawModel {
  std::vector<MappedFile> files;           // maps the views point into
  std::vector<std::shared_ptr<const void>> keep_alive;  // other owners of mapped data (parsed GGUF/safetensors files)
  std::vector<std::vector<float>> owned;   // converted buffers (their data never moves)
  ModelConfig cfg;
  PositionalConfig positional;
  RawMatrix tok_embeddings;               // [vocab, dim]
  std::vector<RawLayer> layers;
  const float* norm = nullptr;            // [dim]
  RawMatrix output;                       // [vocab, dim] (the embedding's matrix when shared)
  const float* pos_embeddings = nullptr;  // [pos_rows, dim] (learned)
  int64_t pos_rows = 0;
  const float* t5_bias = nullptr;         // [num_buckets, n_heads] (t5_bias)
  std::vector<std::string> symbols;
  std::string metadata_json = "{}";
  ModelSource source;
  std::optional<Tokenizer> tokenizer;     // the tokenizer the file brings
  int64_t sliding_window = 0;             // 0 = causal
  int64_t trained_context = 0;            // 0 = cfg.max_position_embeddings

  /// Keeps `v` alive with the model and returns its data.
  const float* own(std::vector<float> v);
};

/// A float32 [rows, cols] matrix view (for readers whose data are float32).
RawMatrix f32_matrix(const float* p, int64_t rows, int64_t cols, std::string name);

/// llama2.c legacy checkpoints (see Model::load_llama2c).
RawModel read_llama2c(const std::filesystem::path& path);
/// posenc checkpoints (see checkpoint.hpp).
RawModel read_posenc(const std::filesystem::path& path);
/// Hugging Face directories (src/model/formats/hf.cpp).
RawModel read_hf_directory(const std::filesystem::path& dir);
/// "<dir>: not a Hugging Face model directory: config.json is missing", naming the model files (.gguf, .bin) the
/// directory holds, if any, to be given instead.
std::string missing_config_message(const std::filesystem::path& dir);
/// GGUF files (src/model/formats/gguf_model.cpp).
RawModel read_gguf_model(const std::filesystem::path& path);
/// A GGUF file's embedded tokenizer (nullopt when it has none); `describe`
/// receives a description of it.
std::optional<Tokenizer> read_gguf_tokenizer(const std::filesystem::path& path, std::string& describe);
/// Whether `path` is named as a GGUF file (extension .gguf, any case): such a file without the magic is a damaged
/// GGUF, which the GGUF reader refuses by name, not another format.
bool named_gguf(const std::filesystem::path& path);

/// Shared validation of architecture sizes (head_dim 0 -> dim / n_heads);
/// throws CheckpointError prefixed with `name`.
void validate_config(const std::string& name, ModelConfig& cfg);
/// Throws CheckpointError if any of the n floats is not finite, naming the tensor.
void check_finite(const std::string& name, const std::string& tensor, const float* p, uint64_t n);
/// Throws CheckpointError naming `file`, the tensor and the first element (or
/// Q8_0/Q4_0 block scale) that is not finite.
void check_finite(const std::string& file, const RawMatrix& m);

}  // namespace posenc::detail
