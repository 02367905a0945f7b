// One CLI convention (issue 14 part 5): output files are `--json FILE` / `--csv FILE` with `-` = stdout, one flag
// name per concept (old spellings refused naming the new one), `--version`, required options marked and exiting 2,
// empty list items refused, an output file's missing directory refused, `train` without `--out` refused before it
// trains. Each case failed on the main of before the change (the flag was a switch, the old name was the only name,
// the directory was created, the empty item was dropped, the model was trained and thrown away).
#include <chrono>
#include <cstdio>
#include <algorithm>
#include <filesystem>
#include <map>
#include <optional>
#include <cstdlib>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/types.h>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "test_support.hpp"

namespace POSENC_UNITY_ID {  // this file's own namespace in the tests' unity build (CMakeLists.txt)

using posenc::test::CliResult;
using posenc::test::run_cli;
using posenc::test::slurp;
using posenc::test::TempDir;
namespace fs = std::filesystem;

namespace {

std::string q(const fs::path& p) { return "'" + p.string() + "'"; }
std::string model_args() {
  return "--model " + q(posenc::test::model_path()) + " --tokenizer " + q(posenc::test::tokenizer_path());
}
std::string text_arg() { return " --text " + q(posenc::test::text_path()); }
std::string config(const std::string& name) { return q(posenc::test::shared_dir() / "configs" / name); }

/// The output of a shell command (stdout), trailing newline removed; nullopt when it fails.
std::optional<std::string> shell(const std::string& cmd) {
  FILE* p = ::popen(cmd.c_str(), "r");
  if (p == nullptr) return std::nullopt;
  std::string out;
  char buf[256];
  while (std::fgets(buf, sizeof buf, p) != nullptr) out += buf;
  if (::pclose(p) != 0) return std::nullopt;
  while (!out.empty() && (out.back() == '\n' || out.back() == ' ')) out.pop_back();
  return out;
}

void expect_usage_error(const std::string& args, const std::vector<std::string>& needles) {
  const CliResult r = run_cli(args);
  EXPECT_EQ(r.exit_code, 2) << args << "\nstderr: " << r.err;
  for (const auto& n : needles)
    EXPECT_NE(r.err.find(n), std::string::npos) << args << ": '" << n << "' not in " << r.err;
}

}  // namespace

// `--json -` puts exactly one JSON document on stdout, for every command that writes JSON; `--csv -` the CSV.
// inspect and periods took a bare `--json`/`--csv` switch and wrote with -o; check-cache and detect-layout took an
// optional value; ppl, generate and tokenize took a file only.
TEST(CliConvention, DashWritesTheOutputAloneOnStdout) {
  const std::pair<std::string, std::string> cases[] = {
      {"inspect --config " + config("llama-3.1-8b.json") + " --json -", "rope_type"},
      {"periods --rope-theta 10000 --context 4K --json -", "rows"},
      {"tokenize --tokenizer " + q(posenc::test::tokenizer_path()) + " --prompt 'Once upon a time' --json -", "ids"},
      {"detect-layout " + model_args() + text_arg() + " --scored-tokens 512 --json -", "likely_layout"},
      {"check-cache " + model_args() + text_arg() + " --json -", "scenarios"},
      // ppl prints its table and generate its text: they go to stderr, stdout is the JSON alone.
      {"ppl " + model_args() + text_arg() + " --context 128 --rope-scaling default --scored-tokens 500 --json -",
       "results"},
      {"generate " + model_args() + " --prompt 'Once upon a time' --max-tokens 8 --json -", "generated_ids"},
  };
  for (const auto& [args, key] : cases) {
    const CliResult r = run_cli(args);
    ASSERT_EQ(r.exit_code, 0) << args << ": " << r.err;
    nlohmann::json j;
    ASSERT_NO_THROW(j = nlohmann::json::parse(r.out)) << args << ": stdout is not one JSON document: " << r.out;
    EXPECT_TRUE(j.contains(key)) << args;
  }
  const CliResult g = run_cli("generate " + model_args() + " --prompt 'Once upon a time' --max-tokens 8 --json -");
  EXPECT_NE(g.err.find("Once upon a time"), std::string::npos) << "the generated text goes to stderr: " << g.err;
  EXPECT_EQ(nlohmann::json::parse(g.out)["text"].get<std::string>().rfind("Once upon a time", 0), 0u);

  const CliResult csv = run_cli("periods --rope-theta 500000 --context 128K --csv -");
  ASSERT_EQ(csv.exit_code, 0) << csv.err;
  EXPECT_EQ(csv.out, "rope_theta,head_dim,length,wrapped,unwrapped,unwrapped_channels\n"
                     "500000,128,131072,49,15,49 50 51 52 53 54 55 56 57 58 59 60 61 62 63\n");
  const CliResult d = run_cli("decay --max-distance 2 --csv -");
  ASSERT_EQ(d.exit_code, 0) << d.err;
  EXPECT_EQ(d.out.substr(0, d.out.find('\n')), "distance,bound");
  EXPECT_EQ(d.out.find("RoFormer"), std::string::npos) << "the summary is left out: " << d.out;
}

// Both outputs of periods can be files at once, next to the table on stdout; two `-` cannot share stdout.
TEST(CliConvention, PeriodsWritesJsonAndCsvFiles) {
  TempDir d;
  const CliResult r = run_cli("periods --rope-theta 500000 --context 128K --json " + q(d.path() / "p.json") +
                              " --csv " + q(d.path() / "p.csv"));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("unwrapped channels"), std::string::npos) << r.out;
  EXPECT_EQ(nlohmann::json::parse(slurp(d.path() / "p.json"))["rows"][0]["unwrapped"], 15);
  EXPECT_NE(slurp(d.path() / "p.csv").find("500000,128,131072,49,15,"), std::string::npos);
  expect_usage_error("periods --rope-theta 500000 --context 128K --json - --csv -",
                     {"--json and --csv", "only one output can go to stdout"});
}

