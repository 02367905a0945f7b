// The length-generalization study: orchestration (resumable) and report.
#include "posenc/study.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <optional>
#include <map>
#include <set>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <omp.h>
#include <nlohmann/json.hpp>

#include "posenc/error.hpp"
#include "posenc/io.hpp"
#include "posenc/stats.hpp"

namespace posenc {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

json train_settings(const TrainConfig& t) {
  return {{"steps", t.steps},
          {"batch_size", t.batch_size},
          {"dim", t.dim},
          {"n_layers", t.n_layers},
          {"n_heads", t.n_heads},
          {"hidden_dim", t.hidden_dim},
          {"rope_theta", t.rope_theta},
          {"alibi_max_bias", t.alibi_max_bias},
          {"t5_num_buckets", t.t5_num_buckets},
          {"t5_max_distance", t.t5_max_distance},
          {"sinusoidal_base", t.sinusoidal_base},
          {"lr", t.lr},
          {"weight_decay", t.weight_decay},
          {"warmup_steps", t.warmup_steps},
          {"min_lr_ratio", t.min_lr_ratio},
          {"clip_norm", t.clip_norm},
          {"curriculum", t.curriculum},
          {"ar_queries", t.ar_queries}};
}

/// What must match between a study directory and a resumed run.
json fixed_settings(const StudyConfig& c) {
  json s{{"train_lengths", {c.train_lengths.lo, c.train_lengths.hi}},
         {"test_lengths", {c.test_lengths.lo, c.test_lengths.hi, c.test_lengths.step}},
         {"samples", c.samples},
         {"scalings", c.scalings},
         {"train", train_settings(c.train)}};
  json recipes = json::object();  // of the study's tasks only: a recipe for a task not run changes nothing
  for (const auto& [task, r] : c.recipes)
    if (!r.empty() && std::find(c.tasks.begin(), c.tasks.end(), task) != c.tasks.end())
      recipes[std::string(to_string(task))] = to_string(r);
  if (!recipes.empty()) s["recipes"] = recipes;
  return s;
}

/// "train/lr: 0.003 in the directory, 0.01 requested; ..." for the leaves that differ.
std::string settings_difference(const json& have, const json& want) {
  const json a = have.flatten(), b = want.flatten();
  std::vector<std::string> out;
  auto shown = [](const json& j, const std::string& key) { return j.contains(key) ? j[key].dump() : "absent"; };
  for (const auto& [key, v] : a.items())
    if (!b.contains(key) || b[key] != v) out.push_back(fmt::format("{}: {} in the directory, {} requested", key.substr(1), v.dump(), shown(b, key)));
  for (const auto& [key, v] : b.items())
    if (!a.contains(key)) out.push_back(fmt::format("{}: absent in the directory, {} requested", key.substr(1), v.dump()));
  return fmt::format("{}", fmt::join(out, "; "));
}

/// The TrainConfig of one model: the common settings, then the task's recipe.
TrainConfig model_train_config(const StudyConfig& c, TrainTaskKind task, TrainEncoding pe, uint64_t seed) {
  TrainConfig t = c.train;
  if (const auto it = c.recipes.find(task); it != c.recipes.end()) apply_recipe(t, it->second);
  t.task = task;
  t.pe = pe;
  t.seed = seed;
  t.train_lengths = c.train_lengths;
  return t;
}

std::string unit_name(TrainTaskKind task, TrainEncoding pe, uint64_t seed) {
  return fmt::format("{}-{}-s{}", to_string(task), to_string(pe), seed);
}

json cells_json(const std::vector<ExactMatchCell>& cells) {
  json a = json::array();
  for (const auto& c : cells)
    a.push_back({{"length", c.input_length},
                 {"samples", c.samples},
                 {"correct", c.correct},
                 {"can_run", c.can_run},
                 {"note", c.note}});
  return a;
}

std::string hms(double s) {
  const auto t = static_cast<int64_t>(s + 0.5);
  return t >= 3600 ? fmt::format("{}h{:02d}m", t / 3600, (t % 3600) / 60)
                   : fmt::format("{}m{:02d}s", t / 60, t % 60);
}

bool is_rope(TrainEncoding pe) { return pe == TrainEncoding::rope || pe == TrainEncoding::rope25; }

}  // namespace

