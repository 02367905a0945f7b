// The CLI on bad inputs: a clear message on stderr, a non-zero exit, no crash.
#include <algorithm>
#include <cstring>

#include <gtest/gtest.h>
#include <omp.h>
#include <nlohmann/json.hpp>

#include "posenc/model.hpp"
#include "posenc/perplexity.hpp"
#include "posenc/tokenizer.hpp"
#include "test_support.hpp"

namespace POSENC_UNITY_ID {  // this file's own namespace in the tests' unity build (CMakeLists.txt)

using posenc::test::run_cli;
using posenc::test::TempDir;

namespace {
std::string q(const std::filesystem::path& p) {
  std::string s(1, '\'');
  s += p.string();
  s += '\'';
  return s;
}
std::string model_args() {
  return "--model " + q(posenc::test::model_path()) + " --tokenizer " + q(posenc::test::tokenizer_path());
}
void expect_clean_failure(const posenc::test::CliResult& r, const std::string& needle) {
  EXPECT_FALSE(r.signaled);
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.err.find(needle), std::string::npos) << "stderr: " << r.err;
}
}  // namespace

TEST(Cli, PplBadInputs) {
  TempDir d;
  const std::string good = posenc::test::slurp(posenc::test::model_path());
  const auto trunc = d.file("trunc.bin", good.substr(0, 5000));
  const auto text = q(posenc::test::text_path());
  expect_clean_failure(run_cli("ppl --model " + q(trunc) + " --tokenizer " + q(posenc::test::tokenizer_path()) +
                               " --text " + text),
                       "truncated");
  // A well-formed tokenizer with 300 entries, fewer than the model's 512.
  const std::string tok = posenc::test::slurp(posenc::test::tokenizer_path());
  std::size_t off = 4;
  for (int i = 0; i < 300; ++i) {
    int32_t len;
    std::memcpy(&len, tok.data() + off + 4, 4);
    off += 8 + static_cast<std::size_t>(len);
  }
  const auto small_tok = d.file("small_tok.bin", tok.substr(0, off));
  expect_clean_failure(run_cli("ppl --model " + q(posenc::test::model_path()) + " --tokenizer " + q(small_tok) +
                               " --text " + text),
                       "vocab_size");
  expect_clean_failure(run_cli("ppl " + model_args() + " --text " + text + " --context 0"), "--context");
  expect_clean_failure(run_cli("ppl " + model_args() + " --text " + text + " --context 1048577"), "--context");
  expect_clean_failure(run_cli("ppl " + model_args() + " --text " + q(d.path() / "nope.txt")), "nope.txt");
  expect_clean_failure(run_cli("ppl " + model_args() + " --text " + q(d.file("empty.txt", ""))), "text");
  expect_clean_failure(run_cli("ppl " + model_args() + " --text " + text + " --rope-scaling bogus"), "bogus");
  // The list of known names includes native (the model's own), which every command takes.
  expect_clean_failure(run_cli("ppl " + model_args() + " --text " + text + " --rope-scaling bogus"),
                       "proportional, and native: the model's own)");
  expect_clean_failure(run_cli("ppl " + model_args() + " --text " + text + " --rope-layout neox"), "neox");
}

// Results that cannot be written (standard output on a full disk) are a failure naming it, not a silent exit 0.
TEST(Cli, StandardOutputThatCannotBeWrittenIsAFailure) {
  TempDir d;
  const auto err = d.path() / "err";
  const std::string cmd = std::string("'") + POSENC_CLI_PATH + "' tokenize --tokenizer " +
                          q(posenc::test::tokenizer_path()) + " --pieces --prompt 'Once upon a time' >/dev/full 2>" +
                          q(err);
  const int st = std::system(cmd.c_str());
  ASSERT_TRUE(WIFEXITED(st));
  EXPECT_EQ(WEXITSTATUS(st), 1);
  EXPECT_NE(posenc::test::slurp(err).find("writing standard output failed"), std::string::npos)
      << posenc::test::slurp(err);
}

// --help and --version whose text never reached standard output fail too.
TEST(Cli, HelpAndVersionThatCannotBeWrittenAreAFailure) {
  for (const std::string args : {"--version", "ppl --help", "--help-all"}) {
    // (appended, not one expression of temporaries: in the tests' unity build gcc 12 warned of a false
    // out-of-bounds memcpy in that one, -Warray-bounds)
    std::string cmd = "'";
    cmd += POSENC_CLI_PATH;
    cmd += "' " + args + " >/dev/full 2>/dev/null";
    const int st = std::system(cmd.c_str());
    ASSERT_TRUE(WIFEXITED(st)) << args;
    EXPECT_EQ(WEXITSTATUS(st), 1) << args;
  }
  EXPECT_EQ(run_cli("--version").exit_code, 0);
}

