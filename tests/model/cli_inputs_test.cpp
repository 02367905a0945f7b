// CLI inputs that must not hang, exhaust memory or wrap (issue 13 items 7 and
// 11): FIFOs and devices as input files, out-of-range and non-finite flag
// values, the exit-code rule, --prompt-file.
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "test_support.hpp"

namespace POSENC_UNITY_ID {  // this file's own namespace in the tests' unity build (CMakeLists.txt)

using posenc::test::CliResult;
using posenc::test::TempDir;

namespace {

std::string q(const std::filesystem::path& p) { return "'" + p.string() + "'"; }
std::string model_args() {
  return "--model " + q(posenc::test::model_path()) + " --tokenizer " + q(posenc::test::tokenizer_path());
}

}  // namespace

// A FIFO hung open() forever; now every input is opened non-blocking and
// refused when it is not a regular file: exit 1 at once, naming the file.
TEST(CliInputs, FifoInputsFailAtOnceNamingTheFile) {
  TempDir d;
  const auto fifo = d.path() / "pipe";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  const std::string text = " --text " + q(posenc::test::text_path());
  const std::string cases[] = {
      "ppl --model " + q(fifo) + " --tokenizer " + q(posenc::test::tokenizer_path()) + text,
      "ppl --model " + q(posenc::test::model_path()) + " --tokenizer " + q(fifo) + text,
      "ppl " + model_args() + " --text " + q(fifo),
      "ppl " + model_args() + " --config " + q(fifo) + text,
      "check-cache " + model_args() + " --text " + q(fifo),
      "detect-layout " + model_args() + " --text " + q(fifo),
      "generate " + model_args() + " --prompt-file " + q(fifo),
      "tokenize --tokenizer " + q(posenc::test::tokenizer_path()) + " --text " + q(fifo),
      "tokenize --tokenizer " + q(fifo) + " --prompt hi",
      "inspect --config " + q(fifo),
  };
  for (const auto& args : cases) {
    const std::string cmd = "timeout 30 '" + std::string(POSENC_CLI_PATH) + "' " + args + " >/dev/null 2>'" +
                            (d.path() / "err").string() + "'";
    const auto t0 = std::chrono::steady_clock::now();
    const int st = std::system(cmd.c_str());
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    ASSERT_TRUE(WIFEXITED(st)) << args;
    EXPECT_EQ(WEXITSTATUS(st), 1) << args << " (124 = hung until the timeout)";
    const std::string err = posenc::test::slurp(d.path() / "err");
    EXPECT_NE(err.find(fifo.string()), std::string::npos) << args << ": " << err;
    EXPECT_NE(err.find("not a regular file"), std::string::npos) << args << ": " << err;
    EXPECT_LT(s, 20.0) << args;
  }
}

// /dev/zero as --text or --config grew memory without bound; now refused.
TEST(CliInputs, DevZeroIsRefused) {
  const std::string text = " --text " + q(posenc::test::text_path());
  const std::string cases[] = {
      "ppl " + model_args() + " --text /dev/zero",
      "ppl " + model_args() + " --config /dev/zero" + text,
      "inspect --config /dev/zero",
      "generate " + model_args() + " --prompt-file /dev/zero",
  };
  for (const auto& args : cases) {
    // In 4 GB of address space: the old read grew until it ran out (not under
    // AddressSanitizer, whose shadow memory alone reserves more).
    const std::string limit = posenc::test::kAddressSanitizer ? "" : "ulimit -v 4000000; ";
    const CliResult r = posenc::test::run_cli("--help >/dev/null; " + limit + "'" +
                                              std::string(POSENC_CLI_PATH) + "' " + args);
    EXPECT_EQ(r.exit_code, 1) << args << ": " << r.err;
    EXPECT_NE(r.err.find("/dev/zero"), std::string::npos) << args << ": " << r.err;
    EXPECT_NE(r.err.find("not a regular file"), std::string::npos) << args << ": " << r.err;
  }
}

// Flag values: malformed or out of range alike are usage errors (exit 2),
// refused at parse time with the flag and the allowed range.
TEST(CliInputs, BadFlagValuesAreUsageErrorsNamingFlagAndRange) {
  const std::string text = " --text " + q(posenc::test::text_path());
  const std::pair<std::string, std::string> cases[] = {
      // --seed -1 wrapped to 2^64 - 1 silently.
      {"generate " + model_args() + " --prompt hi --seed -1", "--seed"},
      {"generate " + model_args() + " --prompt hi --seed -1", "[0, 18446744073709551615]"},
      {"generate " + model_args() + " --prompt hi --temperature nan", "--temperature"},
      {"generate " + model_args() + " --prompt hi --top-p 0", "--top-p"},
      {"generate " + model_args() + " --prompt hi --max-tokens -5", "--max-tokens"},
#if POSENC_WITH_TRAIN
      {"train --seed -1 --out /tmp/posenc-never-written.pt", "--seed"},
#endif
      // check-cache --tolerance nan was accepted.
      {"check-cache " + model_args() + text + " --tolerance nan", "--tolerance"},
      {"check-cache " + model_args() + text + " --tolerance inf", "--tolerance"},
      // "length must be positive" for INT64_MAX.
      {"check-cache " + model_args() + text + " --length 9223372036854775807", "[16, 1048576]"},
      {"check-cache " + model_args() + text + " --block-size 0", "--block-size"},
      {"ppl " + model_args() + text + " --scored-tokens 9223372036854775807", "--scored-tokens"},
      // --context: one check with the command's real range (it was [1, 2^40] at parse and [2, 1048576] later).
      {"ppl " + model_args() + text + " --context 9223372036854775807",
       "--context: a length must be an integer in [2, 1048576] (got '9223372036854775807')"},
      {"ppl " + model_args() + text + " --context 4096K", "--context: a length must be an integer in [2, 1048576] (got '4096K')"},
      {"ppl " + model_args() + text + " --context 1", "--context: a length must be an integer in [2, 1048576] (got '1')"},
      {"ppl " + model_args() + text + " --context 0", "--context: a length must be an integer in [2, 1048576] (got '0')"},
      {"eval " + model_args() + " --tasks kv_retrieval --ppl-tokens -1 --out /tmp/posenc-never --context 4",
       "--context: a length must be an integer in [8, 1048576] (got '4')"},
      {"eval " + model_args() + " --tasks kv_retrieval --ppl-tokens -1 --out /tmp/posenc-never --context 256,2048K",
       "--context: a length must be an integer in [8, 1048576] (got '2048K')"},
      {"detect-layout " + model_args() + text + " --context 1",
       "--context: must be 0 (the trained context) or one length in [2, 1048576] (an integer, optional K or M "
       "suffix as ppl's; got '1')"},
      {"detect-layout " + model_args() + text + " --context 2K,4K",
       "--context: must be 0 (the trained context) or one length in [2, 1048576] (an integer, optional K or M "
       "suffix as ppl's; got '2K,4K')"},
      {"detect-layout " + model_args() + text + " --context 2048K", "got '2048K'"},
      {"ppl " + model_args() + text + " --context abc", "--context"},
      {"ppl " + model_args() + text + " --rope-factor nan", "--rope-factor"},
      {"ppl " + model_args() + text + " --rope-theta -1", "--rope-theta"},
      {"detect-layout " + model_args() + text + " --context -3", "--context"},
      // 1e-300 passed the flags' checks and failed later as "inv_freq[0]: must be finite" (exit 1, no flag named).
      {"ppl " + model_args() + text + " --rope-scaling linear --rope-factor 1e-300",
       "--rope-factor: must be a finite number in [1e-06, 1e+06] (got '1e-300')"},
      {"generate " + model_args() + " --prompt hi --rope-scaling linear --rope-factor 1e-300", "--rope-factor"},
      {"ppl " + model_args() + text + " --rope-theta 1e-300",
       "--rope-theta: must be a finite number in [1.17549e-38, 1e+30] (got '1e-300')"},
      {"generate " + model_args() + " --prompt hi --rope-theta 1e-300", "--rope-theta"},
      {"periods --head-dim 1000000000 --rope-theta 10000 --context 4K", "--head-dim"},
      {"decay --head-dim 1000000000", "[2, 16384]"},
      {"periods --rope-theta abc --context 4K", "--rope-theta"},
      {"decay --rope-theta x1", "--rope-theta"},
      {"inspect --config " + q(posenc::test::shared_dir() / "configs/llama-3.1-8b.json") + " --seq-len 12X", "--seq-len"},
      // eval and study: the same rule (they exited 1 for these, or wrapped --seed -1).
      {"eval " + model_args() + " --tasks kv_retrieval --ppl-tokens -1 --out /tmp/posenc-never --seed -1", "--seed"},
      {"eval " + model_args() + " --tasks kv_retrieval --ppl-tokens -1 --out /tmp/posenc-never --samples 0", "--samples"},
      {"eval " + model_args() + " --tasks kv_retrieval --out /tmp/posenc-never --ppl-tokens 9223372036854775807",
       "--ppl-tokens"},
      {"eval " + model_args() + " --tasks kv_retrieval --ppl-tokens -1 --out /tmp/posenc-never --threshold nan",
       "--threshold"},
      {"eval " + model_args() + " --tasks kv_retrieval --ppl-tokens -1 --out /tmp/posenc-never --choices 99", "--choices"},
      {"eval " + model_args() + " --tasks kv_retrieval --ppl-tokens -1 --out /tmp/posenc-never --depths 0.5x", "--depths"},
      {"eval " + model_args() + " --tasks kv_retrieval --ppl-tokens -1 --out /tmp/posenc-never --shard 3/2", "--shard"},
      {"eval " + model_args() + " --tasks kv_retrieval --ppl-tokens -1", "--out is required"},
      {"random-model --vocab 100 --out /tmp/posenc-never.gguf", "--vocab: must be an integer in [259, 2147483647]"},
      {"random-model --dim 0 --out /tmp/posenc-never.gguf", "--dim: must be an integer in [1, 2147483647]"},
      {"random-model --seed -1 --out /tmp/posenc-never.gguf", "--seed"},
#if POSENC_WITH_TRAIN
      {"study --out /tmp/posenc-never --samples 0", "--samples"},
      {"study --out /tmp/posenc-never --shard x", "--shard"},
      {"study --out /tmp/posenc-never --tasks nosuchtask", "--tasks"},
      {"study --out /tmp/posenc-never --recipe copy:bogus=1", "--recipe"},
#endif
  };
  for (const auto& [args, needle] : cases) {
    const CliResult r = posenc::test::run_cli(args);
    EXPECT_EQ(r.exit_code, 2) << args << ": " << r.err;
    EXPECT_NE(r.err.find(needle), std::string::npos) << args << ": " << r.err;
  }
}

// An option a command does not take, and stray words, are named in the order given with the command that refused
// them (CLI11 listed them reversed: "The following arguments were not expected: tok512.bin --tokenizer").
TEST(CliInputs, UnexpectedArgumentsAreNamedAsGiven) {
  const std::string model = "--model " + q(posenc::test::model_path());
  CliResult r = posenc::test::run_cli("inspect " + model + " --tokenizer tok512.bin");
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_NE(r.err.find("posenc inspect does not take the arguments --tokenizer tok512.bin\n"), std::string::npos)
      << r.err;
  r = posenc::test::run_cli("tokenize one --tokenizer " + q(posenc::test::tokenizer_path()) + " --text abc two");
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_NE(r.err.find("posenc tokenize does not take the arguments one two\n"), std::string::npos) << r.err;
  r = posenc::test::run_cli("inspect " + model + " stray");
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_NE(r.err.find("posenc inspect does not take the argument stray\n"), std::string::npos) << r.err;
  // Quoted and escaped as given.
  r = posenc::test::run_cli("inspect " + model + " 'a b' \"$(printf '\\033[31m')\"");
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_NE(r.err.find("does not take the arguments 'a b' \\x1b[31m\n"), std::string::npos) << r.err;
  // An empty argument no option takes as its value: CLI11 2.1 looped forever on it (before an option, in a command
  // with option groups); refused before parsing. An option's empty value is the option's to refuse.
  r = posenc::test::run_cli("inspect " + model + " '' --quiet");
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_NE(r.err.find("posenc: argument 4 is empty where no option takes a value (after '"), std::string::npos)
      << r.err;
  r = posenc::test::run_cli("inspect " + model + " --prompt '' --quiet");  // after an option inspect does not have
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_NE(r.err.find("posenc: argument 5 is empty where no option takes a value (after '--prompt')"),
            std::string::npos)
      << r.err;
  r = posenc::test::run_cli("ppl " + model_args() + " --text " + q(posenc::test::text_path()) + " --context ''");
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_NE(r.err.find("--context: empty value"), std::string::npos) << r.err;
  // A misspelt command is named (CLI11 said only "A subcommand is required").
  r = posenc::test::run_cli("genrate " + model);
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_NE(r.err.find("posenc: 'genrate' is not a command (the commands: ppl, generate,"), std::string::npos) << r.err;
}

TEST(CliInputs, HelpFooterStatesTheExitCodeRule) {
  const CliResult r = posenc::test::run_cli("--help");
  EXPECT_EQ(r.exit_code, 0);
  EXPECT_NE(r.out.find("Exit codes: 0 success; 2 the command line is rejected"), std::string::npos) << r.out;
  // Every environment variable the CLI and library read for users (not the tests' own hooks) is named there.
  for (const char* v : {"OMP_NUM_THREADS", "POSENC_DENSE_KERNEL", "POSENC_Q8_KERNEL", "POSENC_DECODE_STREAMS",
                        "POSENC_PYTHON", "POSENC_SCRIPTS_DIR"})
    EXPECT_NE(r.out.find(v), std::string::npos) << v << " missing from --help:\n" << r.out;
}

// An existing output directory must itself be writable (the check used to test
// its parent). Root may write anywhere but on read-only mounts: skipped as root.
TEST(CliInputs, ExistingOutputDirectoryIsCheckedItself) {
  if (::geteuid() == 0) GTEST_SKIP() << "root writes into a mode-0555 directory";
  TempDir d;
  const auto ro = d.path() / "ro";
  std::filesystem::create_directory(ro);
  ::chmod(ro.c_str(), 0555);
  const CliResult r = posenc::test::run_cli("eval " + model_args() + " --tasks passkey --context 256 --ppl-tokens -1 --out " + q(ro));
  ::chmod(ro.c_str(), 0755);
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_NE(r.err.find("is not writable"), std::string::npos) << r.err;
}

// --prompt-file: a prompt past the 128 KiB limit of one command-line argument
// can be given at all; the same prompt gives the same tokens as --prompt.
TEST(CliInputs, PromptFileGivesTheSamePromptAsPrompt) {
  TempDir d;
  const auto small = d.file("small.txt", "Once upon a time");
  const CliResult a = posenc::test::run_cli("generate " + model_args() + " --quiet --max-tokens 8 --prompt 'Once upon a time'");
  const CliResult b = posenc::test::run_cli("generate " + model_args() + " --quiet --max-tokens 8 --prompt-file " + q(small));
  ASSERT_EQ(a.exit_code, 0) << a.err;
  ASSERT_EQ(b.exit_code, 0) << b.err;
  EXPECT_EQ(a.out, b.out);
  const CliResult both =
      posenc::test::run_cli("generate " + model_args() + " --prompt hi --prompt-file " + q(small));
  EXPECT_EQ(both.exit_code, 2) << both.err;
  const CliResult none = posenc::test::run_cli("generate " + model_args());
  EXPECT_EQ(none.exit_code, 2) << none.err;

  std::string big;
  while (big.size() < 200 * 1024) big += "Once upon a time there was a little girl. ";
  const auto big_file = d.file("big.txt", big);
  const CliResult t = posenc::test::run_cli("tokenize --tokenizer " + q(posenc::test::tokenizer_path()) +
                                            " --prompt-file " + q(big_file) + " --json " + q(d.path() / "t.json"));
  ASSERT_EQ(t.exit_code, 0) << t.err;
  EXPECT_NE(posenc::test::slurp(d.path() / "t.json").find("\"ids\""), std::string::npos);
}

namespace {

void expect_exit(int code, const std::string& args, const std::vector<std::string>& needles,
                 const std::vector<std::string>& absent = {}) {
  const CliResult r = posenc::test::run_cli(args);
  EXPECT_EQ(r.exit_code, code) << args << "\nstderr: " << r.err;
  for (const auto& n : needles)
    EXPECT_NE(r.err.find(n), std::string::npos) << args << ": '" << n << "' not in " << r.err;
  for (const auto& n : absent) EXPECT_EQ(r.err.find(n), std::string::npos) << args << ": '" << n << "' in " << r.err;
}

#if POSENC_WITH_TRAIN  // trains a model or runs `posenc train`/`study` (not in a -DPOSENC_WITH_TRAIN=OFF build)
/// A small `posenc train` checkpoint (`pe` positions, 5 steps: only its positional family matters here).
std::filesystem::path train_small(const TempDir& d, const std::string& pe) {
  const auto out = d.path() / (pe + ".pt");
  const CliResult r = posenc::test::run_cli("train --task copy --pe " + pe + " --train-lengths 8:32 --steps 5 "
                                            "--batch-size 4 --dim 32 --heads 4 --layers 1 --seed 1 --eval-samples 0 "
                                            "--out " + q(out));
  EXPECT_EQ(r.exit_code, 0) << r.err;
  return out;
}
#endif

}  // namespace

// `--context ""`, `--buckets ""`, `--tasks ""` silently ran the defaults: an option given empty is not an option
// left out.
TEST(CliInputs, EmptyValuesAreRefusedNamingTheFlag) {
  TempDir d;
  const std::string text = " --text " + q(posenc::test::text_path());
  const std::string eval = "eval " + model_args() + " --ppl-tokens -1 --out " + q(d.path() / "runs");
  for (const std::string& args : {"ppl " + model_args() + text + " --context ''",
                                  "ppl " + model_args() + text + " --buckets ''",
                                  eval + " --tasks kv_retrieval --context ''", eval + " --tasks ''"}) {
    const std::string flag = args.substr(args.rfind(" --") + 1, args.rfind(" ''") - args.rfind(" --") - 1);
    expect_exit(2, args, {flag + ":", "empty"});
  }
  EXPECT_FALSE(std::filesystem::exists(d.path() / "runs"));
}

// An unknown --rope-scaling exited 1 from ppl with a message starting "rope_type:"; an unknown --control exited 1.
TEST(CliInputs, UnknownScalingOrControlIsAUsageErrorNamingTheFlag) {
  TempDir d;
  const std::string text = " --text " + q(posenc::test::text_path());
  const std::string eval = "eval " + model_args() + " --ppl-tokens -1 --tasks kv_retrieval --out " + q(d.path() / "r");
  const std::string unknown = "--rope-scaling: unknown RoPE scaling 'bogus'";
  expect_exit(2, "ppl " + model_args() + text + " --rope-scaling bogus", {unknown});
  expect_exit(2, "ppl " + model_args() + text + " --rope-scaling default,bogus", {unknown});
  expect_exit(2, eval + " --rope-scaling bogus", {unknown});
  expect_exit(2, "generate " + model_args() + " --prompt hi --rope-scaling bogus", {unknown});
  expect_exit(2, eval + " --control bogus", {"--control: ", "bogus"});
}

#if POSENC_WITH_TRAIN  // trains a model or runs `posenc train`/`study` (not in a -DPOSENC_WITH_TRAIN=OFF build)
// Models whose positions are not RoPE or end in a learned table: --rope-factor was ignored by ppl and eval (and
// generate blamed "--rope-scaling native", a flag never passed); a --context past the learned table exited 1 while
// check-cache --length exited 2. A posenc checkpoint given as --tokenizer failed on a llama2.c header field.
TEST(CliInputs, FlagsThatDoNotFitTheModelAreUsageErrors) {
  TempDir d;
  const auto alibi = train_small(d, "alibi");
  const auto learned = train_small(d, "learned");
  ASSERT_TRUE(std::filesystem::exists(alibi) && std::filesystem::exists(learned));
  {
    std::ofstream t(d.path() / "copy.txt");
    for (int i = 0; i < 64; ++i) t << "a b c > a b c\n\n";
  }
  const std::string text = " --text " + q(d.path() / "copy.txt");
  const std::string no_rope = "--rope-factor: the model has no RoPE (alibi positions)";
  expect_exit(2, "ppl --model " + q(alibi) + text + " --context 16 --rope-factor 2", {no_rope});
  expect_exit(2, "eval --model " + q(alibi) + " --tasks kv_retrieval --context 16 --ppl-tokens -1 --rope-factor 2 "
                 "--out " + q(d.path() / "runs"), {no_rope});
  expect_exit(2, "generate --model " + q(alibi) + " --prompt 'a b' --max-tokens 2 --rope-factor 2", {no_rope},
              {"--rope-scaling native"});
  EXPECT_FALSE(std::filesystem::exists(d.path() / "runs"));

  const std::string past = "--context: 100000 positions are past the learned position table (max_position_embeddings ";
  expect_exit(2, "ppl --model " + q(learned) + text + " --context 100000", {past});
  expect_exit(2, "ppl --model " + q(learned) + text + " --context 16,100000", {past});
  expect_exit(2, "eval --model " + q(learned) + " --tasks kv_retrieval --context 100000 --ppl-tokens -1 --out " +
                     q(d.path() / "runs"), {past});
  // Inside the table it runs.
  expect_exit(0, "ppl --model " + q(learned) + text + " --context 16 --quiet", {});

  expect_exit(1, "ppl --model " + q(posenc::test::model_path()) + " --tokenizer " + q(alibi) + text,
              {"--tokenizer " + alibi.string() + ": is a posenc checkpoint, not a tokenizer (its vocabulary is used when "
                                                 "it is the model)"},
              {"max_token_length"});
}
#endif

// check-cache without --text feeds pseudo-random ids: a llama2.c .bin, which brings no tokenizer, needs none. With
// --text it does.
TEST(CliInputs, CheckCacheWithoutTextNeedsNoTokenizer) {
  const std::string m = "check-cache --model " + q(posenc::test::model_path()) + " --length 40";
  const CliResult r = posenc::test::run_cli(m);
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.err.find("tokenizer: none"), std::string::npos) << r.err;
  EXPECT_NE(r.out.find("PASSED"), std::string::npos) << r.out;
  // A flag the model needs is missing: the command line is rejected (exit 2), as --endpoint without --tokenizer.
  expect_exit(2, m + " --text " + q(posenc::test::text_path()), {"--tokenizer: required"});
}

