// A study directory read back (issue 13): study.json and evals/*.json through
// the checked reader (a missing key, a wrong type or a short array is a
// DataError naming the file and the key, not undefined behaviour in
// write_study_report), resume planning, checkpoints checked against the
// study's settings, the directory lock and the clean-up of stale temporaries.
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "posenc/error.hpp"
#include "posenc/io.hpp"
#include "posenc/model.hpp"
#include "posenc/checkpoint.hpp"
#include "posenc/study.hpp"
#include "study_dir_seeds.hpp"
#include "test_support.hpp"
#include "train/study_dir.hpp"

namespace POSENC_UNITY_ID {  // this file's own namespace in the tests' unity build (CMakeLists.txt)

using namespace posenc;
using posenc::test::run_cli;
using posenc::test::slurp;
using posenc::test::TempDir;
namespace fs = std::filesystem;
using nlohmann::json;

namespace {

using posenc::test::message_of;

struct Mutation {
  const char* file;     // "study.json" or "evals/copy-nope-s1.json"
  const char* pointer;  // JSON pointer of the value changed
  const char* value;    // the new value (JSON), or nullptr: the key is removed
  const char* expected; // in the message, after the file name
};

// One per read site of write_study_report (and its neighbours): a missing key,
// a wrong type, a short array, an out-of-range number. Before the checked
// reader these were operator[] on a const json (heap-buffer-overflow under
// ASan, garbage or nlohmann::type_error without a file name otherwise).
const Mutation kMutations[] = {
    {"study.json", "/settings", nullptr, "missing key 'settings'"},
    {"study.json", "/settings", "[]", "settings: expected an object"},
    {"study.json", "/settings/train_lengths", nullptr, "settings: missing key 'train_lengths'"},
    {"study.json", "/settings/train_lengths", "[8]", "settings.train_lengths: index 1 past the end"},
    {"study.json", "/settings/train_lengths", "8", "settings.train_lengths: expected an array"},
    {"study.json", "/settings/train_lengths/0", "\"8\"", "settings.train_lengths[0]: expected an integer"},
    {"study.json", "/settings/train_lengths/1", "4", "settings.train_lengths[1]: 4 is out of range [8, 4096]"},
    {"study.json", "/settings/train_lengths/1", "1e9", "settings.train_lengths[1]: 1000000000 is out of range"},
    {"study.json", "/settings/test_lengths", nullptr, "settings: missing key 'test_lengths'"},
    {"study.json", "/settings/test_lengths", "[8, 32]", "settings.test_lengths: index 2 past the end"},
    {"study.json", "/settings/test_lengths/2", "0", "settings.test_lengths[2]: 0 is out of range"},
    {"study.json", "/settings/samples", nullptr, "settings: missing key 'samples'"},
    {"study.json", "/settings/samples", "\"10\"", "settings.samples: expected an integer"},
    {"study.json", "/settings/scalings", nullptr, "settings: missing key 'scalings'"},
    {"study.json", "/settings/scalings", "[1]", "settings.scalings[0]: expected a string"},
    {"study.json", "/settings/recipes/reverse", "3", "settings.recipes.reverse: expected a string"},
    {"study.json", "/settings/train", "7", "settings.train: expected an object"},
    {"study.json", "/tasks", nullptr, "missing key 'tasks'"},
    {"study.json", "/tasks", "\"copy\"", "tasks: expected an array"},
    {"study.json", "/tasks/0", "5", "tasks[0]: expected a string"},
    {"study.json", "/tasks/0", "\"../../x\"", "tasks[0]: '../../x' is not a task or encoding name"},
    {"study.json", "/pes", nullptr, "missing key 'pes'"},
    {"study.json", "/pes/0", "\"a/b\"", "pes[0]: 'a/b' is not a task or encoding name"},
    {"study.json", "/pes/1", "null", "pes[1]: expected a string"},
    {"study.json", "/seeds", nullptr, "missing key 'seeds'"},
    {"study.json", "/seeds/0", "-1", "seeds[0]: -1 is out of range"},
    {"study.json", "/seeds/0", "\"1\"", "seeds[0]: expected an integer"},
    {"evals/copy-nope-s1.json", "", "[]", "expected an object"},
    {"evals/copy-nope-s1.json", "/task", nullptr, "missing key 'task'"},
    {"evals/copy-nope-s1.json", "/pe", "1", "pe: expected a string"},
    {"evals/copy-nope-s1.json", "/task", "\"\"", "task: '' is not a task or encoding name"},
    {"evals/copy-nope-s1.json", "/seed", nullptr, "missing key 'seed'"},
    {"evals/copy-nope-s1.json", "/seed", "\"1\"", "seed: expected an integer"},
    {"evals/copy-nope-s1.json", "/results", nullptr, "missing key 'results'"},
    {"evals/copy-nope-s1.json", "/results", "[]", "results: expected an object"},
    {"evals/copy-nope-s1.json", "/results/default", nullptr, "results: missing key 'default'"},
    {"evals/copy-nope-s1.json", "/results/default", "{}", "results.default: expected an array"},
    {"evals/copy-nope-s1.json", "/results/default/0", "3", "results.default[0]: expected an object"},
    {"evals/copy-nope-s1.json", "/results/default/0/length", nullptr, "results.default[0]: missing key 'length'"},
    {"evals/copy-nope-s1.json", "/results/default/0/length", "\"8\"", "results.default[0].length: expected an integer"},
    {"evals/copy-nope-s1.json", "/results/default/0/length", "1e12", "results.default[0].length: 1000000000000 is out of range"},
    {"evals/copy-nope-s1.json", "/results/default/1/length", "8", "results.default[1].length: length 8 appears twice"},
    {"evals/copy-nope-s1.json", "/results/default/0/samples", nullptr, "results.default[0]: missing key 'samples'"},
    {"evals/copy-nope-s1.json", "/results/default/0/samples", "-1", "results.default[0].samples: -1 is out of range"},
    {"evals/copy-nope-s1.json", "/results/default/0/correct", nullptr, "results.default[0]: missing key 'correct'"},
    {"evals/copy-nope-s1.json", "/results/default/0/correct", "11", "results.default[0].correct: 11 is out of range [0, 10]"},
    {"evals/copy-nope-s1.json", "/results/default/0/can_run", nullptr, "results.default[0]: missing key 'can_run'"},
    {"evals/copy-nope-s1.json", "/results/default/0/can_run", "1", "results.default[0].can_run: expected a boolean"},
    {"evals/copy-nope-s1.json", "/train_seconds", "\"x\"", "train_seconds: expected a number"},
    {"evals/copy-nope-s1.json", "/eval_seconds", "-1", "eval_seconds: -1 is out of range"},
    {"evals/copy-nope-s1.json", "/pe", "\"t5\"", "holds the evaluation of copy-t5-s1"},
};

}  // namespace

TEST(TrainStudyDir, ValidSeedStudyReports) {
  TempDir d;
  test::write_study_dir(d.path(), test::study_dir_base());
  const StudyReport r = write_study_report(d.path());
  EXPECT_EQ(r.evaluations, 3);
  EXPECT_EQ(r.expected, 3);
}

TEST(TrainStudyDir, EveryMalformedValueIsADataErrorNamingFileAndKey) {
  for (const Mutation& m : kMutations) {
    SCOPED_TRACE(std::string(m.file) + " " + m.pointer + " = " + (m.value ? m.value : "(removed)"));
    TempDir d;
    auto files = test::study_dir_base();
    json& j = files.at(m.file);
    const json::json_pointer ptr(m.pointer);
    if (m.value == nullptr)
      j[ptr.parent_pointer()].erase(ptr.back());
    else
      j[ptr] = json::parse(m.value);
    test::write_study_dir(d.path(), files);
    const std::string msg = message_of<DataError>([&] { (void)write_study_report(d.path()); });
    const std::string file = (d.path() / m.file).string();
    EXPECT_EQ(msg.rfind(file + ": ", 0), 0u) << msg;
    EXPECT_NE(msg.find(m.expected), std::string::npos) << msg;
  }
}

TEST(TrainStudyDir, UnreadableEvaluationIsNamed) {
  TempDir d;
  test::write_study_dir(d.path(), test::study_dir_base());
  write_file_atomic(d.path() / "evals/copy-nope-s1.json", "{\"task\": ");
  const std::string msg = message_of<DataError>([&] { (void)write_study_report(d.path()); });
  EXPECT_NE(msg.find((d.path() / "evals/copy-nope-s1.json").string() + ": not valid JSON"), std::string::npos) << msg;
}

// A file copied over another's name was counted twice (and the unit it
// replaced not at all).
TEST(TrainStudyDir, EvaluationCopiedOverAnotherIsRefused) {
  TempDir d;
  test::write_study_dir(d.path(), test::study_dir_base());
  fs::copy_file(d.path() / "evals/copy-nope-s1.json", d.path() / "evals/copy-t5-s1.json",
                fs::copy_options::overwrite_existing);
  const std::string msg = message_of<DataError>([&] { (void)write_study_report(d.path()); });
  EXPECT_NE(msg.find("copy-t5-s1.json: holds the evaluation of copy-nope-s1"), std::string::npos) << msg;
  // Resume planning: the same file is re-evaluated, with the reason.
  const auto why = detail::eval_file_problem(d.path() / "evals/copy-t5-s1.json", "copy", "t5", 1, 10, {});
  ASSERT_TRUE(why.has_value());
  EXPECT_NE(why->find("holds the evaluation of copy-nope-s1"), std::string::npos) << *why;
  EXPECT_FALSE(detail::eval_file_problem(d.path() / "evals/copy-nope-s1.json", "copy", "nope", 1, 10, {}));
  const auto fewer = detail::eval_file_problem(d.path() / "evals/copy-nope-s1.json", "copy", "nope", 1, 12, {});
  ASSERT_TRUE(fewer.has_value());
  EXPECT_NE(fewer->find("samples 10 where the study evaluates 12"), std::string::npos) << *fewer;
  const auto scaling = detail::eval_file_problem(d.path() / "evals/copy-nope-s1.json", "copy", "nope", 1, 10, {"yarn"});
  ASSERT_TRUE(scaling.has_value());
  EXPECT_NE(scaling->find("no 'yarn' evaluation"), std::string::npos) << *scaling;
}

// Issue 13 item 11: a study.json without settings made a resumed run fail with
// "basic_string::substr" (the flattened null's empty key).
TEST(TrainStudyDir, ResumeOfStudyJsonWithoutSettingsIsADataError) {
  TempDir d;
  auto files = test::study_dir_base();
  files.at("study.json").erase("settings");
  test::write_study_dir(d.path(), files);
  StudyConfig c;
  c.tasks = {TrainTaskKind::copy};
  c.pes = {TrainEncoding::nope};
  c.seeds = {1};
  c.out = d.path();
  const std::string msg = message_of<DataError>([&] { run_study(c, [](std::string_view) {}); });
  EXPECT_NE(msg.find((d.path() / "study.json").string() + ": missing key 'settings'"), std::string::npos) << msg;
  // Empty settings: named, not substr.
  files.at("study.json")["settings"] = json::object();
  test::write_study_dir(d.path(), files);
  const std::string msg2 = message_of<DataError>([&] { run_study(c, [](std::string_view) {}); });
  EXPECT_NE(msg2.find("settings: missing key 'train_lengths'"), std::string::npos) << msg2;
  EXPECT_EQ(detail::settings_difference(json(nullptr), json{{"a", 1}}), "(the settings): null in the directory, absent requested; a: absent in the directory, 1 requested");
}

// A scaling name with a comma broke summary.csv's columns.
TEST(TrainStudyDir, CsvFieldsAreQuoted) {
  TempDir d;
  auto files = test::study_dir_base();
  json& ev = files.at("evals/copy-nope-s1.json");
  ev["results"]["lin,\"ear\""] = ev["results"]["default"];
  test::write_study_dir(d.path(), files);
  const StudyReport r = write_study_report(d.path());
  EXPECT_NE(slurp(r.summary_csv).find("copy,nope,\"lin,\"\"ear\"\"\",8,"), std::string::npos) << slurp(r.summary_csv);
}

// summary.csv names its columns as eval's summary.csv does (issue 14): rope_scaling (was scaling), n (was samples,
// and before correct as in eval), ci_low/ci_high (were wilson_low/wilson_high), the Wilson 95% interval.
TEST(TrainStudyDir, CsvColumnsHaveEvalsNames) {
  TempDir d;
  test::write_study_dir(d.path(), test::study_dir_base());
  const StudyReport r = write_study_report(d.path());
  const std::string csv = slurp(r.summary_csv);
  EXPECT_EQ(csv.substr(0, csv.find('\n')), "task,encoding,rope_scaling,length,n,correct,accuracy,ci_low,ci_high,can_run,seeds");
  // copy / rope / linear at 24 tokens: 5 of 10, Wilson interval [0.236593, 0.763407] (z = 1.959964).
  EXPECT_NE(csv.find("\ncopy,rope,linear,24,10,5,0.500000,0.236593,0.763407,1,1\n"), std::string::npos) << csv;
}

TEST(TrainStudyDir, DirectoryLockIsExclusiveOrShared) {
  TempDir d;
  const fs::path dir = d.path() / "run";
  {
    DirectoryLock a(dir);
    EXPECT_TRUE(fs::exists(dir / ".posenc.lock"));
    const std::string msg = message_of<IoError>([&] { DirectoryLock b(dir); });
    EXPECT_NE(msg.find(dir.string() + ": is in use by another posenc process"), std::string::npos) << msg;
    EXPECT_THROW(DirectoryLock(dir, ".posenc.lock", true), IoError);
    DirectoryLock other(dir, "other.lock");  // another name is another lock
    DirectoryLock moved = std::move(a);
    EXPECT_THROW(DirectoryLock{dir}, IoError);  // still held after the move
  }
  DirectoryLock s1(dir, ".posenc.lock", true);
  DirectoryLock s2(dir, ".posenc.lock", true);
  EXPECT_THROW(DirectoryLock{dir}, IoError);
}

TEST(TrainStudyDir, StaleTemporariesAreRecognisedAndRemoved) {
  long pid = 0;
  EXPECT_TRUE(is_atomic_write_temporary("copy-rope-s1.json.tmp.1234.0", pid));
  EXPECT_EQ(pid, 1234);
  for (const char* n : {"notes.tmp.txt", "a.tmp.12.", "a.tmp..3", ".tmp.1.2", "a.tmp.x.1", "a.json"})
    EXPECT_FALSE(is_atomic_write_temporary(n, pid)) << n;
  TempDir d;
  const std::string own = std::to_string(::getpid());
  for (const std::string& n :
       std::vector<std::string>{"a.json.tmp.999999999.0", "b.pt.tmp." + own + ".3", "c.json.tmp.1.2", "notes.tmp.txt"})
    write_file_atomic(d.path() / n, "x");
  auto removed = remove_stale_temporaries(d.path(), /*all=*/false);  // pid 1 is alive: kept
  EXPECT_EQ(removed.size(), 2u);
  EXPECT_FALSE(fs::exists(d.path() / "a.json.tmp.999999999.0"));
  EXPECT_FALSE(fs::exists(d.path() / ("b.pt.tmp." + own + ".3")));
  EXPECT_TRUE(fs::exists(d.path() / "c.json.tmp.1.2"));
  removed = remove_stale_temporaries(d.path(), /*all=*/true);
  EXPECT_EQ(removed.size(), 1u);
  EXPECT_TRUE(fs::exists(d.path() / "notes.tmp.txt"));
}

namespace {
const char* kTiny =
    "study --tasks copy --pe rope --seeds 1 --steps 30 --batch-size 8 --dim 32 --heads 4 "
    "--train-lengths 4:8 --test-lengths 4:12:4 --rope-scaling linear --samples 6 --out ";

std::vector<float> weights(const fs::path& p) {
  std::vector<float> all;
  for (const auto& t : Model::load(p).to_checkpoint().tensors) all.insert(all.end(), t.data.begin(), t.data.end());
  return all;
}
}  // namespace

// A second `posenc study` on the same --out fails at once; a run holding the
// directory is not disturbed.
TEST(TrainStudyDir, SecondConcurrentStudyFailsAtOnce) {
  TempDir d;
  const fs::path out = d.path() / "s";
  DirectoryLock held(out);  // as a running study holds it
  const auto t0 = std::chrono::steady_clock::now();
  const auto r = run_cli(kTiny + out.string());
  EXPECT_EQ(r.exit_code, 1) << r.err;
  EXPECT_NE(r.err.find("is in use by another posenc process"), std::string::npos) << r.err;
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 20.0);
  EXPECT_FALSE(fs::exists(out / "study.json"));
  // The same shard twice is refused too; shards of one study hold it shared.
  DirectoryLock shard(out, ".posenc.lock.shard-0-of-2");
  held = DirectoryLock(d.path() / "elsewhere");
  const auto r2 = run_cli(kTiny + out.string() + " --shard 0/2");
  EXPECT_EQ(r2.exit_code, 1) << r2.err;
  EXPECT_NE(r2.err.find(".posenc.lock.shard-0-of-2 is held"), std::string::npos) << r2.err;
}

