#include "posenc/generate.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <numeric>
#include <random>

#include <fmt/format.h>

#include "posenc/error.hpp"
#include "posenc/perplexity.hpp"
#include "posenc/scaling.hpp"

#include "eval/logprob.hpp"

namespace posenc {

namespace {

int32_t argmax(const float* x, int n) {
  int32_t best = 0;
  for (int i = 1; i < n; ++i)
    if (x[i] > x[best]) best = i;
  return best;
}

double log_softmax_at(const float* x, int n, int32_t i) {
  double mx = x[0];
  for (int j = 1; j < n; ++j) mx = std::max(mx, static_cast<double>(x[j]));
  double sum = 0;
  for (int j = 0; j < n; ++j) sum += std::exp(static_cast<double>(x[j]) - mx);
  return static_cast<double>(x[i]) - mx - std::log(sum);
}

int32_t sample(const float* logits, int n, float temperature, float top_p, std::mt19937_64& rng) {
  std::vector<double> p(static_cast<std::size_t>(n));
  double mx = logits[0];
  for (int i = 1; i < n; ++i) mx = std::max(mx, static_cast<double>(logits[i]));
  double sum = 0;
  for (int i = 0; i < n; ++i) sum += p[static_cast<std::size_t>(i)] = std::exp((logits[i] - mx) / temperature);
  for (double& v : p) v /= sum;
  std::vector<int32_t> idx(static_cast<std::size_t>(n));
  std::iota(idx.begin(), idx.end(), 0);
  if (top_p < 1.0f) {
    std::sort(idx.begin(), idx.end(), [&](int32_t a, int32_t b) { return p[static_cast<std::size_t>(a)] > p[static_cast<std::size_t>(b)]; });
    double cum = 0;
    std::size_t keep = 0;
    while (keep < idx.size()) {
      cum += p[static_cast<std::size_t>(idx[keep++])];
      if (cum >= top_p) break;
    }
    idx.resize(keep);
  }
  double total = 0;
  for (int32_t i : idx) total += p[static_cast<std::size_t>(i)];
  std::uniform_real_distribution<double> u(0.0, total);
  double r = u(rng), acc = 0;
  for (int32_t i : idx) {
    acc += p[static_cast<std::size_t>(i)];
    if (r < acc) return i;
  }
  return idx.back();
}

}  // namespace

GenerateResult generate(const Model& model, const Tokenizer& tokenizer, std::string_view prompt,
                        const GenerateOptions& o, const std::function<void(std::string_view)>& on_piece) {
  if (o.max_new_tokens < 0) fail_field<InvalidArgument>("max_new_tokens", "must be >= 0", o.max_new_tokens);
  if (!(o.temperature >= 0.0f) || !std::isfinite(o.temperature))
    fail_field<InvalidArgument>("temperature", "must be finite and >= 0", o.temperature);
  if (!(o.top_p > 0.0f && o.top_p <= 1.0f)) fail_field<InvalidArgument>("top_p", "must be in (0, 1]", o.top_p);
  const int V = model.config().vocab_size;
  if (tokenizer.vocab_size() != V)
    throw TokenizerError(fmt::format("tokenizer vocab_size {} does not match the model's vocab_size {}",
                                     tokenizer.vocab_size(), V));
  GenerateResult res;
  res.prompt_tokens = tokenizer.encode(prompt, true, false);
  if (res.prompt_tokens.empty())
    throw InvalidArgument("prompt: encodes to no tokens (empty prompt and a tokenizer without BOS)");
  const std::optional<int32_t> bos = tokenizer.bos_id(), eos = tokenizer.eos_id();
  // The text starts after the BOS the encoder added (as run.c prints it; some
  // tokenizer.json files would otherwise decode it as text).
  const std::size_t first = bos && res.prompt_tokens.front() == *bos ? 1 : 0;
  // The prompt's pieces go to on_piece once the checks below have passed (a refused prompt prints nothing).
  std::vector<std::string> prompt_pieces;
  for (std::size_t i = first; i < res.prompt_tokens.size(); ++i) {
    // The first piece decodes as the start of the text: after the BOS when the
    // tokenizer treats it as special (llama2.c strips the dummy-prefix space
    // there), else with no previous token (a decoder's Strip applies).
    const int32_t prev = i > first ? res.prompt_tokens[i - 1] : first == 1 && tokenizer.is_special(*bos) ? *bos : -1;
    auto piece = tokenizer.decode(prev, res.prompt_tokens[i]);
    res.text += piece;
    prompt_pieces.push_back(std::move(piece));
  }
  // The positional setup: the scaling as ppl applies it to a window of the
  // longest sequence this call can reach.
  const int64_t prompt_len = static_cast<int64_t>(res.prompt_tokens.size());
  res.trained_context = model.trained_context();
  Model m = model;
  if (model.family() == PositionFamily::rope) {
    res.rope_context = prompt_len + o.max_new_tokens;
    m.set_rope(rope_setup_for_context(model.rope(), model.trained_context(), o.rope_scaling, res.rope_context,
                                      o.rope_factor));
    res.rope_scaling = o.rope_scaling;
    res.rope_factor = m.rope().params.factor;
    res.rope_type = m.rope().params.rope_type;
    const bool length_dependent = find_rope_scaling(m.rope().params.rope_type).depends_on_seq_len;
    m.set_rope_change_policy(o.rope_change_policy);
    res.rope_change_policy = length_dependent ? std::string(to_string(o.rope_change_policy)) : "none";
    res.rope_switch_point = length_dependent ? rope_switch_point(m.rope().params) : 0;
  } else if (o.rope_scaling != "native" && o.rope_scaling != "default") {
    throw InvalidArgument(fmt::format("rope_scaling: the model uses {} positions; RoPE scalings do not apply (got {})",
                                      to_string(model.family()), o.rope_scaling));
  }
  // A learned table ends: positions >= its rows cannot be fed.
  const int64_t table = model.family() == PositionFamily::learned_absolute && model.config().max_position_embeddings > 0
                            ? model.config().max_position_embeddings
                            : -1;
  if (table >= 0 && prompt_len > table)
    throw PositionError(fmt::format("prompt: {} tokens are past the learned position table ({} positions)", prompt_len,
                                    table));
  // --max-position N (Model::set_max_position) ends the positions too: the prompt must fit (a PositionError before
  // anything runs), and generation stops with stop_reason position_limit where the next token would pass N.
  if (model.max_position() >= 0 && prompt_len - 1 > model.max_position())
    throw PositionError(fmt::format("prompt: {} tokens reach position {}, past the position limit {} (max_position, "
                                    "the CLI's --max-position; positions 0 .. {} are allowed)",
                                    prompt_len, prompt_len - 1, model.max_position(), model.max_position()));
  const int64_t limit = model.max_position() >= 0
                            ? (table >= 0 ? std::min(table, model.max_position() + 1) : model.max_position() + 1)
                            : table;
  // Warns once, before the first token at a position >= the trained context x the rope_scaling factor: the
  // forward's position watch (Model::set_position_warning), chained to the one the caller installed on `model`.
  m.set_position_warning([&res, &o, prev = model.position_warning()](const PositionWarning& w) {
    res.passed_trained_context_at = w.position;
    if (prev) prev(w);
    if (o.on_warning) o.on_warning(w.message);
  });
  if (on_piece)
    for (const auto& piece : prompt_pieces) on_piece(piece);
  KvCache cache = m.make_cache(o.block_size);
  const KvCache::SeqId seq = cache.create();
  cache.set_planned_length(seq, prompt_len + o.max_new_tokens);
  std::vector<float> logits;
  Model::SequenceInput in{seq, res.prompt_tokens, {}};
  using clock = std::chrono::steady_clock;
  auto t0 = clock::now();
  m.forward(cache, std::span<const Model::SequenceInput>(&in, 1), Model::LogitsMode::last, logits);
  res.prefill_seconds = std::chrono::duration<double>(clock::now() - t0).count();
  std::mt19937_64 rng(o.seed);
  int32_t prev = res.prompt_tokens.size() > first ? res.prompt_tokens.back() : -1;
  res.stop_reason = "max_tokens";
  for (int step = 0; step < o.max_new_tokens; ++step) {
    detail::check_logits_finite(logits.data(), V, V, [&](int64_t) {
      return fmt::format("position {} (the logits after it, for generated token {})", prompt_len + step - 1, step);
    });
    const int32_t next = o.temperature == 0.0f ? argmax(logits.data(), V)
                                               : sample(logits.data(), V, o.temperature, o.top_p, rng);
    if (o.stop_at_bos && bos && next == *bos) {
      res.stop_reason = "bos";
      break;
    }
    if (o.stop_at_eos && eos && next == *eos) {
      res.stop_reason = "eos";
      break;
    }
    res.new_tokens.push_back(next);
    res.new_token_logprobs.push_back(log_softmax_at(logits.data(), V, next));
    const auto piece = tokenizer.decode(prev, next);
    res.text += piece;
    if (on_piece) on_piece(piece);
    prev = next;
    if (step + 1 == o.max_new_tokens) break;
    const int64_t position = prompt_len + static_cast<int64_t>(res.new_tokens.size()) - 1;
    if (limit >= 0 && position >= limit) {
      res.stop_reason = "position_limit";
      break;
    }
    const int32_t tok[1] = {next};
    in = {seq, tok, {}};
    t0 = clock::now();
    m.forward(cache, std::span<const Model::SequenceInput>(&in, 1), Model::LogitsMode::last, logits);
    res.decode_seconds += std::chrono::duration<double>(clock::now() - t0).count();
  }
  res.rope_recomputes = cache.stats(seq).rope_recomputes;
  res.tokens_reprefilled = cache.stats(seq).tokens_reprefilled;
  return res;
}

}  // namespace posenc