// The old spellings exit 2 with a message that names the new form (they were the only names, or meant a switch).
TEST(CliConvention, OldSpellingsAreRefusedNamingTheNewOnes) {
  TempDir d;
  const std::string llama = config("llama-3.1-8b.json"), out = q(d.path() / "out"), txt = q(d.path() / "x.txt");
  const std::pair<std::string, std::vector<std::string>> cases[] = {
      {"inspect --config " + llama + " --json", {"--json: needs a FILE", "'--json -' for stdout"}},
      {"inspect --config " + llama + " -o " + txt, {"removed", "--json FILE"}},
      {"periods --rope-theta 10000 --context 4K --json", {"--json: needs a FILE"}},
      {"periods --rope-theta 10000 --context 4K --csv", {"--csv: needs a FILE", "'--csv -'"}},
      {"periods --rope-theta 10000 --context 4K -o " + txt, {"removed", "--csv FILE"}},
      {"periods --rope-theta 10000 --lengths 4K", {"--lengths", "renamed --context"}},
      {"periods --rope-theta 10000 --context 4K --rope-scaling linear --factor 2",
       {"--factor", "renamed --rope-factor"}},
      {"check-cache " + model_args() + text_arg() + " --json", {"--json: needs a FILE"}},
      {"detect-layout " + model_args() + text_arg() + " --json", {"--json: needs a FILE"}},
      {"detect-layout " + model_args() + text_arg() + " --max-tokens 100", {"renamed --scored-tokens"}},
      {"ppl " + model_args() + text_arg() + " --max-tokens 100", {"--max-tokens", "renamed --scored-tokens"}},
      // (--shard 3/2 and --recipe copy:bogus=1, refused after the lists are read, keep the binary of before from
      // running an eval or a whole study with the names it accepted.)
      {"eval " + model_args() + " --tasks kv_retrieval --lengths 256 --ppl-tokens -1 --shard 3/2 --out " + out,
       {"renamed --context"}},
#if POSENC_WITH_TRAIN
      {"study --scalings linear --recipe copy:bogus=1 --out " + out, {"--scalings", "renamed --rope-scaling"}},
#endif
  };
  for (const auto& [args, needles] : cases) expect_usage_error(args, needles);
  // The new names work where the old ones did.
  const CliResult p = run_cli("periods --rope-theta 10000 --context 4K --rope-scaling linear --rope-factor 2 --json -");
  ASSERT_EQ(p.exit_code, 0) << p.err;
  EXPECT_EQ(nlohmann::json::parse(p.out)["rows"][0]["rope_type"], "linear");
  // --max-tokens keeps its one meaning: generate's new tokens.
  const CliResult g = run_cli("generate " + model_args() + " --prompt 'Once upon a time' --max-tokens 3 --json -");
  ASSERT_EQ(g.exit_code, 0) << g.err;
  EXPECT_EQ(nlohmann::json::parse(g.out)["generated_ids"].size(), 3u);
}

