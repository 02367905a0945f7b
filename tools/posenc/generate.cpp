// posenc generate: greedy (or sampled) continuation of a prompt with the KV cache.
#include <chrono>
#include <cstdio>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "posenc/io.hpp"

#include "commands.hpp"
#include "common.hpp"
#include "posenc/generate.hpp"
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
};

void run_generate(const GenerateArgs& a) {
  LoadedModel lm = load_model(a.model);
  Model& model = lm.model;
  const Tokenizer& tok = lm.tokenizer;
  // Length-dependent RoPE (dynamic NTK, longrope) changes the frequencies once
  // the text passes the original context: the cached keys are rotated again
  // with the new frequencies. This is an approximation of a full forward at
  // the new length (keys of layers >= 1 come from hidden states computed with
  // the old frequencies); the default policy, refuse, stopped generation
  // there with a CacheError that no flag could lift.
  const bool length_dependent = model.family() == PositionFamily::rope &&
                                find_rope_scaling(model.rope().params.rope_type).depends_on_seq_len;
  if (length_dependent) model.set_rope_change_policy(RopeChangePolicy::rerotate);
  if (!a.quiet) {
    print_model_header(stderr, lm, a.model);
    if (length_dependent)
      fmt::print(stderr,
                 "  cache: rope_type {} depends on the length: cached keys are re-rotated when it changes "
                 "(approximate past the original context)\n",
                 model.rope().params.rope_type);
  }
  GenerateOptions opt = a.options;
  if (a.ignore_eos) opt.stop_at_bos = opt.stop_at_eos = false;
  const auto t0 = std::chrono::steady_clock::now();
  const std::string prompt = a.prompt.text();
  const auto res = generate(model, tok, prompt, opt, [](std::string_view piece) {
    std::fwrite(piece.data(), 1, piece.size(), stdout);
    std::fflush(stdout);
  });
  std::fputc('\n', stdout);
  std::fflush(stdout);
  if (!a.json_path.empty()) {
    nlohmann::json j;
    j["model"] = a.model.model_path;
    j["model_format"] = std::string(to_string(model.source().format));
    j["tokenizer"] = lm.tokenizer_source;
    j["prompt"] = prompt;
    j["prompt_ids"] = res.prompt_tokens;
    j["generated_ids"] = res.new_tokens;
    j["generated_logprobs"] = res.new_token_logprobs;
    j["text"] = res.text;
    j["stop_reason"] = res.stop_reason;
    j["temperature"] = opt.temperature;
    j["top_p"] = opt.top_p;
    j["seed"] = opt.seed;
    if (model.family() == PositionFamily::rope) {
      j["rope_type"] = model.rope().params.rope_type;
      j["rope_layout"] = std::string(to_string(model.rope().layout));
      j["angle_precision"] = std::string(to_string(model.rope().precision));
      j["rope_change_policy"] = length_dependent ? "rerotate" : "refuse";
    }
    j["quantized_matmul"] = std::string(to_string(model.quantized_matmul()));
    write_output(a.json_path, j.dump(2) + "\n");
  }
  if (a.stats) {
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    fmt::print(stderr, "{} prompt + {} new tokens in {:.3f} s ({:.0f} tokens/s)\n", res.prompt_tokens.size(),
               res.new_tokens.size(), s, static_cast<double>(res.prompt_tokens.size() + res.new_tokens.size()) / s);
  }
}

}  // namespace

void add_generate_command(CLI::App& app) {
  auto args = std::make_shared<GenerateArgs>();
  CLI::App* cmd = app.add_subcommand("generate", "Continue a prompt (greedy by default; angle_precision float32)");
  args->model.add_to(*cmd);
  args->prompt.add_to(*cmd, /*required=*/true);
  cmd->add_option("--max-tokens", args->options.max_new_tokens, "new tokens to generate")
      ->check(int_in(0, 1 << 20))
      ->capture_default_str();
  cmd->add_option("--temperature", args->options.temperature, "0 = greedy")
      ->check(finite_in(0, 100))
      ->capture_default_str();
  cmd->add_option("--top-p", args->options.top_p, "nucleus sampling threshold")
      ->check(finite_above(0, 1))
      ->capture_default_str();
  cmd->add_option("--seed", args->options.seed, "sampling seed")->check(seed_value())->capture_default_str();
  cmd->add_flag("--stats", args->stats, "print tokens/s to stderr");
  cmd->add_flag("--ignore-eos", args->ignore_eos, "do not stop at the tokenizer's BOS/EOS: always --max-tokens tokens");
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
