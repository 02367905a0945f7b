// posenc — perplexity by position: the `ppl` job.
//
// Protocol (defined so that results are comparable across tools):
//  1. The text is split into blocks: a block is a maximal run of non-blank
//     lines (a blank line is empty or whitespace-only); its lines are joined
//     with '\n' and the block is stripped of leading/trailing whitespace.
//  2. Each block is encoded with tokenizer.encode(block, bos=true): the
//     tokenizer's BOS when it has one, then its own normalization (llama2.c:
//     BOS id 1 + the leading-space prefix, as run.c; tokenizer.json:
//     encode(block, add_special_tokens=True)); blocks are concatenated in file
//     order into one stream.
//  3. Windows of L tokens are cut from the start of the stream without
//     overlap; the last, shorter window is scored too when it has >= 2 tokens.
//  4. In each window, the logits at position p score the token at p+1 (L-1
//     predictions, none across a window boundary); a prediction's bucket is
//     its input position p. Buckets: [0,256) [256,512) [512,1024) ... (doubling).
//  5. NLL in nats, log-sum-exp in double. `max_tokens` N stops after
//     ceil(N / (L-1)) windows.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "posenc/model.hpp"
#include "posenc/tokenizer.hpp"

namespace posenc {

/// Step 1 of the protocol: the text's blocks, in order.
std::vector<std::string> split_blocks(std::string_view text);

/// Steps 1-2: the token stream of the whole text (BOS + block tokens, per block).
/// Throws InvalidArgument if the text holds no block; TokenizerError (from the
/// parallel encode, rethrown) for a piece a symbol vocabulary does not hold.
std::vector<int32_t> encode_stream(const Tokenizer& tokenizer, std::string_view text);

/// The position buckets [0,256) [256,512) [512,1024) ... that start below
/// `context` (the protocol's fixed bucket edges; the last may extend past it).
std::vector<std::pair<int64_t, int64_t>> position_buckets(int64_t context);

struct PplBucket {
  int64_t start = 0;
  int64_t end = 0;
  double nll_sum = 0.0;  ///< nats
  int64_t tokens = 0;
  double nll() const { return tokens > 0 ? nll_sum / static_cast<double>(tokens) : 0.0; }
};

struct PplResult {
  int64_t context = 0;       ///< window length L
  std::string rope_scaling;  ///< rope_type used
  double factor = 1.0;       ///< scaling factor s used (1 for default)
  int64_t windows = 0;
  int64_t tokens = 0;        ///< scored predictions
  double nll = 0.0;          ///< mean NLL (nats/token)
  double ppl = 0.0;          ///< exp(nll)
  std::vector<PplBucket> buckets;
};

struct PplProgress {
  int64_t windows_done = 0;
  int64_t windows_total = 0;
  int64_t tokens_done = 0;
  double seconds = 0.0;
};

struct PplOptions {
  int64_t context = 512;     ///< L, in [2, 1048576]
  int64_t max_tokens = 0;    ///< 0 = the whole stream
  /// Called from the calling thread at most about once per second.
  std::function<void(const PplProgress&)> on_progress;
};

/// Scores `stream` with `model` (its current RopeSetup) per the protocol above.
/// Windows run in parallel over the OpenMP threads (one window per thread, each
/// with its own KV cache); sums are reduced in window order, so the result does
/// not depend on the thread count. Throws InvalidArgument for a context outside
/// [2, 1048576], max_tokens < 0, or a stream shorter than 2 tokens;
/// PositionError (before any window runs) when a learned-position model's
/// table is shorter than the windows; any error of Model::score_window is
/// rethrown after the parallel loop (never terminate()).
PplResult evaluate_perplexity(const Model& model, std::span<const int32_t> stream,
                              const PplOptions& options);

/// The RoPE setup for evaluating `model` at window length `context` with the
/// scaling `rope_type` ("default", "linear", "ntk", "dynamic", "yarn", ...,
/// or "native": `base` unchanged, the model's own parameters as loaded or as
/// --config set them).
/// When `rope_type` is base's own (non-default) type and no `factor` is
/// given, base's parameters are used as they are (e.g. a Llama-3.1 config's
/// llama3 factor 8 and original_max_position_embeddings 8192). Otherwise the
/// factor s is `factor` if given, else max(1, context / trained context), with
/// original_max_position_embeddings = max_position_embeddings = the trained
/// context, and every other parameter taken from base (so a --config's
/// low_freq_factor, beta_fast, long_factor, ... reach the method). Parameters
/// follow Hugging Face semantics (yarn: beta_fast 32, beta_slow 1 defaults;
/// dynamic: HF's rule with factor s and seq_len = context). Layout and angle
/// precision are kept from `base`. Throws ConfigError for a method whose
/// required parameters are missing (llama3 without low_freq_factor, ...).
RopeSetup rope_setup_for_context(const RopeSetup& base, int64_t trained_context,
                                 std::string_view rope_type, int64_t context,
                                 std::optional<double> factor);

/// True for the names rope_setup_for_context accepts ("native" and the
/// registry's rope_types); throws ConfigError listing them otherwise.
bool is_rope_scaling_name(std::string_view name);

}  // namespace posenc

namespace posenc {

/// Evidence for a checkpoint's RoPE layout: the mean NLL of the same text
/// scored under each layout (same frequencies, angle precision and windows).
/// Weights trained with one layout are badly hurt by the other, so the layout
/// with the lower NLL is the checkpoint's; `margin` = |nll_half - nll_interleaved|
/// in nats/token tells how clear the evidence is.
struct LayoutEvidence {
  double nll_half = 0.0;
  double nll_interleaved = 0.0;
  int64_t tokens = 0;
  int64_t context = 0;
  RopeLayout likely = RopeLayout::half;
  double margin = 0.0;
};

/// Scores up to `max_tokens` predictions of `stream` in windows of `context`
/// under both layouts. Throws as evaluate_perplexity.
LayoutEvidence detect_rope_layout(const Model& model, std::span<const int32_t> stream, int64_t context,
                                  int64_t max_tokens);

}  // namespace posenc
