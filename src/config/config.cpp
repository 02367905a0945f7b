#include "posenc/config.hpp"
#include "posenc/mrope.hpp"

#include <algorithm>
#include <array>
#include <cmath>
#include <set>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "config/architectures.hpp"
#include "posenc/checked.hpp"
#include "posenc/error.hpp"
#include "posenc/io.hpp"
#include "posenc/json_file.hpp"

namespace posenc {

using json = nlohmann::json;
using namespace config_limits;

std::string_view to_string(AlibiConvention convention) {
  return convention == AlibiConvention::bloom ? "bloom" : "mpt";
}

MaskKind SlidingWindowSpec::layer_mask(int layer) const {
  if (!active) return MaskKind::causal;
  if (layer_is_sliding.empty()) return MaskKind::sliding_window;
  if (layer < 0 || static_cast<std::size_t>(layer) >= layer_is_sliding.size())
    throw InvalidArgument(fmt::format("layer: must be in [0, {}) (got {})",
                                      layer_is_sliding.size(), layer));
  return layer_is_sliding[static_cast<std::size_t>(layer)] ? MaskKind::sliding_window
                                                            : MaskKind::causal;
}

std::string layout_name(const PositionalSpec& spec) {
  if (!spec.layout) return "unknown";
  if (spec.rope_output_half_order) return "interleaved_in_half_out";
  return std::string(to_string(*spec.layout));
}

namespace {

// ---------------------------------------------------------------------------
// Typed reads of JSON values; every failure names the field path and value.

class ConfigReader {
 public:
  ConfigReader(std::string source, const ConfigOptions& options)
      : source_(std::move(source)), options_(options) {}

  const ConfigOptions& options() const { return options_; }

  [[noreturn]] void fail(std::string_view field, std::string_view reason) const {
    throw ConfigError(fmt::format("{}: {}: {}", source_, field, reason));
  }
  [[noreturn]] void fail(std::string_view field, std::string_view reason, const json& value) const {
    throw ConfigError(fmt::format("{}: {}: {} (got {})", source_, field, reason, show(value)));
  }
  template <class V>
  [[noreturn]] void fail_value(std::string_view field, std::string_view reason, const V& value) const {
    throw ConfigError(fmt::format("{}: {}: {} (got {})", source_, field, reason, value));
  }

  static std::string show(const json& v) {
    std::string s = v.dump();
    if (s.size() > 80) s = s.substr(0, 77) + "...";
    return s;
  }

  static std::string path(std::string_view parent, std::string_view key) {
    return parent.empty() ? std::string(key) : fmt::format("{}.{}", parent, key);
  }

  double number(const json& v, std::string_view field) const {
    if (!v.is_number()) fail(field, "must be a number", v);
    const double d = v.get<double>();
    if (!std::isfinite(d)) fail(field, "must be finite", v);
    return d;
  }

  double positive(const json& v, std::string_view field) const {
    const double d = number(v, field);
    if (!(d > 0)) fail(field, "must be finite and > 0", v);
    return d;
  }

  int64_t integer(const json& v, std::string_view field) const {
    if (v.is_number_integer()) return v.get<int64_t>();
    if (v.is_number_float()) {
      const double d = v.get<double>();
      if (std::isfinite(d) && d == std::floor(d) && std::fabs(d) < 9.0e15)
        return static_cast<int64_t>(d);
      fail(field, "must be an integer", v);
    }
    fail(field, "must be an integer", v);
  }

  /// An integer in [lo, hi] (hi <= INT_MAX): sizes are bounded before use
  /// (config_limits in posenc/config.hpp).
  int bounded_int(const json& v, std::string_view field, int64_t lo, int64_t hi) const {
    return static_cast<int>(bounded_int64(v, field, lo, hi));
  }
  int64_t bounded_int64(const json& v, std::string_view field, int64_t lo, int64_t hi) const {
    const int64_t i = integer(v, field);
    if (i < lo || i > hi) fail(field, fmt::format("must be an integer in [{}, {}]", lo, hi), v);
    return i;
  }
  int positive_int(const json& v, std::string_view field, int64_t hi) const { return bounded_int(v, field, 1, hi); }
  int64_t positive_int64(const json& v, std::string_view field, int64_t hi) const {
    return bounded_int64(v, field, 1, hi);
  }

  bool boolean(const json& v, std::string_view field) const {
    if (!v.is_boolean()) fail(field, "must be true or false", v);
    return v.get<bool>();
  }

  std::string string(const json& v, std::string_view field) const {
    if (!v.is_string()) fail(field, "must be a string", v);
    return v.get<std::string>();
  }

  std::vector<double> positive_list(const json& v, std::string_view field) const {
    if (!v.is_array()) fail(field, "must be a list of numbers", v);
    std::vector<double> out;
    out.reserve(v.size());
    for (std::size_t i = 0; i < v.size(); ++i)
      out.push_back(positive(v[i], fmt::format("{}[{}]", field, i)));
    return out;
  }

 private:
  std::string source_;
  ConfigOptions options_;
};

/// obj[key] when present and not null, else nullptr.
const json* get(const json& obj, std::string_view key) {
  if (!obj.is_object()) return nullptr;
  auto it = obj.find(key);
  if (it == obj.end() || it->is_null()) return nullptr;
  return &*it;
}

/// The first of `keys` present (not null) in obj; its name goes to *which.
const json* get_any(const json& obj, std::initializer_list<std::string_view> keys,
                    std::string* which = nullptr) {
  for (auto k : keys)
    if (const json* v = get(obj, k)) {
      if (which) *which = std::string(k);
      return v;
    }
  return nullptr;
}

// ---------------------------------------------------------------------------
// RoPE scaling dictionaries.

struct TypeKeys {
  std::string_view rope_type;
  std::vector<std::string_view> allowed;   // besides rope_type/type
  std::vector<std::string_view> required;  // must be present in the dict
};

// Parameters Hugging Face reads for each rope_type (modeling_rope_utils.py,
// _validate_*_rope_parameters), plus posenc's static "ntk".
const std::vector<TypeKeys>& type_keys() {
  static const std::vector<TypeKeys> table{
      {"default", {}, {}},
      {"linear", {"factor"}, {"factor"}},
      {"dynamic", {"factor", "original_max_position_embeddings"}, {"factor"}},
      {"ntk", {"factor"}, {"factor"}},
      {"yarn",
       {"factor", "original_max_position_embeddings", "attention_factor", "beta_fast",
        "beta_slow", "mscale", "mscale_all_dim", "truncate"},
       {}},
      {"longrope",
       {"short_factor", "long_factor", "factor", "original_max_position_embeddings",
        "attention_factor"},
       {"short_factor", "long_factor"}},
      {"llama3",
       {"factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor"},
       {"factor", "low_freq_factor", "high_freq_factor"}},
      {"proportional", {"partial_rotary_factor", "factor"}, {}},
  };
  return table;
}

const TypeKeys* find_type_keys(std::string_view rope_type) {
  for (const auto& t : type_keys())
    if (t.rope_type == rope_type) return &t;
  return nullptr;
}

bool is_registered(std::string_view rope_type) {
  for (const auto& m : rope_scalings())
    if (m.name == rope_type) return true;
  return false;
}

/// Registry names first, then the names this parser can read that are not
/// (yet) registered.
std::string known_rope_types() {
  std::vector<std::string> names;
  for (const auto& m : rope_scalings()) names.emplace_back(m.name);
  for (const auto& t : type_keys())
    if (std::find(names.begin(), names.end(), t.rope_type) == names.end())
      names.emplace_back(t.rope_type);
  return fmt::format("{}", fmt::join(names, ", "));
}

struct ScalingDict {
  const json* dict = nullptr;  // the rope_scaling / rope_parameters object, or nullptr
  std::string name;            // "rope_scaling" or "rope_parameters"
};

ScalingDict find_scaling_dict(const ConfigReader& r, const json& cfg) {
  const json* scaling = get(cfg, "rope_scaling");
  const json* params = get(cfg, "rope_parameters");
  if (scaling && !scaling->is_object()) r.fail("rope_scaling", "must be an object or null", *scaling);
  if (params && !params->is_object())
    r.fail("rope_parameters", "must be an object or null", *params);
  if (params) {
    // transformers v5 allows one dict per layer type ({"full_attention": {...},
    // "sliding_attention": {...}}); a PositionalSpec holds one RoPE.
    for (auto it = params->begin(); it != params->end(); ++it)
      if (it->is_object())
        r.fail(ConfigReader::path("rope_parameters", it.key()),
               "per-layer-type RoPE parameters are not supported (one RoPE per model)", *it);
  }
  if (scaling && params && *scaling != *params) {
    // Both present: v5 re-saves keep them equal; a difference is ambiguous.
    // Compare the scaling keys only (rope_parameters also carries rope_theta).
    for (auto it = scaling->begin(); it != scaling->end(); ++it) {
      auto p = params->find(it.key());
      if (p == params->end() || *p != *it)
        r.fail(ConfigReader::path("rope_scaling", it.key()),
               fmt::format("disagrees with rope_parameters.{} ({})", it.key(),
                           p == params->end() ? std::string("absent") : ConfigReader::show(*p)),
               *it);
    }
  }
  if (params) return {params, "rope_parameters"};
  if (scaling) return {scaling, "rope_scaling"};
  return {};
}

/// rope_type from a scaling dict ("rope_type" or legacy "type").
std::string read_rope_type(const ConfigReader& r, const ScalingDict& sd) {
  const json* rt = get(*sd.dict, "rope_type");
  const json* ty = get(*sd.dict, "type");
  if (rt && ty && *rt != *ty)
    r.fail(ConfigReader::path(sd.name, "type"),
           fmt::format("disagrees with {}.rope_type {}", sd.name, ConfigReader::show(*rt)), *ty);
  if (!rt && !ty) {
    if (sd.name == "rope_parameters") return "default";
    r.fail(ConfigReader::path(sd.name, "rope_type"),
           "required field missing (the legacy key 'type' is accepted too)");
  }
  const bool legacy = !rt;
  return r.string(legacy ? *ty : *rt, ConfigReader::path(sd.name, legacy ? "type" : "rope_type"));
}

/// Keys that say something about positions (for the top-level / text_config
/// comparison).
const std::set<std::string, std::less<>> kPositionalKeys{
    "rope_scaling", "rope_parameters", "rope_theta", "rotary_emb_base", "rotary_pct", "partial_rotary_factor",
    "rotary_dim", "head_dim", "hidden_size", "num_attention_heads", "num_key_value_heads", "max_position_embeddings",
    "original_max_position_embeddings", "sliding_window", "use_sliding_window", "layer_types",
    "sliding_window_pattern", "max_window_layers", "rope_local_base_freq"};

// ---------------------------------------------------------------------------

class Parser {
 public:
  Parser(const json& cfg, std::string source, const ConfigOptions& options)
      : cfg_(cfg), r_(source, options) {
    spec_.source = std::move(source);
  }

