// posenc — model config.json → PositionalSpec.
//
// Reads a Hugging Face `config.json` (or the JSON text of one) and says how
// that model encodes positions: which family (NoPE, learned absolute,
// sinusoidal, T5 bias, ALiBi, RoPE, MRoPE) and every parameter of it, as typed
// values (RopeParams for RoPE, AlibiSpec, T5BiasSpec, ...). This module is the
// only place in posenc that reads config dictionaries; everything downstream
// takes the spec.
//
// What is read, and where the rules come from (Hugging Face transformers
// configuration_*.py / modeling_*.py of each architecture):
//  - RoPE parameters from `rope_scaling` or the newer `rope_parameters`, with
//    `rope_type` or the legacy `type`; `rope_theta` (top level, or inside
//    `rope_parameters`; GPT-NeoX's `rotary_emb_base`); absent → 10000, the
//    default of every HF RoPE config class.
//  - head_dim: explicit `head_dim` (Qwen3, Gemma) when present and not null,
//    otherwise hidden_size / num_attention_heads. DeepSeek-V2/V3 (MLA): the
//    rotary part only, `qk_rope_head_dim`; qk_head_dim records the full q·k
//    width (qk_nope_head_dim + qk_rope_head_dim).
//  - rotary_dim: `rotary_dim` (GPT-J, CodeGen), else int(head_dim ×
//    `partial_rotary_factor`) or int(head_dim × `rotary_pct`) (GPT-NeoX), else
//    head_dim. Exception, as HF: model_type llama with default RoPE ignores
//    partial_rotary_factor (LlamaRotaryEmbedding.compute_default_rope_parameters).
//  - original_max_position_embeddings: from the scaling dict, else from the
//    top level (Phi-3 keeps it there; HF copies it into the dict).
//  - `type: mrope` (Qwen2-VL, Qwen2.5-VL) is HF's alias for default RoPE with
//    three position rows: family mrope, rope.rope_type "default",
//    mrope_section from the dict (its sum must equal rotary_dim/2).
//  - ALiBi: BLOOM (always), Falcon with `alibi: true` (BLOOM convention,
//    max_bias 8), MPT with `attn_config.alibi` (MPT convention,
//    `attn_config.alibi_bias_max`, default 8). MPT's `learned_pos_emb` is
//    ignored when ALiBi is on (its model builds no position table then).
//  - T5 (t5, mt5, umt5, switch_transformers): relative_attention_num_buckets
//    (default 32), relative_attention_max_distance (default 128); encoder
//    self-attention is bidirectional, decoder self-attention causal.
//  - Learned absolute: GPT-2 (`n_positions`), BERT/RoBERTa/... (`max_position_
//    embeddings`, `position_embedding_type` must be "absolute"), OPT/BART
//    (position ids offset by 2), MPT without ALiBi (`max_seq_len`).
//  - Sinusoidal: Marian/Pegasus (halves), FSMT/M2M100/Speech2Text
//    (tensor2tensor), XLM/DistilBERT when their sinusoidal flag is set
//    (interleaved).
//  - Sliding window: see SlidingWindowSpec.
//  - Nested `text_config` (mllama, Gemma-3, Llama-4, Qwen2.5-VL re-saved by
//    transformers >= 4.53): every key of text_config that the top level lacks
//    (absent or null) is read as if it were at the top level; a note names the
//    keys so read. A key present in both keeps the top-level value (a note says
//    when the two differ). Messages name such a key "text_config.<key>".
//  - GLM (HF Glm/Glm4: partial_rotary_factor default 0.5, pairs (2i, 2i+1) on the
//    first rotary_dim channels, modeling_glm.apply_rotary_pos_emb) and ChatGLM2/3 /
//    GLM-4 remote code (model_type chatglm: RotaryEmbedding(kv_channels // 2) with
//    base 10000 * rope_ratio, apply_rotary_pos_emb on x[..., :rot_dim] reshaped to
//    pairs): interleaved layout, rotary_dim = head_dim / 2 (64 of 128).
//  - Aliases as Hugging Face's config classes accept them: `su` (and `yarn`) →
//    longrope for Phi-3 / Phi-4-multimodal (Phi3Config.convert_rope_params_to_dict),
//    `type: mrope` → default RoPE with mrope_section for the Qwen2-VL family
//    (Qwen2VLConfig); on any other known architecture they are ConfigErrors.
//  - Positional keys the architecture does not read (rope_scaling on BLOOM or
//    GPT-2, BLOOM's offset_alibi, sliding_window on Llama, ...) are listed in
//    PositionalSpec::ignored_keys with a note saying why; they are not errors
//    (the HF config classes accept and ignore them).
// No config field says "NoPE"; PositionFamily::nope exists for callers that
// build a spec by hand (CLI overrides); the parser never infers it.
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "posenc/attention.hpp"
#include "posenc/rope.hpp"
#include "posenc/scaling.hpp"