// A file named .gguf without the GGUF magic (damaged, or not a GGUF at all) is refused by the GGUF reader, naming
// the magic, rather than read as a llama2.c header ("dim must be in [1, 65536] (got 1196771143)").
TEST(Cli, GgufWithoutItsMagicIsRefusedAsAGguf) {
  TempDir d;
  std::string bytes = posenc::test::slurp(posenc::test::shared_dir() / "models/stories260K/stories260K.gguf");
  bytes[0] = 'X';
  for (const auto& [name, content] : std::vector<std::pair<std::string, std::string>>{
           {"damaged.gguf", bytes}, {"text.GGUF", "hello\n"}, {"empty.gguf", ""}}) {
    const auto r = run_cli("generate --model " + q(d.file(name, content)) + " --prompt 'Once' --max-tokens 2");
    expect_clean_failure(r, "GGUF");
    EXPECT_EQ(r.err.find("llama2.c"), std::string::npos) << r.err;
    // The same file as --tokenizer: the GGUF reader refuses it too.
    const auto t = run_cli("tokenize --tokenizer " + q(d.path() / name) + " --prompt 'Once'");
    expect_clean_failure(t, "GGUF magic");
  }
}

// A file that is neither JSON nor GGUF (nor named .gguf) is read as a llama2.c tokenizer, and the message says so.
TEST(Cli, ATokenizerReadAsLlama2cSaysSo) {
  TempDir d;
  const auto r = run_cli("tokenize --tokenizer " + q(d.file("junk.bin", "GGUXjunkjunkjunk")) + " --prompt x");
  expect_clean_failure(r, "max_token_length");
  EXPECT_NE(r.err.find("read as a llama2.c tokenizer .bin: the file is neither a tokenizer.json nor a GGUF"),
            std::string::npos)
      << r.err;
}

TEST(Cli, PplWritesJsonAtomically) {
  TempDir d;
  const auto out = d.path() / "sub" / "ppl.json";
  const std::string args = "ppl " + model_args() + " --text " + q(posenc::test::text_path()) +
                           " --context 256,1024 --rope-scaling default,linear --scored-tokens 3000 --quiet --json " +
                           q(out);
  // The file's directory must exist (it used to be created, typos included).
  const auto refused = run_cli(args);
  EXPECT_EQ(refused.exit_code, 2) << refused.err;
  EXPECT_NE(refused.err.find((d.path() / "sub").string() + " does not exist"), std::string::npos) << refused.err;
  EXPECT_FALSE(std::filesystem::exists(d.path() / "sub"));
  std::filesystem::create_directory(d.path() / "sub");
  const auto r = run_cli(args);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const auto j = nlohmann::json::parse(posenc::test::slurp(out));
  EXPECT_EQ(j["tokens_total"], 384954);
  ASSERT_EQ(j["results"].size(), 4u);
  const auto& lin1024 = j["results"][3];
  EXPECT_EQ(lin1024["context"], 1024);
  EXPECT_EQ(lin1024["rope_scaling"], "linear");
  EXPECT_EQ(lin1024["factor"], 2.0);
  EXPECT_EQ(lin1024["buckets"].size(), 3u);
  EXPECT_EQ(lin1024["buckets"][2]["start"], 512);
  for (const auto& res : j["results"]) {
    int64_t sum = 0;
    for (const auto& b : res["buckets"]) sum += b["tokens"].get<int64_t>();
    EXPECT_EQ(sum, res["tokens"].get<int64_t>());
  }
  // No temporary file left behind.
  int files = 0;
  for (const auto& e : std::filesystem::directory_iterator(out.parent_path())) files += e.is_regular_file();
  EXPECT_EQ(files, 1);
}

TEST(Cli, GenerateGolden) {
  const auto r = run_cli("generate " + model_args() + " --prompt 'Once upon a time' --max-tokens 60");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.out.rfind("Once upon a time, there was a little girl named Lily. She loved to play outside in the "
                        "park. One day, she saw a big, red ball.",
                        0),
            0u)
      << r.out;
}