std::vector<int> study_test_lengths(const StudyConfig& c) {
  std::vector<int> out;
  for (int n = c.test_lengths.lo; n <= c.test_lengths.hi; n += c.test_lengths.step) out.push_back(n);
  return out;
}

void run_study(const StudyConfig& cfg, const std::function<void(std::string_view)>& log) {
  if (cfg.out.empty()) throw ConfigError("--out: the study needs an output directory");
  if (cfg.tasks.empty() || cfg.pes.empty() || cfg.seeds.empty())
    throw ConfigError("--tasks/--pe/--seeds: each needs at least one entry");
  if (cfg.samples < 1) fail_field<ConfigError>("--samples", "must be >= 1", cfg.samples);
  if (cfg.shard_count < 1 || cfg.shard < 0 || cfg.shard >= cfg.shard_count)
    throw ConfigError(fmt::format("--shard: need 0 <= K < N (got {}/{})", cfg.shard, cfg.shard_count));
  for (const auto& s : cfg.scalings) (void)find_rope_scaling(s);  // ConfigError for unknown names
  for (TrainTaskKind task : cfg.tasks)  // bad hyper-parameters fail before study.json is written
    for (TrainEncoding pe : cfg.pes) validate_train_config(model_train_config(cfg, task, pe, 1));
  // Evaluation runs the runtime's OpenMP kernels: use the training thread
  // count there too (with more threads than free cores, OpenMP's spin-waiting
  // made one evaluation 20x slower in a measurement on this 2-core machine).
  if (cfg.train.threads > 0) omp_set_num_threads(cfg.train.threads);
  const fs::path study_json = cfg.out / "study.json";
  json study;
  if (fs::exists(study_json)) {
    study = json::parse(read_file(study_json), nullptr, false);
    if (!study.is_object() || study.value("format", "") != "posenc-study")
      throw ConfigError(fmt::format("{}: not a posenc study file", study_json.string()));
    if (study["settings"] != fixed_settings(cfg))
      throw ConfigError(fmt::format("--out: {} holds a study run with other settings ({}); use the same settings to "
                                    "resume it, or another --out",
                                    cfg.out.string(), settings_difference(study["settings"], fixed_settings(cfg))));
  } else {
    study = {{"format", "posenc-study"}, {"version", 1}, {"settings", fixed_settings(cfg)},
             {"tasks", json::array()},   {"pes", json::array()},  {"seeds", json::array()}};
  }
  auto add_unique = [](json& arr, const json& v) {
    if (std::find(arr.begin(), arr.end(), v) == arr.end()) arr.push_back(v);
  };
  for (auto t : cfg.tasks) add_unique(study["tasks"], std::string(to_string(t)));
  for (auto p : cfg.pes) add_unique(study["pes"], std::string(to_string(p)));
  for (auto s : cfg.seeds) add_unique(study["seeds"], s);
  study["threads"] = cfg.train.threads;
  write_file_atomic(study_json, study.dump(2) + "\n");

  const std::vector<int> lengths = study_test_lengths(cfg);
  const int total = static_cast<int>(cfg.tasks.size() * cfg.pes.size() * cfg.seeds.size());
  int index = 0, done_now = 0;
  double work_seconds = 0.0;
  const auto t_start = std::chrono::steady_clock::now();
  for (uint64_t seed : cfg.seeds)
    for (TrainTaskKind tk : cfg.tasks)
      for (TrainEncoding pe : cfg.pes) {
        ++index;
        if ((index - 1) % cfg.shard_count != cfg.shard) continue;
        const std::string name = unit_name(tk, pe, seed);
        const std::string tag = fmt::format("[{}/{}] {}", index, total, name);
        const fs::path model_path = cfg.out / "models" / (name + ".pt");
        const fs::path eval_path = cfg.out / "evals" / (name + ".json");
        if (fs::exists(eval_path)) {
          const json e = json::parse(read_file(eval_path), nullptr, false);
          if (e.is_object() && e.contains("results") && e.value("samples", 0) == cfg.samples) {
            log(fmt::format("{}: evaluated already, skipped", tag));
            continue;
          }
        }
        const auto t_unit = std::chrono::steady_clock::now();
        const Task task(tk);
        std::optional<Model> model;
        if (fs::exists(model_path)) {
          try {
            model = Model::load(model_path);
            log(fmt::format("{}: checkpoint exists, training skipped", tag));
          } catch (const Error& e) {
            log(fmt::format("{}: unreadable checkpoint ({}), retraining", tag, e.what()));
          }
        }
        if (!model) {
          TrainConfig tc = model_train_config(cfg, tk, pe, seed);
          tc.out = model_path;
          log(fmt::format("{}: training {} steps of {} sequences, lr {}", tag, tc.steps, tc.batch_size, tc.lr));
          const TrainResult r = train_model(
              tc,
              [&](const TrainProgress& p) {
                log(fmt::format("{}:   step {}/{} loss {:.4f} ({:.0f} s)", tag, p.step, p.steps, p.loss, p.seconds));
              },
              std::max(1, tc.steps / 4));
          log(fmt::format("{}: trained in {:.1f} s ({:.1f} ms/step), final loss {:.4f}", tag, r.seconds,
                          1e3 * r.seconds / tc.steps, r.final_loss));
          model = Model::load(model_path);
        }
        const json meta = json::parse(model->metadata_json(), nullptr, false);
        json ev{{"task", std::string(to_string(tk))},
                {"pe", std::string(to_string(pe))},
                {"seed", seed},
                {"model", fs::relative(model_path, cfg.out).string()},
                {"train_seconds", meta.value("train_seconds", 0.0)},
                {"final_loss", meta.value("final_loss", 0.0)},
                {"parameters", meta.value("parameters", 0)},
                {"trained_context", model->config().max_position_embeddings},
                {"samples", cfg.samples},
                {"results", json::object()}};
        const auto t_eval = std::chrono::steady_clock::now();
        ExactMatchOptions o;
        o.lengths = lengths;
        o.samples = cfg.samples;
        o.seed = seed;
        const auto base = evaluate_exact_match(*model, task, o);
        ev["results"]["default"] = cells_json(base);
        if (is_rope(pe))
          for (const auto& s : cfg.scalings) {
            o.rope_scaling = s;
            ev["results"][s] = cells_json(evaluate_exact_match(*model, task, o));
          }
        const double eval_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_eval).count();
        ev["eval_seconds"] = eval_s;
        write_file_atomic(eval_path, ev.dump(1) + "\n");
        int64_t id_c = 0, id_n = 0, ood_c = 0, ood_n = 0;
        for (const auto& c : base) {
          const bool in = c.input_length <= cfg.train_lengths.hi && c.input_length >= cfg.train_lengths.lo;
          (in ? id_c : ood_c) += c.correct;
          (in ? id_n : ood_n) += c.can_run ? c.samples : cfg.samples;
        }
        const double unit_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_unit).count();
        work_seconds += unit_s;
        ++done_now;
        const double eta = work_seconds / done_now * (total - index) / cfg.shard_count;
        log(fmt::format("{}: in-distribution {:.1f}%, beyond {:.1f}%; eval {:.1f} s; elapsed {}, about {} left", tag,
                        id_n ? 100.0 * id_c / id_n : 0.0, ood_n ? 100.0 * ood_c / ood_n : 0.0, eval_s,
                        hms(std::chrono::duration<double>(std::chrono::steady_clock::now() - t_start).count()),
                        hms(eta)));
      }
}

