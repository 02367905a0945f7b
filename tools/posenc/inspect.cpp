// posenc inspect --config F [--seq-len N] [--json FILE|-] [--lenient]
// Prints what a config.json says about positions and, for RoPE, the
// per-channel table (posenc/analysis.hpp: inspect_rope).
#include <cstdio>
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
#include "posenc/io.hpp"

namespace posenc::cli {

namespace {

using json = nlohmann::ordered_json;

struct InspectOptions {
  std::string config;
  std::string seq_len;
  bool lenient = false;
  std::string json;  // "" = none, "-" = stdout (instead of the text), else a file
};

json scaling_json(const RopeParams& p) {
  json j = json::object();
  if (p.factor) j["factor"] = *p.factor;
  if (p.original_max_position_embeddings)
    j["original_max_position_embeddings"] = *p.original_max_position_embeddings;
  if (p.max_position_embeddings) j["max_position_embeddings"] = *p.max_position_embeddings;
  if (p.attention_factor) j["attention_factor"] = *p.attention_factor;
  if (p.beta_fast) j["beta_fast"] = *p.beta_fast;
  if (p.beta_slow) j["beta_slow"] = *p.beta_slow;
  if (p.mscale) j["mscale"] = *p.mscale;
  if (p.mscale_all_dim) j["mscale_all_dim"] = *p.mscale_all_dim;
  if (p.truncate) j["truncate"] = *p.truncate;
  if (p.low_freq_factor) j["low_freq_factor"] = *p.low_freq_factor;
  if (p.high_freq_factor) j["high_freq_factor"] = *p.high_freq_factor;
  if (!p.short_factor.empty()) j["short_factor"] = p.short_factor;
  if (!p.long_factor.empty()) j["long_factor"] = p.long_factor;
  return j;
}

json sliding_json(const SlidingWindowSpec& sw) {
  json j = json::object();
  j["size"] = sw.size ? json(*sw.size) : json(nullptr);
  j["active"] = sw.active;
  j["layer_is_sliding"] = sw.layer_is_sliding;
  j["source"] = sw.source;
  return j;
}

json spec_json(const PositionalSpec& s, const std::optional<RopeInspection>& ins) {
  json j = json::object();
  j["family"] = std::string(to_string(s.family));
  if (s.rope && ins) {
    const RopeParams& p = *s.rope;
    j["rope_type"] = p.rope_type;
    j["rope_theta"] = p.rope_theta;
    j["head_dim"] = p.head_dim;
    j["rotary_dim"] = p.effective_rotary_dim();
    j["layout"] = layout_name(s);
    j["attention_factor"] = ins->frequencies.attention_factor;
    json inv = json::array();
    for (float f : ins->frequencies.inv_freq) inv.push_back(static_cast<double>(f));
    j["inv_freq"] = inv;
    json ch = json::array();
    for (const auto& c : ins->channels)
      ch.push_back(json{{"i", c.i},
                        {"inv_freq", c.inv_freq},
                        {"wavelength", c.wavelength},
                        {"rotations_original", c.rotations_original},
                        {"rotations_target", c.rotations_target},
                        {"wavelength_ratio", c.wavelength_ratio}});
    j["channels"] = ch;
    j["original_length"] = ins->original_length;
    j["seq_len"] = ins->target_length;
    j["rope_parameters"] = scaling_json(p);
    if (s.qk_head_dim) j["qk_head_dim"] = *s.qk_head_dim;
    if (s.softmax_scale) j["softmax_scale"] = *s.softmax_scale;
    if (!s.mrope_section.empty()) j["mrope_section"] = s.mrope_section;
    if (s.mrope_interleaved) j["mrope_interleaved"] = true;
  }
  if (s.alibi) {
    j["alibi_convention"] = std::string(to_string(s.alibi->convention));
    j["max_bias"] = s.alibi->max_bias;
    j["slopes_dtype"] = s.alibi->bfloat16_slopes ? "bfloat16" : "float32";
    json slopes = json::array();
    for (float f : alibi_slopes_for(*s.alibi, s.num_attention_heads))
      slopes.push_back(static_cast<double>(f));
    j["slopes"] = slopes;
  }
  if (s.t5) {
    j["relative_attention_num_buckets"] = s.t5->relative_attention_num_buckets;
    j["relative_attention_max_distance"] = s.t5->relative_attention_max_distance;
    j["encoder_bidirectional"] = s.t5->encoder_bidirectional;
    j["decoder_bidirectional"] = s.t5->decoder_bidirectional;
    j["is_encoder_decoder"] = s.t5->is_encoder_decoder;
  }
  if (s.sinusoidal_layout) j["sinusoidal_layout"] = std::string(to_string(*s.sinusoidal_layout));
  if (s.family == PositionFamily::learned_absolute) j["position_offset"] = s.position_offset;
  j["model_type"] = s.model_type;
  j["architecture"] = s.architecture;
  j["num_attention_heads"] = s.num_attention_heads;
  j["num_key_value_heads"] = s.num_key_value_heads;
  j["hidden_size"] = s.hidden_size;
  j["num_hidden_layers"] = s.num_hidden_layers;
  j["max_position_embeddings"] =
      s.max_position_embeddings ? json(*s.max_position_embeddings) : json(nullptr);
  j["sliding_window"] = sliding_json(s.sliding_window);
  j["ignored_keys"] = s.ignored_keys;
  j["notes"] = s.notes;
  return j;
}

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
    json params = scaling_json(p);
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

void run_inspect(const InspectOptions& opt) {
  ConfigOptions co;
  co.lenient = opt.lenient;
  const PositionalSpec spec = load_positional_spec(opt.config, co);
  std::optional<int64_t> seq_len;
  if (!opt.seq_len.empty())
    seq_len = as_usage_error([&] { return parse_context_length(opt.seq_len, "--seq-len"); });
  std::optional<RopeInspection> ins;
  if (spec.rope) ins = inspect_rope(spec, seq_len);
  if (opt.json != "-") fmt::print("{}", spec_text(spec, ins));
  emit_json(opt.json, spec_json(spec, ins));
}

}  // namespace

void add_inspect_command(CLI::App& app) {
  auto opt = std::make_shared<InspectOptions>();
  auto* sub = app.add_subcommand(
      "inspect", "Show how a config.json encodes positions (RoPE: per-channel periods)");
  sub->add_option("--config", opt->config, "Model config.json")->required();
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