TEST(Cli, DetectLayout) {
  const auto r = run_cli("detect-layout " + model_args() + " --text " + q(posenc::test::text_path()) +
                         " --scored-tokens 4096 --json -");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const auto j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["likely_layout"], "interleaved");
  EXPECT_GT(j["nll_half"].get<double>(), j["nll_interleaved"].get<double>() + 0.3);
  // Real evidence is conclusive: the margin is many standard errors.
  EXPECT_EQ(j["inconclusive"], false);
  EXPECT_GT(j["margin"].get<double>(), 10 * j["margin_standard_error"].get<double>());
  EXPECT_EQ(j["agrees_with_loader"], true);
}

// detect-layout declared "THE EVIDENCE DISAGREES" (a firm verdict) on no evidence: at --context 2 every prediction
// is made at position 0, where RoPE rotates nothing (margin exactly 0), and on a 14-token text the margin (0.006)
// was within its noise. Both are now inconclusive: said in words, "inconclusive": true and no agreement either way.
TEST(Cli, DetectLayoutSaysWhenTheEvidenceIsInconclusive) {
  TempDir d;
  const auto tiny = d.file("tiny.txt", "Once upon a time, there was a little girl named Lily.\n");
  for (const std::string& args :
       {std::string(" --text ") + q(posenc::test::text_path()) + " --context 2 --scored-tokens 512",
        std::string(" --text ") + q(tiny)}) {
    // The loader's layout (interleaved) and the other one: neither may be confirmed nor contradicted.
    for (const std::string layout : {"", " --rope-layout half", " --rope-layout interleaved"}) {
      const auto t = run_cli("detect-layout " + model_args() + layout + args);
      ASSERT_EQ(t.exit_code, 0) << args << layout << ": " << t.err;
      EXPECT_EQ(t.out.find("DISAGREES"), std::string::npos) << args << layout << ": " << t.out;
      EXPECT_EQ(t.out.find("agrees"), std::string::npos) << args << layout << ": " << t.out;
      EXPECT_NE(t.out.find("likely layout: inconclusive (margin "), std::string::npos) << t.out;
      EXPECT_NE(t.out.find(": the evidence is inconclusive"), std::string::npos) << t.out;
      const auto r = run_cli("detect-layout " + model_args() + layout + args + " --json -");
      ASSERT_EQ(r.exit_code, 0) << r.err;
      const auto j = nlohmann::json::parse(r.out);
      EXPECT_EQ(j["inconclusive"], true) << j.dump();
      EXPECT_TRUE(j["agrees_with_loader"].is_null()) << j.dump();
      EXPECT_LE(j["margin"].get<double>(), posenc::kLayoutEvidenceZ * j["margin_standard_error"].get<double>())
          << j.dump();
    }
  }
  const auto two = nlohmann::json::parse(
      run_cli("detect-layout " + model_args() + " --text " + q(posenc::test::text_path()) +
              " --context 2 --scored-tokens 512 --json -")
          .out);
  EXPECT_EQ(two["margin"].get<double>(), 0.0);  // position 0 only: the layouts are the same computation
}

// --context takes ppl's lengths (K = 1024), one of them; --quiet leaves stderr empty as ppl's does.
TEST(Cli, DetectLayoutContextSuffixAndQuiet) {
  const auto r = run_cli("detect-layout " + model_args() + " --text " + q(posenc::test::text_path()) +
                         " --context 1K --scored-tokens 1023 --quiet --json -");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(nlohmann::json::parse(r.out)["context"], 1024);
  // Past the trained context the position warning is the one line left: it is a finding, not chatter.
  EXPECT_EQ(r.err.find("trained context: "), std::string::npos) << r.err;
  const auto q2 = run_cli("detect-layout " + model_args() + " --text " + q(posenc::test::text_path()) +
                          " --context 0.5K --quiet");
  EXPECT_EQ(q2.exit_code, 2) << q2.err;
  EXPECT_NE(q2.err.find("--context"), std::string::npos) << q2.err;
  const auto quiet = run_cli("detect-layout " + model_args() + " --text " + q(posenc::test::text_path()) +
                             " --scored-tokens 511 --quiet");
  ASSERT_EQ(quiet.exit_code, 0) << quiet.err;
  EXPECT_EQ(quiet.err, "");
  EXPECT_NE(quiet.out.find("likely layout: interleaved"), std::string::npos) << quiet.out;
  const auto loud = run_cli("detect-layout " + model_args() + " --text " + q(posenc::test::text_path()) +
                            " --scored-tokens 511");
  EXPECT_NE(loud.err.find("trained context: 512"), std::string::npos) << loud.err;
}

