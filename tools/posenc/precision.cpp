// posenc precision --config config.json [--positions 0:1M] [--modes bf16,fp16,...] [--heads N]
//   [--samples N] [--deltas 0,1,16] [--json FILE] [--plot out.png]
// What each dtype of RoPE's cos/sin costs by position, against the fp64 reference
// (library: posenc/precision.hpp).
#include <memory>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "commands.hpp"
#include "common.hpp"
#include "posenc/analysis.hpp"
#include "posenc/config.hpp"
#include "posenc/error.hpp"
#include "posenc/family.hpp"
#include "posenc/precision.hpp"
#include "posenc/scaling.hpp"
#include "scripts.hpp"

namespace posenc::cli {

namespace {

struct PrecisionCliOptions {
  std::string config;
  std::string positions = "0:1M";
  std::string modes;
  std::string deltas = "0,1,16,256,4096";
  int heads = 4;
  int samples = 256;
  uint64_t seed = 18;
  std::string layout = "half";
  bool no_collisions = false;
  std::string json;
  std::string plot;
};

// "A:B", both inclusive; A may be 0; K = 1024, M = 1048576.
std::pair<int64_t, int64_t> parse_range(const std::string& text) {
  const auto colon = text.find(':');
  if (colon == std::string::npos)
    throw UsageError(fmt::format("--positions: expected FIRST:LAST, e.g. 0:1M (got '{}')", text));
  const std::string a = text.substr(0, colon), b = text.substr(colon + 1);
  const int64_t first = a == "0" ? 0 : parse_context_length(a, "--positions (first)");
  const int64_t last = parse_context_length(b, "--positions (last)");
  if (last < first || last >= (int64_t{1} << 40))
    throw UsageError(fmt::format("--positions: need FIRST <= LAST < 2^40 (got '{}')", text));
  return {first, last};
}

void run_precision(const PrecisionCliOptions& opt) {
  const bool data_on_stdout = output_to_stdout({opt.json, opt.plot}, {"--json", "--plot"});
  PrecisionOptions po;
  as_usage_error([&] {
    std::tie(po.first_position, po.last_position) = parse_range(opt.positions);
    if (!opt.modes.empty())
      for (const auto& m : split_list(opt.modes, "--modes")) {
        find_rope_numerics_preset(m, "--modes");
        po.modes.push_back(m);
      }
    po.deltas.clear();
    for (const auto& d : split_list(opt.deltas, "--deltas")) {
      const double v = parse_number(d, "--deltas");
      if (v < 0 || v != static_cast<double>(static_cast<int64_t>(v)) || v > 1e12)
        throw UsageError(fmt::format("--deltas: a non-negative integer (got '{}')", d));
      po.deltas.push_back(static_cast<int64_t>(v));
    }
    po.layout = parse_rope_layout(opt.layout, "--rope-layout");
    return 0;
  });
  po.heads = opt.heads;
  po.samples_per_bucket = opt.samples;
  po.seed = opt.seed;
  po.scan_collisions = !opt.no_collisions;

  const PositionalSpec spec = load_positional_spec(opt.config);
  if (!spec.rope)
    throw ConfigError(fmt::format("{}: no RoPE in this config (position family {})", opt.config,
                                  to_string(spec.family)));
  // Methods that depend on the length (dynamic, longrope) are evaluated at the range's end.
  const RopeFrequencies freqs = compute_rope_frequencies(*spec.rope, po.last_position + 1);
  const PrecisionReport rep = rope_precision_report(freqs, po);
  if (!data_on_stdout) {
    fmt::print("config: {}\n", opt.config);
    fmt::print("{}", format_precision_report(rep));
  }
  const std::string j = precision_report_json(rep);
  if (!opt.json.empty()) write_output(opt.json, j);
  if (!opt.plot.empty()) {
    run_plot("plot_precision.py", j, opt.plot);
    if (!data_on_stdout) fmt::print("plot: {}\n", opt.plot);
  }
}

}  // namespace

void add_precision_command(CLI::App& app) {
  auto opt = std::make_shared<PrecisionCliOptions>();
  auto* sub = app.add_subcommand(
      "precision",
      "Error of RoPE's cos/sin and q·k in each precision mode (float32, exact, bf16, fp16, single-stage variants) "
      "against fp64, by position, and where distinct positions collapse onto one table row");
  sub->add_option("--config", opt->config, "config.json of the model (its RoPE parameters)")
      ->required()
      ->check(non_empty());
  sub->add_option("--positions", opt->positions, "FIRST:LAST, both inclusive; K = 1024, M = 1048576")
      ->capture_default_str();
  sub->add_option("--modes", opt->modes,
                  "comma-separated modes (default: all but fp64): float32, exact, bf16, fp16, bf16-table, "
                  "fp16-table, bf16-inv_freq, fp16-inv_freq, bf16-positions, bf16-angle, fp16-angle");
  sub->add_option("--heads", opt->heads, "random unit (q, k) pairs per position for the q·k error")
      ->check(int_in(1, 1024))
      ->capture_default_str();
  sub->add_option("--samples", opt->samples, "positions sampled per bucket (evenly spaced, ends included)")
      ->check(int_in(2, 1 << 16))
      ->capture_default_str();
  sub->add_option("--deltas", opt->deltas, "q at p against k at p - Δ for each Δ")->capture_default_str();
  sub->add_option("--seed", opt->seed, "seed of the random q, k")->check(seed_value())->capture_default_str();
  sub->add_option("--rope-layout", opt->layout, "pairing of the q·k rotation: half or interleaved")
      ->capture_default_str();
  sub->add_flag("--no-collisions", opt->no_collisions, "skip the scan of every position for collisions");
  add_json_option(sub, opt->json, "the report (schema posenc.precision/1)");
  sub->add_option("--plot", opt->plot, "Write a PNG: max cos/sin and q·k error per mode against position (log axes)")
      ->check(output_path());
  sub->callback([opt] { run_precision(*opt); });
}

}  // namespace posenc::cli
