// posenc — the model runtime: a Llama-architecture decoder (token embedding,
// RMSNorm, grouped-query attention, SwiGLU feed-forward, final norm,
// classifier) running on posenc's attention engine and paged KV cache, with
// the positional encoding as an explicit, overridable value.
//
// One forward pass, several loaders (src/model/formats/): llama2.c `.bin`,
// posenc checkpoints, Hugging Face directories (config.json + safetensors +
// tokenizer.json) and GGUF files each produce the same in-memory model.
// Architecture knobs the forward honours: grouped-query attention, an explicit
// head_dim (n_heads * head_dim may differ from dim), tied embeddings, q/k/v
// (and o) biases (Qwen2, Llama attention_bias), per-head q/k RMSNorm (Qwen3),
// sliding-window attention (Mistral), rms_norm_eps, partial rotary.
//
// Numerics follow Hugging Face's LlamaForCausalLM / llama2.c's run.c forward()
// (RMSNorm in float32, softmax scale 1/sqrt(head_dim)), with RoPE from posenc's
// RoPE core (float32 angles by default, as the checkpoints were trained).
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "posenc/family.hpp"
#include "posenc/kv_cache.hpp"
#include "posenc/mrope.hpp"
#include "posenc/rope.hpp"
#include "posenc/scaling.hpp"
#include "posenc/tokenizer.hpp"

