// llama2.c legacy (version 0) checkpoint reader.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <span>
#include <string>

#include <fmt/format.h>

#include "model/raw_model.hpp"
#include "posenc/error.hpp"
#include "posenc/scaling.hpp"

namespace posenc::detail {

void validate_config(const std::string& name, ModelConfig& c) {
  if (c.n_heads <= 0 || c.n_kv_heads <= 0 || c.dim <= 0)
    throw CheckpointError(fmt::format("{}: dim {}, n_heads {}, n_kv_heads {} must be positive", name, c.dim,
                                      c.n_heads, c.n_kv_heads));
  if (c.head_dim == 0 && c.dim % c.n_heads != 0)
    throw CheckpointError(fmt::format("{}: dim {} is not divisible by n_heads {}", name, c.dim, c.n_heads));
  if (c.n_kv_heads > c.n_heads || c.n_heads % c.n_kv_heads != 0)
    throw CheckpointError(fmt::format("{}: n_heads {} is not a multiple of n_kv_heads {}", name, c.n_heads,
                                      c.n_kv_heads));
  if (c.head_dim == 0) c.head_dim = c.dim / c.n_heads;
  if (c.head_dim <= 0 || c.head_dim > (1 << 14))
    throw CheckpointError(fmt::format("{}: head_dim must be in [2, 16384] (got {})", name, c.head_dim));
  if (c.head_dim % 2 != 0)
    throw CheckpointError(fmt::format("{}: head_dim {} must be even for RoPE", name, c.head_dim));
  if (static_cast<int64_t>(c.n_heads) * c.head_dim > (1 << 20))
    throw CheckpointError(fmt::format("{}: n_heads * head_dim = {} is too large", name,
                                      static_cast<int64_t>(c.n_heads) * c.head_dim));
}

void check_finite(const std::string& name, const std::string& tensor, const float* p, uint64_t n) {
  for (uint64_t i = 0; i < n; ++i)
    if (!std::isfinite(p[i]))
      throw CheckpointError(fmt::format("{}: {}[{}] is not finite ({})", name, tensor, i, p[i]));
}

namespace {
/// "; it starts as text: 'Once upon a time'" when the file's first bytes are printable text (a text file given
/// as the model), "" otherwise.
std::string text_start(std::span<const std::byte> bytes) {
  const std::size_t n = std::min<std::size_t>(bytes.size(), 32);
  if (n == 0) return "";
  std::string shown;
  for (std::size_t i = 0; i < n; ++i) {
    const auto b = static_cast<uint8_t>(bytes[i]);
    if (b == '\n' || b == '\r' || b == '\t') {
      shown += ' ';
    } else if (b >= 0x20 && b < 0x7f) {
      shown += static_cast<char>(b);
    } else if (b >= 0x80 && i + 1 < n) {
      shown += '?';  // UTF-8 text passes; bytes below 0x20 say binary
    } else {
      return "";
    }
  }
  return fmt::format("; it starts as text: '{}'", shown);
}
}  // namespace

RawModel read_llama2c(const std::filesystem::path& path) {
  RawModel raw;
  raw.files.emplace_back(path);
  const std::string name = path.string();
  const auto bytes = raw.files.back().bytes();
  // llama2.c files have no magic: whatever is not a directory, a GGUF or a posenc checkpoint is read as one, and the
  // header's errors say so (a text file given as --model failed with "header field dim must be in [1, 65536] (got
  // 1701015119)" and no word of the format assumed).
  auto header_error = [&](const std::string& what) {
    return CheckpointError(fmt::format("{} (read as a llama2.c checkpoint, the format of last resort: the file is not "
                                       "a directory and has neither the GGUF nor the posenc magic{})",
                                       what, text_start(bytes)));
  };
  if (bytes.empty()) throw header_error(fmt::format("{}: empty file, expected a llama2.c checkpoint", name));
  if (bytes.size() < 28)
    throw header_error(
        fmt::format("{}: truncated header: {} bytes, the llama2.c header needs 28", name, bytes.size()));
  int32_t h[7];
  std::memcpy(h, bytes.data(), sizeof h);
  if (static_cast<uint32_t>(h[0]) == 0x616b3432u)
    throw CheckpointError(fmt::format(
        "{}: llama2.c export version >= 1 (magic 'ak42'); only the legacy version-0 layout is supported", name));
  static constexpr const char* kField[7] = {"dim", "hidden_dim", "n_layers", "n_heads", "n_kv_heads",
                                            "vocab_size", "seq_len"};
  static constexpr int32_t kMax[7] = {1 << 16, 1 << 18, 1 << 10, 1 << 10, 1 << 10, 1 << 22, 1 << 24};
  for (int i = 0; i < 7; ++i) {
    const int64_t v = i == 5 ? std::abs(static_cast<int64_t>(h[i])) : h[i];
    if (v <= 0 || v > kMax[i])
      throw header_error(fmt::format("{}: header field {} must be in [1, {}]{} (got {})", name, kField[i], kMax[i],
                                     i == 5 ? " in absolute value" : "", h[i]));
  }
  ModelConfig& c = raw.cfg;
  c.dim = h[0];
  c.hidden_dim = h[1];
  c.n_layers = h[2];
  c.n_heads = h[3];
  c.n_kv_heads = h[4];
  c.shared_classifier = h[5] > 0;
  c.vocab_size = std::abs(h[5]);
  c.max_position_embeddings = h[6];
  try {
    validate_config(name, c);
  } catch (const CheckpointError& e) {
    throw header_error(e.what());
  }

  const uint64_t dim = static_cast<uint64_t>(c.dim), hid = static_cast<uint64_t>(c.hidden_dim),
                 L = static_cast<uint64_t>(c.n_layers), V = static_cast<uint64_t>(c.vocab_size),
                 kv = static_cast<uint64_t>(c.kv_dim()), hs = static_cast<uint64_t>(c.head_dim),
                 S = static_cast<uint64_t>(c.max_position_embeddings);
  const uint64_t floats = V * dim + L * dim + L * dim * dim + 2 * L * dim * kv + L * dim * dim + L * dim +
                          3 * L * dim * hid + dim + S * hs + (c.shared_classifier ? 0 : V * dim);
  const uint64_t expect = 28 + 4 * floats;
  if (bytes.size() < expect)
    throw header_error(fmt::format(
        "{}: truncated: the header (dim={}, hidden_dim={}, n_layers={}, n_heads={}, n_kv_heads={}, "
        "vocab_size={}, seq_len={}) needs {} bytes, the file has {}",
        name, h[0], h[1], h[2], h[3], h[4], h[5], h[6], expect, bytes.size()));
  if (bytes.size() > expect)
    throw header_error(fmt::format(
        "{}: {} bytes beyond the {} the header describes: not a llama2.c version-0 checkpoint for this header",
        name, bytes.size() - expect, expect));

  const float* p = reinterpret_cast<const float*>(bytes.data() + 28);
  check_finite(name, "weights", p, floats);
  auto take = [&](uint64_t n) {
    const float* r = p;
    p += n;
    return r;
  };
  const float* tok = take(V * dim);
  raw.tok_embeddings = f32_matrix(tok, static_cast<int64_t>(V), static_cast<int64_t>(dim), "token_embedding_table");
  const float* rms_att = take(L * dim);
  const float* wq = take(L * dim * dim);
  const float* wk = take(L * dim * kv);
  const float* wv = take(L * dim * kv);
  const float* wo = take(L * dim * dim);
  const float* rms_ffn = take(L * dim);
  const float* w1 = take(L * dim * hid);
  const float* w2 = take(L * hid * dim);
  const float* w3 = take(L * dim * hid);
  raw.norm = take(dim);
  take(S * hs / 2);  // freq_cis_real (unused: RoPE comes from posenc's RoPE core)
  take(S * hs / 2);  // freq_cis_imag
  raw.output = c.shared_classifier ? raw.tok_embeddings
                                   : f32_matrix(take(V * dim), static_cast<int64_t>(V), static_cast<int64_t>(dim), "wcls");
  raw.layers.resize(static_cast<std::size_t>(L));
  const auto D = static_cast<int64_t>(dim), KV = static_cast<int64_t>(kv), H = static_cast<int64_t>(hid);
  for (uint64_t l = 0; l < L; ++l) {
    RawLayer& r = raw.layers[l];
    auto layer_name = [&](const char* t) { return fmt::format("{}[{}]", t, l); };
    r.attention_norm = rms_att + l * dim;
    r.wq = f32_matrix(wq + l * dim * dim, D, D, layer_name("wq"));
    r.wk = f32_matrix(wk + l * dim * kv, KV, D, layer_name("wk"));
    r.wv = f32_matrix(wv + l * dim * kv, KV, D, layer_name("wv"));
    r.wo = f32_matrix(wo + l * dim * dim, D, D, layer_name("wo"));
    r.ffn_norm = rms_ffn + l * dim;
    r.w1 = f32_matrix(w1 + l * dim * hid, H, D, layer_name("w1"));
    r.w2 = f32_matrix(w2 + l * hid * dim, D, H, layer_name("w2"));
    r.w3 = f32_matrix(w3 + l * dim * hid, H, D, layer_name("w3"));
  }

  // llama2.c models: RoPE, theta 10000, interleaved pairs, float32 angles.
  RopeParams rp;
  rp.rope_type = "default";
  rp.rope_theta = 10000.0;
  rp.head_dim = c.head_dim;
  rp.rotary_dim = c.head_dim;
  rp.max_position_embeddings = c.max_position_embeddings;
  rp.original_max_position_embeddings = c.max_position_embeddings;
  raw.positional.family = PositionFamily::rope;
  raw.positional.rope.params = rp;
  raw.positional.rope.freqs = compute_rope_frequencies(rp);
  raw.positional.rope.layout = RopeLayout::interleaved;
  raw.positional.rope.precision = AnglePrecision::float32;
  raw.source.format = ModelFormat::llama2c;
  raw.source.path = path;
  raw.source.architecture = "llama2.c";
  raw.source.weights = "F32";
  raw.source.layout_reason = "interleaved: llama2.c checkpoints are trained with interleaved pairs (run.c rotates 2i, 2i+1)";
  raw.source.trained_context_source = "llama2.c header seq_len";
  raw.source.notes.push_back("rope_theta 10000: llama2.c's fixed value (the file stores no theta)");
  return raw;
}

}  // namespace posenc::detail