  PositionalSpec run() {
    if (!cfg_.is_object()) r_.fail("<top level>", "a config must be a JSON object", cfg_);
    merge_text_config();
    if (const json* mt = get(cfg_, "model_type")) spec_.model_type = r_.string(*mt, "model_type");
    if (const json* archs = get(cfg_, "architectures")) {
      if (!archs->is_array()) r_.fail("architectures", "must be a list of class names", *archs);
      if (!archs->empty()) spec_.architecture = r_.string((*archs)[0], "architectures[0]");
    }
    read_common();
    arch_ = detail::find_architecture(spec_.model_type, spec_.architecture);
    bool via_text_config = false;
    if (arch_ == nullptr && !text_model_type_.empty()) {
      arch_ = detail::find_architecture(text_model_type_, "");
      via_text_config = arch_ != nullptr;
      if (via_text_config)
        note(fmt::format("rules of text_config.model_type '{}' (model_type '{}' is not in posenc's table)",
                         text_model_type_, spec_.model_type));
    }
    if (arch_ != nullptr) {
      if (!via_text_config && (spec_.model_type.empty() || spec_.model_type != arch_->model_type))
        note(fmt::format("rules of model_type '{}', matched from architectures[0] '{}' "
                         "(model_type '{}' is not in posenc's table)",
                         arch_->model_type, spec_.architecture, spec_.model_type));
      from_architecture();
    } else {
      from_fields_only();
    }
    read_sliding_window();
    report_ignored_keys();
    return std::move(spec_);
  }

 private:
  void note(std::string text) { spec_.notes.push_back(std::move(text)); }

  /// The field path of a top-level key as the file spells it ("text_config.<key>"
  /// when it was read from text_config).
  std::string field(std::string_view key) const {
    return from_text_config_.count(std::string(key)) ? fmt::format("text_config.{}", key) : std::string(key);
  }

  /// Composite (vision + text) configs keep the decoder's keys under
  /// text_config (HF MllamaConfig, Gemma3Config, Llama4Config, Qwen2_5_VLConfig
  /// build their text model from config.text_config). Every key of text_config
  /// is read from there: keys the top level lacks, and keys in both, where the
  /// text_config value wins as in HF (the decoder is built from text_config;
  /// the top-level copy is what older saves left behind), with a note naming
  /// each positional key whose two values differ.
  void merge_text_config() {
    const json* tc = get(cfg_, "text_config");
    if (tc == nullptr) return;
    if (!tc->is_object()) r_.fail("text_config", "must be an object or null", *tc);
    std::vector<std::string> read, differ;
    for (auto it = tc->begin(); it != tc->end(); ++it) {
      if (it->is_null()) continue;
      const std::string& k = it.key();
      if (k == "model_type" || k == "architectures") continue;  // the composite's own names stay
      if (k == "text_config")  // HF composite configs nest one level only
        r_.fail("text_config.text_config", "a text_config inside text_config is not a config HF writes", *it);
      const json* top = get(cfg_, k);
      if (top == nullptr) {
        cfg_[k] = *it;
        from_text_config_.insert(k);
        read.push_back(k);
      } else if (*top != *it) {
        if (kPositionalKeys.count(k))
          differ.push_back(
              fmt::format("{} (top level {}, text_config {})", k, ConfigReader::show(*top), ConfigReader::show(*it)));
        cfg_[k] = *it;
        from_text_config_.insert(k);
      }
    }
    if (const json* mt = get(*tc, "model_type"); mt && mt->is_string()) text_model_type_ = mt->get<std::string>();
    if (!read.empty()) {
      std::vector<std::string> positional;
      for (const auto& k : read)
        if (kPositionalKeys.count(k) || k == "num_hidden_layers" || k == "no_rope_layers" || k == "kv_channels")
          positional.push_back(k);
      note(fmt::format("read from text_config (the top level lacks them): {}{}", fmt::join(positional, ", "),
                       read.size() > positional.size()
                           ? fmt::format("{}and {} other keys", positional.empty() ? "" : ", ",
                                         read.size() - positional.size())
                           : std::string()));
    }
    if (!differ.empty())
      note(fmt::format("top level and text_config differ, text_config used (as HF's text model): {}", fmt::join(differ, "; ")));
  }

  /// Marks a positional key the architecture does not read: listed in
  /// ignored_keys, with a note saying why (HF's config classes accept it too).
  void ignore(std::string_view key, std::string_view why) {
    std::string f = field(key);
    if (std::find(spec_.ignored_keys.begin(), spec_.ignored_keys.end(), f) != spec_.ignored_keys.end()) return;
    note(fmt::format("{} ignored: {}", f, why));
    spec_.ignored_keys.push_back(std::move(f));
  }