namespace posenc {

namespace detail {
struct RawModel;
}
struct PosencCheckpoint;
struct CheckpointTensor;

/// Architecture hyper-parameters (llama2.c's Config, plus the knobs of the
/// Hugging Face Llama family).
struct ModelConfig {
  int dim = 0;          ///< d_model (hidden_size)
  int hidden_dim = 0;   ///< SwiGLU inner size (intermediate_size)
  int n_layers = 0;     ///< num_hidden_layers
  int n_heads = 0;      ///< query heads (num_attention_heads)
  int n_kv_heads = 0;   ///< num_key_value_heads
  int vocab_size = 0;
  /// Channels per head. 0 in a config being built means dim / n_heads;
  /// validate_config resolves it. Qwen3/Gemma-style configs set it explicitly,
  /// so n_heads * head_dim (the q width) may differ from dim.
  int head_dim = 0;
  int64_t max_position_embeddings = 0;  ///< the context the file says the model was trained with
  float norm_eps = 1e-5f;               ///< rms_norm_eps
  bool shared_classifier = true;        ///< classifier tied to the token embedding (tie_word_embeddings)
  bool qkv_bias = false;    ///< biases on q, k, v projections (Qwen2; Llama attention_bias)
  bool o_bias = false;      ///< bias on the output projection (Llama attention_bias)
  bool mlp_bias = false;    ///< biases on gate/up/down (Llama mlp_bias)
  bool qk_norm = false;     ///< RMSNorm over head_dim on each q and k head before RoPE (Qwen3)
  int q_dim() const { return n_heads * head_dim; }
  int kv_dim() const { return n_kv_heads * head_dim; }
};

/// The file formats Model::load reads.
///  - llama2c:      llama2.c legacy `.bin` (q/k stored for interleaved pairs)
///  - posenc:       posenc's POSENC01 checkpoint (layout in its header)
///  - hf_directory: config.json + model.safetensors (or sharded, with
///                  model.safetensors.index.json) + tokenizer.json; q/k stored for
///                  `half` (rotate_half)
///  - gguf:         llama.cpp's GGUF (architecture llama: q/k stored for
///                  interleaved pairs, because llama.cpp's converter permutes them)
enum class ModelFormat { llama2c, posenc, hf_directory, gguf };
std::string_view to_string(ModelFormat format);

/// How products with quantized weights (GGUF Q8_0, Q4_0) are computed.
///  - dequantize:     the blocks stay in the file (memory-mapped) and each
///                    weight is dequantized to float32 in registers as a
///                    product reads it; every product is float32 (the
///                    reference forward). Weights of every other dtype (F32,
///                    F16, BF16) are read the same way: as stored, never
///                    expanded into a float32 copy.
///  - q8_activations: the weights stay in their blocks; each activation row is
///                    quantized to Q8_0 (blocks of 32: d = amax/127 rounded to
///                    fp16, q = round(x/d)) and every block product is an exact
///                    int8 dot product scaled by d_w*d_x — llama.cpp's CPU
///                    arithmetic (ggml's vec_dot_type of Q8_0/Q4_0 is Q8_0).
enum class QuantizedMatmul { dequantize, q8_activations };
std::string_view to_string(QuantizedMatmul mode);
/// Parses "dequantize" or "q8_activations". Throws ConfigError naming `field`.
QuantizedMatmul parse_quantized_matmul(std::string_view text, std::string_view field);

/// What a timing of this process depends on and its results do not (every path and plan gives the same bits):
/// the matrix-product paths, chosen once per process from the CPU and POSENC_DENSE_KERNEL / POSENC_Q8_KERNEL, the
/// decode plans of the AVX-512 and AVX2 paths (POSENC_DECODE_STREAMS or the CPU vendor's), and the OpenMP thread
/// count.
struct KernelInfo {
  std::string dense_kernel;        ///< float32 products: "reference", "avx2" or "avx512"
  std::string q8_kernel;           ///< q8_activations products: "reference", "avx2", "avx512_vnni" or "amx"
  std::string decode_plan_dense;   ///< F32/F16/BF16 decode plan ("2:prefetch=4096"); "" on the reference path
  std::string decode_plan_blocks;  ///< Q8_0/Q4_0 decode plan of the float32 products' path (the VNNI/AMX decode of
                                   ///< q8_activations takes the avx512 one: the same, but where POSENC_DENSE_KERNEL=avx2
                                   ///< is asked on an Intel CPU with AVX-512, 8 runs here and 16 there); ""
                                   ///< when none of them runs
  int threads = 1;                 ///< region_thread_count() (posenc/threads.hpp)
};
/// This process's KernelInfo. Asking for the plans reports a bad POSENC_DECODE_STREAMS on stderr once, as a decode
/// would, only when a decode with a plan (the float32 products' AVX-512 or AVX2 path, the VNNI/AMX q8_activations
/// path) is in use.
KernelInfo kernel_info();

/// How products with F16/BF16 weights are computed.
///  - float32: each weight widened to float32 in registers, float32 FMAs in
///             the fixed order of kernels_dense.hpp (the reference forward;
///             the same bits on every x86-64 path and thread count).
///  - bf16x3, bf16x6: on AMX-BF16 tiles (Intel Sapphire Rapids and later):
///             each float32 activation split into bfloat16 terms, each weight
///             into two (exact for F16), and the kept bf16 products (exact in
///             float32) summed in float32 by tdpbf16ps. bf16x6 keeps all six
///             (every product x * w exact; only the sums' rounding differs
///             from float32); bf16x3 keeps three (XLA's BF16_BF16_F32_X3),
///             the dropped ones under 2^-13 |x w| together. The bits are the AMX unit's: the same
///             for decode and prefill and any thread count, not those of
///             float32. Prefill of the 487M-parameter F16 benchmark model:
///             1.28-1.53x float32's (bf16x6), 2.10-2.47x (bf16x3); decode under
///             half of float32's (each weight is widened and split again per
///             token). F32, Q8_0 and Q4_0 weights are not affected.
///             Model::load throws InvalidArgument (naming dense_matmul) for a
///             model with F16/BF16 matrices on a CPU without AMX-BF16.
enum class DenseMatmul { float32, bf16x3, bf16x6 };
std::string_view to_string(DenseMatmul mode);
/// Parses "float32", "bf16x3" or "bf16x6". Throws ConfigError naming `field`.
DenseMatmul parse_dense_matmul(std::string_view text, std::string_view field);

struct LoadOptions {
  QuantizedMatmul quantized_matmul = QuantizedMatmul::dequantize;
  DenseMatmul dense_matmul = DenseMatmul::float32;
};

/// Where a loaded model came from, and why its settings are what they are.
struct ModelSource {
  ModelFormat format = ModelFormat::llama2c;
  std::filesystem::path path;
  std::string architecture;            ///< "LlamaForCausalLM", "gguf llama", "llama2.c", "posenc"
  std::string weights;                 ///< stored dtypes and how they are held, e.g. "Q8_0 (dequantized to float32)"
  std::string layout_reason;           ///< why the RoPE layout is what it is (RoPE models)
  std::string trained_context_source;  ///< "config.json max_position_embeddings", "GGUF llama.context_length", ...
  std::string tokenizer;               ///< the bundled tokenizer ("tokenizer.json", "GGUF embedded llama vocabulary", "")
  /// Why the file's own tokenizer could not be read ("" when it could or there
  /// is none): the model loads anyway (a --tokenizer can stand in), and
  /// bundled_tokenizer() is then nullopt.
  std::string tokenizer_error;
  std::vector<std::string> notes;      ///< other provenance (defaults applied, values the file overstates, ...)
};

/// How positions enter attention in this run: the RoPE frequencies, the
/// layout and the angle precision. Overridable for experiments (scalings,
/// wrong-layout checks); the default comes from the checkpoint.
struct RopeSetup {
  RopeParams params;       ///< what the frequencies were computed from (provenance; dynamic recompute)
  RopeFrequencies freqs;   ///< what the kernels use
  RopeLayout layout = RopeLayout::interleaved;
  AnglePrecision precision = AnglePrecision::float32;
  /// For length-dependent methods (dynamic, longrope): recompute the
  /// frequencies in every forward from the sequence length (HF's
  /// dynamic_rope_update). false freezes `freqs` as given, e.g. at the values
  /// for a whole evaluation window.
  bool update_with_length = true;
};

/// `rope` with its frequencies frozen at those Model::forward computes for a
/// sequence of `seq_len` tokens (max(position_ids)+1 = seq_len): dynamic NTK in
/// HF's forward-path float32 arithmetic (dynamic_rope_update), LongRoPE's short
/// or long factors by seq_len; update_with_length false. A method that does not
/// depend on the length keeps its frequencies. Throws as compute_rope_frequencies.
RopeSetup freeze_rope_for_length(const RopeSetup& rope, int64_t seq_len);

/// What Model::forward does when a length-dependent method (rope_type dynamic,
/// longrope) gives a sequence other frequencies than those its cached keys
/// were rotated with (the length passed the switch point: dynamic NTK's
/// max_position_embeddings, LongRoPE's original_max_position_embeddings).
///  - recompute: the sequence is re-prefilled from its own cached token ids at
///               their cached positions with the new frequencies (every layer's
///               keys and values), then the new tokens run: the cache equals a
///               full forward at the current length, exactly. Cost: one forward
///               over the cached tokens per change (KvCache::stats counts
///               them). Needs every token of the sequence (CacheError after
///               an eviction or for slots appended without token ids).
///  - hf:        Hugging Face transformers' generation: cached keys keep the
///               rotation they were written with, new tokens use the frequencies
///               HF's dynamic_rope_update gives for the current length
///               (dynamic: grow only, reset below the original context;
///               longrope: long past original_max_position_embeddings, the
///               planned length ignored). The sequence is marked mixed
///               (KvCache::rope_mixed; shift() refuses it). Drifts from a full
///               forward; reproduces HF's numerics.
///  - refuse:    CacheError; nothing appended.
///  - rerotate:  every cached key is rotated back and forward with the new
///               frequencies. Exact only for single-layer attention: keys and
///               values of layers >= 1 stay computed from hidden states of the
///               old frequencies (stories260K at original context 128, 172
///               tokens of tinystories_val, chunks of 32: max |dlogit| 0.36
///               under dynamic NTK, 5.2 across a LongRoPE switch, against the
///               full forward at each length; `posenc check-cache` reports it).
enum class RopeChangePolicy { recompute, hf, refuse, rerotate };
/// "recompute", "hf", "refuse", "rerotate".
std::string_view to_string(RopeChangePolicy policy);
/// Parses the names of to_string. Throws ConfigError naming `field` and the
/// accepted names.
RopeChangePolicy parse_rope_change_policy(std::string_view text, std::string_view field);
/// The length past which a length-dependent method changes its frequencies:
/// dynamic: max_position_embeddings; longrope: original_max_position_embeddings
/// (else max_position_embeddings); 0 for a method that does not depend on the length.
int64_t rope_switch_point(const RopeParams& params);

/// The positional encoding of a model (the non-tensor part; tables are weights).
struct PositionalConfig {
  PositionFamily family = PositionFamily::rope;
  RopeSetup rope;                      ///< family == rope or mrope (mrope: frequencies fixed, never length-dependent)
  /// family == mrope: [s_t, s_h, s_w] pairs per position row, summing to
  /// rope.freqs.rotary_dim/2, and how pairs map to rows (chunked: Qwen2-VL,
  /// Qwen2.5-VL; interleaved: Qwen3-VL). See mrope.hpp.
  std::vector<int> mrope_section;
  MropeMapping mrope_mapping = MropeMapping::chunked;
  double alibi_max_bias = 8.0;         ///< family == alibi: slopes = alibi_slopes(n_heads, max_bias)
  int t5_num_buckets = 32;             ///< family == t5_bias: relative_attention_num_buckets
  int t5_max_distance = 128;           ///< family == t5_bias: relative_attention_max_distance
  double sinusoidal_base = 10000.0;    ///< family == sinusoidal (interleaved sin/cos layout)
};

/// The first position a forward fed at or past trained_position_bound(model) (issue 16 finding 4): what
/// Model::set_position_warning's callback receives, once.
struct PositionWarning {
  int64_t position = 0;         ///< the first position id >= bound in the batch that crossed it
  int64_t bound = 0;            ///< trained_position_bound at that forward (positions 0 .. bound-1 are inside)
  int64_t trained_context = 0;  ///< Model::trained_context()
  double factor = 1.0;          ///< the active rope_scaling factor (1 for native RoPE and for other families)
  std::string message;          ///< one line, "the sequence passes the trained context (...) at position P: ..."
};

struct PositionalSpec;

class Model {
 public:
  /// Which loader reads `path`: a directory is a Hugging Face directory; a
  /// file starting with "GGUF" or named *.gguf is GGUF (whose reader refuses a
  /// wrong magic, naming it), with "POSENC01" a posenc checkpoint; anything
  /// else is read as llama2.c. Throws IoError if the path does not exist.
  static ModelFormat detect_format(const std::filesystem::path& path);

