// The length-generalization study, the part that reads a study directory
// back: study.json and evals/*.json through the checked reader, the report,
// resume planning and the clean-up of stale temporaries. No libtorch here
// (see study_dir.hpp).
#include "train/study_dir.hpp"

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <map>
#include <optional>
#include <set>
#include <tuple>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "posenc/error.hpp"
#include "posenc/io.hpp"
#include "posenc/stats.hpp"
#include "posenc/study.hpp"

namespace posenc {

namespace fs = std::filesystem;
using nlohmann::json;

namespace detail {

namespace {

/// [lo, hi] (and step) of a length range in settings: an array of `n` integers.
void length_range(const JsonView& v, int& lo, int& hi, int* step) {
  lo = static_cast<int>(v.at(std::size_t{0}).integer(1, kStudyMaxLength));
  hi = static_cast<int>(v.at(std::size_t{1}).integer(lo, kStudyMaxLength));
  if (step != nullptr) *step = static_cast<int>(v.at(std::size_t{2}).integer(1, kStudyMaxLength));
}

std::string hms(double s) {
  const auto t = static_cast<int64_t>(s + 0.5);
  return t >= 3600 ? fmt::format("{}h{:02d}m", t / 3600, (t % 3600) / 60)
                   : fmt::format("{}m{:02d}s", t / 60, t % 60);
}

/// The strings of an array, each once, in first-seen order (a study writes
/// each name once; repeats would count models twice).
std::vector<std::string> strings(const JsonView& v) {
  std::vector<std::string> out;
  std::set<std::string> seen;
  for (const JsonView& e : v.elements())
    if (std::string x = e.string(); seen.insert(x).second) out.push_back(std::move(x));
  return out;
}

/// A task or encoding name: letters, digits and '_' (every name posenc
/// writes). They become file names (evals/<task>-<pe>-s<seed>.json, the
/// report's plots/<task>.png), so "../x" or "a/b" is refused.
std::string plain_name(const JsonView& v) {
  std::string s = v.string();
  const bool ok = !s.empty() && s.size() <= 64 && std::all_of(s.begin(), s.end(), [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_';
  });
  if (!ok) v.fail(fmt::format("'{}' is not a task or encoding name (letters, digits and '_', at most 64)", s));
  return s;
}

std::vector<std::string> names(const JsonView& v) {
  std::vector<std::string> out;
  for (const JsonView& e : v.elements()) (void)plain_name(e);
  return strings(v);
}

}  // namespace

StudyFile read_study_file(const fs::path& path) {
  StudyFile s{read_json_document(path), 0, 0, 0, 0, 0, 0, {}, {}, {}, {}};
  const JsonView root = s.doc.root();
  if (!root.is_object() || !root.contains("format") || !root.at("format").is_string() ||
      root.at("format").string() != "posenc-study")
    throw ConfigError(fmt::format("{}: not a posenc study file (no \"format\": \"posenc-study\")", path.string()));
  const JsonView st = root.at("settings");
  if (!st.is_object()) st.fail("expected an object (the study's settings)");
  length_range(st.at("train_lengths"), s.train_lo, s.train_hi, nullptr);
  length_range(st.at("test_lengths"), s.test_lo, s.test_hi, &s.test_step);
  s.samples = st.at("samples").integer(0, kStudyMaxSamples);
  s.scalings = strings(st.at("scalings"));
  s.tasks = names(root.at("tasks"));
  s.pes = names(root.at("pes"));
  std::set<std::uint64_t> seen;
  for (const JsonView& e : root.at("seeds").elements())
    if (const auto seed = static_cast<std::uint64_t>(e.integer(0)); seen.insert(seed).second) s.seeds.push_back(seed);
  if (const auto train = st.find("train"); train && !train->is_object()) train->fail("expected an object");
  if (const auto recipes = st.find("recipes")) {
    if (!recipes->is_object()) recipes->fail("expected an object of task -> recipe");
    for (const auto& [task, r] : recipes->members()) (void)r.string();
  }
  return s;
}

std::string settings_difference(const json& have, const json& want) {
  const json a = have.flatten(), b = want.flatten();
  std::vector<std::string> out;
  // flatten() keys are JSON pointers ("/train/lr"); "" is the root itself (a
  // scalar or an empty container).
  auto name = [](const std::string& key) { return key.empty() ? std::string("(the settings)") : key.substr(1); };
  auto shown = [](const json& j, const std::string& key) {
    const auto it = j.find(key);
    return it == j.end() ? std::string("absent") : it->dump();
  };
  for (const auto& [key, v] : a.items())
    if (const auto it = b.find(key); it == b.end() || *it != v)
      out.push_back(fmt::format("{}: {} in the directory, {} requested", name(key), v.dump(), shown(b, key)));
  for (const auto& [key, v] : b.items())
    if (!a.contains(key)) out.push_back(fmt::format("{}: absent in the directory, {} requested", name(key), v.dump()));
  return fmt::format("{}", fmt::join(out, "; "));
}

void check_study_settings(const StudyFile& study, const json& wanted, const fs::path& out) {
  const json& have = study.doc.root().at("settings").raw();
  if (have != wanted)
    throw ConfigError(fmt::format("--out: {} holds a study run with other settings ({}); use the same settings to "
                                  "resume it, or another --out",
                                  out.string(), settings_difference(have, wanted)));
}

std::string study_unit_name(std::string_view task, std::string_view pe, std::uint64_t seed) {
  return fmt::format("{}-{}-s{}", task, pe, seed);
}

EvalFile read_eval_file(const fs::path& path) {
  const JsonDocument doc = read_json_document(path);
  const JsonView root = doc.root();
  if (!root.is_object()) root.fail("expected an object (a study evaluation)");
  EvalFile e;
  e.task = plain_name(root.at("task"));
  e.pe = plain_name(root.at("pe"));
  e.seed = static_cast<std::uint64_t>(root.at("seed").integer(0));
  if (const auto s = root.find("samples")) e.samples = s->integer(0, kStudyMaxSamples);
  e.train_seconds = root.find("train_seconds") ? root.at("train_seconds").number(0) : 0.0;
  e.eval_seconds = root.find("eval_seconds") ? root.at("eval_seconds").number(0) : 0.0;
  const JsonView results = root.at("results");
  for (const auto& [scaling, cells] : results.members()) {
    std::vector<EvalCellRecord>& out = e.results[scaling];
    std::set<int> seen;
    for (const JsonView& c : cells.elements()) {
      EvalCellRecord r;
      r.length = static_cast<int>(c.at("length").integer(0, kStudyMaxLength));
      r.samples = c.at("samples").integer(0, kStudyMaxSamples);
      r.correct = c.at("correct").integer(0, r.samples);
      r.can_run = c.at("can_run").boolean();
      if (!seen.insert(r.length).second) c.at("length").fail(fmt::format("length {} appears twice", r.length));
      out.push_back(r);
    }
  }
  if (!e.results.count("default")) results.fail("missing key 'default' (the unscaled evaluation)");
  const std::string unit = study_unit_name(e.task, e.pe, e.seed);
  if (path.filename().string() != unit + ".json")
    throw DataError(fmt::format("{}: holds the evaluation of {} (task, pe, seed), not of its own name; a file "
                                "copied over another's is not counted",
                                path.string(), unit));
  return e;
}

std::optional<std::string> eval_file_problem(const fs::path& path, std::string_view task, std::string_view pe,
                                             std::uint64_t seed, std::int64_t samples,
                                             const std::vector<std::string>& scalings) {
  try {
    const EvalFile e = read_eval_file(path);
    if (e.task != task || e.pe != pe || e.seed != seed)
      return fmt::format("{}: holds {}, not {}", path.string(), study_unit_name(e.task, e.pe, e.seed),
                         study_unit_name(task, pe, seed));
    if (e.samples != samples)
      return fmt::format("{}: samples {} where the study evaluates {}", path.string(),
                         e.samples ? fmt::format("{}", *e.samples) : std::string("absent"), samples);
    for (const auto& s : scalings)
      if (!e.results.count(s)) return fmt::format("{}: results: no '{}' evaluation", path.string(), s);
    return std::nullopt;
  } catch (const Error& err) {
    return err.what();
  }
}

}  // namespace detail

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

/// RFC 4180: a field with a comma, quote or line break is quoted, quotes doubled.
std::string csv_escape(const std::string& s) {
  if (s.find_first_of(",\"\r\n") == std::string::npos) return s;
  std::string out = "\"";
  for (char c : s) out += c == '"' ? std::string("\"\"") : std::string(1, c);
  return out + "\"";
}

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
  const detail::StudyFile sf = detail::read_study_file(study_json);
  const json& study = sf.doc.raw();
  const JsonView st = sf.doc.root().at("settings");
  const int train_lo = sf.train_lo, train_hi = sf.train_hi;
  const int test_lo = sf.test_lo, test_hi = sf.test_hi;
  const std::vector<std::string>& tasks = sf.tasks;
  const std::vector<std::string>& pes = sf.pes;
  const std::vector<uint64_t>& seeds = sf.seeds;
  const std::vector<Bucket> buckets = make_buckets(train_lo, train_hi, test_lo, test_hi);