// generate --json recorded the model's base rope_type ("default") whatever --rope-scaling applied.
TEST(CliInputs, GenerateJsonRecordsTheAppliedRopeSetup) {
  TempDir d;
  const auto f = d.path() / "g.json";
  const std::string g =
      "generate " + model_args() + " --prompt 'Once upon a time' --max-tokens 4 --quiet --json " + q(f);
  CliResult r = posenc::test::run_cli(g + " --rope-scaling linear --rope-factor 2");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  auto j = nlohmann::json::parse(posenc::test::slurp(f));
  EXPECT_EQ(j["rope_type"], "linear");
  EXPECT_EQ(j["rope_scaling"], "linear");
  EXPECT_EQ(j["rope_factor"], 2.0);
  r = posenc::test::run_cli(g);  // native: the model's own (stories260K: default, no factor)
  ASSERT_EQ(r.exit_code, 0) << r.err;
  j = nlohmann::json::parse(posenc::test::slurp(f));
  EXPECT_EQ(j["rope_type"], "default");
  EXPECT_EQ(j["rope_scaling"], "native");
  EXPECT_TRUE(j["rope_factor"].is_null());
}

// Text inputs documented as UTF-8 were taken whatever their bytes, and each tokenizer did its own thing with
// invalid ones (run.c's byte fallback, llama.cpp's lead-byte lengths, U+FFFD): every text input now refuses invalid
// UTF-8 before any work, naming the input, the byte offset and line of the first invalid sequence; a file exits 1,
// a --prompt 2; nothing is written.
TEST(CliInputs, InvalidUtf8TextInputsAreRefusedNamingTheOffset) {
  TempDir d;
  const std::string good = posenc::test::slurp(posenc::test::text_path()).substr(0, 2000);
  const auto nl = static_cast<std::size_t>(std::count(good.begin(), good.end(), '\n'));
  const auto bad = d.file("latin1.txt", good + "caf\xe9 au lait\n");
  const std::string at = "not valid UTF-8: the first invalid sequence is at byte offset " +
                         std::to_string(good.size() + 3) + " (line " + std::to_string(nl + 1) +
                         "; bytes from there: 0xe9 0x20 0x61 0x75 ...)";
  const auto json = d.path() / "out.json";
  const std::pair<std::string, std::string> files[] = {
      {"ppl " + model_args() + " --text " + q(bad) + " --json " + q(json), "--text " + bad.string()},
      {"detect-layout " + model_args() + " --text " + q(bad) + " --json " + q(json), "--text " + bad.string()},
      {"check-cache " + model_args() + " --text " + q(bad) + " --json " + q(json), "--text " + bad.string()},
      {"generate " + model_args() + " --prompt-file " + q(bad) + " --json " + q(json), "--prompt-file " + bad.string()},
      {"tokenize --tokenizer " + q(posenc::test::tokenizer_path()) + " --text " + q(bad) + " --json " + q(json),
       "--text " + bad.string()},
      {"eval " + model_args() + " --haystack " + q(bad) + " --tasks kv_retrieval --context 64 --out " +
           q(d.path() / "run"),
       "--haystack " + bad.string()},
  };
  for (const auto& [args, what] : files) {
    const CliResult r = posenc::test::run_cli(args);
    EXPECT_EQ(r.exit_code, 1) << args << ": " << r.err;
    EXPECT_NE(r.err.find("posenc: error: " + what + ": " + at), std::string::npos) << args << ": " << r.err;
    EXPECT_FALSE(std::filesystem::exists(json)) << args;
    EXPECT_FALSE(std::filesystem::exists(d.path() / "run")) << args;
  }
  for (const std::string& args : {"generate " + model_args() + " --prompt 'caf\xe9'",
                                  "tokenize --tokenizer " + q(posenc::test::tokenizer_path()) + " --prompt 'caf\xe9'"}) {
    const CliResult r = posenc::test::run_cli(args);
    EXPECT_EQ(r.exit_code, 2) << args << ": " << r.err;
    EXPECT_NE(r.err.find("--prompt: not valid UTF-8: the first invalid sequence is at byte offset 3 (line 1; bytes "
                         "from there: 0xe9)"),
              std::string::npos)
        << args << ": " << r.err;
    EXPECT_EQ(r.err.find("model:"), std::string::npos) << r.err;  // refused while parsing, before any loading
  }
  // The same text in UTF-8 runs.
  const auto fixed = d.file("utf8.txt", good + "caf\xc3\xa9 au lait\n");
  const CliResult ok = posenc::test::run_cli("tokenize --tokenizer " + q(posenc::test::tokenizer_path()) + " --text " +
                                             q(fixed) + " --json -");
  EXPECT_EQ(ok.exit_code, 0) << ok.err;
  EXPECT_NE(ok.out.find("\"count\""), std::string::npos) << ok.out;
}


