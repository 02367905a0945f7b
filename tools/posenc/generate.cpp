// posenc generate: greedy (or sampled) continuation of a prompt with the KV cache.
#include <unistd.h>

#include <chrono>
#include <cstdio>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "commands.hpp"
#include "common.hpp"
#include "posenc/generate.hpp"
#include "posenc/io.hpp"
#include "posenc/perplexity.hpp"
#include "posenc/scaling.hpp"

namespace posenc::cli {

namespace {

struct GenerateArgs {
  ModelArgs model;
  PromptArgs prompt;
  GenerateOptions options;
  bool stats = false;
  bool ignore_eos = false;
  std::string json_path;
  bool quiet = false;
  CLI::Option* rope_scaling_option = nullptr;  // given or the default ("native")
  std::string rope_change_policy = "recompute";
};

void run_generate(const GenerateArgs& a) {
  GenerateOptions opt = a.options;
  check_rope_scaling_name(opt.rope_scaling);  // an unknown name: exit 2, before loading
  opt.rope_change_policy = parse_rope_change_policy(a.rope_change_policy, "--rope-change-policy");
  LoadedModel lm = load_model(a.model);
  Model& model = lm.model;
  const Tokenizer& tok = lm.tokenizer;
  // A model without RoPE first: "not --rope-scaling native" would blame a flag the user may not have passed.
  check_rope_factor_applies(model, opt.rope_factor);
  if (opt.rope_factor && (opt.rope_scaling == "native" || opt.rope_scaling == "default"))
    throw UsageError(fmt::format("--rope-factor: applies to a --rope-scaling method (linear, ntk, yarn, ...), not "
                                 "--rope-scaling {}{} (got --rope-factor {})",
                                 opt.rope_scaling, a.rope_scaling_option->count() > 0 ? "" : " (the default)",
                                 *opt.rope_factor));
  if (model.family() != PositionFamily::rope && opt.rope_scaling != "native" && opt.rope_scaling != "default")
    throw ConfigError(fmt::format("--rope-scaling: {} uses {} positions; RoPE scalings do not apply (got {})",
                                  a.model.model_path, to_string(model.family()), opt.rope_scaling));
  // Length-dependent RoPE (dynamic NTK, longrope) changes the frequencies once
  // the text passes the original context: generate() applies
  // --rope-change-policy (default recompute: the sequence is re-prefilled with
  // the new frequencies, so every step equals a full forward at its length).
  const std::string method = opt.rope_scaling == "native" && model.family() == PositionFamily::rope
                                 ? model.rope().params.rope_type
                                 : opt.rope_scaling;
  const bool length_dependent = model.family() == PositionFamily::rope && find_rope_scaling(method).depends_on_seq_len;
  if (!a.quiet) {
    print_model_header(stderr, lm, a.model);
    if (model.family() == PositionFamily::rope && opt.rope_scaling != "native")
      fmt::print(stderr, "  rope scaling: {}{} (as ppl applies it to a window of prompt + --max-tokens tokens)\n",
                 opt.rope_scaling, opt.rope_factor ? fmt::format(", factor {:g}", *opt.rope_factor) : "");
    if (length_dependent)
      fmt::print(stderr, "  cache: rope_type {} depends on the length: rope change policy {} when it changes ({})\n",
                 method, to_string(opt.rope_change_policy),
                 opt.rope_change_policy == RopeChangePolicy::recompute ? "re-prefill: exact, costs a forward"
                 : opt.rope_change_policy == RopeChangePolicy::hf      ? "cached keys keep their rotation, as "
                                                                         "transformers: drifts from a full forward"
                 : opt.rope_change_policy == RopeChangePolicy::rerotate
                     ? "cached keys re-rotated: exact only for single-layer attention"
                     : "an error past the switch point");
  }
  if (a.ignore_eos) opt.stop_at_bos = opt.stop_at_eos = false;
  // Past the trained context x the rope_scaling factor: load_model's position warning prints it once (generate()
  // chains to it).
  const auto t0 = std::chrono::steady_clock::now();
  const std::string prompt = a.prompt.text();
  // The text ends with a newline however generation ends: an error part-way (a NumericError, a CacheError of
  // --rope-change-policy refuse, a PositionError) left the text without one, and the error message (or, with
  // stderr elsewhere, the shell's prompt) was glued onto its last word.
  bool printed = false;
  const auto end_line = [&] {
    if (!printed) return;
    std::fputc('\n', stdout);
    std::fflush(stdout);
    printed = false;
  };
  GenerateResult res;
  try {
    res = generate(model, tok, prompt, opt, [&](std::string_view piece) {
      std::fwrite(piece.data(), 1, piece.size(), stdout);
      std::fflush(stdout);
      printed = true;
    });
  } catch (...) {
    end_line();
    throw;
  }
  printed = true;  // the prompt alone (no new token) is a line too
  end_line();
  if (res.stop_reason == "position_limit") {
    // The nearer of the two ends generate() stops at: --max-position, or a learned position table's last row.
    const int64_t table = model.family() == PositionFamily::learned_absolute ? model.config().max_position_embeddings : -1;
    if (model.max_position() >= 0 && (table <= 0 || model.max_position() + 1 < table))
      fmt::print(stderr, "stopped: the next token would pass --max-position {} (positions 0 .. {} may be fed; "
                 "stop_reason position_limit)\n", model.max_position(), model.max_position());
    else
      fmt::print(stderr, "stopped: the learned position table ends at {} positions (stop_reason position_limit)\n",
                 table);
  }
  if (!a.json_path.empty()) {
    nlohmann::json j;
    j["model"] = a.model.model_path;
    j["model_format"] = std::string(to_string(model.source().format));
    j["tokenizer"] = lm.tokenizer_source;
    j["prompt"] = prompt;
    j["prompt_ids"] = res.prompt_tokens;
    j["generated_ids"] = res.new_tokens;
    j["generated_logprobs"] = res.new_token_logprobs;
    // Sampled byte tokens need not form UTF-8: the text is written with each invalid byte as U+FFFD (the ids above
    // keep every token) and text_is_utf8 says whether it was replaced.
    j["text"] = res.text;
    j["text_is_utf8"] = !first_invalid_utf8(res.text).has_value();
    j["stop_reason"] = res.stop_reason;
    j["trained_context"] = res.trained_context;
    j["passed_trained_context_at"] =
        res.passed_trained_context_at >= 0 ? nlohmann::json(res.passed_trained_context_at) : nlohmann::json(nullptr);
    j["position_warning"] = position_warning_json();
    j["positional_family"] = std::string(to_string(model.family()));
    j["temperature"] = opt.temperature;
    j["top_p"] = opt.top_p;
    j["seed"] = opt.seed;
    if (model.family() == PositionFamily::rope) {
      j["rope_type"] = res.rope_type;  // of the setup applied (--rope-scaling), not the model's base setup
      j["rope_scaling"] = res.rope_scaling;
      j["rope_factor"] = res.rope_factor ? nlohmann::json(*res.rope_factor) : nlohmann::json(nullptr);
      j["rope_context"] = res.rope_context;
      j["rope_layout"] = std::string(to_string(model.rope().layout));
      j["angle_precision"] = std::string(to_string(model.rope().precision));
      j["rope_change_policy"] = res.rope_change_policy;
      j["rope_switch_point"] = res.rope_switch_point;
      j["rope_recomputes"] = res.rope_recomputes;
      j["tokens_reprefilled"] = res.tokens_reprefilled;
    }
    j["quantized_matmul"] = std::string(to_string(model.quantized_matmul()));
    j["dense_matmul"] = std::string(to_string(model.dense_matmul()));
    j["kv_dtype"] = std::string(to_string(model.kv_cache_dtype()));
    j["prefill_seconds"] = res.prefill_seconds;
    j["decode_seconds"] = res.decode_seconds;
    j["kernels"] = kernels_json();  // what the timings depend on (the results do not)
    write_output(a.json_path, j.dump(2, ' ', false, nlohmann::json::error_handler_t::replace) + "\n");
  }
  if (a.stats) {
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    fmt::print(stderr, "{} prompt + {} new tokens in {:.3f} s ({:.0f} tokens/s)\n", res.prompt_tokens.size(),
               res.new_tokens.size(), s, static_cast<double>(res.prompt_tokens.size() + res.new_tokens.size()) / s);
    fmt::print(stderr, "prefill {:.4f} s, decode {:.4f} s ({:.3f} ms/token)", res.prefill_seconds,
               res.decode_seconds,
               res.new_tokens.size() > 1 ? 1e3 * res.decode_seconds / static_cast<double>(res.new_tokens.size() - 1) : 0.0);
    if (res.rope_change_policy != "none" && !res.rope_change_policy.empty())
      fmt::print(stderr, "; rope change policy {}: {} re-prefills, {} tokens re-run", res.rope_change_policy,
                 res.rope_recomputes, res.tokens_reprefilled);
    fmt::print(stderr, "\n");
  }
}

}  // namespace

void add_generate_command(CLI::App& app) {
  auto args = std::make_shared<GenerateArgs>();
  CLI::App* cmd = app.add_subcommand("generate", "Continue a prompt (greedy by default; angle_precision float32)");
  args->model.add_to(*cmd);
  args->model.add_kv_dtype_to(*cmd);
  args->prompt.add_to(*cmd, /*required=*/true);
  cmd->add_option("--max-tokens", args->options.max_new_tokens, "new tokens to generate")
      ->transform(length_in(0, 1 << 20))
      ->capture_default_str();
  cmd->add_option("--temperature", args->options.temperature, "0 = greedy")
      ->check(finite_in(0, 100))
      ->capture_default_str();
  cmd->add_option("--top-p", args->options.top_p, "nucleus sampling threshold")
      ->check(finite_above(0, 1))
      ->capture_default_str();
  cmd->add_option("--seed", args->options.seed, "sampling seed")->check(seed_value())->capture_default_str();
  args->rope_scaling_option = cmd->add_option("--rope-scaling", args->options.rope_scaling,
                  "RoPE scaling (rope_type) applied as ppl applies it to a window of prompt + --max-tokens tokens: "
                  "native (the model's own parameters, or --config's), default, linear, ntk, dynamic, yarn, llama3, "
                  "longrope, ...")
      ->capture_default_str();
  cmd->add_option("--rope-factor", args->options.rope_factor,
                  "scaling factor s of --rope-scaling (default: max(1, (prompt + --max-tokens) / trained context))")
      ->check(finite_in(kMinRopeFactorFlag, kMaxRopeFactorFlag));
  cmd->add_option("--rope-change-policy", args->rope_change_policy,
                  "when a length-dependent rope_type (dynamic, longrope) changes its frequencies under the cache: "
                  "recompute (re-prefill, exact), hf (cached keys keep their rotation, as transformers), refuse, "
                  "rerotate (exact only for single-layer attention)")
      ->check(CLI::IsMember({"recompute", "hf", "refuse", "rerotate"}))
      ->capture_default_str();
  cmd->add_flag("--stats", args->stats, "print tokens/s, prefill/decode time and re-prefills to stderr");
  cmd->add_flag("--ignore-eos", args->ignore_eos,
                "do not stop at the tokenizer's BOS/EOS: --max-tokens tokens (fewer only where a learned position "
                "table ends)");
  add_json_option(cmd, args->json_path,
                  "prompt ids, generated ids, their log-probabilities (temperature 1) and the text as JSON");
  cmd->add_flag("--quiet", args->quiet,
                "do not print the model's provenance (format, layout, trained context) to stderr");
  cmd->callback([args] {
    const StdoutForData data({args->json_path}, {"--json"});  // --json -: the generated text goes to stderr
    run_generate(*args);
  });
}

}  // namespace posenc::cli
