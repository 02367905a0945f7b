// Exact-match evaluation of task models with the posenc runtime.
#include <algorithm>

#include <fmt/format.h>

#include "posenc/error.hpp"
#include "posenc/perplexity.hpp"
#include "posenc/scaling.hpp"
#include "posenc/tokenizer.hpp"
#include "posenc/synthetic_tasks.hpp"

namespace posenc {

namespace {

int32_t argmax_row(const float* x, int n) {  // lowest id on ties, as generate()
  int32_t best = 0;
  for (int i = 1; i < n; ++i)
    if (x[i] > x[best]) best = i;
  return best;
}

/// Greedy-decodes every sample (one batch) and counts exact matches.
int64_t count_correct(const Model& m, std::span<const TrainSample> samples) {
  const int V = m.config().vocab_size;
  KvCache cache = m.make_cache(16);
  const std::size_t n = samples.size();
  std::vector<KvCache::SeqId> seq(n);
  std::vector<Model::SequenceInput> batch;
  for (std::size_t i = 0; i < n; ++i) {
    seq[i] = cache.create();
    batch.push_back({seq[i], samples[i].prompt, {}});
  }
  std::vector<float> logits;
  m.forward(cache, batch, Model::LogitsMode::last, logits);
  std::vector<std::size_t> active(n), still;
  for (std::size_t i = 0; i < n; ++i) active[i] = i;
  std::vector<int32_t> next(n);
  int64_t correct = 0;
  for (std::size_t step = 0; !active.empty(); ++step) {
    still.clear();
    for (std::size_t r = 0; r < active.size(); ++r) {
      const std::size_t i = active[r];
      const int32_t tok = argmax_row(logits.data() + r * static_cast<std::size_t>(V), V);
      const auto& ans = samples[i].answer;
      if (tok != ans[step]) {  // first wrong token: not an exact match
        cache.free(seq[i]);
        continue;
      }
      if (step + 1 == ans.size()) {  // whole answer, <eos> included
        ++correct;
        cache.free(seq[i]);
        continue;
      }
      next[i] = tok;
      still.push_back(i);
    }
    active.swap(still);
    if (active.empty()) break;
    batch.clear();
    for (std::size_t i : active) batch.push_back({seq[i], std::span<const int32_t>(&next[i], 1), {}});
    m.forward(cache, batch, Model::LogitsMode::last, logits);
  }
  return correct;
}

}  // namespace

std::vector<ExactMatchCell> evaluate_exact_match(const Model& model, const Task& task, const ExactMatchOptions& o) {
  if (model.config().vocab_size != task.vocab_size())
    throw InvalidArgument(fmt::format("evaluate_exact_match: the model's vocab_size {} is not the {} task's {}",
                                      model.config().vocab_size, task.name(), task.vocab_size()));
  if (o.samples < 1) fail_field<InvalidArgument>("samples", "must be >= 1", o.samples);
  if (o.batch < 1) fail_field<InvalidArgument>("batch", "must be >= 1", o.batch);
  const bool scaled = o.rope_scaling != "default";
  if (scaled && model.family() != PositionFamily::rope)
    throw InvalidArgument(fmt::format("rope_scaling: {} applies to RoPE models; this one uses {}", o.rope_scaling,
                                      to_string(model.family())));
  const bool dynamic = scaled && find_rope_scaling(o.rope_scaling).depends_on_seq_len;
  std::vector<ExactMatchCell> out;
  for (int requested : o.lengths) {
    ExactMatchCell cell;
    const int n = task.round_length(requested);
    cell.input_length = n;
    if (n == 0) {
      cell.input_length = requested;
      cell.can_run = false;
      cell.note = fmt::format("no {} sample has {} input tokens", task.name(), requested);
      out.push_back(cell);
      continue;
    }
    SampleRng rng(derive_seed(o.seed, fmt::format("eval/{}", task.name()), n));
    std::vector<TrainSample> samples;
    for (int i = 0; i < o.samples; ++i) samples.push_back(task.sample(rng, n));
    Model m = model;
    if (scaled) {
      m.set_rope(rope_setup_for_context(model.rope(), model.config().max_position_embeddings, o.rope_scaling,
                                        task.positions_needed(n), std::nullopt));
      // Dynamic methods change theta as the sequence grows: re-prefill (recompute),
      // so every decoded token is the full forward's at its length.
      if (dynamic) m.set_rope_change_policy(RopeChangePolicy::recompute);
    }
    try {
      // Can the model read every position a whole answer needs? One
      // teacher-forced forward of a full sequence: a learned table that is
      // too short throws PositionError here, whatever the model would generate.
      std::vector<int32_t> full(samples[0].prompt);
      full.insert(full.end(), samples[0].answer.begin(), samples[0].answer.end() - 1);
      (void)m.score_window(full);
      for (std::size_t b = 0; b < samples.size(); b += static_cast<std::size_t>(o.batch)) {
        const std::size_t e = std::min(samples.size(), b + static_cast<std::size_t>(o.batch));
        cell.correct += count_correct(m, std::span<const TrainSample>(samples).subspan(b, e - b));
        cell.samples += static_cast<int64_t>(e - b);
      }
    } catch (const PositionError& e) {
      cell.can_run = false;
      cell.samples = 0;
      cell.correct = 0;
      cell.note = e.what();
    }
    out.push_back(cell);
  }
  return out;
}

std::vector<int32_t> greedy_answer(const Model& model, std::span<const int32_t> prompt, int max_new) {
  const int V = model.config().vocab_size;
  KvCache cache = model.make_cache(16);
  const auto seq = cache.create();
  Model::SequenceInput in{seq, prompt, {}};
  std::vector<float> logits;
  model.forward(cache, std::span(&in, 1), Model::LogitsMode::last, logits);
  std::vector<int32_t> out;
  for (int i = 0; i < max_new; ++i) {
    const int32_t tok = argmax_row(logits.data(), V);
    out.push_back(tok);
    if (tok == Tokenizer::kEos || i + 1 == max_new) break;
    in = {seq, std::span<const int32_t>(&out.back(), 1), {}};
    model.forward(cache, std::span(&in, 1), Model::LogitsMode::last, logits);
  }
  return out;
}

}  // namespace posenc
