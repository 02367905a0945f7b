// The JSON object of `posenc inspect --json` (posenc/inspect_json.hpp), moved here from
// tools/posenc/inspect.cpp so that the Python package returns the same dict.
#include "posenc/inspect_json.hpp"

#include <string>

namespace posenc {

namespace {

using ojson = nlohmann::ordered_json;

ojson sliding_json(const SlidingWindowSpec& sw) {
  ojson j = ojson::object();
  j["size"] = sw.size ? ojson(*sw.size) : ojson(nullptr);
  j["active"] = sw.active;
  j["layer_is_sliding"] = sw.layer_is_sliding;
  j["source"] = sw.source;
  return j;
}

}  // namespace

ojson rope_parameters_json(const RopeParams& p) {
  ojson j = ojson::object();
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

ojson inspect_json(const PositionalSpec& s, const std::optional<RopeInspection>& ins) {
  ojson j = ojson::object();
  j["family"] = std::string(to_string(s.family));
  if (s.rope && ins) {
    const RopeParams& p = *s.rope;
    j["rope_type"] = p.rope_type;
    j["rope_theta"] = p.rope_theta;
    j["head_dim"] = p.head_dim;
    j["rotary_dim"] = p.effective_rotary_dim();
    j["layout"] = layout_name(s);
    j["attention_factor"] = ins->frequencies.attention_factor;
    ojson inv = ojson::array();
    for (float f : ins->frequencies.inv_freq) inv.push_back(static_cast<double>(f));
    j["inv_freq"] = inv;
    ojson ch = ojson::array();
    for (const auto& c : ins->channels)
      ch.push_back(ojson{{"i", c.i},
                         {"inv_freq", c.inv_freq},
                         {"wavelength", c.wavelength},
                         {"rotations_original", c.rotations_original},
                         {"rotations_target", c.rotations_target},
                         {"wavelength_ratio", c.wavelength_ratio}});
    j["channels"] = ch;
    j["original_length"] = ins->original_length;
    j["seq_len"] = ins->target_length;
    j["rope_parameters"] = rope_parameters_json(p);
    if (s.qk_head_dim) j["qk_head_dim"] = *s.qk_head_dim;
    if (s.softmax_scale) j["softmax_scale"] = *s.softmax_scale;
    if (!s.mrope_section.empty()) j["mrope_section"] = s.mrope_section;
    if (s.mrope_interleaved) j["mrope_interleaved"] = true;
  }
  if (s.alibi) {
    j["alibi_convention"] = std::string(to_string(s.alibi->convention));
    j["max_bias"] = s.alibi->max_bias;
    j["slopes_dtype"] = s.alibi->bfloat16_slopes ? "bfloat16" : "float32";
    ojson slopes = ojson::array();
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
      s.max_position_embeddings ? ojson(*s.max_position_embeddings) : ojson(nullptr);
  j["sliding_window"] = sliding_json(s.sliding_window);
  j["ignored_keys"] = s.ignored_keys;
  j["notes"] = s.notes;
  return j;
}

}  // namespace posenc
