// The trainer's network in torch: exactly the runtime's Llama architecture
// (model.hpp), so its weights save into a posenc checkpoint unchanged.
// Private to the trainer and its tests.
#pragma once

#include <string>
#include <vector>

#include <torch/torch.h>

#include "posenc/checkpoint.hpp"
#include "posenc/model.hpp"

namespace posenc::detail {

class TransformerImpl : public torch::nn::Module {
 public:
  /// config: dim, hidden_dim, n_layers, n_heads (n_kv_heads must equal
  /// n_heads), vocab_size, max_position_embeddings (learned table rows),
  /// norm_eps; shared_classifier must be false. positional: any family; for
  /// rope, positional.rope.freqs.rotary_dim / params.rope_theta / layout are
  /// used (float32 angles). Weights are drawn from torch's global generator
  /// (seed it first). Throws InvalidArgument for an unsupported config.
  TransformerImpl(const ModelConfig& config, const PositionalConfig& positional);

  /// tokens: [B, T] int64 at positions 0..T-1 (right padding, so real tokens
  /// never see padding under the causal mask). Returns logits [B, T, vocab_size].
  torch::Tensor forward(const torch::Tensor& tokens);

  /// Matrices (weight decay applies) and the rest (norms, embeddings, tables).
  std::vector<torch::Tensor> matrices() const;
  std::vector<torch::Tensor> non_matrices() const;

  const ModelConfig& config() const { return config_; }
  const PositionalConfig& positional() const { return positional_; }

  /// The weights as a posenc checkpoint value (float32 copies).
  PosencCheckpoint to_checkpoint(std::vector<std::string> symbols, std::string metadata_json) const;

 private:
  struct Layer {
    torch::Tensor attention_norm, wq, wk, wv, wo, ffn_norm, w1, w2, w3;
  };
  torch::Tensor rmsnorm(const torch::Tensor& x, const torch::Tensor& w) const;

  ModelConfig config_;
  PositionalConfig positional_;
  torch::Tensor tok_embeddings_, norm_, output_, pos_embeddings_, t5_table_;
  std::vector<Layer> layers_;
};
TORCH_MODULE(Transformer);

}  // namespace posenc::detail