  /// Every positional key present that the resolved family does not read.
  void report_ignored_keys() {
    const std::string who = arch_ ? fmt::format("model_type '{}'", arch_->model_type) : std::string("this config");
    const PositionFamily fam = spec_.family;
    const bool rope_family = fam == PositionFamily::rope || fam == PositionFamily::mrope;
    if (!rope_family) {
      for (std::string_view k : {"rope_scaling", "rope_parameters", "rope_theta", "rotary_emb_base", "rotary_pct",
                                 "partial_rotary_factor", "rotary_dim", "original_max_position_embeddings",
                                 "rope_ratio", "rope_local_base_freq"})
        if (get(cfg_, k))
          ignore(k, fmt::format("{} uses {} positions, no RoPE", who, to_string(fam)));
    }
    if (fam != PositionFamily::alibi) {
      if (const json* a = get(cfg_, "alibi"); a && a->is_boolean() && a->get<bool>())
        ignore("alibi", fmt::format("{} has no ALiBi (its positions are {})", who, to_string(fam)));
    }
    if (fam != PositionFamily::t5_bias)
      for (std::string_view k : {"relative_attention_num_buckets", "relative_attention_max_distance"})
        if (get(cfg_, k)) ignore(k, fmt::format("{} has no T5 relative buckets", who));
    if (arch_ && arch_->kind == detail::ArchKind::alibi_bloom && get(cfg_, "offset_alibi"))
      ignore("offset_alibi", "BloomConfig has no such parameter; build_alibi_tensor anchors slopes at key index 0");
    if (fam == PositionFamily::alibi && arch_ && arch_->kind == detail::ArchKind::mpt && get(cfg_, "learned_pos_emb"))
      ignore("learned_pos_emb", "MPT builds no position table when attn_config.alibi is on");
    if (fam == PositionFamily::t5_bias)
      for (std::string_view k : {"n_positions", "max_position_embeddings"})
        if (get(cfg_, k)) ignore(k, "T5 relative buckets have no position table (informational only)");
    if (arch_ && arch_->kind == detail::ArchKind::chatglm)
      for (std::string_view k : {"rope_theta", "rope_scaling", "rope_parameters", "partial_rotary_factor"})
        if (get(cfg_, k))
          ignore(k, "modeling_chatglm rotates kv_channels // 2 channels with base 10000 * rope_ratio and reads no "
                    "other RoPE field");
    if (arch_ && arch_->sliding == detail::SlidingRule::none && !get(cfg_, "layer_types") &&
        spec_.sliding_window.size)
      ignore("sliding_window", fmt::format("{} has no sliding-window attention", who));
  }

  // heads / hidden size / layers / max positions under their various names.
  void read_common() {
    std::string which;
    if (const json* v = get_any(cfg_, {"num_attention_heads", "n_head", "n_heads", "num_heads",
                                       "encoder_attention_heads"},
                                &which))
      spec_.num_attention_heads = r_.positive_int(*v, which, kMaxHeads);
    if (const json* v = get_any(cfg_, {"hidden_size", "n_embd", "d_model", "dim"}, &which))
      spec_.hidden_size = r_.positive_int(*v, which, kMaxHiddenSize);
    if (const json* v =
            get_any(cfg_, {"num_hidden_layers", "n_layer", "n_layers", "num_layers"}, &which))
      spec_.num_hidden_layers = r_.positive_int(*v, which, kMaxLayers);
    if (const json* v = get_any(cfg_, {"max_position_embeddings", "n_positions", "max_seq_len"},
                                &which))
      spec_.max_position_embeddings = r_.positive_int64(*v, which, kMaxPositions);
    spec_.num_key_value_heads = spec_.num_attention_heads;
    if (const json* v = get_any(cfg_, {"num_key_value_heads", "num_kv_heads", "n_head_kv"}, &which))
      spec_.num_key_value_heads = r_.positive_int(*v, which, kMaxHeads);
  }

  void require_heads() {
    if (spec_.num_attention_heads <= 0)
      r_.fail("num_attention_heads",
              "required field missing (also read as n_head, n_heads, num_heads)");
    if (spec_.num_key_value_heads <= 0 ||
        spec_.num_attention_heads % spec_.num_key_value_heads != 0)
      r_.fail_value("num_key_value_heads",
                    fmt::format("must divide num_attention_heads {}", spec_.num_attention_heads),
                    spec_.num_key_value_heads);
  }

  void from_architecture() {
    using detail::ArchKind;
    const auto& a = *arch_;
    spec_.position_offset = a.position_offset;
    switch (a.kind) {
      case ArchKind::rope:
      case ArchKind::rope_deepseek:
      case ArchKind::mrope:
        read_rope();
        break;
      case ArchKind::chatglm: {
        // ChatGLM-6B (v1) shares model_type chatglm but rotates two position rows
        // (position_encoding_2d, GPT-NeoX style): not the v2/v3 rule below.
        if (const json* v1 = get(cfg_, "position_encoding_2d"); v1 && r_.boolean(*v1, field("position_encoding_2d")))
          r_.fail(field("position_encoding_2d"),
                  "ChatGLM-6B v1's 2-D rotary positions are not supported (ChatGLM2/3 and GLM-4 are)", *v1);
        // ChatGLMConfig: seq_length (default 2048) is the context; with
        // multi_query_attention, multi_query_group_num key/value heads.
        if (!spec_.max_position_embeddings)
          if (const json* v = get(cfg_, "seq_length"))
            spec_.max_position_embeddings = r_.positive_int64(*v, field("seq_length"), kMaxPositions);
        const json* mqa = get(cfg_, "multi_query_attention");
        if (mqa && r_.boolean(*mqa, field("multi_query_attention")))
          if (const json* g = get(cfg_, "multi_query_group_num")) {
            spec_.num_key_value_heads = r_.positive_int(*g, field("multi_query_group_num"), kMaxHeads);
            note(fmt::format("multi_query_attention: true → num_key_value_heads = multi_query_group_num {}",
                             spec_.num_key_value_heads));
          }
        read_rope();
        break;
      }
      case ArchKind::falcon: {
        const json* alibi = get(cfg_, "alibi");
        if (alibi && r_.boolean(*alibi, "alibi")) {
          read_alibi(AlibiSpec{AlibiConvention::bloom, 8.0, true},
                     "alibi: true → ALiBi, BLOOM slope convention, max_bias 8, slopes rounded to bfloat16 "
                     "(modeling_falcon.build_alibi_tensor casts them with .bfloat16())");
        } else {
          if (!spec_.max_position_embeddings) {
            spec_.max_position_embeddings = 2048;
            note("max_position_embeddings absent: FalconConfig default 2048");
          }
          read_rope();
        }
        // FalconAttention: num_kv_heads = config.num_kv_heads with the new
        // decoder architecture, else 1 if multi_query else num_attention_heads.
        const json* nda = get(cfg_, "new_decoder_architecture");
        const json* mq = get(cfg_, "multi_query");
        if (!(nda && r_.boolean(*nda, "new_decoder_architecture")) && mq &&
            r_.boolean(*mq, "multi_query")) {
          spec_.num_key_value_heads = 1;
          note("multi_query: true → num_key_value_heads 1");
        }
        break;
      }
      case ArchKind::alibi_bloom:
        read_alibi(AlibiSpec{AlibiConvention::bloom, 8.0}, "BLOOM: ALiBi, max_bias 8");
        break;
      case ArchKind::mpt: read_mpt(); break;
      case ArchKind::t5: read_t5(); break;
      case ArchKind::learned: read_learned(); break;
      case ArchKind::bert_like: {
        if (const json* pet = get(cfg_, "position_embedding_type")) {
          const std::string t = r_.string(*pet, "position_embedding_type");
          if (t != "absolute")
            r_.fail("position_embedding_type",
                    "only 'absolute' (a learned table) is supported", *pet);
        }
        read_learned();
        break;
      }
      case ArchKind::sinusoidal: read_sinusoidal(*a.sinusoidal); break;
      case ArchKind::maybe_sinusoidal: {
        const json* flag = get_any(cfg_, {"sinusoidal_pos_embds", "sinusoidal_embeddings"});
        if (flag && r_.boolean(*flag, a.model_type == "xlm" ? "sinusoidal_embeddings"
                                                             : "sinusoidal_pos_embds"))
          read_sinusoidal(*a.sinusoidal);
        else
          read_learned();
        break;
      }
    }
  }

