// posenc — internal entry point of the tiled CPU attention kernel.
#pragma once

#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "posenc/attention.hpp"
#include "posenc/rope.hpp"

namespace posenc::detail {

/// Rotation of the query rows done by the kernel while it packs them
/// (attention_with_rope). cos/sin: [q_tokens, n_pairs], row t for query token t.
struct QueryRope {
  const float* cos = nullptr;
  const float* sin = nullptr;
  int n_pairs = 0;
  RopeLayout layout = RopeLayout::half;
};

/// Checks every block (n_tokens >= 0; non-null position_ids and the data
/// pointers of its dtype, k/v or k16/v16) and returns the total n_tokens.
/// Throws InvalidArgument naming `caller`, the block's size and dtype.
int64_t check_kv_blocks(std::span<const KvBlock> kv, std::string_view caller);

/// kv with every f16/bf16 block widened exactly to float32: the copies are
/// written to `storage` (resized) and the blocks, pointing at them, to
/// `widened`; returns a span over `widened`, or kv itself when every block is
/// float32 already (nothing written). row: kv_heads * head_dim elements per
/// token. Only the channels [first, first + count) of each token's row are
/// widened (count -1: to the row's end); the copy's other channels hold
/// whatever storage held, and must not be read.
std::span<const KvBlock> widen_kv_blocks(std::span<const KvBlock> kv, int64_t row, std::vector<float>& storage,
                                         std::vector<KvBlock>& widened, int64_t first = 0, int64_t count = -1);

/// Whether a call with `rows` query rows per KV head (q_tokens x the GQA group) over f16/bf16 blocks reads them
/// in place (the narrow kernels, up to 8 rows, on AVX-512 or AVX2 with F16C); otherwise it widens them into a
/// float32 copy per thread of the call, the size of the blocks' rows (the decode team keeps out of such calls).
bool reads_16bit_blocks_in_place(int64_t rows);

/// attention_forward with an optional query rotation (nullptr: none).
/// Validates its arguments (InvalidArgument).
void attention_kernel(const AttentionSpec& spec, const float* q,
                      std::span<const int64_t> q_position_ids, std::span<const KvBlock> kv,
                      float* out, const AttentionOptions& options, const QueryRope* q_rope);

}  // namespace posenc::detail
