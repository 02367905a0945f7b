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
  o.type = weight_type_of(a.type);
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
  add_weight_type_option(*cmd, args->type);
  cmd->add_option("--out", args->out, "output file (written atomically)")->required()->check(output_path());
  cmd->add_option("--name", args->name, "general.name (default: the model's file name)");
  cmd->callback([args] { run_convert(*args); });
}

}  // namespace posenc::cli