  void from_fields_only() {
    const std::string who = fmt::format("model_type '{}' (architectures[0] '{}')",
                                        spec_.model_type, spec_.architecture);
    if (get_any(cfg_, {"rope_theta", "rope_scaling", "rope_parameters", "rotary_emb_base",
                       "rotary_pct", "partial_rotary_factor", "rotary_dim"})) {
      note(fmt::format("unknown {}: RoPE read from its rope fields; layout not implied "
                       "(posenc does not guess it)",
                       who));
      read_rope();
      return;
    }
    if (const json* alibi = get(cfg_, "alibi"); alibi && r_.boolean(*alibi, "alibi")) {
      read_alibi(AlibiSpec{AlibiConvention::bloom, 8.0},
                 fmt::format("unknown {}: alibi: true, BLOOM slope convention assumed", who));
      return;
    }
    if (get(cfg_, "relative_attention_num_buckets")) {
      note(fmt::format("unknown {}: T5 buckets read from relative_attention_*", who));
      read_t5();
      return;
    }
    if (const json* pet = get(cfg_, "position_embedding_type")) {
      if (r_.string(*pet, "position_embedding_type") == "absolute") {
        note(fmt::format("unknown {}: position_embedding_type absolute → learned table", who));
        read_learned();
        return;
      }
      r_.fail("position_embedding_type", "only 'absolute' (a learned table) is supported", *pet);
    }
    r_.fail("model_type",
            fmt::format("unknown architecture (architectures[0] '{}') and no positional field "
                        "(rope_theta, rope_scaling, rope_parameters, rotary_emb_base, alibi, "
                        "relative_attention_num_buckets, position_embedding_type)",
                        spec_.architecture),
            json(spec_.model_type));
  }

  // ---- RoPE ---------------------------------------------------------------