#include "posenc/absolute.hpp"
#include "posenc/family.hpp"

namespace posenc {


/// Which reference an ALiBi model follows. Both give the same slopes for the
/// same (n_heads, max_bias): MPT's ordering of 2^-(k·b/P), P = the power of two
/// >= n, taking k = 2,4,... then 1,3,..., reproduces BLOOM's rule (p = the
/// power of two <= n, 2^(-b/p)^k then odd powers of 2^(-b/(2p))). They differ
/// in where the bias is anchored and in float32 rounding:
///  - bloom: bias = slope * key_index (HF build_alibi_tensor, BLOOM/Falcon;
///           max_bias fixed at 8; Falcon rounds slopes to bfloat16).
///  - mpt:   bias = slope * (j - (L-1)) (HF build_mpt_alibi_tensor;
///           max_bias = attn_config.alibi_bias_max).
/// The two biases differ by a per-row constant, which softmax ignores.
enum class AlibiConvention { bloom, mpt };
std::string_view to_string(AlibiConvention convention);

struct AlibiSpec {
  AlibiConvention convention = AlibiConvention::bloom;
  double max_bias = 8.0;  ///< MPT's attn_config.alibi_bias_max; 8 for BLOOM/Falcon
  /// Falcon (`alibi: true`): HF modeling_falcon.build_alibi_tensor casts the
  /// slopes to bfloat16 before multiplying (falcon_alibi_slopes); BLOOM keeps float32.
  bool bfloat16_slopes = false;
  bool operator==(const AlibiSpec&) const = default;
};

struct T5BiasSpec {
  int relative_attention_num_buckets = 32;
  int relative_attention_max_distance = 128;
  bool encoder_bidirectional = true;   ///< encoder self-attention: bidirectional buckets
  bool decoder_bidirectional = false;  ///< decoder self-attention: causal buckets
  bool is_encoder_decoder = true;
  bool operator==(const T5BiasSpec&) const = default;
};

/// Sliding-window attention as the config implies it.
///  - size: the config's `sliding_window` (nullopt when absent or null).
///  - active: whether any layer uses it. False when size is absent, or when
///    `use_sliding_window` is false (Qwen2/Qwen2.5/Qwen3 carry a size but
///    disable it).
///  - layer_is_sliding: [num_hidden_layers], true where the layer uses the
///    window. From `layer_types` when present; Gemma-2 alternates (even layers
///    sliding, HF Gemma2Config: sliding when (i+1) % 2 != 0); Gemma-3 every
///    layer except each `sliding_window_pattern`-th (default 6); Qwen2 with
///    use_sliding_window: layers >= max_window_layers; otherwise all layers.
///    Empty when num_hidden_layers is unknown (then "active" means all layers).
///  - source: one line saying which rule produced the pattern.
struct SlidingWindowSpec {
  std::optional<int64_t> size;
  bool active = false;
  std::vector<bool> layer_is_sliding;
  std::string source;

  /// MaskKind::sliding_window for a sliding layer, else MaskKind::causal.
  /// Throws InvalidArgument for a layer outside [0, layer_is_sliding.size())
  /// when the pattern is known.
  MaskKind layer_mask(int layer) const;
  bool operator==(const SlidingWindowSpec&) const = default;
};

/// Everything a config says about positions. Fields that do not apply to the
/// family are left empty (std::nullopt / 0).
struct PositionalSpec {
  PositionFamily family = PositionFamily::nope;
  std::string model_type;    ///< config `model_type` ("" when absent)
  std::string architecture;  ///< first entry of `architectures` ("" when absent)
  std::string source;        ///< file path or caller label, for messages

  int num_attention_heads = 0;
  int num_key_value_heads = 0;  ///< = num_attention_heads when the config has none (MHA)
  int hidden_size = 0;          ///< d_model / n_embd
  int num_hidden_layers = 0;    ///< 0 when absent
  /// Longest trained/target context (`max_position_embeddings`, `n_positions`,
  /// `max_seq_len`, or the architecture default, e.g. Falcon 2048).
  std::optional<int64_t> max_position_embeddings;

