// The trainer's recipes, schedule and configs; train_model itself (AdamW + warmup/cosine + clipping on
// batches of task samples, in libtorch) is in train_torch.cpp, loaded as libposenc_torch.so on first use.
#include <algorithm>
#include <charconv>
#include <chrono>
#include <cmath>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "posenc/checkpoint.hpp"
#include "posenc/error.hpp"
#include "posenc/train.hpp"
#include "train/torch_module.hpp"

namespace posenc {

void validate_train_config(const TrainConfig& c) {
  if (c.steps < 1) fail_field<ConfigError>("--steps", "must be >= 1", c.steps);
  if (c.batch_size < 1) fail_field<ConfigError>("--batch-size", "must be >= 1", c.batch_size);
  if (c.dim < 8) fail_field<ConfigError>("--dim", "must be >= 8", c.dim);
  if (c.n_layers < 1) fail_field<ConfigError>("--layers", "must be >= 1", c.n_layers);
  if (c.n_heads < 1 || c.dim % c.n_heads != 0)
    throw ConfigError(fmt::format("--heads: must divide --dim {} (got {})", c.dim, c.n_heads));
  const int hd = c.dim / c.n_heads;
  if (hd % 2 != 0) fail_field<ConfigError>("head_dim", "must be even (dim / heads)", hd);
  if (c.pe == TrainEncoding::rope25 && (hd % 8 != 0))
    fail_field<ConfigError>("head_dim", "rope25 rotates head_dim/4 channels, which must be even: head_dim must be a multiple of 8", hd);
  if (c.hidden_dim < 0) fail_field<ConfigError>("--hidden-dim", "must be >= 0 (0 = 2 * dim)", c.hidden_dim);
  if (!(c.lr > 0 && c.lr <= kMaxLr)) fail_field<ConfigError>("--lr", "must be in (0, 10]", c.lr);
  if (!(c.weight_decay >= 0)) fail_field<ConfigError>("--weight-decay", "must be >= 0", c.weight_decay);
  if (c.warmup_steps < 0) fail_field<ConfigError>("--warmup", "must be >= 0", c.warmup_steps);
  if (!(c.min_lr_ratio >= 0 && c.min_lr_ratio <= 1))
    fail_field<ConfigError>("min_lr_ratio", "must be in [0, 1]", c.min_lr_ratio);
  if (!(c.clip_norm > 0)) fail_field<ConfigError>("--clip", "must be > 0", c.clip_norm);
  if (c.threads < 0) fail_field<ConfigError>("--threads", "must be >= 0", c.threads);
  if (!(c.curriculum >= 0 && c.curriculum < 1))
    fail_field<ConfigError>("--curriculum", "must be in [0, 1) (a fraction of the steps)", c.curriculum);
  if (c.ar_queries < 1) fail_field<ConfigError>("--ar-queries", "must be >= 1", c.ar_queries);
}

TaskRecipe default_recipe(TrainTaskKind task) {
  TaskRecipe r;
  if (task == TrainTaskKind::associative_recall) {
    r.lr = 1e-3;
    r.steps = 6000;
  }
  return r;
}

std::map<TrainTaskKind, TaskRecipe> default_recipes() {
  std::map<TrainTaskKind, TaskRecipe> out;
  for (auto k : kTrainTaskKinds)
    if (TaskRecipe r = default_recipe(k); !r.empty()) out.emplace(k, r);
  return out;
}

TaskRecipe parse_task_recipe(std::string_view text, std::string_view field) {
  TaskRecipe r;
  if (text == "none") return r;
  if (text.empty())
    throw ConfigError(fmt::format("{}: empty recipe '{}' (use key=value pairs, e.g. lr=1e-3,steps=6000, or 'none')",
                                  field, text));
  std::size_t pos = 0;
  while (pos <= text.size()) {
    const std::size_t comma = std::min(text.find(',', pos), text.size());
    const std::string_view entry = text.substr(pos, comma - pos);
    const std::size_t eq = entry.find('=');
    const std::string_view key = entry.substr(0, eq == std::string_view::npos ? entry.size() : eq);
    const std::string_view value = eq == std::string_view::npos ? std::string_view{} : entry.substr(eq + 1);
    auto bad = [&](std::string_view why) {
      throw ConfigError(fmt::format("{}: '{}' {} (recipe keys: lr, steps, batch-size, curriculum)", field, entry, why));
    };
    if (eq == std::string_view::npos || value.empty()) bad("is not key=value");
    const char* b = value.data();
    const char* e = value.data() + value.size();
    // Parses the value as a T, checks its range and that the key is new.
    auto set = [&]<typename T>(std::optional<T>& slot, auto in_range, std::string_view why) {
      T v{};
      const auto [p, ec] = std::from_chars(b, e, v);
      if (ec != std::errc{} || p != e || !in_range(v)) bad(why);
      if (slot) bad(fmt::format("sets {} twice", key));
      slot = v;
    };
    auto at_least_one = [](int v) { return v >= 1; };
    if (key == "lr")
      set(r.lr, [](double v) { return v > 0 && v <= kMaxLr; }, "needs an lr in (0, 10]");
    else if (key == "curriculum")
      set(r.curriculum, [](double v) { return v >= 0 && v < 1; }, "needs a fraction of the steps in [0, 1)");
    else if (key == "steps")
      set(r.steps, at_least_one, "needs an integer >= 1");
    else if (key == "batch-size")
      set(r.batch_size, at_least_one, "needs an integer >= 1");
    else
      bad("has an unknown key");
    pos = comma + 1;
  }
  return r;
}

std::string to_string(const TaskRecipe& r) {
  std::vector<std::string> parts;
  if (r.lr) parts.push_back(fmt::format("lr={}", *r.lr));
  if (r.steps) parts.push_back(fmt::format("steps={}", *r.steps));
  if (r.batch_size) parts.push_back(fmt::format("batch-size={}", *r.batch_size));
  if (r.curriculum) parts.push_back(fmt::format("curriculum={}", *r.curriculum));
  return parts.empty() ? "none" : fmt::format("{}", fmt::join(parts, ","));
}

void merge_recipe(TaskRecipe& into, const TaskRecipe& r) {
  if (r.lr) into.lr = r.lr;
  if (r.steps) into.steps = r.steps;
  if (r.batch_size) into.batch_size = r.batch_size;
  if (r.curriculum) into.curriculum = r.curriculum;
}

void apply_recipe(TrainConfig& c, const TaskRecipe& r) {
  if (r.lr) c.lr = *r.lr;
  if (r.steps) c.steps = *r.steps;
  if (r.batch_size) c.batch_size = *r.batch_size;
  if (r.curriculum) c.curriculum = *r.curriculum;
}

std::size_t curriculum_count(const TrainConfig& c, const std::vector<int>& lengths, int step) {
  if (lengths.empty()) return 0;
  const double ramp = c.curriculum * c.steps;
  if (step >= ramp) return lengths.size();
  const double bound = lengths.front() + (lengths.back() - lengths.front()) * (step + 1) / ramp;
  std::size_t k = 1;
  while (k < lengths.size() && lengths[k] <= bound) ++k;
  return k;
}

int64_t trained_context_for(const Task& task, LengthRange r, int ar_queries) {
  int64_t ctx = 0;
  for (int n : task.lengths_in(r.lo, r.hi)) ctx = std::max(ctx, task.training_positions(n, ar_queries));
  return ctx;
}

ModelConfig model_config_for(const TrainConfig& t) {
  const Task task(t.task);
  ModelConfig c;
  c.dim = t.dim;
  c.hidden_dim = t.hidden_dim > 0 ? t.hidden_dim : 2 * t.dim;
  c.n_layers = t.n_layers;
  c.n_heads = t.n_heads;
  c.n_kv_heads = t.n_heads;
  c.head_dim = t.dim / t.n_heads;
  c.vocab_size = task.vocab_size();
  c.max_position_embeddings = trained_context_for(task, t.train_lengths, t.ar_queries);
  c.norm_eps = 1e-5f;
  c.shared_classifier = false;
  return c;
}

PositionalConfig positional_config_for(const TrainConfig& t) {
  PositionalConfig pc;
  pc.family = family_of(t.pe);
  pc.alibi_max_bias = t.alibi_max_bias;
  pc.t5_num_buckets = t.t5_num_buckets;
  pc.t5_max_distance = t.t5_max_distance;
  pc.sinusoidal_base = t.sinusoidal_base;
  if (pc.family == PositionFamily::rope) {
    const int hd = t.dim / t.n_heads;
    RopeParams p;
    p.rope_type = "default";
    p.rope_theta = t.rope_theta;
    p.head_dim = hd;
    p.rotary_dim = t.pe == TrainEncoding::rope25 ? hd / 4 : hd;
    const int64_t ctx = trained_context_for(Task(t.task), t.train_lengths, t.ar_queries);
    p.max_position_embeddings = ctx;
    p.original_max_position_embeddings = ctx;
    pc.rope.params = p;
    pc.rope.freqs = compute_rope_frequencies(p);
    pc.rope.layout = RopeLayout::interleaved;  // GPT-J pairing, as Kazemnejad et al.
    pc.rope.precision = AnglePrecision::float32;
  }
  return pc;
}

TrainResult train_model(const TrainConfig& cfg, const std::function<void(const TrainProgress&)>& on_progress,
                        int report_every) {
  validate_train_config(cfg);  // a bad flag fails before libtorch loads
  TrainResult result;
  detail::torch_train_model()(cfg, on_progress, report_every, result);
  return result;
}

}  // namespace posenc
