// posenc — a paged KV cache that keeps position semantics intact.
//
// Keys are stored after rotation (RoPE) together with each entry's position
// id; attention masks are evaluated on those position ids, never on slot
// indices, so forks, evictions and shifts cannot renumber anything by accident.
// Layout (vLLM-style paging): fixed-size blocks from a pool; each sequence owns
// a block table; a block holds, for every layer, k and v
// [block_size, num_key_value_heads, head_dim] in the cache's dtype (float32 by
// default, or binary16 / bfloat16: KvCacheDtype) plus the block's position ids
// [block_size] (-1 = empty slot). Blocks are reference counted: fork() shares a
// sequence's blocks, and a shared block is copied before it is written
// (copy-on-write).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string_view>
#include <vector>

#include "posenc/attention.hpp"
#include "posenc/rope.hpp"

namespace posenc {

// KvCacheDtype (f32 | f16 | bf16, the cache's element type and its rounding) is declared in attention.hpp,
// whose KvBlock carries it.

std::string_view to_string(KvCacheDtype dtype);
/// "f32" | "f16" | "bf16" (also "float32", "float16", "bfloat16"). Throws
/// InvalidArgument naming `field` and the value otherwise.
KvCacheDtype parse_kv_cache_dtype(std::string_view name, std::string_view field = "kv_dtype");
/// Bytes of one stored element: 4 (f32) or 2 (f16, bf16).
int kv_cache_dtype_bytes(KvCacheDtype dtype);

class KvCache {
 public:
  using SeqId = int32_t;

  struct Config {
    int n_layers = 0;
    int kv_heads = 0;   ///< num_key_value_heads
    int head_dim = 0;
    int block_size = 16;     ///< tokens per block
    int64_t max_blocks = 0;  ///< pool capacity; 0 = grow on demand
    KvCacheDtype dtype = KvCacheDtype::f32;  ///< element type of the stored k and v
  };

  /// Where one token's k/v live.
  struct Slot {
    int32_t block = -1;
    int32_t offset = -1;
  };

  /// The rotation cached keys of a sequence carry (for RoPE models). Keys
  /// rotated with one set of frequencies must never meet queries rotated with
  /// another (dynamic NTK changes theta with the length).
  struct RopeState {
    RopeFrequencies freqs;
    RopeLayout layout = RopeLayout::half;
    AnglePrecision precision = AnglePrecision::float32;
    /// The sequence length the frequencies were computed for (length-dependent
    /// methods; under RopeChangePolicy::hf, HF's max_seq_len_cached of the
    /// sequence). Bookkeeping only: not part of the comparison (two states
    /// with the same rotation are the same rotation).
    int64_t seq_len = 0;
    bool operator==(const RopeState& o) const {
      return freqs == o.freqs && layout == o.layout && precision == o.precision;
    }
  };

  /// What happened to a sequence's rotation (see RopeChangePolicy in model.hpp).
  struct SequenceStats {
    int64_t rope_recomputes = 0;      ///< re-prefills after a frequency change (recompute)
    int64_t tokens_reprefilled = 0;   ///< tokens those re-prefills ran again
    int64_t rope_rerotations = 0;     ///< re-rotations of every cached key (rerotate)
    int64_t rope_changes_kept = 0;    ///< changes with the old keys kept as written (hf)
  };

  /// Throws InvalidArgument for non-positive sizes.
  explicit KvCache(const Config& config);
  ~KvCache();
  KvCache(KvCache&&) noexcept;
  KvCache& operator=(KvCache&&) noexcept;

  const Config& config() const { return config_; }

  /// A new empty sequence.
  SeqId create();
  /// A new sequence sharing every block of `parent` (prefix reuse); blocks are
  /// copied only when one side writes into a shared block. Throws InvalidArgument
  /// for an unknown sequence.
  SeqId fork(SeqId parent);
  /// Releases the sequence and its references to blocks.
  void free(SeqId seq);
  bool contains(SeqId seq) const;

  /// Tokens currently stored (evicted ones excluded).
  int64_t size(SeqId seq) const;
  /// One past the largest position id ever appended (0 when empty): the
  /// position the next token of a continuing sequence takes.
  int64_t next_position(SeqId seq) const;
  /// Position ids of the stored tokens, in slot order.
  std::vector<int64_t> positions(SeqId seq) const;

  /// Reserves one slot per position id (appended at the end of the sequence's
  /// block table), records the position ids and returns the slots; the caller
  /// then writes k/v for every layer with key()/value(). Copy-on-write happens
  /// here. Throws InvalidArgument for a negative position id, CacheError when
  /// the pool is exhausted (max_blocks); nothing is appended when it throws.
  /// token_ids: empty, or one id per position (recorded per slot, so that a
  /// sequence can be re-prefilled from its own tokens; -1 = unknown).
  std::vector<Slot> append(SeqId seq, std::span<const int64_t> position_ids,
                           std::span<const int32_t> token_ids = {});

