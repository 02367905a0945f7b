// posenc — RoPE frequency scalings, keyed by Hugging Face's `rope_type`.
//
// Every method turns a typed RopeParams into one RopeFrequencies value
// (inv_freq per channel pair + attention_factor). Kernels never see config
// dictionaries. Numerics follow Hugging Face transformers,
// src/transformers/modeling_rope_utils.py (ROPE_INIT_FUNCTIONS and the
// `dynamic_rope_update` decorator), in float32, operation by operation, and are
// checked against ../shared/testdata/hf_reference/rope_init.json and
// rope_forward.json (transformers commit c49429ed, v5.16.0.dev0).
//
// Registered methods (rope_type -> reference function):
//   default       LlamaRotaryEmbedding.compute_default_rope_parameters
//   linear        _compute_linear_scaling_rope_parameters
//   ntk           static NTK-aware base change (no HF type; YaRN paper eq. 16)
//   dynamic       _compute_dynamic_ntk_parameters            (depends on seq_len)
//   yarn          _compute_yarn_parameters
//   longrope      _compute_longrope_parameters               (depends on seq_len)
//   llama3        _compute_llama3_parameters
//   proportional  _compute_proportional_rope_parameters      (Gemma-4 style)
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "posenc/rope.hpp"

namespace posenc {

/// Typed RoPE parameters, as read from a config.json (`rope_scaling` /
/// `rope_parameters`) or from CLI flags. Optional fields are std::nullopt when
/// absent; each method documents which it requires. Field names are Hugging
/// Face's. Error messages name fields as "rope_scaling.<field>".
///
/// Rotated width: `rotary_dim` if non-zero, else int(head_dim *
/// partial_rotary_factor) if that is set (HF truncates), else head_dim.
/// Model quirk the importer must resolve: Llama-family *default* RoPE ignores
/// partial_rotary_factor (LlamaRotaryEmbedding.compute_default_rope_parameters),
/// GPT-NeoX's default and every scaled type apply it; so do not set it for a
/// Llama default config. `proportional` always spans head_dim and uses
/// partial_rotary_factor for the share of non-zero frequencies instead.
struct RopeParams {
  std::string rope_type = "default";  ///< registry key (HF `rope_type`, legacy `type`)
  double rope_theta = 10000.0;        ///< base of the frequencies
  int head_dim = 0;                   ///< channels per attention head
  int rotary_dim = 0;                 ///< rotated channels (even); 0: see above
  std::optional<double> partial_rotary_factor;  ///< share of head_dim rotated, in (0, 1]
  std::optional<double> factor;       ///< scaling factor s (linear, ntk, dynamic, yarn, longrope, llama3, proportional)
  std::optional<int64_t> original_max_position_embeddings;  ///< trained context (yarn, longrope, llama3)
  std::optional<int64_t> max_position_embeddings;           ///< config.max_position_embeddings
  // yarn (attention_factor also longrope)
  std::optional<double> attention_factor;
  std::optional<double> beta_fast;
  std::optional<double> beta_slow;
  std::optional<double> mscale;
  std::optional<double> mscale_all_dim;
  std::optional<bool> truncate;
  // longrope (each of length rotary_dim/2 when present)
  std::vector<double> short_factor;
  std::vector<double> long_factor;
  // llama3
  std::optional<double> low_freq_factor;
  std::optional<double> high_freq_factor;

