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

#include "posenc/checkpoint.hpp"
#include "posenc/error.hpp"
#include "posenc/io.hpp"
#include "posenc/json_file.hpp"
#include "train/study_dir.hpp"

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
  return detail::study_unit_name(to_string(task), to_string(pe), seed);
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

bool near(double a, double b) { return std::abs(a - b) <= 1e-9 * std::max(1.0, std::abs(b)); }

/// Why the checkpoint `m` (read from `path`) is not the model the study trains
/// with `tc`, or nullopt when it is: the architecture (every ModelConfig field,
/// hence every tensor shape), the positional encoding and its parameters, the
/// task's vocabulary, and the training recipe recorded in its metadata (task,
/// pe, seed, steps, batch size, train lengths, optimizer, curriculum, MQAR
/// queries, parameter count).
std::optional<std::string> checkpoint_mismatch(const Model& m, const fs::path& path, const TrainConfig& tc) {
  std::vector<std::string> diff;
  auto check = [&](std::string_view what, const auto& have, const auto& want) {
    if (!(have == want)) diff.push_back(fmt::format("{} {} where the study trains {}", what, have, want));
  };
  auto check_num = [&](std::string_view what, double have, double want) {
    if (!near(have, want)) diff.push_back(fmt::format("{} {} where the study trains {}", what, have, want));
  };
  const ModelConfig want = model_config_for(tc);
  const ModelConfig& have = m.config();
  check("dim", have.dim, want.dim);
  check("hidden_dim", have.hidden_dim, want.hidden_dim);
  check("n_layers", have.n_layers, want.n_layers);
  check("n_heads", have.n_heads, want.n_heads);
  check("n_kv_heads", have.n_kv_heads, want.n_kv_heads);
  check("head_dim", have.head_dim, want.head_dim);
  check("vocab_size", have.vocab_size, want.vocab_size);
  check("max_position_embeddings", have.max_position_embeddings, want.max_position_embeddings);
  check("shared_classifier", have.shared_classifier, want.shared_classifier);
  check("qkv_bias", have.qkv_bias, want.qkv_bias);
  check("o_bias", have.o_bias, want.o_bias);
  check("mlp_bias", have.mlp_bias, want.mlp_bias);
  check("qk_norm", have.qk_norm, want.qk_norm);
  const PositionalConfig wp = positional_config_for(tc);
  const PositionalConfig& hp = m.positional();
  check("position family", to_string(hp.family), to_string(wp.family));
  if (hp.family == wp.family) switch (wp.family) {
      case PositionFamily::rope:
        check("rotary_dim", hp.rope.params.rotary_dim, wp.rope.params.rotary_dim);
        check_num("rope_theta", hp.rope.params.rope_theta, wp.rope.params.rope_theta);
        check("rope layout", to_string(hp.rope.layout), to_string(wp.rope.layout));
        break;
      case PositionFamily::alibi: check_num("alibi_max_bias", hp.alibi_max_bias, wp.alibi_max_bias); break;
      case PositionFamily::t5_bias:
        check("t5_num_buckets", hp.t5_num_buckets, wp.t5_num_buckets);
        check("t5_max_distance", hp.t5_max_distance, wp.t5_max_distance);
        break;
      case PositionFamily::sinusoidal: check_num("sinusoidal_base", hp.sinusoidal_base, wp.sinusoidal_base); break;
      default: break;
    }
  if (m.embedded_symbols() != Task(tc.task).symbols()) diff.push_back("its vocabulary is not the task's");
  try {
    const JsonDocument doc = parse_json_document(m.metadata_json(), path.string() + " (metadata)");
    const JsonView meta = doc.root();
    check("task", meta.at("task").string(), std::string(to_string(tc.task)));
    check("pe", meta.at("pe").string(), std::string(to_string(tc.pe)));
    check("seed", static_cast<uint64_t>(meta.at("seed").integer(0)), tc.seed);
    check("steps", meta.at("steps").integer(), int64_t{tc.steps});
    check("batch_size", meta.at("batch_size").integer(), int64_t{tc.batch_size});
    const JsonView tl = meta.at("train_lengths");
    check("train_lengths", fmt::format("{}:{}", tl.at(std::size_t{0}).integer(), tl.at(std::size_t{1}).integer()),
          fmt::format("{}:{}", tc.train_lengths.lo, tc.train_lengths.hi));
    const JsonView opt = meta.at("optimizer");
    check_num("lr", opt.at("lr").number(), tc.lr);
    check_num("weight_decay", opt.at("weight_decay").number(), tc.weight_decay);
    check("warmup_steps", opt.at("warmup_steps").integer(), int64_t{tc.warmup_steps});
    check_num("min_lr_ratio", opt.at("min_lr_ratio").number(), tc.min_lr_ratio);
    check_num("clip_norm", opt.at("clip_norm").number(), tc.clip_norm);
    check_num("curriculum", meta.at("curriculum").number(), tc.curriculum);
    if (tc.task == TrainTaskKind::associative_recall)
      check("ar_queries", meta.at("ar_queries").integer(), int64_t{tc.ar_queries});
    int64_t parameters = 0;
    for (const auto& t : m.to_checkpoint().tensors) parameters += static_cast<int64_t>(t.data.size());
    check("parameters (metadata)", meta.at("parameters").integer(), parameters);
  } catch (const DataError& e) {
    diff.push_back(e.what());
  }
  if (diff.empty()) return std::nullopt;
  return fmt::format("{}", fmt::join(diff, "; "));
}

