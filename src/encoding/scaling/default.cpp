#include "encoding/scaling/methods.hpp"

namespace posenc::detail {

// Plain RoPE (Su et al. 2021, eq. 15: theta_i = base^(-2i/d)). HF:
// LlamaRotaryEmbedding.compute_default_rope_parameters / GPT-NeoX's (which
// applies partial_rotary_factor; Llama's ignores it -- see RopeParams).
template <class T>
RopeFrequencies rope_default(const RopeParams& p, std::optional<int64_t>) {
  const int dim = resolve_rotary_dim(p);
  return make_frequencies(p.head_dim, dim, default_inv_freq<T>(dim / 2, dim, p.rope_theta), 1.0);
}

POSENC_ROPE_METHOD_INSTANTIATE(rope_default)

}  // namespace posenc::detail