  void read_rope() {
    require_heads();
    RopeParams p;
    const bool deepseek = arch_ && arch_->kind == detail::ArchKind::rope_deepseek;
    spec_.family = (arch_ && arch_->kind == detail::ArchKind::mrope) ? PositionFamily::mrope
                                                                     : PositionFamily::rope;
    const bool chatglm = arch_ && arch_->kind == detail::ArchKind::chatglm;
    // ChatGLM reads no rope_scaling / rope_parameters (modeling_chatglm RotaryEmbedding): they are listed as
    // ignored (report_ignored_keys) and must not change the frequencies either.
    const ScalingDict sd = chatglm ? ScalingDict{} : find_scaling_dict(r_, cfg_);
    // head_dim
    if (chatglm && get(cfg_, "kv_channels")) {
      // modeling_chatglm: rotary_dim = kv_channels (else hidden_size // num_attention_heads).
      p.head_dim = r_.positive_int(*get(cfg_, "kv_channels"), field("kv_channels"), kMaxHeadDim);
      note(fmt::format("head_dim {}: kv_channels (ChatGLM)", p.head_dim));
    } else if (deepseek) {
      const json* v = get(cfg_, "qk_rope_head_dim");
      if (!v) r_.fail("qk_rope_head_dim", "required field missing for DeepSeek MLA");
      p.head_dim = r_.positive_int(*v, "qk_rope_head_dim", kMaxHeadDim);
      if (const json* nope = get(cfg_, "qk_nope_head_dim"))
        spec_.qk_head_dim = static_cast<int>(checked_add<ConfigError>(
            p.head_dim, r_.positive_int(*nope, "qk_nope_head_dim", kMaxHeadDim), "qk_nope_head_dim + qk_rope_head_dim"));
      note(fmt::format("head_dim {}: qk_rope_head_dim, the rotary part of DeepSeek's MLA heads",
                       p.head_dim));
    } else if (const json* hd = get(cfg_, "head_dim")) {
      p.head_dim = r_.positive_int(*hd, "head_dim", kMaxHeadDim);
      if (spec_.hidden_size > 0 &&
          spec_.hidden_size != checked_mul<ConfigError>(p.head_dim, spec_.num_attention_heads,
                                                        "head_dim × num_attention_heads"))
        note(fmt::format("head_dim {} explicit (hidden_size/num_attention_heads = {}/{} would "
                         "give {})",
                         p.head_dim, spec_.hidden_size, spec_.num_attention_heads,
                         static_cast<double>(spec_.hidden_size) / spec_.num_attention_heads));
    } else {
      if (spec_.hidden_size <= 0)
        r_.fail("hidden_size",
                "required field missing (needed for head_dim = hidden_size / num_attention_heads; "
                "also read as n_embd, d_model)");
      if (spec_.hidden_size % spec_.num_attention_heads != 0)
        r_.fail_value("hidden_size",
                      fmt::format("not divisible by num_attention_heads {} and no head_dim given",
                                  spec_.num_attention_heads),
                      spec_.hidden_size);
      p.head_dim = spec_.hidden_size / spec_.num_attention_heads;
      if (p.head_dim > kMaxHeadDim)
        r_.fail_value("hidden_size",
                      fmt::format("hidden_size / num_attention_heads = {} / {} = {} exceeds the head_dim bound {}",
                                  spec_.hidden_size, spec_.num_attention_heads, p.head_dim, kMaxHeadDim),
                      spec_.hidden_size);
    }

    // rope_theta
    const json* theta_top = get(cfg_, "rope_theta");
    const json* theta_in = sd.dict ? get(*sd.dict, "rope_theta") : nullptr;
    if (theta_in && theta_top &&
        r_.number(*theta_in, sd.name + ".rope_theta") != r_.number(*theta_top, "rope_theta"))
      r_.fail(sd.name + ".rope_theta",
              fmt::format("disagrees with top-level rope_theta {}", ConfigReader::show(*theta_top)),
              *theta_in);
    if (chatglm) {
      // RotaryEmbedding.forward_impl: base = 10000 * rope_ratio (ChatGLMConfig rope_ratio default 1).
      double ratio = 1.0;
      if (const json* rr = get(cfg_, "rope_ratio")) ratio = r_.positive(*rr, field("rope_ratio"));
      p.rope_theta = 10000.0 * ratio;
      note(fmt::format("rope_theta {}: 10000 × rope_ratio {} (modeling_chatglm RotaryEmbedding)", p.rope_theta,
                       ratio));
    } else if (theta_in) {
      p.rope_theta = r_.positive(*theta_in, sd.name + ".rope_theta");
    } else if (theta_top) {
      p.rope_theta = r_.positive(*theta_top, "rope_theta");
    } else if (const json* base = get(cfg_, "rotary_emb_base")) {
      p.rope_theta = r_.positive(*base, "rotary_emb_base");
    } else {
      p.rope_theta = 10000.0;
      note("rope_theta absent: default 10000 (the default of Hugging Face's RoPE configs)");
    }

    // rotary_dim. Proportional RoPE (Gemma 4) always spans head_dim and reads
    // partial_rotary_factor as the share of non-zero frequencies instead.
    const bool proportional = sd.dict && read_rope_type(r_, sd) == "proportional";
    const json* prf_in = sd.dict ? get(*sd.dict, "partial_rotary_factor") : nullptr;
    std::string which;
    if (chatglm) {
      // RotaryEmbedding(rotary_dim // 2): rotates the first half of each head.
      p.rotary_dim = p.head_dim / 2;
      if (p.rotary_dim < 2 || p.rotary_dim % 2 != 0)
        r_.fail_value(field("kv_channels"), "ChatGLM rotates kv_channels / 2 channels, which must be even and >= 2",
                      p.head_dim);
      note(fmt::format("rotary_dim {} of head_dim {}: ChatGLM's RotaryEmbedding(kv_channels // 2)", p.rotary_dim,
                       p.head_dim));
    } else if (const json* rd = get(cfg_, "rotary_dim")) {
      p.rotary_dim = r_.positive_int(*rd, "rotary_dim", kMaxHeadDim);
    } else if (const json* f = prf_in ? prf_in
                                      : get_any(cfg_, {"partial_rotary_factor", "rotary_pct"},
                                                &which)) {
      const std::string field = prf_in ? sd.name + ".partial_rotary_factor" : which;
      const double frac = r_.number(*f, field);
      if (!(frac > 0 && frac <= 1)) r_.fail(field, "must be in (0, 1]", *f);
      if (proportional) {
        p.partial_rotary_factor = frac;
        p.rotary_dim = p.head_dim;
      } else {
        p.rotary_dim = static_cast<int>(p.head_dim * frac);  // Python int(): truncation
        if (p.rotary_dim < 2 || p.rotary_dim % 2 != 0)
          r_.fail_value(field,
                        fmt::format("int(head_dim {} × {}) = {} is not an even number >= 2",
                                    p.head_dim, frac, p.rotary_dim),
                        frac);
      }
    } else if (arch_ && arch_->default_partial_rotary_factor != 1.0) {
      // GlmConfig(partial_rotary_factor=0.5): the default when the file has none.
      p.rotary_dim = static_cast<int>(p.head_dim * arch_->default_partial_rotary_factor);
      note(fmt::format("rotary_dim {} = head_dim {} × {}: partial_rotary_factor absent, {}'s default", p.rotary_dim,
                       p.head_dim, arch_->default_partial_rotary_factor, arch_->model_type));
    } else {
      p.rotary_dim = p.head_dim;
    }
    if (p.rotary_dim == p.head_dim && p.head_dim % 2 != 0 && !get(cfg_, "rotary_dim"))
      r_.fail_value("head_dim",
                    "must be even: RoPE turns channels in pairs, and here the whole head turns (no "
                    "partial_rotary_factor or rotary_dim below it)",
                    p.head_dim);
    if (p.rotary_dim % 2 != 0 || p.rotary_dim > p.head_dim)
      r_.fail_value("rotary_dim", fmt::format("must be even and <= head_dim {}", p.head_dim),
                    p.rotary_dim);

    p.max_position_embeddings = spec_.max_position_embeddings;
    if (const json* o = get(cfg_, "original_max_position_embeddings"))
      p.original_max_position_embeddings =
          r_.positive_int64(*o, "original_max_position_embeddings", kMaxPositions);

    p.rope_type = "default";
    if (sd.dict) read_scaling(sd, p);
    if (p.rope_type == "default" && !get(cfg_, "rotary_dim") && p.rotary_dim != p.head_dim &&
        arch_ && arch_->model_type == "llama") {
      // HF LlamaRotaryEmbedding.compute_default_rope_parameters ignores
      // partial_rotary_factor (golden case default_llama_ignores_partial_rotary_factor).
      ignore("partial_rotary_factor",
             fmt::format("Llama's default RoPE rotates all {} channels "
                         "(LlamaRotaryEmbedding.compute_default_rope_parameters)",
                         p.head_dim));
      p.rotary_dim = p.head_dim;
    }
    if (spec_.family == PositionFamily::mrope && arch_ && arch_->model_type.starts_with("qwen3_vl")) {
      // HF Qwen3VLTextRotaryEmbedding: mrope_section = rope_scaling.get("mrope_section",
      // [24, 20, 20]), and forward always calls apply_interleaved_mrope (the
      // config's mrope_interleaved key is not consulted).
      if (spec_.mrope_section.empty()) {
        spec_.mrope_section = {24, 20, 20};
        if (p.rotary_dim / 2 != 64)
          r_.fail(sd.dict ? sd.name + ".mrope_section" : std::string("rope_scaling.mrope_section"),
                  fmt::format("missing: Qwen3-VL's default [24, 20, 20] sums to 64, but rotary_dim/2 = {}",
                              p.rotary_dim / 2));
        note("mrope_section [24, 20, 20]: Qwen3-VL's default (Qwen3VLTextRotaryEmbedding)");
      }
      if (!spec_.mrope_interleaved)
        note("mrope_interleaved: Qwen3-VL always interleaves (apply_interleaved_mrope)");
      spec_.mrope_interleaved = true;
    }
    if (spec_.family == PositionFamily::mrope && spec_.mrope_interleaved && spec_.mrope_section.size() == 3) {
      try {  // the cycle must give h and w their budgets within rotary_dim/2 pairs
        (void)mrope_pair_rows(spec_.mrope_section, p.rotary_dim / 2, MropeMapping::interleaved);
      } catch (const ConfigError& e) {
        r_.fail(sd.dict ? sd.name + ".mrope_section" : std::string("rope_scaling.mrope_section"), e.what());
      }
    }
    if (spec_.family == PositionFamily::mrope && spec_.mrope_section.empty())
      r_.fail(sd.dict ? sd.name + ".mrope_section" : std::string("rope_scaling.mrope_section"),
              fmt::format("required for MRoPE (model_type '{}') but missing", spec_.model_type));

    // layout
    if (arch_ && arch_->layout) {
      spec_.layout = arch_->layout;
      if (deepseek) {
        bool interleave = true;  // DeepseekV3Config.rope_interleave default
        if (const json* ri = get(cfg_, "rope_interleave"))
          interleave = r_.boolean(*ri, "rope_interleave");
        if (interleave) {
          spec_.layout = RopeLayout::interleaved;
          spec_.rope_output_half_order = true;
          note("layout interleaved_in_half_out: HF apply_rotary_pos_emb_interleave pairs "
               "channels (2i, 2i+1) and writes the result in rotate_half order; q·k equals the "
               "interleaved rotation's");
        } else {
          spec_.layout = RopeLayout::half;
          note("layout half: rope_interleave false → apply_rotary_pos_emb (rotate_half)");
        }
      } else {
        note(fmt::format("layout {}: model_type '{}' uses {}", to_string(*spec_.layout),
                         arch_->model_type, arch_->layout_reason));
      }
    }
    if (deepseek && spec_.qk_head_dim && p.rope_type != "default" && p.mscale_all_dim &&
        *p.mscale_all_dim != 0 && p.factor) {
      const double g = *p.factor <= 1 ? 1.0 : 0.1 * *p.mscale_all_dim * std::log(*p.factor) + 1.0;
      spec_.softmax_scale = std::pow(static_cast<double>(*spec_.qk_head_dim), -0.5) * g * g;
      note(fmt::format("softmax_scale {:.9g} = qk_head_dim {}^-0.5 × (0.1·mscale_all_dim·ln(factor) "
                       "+ 1)^2 (DeepseekV3Attention)",
                       *spec_.softmax_scale, *spec_.qk_head_dim));
    }
    if (get(cfg_, "rope_local_base_freq"))
      ignore("rope_local_base_freq",
             "Gemma-3's sliding layers use default RoPE with this theta; this spec describes the global layers "
             "(rope_theta and rope_scaling)");
    if (const json* xl = get(cfg_, "cross_attention_layers"); xl && xl->is_array() && !xl->empty())
      note(fmt::format("{}: {} layers attend to the image tokens without RoPE (MllamaTextCrossAttention); "
                       "this spec describes the self-attention layers",
                       field("cross_attention_layers"), xl->size()));
    if (arch_ && (arch_->model_type == "llama4" || arch_->model_type == "llama4_text")) {
      // Llama4TextConfig: no_rope_layers[i] = 0 marks a NoPE layer; absent, every
      // no_rope_layer_interval-th layer (default 4) has no RoPE. RoPE layers attend in
      // chunks of attention_chunk_size.
      if (get(cfg_, "no_rope_layers"))
        note(fmt::format("{}: Llama-4 skips RoPE on the layers marked 0 (NoPE layers); this spec describes the "
                         "RoPE layers",
                         field("no_rope_layers")));
      else
        note("no_rope_layers absent: Llama4TextConfig makes every no_rope_layer_interval-th layer (default 4: "
             "layers 3, 7, 11, ...) a NoPE layer; this spec describes the RoPE layers");
      if (const json* c = get(cfg_, "attention_chunk_size"))
        note(fmt::format("{} {}: the RoPE layers attend within chunks of that many tokens (chunked attention)",
                         field("attention_chunk_size"), ConfigReader::show(*c)));
    }
    spec_.rope = std::move(p);
    check_with_registry();
  }