// `posenc --version`: the CMake project version and the commit of this checkout (configure time), "unknown" when
// the sources are not a git checkout. There was no --version.
TEST(CliConvention, VersionPrintsTheProjectVersionAndTheCommit) {
  const CliResult r = run_cli("--version");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const std::string cmake = slurp(fs::path(POSENC_SOURCE_DIR) / "CMakeLists.txt");
  std::smatch m;
  ASSERT_TRUE(std::regex_search(cmake, m, std::regex(R"(project\(posenc VERSION ([0-9.]+))")));
  EXPECT_EQ(r.out.rfind("posenc " + m[1].str() + " (git ", 0), 0u) << r.out;
  const auto head = shell("git -C " + q(POSENC_SOURCE_DIR) + " rev-parse --short=12 HEAD 2>/dev/null");
  if (!head) {
    EXPECT_NE(r.out.find("(git unknown)"), std::string::npos) << r.out;
    return;
  }
  // The commit the binary was configured at: HEAD, or (a binary not rebuilt since the last commit; ctest does not
  // build) one of its ancestors. Any other value - a wrong, truncated or made-up hash - fails.
  std::smatch h;
  ASSERT_TRUE(std::regex_search(r.out, h, std::regex(R"(\(git ([0-9a-f]{12})\))"))) << r.out;
  if (h[1].str() != *head) {
    EXPECT_EQ(std::system(("git -C " + q(POSENC_SOURCE_DIR) + " merge-base --is-ancestor " + h[1].str() +
                           " HEAD >/dev/null 2>&1")
                              .c_str()),
              0)
        << "HEAD " << *head << ", printed " << r.out;
  }
}

// Every required option shows REQUIRED in its command's --help, and leaving it out exits 2 naming it. eval checked
// --model/--out by hand after parsing (unmarked), study --out likewise, train had no --out requirement, tokenize
// checked its either-or options in its callback (unmarked).
TEST(CliConvention, RequiredOptionsAreMarkedAndMissingOnesExit2) {
  struct Case {
    std::string command;             // the subcommand
    std::string flag;                // the required option
    std::string without;             // a command line with everything else
  };
  const std::string m = q(posenc::test::model_path()), t = q(posenc::test::tokenizer_path());
  TempDir d;
  const std::string out = q(d.path() / "out");
  const Case cases[] = {
      {"ppl", "--model", "ppl --tokenizer " + t + text_arg()},
      {"ppl", "--text", "ppl " + model_args()},
      {"generate", "--model", "generate --tokenizer " + t + " --prompt hi"},
      {"detect-layout", "--text", "detect-layout " + model_args()},
      {"convert", "--out", "convert " + model_args()},
      {"periods", "--rope-theta", "periods --context 4K"},
      {"periods", "--context", "periods --rope-theta 10000"},
      {"eval", "--out", "eval " + model_args() + " --tasks kv_retrieval --ppl-tokens -1"},
#if POSENC_WITH_TRAIN
      {"train", "--out", "train --task copy --steps 5 --eval-samples 0"},
      {"study", "--out", "study --tasks copy --pe rope --seeds 1"},
#endif
  };
  for (const auto& c : cases) {
    const CliResult help = run_cli(c.command + " --help");
    ASSERT_EQ(help.exit_code, 0) << c.command;
    const std::regex marked("\\n\\s*" + c.flag + " [^\\n]*REQUIRED");
    EXPECT_TRUE(std::regex_search(help.out, marked)) << c.command << " --help does not mark " << c.flag << ":\n"
                                                      << help.out;
    expect_usage_error(c.without, {c.flag});
  }
  // Either-or requirements: option groups that --help states and CLI11 enforces.
  const CliResult th = run_cli("tokenize --help");
  EXPECT_NE(th.out.find("the tokenizer: --model, --tokenizer or both"), std::string::npos) << th.out;
  EXPECT_NE(th.out.find("the text: exactly one of --text (--prompt-file) and --prompt"), std::string::npos) << th.out;
  expect_usage_error("tokenize --prompt hi", {"--model", "--tokenizer"});
  const CliResult ih = run_cli("inspect --help");
  EXPECT_NE(ih.out.find("the model: exactly one of --config and --model"), std::string::npos) << ih.out;
  expect_usage_error("inspect", {"--config", "--model"});
  expect_usage_error("inspect --config a.json --model " + m, {"--config", "--model"});
  // eval: an in-process --model or a served --endpoint (issue 15), one of them.
  const CliResult eh = run_cli("eval --help");
  EXPECT_NE(eh.out.find("the model: exactly one of --model and --endpoint"), std::string::npos) << eh.out;
  expect_usage_error("eval --tokenizer " + t + " --tasks kv_retrieval --ppl-tokens -1 --out " + out,
                     {"--model or --endpoint is required"});
  expect_usage_error("tokenize --tokenizer " + t, {"--text", "--prompt"});
  expect_usage_error("tokenize --tokenizer " + t + " --prompt hi --text " + q(posenc::test::text_path()), {"--prompt"});
  // The subcommands that share eval / study do not need their parent's required options.
  const CliResult er = run_cli("eval report --no-plots " + q(d.path()));
  EXPECT_EQ(er.exit_code, 1) << er.err;  // the directory holds no run: an input problem, not --model
  EXPECT_EQ(er.err.find("--model is required"), std::string::npos) << er.err;
  EXPECT_EQ(er.err.find("--out is required"), std::string::npos) << er.err;
#if POSENC_WITH_TRAIN
  const CliResult sr = run_cli("study report --no-plots " + q(d.path()));
  EXPECT_EQ(sr.exit_code, 1) << sr.err;
  EXPECT_EQ(sr.err.find("--out is required"), std::string::npos) << sr.err;
#endif
  const CliResult em = run_cli("eval merge " + q(d.path()));
  EXPECT_EQ(em.exit_code, 2) << em.err;  // merge's own --out
  EXPECT_NE(em.err.find("--out is required"), std::string::npos) << em.err;
}

