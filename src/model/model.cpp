#include "posenc/model.hpp"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <set>

#include <fmt/format.h>

#include "model/kernels.hpp"
#include "model/raw_model.hpp"
#include "posenc/absolute.hpp"
#include "posenc/bias.hpp"
#include "posenc/checkpoint.hpp"
#include "posenc/attention.hpp"
#include "posenc/error.hpp"
#include "posenc/io.hpp"

namespace posenc {

namespace {

struct LayerWeights {
  const float* rms_att;
  const float* rms_ffn;
  // Transposed copies [in, out] of the checkpoint's [out, in] matrices.
  std::vector<float> wq_t, wk_t, wv_t, wo_t, w1_t, w2_t, w3_t;
};

std::vector<float> transpose(const float* w, int out, int in) {
  std::vector<float> t(static_cast<std::size_t>(out) * static_cast<std::size_t>(in));
  for (int o = 0; o < out; ++o)
    for (int i = 0; i < in; ++i)
      t[static_cast<std::size_t>(i) * static_cast<std::size_t>(out) + static_cast<std::size_t>(o)] =
          w[static_cast<std::size_t>(o) * static_cast<std::size_t>(in) + static_cast<std::size_t>(i)];
  return t;
}

struct Scratch {
  std::vector<float> x, xb, q, k, v, att, h1, h3, rows;
  std::vector<KvBlock> blocks;
};

}  // namespace

struct Model::Weights {
  MappedFile file;
  ModelConfig cfg;
  const float* token_embedding = nullptr;  // [vocab, dim]
  const float* rms_final = nullptr;        // [dim]
  std::vector<LayerWeights> layers;
  std::vector<float> wcls_t;               // [dim, vocab]
  const float* pos_table = nullptr;        // learned: [pos_rows, dim]
  int64_t pos_rows = 0;
  const float* t5_table = nullptr;         // t5_bias: [num_buckets, n_heads]
  std::vector<float> alibi_slopes;         // alibi: [n_heads]
  std::vector<std::string> symbols;
  std::string metadata_json = "{}";
  // The checkpoint's own [out, in] matrices (views into `file`), for export.
  std::vector<detail::RawLayer> raw_layers;
  const float* raw_output = nullptr;
};

namespace detail {
namespace {
std::atomic<PositionBug> g_position_bug{PositionBug::none};
}
void set_position_bug_for_testing(PositionBug bug) { g_position_bug.store(bug); }
PositionBug position_bug_for_testing() { return g_position_bug.load(std::memory_order_relaxed); }
}  // namespace detail

void Model::set_sliding_window(int64_t window) {
  if (window < 0) fail_field<InvalidArgument>("sliding_window", "must be >= 0 (0 = causal)", window);
  sliding_window_ = window;
}

Model::Model(std::shared_ptr<const Weights> weights) : w_(std::move(weights)) {}
Model::Model(const Model&) = default;
Model& Model::operator=(const Model&) = default;
Model::Model(Model&&) noexcept = default;
Model& Model::operator=(Model&&) noexcept = default;
Model::~Model() = default;

const ModelConfig& Model::config() const { return w_->cfg; }
void Model::set_rope_change_policy(RopeChangePolicy policy) { policy_ = policy; }

void Model::set_rope(const RopeSetup& rope) {
  if (positional_.family != PositionFamily::rope)
    throw InvalidArgument(fmt::format("rope: this model's positional family is {}, not rope",
                                      to_string(positional_.family)));
  rope.freqs.validate();
  if (rope.freqs.head_dim != w_->cfg.head_dim)
    throw InvalidArgument(fmt::format("head_dim: RoPE frequencies are for head_dim {}, the model has {}",
                                      rope.freqs.head_dim, w_->cfg.head_dim));
  positional_.rope = rope;
}

Model Model::build(detail::RawModel raw) {
  auto w = std::make_shared<Weights>();
  const ModelConfig& c = raw.cfg;
  w->cfg = c;
  w->token_embedding = raw.tok_embeddings;
  w->rms_final = raw.norm;
  w->layers.resize(static_cast<std::size_t>(c.n_layers));
  for (std::size_t l = 0; l < w->layers.size(); ++l) {
    const detail::RawLayer& r = raw.layers[l];
    LayerWeights& lw = w->layers[l];
    lw.rms_att = r.attention_norm;
    lw.rms_ffn = r.ffn_norm;
    lw.wq_t = transpose(r.wq, c.dim, c.dim);
    lw.wk_t = transpose(r.wk, c.kv_dim(), c.dim);
    lw.wv_t = transpose(r.wv, c.kv_dim(), c.dim);
    lw.wo_t = transpose(r.wo, c.dim, c.dim);
    lw.w1_t = transpose(r.w1, c.hidden_dim, c.dim);
    lw.w2_t = transpose(r.w2, c.dim, c.hidden_dim);
    lw.w3_t = transpose(r.w3, c.hidden_dim, c.dim);
  }
  w->wcls_t = transpose(raw.output, c.vocab_size, c.dim);
  w->raw_layers = raw.layers;
  w->raw_output = raw.output;
  w->pos_table = raw.pos_embeddings;
  w->pos_rows = raw.pos_rows;
  w->t5_table = raw.t5_bias;
  if (raw.positional.family == PositionFamily::alibi)
    w->alibi_slopes = alibi_slopes(c.n_heads, raw.positional.alibi_max_bias);
  w->symbols = std::move(raw.symbols);
  w->metadata_json = std::move(raw.metadata_json);
  PositionalConfig pc = raw.positional;
  w->file = std::move(raw.file);
  Model m(std::move(w));
  m.positional_ = std::move(pc);
  return m;
}

Model Model::load_llama2c(const std::filesystem::path& path) { return build(detail::read_llama2c(path)); }

Model Model::load(const std::filesystem::path& path) {
  return build(is_posenc_checkpoint(path) ? detail::read_posenc(path) : detail::read_llama2c(path));
}

PosencCheckpoint Model::to_checkpoint() const {
  const Weights& w = *w_;
  const ModelConfig& c = w.cfg;
  PosencCheckpoint ck;
  ck.config = c;
  ck.positional = positional_;
  ck.symbols = w.symbols;
  ck.metadata_json = w.metadata_json;
  auto add = [&](std::string name, std::vector<int64_t> shape, const float* p) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    ck.tensors.push_back({std::move(name), std::move(shape), std::vector<float>(p, p + n)});
  };
  const int64_t D = c.dim, H = c.hidden_dim, V = c.vocab_size, KV = c.kv_dim();
  add("tok_embeddings", {V, D}, w.token_embedding);
  for (int l = 0; l < c.n_layers; ++l) {
    const auto& r = w.raw_layers[static_cast<std::size_t>(l)];
    const std::string p = fmt::format("layers.{}.", l);
    add(p + "attention_norm", {D}, r.attention_norm);
    add(p + "wq", {D, D}, r.wq);
    add(p + "wk", {KV, D}, r.wk);
    add(p + "wv", {KV, D}, r.wv);
    add(p + "wo", {D, D}, r.wo);
    add(p + "ffn_norm", {D}, r.ffn_norm);
    add(p + "w1", {H, D}, r.w1);
    add(p + "w2", {D, H}, r.w2);
    add(p + "w3", {H, D}, r.w3);
  }
  add("norm", {D}, w.rms_final);
  if (!c.shared_classifier) add("output", {V, D}, w.raw_output);
  if (positional_.family == PositionFamily::learned_absolute) add("pos_embeddings", {w.pos_rows, D}, w.pos_table);
  if (positional_.family == PositionFamily::t5_bias)
    add("t5_relative_attention_bias", {positional_.t5_num_buckets, c.n_heads}, w.t5_table);
  return ck;
}

