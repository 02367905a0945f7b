#include "common.hpp"

#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <limits>
#include <mutex>
#include <thread>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "posenc_version.hpp"

#include "posenc/error.hpp"
#include "posenc/io.hpp"
#include "posenc/overrides.hpp"
#include "posenc/perplexity.hpp"
#include "posenc/threads.hpp"
#include "posenc/version.hpp"

namespace posenc::cli {

CLI::Validator output_path(bool directory, bool stdout_ok) {
  return CLI::Validator(
      [directory, stdout_ok](std::string& text) -> std::string {
        namespace fs = std::filesystem;
        if (text.empty()) return "empty path";
        // Only --json / --csv stream to stdout (add_output_option handles "-" before this check); elsewhere "-"
        // would become a file literally named "-".
        if (text == "-" && !stdout_ok)
          return directory ? "'-' (stdout) is not supported for an output directory; give a directory path"
                           : "'-' (stdout) is not supported for images/checkpoints; give a file path";
        std::error_code ec;
        const fs::path p(text);
        if (fs::exists(p, ec)) {
          if (directory && !fs::is_directory(p, ec)) return fmt::format("{} exists and is not a directory", text);
          if (!directory && fs::is_directory(p, ec)) return fmt::format("{} is a directory, not a file", text);
          // The file is replaced by renaming a temporary over it: a device (/dev/null), FIFO or socket would be
          // replaced by a regular file. A symlink to a regular file is followed (fs::status).
          if (!directory && !fs::is_regular_file(p, ec))
            return fmt::format("{} exists and is not a regular file (a device, FIFO or socket); give a file path{}",
                               text, stdout_ok ? ", or '-' for stdout" : "");
        }
        const fs::path abs = fs::absolute(p, ec);
        if (!directory) {
          // A file is written into its parent directory, which must exist: a
          // typo in the directory must not create a tree of directories.
          const fs::path parent = abs.parent_path();
          if (!fs::exists(parent, ec))
            return fmt::format("{}: directory {} does not exist (create it first)", text, parent.string());
          if (!fs::is_directory(parent, ec)) return fmt::format("{}: {} is not a directory", text, parent.string());
          if (::access(parent.c_str(), W_OK) != 0)
            return fmt::format("{}: directory {} is not writable", text, parent.string());
          return "";
        }
        // An existing output directory is written into: it must itself be
        // writable (a read-only mount point with a writable parent is not).
        // Otherwise the nearest existing ancestor must be, where the missing
        // directories will be created.
        fs::path a = fs::is_directory(p, ec) ? abs : abs.parent_path();
        while (!fs::exists(a, ec) && a.has_parent_path() && a != a.parent_path()) a = a.parent_path();
        if (!fs::is_directory(a, ec)) return fmt::format("{}: {} is not a directory", text, a.string());
        if (::access(a.c_str(), W_OK) != 0) return fmt::format("{}: directory {} is not writable", text, a.string());
        return "";
      },
      directory ? "DIR" : "FILE",
      directory ? "writable output directory (created with its missing parents)"
                : "writable output file in an existing directory");
}

CLI::Validator int_in(int64_t lo, int64_t hi) {
  return CLI::Validator(
      [lo, hi](std::string& text) -> std::string {
        int64_t v = 0;
        const auto [p, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
        if (ec != std::errc() || p != text.data() + text.size() || v < lo || v > hi)
          return fmt::format("must be an integer in [{}, {}] (got '{}')", lo, hi, text);
        return "";
      },
      "");
}

namespace {
/// A length's parts: "4K" is 4 and 1024, "1m" 1 and 1048576, "300" 300 and 1; false unless the text is a decimal
/// integer (a leading '-' allowed) with an optional K or M suffix. The one reading of lengths, lists and single.
bool length_parts(std::string_view text, int64_t& v, int64_t& mult) {
  const char last = text.empty() ? '\0' : static_cast<char>(std::toupper(static_cast<unsigned char>(text.back())));
  mult = last == 'K' ? 1024 : last == 'M' ? 1024 * 1024 : 1;
  if (mult != 1) text.remove_suffix(1);
  const auto [p, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  return !text.empty() && ec == std::errc() && p == text.data() + text.size();
}
}  // namespace

CLI::Validator length_in(int64_t lo, int64_t hi) {
  return CLI::Validator(
      [lo, hi](std::string& text) -> std::string {
        int64_t v = 0, mult = 1;
        const bool fits = length_parts(text, v, mult) && v >= std::numeric_limits<int64_t>::min() / mult &&
                          v <= std::numeric_limits<int64_t>::max() / mult;
        if (!fits || v * mult < lo || v * mult > hi)
          return fmt::format("must be an integer in [{}, {}] (got '{}')", lo, hi, text);
        text = std::to_string(v * mult);
        return "";
      },
      "");
}

CLI::Validator seed_value() {
  return CLI::Validator(
      [](std::string& text) -> std::string {
        uint64_t v = 0;
        const auto [p, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
        if (text.empty() || text[0] == '-' || text[0] == '+' || ec != std::errc() || p != text.data() + text.size())
          return fmt::format("must be an integer in [0, 18446744073709551615] (got '{}')", text);
        return "";
      },
      "");
}

namespace {
std::string finite_check(const std::string& text, double lo, double hi, bool open_lo) {
  const char* b = text.c_str();
  char* e = nullptr;
  errno = 0;
  const double v = std::strtod(b, &e);
  const bool parsed = !text.empty() && e == b + text.size() && !std::isspace(static_cast<unsigned char>(text[0]));
  if (!parsed || !std::isfinite(v) || (open_lo ? !(v > lo) : !(v >= lo)) || !(v <= hi))
    return fmt::format("must be a finite number in {}{:g}, {:g}] (got '{}')", open_lo ? "(" : "[", lo, hi, text);
  return "";
}
}  // namespace

CLI::Validator finite_in(double lo, double hi) {
  return CLI::Validator([lo, hi](std::string& t) { return finite_check(t, lo, hi, false); }, "");
}
CLI::Validator finite_above(double lo, double hi) {
  return CLI::Validator([lo, hi](std::string& t) { return finite_check(t, lo, hi, true); }, "");
}

void PromptArgs::add_to(CLI::App& cmd, bool required) {
  prompt_option = cmd.add_option("--prompt", prompt, "prompt text (or --prompt-file), UTF-8")->check(utf8_value());
  file_option = cmd.add_option("--prompt-file", prompt_file,
                               "read the prompt from FILE (whole file, as is; for prompts past the 128 KiB "
                               "command-line limit)");
  prompt_option->excludes(file_option);
  if (required) {
    auto* group = cmd.add_option_group("prompt");
    group->add_option(prompt_option);
    group->add_option(file_option);
    group->require_option(1);
  }
}

bool PromptArgs::given() const {
  return (prompt_option != nullptr && prompt_option->count() > 0) || (file_option != nullptr && file_option->count() > 0);
}

std::string PromptArgs::text() const {
  if (file_option != nullptr && file_option->count() > 0) return read_text_input(prompt_file, "--prompt-file");
  require_utf8_flag(prompt, "--prompt");
  return prompt;
}

std::string read_text_input(const std::string& path, const std::string& flag) {
  std::string text = read_file(path);
  require_utf8(text, fmt::format("{} {}", flag, path));
  return text;
}

CLI::Validator utf8_value() {
  return CLI::Validator(
      [](std::string& text) -> std::string {
        try {
          require_utf8(text, "");
        } catch (const InvalidArgument& e) {
          std::string_view m = e.what();
          if (m.starts_with(": ")) m.remove_prefix(2);  // CLI11 prefixes the option's name
          return std::string(m);
        }
        return "";
      },
      "");
}

void require_utf8_flag(const std::string& text, const std::string& flag) {
  as_usage_error([&] {
    try {
      require_utf8(text, flag);
    } catch (const InvalidArgument& e) {
      throw ConfigError(e.what());  // a flag's value: as_usage_error makes it exit 2
    }
  });
}

CLI::Validator non_empty() {
  return CLI::Validator([](std::string& text) -> std::string { return text.empty() ? "empty value" : ""; }, "");
}

void ModelArgs::add_to(CLI::App& cmd, bool runs_model) {
  cmd.add_option("--model", model_path,
                 "the model: a Hugging Face directory (config.json + safetensors + tokenizer.json), a .gguf file, a "
                 "llama2.c .bin or a posenc checkpoint")
      ->required();
  cmd.add_option("--tokenizer", tokenizer_path,
                 "tokenizer.json (or a directory holding one), a GGUF (its embedded vocabulary) or a llama2.c "
                 "tokenizer .bin; default: the one the model brings (tokenizer.json of a HF directory, a GGUF's "
                 "embedded vocabulary, a posenc checkpoint's symbols); required for llama2.c checkpoints")
      ->check(non_empty());
  cmd.add_option("--config", config_path,
                 "positional parameters from a config.json or a bare rope_scaling object "
                 "({\"rope_type\": \"llama3\", \"factor\": 8, ...}); the layout stays the loader's")
      ->check(non_empty());  // read with read_file: a missing or non-regular file is an IoError naming it (exit 1)
  cmd.add_option("--rope-theta", rope_theta, "override rope_theta (applied after --config)")
      ->check(finite_in(kMinRopeThetaFlag, kMaxRopeThetaFlag));
  cmd.add_option("--rope-layout", rope_layout,
                 "override the RoPE layout: half (rotate_half/GPT-NeoX) or interleaved "
                 "(GPT-J/llama2.c); default: the loader's (half for Hugging Face, interleaved for GGUF llama and "
                 "llama2.c)")
      ->check(non_empty())
      ->check(CLI::IsMember({"half", "interleaved"}));
  cmd.add_option("--angle-precision", angle_precision,
                 "float32 (reproduces training/reference numerics; default), exact (angle in double), fp64 "
                 "(inv_freq too: the reference), bf16 or fp16 (every stage in that dtype, as a rotary module cast "
                 "to it; positions collide from 257 / 2049)")
      ->check(non_empty())
      ->check(CLI::IsMember({"float32", "exact", "fp64", "bf16", "fp16"}))
      ->capture_default_str();
  cmd.add_option("--trained-context", trained_context,
                 "the context the model was trained with (scaling factors and default lengths derive from it); "
                 "default: from the file (config.json, GGUF context_length, llama2.c seq_len)")
      ->transform(length_in(1, int64_t{1} << 32));  // GGUF's uint32; CLI11 would clamp 10^20 to INT64_MAX
  if (!runs_model) return;
  cmd.add_option("--quantized-matmul", quantized_matmul,
                 "products with Q8_0/Q4_0 weights: dequantize (each weight widened to float32 in registers, "
                 "float32 products; default) or q8_activations (activations quantized to Q8_0, exact int8 block "
                 "products: llama.cpp's CPU arithmetic, and faster in prefill)")
      ->check(non_empty())
      ->transform(CLI::IsMember({"dequantize", "q8_activations"}, CLI::ignore_case))
      ->capture_default_str();
  cmd.add_option("--dense-matmul", dense_matmul,
                 "products with F16/BF16 weights: float32 (each weight widened in registers, float32 FMAs: the "
                 "reference; default), bf16x6 (on AMX-BF16 tiles: activations split into three bf16 terms and "
                 "weights into two, every product exact, sums rounded by the AMX unit; prefill up to 1.5x faster "
                 "on a 0.5B model, less on small ones) or bf16x3 (three of the six terms, under 2^-13 of each "
                 "product, dropped; faster still). Decode is under half of float32's in both: for prefill-bound "
                 "work (ppl, eval)")
      ->check(non_empty())
      ->transform(CLI::IsMember({"float32", "bf16x3", "bf16x6"}, CLI::ignore_case))
      ->capture_default_str();
  cmd.add_option("--max-position", max_position,
                 "largest position id the model may be fed: a longer context, prompt or request is an error naming "
                 "the position (exit 1; serve answers 400). Without it, passing the trained context x the "
                 "rope_scaling factor warns once")
      ->transform(length_in(0, int64_t{1} << 40));
}

void ModelArgs::add_kv_dtype_to(CLI::App& cmd) {
  cmd.add_option("--kv-dtype", kv_dtype,
                 "element type of the KV cache: f32 (default), f16 (IEEE binary16) or bf16; keys and values are "
                 "rounded to nearest even when stored (half the memory of f32) and widened exactly when read")
      ->check(CLI::IsMember({"f32", "f16", "bf16"}))
      ->capture_default_str();
}

namespace {
std::mutex g_position_warning_mutex;
std::optional<PositionWarning> g_position_warning;  // the first one of this process

void install_position_bounds(Model& model, const ModelArgs& args) {
  if (args.max_position) model.set_max_position(*args.max_position);
  model.set_position_warning([](const PositionWarning& w) {
    const std::lock_guard<std::mutex> lock(g_position_warning_mutex);
    if (g_position_warning) return;  // once per process, whichever copy of the model crossed first
    g_position_warning = w;
    std::fflush(stdout);
    // On one terminal the warning starts its own line after streamed text (generate).
    const bool same_tty = ::isatty(STDOUT_FILENO) != 0 && ::isatty(STDERR_FILENO) != 0;
    fmt::print(stderr, "{}posenc: warning: {}\n", same_tty ? "\n" : "", w.message);
  });
}
}  // namespace

nlohmann::json kernels_json() {
  const KernelInfo k = kernel_info();
  const auto plan = [](const std::string& p) { return p.empty() ? nlohmann::json(nullptr) : nlohmann::json(p); };
  return {{"dense_kernel", k.dense_kernel},
          {"q8_kernel", k.q8_kernel},
          {"decode_plan_dense", plan(k.decode_plan_dense)},
          {"decode_plan_blocks", plan(k.decode_plan_blocks)},
          {"threads", k.threads},
          // One-token steps this process ran as one team of threads (Model::forward's decode team: models whose
          // matrices are large enough for threads, on AVX-512, at two threads or more).
          {"decode_team_steps", detail::decode_team_steps()}};
}

nlohmann::json position_warning_json() {
  const std::lock_guard<std::mutex> lock(g_position_warning_mutex);
  if (!g_position_warning) return nullptr;
  const PositionWarning& w = *g_position_warning;
  return {{"position", w.position},
          {"bound", w.bound},
          {"trained_context", w.trained_context},
          {"factor", w.factor},
          {"message", w.message}};
}

Tokenizer load_tokenizer_file(const std::string& path) { return load_tokenizer_from_path(path, "--tokenizer"); }

namespace {
/// --config, --rope-theta, --rope-layout, --angle-precision, --trained-context applied to `model`.
std::vector<std::string> apply_model_overrides(Model& model, const ModelArgs& args) {
  PositionalOverrides o;
  if (!args.config_path.empty()) o.config = args.config_path;
  o.rope_theta = args.rope_theta;
  if (!args.rope_layout.empty()) o.layout = parse_rope_layout(args.rope_layout, "--rope-layout");
  o.precision = parse_angle_precision(args.angle_precision, "--angle-precision");
  o.trained_context = args.trained_context;
  if (model.family() != PositionFamily::rope) o.precision.reset();
  model.set_kv_cache_dtype(parse_kv_cache_dtype(args.kv_dtype, "--kv-dtype"));
  return apply_positional_overrides(model, o);
}
}  // namespace

void require_usable_tokenizer(const Tokenizer& tok, bool bundled) {
  if (tok.usable()) return;
  // The reason names the file and the tokenizer to use instead; how to pass it is the CLI's.
  throw TokenizerError(fmt::format("{}{} (--tokenizer <Hugging Face model dir>/tokenizer.json)",
                                   bundled ? "the tokenizer this model brings cannot be used: " : "",
                                   tok.unusable_reason()));
}

LoadedModel load_model(const ModelArgs& args) {
  LoadOptions lo;
  lo.quantized_matmul = parse_quantized_matmul(args.quantized_matmul, "--quantized-matmul");
  lo.dense_matmul = parse_dense_matmul(args.dense_matmul, "--dense-matmul");
  Model model = Model::load(args.model_path, lo);
  // The matrix-product paths and decode plans are chosen now, so that a bad POSENC_* value is reported before any
  // output (it was reported when the first decode asked: in the middle of generate's streamed text).
  (void)kernel_info();
  const ModelConfig& c = model.config();
  std::string tok_source;
  if (args.tokenizer_optional && args.tokenizer_path.empty() && !model.bundled_tokenizer()) {
    auto notes = apply_model_overrides(model, args);
    install_position_bounds(model, args);
    return {std::move(model), Tokenizer{}, std::string(), std::move(notes)};
  }
  Tokenizer tok = [&] {
    if (!args.tokenizer_path.empty()) {
      tok_source = args.tokenizer_path;
      return load_tokenizer_file(args.tokenizer_path);
    }
    if (model.bundled_tokenizer()) {
      tok_source = "bundled: " + model.source().tokenizer;
      return *model.bundled_tokenizer();
    }
    if (const std::string& e = model.source().tokenizer_error; !e.empty())
      throw TokenizerError(fmt::format("{}{}", e,
                                       e.find("--tokenizer") != std::string::npos
                                           ? ""
                                           : "; pass --tokenizer with a tokenizer.json or llama2.c tokenizer .bin"));
    // A flag this model needs is missing: the command line's fault (exit 2), as for --endpoint without --tokenizer.
    throw UsageError(fmt::format("--tokenizer: required, {} brings no tokenizer", args.model_path));
  }();
  require_usable_tokenizer(tok, args.tokenizer_path.empty());
  require_tokenizer_fits(tok, c.vocab_size, tok_source, args.model_path);
  auto notes = apply_model_overrides(model, args);
  install_position_bounds(model, args);
  return {std::move(model), std::move(tok), std::move(tok_source), std::move(notes)};
}

void print_model_header(std::FILE* out, const LoadedModel& m, const ModelArgs& args) {
  const Model& model = m.model;
  const ModelSource& s = model.source();
  const std::string format(to_string(s.format));
  if (s.architecture.empty() || s.architecture == format || s.architecture.starts_with(format))
    fmt::print(out, "model: {} ({})\n", args.model_path, s.architecture.empty() ? format : s.architecture);
  else
    fmt::print(out, "model: {} ({}, {})\n", args.model_path, format, s.architecture);
  fmt::print(out, "  {}\n", describe(model));
  const bool quantized = model.has_block_quantized_matrices();
  fmt::print(out, "  weights: {}{}\n", s.weights,
             !quantized ? (model.quantized_matmul() == QuantizedMatmul::q8_activations
                               ? " (no Q8_0/Q4_0 matrices: --quantized-matmul q8_activations changes nothing)"
                               : "")
             : model.quantized_matmul() == QuantizedMatmul::q8_activations
                 ? " (kept in blocks; products with Q8_0-quantized activations, llama.cpp's arithmetic)"
                 : " (read as stored, dequantized to float32 in registers; --quantized-matmul q8_activations for llama.cpp's "
                   "arithmetic)");
  if (model.dense_matmul() != DenseMatmul::float32) {
    const bool dense16 = model.has_half_precision_matrices();
    fmt::print(out, "  dense products: {}{}\n", to_string(model.dense_matmul()),
               dense16 ? " on AMX-BF16 tiles for the F16/BF16 weights (not float32's bits; faster prefill, "
                         "decode under half of float32's)"
                       : " (no F16/BF16 matrices: --dense-matmul changes nothing)");
  }
  if (model.family() == PositionFamily::rope && !s.layout_reason.empty())
    fmt::print(out, "  layout: {}{}\n", args.rope_layout.empty() ? s.layout_reason : to_string(model.rope().layout),
               args.rope_layout.empty() ? "" : " (--rope-layout)");
  fmt::print(out, "  trained context: {} ({}{})\n", model.trained_context(), model.trained_context_source(),
             s.format == ModelFormat::gguf && model.trained_context_source().starts_with("GGUF")
                 ? "; GGUF files may overstate it, --trained-context sets it"
                 : "");
  if (model.family() == PositionFamily::rope) {
    const RopeParams& p = model.rope().params;
    if (p.rope_type != "default") {
      std::string params = fmt::format("rope_type {}", p.rope_type);
      if (p.factor) params += fmt::format(", factor {:g}", *p.factor);
      if (p.original_max_position_embeddings)
        params += fmt::format(", original_max_position_embeddings {}", *p.original_max_position_embeddings);
      if (p.low_freq_factor) params += fmt::format(", low_freq_factor {:g}", *p.low_freq_factor);
      if (p.high_freq_factor) params += fmt::format(", high_freq_factor {:g}", *p.high_freq_factor);
      if (p.beta_fast) params += fmt::format(", beta_fast {:g}", *p.beta_fast);
      if (p.beta_slow) params += fmt::format(", beta_slow {:g}", *p.beta_slow);
      if (p.attention_factor) params += fmt::format(", attention_factor {:g}", *p.attention_factor);
      if (!p.long_factor.empty()) params += fmt::format(", long_factor [{}]", p.long_factor.size());
      fmt::print(out, "  rope scaling: {}; attention_factor {:g}\n", params, model.rope().freqs.attention_factor);
    }
  }
  if (m.tokenizer_source.empty())
    fmt::print(out, "  tokenizer: none (not needed: token ids are fed directly)\n");
  else
    fmt::print(out, "  tokenizer: {} ({}, {} tokens)\n", m.tokenizer_source, m.tokenizer.describe(),
               m.tokenizer.vocab_size());
  for (const auto& n : s.notes)
    if (!n.starts_with("layout ")) fmt::print(out, "  note: {}\n", n);  // the layout line says it already
  for (const auto& n : m.overrides) fmt::print(out, "  override: {}\n", n);
}

int max_threads() { return max_omp_threads(); }

void check_thread_environment() {
  try {
    check_omp_threads_in_use();
  } catch (const InvalidArgument& e) {
    throw UsageError(e.what());
  }
}

std::vector<std::string> split_list(const std::string& text, const std::string& flag) {
  std::vector<std::string> out;
  std::size_t pos = 0;
  while (pos <= text.size()) {
    std::size_t c = text.find(',', pos);
    std::string item = text.substr(pos, c == std::string::npos ? std::string::npos : c - pos);
    while (!item.empty() && std::isspace(static_cast<unsigned char>(item.back()))) item.pop_back();
    while (!item.empty() && std::isspace(static_cast<unsigned char>(item.front()))) item.erase(item.begin());
    out.push_back(item);
    if (c == std::string::npos) break;
    pos = c + 1;
  }
  if (out.size() == 1 && out[0].empty())
    throw UsageError(fmt::format("{}: expected a comma-separated list (got '{}')", flag, text));
  for (std::size_t i = 0; i < out.size(); ++i)
    if (out[i].empty())
      throw UsageError(fmt::format("{}: item {} of '{}' is empty (a doubled, leading or trailing comma)", flag, i + 1,
                                   text));
  return out;
}

std::vector<int64_t> parse_lengths(const std::string& text, const std::string& flag, int64_t lo, int64_t hi) {
  std::vector<int64_t> out;
  for (const std::string& item : split_list(text, flag)) {
    int64_t v = 0, mult = 1;
    if (!length_parts(item, v, mult))
      throw UsageError(fmt::format("{}: '{}' is not a length (integer, optional K or M suffix)", flag, item));
    if (v < 1 || v > hi / mult || v * mult < lo)  // v <= hi / mult: v * mult does not overflow
      throw UsageError(fmt::format("{}: a length must be an integer in [{}, {}] (got '{}')", flag, lo, hi, item));
    out.push_back(v * mult);
  }
  return out;
}

CLI::Validator lengths_in(const std::string& flag, int64_t lo, int64_t hi) {
  return CLI::Validator(
      [flag, lo, hi](std::string& text) -> std::string {
        try {
          (void)parse_lengths(text, flag, lo, hi);
        } catch (const UsageError& e) {
          // CLI11 prefixes the option's name: the message without our own "<flag>: ".
          std::string_view m = e.what();
          if (m.starts_with(flag + ": ")) m.remove_prefix(flag.size() + 2);
          return std::string(m);
        }
        return "";
      },
      "");
}

void check_rope_scaling_name(const std::string& name, const std::string& flag) {
  try {
    is_rope_scaling_name(name);
  } catch (const ConfigError& e) {
    std::string_view what = e.what();
    if (what.starts_with("rope_type: ")) what.remove_prefix(11);  // the library's field name; the flag says it
    throw UsageError(fmt::format("{}: {}", flag, what));
  }
}

void check_learned_table(const Model& model, const std::string& model_path, int64_t length, const std::string& flag) {
  const int64_t table = model.config().max_position_embeddings;
  if (model.family() == PositionFamily::learned_absolute && table > 0 && length > table)
    throw UsageError(fmt::format("{}: {} positions are past the learned position table (max_position_embeddings {}) "
                                 "of {}; the longest length for this model is {}",
                                 flag, length, table, model_path, table));
}

void check_rope_factor_applies(const Model& model, const std::optional<double>& rope_factor) {
  if (rope_factor && model.family() != PositionFamily::rope)
    throw UsageError(fmt::format("--rope-factor: the model has no RoPE ({} positions); nothing is scaled (got "
                                 "--rope-factor {:g})",
                                 to_string(model.family()), *rope_factor));
}

std::string describe(const Model& model) {
  const auto& c = model.config();
  std::string arch = fmt::format("dim {}, {} layers, {} heads / {} KV heads, head_dim {}, vocab {}, trained context {}",
                                 c.dim, c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim, c.vocab_size,
                                 model.trained_context());
  if (c.qkv_bias) arch += ", q/k/v bias";
  if (c.qk_norm) arch += ", q/k norm";
  if (model.sliding_window() > 0) arch += fmt::format(", sliding window {}", model.sliding_window());
  if (model.family() != PositionFamily::rope)
    return fmt::format("{}; positional family {}", arch, to_string(model.family()));
  const auto& r = model.rope();
  return fmt::format("{}; RoPE rope_type {}, rope_theta {:g}, rotary_dim {}, layout {}, angle_precision {}", arch,
                     r.params.rope_type, r.params.rope_theta, r.freqs.rotary_dim, to_string(r.layout),
                     to_string(r.precision));
}

namespace {
/// The file descriptor "-" writes to: stdout, or its saved copy while a StdoutForData sends the text to stderr.
int g_data_fd = STDOUT_FILENO;

void write_fd(int fd, std::string_view text) {
  while (!text.empty()) {
    const ssize_t n = ::write(fd, text.data(), text.size());
    if (n < 0) {
      if (errno == EINTR) continue;
      throw IoError(fmt::format("stdout: write failed ({})", std::strerror(errno)));
    }
    text.remove_prefix(static_cast<std::size_t>(n));
  }
}
}  // namespace

CLI::Option* add_output_option(CLI::App* cmd, const std::string& name, std::string& target, const std::string& what) {
  const CLI::Validator file = output_path(false, true);
  return cmd
      ->add_option_function<std::string>(
          name,
          [name, &target](const std::string& v) {
            // A bare flag (CLI11 gives "" for the missing value): the old switch form.
            if (v.empty())
              throw CLI::ValidationError(name, fmt::format("needs a FILE ('{} -' for stdout, '{} out.{}' for a file)",
                                                           name, name, name.substr(2)));
            target = v;
          },
          fmt::format("write {} to FILE (atomically; '-' = stdout, which then carries only this)", what))
      ->expected(0, 1)
      ->type_name("FILE")
      ->check(CLI::Validator([file](std::string& v) { return v == "-" ? std::string() : file(v); }, "",
                             "writable output file in an existing directory, or - for stdout"));
}

CLI::Option* add_json_option(CLI::App* cmd, std::string& target, const std::string& what) {
  return add_output_option(cmd, "--json", target, what);
}

void write_output(const std::string& target, std::string_view text) {
  if (target.empty()) return;
  if (target == "-") {
    std::fflush(stdout);
    write_fd(g_data_fd, text);
  } else {
    write_file_atomic(target, text);
  }
}

// Strings that are not UTF-8 (a sampled or decoded text) are written with U+FFFD for each invalid byte, not thrown
// as nlohmann's type_error.316 after the work is done.
void emit_json(const std::string& target, const nlohmann::json& j) {
  write_output(target, j.dump(2, ' ', false, nlohmann::json::error_handler_t::replace) + "\n");
}
void emit_json(const std::string& target, const nlohmann::ordered_json& j) {
  write_output(target, j.dump(2, ' ', false, nlohmann::ordered_json::error_handler_t::replace) + "\n");
}

void distinct_outputs(const std::vector<std::string>& targets, const std::vector<std::string>& names) {
  namespace fs = std::filesystem;
  for (std::size_t i = 0; i < targets.size(); ++i)
    for (std::size_t j = i + 1; j < targets.size(); ++j) {
      if (targets[i].empty() || targets[j].empty() || targets[i] == "-" || targets[j] == "-") continue;
      std::error_code ec1, ec2;
      const fs::path a = fs::weakly_canonical(fs::absolute(targets[i]), ec1);
      const fs::path b = fs::weakly_canonical(fs::absolute(targets[j]), ec2);
      if (targets[i] == targets[j] || (!ec1 && !ec2 && a == b))
        throw UsageError(fmt::format("{} and {}: the same output file {} given twice (one would overwrite the "
                                     "other); give each its own path",
                                     i < names.size() ? names[i] : "?", j < names.size() ? names[j] : "?",
                                     targets[i]));
    }
}

bool output_to_stdout(const std::vector<std::string>& targets, const std::vector<std::string>& names) {
  distinct_outputs(targets, names);
  std::vector<std::string> to_stdout;
  for (std::size_t i = 0; i < targets.size(); ++i)
    if (targets[i] == "-") to_stdout.push_back(i < names.size() ? names[i] : "?");
  if (to_stdout.size() > 1)
    throw UsageError(fmt::format("{}: only one output can go to stdout ('-'); give the others a FILE",
                                 fmt::join(to_stdout, " and ")));
  return !to_stdout.empty();
}

StdoutForData::StdoutForData(const std::vector<std::string>& targets, const std::vector<std::string>& names) {
  if (!output_to_stdout(targets, names) || g_data_fd != STDOUT_FILENO) return;
  std::fflush(stdout);
  saved_fd_ = ::dup(STDOUT_FILENO);
  if (saved_fd_ < 0 || ::dup2(STDERR_FILENO, STDOUT_FILENO) < 0)
    throw IoError(fmt::format("stdout: cannot redirect ({})", std::strerror(errno)));
  g_data_fd = saved_fd_;
}

StdoutForData::~StdoutForData() {
  if (saved_fd_ < 0) return;
  std::fflush(stdout);
  ::dup2(saved_fd_, STDOUT_FILENO);
  ::close(saved_fd_);
  g_data_fd = STDOUT_FILENO;
}

void add_renamed_option(CLI::App* cmd, const std::string& old_name, const std::string& instead) {
  cmd->add_option_function<std::vector<std::string>>(
         old_name,
         [old_name, instead](const std::vector<std::string>&) { throw CLI::ValidationError(old_name, instead); },
         instead)
      ->expected(0, 1)
      ->group("");  // hidden from --help
}

void not_required_with(CLI::App* sub, const std::vector<CLI::Option*>& options) {
  // The subcommand's parse completes before its parent checks its requirements.
  sub->parse_complete_callback([options] {
    for (CLI::Option* o : options) o->required(false);
  });
}

std::string version_text() {
  return fmt::format("posenc {} (git {}{})", posenc::version(), POSENC_GIT_COMMIT,
                     std::string_view(POSENC_GIT_DESCRIBE) == POSENC_GIT_COMMIT ||
                             std::string_view(POSENC_GIT_DESCRIBE) == "unknown"
                         ? std::string()
                         : fmt::format(", {}", POSENC_GIT_DESCRIBE));
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


void add_weight_type_option(CLI::App& cmd, std::string& type) {
  cmd.add_option("--type", type, "weight type of the matrices: f32, f16, bf16, q8_0, q4_0 (any case)")
      ->capture_default_str()
      ->transform(CLI::IsMember({"f32", "f16", "bf16", "q8_0", "q4_0"}, CLI::ignore_case));
}

GgmlType weight_type_of(const std::string& type) {
  if (type == "f16") return GgmlType::f16;
  if (type == "bf16") return GgmlType::bf16;
  if (type == "q8_0") return GgmlType::q8_0;
  if (type == "q4_0") return GgmlType::q4_0;
  if (type == "f32") return GgmlType::f32;
  throw ConfigError(fmt::format("--type: must be f32, f16, bf16, q8_0 or q4_0 (got '{}')", type));
}

}  // namespace posenc::cli