// OMP_NUM_THREADS=100000 made every command die of SIGSEGV inside libgomp's GOMP_parallel (encode_stream's region)
// with no message. A count past 64 x the hardware threads is now refused before any parallel region: exit 2, naming
// the variable, its value and the bound; a sane count runs as before.
TEST(CliInputs, AbsurdOmpNumThreadsIsRefusedNamingTheVariable) {
  struct Restore {
    std::string old;
    bool had = false;
    Restore() {
      if (const char* v = std::getenv("OMP_NUM_THREADS")) had = true, old = v;
    }
    ~Restore() { had ? ::setenv("OMP_NUM_THREADS", old.c_str(), 1) : ::unsetenv("OMP_NUM_THREADS"); }
  } restore;
  const unsigned hw = std::max(1U, std::thread::hardware_concurrency());
  const std::string bound = std::to_string(64 * hw);
  const std::string ppl = "ppl " + model_args() + " --text " + q(posenc::test::text_path()) +
                          " --context 64 --scored-tokens 63 --quiet";
  for (const std::string& value :
       std::vector<std::string>{"100000", "4,100000", "99999999999999999999999", std::to_string(64 * hw + 1)}) {
    ::setenv("OMP_NUM_THREADS", value.c_str(), 1);
    const CliResult r = posenc::test::run_cli(ppl);
    EXPECT_FALSE(r.signaled) << value;
    EXPECT_EQ(r.exit_code, 2) << value << ": " << r.err;
    EXPECT_NE(r.err.find("OMP_NUM_THREADS '" + value + "'"), std::string::npos) << r.err;
    EXPECT_NE(r.err.find("at most " + bound), std::string::npos) << r.err;
    EXPECT_EQ(r.out, "");
  }
  // Values that are not counts: libgomp warned and ran with its default; refused the same way.
  for (const std::string& value : std::vector<std::string>{"abc", "0", "-1", "4,,2", "2x", "+", "++2", "+ 2", "+0"}) {
    ::setenv("OMP_NUM_THREADS", value.c_str(), 1);
    const CliResult r = posenc::test::run_cli(ppl);
    EXPECT_EQ(r.exit_code, 2) << value << ": " << r.err;
    EXPECT_NE(r.err.find("OMP_NUM_THREADS '" + value + "'"), std::string::npos) << r.err;
    EXPECT_NE(r.err.find("is not a thread count"), std::string::npos) << r.err;
  }
  for (const std::string& value : std::vector<std::string>{"2", " 2 ", "2,1", "+2"}) {
    ::setenv("OMP_NUM_THREADS", value.c_str(), 1);
    const CliResult ok = posenc::test::run_cli(ppl);
    EXPECT_EQ(ok.exit_code, 0) << value << ": " << ok.err;
  }
  // --version and --help answer under any value (they run no parallel region); a command still exits 2.
  ::setenv("OMP_NUM_THREADS", "100000", 1);
  const CliResult v = posenc::test::run_cli("--version");
  EXPECT_EQ(v.exit_code, 0) << v.err;
  EXPECT_TRUE(v.out.starts_with("posenc ")) << v.out;
  const CliResult h = posenc::test::run_cli("ppl --help");
  EXPECT_EQ(h.exit_code, 0) << h.err;
  EXPECT_NE(h.out.find("--context"), std::string::npos) << h.out;
  const CliResult i = posenc::test::run_cli(ppl);
  EXPECT_EQ(i.exit_code, 2) << i.err;
  EXPECT_NE(i.err.find("OMP_NUM_THREADS '100000'"), std::string::npos) << i.err;
  EXPECT_EQ(i.out, "");
  ::unsetenv("OMP_NUM_THREADS");
  // The --threads flags have the same bound, as a usage error.
  const CliResult s = posenc::test::run_cli("serve " + model_args() + " --threads 100000");
  EXPECT_EQ(s.exit_code, 2) << s.err;
  EXPECT_NE(s.err.find("--threads"), std::string::npos) << s.err;
  EXPECT_NE(s.err.find(bound), std::string::npos) << s.err;
}

