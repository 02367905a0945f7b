// posenc inspect (--config F | --model M) [--seq-len N] [--json FILE|-] [--lenient]
// Prints what a config.json (or a model of any format the runtime loads) says
// about positions and, for RoPE, the per-channel table (posenc/analysis.hpp:
// inspect_rope).
#include <cstdio>
#include <filesystem>
#include <memory>
#include <string>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "commands.hpp"
#include "common.hpp"
#include "posenc/analysis.hpp"
#include "posenc/config.hpp"
#include "posenc/error.hpp"
#include "posenc/inspect_json.hpp"
#include "posenc/io.hpp"
#include "posenc/model.hpp"

namespace posenc::cli {

namespace {

using json = nlohmann::ordered_json;

struct InspectOptions {
  std::string config;
  std::string model;
  std::string seq_len;
  bool lenient = false;
  std::string json;  // "" = none, "-" = stdout (instead of the text), else a file
};

std::string sliding_text(const SlidingWindowSpec& sw) {
  if (!sw.size) return "none";
  std::string out = fmt::format("{} ({})", *sw.size, sw.active ? "active" : "inactive");
  if (sw.active && !sw.layer_is_sliding.empty()) {
    int n = 0;
    for (bool b : sw.layer_is_sliding) n += b ? 1 : 0;
    out += fmt::format(", {} of {} layers", n, sw.layer_is_sliding.size());
  }
  return out + "; " + sw.source;
}

std::string spec_text(const PositionalSpec& s, const std::optional<RopeInspection>& ins) {
  std::string o;
  auto line = [&](std::string_view k, const std::string& v) {
    o += fmt::format("{:<26}{}\n", fmt::format("{}:", k), v);
  };
  line("config", s.source);
  line("model_type", fmt::format("{} ({})", s.model_type.empty() ? "-" : s.model_type,
                                 s.architecture.empty() ? "-" : s.architecture));
  line("family", std::string(to_string(s.family)));
  line("heads", fmt::format("{} attention, {} key/value", s.num_attention_heads,
                            s.num_key_value_heads));
  line("max_position_embeddings",
       s.max_position_embeddings ? std::to_string(*s.max_position_embeddings) : "-");
  if (s.rope) {
    const RopeParams& p = *s.rope;
    line("rope_type", p.rope_type);
    json params = rope_parameters_json(p);
    // rope_parameters.max_position_embeddings is the max_position_embeddings line above: not printed twice.
    if (params.contains("max_position_embeddings") && s.max_position_embeddings &&
        params["max_position_embeddings"] == *s.max_position_embeddings)
      params.erase("max_position_embeddings");
    if (!params.empty()) {
      std::string t;
      for (auto it = params.begin(); it != params.end(); ++it) {
        if (!t.empty()) t += ", ";
        if (it->is_array())
          t += fmt::format("{}[{}]", it.key(), it->size());
        else
          t += fmt::format("{} {}", it.key(), it->dump());
      }
      line("rope parameters", t);
    }
    line("rope_theta", fmt::format("{}", p.rope_theta));
    line("head_dim / rotary_dim", fmt::format("{} / {}", p.head_dim, p.effective_rotary_dim()));
    if (s.qk_head_dim) line("qk_head_dim", std::to_string(*s.qk_head_dim));
    if (s.softmax_scale) line("softmax_scale", fmt::format("{:.9g}", *s.softmax_scale));
    line("layout", layout_name(s));
    if (!s.mrope_section.empty()) line("mrope_section", fmt::format("{}", s.mrope_section));
    if (!s.mrope_section.empty()) line("mrope_mapping", s.mrope_interleaved ? "interleaved (Qwen3-VL)" : "chunked (Qwen2-VL)");
    if (ins) line("attention_factor", fmt::format("{:.9g}", ins->frequencies.attention_factor));
  }
  if (s.alibi) {
    line("alibi", fmt::format("{} convention, max_bias {}, slopes {}", to_string(s.alibi->convention),
                              s.alibi->max_bias,
                              s.alibi->bfloat16_slopes ? "rounded to bfloat16 (Falcon)" : "float32"));
    std::string sl;
    for (float f : alibi_slopes_for(*s.alibi, s.num_attention_heads))
      sl += fmt::format("{}{:.9g}", sl.empty() ? "" : " ", f);
    line("slopes", sl);
  }
  if (s.t5)
    line("t5 buckets",
         fmt::format("relative_attention_num_buckets {}, relative_attention_max_distance {}, "
                     "encoder bidirectional, decoder causal",
                     s.t5->relative_attention_num_buckets,
                     s.t5->relative_attention_max_distance));
  if (s.sinusoidal_layout) line("sinusoidal layout", std::string(to_string(*s.sinusoidal_layout)));
  if (s.family == PositionFamily::learned_absolute)
    line("position table", fmt::format("{} rows, position offset {}",
                                       s.max_position_embeddings.value_or(0), s.position_offset));
  line("sliding_window", sliding_text(s.sliding_window));
  if (!s.ignored_keys.empty()) line("ignored keys", fmt::format("{} (see the notes)", fmt::join(s.ignored_keys, ", ")));
  for (const auto& n : s.notes) o += fmt::format("  note: {}\n", n);
  if (ins) {
    const std::string lo = format_context_length(ins->original_length);
    const std::string lt = format_context_length(ins->target_length);
    o += fmt::format(
        "\nchannels (frequencies for seq_len {}; wavelength = 2π/inv_freq in tokens; rotations = "
        "length/wavelength; ratio = wavelength / plain RoPE's)\n",
        ins->target_length);
    // One rotations column per distinct length: with seq_len = the original length (every config without
    // scaling) the two columns were the same numbers under the same heading.
    const bool two_lengths = ins->original_length != ins->target_length;
    o += fmt::format("{:>4} {:>14} {:>14} {:>14}{} {:>10}\n", "i", "inv_freq", "wavelength",
                     fmt::format("rot@{}", lo), two_lengths ? fmt::format(" {:>14}", fmt::format("rot@{}", lt)) : "",
                     "ratio");
    for (const auto& c : ins->channels)
      o += fmt::format("{:>4} {:>14.7g} {:>14.6g} {:>14.6g}{} {:>10.5g}\n", c.i, c.inv_freq, c.wavelength,
                       c.rotations_original, two_lengths ? fmt::format(" {:>14.6g}", c.rotations_target) : "",
                       c.wavelength_ratio);
  }
  return o;
}

/// --config: a config.json, or a directory holding one; a model file (GGUF, llama2.c, posenc) is named and sent to
/// --model. --model: a Hugging Face directory's config.json (what it says in full), any other format loaded
/// (memory-mapped, nothing computed) and described by positional_spec.
PositionalSpec spec_to_inspect(const InspectOptions& opt) {
  ConfigOptions co;
  co.lenient = opt.lenient;
  namespace fs = std::filesystem;
  if (!opt.config.empty()) {
    const fs::path p = opt.config;
    if (fs::is_directory(p)) {
      if (!fs::exists(p / "config.json"))
        throw IoError(fmt::format("--config {}: a directory without config.json (a model file: --model)", p.string()));
      return load_positional_spec(p / "config.json", co);
    }
    if (fs::is_regular_file(p) && p.extension() != ".json") {
      const ModelFormat f = Model::detect_format(p);
      if (f == ModelFormat::gguf || f == ModelFormat::posenc || p.extension() == ".bin")
        throw UsageError(fmt::format("--config {}: a {} model, not a config.json: give it as --model", p.string(),
                                     f == ModelFormat::llama2c ? "llama2.c" : to_string(f)));
    }
    return load_positional_spec(p, co);
  }
  const fs::path m = opt.model;
  if (fs::is_directory(m) && fs::exists(m / "config.json")) return load_positional_spec(m / "config.json", co);
  return positional_spec(Model::load(m));
}

void run_inspect(const InspectOptions& opt) {
  const PositionalSpec spec = spec_to_inspect(opt);
  std::optional<int64_t> seq_len;
  if (!opt.seq_len.empty())
    seq_len = as_usage_error([&] { return parse_context_length(opt.seq_len, "--seq-len"); });
  std::optional<RopeInspection> ins;
  if (spec.rope) ins = inspect_rope(spec, seq_len);
  if (opt.json != "-") fmt::print("{}", spec_text(spec, ins));
  emit_json(opt.json, inspect_json(spec, ins));
}

}  // namespace

void add_inspect_command(CLI::App& app) {
  auto opt = std::make_shared<InspectOptions>();
  auto* sub = app.add_subcommand(
      "inspect", "Show how a config.json or a model encodes positions (RoPE: per-channel periods)");
  CLI::Option_group* what = sub->add_option_group("model", "the model: exactly one of --config and --model");
  what->add_option("--config", opt->config, "Model config.json (or a directory holding one)")->check(non_empty());
  what->add_option("--model", opt->model,
                   "A model the runtime loads: Hugging Face directory (its config.json), GGUF, llama2.c .bin or posenc "
                   "checkpoint (what the loader reads: GGUF rope.* keys, llama2.c's defaults)")
      ->check(non_empty());
  what->require_option(1);
  sub->add_option("--seq-len", opt->seq_len,
                  "Target length N (K = 1024, M = 1048576); default max_position_embeddings. "
                  "Length-dependent scalings (dynamic, longrope) are computed for N");
  add_json_option(sub, opt->json, "the same as one JSON object");
  sub->add_flag("--lenient", opt->lenient,
                "Ignore unknown keys inside rope_scaling/rope_parameters (listed in the output)");
  add_renamed_option(sub, "-o,--output",
                     "removed: the text goes to stdout (redirect it), the JSON to --json FILE (- = stdout)");
  sub->callback([opt] { run_inspect(*opt); });
}

}  // namespace posenc::cli