#if POSENC_WITH_TRAIN  // trains a model or runs `posenc train`/`study` (not in a -DPOSENC_WITH_TRAIN=OFF build)
// `train` without --out trained for the whole run and then threw the model away; now refused before any step.
TEST(CliConvention, TrainWithoutOutIsRefusedBeforeTraining) {
  const auto t0 = std::chrono::steady_clock::now();
  const CliResult r = run_cli("train --task copy --pe rope --train-lengths 8:32 --steps 300 --seed 1");
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_NE(r.err.find("--out is required"), std::string::npos) << r.err;
  EXPECT_EQ(r.err.find("step"), std::string::npos) << "no training step ran: " << r.err;
  EXPECT_EQ(r.out.find("trained"), std::string::npos) << r.out;
  EXPECT_LT(s, 5.0);
}
#endif

// An empty list item is a typo; it was dropped silently (256,,512 ran 256 and 512).
TEST(CliConvention, EmptyListItemsAreRefusedNamingTheFlag) {
  // A flag error found after the lists are read (--shard 3/2, --recipe copy:bogus=1) and a small --scored-tokens
  // keep the binary of before, which dropped the empty item, from running a whole eval, study or ppl.
  TempDir d;
  const std::string out = q(d.path() / "out");
  const std::string eval = "eval " + model_args() + " --ppl-tokens -1 --shard 3/2 --out " + out + " ";
  const std::string ppl = "ppl " + model_args() + text_arg() + " --scored-tokens 200 ";
#if POSENC_WITH_TRAIN
  const std::string study = "study --recipe copy:bogus=1 --out " + out + " ";
#endif
  const std::pair<std::string, std::string> cases[] = {
      {ppl + "--context 256,,512", "--context"},
      {ppl + "--rope-scaling default,", "--rope-scaling"},
      {ppl + "--rope-scaling ,default", "--rope-scaling"},
      {eval + "--tasks kv_retrieval,,passkey", "--tasks"},
      {eval + "--tasks kv_retrieval --context 256,,512", "--context"},
      {eval + "--tasks kv_retrieval --rope-scaling default,", "--rope-scaling"},
      {eval + "--tasks kv_retrieval --depths 0,,1", "--depths"},
      {eval + "--tasks kv_retrieval --control none,", "--control"},
      {"periods --rope-theta 10000,,500000 --context 4K", "--rope-theta"},
      {"periods --rope-theta 10000 --context 4K,,8K", "--context"},
      {"periods --rope-theta 10000 --context 4K --rope-scaling default,", "--rope-scaling"},
#if POSENC_WITH_TRAIN
      {study + "--tasks copy,,reverse", "--tasks"},
      {study + "--pe rope,", "--pe"},
      {study + "--seeds 1,,2", "--seeds"},
      {study + "--rope-scaling linear,,ntk", "--rope-scaling"},
#endif
  };
  for (const auto& [args, flag] : cases) expect_usage_error(args, {flag + ": item", "is empty"});
}