// Inputs of the wrong format said nothing of the format they were read as: a text file given as --model failed as a
// llama2.c header ("header field dim must be in [1, 65536] (got 1701015119)"), a tokenizer.json holding `[]` was read
// as a llama2.c tokenizer, and bad content of tokenize --prompt-file was blamed on --text.
TEST(CliInputs, WrongFormatsSayWhatTheyWereReadAs) {
  TempDir d;
  const auto txt = d.file("story.txt", "Once upon a time, there was a little girl named Lily.\n");
  const CliResult m = posenc::test::run_cli("ppl --model " + q(txt) + " --tokenizer " +
                                            q(posenc::test::tokenizer_path()) + " --text " + q(txt));
  EXPECT_EQ(m.exit_code, 1) << m.err;
  EXPECT_NE(m.err.find("read as a llama2.c checkpoint, the format of last resort"), std::string::npos) << m.err;
  EXPECT_NE(m.err.find("it starts as text: 'Once upon a time, there was a li'"), std::string::npos) << m.err;
  EXPECT_NE(m.err.find(txt.string() + ": header field dim"), std::string::npos) << m.err;

  const auto arr = d.file("tokenizer.json", " []\n");
  const CliResult t = posenc::test::run_cli("tokenize --tokenizer " + q(arr) + " --prompt hi");
  EXPECT_EQ(t.exit_code, 1) << t.err;
  EXPECT_NE(t.err.find(arr.string() + ": (root): malformed tokenizer.json: must be a JSON object (got an array of 0 items)"),
            std::string::npos)
      << t.err;
  EXPECT_EQ(t.err.find("llama2.c"), std::string::npos) << t.err;

  // --config with a number past a double: the key and the file, not nlohmann's bare "number overflow".
  const auto cfg = d.file("config.json", R"({"rope_type": "linear", "factor": 2, "rope_theta": 1e400})");
  const CliResult c = posenc::test::run_cli("ppl " + model_args() + " --text " + q(txt) + " --config " + q(cfg));
  EXPECT_EQ(c.exit_code, 1) << c.err;
  EXPECT_NE(c.err.find("--config " + cfg.string() + ": rope_theta: unusable JSON value"), std::string::npos) << c.err;
  EXPECT_NE(c.err.find("1e400"), std::string::npos) << c.err;

  const auto bad = d.file("bad.txt", std::string("ab\xff" "cd"));
  for (const std::string flag : {"--prompt-file", "--text"}) {
    const CliResult r = posenc::test::run_cli("tokenize " + model_args() + " " + flag + " " + q(bad));
    EXPECT_EQ(r.exit_code, 1) << r.err;
    EXPECT_NE(r.err.find(flag + " " + bad.string()), std::string::npos) << r.err;
    if (flag == "--prompt-file") {
      EXPECT_EQ(r.err.find("--text"), std::string::npos) << r.err;
    }
  }
  const CliResult both =
      posenc::test::run_cli("tokenize " + model_args() + " --text " + q(txt) + " --prompt-file " + q(txt));
  EXPECT_EQ(both.exit_code, 2) << both.err;
}

