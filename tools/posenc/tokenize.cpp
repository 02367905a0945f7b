// posenc tokenize: the ids (and pieces) a tokenizer gives for a text.
#include <cstdio>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "commands.hpp"
#include "common.hpp"
#include "posenc/error.hpp"
#include "posenc/io.hpp"

namespace posenc::cli {

namespace {

struct TokenizeArgs {
  std::string model_path;
  std::string tokenizer_path;
  std::string text_path;
  std::string text_flag = "--text";  // the flag that gave text_path: --text or --prompt-file (named in errors)
  std::optional<std::string> prompt;
  bool no_special = false;
  bool pieces = false;
  std::string json_path;
};

/// A piece as a readable, unambiguous string: printable ASCII as is, other
/// bytes and control characters escaped.
std::string show(const std::string& s) {
  std::string o;
  for (unsigned char c : s) {
    if (c == '\\') o += "\\\\";
    else if (c == '\n') o += "\\n";
    else if (c == '\t') o += "\\t";
    else if (c == '\r') o += "\\r";
    else if (c < 0x20 || c == 0x7f) o += fmt::format("\\x{:02x}", c);
    else o += static_cast<char>(c);
  }
  return o;
}

void run_tokenize(const TokenizeArgs& a) {
  std::string source;
  Tokenizer tok = [&] {
    if (!a.tokenizer_path.empty()) {
      source = a.tokenizer_path;
      return load_tokenizer_file(a.tokenizer_path);
    }
    auto t = Model::load_bundled_tokenizer(a.model_path);
    if (!t) throw UsageError(fmt::format("--model {}: brings no tokenizer; pass --tokenizer", a.model_path));
    source = a.model_path + " (bundled)";
    return std::move(*t);
  }();
  require_usable_tokenizer(tok, a.tokenizer_path.empty());
  // The option groups admit exactly one of --text and --prompt (CLI11 leaves --prompt '' unset: the empty text).
  const std::string text = a.text_path.empty() ? a.prompt.value_or("") : read_text_input(a.text_path, a.text_flag);
  if (a.text_path.empty()) require_utf8_flag(text, "--prompt");
  const std::vector<int32_t> ids = tok.encode_hf(text, !a.no_special);
  if (!a.json_path.empty()) {
    nlohmann::json j;
    j["tokenizer"] = source;
    j["tokenizer_kind"] = tok.describe();
    j["vocab_size"] = tok.vocab_size();
    j["add_special_tokens"] = !a.no_special;
    j["text_bytes"] = text.size();
    j["count"] = ids.size();
    j["ids"] = ids;
    std::vector<std::string> pieces;
    for (int32_t id : ids) pieces.push_back(tok.piece(id));
    j["pieces"] = nlohmann::json(pieces).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) ;
    j["pieces"] = nlohmann::json::parse(j["pieces"].get<std::string>());
    j["decoded"] = nlohmann::json(tok.decode(ids)).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
    j["decoded"] = nlohmann::json::parse(j["decoded"].get<std::string>());
    write_output(a.json_path, j.dump(2, ' ', false, nlohmann::json::error_handler_t::replace) + "\n");
  }
  if (a.json_path == "-") {
    // stdout carries the JSON only
  } else if (a.pieces) {
    for (std::size_t i = 0; i < ids.size(); ++i)
      fmt::print("{:>8} {:>7}  {}\n", i, ids[i], show(tok.piece(ids[i])));
  } else {
    std::string line;
    for (std::size_t i = 0; i < ids.size(); ++i) line += (i ? " " : "") + std::to_string(ids[i]);
    fmt::print("{}\n", line);
  }
  fmt::print(stderr, "{} tokens ({}, {}; special tokens {})\n", ids.size(), source, tok.describe(),
             a.no_special ? "not added" : "added");
}

}  // namespace

void add_tokenize_command(CLI::App& app) {
  auto args = std::make_shared<TokenizeArgs>();
  CLI::App* cmd = app.add_subcommand(
      "tokenize", "Print the token ids (or pieces) a tokenizer gives for a text, as Hugging Face's "
                  "encode(text, add_special_tokens) does");
  // Which tokenizer (one or both: --tokenizer overrides the model's) and which text (exactly one): CLI11 option
  // groups, so that --help marks them and a missing one exits 2 at parse time.
  CLI::Option_group* from = cmd->add_option_group("tokenizer", "the tokenizer: --model, --tokenizer or both");
  from->add_option("--model", args->model_path, "use the tokenizer this model brings (HF directory, GGUF, posenc)")
      ->check(non_empty());
  from->add_option("--tokenizer", args->tokenizer_path,
                   "tokenizer.json, a GGUF (its embedded vocabulary) or llama2.c tokenizer .bin (overrides --model's)")
      ->check(non_empty());
  from->require_option(1, 2);
  CLI::Option_group* input =
      cmd->add_option_group("text", "the text: exactly one of --text (--prompt-file) and --prompt");
  // Two options of one value, so that an error names the flag given (--prompt-file's bad content was said to be
  // --text's); the group's require_option(1) refuses both together.
  input->add_option("--text", args->text_path,
                    "UTF-8 text file (read whole; a missing or non-regular file is an error naming it)")
      ->check(non_empty());
  input
      ->add_option_function<std::string>(
          "--prompt-file",
          [args](const std::string& path) {
            args->text_path = path;
            args->text_flag = "--prompt-file";
          },
          "the same as --text (generate's name)")
      ->check(non_empty());
  input->add_option("--prompt", args->prompt, "text given on the command line (UTF-8)")->check(utf8_value());
  input->require_option(1);
  cmd->add_flag("--no-special", args->no_special, "do not add BOS/EOS/template tokens (add_special_tokens=False)");
  cmd->add_flag("--pieces", args->pieces, "one line per token: index, id, piece (escaped)");
  add_json_option(cmd, args->json_path, "the ids, pieces and decoded text as JSON");
  cmd->callback([args] { run_tokenize(*args); });
}

}  // namespace posenc::cli