  /// Loads a model of any supported format (detect_format). Throws IoError,
  /// CheckpointError naming the file and tensor/field (shape mismatch, missing
  /// tensor, unsupported dtype, a weight that is not finite, a stored tensor
  /// the config/metadata do not use, a JSON or safetensors file given instead
  /// of its directory), ConfigError for a config.json the runtime cannot run
  /// ("architectures: GPT2LMHeadModel is not supported yet", a model_type
  /// that disagrees with architectures). A bundled tokenizer that cannot be
  /// read does not fail the load: source().tokenizer_error says why.
  static Model load(const std::filesystem::path& path, const LoadOptions& options);

  /// The tokenizer a model file brings, without loading its weights: a HF
  /// directory's tokenizer.json, a GGUF's embedded vocabulary (possibly not
  /// usable()), a posenc checkpoint's symbols; nullopt for llama2.c. Throws as load
  /// (CheckpointError for a directory without config.json).
  static std::optional<Tokenizer> load_bundled_tokenizer(const std::filesystem::path& path);

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

  /// load(path, LoadOptions{}): any format (a posenc checkpoint with any
  /// positional family and an optional embedded symbol vocabulary; a
  /// llama2.c checkpoint when the file has no known magic). Throws as the loaders.
  static Model load(const std::filesystem::path& path);

