// posenc — text generation with the KV cache (greedy by default).
#pragma once

#include <cstdint>
#include <functional>
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
};

struct GenerateResult {
  std::vector<int32_t> prompt_tokens;  ///< with BOS when the tokenizer has one
  std::vector<int32_t> new_tokens;
  /// [new_tokens.size()] natural-log probability of each generated token under
  /// the model's distribution at temperature 1 (log-softmax in double of the
  /// logits it was chosen from), whatever the sampling temperature.
  std::vector<double> new_token_logprobs;
  std::string text;                    ///< decoded prompt + continuation, as run.c prints it
  std::string stop_reason;             ///< "max_tokens", "bos" or "eos"
};

/// Encodes `prompt` (tokenizer.encode(prompt, bos=true): BOS + dummy prefix for
/// llama2.c, the tokenizer's own rules otherwise), prefills it in one forward
/// and decodes token by token through the KV cache. `on_piece` (optional) is
/// called with each decoded piece as it is produced, starting with the prompt's.
/// Throws InvalidArgument for bad options (temperature < 0, top_p not in (0,1],
/// max_new_tokens < 0) and PositionError if prompt + new tokens exceed
/// `max_positions` when it is > 0.
GenerateResult generate(const Model& model, const Tokenizer& tokenizer, std::string_view prompt,
                        const GenerateOptions& options,
                        const std::function<void(std::string_view)>& on_piece = {});

}  // namespace posenc
