// posenc train: train a tiny Transformer on a synthetic task with one positional encoding.
#include <cstdio>

#include <fmt/format.h>

#include "commands.hpp"
#include "common.hpp"
#include "posenc/train.hpp"

namespace posenc::cli {

namespace {

struct TrainArgs {
  std::string task = "copy";
  std::string pe = "rope";
  std::string train_lengths = "8:32";
  std::string out;
  TrainConfig config;
  int eval_samples = 100;
  uint64_t eval_seed = 0;  // 0 = --seed
  RecipeFlags flags;  // the task's default recipe sets the fields not given explicitly
};

void run_train(TrainArgs a) {
  reexec_for_fast_openblas();  // returns only when no re-exec is needed
  TrainConfig& c = a.config;
  c.task = parse_task_kind(a.task, "--task");
  c.pe = parse_train_encoding(a.pe, "--pe");
  c.train_lengths = parse_length_range(a.train_lengths, "--train-lengths", 1);
  c.out = a.out;
  const TaskRecipe recipe = a.flags.without_explicit(default_recipe(c.task));
  apply_recipe(c, recipe);
  fmt::print(stderr,
             "posenc train: task {}, pe {}, lengths {}:{}, {} steps, batch {}, lr {}, curriculum {}, seed {}, {} "
             "threads{}\n",
             a.task, a.pe, c.train_lengths.lo, c.train_lengths.hi, c.steps, c.batch_size, c.lr, c.curriculum, c.seed,
             c.threads,
             recipe.empty() ? "" : fmt::format(" (task recipe {})", to_string(recipe)));
  const TrainResult r = train_model(c, [](const TrainProgress& p) {
    fmt::print(stderr, "  step {:5d}/{}  loss {:.4f}  lr {:.2e}  {:.1f} s\n", p.step, p.steps, p.loss, p.lr, p.seconds);
  });
  fmt::print("trained {} parameters in {:.1f} s ({:.1f} ms/step), final answer-token loss {:.4f} nats, trained "
             "context {} positions\n",
             r.parameters, r.seconds, 1e3 * r.seconds / c.steps, r.final_loss, r.trained_context);
  fmt::print("saved {}\n", a.out);
  if (a.eval_samples <= 0) return;
  // In-distribution check with the runtime on the saved file.
  const Model model = Model::load(a.out);
  const Task task(c.task);
  ExactMatchOptions o;
  o.samples = a.eval_samples;
  o.seed = a.eval_seed ? a.eval_seed : c.seed;
  const int lo = c.train_lengths.lo, hi = c.train_lengths.hi;
  o.lengths = {lo, (lo + hi) / 2, hi};
  for (const auto& cell : evaluate_exact_match(model, task, o))
    fmt::print("exact match at {} input tokens: {}/{} = {:.1f}%\n", cell.input_length, cell.correct, cell.samples,
               100.0 * cell.accuracy());
}

}  // namespace

void add_train_command(CLI::App& app) {
  auto a = std::make_shared<TrainArgs>();
  CLI::App* cmd = app.add_subcommand("train", "Train a tiny Transformer on a synthetic task (libtorch) and save it as a posenc checkpoint");
  cmd->add_option("--task", a->task,
                  "copy | reverse | addition | sort | associative_recall (its recipe " +
                      to_string(default_recipe(TrainTaskKind::associative_recall)) +
                      " sets --lr/--steps/--batch-size/--curriculum unless given)")
      ->capture_default_str();
  cmd->add_option("--pe", a->pe, "nope | learned | sinusoidal | t5 | alibi | rope | rope25")->capture_default_str();
  cmd->add_option("--train-lengths", a->train_lengths, "input lengths lo:hi, drawn uniformly")->capture_default_str();
  a->flags.steps = cmd->add_option("--steps", a->config.steps, "optimizer steps")->capture_default_str();
  cmd->add_option("--seed", a->config.seed, "seed of the weights and the data")
      ->check(seed_value())
      ->capture_default_str();
  a->flags.batch_size =
      cmd->add_option("--batch-size", a->config.batch_size, "sequences per step")->capture_default_str();
  cmd->add_option("--dim", a->config.dim, "d_model")->capture_default_str();
  cmd->add_option("--layers", a->config.n_layers, "decoder layers")->capture_default_str();
  cmd->add_option("--heads", a->config.n_heads, "attention heads")->capture_default_str();
  cmd->add_option("--hidden-dim", a->config.hidden_dim, "SwiGLU width (0 = 2 * dim)")->capture_default_str();
  a->flags.lr = cmd->add_option("--lr", a->config.lr, "peak learning rate (AdamW)")
                    ->check(finite_above(0, 10))
                    ->capture_default_str();
  cmd->add_option("--weight-decay", a->config.weight_decay, "AdamW weight decay (matrices)")
      ->check(finite_in(0, 10))
      ->capture_default_str();
  cmd->add_option("--warmup", a->config.warmup_steps, "linear warmup steps before the cosine decay")->capture_default_str();
  cmd->add_option("--clip", a->config.clip_norm, "gradient-norm clipping")
      ->check(finite_in(0, 1e30))
      ->capture_default_str();
  a->flags.curriculum = add_curriculum_option(cmd, a->config.curriculum);
  cmd->add_option("--ar-queries", a->config.ar_queries, "associative_recall: queries per training context (MQAR)")
      ->capture_default_str();
  cmd->add_option("--threads", a->config.threads,
                  "torch/OpenMP threads (fixed for determinism; 0 = the runtime's; at most 64 x the hardware threads)")
      ->check(int_in(0, max_threads()))
      ->capture_default_str();
  // Required: a model trained without a file to save it to would be thrown away after the training.
  cmd->add_option("--out", a->out,
                  "posenc checkpoint to write (e.g. models/copy-rope-s1.pt; the directory must exist)")
      ->check(output_path())
      ->required();
  cmd->add_option("--eval-samples", a->eval_samples, "after saving: samples per length of the in-distribution check (0 = skip)")
      ->capture_default_str();
  cmd->callback([a] { run_train(*a); });
}

}  // namespace posenc::cli
