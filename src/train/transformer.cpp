#include "train/transformer.hpp"

#include <cmath>
#include <limits>

#include <fmt/format.h>

#include "posenc/error.hpp"
#include "train/autograd.hpp"

namespace posenc::detail {

TransformerImpl::TransformerImpl(const ModelConfig& c, const PositionalConfig& pc) : config_(c), positional_(pc) {
  if (c.dim <= 0 || c.n_heads <= 0 || c.dim % c.n_heads != 0 || c.n_layers <= 0 || c.hidden_dim <= 0 ||
      c.vocab_size <= 0)
    throw InvalidArgument(fmt::format("transformer: bad dimensions (dim {}, n_heads {}, n_layers {}, hidden_dim {}, "
                                      "vocab_size {})",
                                      c.dim, c.n_heads, c.n_layers, c.hidden_dim, c.vocab_size));
  if (c.n_kv_heads != c.n_heads)
    fail_field<InvalidArgument>("num_key_value_heads", "the trainer uses full multi-head attention (= n_heads)",
                                c.n_kv_heads);
  if (c.shared_classifier) throw InvalidArgument("shared_classifier: the trainer uses an untied classifier");
  config_.head_dim = c.dim / c.n_heads;
  const int64_t D = c.dim, H = c.hidden_dim, V = c.vocab_size;
  const double layers = c.n_layers;
  auto normal = [](std::initializer_list<int64_t> shape, double std) {
    return torch::randn(shape, torch::kFloat32) * std;
  };
  torch::NoGradGuard no_grad;
  tok_embeddings_ = register_parameter("tok_embeddings", normal({V, D}, 1.0));
  for (int l = 0; l < c.n_layers; ++l) {
    const std::string p = fmt::format("layers_{}_", l);  // torch names may not contain dots
    Layer L;
    // Inputs ~ unit RMS after RMSNorm: 1/sqrt(fan_in) keeps activations O(1);
    // the residual branches' outputs are scaled by 1/sqrt(2 n_layers) (GPT-2).
    const double out_scale = 1.0 / std::sqrt(2.0 * layers);
    L.attention_norm = register_parameter(p + "attention_norm", torch::ones({D}));
    L.wq = register_parameter(p + "wq", normal({D, D}, 1.0 / std::sqrt(D)));
    L.wk = register_parameter(p + "wk", normal({D, D}, 1.0 / std::sqrt(D)));
    L.wv = register_parameter(p + "wv", normal({D, D}, 1.0 / std::sqrt(D)));
    L.wo = register_parameter(p + "wo", normal({D, D}, out_scale / std::sqrt(D)));
    L.ffn_norm = register_parameter(p + "ffn_norm", torch::ones({D}));
    L.w1 = register_parameter(p + "w1", normal({H, D}, 1.0 / std::sqrt(D)));
    L.w2 = register_parameter(p + "w2", normal({D, H}, out_scale / std::sqrt(H)));
    L.w3 = register_parameter(p + "w3", normal({H, D}, 1.0 / std::sqrt(D)));
    layers_.push_back(L);
  }
  norm_ = register_parameter("norm", torch::ones({D}));
  output_ = register_parameter("output", normal({V, D}, 1.0 / std::sqrt(D)));
  switch (pc.family) {
    case PositionFamily::learned_absolute:
      if (c.max_position_embeddings <= 0)
        fail_field<InvalidArgument>("max_position_embeddings", "must be positive for a learned table",
                                    c.max_position_embeddings);
      pos_embeddings_ = register_parameter("pos_embeddings", normal({c.max_position_embeddings, D}, 1.0));
      break;
    case PositionFamily::t5_bias:
      t5_table_ = register_parameter("t5_relative_attention_bias", torch::zeros({pc.t5_num_buckets, c.n_heads}));
      break;
    case PositionFamily::rope:
      positional_.rope.freqs.validate();
      if (positional_.rope.freqs.head_dim != config_.head_dim)
        throw InvalidArgument(fmt::format("head_dim: RoPE frequencies for head_dim {}, the model has {}",
                                          positional_.rope.freqs.head_dim, config_.head_dim));
      break;
    default: break;
  }
}

torch::Tensor TransformerImpl::rmsnorm(const torch::Tensor& x, const torch::Tensor& w) const {
  // The runtime's RMSNorm: w * x / sqrt(mean(x^2) + eps).
  return x * torch::rsqrt(x.pow(2).mean(-1, /*keepdim=*/true) + config_.norm_eps) * w;
}

torch::Tensor TransformerImpl::forward(const torch::Tensor& tokens) {
  namespace F = torch::nn::functional;
  const int64_t B = tokens.size(0), T = tokens.size(1);
  const int64_t D = config_.dim, NH = config_.n_heads, HD = config_.head_dim;
  const PositionFamily family = positional_.family;
  torch::Tensor x = F::embedding(tokens, tok_embeddings_);  // [B, T, D]
  if (family == PositionFamily::learned_absolute) x = x + learned_positions(pos_embeddings_, T);
  if (family == PositionFamily::sinusoidal) x = add_sinusoidal(x, positional_.sinusoidal_base);

  torch::Tensor mask =
      torch::full({T, T}, -std::numeric_limits<float>::infinity(), torch::kFloat32).triu(1);  // causal
  torch::Tensor t5;
  if (family == PositionFamily::t5_bias)
    t5 = t5_bias(t5_table_, T, positional_.t5_num_buckets, positional_.t5_max_distance);  // shared by all layers
  const double scale = 1.0 / std::sqrt(static_cast<double>(HD));
  const int rotary_dim = positional_.rope.freqs.rotary_dim;
  const double theta = positional_.rope.params.rope_theta;

  for (const Layer& L : layers_) {
    const torch::Tensor h = rmsnorm(x, L.attention_norm);
    torch::Tensor q = F::linear(h, L.wq).view({B, T, NH, HD});
    torch::Tensor k = F::linear(h, L.wk).view({B, T, NH, HD});
    torch::Tensor v = F::linear(h, L.wv).view({B, T, NH, HD});
    if (family == PositionFamily::rope) {
      q = rope_rotate(q, rotary_dim, theta, positional_.rope.layout);
      k = rope_rotate(k, rotary_dim, theta, positional_.rope.layout);
    }
    q = q.permute({0, 2, 1, 3});  // [B, NH, T, HD]
    k = k.permute({0, 2, 1, 3});
    v = v.permute({0, 2, 1, 3});
    torch::Tensor scores = torch::matmul(q, k.transpose(-2, -1)) * scale;  // [B, NH, T, T]
    if (family == PositionFamily::alibi) scores = add_alibi(scores, positional_.alibi_max_bias);
    if (family == PositionFamily::t5_bias) scores = scores + t5;
    scores = scores + mask;
    const torch::Tensor att = torch::softmax(scores, -1);
    const torch::Tensor o = torch::matmul(att, v).permute({0, 2, 1, 3}).reshape({B, T, D});
    x = x + F::linear(o, L.wo);
    const torch::Tensor h2 = rmsnorm(x, L.ffn_norm);
    x = x + F::linear(F::silu(F::linear(h2, L.w1)) * F::linear(h2, L.w3), L.w2);
  }
  return F::linear(rmsnorm(x, norm_), output_);
}

std::vector<torch::Tensor> TransformerImpl::matrices() const {
  std::vector<torch::Tensor> out;
  for (const Layer& L : layers_) out.insert(out.end(), {L.wq, L.wk, L.wv, L.wo, L.w1, L.w2, L.w3});
  out.push_back(output_);
  return out;
}

std::vector<torch::Tensor> TransformerImpl::non_matrices() const {
  std::vector<torch::Tensor> out{tok_embeddings_, norm_};
  for (const Layer& L : layers_) out.insert(out.end(), {L.attention_norm, L.ffn_norm});
  if (pos_embeddings_.defined()) out.push_back(pos_embeddings_);
  if (t5_table_.defined()) out.push_back(t5_table_);
  return out;
}

PosencCheckpoint TransformerImpl::to_checkpoint(std::vector<std::string> symbols, std::string metadata_json) const {
  PosencCheckpoint ck;
  ck.config = config_;
  ck.positional = positional_;
  ck.symbols = std::move(symbols);
  ck.metadata_json = std::move(metadata_json);
  auto add = [&](const std::string& name, const torch::Tensor& t) {
    const torch::Tensor c = t.detach().contiguous().to(torch::kFloat32);
    CheckpointTensor ct;
    ct.name = name;
    ct.shape.assign(c.sizes().begin(), c.sizes().end());
    ct.data.assign(c.data_ptr<float>(), c.data_ptr<float>() + c.numel());
    ck.tensors.push_back(std::move(ct));
  };
  add("tok_embeddings", tok_embeddings_);
  for (std::size_t l = 0; l < layers_.size(); ++l) {
    const Layer& L = layers_[l];
    const std::string p = fmt::format("layers.{}.", l);
    add(p + "attention_norm", L.attention_norm);
    add(p + "wq", L.wq);
    add(p + "wk", L.wk);
    add(p + "wv", L.wv);
    add(p + "wo", L.wo);
    add(p + "ffn_norm", L.ffn_norm);
    add(p + "w1", L.w1);
    add(p + "w2", L.w2);
    add(p + "w3", L.w3);
  }
  add("norm", norm_);
  add("output", output_);
  if (pos_embeddings_.defined()) add("pos_embeddings", pos_embeddings_);
  if (t5_table_.defined()) add("t5_relative_attention_bias", t5_table_);
  return ck;
}

}  // namespace posenc::detail