// A text shorter than the window: the default (the trained context) reported "windows of 512" for a text scored as
// one window of fewer tokens. It now becomes the text's length with a note; a --context given so is refused.
TEST(Cli, DetectLayoutOnATextShorterThanTheTrainedContext) {
  TempDir d;
  const auto txt = d.file("short.txt", posenc::test::slurp(posenc::test::text_path()).substr(0, 600));
  const auto tokens = static_cast<int64_t>(  // the ppl protocol's stream: one BOS per block
      posenc::encode_stream(posenc::Tokenizer::load_llama2c(posenc::test::tokenizer_path(), 512),
                            posenc::test::slurp(txt))
          .size());
  const auto r = run_cli("detect-layout " + model_args() + " --text " + q(txt) + " --json -");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const auto j = nlohmann::json::parse(r.out);
  const auto trained = 512;  // stories260K's seq_len, checked against the header line below
  ASSERT_NE(r.err.find("trained context: " + std::to_string(trained)), std::string::npos) << r.err;
  ASSERT_LT(tokens, trained);
  EXPECT_EQ(j["context"].get<int64_t>(), tokens);
  EXPECT_EQ(j["tokens"].get<int64_t>(), tokens - 1);
  EXPECT_NE(r.err.find("detect-layout: note: the text has only " + std::to_string(tokens) +
                       " tokens, fewer than the trained context " + std::to_string(trained) + ": scored as one window of " +
                       std::to_string(tokens) + " tokens"),
            std::string::npos)
      << r.err;
  const auto bad = run_cli("detect-layout " + model_args() + " --text " + q(txt) + " --context " +
                           std::to_string(tokens + 1) + " --json -");
  EXPECT_EQ(bad.exit_code, 1);
  EXPECT_NE(bad.err.find("--context " + std::to_string(tokens + 1) + ": the text has only " + std::to_string(tokens) +
                         " tokens"),
            std::string::npos)
      << bad.err;
  EXPECT_EQ(bad.out, "");
}

// generate's text ends with a newline however it ends: an error part-way (here --rope-change-policy refuse at the
// first step past a dynamic-NTK switch point) left the text without one, and the error (or the shell's prompt) was
// glued onto its last word. A normal run ends with exactly one.
// Sampled byte tokens need not form UTF-8 (stories260K at temperature 5 samples stray bytes): generate --json
// writes the text with U+FFFD for each invalid byte, says so in text_is_utf8 and keeps every id; it used to
// exit 1 with nlohmann's type_error.316 after the generation, writing nothing (a newcomer's find).
TEST(Cli, GenerateJsonWithTextThatIsNotUtf8) {
  TempDir d;
  int replaced = 0;
  for (int seed : {1, 2, 3}) {
    const auto out = d.path() / ("g" + std::to_string(seed) + ".json");
    const auto r = run_cli("generate " + model_args() + " --prompt 'Once' --max-tokens 200 --temperature 5 --seed " +
                           std::to_string(seed) + " --quiet --json " + q(out));
    ASSERT_EQ(r.exit_code, 0) << r.err;
    const auto j = nlohmann::json::parse(posenc::test::slurp(out));  // valid JSON, so valid UTF-8
    EXPECT_FALSE(j.at("generated_ids").empty());
    const std::string text = j.at("text");
    const bool utf8 = j.at("text_is_utf8");
    replaced += utf8 ? 0 : 1;
    EXPECT_EQ(!utf8, text.find("\xEF\xBF\xBD") != std::string::npos) << seed;  // U+FFFD where bytes were replaced
  }
  EXPECT_GE(replaced, 1);
}