  // ---- rope / mrope
  /// Typed RoPE parameters (rope_type, rope_theta, head_dim, rotary_dim and
  /// every scaling parameter), ready for compute_rope_frequencies().
  std::optional<RopeParams> rope;
  /// Channel pairing of the checkpoint's q/k weights as Hugging Face stores
  /// them. nullopt when the architecture does not imply one (unknown
  /// model_type with RoPE fields): posenc never guesses a layout.
  std::optional<RopeLayout> layout;
  /// DeepSeek-V2/V3 (`rope_interleave`, default true): HF's
  /// apply_rotary_pos_emb_interleave reads interleaved pairs (layout =
  /// interleaved) and writes the rotated result in half order. q and k are
  /// permuted alike, so q·k equals that of the interleaved rotation; only the
  /// order of the rotated channels in the output differs.
  bool rope_output_half_order = false;
  /// Width of the q·k product when it differs from rope->head_dim (MLA:
  /// qk_nope_head_dim + qk_rope_head_dim = 192 for DeepSeek-V3).
  std::optional<int> qk_head_dim;
  std::vector<int> mrope_section;  ///< [t, h, w] frequencies per half (mrope only)
  /// mrope only: channel pairs cycle t, h, w (Qwen3-VL, HF apply_interleaved_mrope)
  /// instead of the chunked [t..., h..., w...] split (Qwen2-VL). From rope_scaling
  /// `mrope_interleaved`; always true for model_type qwen3_vl / qwen3_vl_text.
  bool mrope_interleaved = false;
  /// Logit scale when the RoPE scaling changes it from 1/sqrt(qk_head_dim).
  /// DeepSeek-V2/V3 (HF DeepseekV3Attention): with a non-default rope_type and a
  /// truthy mscale_all_dim, qk_head_dim^-0.5 · g(factor, mscale_all_dim)^2,
  /// g(s, m) = 0.1·m·ln(s) + 1 (1 when s <= 1). Applied to q·k, unlike
  /// attention_factor, which multiplies cos/sin.
  std::optional<double> softmax_scale;

  // ---- biases
  std::optional<AlibiSpec> alibi;
  std::optional<T5BiasSpec> t5;

  // ---- absolute
  std::optional<SinusoidalLayout> sinusoidal_layout;
  int position_offset = 0;  ///< learned tables read row position + offset (OPT/BART/RoBERTa: 2)

  SlidingWindowSpec sliding_window;

