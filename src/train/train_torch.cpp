// train_model in libtorch: AdamW + warmup/cosine + clipping on batches of task samples. Built into the
// module libposenc_torch.so (with transformer.cpp and autograd.cpp), which train_model (trainer.cpp)
// loads on first use, so that only the processes that train load libtorch (see torch_module.hpp).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include <malloc.h>

#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "posenc/checkpoint.hpp"
#include "posenc/error.hpp"
#include "posenc/train.hpp"
#include "train/torch_module.hpp"
#include "train/transformer.hpp"

namespace posenc {

namespace {

double lr_at(const TrainConfig& c, int step) {  // step: 0-based index of the update
  if (step < c.warmup_steps) return c.lr * static_cast<double>(step + 1) / static_cast<double>(c.warmup_steps);
  const int decay = std::max(1, c.steps - c.warmup_steps);
  const double t = std::min(1.0, static_cast<double>(step - c.warmup_steps) / decay);
  const double cosine = 0.5 * (1.0 + std::cos(M_PI * t));
  return c.lr * (c.min_lr_ratio + (1.0 - c.min_lr_ratio) * cosine);
}

TrainResult train_model_torch(const TrainConfig& cfg, const std::function<void(const TrainProgress&)>& on_progress,
                              int report_every) {
  validate_train_config(cfg);
  const Task task(cfg.task);
  const std::vector<int> lengths = task.lengths_in(cfg.train_lengths.lo, cfg.train_lengths.hi);
  if (lengths.empty())
    throw ConfigError(fmt::format("--train-lengths: no valid {} length in {}:{}", task.name(), cfg.train_lengths.lo,
                                  cfg.train_lengths.hi));
  if (cfg.threads > 0) at::set_num_threads(cfg.threads);
  set_openblas_threads(1);
  // Keep freed activation buffers in the heap instead of returning them to the
  // kernel after every step (each step allocates the same sizes again; the
  // page faults otherwise cost ~15% of a step).
  mallopt(M_MMAP_THRESHOLD, 512 << 20);
  mallopt(M_TRIM_THRESHOLD, 1 << 30);
  torch::manual_seed(cfg.seed);
  const ModelConfig mc = model_config_for(cfg);
  const PositionalConfig pc = positional_config_for(cfg);
  detail::Transformer model(mc, pc);

  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(model->matrices(),
                      std::make_unique<torch::optim::AdamWOptions>(torch::optim::AdamWOptions(cfg.lr)
                                                                       .betas({0.9, 0.98})
                                                                       .eps(1e-8)
                                                                       .weight_decay(cfg.weight_decay)));
  groups.emplace_back(model->non_matrices(), std::make_unique<torch::optim::AdamWOptions>(
                                                 torch::optim::AdamWOptions(cfg.lr).betas({0.9, 0.98}).eps(1e-8).weight_decay(0.0)));
  torch::optim::AdamW opt(std::move(groups), torch::optim::AdamWOptions(cfg.lr));
  std::vector<torch::Tensor> params = model->parameters();

  SampleRng rng(derive_seed(cfg.seed, fmt::format("train/{}", task.name())));
  const auto B = static_cast<std::size_t>(cfg.batch_size);
  std::vector<TrainingSequence> batch(B);
  std::vector<int64_t> tokens, targets;
  TrainResult res;
  res.trained_context = mc.max_position_embeddings;
  for (const auto& p : params) res.parameters += p.numel();

  const auto t0 = std::chrono::steady_clock::now();
  double window_loss = 0.0, tail_loss = 0.0;
  int window_n = 0, tail_n = 0;
  for (int step = 0; step < cfg.steps; ++step) {
    // One input length per step (drawn uniformly from the valid lengths, up
    // to the curriculum's bound), so a batch needs no padding; every sample
    // reads T positions.
    const int n = lengths[static_cast<std::size_t>(rng.below(curriculum_count(cfg, lengths, step)))];
    const int64_t T = task.training_positions(n, cfg.ar_queries);
    for (auto& s : batch) s = task.training_sequence(rng, n, cfg.ar_queries);
    tokens.assign(B * static_cast<std::size_t>(T), 0);
    targets.assign(B * static_cast<std::size_t>(T), -100);
    for (std::size_t b = 0; b < B; ++b) {
      const auto& s = batch[b];
      if (static_cast<int64_t>(s.tokens.size()) - 1 != T)
        throw InvalidArgument("train: sequence length differs from training_positions");
      int64_t* tok = tokens.data() + b * static_cast<std::size_t>(T);
      int64_t* tgt = targets.data() + b * static_cast<std::size_t>(T);
      // Position i reads token i and predicts token i+1; only answer tokens
      // are targets (the prompt is context, not something to predict).
      for (int64_t i = 0; i < T; ++i) {
        tok[i] = s.tokens[static_cast<std::size_t>(i)];
        if (s.is_answer[static_cast<std::size_t>(i + 1)]) tgt[i] = s.tokens[static_cast<std::size_t>(i + 1)];
      }
    }
    const torch::Tensor tok_t =
        torch::from_blob(tokens.data(), {static_cast<int64_t>(B), T}, torch::kInt64).clone();
    const torch::Tensor tgt_t = torch::from_blob(targets.data(), {static_cast<int64_t>(B) * T}, torch::kInt64).clone();
    const double lr = lr_at(cfg, step);
    for (auto& g : opt.param_groups()) static_cast<torch::optim::AdamWOptions&>(g.options()).lr(lr);

    const torch::Tensor logits = model->forward(tok_t);
    const torch::Tensor loss = torch::nn::functional::cross_entropy(
        logits.view({-1, mc.vocab_size}), tgt_t, torch::nn::functional::CrossEntropyFuncOptions().ignore_index(-100));
    opt.zero_grad();
    loss.backward();
    torch::nn::utils::clip_grad_norm_(params, cfg.clip_norm);
    opt.step();

    const double l = loss.item<double>();
    if (!std::isfinite(l))
      throw InvalidArgument(fmt::format("training diverged: loss {} at step {} with lr {} (lower the learning rate: "
                                        "--lr, or the task's --recipe)",
                                        l, step + 1, cfg.lr));
    window_loss += l;
    ++window_n;
    if (step >= cfg.steps - 100) {
      tail_loss += l;
      ++tail_n;
    }
    const bool report = (step + 1) % std::max(1, report_every) == 0 || step + 1 == cfg.steps;
    if (report) {
      const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      res.loss_curve.emplace_back(step + 1, window_loss / window_n);
      if (on_progress) on_progress({step + 1, cfg.steps, window_loss / window_n, lr, secs});
      window_loss = 0.0;
      window_n = 0;
    }
  }
  res.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  res.final_loss = tail_n > 0 ? tail_loss / tail_n : 0.0;

  nlohmann::json meta;
  meta["task"] = std::string(task.name());
  meta["pe"] = std::string(to_string(cfg.pe));
  meta["seed"] = cfg.seed;
  meta["steps"] = cfg.steps;
  meta["batch_size"] = cfg.batch_size;
  meta["train_lengths"] = {cfg.train_lengths.lo, cfg.train_lengths.hi};
  if (cfg.task == TrainTaskKind::associative_recall) meta["ar_queries"] = cfg.ar_queries;
  meta["trained_context"] = res.trained_context;
  meta["optimizer"] = {{"name", "AdamW"},        {"lr", cfg.lr},
                       {"betas", {0.9, 0.98}},   {"weight_decay", cfg.weight_decay},
                       {"warmup_steps", cfg.warmup_steps}, {"schedule", "linear warmup, cosine decay"},
                       {"min_lr_ratio", cfg.min_lr_ratio}, {"clip_norm", cfg.clip_norm}};
  meta["curriculum"] = cfg.curriculum;
  meta["loss"] = "mean cross-entropy over answer tokens (output and <eos>)";
  meta["threads"] = cfg.threads;
  meta["parameters"] = res.parameters;
  meta["train_seconds"] = res.seconds;
  meta["final_loss"] = res.final_loss;
  nlohmann::json curve = nlohmann::json::array();
  for (const auto& [s, l] : res.loss_curve) curve.push_back({s, l});
  meta["loss_curve"] = curve;
  res.metadata_json = meta.dump();
  if (!cfg.out.empty()) save_posenc_checkpoint(cfg.out, model->to_checkpoint(task.symbols(), res.metadata_json));
  return res;
}

}  // namespace

}  // namespace posenc

// The module's one exported symbol (kTorchTrainModelSymbol): every other symbol of the module, its private
// copy of posenc_core included, is hidden (-fvisibility=hidden, --exclude-libs ALL).
extern "C" __attribute__((visibility("default"))) void posenc_torch_train_model(
    const posenc::TrainConfig& config, const std::function<void(const posenc::TrainProgress&)>& on_progress,
    int report_every, posenc::TrainResult& result) {
  result = posenc::train_model_torch(config, on_progress, report_every);
}

// Checked against the loader's declaration.
[[maybe_unused]] static constexpr posenc::detail::TorchTrainModel kSignatureCheck = &posenc_torch_train_model;