// ---- report ---------------------------------------------------------------------------

namespace {

struct Cell {
  int64_t correct = 0, samples = 0;
  bool can_run = true;
  int seeds = 0;
};

struct Bucket {
  std::string label;
  int lo = 0, hi = 0;  // inclusive input lengths
  bool in_distribution = false;
};

std::vector<Bucket> make_buckets(int train_lo, int train_hi, int test_lo, int test_hi) {
  std::vector<Bucket> b;
  if (test_lo < train_lo) b.push_back({fmt::format("<{}", train_lo), 1, train_lo - 1, false});
  b.push_back({fmt::format("{}-{} (train)", train_lo, train_hi), train_lo, train_hi, true});
  const double mult[] = {1.0, 1.5, 2.0, 3.0, 4.0};
  for (int i = 0; i + 1 < 5; ++i) {
    const int lo = static_cast<int>(std::floor(train_hi * mult[i])) + 1;
    const int hi = static_cast<int>(std::floor(train_hi * mult[i + 1]));
    if (lo > test_hi) break;
    b.push_back({fmt::format("{}-{}", lo, hi), lo, hi, false});
  }
  const int lo4 = 4 * train_hi + 1;
  if (lo4 <= test_hi) b.push_back({fmt::format("{}-{}", lo4, test_hi), lo4, test_hi, false});
  return b;
}

std::string fmt_cell(const Cell& c) {
  if (!c.can_run) return "cannot run";
  if (c.samples == 0) return "-";
  const Interval w = wilson_interval(c.correct, c.samples);
  const double p = 100.0 * c.correct / c.samples;
  return fmt::format("{:5.1f} [{:4.1f},{:5.1f}]", p, 100.0 * w.low, 100.0 * w.high);
}

json cell_json(const Cell& c) {
  json j{{"correct", c.correct}, {"samples", c.samples}, {"can_run", c.can_run}, {"seeds", c.seeds}};
  if (c.can_run && c.samples > 0) {
    const Interval w = wilson_interval(c.correct, c.samples);
    j["accuracy"] = static_cast<double>(c.correct) / c.samples;
    j["wilson95"] = {w.low, w.high};
  } else {
    j["accuracy"] = nullptr;
  }
  return j;
}

std::string csv_escape(const std::string& s) { return s.find(',') == std::string::npos ? s : "\"" + s + "\""; }

/// Average ranks (1 = best) of `scores`, higher is better; ties share the mean rank.
std::vector<double> average_ranks(const std::vector<double>& scores) {
  const std::size_t n = scores.size();
  std::vector<std::size_t> idx(n);
  for (std::size_t i = 0; i < n; ++i) idx[i] = i;
  std::stable_sort(idx.begin(), idx.end(), [&](std::size_t a, std::size_t b) { return scores[a] > scores[b]; });
  std::vector<double> rank(n);
  for (std::size_t i = 0; i < n;) {
    std::size_t j = i;
    while (j + 1 < n && scores[idx[j + 1]] == scores[idx[i]]) ++j;
    const double r = (static_cast<double>(i + 1) + static_cast<double>(j + 1)) / 2.0;
    for (std::size_t k = i; k <= j; ++k) rank[idx[k]] = r;
    i = j + 1;
  }
  return rank;
}

}  // namespace