// An output FILE in a directory that does not exist is refused at parse time, naming the directory, and nothing is
// created (`--json /nonexistdir/x.json` created /nonexistdir). An output DIR is still created with its parents.
// A flag that takes one length in tokens takes K = 1024 and M = 1048576 as length lists do (the README's convention;
// before, `--scored-tokens 1K` or `check-cache --length 1K` was "must be an integer in [..] (got '1K')"), and a bad
// one is refused naming the text as given.
TEST(CliConvention, OneLengthFlagsTakeKAndMAsListsDo) {
  const CliResult r = run_cli("ppl " + model_args() + text_arg() +
                              " --trained-context 1K --context 256 --scored-tokens 1K --rope-scaling default --json -");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const auto j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j.at("trained_context").get<int64_t>(), 1024);
  EXPECT_EQ(j.at("trained_context_source").get<std::string>(), "--trained-context");
  // 1024 predictions at 255 a window of 256 tokens: 5 windows (1020 would be 4).
  EXPECT_EQ(j.at("results").at(0).at("windows").get<int64_t>(), 5);
  EXPECT_GE(j.at("results").at(0).at("tokens").get<int64_t>(), 1024);
  expect_usage_error("generate " + model_args() + " --prompt Once --max-tokens 2M",
                     {"--max-tokens", "[0, 1048576]", "got '2M'"});
  for (const std::string bad : {"1.5K", "K", "-1K", "99999999999999999999K", "4k4"})
    expect_usage_error("check-cache " + model_args() + " --length " + bad, {"--length", "got '" + bad + "'"});
}

TEST(CliConvention, AFilesMissingDirectoryIsAnErrorNamingIt) {
  TempDir d;
  const fs::path missing = d.path() / "nonexistdir";
  const std::string f = q(missing / "x.json");
  const std::string cases[] = {
      "inspect --config " + config("llama-3.1-8b.json") + " --json " + f,
      "periods --rope-theta 10000 --context 4K --json " + f,
      "periods --rope-theta 10000 --context 4K --csv " + f,
      "periods --rope-theta 10000 --context 4K --plot " + f,
      "decay --csv " + f,
      "tokenize --tokenizer " + q(posenc::test::tokenizer_path()) + " --prompt hi --json " + f,
      "ppl " + model_args() + text_arg() + " --context 128 --rope-scaling default --json " + f,
      "ppl " + model_args() + text_arg() + " --context 128 --rope-scaling default --plot " + f,
      "generate " + model_args() + " --prompt hi --json " + f,
      "detect-layout " + model_args() + text_arg() + " --json " + f,
      "check-cache " + model_args() + text_arg() + " --json " + f,
      "convert " + model_args() + " --out " + f,
#if POSENC_WITH_TRAIN
      "train --task copy --steps 5 --eval-samples 0 --out " + f,
#endif
  };
  for (const auto& args : cases) {
    expect_usage_error(args, {missing.string() + " does not exist"});
    EXPECT_FALSE(fs::exists(missing)) << args << " created " << missing;
  }
  // Directories are outputs that are created (their --help says so).
  const CliResult help = run_cli("eval --help");
  EXPECT_NE(help.out.find("created with its missing parents"), std::string::npos) << help.out;
  const CliResult e = run_cli("eval " + model_args() + " --tasks kv_retrieval --context 256 --depths 0.5 --samples 1 "
                              "--ppl-tokens -1 --quiet --out " + q(missing / "runs"));
  EXPECT_EQ(e.exit_code, 0) << e.err;
  EXPECT_TRUE(fs::exists(missing / "runs" / "LATEST"));
}

