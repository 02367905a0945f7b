// posenc ppl: perplexity by position bucket, per context length and RoPE scaling.
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <map>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "commands.hpp"
#include "common.hpp"
#include "posenc/error.hpp"
#include "posenc/io.hpp"
#include "posenc/perplexity.hpp"
#include "scripts.hpp"

namespace posenc::cli {

namespace {

struct PplArgs {
  ModelArgs model;
  std::string text_path;
  std::string contexts = "256,512,1024,2048";
  std::string scalings = "default,linear";
  CLI::Option* scalings_option = nullptr;  // to tell the default from an explicit --rope-scaling
  std::optional<double> rope_factor;
  int64_t max_tokens = 0;
  std::string json_path;
  std::string plot_path;
  bool quiet = false;
};

void run_ppl(const PplArgs& a) {
  const auto contexts = parse_lengths(a.contexts, "--context");
  for (int64_t L : contexts)
    if (L < 2 || L > (int64_t{1} << 20))
      throw UsageError(fmt::format("--context: must be in [2, 1048576] (got {})", L));
  auto scalings = split_list(a.scalings, "--rope-scaling");
  for (const auto& s : scalings) is_rope_scaling_name(s);  // unknown name -> ConfigError before any work
  LoadedModel lm = load_model(a.model);
  Model& model = lm.model;
  const Tokenizer& tok = lm.tokenizer;
  if (model.family() != PositionFamily::rope) {
    // RoPE scalings do not apply: the default list shrinks to "default"; an
    // explicit scaling is an error before any work.
    if (a.scalings_option == nullptr || a.scalings_option->count() == 0) scalings = {"default"};
    for (const auto& s : scalings)
      if (s != "default")
        throw ConfigError(fmt::format("--rope-scaling: {} uses {} positions; RoPE scalings do not apply (got {})",
                                      a.model.model_path, to_string(model.family()), s));
  }
  const std::string text = read_file(a.text_path);
  const auto stream = encode_stream(tok, text);
  const bool tty = ::isatty(STDERR_FILENO) != 0;
  if (!a.quiet) {
    print_model_header(stdout, lm, a.model);
    fmt::print("text:  {} ({} tokens{})\n\n", a.text_path, stream.size(),
               tok.bos_id() ? " incl. one BOS per block" : "; this tokenizer adds no BOS");
  }
  std::fflush(stdout);

  const int64_t trained = model.trained_context();
  // Every (context, scaling) setup is built before any work, so a method
  // missing its parameters (llama3 without --config, ...) fails at once.
  if (model.family() == PositionFamily::rope)
    for (int64_t L : contexts)
      for (const auto& s : scalings) try {
          rope_setup_for_context(model.rope(), trained, s, L, a.rope_factor);
        } catch (const ConfigError& e) {
          throw ConfigError(fmt::format("--rope-scaling {}: {}; pass the method's parameters with --config (a "
                                        "config.json or a bare rope_scaling object)",
                                        s, e.what()));
        }
  std::vector<PplResult> results;
  for (int64_t L : contexts)
    for (const auto& s : scalings) {
      Model m = model;
      if (model.family() == PositionFamily::rope)
        m.set_rope(rope_setup_for_context(model.rope(), trained, s, L, a.rope_factor));
      PplOptions o;
      o.context = L;
      o.max_tokens = a.max_tokens;
      if (!a.quiet)
        o.on_progress = [&, last = -1.0](const PplProgress& p) mutable {
          // A line every second on a terminal, every 15 s into a log.
          if (!tty && p.windows_done != p.windows_total && p.seconds - last < 15.0) return;
          last = p.seconds;
          const double tps = p.seconds > 0 ? static_cast<double>(p.tokens_done) / p.seconds : 0.0;
          fmt::print(stderr, "{}ppl L={} {}: windows {}/{}, {:.0f} tokens/s{}", tty ? "\r" : "", L, s,
                     p.windows_done, p.windows_total, tps, tty ? "   " : "\n");
          if (tty && p.windows_done == p.windows_total) fmt::print(stderr, "\n");
        };
      results.push_back(evaluate_perplexity(m, stream, o));
      results.back().rope_scaling = s;
    }

  // Table: one row per (context, scaling); bucket columns = union of all buckets.
  std::map<int64_t, int64_t> columns;
  for (const auto& r : results)
    for (const auto& b : r.buckets) columns[b.start] = b.end;
  std::string head = fmt::format("{:>8} {:<13} {:>7} {:>9} {:>8} {:>9}", "context", "rope_scaling", "factor",
                                 "ppl", "nll", "tokens");
  for (const auto& [s, e] : columns) head += fmt::format(" {:>12}", fmt::format("[{},{})", s, e));
  fmt::print("mean NLL (nats/token) per position bucket{}\n{}\n",
             model.family() == PositionFamily::rope
                 ? fmt::format("; angle_precision {}", to_string(model.rope().precision))
                 : fmt::format("; positional family {}", to_string(model.family())),
             head);
  for (const auto& r : results) {
    std::string row = fmt::format("{:>8} {:<13} {:>7.3f} {:>9.4f} {:>8.4f} {:>9}", r.context, r.rope_scaling,
                                  r.factor, r.ppl, r.nll, r.tokens);
    for (const auto& [s, e] : columns) {
      auto it = std::find_if(r.buckets.begin(), r.buckets.end(), [&](const PplBucket& b) { return b.start == s; });
      row += it != r.buckets.end() && it->tokens > 0 ? fmt::format(" {:>12.4f}", it->nll()) : fmt::format(" {:>12}", "-");
    }
    fmt::print("{}\n", row);
  }
  std::fflush(stdout);

  if (!a.json_path.empty() || !a.plot_path.empty()) {
    nlohmann::json j;
    j["model"] = a.model.model_path;
    j["text"] = a.text_path;
    j["tokens_total"] = stream.size();
    j["positional_family"] = std::string(to_string(model.family()));
    if (model.family() == PositionFamily::rope) {
      j["rope_layout"] = std::string(to_string(model.rope().layout));
      j["angle_precision"] = std::string(to_string(model.rope().precision));
    }
    j["trained_context"] = trained;
    j["trained_context_source"] = model.trained_context_source();
    j["model_format"] = std::string(to_string(model.source().format));
    if (model.family() == PositionFamily::rope) j["rope_type"] = model.rope().params.rope_type;
    j["quantized_matmul"] = std::string(to_string(model.quantized_matmul()));
    j["results"] = nlohmann::json::array();
    for (const auto& r : results) {
      nlohmann::json jr{{"context", r.context}, {"rope_scaling", r.rope_scaling}, {"factor", r.factor},
                        {"ppl", r.ppl},         {"nll", r.nll},                   {"tokens", r.tokens},
                        {"windows", r.windows}};
      jr["buckets"] = nlohmann::json::array();
      for (const auto& b : r.buckets)
        jr["buckets"].push_back({{"start", b.start}, {"end", b.end}, {"nll", b.nll()}, {"tokens", b.tokens}});
      j["results"].push_back(jr);
    }
    if (!a.json_path.empty()) {
      write_output(a.json_path, j.dump(2) + "\n");
      if (!a.quiet) fmt::print(stderr, "wrote {}\n", a.json_path);
    }
    if (!a.plot_path.empty()) {
      run_plot("plot_ppl.py", j.dump() + "\n", a.plot_path);
      if (!a.quiet) fmt::print(stderr, "wrote {}\n", a.plot_path);
    }
  }
}

}  // namespace

void add_ppl_command(CLI::App& app) {
  auto args = std::make_shared<PplArgs>();
  CLI::App* cmd = app.add_subcommand(
      "ppl", "Perplexity by position bucket for each context length and RoPE scaling (angle_precision float32 "
             "by default: the numerics the model was trained with)");
  args->model.add_to(*cmd);
  cmd->add_option("--text", args->text_path, "UTF-8 text file to score")->required();
  cmd->add_option("--context", args->contexts, "window lengths L, comma-separated (K = 1024)")->capture_default_str();
  args->scalings_option = cmd->add_option("--rope-scaling", args->scalings,
                  "RoPE scalings (rope_type), comma-separated: default, linear, ntk, dynamic, yarn, llama3, longrope, ... "
                  "or native (the model's own parameters, or --config's)")
      ->capture_default_str();
  cmd->add_option("--rope-factor", args->rope_factor,
                  "scaling factor s for every method (default: max(1, L / trained context))")
      ->check(finite_above(0, 1e6));
  cmd->add_option("--scored-tokens", args->max_tokens,
                  "score about N tokens: stop after ceil(N/(L-1)) windows (0 = whole text)")
      ->check(int_in(0, int64_t{1} << 40));
  add_renamed_option(cmd, "--max-tokens", "renamed --scored-tokens (--max-tokens is generate's new tokens)");
  add_json_option(cmd, args->json_path, "the results as JSON");
  cmd->add_option("--plot", args->plot_path,
                  "also draw NLL by position bucket, one line per scaling, one panel per context (PNG, matplotlib)")->check(output_path());
  cmd->add_flag("--quiet", args->quiet, "no header or progress");
  cmd->callback([args] {
    const StdoutForData data({args->json_path}, {"--json"});  // --json -: the table goes to stderr
    run_ppl(*args);
  });
}

}  // namespace posenc::cli