// Issue 13 item 9: resume used any readable checkpoint under the unit's name
// (a 1,144-parameter model silently replaced the 127,168-parameter one). Now
// a checkpoint that is not the study's model is retrained, with a warning
// naming the file, and the result is what an uninterrupted run gives. Stale
// temporaries of a killed run are removed on resume.
TEST(TrainStudyDir, ResumeRetrainsACheckpointThatIsNotTheStudysModel) {
  TempDir d;
  const fs::path out = d.path() / "s";
  const fs::path pt = out / "models/copy-rope-s1.pt";
  const fs::path ev = out / "evals/copy-rope-s1.json";
  const auto r0 = run_cli(kTiny + out.string());
  ASSERT_EQ(r0.exit_code, 0) << r0.err;
  const auto trained = weights(pt);
  const std::string eval_bytes = slurp(ev);
  const json eval0 = json::parse(eval_bytes);

  struct Foreign {
    const char* flags;
    const char* expected;
  };
  for (const Foreign& f : {Foreign{"--pe rope --dim 16 --heads 2 --seed 1", "dim 16 where the study trains 32"},
                           Foreign{"--pe rope --dim 32 --heads 4 --seed 2", "seed 2 where the study trains 1"},
                           Foreign{"--pe alibi --dim 32 --heads 4 --seed 1", "position family alibi where the study trains rope"}}) {
    SCOPED_TRACE(f.flags);
    const fs::path foreign = d.path() / "foreign.pt";
    const auto t = run_cli(std::string("train --task copy --steps 30 --batch-size 8 --train-lengths 4:8 --eval-samples 0 ") +
                           f.flags + " --out " + foreign.string());
    ASSERT_EQ(t.exit_code, 0) << t.err;
    fs::copy_file(foreign, pt, fs::copy_options::overwrite_existing);
    fs::remove(ev);
    write_file_atomic(out / "evals/copy-rope-s1.json.tmp.999999999.0", "{");
    write_file_atomic(out / "models/copy-rope-s1.pt.tmp.999999999.1", "x");
    const auto r = run_cli(kTiny + out.string());
    ASSERT_EQ(r.exit_code, 0) << r.err;
    EXPECT_NE(r.err.find("warning: " + pt.string() + " is not this study's model ("), std::string::npos) << r.err;
    EXPECT_NE(r.err.find(f.expected), std::string::npos) << r.err;
    EXPECT_NE(r.err.find("retraining"), std::string::npos) << r.err;
    EXPECT_NE(r.err.find("training 30 steps"), std::string::npos) << r.err;
    EXPECT_TRUE(weights(pt) == trained);
    json eval = json::parse(slurp(ev));
    EXPECT_EQ(eval["results"], eval0["results"]);
    EXPECT_EQ(eval["parameters"], eval0["parameters"]);
    EXPECT_FALSE(fs::exists(out / "evals/copy-rope-s1.json.tmp.999999999.0"));
    EXPECT_FALSE(fs::exists(out / "models/copy-rope-s1.pt.tmp.999999999.1"));
    EXPECT_NE(r.err.find("removed " + (out / "models/copy-rope-s1.pt.tmp.999999999.1").string()), std::string::npos)
        << r.err;
  }
  // The study's own checkpoint is kept (evaluated, not retrained).
  fs::remove(ev);
  const auto r = run_cli(kTiny + out.string());
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.err.find("checkpoint exists, training skipped"), std::string::npos) << r.err;
  EXPECT_EQ(json::parse(slurp(ev))["results"], eval0["results"]);
  // An evaluation file of another unit under this one's name is evaluated again.
  json other = eval0;
  other["seed"] = 2;
  write_file_atomic(ev, other.dump());
  const auto r2 = run_cli(kTiny + out.string());
  ASSERT_EQ(r2.exit_code, 0) << r2.err;
  EXPECT_NE(r2.err.find("evaluation not kept"), std::string::npos) << r2.err;
  EXPECT_EQ(json::parse(slurp(ev))["results"], eval0["results"]);
}