// An existing output path that is not a regular file is refused at parse time naming the flag: the atomic rename
// replaced a FIFO or a device node (`--json /dev/null` as root) by a regular file. The special files are made in a
// temporary directory (never /dev/null itself); the device case is skipped where mknod is not permitted.
TEST(CliConvention, AnOutputThatIsNotARegularFileIsRefused) {
  TempDir d;
  std::vector<fs::path> specials;
  const fs::path fifo = d.path() / "fifo";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0644), 0);
  specials.push_back(fifo);
  const fs::path dev = d.path() / "null";
  if (::mknod(dev.c_str(), S_IFCHR | 0666, makedev(1, 3)) == 0) specials.push_back(dev);
  else std::fprintf(stderr, "mknod not permitted here: the device case is skipped (FIFO only)\n");
  for (const fs::path& sp : specials) {
    const std::string f = q(sp);
    const std::pair<std::string, std::string> cases[] = {
        {"periods --rope-theta 10000 --context 4K --json " + f, "--json"},
        {"periods --rope-theta 10000 --context 4K --csv " + f, "--csv"},
        {"periods --rope-theta 10000 --context 4K --plot " + f, "--plot"},
        {"decay --csv " + f, "--csv"},
        {"inspect --config " + config("llama-3.1-8b.json") + " --json " + f, "--json"},
        {"tokenize --tokenizer " + q(posenc::test::tokenizer_path()) + " --prompt hi --json " + f, "--json"},
        {"ppl " + model_args() + text_arg() + " --context 128 --rope-scaling default --json " + f, "--json"},
        {"ppl " + model_args() + text_arg() + " --context 128 --rope-scaling default --plot " + f, "--plot"},
        {"generate " + model_args() + " --prompt hi --json " + f, "--json"},
        {"check-cache " + model_args() + " --json " + f, "--json"},
        {"convert " + model_args() + " --out " + f, "--out"},
#if POSENC_WITH_TRAIN
        {"train --task copy --steps 5 --eval-samples 0 --out " + f, "--out"},
#endif
    };
    for (const auto& [args, flag] : cases) {
      expect_usage_error(args, {flag + ": " + sp.string() + " exists and is not a regular file"});
      struct stat st {};
      ASSERT_EQ(::lstat(sp.c_str(), &st), 0) << args;
      EXPECT_FALSE(S_ISREG(st.st_mode)) << args << " replaced " << sp << " by a regular file";
    }
  }
  // A symlink to a regular file is an ordinary output (written through by the library).
  const fs::path target = d.path() / "target.json";
  { std::FILE* f = std::fopen(target.c_str(), "w"); ASSERT_NE(f, nullptr); std::fclose(f); }
  fs::create_symlink(target, d.path() / "link.json");
  const CliResult ok = run_cli("periods --rope-theta 10000 --context 4K --json " + q(d.path() / "link.json"));
  EXPECT_EQ(ok.exit_code, 0) << ok.err;
}

// `-` is stdout for --json / --csv only: an image or a checkpoint given `-` wrote a file literally named `-`. One
// path given to two outputs is refused naming both flags (one overwrote the other).
TEST(CliConvention, DashForAnImageOrCheckpointAndOneFileForTwoOutputsAreRefused) {
  TempDir d;
  const std::string cd = "cd " + q(d.path()) + " && '" + POSENC_CLI_PATH + "' ";
  const std::pair<std::string, std::string> dash[] = {
      {"ppl " + model_args() + text_arg() + " --context 128 --rope-scaling default --plot -", "--plot"},
      {"periods --rope-theta 10000 --context 4K --plot -", "--plot"},
      {"decay --plot -", "--plot"},
#if POSENC_WITH_TRAIN
      {"train --task copy --steps 5 --eval-samples 0 --out -", "--out"},
#endif
      {"convert " + model_args() + " --out -", "--out"},
  };
  for (const auto& [args, flag] : dash) {
    const CliResult r = run_cli(args);
    EXPECT_EQ(r.exit_code, 2) << args << "\nstderr: " << r.err;
    EXPECT_NE(r.err.find(flag + ": '-' (stdout) is not supported"), std::string::npos) << args << ": " << r.err;
    // Run from the temporary directory: no file named "-" appears there.
    const int st = std::system((cd + args + " >/dev/null 2>&1").c_str());
    EXPECT_EQ(WEXITSTATUS(st), 2) << args;
    EXPECT_FALSE(fs::exists(d.path() / "-")) << args << " wrote a file named '-'";
  }
  const std::string x = q(d.path() / "x.out");
  const std::string y = q(d.path() / "." / "x.out");  // the same file spelled differently
  const std::pair<std::string, std::vector<std::string>> same[] = {
      {"ppl " + model_args() + text_arg() + " --context 128 --rope-scaling default --json " + x + " --plot " + x,
       {"--json and --plot", "given twice"}},
      {"periods --rope-theta 10000 --context 4K --json " + x + " --csv " + y, {"--json and --csv", "given twice"}},
      {"periods --rope-theta 10000 --context 4K --csv " + x + " --plot " + x, {"--csv and --plot", "given twice"}},
      {"decay --csv " + x + " --plot " + x, {"--csv and --plot", "given twice"}},
  };
  for (const auto& [args, needles] : same) {
    expect_usage_error(args, needles);
    EXPECT_FALSE(fs::exists(d.path() / "x.out")) << args;
  }
}

