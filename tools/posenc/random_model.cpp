// posenc random-model: a random-weight Llama GGUF of a given shape (benchmarks, memory tests).
#include <climits>

#include <fmt/format.h>

#include "commands.hpp"
#include "common.hpp"
#include "posenc/convert.hpp"
#include "posenc/error.hpp"

namespace posenc::cli {

namespace {

struct RandomModelArgs {
  RandomGgufOptions o;
  std::string type = "f16";
  std::string out;
  bool tied = false;
};

void run_random_model(RandomModelArgs a) {
  a.o.type = weight_type_of(a.type);
  a.o.config.shared_classifier = a.tied;
  const GgufExportReport r = write_random_gguf(a.o, a.out);
  for (const auto& n : r.notes) fmt::print(stderr, "  {}\n", n);
  fmt::print("wrote {} ({} tensors, {} bytes of tensor data, {})\n", a.out, r.tensors, r.bytes, a.type);
}

}  // namespace

void add_random_model_command(CLI::App& app) {
  auto args = std::make_shared<RandomModelArgs>();
  ModelConfig& c = args->o.config;
  c.dim = 1024;
  c.n_layers = 24;
  c.n_heads = 16;
  c.n_kv_heads = 4;
  c.hidden_dim = 4864;
  c.vocab_size = 32000;
  c.max_position_embeddings = 4096;
  c.norm_eps = 1e-5f;
  CLI::App* cmd = app.add_subcommand(
      "random-model",
      "Write a Llama GGUF with random weights (uniform, std 0.02; a fixed splitmix64 stream) of the given shape, "
      "for benchmarks and memory tests that llama.cpp's llama-bench runs on the same file. The defaults are the "
      "487M-parameter benchmark model (dim 1024, 24 layers, 16 heads / 4 KV heads, ffn 4864, vocab 32000, untied output)");
  cmd->add_option("--dim", c.dim, "hidden size")->check(int_in(1, INT32_MAX))->capture_default_str();
  cmd->add_option("--layers", c.n_layers, "number of layers")->check(int_in(1, INT32_MAX))->capture_default_str();
  cmd->add_option("--heads", c.n_heads, "query heads")->check(int_in(1, INT32_MAX))->capture_default_str();
  cmd->add_option("--kv-heads", c.n_kv_heads, "key/value heads (num_key_value_heads)")
      ->check(int_in(1, INT32_MAX))
      ->capture_default_str();
  cmd->add_option("--head-dim", c.head_dim, "channels per head (0: dim / heads)")
      ->check(int_in(0, INT32_MAX))
      ->capture_default_str();
  cmd->add_option("--ffn", c.hidden_dim, "SwiGLU inner size (intermediate_size)")
      ->check(int_in(1, INT32_MAX))
      ->capture_default_str();
  cmd->add_option("--vocab", c.vocab_size, "vocabulary size (>= 259: <unk> <s> </s> and the 256 byte pieces)")
      ->check(int_in(259, INT32_MAX))
      ->capture_default_str();
  cmd->add_option("--context", c.max_position_embeddings, "llama.context_length (0: 2048)")
      ->transform(length_in(0, INT32_MAX))
      ->capture_default_str();
  cmd->add_option("--rope-theta", args->o.rope_theta, "rope_theta (llama.rope.freq_base)")->capture_default_str();
  cmd->add_flag("--tied", args->tied, "the output projection tied to the token embedding (default: an output.weight of "
                                      "its own, as the 487M count has it)");
  cmd->add_option("--seed", args->o.seed, "random stream seed")->check(seed_value())->capture_default_str();
  add_weight_type_option(*cmd, args->type);
  cmd->add_option("--name", args->o.name, "general.name")->capture_default_str();
  cmd->add_option("--out", args->out, "output file (written atomically)")->required()->check(output_path());
  cmd->callback([args] { run_random_model(*args); });
}

}  // namespace posenc::cli