  // Copies share the (immutable) weights and carry their own RopeSetup, so
  // one loaded checkpoint can be evaluated under several encodings at once.
  Model(const Model&);
  Model& operator=(const Model&);
  Model(Model&&) noexcept;
  Model& operator=(Model&&) noexcept;
  ~Model();

  const ModelConfig& config() const;
  const ModelSource& source() const;
  /// The tokenizer the file brings (HF tokenizer.json, GGUF embedded
  /// vocabulary, posenc symbol vocabulary), if any. A GGUF vocabulary that
  /// cannot encode is returned with usable() false.
  const std::optional<Tokenizer>& bundled_tokenizer() const;
  /// The context the model was trained with, used to derive scaling factors
  /// and default lengths: from the format (config.json
  /// original_max_position_embeddings / max_position_embeddings, GGUF
  /// context_length, llama2.c seq_len) unless set_trained_context changed it.
  int64_t trained_context() const { return trained_context_; }
  const std::string& trained_context_source() const { return trained_context_source_; }
  /// Throws InvalidArgument for n <= 0.
  void set_trained_context(int64_t n, std::string source);
  /// How quantized weights are multiplied (LoadOptions).
  QuantizedMatmul quantized_matmul() const;
  /// How F16/BF16 weights are multiplied (LoadOptions).
  DenseMatmul dense_matmul() const;
  /// Whether some matrix (a projection or the classifier) is stored as Q8_0/Q4_0: quantized_matmul() changes
  /// the results only then.
  bool has_block_quantized_matrices() const;
  /// Whether some matrix (a projection or the classifier) is stored as F16/BF16: dense_matmul() changes the
  /// results only then.
  bool has_half_precision_matrices() const;
  const PositionalConfig& positional() const { return positional_; }
  PositionFamily family() const { return positional_.family; }
  /// The RoPE setup (meaningful for family() == rope, and for mrope: its frequencies,
  /// layout and precision; positional().mrope_section/mrope_mapping split the pairs).
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
  /// positional setup), e.g. to convert a llama2.c checkpoint. Throws
  /// InvalidArgument for models the format cannot hold (biases, q/k norm,
  /// n_heads * head_dim != dim).
  PosencCheckpoint to_checkpoint() const;