  /// The rotated width per the rule above (no validation; see
  /// compute_rope_frequencies for the checks).
  int effective_rotary_dim() const {
    if (rotary_dim != 0) return rotary_dim;
    if (partial_rotary_factor) return static_cast<int>(head_dim * *partial_rotary_factor);
    return head_dim;
  }
  bool operator==(const RopeParams&) const = default;
};

/// One entry of the registry.
struct RopeScaling {
  std::string_view name;     ///< the rope_type string checkpoints carry
  std::string_view summary;  ///< one line for --help and `posenc inspect`
  /// True when the result depends on the current sequence length (dynamic,
  /// longrope): callers must recompute (and a KV cache re-rotate or refuse)
  /// when the length changes. See RopeFrequencySchedule.
  bool depends_on_seq_len;
  /// Computes the frequencies. seq_len: the current sequence length, when the
  /// method uses it. Throws ConfigError naming the field for missing or
  /// out-of-range parameters.
  RopeFrequencies (*compute)(const RopeParams& params, std::optional<int64_t> seq_len);
  /// The same formula evaluated in double (the fp64 reference): fills
  /// inv_freq_f64 (and inv_freq with its float cast). Same errors as compute.
  RopeFrequencies (*compute_f64)(const RopeParams& params, std::optional<int64_t> seq_len);
};

/// All registered methods, in a stable order.
std::span<const RopeScaling> rope_scalings();

/// The method for `rope_type`. Throws ConfigError("rope_type: unknown ... (got X);
/// known: ...") for an unknown name.
const RopeScaling& find_rope_scaling(std::string_view rope_type);

/// Looks up params.rope_type and computes its frequencies, as HF's
/// ROPE_INIT_FUNCTIONS[rope_type](config, device, seq_len) with seq_len a
/// Python int (or absent). Validates head_dim, rope_theta,
/// partial_rotary_factor and seq_len first; each method then validates its
/// own fields. Throws ConfigError "<field>: <reason> (got <value>)".
/// Result: inv_freq [rotary_dim/2] float32 (radians per position), HF's
/// float32 arithmetic; inv_freq_f64 [rotary_dim/2] double, the same method's
/// formula evaluated in double (the true values: the fp64 reference that
/// AnglePrecision::fp64 and `posenc precision` measure against);
/// attention_factor (double; multiplies cos and sin).
RopeFrequencies compute_rope_frequencies(const RopeParams& params,
                                         std::optional<int64_t> seq_len = std::nullopt);

/// How the dynamic-NTK base' is evaluated.
///  - python_double: HF's direct call with a Python int seq_len: base' in
///    double, then cast to float32 for the power (rope_init.json).
///  - tensor_float32: HF's forward path (dynamic_rope_update), where seq_len =
///    max(position_ids)+1 is an integer tensor, so factor*L/max_pos - (factor-1)
///    and base' are float32 (rope_forward.json). Differs in the last ulp of
///    some entries.
enum class DynamicNtkArithmetic { python_double, tensor_float32 };

/// Dynamic NTK (bloc97/emozilla, 2023; HF _compute_dynamic_ntk_parameters):
///   L = max(seq_len, max_position_embeddings) (seq_len absent: max_position_embeddings)
///   base' = rope_theta * (factor*L/max_position_embeddings - (factor-1))^(d/(d-2))
///   inv_freq[i] = 1 / base'^(2i/d),  d = rotary dim, attention_factor = 1.
/// Requires factor and max_position_embeddings (ConfigError otherwise).
/// inv_freq_f64 is the formula in double (python_double's base' in double, its
/// power in double) for either arithmetic.
RopeFrequencies dynamic_ntk_frequencies(const RopeParams& params, std::optional<int64_t> seq_len,
                                        DynamicNtkArithmetic arithmetic);

/// YaRN's magnitude rule g(s, m) = 0.1*m*ln(s) + 1, and 1 for s <= 1
/// (Peng et al. 2023, eq. 22 generalised by DeepSeek's mscale; HF get_mscale /
/// yarn_get_mscale). Evaluated in double in HF's operation order.
double yarn_get_mscale(double scale, double mscale = 1.0);

/// DeepSeek-V2/V3 softmax scale with YaRN: qk_head_dim^-0.5, multiplied by
/// g(factor, mscale_all_dim)^2 when rope_type is not "default" and
/// mscale_all_dim is set and non-zero (HF DeepseekV3Attention.__init__).
/// qk_head_dim = qk_nope_head_dim + qk_rope_head_dim (192 for DeepSeek-V3).
/// Throws ConfigError if qk_head_dim <= 0 or a needed factor is missing/invalid.
double deepseek_yarn_softmax_scale(int qk_head_dim, const RopeParams& params);

/// The frequency update HF runs inside the rotary module's forward
/// (modeling_rope_utils.dynamic_rope_update), as a small state machine. One
/// instance per rotary module (i.e. per model, or per layer type).
///
/// At construction: frequencies = compute_rope_frequencies(params) (seq_len
/// absent), max_seq_len_cached = original_max_seq_len = max_position_embeddings.
/// On each forward call with position ids P (all batch rows), L = max(P)+1:
///  - dynamic:  if L > max_seq_len_cached: recompute with seq_len L in
///              tensor_float32 arithmetic, max_seq_len_cached = L. Then, if
///              L < original_max_seq_len and the cached length *before this
///              call* exceeded original_max_seq_len: back to the construction
///              frequencies, max_seq_len_cached = original_max_seq_len.
///  - longrope: L > original_max_position_embeddings selects the long
///              factors (computed once, with seq_len = original+1), otherwise
///              the construction (short) frequencies; attention_factor keeps
///              its construction value.
///  - any other type: nothing changes.
/// generation() counts the changes of the frequencies, so a KV cache can tell
/// that keys rotated earlier used other frequencies (re-rotate or refuse).
class RopeFrequencySchedule {
 public:
  /// Throws ConfigError as compute_rope_frequencies; for dynamic also if
  /// max_position_embeddings is missing, for longrope if neither
  /// original_max_position_embeddings nor max_position_embeddings is set.
  explicit RopeFrequencySchedule(RopeParams params);

  /// Runs the update for a forward call with these position ids (any shape,
  /// flattened; must be non-empty, non-negative: PositionError otherwise) and
  /// returns the frequencies in effect for the call.
  const RopeFrequencies& update(std::span<const int64_t> position_ids);
  /// Same, given max(position_ids) + 1 directly.
  const RopeFrequencies& update_for_length(int64_t seq_len);

  const RopeFrequencies& current() const { return current_; }
  const RopeFrequencies& original() const { return original_; }
  const RopeParams& params() const { return params_; }
  /// HF's max_seq_len_cached (dynamic); max_position_embeddings otherwise.
  int64_t max_seq_len_cached() const { return max_seq_len_cached_; }
  /// Incremented whenever current() changes.
  uint64_t generation() const { return generation_; }
  bool depends_on_seq_len() const { return dynamic_ || longrope_; }

 private:
  void set_current(const RopeFrequencies& f);

  RopeParams params_;
  RopeFrequencies original_;
  RopeFrequencies current_;
  std::optional<RopeFrequencies> long_;  // longrope, computed on first use
  int64_t original_max_seq_len_ = 0;
  int64_t max_seq_len_cached_ = 0;
  int64_t longrope_original_max_ = 0;
  uint64_t generation_ = 0;
  bool dynamic_ = false;
  bool longrope_ = false;
};

}  // namespace posenc