// convert only reads and writes weights: it listed --quantized-matmul and --max-position (inherited from the model
// flags of the commands that run a model) and ignored them. They are gone from it, and kept where a model runs.
TEST(CliInputs, ConvertTakesNoFlagsOfRunningAModel) {
  const CliResult h = posenc::test::run_cli("convert --help");
  EXPECT_EQ(h.exit_code, 0);
  EXPECT_NE(h.out.find("--rope-theta"), std::string::npos) << h.out;
  EXPECT_EQ(h.out.find("--quantized-matmul"), std::string::npos) << h.out;
  EXPECT_EQ(h.out.find("--max-position"), std::string::npos) << h.out;
  TempDir d;
  for (const std::string flag : {"--quantized-matmul q8_activations", "--max-position 10"}) {
    const CliResult r =
        posenc::test::run_cli("convert " + model_args() + " --out " + q(d.path() / "m.gguf") + " " + flag);
    EXPECT_EQ(r.exit_code, 2) << flag << ": " << r.err;
    EXPECT_FALSE(std::filesystem::exists(d.path() / "m.gguf"));
  }
  for (const char* cmd : {"ppl", "generate", "eval", "serve", "detect-layout", "check-cache"}) {
    const CliResult p = posenc::test::run_cli(std::string(cmd) + " --help");
    EXPECT_NE(p.out.find("--quantized-matmul"), std::string::npos) << cmd;
    EXPECT_NE(p.out.find("--max-position"), std::string::npos) << cmd;
  }
}

}  // namespace POSENC_UNITY_ID
