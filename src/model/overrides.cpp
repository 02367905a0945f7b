#include "posenc/overrides.hpp"

#include <cmath>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "posenc/config.hpp"
#include "posenc/error.hpp"
#include "posenc/io.hpp"
#include "posenc/json_file.hpp"
#include "posenc/scaling.hpp"

namespace posenc {

namespace {
/// True for a bare rope_scaling / rope_parameters object (what rope_params_from_config wraps).
bool bare_rope_object(const std::filesystem::path& path) {
  const auto j = nlohmann::json::parse(read_file(path), nullptr, false);
  return j.is_object() && !j.contains("model_type") && !j.contains("architectures") &&
         !j.contains("num_attention_heads") && !j.contains("hidden_size");
}
}  // namespace

std::pair<RopeParams, int64_t> rope_params_from_config(const std::filesystem::path& path, const RopeParams& base,
                                                       int64_t trained_context) {
  const std::string text = read_file(path);
  const std::string src = "--config " + path.string();
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const nlohmann::json::parse_error& e) {
    throw ConfigError(fmt::format("{}: malformed JSON: {}", src, e.what()));
  } catch (const nlohmann::json::exception& e) {  // a value nlohmann cannot hold (1e400): name its key
    const std::string key = json_failure_path(text);
    throw ConfigError(
        fmt::format("{}: {}{}unusable JSON value: {}", src, key, key.empty() ? "" : ": ", e.what()));
  }
  if (!j.is_object()) throw ConfigError(fmt::format("{}: must be a JSON object (a config.json or a rope_scaling object)", src));
  const bool bare = !j.contains("model_type") && !j.contains("architectures") && !j.contains("num_attention_heads") &&
                    !j.contains("hidden_size");
  std::string config_text = text;
  if (bare) {
    if (!j.contains("rope_type") && !j.contains("type"))
      throw ConfigError(fmt::format("{}: neither a config.json (no model_type/architectures/num_attention_heads) nor "
                                    "a rope_scaling object (no rope_type)",
                                    src));
    // Wrap it in a minimal config with the model's own sizes, so that the one
    // config parser reads it (rope_parameters when it carries rope_theta).
    nlohmann::json cfg{{"model_type", "llama"},
                       {"num_attention_heads", 1},
                       {"hidden_size", base.head_dim},
                       {"head_dim", base.head_dim},
                       {"max_position_embeddings", trained_context}};
    // The object's own rope_theta replaces the model's (a top-level one next
    // to it would be a disagreement the parser refuses).
    if (!j.contains("rope_theta")) cfg["rope_theta"] = base.rope_theta;
    cfg[j.contains("rope_theta") ? "rope_parameters" : "rope_scaling"] = j;
    config_text = cfg.dump();
  }
  const PositionalSpec ps = parse_positional_spec(config_text, src);
  if (!ps.rope) throw ConfigError(fmt::format("{}: the config describes {} positions, not RoPE", src, to_string(ps.family)));

  RopeParams p = *ps.rope;
  if (p.head_dim != base.head_dim)
    throw ConfigError(fmt::format("{}: head_dim {} does not match the model's head_dim {}", src, p.head_dim, base.head_dim));
  if (bare && p.rotary_dim == 0 && !p.partial_rotary_factor) p.rotary_dim = base.effective_rotary_dim();
  int64_t trained = 0;
  if (p.rope_type != "default" && p.original_max_position_embeddings)
    trained = *p.original_max_position_embeddings;
  else if (!bare && ps.max_position_embeddings)
    trained = *ps.max_position_embeddings;
  if (bare) {
    if (!p.original_max_position_embeddings) p.original_max_position_embeddings = trained_context;
    if (!p.max_position_embeddings) p.max_position_embeddings = trained_context;
  }
  return {p, trained};
}

std::vector<std::string> apply_positional_overrides(Model& model, const PositionalOverrides& o) {
  std::vector<std::string> notes;
  const bool rope_override = o.config || o.rope_theta || o.layout;
  if (model.family() != PositionFamily::rope) {
    if (rope_override)
      throw ConfigError(fmt::format("--config/--rope-theta/--rope-layout: this model uses {} positions, not RoPE",
                                    to_string(model.family())));
  } else {
    RopeSetup r = model.rope();
    if (o.config) {
      auto [p, trained] = rope_params_from_config(*o.config, r.params, model.trained_context());
      // A config.json's attention mask is not taken over: one that describes
      // another sliding window than the model runs with would be ignored.
      if (!bare_rope_object(*o.config)) {
        const PositionalSpec ps = load_positional_spec(*o.config);
        const int64_t w = ps.sliding_window.active && ps.sliding_window.size ? *ps.sliding_window.size : 0;
        if (w != model.sliding_window())
          throw ConfigError(fmt::format("--config {}: sliding window {} ({}), the model runs with {}; --config "
                                        "replaces the RoPE parameters only",
                                        o.config->string(), w, ps.sliding_window.source, model.sliding_window()));
      }
      r.params = p;
      r.freqs = compute_rope_frequencies(p);
      notes.push_back(fmt::format("--config {}: rope_type {}, rope_theta {:g}, rotary_dim {}", o.config->string(),
                                  p.rope_type, p.rope_theta, r.freqs.rotary_dim));
      if (trained > 0 && !o.trained_context) {
        model.set_trained_context(trained, "--config " + o.config->string());
        notes.push_back(fmt::format("--config {}: trained context {}", o.config->string(), trained));
      }
    }
    if (o.rope_theta) {
      if (!(std::isfinite(*o.rope_theta) && *o.rope_theta > 0))
        fail_field<ConfigError>("--rope-theta", "must be finite and > 0", *o.rope_theta);
      r.params.rope_theta = *o.rope_theta;
      r.freqs = compute_rope_frequencies(r.params);
      notes.push_back(fmt::format("--rope-theta: rope_theta {:g}", *o.rope_theta));
    }
    if (o.layout) {
      if (*o.layout != r.layout)
        notes.push_back(fmt::format("--rope-layout: {} instead of the loader's {}", to_string(*o.layout),
                                    to_string(r.layout)));
      r.layout = *o.layout;
    }
    if (o.precision) r.precision = *o.precision;
    model.set_rope(r);
  }
  if (o.trained_context) {
    if (*o.trained_context <= 0) fail_field<ConfigError>("--trained-context", "must be positive", *o.trained_context);
    model.set_trained_context(*o.trained_context, "--trained-context");
    notes.push_back(fmt::format("--trained-context: {}", *o.trained_context));
  }
  return notes;
}

}  // namespace posenc
