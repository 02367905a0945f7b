// The evaluation run: cells, resume, shards, outputs, merge, summary.
#include <fcntl.h>
#include <omp.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <ctime>
#include <exception>
#include <filesystem>
#include <map>
#include <mutex>
#include <set>
#include <sstream>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "eval/endpoint_lab.hpp"
#include "eval/rng.hpp"
#include "posenc/error.hpp"
#include "posenc/eval.hpp"
#include "posenc/io.hpp"
#include "posenc/json_file.hpp"
#include "posenc/perplexity.hpp"
#include "posenc/scaling.hpp"
#include "posenc/threads.hpp"

namespace posenc {

using detail::eval_warn;
using detail::hex16;

namespace fs = std::filesystem;
using nlohmann::json;

std::string detail::hex16(uint64_t h) { return fmt::format("{:016x}", h); }

void detail::eval_warn(const std::string& message) {
  fmt::print(stderr, "eval: warning: {}\n", message);
  std::fflush(stderr);
}

namespace {

// Bump when the task generator or the scoring changes what a cell holds.
// 2: acc_norm (primary) next to acc, the "absent" control, name_recall's
// equal-length candidates.
constexpr int kTaskGeneratorVersion = 3;  // 3: associative_recall absent keeps the gold value

// Upper bound of --ppl-tokens (2^48 tokens, far beyond any text): larger
// values are refused by name rather than carried into window arithmetic.
constexpr int64_t kMaxPplTokens = int64_t{1} << 48;

// run.json model.family (the contract's names): rope, alibi, learned, sinusoidal, t5, nope.
std::string eval_model_family(const Model& model) {
  switch (model.family()) {
    case PositionFamily::learned_absolute: return "learned";
    case PositionFamily::t5_bias: return "t5";
    default: return std::string(to_string(model.family()));
  }
}

uint64_t hash_bytes(std::string_view bytes) { return detail::fnv1a64(bytes); }

// A file's content hash; for a directory (a Hugging Face model), the hash of
// every regular file's name and content hash, in name order.
std::string file_hash(const std::string& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (!fs::is_directory(path, ec)) return hex16(hash_bytes(read_file(path)));
  std::vector<fs::path> files;
  for (const auto& e : fs::directory_iterator(path, ec))
    if (e.is_regular_file(ec)) files.push_back(e.path());
  std::sort(files.begin(), files.end());
  std::string all;
  for (const auto& f : files) all += f.filename().string() + ":" + hex16(hash_bytes(read_file(f))) + "\n";
  return hex16(hash_bytes(all));
}

std::string depth_key(double d) { return d < 0 ? "na" : fmt::format("{:g}", d); }

json depth_json(double d) { return d < 0 ? json(nullptr) : json(d); }

std::string utc_now() {
  const std::time_t t = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buf;
}

// ---- checked reading of the run directory ----
//
// Everything read back from a run directory (run.json, cells/*.json,
// ppl/*.json, LATEST) goes through JsonView (include/posenc/json_file.hpp):
// a malformed, edited or misplaced file is a DataError naming the file and
// the key, never undefined behaviour or a raw nlohmann exception.

// A run id, as it appears in run.json and LATEST, is used as a directory name
// under --out: it must be one safe path component ([A-Za-z0-9._-]+, not "."
// or "..", at most 255 bytes), so no run.json or LATEST can point outside.
bool safe_component(std::string_view s) {
  if (s.empty() || s.size() > 255 || s == "." || s == "..") return false;
  return std::all_of(s.begin(), s.end(), [](char ch) {
    return (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9') || ch == '.' || ch == '_' ||
           ch == '-';
  });
}

std::string shown_string(std::string_view s) {
  std::string out = json(std::string(s)).dump(-1, ' ', true, json::error_handler_t::replace);
  if (out.size() > 80) out = out.substr(0, 77) + "...";
  return out;
}

std::string checked_run_id(const JsonView& v) {
  std::string id = v.string();
  if (!safe_component(id))
    v.fail(fmt::format("{} is not a run id (expected one path component of [A-Za-z0-9._-], not '.' or '..')",
                       shown_string(id)));
  return id;
}

// Cell and perplexity files carry "checksum": "fnv1a64:<16 hex digits>", the
// FNV-1a 64 hash of the file's JSON without its "checksum" member, dumped
// compactly (nlohmann::json::dump(), keys sorted). A file edited by hand or
// damaged no longer matches; the check is against accidents and edits, not
// against someone who recomputes the hash.
constexpr std::string_view kChecksumPrefix = "fnv1a64:";

std::string content_checksum(json j) {
  if (j.is_object()) j.erase("checksum");
  return std::string(kChecksumPrefix) + hex16(hash_bytes(j.dump(-1, ' ', false, json::error_handler_t::replace)));
}

std::string with_checksum(json j, int indent = -1) {
  j["checksum"] = content_checksum(j);
  return j.dump(indent) + "\n";
}

void check_checksum(const JsonView& root) {
  const auto c = root.find("checksum");
  if (!c) root.fail("missing key 'checksum' (the file was edited, or written by a posenc without checksums)");
  if (c->string() != content_checksum(root.raw()))
    c->fail("does not match the file's content (the file was edited or damaged)");
}

// The run's axes, as stored in run.json's "config".
struct Axes {
  std::vector<std::string> tasks;
  std::vector<std::string> controls;
  std::vector<std::string> scalings;
  std::vector<int64_t> lengths;
  /// The perplexity matrix's lengths: `lengths` but those longer than the text (default lengths, left out;
  /// run.json config.ppl_lengths; runs before it have none: all of `lengths`).
  std::vector<int64_t> ppl_lengths;
  std::vector<double> depths;
  int64_t samples = 0;
  int choices = 4;
  double threshold = 0.85;
  double min_baseline = 0.0;
  int64_t ppl_tokens = -1;
  bool absent = false;  ///< the "absent" control runs for every forced-choice task (run.json config.absent_control)
  bool labels = false;  ///< the scaling axis holds endpoint labels (eval --endpoint), not RoPE methods
};

// Upper bound of a run's cells (a grid of 2^20 cells is already days of
// compute): a run.json listing more is refused before its cells are looked up.
constexpr uint64_t kMaxCells = uint64_t{1} << 20;

bool runs_absent(const Axes& a, const std::string& task) { return a.absent && find_eval_task(task).kind == TaskKind::choice; }

// tasks x controls x scalings x lengths x depths (1 for tasks without depth),
// plus scalings x lengths absent-control cells per forced-choice task;
// nullopt on uint64 overflow.
std::optional<uint64_t> cell_count(const Axes& a) {
  uint64_t total = 0;
  for (const auto& t : a.tasks) {
    uint64_t n = find_eval_task(t).uses_depth ? a.depths.size() : 1;
    for (uint64_t f : {a.controls.size(), a.scalings.size(), a.lengths.size()})
      if (__builtin_mul_overflow(n, f, &n)) return std::nullopt;
    if (__builtin_add_overflow(total, n, &total)) return std::nullopt;
    if (runs_absent(a, t)) {
      uint64_t m = a.scalings.size();
      if (__builtin_mul_overflow(m, static_cast<uint64_t>(a.lengths.size()), &m)) return std::nullopt;
      if (__builtin_add_overflow(total, m, &total)) return std::nullopt;
    }
  }
  return total;
}

// The depths of a (task, control): none (-1) for tasks without a depth axis
// and for the absent control (there is no evidence to place).
std::vector<double> task_depths(const Axes& a, const std::string& task, const std::string& control) {
  return find_eval_task(task).uses_depth && control != "absent" ? a.depths : std::vector<double>{-1.0};
}

std::string cell_name(const std::string& task, const std::string& control, const std::string& scaling, int64_t L,
                      double depth) {
  return fmt::format("{}__{}__{}__L{}__d{}", task, control, scaling, L, depth_key(depth));
}

struct Group {
  std::string task, control, scaling;
  int64_t length = 0;
};

std::vector<Group> groups_of(const Axes& a) {
  std::vector<Group> g;
  for (const auto& t : a.tasks) {
    for (const auto& c : a.controls)
      for (const auto& s : a.scalings)
        for (int64_t L : a.lengths) g.push_back({t, c, s, L});
    if (runs_absent(a, t))
      for (const auto& s : a.scalings)
        for (int64_t L : a.lengths) g.push_back({t, "absent", s, L});
  }
  return g;
}

struct PplJob {
  std::string scaling;
  int64_t length = 0;
};

std::vector<PplJob> ppl_jobs_of(const Axes& a) {
  std::vector<PplJob> j;
  if (a.ppl_tokens < 0) return j;
  for (int64_t L : a.ppl_lengths)
    for (const auto& s : a.scalings) j.push_back({s, L});
  return j;
}

std::string ppl_name(const PplJob& j) { return fmt::format("{}__L{}", j.scaling, j.length); }

Axes axes_from_config(const EvalConfig& c) {
  Axes a;
  a.tasks = c.tasks;
  for (auto ctl : c.controls) a.controls.emplace_back(to_string(ctl));
  a.scalings = c.rope_scalings;
  a.lengths = c.lengths;
  a.ppl_lengths = c.lengths;  // run_eval_impl leaves out those longer than the text
  a.depths = c.depths;
  a.samples = c.samples;
  a.choices = c.choices;
  a.threshold = c.threshold;
  a.min_baseline = c.min_baseline;
  a.ppl_tokens = c.ppl_tokens;
  a.absent = true;
  a.labels = c.scaling_labels;
  return a;
}

// The axes of run.json's "config", each checked as validate_eval_config
// checks the flags (a name listed twice would count its cells twice, an
// unknown control or scaling would name files outside cells/).
Axes axes_from_run_json(const JsonView& run) {
  const JsonView c = run.at("config");
  Axes a;
  auto names = [&](std::string_view key, auto&& check) {
    std::vector<std::string> out;
    const JsonView list = c.at(key);
    if (list.size() == 0) list.fail("must not be empty");
    for (const JsonView& v : list.elements()) {
      std::string name = v.string();
      try {
        check(name);
      } catch (const Error& e) {
        v.fail(e.what());
      }
      if (std::find(out.begin(), out.end(), name) != out.end()) v.fail(fmt::format("{} listed twice", shown_string(name)));
      out.push_back(std::move(name));
    }
    return out;
  };
  a.tasks = names("tasks", [](const std::string& t) { find_eval_task(t); });
  a.controls = names("controls", [](const std::string& t) {
    if (parse_task_control(t, "control") == TaskControl::absent)
      throw DataError("absent is not a --control value (config.absent_control adds it)");
  });
  // eval --endpoint: the axis holds the endpoints' labels (one path component each).
  a.labels = c.string_or("scaling_axis", "rope_scaling") == "endpoint_label";
  a.scalings = names("rope_scalings", [&](const std::string& t) {
    if (!a.labels) is_rope_scaling_name(t);
    else if (!safe_component(t)) throw DataError("is not an endpoint label (one path component of [A-Za-z0-9._-])");
  });
  {
    const JsonView list = c.at("lengths");
    if (list.size() == 0) list.fail("must not be empty");
    for (const JsonView& v : list.elements()) {
      const int64_t L = v.integer(8, int64_t{1} << 20);
      if (!a.lengths.empty() && L <= a.lengths.back()) v.fail("lengths must be increasing (sorted, each once)");
      a.lengths.push_back(L);
    }
  }
  if (const auto list = c.find("ppl_lengths")) {
    for (const JsonView& v : list->elements()) {
      const int64_t L = v.integer(8, int64_t{1} << 20);
      if (std::find(a.lengths.begin(), a.lengths.end(), L) == a.lengths.end()) v.fail("is not one of config.lengths");
      if (!a.ppl_lengths.empty() && L <= a.ppl_lengths.back()) v.fail("ppl_lengths must be increasing (sorted, each once)");
      a.ppl_lengths.push_back(L);
    }
  } else {
    a.ppl_lengths = a.lengths;  // runs from before config.ppl_lengths: the matrix had every length
  }
  {
    const JsonView list = c.at("depths");
    if (list.size() == 0) list.fail("must not be empty");
    for (const JsonView& v : list.elements()) {
      const double d = v.number(0.0, 1.0);
      if (!a.depths.empty() && d <= a.depths.back()) v.fail("depths must be increasing (sorted, each once)");
      a.depths.push_back(d);
    }
  }
  a.samples = c.at("samples").integer(1, 1000000);
  a.choices = static_cast<int>(c.at("choices").integer(2, 16));
  a.threshold = c.at("threshold").number(0.0, 1.0);
  a.min_baseline = c.at("min_baseline").number(0.0, 1.0);
  a.ppl_tokens = c.at("ppl_tokens").integer(-1, kMaxPplTokens);
  a.absent = c.boolean_or("absent_control", false);  // runs before generator version 2 have none
  if (const auto cells = cell_count(a); !cells || *cells > kMaxCells)
    c.fail(fmt::format("the axes make more than {} cells (tasks x controls x scalings x lengths x depths)", kMaxCells));
  return a;
}

json sample_record(const TaskSample& s, const SampleOutcome& o, const std::string& scaling, bool log_prompts) {
  json r;
  r["seed"] = s.seed;
  r["task"] = s.task;
  r["control"] = std::string(to_string(s.control));
  r["rope_scaling"] = scaling;
  r["length"] = s.length;
  r["depth"] = depth_json(s.depth);
  r["index"] = s.index;
  r["prompt_tokens"] = s.prompt_tokens.size();
  {
    std::string_view bytes(reinterpret_cast<const char*>(s.prompt_tokens.data()), s.prompt_tokens.size() * sizeof(int32_t));
    r["prompt_hash"] = hex16(hash_bytes(bytes));
  }
  r["context_start"] = s.context_start;
  r["context_tokens"] = s.context_tokens;
  r["haystack_start"] = s.haystack_start;
  r["haystack_units"] = s.haystack_sentences;
  json needles = json::array();
  for (const auto& n : s.needles)
    needles.push_back({{"role", n.role},
                       {"target_depth", n.target_depth},
                       {"depth", n.depth},
                       {"token_position", n.token_position},
                       {"tokens", n.tokens},
                       {"sentence_index", n.sentence_index}});
  r["needles"] = needles;
  if (!s.choice_tokens.empty()) {
    r["choices"] = s.choices;
    std::vector<std::size_t> nt;
    for (const auto& t : s.choice_tokens) nt.push_back(t.size());
    r["choice_tokens"] = nt;
    r["choice_bytes"] = s.choice_bytes;
    r["equal_length_choices"] = s.equal_length_choices;
    r["candidate_logprobs"] = o.logprobs;
    r["answer"] = s.choices[static_cast<std::size_t>(s.gold)];
    r["gold"] = s.gold;
    r["metric"] = s.metric;
    r["predicted"] = o.predicted;
    r["predicted_by_metric"] = {{"acc_norm", o.predicted}, {"acc", o.predicted_acc}};
    r["correct_by_metric"] = {{"acc_norm", o.correct}, {"acc", o.correct_acc}};
    if (s.control != TaskControl::none) r["original_answer"] = s.choices[static_cast<std::size_t>(s.original_gold)];
  } else {
    r["answer"] = s.answers;
    if (s.control != TaskControl::none) r["original_answer"] = s.original_answers;
    r["metric"] = s.metric;
    r["predicted_tokens"] = o.generated_tokens >= 0 ? o.generated_tokens : static_cast<int64_t>(o.new_tokens.size());
  }
  r["prediction"] = o.prediction;
  r["score"] = o.score;
  r["correct"] = o.correct;
  if (s.control != TaskControl::none) r["kept_original"] = o.kept_original;
  if (log_prompts) {
    r["prompt"] = s.prompt_text;
    r["prompt_token_ids"] = s.prompt_tokens;
  }
  return r;
}

// One metric's counts of a cell: {"correct", "accuracy", "ci_low", "ci_high"}.
json metric_json(int64_t n, int64_t correct) {
  const Interval ci = wilson_interval(correct, n);
  return {{"correct", correct},
          {"accuracy", n > 0 ? json(static_cast<double>(correct) / static_cast<double>(n)) : json(nullptr)},
          {"ci_low", ci.low},
          {"ci_high", ci.high}};
}

// The metrics a cell of `task` reports, the primary first.
std::vector<std::string> task_metrics(const std::string& task) {
  const TaskInfo& info = find_eval_task(task);
  if (info.kind == TaskKind::choice) return {std::begin(kChoiceMetrics), std::end(kChoiceMetrics)};
  return {std::string(info.metric)};
}

// A cell: its coordinates, the primary metric's counts (correct, accuracy,
// ci_*), "metric" and "metrics" (every metric's counts; `correct_by_metric`
// in the order of task_metrics, empty for a cell without samples).
json cell_json(const std::string& task, const std::string& control, const std::string& scaling, int64_t L, double depth,
               int64_t n, const std::vector<int64_t>& correct_by_metric, const std::string& status = "ok") {
  const auto names = task_metrics(task);
  const int64_t correct = correct_by_metric.empty() ? 0 : correct_by_metric.front();
  const Interval ci = wilson_interval(correct, n);
  json metrics = json::object();
  for (std::size_t i = 0; i < names.size(); ++i)
    metrics[names[i]] = metric_json(n, i < correct_by_metric.size() ? correct_by_metric[i] : 0);
  return {{"task", task},
          {"control", control},
          {"rope_scaling", scaling},
          {"length", L},
          {"depth", depth_json(depth)},
          {"n", n},
          {"correct", correct},
          {"accuracy", n > 0 ? json(static_cast<double>(correct) / static_cast<double>(n)) : json(nullptr)},
          {"ci_low", ci.low},
          {"ci_high", ci.high},
          {"status", status},
          {"metric", names.front()},
          {"metrics", metrics}};
}

bool cell_ok(const json& c) { return c.value("status", std::string("ok")) == "ok" && c.at("n").get<int64_t>() > 0; }

// Checks that the JSON `v` holds the depth `d` (null for tasks without depth).
void check_depth(const JsonView& v, double d, std::string_view expected_where) {
  if (d < 0) {
    if (!v.is_null()) v.fail(fmt::format("expected null (the cell {} has no depth)", expected_where));
  } else if (v.number(0.0, 1.0) != d) {
    v.fail(fmt::format("is {}, the cell {} has depth {}", v.raw().dump(), expected_where, depth_key(d)));
  }
}

void check_string(const JsonView& v, const std::string& expected, std::string_view where) {
  const std::string got = v.string();
  if (got != expected) v.fail(fmt::format("is {}, expected {} ({})", shown_string(got), shown_string(expected), where));
}

// Reads and checks cells/<name>.json against the cell it must hold: its
// checksum, its coordinates (task, control, scaling, length, depth) and every
// sample's, n = the run's samples (0 when it does not fit), `correct` = the
// samples marked correct, accuracy = correct / n. A cell copied over another,
// edited or truncated is a DataError naming the file. Returns the document.
JsonDocument load_cell(const fs::path& p, const Group& g, double depth, const Axes& a) {
  const JsonDocument doc = read_json_document(p);
  const JsonView root = doc.root();
  check_checksum(root);
  const std::string where = fmt::format("named {}", p.filename().string());
  const JsonView cell = root.at("cell");
  check_string(cell.at("task"), g.task, where);
  check_string(cell.at("control"), g.control, where);
  check_string(cell.at("rope_scaling"), g.scaling, where);
  if (cell.at("length").integer() != g.length)
    cell.at("length").fail(fmt::format("is {}, the cell {} has length {}", cell.at("length").raw().dump(), where, g.length));
  check_depth(cell.at("depth"), depth, where);
  const std::string status = cell.string_or("status", "ok");
  if (status != "ok" && status != "does not fit" && status != detail::kNotSupported)
    cell.at("status").fail(fmt::format("expected \"ok\", \"does not fit\" or \"{}\"", detail::kNotSupported));
  const int64_t n = cell.at("n").integer(0, a.samples);
  if (status == "ok" && n != a.samples) cell.at("n").fail(fmt::format("is {}, the run has {} samples per cell", n, a.samples));
  if (status != "ok" && n != 0) cell.at("n").fail(fmt::format("must be 0 for a cell that is \"{}\"", status));
  const int64_t correct = cell.at("correct").integer(0, n);
  const JsonView acc = cell.at("accuracy");
  if (n == 0) {
    if (!acc.is_null()) acc.fail("must be null when n is 0");
  } else if (acc.number(0.0, 1.0) != static_cast<double>(correct) / static_cast<double>(n)) {
    acc.fail(fmt::format("is not correct / n = {} / {}", correct, n));
  }
  const double lo = cell.at("ci_low").number(0.0, 1.0), hi = cell.at("ci_high").number(0.0, 1.0);
  if (lo > hi) cell.at("ci_low").fail("is above ci_high");
  // Generator version 2 cells: "metric" (the primary, whose counts the cell's
  // correct/accuracy are) and "metrics"; earlier cells have neither.
  std::vector<std::string> metric_names;
  if (const auto metrics = cell.find("metrics")) {
    const std::string primary = cell.at("metric").string();
    metric_names = task_metrics(g.task);
    if (primary != metric_names.front())
      cell.at("metric").fail(fmt::format("is {}, task {} reports {} first", shown_string(primary), g.task,
                                         metric_names.front()));
    for (const auto& m : metric_names) {
      const JsonView e = metrics->at(m);
      const int64_t km = e.at("correct").integer(0, n);
      if (m == primary && km != correct) e.at("correct").fail(fmt::format("is {}, the cell's correct is {}", km, correct));
      const Interval ci = wilson_interval(km, n);
      if (e.at("ci_low").number(0.0, 1.0) != ci.low || e.at("ci_high").number(0.0, 1.0) != ci.high)
        e.fail(fmt::format("ci_low/ci_high are not the Wilson 95% interval of {} / {}", km, n));
      const JsonView am = e.at("accuracy");
      if (n == 0 ? !am.is_null() : am.number(0.0, 1.0) != static_cast<double>(km) / static_cast<double>(n))
        am.fail(fmt::format("is not correct / n = {} / {}", km, n));
    }
  }
  std::vector<int64_t> k_by_metric(metric_names.size(), 0);
  const JsonView samples = root.at("samples");
  if (static_cast<int64_t>(samples.size()) != n)
    samples.fail(fmt::format("holds {} samples, the cell says n = {}", samples.size(), n));
  int64_t k = 0;
  for (std::size_t i = 0; i < samples.size(); ++i) {
    const JsonView s = samples.at(i);
    const std::string swhere = fmt::format("sample of the cell {}", where);
    check_string(s.at("task"), g.task, swhere);
    check_string(s.at("control"), g.control, swhere);
    check_string(s.at("rope_scaling"), g.scaling, swhere);
    if (s.at("length").integer() != g.length) s.at("length").fail(fmt::format("expected {} ({})", g.length, swhere));
    check_depth(s.at("depth"), depth, where);
    if (s.at("index").integer() != static_cast<int64_t>(i)) s.at("index").fail(fmt::format("expected {} (samples in order)", i));
    k += s.at("correct").boolean() ? 1 : 0;
    if (metric_names.size() > 1) {
      const JsonView by = s.at("correct_by_metric");
      for (std::size_t m = 0; m < metric_names.size(); ++m) k_by_metric[m] += by.at(metric_names[m]).boolean() ? 1 : 0;
    }
    (void)s.boolean_or("kept_original", false);
    (void)s.at("prediction");
  }
  if (k != correct) cell.at("correct").fail(fmt::format("is {}, {} samples are marked correct", correct, k));
  for (std::size_t m = 1; m < k_by_metric.size(); ++m) {
    const JsonView e = cell.at("metrics").at(metric_names[m]).at("correct");
    if (e.integer() != k_by_metric[m])
      e.fail(fmt::format("is {}, {} samples are marked correct under {}", e.integer(), k_by_metric[m], metric_names[m]));
  }
  return doc;
}

// Reads and checks ppl/<scaling>__L<length>.json: checksum, coordinates and
// the fields ppl.json copies.
JsonDocument load_ppl(const fs::path& p, const std::string& scaling, int64_t length) {
  const JsonDocument doc = read_json_document(p);
  const JsonView r = doc.root();
  check_checksum(r);
  check_string(r.at("rope_scaling"), scaling, fmt::format("named {}", p.filename().string()));
  if (r.at("context").integer() != length)
    r.at("context").fail(fmt::format("expected {} (the file is named {})", length, p.filename().string()));
  (void)r.at("factor").number();
  (void)r.at("ppl");  // a number, or null if it overflowed
  // eval --endpoint: a result not computed ("does not fit", "not supported by
  // this endpoint") has null nll/ppl, no tokens and no buckets.
  const std::string status = r.string_or("status", "ok");
  if (status != "ok") {
    if (status != "does not fit" && status != detail::kNotSupported)
      r.at("status").fail(fmt::format("expected \"ok\", \"does not fit\" or \"{}\"", detail::kNotSupported));
    if (!r.at("nll").is_null() || !r.at("ppl").is_null() || r.at("tokens").integer() != 0 || r.at("buckets").size() != 0)
      r.fail("a result that is not computed must have null nll and ppl, tokens 0 and no buckets");
    return doc;
  }
  (void)r.at("nll").number();
  (void)r.at("tokens").integer(0);
  (void)r.at("windows").integer(0);
  for (const JsonView& b : r.at("buckets").elements()) {
    (void)b.at("start").integer(0);
    (void)b.at("end").integer(0);
    (void)b.at("nll").number();
    (void)b.at("tokens").integer(0);
  }
  return doc;
}

std::string fingerprint(const RopeSetup& r) {
  std::string f(reinterpret_cast<const char*>(r.freqs.inv_freq.data()), r.freqs.inv_freq.size() * sizeof(float));
  f += fmt::format("|{}|{}|{}|{}|{}", r.freqs.attention_factor, r.freqs.rotary_dim, r.freqs.head_dim,
                   to_string(r.layout), to_string(r.precision));
  return f;
}


void note(const std::string& message) {
  fmt::print(stderr, "eval: note: {}\n", message);
  std::fflush(stderr);
}

// write_file_atomic writes <path>.tmp.<pid>.<n> and renames it; a SIGKILL in
// between leaves the temporary behind. Under the run directory's exclusive
// lock no other process writes there, so every such file is stale: removed.
void remove_run_temporaries(const fs::path& run_dir) {
  for (const fs::path& d : {run_dir, run_dir / "cells", run_dir / "ppl"})
    for (const fs::path& p : remove_stale_temporaries(d, /*all=*/true))
      eval_warn(fmt::format("{}: removed a stale temporary file (a killed run)", p.string()));
}

// What both run ids hash of the run's axes (the haystack's contents, tasks, lengths, depths, samples, controls,
// seed, choices, perplexity tokens); a JSON object's keys are sorted, so the order of insertion does not matter.
void add_run_axes(json& a, const EvalConfig& c) {
  a["haystack"] = c.haystack_path.empty() ? std::string("none") : file_hash(c.haystack_path);
  a["tasks"] = c.tasks;
  a["lengths"] = c.lengths;
  a["depths"] = c.depths;
  a["samples"] = c.samples;
  std::vector<std::string> ctl;
  for (auto x : c.controls) ctl.emplace_back(to_string(x));
  a["controls"] = ctl;
  a["seed"] = c.seed;
  a["choices"] = c.choices;
  a["ppl_tokens"] = c.ppl_tokens;
}

// TEST-ONLY: POSENC_EVAL_TEST_GROUP_DELAY_MS=n sleeps n ms after each
// persisted group, so the resume test can kill a run between groups however
// fast the machine is. Unset in normal use.
void test_group_delay() {
  static const long ms = [] {
    const char* e = std::getenv("POSENC_EVAL_TEST_GROUP_DELAY_MS");
    return e ? std::strtol(e, nullptr, 10) : 0L;
  }();
  if (ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(ms));
}

}  // namespace

// ---------------------------------------------------------------- config

std::vector<int64_t> default_eval_lengths(const Model& model) {
  const int64_t T = model.trained_context();
  if (T < 1) fail_field<InvalidArgument>("trained context", "must be >= 1", T);
  const int64_t table = model.config().max_position_embeddings;
  const bool capped = model.family() == PositionFamily::learned_absolute && table > 0;
  // A learned table bounds every length; a --trained-context past it (the user's
  // claim) would otherwise leave no length at all: the list then follows the table.
  const int64_t base = capped ? std::min(T, table) : T;
  std::vector<int64_t> out;
  for (const int64_t L : {base / 2, base, 2 * base, 4 * base, 8 * base}) {
    const int64_t x = std::clamp<int64_t>(L, 8, int64_t{1} << 20);
    if (capped && x > table) continue;
    if (out.empty() || x > out.back()) out.push_back(x);
  }
  if (out.empty()) out.push_back(8);  // a table shorter than 8 positions: validate_eval_config names the limit
  return out;
}

std::vector<std::string> default_eval_tasks(const Tokenizer& tokenizer) {
  if (!tokenizer.is_symbolic()) return {"name_recall"};
  const Haystack none;
  const TaskGenerator gen(tokenizer, none, TaskOptions{});
  try {
    (void)gen.make("associative_recall", 0, 16, 0.0);
  } catch (const TaskDoesNotFit&) {
  } catch (const ConfigError& e) {
    throw ConfigError(fmt::format("--tasks: no default task for this model's symbol vocabulary ({})", e.what()));
  }
  return {"associative_recall"};
}

void validate_eval_config(EvalConfig& c) {
  if (c.tasks.empty()) throw ConfigError("--tasks: at least one task is required");
  {
    std::set<std::string> seen;
    for (const auto& t : c.tasks) {
      find_eval_task(t);
      if (!seen.insert(t).second) throw ConfigError(fmt::format("--tasks: '{}' listed twice", t));
    }
  }
  if (c.lengths.empty()) throw ConfigError("--context: at least one length is required");
  std::sort(c.lengths.begin(), c.lengths.end());
  for (std::size_t i = 0; i < c.lengths.size(); ++i) {
    if (c.lengths[i] < kMinEvalLength || c.lengths[i] > kMaxEvalLength)  // the CLI's check (lengths_in) says the same
      throw ConfigError(fmt::format("--context: a length must be an integer in [{}, {}] (got {})", kMinEvalLength,
                                    kMaxEvalLength, c.lengths[i]));
    if (i > 0 && c.lengths[i] == c.lengths[i - 1])
      throw ConfigError(fmt::format("--context: {} listed twice", c.lengths[i]));
  }
  if (c.depths.empty()) throw ConfigError("--depths: at least one depth is required");
  std::sort(c.depths.begin(), c.depths.end());
  for (std::size_t i = 0; i < c.depths.size(); ++i) {
    if (!(c.depths[i] >= 0.0 && c.depths[i] <= 1.0))
      throw ConfigError(fmt::format("--depths: must be in [0, 1] (got {})", c.depths[i]));
    if (i > 0 && c.depths[i] == c.depths[i - 1]) throw ConfigError(fmt::format("--depths: {} listed twice", c.depths[i]));
  }
  if (c.samples < 1 || c.samples > 1000000) throw ConfigError(fmt::format("--samples: must be in [1, 1000000] (got {})", c.samples));
  if (c.rope_scalings.empty()) throw ConfigError("--rope-scaling: at least one method is required");
  {
    std::set<std::string> seen;
    for (const auto& s : c.rope_scalings) {
      if (!c.scaling_labels) is_rope_scaling_name(s);
      else if (!safe_component(s))
        throw ConfigError(fmt::format("--endpoint: label {} is not one path component of [A-Za-z0-9._-]", shown_string(s)));
      if (!seen.insert(s).second)
        throw ConfigError(fmt::format("{}: '{}' listed twice", c.scaling_labels ? "--endpoint label" : "--rope-scaling", s));
    }
    if (c.scaling_labels && c.rope_factor)
      throw ConfigError("--rope-factor: scaling a served model is the server's business (label each endpoint instead)");
  }
  if (c.rope_factor && (!std::isfinite(*c.rope_factor) || *c.rope_factor <= 0))
    fail_field<ConfigError>("--rope-factor", "must be finite and > 0", *c.rope_factor);
  if (c.controls.empty()) throw ConfigError("--control: at least one control (none, swap, shuffle) is required");
  {
    std::set<TaskControl> seen;
    for (auto ctl : c.controls) {
      if (ctl == TaskControl::absent)
        throw ConfigError("--control: absent is not chosen: it runs by itself for every forced-choice task (it "
                          "measures the chance level)");
      if (!seen.insert(ctl).second) throw ConfigError(fmt::format("--control: '{}' listed twice", to_string(ctl)));
    }
  }
  if (c.choices < 2 || c.choices > 16) fail_field<ConfigError>("--choices", "must be in [2, 16]", c.choices);
  if (!(c.threshold >= 0.0 && c.threshold <= 1.0)) fail_field<ConfigError>("--threshold", "must be in [0, 1]", c.threshold);
  if (!(c.min_baseline >= 0.0 && c.min_baseline <= 1.0))
    fail_field<ConfigError>("--min-baseline", "must be in [0, 1]", c.min_baseline);
  if (c.ppl_tokens < -1 || c.ppl_tokens > kMaxPplTokens)
    fail_field<ConfigError>("--ppl-tokens", "must be -1 (skip), 0 (whole text) or in [1, 2^48]", c.ppl_tokens);
  if (c.haystack_path.empty()) {
    for (const auto& t : c.tasks)
      if (find_eval_task(t).uses_haystack)
        throw ConfigError(fmt::format("--haystack: required by task {} (its context is built from the text)", t));
    if (c.ppl_tokens >= 0)
      throw ConfigError(fmt::format("--haystack: required by the perplexity matrix (--ppl-tokens {}); "
                                    "--ppl-tokens -1 skips it",
                                    c.ppl_tokens));
  }
  if (c.choices > 10 && std::find(c.tasks.begin(), c.tasks.end(), "associative_recall") != c.tasks.end())
    fail_field<ConfigError>("--choices", "must be <= 10 for associative_recall (its values are the digits 0..9)",
                            c.choices);
  if (c.shard_count < 1 || c.shard_index < 0 || c.shard_index >= c.shard_count)
    throw ConfigError(fmt::format("--shard: must be i/n with 0 <= i < n (got {}/{})", c.shard_index, c.shard_count));
  if (c.out.empty()) throw ConfigError("--out: an output directory is required");
  if (const auto cells = cell_count(axes_from_config(c)); !cells || *cells > kMaxCells)
    throw ConfigError(fmt::format("--tasks x --control x --rope-scaling x --context x --depths: more than {} cells",
                                  kMaxCells));
}

std::string eval_run_id(const EvalConfig& c, const Model& model) {
  json a;
  a["generator_version"] = kTaskGeneratorVersion;
  a["model"] = file_hash(c.model_path);
  // An empty tokenizer path means the vocabulary embedded in the model file
  // (hashed with it); an empty haystack path, no haystack (validated above).
  a["tokenizer"] = c.tokenizer_path.empty() ? std::string("embedded") : file_hash(c.tokenizer_path);
  add_run_axes(a, c);
  a["rope_scalings"] = c.rope_scalings;
  a["rope_factor"] = c.rope_factor ? json(*c.rope_factor) : json(nullptr);
  a["rope_layout"] = std::string(to_string(model.rope().layout));
  a["angle_precision"] = std::string(to_string(model.rope().precision));
  a["rope_theta"] = model.rope().params.rope_theta;
  // Positional overrides and load options that change results (--config,
  // --trained-context, --quantized-matmul, --dense-matmul); added only when not the defaults,
  // so the ids of earlier runs stay valid.
  const RopeParams& rp = model.rope().params;
  if (rp.rope_type != "default" || rp.factor) {
    const auto& f = model.rope().freqs;
    a["rope_type"] = rp.rope_type;
    a["inv_freq"] = hex16(hash_bytes(std::string_view(reinterpret_cast<const char*>(f.inv_freq.data()),
                                                      f.inv_freq.size() * sizeof(float))));
    a["attention_factor"] = f.attention_factor;
    a["rope_factor_native"] = rp.factor ? json(*rp.factor) : json(nullptr);
  }
  if (model.trained_context() != model.config().max_position_embeddings) a["trained_context"] = model.trained_context();
  // A mode the model has no matrices for changes nothing, and leaves the id alone.
  if (model.quantized_matmul() != QuantizedMatmul::dequantize && model.has_block_quantized_matrices())
    a["quantized_matmul"] = std::string(to_string(model.quantized_matmul()));
  if (model.dense_matmul() != DenseMatmul::float32 && model.has_half_precision_matrices())
    a["dense_matmul"] = std::string(to_string(model.dense_matmul()));
  if (model.kv_cache_dtype() != KvCacheDtype::f32) a["kv_dtype"] = std::string(to_string(model.kv_cache_dtype()));
  return hex16(hash_bytes(a.dump()));
}

fs::path resolve_run_dir(const fs::path& dir) {
  if (fs::exists(dir / "run.json")) return dir;
  const fs::path latest = dir / "LATEST";
  if (fs::exists(latest)) {
    std::string id = read_file(latest, 4096);
    while (!id.empty() && (id.back() == '\n' || id.back() == '\r' || id.back() == ' ')) id.pop_back();
    // LATEST names a direct child of dir: never an absolute path or ../.
    if (!safe_component(id))
      throw DataError(fmt::format("{}: names {}, not a run directory of {} (expected one path component of "
                                  "[A-Za-z0-9._-], not '.' or '..')",
                                  latest.string(), shown_string(id), dir.string()));
    const fs::path p = dir / id;
    if (fs::exists(p / "run.json")) return p;
    throw IoError(fmt::format("{}: LATEST names run '{}' but {} has no run.json", dir.string(), id, p.string()));
  }
  throw IoError(fmt::format("{}: no run.json and no LATEST file (not an eval run directory)", dir.string()));
}

// ---------------------------------------------------------------- outputs

namespace {

struct Collected {
  json cells = json::array();
  std::vector<json> samples;  // in canonical order
  int64_t expected = 0;
  int64_t present = 0;
};

// Every cell of the run's axes found in cells/, each checked by load_cell: a
// cell file that does not hold its cell is a DataError, never counted.
Collected collect_cells(const fs::path& run_dir, const Axes& a) {
  Collected c;
  for (const auto& g : groups_of(a))
    for (double d : task_depths(a, g.task, g.control)) {
      ++c.expected;
      const fs::path p = run_dir / "cells" / (cell_name(g.task, g.control, g.scaling, g.length, d) + ".json");
      if (!fs::exists(p)) continue;
      const JsonDocument doc = load_cell(p, g, d, a);
      c.cells.push_back(doc.raw().at("cell"));
      for (const auto& s : doc.raw().at("samples")) c.samples.push_back(s);
      ++c.present;
    }
  return c;
}

// summarise and summary_csv index the cells and samples collect_cells read:
// every key they use was checked by load_cell (type and, for coordinates,
// value), so these .at() calls on in-memory values cannot throw.
// The metrics of a cell read back: name -> (n, correct). Cells of generator
// version 2 carry "metrics"; earlier ones only their primary counts, which
// were acc (summed log-probabilities) for forced choice.
std::vector<std::pair<std::string, std::pair<int64_t, int64_t>>> cell_metric_counts(const json& c) {
  std::vector<std::pair<std::string, std::pair<int64_t, int64_t>>> out;
  const int64_t n = c.at("n").get<int64_t>();
  if (c.contains("metrics")) {
    for (const auto& m : task_metrics(c.at("task").get<std::string>()))
      out.push_back({m, {n, c.at("metrics").at(m).at("correct").get<int64_t>()}});
  } else {
    const TaskInfo& info = find_eval_task(c.at("task").get<std::string>());
    out.push_back({info.kind == TaskKind::choice ? "acc" : std::string(info.metric), {n, c.at("correct").get<int64_t>()}});
  }
  return out;
}

// The metrics cells of `task` report in this run (the primary first).
std::vector<std::string> metrics_present(const json& cells, const std::string& task) {
  std::vector<std::string> out;
  for (const auto& c : cells)
    if (c.at("task") == task)
      for (const auto& [m, nk] : cell_metric_counts(c))
        if (std::find(out.begin(), out.end(), m) == out.end()) out.push_back(m);
  return out;
}

json summarise(const Collected& col, const Axes& a, const std::string& run_id, const json& model_info) {
  json summary;
  summary["schema_version"] = 2;
  summary["run_id"] = run_id;
  summary["complete"] = col.present == col.expected;
  summary["cells_expected"] = col.expected;
  summary["cells_present"] = col.present;
  summary["threshold"] = a.threshold;
  summary["min_baseline"] = a.min_baseline;
  summary["model"] = model_info;
  summary["cells"] = col.cells;
  // Index cells.
  std::map<std::tuple<std::string, std::string, std::string, int64_t>, std::vector<const json*>> by_group;
  for (const auto& c : col.cells)
    by_group[{c.at("task").get<std::string>(), c.at("control").get<std::string>(), c.at("rope_scaling").get<std::string>(),
              c.at("length").get<int64_t>()}]
        .push_back(&c);
  // (n, correct) of one metric pooled over a group's cells.
  auto pooled = [](const std::vector<const json*>& cells, const std::string& metric) {
    std::pair<int64_t, int64_t> nk{0, 0};
    for (const json* c : cells)
      for (const auto& [m, x] : cell_metric_counts(*c))
        if (m == metric) nk = {nk.first + x.first, nk.second + x.second};
    return nk;
  };
  // Measured chance: the absent control of (task, scaling), per metric,
  // pooled over the run's lengths (its cells that fit).
  struct Chance {
    double level = 0.0;
    Interval ci{0.0, 0.0};
    std::string source = "none";
    int64_t n = 0, k = 0;
  };
  json chance_list = json::array();
  auto chance_of = [&](const std::string& t, const std::string& s, const std::string& metric) {
    const TaskInfo& info = find_eval_task(t);
    Chance ch;
    if (info.kind != TaskKind::choice) return ch;
    const double assumed = 1.0 / a.choices;
    for (int64_t L : a.lengths) {
      auto it = by_group.find({t, "absent", s, L});
      if (it == by_group.end() || !std::all_of(it->second.begin(), it->second.end(), [](const json* c) { return cell_ok(*c); }))
        continue;
      const auto [n, k] = pooled(it->second, metric);
      ch.n += n;
      ch.k += k;
    }
    if (ch.n > 0) {
      ch.level = static_cast<double>(ch.k) / static_cast<double>(ch.n);
      ch.ci = wilson_interval(ch.k, ch.n);
      ch.source = "measured";
    } else {
      ch.level = assumed;
      ch.ci = {assumed, assumed};
      ch.source = "assumed";
    }
    return ch;
  };
  for (const auto& t : a.tasks) {
    if (find_eval_task(t).kind != TaskKind::choice) continue;
    for (const auto& s : a.scalings)
      for (const auto& m : metrics_present(col.cells, t)) {
        const Chance ch = chance_of(t, s, m);
        if (ch.source != "measured") continue;
        chance_list.push_back({{"task", t}, {"rope_scaling", s}, {"metric", m}, {"n", ch.n}, {"correct", ch.k},
                               {"accuracy", ch.level}, {"ci_low", ch.ci.low}, {"ci_high", ch.ci.high},
                               {"assumed", 1.0 / a.choices}});
      }
  }
  summary["chance"] = chance_list;

  json eff = json::array();
  for (const auto& t : a.tasks) {
    const auto metrics = metrics_present(col.cells, t);
    for (const auto& ctl : a.controls) {
      const std::size_t nd = task_depths(a, t, ctl).size();
      for (const auto& s : a.scalings)
        for (const auto& metric : metrics) {
          const Chance ch = chance_of(t, s, metric);
          // The gate: the baseline's Wilson lower bound must exceed the upper
          // Wilson bound of the measured chance (both are estimates; a chance
          // level measured low by sampling noise must not make a model at
          // chance "solvable"), or the assumed 1/K without a measurement.
          const double gate = ch.source == "measured" ? ch.ci.high : ch.level;
          json chance_fields{{"chance", ch.level},
                             {"chance_ci_low", ch.ci.low},
                             {"chance_ci_high", ch.ci.high},
                             {"chance_source", ch.source},
                             {"chance_gate", gate}};
          std::vector<LengthAccuracy> la;
          bool complete = true, unsupported = true;  // unsupported: every cell is "not supported by this endpoint"
          for (int64_t L : a.lengths) {
            auto it = by_group.find({t, ctl, s, L});
            if (it == by_group.end() || it->second.size() != nd) {
              complete = false;
              break;
            }
            if (!std::all_of(it->second.begin(), it->second.end(), [](const json* c) { return cell_ok(*c); })) {
              for (const json* cell : it->second)
                unsupported = unsupported && cell->value("status", std::string("ok")) == detail::kNotSupported;
              continue;  // does not fit at this length: not part of the length curve
            }
            unsupported = false;
            const auto [n, k] = pooled(it->second, metric);
            // Every cell of a group has n = samples: the depth average is the pooled rate.
            la.push_back({L, n > 0 ? static_cast<double>(k) / static_cast<double>(n) : 0.0, n, k});
          }
          if (!complete) continue;
          json e{{"task", t}, {"control", ctl}, {"rope_scaling", s}, {"metric", metric}};
          if (la.empty()) {
            e.update({{"baseline", nullptr}, {"threshold", nullptr}, {"length", nullptr}, {"solvable", false},
                      {"status", unsupported ? detail::kNotSupported : "does not fit at any tested length"},
                      {"accuracy_by_length", json::array()}});
            e.update(chance_fields);
            eff.push_back(e);
            continue;
          }
          const EffectiveContext r = effective_context(la, a.threshold, gate, a.min_baseline);
          json acc = json::array();
          for (const auto& x : la) {
            const Interval ci = wilson_interval(x.correct, x.n);
            acc.push_back({{"length", x.length}, {"accuracy", x.accuracy}, {"n", x.n}, {"correct", x.correct},
                           {"ci_low", ci.low}, {"ci_high", ci.high}});
          }
          e.update({{"baseline", r.baseline},
                    {"baseline_ci_low", r.baseline_ci.low},
                    {"baseline_ci_high", r.baseline_ci.high},
                    {"threshold", r.threshold},
                    {"length", r.length ? json(*r.length) : json(nullptr)},
                    {"solvable", r.solvable},
                    {"status", !r.solvable ? "not solvable by this model"
                               : r.length  ? "ok"
                                           : "below threshold at the shortest length"},
                    {"baseline_length", la.front().length},
                    {"accuracy_by_length", acc}});
          e.update(chance_fields);
          eff.push_back(e);
        }
    }
  }
  summary["effective_context"] = eff;

  // Controls: did the prediction move with the evidence?
  std::map<std::tuple<std::string, std::string, int64_t, std::string, int64_t>, const json*> base;
  for (const auto& s : col.samples)
    if (s.at("control") == "none")
      base[{s.at("task").get<std::string>(), s.at("rope_scaling").get<std::string>(), s.at("length").get<int64_t>(),
            s.at("depth").dump(), s.at("index").get<int64_t>()}] = &s;
  struct Agg {
    int64_t n = 0, followed = 0, kept = 0, paired = 0, changed = 0, base_correct = 0;
  };
  std::map<std::tuple<std::string, std::string, std::string, int64_t>, Agg> agg;
  for (const auto& s : col.samples) {
    if (s.at("control") == "none" || s.at("control") == "absent") continue;
    auto& g = agg[{s.at("task").get<std::string>(), s.at("control").get<std::string>(), s.at("rope_scaling").get<std::string>(),
                   s.at("length").get<int64_t>()}];
    ++g.n;
    g.followed += s.at("correct").get<bool>() ? 1 : 0;
    g.kept += s.value("kept_original", false) ? 1 : 0;
    auto it = base.find({s.at("task").get<std::string>(), s.at("rope_scaling").get<std::string>(), s.at("length").get<int64_t>(),
                         s.at("depth").dump(), s.at("index").get<int64_t>()});
    if (it != base.end()) {
      ++g.paired;
      g.changed += it->second->at("prediction") != s.at("prediction") ? 1 : 0;
      g.base_correct += it->second->at("correct").get<bool>() ? 1 : 0;
    }
  }
  json controls = json::array();
  for (const auto& t : a.tasks)
    for (const auto& ctl : a.controls) {
      if (ctl == "none") continue;
      for (const auto& s : a.scalings)
        for (int64_t L : a.lengths) {
          auto it = agg.find({t, ctl, s, L});
          if (it == agg.end()) continue;
          const Agg& g = it->second;
          const Interval ci = wilson_interval(g.followed, g.n);
          controls.push_back({{"task", t},
                              {"control", ctl},
                              {"rope_scaling", s},
                              {"length", L},
                              {"n", g.n},
                              {"followed_evidence", g.followed},
                              {"followed_rate", g.n ? static_cast<double>(g.followed) / static_cast<double>(g.n) : 0.0},
                              {"ci_low", ci.low},
                              {"ci_high", ci.high},
                              {"kept_original_answer", g.kept},
                              {"paired_with_none", g.paired},
                              {"prediction_changed", g.changed},
                              {"none_correct", g.base_correct}});
        }
    }
  summary["controls"] = controls;
  return summary;
}

// One row per cell and metric (the primary metric's row first, primary = 1).
std::string summary_csv(const json& summary) {
  std::string out = "task,control,rope_scaling,length,depth,metric,primary,n,correct,accuracy,ci_low,ci_high,status\n";
  for (const auto& c : summary.at("cells")) {
    const auto counts = cell_metric_counts(c);
    for (std::size_t m = 0; m < counts.size(); ++m) {
      const auto [n, k] = counts[m].second;
      const Interval ci = wilson_interval(k, n);
      out += fmt::format("{},{},{},{},{},{},{},{},{},{},{:.6f},{:.6f},{}\n", c.at("task").get<std::string>(),
                         c.at("control").get<std::string>(), c.at("rope_scaling").get<std::string>(),
                         c.at("length").get<int64_t>(),
                         c.at("depth").is_null() ? std::string("") : fmt::format("{:g}", c.at("depth").get<double>()),
                         counts[m].first, m == 0 ? 1 : 0, n, k,
                         n > 0 ? fmt::format("{:.6f}", static_cast<double>(k) / static_cast<double>(n)) : std::string(""),
                         ci.low, ci.high, c.value("status", std::string("ok")));
    }
  }
  return out;
}

json write_outputs(const fs::path& run_dir, const JsonView& run, const Axes& a) {
  const Collected col = collect_cells(run_dir, a);
  json model_info = json::object();
  if (const auto m = run.find("model"); m && m->raw().is_object())
    for (const char* k : {"family", "trained_context"})
      if (m->raw().contains(k)) model_info[k] = m->raw().at(k);
  const json summary = summarise(col, a, checked_run_id(run.at("run_id")), model_info);
  std::string lines;
  for (const auto& s : col.samples) lines += s.dump() + "\n";
  // Perplexity matrix, in `posenc ppl --json`'s schema (read before anything is written).
  const auto jobs = ppl_jobs_of(a);
  json ppl;
  if (!jobs.empty()) {
    const auto h = run.find("ppl_header");
    if (h && !h->is_object()) h->fail("expected an object");
    ppl = h ? h->raw() : json::object();
    ppl["results"] = json::array();
    for (const auto& j : jobs) {
      const fs::path p = run_dir / "ppl" / (ppl_name(j) + ".json");
      if (!fs::exists(p)) continue;
      json r = load_ppl(p, j.scaling, j.length).raw();
      r.erase("checksum");
      ppl["results"].push_back(std::move(r));
    }
  }
  write_file_atomic(run_dir / "samples.jsonl", lines);
  write_file_atomic(run_dir / "summary.json", summary.dump(2) + "\n");
  write_file_atomic(run_dir / "summary.csv", summary_csv(summary));
  if (!jobs.empty()) write_file_atomic(run_dir / "ppl.json", ppl.dump(2) + "\n");
  return summary;
}

json write_outputs(const fs::path& run_dir, const json& run, const Axes& a) {
  const JsonDocument doc(run, (run_dir / "run.json").string());
  return write_outputs(run_dir, doc.root(), a);
}

}  // namespace

json rebuild_eval_outputs(const fs::path& dir, std::optional<double> threshold, std::optional<double> min_baseline) {
  const fs::path run_dir = resolve_run_dir(dir);
  const JsonDocument run = read_json_document(run_dir / "run.json");
  Axes a = axes_from_run_json(run.root());
  if (threshold) {
    if (!(*threshold >= 0.0 && *threshold <= 1.0)) fail_field<ConfigError>("--threshold", "must be in [0, 1]", *threshold);
    a.threshold = *threshold;
  }
  if (min_baseline) {
    if (!(*min_baseline >= 0.0 && *min_baseline <= 1.0))
      fail_field<ConfigError>("--min-baseline", "must be in [0, 1]", *min_baseline);
    a.min_baseline = *min_baseline;
  }
  return write_outputs(run_dir, run.root(), a);
}

std::vector<std::string> eval_resume_plan(const fs::path& dir) {
  const fs::path run_dir = resolve_run_dir(dir);
  const JsonDocument run = read_json_document(run_dir / "run.json");
  const Axes a = axes_from_run_json(run.root());
  (void)checked_run_id(run.root().at("run_id"));
  std::vector<std::string> todo;
  for (const auto& g : groups_of(a))
    for (double d : task_depths(a, g.task, g.control)) {
      const fs::path p = run_dir / "cells" / (cell_name(g.task, g.control, g.scaling, g.length, d) + ".json");
      if (!fs::exists(p)) {
        todo.push_back(p.string() + ": missing");
        continue;
      }
      try {
        (void)load_cell(p, g, d, a);
      } catch (const Error& e) {
        todo.push_back(e.what());
      }
    }
  for (const auto& j : ppl_jobs_of(a)) {
    const fs::path p = run_dir / "ppl" / (ppl_name(j) + ".json");
    if (!fs::exists(p)) {
      todo.push_back(p.string() + ": missing");
      continue;
    }
    try {
      (void)load_ppl(p, j.scaling, j.length);
    } catch (const Error& e) {
      todo.push_back(e.what());
    }
  }
  return todo;
}

std::string eval_file_checksum(const json& file) { return content_checksum(file); }

// ---------------------------------------------------------------- the run

EvalRunResult run_eval(const Model& model, const Tokenizer& tokenizer, std::string_view haystack_text, EvalConfig c,
                       const std::function<void(const EvalProgress&)>& on_progress) {
  if (c.scaling_labels) throw ConfigError("--rope-scaling: endpoint labels are for eval --endpoint only");
  return detail::run_eval_impl(&model, nullptr, tokenizer, haystack_text, std::move(c), on_progress);
}

namespace {

// The run id of an endpoint run (eval --endpoint): the arguments that change a
// result, as eval_run_id, with the served model's reported identity in place
// of the model file and its RoPE setup.
std::string endpoint_run_id(const EvalConfig& c, const json& endpoints) {
  json a;
  a["backend"] = "endpoint";
  a["generator_version"] = kTaskGeneratorVersion;
  a["endpoints"] = endpoints;
  a["tokenizer"] = file_hash(c.tokenizer_path);
  add_run_axes(a, c);
  a["labels"] = c.rope_scalings;
  return hex16(hash_bytes(a.dump()));
}

// A group's journal (eval --endpoint): its finished samples until its cells are written.
fs::path group_journal(const fs::path& run_dir, const std::string& task, const std::string& control,
                       const std::string& scaling, int64_t L) {
  return run_dir / "journal" / fmt::format("{}__{}__{}__L{}.jsonl", task, control, scaling, L);
}

}  // namespace

EvalRunResult detail::run_eval_impl(const Model* model_ptr, EndpointLab* endpoint, const Tokenizer& tokenizer,
                                    std::string_view haystack_text, EvalConfig c,
                                    const std::function<void(const EvalProgress&)>& on_progress) {
  if ((model_ptr == nullptr) == (endpoint == nullptr))
    throw InvalidArgument("run_eval_impl: exactly one of a model and an endpoint");
  validate_eval_config(c);
  const auto t0 = std::chrono::steady_clock::now();
  auto elapsed = [&] { return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(); };

  // RoPE scalings apply to RoPE models only; another family runs as trained.
  // A served model (endpoint): the scaling axis holds labels, scaling is the server's.
  const bool rope = model_ptr && model_ptr->family() == PositionFamily::rope;
  if (model_ptr && !rope)
    for (const auto& s : c.rope_scalings)
      if (s != "default")
        throw ConfigError(fmt::format("--rope-scaling: {} rescales RoPE; this model's positions are {} (only default "
                                      "applies)",
                                      s, eval_model_family(*model_ptr)));
  EvalRunResult res;
  res.run_id = model_ptr ? eval_run_id(c, *model_ptr) : endpoint_run_id(c, endpoint->run_id_material());
  res.run_dir = c.out / res.run_id;
  const fs::path run_dir = res.run_dir;

  // The haystack only when a task or the perplexity matrix reads it.
  const bool need_haystack =
      std::any_of(c.tasks.begin(), c.tasks.end(), [](const std::string& t) { return find_eval_task(t).uses_haystack; });
  const Haystack hay =
      need_haystack ? Haystack::build(haystack_text, tokenizer, TaskGenerator::candidate_names()) : Haystack{};
  // Each sentence is used at most once per sample: a haystack shorter than the longest length would give contexts
  // of a fraction of the length they are reported under.
  if (need_haystack && !c.lengths.empty()) {
    const int64_t longest = *std::max_element(c.lengths.begin(), c.lengths.end());
    if (hay.total_tokens() < longest)
      throw ConfigError(fmt::format(
          "--haystack: its usable sentences hold {} tokens ({} sentences; {} dropped for a digit or a candidate "
          "name), fewer than the longest length {}: a context would be shorter than the length it is reported "
          "under; give a longer text or shorter lengths",
          hay.total_tokens(), hay.size(), hay.dropped(), longest));
  }
  TaskOptions topt;
  topt.seed = c.seed;
  topt.choices = c.choices;
  const TaskGenerator gen(tokenizer, hay, topt);
  Axes axes = axes_from_config(c);
  const int64_t trained = model_ptr ? model_ptr->trained_context() : endpoint->trained_context();

  // Every task must be generatable (a length too short for a task is not an
  // error: its cells are recorded as "does not fit"). Checked before anything
  // is written, so e.g. a model without a task's vocabulary leaves no run.
  for (const auto& t : c.tasks)
    for (int64_t L : c.lengths) try {
        gen.make(t, 0, L, c.depths.front(), TaskControl::none);
      } catch (const TaskDoesNotFit&) {
      }
  // The perplexity matrix's token stream, encoded before anything is written
  // so a text the tokenizer cannot encode (an empty or binary file, a symbol
  // vocabulary) fails at once and leaves no run behind.
  const std::vector<int32_t> stream =
      c.ppl_tokens >= 0 ? encode_stream(tokenizer, haystack_text) : std::vector<int32_t>{};
  // And its lengths, against the text, before anything is written (`posenc ppl`'s rule): a length longer than the
  // text would score the whole text as one shorter window and report it under that length. A length asked for is
  // refused; a default one is left out of the matrix (its task cells still run), said on stderr and in run.json.
  std::string ppl_note;
  if (c.ppl_tokens >= 0) {
    const auto text_tokens = static_cast<int64_t>(stream.size());
    std::vector<int64_t> dropped;
    axes.ppl_lengths.clear();
    for (int64_t L : c.lengths) {
      if (text_tokens >= L) {
        axes.ppl_lengths.push_back(L);
        continue;
      }
      if (!c.default_lengths)
        throw InvalidArgument(fmt::format(
            "--context {}: the perplexity matrix's text ({}) has only {} tokens, so no window would be {} tokens "
            "long (give a longer text, lengths of at most {}, or --ppl-tokens -1 to skip the matrix)",
            L, c.haystack_path.empty() ? std::string("--haystack") : c.haystack_path, text_tokens, L, text_tokens));
      dropped.push_back(L);
    }
    if (!dropped.empty()) {
      ppl_note = fmt::format("default length{} {} left out of the perplexity matrix: the text has only {} tokens{}",
                             dropped.size() > 1 ? "s" : "", fmt::join(dropped, ", "), text_tokens,
                             axes.ppl_lengths.empty() ? " (no length left: no perplexity matrix)" : "");
      note(ppl_note);
    }
  }
  fs::create_directories(run_dir / "cells");
  // A second process on the same run directory fails at once instead of
  // duplicating the work and racing on the files.
  const DirectoryLock lock(run_dir, ".lock");
  remove_run_temporaries(run_dir);

  // ---- run.json (written first, so a partial run is self-describing) ----
  json run;
  run["run_id"] = res.run_id;
  run["posenc_version"] = "0.1.0";
  run["generator_version"] = kTaskGeneratorVersion;
  run["git_hash"] = c.git_hash.empty() ? json(nullptr) : json(c.git_hash);
  run["date"] = utc_now();
  run["command"] = c.command_line;
  {
    json cfg;
    cfg["tasks"] = c.tasks;
    cfg["lengths"] = c.lengths;
    cfg["depths"] = c.depths;
    cfg["samples"] = c.samples;
    cfg["rope_scalings"] = c.rope_scalings;
    cfg["rope_factor"] = c.rope_factor ? json(*c.rope_factor) : json(nullptr);
    cfg["controls"] = axes.controls;
    cfg["seed"] = c.seed;
    cfg["choices"] = c.choices;
    cfg["threshold"] = c.threshold;
    cfg["min_baseline"] = c.min_baseline;
    cfg["ppl_tokens"] = c.ppl_tokens;
    if (c.ppl_tokens >= 0) cfg["ppl_lengths"] = axes.ppl_lengths;
    if (!ppl_note.empty()) cfg["ppl_note"] = ppl_note;
    cfg["shard"] = fmt::format("{}/{}", c.shard_index, c.shard_count);
    cfg["log_prompts"] = c.log_prompts;
    cfg["absent_control"] = true;
    if (endpoint) cfg["scaling_axis"] = "endpoint_label";
    run["config"] = cfg;
  }
  run["seeds"] = {{"task_seed", c.seed},
                  {"rng", "splitmix64 streams keyed by (seed, task, sample index): 1 content, 2 haystack, 3 control"}};
  if (endpoint) {
    run["model"] = endpoint->model_json();
    run["endpoints"] = endpoint->endpoints_json();
    run["request_parameters"] = endpoint->request_parameters_json();
  } else {
  const Model& model = *model_ptr;
  const auto& mc = model.config();
  run["model"] = {{"path", c.model_path},
                  {"fnv1a64", file_hash(c.model_path)},
                  {"dim", mc.dim},
                  {"hidden_dim", mc.hidden_dim},
                  {"n_layers", mc.n_layers},
                  {"n_heads", mc.n_heads},
                  {"n_kv_heads", mc.n_kv_heads},
                  {"vocab_size", mc.vocab_size},
                  {"head_dim", mc.head_dim},
                  {"trained_context", trained},
                  {"trained_context_source", model.trained_context_source()},
                  {"family", eval_model_family(model)},
                  {"format", std::string(to_string(model.source().format))},
                  {"architecture", model.source().architecture},
                  {"weights", model.source().weights},
                  {"quantized_matmul", std::string(to_string(model.quantized_matmul()))},
                  {"dense_matmul", std::string(to_string(model.dense_matmul()))},
                  {"kv_dtype", std::string(to_string(model.kv_cache_dtype()))},
                  {"layout_reason", model.source().layout_reason}};
  }
  if (c.tokenizer_path.empty())
    run["tokenizer"] = {{"path", nullptr}, {"embedded", true}, {"vocab_size", tokenizer.vocab_size()}};
  else
    run["tokenizer"] = {{"path", c.tokenizer_path}, {"fnv1a64", file_hash(c.tokenizer_path)}, {"vocab_size", tokenizer.vocab_size()}};
  if (need_haystack)
    run["haystack"] = {{"path", c.haystack_path},
                       {"fnv1a64", hex16(hash_bytes(haystack_text))},
                       {"sentences", hay.size()},
                       {"sentences_dropped", hay.dropped()},
                       {"tokens", hay.total_tokens()},
                       {"filter", "sentences holding an ASCII digit or a name_recall candidate name are dropped"}};
  else
    run["haystack"] = {{"path", c.haystack_path.empty() ? json(nullptr) : json(c.haystack_path)},
                       {"used", false},
                       {"note", "no task of this run reads a haystack"}};
  json encs = json::array();
  for (const auto& s : c.rope_scalings)
    for (int64_t L : c.lengths) {
      if (!rope) break;  // other families and endpoints: positions as trained (or the server's), no RoPE setup
      const RopeSetup r = eval_rope_setup(*model_ptr, s, L, c.rope_factor);
      encs.push_back({{"rope_scaling", s},
                      {"length", L},
                      {"rope_type", r.freqs.rope_type},
                      {"factor", r.params.factor ? json(*r.params.factor) : json(nullptr)},
                      {"rope_theta", r.params.rope_theta},
                      {"original_max_position_embeddings", trained},
                      {"rotary_dim", r.freqs.rotary_dim},
                      {"attention_factor", r.freqs.attention_factor},
                      {"inv_freq_first", r.freqs.inv_freq.front()},
                      {"inv_freq_last", r.freqs.inv_freq.back()},
                      {"rope_layout", std::string(to_string(r.layout))},
                      {"angle_precision", std::string(to_string(r.precision))}});
    }
  run["encodings"] = encs;
  json tasks = json::array();
  for (const auto& t : c.tasks) {
    const TaskInfo& i = find_eval_task(t);
    tasks.push_back({{"name", std::string(i.name)},
                     {"kind", i.kind == TaskKind::choice ? "choice" : "generation"},
                     {"metric", std::string(i.metric)},
                     {"answer_budget", i.answer_budget},
                     {"uses_depth", i.uses_depth},
                     {"uses_haystack", i.uses_haystack},
                     {"description", std::string(i.summary)}});
  }
  run["tasks"] = tasks;
  run["scoring"] =
      "choice: acc_norm (primary; argmax of summed candidate log-prob / candidate UTF-8 bytes, lm-eval-harness "
      "acc_norm) and acc (argmax of summed log-prob); chance measured by the absent control (evidence removed); "
      "generation: greedy, stop at BOS/EOS, "
      "RULER normalisation (strip, control chars -> newline), case-insensitive substring match of every answer "
      "(string_match_all; correct = all found); passkey: first integer equals the key";
  if (endpoint)
    run["ppl_header"] = {{"model", run["model"].value("served_model", std::string())},
                         {"text", c.haystack_path},
                         {"endpoint", true},
                         {"trained_context", trained}};
  else
    run["ppl_header"] = {{"model", c.model_path},
                         {"text", c.haystack_path},
                         {"rope_layout", std::string(to_string(model_ptr->rope().layout))},
                         {"angle_precision", std::string(to_string(model_ptr->rope().precision))},
                         {"trained_context", trained}};
  run["threads"] = region_thread_count();
  write_file_atomic(run_dir / "run.json", run.dump(2) + "\n");
  // LATEST only ever names a run that has its run.json.
  write_file_atomic(c.out / "LATEST", res.run_id + "\n");

  // ---- units of this shard ----
  const auto groups = groups_of(axes);
  const auto pjobs = ppl_jobs_of(axes);
  struct Unit {
    bool is_ppl = false;
    std::size_t i = 0;
  };
  std::vector<Unit> units;
  {
    std::size_t u = 0;
    for (std::size_t i = 0; i < groups.size(); ++i, ++u)
      if (static_cast<int>(u % static_cast<std::size_t>(c.shard_count)) == c.shard_index) units.push_back({false, i});
    for (std::size_t i = 0; i < pjobs.size(); ++i, ++u)
      if (static_cast<int>(u % static_cast<std::size_t>(c.shard_count)) == c.shard_index) units.push_back({true, i});
  }
  for (const auto& g : groups) res.cells_total += static_cast<int64_t>(task_depths(axes, g.task, g.control).size());

  // Work weights (tokens) for the ETA.
  auto group_weight = [&](const Group& g) {
    return static_cast<double>(g.length) * static_cast<double>(task_depths(axes, g.task, g.control).size()) *
           static_cast<double>(c.samples);
  };
  double weight_total = 0, weight_done = 0, weight_done_here = 0;
  int64_t cells_shard = 0, cells_done = 0;
  std::vector<std::vector<std::string>> missing(units.size());
  for (std::size_t u = 0; u < units.size(); ++u) {
    if (units[u].is_ppl) continue;
    const Group& g = groups[units[u].i];
    const auto depths = task_depths(axes, g.task, g.control);
    cells_shard += static_cast<int64_t>(depths.size());
    weight_total += group_weight(g);
    for (double d : depths) {
      const std::string name = cell_name(g.task, g.control, g.scaling, g.length, d);
      const fs::path p = run_dir / "cells" / (name + ".json");
      if (!fs::exists(p)) {
        missing[u].push_back(name);
        continue;
      }
      // A cell on disk counts only if it holds its cell (coordinates, checksum).
      try {
        (void)load_cell(p, g, d, axes);
      } catch (const Error& e) {
        eval_warn(fmt::format("{}; recomputing the cell", e.what()));
        missing[u].push_back(name);
      }
    }
    if (missing[u].empty()) weight_done += group_weight(g);
    cells_done += static_cast<int64_t>(depths.size() - missing[u].size());
  }
  // The perplexity matrix is part of the ETA: a job weighs the tokens it
  // scores (each token of the stream is read once per job).
  auto ppl_weight = [&](const PplJob&) {
    const auto all = static_cast<double>(stream.size());
    return c.ppl_tokens == 0 ? all : std::min(all, static_cast<double>(c.ppl_tokens));
  };
  std::vector<char> ppl_found(units.size(), 0);
  int64_t ppl_shard = 0, ppl_done = 0;  // perplexity results of this shard, and those done (found or computed)
  for (std::size_t u = 0; u < units.size(); ++u) {
    if (!units[u].is_ppl) continue;
    const PplJob& j = pjobs[units[u].i];
    ++ppl_shard;
    weight_total += ppl_weight(j);
    const fs::path p = run_dir / "ppl" / (ppl_name(j) + ".json");
    if (!fs::exists(p)) continue;
    try {
      (void)load_ppl(p, j.scaling, j.length);
      ppl_found[u] = 1;
      ++ppl_done;
      weight_done += ppl_weight(j);
    } catch (const Error& e) {
      eval_warn(fmt::format("{}; recomputing it", e.what()));
    }
  }
  const double weight_found = weight_done;

  std::map<std::string, std::vector<std::vector<SampleOutcome>>> memo;
  std::mutex progress_mu;
  auto last_report = std::chrono::steady_clock::now() - std::chrono::seconds(10);
  auto report = [&](const std::string& current, double partial_weight, bool force) {
    if (!on_progress) return;
    const auto now = std::chrono::steady_clock::now();
    if (!force && now - last_report < std::chrono::seconds(1)) return;
    last_report = now;
    EvalProgress p;
    p.cells_done = cells_done;
    p.cells_total = cells_shard;
    p.ppl_done = ppl_done;
    p.ppl_total = ppl_shard;
    p.samples_done = res.samples_computed;
    p.seconds = elapsed();
    const double done_here = weight_done_here + partial_weight;
    const double remaining = weight_total - weight_done - partial_weight;
    p.eta_seconds = done_here > 0 ? p.seconds * remaining / done_here : -1.0;
    p.current = current;
    on_progress(p);
  };

  // ---- perplexity jobs first? No: groups first (they are the expensive part users wait for) ----
  for (std::size_t u = 0; u < units.size(); ++u) {
    if (units[u].is_ppl) continue;
    if (missing[u].empty()) continue;
    const Group& g = groups[units[u].i];
    const auto depths = task_depths(axes, g.task, g.control);
    const TaskControl control = parse_task_control(g.control);
    const bool choice_task = find_eval_task(g.task).kind == TaskKind::choice;
    // Writes every missing cell of the group as not computed (`status`, `note`).
    auto write_status_cells = [&](const std::string& status, const std::string& note) {
      for (double d : depths) {
        const std::string name = cell_name(g.task, g.control, g.scaling, g.length, d);
        if (std::find(missing[u].begin(), missing[u].end(), name) == missing[u].end()) continue;
        json cell;
        cell["cell"] = cell_json(g.task, g.control, g.scaling, g.length, d, 0, {}, status);
        cell["cell"]["note"] = note;
        cell["samples"] = json::array();
        write_file_atomic(run_dir / "cells" / (name + ".json"), with_checksum(cell));
        ++res.cells_computed;
        ++cells_done;
      }
      weight_done += group_weight(g);
      weight_done_here += group_weight(g);
    };
    if (endpoint)
      if (const auto st = endpoint->status(g.scaling, g.length, choice_task)) {
        write_status_cells(st->status, st->note);
        continue;
      }
    std::optional<Model> m;
    std::string key = fmt::format("{}|{}|{}|", g.task, g.control, g.length);
    if (model_ptr) m = *model_ptr;
    else key += "endpoint:" + g.scaling;  // each label is another server: never reused
    if (rope) {
      const RopeSetup setup = eval_rope_setup(*model_ptr, g.scaling, g.length, c.rope_factor);
      m->set_rope(setup);
      key += fingerprint(setup);
    }
    const std::string label = fmt::format("{} {} {} L={}", g.task, g.control, g.scaling, g.length);
    const auto n = static_cast<std::size_t>(c.samples);
    std::vector<std::vector<TaskSample>> samples(n);
    auto it = memo.find(key);
    const bool reuse = it != memo.end();
    std::vector<std::vector<SampleOutcome>> outcomes(n);
    std::exception_ptr error;
    std::string nofit;
    int64_t done_in_group = 0;
#pragma omp parallel for schedule(dynamic, 1)
    for (std::size_t i = 0; i < n; ++i) {
      try {
        std::vector<TaskSample> ss;
        for (double d : depths) ss.push_back(gen.make(g.task, static_cast<int64_t>(i), g.length, d < 0 ? 0.0 : d, control));
        if (!reuse && m) outcomes[i] = evaluate_samples(*m, tokenizer, ss);
        samples[i] = std::move(ss);
      } catch (const TaskDoesNotFit& e) {
        std::lock_guard lock(progress_mu);
        if (nofit.empty()) nofit = e.what();
      } catch (...) {
        std::lock_guard lock(progress_mu);
        if (!error) error = std::current_exception();
      }
      std::lock_guard lock(progress_mu);
      ++done_in_group;
      if (!reuse && m) res.samples_computed += static_cast<int64_t>(depths.size());
      if (omp_get_thread_num() == 0)
        report(label, group_weight(g) * static_cast<double>(done_in_group) / static_cast<double>(n), false);
    }
    if (error) std::rethrow_exception(error);
    if (!nofit.empty()) {
      write_status_cells("does not fit", nofit);
      continue;
    }
    const fs::path journal = group_journal(run_dir, g.task, g.control, g.scaling, g.length);
    if (endpoint && !reuse) {
      // The samples through the server: each finished one is journaled before more are sent.
      auto r = endpoint->run_group(g.scaling, journal, samples, [&](int64_t done) {
        std::lock_guard lock(progress_mu);
        report(label, group_weight(g) * static_cast<double>(done) / static_cast<double>(n), false);
      });
      outcomes = std::move(r.outcomes);
      res.samples_computed += r.computed;
    }
    if (reuse) {
      outcomes = it->second;
      ++res.groups_reused;
    } else {
      memo.emplace(key, outcomes);
    }
    // Persist every missing cell of the group.
    for (std::size_t di = 0; di < depths.size(); ++di) {
      const std::string name = cell_name(g.task, g.control, g.scaling, g.length, depths[di]);
      if (std::find(missing[u].begin(), missing[u].end(), name) == missing[u].end()) continue;
      json recs = json::array();
      const bool choice = find_eval_task(g.task).kind == TaskKind::choice;
      std::vector<int64_t> correct(choice ? 2 : 1, 0);  // task_metrics order: acc_norm, acc | the generation metric
      for (std::size_t i = 0; i < n; ++i) {
        const SampleOutcome& o = outcomes[i][di];
        correct[0] += o.correct ? 1 : 0;
        if (choice) correct[1] += o.correct_acc ? 1 : 0;
        json r = sample_record(samples[i][di], o, g.scaling, c.log_prompts);
        recs.push_back(std::move(r));
      }
      json cell;
      cell["cell"] = cell_json(g.task, g.control, g.scaling, g.length, depths[di], static_cast<int64_t>(n), correct);
      cell["samples"] = std::move(recs);
      write_file_atomic(run_dir / "cells" / (name + ".json"), with_checksum(cell));
      ++res.cells_computed;
      ++cells_done;
    }
    if (endpoint) {
      // Its cells hold every sample now: the journal has done its work.
      std::error_code ec;
      fs::remove(journal, ec);
    }
    weight_done += group_weight(g);
    weight_done_here += group_weight(g);
    report(label, 0.0, true);
    test_group_delay();
  }

  // ---- perplexity matrix ----
  bool any_ppl = false;
  for (const auto& u : units) any_ppl = any_ppl || u.is_ppl;
  std::vector<PplResult> computed_ppl;
  if (any_ppl) {
    json header = run["ppl_header"];
    header["tokens_total"] = stream.size();
    run["ppl_header"] = header;
    for (std::size_t ui = 0; ui < units.size(); ++ui) {
      const auto& u = units[ui];
      if (!u.is_ppl || ppl_found[ui]) continue;
      const PplJob& j = pjobs[u.i];
      const fs::path p = run_dir / "ppl" / (ppl_name(j) + ".json");
      if (endpoint)
        if (const auto st = endpoint->status(j.scaling, j.length, true)) {
          json r{{"context", j.length}, {"trained_context", trained}, {"rope_scaling", j.scaling}, {"factor", 1.0},
                 {"ppl", nullptr},      {"nll", nullptr},            {"tokens", 0},               {"windows", 0},
                 {"buckets", json::array()}, {"status", st->status}, {"note", st->note}};
          fs::create_directories(p.parent_path());
          write_file_atomic(p, with_checksum(r, 2));
          weight_done += ppl_weight(j);
          weight_done_here += ppl_weight(j);
          ++ppl_done;
          continue;
        }
      PplOptions o;
      o.context = j.length;
      o.max_tokens = c.ppl_tokens;
      const std::string label = fmt::format("ppl {} L={}", j.scaling, j.length);
      o.on_progress = [&](const PplProgress& pp) {
        // The job's last report (every window done) is the forced one after it is written, counted done: once.
        if (pp.windows_done < pp.windows_total)
          report(label, std::min(static_cast<double>(pp.tokens_done), ppl_weight(j)), false);
      };
      PplResult r;
      const fs::path journal = run_dir / "journal" / fmt::format("ppl__{}.jsonl", ppl_name(j));
      if (endpoint) {
        r = endpoint->perplexity(j.scaling, journal, stream, o);
      } else {
        Model m = *model_ptr;
        if (rope) m.set_rope(rope_setup_for_context(m.rope(), trained, j.scaling, j.length, c.rope_factor));
        r = evaluate_perplexity(m, stream, o);
      }
      r.rope_scaling = j.scaling;
      write_file_atomic(p, with_checksum(ppl_result_json(r), 2));
      if (endpoint) {
        std::error_code ec;
        fs::remove(journal, ec);  // the result is on disk: its windows' journal has done its work
      }
      weight_done += ppl_weight(j);
      weight_done_here += ppl_weight(j);
      ++ppl_done;
      report(label, 0.0, true);
      computed_ppl.push_back(std::move(r));
    }
    // A tokenizer that is not the model's shows as an NLL above uniform guessing inside the trained context
    // (the `ppl` job's check): every task score of the run is then meaningless, so say so.
    const int64_t model_vocab = model_ptr ? model_ptr->config().vocab_size : endpoint->vocab_size().value_or(0);
    if (const auto nll = in_range_nll(computed_ppl))
      if (const auto w = tokenizer_mismatch_warning(
              *nll, model_vocab, tokenizer,
              c.tokenizer_path.empty() ? std::string("the model's own tokenizer") : c.tokenizer_path))
        eval_warn(*w);
  }

  res.seconds = elapsed();
  run["timing"] = {{"seconds", res.seconds},
                   {"samples_computed", res.samples_computed},
                   {"samples_per_second", res.seconds > 0 ? static_cast<double>(res.samples_computed) / res.seconds : 0.0},
                   {"cells_computed", res.cells_computed},
                   {"groups_reused_from_identical_encodings", res.groups_reused},
                   {"work_found_done_fraction", weight_total > 0 ? weight_found / weight_total : 0.0}};
  write_file_atomic(run_dir / "run.json", run.dump(2) + "\n");
  const json summary = write_outputs(run_dir, run, axes);
  res.cells_present = summary.at("cells_present").get<int64_t>();
  return res;
}

// ---------------------------------------------------------------- merge

fs::path merge_eval_runs(std::span<const fs::path> inputs, const fs::path& out) {
  if (inputs.empty()) throw ConfigError("merge: at least one input run directory is required");
  std::vector<fs::path> dirs;
  std::vector<JsonDocument> runs;
  for (const auto& i : inputs) {
    dirs.push_back(resolve_run_dir(i));
    runs.push_back(read_json_document(dirs.back() / "run.json"));
  }
  // The run id names the output directory: checked to be one path component.
  const std::string id = checked_run_id(runs[0].root().at("run_id"));
  const Axes axes = axes_from_run_json(runs[0].root());
  for (std::size_t k = 0; k < dirs.size(); ++k) {
    const std::string other = checked_run_id(runs[k].root().at("run_id"));
    if (other != id)
      throw ConfigError(fmt::format("merge: {} is run {}, {} is run {} (different argument sets cannot be merged)",
                                    dirs[0].string(), id, dirs[k].string(), other));
  }
  const fs::path run_dir = out / id;
  fs::create_directories(run_dir / "cells");
  fs::create_directories(run_dir / "ppl");
  // A second process on the same run directory fails at once instead of
  // duplicating the work and racing on the files.
  const DirectoryLock lock(run_dir, ".lock");
  remove_run_temporaries(run_dir);
  json run = runs[0].raw();
  json merged_from = json::array();
  json header = run.contains("ppl_header") ? run["ppl_header"] : json::object();
  // Copies one checked file (a cell or a perplexity result) into the output.
  auto copy_checked = [&](const fs::path& src, const fs::path& dst) {
    const std::string content = read_file(src);
    if (fs::exists(dst)) {
      if (read_file(dst) != content)
        throw InvalidArgument(
            fmt::format("merge: {} differs from {} (same cell, different results)", src.string(), dst.string()));
      return;
    }
    write_file_atomic(dst, content);
  };
  for (std::size_t k = 0; k < dirs.size(); ++k) {
    const fs::path& d = dirs[k];
    const fs::path src_run = fs::weakly_canonical(d);
    const bool same = fs::exists(run_dir) && fs::weakly_canonical(run_dir) == src_run;
    merged_from.push_back(d.string());
    if (const auto h = runs[k].root().find("ppl_header")) {
      if (!h->is_object()) h->fail("expected an object");
      if (h->contains("tokens_total")) header = h->raw();
    }
    if (same) continue;
    // Only the cells of the run's axes, each checked (its name, coordinates
    // and checksum) before it is copied: a file that does not hold its cell
    // is a DataError naming it, never merged.
    for (const auto& g : groups_of(axes))
      for (double depth : task_depths(axes, g.task, g.control)) {
        const std::string name = cell_name(g.task, g.control, g.scaling, g.length, depth) + ".json";
        const fs::path src = d / "cells" / name;
        if (!fs::exists(src)) continue;
        (void)load_cell(src, g, depth, axes);
        copy_checked(src, run_dir / "cells" / name);
      }
    for (const auto& j : ppl_jobs_of(axes)) {
      const std::string name = ppl_name(j) + ".json";
      const fs::path src = d / "ppl" / name;
      if (!fs::exists(src)) continue;
      (void)load_ppl(src, j.scaling, j.length);
      copy_checked(src, run_dir / "ppl" / name);
    }
  }
  run["config"]["shard"] = nullptr;
  run["merged_from"] = merged_from;
  run["ppl_header"] = header;
  run.erase("timing");
  write_file_atomic(run_dir / "run.json", run.dump(2) + "\n");
  write_file_atomic(out / "LATEST", id + "\n");
  write_outputs(run_dir, run, axes);
  return run_dir;
}

// ---------------------------------------------------------------- text summary

std::string format_eval_summary(const json& summary) {
  const JsonDocument doc(summary, "summary");
  return format_eval_summary(doc.root());
}

namespace {

// The primary metric of a cell without "metric" (generator version 1): acc for
// forced choice (it summed log-probabilities), the task's metric otherwise; ""
// for a task this posenc does not know.
std::string legacy_metric(const std::string& task) {
  for (const auto& t : eval_tasks())
    if (t.name == task) return t.kind == TaskKind::choice ? "acc" : std::string(t.metric);
  return "";
}

// (metric, n, correct) of a cell read back, the primary first.
std::vector<std::tuple<std::string, int64_t, int64_t>> view_metric_counts(const JsonView& c) {
  std::vector<std::tuple<std::string, int64_t, int64_t>> out;
  const int64_t n = c.at("n").integer(0);
  const std::string primary = c.contains("metric") ? c.at("metric").string() : legacy_metric(c.at("task").string());
  out.emplace_back(primary, n, c.at("correct").integer(0, n));
  if (const auto m = c.find("metrics"))
    for (const auto& [name, e] : m->members())
      if (name != primary) out.emplace_back(name, n, e.at("correct").integer(0, n));
  return out;
}

}  // namespace

std::string format_eval_summary(const JsonView& summary) {
  std::string out;
  // A row: (task, control, scaling, metric).
  using Key = std::tuple<std::string, std::string, std::string, std::string>;
  struct Pool {
    int64_t n = 0, k = 0, cells = 0, fit = 0, unsupported = 0;
  };
  std::map<Key, std::map<int64_t, Pool>> rows;
  std::vector<Key> order;
  std::set<int64_t> lengths;
  std::set<std::string> scalings;
  for (const JsonView& c : summary.at("cells").elements()) {
    const int64_t L = c.at("length").integer();
    lengths.insert(L);
    scalings.insert(c.at("rope_scaling").string());
    const bool fits = c.string_or("status", "ok") == "ok" && c.at("n").integer() > 0;
    for (const auto& [metric, n, k] : view_metric_counts(c)) {
      const Key key{c.at("task").string(), c.at("control").string(), c.at("rope_scaling").string(), metric};
      if (!rows.count(key)) order.push_back(key);
      Pool& p = rows[key][L];
      ++p.cells;
      if (c.string_or("status", "ok") == detail::kNotSupported) ++p.unsupported;
      if (fits) {
        ++p.fit;
        p.n += n;
        p.k += k;
      }
    }
  }
  // Rows in a stable order: as the cells come, the absent control after the others of its task.
  {
    std::vector<std::string> tasks;
    for (const auto& k : order)
      if (std::find(tasks.begin(), tasks.end(), std::get<0>(k)) == tasks.end()) tasks.push_back(std::get<0>(k));
    std::vector<Key> sorted;
    for (const auto& t : tasks)
      for (const bool absent : {false, true})
        for (const auto& k : order)
          if (std::get<0>(k) == t && (std::get<1>(k) == "absent") == absent) sorted.push_back(k);
    order = std::move(sorted);
  }
  std::map<Key, JsonView> eff;
  for (const JsonView& e : summary.at("effective_context").elements()) {
    const std::string task = e.at("task").string();
    eff.emplace(Key{task, e.at("control").string(), e.at("rope_scaling").string(),
                    e.contains("metric") ? e.at("metric").string() : legacy_metric(task)},
                e);
  }
  std::map<std::tuple<std::string, std::string, std::string>, JsonView> chance;
  if (const auto ch = summary.find("chance"))
    for (const JsonView& c : ch->elements())
      chance.emplace(std::make_tuple(c.at("task").string(), c.at("rope_scaling").string(), c.at("metric").string()), c);
  // The scaling column only where RoPE scalings apply: a model of another
  // family runs "default" alone, and the column would say nothing.
  std::string family = "rope";
  if (const auto m = summary.find("model")) family = m->string_or("family", "rope");
  const bool show_scaling = family == "rope" || scalings.size() > 1 || (scalings.size() == 1 && *scalings.begin() != "default");
  const double min_baseline = summary.number_or("min_baseline", 0.0);
  out += fmt::format("run {}: {} of {} cells{}\n", summary.string_or("run_id", "?"),
                     summary.integer_or("cells_present", 0), summary.integer_or("cells_expected", 0),
                     summary.boolean_or("complete", false) ? "" : " (incomplete)");
  out += "accuracy over depths (n = samples x depths per length) [Wilson 95% interval of the pooled correct / n]\n";
  bool any_choice = false, any_absent = false;
  for (const auto& k : order) {
    any_choice = any_choice || std::get<3>(k) == "acc_norm" || std::get<3>(k) == "acc";
    any_absent = any_absent || std::get<1>(k) == "absent";
  }
  if (any_choice)
    out += "forced choice: acc_norm = argmax of log-prob / candidate bytes (primary), acc = argmax of summed "
           "log-prob (favours candidates of fewer tokens)\n";
  if (any_absent)
    out += "control absent = the evidence removed: its accuracy is the measured chance level\n";
  // acc rows identical to their acc_norm rows (equal-length candidates) are not repeated.
  std::set<Key> hidden;
  for (const auto& k : order) {
    if (std::get<3>(k) != "acc") continue;
    const Key norm{std::get<0>(k), std::get<1>(k), std::get<2>(k), "acc_norm"};
    auto it = rows.find(norm);
    if (it == rows.end()) continue;
    bool same = it->second.size() == rows[k].size();
    for (const auto& [L, p] : rows[k]) {
      auto q = it->second.find(L);
      same = same && q != it->second.end() && q->second.k == p.k && q->second.n == p.n && q->second.fit == p.fit;
    }
    if (same) hidden.insert(k);
  }
  if (!hidden.empty())
    out += fmt::format("({} acc rows equal to their acc_norm rows are not repeated: equal-length candidates)\n",
                       hidden.size());
  std::string head = fmt::format("{:<18} {:<8} {}{:<13}", "task", "control",
                                 show_scaling ? fmt::format("{:<8} ", "scaling") : "", "metric");
  for (int64_t L : lengths) head += fmt::format(" {:>17}", fmt::format("L={}", L));
  head += "  effective context";
  out += head + "\n";
  for (const auto& k : order) {
    const auto& [task, control, scaling, metric] = k;
    if (hidden.count(k)) continue;
    std::string row = fmt::format("{:<18} {:<8} {}{:<13}", task, control,
                                  show_scaling ? fmt::format("{:<8} ", scaling) : "", metric.empty() ? "-" : metric);
    for (int64_t L : lengths) {
      auto it = rows[k].find(L);
      if (it == rows[k].end()) {
        row += fmt::format(" {:>17}", "-");
        continue;
      }
      const Pool& p = it->second;
      if (p.fit != p.cells || p.n == 0) {
        row += fmt::format(" {:>17}", p.unsupported == p.cells ? "not supported" : "does not fit");
        continue;
      }
      const Interval ci = wilson_interval(p.k, p.n);
      row += fmt::format(" {:>17}", fmt::format("{:.2f} [{:.2f},{:.2f}]", static_cast<double>(p.k) / static_cast<double>(p.n),
                                                ci.low, ci.high));
    }
    if (control == "absent") {
      auto c = chance.find({task, scaling, metric});
      if (c != chance.end())
        row += fmt::format("  chance {:.2f} [{:.2f},{:.2f}] over all lengths (1/K = {:.2f})",
                           c->second.at("accuracy").number(), c->second.at("ci_low").number(),
                           c->second.at("ci_high").number(), c->second.at("assumed").number());
      out += row + "\n";
      continue;
    }
    auto e = eff.find(k);
    if (e == eff.end()) {
      row += "  (incomplete)";
    } else {
      const JsonView& x = e->second;
      const std::string source = x.string_or("chance_source", "assumed");
      const std::string vs =
          source == "measured"
              ? fmt::format("chance {:.2f}, measured, upper {:.2f}", x.at("chance").number(), x.number_or("chance_gate", 0.0))
              : fmt::format("chance {:.2f}{}", x.at("chance").number(), source == "assumed" ? ", assumed" : "");
      if (x.at("baseline").is_null())
        row += "  " + x.at("status").string();
      else if (!x.at("solvable").boolean())
        row += fmt::format("  not solvable by this model (baseline {:.2f}, 95% CI low {:.2f} vs {}{})",
                           x.at("baseline").number(), x.number_or("baseline_ci_low", 0.0), vs,
                           min_baseline > 0 ? fmt::format(", min {:.2f}", min_baseline) : "");
      else if (x.at("length").is_null())
        row += fmt::format("  none (baseline {:.2f}, threshold {:.2f}; {})", x.at("baseline").number(),
                           x.at("threshold").number(), vs);
      else
        row += fmt::format("  {} (baseline {:.2f}, threshold {:.2f}; {})", x.at("length").integer(),
                           x.at("baseline").number(), x.at("threshold").number(), vs);
    }
    out += row + "\n";
  }
  if (const auto controls = summary.find("controls"); controls && controls->size() > 0) {
    out += "\ncontrols: the evidence was changed; followed = prediction matches the changed evidence, kept = "
           "prediction still matches the original answer, changed = prediction differs from the uncontrolled run\n";
    auto sc = [&](const std::string& v) { return show_scaling ? fmt::format("{:<8} ", v) : std::string(); };
    out += fmt::format("{:<18} {:<8} {}{:>6} {:>4} {:>18} {:>6} {:>8} {:>12}\n", "task", "control", sc("scaling"),
                       "length", "n", "followed [95% CI]", "kept", "changed", "none correct");
    for (const JsonView& c : controls->elements())
      out += fmt::format("{:<18} {:<8} {}{:>6} {:>4} {:>18} {:>6} {:>8} {:>12}\n", c.at("task").string(),
                         c.at("control").string(), sc(c.at("rope_scaling").string()), c.at("length").integer(),
                         c.at("n").integer(),
                         fmt::format("{:.2f} [{:.2f},{:.2f}]", c.at("followed_rate").number(), c.at("ci_low").number(),
                                     c.at("ci_high").number()),
                         c.at("kept_original_answer").integer(),
                         fmt::format("{}/{}", c.at("prediction_changed").integer(), c.at("paired_with_none").integer()),
                         c.at("none_correct").integer());
  }
  return out;
}

}  // namespace posenc