const std::vector<std::string>& Model::embedded_symbols() const { return w_->symbols; }
const std::string& Model::metadata_json() const { return w_->metadata_json; }

KvCache Model::make_cache(int block_size, int64_t max_blocks) const {
  KvCache::Config kc;
  kc.n_layers = w_->cfg.n_layers;
  kc.kv_heads = w_->cfg.n_kv_heads;
  kc.head_dim = w_->cfg.head_dim;
  kc.block_size = block_size;
  kc.max_blocks = max_blocks;
  return KvCache(kc);
}

void Model::forward(KvCache& cache, std::span<const SequenceInput> batch, LogitsMode mode,
                    std::vector<float>& logits) const {
  const Weights& m = *w_;
  const ModelConfig& c = m.cfg;
  const auto& kc = cache.config();
  if (kc.n_layers != c.n_layers || kc.kv_heads != c.n_kv_heads || kc.head_dim != c.head_dim)
    throw InvalidArgument(fmt::format(
        "KV cache shape (n_layers {}, num_key_value_heads {}, head_dim {}) does not match the model ({}, {}, {})",
        kc.n_layers, kc.kv_heads, kc.head_dim, c.n_layers, c.n_kv_heads, c.head_dim));

  // ---- validate everything before touching the cache ("loses nothing") ----
  const std::size_t B = batch.size();
  std::vector<int64_t> offset(B + 1, 0);
  std::set<KvCache::SeqId> seen;
  for (std::size_t b = 0; b < B; ++b) {
    const auto& in = batch[b];
    if (!cache.contains(in.seq)) fail_field<InvalidArgument>("sequence id", "not a live sequence", in.seq);
    if (!seen.insert(in.seq).second)
      fail_field<InvalidArgument>("sequence id", "listed twice in one batch", in.seq);
    if (!in.position_ids.empty() && in.position_ids.size() != in.tokens.size())
      throw InvalidArgument(fmt::format("position_ids: {} entries for {} tokens (sequence {})",
                                        in.position_ids.size(), in.tokens.size(), in.seq));
    for (int32_t t : in.tokens)
      if (t < 0 || t >= c.vocab_size)
        throw InvalidArgument(fmt::format("token id: must be in [0, {}) (got {})", c.vocab_size, t));
    if (mode == LogitsMode::last && in.tokens.empty())
      fail_field<InvalidArgument>("tokens", "empty input cannot give a last-token logit row (sequence)", in.seq);
    offset[b + 1] = offset[b] + static_cast<int64_t>(in.tokens.size());
  }
  const int64_t N = offset[B];
  std::vector<int64_t> pos(static_cast<std::size_t>(N));
  for (std::size_t b = 0; b < B; ++b) {
    const auto& in = batch[b];
    const int64_t start = detail::position_bug_for_testing() == detail::PositionBug::restart_each_chunk
                              ? 0
                              : cache.next_position(in.seq);
    for (std::size_t i = 0; i < in.tokens.size(); ++i) {
      const int64_t p = in.position_ids.empty() ? start + static_cast<int64_t>(i) : in.position_ids[i];
      if (p < 0) fail_field<InvalidArgument>("position_ids", "must be non-negative", p);
      pos[static_cast<std::size_t>(offset[b]) + i] = p;
    }
  }

  const PositionFamily family = positional_.family;
  if (family == PositionFamily::learned_absolute)
    for (int64_t p : pos)
      if (p >= m.pos_rows)
        throw PositionError(fmt::format(
            "position_ids: position {} is past the learned position table (max_position_embeddings {})", p,
            m.pos_rows));

  // ---- per-sequence RoPE state (dynamic methods recompute for the length) ----
  const bool rope = family == PositionFamily::rope;
  std::vector<KvCache::RopeState> states(rope ? B : 0);
  if (rope) {
    const bool dynamic = find_rope_scaling(positional_.rope.params.rope_type).depends_on_seq_len &&
                         positional_.rope.params.rope_type == positional_.rope.freqs.rope_type;
    for (std::size_t b = 0; b < B; ++b) {
      states[b] = {positional_.rope.freqs, positional_.rope.layout, positional_.rope.precision};
      if (dynamic && offset[b + 1] > offset[b]) {
        int64_t maxp = 0;
        for (int64_t i = offset[b]; i < offset[b + 1]; ++i) maxp = std::max(maxp, pos[static_cast<std::size_t>(i)]);
        maxp = std::max(maxp, cache.next_position(batch[b].seq) - 1);
        // HF's forward path (dynamic_rope_update) forms dynamic NTK's base' in
        // float32 from the integer length tensor.
        states[b].freqs = positional_.rope.params.rope_type == "dynamic"
                              ? dynamic_ntk_frequencies(positional_.rope.params, maxp + 1,
                                                        DynamicNtkArithmetic::tensor_float32)
                              : compute_rope_frequencies(positional_.rope.params, maxp + 1);
      }
    }
    // Refusals happen here, before anything is appended to any sequence.
    for (std::size_t b = 0; b < B; ++b) {
      const auto& cur = cache.rope_state(batch[b].seq);
      if (cur && !(*cur == states[b]) && cache.size(batch[b].seq) > 0 && policy_ == RopeChangePolicy::refuse)
        cache.set_rope_state(batch[b].seq, states[b], false);  // throws CacheError
    }
    for (std::size_t b = 0; b < B; ++b)
      cache.set_rope_state(batch[b].seq, states[b], policy_ == RopeChangePolicy::rerotate);
  }

  std::vector<std::vector<KvCache::Slot>> slots(B);
  for (std::size_t b = 0; b < B; ++b)
    slots[b] = cache.append(batch[b].seq, std::span<const int64_t>(pos).subspan(
                                              static_cast<std::size_t>(offset[b]), batch[b].tokens.size()));
  std::vector<RopeTable> tables;
  if (rope) {
    tables.reserve(B);
    for (std::size_t b = 0; b < B; ++b)
      tables.emplace_back(states[b].freqs,
                          std::span<const int64_t>(pos).subspan(static_cast<std::size_t>(offset[b]),
                                                                batch[b].tokens.size()),
                          states[b].precision);
  }

  // ---- the network ----
  thread_local Scratch s;
  const int D = c.dim, KV = c.kv_dim(), HID = c.hidden_dim;
  const auto sz = static_cast<std::size_t>(N);
  s.x.resize(sz * D);
  s.xb.resize(sz * D);
  s.q.resize(sz * D);
  s.k.resize(sz * KV);
  s.v.resize(sz * KV);
  s.att.resize(sz * D);
  s.h1.resize(sz * HID);
  s.h3.resize(sz * HID);
  for (std::size_t b = 0; b < B; ++b)
    for (std::size_t i = 0; i < batch[b].tokens.size(); ++i) {
      const int64_t r = offset[b] + static_cast<int64_t>(i);
      std::memcpy(s.x.data() + r * D, m.token_embedding + static_cast<int64_t>(batch[b].tokens[i]) * D,
                  sizeof(float) * static_cast<std::size_t>(D));
    }
  if (family == PositionFamily::learned_absolute)
    add_absolute_position_encoding(AbsolutePositionEncoding::table, std::span(s.x.data(), sz * D), D, pos,
                                   std::span(m.pos_table, static_cast<std::size_t>(m.pos_rows) * D), m.pos_rows);
  if (family == PositionFamily::sinusoidal)
    add_sinusoidal_encoding(std::span(s.x.data(), sz * D), D, pos, SinusoidalLayout::interleaved,
                            positional_.sinusoidal_base);

  AttentionSpec spec;
  spec.heads = c.n_heads;
  spec.kv_heads = c.n_kv_heads;
  spec.head_dim = c.head_dim;
  spec.mask = sliding_window_ > 0 ? MaskKind::sliding_window : MaskKind::causal;
  spec.sliding_window = sliding_window_;
  if (family == PositionFamily::alibi) {
    spec.bias = LogitBias::alibi;
    spec.alibi_slopes = m.alibi_slopes;
  } else if (family == PositionFamily::t5_bias) {
    spec.bias = LogitBias::t5;
    spec.t5.table = std::span(m.t5_table, static_cast<std::size_t>(positional_.t5_num_buckets) * c.n_heads);
    spec.t5.num_buckets = positional_.t5_num_buckets;
    spec.t5.max_distance = positional_.t5_max_distance;
    spec.t5.bidirectional = false;
  }

  for (int l = 0; l < c.n_layers; ++l) {
    const LayerWeights& w = m.layers[static_cast<std::size_t>(l)];
    detail::rmsnorm(s.x.data(), w.rms_att, N, D, c.norm_eps, s.xb.data());
    detail::matmul_t(s.xb.data(), N, D, w.wq_t.data(), D, s.q.data());
    detail::matmul_t(s.xb.data(), N, D, w.wk_t.data(), KV, s.k.data());
    detail::matmul_t(s.xb.data(), N, D, w.wv_t.data(), KV, s.v.data());
    for (std::size_t b = 0; b < B; ++b) {
      const int64_t r0 = offset[b], n = offset[b + 1] - offset[b];
      if (n == 0) continue;
      if (rope) {
        apply_rope(s.q.data() + r0 * D, n, c.n_heads, c.head_dim, tables[b], states[b].layout);
        apply_rope(s.k.data() + r0 * KV, n, c.n_kv_heads, c.head_dim, tables[b], states[b].layout);
      }
      for (int64_t i = 0; i < n; ++i) {
        const auto slot = slots[b][static_cast<std::size_t>(i)];
        std::memcpy(cache.key(l, slot), s.k.data() + (r0 + i) * KV, sizeof(float) * static_cast<std::size_t>(KV));
        std::memcpy(cache.value(l, slot), s.v.data() + (r0 + i) * KV, sizeof(float) * static_cast<std::size_t>(KV));
      }
    }
    for (std::size_t b = 0; b < B; ++b) {
      const int64_t r0 = offset[b], n = offset[b + 1] - offset[b];
      if (n == 0) continue;
      s.blocks.clear();
      cache.blocks(l, batch[b].seq, s.blocks);
      attention_forward(spec, s.q.data() + r0 * D,
                        std::span<const int64_t>(pos).subspan(static_cast<std::size_t>(r0), static_cast<std::size_t>(n)),
                        s.blocks, s.att.data() + r0 * D);
    }
    detail::matmul_t_acc(s.att.data(), N, D, w.wo_t.data(), D, s.x.data());
    detail::rmsnorm(s.x.data(), w.rms_ffn, N, D, c.norm_eps, s.xb.data());
    detail::matmul_t(s.xb.data(), N, D, w.w1_t.data(), HID, s.h1.data());
    detail::matmul_t(s.xb.data(), N, D, w.w3_t.data(), HID, s.h3.data());
    detail::swiglu(s.h1.data(), s.h3.data(), N * HID);
    detail::matmul_t_acc(s.h1.data(), N, HID, w.w2_t.data(), D, s.x.data());
  }

  // ---- classifier on the requested rows ----
  int64_t rows = N;
  const float* src = s.x.data();
  if (mode == LogitsMode::last) {
    rows = static_cast<int64_t>(B);
    s.rows.resize(B * static_cast<std::size_t>(D));
    for (std::size_t b = 0; b < B; ++b)
      std::memcpy(s.rows.data() + b * D, s.x.data() + (offset[b + 1] - 1) * D, sizeof(float) * static_cast<std::size_t>(D));
    src = s.rows.data();
  }
  detail::rmsnorm(src, m.rms_final, rows, D, c.norm_eps, s.xb.data());
  logits.resize(static_cast<std::size_t>(rows) * static_cast<std::size_t>(c.vocab_size));
  detail::matmul_t(s.xb.data(), rows, D, m.wcls_t.data(), c.vocab_size, logits.data());
}