  /// Where a sequence's appends stand (append_mark), to take back with rollback_appends.
  struct AppendMark {
    std::size_t table_size = 0;  ///< blocks in the sequence's table
    int32_t last_used = 0;       ///< slots handed out of its last block
    int64_t n_tokens = 0;
    int64_t next_pos = 0;
    int64_t mrope_next = -1;
  };
  /// The sequence's appends so far. Throws InvalidArgument for an unknown sequence.
  AppendMark append_mark(SeqId seq) const;
  /// Takes back every slot appended to `seq` since `mark` (their positions, token ids, MRoPE rows and
  /// blocks; next_position as it was), so that a step that failed after appending leaves the sequence as
  /// before it (Model::forward). Only appends may have happened since the mark (no evict, shift, clear or
  /// fork of the sequence). Never throws (blocks go back to the pool without allocating).
  void rollback_appends(SeqId seq, const AppendMark& mark) noexcept;
  /// Token ids of the stored tokens, in slot order (as positions(); -1 where
  /// append was given none).
  std::vector<int32_t> token_ids(SeqId seq) const;
  /// Tokens removed by evict()/keep_window() since the sequence was created or cleared.
  int64_t evicted(SeqId seq) const;
  /// Empties the sequence (same id): every slot released, next_position 0, no
  /// RopeState, not mixed, the planned length and stats kept.
  void clear(SeqId seq);

  /// The total length the request on this sequence will reach (0 = unknown):
  /// LongRoPE picks its short or long factors from max(this, the current
  /// length), consistently across the chunks of a chunked prefill. Throws
  /// InvalidArgument for n < 0.
  void set_planned_length(SeqId seq, int64_t n);
  int64_t planned_length(SeqId seq) const;

  /// Per-sequence counters of frequency changes (kept by clear(), copied by fork()).
  const SequenceStats& stats(SeqId seq) const;
  /// Records a re-prefill of `tokens` tokens (Model::forward under recompute).
  void record_recompute(SeqId seq, int64_t tokens);

  /// k or v of one slot at one layer: [kv_heads, head_dim] float32, written
  /// and read in place. float32 caches only: throws InvalidArgument for an f16
  /// or bf16 cache (use write()/read_key()/read_value()).
  float* key(int layer, Slot slot);
  float* value(int layer, Slot slot);
  const float* key(int layer, Slot slot) const;
  const float* value(int layer, Slot slot) const;

  /// Stores one slot's k and v at `layer` (each [kv_heads, head_dim] float32),
  /// converted to the cache's dtype (f16/bf16: round to nearest even, see
  /// KvCacheDtype; f32: copied bit for bit). Throws InvalidArgument for a layer
  /// or slot outside the cache.
  void write(int layer, Slot slot, const float* k, const float* v);
  /// write() of the KV heads [kv_head_begin, kv_head_end) only: k and v are
  /// still whole rows ([kv_heads, head_dim] float32), of which those heads'
  /// channels are read and stored, the same values write() stores for them.
  /// Threads may write disjoint head ranges of one slot at once (the decode
  /// team does). Throws InvalidArgument for a layer or slot outside the cache
  /// or a range outside [0, kv_heads].
  void write(int layer, Slot slot, const float* k, const float* v, int kv_head_begin, int kv_head_end);
  /// One slot's k or v at `layer` widened to float32 (exact): [kv_heads, head_dim].
  void read_key(int layer, Slot slot, float* out) const;
  void read_value(int layer, Slot slot, float* out) const;

  /// The sequence's keys/values at `layer` as attention inputs (one KvBlock per
  /// cache block, empty slots carry position -1). Appends to `out`. float32
  /// caches only (the blocks point into the cache); throws InvalidArgument
  /// for f16/bf16 (use the overload with a widening buffer).
  void blocks(int layer, SeqId seq, std::vector<KvBlock>& out) const;
  /// As blocks(layer, seq, out) for any dtype: a float32 cache's blocks point
  /// into the cache (`widened` untouched); an f16/bf16 cache's are widened
  /// exactly into `widened` (resized to [blocks, 2, block_size, kv_heads,
  /// head_dim] float32; the KvBlocks point into it and stay valid until it is
  /// changed). Appends to `out`.
  void blocks(int layer, SeqId seq, std::vector<KvBlock>& out, std::vector<float>& widened) const;
  /// As blocks(layer, seq, out) for any dtype, without a copy: every KvBlock
  /// points into the cache in its stored dtype (f32: k, v; f16/bf16: k16,
  /// v16 and dtype set), valid until the cache is next changed. What the
  /// model's forward pass hands attention_forward, which reads 16-bit blocks
  /// in place for decode. Appends to `out`. Throws InvalidArgument for a
  /// layer outside the cache.
  void blocks_as_stored(int layer, SeqId seq, std::vector<KvBlock>& out) const;

  /// Empties every slot whose position id p satisfies begin <= p < end
  /// (positions of the other tokens are unchanged). Blocks left without tokens
  /// are released. Returns the number of tokens removed.
  int64_t evict(SeqId seq, int64_t begin, int64_t end);