  void read_scaling(const ScalingDict& sd, RopeParams& p) {
    const json& d = *sd.dict;
    std::string rope_type = read_rope_type(r_, sd);
    const std::string type_field = ConfigReader::path(sd.name, get(d, "rope_type") ? "rope_type" : "type");
    const bool mrope_alias = rope_type == "mrope";
    if (mrope_alias) {
      // HF Qwen2VLConfig / Qwen2_5_VLConfig: type mrope → default (+ mrope_section).
      // No other config class maps it; ROPE_INIT_FUNCTIONS has no 'mrope'.
      if (arch_ && arch_->kind != detail::ArchKind::mrope)
        r_.fail(type_field,
                fmt::format("'mrope' is an alias Hugging Face accepts only for the Qwen2-VL family "
                            "(Qwen2VLConfig maps it to default RoPE); model_type '{}' does not",
                            arch_->model_type),
                json(rope_type));
      rope_type = "default";
      note(fmt::format("{} 'mrope': default RoPE with three position rows (Qwen2VLConfig's alias)", type_field));
    }
    const bool phi3_family = arch_ && (arch_->model_type == "phi3" || arch_->model_type == "phi4mm" ||
                                       arch_->model_type == "phi4_multimodal");
    if (rope_type == "su" || (rope_type == "yarn" && phi3_family)) {
      // Phi3Config.convert_rope_params_to_dict: "For backward compatibility if previous
      // version used 'su' or 'yarn'" → longrope. Only the Phi-3 config classes do it.
      if (arch_ && !phi3_family)
        r_.fail(type_field,
                fmt::format("'su' is an alias of longrope that Hugging Face accepts only for Phi-3 / "
                            "Phi-4-multimodal (Phi3Config); model_type '{}' does not",
                            arch_->model_type),
                json(rope_type));
      note(fmt::format("{} '{}' read as 'longrope' (Phi3Config's backward-compatible alias)", type_field,
                       rope_type));
      rope_type = "longrope";
    }
    const TypeKeys* keys = find_type_keys(rope_type);
    if (keys == nullptr && !is_registered(rope_type))
      r_.fail(type_field,
              fmt::format("unknown RoPE scaling '{}' (known: {}; 'mrope' is read as default "
                          "RoPE with mrope_section)",
                          rope_type, known_rope_types()),
              json(rope_type));
    p.rope_type = rope_type;

    // Which keys may appear.
    std::set<std::string_view> allowed{"rope_type", "type"};
    // transformers >= 4.53 re-saves Qwen2.5-VL with both keys ({"rope_type": "default", "type": "default"}).
    if (sd.name == "rope_parameters") {
      allowed.insert("rope_theta");
      allowed.insert("partial_rotary_factor");
    }
    if (rope_type == "default") {
      allowed.insert("mrope_section");
      allowed.insert("mrope_interleaved");  // Qwen3-VL configs
    }
    if (keys) {
      allowed.insert(keys->allowed.begin(), keys->allowed.end());
    } else {  // registered by another module, schema unknown here: accept every known key
      for (const auto& t : type_keys()) allowed.insert(t.allowed.begin(), t.allowed.end());
    }
    for (auto it = d.begin(); it != d.end(); ++it) {
      if (allowed.count(it.key())) continue;
      const std::string field = ConfigReader::path(sd.name, it.key());
      if (r_.options().lenient) {
        spec_.ignored_keys.push_back(field);
        note(fmt::format("{} ignored (lenient)", field));
        continue;
      }
      std::vector<std::string_view> list(allowed.begin(), allowed.end());
      r_.fail(field,
              fmt::format("not a parameter of rope_type '{}' (allowed: {}; set lenient to "
                          "ignore unknown keys)",
                          rope_type, fmt::join(list, ", ")),
              *it);
    }
    if (keys)
      for (auto req : keys->required)
        if (!get(d, req))
          r_.fail(ConfigReader::path(sd.name, req),
                  fmt::format("required for rope_type '{}' but missing", rope_type));

    auto field = [&](std::string_view key) { return ConfigReader::path(sd.name, key); };
    if (const json* v = get(d, "factor")) {
      p.factor = r_.number(*v, field("factor"));
      // Far outside every published factor (1 to 128); 1e300 gave NaN frequencies that named no field, 1e-300
      // infinite ones (the bounds of --rope-factor).
      if (!(*p.factor >= config_limits::kMinRopeFactor && *p.factor <= config_limits::kMaxRopeFactor))
        r_.fail(field("factor"),
                fmt::format("must be in [{:g}, {:g}]", config_limits::kMinRopeFactor, config_limits::kMaxRopeFactor),
                *v);
    }
    if (const json* v = get(d, "original_max_position_embeddings")) {
      const int64_t o = r_.positive_int64(*v, field("original_max_position_embeddings"), kMaxPositions);
      if (p.original_max_position_embeddings && *p.original_max_position_embeddings != o)
        r_.fail(field("original_max_position_embeddings"),
                fmt::format("disagrees with top-level original_max_position_embeddings {}",
                            *p.original_max_position_embeddings),
                *v);
      p.original_max_position_embeddings = o;
    }
    if (const json* v = get(d, "attention_factor"))
      p.attention_factor = r_.positive(*v, field("attention_factor"));
    if (const json* v = get(d, "beta_fast")) p.beta_fast = r_.number(*v, field("beta_fast"));
    if (const json* v = get(d, "beta_slow")) p.beta_slow = r_.number(*v, field("beta_slow"));
    if (const json* v = get(d, "mscale")) p.mscale = r_.number(*v, field("mscale"));
    if (const json* v = get(d, "mscale_all_dim"))
      p.mscale_all_dim = r_.number(*v, field("mscale_all_dim"));
    if (const json* v = get(d, "truncate")) p.truncate = r_.boolean(*v, field("truncate"));
    if (const json* v = get(d, "low_freq_factor"))
      p.low_freq_factor = r_.positive(*v, field("low_freq_factor"));
    if (const json* v = get(d, "high_freq_factor"))
      p.high_freq_factor = r_.positive(*v, field("high_freq_factor"));
    // Equal factors are Llama 4's (HF _validate_llama3_parameters only warns): a step, no smooth band.
    if (p.low_freq_factor && p.high_freq_factor && *p.high_freq_factor < *p.low_freq_factor)
      r_.fail_value(field("high_freq_factor"),
                    fmt::format("must be >= low_freq_factor {}", *p.low_freq_factor),
                    *p.high_freq_factor);
    const std::size_t half = static_cast<std::size_t>(p.rotary_dim / 2);
    for (auto key : {"short_factor", "long_factor"}) {
      const json* v = get(d, key);
      if (!v) continue;
      auto list = r_.positive_list(*v, field(key));
      if (list.size() != half)
        r_.fail_value(field(key),
                      fmt::format("must have rotary_dim/2 = {} entries (rotary_dim {})", half,
                                  p.rotary_dim),
                      fmt::format("{} entries", list.size()));
      (std::string_view(key) == "short_factor" ? p.short_factor : p.long_factor) = std::move(list);
    }
    if (rope_type == "llama3" && !p.original_max_position_embeddings)
      r_.fail(field("original_max_position_embeddings"), "required for rope_type 'llama3' but missing");

    const json* ms = get(d, "mrope_section");
    if (ms && arch_ && arch_->kind != detail::ArchKind::mrope) {
      // Only the Qwen2-VL config classes read it (rope_config_validation(ignore_keys={"mrope_section"}));
      // a Llama-family model runs one position row whatever the dict says.
      ignore(sd.name + ".mrope_section",
             fmt::format("model_type '{}' runs 1-D RoPE; only the Qwen2-VL family reads mrope_section",
                         arch_->model_type));
      ms = nullptr;
    }
    if (ms) {
      if (!ms->is_array() || ms->empty())
        r_.fail(field("mrope_section"), "must be a list of positive integers", *ms);
      if (ms->size() != 3)  // Qwen2-VL's apply_multimodal_rotary_pos_emb: one section per row (t, h, w)
        r_.fail(field("mrope_section"), fmt::format("must have 3 entries (t, h, w), got {}", ms->size()), *ms);
      int64_t sum = 0;  // int64 of entries <= kMaxHeadDim: no overflow for any list a file can hold
      for (std::size_t i = 0; i < ms->size(); ++i) {
        const int s = r_.positive_int((*ms)[i], fmt::format("{}[{}]", field("mrope_section"), i), kMaxHeadDim);
        spec_.mrope_section.push_back(s);
        sum = checked_add<ConfigError>(sum, s, field("mrope_section"));
      }
      if (static_cast<std::size_t>(sum) != half)
        r_.fail(field("mrope_section"),
                fmt::format("must sum to rotary_dim/2 = {} (sums to {})", half, sum), *ms);
      spec_.family = PositionFamily::mrope;
    } else if (mrope_alias) {
      r_.fail(field("mrope_section"), "required for MRoPE but missing");
    }
    if (const json* mi = get(d, "mrope_interleaved")) {
      spec_.mrope_interleaved = r_.boolean(*mi, field("mrope_interleaved"));
      if (spec_.mrope_interleaved && spec_.mrope_section.empty() &&
          !(arch_ && arch_->model_type.starts_with("qwen3_vl")))
        r_.fail(field("mrope_section"), "required with mrope_interleaved but missing");
    }
  }

