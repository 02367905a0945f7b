// posenc ppl: perplexity by position bucket, per context length and RoPE scaling.
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <map>

#include <fmt/format.h>
#include <fmt/ranges.h>
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
  std::string contexts;  // empty = from the model: T/2, T, 2T, 4T
  std::string buckets;   // empty = from the model: [0,T/2) [T/2,T) [T,2T) ...
  std::string scalings = "default,linear";
  CLI::Option* scalings_option = nullptr;  // to tell the default from an explicit --rope-scaling
  std::optional<double> rope_factor;
  int64_t max_tokens = 0;
  int64_t chunk_tokens = 0;
  std::string json_path;
  std::string plot_path;
  bool quiet = false;
};

// Bins per bucket in the JSON's fine_buckets (the plot's detail line).
constexpr int kFineBins = 4;

// The default window lengths of a model trained at T: T/2, T, 2T, 4T (each
// at least 2; within a learned position table).
std::vector<int64_t> default_contexts(const Model& model) {
  const int64_t T = std::max<int64_t>(model.trained_context(), 2);
  std::vector<int64_t> out;
  for (int64_t L : {T / 2, T, 2 * T, 4 * T}) {
    L = std::clamp<int64_t>(L, kMinWindow, kMaxWindow);
    if (model.family() == PositionFamily::learned_absolute && model.config().max_position_embeddings > 0 &&
        L > model.config().max_position_embeddings)
      continue;
    if (out.empty() || out.back() != L) out.push_back(L);
  }
  return out;
}

