#include "posenc/kv_cache.hpp"

#include <algorithm>
#include <array>
#include <limits>

#include <fmt/format.h>

#include "posenc/error.hpp"
#include "posenc/float16.hpp"

namespace posenc {

std::string_view to_string(KvCacheDtype dtype) {
  switch (dtype) {
    case KvCacheDtype::f32: return "f32";
    case KvCacheDtype::f16: return "f16";
    case KvCacheDtype::bf16: return "bf16";
  }
  return "?";
}

KvCacheDtype parse_kv_cache_dtype(std::string_view name, std::string_view field) {
  if (name == "f32" || name == "float32") return KvCacheDtype::f32;
  if (name == "f16" || name == "float16") return KvCacheDtype::f16;
  if (name == "bf16" || name == "bfloat16") return KvCacheDtype::bf16;
  throw InvalidArgument(fmt::format("{}: unknown KV cache dtype '{}' (expected f32, f16 or bf16)", field, name));
}

int kv_cache_dtype_bytes(KvCacheDtype dtype) { return dtype == KvCacheDtype::f32 ? 4 : 2; }

namespace {

// One dispatch per call, then a branch-free loop per dtype.
void narrow_to(KvCacheDtype dtype, const float* src, uint16_t* dst, std::size_t n) {
  if (dtype == KvCacheDtype::f16) {
    for (std::size_t i = 0; i < n; ++i) dst[i] = f32_to_f16(src[i]);
  } else {
    for (std::size_t i = 0; i < n; ++i) dst[i] = f32_to_bf16(src[i]);
  }
}

void widen_from(KvCacheDtype dtype, const uint16_t* src, float* dst, std::size_t n) {
  if (dtype == KvCacheDtype::f16) {
    for (std::size_t i = 0; i < n; ++i) dst[i] = f16_to_f32(src[i]);
  } else {
    for (std::size_t i = 0; i < n; ++i) dst[i] = bf16_to_f32(src[i]);
  }
}

}  // namespace

struct KvCache::Block {
  // [n_layers][2 (k, v)][block_size][kv_heads * head_dim], in `data` (f32) or `half` (f16/bf16 bits); the other is empty.
  std::vector<float> data;
  std::vector<uint16_t> half;
  std::vector<int64_t> pos;  // [block_size], -1 = empty
  std::vector<int32_t> tok;  // [block_size] token ids, -1 = unknown
  int32_t used = 0;          // slots handed out so far; slots >= used are free
  int32_t refs = 0;
  std::vector<int64_t> mpos;  // MRoPE: [3][block_size] (t, h, w rows), empty until set_mrope_positions
  std::vector<uint8_t> mset;  // MRoPE: [block_size], 1 = the slot's mpos entries are set
};

struct KvCache::Sequence {
  std::vector<int32_t> table;
  int64_t next_pos = 0;
  int64_t n_tokens = 0;
  std::optional<RopeState> rope;
  int64_t mrope_next = -1;  // largest recorded 3-row id + 1; -1 = none recorded
  bool rope_mixed = false;
  int64_t evicted = 0;
  int64_t planned = 0;
  SequenceStats stats;
};

KvCache::KvCache(const Config& config) : config_(config) {
  if (config.n_layers <= 0) fail_field<InvalidArgument>("n_layers", "must be positive", config.n_layers);
  if (config.kv_heads <= 0)
    fail_field<InvalidArgument>("num_key_value_heads", "must be positive", config.kv_heads);
  if (config.head_dim <= 0) fail_field<InvalidArgument>("head_dim", "must be positive", config.head_dim);
  if (config.block_size <= 0)
    fail_field<InvalidArgument>("block_size", "must be positive", config.block_size);
  if (config.max_blocks < 0)
    fail_field<InvalidArgument>("max_blocks", "must be >= 0", config.max_blocks);
}

KvCache::~KvCache() = default;
KvCache::KvCache(KvCache&&) noexcept = default;
KvCache& KvCache::operator=(KvCache&&) noexcept = default;

KvCache::Sequence& KvCache::seq_ref(SeqId seq) {
  if (seq < 0 || static_cast<std::size_t>(seq) >= seqs_.size() || !seqs_[static_cast<std::size_t>(seq)])
    fail_field<InvalidArgument>("sequence id", "no such live sequence in the KV cache", seq);
  return *seqs_[static_cast<std::size_t>(seq)];
}

const KvCache::Sequence& KvCache::seq_ref(SeqId seq) const {
  return const_cast<KvCache*>(this)->seq_ref(seq);
}

bool KvCache::contains(SeqId seq) const {
  return seq >= 0 && static_cast<std::size_t>(seq) < seqs_.size() &&
         seqs_[static_cast<std::size_t>(seq)] != nullptr;
}

KvCache::SeqId KvCache::create() {
  for (std::size_t i = 0; i < seqs_.size(); ++i)
    if (!seqs_[i]) {
      seqs_[i] = std::make_unique<Sequence>();
      return static_cast<SeqId>(i);
    }
  seqs_.push_back(std::make_unique<Sequence>());
  return static_cast<SeqId>(seqs_.size() - 1);
}

KvCache::SeqId KvCache::fork(SeqId parent) {
  const Sequence copy = seq_ref(parent);
  const SeqId child = create();
  Sequence& c = seq_ref(child);
  c = copy;
  for (int32_t b : c.table) ++blocks_[static_cast<std::size_t>(b)]->refs;
  return child;
}

void KvCache::free(SeqId seq) {
  Sequence& s = seq_ref(seq);
  for (int32_t b : s.table) release_block(b);
  seqs_[static_cast<std::size_t>(seq)].reset();
}

int64_t KvCache::size(SeqId seq) const { return seq_ref(seq).n_tokens; }
int64_t KvCache::next_position(SeqId seq) const { return seq_ref(seq).next_pos; }

std::vector<int64_t> KvCache::positions(SeqId seq) const {
  std::vector<int64_t> out;
  for (int32_t b : seq_ref(seq).table) {
    const Block& blk = *blocks_[static_cast<std::size_t>(b)];
    for (int32_t i = 0; i < blk.used; ++i)
      if (blk.pos[static_cast<std::size_t>(i)] >= 0) out.push_back(blk.pos[static_cast<std::size_t>(i)]);
  }
  return out;
}

int32_t KvCache::allocate_block() {
  int32_t id;
  if (!free_blocks_.empty()) {
    id = free_blocks_.back();
    free_blocks_.pop_back();
  } else {
    if (config_.max_blocks > 0 && static_cast<int64_t>(blocks_.size()) >= config_.max_blocks)
      throw CacheError(fmt::format("KV cache: block pool exhausted (max_blocks = {}, block_size = {})",
                                   config_.max_blocks, config_.block_size));
    // The free list can hold every block: release_block then never allocates (rollback_appends is noexcept).
    if (free_blocks_.capacity() < blocks_.size() + 1) free_blocks_.reserve(2 * (blocks_.size() + 1));
    auto blk = std::make_unique<Block>();
    const std::size_t elements = static_cast<std::size_t>(config_.n_layers) * 2 *
                                 static_cast<std::size_t>(config_.block_size) *
                                 static_cast<std::size_t>(config_.kv_heads) * static_cast<std::size_t>(config_.head_dim);
    if (config_.dtype == KvCacheDtype::f32)
      blk->data.resize(elements);
    else
      blk->half.resize(elements);
    blk->pos.assign(static_cast<std::size_t>(config_.block_size), -1);
    blk->tok.assign(static_cast<std::size_t>(config_.block_size), -1);
    blocks_.push_back(std::move(blk));
    id = static_cast<int32_t>(blocks_.size() - 1);
  }
  Block& b = *blocks_[static_cast<std::size_t>(id)];
  std::fill(b.pos.begin(), b.pos.end(), -1);
  b.mpos.clear();
  b.mset.clear();
  std::fill(b.tok.begin(), b.tok.end(), -1);
  b.used = 0;
  b.refs = 1;
  return id;
}

void KvCache::release_block(int32_t block) {
  Block& b = *blocks_[static_cast<std::size_t>(block)];
  if (--b.refs == 0) free_blocks_.push_back(block);
}

int32_t KvCache::make_writable(Sequence& s, std::size_t table_index) {
  const int32_t id = s.table[table_index];
  Block& b = *blocks_[static_cast<std::size_t>(id)];
  if (b.refs == 1) return id;
  const int32_t nid = allocate_block();
  Block& nb = *blocks_[static_cast<std::size_t>(nid)];
  const Block& ob = *blocks_[static_cast<std::size_t>(id)];  // re-fetch: allocate may grow blocks_
  nb.data = ob.data;
  nb.half = ob.half;
  nb.pos = ob.pos;
  nb.mpos = ob.mpos;
  nb.mset = ob.mset;
  nb.tok = ob.tok;
  nb.used = ob.used;
  release_block(id);
  s.table[table_index] = nid;
  return nid;
}

KvCache::AppendMark KvCache::append_mark(SeqId seq) const {
  const Sequence& s = seq_ref(seq);
  AppendMark m;
  m.table_size = s.table.size();
  m.last_used = s.table.empty() ? 0 : blocks_[static_cast<std::size_t>(s.table.back())]->used;
  m.n_tokens = s.n_tokens;
  m.next_pos = s.next_pos;
  m.mrope_next = s.mrope_next;
  return m;
}

void KvCache::rollback_appends(SeqId seq, const AppendMark& mark) noexcept {
  if (!contains(seq)) return;
  Sequence& s = *seqs_[static_cast<std::size_t>(seq)];
  while (s.table.size() > mark.table_size) {  // blocks the appends took: theirs alone (no fork since the mark)
    release_block(s.table.back());
    s.table.pop_back();
  }
  if (mark.table_size > 0) {  // the slots handed out of the block that was last (or its copy-on-write copy)
    Block& b = *blocks_[static_cast<std::size_t>(s.table.back())];
    for (int32_t off = mark.last_used; off < b.used; ++off) {
      b.pos[static_cast<std::size_t>(off)] = -1;
      b.tok[static_cast<std::size_t>(off)] = -1;
      if (!b.mset.empty()) b.mset[static_cast<std::size_t>(off)] = 0;
    }
    b.used = std::min(b.used, mark.last_used);
  }
  s.n_tokens = mark.n_tokens;
  s.next_pos = mark.next_pos;
  s.mrope_next = mark.mrope_next;
}

std::vector<KvCache::Slot> KvCache::append(SeqId seq, std::span<const int64_t> position_ids,
                                           std::span<const int32_t> token_ids) {
  Sequence& s = seq_ref(seq);
  if (!token_ids.empty() && token_ids.size() != position_ids.size())
    throw InvalidArgument(fmt::format("append: {} token ids for {} position ids (sequence {})", token_ids.size(),
                                      position_ids.size(), seq));
  for (int64_t p : position_ids)
    if (p < 0) fail_field<InvalidArgument>("position_ids", "must be non-negative", p);
  std::vector<Slot> slots;
  slots.reserve(position_ids.size());
  const AppendMark mark = append_mark(seq);
  try {
    append_slots(s, position_ids, token_ids, slots);
  } catch (...) {  // the pool ran out part-way: nothing appended
    rollback_appends(seq, mark);
    throw;
  }
  return slots;
}

void KvCache::append_slots(Sequence& s, std::span<const int64_t> position_ids, std::span<const int32_t> token_ids,
                           std::vector<Slot>& slots) {
  for (std::size_t i = 0; i < position_ids.size(); ++i) {
    const int64_t p = position_ids[i];
    int32_t id = -1;
    if (!s.table.empty()) {
      const Block& last = *blocks_[static_cast<std::size_t>(s.table.back())];
      if (last.used < config_.block_size) id = make_writable(s, s.table.size() - 1);
    }
    if (id < 0) {
      id = allocate_block();
      s.table.push_back(id);
    }
    Block& b = *blocks_[static_cast<std::size_t>(id)];
    const int32_t off = b.used++;
    b.pos[static_cast<std::size_t>(off)] = p;
    b.tok[static_cast<std::size_t>(off)] = token_ids.empty() ? -1 : token_ids[i];
    slots.push_back({id, off});
    ++s.n_tokens;
    s.next_pos = std::max(s.next_pos, p + 1);
  }
}

std::size_t KvCache::element_index(int layer, int kv, int32_t offset) const {
  const std::size_t kv_dim = static_cast<std::size_t>(config_.kv_heads) * static_cast<std::size_t>(config_.head_dim);
  const std::size_t bs = static_cast<std::size_t>(config_.block_size);
  return ((static_cast<std::size_t>(layer) * 2 + static_cast<std::size_t>(kv)) * bs + static_cast<std::size_t>(offset)) *
         kv_dim;
}

float* KvCache::key(int layer, Slot slot) {
  if (config_.dtype != KvCacheDtype::f32)
    throw InvalidArgument(fmt::format("KvCache::key: the cache stores {} (no float32 buffer to point into; use "
                                      "write() / read_key())",
                                      to_string(config_.dtype)));
  return blocks_[static_cast<std::size_t>(slot.block)]->data.data() + element_index(layer, 0, slot.offset);
}

float* KvCache::value(int layer, Slot slot) {
  if (config_.dtype != KvCacheDtype::f32)
    throw InvalidArgument(fmt::format("KvCache::value: the cache stores {} (no float32 buffer to point into; use "
                                      "write() / read_value())",
                                      to_string(config_.dtype)));
  return blocks_[static_cast<std::size_t>(slot.block)]->data.data() + element_index(layer, 1, slot.offset);
}

const float* KvCache::key(int layer, Slot slot) const { return const_cast<KvCache*>(this)->key(layer, slot); }
const float* KvCache::value(int layer, Slot slot) const {
  return const_cast<KvCache*>(this)->value(layer, slot);
}

namespace {
void check_slot(const KvCache::Config& c, std::size_t n_blocks, int layer, KvCache::Slot slot, const char* what) {
  if (layer < 0 || layer >= c.n_layers)
    fail_field<InvalidArgument>("layer", fmt::format("{}: must be in [0, {})", what, c.n_layers), layer);
  if (slot.block < 0 || static_cast<std::size_t>(slot.block) >= n_blocks || slot.offset < 0 ||
      slot.offset >= c.block_size)
    throw InvalidArgument(fmt::format("{}: slot (block {}, offset {}) is outside the cache ({} blocks of {})", what,
                                      slot.block, slot.offset, n_blocks, c.block_size));
}
}  // namespace

void KvCache::write(int layer, Slot slot, const float* k, const float* v) {
  check_slot(config_, blocks_.size(), layer, slot, "KvCache::write");
  const std::size_t kv_dim = static_cast<std::size_t>(config_.kv_heads) * static_cast<std::size_t>(config_.head_dim);
  Block& b = *blocks_[static_cast<std::size_t>(slot.block)];
  const std::size_t ki = element_index(layer, 0, slot.offset), vi = element_index(layer, 1, slot.offset);
  if (config_.dtype == KvCacheDtype::f32) {
    std::copy(k, k + kv_dim, b.data.data() + ki);
    std::copy(v, v + kv_dim, b.data.data() + vi);
  } else {
    narrow_to(config_.dtype, k, b.half.data() + ki, kv_dim);
    narrow_to(config_.dtype, v, b.half.data() + vi, kv_dim);
  }
}

void KvCache::write(int layer, Slot slot, const float* k, const float* v, int kv_head_begin, int kv_head_end) {
  check_slot(config_, blocks_.size(), layer, slot, "KvCache::write");
  if (kv_head_begin < 0 || kv_head_begin > kv_head_end || kv_head_end > config_.kv_heads)
    throw InvalidArgument(fmt::format("KvCache::write: KV heads [{}, {}) are not within [0, {}] (num_key_value_heads)",
                                      kv_head_begin, kv_head_end, config_.kv_heads));
  const std::size_t hd = static_cast<std::size_t>(config_.head_dim);
  const std::size_t first = static_cast<std::size_t>(kv_head_begin) * hd;
  const std::size_t n = static_cast<std::size_t>(kv_head_end - kv_head_begin) * hd;
  Block& b = *blocks_[static_cast<std::size_t>(slot.block)];
  const std::size_t ki = element_index(layer, 0, slot.offset) + first, vi = element_index(layer, 1, slot.offset) + first;
  if (config_.dtype == KvCacheDtype::f32) {
    std::copy(k + first, k + first + n, b.data.data() + ki);
    std::copy(v + first, v + first + n, b.data.data() + vi);
  } else {
    narrow_to(config_.dtype, k + first, b.half.data() + ki, n);
    narrow_to(config_.dtype, v + first, b.half.data() + vi, n);
  }
}

void KvCache::read_key(int layer, Slot slot, float* out) const {
  check_slot(config_, blocks_.size(), layer, slot, "KvCache::read_key");
  const std::size_t kv_dim = static_cast<std::size_t>(config_.kv_heads) * static_cast<std::size_t>(config_.head_dim);
  const Block& b = *blocks_[static_cast<std::size_t>(slot.block)];
  const std::size_t i = element_index(layer, 0, slot.offset);
  if (config_.dtype == KvCacheDtype::f32)
    std::copy(b.data.data() + i, b.data.data() + i + kv_dim, out);
  else
    widen_from(config_.dtype, b.half.data() + i, out, kv_dim);
}

void KvCache::read_value(int layer, Slot slot, float* out) const {
  check_slot(config_, blocks_.size(), layer, slot, "KvCache::read_value");
  const std::size_t kv_dim = static_cast<std::size_t>(config_.kv_heads) * static_cast<std::size_t>(config_.head_dim);
  const Block& b = *blocks_[static_cast<std::size_t>(slot.block)];
  const std::size_t i = element_index(layer, 1, slot.offset);
  if (config_.dtype == KvCacheDtype::f32)
    std::copy(b.data.data() + i, b.data.data() + i + kv_dim, out);
  else
    widen_from(config_.dtype, b.half.data() + i, out, kv_dim);
}

template <class F>
void KvCache::edit_keys(int32_t block, int layer, int32_t n, F&& f) {
  if (config_.dtype == KvCacheDtype::f32) {
    f(key(layer, {block, 0}));
    return;
  }
  const std::size_t count = static_cast<std::size_t>(n) * static_cast<std::size_t>(config_.kv_heads) *
                            static_cast<std::size_t>(config_.head_dim);
  uint16_t* bits = blocks_[static_cast<std::size_t>(block)]->half.data() + element_index(layer, 0, 0);
  std::vector<float> k(count);
  widen_from(config_.dtype, bits, k.data(), count);
  f(k.data());
  narrow_to(config_.dtype, k.data(), bits, count);
}

void KvCache::blocks(int layer, SeqId seq, std::vector<KvBlock>& out) const {
  if (layer < 0 || layer >= config_.n_layers)
    fail_field<InvalidArgument>("layer", fmt::format("must be in [0, {})", config_.n_layers), layer);
  if (config_.dtype != KvCacheDtype::f32)
    throw InvalidArgument(fmt::format("KvCache::blocks: the cache stores {}; pass a widening buffer",
                                      to_string(config_.dtype)));
  for (int32_t b : seq_ref(seq).table) {
    const Block& blk = *blocks_[static_cast<std::size_t>(b)];
    out.push_back({key(layer, {b, 0}), value(layer, {b, 0}), blk.pos.data(), blk.used});
  }
}

void KvCache::blocks(int layer, SeqId seq, std::vector<KvBlock>& out, std::vector<float>& widened) const {
  if (config_.dtype == KvCacheDtype::f32) {
    blocks(layer, seq, out);
    return;
  }
  if (layer < 0 || layer >= config_.n_layers)
    fail_field<InvalidArgument>("layer", fmt::format("must be in [0, {})", config_.n_layers), layer);
  const Sequence& s = seq_ref(seq);
  const std::size_t kv_dim = static_cast<std::size_t>(config_.kv_heads) * static_cast<std::size_t>(config_.head_dim);
  const std::size_t per = static_cast<std::size_t>(config_.block_size) * kv_dim;  // k (or v) of one block
  widened.resize(s.table.size() * 2 * per);  // before taking pointers into it
  for (std::size_t i = 0; i < s.table.size(); ++i) {
    const int32_t b = s.table[i];
    const Block& blk = *blocks_[static_cast<std::size_t>(b)];
    float* k = widened.data() + 2 * i * per;
    float* v = k + per;
    const std::size_t n = static_cast<std::size_t>(blk.used) * kv_dim;  // slots past `used` are never read
    widen_from(config_.dtype, blk.half.data() + element_index(layer, 0, 0), k, n);
    widen_from(config_.dtype, blk.half.data() + element_index(layer, 1, 0), v, n);
    out.push_back({k, v, blk.pos.data(), blk.used});
  }
}

void KvCache::blocks_as_stored(int layer, SeqId seq, std::vector<KvBlock>& out) const {
  if (config_.dtype == KvCacheDtype::f32) {
    blocks(layer, seq, out);
    return;
  }
  if (layer < 0 || layer >= config_.n_layers)
    fail_field<InvalidArgument>("layer", fmt::format("must be in [0, {})", config_.n_layers), layer);
  for (int32_t b : seq_ref(seq).table) {
    const Block& blk = *blocks_[static_cast<std::size_t>(b)];
    KvBlock kb;
    kb.position_ids = blk.pos.data();
    kb.n_tokens = blk.used;
    kb.dtype = config_.dtype;
    kb.k16 = blk.half.data() + element_index(layer, 0, 0);
    kb.v16 = blk.half.data() + element_index(layer, 1, 0);
    out.push_back(kb);
  }
}

void KvCache::drop_empty_blocks(Sequence& s) {
  std::vector<int32_t> kept;
  kept.reserve(s.table.size());
  for (std::size_t i = 0; i < s.table.size(); ++i) {
    const Block& b = *blocks_[static_cast<std::size_t>(s.table[i])];
    const bool empty = std::none_of(b.pos.begin(), b.pos.begin() + b.used, [](int64_t p) { return p >= 0; });
    // A fully handed-out block with no tokens left is dead; so is an empty
    // block that is not the last one (the last may still take appends).
    if (empty && (b.used == config_.block_size || i + 1 < s.table.size()))
      release_block(s.table[i]);
    else
      kept.push_back(s.table[i]);
  }
  s.table = std::move(kept);
}

int64_t KvCache::evict(SeqId seq, int64_t begin, int64_t end) {
  Sequence& s = seq_ref(seq);
  int64_t removed = 0;
  for (std::size_t i = 0; i < s.table.size(); ++i) {
    const Block& ro = *blocks_[static_cast<std::size_t>(s.table[i])];
    const bool hit = std::any_of(ro.pos.begin(), ro.pos.begin() + ro.used,
                                 [&](int64_t p) { return p >= begin && p < end; });
    if (!hit) continue;
    Block& b = *blocks_[static_cast<std::size_t>(make_writable(s, i))];
    for (int32_t k = 0; k < b.used; ++k) {
      int64_t& p = b.pos[static_cast<std::size_t>(k)];
      if (p >= begin && p < end) {
        p = -1;
        ++removed;
      }
    }
  }
  s.n_tokens -= removed;
  s.evicted += removed;
  drop_empty_blocks(s);
  return removed;
}

int64_t KvCache::keep_window(SeqId seq, int64_t window, int64_t sinks) {
  if (window <= 0) fail_field<InvalidArgument>("window", "must be positive", window);
  if (sinks < 0) fail_field<InvalidArgument>("sinks", "must be >= 0", sinks);
  std::vector<int64_t> pos = positions(seq);
  std::sort(pos.begin(), pos.end());
  const int64_t cut = seq_ref(seq).next_pos - window;  // keep positions >= cut
  const int64_t sink_end = sinks > 0 && !pos.empty()
                               ? pos[static_cast<std::size_t>(std::min<int64_t>(sinks, static_cast<int64_t>(pos.size())) - 1)] + 1
                               : std::numeric_limits<int64_t>::min();
  const int64_t begin = std::max(sink_end, pos.empty() ? 0 : pos.front());
  if (cut <= begin) return 0;
  return evict(seq, begin, cut);
}

namespace {
RopeFrequencies rotation_only(const RopeFrequencies& f) {
  RopeFrequencies r = f;
  r.attention_factor = 1.0;
  return r;
}
}  // namespace

void KvCache::shift(SeqId seq, int64_t delta, int64_t from) {
  Sequence& s = seq_ref(seq);
  if (delta == 0) return;
  if (s.rope_mixed)
    throw CacheError(fmt::format("shift: sequence {} holds keys rotated with different frequencies (rope change "
                                 "policy hf); a shift would rotate them all by one rule",
                                 seq));
  int64_t max_kept = -1, min_shifted = std::numeric_limits<int64_t>::max();
  for (int64_t p : positions(seq)) {
    if (p >= from) min_shifted = std::min(min_shifted, p);
    else max_kept = std::max(max_kept, p);
  }
  if (min_shifted == std::numeric_limits<int64_t>::max()) return;
  if (min_shifted + delta < 0 || min_shifted + delta <= max_kept)
    throw CacheError(fmt::format(
        "shift: delta {} would move position {} to {}, onto or before kept position {} (or below 0)",
        delta, min_shifted, min_shifted + delta, max_kept));
  for (std::size_t i = 0; i < s.table.size(); ++i) {
    const Block& ro = *blocks_[static_cast<std::size_t>(s.table[i])];
    if (std::none_of(ro.pos.begin(), ro.pos.begin() + ro.used, [&](int64_t p) { return p >= from; }))
      continue;
    const int32_t id = make_writable(s, i);
    Block& b = *blocks_[static_cast<std::size_t>(id)];
    // Rotation angle per slot: delta for shifted tokens, 0 (the identity,
    // exactly) for the others and for empty slots.
    std::vector<int64_t> angle(static_cast<std::size_t>(b.used), 0);
    for (int32_t k = 0; k < b.used; ++k) {
      int64_t& p = b.pos[static_cast<std::size_t>(k)];
      if (p < from) continue;
      p += delta;
      angle[static_cast<std::size_t>(k)] = delta;
      if (!b.mset.empty() && b.mset[static_cast<std::size_t>(k)])  // MRoPE: all three rows move
        for (int r = 0; r < 3; ++r) b.mpos[static_cast<std::size_t>(r * config_.block_size + k)] += delta;
    }
    if (s.rope) {
      const RopeTable table(rotation_only(s.rope->freqs), angle, s.rope->precision);
      for (int l = 0; l < config_.n_layers; ++l)
        edit_keys(id, l, b.used, [&](float* k) {
          apply_rope(k, b.used, config_.kv_heads, config_.head_dim, table, s.rope->layout);
        });
    }
  }
  if (from < s.next_pos) {
    s.next_pos += delta;
    if (s.mrope_next >= 0) s.mrope_next += delta;
  }
}

const std::optional<KvCache::RopeState>& KvCache::rope_state(SeqId seq) const { return seq_ref(seq).rope; }

void KvCache::set_rope_state(SeqId seq, const RopeState& state, bool rerotate) {
  Sequence& s = seq_ref(seq);
  if (s.rope && *s.rope == state) {
    s.rope->seq_len = state.seq_len;
    return;
  }
  if (!s.rope || s.n_tokens == 0) {
    s.rope = state;
    return;
  }
  if (!rerotate) {
    const auto& o = s.rope->freqs;
    throw CacheError(fmt::format(
        "KV cache: sequence {} holds {} keys rotated with inv_freq[last] = {} (layout {}, angle_precision {}{}), "
        "but the new frequencies have inv_freq[last] = {} (layout {}, angle_precision {}{}); refusing to mix them "
        "(rope change policy refuse: a length-dependent scaling such as dynamic NTK or LongRoPE passed its switch "
        "point; use --rope-change-policy recompute (exact), hf or rerotate)",
        seq, s.n_tokens, o.inv_freq.empty() ? 0.0f : o.inv_freq.back(), to_string(s.rope->layout),
        to_string(s.rope->precision),
        s.rope->seq_len > 0 ? fmt::format(", computed for length {}", s.rope->seq_len) : std::string(),
        state.freqs.inv_freq.empty() ? 0.0f : state.freqs.inv_freq.back(), to_string(state.layout),
        to_string(state.precision),
        state.seq_len > 0 ? fmt::format(", computed for length {}", state.seq_len) : std::string()));
  }
  if (s.mrope_next >= 0)
    throw CacheError(fmt::format(
        "KV cache: sequence {} holds MRoPE keys (three position rows); re-rotating them with new frequencies is "
        "not supported",
        seq));
  if (s.rope->freqs.head_dim != config_.head_dim || state.freqs.head_dim != config_.head_dim)
    throw InvalidArgument("set_rope_state: head_dim of the frequencies differs from the cache's");
  const RopeFrequencies old_rot = rotation_only(s.rope->freqs);
  const RopeFrequencies new_rot = rotation_only(state.freqs);
  const float rescale = static_cast<float>(state.freqs.attention_factor / s.rope->freqs.attention_factor);
  const std::size_t kv_dim = static_cast<std::size_t>(config_.kv_heads) * static_cast<std::size_t>(config_.head_dim);
  for (std::size_t i = 0; i < s.table.size(); ++i) {
    const int32_t id = make_writable(s, i);
    Block& b = *blocks_[static_cast<std::size_t>(id)];
    if (b.used == 0) continue;
    // Empty slots get angle 0; their contents are never read.
    std::vector<int64_t> pos(static_cast<std::size_t>(b.used));
    for (int32_t k = 0; k < b.used; ++k) pos[static_cast<std::size_t>(k)] = std::max<int64_t>(b.pos[static_cast<std::size_t>(k)], 0);
    const RopeTable undo(old_rot, pos, s.rope->precision);
    const RopeTable redo(new_rot, pos, state.precision);
    for (int l = 0; l < config_.n_layers; ++l)
      edit_keys(id, l, b.used, [&](float* k) {
        apply_rope(k, b.used, config_.kv_heads, config_.head_dim, undo, s.rope->layout, RopeDirection::inverse);
        if (rescale != 1.0f)
          for (std::size_t d = 0; d < static_cast<std::size_t>(b.used) * kv_dim; ++d) k[d] *= rescale;
        apply_rope(k, b.used, config_.kv_heads, config_.head_dim, redo, state.layout, RopeDirection::forward);
      });
  }
  s.rope = state;
  ++s.stats.rope_rerotations;
}

void KvCache::set_rope_state_mixed(SeqId seq, const RopeState& state) {
  Sequence& s = seq_ref(seq);
  if (s.rope && *s.rope == state) {
    s.rope->seq_len = state.seq_len;
    return;
  }
  if (s.rope && s.n_tokens > 0) {
    s.rope_mixed = true;
    ++s.stats.rope_changes_kept;
  }
  s.rope = state;
}

bool KvCache::rope_mixed(SeqId seq) const { return seq_ref(seq).rope_mixed; }

std::vector<int32_t> KvCache::token_ids(SeqId seq) const {
  std::vector<int32_t> out;
  for (int32_t b : seq_ref(seq).table) {
    const Block& blk = *blocks_[static_cast<std::size_t>(b)];
    for (int32_t i = 0; i < blk.used; ++i)
      if (blk.pos[static_cast<std::size_t>(i)] >= 0) out.push_back(blk.tok[static_cast<std::size_t>(i)]);
  }
  return out;
}

int64_t KvCache::evicted(SeqId seq) const { return seq_ref(seq).evicted; }

void KvCache::clear(SeqId seq) {
  Sequence& s = seq_ref(seq);
  for (int32_t b : s.table) release_block(b);
  s.table.clear();
  s.next_pos = 0;
  s.n_tokens = 0;
  s.rope.reset();
  s.rope_mixed = false;
  s.evicted = 0;
  s.mrope_next = -1;
}

void KvCache::set_planned_length(SeqId seq, int64_t n) {
  if (n < 0) fail_field<InvalidArgument>("planned_length", "must be >= 0 (0 = unknown)", n);
  seq_ref(seq).planned = n;
}

int64_t KvCache::planned_length(SeqId seq) const { return seq_ref(seq).planned; }
const KvCache::SequenceStats& KvCache::stats(SeqId seq) const { return seq_ref(seq).stats; }

void KvCache::record_recompute(SeqId seq, int64_t tokens) {
  Sequence& s = seq_ref(seq);
  ++s.stats.rope_recomputes;
  s.stats.tokens_reprefilled += tokens;
}

void KvCache::set_mrope_positions(SeqId seq, std::span<const Slot> slots, std::span<const int64_t> position_ids) {
  Sequence& s = seq_ref(seq);
  const std::size_t n = slots.size();
  if (position_ids.size() != 3 * n)
    throw InvalidArgument(fmt::format("mrope position_ids: expected [3, {}] = {} values (got {})", n, 3 * n,
                                      position_ids.size()));
  for (const Slot& slot : slots)
    if (slot.offset < 0 || slot.offset >= config_.block_size ||
        std::find(s.table.begin(), s.table.end(), slot.block) == s.table.end())
      throw InvalidArgument(fmt::format("set_mrope_positions: slot (block {}, offset {}) is not in sequence {}",
                                        slot.block, slot.offset, seq));
  const std::size_t bs = static_cast<std::size_t>(config_.block_size);
  for (std::size_t i = 0; i < n; ++i) {
    Block& b = *blocks_[static_cast<std::size_t>(slots[i].block)];  // append() made it writable
    if (b.mpos.empty()) {
      b.mpos.assign(3 * bs, 0);
      b.mset.assign(bs, 0);
    }
    const auto off = static_cast<std::size_t>(slots[i].offset);
    for (std::size_t r = 0; r < 3; ++r) {
      const int64_t p = position_ids[r * n + i];
      b.mpos[r * bs + off] = p;
      s.mrope_next = std::max(s.mrope_next, p + 1);
    }
    b.mset[off] = 1;
  }
}

std::vector<int64_t> KvCache::mrope_positions(SeqId seq) const {
  const Sequence& s = seq_ref(seq);
  const std::size_t bs = static_cast<std::size_t>(config_.block_size);
  std::array<std::vector<int64_t>, 3> rows;
  for (int32_t id : s.table) {
    const Block& blk = *blocks_[static_cast<std::size_t>(id)];
    for (int32_t k = 0; k < blk.used; ++k) {
      const auto off = static_cast<std::size_t>(k);
      if (blk.pos[off] < 0) continue;
      const bool set = !blk.mset.empty() && blk.mset[off];
      for (std::size_t r = 0; r < 3; ++r) rows[r].push_back(set ? blk.mpos[r * bs + off] : blk.pos[off]);
    }
  }
  std::vector<int64_t> out;
  out.reserve(3 * rows[0].size());
  for (const auto& r : rows) out.insert(out.end(), r.begin(), r.end());
  return out;
}

int64_t KvCache::mrope_delta(SeqId seq) const {
  const Sequence& s = seq_ref(seq);
  return s.mrope_next < 0 ? 0 : s.mrope_next - s.next_pos;
}

int64_t KvCache::blocks_in_use() const {
  return static_cast<int64_t>(blocks_.size() - free_blocks_.size());
}
int64_t KvCache::blocks_allocated() const { return static_cast<int64_t>(blocks_.size()); }

int64_t KvCache::kv_bytes_per_token() const {
  return int64_t{config_.n_layers} * 2 * config_.kv_heads * config_.head_dim * kv_cache_dtype_bytes(config_.dtype);
}

int64_t KvCache::kv_bytes_allocated() const {
  int64_t bytes = 0;
  for (const auto& b : blocks_)
    bytes += static_cast<int64_t>(b->data.size() * sizeof(float) + b->half.size() * sizeof(uint16_t));
  return bytes;
}

}  // namespace posenc
