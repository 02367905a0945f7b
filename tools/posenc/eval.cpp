// posenc eval: the long-context evaluation lab (run / report / merge).
#include <unistd.h>

#include <charconv>
#include <cstdio>
#include <filesystem>

#include <fmt/format.h>

#include "commands.hpp"
#include "common.hpp"
#include "posenc/endpoint.hpp"
#include "posenc/error.hpp"
#include "posenc/eval.hpp"
#include "posenc/io.hpp"
#include "posenc/json_file.hpp"
#include "scripts.hpp"

namespace posenc::cli {

namespace {

struct EvalArgs {
  ModelArgs model;
  std::string haystack;
  std::string tasks;    ///< empty: default_eval_tasks(the model's tokenizer)
  std::string lengths;  ///< empty: default_eval_lengths(the model)
  std::string depths = "0,0.25,0.5,0.75,1";
  int64_t samples = 50;
  std::string scalings = "default";
  std::optional<double> rope_factor;
  std::string controls = "none";
  uint64_t seed = 42;
  int choices = 4;
  double threshold = 0.85;
  double min_baseline = 0.0;
  std::optional<int64_t> ppl_tokens;  ///< unset: 32768 with --haystack, -1 (skip) without
  std::string shard = "0/1";
  std::string out;
  bool log_prompts = false;
  bool quiet = false;
  // eval --endpoint
  std::vector<std::string> endpoints;  ///< URL[=LABEL]
  std::string served_model;
  int concurrency = 1;
  double request_timeout = 600.0;
  int retries = 4;
  std::vector<std::string> model_only_flags;  ///< flags given that apply to an in-process model only
};

struct ReportArgs {
  std::string dir;
  std::optional<double> threshold;
  std::optional<double> min_baseline;
  bool no_plots = false;
};

struct MergeArgs {
  std::vector<std::string> inputs;
  std::string out;
};

std::vector<double> parse_depths(const std::string& text) {
  std::vector<double> out;
  for (const auto& item : split_list(text, "--depths")) {
    double v = 0;
    auto [p, ec] = std::from_chars(item.data(), item.data() + item.size(), v);
    if (ec != std::errc() || p != item.data() + item.size())
      throw UsageError(fmt::format("--depths: '{}' is not a number", item));
    out.push_back(v);
  }
  return out;
}

std::pair<int, int> parse_shard(const std::string& text) {
  const auto slash = text.find('/');
  int i = -1, n = -1;
  if (slash != std::string::npos) {
    auto [p1, e1] = std::from_chars(text.data(), text.data() + slash, i);
    auto [p2, e2] = std::from_chars(text.data() + slash + 1, text.data() + text.size(), n);
    if (e1 != std::errc() || e2 != std::errc() || p1 != text.data() + slash || p2 != text.data() + text.size()) i = n = -1;
  }
  if (n < 1 || i < 0 || i >= n) throw UsageError(fmt::format("--shard: expected i/n with 0 <= i < n (got '{}')", text));
  return {i, n};
}

// This process's argv joined by spaces (Linux /proc), for run.json.
std::string command_line() {
  std::string raw;
  try {
    raw = read_file("/proc/self/cmdline");
  } catch (const Error&) {
    return "";
  }
  for (char& ch : raw)
    if (ch == '\0') ch = ' ';
  while (!raw.empty() && raw.back() == ' ') raw.pop_back();
  return raw;
}

std::string fmt_duration(double s) {
  if (s < 0) return "?";
  const auto t = static_cast<int64_t>(s + 0.5);
  if (t >= 3600) return fmt::format("{}h{:02}m", t / 3600, (t % 3600) / 60);
  if (t >= 60) return fmt::format("{}m{:02}s", t / 60, t % 60);
  return fmt::format("{}s", t);
}

// --tokenizer with --endpoint: a tokenizer file (tokenizer.json, a directory
// holding one, a llama2.c tokenizer) or a model file whose bundled tokenizer
// is used (a GGUF's vocabulary, a posenc checkpoint's symbols).
Tokenizer endpoint_tokenizer(const std::string& path) {
  std::string head;
  std::error_code ec;
  if (std::filesystem::is_regular_file(path, ec)) head = read_file_prefix(path, 8);  // the magic only
  if (head.starts_with("GGUF") || head.starts_with("POSENC01")) {
    ModelArgs m;
    m.model_path = path;
    return load_model(m).tokenizer;
  }
  return load_tokenizer_file(path);
}

void run_endpoint_eval(const EvalArgs& a, EvalConfig c, const std::function<void(const EvalProgress&)>& progress) {
  EndpointEvalConfig ec;
  for (const auto& e : a.endpoints) ec.endpoints.push_back(as_usage_error([&] { return parse_endpoint_spec(e); }));
  ec.served_model = a.served_model;
  ec.options.concurrency = a.concurrency;
  ec.options.request_timeout = a.request_timeout;
  ec.options.retries = a.retries;
  ec.trained_context = a.model.trained_context;
  const Tokenizer tok = endpoint_tokenizer(a.model.tokenizer_path);
  const std::string text = a.haystack.empty() ? std::string() : read_text_input(a.haystack, "--haystack");
  if (!a.quiet) {
    for (const auto& e : ec.endpoints) fmt::print(stderr, "endpoint {} = {}\n", e.label, e.url);
    fmt::print(stderr, "tokenizer: {} ({})\n", a.model.tokenizer_path, tok.describe());
  }
  const EvalRunResult r = run_eval_endpoint(ec, tok, text, std::move(c), progress);
  if (!a.quiet && ::isatty(STDERR_FILENO)) fmt::print(stderr, "\n");
  const JsonDocument summary = read_json_document(r.run_dir / "summary.json");
  fmt::print("{}", format_eval_summary(summary.root()));
  fmt::print("\nrun {} in {}: {} cells computed now ({} samples in {:.1f} s, {:.1f} samples/s), {} of {} cells present\n",
             r.run_id, r.run_dir.string(), r.cells_computed, r.samples_computed, r.seconds,
             r.seconds > 0 ? static_cast<double>(r.samples_computed) / r.seconds : 0.0, r.cells_present, r.cells_total);
  fmt::print("outputs: samples.jsonl, summary.json, summary.csv, run.json{}; `posenc eval report {}` draws the plots\n",
             std::filesystem::exists(r.run_dir / "ppl.json") ? ", ppl.json" : "", a.out);
}

void run_eval_cmd(const EvalArgs& a) {
  const bool served = !a.endpoints.empty();
  if (served && !a.model.model_path.empty())
    throw UsageError("--model and --endpoint are mutually exclusive (an in-process model or a served one)");
  if (!served && a.model.model_path.empty()) throw UsageError("--model or --endpoint is required");
  if (!served) {
    for (const char* f : {"--served-model", "--concurrency", "--request-timeout", "--retries"})
      if (std::find(a.model_only_flags.begin(), a.model_only_flags.end(), f) != a.model_only_flags.end())
        throw UsageError(fmt::format("{}: applies to --endpoint only", f));
  } else {
    for (const auto& f : a.model_only_flags) {
      if (f == "--rope-scaling" || f == "--rope-factor")
        throw UsageError(fmt::format("{}: scaling a served model is the server's business (vLLM --hf-overrides / "
                                     "--rope-scaling, llama-server --rope-scaling / --rope-freq-base / --yarn-orig-ctx); "
                                     "label each endpoint instead: --endpoint URL=yarn",
                                     f));
      if (f != "--served-model" && f != "--concurrency" && f != "--request-timeout" && f != "--retries")
        throw UsageError(fmt::format("{}: applies to an in-process --model, not to --endpoint", f));
    }
    if (a.model.tokenizer_path.empty())
      throw UsageError("--tokenizer: required with --endpoint (a tokenizer.json, a llama2.c tokenizer, or a model file "
                       "whose bundled tokenizer is used): prompts are sent as the served model's token ids");
    for (const auto& e : a.endpoints) as_usage_error([&] { (void)parse_endpoint_spec(e); });
  }
  // --model and --out are required options (CLI11, exit 2); --tokenizer may be
  // omitted for posenc checkpoints with an embedded vocabulary (load_model);
  // --haystack when no task and no perplexity matrix reads it
  // (validate_eval_config names what needs it).
  EvalConfig c;
  c.model_path = served ? std::string() : a.model.model_path;
  c.tokenizer_path = a.model.tokenizer_path;
  c.haystack_path = a.haystack;
  if (!a.tasks.empty()) c.tasks = split_list(a.tasks, "--tasks");
  if (!a.lengths.empty()) c.lengths = parse_lengths(a.lengths, "--context", kMinEvalLength, kMaxEvalLength);
  c.depths = parse_depths(a.depths);
  c.samples = a.samples;
  c.rope_scalings = split_list(a.scalings, "--rope-scaling");
  c.rope_factor = a.rope_factor;
  c.controls.clear();
  for (const auto& s : split_list(a.controls, "--control"))
    c.controls.push_back(as_usage_error([&] { return parse_task_control(s, "--control"); }));
  for (const auto& s : c.rope_scalings) check_rope_scaling_name(s);
  c.seed = a.seed;
  c.choices = a.choices;
  c.threshold = a.threshold;
  c.min_baseline = a.min_baseline;
  c.ppl_tokens = a.ppl_tokens.value_or(a.haystack.empty() ? -1 : 32768);
  std::tie(c.shard_index, c.shard_count) = parse_shard(a.shard);
  c.log_prompts = a.log_prompts;
  c.out = a.out;
  c.command_line = command_line();
  c.git_hash = source_git_hash();
  {
    // Flag errors (exit 2) before loading anything; the defaults that follow
    // the model (tasks, lengths) are stood in for until it is loaded.
    EvalConfig check = c;
    if (check.tasks.empty()) check.tasks = {"kv_retrieval"};
    if (check.lengths.empty()) check.lengths = {256};
    if (served) {
      check.rope_scalings.clear();
      for (const auto& e : a.endpoints) check.rope_scalings.push_back(parse_endpoint_spec(e).label);
      check.scaling_labels = true;
    }
    as_usage_error([&] { validate_eval_config(check); });
  }
  const bool tty = ::isatty(STDERR_FILENO) != 0;
  std::function<void(const EvalProgress&)> progress;
  if (!a.quiet)
    progress = [tty, last = -100.0, finished = false](const EvalProgress& p) mutable {
      // Into a log: a line every 15 s and one when all work is done. The cells finish before the perplexity
      // matrix, so "cells N/N" alone is not the end: it printed a line per report (every second) through the whole
      // matrix, and the last one twice.
      const bool done = p.cells_done == p.cells_total && p.ppl_done == p.ppl_total;
      if (finished || (!tty && p.seconds - last < 15.0 && !done)) return;
      finished = done;
      last = p.seconds;
      const double sps = p.seconds > 0 ? static_cast<double>(p.samples_done) / p.seconds : 0.0;
      fmt::print(stderr, "{}eval: cells {}/{}{}, {:.1f} samples/s, ETA {} [{}]{}", tty ? "\r\033[K" : "", p.cells_done,
                 p.cells_total, p.ppl_total > 0 ? fmt::format(", perplexity {}/{}", p.ppl_done, p.ppl_total) : "", sps,
                 fmt_duration(p.eta_seconds), p.current, tty ? "" : "\n");
      std::fflush(stderr);
    };
  if (served) {
    if (c.tasks.empty()) {
      c.tasks = default_eval_tasks(endpoint_tokenizer(a.model.tokenizer_path));
      as_usage_error([&] {  // e.g. the default name_recall without --haystack
        EvalConfig check = c;
        if (check.lengths.empty()) check.lengths = {256};
        check.rope_scalings = {"default"};
        check.scaling_labels = false;
        validate_eval_config(check);
      });
    }
    run_endpoint_eval(a, std::move(c), progress);
    return;
  }

  LoadedModel lm = load_model(a.model);
  Model& model = lm.model;
  const Tokenizer& tok = lm.tokenizer;
  if (c.lengths.empty()) {
    c.lengths = default_eval_lengths(model);
    c.default_lengths = true;  // those longer than the perplexity text are left out of the matrix, not refused
  }
  for (int64_t L : c.lengths) check_learned_table(model, a.model.model_path, L, "--context");
  check_rope_factor_applies(model, a.rope_factor);
  if (c.tasks.empty()) c.tasks = default_eval_tasks(tok);
  as_usage_error([&] { validate_eval_config(c); });  // e.g. the default name_recall without --haystack
  const std::string text = a.haystack.empty() ? std::string() : read_text_input(a.haystack, "--haystack");
  if (!a.quiet) print_model_header(stderr, lm, a.model);
  const EvalRunResult r = run_eval(model, tok, text, c, progress);
  if (!a.quiet && tty) fmt::print(stderr, "\n");
  const JsonDocument summary = read_json_document(r.run_dir / "summary.json");
  fmt::print("{}", format_eval_summary(summary.root()));
  fmt::print("\nrun {} in {}: {} cells computed now ({} samples in {:.1f} s, {:.1f} samples/s), {} of {} cells present{}\n",
             r.run_id, r.run_dir.string(), r.cells_computed, r.samples_computed, r.seconds,
             r.seconds > 0 ? static_cast<double>(r.samples_computed) / r.seconds : 0.0, r.cells_present, r.cells_total,
             r.groups_reused ? fmt::format(" ({} groups reused from bit-identical encodings)", r.groups_reused) : "");
  fmt::print("outputs: samples.jsonl, summary.json, summary.csv, run.json{}; `posenc eval report {}` draws the plots\n",
             std::filesystem::exists(r.run_dir / "ppl.json") ? ", ppl.json" : "", a.out);
}

void run_report_cmd(const ReportArgs& a) {
  const std::filesystem::path run_dir = resolve_run_dir(a.dir);
  const nlohmann::json summary = rebuild_eval_outputs(run_dir, a.threshold, a.min_baseline);
  const std::string table = format_eval_summary(summary);
  write_file_atomic(run_dir / "report.txt", table);
  fmt::print("{}", table);
  if (!a.no_plots) {
    run_script("eval_report.py", {run_dir.string()});
    fmt::print("\nreport: {} (heatmaps in {}{})\n", (run_dir / "report.html").string(), (run_dir / "plots").string(),
               std::filesystem::exists(run_dir / "ppl.json") ? ", perplexity plot ppl_by_position.png" : "");
  }
}

void run_merge_cmd(const MergeArgs& a) {
  std::vector<std::filesystem::path> in(a.inputs.begin(), a.inputs.end());
  const auto dir = merge_eval_runs(in, a.out);
  const JsonDocument summary = read_json_document(dir / "summary.json");
  fmt::print("{}", format_eval_summary(summary.root()));
  fmt::print("\nmerged {} run directories into {}\n", in.size(), dir.string());
}

}  // namespace

void add_eval_command(CLI::App& app) {
  auto args = std::make_shared<EvalArgs>();
  auto rargs = std::make_shared<ReportArgs>();
  auto margs = std::make_shared<MergeArgs>();
  CLI::App* cmd = app.add_subcommand(
      "eval",
      "Long-context evaluation: tasks x lengths x depths x RoPE scalings, Wilson 95% intervals, effective context, "
      "controls, perplexity matrix; resumable (same arguments = same run id) and shardable (--shard i/n, `eval "
      "merge`). Subcommands: report, merge.");
  args->model.add_to(*cmd);
  args->model.add_kv_dtype_to(*cmd);
  cmd->get_option("--model")->required(false);  // --model or --endpoint (run_eval_cmd checks)
  cmd->add_option("--endpoint", args->endpoints,
                  "evaluate a served model instead of --model: the OpenAI-compatible API base URL[=LABEL] (e.g. "
                  "http://127.0.0.1:8000/v1=yarn; repeatable: several servers of one model, each label a value of the "
                  "scaling axis; default label 'default'); needs --tokenizer; the model: exactly one of --model and "
                  "--endpoint")
      ->check(non_empty());
  cmd->add_option("--served-model", args->served_model,
                  "--endpoint: the model name to request (default: the only one GET /v1/models lists)")
      ->check(non_empty());
  cmd->add_option("--concurrency", args->concurrency, "--endpoint: requests in flight")
      ->check(int_in(1, 1024))
      ->capture_default_str();
  cmd->add_option("--request-timeout", args->request_timeout, "--endpoint: seconds per request")
      ->check(finite_above(0, 86400))
      ->capture_default_str();
  cmd->add_option("--retries", args->retries,
                  "--endpoint: retries of a request on connection errors, 429 and 5xx (exponential backoff, full "
                  "jitter, Retry-After honoured; not an error of type numeric_error, the model's non-finite logits "
                  "for that input: it stops the run at once)")
      ->check(int_in(0, 100))
      ->capture_default_str();
  cmd->add_option("--haystack", args->haystack,
                  "real text for the haystacks and the perplexity matrix (not needed for kv_retrieval and "
                  "associative_recall with --ppl-tokens -1)");
  std::string known;
  for (const auto& t : eval_tasks()) known += (known.empty() ? "" : ", ") + std::string(t.name);
  cmd->add_option("--tasks", args->tasks,
                  "tasks, comma-separated: " + known +
                      " (default: associative_recall for a model trained on it, else name_recall)")
      ->check(non_empty());  // "" must not mean the default
  cmd->add_option("--context", args->lengths,
                  "context lengths in tokens (prompt + answer budget), K = 1024 (default: T/2,T,2T,4T,8T of the "
                  "trained context T, within a learned position table); each in [8, 1048576]")
      ->check(non_empty())  // "" must not mean the default
      ->check(lengths_in("--context", kMinEvalLength, kMaxEvalLength));
  add_renamed_option(cmd, "--lengths", "renamed --context (e.g. --context 256,512,1K)");
  cmd->add_option("--depths", args->depths, "needle depths in [0, 1] (fraction of the context before the needle)")
      ->capture_default_str();
  cmd->add_option("--samples", args->samples, "samples per cell")->check(int_in(1, 1000000))->capture_default_str();
  cmd->add_option("--rope-scaling", args->scalings, "RoPE scalings (rope_type), comma-separated")->capture_default_str();
  cmd->add_option("--rope-factor", args->rope_factor, "scaling factor s (default: max(1, L / trained context))")
      ->check(finite_in(kMinRopeFactorFlag, kMaxRopeFactorFlag));
  cmd->add_option("--control", args->controls,
                  "evidence controls, comma-separated: none, swap, shuffle (absent, the measured chance level, runs "
                  "by itself for forced-choice tasks)")
      ->capture_default_str();
  cmd->add_option("--seed", args->seed, "task generator seed")->check(seed_value())->capture_default_str();
  cmd->add_option("--choices", args->choices, "candidates K of forced-choice tasks")->check(int_in(2, 16))->capture_default_str();
  cmd->add_option("--threshold", args->threshold, "effective context: accuracy >= threshold x short baseline")
      ->check(finite_in(0, 1))
      ->capture_default_str();
  cmd->add_option("--min-baseline", args->min_baseline,
                  "a task is 'not solvable by this model' unless its shortest-length accuracy is significantly above "
                  "chance (Wilson 95% low > the upper Wilson bound of the chance level the absent control measures, "
                  "or > 0 for generation) and >= this")
      ->check(finite_in(0, 1))
      ->capture_default_str();
  cmd->add_option("--ppl-tokens", args->ppl_tokens,
                  "perplexity matrix: scored tokens per (scaling, length) on the haystack text; 0 = all, -1 = skip "
                  "(default: 32768 with --haystack, -1 without)")
      ->transform(length_in(-1, int64_t{1} << 48));
  cmd->add_option("--shard", args->shard, "run the deterministic share i of n of the work (i/n)")->capture_default_str();
  CLI::Option* out = cmd->add_option("--out", args->out,
                                     "output directory, created with its missing parents (the run goes to "
                                     "OUT/<run id>/)")
                         ->check(output_path(true))
                         ->required();
  cmd->add_flag("--log-prompts", args->log_prompts, "samples.jsonl also holds every prompt (large)");
  cmd->add_flag("--quiet", args->quiet, "no progress line");

  CLI::App* report = cmd->add_subcommand("report", "Text summary, heatmaps (PNG) and a self-contained report.html");
  report->add_option("dir", rargs->dir, "run directory (or the --out of `eval`)")->required();
  report->add_option("--threshold", rargs->threshold, "override the run's relative threshold")->check(finite_in(0, 1));
  report->add_option("--min-baseline", rargs->min_baseline, "override the run's solvability baseline")
      ->check(finite_in(0, 1));
  report->add_flag("--no-plots", rargs->no_plots, "text summary only (no matplotlib)");
  report->callback([rargs] { run_report_cmd(*rargs); });

  CLI::App* merge = cmd->add_subcommand("merge", "Combine the shards of one run into one run directory");
  merge->add_option("inputs", margs->inputs, "run directories (or --out directories) of the shards")->required();
  merge->add_option("--out", margs->out, "output directory, created with its missing parents")
      ->check(output_path(true))
      ->required();
  // `eval report DIR` and `eval merge` need neither the model nor eval's --out.
  not_required_with(report, {cmd->get_option("--model"), out});
  not_required_with(merge, {cmd->get_option("--model"), out});
  merge->callback([margs] { run_merge_cmd(*margs); });

  cmd->callback([args, cmd, report, merge] {
    if (cmd->got_subcommand(report) || cmd->got_subcommand(merge)) return;
    args->model_only_flags.clear();
    for (const char* f : {"--rope-scaling", "--rope-factor", "--config", "--rope-theta", "--rope-layout",
                          "--angle-precision", "--quantized-matmul", "--dense-matmul", "--served-model", "--concurrency",
                          "--request-timeout", "--retries"})
      if (cmd->count(f) > 0) args->model_only_flags.emplace_back(f);
    run_eval_cmd(*args);
  });
}

}  // namespace posenc::cli
