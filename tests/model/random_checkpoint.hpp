// Random weights for the small posenc checkpoints tests build (what `posenc train` writes, at a size a test runs in
// milliseconds): one generator, one normal distribution, drawn in the checkpoint's tensor order.
#pragma once

#include <cstdint>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "posenc/checkpoint.hpp"

namespace posenc::test {

/// The shape of the tiny Llama checkpoints the tests build: dim 32, hidden 48, 2 layers, 4 heads / 2 KV heads of
/// head_dim 8, vocabulary 16, trained context T (max_position_embeddings), an untied classifier.
inline void set_tiny_llama(ModelConfig& c, int64_t T) {
  c.dim = 32;
  c.hidden_dim = 48;
  c.n_layers = 2;
  c.n_heads = 4;
  c.n_kv_heads = 2;
  c.vocab_size = 16;
  c.max_position_embeddings = T;
  c.shared_classifier = false;
  c.head_dim = 8;
}

class RandomTensors {
 public:
  /// Weights ~ N(0, sigma) from a std::mt19937 seeded with `seed`, appended to ck.tensors.
  RandomTensors(PosencCheckpoint& ck, uint32_t seed, float sigma) : ck_(ck), rng_(seed), nd_(0.0f, sigma) {}

  /// One tensor [shape] float32; `ones`: 1 + 0.1 N(0, sigma) (a norm's weight).
  void add(std::string name, std::vector<int64_t> shape, bool ones = false) {
    int64_t n = 1;
    for (auto d : shape) n *= d;
    std::vector<float> v(static_cast<std::size_t>(n));
    for (auto& x : v) x = ones ? 1.0f + 0.1f * nd_(rng_) : nd_(rng_);
    ck_.tensors.push_back({std::move(name), std::move(shape), std::move(v)});
  }

  /// The Llama tensors of ck.config, in checkpoint order: tok_embeddings, per layer attention_norm, wq, wk, wv,
  /// wo, ffn_norm, w1, w2, w3; norm, output.
  void add_llama() {
    const ModelConfig& c = ck_.config;
    const int64_t D = c.dim, Q = int64_t{c.n_heads} * c.head_dim, KV = int64_t{c.n_kv_heads} * c.head_dim,
                  H = c.hidden_dim, V = c.vocab_size;
    add("tok_embeddings", {V, D});
    for (int l = 0; l < c.n_layers; ++l) {
      const std::string p = "layers." + std::to_string(l) + ".";
      add(p + "attention_norm", {D}, true);
      add(p + "wq", {Q, D});
      add(p + "wk", {KV, D});
      add(p + "wv", {KV, D});
      add(p + "wo", {D, Q});
      add(p + "ffn_norm", {D}, true);
      add(p + "w1", {H, D});
      add(p + "w2", {D, H});
      add(p + "w3", {H, D});
    }
    add("norm", {D}, true);
    add("output", {V, D});
  }

 private:
  PosencCheckpoint& ck_;
  std::mt19937 rng_;
  std::normal_distribution<float> nd_;
};

}  // namespace posenc::test
