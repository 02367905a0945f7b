// Internal: what each known architecture implies about positions, keyed by
// Hugging Face `model_type` (with an `architectures` class-name prefix as a
// fallback). The rules come from each model's configuration_*.py and
// modeling_*.py in huggingface/transformers.
#pragma once

#include <optional>
#include <string_view>

#include "posenc/config.hpp"

namespace posenc::detail {

/// What the parser does with an architecture. Conditional cases (Falcon's
/// `alibi`, MPT's `attn_config.alibi`, BERT's `position_embedding_type`,
/// XLM/DistilBERT's sinusoidal flags) are resolved in config.cpp.
enum class ArchKind {
  rope,             ///< RoPE; layout from the row
  rope_deepseek,    ///< RoPE on qk_rope_head_dim, interleaved in / half out
  chatglm,          ///< ChatGLM2/3, GLM-4 remote code: kv_channels / 2 rotary, base 10000 * rope_ratio
  mrope,            ///< Qwen2-VL family: default RoPE with three position rows
  falcon,           ///< RoPE (half) or, with `alibi: true`, ALiBi (BLOOM convention)
  alibi_bloom,      ///< BLOOM
  mpt,              ///< ALiBi (MPT convention) or learned, from attn_config.alibi
  t5,               ///< T5 relative buckets
  learned,          ///< learned absolute table
  bert_like,        ///< learned unless position_embedding_type says otherwise
  sinusoidal,       ///< fixed sinusoidal table; layout from the row
  maybe_sinusoidal  ///< learned unless a sinusoidal flag is set (XLM, DistilBERT)
};

/// Which rule gives the per-layer sliding-window pattern.
enum class SlidingRule {
  none,              ///< the architecture has no sliding window
  all_layers,        ///< every layer when `sliding_window` is set (Mistral, Phi-3)
  qwen,              ///< gated by use_sliding_window; layers >= max_window_layers
  gemma2_alternate,  ///< even layers sliding, odd layers global
  gemma3_pattern     ///< all but every sliding_window_pattern-th layer (default 6)
};

struct ArchTraits {
  std::string_view model_type;
  std::string_view arch_prefix;  ///< prefix of the `architectures` class name
  ArchKind kind;
  std::optional<RopeLayout> layout;  ///< for rope kinds
  std::string_view layout_reason;    ///< why that layout (HF function)
  SlidingRule sliding;
  int position_offset;  ///< learned tables: row = position + offset
  std::optional<SinusoidalLayout> sinusoidal;
  /// partial_rotary_factor when the config has none (HF GlmConfig: 0.5).
  double default_partial_rotary_factor = 1.0;
};

/// The row for `model_type`, else the row whose arch_prefix is the longest
/// prefix of `architecture`, else nullptr.
const ArchTraits* find_architecture(std::string_view model_type, std::string_view architecture);

}  // namespace posenc::detail
