// posenc — the model runtime: a Llama-architecture decoder (token embedding,
// RMSNorm, grouped-query attention, SwiGLU feed-forward, final norm,
// classifier) running on posenc's attention engine and paged KV cache, with
// the positional encoding as an explicit, overridable value.
//
// Numerics follow llama2.c's run.c forward() (RMSNorm eps 1e-5, softmax scale
// 1/sqrt(head_dim)), with RoPE from posenc's RoPE core (float32 angles by
// default, as the checkpoints were trained).
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "posenc/family.hpp"
#include "posenc/kv_cache.hpp"
#include "posenc/rope.hpp"
#include "posenc/scaling.hpp"

namespace posenc {

namespace detail {
struct RawModel;
}
struct PosencCheckpoint;

/// Architecture hyper-parameters (llama2.c's Config, plus derived values).
struct ModelConfig {
  int dim = 0;          ///< d_model
  int hidden_dim = 0;   ///< SwiGLU inner size
  int n_layers = 0;
  int n_heads = 0;      ///< query heads
  int n_kv_heads = 0;   ///< num_key_value_heads
  int vocab_size = 0;
  int head_dim = 0;     ///< dim / n_heads
  int64_t max_position_embeddings = 0;  ///< the context the model was trained with (llama2.c seq_len)
  float norm_eps = 1e-5f;
  bool shared_classifier = true;  ///< classifier tied to the token embedding
  int kv_dim() const { return n_kv_heads * head_dim; }
};

/// How positions enter attention in this run: the RoPE frequencies, the
/// layout and the angle precision. Overridable for experiments (scalings,
/// wrong-layout checks); the default comes from the checkpoint.
struct RopeSetup {
  RopeParams params;       ///< what the frequencies were computed from (provenance; dynamic recompute)
  RopeFrequencies freqs;   ///< what the kernels use
  RopeLayout layout = RopeLayout::interleaved;
  AnglePrecision precision = AnglePrecision::float32;
};

/// What to do when frequencies change under cached keys (dynamic NTK).
enum class RopeChangePolicy { refuse, rerotate };

/// The positional encoding of a model (the non-tensor part; tables are weights).
struct PositionalConfig {
  PositionFamily family = PositionFamily::rope;  ///< mrope is not run by this runtime
  RopeSetup rope;                      ///< family == rope
  double alibi_max_bias = 8.0;         ///< family == alibi: slopes = alibi_slopes(n_heads, max_bias)
  int t5_num_buckets = 32;             ///< family == t5_bias: relative_attention_num_buckets
  int t5_max_distance = 128;           ///< family == t5_bias: relative_attention_max_distance
  double sinusoidal_base = 10000.0;    ///< family == sinusoidal (interleaved sin/cos layout)
};

class Model {
 public:
  /// Loads a llama2.c legacy (version 0) checkpoint: seven int32
  /// (dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size, seq_len;
  /// vocab_size < 0 = unshared classifier), then float32 weights in
  /// export order (token embedding, rms_att, wq, wk, wv, wo, rms_ffn, w1, w2,
  /// w3, rms_final, freq_cis_real, freq_cis_imag, [wcls]). Memory-mapped.
  /// Every size is validated against the others and against the file length
  /// before any weight is read. RoPE defaults: rope_theta 10000, interleaved
  /// layout, float32 angles (how llama2.c models are trained).
  /// Throws IoError (unreadable) or CheckpointError naming the field and value
  /// (empty/truncated file, dim not divisible by n_heads, odd head_dim, ...).
  static Model load_llama2c(const std::filesystem::path& path);

  /// Loads a posenc checkpoint (see checkpoint.hpp: any positional family,
  /// optional embedded symbol vocabulary) or, when the file does not start
  /// with the posenc magic, a llama2.c checkpoint. Throws as the loaders.
  static Model load(const std::filesystem::path& path);

  // Copies share the (immutable) weights and carry their own RopeSetup, so
  // one loaded checkpoint can be evaluated under several encodings at once.
  Model(const Model&);
  Model& operator=(const Model&);
  Model(Model&&) noexcept;
  Model& operator=(Model&&) noexcept;
  ~Model();

