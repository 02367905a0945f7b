// posenc — the posenc checkpoint format (version 1): a Llama-architecture
// decoder with any positional family, its symbol vocabulary and metadata, in
// one memory-mappable file. Written by `posenc train`, read by Model::load.
//
// Layout (little-endian):
//   bytes [0, 8)     magic "POSENC01"
//   bytes [8, 16)    uint64 H: length of the JSON header in bytes
//   bytes [16, 16+H) UTF-8 JSON header (below)
//   zero padding up to the next multiple of 64: the data section starts there
//   data section     float32 tensors, row-major, each at a 64-byte aligned
//                    offset relative to the data section start
// JSON header:
//   {"format": "posenc-checkpoint", "version": 1,
//    "config": {"dim", "hidden_dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size",
//               "max_position_embeddings" (trained context), "norm_eps", "shared_classifier"},
//    "positional": {"family": "nope"|"learned_absolute"|"sinusoidal"|"t5_bias"|"alibi"|"rope"|"mrope",
//                   rope: "rope_theta", "rotary_dim", "layout" ("half"|"interleaved"), "angle_precision";
//                   mrope: as rope, plus "mrope_section" [s_t, s_h, s_w] (sum rotary_dim/2) and
//                   "mrope_mapping" ("chunked" | "interleaved", default chunked; see mrope.hpp);
//                   alibi: "max_bias"; t5_bias: "relative_attention_num_buckets",
//                   "relative_attention_max_distance"; sinusoidal: "base"},
//    "symbols": [...] (optional symbol vocabulary, see tokenizer.hpp),
//    "metadata": {...} (free-form: training task, seed, steps, ...),
//    "tensors": [{"name", "shape": [...], "offset": bytes}]}
// Tensors ([out, in] for matrices, as PyTorch nn.Linear stores them):
//   tok_embeddings [vocab_size, dim]; layers.{l}.attention_norm [dim];
//   layers.{l}.wq [dim, dim]; layers.{l}.wk, .wv [n_kv_heads*head_dim, dim];
//   layers.{l}.wo [dim, dim]; layers.{l}.ffn_norm [dim];
//   layers.{l}.w1, .w3 [hidden_dim, dim]; layers.{l}.w2 [dim, hidden_dim];
//   norm [dim]; output [vocab_size, dim] (absent when shared_classifier);
//   pos_embeddings [max_position_embeddings, dim] (learned_absolute);
//   t5_relative_attention_bias [relative_attention_num_buckets, n_heads] (t5_bias).
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "posenc/model.hpp"

namespace posenc {

struct CheckpointTensor {
  std::string name;
  std::vector<int64_t> shape;
  std::vector<float> data;  ///< row-major, product(shape) values
};

struct PosencCheckpoint {
  ModelConfig config;                 ///< head_dim is derived (dim / n_heads)
  PositionalConfig positional;        ///< rope: rope.params (rope_theta, rotary_dim), layout, precision
  std::vector<std::string> symbols;   ///< optional symbol vocabulary
  std::string metadata_json = "{}";   ///< a JSON object
  std::vector<CheckpointTensor> tensors;
};

/// Writes `ckpt` atomically. Throws InvalidArgument for a tensor whose data
/// size differs from its shape, a missing or misshapen required tensor, or
/// metadata that is not a JSON object; IoError on write failure.
void save_posenc_checkpoint(const std::filesystem::path& path, const PosencCheckpoint& ckpt);

/// True if the file starts with the posenc magic.
bool is_posenc_checkpoint(const std::filesystem::path& path);

}  // namespace posenc
