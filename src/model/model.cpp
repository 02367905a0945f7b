#include "posenc/model.hpp"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <set>

#include <fmt/format.h>

#include "model/kernels.hpp"
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
  std::vector<float> wcls_t;  // [dim, vocab]
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
const RopeSetup& Model::rope() const { return rope_; }
void Model::set_rope_change_policy(RopeChangePolicy policy) { policy_ = policy; }

void Model::set_rope(const RopeSetup& rope) {
  rope.freqs.validate();
  if (rope.freqs.head_dim != w_->cfg.head_dim)
    throw InvalidArgument(fmt::format("head_dim: RoPE frequencies are for head_dim {}, the model has {}",
                                      rope.freqs.head_dim, w_->cfg.head_dim));
  rope_ = rope;
}

Model Model::load_llama2c(const std::filesystem::path& path) {
  auto impl = std::make_shared<Weights>();
  impl->file = MappedFile(path);
  const std::string name = path.string();
  const auto bytes = impl->file.bytes();
  if (bytes.empty()) throw CheckpointError(fmt::format("{}: empty file, expected a llama2.c checkpoint", name));
  if (bytes.size() < 28)
    throw CheckpointError(fmt::format("{}: truncated header: {} bytes, the llama2.c header needs 28", name,
                                      bytes.size()));
  int32_t h[7];
  std::memcpy(h, bytes.data(), sizeof h);
  if (static_cast<uint32_t>(h[0]) == 0x616b3432u)
    throw CheckpointError(fmt::format(
        "{}: llama2.c export version >= 1 (magic 'ak42'); only the legacy version-0 layout is supported",
        name));
  static constexpr const char* kField[7] = {"dim", "hidden_dim", "n_layers", "n_heads", "n_kv_heads",
                                            "vocab_size", "seq_len"};
  static constexpr int32_t kMax[7] = {1 << 16, 1 << 18, 1 << 10, 1 << 10, 1 << 10, 1 << 22, 1 << 24};
  for (int i = 0; i < 7; ++i) {
    const int64_t v = i == 5 ? std::abs(static_cast<int64_t>(h[i])) : h[i];
    if (v <= 0 || v > kMax[i])
      throw CheckpointError(fmt::format("{}: header field {} must be in [1, {}]{} (got {})", name, kField[i],
                                        kMax[i], i == 5 ? " in absolute value" : "", h[i]));
  }
  ModelConfig& c = impl->cfg;
  c.dim = h[0];
  c.hidden_dim = h[1];
  c.n_layers = h[2];
  c.n_heads = h[3];
  c.n_kv_heads = h[4];
  c.shared_classifier = h[5] > 0;
  c.vocab_size = std::abs(h[5]);
  c.max_position_embeddings = h[6];
  if (c.dim % c.n_heads != 0)
    throw CheckpointError(fmt::format("{}: dim {} is not divisible by n_heads {}", name, c.dim, c.n_heads));
  if (c.n_kv_heads > c.n_heads || c.n_heads % c.n_kv_heads != 0)
    throw CheckpointError(fmt::format("{}: n_heads {} is not a multiple of n_kv_heads {}", name, c.n_heads,
                                      c.n_kv_heads));
  c.head_dim = c.dim / c.n_heads;
  if (c.head_dim % 2 != 0)
    throw CheckpointError(fmt::format("{}: head_dim = dim/n_heads = {} must be even for RoPE", name, c.head_dim));

  const uint64_t dim = static_cast<uint64_t>(c.dim), hid = static_cast<uint64_t>(c.hidden_dim),
                 L = static_cast<uint64_t>(c.n_layers), V = static_cast<uint64_t>(c.vocab_size),
                 kv = static_cast<uint64_t>(c.kv_dim()), hs = static_cast<uint64_t>(c.head_dim),
                 S = static_cast<uint64_t>(c.max_position_embeddings);
  const uint64_t floats = V * dim + L * dim + L * dim * dim + 2 * L * dim * kv + L * dim * dim + L * dim +
                          3 * L * dim * hid + dim + S * hs + (c.shared_classifier ? 0 : V * dim);
  const uint64_t expect = 28 + 4 * floats;
  if (bytes.size() < expect)
    throw CheckpointError(fmt::format(
        "{}: truncated: the header (dim={}, hidden_dim={}, n_layers={}, n_heads={}, n_kv_heads={}, "
        "vocab_size={}, seq_len={}) needs {} bytes, the file has {}",
        name, h[0], h[1], h[2], h[3], h[4], h[5], h[6], expect, bytes.size()));
  if (bytes.size() > expect)
    throw CheckpointError(fmt::format(
        "{}: {} bytes beyond the {} the header describes: not a llama2.c version-0 checkpoint for this header",
        name, bytes.size() - expect, expect));

  const float* p = reinterpret_cast<const float*>(bytes.data() + 28);
  // Reject non-finite weights before use (names the tensor and the index).
  {
    const uint64_t n = floats;
    for (uint64_t i = 0; i < n; ++i)
      if (!std::isfinite(p[i]))
        throw CheckpointError(fmt::format("{}: weight #{} (byte offset {}) is not finite ({})", name, i,
                                          28 + 4 * i, p[i]));
  }
  auto take = [&](uint64_t n) {
    const float* r = p;
    p += n;
    return r;
  };
  impl->token_embedding = take(V * dim);
  const float* rms_att = take(L * dim);
  const float* wq = take(L * dim * dim);
  const float* wk = take(L * dim * kv);
  const float* wv = take(L * dim * kv);
  const float* wo = take(L * dim * dim);
  const float* rms_ffn = take(L * dim);
  const float* w1 = take(L * dim * hid);
  const float* w2 = take(L * hid * dim);
  const float* w3 = take(L * dim * hid);
  impl->rms_final = take(dim);
  take(S * hs / 2);  // freq_cis_real (unused: RoPE comes from posenc's RoPE core)
  take(S * hs / 2);  // freq_cis_imag
  const float* wcls = c.shared_classifier ? impl->token_embedding : take(V * dim);

  impl->layers.resize(static_cast<std::size_t>(c.n_layers));
  for (uint64_t l = 0; l < L; ++l) {
    LayerWeights& lw = impl->layers[l];
    lw.rms_att = rms_att + l * dim;
    lw.rms_ffn = rms_ffn + l * dim;
    lw.wq_t = transpose(wq + l * dim * dim, c.dim, c.dim);
    lw.wk_t = transpose(wk + l * dim * kv, c.kv_dim(), c.dim);
    lw.wv_t = transpose(wv + l * dim * kv, c.kv_dim(), c.dim);
    lw.wo_t = transpose(wo + l * dim * dim, c.dim, c.dim);
    lw.w1_t = transpose(w1 + l * dim * hid, c.hidden_dim, c.dim);
    lw.w2_t = transpose(w2 + l * hid * dim, c.dim, c.hidden_dim);
    lw.w3_t = transpose(w3 + l * dim * hid, c.hidden_dim, c.dim);
  }
  impl->wcls_t = transpose(wcls, c.vocab_size, c.dim);

  RopeParams rp;
  rp.rope_type = "default";
  rp.rope_theta = 10000.0;
  rp.head_dim = c.head_dim;
  rp.rotary_dim = c.head_dim;
  rp.max_position_embeddings = c.max_position_embeddings;
  rp.original_max_position_embeddings = c.max_position_embeddings;
  Model model(std::move(impl));
  model.rope_.params = rp;
  model.rope_.freqs = compute_rope_frequencies(rp);
  model.rope_.layout = RopeLayout::interleaved;
  model.rope_.precision = AnglePrecision::float32;
  return model;
}

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

  // ---- per-sequence RoPE state (dynamic methods recompute for the length) ----
  const bool dynamic = find_rope_scaling(rope_.params.rope_type).depends_on_seq_len &&
                       rope_.params.rope_type == rope_.freqs.rope_type;
  std::vector<KvCache::RopeState> states(B);
  for (std::size_t b = 0; b < B; ++b) {
    states[b] = {rope_.freqs, rope_.layout, rope_.precision};
    if (dynamic && offset[b + 1] > offset[b]) {
      int64_t maxp = 0;
      for (int64_t i = offset[b]; i < offset[b + 1]; ++i) maxp = std::max(maxp, pos[static_cast<std::size_t>(i)]);
      maxp = std::max(maxp, cache.next_position(batch[b].seq) - 1);
      states[b].freqs = compute_rope_frequencies(rope_.params, maxp + 1);
    }
  }
  for (std::size_t b = 0; b < B; ++b)
    cache.set_rope_state(batch[b].seq, states[b], policy_ == RopeChangePolicy::rerotate);

  std::vector<std::vector<KvCache::Slot>> slots(B);
  for (std::size_t b = 0; b < B; ++b)
    slots[b] = cache.append(batch[b].seq, std::span<const int64_t>(pos).subspan(
                                              static_cast<std::size_t>(offset[b]), batch[b].tokens.size()));
  std::vector<RopeTable> tables;
  tables.reserve(B);
  for (std::size_t b = 0; b < B; ++b)
    tables.emplace_back(states[b].freqs,
                        std::span<const int64_t>(pos).subspan(static_cast<std::size_t>(offset[b]),
                                                              batch[b].tokens.size()),
                        states[b].precision);

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

  AttentionSpec spec;
  spec.heads = c.n_heads;
  spec.kv_heads = c.n_kv_heads;
  spec.head_dim = c.head_dim;
  spec.mask = sliding_window_ > 0 ? MaskKind::sliding_window : MaskKind::causal;
  spec.sliding_window = sliding_window_;

  for (int l = 0; l < c.n_layers; ++l) {
    const LayerWeights& w = m.layers[static_cast<std::size_t>(l)];
    detail::rmsnorm(s.x.data(), w.rms_att, N, D, c.norm_eps, s.xb.data());
    detail::matmul_t(s.xb.data(), N, D, w.wq_t.data(), D, s.q.data());
    detail::matmul_t(s.xb.data(), N, D, w.wk_t.data(), KV, s.k.data());
    detail::matmul_t(s.xb.data(), N, D, w.wv_t.data(), KV, s.v.data());
    for (std::size_t b = 0; b < B; ++b) {
      const int64_t r0 = offset[b], n = offset[b + 1] - offset[b];
      if (n == 0) continue;
      apply_rope(s.q.data() + r0 * D, n, c.n_heads, c.head_dim, tables[b], states[b].layout);
      apply_rope(s.k.data() + r0 * KV, n, c.n_kv_heads, c.head_dim, tables[b], states[b].layout);
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
