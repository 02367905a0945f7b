#include <algorithm>

#include <fmt/format.h>

#include "encoding/scaling/methods.hpp"

namespace posenc {

// HF modeling_rope_utils.dynamic_rope_update (dynamic_frequency_update,
// longrope_frequency_update) around LlamaRotaryEmbedding.__init__/forward.

RopeFrequencySchedule::RopeFrequencySchedule(RopeParams params) : params_(std::move(params)) {
  original_ = compute_rope_frequencies(params_);
  current_ = original_;
  dynamic_ = params_.rope_type == "dynamic";
  longrope_ = params_.rope_type == "longrope";
  if (dynamic_) {
    original_max_seq_len_ = detail::require_max_position_embeddings(params_);
  } else {
    original_max_seq_len_ = params_.max_position_embeddings.value_or(0);
  }
  if (longrope_) longrope_original_max_ = detail::original_max_position(params_);
  max_seq_len_cached_ = original_max_seq_len_;
}

void RopeFrequencySchedule::set_current(const RopeFrequencies& f) {
  if (!(f == current_)) {
    current_ = f;
    ++generation_;
  }
}

const RopeFrequencies& RopeFrequencySchedule::update(std::span<const int64_t> position_ids) {
  if (position_ids.empty())
    throw PositionError("position_ids: empty; a forward call needs at least one position");
  const int64_t max_pos = *std::max_element(position_ids.begin(), position_ids.end());
  const int64_t min_pos = *std::min_element(position_ids.begin(), position_ids.end());
  if (min_pos < 0) fail_field<PositionError>("position_ids", "must be non-negative", min_pos);
  return update_for_length(max_pos + 1);
}

const RopeFrequencies& RopeFrequencySchedule::update_for_length(int64_t seq_len) {
  if (seq_len <= 0) fail_field<PositionError>("seq_len", "must be positive", seq_len);
  if (dynamic_) {
    const int64_t cached_before = max_seq_len_cached_;
    if (seq_len > cached_before) {  // growth
      RopeFrequencies f =
          dynamic_ntk_frequencies(params_, seq_len, DynamicNtkArithmetic::tensor_float32);
      f.rope_type = original_.rope_type;
      f.validate();
      set_current(f);
      max_seq_len_cached_ = seq_len;
    }
    // HF compares against the cached length read before the growth step.
    if (seq_len < original_max_seq_len_ && cached_before > original_max_seq_len_) {  // reset
      set_current(original_);
      max_seq_len_cached_ = original_max_seq_len_;
    }
  } else if (longrope_) {
    if (seq_len > longrope_original_max_) {
      if (!long_) {
        long_ = compute_rope_frequencies(params_, longrope_original_max_ + 1);
        // attention_scaling keeps its construction value (HF discards the
        // init function's second result here).
        long_->attention_factor = original_.attention_factor;
      }
      set_current(*long_);
    } else {
      set_current(original_);
    }
  }
  return current_;
}

}  // namespace posenc