// fuzz/corpus/study_dir/ holds exactly study_dir_fuzz_seeds() (the input
// format of fuzz/study_dir_fuzz.cpp); POSENC_WRITE_FUZZ_CORPUS=1 rewrites it.
// Each seed goes through the harness's steps here too.
TEST(StudyDirFuzzCorpus, SeedsAreCurrent) {
  const auto dir = fs::path(POSENC_SOURCE_DIR) / "fuzz/corpus/study_dir";
  const auto seeds = test::study_dir_fuzz_seeds();
  if (const char* e = std::getenv("POSENC_WRITE_FUZZ_CORPUS"); e != nullptr && std::string(e) == "1") {
    fs::create_directories(dir);
    for (const auto& [name, bytes] : seeds) write_file_atomic(dir / name, bytes);
  }
  std::size_t on_disk = 0;
  for (const auto& entry : fs::directory_iterator(dir)) on_disk += entry.is_regular_file();
  EXPECT_EQ(on_disk, seeds.size());
  for (const auto& [name, bytes] : seeds) {
    SCOPED_TRACE(name);
    ASSERT_TRUE(fs::exists(dir / name)) << "run with POSENC_WRITE_FUZZ_CORPUS=1 to write the corpus";
    EXPECT_TRUE(slurp(dir / name) == bytes) << "stale seed; POSENC_WRITE_FUZZ_CORPUS=1 rewrites it";
    TempDir t;
    const auto files = test::split_study_dir_input(bytes);
    for (const auto& [file, contents] : files) write_file_atomic(t.path() / file, contents);
    const bool valid = name.rfind("valid_", 0) == 0;
    if (valid) {
      EXPECT_NO_THROW((void)write_study_report(t.path()));
    } else {
      EXPECT_THROW((void)write_study_report(t.path()), posenc::Error);
    }
  }
}

}  // namespace POSENC_UNITY_ID
