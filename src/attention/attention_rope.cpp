// posenc — attention_with_rope: RoPE on q and k, then the tiled kernel.
//
// Keys are copied once and rotated in the copy (the caller's cache stays
// untouched); queries are rotated row by row inside the kernel while it packs
// them, so no rotated copy of q exists. The rotation and the cos/sin rows come
// from encoding/rope_kernels (float32 products without FMA, cos/sin within
// 1 ulp of the float32 reference), i.e. the numerics of apply_rope.
#include <algorithm>
#include <cstring>
#include <memory>
#include <vector>

#include <fmt/format.h>
#include <omp.h>

#include "attention/attention_kernel.hpp"
#include "core/parallel.hpp"
#include "encoding/rope_kernels.hpp"
#include "posenc/attention.hpp"
#include "posenc/error.hpp"

namespace posenc {

namespace {

// One rotation unit: `n` consecutive keys of one block.
struct KeyChunk {
  const float* src;
  float* dst;
  const int64_t* pos;
  int64_t n;
};

}  // namespace

void attention_with_rope(const AttentionSpec& spec, const RopeFrequencies& freqs,
                         RopeLayout layout, AnglePrecision precision, const float* q,
                         std::span<const int64_t> q_position_ids, std::span<const KvBlock> kv,
                         float* out, const AttentionOptions& options) {
  spec.validate();
  freqs.validate();
  if (freqs.head_dim != spec.head_dim)
    throw InvalidArgument(fmt::format(
        "head_dim: RoPE frequencies are for head_dim {} but the attention spec has {}",
        freqs.head_dim, spec.head_dim));
  if (options.num_threads < 0)
    fail_field<InvalidArgument>("num_threads", "must be >= 0", options.num_threads);
  const int64_t kv_tokens = detail::check_kv_blocks(kv, "attention_with_rope");
  const int64_t q_tokens = static_cast<int64_t>(q_position_ids.size());
  const int np = freqs.n_pairs();
  const int D = spec.head_dim;
  const int64_t row = static_cast<int64_t>(spec.kv_heads) * D;
  // f16/bf16 blocks: rotated from (and their values read from) an exact float32 copy.
  std::vector<float> widened_storage;
  std::vector<KvBlock> widened_blocks;
  kv = detail::widen_kv_blocks(kv, row, widened_storage, widened_blocks);

  // Rotated copy of the keys, in chunks of up to 32 keys (one cos/sin row per key).
  constexpr int64_t kChunk = 32;
  std::unique_ptr<float[]> k_rot(new float[static_cast<std::size_t>(std::max<int64_t>(kv_tokens * row, 1))]);
  std::vector<KvBlock> blocks(kv.begin(), kv.end());
  std::vector<KeyChunk> chunks;
  int64_t offset = 0;
  for (auto& b : blocks) {
    float* dst = k_rot.get() + offset * row;
    for (int64_t j = 0; j < b.n_tokens; j += kChunk)
      chunks.push_back({b.k + j * row, dst + j * row, b.position_ids + j,
                        std::min(kChunk, b.n_tokens - j)});
    b.k = dst;
    offset += b.n_tokens;
  }
  std::vector<float> q_cos(static_cast<std::size_t>(q_tokens * np)),
      q_sin(static_cast<std::size_t>(q_tokens * np));

  int threads = options.num_threads > 0 ? options.num_threads : omp_get_max_threads();
  if ((kv_tokens * row + q_tokens * np) < (int64_t{1} << 16) || omp_in_parallel()) threads = 1;
  const int64_t n_chunks = static_cast<int64_t>(chunks.size());
  detail::FirstException error;  // std::bad_alloc of a thread's buffer, rethrown after the region
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
    std::vector<float> cs;
    error.run([&] { cs.resize(static_cast<std::size_t>(2 * kChunk * np)); });
    float* c = cs.data();
    float* s = cs.data() + kChunk * np;
    // Every thread meets both loops; one whose buffer failed rotates no key (its results are not used).
#pragma omp for schedule(static) nowait
    for (int64_t i = 0; i < n_chunks; ++i) {
      if (cs.empty()) continue;
      const KeyChunk& ch = chunks[static_cast<std::size_t>(i)];
      std::memcpy(ch.dst, ch.src, static_cast<std::size_t>(ch.n * row) * sizeof(float));
      for (int64_t t = 0; t < ch.n; ++t)
        detail::rope_cos_sin_row(freqs, ch.pos[t], precision, c + t * np, s + t * np);
      detail::rope_rotate_rows(ch.dst, ch.n, spec.kv_heads, D, row, c, s, np, np, layout,
                               RopeDirection::forward);
    }
#pragma omp for schedule(static)
    for (int64_t t = 0; t < q_tokens; ++t)
      detail::rope_cos_sin_row(freqs, q_position_ids[static_cast<std::size_t>(t)], precision, q_cos.data() + t * np,
                               q_sin.data() + t * np);
  }
  error.rethrow();

  const detail::QueryRope q_rope{q_cos.data(), q_sin.data(), np, layout};
  detail::attention_kernel(spec, q, q_position_ids, blocks, out, options, &q_rope);
}

}  // namespace posenc
