// posenc decay --head-dim 128 --rope-theta 10000 --max-distance 65536
//   [--csv FILE|-] [--plot FILE.png]
// RoFormer's long-term decay bound (Su et al. 2021, §3.4.3) over distance.
#include <filesystem>
#include <memory>
#include <string>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "commands.hpp"
#include "common.hpp"
#include "posenc/config.hpp"
#include "scripts.hpp"
#include "posenc/analysis.hpp"
#include "posenc/error.hpp"
#include "posenc/io.hpp"

namespace posenc::cli {

namespace {

struct DecayOptions {
  int head_dim = 128;
  std::string rope_theta = "10000";
  std::string max_distance = "65536";
  std::string csv;
  std::string plot;
};

void run_decay(const DecayOptions& opt) {
  distinct_outputs({opt.csv, opt.plot}, {"--csv", "--plot"});
  // Every input of decay is a flag: a bad value is a usage error (exit 2).
  const double theta = as_usage_error([&] { return parse_number(opt.rope_theta, "--rope-theta"); });
  const int64_t max_distance =
      as_usage_error([&] { return parse_context_length(opt.max_distance, "--max-distance"); });
  const auto curve = as_usage_error([&] { return rope_decay_curve(opt.head_dim, theta, max_distance); });

  std::string csv = "distance,bound\n";
  for (const auto& p : curve) csv += fmt::format("{},{:.10g}\n", p.distance, p.bound);

  if (opt.csv.empty() && opt.plot.empty()) {
    fmt::print("{}", csv);
    return;
  }
  write_output(opt.csv, csv);
  if (!opt.plot.empty()) {
    nlohmann::ordered_json data;
    data["title"] =
        fmt::format("RoPE long-term decay, head_dim {}, rope_theta {}", opt.head_dim, theta);
    data["head_dim"] = opt.head_dim;
    data["rope_theta"] = theta;
    nlohmann::ordered_json d = nlohmann::ordered_json::array();
    nlohmann::ordered_json b = nlohmann::ordered_json::array();
    for (const auto& p : curve) {
      d.push_back(p.distance);
      b.push_back(p.bound);
    }
    data["distance"] = std::move(d);
    data["bound"] = std::move(b);
    run_plot("plot_decay.py", data.dump(),
                opt.plot);
  }
  if (opt.csv == "-") return;  // stdout carries the CSV only
  // Short summary on stdout when the curve went to files.
  fmt::print("RoFormer decay bound (1/(d/2)) Σ_j |S_j(r)|, head_dim {}, rope_theta {}: {} points "
             "(every r in [0, 1024], then 200 log-spaced per decade to {})\n",
             opt.head_dim, theta, curve.size(), max_distance);
  for (const auto& p : curve)
    if (p.distance == 0 || p.distance == 1 || p.distance == 10 || p.distance == 100 ||
        p.distance == 1000 || p.distance == max_distance)
      fmt::print("  r = {:>8}  bound = {:.6g}\n", p.distance, p.bound);
  if (!opt.csv.empty()) fmt::print("csv: {}\n", opt.csv);
  if (!opt.plot.empty()) fmt::print("plot: {}\n", opt.plot);
}

}  // namespace

void add_decay_command(CLI::App& app) {
  auto opt = std::make_shared<DecayOptions>();
  auto* sub = app.add_subcommand(
      "decay",
      "RoFormer long-term decay: relative upper bound (1/(d/2)) Σ_j |S_j(r)| vs distance r. "
      "Grid: every integer r in [0, 1024], then 200 log-spaced distances per decade up to "
      "--max-distance. Without --csv/--plot the CSV goes to stdout");
  sub->add_option("--head-dim", opt->head_dim, "Channels per head d (even)")
      ->check(int_in(2, config_limits::kMaxHeadDim))
      ->capture_default_str();
  sub->add_option("--rope-theta", opt->rope_theta, "RoPE base")->capture_default_str();
  sub->add_option("--max-distance", opt->max_distance,
                  "Largest relative distance (K = 1024, M = 1048576)")
      ->capture_default_str();
  add_output_option(sub, "--csv", opt->csv, "distance,bound");
  sub->add_option("--plot", opt->plot, "Write a PNG of the curve")->check(output_path());
  sub->callback([opt] { run_decay(*opt); });
}

}  // namespace posenc::cli
