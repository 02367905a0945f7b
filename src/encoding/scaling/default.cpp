#include "encoding/scaling/methods.hpp"

namespace posenc::detail {

// HF: _compute_default_rope_parameters (rope_type "default").
RopeFrequencies rope_default(const RopeParams& p, std::optional<int64_t>) {
  return default_rope_frequencies(p.head_dim, p.effective_rotary_dim(), p.rope_theta);
}

}  // namespace posenc::detail