// inspect's text (issue 14 part 6): no column or field printed twice. Without scaling the channel table had
// rot@<original> and rot@<seq_len> side by side with the same heading and the same numbers (mistral: rot@32K twice),
// and "rope parameters: max_position_embeddings N" repeated the max_position_embeddings line.
TEST(CliInspect, PrintsNoDuplicatedColumnsOrFields) {
  std::vector<fs::path> configs;
  for (const char* dir : {"configs", "configs-extra"})
    for (const auto& e : fs::directory_iterator(posenc::test::shared_dir() / dir))
      if (e.path().extension() == ".json") configs.push_back(e.path());
  ASSERT_GE(configs.size(), 20u);
  int tables = 0, single_length = 0;
  for (const auto& c : configs) {
    const CliResult r = run_cli("inspect --config " + q(c));
    if (r.exit_code != 0) continue;  // a config this runtime refuses is another test's business
    std::vector<std::string> lines;
    for (std::size_t a = 0, b; a < r.out.size(); a = b + 1) {
      b = r.out.find('\n', a);
      if (b == std::string::npos) b = r.out.size();
      lines.push_back(r.out.substr(a, b - a));
    }
    // Header fields: "name:   value", each name once; max_position_embeddings on its own line only.
    std::map<std::string, int> fields;
    std::size_t i = 0;
    for (; i < lines.size() && !lines[i].empty(); ++i) {
      const auto colon = lines[i].find(':');
      if (lines[i].starts_with("  note:") || colon == std::string::npos) continue;
      ++fields[lines[i].substr(0, colon)];
    }
    for (const auto& [name, n] : fields) EXPECT_EQ(n, 1) << c.filename() << ": field " << name;
    // The value of the max_position_embeddings line is not repeated as a rope parameter.
    for (std::size_t k = 0; k < i; ++k)
      if (lines[k].starts_with("max_position_embeddings:")) {
        std::string v = lines[k].substr(lines[k].find(':') + 1);
        v.erase(0, v.find_first_not_of(' '));
        for (std::size_t j = 0; j < i; ++j) {
          if (!lines[j].starts_with("rope parameters:")) continue;
          EXPECT_EQ(lines[j].find(" max_position_embeddings " + v), std::string::npos)
              << c.filename() << ": max_position_embeddings " << v << " printed twice:\n" << r.out;
        }
      }
    // The channel table: distinct headings, and no column equal to another in every row.
    const auto head =
        std::find_if(lines.begin(), lines.end(), [](const std::string& l) { return l.starts_with("   i "); });
    if (head == lines.end()) continue;
    ++tables;
    std::vector<std::string> names;
    {
      std::istringstream in(*head);
      for (std::string w; in >> w;) names.push_back(w);
    }
    std::set<std::string> distinct(names.begin(), names.end());
    EXPECT_EQ(distinct.size(), names.size()) << c.filename() << ": " << *head;
    if (names.size() == 5) ++single_length;
    std::vector<std::vector<std::string>> cols(names.size());
    for (auto it = head + 1; it != lines.end() && !it->empty(); ++it) {
      std::istringstream in(*it);
      std::vector<std::string> v;
      for (std::string w; in >> w;) v.push_back(w);
      ASSERT_EQ(v.size(), names.size()) << c.filename() << ": " << *it;
      for (std::size_t k = 0; k < v.size(); ++k) cols[k].push_back(v[k]);
    }
    ASSERT_GE(cols[0].size(), 2u) << c.filename();
    for (std::size_t a = 0; a < cols.size(); ++a)
      for (std::size_t b = a + 1; b < cols.size(); ++b)
        EXPECT_NE(cols[a], cols[b]) << c.filename() << ": columns " << names[a] << " and " << names[b] << " are equal";
  }
  EXPECT_GE(tables, 15);
  EXPECT_GE(single_length, 8) << "configs without scaling print one rotations column";
}

}  // namespace POSENC_UNITY_ID
