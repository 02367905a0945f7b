// Running task samples through the model: forced choice on KV-cache forks,
// greedy continuation, and prefix sharing across a sample's depths.
#include <algorithm>
#include <cmath>

#include <fmt/format.h>

#include "posenc/error.hpp"
#include "posenc/eval.hpp"
#include "posenc/perplexity.hpp"
#include "posenc/scaling.hpp"

#include "eval/logprob.hpp"

namespace posenc {

namespace detail {

double log_prob(const float* row, int V, int32_t token) {
  double mx = row[0];
  for (int j = 1; j < V; ++j) mx = std::max(mx, static_cast<double>(row[j]));
  double z = 0.0;
  for (int j = 0; j < V; ++j) z += std::exp(static_cast<double>(row[j]) - mx);
  return static_cast<double>(row[token]) - mx - std::log(z);
}

int32_t argmax(const float* x, int n) {
  int32_t best = 0;
  for (int i = 1; i < n; ++i)
    if (x[i] > x[best]) best = i;
  return best;
}

void check_logits_finite(const float* logits, int64_t count, int V, const std::function<std::string(int64_t row)>& where) {
  bool bad = false;
  for (int64_t i = 0; i < count; ++i) bad |= !std::isfinite(logits[i]);
  if (!bad) return;
  int64_t i = 0;
  while (std::isfinite(logits[i])) ++i;
  throw NumericError(fmt::format(
      "{}: logit {} is not finite (got {}): float32 overflowed in the forward pass (weights or activations too large "
      "for it), so no log probability or token can be taken from this row",
      where(i / V), i % V, logits[i]));
}

}  // namespace detail

namespace {

using Input = Model::SequenceInput;
using detail::argmax;
using detail::log_prob;

void forward_one(const Model& model, KvCache& cache, KvCache::SeqId seq, std::span<const int32_t> tokens,
                 std::vector<float>& logits) {
  const Input in{seq, tokens, {}};
  model.forward(cache, std::span<const Input>(&in, 1), Model::LogitsMode::last, logits);
}

std::size_t common_prefix(std::span<const int32_t> a, std::span<const int32_t> b) {
  const std::size_t n = std::min(a.size(), b.size());
  std::size_t i = 0;
  while (i < n && a[i] == b[i]) ++i;
  return i;
}

}  // namespace

RopeSetup eval_rope_setup(const Model& model, std::string_view rope_scaling, int64_t length,
                          std::optional<double> rope_factor) {
  RopeSetup r = rope_setup_for_context(model.rope(), model.trained_context(), rope_scaling, length, rope_factor);
  if (find_rope_scaling(r.params.rope_type).depends_on_seq_len) {
    // The frequencies the forward itself computes for a full window of
    // `length` tokens (max(position_ids)+1 = length; dynamic NTK in HF's
    // forward-path float32 arithmetic) ...
    r.freqs = r.params.rope_type == "dynamic"
                  ? dynamic_ntk_frequencies(r.params, length, DynamicNtkArithmetic::tensor_float32)
                  : compute_rope_frequencies(r.params, length);
    // ... frozen for every token of the sample (prompt, candidates, generated tokens).
    r.update_with_length = false;
  }
  return r;
}

std::vector<double> score_candidates(const Model& model, KvCache& cache, KvCache::SeqId seq,
                                     std::span<const float> last_logits,
                                     std::span<const std::vector<int32_t>> candidates) {
  const int V = model.config().vocab_size;
  if (last_logits.size() != static_cast<std::size_t>(V))
    throw InvalidArgument(fmt::format("last_logits: {} values for vocab_size {}", last_logits.size(), V));
  if (candidates.empty()) throw InvalidArgument("score_candidates: no candidates");
  std::vector<double> lp(candidates.size(), 0.0);
  std::vector<Input> batch;
  std::vector<KvCache::SeqId> forks;
  std::vector<std::size_t> which;
  for (std::size_t c = 0; c < candidates.size(); ++c) {
    const auto& t = candidates[c];
    if (t.empty()) fail_field<InvalidArgument>("candidate", "has no tokens (index)", c);
    for (int32_t id : t)
      if (id < 0 || id >= V) throw InvalidArgument(fmt::format("candidate token id: must be in [0, {}) (got {})", V, id));
    if (c == 0)
      detail::check_logits_finite(last_logits.data(), V, V, [](int64_t) { return std::string("the context's last position"); });
    lp[c] = log_prob(last_logits.data(), V, t[0]);
    if (t.size() > 1) {
      forks.push_back(cache.fork(seq));
      which.push_back(c);
    }
  }
  if (!forks.empty()) {
    for (std::size_t i = 0; i < forks.size(); ++i) {
      const auto& t = candidates[which[i]];
      batch.push_back({forks[i], std::span<const int32_t>(t).first(t.size() - 1), {}});
    }
    std::vector<float> rows;
    try {
      model.forward(cache, batch, Model::LogitsMode::all, rows);
      detail::check_logits_finite(rows.data(), static_cast<int64_t>(rows.size()), V, [&](int64_t row) {
        // Row r belongs to the fork whose rows (its candidate's tokens but the last) cover it.
        std::size_t i = 0;
        for (int64_t first = 0; i < forks.size(); ++i) {
          const int64_t count = static_cast<int64_t>(candidates[which[i]].size()) - 1;
          if (row < first + count) return fmt::format("candidate {}, its token {}", which[i], row - first + 1);
          first += count;
        }
        return fmt::format("candidate row {}", row);
      });
    } catch (...) {
      for (auto f : forks) cache.free(f);
      throw;
    }
    std::size_t r = 0;
    for (std::size_t i = 0; i < forks.size(); ++i) {
      const auto& t = candidates[which[i]];
      for (std::size_t j = 1; j < t.size(); ++j, ++r) lp[which[i]] += log_prob(rows.data() + r * static_cast<std::size_t>(V), V, t[j]);
      cache.free(forks[i]);
    }
  }
  return lp;
}

std::vector<int32_t> greedy_continue(const Model& model, KvCache& cache, KvCache::SeqId seq,
                                     std::vector<float> logits, int max_new_tokens,
                                     std::span<const int32_t> stop_ids) {
  const int V = model.config().vocab_size;
  if (logits.size() != static_cast<std::size_t>(V))
    throw InvalidArgument(fmt::format("last_logits: {} values for vocab_size {}", logits.size(), V));
  std::vector<int32_t> out;
  for (int step = 0; step < max_new_tokens; ++step) {
    detail::check_logits_finite(logits.data(), V, V, [&](int64_t) { return fmt::format("greedy continuation step {}", step); });
    const int32_t next = argmax(logits.data(), V);
    if (std::find(stop_ids.begin(), stop_ids.end(), next) != stop_ids.end()) break;
    out.push_back(next);
    if (step + 1 == max_new_tokens) break;
    const int32_t tok[1] = {next};
    forward_one(model, cache, seq, tok, logits);
  }
  return out;
}

SampleOutcome choice_outcome(const TaskSample& s, std::vector<double> logprobs) {
  if (logprobs.size() != s.choices.size() || logprobs.empty())
    throw InvalidArgument(fmt::format("sample {} of {}: {} candidate log-probabilities for {} candidates", s.index,
                                      s.task, logprobs.size(), s.choices.size()));
  SampleOutcome o;
  o.logprobs = std::move(logprobs);
  std::vector<int64_t> bytes = s.choice_bytes;
  if (bytes.empty())
    for (const auto& ch : s.choices) bytes.push_back(candidate_bytes(ch));
  const ChoiceScore cs = score_choice(o.logprobs, bytes);
  o.predicted = cs.acc_norm;
  o.predicted_acc = cs.acc;
  o.correct_acc = cs.acc == s.gold;
  o.correct = o.predicted == s.gold;
  o.score = o.correct ? 1.0 : 0.0;
  o.kept_original = o.predicted == s.original_gold;
  o.prediction = s.choices[static_cast<std::size_t>(o.predicted)];
  return o;
}

SampleOutcome generation_outcome(const TaskSample& s, std::string prediction) {
  SampleOutcome o;
  o.prediction = std::move(prediction);
  const auto g = score_generation(s.metric, o.prediction, s.answers);
  o.correct = g.correct;
  o.score = g.score;
  o.kept_original = s.original_answers.empty() ? g.correct
                                               : score_generation(s.metric, o.prediction, s.original_answers).correct;
  return o;
}

std::vector<SampleOutcome> evaluate_samples(const Model& model, const Tokenizer& tokenizer,
                                            std::span<const TaskSample> samples) {
  const std::size_t m = samples.size();
  std::vector<SampleOutcome> out(m);
  if (m == 0) return out;
  for (const auto& s : samples) {
    if (s.prompt_tokens.empty()) throw InvalidArgument(fmt::format("sample {} of {}: empty prompt", s.index, s.task));
    if (static_cast<int64_t>(s.prompt_tokens.size()) + s.answer_budget > s.length)
      throw InvalidArgument(fmt::format("sample {} of {}: prompt {} + answer budget {} exceed the length {}", s.index,
                                        s.task, s.prompt_tokens.size(), s.answer_budget, s.length));
  }
  // c[j] = the common prefix of prompts j..m-1 (at most len_j - 1 so the
  // sample's own forward has a last token); non-decreasing in j before the cap.
  std::vector<std::size_t> c(m);
  std::size_t run = samples[m - 1].prompt_tokens.size();
  for (std::size_t j = m; j-- > 0;) {
    if (j + 1 < m) run = std::min(run, common_prefix(samples[j].prompt_tokens, samples[j + 1].prompt_tokens));
    c[j] = std::min(run, samples[j].prompt_tokens.size() - 1);
  }
  std::vector<int32_t> stop_ids;
  if (tokenizer.bos_id()) stop_ids.push_back(*tokenizer.bos_id());
  if (tokenizer.eos_id()) stop_ids.push_back(*tokenizer.eos_id());
  KvCache cache = model.make_cache(16);
  const KvCache::SeqId trunk = cache.create();
  std::size_t t = 0;  // tokens in the trunk (= prefix of every remaining prompt)
  std::vector<float> logits;
  for (std::size_t j = 0; j < m; ++j) {
    const TaskSample& s = samples[j];
    const std::span<const int32_t> p(s.prompt_tokens);
    KvCache::SeqId seq;
    if (c[j] >= t) {
      if (c[j] > t) forward_one(model, cache, trunk, p.subspan(t, c[j] - t), logits);
      t = c[j];
      seq = cache.fork(trunk);
      forward_one(model, cache, seq, p.subspan(t), logits);
    } else {  // cannot happen for prompts that only grow a shared prefix; kept correct anyway
      seq = cache.create();
      forward_one(model, cache, seq, p, logits);
    }
    SampleOutcome& o = out[j];
    if (!s.choice_tokens.empty()) {
      o = choice_outcome(s, score_candidates(model, cache, seq, logits, s.choice_tokens));
    } else {
      std::vector<int32_t> ids = greedy_continue(model, cache, seq, logits, s.answer_budget, stop_ids);
      std::string text;
      int32_t prev = s.prompt_tokens.back();
      for (int32_t id : ids) {
        text += tokenizer.decode(prev, id);
        prev = id;
      }
      o = generation_outcome(s, std::move(text));
      o.new_tokens = std::move(ids);
    }
    cache.free(seq);
  }
  cache.free(trunk);
  return out;
}

}  // namespace posenc
