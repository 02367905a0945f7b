// posenc — converting a loaded model into another format.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "posenc/gguf.hpp"
#include "posenc/model.hpp"
#include "posenc/tokenizer.hpp"

namespace posenc {

struct GgufExportOptions {
  /// Type of the 2-D weight matrices: f32, f16, bf16, q8_0 or q4_0. 1-D
  /// tensors (norms, biases) stay f32, as llama.cpp keeps them. A matrix whose
  /// row length is not a multiple of 32 cannot be Q8_0/Q4_0 and is written as
  /// F16 (a note says so), as llama.cpp's quantizer falls back.
  GgmlType type = GgmlType::f32;
  std::string name;  ///< general.name (default: the source file's name)
};

struct GgufExportReport {
  std::vector<std::string> notes;  ///< fallbacks, layout permutation, vocabulary conversion
  int64_t tensors = 0;
  uint64_t bytes = 0;
};

/// Writes `model` as a GGUF v3 file of architecture `llama` that llama.cpp
/// loads: llama.* hyper-parameters (context_length = the trained context,
/// rope.freq_base, rope.dimension_count = rotary_dim, layer_norm_rms_epsilon,
/// key_length when head_dim != dim / n_heads, rope.scaling.* for linear and
/// yarn), tensors under llama.cpp's names with q/k rows permuted to the
/// interleaved layout when the model stores them for half (llama.cpp's
/// convert_hf_to_gguf permute), and the tokenizer as tokenizer.ggml.* (see
/// Tokenizer::gguf_vocabulary). Written atomically. Throws InvalidArgument for
/// what llama.cpp's llama architecture cannot express (q/k norm, MLP biases,
/// non-RoPE positions, rope_type dynamic/longrope/llama3, a sliding window),
/// IoError on write failure.
GgufExportReport write_model_gguf(const Model& model, const Tokenizer& tokenizer, const std::filesystem::path& out,
                                  const GgufExportOptions& options);

/// Adds `tokenizer` to a GGUF being written as tokenizer.ggml.* with exactly
/// `vocab_size` tokens (missing ids padded with "[PAD<id>]" tokens of type
/// unused, as llama.cpp's converter does):
///  - llama2.c and SentencePiece-style vocabularies (GGUF llama, tokenizer.json
///    with Prepend/Replace "▁" and byte_fallback): model "llama", pieces with
///    "▁" for spaces, scores (a tokenizer.json's merges become scores: the
///    token made by merge rank r scores -r, so llama.cpp's highest-score-first
///    merging follows the merge order), token types (control for BOS/EOS/
///    specials, byte for <0xXX>, unknown for unk), bos/eos/unk ids, add_bos_token;
///  - byte-level BPE (tokenizer.json ByteLevel, GGUF gpt2): model "gpt2", tokens,
///    merges, tokenizer.ggml.pre;
///  - symbol vocabularies: model "llama" with the symbols as pieces (llama.cpp
///    cannot tokenize text with it; ids fed directly work).
/// Returns notes on what was converted. Throws InvalidArgument for a tokenizer
/// with more ids than vocab_size.
/// What write_random_gguf writes: a Llama model of this shape with random weights.
struct RandomGgufOptions {
  /// dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size (all > 0),
  /// head_dim (0: dim / n_heads), max_position_embeddings (llama.context_length;
  /// 0: 2048), norm_eps, shared_classifier (false: an output.weight of its own).
  ModelConfig config;
  GgmlType type = GgmlType::f16;  ///< the 2-D matrices (f32, f16, bf16, q8_0, q4_0); norms F32
  uint64_t seed = 1;
  double rope_theta = 10000.0;
  std::string name = "posenc-random";
};

/// Writes a GGUF v3 file of architecture llama with random weights — for
/// benchmarks and memory tests at sizes no fixture has (llama.cpp's llama-bench
/// and posenc load the same file). Matrices: uniform in [-sqrt(3) 0.02,
/// sqrt(3) 0.02] (standard deviation 0.02, the usual initializer's), from a
/// splitmix64 stream seeded by `seed` (the same bytes on every machine); norms
/// 1. Vocabulary: a llama (SentencePiece) vocabulary of vocab_size pieces,
/// <unk> <s> </s>, the 256 byte pieces <0x00>..<0xFF>, then "tok<id>" (so
/// llama.cpp finds its byte and special tokens; text tokenizes into byte
/// pieces). Tensors are generated one at a time and encoded as they are made
/// (memory: the encoded file, not its float32 expansion). Written atomically.
/// Throws InvalidArgument naming the field for a size that is not positive,
/// heads that do not divide, a vocabulary under 259, rows not a multiple of 32
/// for q8_0/q4_0; IoError on write failure.
GgufExportReport write_random_gguf(const RandomGgufOptions& options, const std::filesystem::path& out);

std::vector<std::string> write_gguf_vocabulary(const Tokenizer& tokenizer, int vocab_size, GgufWriter& writer);

}  // namespace posenc
