#include <cerrno>
#include <cstdio>
#include <cstring>
#include <exception>
#include <filesystem>
#include <functional>
#include <iostream>
#include <new>
#include <set>
#include <string>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "commands.hpp"
#include "common.hpp"
#include "posenc/error.hpp"

namespace {
/// Whether everything written to standard output reached it; says so on stderr when not. Results that never
/// reached it (a full disk, a closed pipe) are a failure, not a success. The reason is known when the last flush
/// fails; a write that failed earlier left only the stream's error flag.
bool stdout_written() {
  std::cout.flush();
  errno = 0;
  const bool flushed = std::fflush(stdout) == 0;
  const int err = flushed ? 0 : errno;
  if (std::cout && flushed && std::ferror(stdout) == 0) return true;
  fmt::print(stderr, "posenc: error: writing standard output failed{}\n",
             err != 0 ? fmt::format(": {}", std::strerror(err)) : std::string(" (an earlier write failed)"));
  return false;
}

/// A command-line argument for a message: bytes outside printable ASCII as \xNN, in single quotes when empty, when
/// it holds a space or quote, or when `quote`.
std::string shown_argument(const std::string& a, bool quote = false) {
  std::string out;
  for (unsigned char c : a) {
    if (c < 0x20 || c > 0x7e || c == '\\')
      out += fmt::format("\\x{:02x}", c);
    else
      out += static_cast<char>(c);
  }
  if (quote || a.empty() || a.find_first_of(" '\"") != std::string::npos) out = "'" + out + "'";
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"posenc: positional encodings of Transformer attention, measured"};
  app.require_subcommand(1);
  app.set_help_all_flag("--help-all", "Show help for every subcommand");
  app.set_version_flag("--version", posenc::cli::version_text(), "Print the version and the git commit, and exit");
  app.footer(std::string(posenc::cli::kCliConvention) + "\n" + posenc::cli::kExitCodeRule + "\n" +
             posenc::cli::kEnvironment);
  posenc::cli::add_ppl_command(app);
  posenc::cli::add_generate_command(app);
  posenc::cli::add_detect_layout_command(app);
  posenc::cli::add_check_cache_command(app);
  posenc::cli::add_inspect_command(app);
  posenc::cli::add_periods_command(app);
  posenc::cli::add_decay_command(app);
  posenc::cli::add_eval_command(app);
  posenc::cli::add_train_command(app);
  posenc::cli::add_study_command(app);
  posenc::cli::add_tokenize_command(app);
  posenc::cli::add_convert_command(app);
  posenc::cli::add_random_model_command(app);
  posenc::cli::add_serve_command(app);
  posenc::cli::add_verify_command(app);
  posenc::cli::add_precision_command(app);
  // OMP_NUM_THREADS is checked once the command line is parsed and before any command runs (its first parallel
  // region: libgomp crashed on absurd counts); --help and --version answer under any value.
  app.parse_complete_callback([] { posenc::cli::check_thread_environment(); });
  // CLI11 2.1 loops forever on an empty argument that no option takes as its value in a command with option
  // groups (`posenc inspect --model M "" --quiet`, or after an option inspect does not have; found by an
  // adversary): such an argument is refused before parsing. An empty value of an option of the command in use that
  // takes one (`--context ''`) is left to that option's own check.
  const auto value_options = [](CLI::App* command) {
    std::set<std::string> names;
    std::function<void(CLI::App*)> collect = [&](CLI::App* a) {
      for (const CLI::Option* o : a->get_options())
        if (o->get_expected_max() >= 1) {
          for (const std::string& n : o->get_lnames()) names.insert("--" + n);
          for (const std::string& n : o->get_snames()) names.insert("-" + n);
        }
      for (CLI::App* group : a->get_subcommands([](CLI::App* g) { return g->get_name().empty(); })) collect(group);
    };
    collect(command);
    return names;
  };
  std::set<std::string> takes_value = value_options(&app);  // until the command's name
  bool in_command = false;
  for (int i = 1; i < argc; ++i) {
    if (argv[i][0] == '\0' && (i == 1 || takes_value.count(argv[i - 1]) == 0)) {
      fmt::print(stderr, "posenc: argument {} is empty where no option takes a value (after {})\nRun with --help or "
                 "--help-all for more information.\n", i, i == 1 ? "the program name" : shown_argument(argv[i - 1], true));
      return 2;
    }
    if (!in_command && takes_value.count(argv[i - 1]) == 0)
      for (CLI::App* command : app.get_subcommands({}))
        if (!command->get_name().empty() && command->check_name(argv[i])) {
          takes_value = value_options(command);
          in_command = true;
          break;
        }
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::ExtrasError&) {
    // CLI11 (2.1) names the unexpected arguments in reverse order ("tok.bin --tokenizer"): named here as given,
    // with the command that refused them.
    std::string command = "posenc";
    for (const CLI::App* sub = &app; !sub->get_subcommands().empty();) {
      sub = sub->get_subcommands().front();
      command += " " + sub->get_name();
    }
    std::vector<std::string> extras;
    for (const std::string& a : app.remaining(true)) extras.push_back(shown_argument(a));
    fmt::print(stderr, "{} does not take {} {}\nRun with --help or --help-all for more information.\n", command,
               extras.size() == 1 ? "the argument" : "the arguments", fmt::join(extras, " "));
    return 2;
  } catch (const CLI::RequiredError& e) {
    // A word that is no command ("posenc genrate ..."): CLI11 says only that a subcommand is required.
    const std::vector<std::string> extras = app.remaining();
    if (!app.get_subcommands().empty() || extras.empty()) return app.exit(e) != 0 ? 2 : 0;
    std::vector<std::string> names;
    for (const CLI::App* sub : app.get_subcommands({})) names.push_back(sub->get_name());
    fmt::print(stderr, "posenc: {} is not a command (the commands: {})\nRun with --help or --help-all for more "
               "information.\n", shown_argument(extras.front(), true), fmt::join(names, ", "));
    return 2;
  } catch (const CLI::ParseError& e) {
    // --help and --version exit 0; a command line CLI11 rejects (unknown option, missing
    // required option, a failed check such as an unwritable output path) is a
    // usage error: exit 2. Bad input found while running exits 1.
    if (app.exit(e) != 0) return 2;
    return stdout_written() ? 0 : 1;  // --help or --version on a full disk is not a success either
  } catch (const posenc::cli::UsageError& e) {
    // A flag value refused after parsing (a list item, a length out of range): exit 2 as CLI11's own checks.
    std::fflush(stdout);
    fmt::print(stderr, "posenc: error: {}\n", e.what());
    return 2;
  } catch (const posenc::Error& e) {
    std::fflush(stdout);
    fmt::print(stderr, "posenc: error: {}\n", e.what());
    return 1;
  } catch (const std::filesystem::filesystem_error& e) {
    // libstdc++'s "filesystem error: <operation>: <reason> [<path>]": the path first, as every other message.
    std::fflush(stdout);
    std::string what = e.what();
    if (const std::string_view pre = "filesystem error: "; what.starts_with(pre)) what.erase(0, pre.size());
    const std::string path = e.path1().string(), tail = " [" + path + "]";
    if (!path.empty() && what.ends_with(tail)) what = path + ": " + what.substr(0, what.size() - tail.size());
    fmt::print(stderr, "posenc: error: {}\n", what);
    return 1;
  } catch (const std::bad_alloc&) {
    std::fflush(stdout);
    fmt::print(stderr, "posenc: error: out of memory\n");
    return 1;
  } catch (const std::exception& e) {
    std::fflush(stdout);
    fmt::print(stderr, "posenc: error: {}\n", e.what());
    return 1;
  }
  return stdout_written() ? 0 : 1;
}
