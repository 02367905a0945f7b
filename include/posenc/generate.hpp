// posenc — text generation with the KV cache (greedy by default).
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "posenc/model.hpp"
#include "posenc/tokenizer.hpp"

namespace posenc {

struct GenerateOptions {
  int max_new_tokens = 256;  ///< tokens generated after the prompt
  float temperature = 0.0f;  ///< 0 = greedy (argmax, lowest id on ties, as run.c)
  float top_p = 1.0f;        ///< nucleus sampling when temperature > 0 and top_p < 1
  uint64_t seed = 0;         ///< sampling RNG seed
  bool stop_at_bos = true;   ///< stop when the model emits the tokenizer's BOS, as run.c does (id 1)
  bool stop_at_eos = true;   ///< stop when the model emits the tokenizer's EOS (end-of-text)
  int block_size = 16;       ///< KV cache block size
  /// RoPE scaling (RoPE models): a name rope_setup_for_context accepts
  /// ("native" = the model's own parameters, as loaded or as --config set
  /// them; "default", "linear", "ntk", "dynamic", "yarn", ...), applied as
  /// `posenc ppl` applies it to a window of prompt + max_new_tokens tokens.
  std::string rope_scaling = "native";
  std::optional<double> rope_factor;  ///< s for rope_scaling (default: max(1, context / trained context))
  /// What a length-dependent method (dynamic, longrope) does when its
  /// frequencies change under the cache (see RopeChangePolicy). recompute
  /// keeps every step equal to a full forward at the current length.
  RopeChangePolicy rope_change_policy = RopeChangePolicy::recompute;
  /// Called at most once, before the first token at a position >=
  /// trained_position_bound (the trained context x the factor of the applied
  /// rope_scaling; model.hpp) is fed to the model, with a one-line message
  /// (PositionWarning::message). A callback installed on the model with
  /// Model::set_position_warning is called too.
  std::function<void(const std::string&)> on_warning;
};

struct GenerateResult {
  std::vector<int32_t> prompt_tokens;  ///< with BOS when the tokenizer has one
  std::vector<int32_t> new_tokens;
  /// [new_tokens.size()] natural-log probability of each generated token under
  /// the model's distribution at temperature 1 (log-softmax in double of the
  /// logits it was chosen from), whatever the sampling temperature.
  std::vector<double> new_token_logprobs;
  std::string text;                    ///< decoded prompt + continuation, as run.c prints it
  /// "max_tokens", "bos", "eos", or "position_limit": the next token's
  /// position is past the learned position table (learned-absolute models)
  /// or past Model::max_position (--max-position), so nothing more can be
  /// generated.
  std::string stop_reason;
  /// Position of the first token fed at or past trained_position_bound (the
  /// sequence passed it there; on_warning was called), -1 if none was.
  int64_t passed_trained_context_at = -1;
  int64_t trained_context = 0;          ///< the model's
  std::string rope_scaling;             ///< RoPE models: the scaling applied ("native", "linear", ...)
  std::optional<double> rope_factor;    ///< ... its factor (none for default / native without one)
  std::string rope_type;                ///< ... the applied setup's rope_type (the model's for native)
  int64_t rope_context = 0;             ///< ... the sequence length its setup was built for
  /// ... the policy applied when the frequencies change ("recompute", "hf",
  /// "refuse", "rerotate"; "none" when the method does not depend on the length)
  std::string rope_change_policy;
  int64_t rope_switch_point = 0;        ///< ... the length past which they change (0: never)
  int64_t rope_recomputes = 0;          ///< re-prefills the recompute policy ran
  int64_t tokens_reprefilled = 0;       ///< tokens those re-prefills ran again
  double prefill_seconds = 0;           ///< wall time of the prompt's forward
  double decode_seconds = 0;            ///< wall time of the decode steps' forwards (re-prefills included)
};

/// Encodes `prompt` (tokenizer.encode(prompt, bos=true): BOS + dummy prefix for
/// llama2.c, the tokenizer's own rules otherwise), prefills it in one forward
/// and decodes token by token through the KV cache. `on_piece` (optional) is
/// called with each decoded piece as it is produced, starting with the prompt's.
/// RoPE models run with rope_setup_for_context(model.rope(), trained context,
/// options.rope_scaling, prompt + max_new_tokens, options.rope_factor) (the
/// setup `posenc ppl` uses for a window of that length); a length-dependent
/// method (dynamic, longrope) applies options.rope_change_policy when its
/// frequencies change (default recompute: a re-prefill, so each step equals a
/// full forward at its length; LongRoPE plans for prompt + max_new_tokens, so
/// it uses the long factors from the first token when that passes the
/// original context). Generation stops at the tokenizer's
/// BOS / EOS (stop_at_bos / stop_at_eos), after max_new_tokens, or where a
/// learned position table or Model::max_position ends the positions
/// (stop_reason "position_limit").
/// Throws InvalidArgument for bad options (temperature < 0, top_p not in (0,1],
/// max_new_tokens < 0, a RoPE scaling for a model without RoPE), ConfigError
/// for an unknown scaling or one missing its parameters, PositionError for a
/// prompt longer than a learned position table, NumericError when the logits a
/// token would be taken from are not finite (float32 overflowed in the model).
GenerateResult generate(const Model& model, const Tokenizer& tokenizer, std::string_view prompt,
                        const GenerateOptions& options,
                        const std::function<void(std::string_view)>& on_piece = {});

}  // namespace posenc