  /// Sliding window with attention sinks (StreamingLLM): keeps the first
  /// `sinks` tokens (by position) and the tokens with position >=
  /// next_position - window; evicts the rest. Returns tokens removed.
  int64_t keep_window(SeqId seq, int64_t window, int64_t sinks = 0);

  /// Context shift: adds `delta` to the position id of every stored token with
  /// position >= from, and re-rotates their cached keys by delta with the
  /// sequence's RopeState (q·k depends only on position differences, so every
  /// logit between shifted tokens is preserved). Without a RopeState (ALiBi,
  /// T5, NoPE models) only the ids change. Throws CacheError if a shifted id
  /// would become negative or collide with an unshifted one, or if the
  /// sequence is rope_mixed (its keys carry several rotations).
  void shift(SeqId seq, int64_t delta, int64_t from = 0);

  /// The rotation of this sequence's cached keys (std::nullopt: none yet / not RoPE).
  const std::optional<RopeState>& rope_state(SeqId seq) const;
  /// Declares the rotation of keys about to be appended. If the sequence already
  /// holds keys rotated differently: with rerotate = true every cached key is
  /// rotated back and forward again with the new frequencies (copy-on-write for
  /// shared blocks); with rerotate = false a CacheError is thrown. Never mixes.
  void set_rope_state(SeqId seq, const RopeState& state, bool rerotate);
  /// Hugging Face's behaviour (RopeChangePolicy::hf): keys about to be appended
  /// use `state`, cached keys keep the rotation they were written with. If the
  /// sequence holds keys of another rotation it becomes rope_mixed (until
  /// clear()); rope_state() then describes the newest keys only.
  void set_rope_state_mixed(SeqId seq, const RopeState& state);
  /// True when cached keys of the sequence carry different rotations (hf).
  bool rope_mixed(SeqId seq) const;

  // ---- MRoPE (Qwen2-VL): three position rows per cached token ----
  // The 1-D position ids above stay the sequence order (the mask); these rows
  // are what the token's key was rotated with. Forks share them, copy-on-write
  // copies them, shift() moves all three rows by its delta.

  /// Records the [3, slots.size()] row-major (t, h, w) position ids of slots just
  /// returned by append() for `seq`. Throws InvalidArgument for an unknown
  /// sequence, a size other than 3 * slots.size(), or a slot not owned by the
  /// sequence's block table.
  void set_mrope_positions(SeqId seq, std::span<const Slot> slots, std::span<const int64_t> position_ids);
  /// [3, size(seq)] row-major, in slot order (as positions()); a token stored
  /// without 3-row ids reads its 1-D position in all three rows.
  std::vector<int64_t> mrope_positions(SeqId seq) const;
  /// (largest 3-row id recorded + 1) - next_position(seq): HF's rope delta that a
  /// continuing text token adds to its 1-D position (0 when no 3-row ids were recorded).
  int64_t mrope_delta(SeqId seq) const;

  /// Blocks in use / allocated in the pool.
  int64_t blocks_in_use() const;
  int64_t blocks_allocated() const;

  KvCacheDtype dtype() const { return config_.dtype; }
  /// Bytes of k and v storage one token takes: n_layers x 2 x kv_heads x
  /// head_dim x kv_cache_dtype_bytes(dtype).
  int64_t kv_bytes_per_token() const;
  /// Bytes of k and v storage the allocated blocks hold (the element buffers
  /// as allocated, measured from the buffers; position ids and token ids not
  /// included): blocks_allocated() x block_size x kv_bytes_per_token().
  int64_t kv_bytes_allocated() const;

 private:
  struct Block;
  struct Sequence;
  Sequence& seq_ref(SeqId seq);
  const Sequence& seq_ref(SeqId seq) const;
  int32_t allocate_block();
  void release_block(int32_t block);
  int32_t make_writable(Sequence& s, std::size_t table_index);
  void drop_empty_blocks(Sequence& s);
  /// append's work once its arguments are checked (slots reserved by the caller).
  void append_slots(Sequence& s, std::span<const int64_t> position_ids, std::span<const int32_t> token_ids,
                    std::vector<Slot>& slots);
  /// Index of the first element of k (kv = 0) or v (kv = 1) of `offset` at `layer` in a block's buffer.
  std::size_t element_index(int layer, int kv, int32_t offset) const;
  /// Calls f(float* k) with the first n keys of `block` at `layer` as float32 [n, kv_heads, head_dim] (in place
  /// for f32; widened into a scratch buffer and rounded back afterwards for f16/bf16).
  template <class F>
  void edit_keys(int32_t block, int layer, int32_t n, F&& f);

  Config config_;
  std::vector<std::unique_ptr<Block>> blocks_;
  std::vector<int32_t> free_blocks_;
  std::vector<std::unique_ptr<Sequence>> seqs_;
};

}  // namespace posenc