  /// Every weight as float32 (converted or dequantized), row-major, matrices
  /// [out, in], named as the posenc checkpoint names them (see checkpoint.hpp)
  /// plus, when the model has them, layers.{l}.bq/bk/bv [q or kv width],
  /// .bo [dim], .q_norm/.k_norm [head_dim], .b1/.b3 [hidden_dim], .b2 [dim].
  /// q/k rows are in the order the loader's layout implies (rope().layout as
  /// loaded: half for Hugging Face, interleaved for GGUF/llama2.c); "output"
  /// is absent when the classifier is tied.
  std::vector<struct CheckpointTensor> export_tensors() const;
  /// The RoPE layout the weights are stored for (the loader's, whatever
  /// set_rope changed since).
  RopeLayout stored_layout() const;
  /// The rope_type and factor of the file's own rope_scaling (what set_rope changed since is not here).
  const std::string& stored_rope_type() const;
  const std::optional<double>& stored_rope_factor() const;
  /// With a length-dependent method (rope_type dynamic/longrope), each forward
  /// recomputes the frequencies for the sequence length L = max(position_ids,
  /// cached positions)+1 (LongRoPE: for max(L, KvCache::planned_length(seq)),
  /// so a request planned past the original context uses the long factors in
  /// every chunk) and applies `policy` when they change under cached keys.
  /// Default: recompute.
  void set_rope_change_policy(RopeChangePolicy policy);
  RopeChangePolicy rope_change_policy() const { return policy_; }

  /// Bounds on position ids (issue 16 finding 4). set_max_position(n): forward refuses, with a PositionError
  /// naming the position and n, any position id > n (n is the largest allowed id; -1 = no limit, the default).
  /// Checked with the rest of the input, before the cache is touched. Throws InvalidArgument for n < -1.
  void set_max_position(int64_t n);
  int64_t max_position() const { return max_position_; }
  /// Called once (for this model and the copies made after the call, which share the "already warned" state)
  /// the first time forward feeds a position id >= trained_position_bound(*this), before the network runs.
  /// An empty function removes the callback. The bound is taken at each forward, so a copy with another
  /// rope_scaling (set_rope) has its own factor.
  void set_position_warning(std::function<void(const PositionWarning&)> on_warning);
  /// The callback set_position_warning installed (empty if none).
  std::function<void(const PositionWarning&)> position_warning() const;

  /// Attention mask: 0 = causal (default); w > 0 = Mistral's sliding window
  /// (a query at position i sees keys j with 0 <= i - j < w). Throws
  /// InvalidArgument for w < 0.
  void set_sliding_window(int64_t window);
  int64_t sliding_window() const { return sliding_window_; }