TEST(Cli, GenerateTextEndsWithANewlineAlsoWhenGenerationFails) {
  const std::string base = "generate " + model_args() + " --prompt 'Once upon a time' --quiet --ignore-eos ";
  const auto ok = run_cli(base + "--max-tokens 5");
  ASSERT_EQ(ok.exit_code, 0) << ok.err;
  ASSERT_GE(ok.out.size(), 2u);
  EXPECT_EQ(ok.out.rfind("Once upon a time", 0), 0u) << ok.out;
  EXPECT_EQ(ok.out.back(), '\n') << ok.out;
  EXPECT_NE(ok.out[ok.out.size() - 2], '\n') << ok.out;
  // Switch point at --trained-context 16 tokens, whatever the model's own context.
  const auto bad = run_cli(base + "--max-tokens 40 --trained-context 16 --rope-scaling dynamic --rope-change-policy refuse");
  EXPECT_EQ(bad.exit_code, 1) << bad.err;
  EXPECT_NE(bad.err.find("rope change policy refuse"), std::string::npos) << bad.err;
  ASSERT_GT(bad.out.size(), std::string("Once upon a time").size()) << bad.out;  // the prompt and some tokens
  EXPECT_EQ(bad.out.rfind("Once upon a time", 0), 0u) << bad.out;
  EXPECT_EQ(bad.out.back(), '\n') << bad.out;
  EXPECT_EQ(std::count(bad.out.begin(), bad.out.end(), '\n'), 1) << bad.out;
}

// Progress into a log (stderr not a terminal): ppl prints one line per (context, scaling) at 100%, not two; eval
// prints its final line once, counting the perplexity matrix, where "cells N/N" was printed after every perplexity
// job (and every second while one ran).
TEST(Cli, ProgressAt100PercentIsPrintedOnce) {
  TempDir d;
  const auto txt = d.file("t.txt", posenc::test::slurp(posenc::test::text_path()).substr(0, 30000));
  const auto ppl = run_cli("ppl " + model_args() + " --text " + q(txt) + " --context 64,128 --rope-scaling default");
  ASSERT_EQ(ppl.exit_code, 0) << ppl.err;
  for (const char* L : {"64", "128"}) {
    const std::string head = std::string("ppl L=") + L + " default: windows ";
    std::size_t lines = 0, done = 0;
    for (std::size_t at = ppl.err.find(head); at != std::string::npos; at = ppl.err.find(head, at + 1)) {
      ++lines;
      const std::string counts = ppl.err.substr(at + head.size(), ppl.err.find(',', at) - at - head.size());
      const auto slash = counts.find('/');
      done += counts.substr(0, slash) == counts.substr(slash + 1) ? 1 : 0;
    }
    EXPECT_EQ(done, 1u) << ppl.err;
    EXPECT_GE(lines, 1u);
  }
  const auto eval = run_cli("eval " + model_args() + " --haystack " + q(txt) +
                            " --tasks kv_retrieval --context 64,128 --depths 0.5 --samples 2 --ppl-tokens 2000 --out " +
                            q(d.path() / "run"));
  ASSERT_EQ(eval.exit_code, 0) << eval.err;
  std::size_t finals = 0, lines = 0;
  for (std::size_t at = eval.err.find("eval: cells "); at != std::string::npos; at = eval.err.find("eval: cells ", at + 1)) {
    ++lines;
    const std::string line = eval.err.substr(at, eval.err.find('\n', at) - at);
    if (line.find("cells 2/2, perplexity 2/2,") != std::string::npos) ++finals;
    EXPECT_NE(line.find(", perplexity "), std::string::npos) << line;
  }
  EXPECT_EQ(finals, 1u) << eval.err;
  EXPECT_LE(lines, 2u) << eval.err;  // the first report and the final one: the run takes far less than 15 s
}


