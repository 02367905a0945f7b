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
//     its input position p. Buckets follow the model's trained context T:
//     [0,T/2) [T/2,T) [T,2T) [2T,4T) ... (doubling past T) up to L, or the
//     edges the caller gives (`posenc ppl --buckets 0,64,128`).
//  5. NLL in nats, log-sum-exp in double. `max_tokens` N stops after
//     ceil(N / (L-1)) windows.
//  6. Each bucket's mean NLL carries a 95% percentile-bootstrap interval over
//     windows: B resamples of the W windows drawn with replacement (a fixed
//     seed, splitmix64), each giving the bucket's pooled mean NLL (sum of the
//     drawn windows' NLL / their predictions); the 2.5% and 97.5% quantiles
//     (linear interpolation, numpy's default) of the resampled means. A
//     bucket whose predictions fall in fewer than two windows has no interval
//     (PplBucket::has_interval; the JSON gives null and the reason).
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "posenc/model.hpp"
#include "posenc/tokenizer.hpp"

namespace posenc {

/// Step 1 of the protocol: the text's blocks, in order.
std::vector<std::string> split_blocks(std::string_view text);

/// Steps 1-2: the token stream of the whole text (BOS + block tokens, per block).
/// Throws InvalidArgument if the text holds no block; TokenizerError (from the
/// parallel encode, rethrown) for a piece a symbol vocabulary does not hold.
std::vector<int32_t> encode_stream(const Tokenizer& tokenizer, std::string_view text);

/// The default position buckets of a model trained at `trained_context` T,
/// scored in windows of `context` L: [0,T/2) [T/2,T) [T,2T) [2T,4T) ... that
/// start below L (the last may extend past L; [0,T/2) is left out when T < 2,
/// giving [0,T) [T,2T) ...). Pairs are [start, end) input positions.
/// Throws InvalidArgument for T < 1 or L < 1.
std::vector<std::pair<int64_t, int64_t>> position_buckets(int64_t trained_context, int64_t context);

/// Buckets from explicit edges e0 = 0 < e1 < ... < en: [e_i, e_{i+1}) for those
/// starting below `context` L, plus [en, L) when L > en, so that every
/// prediction falls in a bucket. Throws InvalidArgument when there are fewer
/// than two edges, e0 != 0 or the edges do not increase (naming the edge).
std::vector<std::pair<int64_t, int64_t>> buckets_from_edges(std::span<const int64_t> edges, int64_t context);

/// Parses bucket edges "0,64,128,1K" (K = 1024, M = 1048576; no blank entry)
/// and checks them as buckets_from_edges does. Throws ConfigError naming
/// `flag` and the bad entry.
std::vector<int64_t> parse_bucket_edges(std::string_view text, std::string_view flag = "--buckets");

struct PplBucket {
  int64_t start = 0;
  int64_t end = 0;
  double nll_sum = 0.0;  ///< nats
  int64_t tokens = 0;
  int64_t windows = 0;       ///< windows with at least one prediction in the bucket
  double nll_ci_low = 0.0;   ///< 95% bootstrap interval of nll() over windows (protocol step 6), nats
  double nll_ci_high = 0.0;  ///< equal to nll() when one window holds all of the bucket's predictions
  double nll() const { return tokens > 0 ? nll_sum / static_cast<double>(tokens) : 0.0; }
  /// Whether the interval says anything: resampling one window always draws that window, so with fewer than two
  /// windows holding predictions the interval has zero width by construction, not from agreement between
  /// windows. Outputs then give no interval and say why (ppl_result_json's nll_ci_note, the ppl table).
  bool has_interval() const { return windows >= 2; }
};

/// Why a bucket has no interval (PplBucket::has_interval false): the text of ppl_result_json's "nll_ci_note".
std::string no_interval_reason(const PplBucket& bucket);

struct PplResult {
  int64_t context = 0;       ///< window length L
  int64_t trained_context = 0;  ///< T of the model (the default buckets' anchor)
  std::string rope_scaling;  ///< rope_type used
  double factor = 1.0;       ///< scaling factor s used (1 for default)
  int64_t windows = 0;
  int64_t tokens = 0;        ///< scored predictions
  double nll = 0.0;          ///< mean NLL (nats/token)
  double ppl = 0.0;          ///< exp(nll)
  std::vector<PplBucket> buckets;
  /// The buckets cut into PplOptions::fine_bins_per_bucket equal bins each
  /// (empty when 0): finer position detail for plots, same NLL and intervals.
  std::vector<PplBucket> fine_buckets;
};

struct PplProgress {
  int64_t windows_done = 0;
  int64_t windows_total = 0;
  int64_t tokens_done = 0;   ///< predictions scored so far, windows in flight included (their chunks done)
  double seconds = 0.0;
  int64_t tokens_total = 0;  ///< predictions of all windows
};

struct PplOptions {
  int64_t context = 512;     ///< L, in [2, 1048576]
  int64_t max_tokens = 0;    ///< 0 = the whole stream
  /// Bucket edges (buckets_from_edges); empty = position_buckets(model.trained_context(), context).
  std::vector<int64_t> bucket_edges;
  int fine_bins_per_bucket = 0;  ///< in [0, 64]; > 0 fills PplResult::fine_buckets
  /// Tokens per forward within a window (Model::score_window's chunks; the same NLL to the bit for any value):
  /// 0 = automatic, as many as keep one chunk's logits within 64 MiB (ppl_auto_chunk_tokens: 512 for a
  /// 32000-token vocabulary, 32768 for a 512-token one), so that memory does not grow with
  /// context x vocab_size and progress is reported within a long window. Must be >= 0; not used by the
  /// scorer overload of evaluate_perplexity.
  int64_t chunk_tokens = 0;
  int bootstrap_resamples = 1000;             ///< B of protocol step 6, in [1, 1000000]
  uint64_t bootstrap_seed = 0x9e3779b97f4a7c15;  ///< fixed: the interval is a function of the windows only
  /// Called from the calling thread at most about once per progress_interval_seconds while windows run (after a
  /// window or a chunk of one), and exactly once with windows_done == windows_total, when all are scored.
  std::function<void(const PplProgress&)> on_progress;
  double progress_interval_seconds = 1.0;  ///< >= 0 (0: after every window and chunk the calling thread scores)
};

/// PplOptions::chunk_tokens' automatic value for a vocabulary of `vocab_size` tokens: the multiple of 16 tokens
/// whose float32 logits fill at most 64 MiB, at least 16 (512 for 32000 tokens, 128 for Llama 3's 128256, 32768
/// for stories260K's 512). Throws InvalidArgument for vocab_size < 1.
int64_t ppl_auto_chunk_tokens(int64_t vocab_size);

/// Scores `stream` with `model` (its current RopeSetup) per the protocol above.
/// Windows run in parallel over the OpenMP threads (one window per thread, each
/// with its own KV cache); sums are reduced in window order and the bootstrap
/// runs after the loop on one thread, so the result (intervals included) does
/// not depend on the thread count. Throws InvalidArgument for a context outside
/// [2, 1048576], max_tokens < 0, bad bucket_edges, bootstrap_resamples outside
/// [1, 1000000], chunk_tokens < 0, progress_interval_seconds < 0 or not
/// finite, or a stream shorter than 2 tokens;
/// PositionError (before any window runs) when a learned-position model's
/// table is shorter than the windows or they pass model.max_position(); NumericError naming the window and
/// position when a window's logits are not finite (float32 overflowed in the
/// model); any error of Model::score_window is rethrown after the parallel loop
/// (never terminate()).
PplResult evaluate_perplexity(const Model& model, std::span<const int32_t> stream,
                              const PplOptions& options);

/// One window of protocol step 3: stream tokens [start, start + tokens).
struct PplWindow {
  int64_t start = 0;
  int64_t tokens = 0;  ///< in [2, context]
};

/// Fills nll[w] with the tokens[w] - 1 prediction NLLs (nats, position order:
/// nll[w][p] = -log P(stream[start + p + 1] | stream[start .. start + p])) of
/// each window w. Throws whatever the scorer's backend throws.
using PplWindowsScorer =
    std::function<void(std::span<const PplWindow> windows, std::vector<std::vector<double>>& nll)>;

/// The same protocol with the windows scored by `score_windows` (e.g. an
/// endpoint's prompt log-probabilities, posenc/endpoint.hpp) instead of a
/// Model: windows, buckets (default buckets from `trained_context`) and
/// bootstrap are the code above. rope_scaling is "default", factor 1 (the
/// caller names what scored the windows). Throws InvalidArgument as above and
/// when the scorer returns a window with the wrong number of values.
PplResult evaluate_perplexity(std::span<const int32_t> stream, int64_t trained_context, const PplOptions& options,
                              const PplWindowsScorer& score_windows);

/// Percentile-bootstrap 95% interval of a pooled mean over units (protocol
/// step 6): sums[w] / counts[w] are unit w's NLL sum and prediction count;
/// each of `resamples` resamples draws W units with replacement and gives
/// sum(sums) / sum(counts) (resamples with no prediction are skipped). Returns
/// {low, high}; {mean, mean} when a single unit holds predictions; {0, 0}
/// when none does. Deterministic in `seed`. Throws InvalidArgument for spans
/// of different sizes, negative counts or resamples < 1.
std::pair<double, double> bootstrap_mean_interval(std::span<const double> sums, std::span<const int64_t> counts,
                                                  int resamples, uint64_t seed);

/// One result as JSON (the schema of `posenc ppl --json` "results" entries and
/// of eval's ppl/<scaling>__L<length>.json): context, trained_context,
/// rope_scaling, factor, ppl, nll, tokens, windows, buckets [{start, end,
/// tokens, windows, nll, ppl, nll_ci_low, nll_ci_high}] (NLL in nats/token),
/// and fine_buckets (same keys) when the result has them. A bucket whose
/// predictions fall in fewer than two windows (PplBucket::has_interval false)
/// has nll_ci_low and nll_ci_high null and "nll_ci_note" saying why
/// (no_interval_reason): no interval can be estimated from a single window.
nlohmann::json ppl_result_json(const PplResult& result);

/// Margin, in nats/token, above log(vocab_size) (the NLL of guessing
/// uniformly over the model's vocabulary) past which a mean NLL says the
/// tokenizer's ids mean other pieces to the model than they did in training.
inline constexpr double kTokenizerMismatchMarginNats = 1.0;

/// Windows shorter than this many tokens do not judge the tokenizer (their
/// predictions have next to no context; see in_range_nll).
inline constexpr int64_t kTokenizerCheckMinContext = 16;

/// The mean NLL that judges the tokenizer: over `results` with a window of at
/// least kTokenizerCheckMinContext tokens, the lowest mean NLL
/// of the predictions inside the trained context (buckets with end <=
/// trained_context; a result without such a bucket counts with its whole NLL
/// when its context <= trained_context, else not). nullopt when no result
/// qualifies (every window past the trained context: a length effect, not a
/// tokenizer one).
std::optional<double> in_range_nll(std::span<const PplResult> results);

/// A warning when `mean_nll` exceeds log(model_vocab_size) +
/// kTokenizerMismatchMarginNats: a model reading its own tokens does better
/// than uniform guessing, one fed another tokenizer's ids does far worse. The
/// text names the NLL, the uniform level, the tokenizer (`tokenizer_source`,
/// e.g. the --tokenizer path, and its piece count) and the model's
/// vocabulary, and asks for the model's own tokenizer. nullopt otherwise, when
/// model_vocab_size < 2, and for a symbol vocabulary (a `posenc train`
/// checkpoint's own: those models learn to predict their task's answers
/// only, so their NLL over other positions of a text says nothing of the
/// tokenizer).
std::optional<std::string> tokenizer_mismatch_warning(double mean_nll, int64_t model_vocab_size,
                                                      const Tokenizer& tokenizer, std::string_view tokenizer_source);

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
  /// Standard error of `margin` (nats/token): of the mean paired per-prediction difference between the layouts,
  /// the larger of the i.i.d. estimate over predictions and the cluster estimate over windows (when there are at
  /// least two). 0 with fewer than two predictions.
  double margin_se = 0.0;
  /// Whether the evidence decides: margin > kLayoutEvidenceZ * margin_se with at least two predictions. False
  /// e.g. at context 2 (every prediction is at position 0, where RoPE rotates nothing: margin 0) or on a few
  /// tokens whose margin is within its noise; `likely` is then only the lower of two indistinguishable NLLs.
  bool conclusive = false;
};

/// How many standard errors the layout margin must exceed for detect_rope_layout to call the evidence conclusive
/// (3: a chance margin passes it about 0.3% of the time under a normal approximation).
inline constexpr double kLayoutEvidenceZ = 3.0;

/// Scores up to `max_tokens` predictions of `stream` in windows of `context`
/// under both layouts (the same windows) and judges the margin against its
/// noise (LayoutEvidence::margin_se, conclusive). Throws as evaluate_perplexity.
LayoutEvidence detect_rope_layout(const Model& model, std::span<const int32_t> stream, int64_t context,
                                  int64_t max_tokens);

}  // namespace posenc
