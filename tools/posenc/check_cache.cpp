// posenc check-cache: the position-consistency checker on a real checkpoint.
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "commands.hpp"
#include "common.hpp"
#include "posenc/consistency.hpp"
#include "posenc/error.hpp"
#include "posenc/io.hpp"
#include "posenc/perplexity.hpp"

namespace posenc::cli {

namespace {

struct CheckArgs {
  ModelArgs model;
  std::string text_path;
  ConsistencyOptions options;
  std::string json;  // "" = none, "-" = stdout, else a file written atomically
};

void run_check(const CheckArgs& a) {
  LoadedModel lm = load_model(a.model);
  Model& model = lm.model;
  const Tokenizer& tok = lm.tokenizer;
  print_model_header(stderr, lm, a.model);
  const auto stream = encode_stream(tok, read_file(a.text_path));
  const ConsistencyReport r = check_cache_consistency(model, stream, a.options);
  if (!a.json.empty()) {
    nlohmann::json j;
    j["scenarios"] = nlohmann::json::array();
    for (const auto& s : r.scenarios)
    {
      nlohmann::json js{{"name", s.name}, {"max_abs_logit_diff", s.max_abs_logit_diff}, {"tokens", s.tokens},
                        {"reference", s.reference}};
      if (!s.failure.empty()) js["failure"] = s.failure;
      j["scenarios"].push_back(js);
    }
    j["tolerance"] = r.tolerance;
    j["passed"] = r.passed;
    emit_json(a.json, j);
  }
  if (a.json != "-") {
    fmt::print("{:<30} {:>18} {:>8}  {}\n", "scenario", "max |dlogit|", "tokens", "compared with");
    for (const auto& s : r.scenarios)
      fmt::print("{:<30} {:>18.3e} {:>8}  {}{}{}\n", s.name, s.max_abs_logit_diff, s.tokens, s.reference,
                 s.ok(r.tolerance) ? "" : "   <-- FAIL", s.failure.empty() ? "" : ": " + s.failure);
    fmt::print("{} (tolerance {:g})\n", r.passed ? "PASSED" : "FAILED", r.tolerance);
  }
  if (!r.passed) throw CacheError("position consistency check failed: see the scenarios above");
}

}  // namespace

void add_check_cache_command(CLI::App& app) {
  auto args = std::make_shared<CheckArgs>();
  CLI::App* cmd = app.add_subcommand(
      "check-cache", "Prove that the KV cache keeps position semantics: incremental, chunked, padded, ragged, forked, "
                     "shifted and windowed paths against one full forward");
  args->model.add_to(*cmd);
  cmd->add_option("--text", args->text_path, "UTF-8 text supplying the tokens")->required();
  cmd->add_option("--length", args->options.length, "tokens per sequence (<= the trained context)")
      ->check(int_in(kMinConsistencyLength, 1 << 20))
      ->capture_default_str();
  cmd->add_option("--block-size", args->options.block_size, "KV cache block size")
      ->check(int_in(1, 1 << 16))
      ->capture_default_str();
  cmd->add_option("--tolerance", args->options.tolerance, "max |dlogit| allowed")
      ->check(finite_in(0, 1e6))
      ->capture_default_str();
  add_json_option(cmd, args->json, "the scenarios and the verdict as JSON");
  cmd->callback([args] { run_check(*args); });
}

}  // namespace posenc::cli
