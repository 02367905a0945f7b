// posenc study: train and evaluate every (task, encoding, seed); `posenc study report DIR` summarises.
#include <cstdio>
#include <filesystem>
#include <set>

#include <fmt/format.h>

#include "commands.hpp"
#include "common.hpp"
#include "posenc/error.hpp"
#include "posenc/study.hpp"
#include "scripts.hpp"

namespace posenc::cli {

namespace {

struct StudyArgs {
  std::string tasks = "copy,reverse,addition,associative_recall";
  std::string pes = "nope,learned,sinusoidal,t5,alibi,rope,rope25";
  std::string seeds = "1,2,3";
  std::string train_lengths = "8:32";
  std::string test_lengths = "8:128";
  std::string scalings = "linear,ntk,yarn,dynamic";
  std::string out;
  StudyConfig config;
  std::string report_dir;
  std::string shard = "0/1";
  std::vector<std::string> recipes;  // TASK:SPEC
  bool no_plots = false;
  RecipeFlags flags;  // common flags given explicitly override that field of the default recipes
};

void run_report(const StudyArgs& a) {
  const StudyReport r = write_study_report(a.report_dir);
  std::fwrite(r.text.data(), 1, r.text.size(), stdout);
  fmt::print("wrote {} and {}\n", r.summary_json.string(), r.summary_csv.string());
  std::fflush(stdout);
  if (a.no_plots) return;
  const std::string plots = (std::filesystem::path(a.report_dir) / "plots").string();
  run_script("study_report.py", {r.summary_json.string(), plots});
}

void run_study_cmd(StudyArgs a) {
  reexec_for_fast_openblas();  // returns only when no re-exec is needed
  StudyConfig& c = a.config;
  c.tasks.clear();
  for (const auto& t : split_list(a.tasks, "--tasks"))
    c.tasks.push_back(as_usage_error([&] { return parse_task_kind(t, "--tasks"); }));
  c.pes.clear();
  for (const auto& p : split_list(a.pes, "--pe"))
    c.pes.push_back(as_usage_error([&] { return parse_train_encoding(p, "--pe"); }));
  c.seeds.clear();
  for (int64_t s : parse_lengths(a.seeds, "--seeds")) c.seeds.push_back(static_cast<uint64_t>(s));
  c.train_lengths = as_usage_error([&] { return parse_length_range(a.train_lengths, "--train-lengths", 1); });
  c.test_lengths = as_usage_error([&] { return parse_length_range(a.test_lengths, "--test-lengths", 8); });
  c.scalings.clear();
  if (a.scalings != "none")
    for (const auto& s : split_list(a.scalings, "--rope-scaling")) c.scalings.push_back(s);
  // Recipes: posenc's defaults, minus the fields set explicitly by --steps,
  // --lr or --batch-size (those apply to every task), then each --recipe.
  c.recipes = default_recipes();
  for (auto& [task, r] : c.recipes) r = a.flags.without_explicit(r);
  std::set<TrainTaskKind> given;
  for (const auto& spec : a.recipes) {
    const auto colon = spec.find(':');
    if (colon == std::string::npos)
      throw UsageError(fmt::format("--recipe: expected TASK:key=value[,key=value] or TASK:none (got '{}')", spec));
    const TrainTaskKind task = as_usage_error([&] { return parse_task_kind(spec.substr(0, colon), "--recipe"); });
    if (!given.insert(task).second)
      throw UsageError(fmt::format("--recipe: task '{}' given twice (put its keys in one --recipe)", to_string(task)));
    const std::string_view body = std::string_view(spec).substr(colon + 1);
    if (body == "none")
      c.recipes.erase(task);
    else
      merge_recipe(c.recipes[task], as_usage_error([&] { return parse_task_recipe(body, "--recipe"); }));  // on top of the default recipe
  }
  std::erase_if(c.recipes, [](const auto& kv) { return kv.second.empty(); });
  c.out = a.out;
  {
    const auto slash = a.shard.find('/');
    try {
      if (slash == std::string::npos) throw std::invalid_argument("no /");
      c.shard = std::stoi(a.shard.substr(0, slash));
      c.shard_count = std::stoi(a.shard.substr(slash + 1));
    } catch (const std::exception&) {
      throw UsageError(fmt::format("--shard: expected K/N (got '{}')", a.shard));
    }
  }
  run_study(c, [](std::string_view line) {
    fmt::print(stderr, "{}\n", line);
    std::fflush(stderr);
  });
  fmt::print("study complete in {}; `posenc study report {}` summarises it\n", a.out, a.out);
}

}  // namespace

void add_study_command(CLI::App& app) {
  auto a = std::make_shared<StudyArgs>();
  CLI::App* cmd = app.add_subcommand(
      "study", "Length-generalization study: train every (task, encoding, seed), evaluate by length (resumable)");
  cmd->add_option("--tasks", a->tasks, "comma-separated tasks")->capture_default_str();
  cmd->add_option("--pe", a->pes, "comma-separated encodings")->capture_default_str();
  cmd->add_option("--seeds", a->seeds, "comma-separated seeds")->capture_default_str();
  cmd->add_option("--train-lengths", a->train_lengths, "training input lengths lo:hi")->capture_default_str();
  cmd->add_option("--test-lengths", a->test_lengths, "test input lengths lo:hi[:step] (step 8 by default)")
      ->capture_default_str();
  cmd->add_option("--samples", a->config.samples, "evaluation samples per model and length")
      ->check(int_in(1, 1000000000))
      ->capture_default_str();
  cmd->add_option("--rope-scaling", a->scalings,
                  "RoPE scalings evaluated on rope/rope25 models, comma-separated (or none)")
      ->capture_default_str();
  add_renamed_option(cmd, "--scalings", "renamed --rope-scaling");
  a->flags.steps = cmd->add_option("--steps", a->config.train.steps, "optimizer steps per model (every task)")
                       ->capture_default_str();
  a->flags.batch_size =
      cmd->add_option("--batch-size", a->config.train.batch_size, "sequences per step (every task)")->capture_default_str();
  cmd->add_option("--dim", a->config.train.dim, "d_model")->capture_default_str();
  cmd->add_option("--layers", a->config.train.n_layers, "decoder layers")->capture_default_str();
  cmd->add_option("--heads", a->config.train.n_heads, "attention heads")->capture_default_str();
  a->flags.lr = cmd->add_option("--lr", a->config.train.lr, "peak learning rate (every task)")->capture_default_str();
  a->flags.curriculum = add_curriculum_option(cmd, a->config.train.curriculum, "(every task)");
  cmd->add_option("--recipe", a->recipes,
                  "TASK:key=value[,...] (keys lr, steps, batch-size, curriculum; set on top of the task's default recipe) or "
                  "TASK:none (the common settings); repeatable. Default: associative_recall:" +
                      to_string(default_recipe(TrainTaskKind::associative_recall)) +
                      " (fields also given by --steps/--lr/--batch-size/--curriculum yield to those)")
      ->take_all();
  cmd->add_option("--ar-queries", a->config.train.ar_queries, "associative_recall: queries per training context (MQAR)")
      ->capture_default_str();
  cmd->add_option("--threads", a->config.train.threads,
                  "torch/OpenMP threads (0 = the runtime's; at most 64 x the hardware threads)")
      ->check(int_in(0, max_threads()))
      ->capture_default_str();
  CLI::Option* out = cmd->add_option("--out", a->out,
                                     "study directory (resumed if it exists; created with its missing parents)")
                         ->check(output_path(true))
                         ->required();
  cmd->add_option("--shard", a->shard, "K/N: run every N-th model starting at K (several processes, one directory)")
      ->capture_default_str();
  CLI::App* report = cmd->add_subcommand("report", "Print the table, MRR and scalings; write summary.json/csv and plots");
  report->add_option("dir", a->report_dir, "study directory")->required();
  report->add_flag("--no-plots", a->no_plots, "skip the matplotlib plots");
  not_required_with(report, {out});  // `study report DIR` reads a study, it does not run one
  cmd->require_subcommand(0, 1);
  cmd->callback([a, report] {
    if (report->parsed()) {
      if (!a->recipes.empty())
        throw ConfigError("--recipe: applies when a study runs, not to `study report` (the report reads the recipes "
                          "from study.json)");
      run_report(*a);
    } else {
      run_study_cmd(*a);
    }
  });
}

}  // namespace posenc::cli
