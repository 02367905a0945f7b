// posenc detect-layout: which RoPE layout a checkpoint was trained with, from evidence.
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "commands.hpp"
#include "common.hpp"
#include "posenc/error.hpp"
#include "posenc/io.hpp"
#include "posenc/perplexity.hpp"

namespace posenc::cli {

namespace {

struct DetectArgs {
  ModelArgs model;
  std::string text_path;
  int64_t context = 0;
  int64_t scored_tokens = 8192;
  std::string json;  // "" = none, "-" = stdout, else a file written atomically
};

void run_detect(const DetectArgs& a) {
  LoadedModel lm = load_model(a.model);
  Model& model = lm.model;
  const Tokenizer& tok = lm.tokenizer;
  print_model_header(stderr, lm, a.model);
  const std::string text = read_text_input(a.text_path, "--text");
  const auto stream = encode_stream(tok, text);
  // A window longer than the text would score the whole text as one shorter window and report it under L (`posenc
  // ppl`'s rule): a --context given so is refused before any work; the default (the trained context) becomes the
  // text's length, said on stderr, so the report names the window actually scored.
  const auto text_tokens = static_cast<int64_t>(stream.size());
  int64_t L = a.context > 0 ? a.context : model.trained_context();
  if (text_tokens < L) {
    if (a.context > 0)
      throw InvalidArgument(fmt::format("--context {}: the text has only {} tokens, so no window would be {} tokens "
                                        "long (give a longer text or a context of at most {})",
                                        L, text_tokens, L, text_tokens));
    fmt::print(stderr,
               "detect-layout: note: the text has only {} tokens, fewer than the trained context {}: scored as one "
               "window of {} tokens\n",
               text_tokens, L, text_tokens);
    L = std::max<int64_t>(text_tokens, kMinWindow);  // fewer than 2 tokens: evaluate_perplexity names the text
  }
  const LayoutEvidence e = detect_rope_layout(model, stream, L, a.scored_tokens);
  if (!a.json.empty()) {
    nlohmann::json j{{"likely_layout", std::string(to_string(e.likely))},
                     {"nll_half", e.nll_half},
                     {"nll_interleaved", e.nll_interleaved},
                     {"margin", e.margin},
                     {"tokens", e.tokens},
                     {"context", e.context},
                     {"angle_precision", std::string(to_string(model.rope().precision))},
                     {"model_format", std::string(to_string(model.source().format))},
                     {"loader_layout", std::string(to_string(model.rope().layout))},
                     {"loader_layout_reason", model.source().layout_reason},
                     {"agrees_with_loader", e.likely == model.rope().layout},
                     {"position_warning", position_warning_json()}};
    emit_json(a.json, j);
    if (a.json == "-") return;
  }
  fmt::print("scored {} tokens in windows of {} (angle_precision {})\n", e.tokens, e.context,
             to_string(model.rope().precision));
  fmt::print("  half        (rotate_half, GPT-NeoX):       NLL {:.4f} nats/token (ppl {:.3f})\n", e.nll_half,
             std::exp(e.nll_half));
  fmt::print("  interleaved (GPT-J, RoFormer, llama2.c):   NLL {:.4f} nats/token (ppl {:.3f})\n",
             e.nll_interleaved, std::exp(e.nll_interleaved));
  fmt::print("likely layout: {} (margin {:.4f} nats/token{})\n", to_string(e.likely), e.margin,
             e.margin < 0.05 ? "; weak evidence: score more text" : "");
  fmt::print("loader's layout: {} ({}): {}\n", to_string(model.rope().layout),
             a.model.rope_layout.empty() ? model.source().layout_reason : "--rope-layout",
             e.likely == model.rope().layout ? "the evidence agrees" : "THE EVIDENCE DISAGREES");
}

}  // namespace

void add_detect_layout_command(CLI::App& app) {
  auto args = std::make_shared<DetectArgs>();
  CLI::App* cmd = app.add_subcommand(
      "detect-layout", "Score a text sample under both RoPE layouts and report the checkpoint's likely layout");
  args->model.add_to(*cmd);
  cmd->add_option("--text", args->text_path, "UTF-8 text sample")->required();
  cmd->add_option("--context", args->context,
                  "window length in [2, 1048576] (default, or 0: the trained context)")
      ->check(CLI::Validator(
          [](std::string& text) -> std::string {
            // One check, with evaluate_perplexity's range: a window of 1 token has no prediction.
            if (text == "0") return "";
            const std::string e = int_in(kMinWindow, kMaxWindow)(text);
            return e.empty() ? e : fmt::format("must be 0 (the trained context) or an integer in [{}, {}] (got '{}')",
                                               kMinWindow, kMaxWindow, text);
          },
          ""));
  cmd->add_option("--scored-tokens", args->scored_tokens, "predictions to score per layout")
      ->check(int_in(1, int64_t{1} << 40))
      ->capture_default_str();
  add_json_option(cmd, args->json, "the evidence as JSON");
  add_renamed_option(cmd, "--max-tokens", "renamed --scored-tokens (--max-tokens is generate's new tokens)");
  cmd->callback([args] { run_detect(*args); });
}

}  // namespace posenc::cli