StudyReport write_study_report(const fs::path& dir) {
  const fs::path study_json = dir / "study.json";
  if (!fs::exists(study_json)) throw IoError(fmt::format("{}: no study here (study.json missing)", dir.string()));
  const json study = json::parse(read_file(study_json), nullptr, false);
  if (!study.is_object() || study.value("format", "") != "posenc-study")
    throw ConfigError(fmt::format("{}: not a posenc study file", study_json.string()));
  const json& st = study["settings"];
  const int train_lo = st["train_lengths"][0], train_hi = st["train_lengths"][1];
  const int test_lo = st["test_lengths"][0], test_hi = st["test_lengths"][1];
  std::vector<std::string> tasks = study["tasks"], pes = study["pes"];
  const std::vector<uint64_t> seeds = study["seeds"];
  const std::vector<Bucket> buckets = make_buckets(train_lo, train_hi, test_lo, test_hi);

  // (task, pe, scaling, seed) -> cells by length
  struct Run {
    std::string task, pe;
    uint64_t seed;
    json results;
    double train_seconds, eval_seconds;
  };
  std::vector<Run> runs;
  if (fs::exists(dir / "evals"))
    for (const auto& e : fs::directory_iterator(dir / "evals")) {
      if (e.path().extension() != ".json") continue;
      const json j = json::parse(read_file(e.path()), nullptr, false);
      if (!j.is_object() || !j.contains("results")) continue;
      runs.push_back({j["task"], j["pe"], j["seed"], j["results"], j.value("train_seconds", 0.0),
                      j.value("eval_seconds", 0.0)});
    }
  std::sort(runs.begin(), runs.end(), [](const Run& a, const Run& b) {
    return std::tie(a.task, a.pe, a.seed) < std::tie(b.task, b.pe, b.seed);
  });
  StudyReport rep;
  rep.evaluations = static_cast<int>(runs.size());
  rep.expected = static_cast<int>(tasks.size() * pes.size() * seeds.size());

  // Pool over seeds: [task][pe][scaling][length]
  std::map<std::string, std::map<std::string, std::map<std::string, std::map<int, Cell>>>> by_len;
  std::set<int> all_lengths;
  std::vector<std::string> scalings{"default"};
  for (const auto& s : st["scalings"]) scalings.push_back(s);
  for (const Run& r : runs)
    for (const auto& [scaling, cells] : r.results.items())
      for (const auto& c : cells) {
        Cell& cell = by_len[r.task][r.pe][scaling][c["length"].get<int>()];
        cell.correct += c["correct"].get<int64_t>();
        cell.samples += c["samples"].get<int64_t>();
        cell.can_run = cell.can_run && c["can_run"].get<bool>();
        ++cell.seeds;
        all_lengths.insert(c["length"].get<int>());
      }
  auto bucket_cell = [&](const std::map<int, Cell>& m, const Bucket& b) {
    Cell out;
    bool any = false;
    for (const auto& [len, c] : m)
      if (len >= b.lo && len <= b.hi) {
        any = true;
        out.correct += c.correct;
        out.samples += c.samples;
        out.can_run = out.can_run && c.can_run;
        out.seeds = std::max(out.seeds, c.seeds);
      }
    if (!any) out.can_run = true;
    return out;
  };

  // ---- MRR per (task, seed) ----
  auto score_of = [&](const Run& r) {  // mean OOD accuracy; cannot-run lengths score 0
    double sum = 0;
    int n = 0;
    for (const auto& c : r.results["default"]) {
      if (c["length"].get<int>() <= train_hi) continue;
      const int64_t s = c["samples"], k = c["correct"];
      sum += c["can_run"].get<bool>() && s > 0 ? static_cast<double>(k) / s : 0.0;
      ++n;
    }
    return n ? sum / n : 0.0;
  };
  // Pooled accuracy over the training lengths; nullopt if none was tested.
  auto in_distribution_of = [&](const Run& r) -> std::optional<double> {
    int64_t k = 0, n = 0;
    for (const auto& c : r.results["default"]) {
      const int len = c["length"].get<int>();
      if (len < train_lo || len > train_hi) continue;
      k += c["correct"].get<int64_t>();
      n += c["samples"].get<int64_t>();
    }
    if (n == 0) return std::nullopt;
    return static_cast<double>(k) / static_cast<double>(n);
  };
  // A (task, seed) no encoding learned in distribution ranks nothing about
  // length generalization (every score is ~0): it is left out of the MRR and
  // named in the report. Without a test length in the training range there
  // is no evidence either way, and the configuration is ranked.
  constexpr double kLearned = 0.5;
  std::map<std::pair<std::string, uint64_t>, double> best_in_distribution;  // (task, seed) -> best over encodings
  for (const Run& r : runs)
    if (const auto a = in_distribution_of(r)) {
      double& best = best_in_distribution.try_emplace({r.task, r.seed}, 0.0).first->second;
      best = std::max(best, *a);
    }
  std::set<std::pair<std::string, uint64_t>> left_out;
  std::vector<std::string> unlearned;
  for (const auto& task : tasks)
    for (uint64_t seed : seeds)
      if (const auto it = best_in_distribution.find({task, seed});
          it != best_in_distribution.end() && it->second < kLearned) {
        left_out.insert(it->first);
        unlearned.push_back(fmt::format("{} seed {}", task, seed));
      }
  const std::vector<std::string> paper5{"nope", "t5", "alibi", "rope25", "sinusoidal"};
  auto mrr = [&](const std::vector<std::string>& subset) {
    std::map<std::string, std::pair<double, int>> acc;  // pe -> (sum 1/rank, configs)
    int configs = 0;
    for (const auto& task : tasks)
      for (uint64_t seed : seeds) {
        if (left_out.count({task, seed})) continue;
        std::vector<std::string> names;
        std::vector<double> scores;
        for (const auto& pe : subset)
          for (const Run& r : runs)
            if (r.task == task && r.pe == pe && r.seed == seed) {
              names.push_back(pe);
              scores.push_back(score_of(r));
            }
        if (names.size() != subset.size()) continue;  // only complete configurations are ranked
        ++configs;
        const auto ranks = average_ranks(scores);
        for (std::size_t i = 0; i < names.size(); ++i) {
          acc[names[i]].first += 1.0 / ranks[i];
          acc[names[i]].second += 1;
        }
      }
    std::vector<std::pair<std::string, double>> out;
    for (const auto& [pe, v] : acc) out.emplace_back(pe, v.first / v.second);
    std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.second > b.second; });
    return std::make_pair(out, configs);
  };
  std::vector<std::string> present_pes;
  for (const auto& pe : pes) present_pes.push_back(pe);
  const auto [mrr_all, configs_all] = mrr(present_pes);
  std::vector<std::string> p5;
  for (const auto& pe : paper5)
    if (std::find(pes.begin(), pes.end(), pe) != pes.end()) p5.push_back(pe);
  const auto [mrr_p5, configs_p5] = mrr(p5);

  // ---- text ----
  std::string t;
  t += fmt::format("posenc study {}: {}/{} models evaluated; train lengths {}-{}, test lengths {}-{} (step {}), {} "
                   "samples per length and seed\n",
                   dir.string(), rep.evaluations, rep.expected, train_lo, train_hi, test_lo, test_hi, st["test_lengths"][2].get<int>(), st["samples"].get<int>());
  if (st.contains("train") && st["train"].is_object()) {
    const json& tr = st["train"];
    auto num = [&](const char* key) { return tr.contains(key) && tr[key].is_number() ? tr[key].dump() : "?"; };
    t += fmt::format("common settings: {} layers, d_model {}, {} heads; {} steps of {} sequences, AdamW lr {}, "
                     "curriculum {}{}\n",
                     num("n_layers"), num("dim"), num("n_heads"), num("steps"), num("batch_size"), num("lr"),
                     tr.contains("curriculum") ? num("curriculum") : "0 (not recorded)",
                     tr.contains("ar_queries") ? fmt::format("; associative recall trains {} queries per context",
                                                             num("ar_queries"))
                                               : "");
  }
  if (st.contains("recipes") && st["recipes"].is_object())
    for (const auto& [task, r] : st["recipes"].items())
      t += fmt::format("recipe for {}: {} (instead of the common settings)\n", task,
                       r.is_string() ? r.get<std::string>() : r.dump());
  t += "Exact-match accuracy (%) pooled over seeds and samples, [Wilson 95% interval]\n";
  std::string header = fmt::format("{:<19} {:<14}", "task", "encoding");
  for (const auto& b : buckets) header += fmt::format(" {:>20}", b.label);
  t += header + "\n";
  for (const auto& task : tasks) {
    if (!by_len.count(task)) continue;
    for (const auto& pe : pes) {
      if (!by_len[task].count(pe)) continue;
      const auto& m = by_len[task][pe]["default"];
      std::string line = fmt::format("{:<19} {:<14}", task, pe);
      for (const auto& b : buckets) line += fmt::format(" {:>20}", fmt_cell(bucket_cell(m, b)));
      t += line + "\n";
    }
  }
  // The acceptance check: in-distribution accuracy (training range) >= 95%.
  t += "\nIn-distribution (training lengths) exact match >= 95%?\n";
  for (const auto& task : tasks) {
    if (!by_len.count(task)) continue;
    std::vector<std::string> below;
    for (const auto& pe : pes) {
      if (!by_len[task].count(pe)) continue;
      const Cell c = bucket_cell(by_len[task][pe]["default"], buckets[test_lo < train_lo ? 1 : 0]);
      if (c.samples > 0 && 100.0 * c.correct / c.samples < 95.0)
        below.push_back(fmt::format("{} {:.1f}%", pe, 100.0 * c.correct / c.samples));
    }
    t += fmt::format("  {:<19} {}\n", task, below.empty() ? "all encodings" : "below: " + fmt::format("{}", fmt::join(below, ", ")));
  }
  auto print_mrr = [&](const std::string& title, const auto& list, int configs) {
    t += fmt::format("\nMean reciprocal rank, {} ({} complete (task, seed) configurations; score = mean accuracy "
                     "beyond length {}):\n",
                     title, configs, train_hi);
    for (const auto& [pe, v] : list) t += fmt::format("  {:<11} {:.3f}\n", pe, v);
  };
  if (!unlearned.empty())
    t += fmt::format("\nLeft out of the MRR (no encoding reached {:.0f}% in distribution): {}\n", 100 * kLearned,
                     fmt::join(unlearned, ", "));
  print_mrr("all encodings", mrr_all, configs_all);
  print_mrr("the paper's five (Rotary = rope25, APE = sinusoidal)", mrr_p5, configs_p5);
  t += "  Kazemnejad et al. (2023), no scratchpad: NoPE 0.69 > T5 0.55 > ALiBi 0.50 > Rotary 0.33 > APE 0.22\n";

  bool any_scaling = false;
  for (const auto& task : tasks)
    for (const auto& pe : {std::string("rope"), std::string("rope25")})
      if (by_len.count(task) && by_len[task].count(pe) && by_len[task][pe].size() > 1) any_scaling = true;
  if (any_scaling) {
    t += "\nRoPE scalings at inference (factor = max(1, positions needed / trained context)), accuracy %:\n";
    t += header + "\n";
    for (const auto& task : tasks)
      for (const auto& pe : {std::string("rope"), std::string("rope25")}) {
        if (!by_len.count(task) || !by_len[task].count(pe)) continue;
        for (const auto& s : scalings) {
          if (!by_len[task][pe].count(s)) continue;
          std::string line = fmt::format("{:<19} {:<14}", task, pe + (s == "default" ? "" : "+" + s));
          for (const auto& b : buckets) line += fmt::format(" {:>20}", fmt_cell(bucket_cell(by_len[task][pe][s], b)));
          t += line + "\n";
        }
      }
  }
  double train_total = 0, eval_total = 0;
  for (const Run& r : runs) {
    train_total += r.train_seconds;
    eval_total += r.eval_seconds;
  }
  if (!runs.empty())
    t += fmt::format("\nCompute: training {:.1f} s per model on average ({} total), evaluation {:.1f} s per model\n",
                     train_total / runs.size(), hms(train_total), eval_total / runs.size());
  rep.text = t;

  // ---- summary.json / summary.csv ----
  json sj{{"study", study},
          {"evaluations", rep.evaluations},
          {"expected", rep.expected},
          {"buckets", json::array()},
          {"by_length", json::array()},
          {"by_bucket", json::array()},
          {"mrr", {{"all", json::object()}, {"paper5", json::object()}}},
          {"mrr_configurations", {{"all", configs_all}, {"paper5", configs_p5}}},
          {"mrr_left_out", unlearned},
          {"mrr_score", fmt::format("mean exact-match accuracy over test lengths > {} (cannot run = 0); ties share "
                                    "the average rank",
                                    train_hi)}};
  for (const auto& b : buckets)
    sj["buckets"].push_back({{"label", b.label}, {"lo", b.lo}, {"hi", b.hi}, {"in_distribution", b.in_distribution}});
  for (const auto& [pe, v] : mrr_all) sj["mrr"]["all"][pe] = v;
  for (const auto& [pe, v] : mrr_p5) sj["mrr"]["paper5"][pe] = v;
  std::string csv = "task,encoding,scaling,length,correct,samples,accuracy,wilson_low,wilson_high,can_run,seeds\n";
  for (const auto& [task, by_pe] : by_len)
    for (const auto& [pe, by_s] : by_pe)
      for (const auto& [scaling, m] : by_s) {
        for (const auto& [len, c] : m) {
          json j = cell_json(c);
          j["task"] = task;
          j["encoding"] = pe;
          j["scaling"] = scaling;
          j["length"] = len;
          sj["by_length"].push_back(j);
          std::string acc = "", lo = "", hi = "";
          if (c.can_run && c.samples > 0) {
            const Interval w = wilson_interval(c.correct, c.samples);
            acc = fmt::format("{:.6f}", static_cast<double>(c.correct) / c.samples);
            lo = fmt::format("{:.6f}", w.low);
            hi = fmt::format("{:.6f}", w.high);
          }
          csv += fmt::format("{},{},{},{},{},{},{},{},{},{},{}\n", csv_escape(task), csv_escape(pe), scaling, len,
                             c.correct, c.samples, acc, lo, hi, c.can_run ? 1 : 0, c.seeds);
        }
        for (const auto& b : buckets) {
          json j = cell_json(bucket_cell(m, b));
          j["task"] = task;
          j["encoding"] = pe;
          j["scaling"] = scaling;
          j["bucket"] = b.label;
          sj["by_bucket"].push_back(j);
        }
      }
  rep.summary_json = dir / "summary.json";
  rep.summary_csv = dir / "summary.csv";
  write_file_atomic(rep.summary_json, sj.dump(1) + "\n");
  write_file_atomic(rep.summary_csv, csv);
  return rep;
}

}  // namespace posenc
