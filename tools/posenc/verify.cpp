// posenc verify: another engine's dumped RoPE tensors against posenc's
// reference for a config; on a mismatch, the ranked catalogue of known mistakes.
#include <fmt/format.h>

#include "commands.hpp"
#include "common.hpp"
#include "posenc/error.hpp"
#include "posenc/tensor_dump.hpp"
#include "posenc/verify.hpp"

namespace posenc::cli {

namespace {

struct VerifyArgs {
  std::string config;
  std::vector<std::string> dumps;
  std::string dump_layout = "tokens,heads,head_dim";
  std::string rope_layout;  // "" = the config's
  double tolerance_factor = 1.0;
  bool list = false;
  std::string json;
};

void run_verify(const VerifyArgs& a) {
  if (a.list) {
    for (const auto& m : rope_mistake_catalogue()) fmt::print("{:<34} {}\n{:<34} {}\n", m.id, m.title, "", m.report);
    return;
  }
  if (a.config.empty()) throw UsageError("--config: required (a config.json or a bare rope_scaling object)");
  if (a.dumps.empty()) throw UsageError("--dump: required (.npy, .npz or safetensors files)");
  VerifyOptions options;
  std::optional<RopeLayout> layout;
  as_usage_error([&] {
    options.dump_layout = parse_dump_layout(a.dump_layout, "--dump-layout");
    if (!a.rope_layout.empty()) layout = parse_rope_layout(a.rope_layout, "--rope-layout");
  });
  options.tolerance_factor = a.tolerance_factor;
  const VerifyReference ref = load_verify_reference(a.config, layout);
  TensorDump dump = TensorDump::open(a.dumps.front());
  for (std::size_t i = 1; i < a.dumps.size(); ++i) dump.merge(TensorDump::open(a.dumps[i]));
  const VerifyResult r = verify_rope(ref, dump, options);
  if (!a.json.empty()) write_output(a.json, verify_result_json(r) + "\n");
  if (a.json != "-") fmt::print("{}", format_verify_report(r));
  if (!r.pass) throw Error(fmt::format("verify: {} does not match the reference", r.source));
}

}  // namespace

void add_verify_command(CLI::App& app) {
  auto args = std::make_shared<VerifyArgs>();
  CLI::App* cmd = app.add_subcommand(
      "verify", "Check an engine's dumped RoPE tensors (q/q_rope/position_ids, k/k_rope, cos/sin, inv_freq) against "
                "posenc's reference for a config; on a mismatch, name the known mistake they match");
  cmd->add_option("--config", args->config, "config.json, or a bare rope_scaling object with head_dim and rope_theta");
  cmd->add_option("--dump", args->dumps, "dump file(s): .npy (array named by the file stem), .npz, safetensors")
      ->delimiter(',');
  cmd->add_option("--dump-layout", args->dump_layout,
                  "axis order of q/k: tokens,heads,head_dim or batch,heads,tokens,head_dim")
      ->capture_default_str();
  cmd->add_option("--rope-layout", args->rope_layout, "half or interleaved (default: the config's architecture)");
  cmd->add_option("--tolerance-factor", args->tolerance_factor, "multiplies every dtype tolerance")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  cmd->add_flag("--list-mistakes", args->list, "print the catalogue of known mistakes with their bug reports");
  add_json_option(cmd, args->json, "the verdict, errors by channel/position and ranked hypotheses as JSON");
  cmd->callback([args] { run_verify(*args); });
}

}  // namespace posenc::cli