// --json records what the timings depend on and the results do not (kernels): the matrix-product paths, the AVX-512
// decode plans and the thread count. OMP_NUM_THREADS and POSENC_DECODE_STREAMS show there; unset, the plans are
// this CPU's defaults (the library's kernel_info() in this process); a plan is null when only the reference runs.
TEST(Cli, JsonRecordsTheKernelsItsTimingsDependOn) {
  TempDir d;
  const posenc::KernelInfo here = posenc::kernel_info();
  const auto plan_or_null = [](const std::string& p) { return p.empty() ? nlohmann::json(nullptr) : nlohmann::json(p); };
  const auto generate = [&](const std::string& env, const std::filesystem::path& out) {
    const std::string cmd = "env -u POSENC_DECODE_STREAMS " + env + " '" + std::string(POSENC_CLI_PATH) +
                            "' generate " + model_args() + " --prompt Once --max-tokens 3 --quiet --json " + q(out) +
                            " >/dev/null 2>&1";
    const int st = std::system(cmd.c_str());
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  };
  ASSERT_EQ(generate("OMP_NUM_THREADS=1", d.path() / "a.json"), 0);
  const auto a = nlohmann::json::parse(posenc::test::slurp(d.path() / "a.json")).at("kernels");
  EXPECT_EQ(a.at("threads"), 1);
  EXPECT_EQ(a.at("dense_kernel"), here.dense_kernel);
  EXPECT_EQ(a.at("q8_kernel"), here.q8_kernel);
  if (std::getenv("POSENC_DECODE_STREAMS") == nullptr) {
    EXPECT_EQ(a.at("decode_plan_dense"), plan_or_null(here.decode_plan_dense)) << a.dump();
    EXPECT_EQ(a.at("decode_plan_blocks"), plan_or_null(here.decode_plan_blocks)) << a.dump();
  }
  ASSERT_EQ(generate("OMP_NUM_THREADS=2 POSENC_DECODE_STREAMS=8:prefetch=64", d.path() / "b.json"), 0);
  const auto b = nlohmann::json::parse(posenc::test::slurp(d.path() / "b.json")).at("kernels");
  // OMP_THREAD_LIMIT or OMP_MAX_ACTIVE_LEVELS=0, inherited, cap it.
  EXPECT_EQ(b.at("threads"), omp_get_max_active_levels() < 1 ? 1 : std::min(2, omp_get_thread_limit()));
  const bool dense = here.dense_kernel != "reference";
  const bool blocks = dense || here.q8_kernel == "avx512_vnni" || here.q8_kernel == "amx";
  EXPECT_EQ(b.at("decode_plan_dense"), dense ? nlohmann::json("8:prefetch=64") : nlohmann::json(nullptr)) << b.dump();
  EXPECT_EQ(b.at("decode_plan_blocks"), blocks ? nlohmann::json("8:prefetch=64") : nlohmann::json(nullptr))
      << b.dump();
  // stories260K is too small for the decode team; a dim-512 model decodes in one at two threads (AVX-512 or AVX2),
  // not at one.
  EXPECT_EQ(b.at("decode_team_steps"), 0) << b.dump();
  const auto big = d.path() / "dim512.gguf";
  ASSERT_EQ(run_cli("random-model --dim 512 --layers 2 --heads 8 --kv-heads 2 --ffn 512 --vocab 300 --type f16 "
                    "--out " + q(big)).exit_code, 0);
  for (int threads : {1, 2}) {
    const auto out = d.path() / ("big" + std::to_string(threads) + ".json");
    const std::string cmd = "OMP_NUM_THREADS=" + std::to_string(threads) + " '" + std::string(POSENC_CLI_PATH) +
                            "' generate --model " + q(big) + " --prompt 'tok5 tok9' --max-tokens 4 --ignore-eos "
                            "--quiet --json " + q(out) + " >/dev/null 2>&1";
    ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
    const auto k = nlohmann::json::parse(posenc::test::slurp(out)).at("kernels");
    if (threads == 1 || here.dense_kernel == "reference" || omp_get_thread_limit() < 2)
      EXPECT_EQ(k.at("decode_team_steps"), 0) << k.dump();
    else
      EXPECT_EQ(k.at("decode_team_steps"), 3) << k.dump();  // the tokens after the first, one step each
  }
  // OMP_THREAD_LIMIT=1, or OMP_MAX_ACTIVE_LEVELS=0, runs every region on one thread: the count reported is that
  // one (omp_get_max_threads() still says 2), and no decode team forms.
  for (const std::string limit : {"OMP_THREAD_LIMIT=1", "OMP_MAX_ACTIVE_LEVELS=0"}) {
    const auto out = d.path() / "limited.json";
    const std::string cmd = "OMP_NUM_THREADS=2 " + limit + " '" + std::string(POSENC_CLI_PATH) +
                            "' generate --model " + q(big) + " --prompt 'tok5 tok9' --max-tokens 4 --ignore-eos "
                            "--quiet --json " + q(out) + " >/dev/null 2>&1";
    ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
    const auto k = nlohmann::json::parse(posenc::test::slurp(out)).at("kernels");
    EXPECT_EQ(k.at("threads"), 1) << limit << " " << k.dump();
    EXPECT_EQ(k.at("decode_team_steps"), 0) << limit << " " << k.dump();
  }
  const auto out = d.path() / "p.json";
  const auto r = run_cli("ppl " + model_args() + " --text " + q(posenc::test::text_path()) +
                         " --context 64 --scored-tokens 256 --json " + q(out));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const auto p = nlohmann::json::parse(posenc::test::slurp(out)).at("kernels");
  EXPECT_EQ(p.at("dense_kernel"), here.dense_kernel);
  EXPECT_TRUE(p.at("threads").is_number_integer());
}

}  // namespace POSENC_UNITY_ID