void Model::forward_padded(KvCache& cache, std::span<const KvCache::SeqId> seqs, std::span<const int32_t> tokens,
                           std::span<const uint8_t> attention_mask, int64_t width, std::vector<float>& logits) const {
  const std::size_t B = seqs.size();
  if (width <= 0) fail_field<InvalidArgument>("width", "must be positive", width);
  if (tokens.size() != B * static_cast<std::size_t>(width) || attention_mask.size() != tokens.size())
    throw InvalidArgument(fmt::format("forward_padded: tokens ({}) and attention_mask ({}) must both be [batch={}, "
                                      "width={}]",
                                      tokens.size(), attention_mask.size(), B, width));
  for (uint8_t m : attention_mask)
    if (m > 1) fail_field<InvalidArgument>("attention_mask", "values must be 0 or 1", static_cast<int>(m));
  const bool bug = detail::position_bug_for_testing() == detail::PositionBug::count_padding;
  std::vector<std::vector<int32_t>> toks(B);
  std::vector<std::vector<int64_t>> pos(B);
  std::vector<std::vector<int64_t>> cols(B);
  for (std::size_t b = 0; b < B; ++b) {
    if (!cache.contains(seqs[b])) fail_field<InvalidArgument>("sequence id", "not a live sequence", seqs[b]);
    const int64_t start = cache.next_position(seqs[b]);
    int64_t real = 0;
    for (int64_t c = 0; c < width; ++c) {
      const std::size_t i = b * static_cast<std::size_t>(width) + static_cast<std::size_t>(c);
      if (!attention_mask[i]) continue;
      toks[b].push_back(tokens[i]);
      pos[b].push_back(start + (bug ? c : real));
      cols[b].push_back(c);
      ++real;
    }
  }
  std::vector<SequenceInput> batch;
  for (std::size_t b = 0; b < B; ++b)
    if (!toks[b].empty()) batch.push_back({seqs[b], toks[b], pos[b]});
  std::vector<float> rows;
  forward(cache, batch, LogitsMode::all, rows);
  const auto V = static_cast<std::size_t>(w_->cfg.vocab_size);
  logits.assign(B * static_cast<std::size_t>(width) * V, 0.0f);
  std::size_t r = 0;
  for (std::size_t b = 0; b < B; ++b)
    for (int64_t c : cols[b]) {
      std::copy(rows.begin() + static_cast<std::ptrdiff_t>(r * V), rows.begin() + static_cast<std::ptrdiff_t>((r + 1) * V),
                logits.begin() + static_cast<std::ptrdiff_t>((b * static_cast<std::size_t>(width) + static_cast<std::size_t>(c)) * V));
      ++r;
    }
}

std::vector<float> Model::score_window(std::span<const int32_t> tokens) const {
  KvCache cache = make_cache(64);
  const KvCache::SeqId seq = cache.create();
  SequenceInput in{seq, tokens, {}};
  std::vector<float> logits;
  forward(cache, std::span<const SequenceInput>(&in, 1), LogitsMode::all, logits);
  return logits;
}

}  // namespace posenc