void run_ppl(const PplArgs& a) {
  std::vector<int64_t> contexts;
  if (!a.contexts.empty()) {
    contexts = parse_lengths(a.contexts, "--context", kMinWindow, kMaxWindow);  // checked at parse time too
  }
  const std::vector<int64_t> edges =
      a.buckets.empty() ? std::vector<int64_t>{} : as_usage_error([&] { return parse_bucket_edges(a.buckets); });
  auto scalings = split_list(a.scalings, "--rope-scaling");
  for (const auto& s : scalings) check_rope_scaling_name(s);  // unknown name: exit 2 before any work
  LoadedModel lm = load_model(a.model);
  Model& model = lm.model;
  const Tokenizer& tok = lm.tokenizer;
  const bool default_context = contexts.empty();
  if (default_context) contexts = default_contexts(model);
  for (int64_t L : contexts) check_learned_table(model, a.model.model_path, L, "--context");
  check_rope_factor_applies(model, a.rope_factor);
  if (model.family() != PositionFamily::rope) {
    // RoPE scalings do not apply: the default list shrinks to "default"; an
    // explicit scaling is an error before any work.
    if (a.scalings_option == nullptr || a.scalings_option->count() == 0) scalings = {"default"};
    for (const auto& s : scalings)
      if (s != "default")
        throw ConfigError(fmt::format("--rope-scaling: {} uses {} positions; RoPE scalings do not apply (got {})",
                                      a.model.model_path, to_string(model.family()), s));
  }
  const std::string text = read_text_input(a.text_path, "--text");
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
  // And every context against the text, before any work: a context longer than the text would score the whole text
  // as one shorter window and report it under L. A --context given so is refused; the default contexts (multiples
  // of the trained context) longer than the text are left out, said on stderr.
  const int64_t text_tokens = static_cast<int64_t>(stream.size());
  std::vector<int64_t> dropped;
  for (int64_t L : contexts)
    if (text_tokens < L) {
      if (!default_context)
        throw InvalidArgument(fmt::format("--context {}: the text has only {} tokens, so no window would be {} "
                                          "tokens long (give a longer text or contexts of at most {})",
                                          L, text_tokens, L, text_tokens));
      dropped.push_back(L);
    }
  if (!dropped.empty()) {
    std::erase_if(contexts, [&](int64_t L) { return text_tokens < L; });
    if (contexts.empty())
      throw InvalidArgument(fmt::format("text: {} tokens, shorter than every default context ({}); give a longer "
                                        "text or --context",
                                        text_tokens, fmt::join(dropped, ", ")));
    fmt::print(stderr, "ppl: note: default contexts {} left out: the text has only {} tokens\n",
               fmt::join(dropped, ", "), text_tokens);
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
      o.chunk_tokens = a.chunk_tokens;
      o.bucket_edges = edges;
      o.fine_bins_per_bucket = kFineBins;
      if (!a.quiet)
        o.on_progress = [&, last = -1.0](const PplProgress& p) mutable {
          // A line every second on a terminal, every 15 s into a log.
          if (!tty && p.windows_done != p.windows_total && p.seconds - last < 15.0) return;
          last = p.seconds;
          const double tps = p.seconds > 0 ? static_cast<double>(p.tokens_done) / p.seconds : 0.0;
          // Rounded down: 100% only when every prediction is scored.
          const double share =
              p.tokens_total > 0 ? std::floor(100.0 * static_cast<double>(p.tokens_done) / p.tokens_total) : 0.0;
          fmt::print(stderr, "{}ppl L={} {}: windows {}/{}, {:.0f}% of tokens, {:.0f} tokens/s{}", tty ? "\r" : "",
                     L, s, p.windows_done, p.windows_total, share, tps, tty ? "   " : "\n");
          if (tty && p.windows_done == p.windows_total) fmt::print(stderr, "\n");
        };
      results.push_back(evaluate_perplexity(m, stream, o));
      results.back().rope_scaling = s;
    }

  // Table: one row per (context, scaling); bucket columns = union of all
  // buckets. The scaling columns are printed for RoPE models only (nothing is
  // scaled on an ALiBi, learned, sinusoidal, T5 or NoPE model).
  const bool rope = model.family() == PositionFamily::rope;
  std::map<int64_t, int64_t> columns;
  for (const auto& r : results)
    for (const auto& b : r.buckets) columns[b.start] = std::max(columns[b.start], b.end);
  std::string head = fmt::format("{:>8}", "context");
  if (rope) head += fmt::format(" {:<13} {:>7}", "rope_scaling", "factor");
  head += fmt::format(" {:>9} {:>8} {:>9}", "ppl", "nll", "tokens");
  for (const auto& [s, e] : columns) head += fmt::format(" {:>15}", fmt::format("[{},{})", s, e));
  fmt::print("mean NLL (nats/token) per position bucket, \u00b1 half-width of its 95% bootstrap interval over "
             "windows; trained context {}{}\n{}\n",
             trained,
             rope ? fmt::format("; angle_precision {}", to_string(model.rope().precision))
                  : fmt::format("; positional family {}", to_string(model.family())),
             head);
  bool single_window = false;
  for (const auto& r : results) {
    std::string row = fmt::format("{:>8}", r.context);
    if (rope) row += fmt::format(" {:<13} {:>7.3f}", r.rope_scaling, r.factor);
    row += fmt::format(" {:>9.4f} {:>8.4f} {:>9}", r.ppl, r.nll, r.tokens);
    for (const auto& [s, e] : columns) {
      auto it = std::find_if(r.buckets.begin(), r.buckets.end(), [&](const PplBucket& b) { return b.start == s; });
      if (it == r.buckets.end() || it->tokens == 0) {
        row += fmt::format(" {:>15}", "-");
      } else if (!it->has_interval()) {  // one window: a bootstrap over it has zero width by construction
        single_window = true;
        row += fmt::format(" {:>15}", fmt::format("{:.4f} (1 win)", it->nll()));
      } else {
        row += fmt::format(" {:>15}", fmt::format("{:.4f}\u00b1{:.4f}", it->nll(), (it->nll_ci_high - it->nll_ci_low) / 2));
      }
    }
    fmt::print("{}\n", row);
  }
  if (single_window)
    fmt::print("(1 win): one window holds all of the bucket's predictions: no interval can be estimated from a single "
               "window (a longer text or a shorter --context gives more windows)\n");
  std::fflush(stdout);
  // A tokenizer that is not the model's: far worse than uniform guessing
  // inside the trained context.
  const auto in_range = in_range_nll(results);
  const auto mismatch = in_range ? tokenizer_mismatch_warning(*in_range, model.config().vocab_size, tok, lm.tokenizer_source)
                                 : std::nullopt;
  if (mismatch) fmt::print(stderr, "ppl: warning: {}\n", *mismatch);

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
    // Tokens per forward within a window (--chunk-tokens, or its automatic value): how the windows ran, not what
    // they gave (the same NLL for any value).
    j["chunk_tokens"] = a.chunk_tokens > 0 ? a.chunk_tokens : ppl_auto_chunk_tokens(model.config().vocab_size);
    j["trained_context_source"] = model.trained_context_source();
    j["model_format"] = std::string(to_string(model.source().format));
    if (model.family() == PositionFamily::rope) {
      j["rope_type"] = model.rope().params.rope_type;
      // Every window is scored from an empty cache at the frequencies one
      // forward over it computes (frozen for its length when it runs in
      // chunks): a length-dependent method's frequencies never change under
      // cached keys, which is what the recompute policy guarantees.
      j["rope_change_policy"] = std::string(to_string(model.rope_change_policy()));
    }
    j["quantized_matmul"] = std::string(to_string(model.quantized_matmul()));
    j["dense_matmul"] = std::string(to_string(model.dense_matmul()));
    j["kv_dtype"] = std::string(to_string(model.kv_cache_dtype()));
    j["kernels"] = kernels_json();  // what its timing depends on (the results do not)
    j["buckets"] = edges.empty() ? "trained_context" : "--buckets";
    j["bootstrap"] = {{"resamples", PplOptions{}.bootstrap_resamples}, {"level", 0.95}, {"unit", "window"}};
    j["fine_bins_per_bucket"] = kFineBins;
    j["tokenizer_mismatch"] = mismatch ? nlohmann::json(*mismatch) : nlohmann::json();
    j["position_warning"] = position_warning_json();
    j["results"] = nlohmann::json::array();
    for (const auto& r : results) j["results"].push_back(ppl_result_json(r));
    if (!a.json_path.empty()) {
      write_output(a.json_path, j.dump(2, ' ', false, nlohmann::json::error_handler_t::replace) + "\n");
      if (!a.quiet && a.json_path != "-") fmt::print(stderr, "wrote {}\n", a.json_path);
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
  args->model.add_kv_dtype_to(*cmd);
  cmd->add_option("--text", args->text_path, "UTF-8 text file to score")->required();
  cmd->add_option("--context", args->contexts,
                  "window lengths L, comma-separated (K = 1024); default: T/2,T,2T,4T for the model's trained context T "
                  "(within a learned position table); each in [2, 1048576]")
      ->check(non_empty())  // "" must not mean the default
      ->check(lengths_in("--context", kMinWindow, kMaxWindow));
  cmd->add_option("--buckets", args->buckets,
                  "position bucket edges, comma-separated, from 0 and increasing (e.g. 0,64,128,256; a last bucket runs "
                  "from the last edge to L); default: [0,T/2) [T/2,T) [T,2T) [2T,4T) ... (T the trained context), "
                  "those starting below L: the same edges at every L, so the last may end past L (it holds positions "
                  "below L only)")
      ->check(non_empty());  // "" must not mean the default
  args->scalings_option = cmd->add_option("--rope-scaling", args->scalings,
                  "RoPE scalings (rope_type), comma-separated: default, linear, ntk, dynamic, yarn, llama3, longrope, ... "
                  "or native (the model's own parameters, or --config's)")
      ->capture_default_str();
  cmd->add_option("--rope-factor", args->rope_factor,
                  "scaling factor s for every method (default: max(1, L / trained context))")
      ->check(finite_in(kMinRopeFactorFlag, kMaxRopeFactorFlag));
  cmd->add_option("--scored-tokens", args->max_tokens,
                  "score about N tokens: stop after ceil(N/(L-1)) windows (0 = whole text)")
      ->transform(length_in(0, int64_t{1} << 40));
  add_renamed_option(cmd, "--max-tokens", "renamed --scored-tokens (--max-tokens is generate's new tokens)");
  cmd->add_option("--chunk-tokens", args->chunk_tokens,
                  "tokens per forward within a window (the same NLL for any value; K = 1024); 0 = as many as keep a "
                  "chunk's logits within 64 MiB (512 for a 32000-token vocabulary, 32768 for a 512-token one)")
      ->capture_default_str()
      ->transform(length_in(0, int64_t{1} << 20));
  add_json_option(cmd, args->json_path, "the results as JSON");
  cmd->add_option("--plot", args->plot_path,
                  "also draw NLL by position bucket with its 95% band, one colour per scaling, one panel per context, and the "
                  "difference to default below (PNG, matplotlib)")->check(output_path());
  cmd->add_flag("--quiet", args->quiet, "no header or progress");
  cmd->callback([args] {
    // --json -: the table goes to stderr
    const StdoutForData data({args->json_path, args->plot_path}, {"--json", "--plot"});
    run_ppl(*args);
  });
}

}  // namespace posenc::cli
