// posenc detect-layout: which RoPE layout a checkpoint was trained with, from evidence.
#include <cmath>

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
  std::string context;  // "" or "0" = the trained context; else one length (K/M suffix, ppl's parser)
  int64_t scored_tokens = 8192;
  std::string json;  // "" = none, "-" = stdout, else a file written atomically
  bool quiet = false;
};

// --context: "0" (the trained context) or one window length as `posenc ppl --context` takes it (K = 1024,
// M = 1048576), in [kMinWindow, kMaxWindow]. Returns 0 for the trained context.
int64_t parse_detect_context(const std::string& text) {
  if (text.empty() || text == "0") return 0;
  const auto lengths = parse_lengths(text, "--context", kMinWindow, kMaxWindow);
  if (lengths.size() != 1)
    throw UsageError(fmt::format("--context: one window length, not a list (got '{}')", text));
  return lengths[0];
}

void run_detect(const DetectArgs& a) {
  LoadedModel lm = load_model(a.model);
  Model& model = lm.model;
  const Tokenizer& tok = lm.tokenizer;
  if (!a.quiet) print_model_header(stderr, lm, a.model);
  const std::string text = read_text_input(a.text_path, "--text");
  const auto stream = encode_stream(tok, text);
  // A window longer than the text would score the whole text as one shorter window and report it under L (`posenc
  // ppl`'s rule): a --context given so is refused before any work; the default (the trained context) becomes the
  // text's length, said on stderr, so the report names the window actually scored.
  const auto text_tokens = static_cast<int64_t>(stream.size());
  const int64_t context = parse_detect_context(a.context);
  int64_t L = context > 0 ? context : model.trained_context();
  if (text_tokens < L) {
    if (context > 0)
      throw InvalidArgument(fmt::format("--context {}: the text has only {} tokens, so no window would be {} tokens "
                                        "long (give a longer text or a context of at most {})",
                                        L, text_tokens, L, text_tokens));
    if (!a.quiet)
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
                     {"margin_standard_error", e.margin_se},
                     {"inconclusive", !e.conclusive},
                     {"tokens", e.tokens},
                     {"context", e.context},
                     {"angle_precision", std::string(to_string(model.rope().precision))},
                     {"model_format", std::string(to_string(model.source().format))},
                     {"loader_layout", std::string(to_string(model.rope().layout))},
                     {"loader_layout_reason", model.source().layout_reason},
                     // null when the evidence is inconclusive: it neither agrees nor disagrees
                     {"agrees_with_loader", e.conclusive ? nlohmann::json(e.likely == model.rope().layout)
                                                         : nlohmann::json(nullptr)},
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
  if (e.conclusive) {
    fmt::print("likely layout: {} (margin {:.4f} ± {:.4f} nats/token, {:.0f} standard errors)\n", to_string(e.likely),
               e.margin, e.margin_se, e.margin_se > 0 ? e.margin / e.margin_se : INFINITY);
  } else {
    fmt::print("likely layout: inconclusive (margin {:.4f} ± {:.4f} nats/token, not above {} standard errors{}): score "
               "more text or longer windows\n",
               e.margin, e.margin_se, kLayoutEvidenceZ,
               e.context <= 2 ? "; windows of 2 tokens predict only from position 0, where RoPE rotates nothing" : "");
  }
  const char* verdict = !e.conclusive                        ? "the evidence is inconclusive"
                        : e.likely == model.rope().layout ? "the evidence agrees"
                                                           : "THE EVIDENCE DISAGREES";
  fmt::print("loader's layout: {} ({}): {}\n", to_string(model.rope().layout),
             a.model.rope_layout.empty() ? model.source().layout_reason : "--rope-layout", verdict);
}

}  // namespace

void add_detect_layout_command(CLI::App& app) {
  auto args = std::make_shared<DetectArgs>();
  CLI::App* cmd = app.add_subcommand(
      "detect-layout", "Score a text sample under both RoPE layouts and report the checkpoint's likely layout");
  args->model.add_to(*cmd);
  cmd->add_option("--text", args->text_path, "UTF-8 text sample")->required();
  cmd->add_option("--context", args->context,
                  "window length in [2, 1048576], K = 1024, M = 1048576 as ppl's (default, or 0: the trained context)")
      ->check(CLI::Validator(
          [](std::string& text) -> std::string {
            // One check, with evaluate_perplexity's range: a window of 1 token has no prediction.
            try {
              (void)parse_detect_context(text);
            } catch (const UsageError&) {
              return fmt::format("must be 0 (the trained context) or one length in [{}, {}] (an integer, optional K "
                                 "or M suffix as ppl's; got '{}')",
                                 kMinWindow, kMaxWindow, text);
            }
            return "";
          },
          ""));
  cmd->add_option("--scored-tokens", args->scored_tokens, "predictions to score per layout")
      ->transform(length_in(1, int64_t{1} << 40))
      ->capture_default_str();
  add_json_option(cmd, args->json, "the evidence as JSON");
  cmd->add_flag("--quiet", args->quiet, "no model header or notes on stderr");
  add_renamed_option(cmd, "--max-tokens", "renamed --scored-tokens (--max-tokens is generate's new tokens)");
  cmd->callback([args] { run_detect(*args); });
}

}  // namespace posenc::cli