/// The locks of a study directory: exclusive for a whole run; a shard takes
/// the study lock shared (shards run together, but not next to a whole run)
/// and its own shard lock exclusively (the same shard twice is refused).
struct StudyLocks {
  DirectoryLock study;
  std::optional<DirectoryLock> shard;
};

StudyLocks lock_study(const StudyConfig& cfg) {
  if (cfg.shard_count == 1) return {DirectoryLock(cfg.out, ".posenc.lock"), std::nullopt};
  StudyLocks l{DirectoryLock(cfg.out, ".posenc.lock", /*shared=*/true), std::nullopt};
  l.shard.emplace(cfg.out, fmt::format(".posenc.lock.shard-{}-of-{}", cfg.shard, cfg.shard_count));
  return l;
}

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
  // One run per directory (shards: one per shard), so two runs do not
  // duplicate work with the last writer winning; then the temporaries a
  // killed run left behind (write_file_atomic's "<file>.tmp.<pid>.<n>") go.
  const StudyLocks locks = lock_study(cfg);
  for (const fs::path& d : {cfg.out, cfg.out / "models", cfg.out / "evals"})
    for (const fs::path& p : remove_stale_temporaries(d, /*all=*/cfg.shard_count == 1))
      log(fmt::format("removed {} (a temporary file left by a killed run)", p.string()));
  const fs::path study_json = cfg.out / "study.json";
  json study;
  if (fs::exists(study_json)) {
    const detail::StudyFile have = detail::read_study_file(study_json);
    detail::check_study_settings(have, fixed_settings(cfg), cfg.out);
    study = have.doc.raw();  // tasks, pes and seeds are arrays (read_study_file)
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
          const auto problem = detail::eval_file_problem(eval_path, to_string(tk), to_string(pe), seed, cfg.samples,
                                                         is_rope(pe) ? cfg.scalings : std::vector<std::string>{});
          if (!problem) {
            log(fmt::format("{}: evaluated already, skipped", tag));
            continue;
          }
          log(fmt::format("{}: evaluation not kept ({}), evaluating again", tag, *problem));
        }
        const auto t_unit = std::chrono::steady_clock::now();
        const Task task(tk);
        std::optional<Model> model;
        TrainConfig tc = model_train_config(cfg, tk, pe, seed);
        tc.out = model_path;
        if (fs::exists(model_path)) {
          // The file under the study's name is used only if it is the model
          // the study trains; anything else (another study's, a hand-copied
          // checkpoint) is retrained: training is deterministic, so the
          // result is what an uninterrupted run gives.
          try {
            model = Model::load(model_path);
            if (const auto why = checkpoint_mismatch(*model, model_path, tc)) {
              log(fmt::format("{}: warning: {} is not this study's model ({}), retraining", tag, model_path.string(),
                              *why));
              model.reset();
            } else {
              log(fmt::format("{}: checkpoint exists, training skipped", tag));
            }
          } catch (const Error& e) {
            log(fmt::format("{}: unreadable checkpoint ({}), retraining", tag, e.what()));
          }
        }
        if (!model) {
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
        // checkpoint_mismatch read the metadata as an object with "parameters".
        const JsonDocument meta_doc = parse_json_document(model->metadata_json(), model_path.string() + " (metadata)");
        const JsonView meta = meta_doc.root();
        json ev{{"task", std::string(to_string(tk))},
                {"pe", std::string(to_string(pe))},
                {"seed", seed},
                {"model", fs::relative(model_path, cfg.out).string()},
                {"train_seconds", meta.number_or("train_seconds", 0.0)},
                {"final_loss", meta.number_or("final_loss", 0.0)},
                {"parameters", meta.integer_or("parameters", 0)},
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

}  // namespace posenc