  /// Keys that do not shape this spec, as field paths ("rope_scaling",
  /// "text_config.rope_theta", "rope_scaling.finetuned"): keys inside
  /// rope_scaling/rope_parameters ignored in lenient mode, and positional keys the
  /// architecture ignores (each with a note "<key> ignored: <why>").
  std::vector<std::string> ignored_keys;
  /// Human-readable provenance of inferred values ("layout half: model_type
  /// llama uses rotate_half", "rope_theta absent: default 10000", ...).
  std::vector<std::string> notes;
};

/// "half", "interleaved", "interleaved_in_half_out" (DeepSeek) or "unknown".
std::string layout_name(const PositionalSpec& spec);

/// Bounds on the sizes a config.json may give, checked before anything is
/// allocated from them (a 90-byte config with head_dim 1e9 drove 13.5 GB of
/// allocation; 1e9 layers with a sliding_window 16.9 GB). Each is far above
/// every published model (head_dim <= 512, hidden_size <= 25600, <= 200 layers,
/// <= 256 heads, vocabularies <= 262144, contexts <= 10^7) and low enough that
/// the per-channel, per-head and per-layer tables posenc builds stay small. A
/// value outside its bound is a ConfigError "<file>: <field>: must be an
/// integer in [lo, hi] (got v)". Products of sizes are formed in checked int64
/// arithmetic (posenc/checked.hpp).
namespace config_limits {
inline constexpr int64_t kMaxHeadDim = int64_t{1} << 14;           ///< head_dim, qk_*_head_dim, rotary_dim, mrope_section[i]
inline constexpr int64_t kMaxHeads = int64_t{1} << 14;             ///< num_attention_heads, num_key_value_heads
inline constexpr int64_t kMaxHiddenSize = int64_t{1} << 20;        ///< hidden_size / d_model / n_embd
inline constexpr int64_t kMaxIntermediateSize = int64_t{1} << 22;  ///< intermediate_size
inline constexpr int64_t kMaxLayers = int64_t{1} << 14;            ///< num_hidden_layers, max_window_layers, sliding_window_pattern
inline constexpr int64_t kMaxVocab = int64_t{1} << 24;             ///< vocab_size; pad_token_id < kMaxVocab
inline constexpr int64_t kMaxPositions = int64_t{1} << 32;         ///< max_position_embeddings, original_max_position_embeddings, sliding_window
inline constexpr double kMinRopeFactor = 1e-6;                       ///< rope_scaling.factor (as --rope-factor): below,
                                                                     ///< the scaled inv_freq overflow float32
inline constexpr double kMaxRopeFactor = 1e6;                        ///< rope_scaling.factor (as --rope-factor)
inline constexpr int64_t kMaxT5Buckets = int64_t{1} << 16;         ///< relative_attention_num_buckets
inline constexpr int64_t kMaxT5Distance = int64_t{1} << 24;        ///< relative_attention_max_distance
}  // namespace config_limits

struct ConfigOptions {
  /// false (default): a key inside `rope_scaling` / `rope_parameters` that is
  /// not a parameter of its rope_type is an error. true: it is ignored and
  /// listed in PositionalSpec::ignored_keys. Nothing else is relaxed.
  bool lenient = false;
};

/// Parses the JSON text of a config.json. `source` names it in messages
/// (a file name). Throws ConfigError, always naming the JSON field path and
/// the bad value:
///  - malformed JSON: "<source>: malformed JSON at byte N: ..." ;
///  - unknown rope_type: lists the registry's names (rope_scalings());
///  - a required field missing (num_attention_heads, hidden_size without
///    head_dim, llama3's low_freq_factor, longrope's short_factor, ...);
///  - a non-numeric / non-integer / non-finite value where a number is needed;
///  - factor <= 0, rope_theta <= 0, long_factor/short_factor whose length is
///    not rotary_dim/2, mrope_section not summing to rotary_dim/2,
///    high_freq_factor <= low_freq_factor, head_dim/rotary_dim inconsistent;
///  - an unknown key inside the scaling dict (unless options.lenient);
///  - an unknown architecture with no positional field at all.
PositionalSpec parse_positional_spec(std::string_view json_text, std::string_view source = "<config>",
                                     const ConfigOptions& options = {});

/// Reads and parses a config.json file. Throws IoError if it cannot be read,
/// ConfigError as parse_positional_spec (messages start with the path).
PositionalSpec load_positional_spec(const std::filesystem::path& path,
                                    const ConfigOptions& options = {});

/// The decoder a config.json describes, as far as posenc's runtime needs it.
/// The runtime runs the Llama family (Hugging Face class names):
///  - LlamaForCausalLM   (attention_bias: q/k/v/o biases; mlp_bias)
///  - MistralForCausalLM (sliding_window)
///  - Qwen2ForCausalLM   (q/k/v biases always; sliding window per use_sliding_window)
///  - Qwen3ForCausalLM   (q_norm/k_norm: RMSNorm over head_dim; attention_bias)
/// Defaults are those of the transformers config classes (rms_norm_eps 1e-6,
/// tie_word_embeddings false, hidden_act silu, head_dim hidden_size /
/// num_attention_heads).
struct DecoderSpec {
  PositionalSpec positional;   ///< positions (rope params, layout, sliding window)
  std::string architecture;    ///< architectures[0] (or model_type when absent)
  int hidden_size = 0;
  int intermediate_size = 0;
  int num_hidden_layers = 0;
  int num_attention_heads = 0;
  int num_key_value_heads = 0;
  int head_dim = 0;
  int vocab_size = 0;
  double rms_norm_eps = 1e-6;
  bool tie_word_embeddings = false;
  bool qkv_bias = false;
  bool o_bias = false;
  bool mlp_bias = false;
  bool qk_norm = false;
  std::string torch_dtype;     ///< "" when absent
};

/// The architectures parse_decoder_spec accepts, for messages.
std::string_view supported_decoder_architectures();

/// Parses a config.json for the runtime. Throws ConfigError naming the field:
/// an architecture the runtime does not run ("architectures: GPT2LMHeadModel
/// is not supported yet (the runtime runs ...)"), a missing
/// hidden_size/intermediate_size/num_hidden_layers/num_attention_heads/
/// vocab_size, hidden_act other than silu, a positional family other than
/// RoPE, and everything parse_positional_spec refuses.
DecoderSpec parse_decoder_spec(std::string_view json_text, std::string_view source = "<config>");

}  // namespace posenc
