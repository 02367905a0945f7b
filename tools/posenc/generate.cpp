// posenc generate: greedy (or sampled) continuation of a prompt with the KV cache.
#include <chrono>
#include <cstdio>

#include <fmt/format.h>

#include "commands.hpp"
#include "common.hpp"
#include "posenc/generate.hpp"

namespace posenc::cli {

namespace {

struct GenerateArgs {
  ModelArgs model;
  std::string prompt;
  GenerateOptions options;
  bool stats = false;
};

void run_generate(const GenerateArgs& a) {
  auto [model, tok] = load_model(a.model);
  const auto t0 = std::chrono::steady_clock::now();
  const auto res = generate(model, tok, a.prompt, a.options, [](std::string_view piece) {
    std::fwrite(piece.data(), 1, piece.size(), stdout);
    std::fflush(stdout);
  });
  std::fputc('\n', stdout);
  std::fflush(stdout);
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
  cmd->add_option("--prompt", args->prompt, "prompt text")->required();
  cmd->add_option("--max-tokens", args->options.max_new_tokens, "new tokens to generate")->capture_default_str();
  cmd->add_option("--temperature", args->options.temperature, "0 = greedy")->capture_default_str();
  cmd->add_option("--top-p", args->options.top_p, "nucleus sampling threshold")->capture_default_str();
  cmd->add_option("--seed", args->options.seed, "sampling seed")->capture_default_str();
  cmd->add_flag("--stats", args->stats, "print tokens/s to stderr");
  cmd->callback([args] { run_generate(*args); });
}

}  // namespace posenc::cli