  /// Runs the registry once when it knows the method, so that method-specific
  /// errors surface at load time, prefixed with the source.
  void check_with_registry() {
    const RopeParams& p = *spec_.rope;
    if (!is_registered(p.rope_type)) {
      note(fmt::format("rope_type '{}' is not registered in this build: parameters parsed, "
                       "frequencies not computable",
                       p.rope_type));
      return;
    }
    try {
      (void)compute_rope_frequencies(p);
    } catch (const Error& e) {
      throw ConfigError(fmt::format("{}: {}", spec_.source, e.what()));
    }
  }

  // ---- biases and absolute tables ------------------------------------------

  void read_alibi(AlibiSpec a, std::string why) {
    require_heads();
    spec_.family = PositionFamily::alibi;
    spec_.alibi = a;
    note(std::move(why));
  }

  void read_mpt() {
    const json* ac = get(cfg_, "attn_config");
    if (ac && !ac->is_object()) r_.fail("attn_config", "must be an object", *ac);
    bool alibi = true;  // MptAttentionConfig default
    if (const json* v = ac ? get(*ac, "alibi") : nullptr) alibi = r_.boolean(*v, "attn_config.alibi");
    if (alibi) {
      AlibiSpec a{AlibiConvention::mpt, 8.0};
      if (const json* v = ac ? get(*ac, "alibi_bias_max") : nullptr)
        a.max_bias = r_.positive(*v, "attn_config.alibi_bias_max");
      read_alibi(a, fmt::format("attn_config.alibi: true → ALiBi, MPT slope convention, "
                                "alibi_bias_max {}; learned_pos_emb is not used with ALiBi",
                                a.max_bias));
    } else {
      note("attn_config.alibi: false → learned position table of max_seq_len rows");
      read_learned();
    }
  }

  void read_t5() {
    require_heads();
    spec_.family = PositionFamily::t5_bias;
    T5BiasSpec t;
    if (const json* v = get(cfg_, "relative_attention_num_buckets"))
      t.relative_attention_num_buckets = r_.positive_int(*v, "relative_attention_num_buckets", kMaxT5Buckets);
    if (const json* v = get(cfg_, "relative_attention_max_distance"))
      t.relative_attention_max_distance = r_.positive_int(*v, "relative_attention_max_distance", kMaxT5Distance);
    if (t.relative_attention_num_buckets < 4)
      r_.fail_value("relative_attention_num_buckets",
                    "must be >= 4 (bidirectional encoder buckets)",
                    t.relative_attention_num_buckets);
    // The causal (decoder) buckets have max_exact = num_buckets/2 exact offsets.
    if (t.relative_attention_max_distance <= t.relative_attention_num_buckets / 2)
      r_.fail_value("relative_attention_max_distance",
                    fmt::format("must exceed relative_attention_num_buckets/2 = {}",
                                t.relative_attention_num_buckets / 2),
                    t.relative_attention_max_distance);
    if (const json* v = get(cfg_, "is_encoder_decoder"))
      t.is_encoder_decoder = r_.boolean(*v, "is_encoder_decoder");
    spec_.t5 = t;
    if (spec_.max_position_embeddings)
      note(fmt::format("n_positions {} is informational: relative buckets have no table limit",
                       *spec_.max_position_embeddings));
  }

  void read_learned() {
    spec_.family = PositionFamily::learned_absolute;
    if (!spec_.max_position_embeddings)
      r_.fail("max_position_embeddings",
              "required field missing for a learned position table (also read as n_positions, "
              "max_seq_len)");
    if (spec_.position_offset != 0) {
      if (arch_ && (arch_->model_type == "roberta" || arch_->model_type == "xlm-roberta")) {
        if (const json* pad = get(cfg_, "pad_token_id")) {
          const int64_t pad_id = r_.bounded_int64(*pad, "pad_token_id", 0, kMaxVocab - 1);
          spec_.position_offset = static_cast<int>(checked_add<ConfigError>(pad_id, 1, "pad_token_id + 1"));
        }
        note(fmt::format("positions start at padding_idx + 1 = {}", spec_.position_offset));
      } else {
        note(fmt::format("position ids are offset by {} into the table", spec_.position_offset));
      }
    }
  }

  void read_sinusoidal(SinusoidalLayout layout) {
    spec_.family = PositionFamily::sinusoidal;
    spec_.sinusoidal_layout = layout;
    if (spec_.hidden_size <= 0) r_.fail("d_model", "required field missing for a sinusoidal table");
  }

  // ---- sliding window -------------------------------------------------------