  /// A KV cache shaped for this model, storing k/v in kv_cache_dtype().
  KvCache make_cache(int block_size = 16, int64_t max_blocks = 0) const;
  /// The same with an explicit element type.
  KvCache make_cache(int block_size, int64_t max_blocks, KvCacheDtype dtype) const;
  /// The element type of the caches make_cache() builds, score_window() included (default f32). With f16/bf16
  /// every key and value the forward appends is rounded once (round to nearest even) and attention reads the
  /// rounded values, also for the tokens of the same step (prefill sees what decode sees).
  void set_kv_cache_dtype(KvCacheDtype dtype) { kv_dtype_ = dtype; }
  KvCacheDtype kv_cache_dtype() const { return kv_dtype_; }

  /// One sequence's share of a batched forward step.
  struct SequenceInput {
    KvCache::SeqId seq = -1;
    std::span<const int32_t> tokens;
    /// [tokens.size()] explicit position ids; empty = continue the sequence:
    /// next_position(seq) + 0, 1, 2, ...
    std::span<const int64_t> position_ids;
    /// family mrope only: [3, tokens.size()] int64 row-major (rows t, h, w), e.g. a
    /// slice of mrope_position_ids(); the rotation uses these rows while the mask
    /// uses the 1-D positions above (sequence order, HF's cache_position). Empty =
    /// all three rows equal the token's 1-D position (explicit, or next_position +
    /// i) plus the sequence's rope delta (KvCache::mrope_delta, 0 for a fresh or
    /// text-only sequence; Qwen2_5_VLModel.forward's cache_position + rope_deltas).
    /// Non-empty for another family is an InvalidArgument.
    std::span<const int64_t> mrope_position_ids = {};
  };
  enum class LogitsMode { all, last };

  /// Runs `batch` (ragged: each sequence has its own length and positions)
  /// through the network, appending every token's rotated key and value to its
  /// sequence in `cache`, and writes logits [rows, vocab_size] float32 into
  /// `logits` (resized): one row per input token in batch order (all), or one
  /// per sequence (last). Uses all OpenMP threads for large steps; a step of
  /// one token whose projections all run a one-row product (float32
  /// products on AVX-512 or AVX2 on rows of a multiple of 16 weights, or
  /// q8_activations on AVX-512 VNNI) keeps one team of threads through the layers (attention
  /// split by KV heads), synchronised by barriers, instead of one per
  /// projection, when its matrices are large enough for threads to pay (the
  /// same bits; detail::set_decode_team).
  /// Throws InvalidArgument for token ids outside [0, vocab_size), a
  /// position_ids span of the wrong size, a sequence listed twice; PositionError
  /// for a position past a learned position table; CacheError per the RoPE
  /// change policy (a bounded pool running out: CacheError). Nothing is
  /// appended to the cache when it throws: the slots a failing step appended
  /// are taken back (KvCache::rollback_appends); a sequence's RoPE state
  /// changed by the policy before the failure stays changed, its keys rotated
  /// to match. std::bad_alloc reaches the caller from any thread: the decode
  /// team and the kernels' own parallel regions (products, attention, RoPE)
  /// keep the first exception of their threads and rethrow it after the
  /// region. Not an exception: an allocation failing inside the C or
  /// OpenMP runtime itself (libgomp ends the process when it cannot create a
  /// team; a thread's first use of a thread_local may abort in glibc).
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

  /// score_window a chunk of at most `chunk_tokens` tokens at a time, so that
  /// only one chunk's logits are held: for each chunk, in order,
  /// on_chunk(first, logits, rows) with logits [rows, vocab_size] float32 of
  /// window positions first .. first + rows - 1 (valid during the call). One
  /// fresh sequence, the chunks prefilled into its cache one after another: the
  /// same bits as score_window's rows (the forward is chunk-invariant; a
  /// length-dependent RoPE, rope_type dynamic or longrope with
  /// update_with_length, is frozen at the frequencies forward computes for a
  /// fresh sequence of tokens.size() tokens under rope_change_policy()).
  /// Throws InvalidArgument for chunk_tokens < 1, PositionError for a window
  /// past max_position() (before any chunk, naming its last position, as one
  /// forward does), what forward throws, and what on_chunk throws; each chunk
  /// is otherwise validated by its own forward, so on_chunk may have run for
  /// the chunks before one that throws (a token id out of range, a position
  /// past a learned position table).
  void score_window(std::span<const int32_t> tokens, int64_t chunk_tokens,
                    const std::function<void(int64_t first, const float* logits, int64_t rows)>& on_chunk) const;