  // (task, pe, scaling, seed) -> cells by length
  using Run = detail::EvalFile;
  std::vector<Run> runs;
  if (fs::exists(dir / "evals")) {
    std::vector<fs::path> files;  // in name order, whatever the directory's order
    for (const auto& e : fs::directory_iterator(dir / "evals"))
      if (e.path().extension() == ".json") files.push_back(e.path());
    std::sort(files.begin(), files.end());
    for (const auto& f : files) runs.push_back(detail::read_eval_file(f));
  }
  std::sort(runs.begin(), runs.end(), [](const Run& a, const Run& b) {
    return std::tie(a.task, a.pe, a.seed) < std::tie(b.task, b.pe, b.seed);
  });
  StudyReport rep;
  rep.evaluations = static_cast<int>(runs.size());
  std::size_t expected = 0;
  if (__builtin_mul_overflow(tasks.size(), pes.size(), &expected) ||
      __builtin_mul_overflow(expected, seeds.size(), &expected) || expected > 1'000'000'000)
    throw DataError(fmt::format("{}: tasks x pes x seeds = {} x {} x {} models: more than a study can hold",
                                study_json.string(), tasks.size(), pes.size(), seeds.size()));
  rep.expected = static_cast<int>(expected);

  // Pool over seeds: [task][pe][scaling][length]
  std::map<std::string, std::map<std::string, std::map<std::string, std::map<int, Cell>>>> by_len;
  std::set<int> all_lengths;
  std::vector<std::string> scalings{"default"};
  for (const auto& s : sf.scalings) scalings.push_back(s);
  for (const Run& r : runs)
    for (const auto& [scaling, cells] : r.results)
      for (const auto& c : cells) {
        Cell& cell = by_len[r.task][r.pe][scaling][c.length];
        cell.correct += c.correct;
        cell.samples += c.samples;
        cell.can_run = cell.can_run && c.can_run;
        ++cell.seeds;
        all_lengths.insert(c.length);
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
    for (const auto& c : r.results.at("default")) {
      if (c.length <= train_hi) continue;
      const int64_t s = c.samples, k = c.correct;
      sum += c.can_run && s > 0 ? static_cast<double>(k) / s : 0.0;
      ++n;
    }
    return n ? sum / n : 0.0;
  };
  // Pooled accuracy over the training lengths; nullopt if none was tested.
  auto in_distribution_of = [&](const Run& r) -> std::optional<double> {
    int64_t k = 0, n = 0;
    for (const auto& c : r.results.at("default")) {
      const int len = c.length;
      if (len < train_lo || len > train_hi) continue;
      k += c.correct;
      n += c.samples;
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
  // (task, pe, seed) -> its run (file names make them unique), and the
  // (task, seed) that have any: the loops below stay linear in the runs for a
  // study.json listing thousands of names.
  std::map<std::tuple<std::string, std::string, uint64_t>, const Run*> run_of;
  std::set<std::pair<std::string, uint64_t>> evaluated;
  for (const Run& r : runs) {
    run_of.emplace(std::make_tuple(r.task, r.pe, r.seed), &r);
    evaluated.insert({r.task, r.seed});
  }
  auto mrr = [&](const std::vector<std::string>& subset) {
    std::map<std::string, std::pair<double, int>> acc;  // pe -> (sum 1/rank, configs)
    int configs = 0;
    if (subset.empty()) return std::make_pair(std::vector<std::pair<std::string, double>>{}, configs);
    for (const auto& task : tasks)
      for (uint64_t seed : seeds) {
        if (left_out.count({task, seed}) || !evaluated.count({task, seed})) continue;
        std::vector<std::string> names;
        std::vector<double> scores;
        for (const auto& pe : subset)
          if (const auto it = run_of.find(std::make_tuple(task, pe, seed)); it != run_of.end()) {
            names.push_back(pe);
            scores.push_back(score_of(*it->second));
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
                   dir.string(), rep.evaluations, rep.expected, train_lo, train_hi, test_lo, test_hi, sf.test_step, sf.samples);
  if (const auto train = st.find("train")) {  // an object (read_study_file)
    const JsonView tr = *train;
    auto num = [&](const char* key) {
      const auto v = tr.find(key);
      return v && v->is_number() ? v->raw().dump() : std::string("?");
    };
    t += fmt::format("common settings: {} layers, d_model {}, {} heads; {} steps of {} sequences, AdamW lr {}, "
                     "curriculum {}{}\n",
                     num("n_layers"), num("dim"), num("n_heads"), num("steps"), num("batch_size"), num("lr"),
                     tr.contains("curriculum") ? num("curriculum") : "0 (not recorded)",
                     tr.contains("ar_queries") ? fmt::format("; associative recall trains {} queries per context",
                                                             num("ar_queries"))
                                               : "");
  }
  if (const auto recipes = st.find("recipes"))  // an object of strings (read_study_file)
    for (const auto& [task, r] : recipes->members())
      t += fmt::format("recipe for {}: {} (instead of the common settings)\n", task, r.string());
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
                     train_total / runs.size(), detail::hms(train_total), eval_total / runs.size());
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
  // The column names of eval's summary.csv for the same quantities (rope_scaling, n, correct, accuracy, ci_low,
  // ci_high: the Wilson 95% interval).
  std::string csv = "task,encoding,rope_scaling,length,n,correct,accuracy,ci_low,ci_high,can_run,seeds\n";
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
          csv += fmt::format("{},{},{},{},{},{},{},{},{},{},{}\n", csv_escape(task), csv_escape(pe), csv_escape(scaling), len,
                             c.samples, c.correct, acc, lo, hi, c.can_run ? 1 : 0, c.seeds);
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