  void read_sliding_window() {
    SlidingWindowSpec& sw = spec_.sliding_window;
    if (const json* v = get(cfg_, "sliding_window")) {
      // Some configs carry `false` (e.g. sliding disabled); treat as absent.
      if (!(v->is_boolean() && !v->get<bool>())) sw.size = r_.positive_int64(*v, "sliding_window", kMaxPositions);
    }
    const int n = spec_.num_hidden_layers;
    if (const json* lt = get(cfg_, "layer_types")) {
      if (!lt->is_array()) r_.fail("layer_types", "must be a list of strings", *lt);
      if (n > 0 && static_cast<int>(lt->size()) != n)
        r_.fail_value("layer_types", fmt::format("must have num_hidden_layers = {} entries", n),
                      fmt::format("{} entries", lt->size()));
      for (std::size_t i = 0; i < lt->size(); ++i) {
        const std::string field = fmt::format("layer_types[{}]", i);
        const std::string t = r_.string((*lt)[i], field);
        if (t == "sliding_attention")
          sw.layer_is_sliding.push_back(true);
        else if (t == "full_attention")
          sw.layer_is_sliding.push_back(false);
        else
          r_.fail(field, "expected 'sliding_attention' or 'full_attention'", (*lt)[i]);
      }
      const bool any = std::find(sw.layer_is_sliding.begin(), sw.layer_is_sliding.end(), true) !=
                       sw.layer_is_sliding.end();
      if (any && !sw.size) r_.fail("sliding_window", "required when layer_types has sliding layers");
      sw.active = any;
      sw.source = "layer_types";
      return;
    }
    if (!sw.size) {
      sw.source = "no sliding_window";
      return;
    }
    using detail::SlidingRule;
    const SlidingRule rule = arch_ ? arch_->sliding : SlidingRule::all_layers;
    std::optional<bool> use;
    if (const json* u = get(cfg_, "use_sliding_window"))
      use = r_.boolean(*u, "use_sliding_window");
    auto fill = [&](auto pred) {
      sw.layer_is_sliding.clear();
      for (int i = 0; i < n; ++i) sw.layer_is_sliding.push_back(pred(i));
    };
    switch (rule) {
      case SlidingRule::none:
        sw.active = false;
        sw.source = fmt::format("sliding_window present but model_type '{}' does not use it",
                                arch_->model_type);
        return;
      case SlidingRule::qwen: {
        if (!use.value_or(false)) {
          sw.active = false;
          sw.source = "use_sliding_window false: the window is not used";
          return;
        }
        int mwl = 0;
        if (const json* v = get(cfg_, "max_window_layers"))
          mwl = r_.bounded_int(*v, "max_window_layers", 0, kMaxLayers);
        fill([&](int i) { return i >= mwl; });
        sw.active = n == 0 || mwl < n;
        sw.source = fmt::format("use_sliding_window: layers >= max_window_layers {}", mwl);
        return;
      }
      case SlidingRule::gemma2_alternate:
        fill([](int i) { return (i + 1) % 2 != 0; });
        sw.active = true;
        sw.source = "Gemma-2: even layers sliding, odd layers global (implied by model_type)";
        return;
      case SlidingRule::gemma3_pattern: {
        int pattern = 6;
        if (const json* v = get(cfg_, "sliding_window_pattern"))
          pattern = r_.positive_int(*v, "sliding_window_pattern", kMaxLayers);
        fill([&](int i) { return (i + 1) % pattern != 0; });
        sw.active = true;
        sw.source = fmt::format("Gemma-3: every layer but each {}th is sliding", pattern);
        return;
      }
      case SlidingRule::all_layers:
        if (use && !*use) {
          sw.active = false;
          sw.source = "use_sliding_window false: the window is not used";
          return;
        }
        fill([](int) { return true; });
        sw.active = true;
        sw.source = arch_ ? "every layer" : "every layer (assumed: architecture unknown)";
        if (spec_.max_position_embeddings && *sw.size >= *spec_.max_position_embeddings)
          sw.source += fmt::format("; window {} >= max_position_embeddings {}, so it never binds",
                                   *sw.size, *spec_.max_position_embeddings);
        return;
    }
  }

  json cfg_;  ///< the config, with text_config's keys merged in where the top level lacks them
  ConfigReader r_;
  PositionalSpec spec_;
  const detail::ArchTraits* arch_ = nullptr;
  std::set<std::string> from_text_config_;
  std::string text_model_type_;  ///< text_config.model_type ("" when absent)
};

}  // namespace

PositionalSpec parse_positional_spec(std::string_view json_text, std::string_view source,
                                     const ConfigOptions& options) {
  json cfg;
  try {
    cfg = json::parse(json_text.begin(), json_text.end());
  } catch (const json::parse_error& e) {
    throw ConfigError(
        fmt::format("{}: malformed JSON at byte {}: {}", source, e.byte, e.what()));
  } catch (const json::exception& e) {  // e.g. out_of_range 406: a number like 1e999 overflows a double
    // nlohmann's message names the number, not its key: the key path, from a second parse that tracks it.
    const std::string path = json_failure_path(json_text);
    throw ConfigError(fmt::format("{}: {}{}unusable JSON value: {}", source, path, path.empty() ? "" : ": ", e.what()));
  }
  return Parser(cfg, std::string(source), options).run();
}

PositionalSpec load_positional_spec(const std::filesystem::path& path, const ConfigOptions& options) {
  const std::string text = read_file(path);
  return parse_positional_spec(text, path.string(), options);
}

std::string_view supported_decoder_architectures() {
  return "LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM";
}

DecoderSpec parse_decoder_spec(std::string_view json_text, std::string_view source) {
  DecoderSpec d;
  d.positional = parse_positional_spec(json_text, source);
  const json cfg = json::parse(json_text.begin(), json_text.end());  // valid: parse_positional_spec read it
  const ConfigReader r{std::string(source), ConfigOptions{}};
  const PositionalSpec& ps = d.positional;
  d.architecture = !ps.architecture.empty() ? ps.architecture : ps.model_type;
  enum class Kind { llama, mistral, qwen2, qwen3 };
  Kind kind;
  const std::string& a = ps.architecture;
  const std::string& mt = ps.model_type;
  if (a == "LlamaForCausalLM" || (a.empty() && mt == "llama"))
    kind = Kind::llama;
  else if (a == "MistralForCausalLM" || (a.empty() && mt == "mistral"))
    kind = Kind::mistral;
  else if (a == "Qwen2ForCausalLM" || (a.empty() && mt == "qwen2"))
    kind = Kind::qwen2;
  else if (a == "Qwen3ForCausalLM" || (a.empty() && mt == "qwen3"))
    kind = Kind::qwen3;
  else
    throw ConfigError(fmt::format("{}: {}: {} is not supported yet (the runtime runs {})", source,
                                  a.empty() ? "model_type" : "architectures", d.architecture.empty() ? "(none)" : d.architecture,
                                  supported_decoder_architectures()));
  // transformers' Auto classes build the model from model_type, other runtimes
  // (vLLM, TGI) from architectures: when they name different models the
  // config is ambiguous, and running either would be a guess.
  static constexpr std::string_view kModelType[] = {"llama", "mistral", "qwen2", "qwen3"};
  if (!a.empty() && !mt.empty() && mt != kModelType[static_cast<int>(kind)])
    r.fail_value("model_type",
                 fmt::format("disagrees with architectures {} (model_type {} expected): transformers would build "
                             "another model than the architecture names",
                             a, kModelType[static_cast<int>(kind)]),
                 mt);
  if (ps.family != PositionFamily::rope || !ps.rope)
    r.fail_value("rope", "the runtime runs RoPE decoders; this config's positions are", to_string(ps.family));
  auto required = [&](std::string_view key, int64_t hi) {
    const json* v = get(cfg, key);
    if (v == nullptr) r.fail(key, "required field missing");
    return r.positive_int(*v, key, hi);
  };
  d.hidden_size = required("hidden_size", kMaxHiddenSize);
  d.intermediate_size = required("intermediate_size", kMaxIntermediateSize);
  d.num_hidden_layers = required("num_hidden_layers", kMaxLayers);
  d.num_attention_heads = required("num_attention_heads", kMaxHeads);
  d.vocab_size = required("vocab_size", kMaxVocab);
  d.num_key_value_heads = ps.num_key_value_heads > 0 ? ps.num_key_value_heads : d.num_attention_heads;
  d.head_dim = ps.rope->head_dim;
  if (const json* v = get(cfg, "rms_norm_eps")) d.rms_norm_eps = r.positive(*v, "rms_norm_eps");
  if (const json* v = get(cfg, "tie_word_embeddings")) d.tie_word_embeddings = r.boolean(*v, "tie_word_embeddings");
  if (const json* v = get(cfg, "hidden_act")) {
    const std::string act = r.string(*v, "hidden_act");
    if (act != "silu" && act != "swish") r.fail(std::string_view("hidden_act"), "the runtime runs SwiGLU (silu) MLPs", *v);
  }
  if (const json* v = get(cfg, "torch_dtype")) d.torch_dtype = r.string(*v, "torch_dtype");
  const json* attention_bias = get(cfg, "attention_bias");
  const bool ab = attention_bias != nullptr && r.boolean(*attention_bias, "attention_bias");
  switch (kind) {
    case Kind::llama:
      d.qkv_bias = d.o_bias = ab;
      if (const json* v = get(cfg, "mlp_bias")) d.mlp_bias = r.boolean(*v, "mlp_bias");
      break;
    case Kind::mistral: break;
    case Kind::qwen2: d.qkv_bias = true; break;
    case Kind::qwen3:
      d.qkv_bias = d.o_bias = ab;
      d.qk_norm = true;
      break;
  }
  return d;
}

}  // namespace posenc
