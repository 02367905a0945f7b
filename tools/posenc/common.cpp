#include "common.hpp"

#include <unistd.h>

#include <cctype>
#include <charconv>
#include <filesystem>

#include <fmt/format.h>

#include "posenc/error.hpp"

namespace posenc::cli {

CLI::Validator output_path(bool directory) {
  return CLI::Validator(
      [directory](std::string& text) -> std::string {
        namespace fs = std::filesystem;
        if (text.empty()) return "empty path";
        std::error_code ec;
        const fs::path p(text);
        if (fs::exists(p, ec)) {
          if (directory && !fs::is_directory(p, ec)) return fmt::format("{} exists and is not a directory", text);
          if (!directory && fs::is_directory(p, ec)) return fmt::format("{} is a directory, not a file", text);
        }
        fs::path a = fs::absolute(p, ec).parent_path();
        while (!fs::exists(a, ec) && a.has_parent_path() && a != a.parent_path()) a = a.parent_path();
        if (!fs::is_directory(a, ec)) return fmt::format("{}: {} is not a directory", text, a.string());
        if (::access(a.c_str(), W_OK) != 0) return fmt::format("{}: directory {} is not writable", text, a.string());
        return "";
      },
      directory ? "DIR" : "FILE", directory ? "writable output directory" : "writable output file");
}

void ModelArgs::add_to(CLI::App& cmd) {
  cmd.add_option("--model", model_path, "llama2.c checkpoint (.bin) or posenc checkpoint")->required();
  cmd.add_option("--tokenizer", tokenizer_path,
                 "llama2.c tokenizer (.bin); optional for posenc checkpoints with an embedded vocabulary");
  cmd.add_option("--rope-layout", rope_layout,
                 "override the RoPE layout: half (rotate_half/GPT-NeoX) or interleaved "
                 "(GPT-J/llama2.c); default: the checkpoint's (interleaved for llama2.c)");
  cmd.add_option("--angle-precision", angle_precision,
                 "float32 (reproduces training/reference numerics; default) or exact (angle in double)")
      ->capture_default_str();
}

LoadedModel load_model(const ModelArgs& args) {
  Model model = Model::load(args.model_path);
  Tokenizer tok = [&] {
    if (!args.tokenizer_path.empty()) return Tokenizer::load_llama2c(args.tokenizer_path);
    if (!model.embedded_symbols().empty()) return Tokenizer::from_symbols(model.embedded_symbols());
    throw ConfigError(fmt::format("--tokenizer: required, {} has no embedded vocabulary", args.model_path));
  }();
  if (tok.vocab_size() != model.config().vocab_size)
    throw TokenizerError(fmt::format("{}: vocab_size {} does not match the model's vocab_size {} ({})",
                                     args.tokenizer_path, tok.vocab_size(), model.config().vocab_size,
                                     args.model_path));
  const AnglePrecision precision = parse_angle_precision(args.angle_precision, "--angle-precision");
  if (model.family() == PositionFamily::rope) {
    RopeSetup r = model.rope();
    if (!args.rope_layout.empty()) r.layout = parse_rope_layout(args.rope_layout, "--rope-layout");
    r.precision = precision;
    model.set_rope(r);
  } else if (!args.rope_layout.empty()) {
    throw ConfigError(fmt::format("--rope-layout: {} uses {} positions, not RoPE", args.model_path,
                                  to_string(model.family())));
  }
  return {std::move(model), std::move(tok)};
}

std::vector<std::string> split_list(const std::string& text, const std::string& flag) {
  std::vector<std::string> out;
  std::size_t pos = 0;
  while (pos <= text.size()) {
    std::size_t c = text.find(',', pos);
    std::string item = text.substr(pos, c == std::string::npos ? std::string::npos : c - pos);
    while (!item.empty() && std::isspace(static_cast<unsigned char>(item.back()))) item.pop_back();
    while (!item.empty() && std::isspace(static_cast<unsigned char>(item.front()))) item.erase(item.begin());
    if (!item.empty()) out.push_back(item);
    if (c == std::string::npos) break;
    pos = c + 1;
  }
  if (out.empty()) throw ConfigError(fmt::format("{}: expected a comma-separated list (got '{}')", flag, text));
  return out;
}

std::vector<int64_t> parse_lengths(const std::string& text, const std::string& flag) {
  std::vector<int64_t> out;
  for (const std::string& item : split_list(text, flag)) {
    int64_t mult = 1;
    std::string num = item;
    const char last = static_cast<char>(std::toupper(static_cast<unsigned char>(num.back())));
    if (last == 'K') mult = 1024;
    if (last == 'M') mult = 1024 * 1024;
    if (mult != 1) num.pop_back();
    int64_t v = 0;
    auto [p, ec] = std::from_chars(num.data(), num.data() + num.size(), v);
    if (ec != std::errc() || p != num.data() + num.size() || num.empty())
      throw ConfigError(fmt::format("{}: '{}' is not a length (integer, optional K or M suffix)", flag, item));
    if (v <= 0 || v > (int64_t{1} << 40) / mult)
      throw ConfigError(fmt::format("{}: length must be positive (got {})", flag, item));
    out.push_back(v * mult);
  }
  return out;
}

std::string describe(const Model& model) {
  const auto& c = model.config();
  std::string arch = fmt::format("dim {}, {} layers, {} heads / {} KV heads, head_dim {}, vocab {}, trained context {}",
                                 c.dim, c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim, c.vocab_size,
                                 c.max_position_embeddings);
  if (model.family() != PositionFamily::rope)
    return fmt::format("{}; positional family {}", arch, to_string(model.family()));
  const auto& r = model.rope();
  return fmt::format("{}; RoPE rope_theta {:g}, rotary_dim {}, layout {}, angle_precision {}", arch,
                     r.params.rope_theta, r.freqs.rotary_dim, to_string(r.layout), to_string(r.precision));
}

CLI::Option* add_curriculum_option(CLI::App* cmd, double& value, const std::string& scope) {
  return cmd
      ->add_option("--curriculum", value,
                   "fraction of the steps over which the longest drawn length grows from the shortest to the "
                   "longest (0 = off)" +
                       (scope.empty() ? std::string() : " " + scope))
      ->check(CLI::Number)
      ->capture_default_str();
}

TaskRecipe RecipeFlags::without_explicit(TaskRecipe r) const {
  if (steps != nullptr && steps->count() > 0) r.steps.reset();
  if (lr != nullptr && lr->count() > 0) r.lr.reset();
  if (batch_size != nullptr && batch_size->count() > 0) r.batch_size.reset();
  if (curriculum != nullptr && curriculum->count() > 0) r.curriculum.reset();
  return r;
}

}  // namespace posenc::cli
