// ALiBi slopes in the convention a parsed config names.
#include <cmath>

#include <fmt/format.h>

#include "posenc/analysis.hpp"
#include "posenc/bias.hpp"
#include "posenc/error.hpp"

namespace posenc {

std::vector<float> alibi_slopes_for(const AlibiSpec& alibi, int n_heads) {
  if (n_heads <= 0) fail_field<InvalidArgument>("num_attention_heads", "must be positive", n_heads);
  if (!std::isfinite(alibi.max_bias) || alibi.max_bias <= 0)
    fail_field<InvalidArgument>("max_bias", "must be finite and > 0", alibi.max_bias);
  if (alibi.convention == AlibiConvention::bloom) return alibi_slopes(n_heads, alibi.max_bias);
  // HF build_mpt_alibi_tensor: p = 2^ceil(log2 n); base = arange(1, p+1).float()
  // * (alibi_bias_max / p); slopes = 1 / 2^base, all float32; when p != n the
  // order is slopes[1::2] then slopes[::2] (k = 2,4,... then 1,3,...), first n.
  int p = 1;
  while (p < n_heads) p *= 2;
  const float step = static_cast<float>(alibi.max_bias / p);
  std::vector<float> all(static_cast<std::size_t>(p));
  for (int k = 1; k <= p; ++k)
    all[static_cast<std::size_t>(k - 1)] = 1.0f / std::pow(2.0f, static_cast<float>(k) * step);
  if (p == n_heads) return all;
  std::vector<float> out;
  out.reserve(static_cast<std::size_t>(p));
  for (int i = 1; i < p; i += 2) out.push_back(all[static_cast<std::size_t>(i)]);
  for (int i = 0; i < p; i += 2) out.push_back(all[static_cast<std::size_t>(i)]);
  out.resize(static_cast<std::size_t>(n_heads));
  return out;
}

}  // namespace posenc