 private:
  struct Weights;
  explicit Model(std::shared_ptr<const Weights> weights);
  static Model build(detail::RawModel raw, const LoadOptions& options);
  std::shared_ptr<const Weights> w_;
  PositionalConfig positional_;
  int64_t trained_context_ = 0;
  std::string trained_context_source_;
  RopeChangePolicy policy_ = RopeChangePolicy::recompute;
  void recompute_sequence(KvCache& cache, KvCache::SeqId seq, const KvCache::RopeState& state) const;
  int64_t sliding_window_ = 0;
  KvCacheDtype kv_dtype_ = KvCacheDtype::f32;
  struct PositionWatch;
  int64_t max_position_ = -1;
  std::shared_ptr<PositionWatch> position_watch_;
};

/// What a loaded model says about positions, as the PositionalSpec a config.json
/// parse gives (posenc inspect --model): family; heads, hidden size, layers;
/// max_position_embeddings = trained_context(); for RoPE/MRoPE the current
/// rope().params (the file's, unless set_rope changed them), the stored layout
/// (stored_layout(): interleaved for GGUF and llama2.c, half for Hugging Face)
/// and MRoPE's sections; ALiBi's max_bias (BLOOM slopes), T5's buckets and max
/// distance (decoder-only: causal buckets); sinusoidal's interleaved sin/cos;
/// sliding_window() when set. `source` is the file, `architecture` the
/// loader's (source().architecture); notes carry the loader's layout reason,
/// trained-context source and notes. A Hugging Face directory's own config.json
/// says more (ignored keys, model_type rules): inspect reads that one.
PositionalSpec positional_spec(const Model& model);

/// The positions a model is trained for in its current setup: trained_context() x the factor of the active
/// rope_scaling (RopeParams::factor of rope().params; 1 when absent, for native RoPE and for non-RoPE
/// families), rounded up; positions 0 .. bound-1 are inside. When the active scaling is the file's own
/// (same rope_type and factor), at least the file's max_position_embeddings (Llama-3.1: 8192 x 8 = 65536,
/// declared 131072). Saturates at INT64_MAX.
int64_t trained_position_bound(const Model& model);
/// The factor trained_position_bound multiplies by (1 when there is none).
double trained_position_factor(const Model& model);

namespace detail {
/// TEST-ONLY hook: injects one of the classic position bugs into the runtime
/// so tests can prove the consistency checker catches them. restart_each_chunk:
/// a continuing forward numbers its tokens from 0 instead of next_position;
/// count_padding: forward_padded numbers tokens by their column, padding
/// included. Never set outside tests.
enum class PositionBug { none, restart_each_chunk, count_padding };
void set_position_bug_for_testing(PositionBug bug);
PositionBug position_bug_for_testing();
/// When forward runs a one-token step as one team of threads through its layers (a parallel region per
/// projection otherwise, attention between them; the same bits either way). automatic (the default): when every projection can run in a team and
/// Q, O and the FFN's matrices are each large enough that matmul_w would open a parallel region for it
/// (detail::parallel_pays; smaller models decode their projections on one thread, which a team's barriers would
/// slow down). always: whenever every projection can run in a team, whatever its size (tests). off. Neither
/// teams a step whose attention would widen an f16/bf16 cache into a float32 copy per thread (more than 8 query
/// heads per KV head).
enum class DecodeTeam { automatic, always, off };
void set_decode_team(DecodeTeam mode);
DecodeTeam decode_team();
/// How many one-token steps this process has run as a team (tests check that the path they compare ran).
int64_t decode_team_steps();
/// Makes team thread `thread` throw std::bad_alloc at its `segment`-th piece of work of every team step (0: layer
/// 0's Q, K, V; then each piece between two barriers, in order); -1 stops it. Tests only: an exception inside the
/// team reaches forward's caller (rethrown after the region) instead of ending the process or hanging the others.
void set_decode_team_fault_for_testing(int segment, int thread);
}  // namespace detail

}  // namespace posenc