  const ModelConfig& config() const;
  const PositionalConfig& positional() const { return positional_; }
  PositionFamily family() const { return positional_.family; }
  /// The RoPE setup (meaningful for family() == rope).
  const RopeSetup& rope() const { return positional_.rope; }
  /// Replaces the RoPE setup. Throws InvalidArgument if the model is not a
  /// RoPE model, freqs.head_dim differs from the model's head_dim or
  /// rotary_dim is invalid.
  void set_rope(const RopeSetup& rope);
  /// The symbol vocabulary stored in a posenc checkpoint, if any.
  const std::vector<std::string>& embedded_symbols() const;
  /// Free-form JSON metadata of a posenc checkpoint ("{}" otherwise).
  const std::string& metadata_json() const;
  /// The model as a posenc checkpoint value (tensors copied, current
  /// positional setup), e.g. to convert a llama2.c checkpoint.
  PosencCheckpoint to_checkpoint() const;
  /// With a length-dependent method (rope_type dynamic/longrope), each forward
  /// recomputes the frequencies for the sequence length max(position_ids)+1 (Hugging
  /// Face's dynamic_rope_update rule) and the cache applies `policy` when they
  /// change under cached keys. Default: refuse.
  void set_rope_change_policy(RopeChangePolicy policy);

  /// Attention mask: 0 = causal (default); w > 0 = Mistral's sliding window
  /// (a query at position i sees keys j with 0 <= i - j < w). Throws
  /// InvalidArgument for w < 0.
  void set_sliding_window(int64_t window);
  int64_t sliding_window() const { return sliding_window_; }

  /// A KV cache shaped for this model.
  KvCache make_cache(int block_size = 16, int64_t max_blocks = 0) const;

  /// One sequence's share of a batched forward step.
  struct SequenceInput {
    KvCache::SeqId seq = -1;
    std::span<const int32_t> tokens;
    /// [tokens.size()] explicit position ids; empty = continue the sequence:
    /// next_position(seq) + 0, 1, 2, ...
    std::span<const int64_t> position_ids;
  };
  enum class LogitsMode { all, last };

  /// Runs `batch` (ragged: each sequence has its own length and positions)
  /// through the network, appending every token's rotated key and value to its
  /// sequence in `cache`, and writes logits [rows, vocab_size] float32 into
  /// `logits` (resized): one row per input token in batch order (all), or one
  /// per sequence (last). Uses all OpenMP threads for large steps.
  /// Throws InvalidArgument for token ids outside [0, vocab_size), a
  /// position_ids span of the wrong size, a sequence listed twice; PositionError
  /// for a position past a learned position table; CacheError per the RoPE
  /// change policy. Nothing is appended to the cache when it throws.
  void forward(KvCache& cache, std::span<const SequenceInput> batch, LogitsMode mode,
               std::vector<float>& logits) const;

  /// A padded batch as tokenizers and HF generate() produce it: tokens and
  /// attention_mask are [batch, width] row-major (mask 1 = real token, 0 =
  /// padding, left or right or anywhere). Padding never becomes a position and
  /// never receives attention: the real tokens of row b get position ids
  /// next_position(seqs[b]) + (number of real tokens before them in the row)
  /// (HF's cumsum(attention_mask) - 1 rule), and padding is dropped before the
  /// network. logits: [batch, width, vocab_size]; padding rows are zero.
  /// Throws InvalidArgument for mismatched sizes or a mask value other than 0/1.
  void forward_padded(KvCache& cache, std::span<const KvCache::SeqId> seqs, std::span<const int32_t> tokens,
                      std::span<const uint8_t> attention_mask, int64_t width, std::vector<float>& logits) const;

  /// Convenience: logits [tokens.size(), vocab_size] for one fresh sequence
  /// at positions 0..n-1 (a prefill that scores a whole window).
  std::vector<float> score_window(std::span<const int32_t> tokens) const;

 private:
  struct Weights;
  explicit Model(std::shared_ptr<const Weights> weights);
  static Model build(detail::RawModel raw);
  std::shared_ptr<const Weights> w_;
  PositionalConfig positional_;
  RopeChangePolicy policy_ = RopeChangePolicy::refuse;
  int64_t sliding_window_ = 0;
};

namespace detail {
/// TEST-ONLY hook: injects one of the classic position bugs into the runtime
/// so tests can prove the consistency checker catches them. restart_each_chunk:
/// a continuing forward numbers its tokens from 0 instead of next_position;
/// count_padding: forward_padded numbers tokens by their column, padding
/// included. Never set outside tests.
enum class PositionBug { none, restart_each_chunk, count_padding };
void set_position_bug_for_testing(PositionBug bug);
PositionBug position_bug_for_testing();
}  // namespace detail

}  // namespace posenc
