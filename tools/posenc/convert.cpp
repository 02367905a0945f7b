// posenc convert: write a model posenc runs as a GGUF file llama.cpp loads.
#include <fmt/format.h>

#include "commands.hpp"
#include "common.hpp"
#include "posenc/convert.hpp"
#include "posenc/error.hpp"

namespace posenc::cli {

namespace {

struct ConvertArgs {
  ModelArgs model;
  std::string to = "gguf";
  std::string type = "f32";
  std::string out;
  std::string name;
};

void run_convert(const ConvertArgs& a) {
  if (a.to != "gguf") throw ConfigError(fmt::format("--to: only gguf is written (got '{}')", a.to));
  GgufExportOptions o;
  if (a.type == "f32") o.type = GgmlType::f32;
  else if (a.type == "f16") o.type = GgmlType::f16;
  else if (a.type == "bf16") o.type = GgmlType::bf16;
  else if (a.type == "q8_0") o.type = GgmlType::q8_0;
  else if (a.type == "q4_0") o.type = GgmlType::q4_0;
  else throw ConfigError(fmt::format("--type: must be f32, f16, bf16, q8_0 or q4_0 (got '{}')", a.type));
  o.name = a.name;
  LoadedModel lm = load_model(a.model);
  print_model_header(stderr, lm, a.model);
  const GgufExportReport r = write_model_gguf(lm.model, lm.tokenizer, a.out, o);
  for (const auto& n : r.notes) fmt::print(stderr, "  {}\n", n);
  fmt::print("wrote {} ({} tensors, {} bytes of tensor data, {})\n", a.out, r.tensors, r.bytes, a.type);
}

}  // namespace

void add_convert_command(CLI::App& app) {
  auto args = std::make_shared<ConvertArgs>();
  CLI::App* cmd = app.add_subcommand(
      "convert", "Write a model as GGUF (architecture llama) that llama.cpp loads: F32, F16, BF16, Q8_0 or Q4_0 weights, q/k rows "
                 "in llama.cpp's interleaved order, the tokenizer as tokenizer.ggml.*");
  args->model.add_to(*cmd, /*runs_model=*/false);  // no --quantized-matmul, --max-position: nothing runs
  cmd->add_option("--to", args->to, "output format (gguf)")
      ->capture_default_str()
      ->transform(CLI::IsMember({"gguf"}, CLI::ignore_case));
  cmd->add_option("--type", args->type, "weight type of the matrices: f32, f16, bf16, q8_0, q4_0 (any case)")
      ->capture_default_str()
      ->transform(CLI::IsMember({"f32", "f16", "bf16", "q8_0", "q4_0"}, CLI::ignore_case));  // a bad value: exit 2
  cmd->add_option("--out", args->out, "output file (written atomically)")->required()->check(output_path());
  cmd->add_option("--name", args->name, "general.name (default: the model's file name)");
  cmd->callback([args] { run_convert(*args); });
}

}  // namespace posenc::cli
