// posenc periods --head-dim 128 --rope-theta 10000,500000 --context 4K,32K,128K,1M
//   [--rope-scaling default,linear,ntk,yarn,llama3 --rope-factor S
//    --original-max-position-embeddings N] [--json FILE] [--csv FILE] [--plot out.png]
// Which RoPE channels have wrapped (period 2π/inv_freq < length) at each length.
#include <algorithm>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "commands.hpp"
#include "common.hpp"
#include "posenc/config.hpp"
#include "scripts.hpp"
#include "posenc/analysis.hpp"
#include "posenc/error.hpp"
#include "posenc/io.hpp"
#include "posenc/scaling.hpp"

namespace posenc::cli {

namespace {

using json = nlohmann::ordered_json;

struct PeriodsOptions {
  int head_dim = 128;
  int rotary_dim = 0;
  std::string thetas;
  std::string lengths;
  std::string scalings;
  std::string factor;
  std::string original;
  std::string low_freq_factor;
  std::string high_freq_factor;
  std::string json;  // "" = none, "-" = stdout (instead of the table), else a file
  std::string csv;
  std::string plot;
};

/// "49-63" style ranges of ascending channel indices; "-" when empty.
std::string ranges(const std::vector<int>& v) {
  if (v.empty()) return "-";
  std::string out;
  std::size_t i = 0;
  while (i < v.size()) {
    std::size_t j = i;
    while (j + 1 < v.size() && v[j + 1] == v[j] + 1) ++j;
    if (!out.empty()) out += ",";
    out += j == i ? fmt::format("{}", v[i]) : fmt::format("{}-{}", v[i], v[j]);
    i = j + 1;
  }
  return out;
}

std::string render_json(const PeriodsRequest& req, const std::vector<PeriodRow>& rows) {
  const bool with_type = req.has_rope_type();
  json arr = json::array();
  for (const auto& r : rows) {
    json o;
    o["rope_theta"] = r.rope_theta;
    o["head_dim"] = r.head_dim;
    if (with_type) o["rope_type"] = r.rope_type;
    o["length"] = r.length;
    o["wrapped"] = r.wrapped;
    o["unwrapped"] = r.unwrapped;
    o["unwrapped_channels"] = r.unwrapped_channels;
    arr.push_back(std::move(o));
  }
  return json{{"rows", arr}}.dump(2) + "\n";
}

std::string render_csv(const PeriodsRequest& req, const std::vector<PeriodRow>& rows) {
  const bool with_type = req.has_rope_type();
  std::string out = with_type ? "rope_theta,head_dim,rope_type,length,wrapped,unwrapped,unwrapped_channels\n"
                              : "rope_theta,head_dim,length,wrapped,unwrapped,unwrapped_channels\n";
  for (const auto& r : rows) {
    out += fmt::format("{},{},", r.rope_theta, r.head_dim);
    if (with_type) out += r.rope_type + ",";
    out += fmt::format("{},{},{},{}\n", r.length, r.wrapped, r.unwrapped, fmt::join(r.unwrapped_channels, " "));
  }
  return out;
}

std::string render_text(const PeriodsRequest& req, const std::vector<PeriodRow>& rows) {
  const bool with_type = req.has_rope_type();
  std::string out = fmt::format(
      "head_dim {} ({} channel pairs); wrapped = period 2π/inv_freq < length; "
      "K = 1024, M = 1048576\n",
      req.head_dim, (req.rotary_dim ? req.rotary_dim : req.head_dim) / 2);
  const std::string type_head = with_type ? fmt::format(" {:>10}", "rope_type") : "";
  out += fmt::format("{:>12}{} {:>10} {:>8} {:>10}  {}\n", "rope_theta", type_head, "length",
                     "wrapped", "unwrapped", "unwrapped channels");
  for (const auto& r : rows)
    out += fmt::format("{:>12}{} {:>10} {:>8} {:>10}  {}\n", r.rope_theta,
                       with_type ? fmt::format(" {:>10}", r.rope_type) : "",
                       format_context_length(r.length), r.wrapped, r.unwrapped,
                       ranges(r.unwrapped_channels));
  return out;
}

std::string plot_data(const PeriodsRequest& req) {
  json curves = json::array();
  for (const auto& c : period_curves(req)) {
    std::string label = fmt::format("θ={}", c.rope_theta);
    if (req.has_rope_type()) {
      label += " " + c.rope_type;
      if (c.rope_type != "default") label += fmt::format(" ×{}", req.factor.value_or(0));
      if (find_rope_scaling(c.rope_type).depends_on_seq_len)
        label += fmt::format(" at seq_len {}", format_context_length(c.seq_len));
    }
    curves.push_back(json{{"label", label}, {"rope_theta", c.rope_theta},
                          {"rope_type", c.rope_type}, {"wavelengths", c.wavelengths}});
  }
  json lengths = json::array();
  for (int64_t l : req.lengths)
    lengths.push_back(json{{"label", format_context_length(l)}, {"value", l}});
  return json{{"title", fmt::format("RoPE channel periods, head_dim {}", req.head_dim)},
              {"head_dim", req.head_dim},
              {"curves", curves},
              {"lengths", lengths}}
      .dump();
}

std::vector<PeriodRow> periods_rows(const PeriodsOptions& opt, PeriodsRequest& req) {
  req.head_dim = opt.head_dim;
  req.rotary_dim = opt.rotary_dim;
  for (const auto& t : split_list(opt.thetas, "--rope-theta"))
    req.rope_thetas.push_back(parse_number(t, "--rope-theta"));
  for (const auto& l : split_list(opt.lengths, "--context"))
    req.lengths.push_back(parse_context_length(l, "--context"));
  if (!opt.scalings.empty()) req.rope_types = split_list(opt.scalings, "--rope-scaling");
  if (!opt.factor.empty()) req.factor = parse_number(opt.factor, "--rope-factor");
  for (const auto& rt : req.rope_types)
    if (rt != "default" && !req.factor)
      throw UsageError(fmt::format("--rope-factor: required with --rope-scaling {}", rt));
  if (!opt.original.empty())
    req.original_max_position_embeddings =
        parse_context_length(opt.original, "--original-max-position-embeddings");
  if (!opt.low_freq_factor.empty())
    req.low_freq_factor = parse_number(opt.low_freq_factor, "--low-freq-factor");
  if (!opt.high_freq_factor.empty())
    req.high_freq_factor = parse_number(opt.high_freq_factor, "--high-freq-factor");
  const auto rows = periods_table(req);
  return rows;
}

void run_periods(const PeriodsOptions& opt) {
  const bool data_on_stdout = output_to_stdout({opt.json, opt.csv, opt.plot}, {"--json", "--csv", "--plot"});
  PeriodsRequest req;
  // Every input of periods is a flag: a bad value is a usage error (exit 2).
  const auto rows = as_usage_error([&] { return periods_rows(opt, req); });
  if (!data_on_stdout) fmt::print("{}", render_text(req, rows));
  if (!opt.json.empty()) write_output(opt.json, render_json(req, rows));
  if (!opt.csv.empty()) write_output(opt.csv, render_csv(req, rows));
  if (!opt.plot.empty()) {
    run_plot("plot_periods.py", plot_data(req), opt.plot);
    if (!data_on_stdout) fmt::print("plot: {}\n", opt.plot);
  }
}

}  // namespace

void add_periods_command(CLI::App& app) {
  auto opt = std::make_shared<PeriodsOptions>();
  auto* sub = app.add_subcommand(
      "periods", "Count RoPE channels whose period 2π/inv_freq fits in each context length");
  sub->add_option("--head-dim", opt->head_dim, "Channels per head (even)")
      ->check(int_in(2, config_limits::kMaxHeadDim))
      ->capture_default_str();
  sub->add_option("--rotary-dim", opt->rotary_dim, "Rotated channels (0 = head_dim)")
      ->check(int_in(0, config_limits::kMaxHeadDim))
      ->capture_default_str();
  sub->add_option("--rope-theta", opt->thetas, "Comma-separated RoPE bases, e.g. 10000,500000")->required();
  sub->add_option("--context", opt->lengths,
                  "Comma-separated context lengths; K = 1024, M = 1048576 (128K = 131072)")
      ->required();
  sub->add_option("--rope-scaling", opt->scalings,
                  "Comma-separated rope_type names from the registry (default, linear, ntk, "
                  "dynamic, yarn, llama3); frequencies are computed with seq_len = each length");
  sub->add_option("--rope-factor", opt->factor, "Scaling factor s (required with any scaling)");
  sub->add_option("--original-max-position-embeddings", opt->original,
                  "Trained context (dynamic, yarn, llama3); K/M suffixes accepted");
  sub->add_option("--low-freq-factor", opt->low_freq_factor, "llama3 (default 1)");
  sub->add_option("--high-freq-factor", opt->high_freq_factor, "llama3 (default 4)");
  add_json_option(sub, opt->json, "the table as {\"rows\": [...]}");
  add_output_option(sub, "--csv", opt->csv, "the table as CSV (unwrapped_channels space-separated in the field)");
  sub->add_option("--plot", opt->plot,
                  "Write a PNG: period per channel (log axis), lengths as horizontal lines")->check(output_path());
  add_renamed_option(sub, "--lengths", "renamed --context (e.g. --context 4K,128K)");
  add_renamed_option(sub, "--factor", "renamed --rope-factor");
  add_renamed_option(sub, "-o,--output", "removed: the table goes to stdout, or to --json FILE / --csv FILE");
  sub->callback([opt] { run_periods(*opt); });
}

}  // namespace posenc::cli
