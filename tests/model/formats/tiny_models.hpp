// Tiny valid models (dim 32, 1 layer, 4 heads / 2 KV heads, head_dim 8,
// hidden 64, vocab 40) with deterministic weights, as GGUF files and as
// Hugging Face safetensors + config.json. The libFuzzer seeds of the model
// loaders are made from them (fuzz/corpus/gguf_model/, written by
// GgufModelFuzzCorpus.SeedsAreCurrent with POSENC_WRITE_FUZZ_CORPUS=1) and
// fuzz/hf_config_fuzz.cpp builds its fixed directories with them.
//
// Header-only and free of GoogleTest: the fuzz build includes it too.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "posenc/gguf.hpp"

namespace posenc::test::tiny {

inline constexpr int kDim = 32, kHidden = 64, kLayers = 1, kHeads = 4, kKvHeads = 2, kHeadDim = 8, kVocab = 40;

/// Deterministic values in [-scale, scale) (a fixed LCG).
inline std::vector<float> values(std::size_t n, float scale, uint32_t seed) {
  std::vector<float> v(n);
  uint32_t s = seed * 2654435761u + 1u;
  for (auto& x : v) {
    s = s * 1664525u + 1013904223u;
    x = scale * (static_cast<float>(s >> 8) / 8388608.0f - 1.0f);
  }
  return v;
}

/// One tensor in PyTorch order (shape [out, in] for a weight).
struct Tensor {
  std::vector<int64_t> shape;
  std::vector<float> data;
};

struct Parts {
  bool qkv_bias = false;  ///< q/k/v biases (Qwen2; Llama attention_bias)
  bool o_bias = false;    ///< o_proj bias (Llama attention_bias)
  bool mlp_bias = false;  ///< gate/up/down biases (Llama mlp_bias; HF only)
  bool qk_norm = false;   ///< Qwen3 q_norm/k_norm (HF only)
  bool untied = false;    ///< a separate output matrix
};

/// The tensors under Hugging Face names, q/k rows for rotate_half (as HF stores them).
inline std::map<std::string, Tensor> hf_tensors(const Parts& p) {
  std::map<std::string, Tensor> t;
  uint32_t seed = 1;
  auto mat = [&](const std::string& name, int64_t rows, int64_t cols, float scale) {
    t[name] = {{rows, cols}, values(static_cast<std::size_t>(rows * cols), scale, seed++)};
  };
  auto vec = [&](const std::string& name, int64_t n, float base, float spread) {
    auto v = values(static_cast<std::size_t>(n), spread, seed++);
    for (auto& x : v) x += base;
    t[name] = {{n}, std::move(v)};
  };
  const int Q = kHeads * kHeadDim, KV = kKvHeads * kHeadDim;
  mat("model.embed_tokens.weight", kVocab, kDim, 0.5f);
  if (p.untied) mat("lm_head.weight", kVocab, kDim, 0.5f);
  vec("model.norm.weight", kDim, 1.0f, 0.1f);
  for (int l = 0; l < kLayers; ++l) {
    const std::string b = fmt::format("model.layers.{}.", l);
    vec(b + "input_layernorm.weight", kDim, 1.0f, 0.1f);
    vec(b + "post_attention_layernorm.weight", kDim, 1.0f, 0.1f);
    mat(b + "self_attn.q_proj.weight", Q, kDim, 0.3f);
    mat(b + "self_attn.k_proj.weight", KV, kDim, 0.3f);
    mat(b + "self_attn.v_proj.weight", KV, kDim, 0.3f);
    mat(b + "self_attn.o_proj.weight", kDim, Q, 0.3f);
    mat(b + "mlp.gate_proj.weight", kHidden, kDim, 0.3f);
    mat(b + "mlp.up_proj.weight", kHidden, kDim, 0.3f);
    mat(b + "mlp.down_proj.weight", kDim, kHidden, 0.3f);
    if (p.qkv_bias) {
      vec(b + "self_attn.q_proj.bias", Q, 0.0f, 0.1f);
      vec(b + "self_attn.k_proj.bias", KV, 0.0f, 0.1f);
      vec(b + "self_attn.v_proj.bias", KV, 0.0f, 0.1f);
    }
    if (p.o_bias) vec(b + "self_attn.o_proj.bias", kDim, 0.0f, 0.1f);
    if (p.mlp_bias) {
      vec(b + "mlp.gate_proj.bias", kHidden, 0.0f, 0.1f);
      vec(b + "mlp.up_proj.bias", kHidden, 0.0f, 0.1f);
      vec(b + "mlp.down_proj.bias", kDim, 0.0f, 0.1f);
    }
    if (p.qk_norm) {
      vec(b + "self_attn.q_norm.weight", kHeadDim, 1.0f, 0.1f);
      vec(b + "self_attn.k_norm.weight", kHeadDim, 1.0f, 0.1f);
    }
  }
  return t;
}

/// A safetensors file (F32, header padded to 8 bytes) holding `tensors`.
inline std::string safetensors_bytes(const std::map<std::string, Tensor>& tensors) {
  nlohmann::json h = nlohmann::json::object();
  std::string data;
  for (const auto& [name, x] : tensors) {
    const std::size_t begin = data.size();
    data.append(reinterpret_cast<const char*>(x.data.data()), x.data.size() * sizeof(float));
    h[name] = {{"dtype", "F32"}, {"shape", x.shape}, {"data_offsets", {begin, data.size()}}};
  }
  std::string header = h.dump();
  header.append((8 - header.size() % 8) % 8, ' ');
  std::string out(8, '\0');
  const uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) out[static_cast<std::size_t>(i)] = static_cast<char>((n >> (8 * i)) & 0xff);
  return out + header + data;
}

/// The config.json transformers writes for these tensors (architecture from the parts).
inline nlohmann::json hf_config(const Parts& p) {
  const bool qwen3 = p.qk_norm, qwen2 = p.qkv_bias && !p.o_bias && !qwen3;
  nlohmann::json c{{"architectures", {qwen3 ? "Qwen3ForCausalLM" : qwen2 ? "Qwen2ForCausalLM" : "LlamaForCausalLM"}},
                   {"model_type", qwen3 ? "qwen3" : qwen2 ? "qwen2" : "llama"},
                   {"hidden_size", kDim},
                   {"intermediate_size", kHidden},
                   {"num_hidden_layers", kLayers},
                   {"num_attention_heads", kHeads},
                   {"num_key_value_heads", kKvHeads},
                   {"head_dim", kHeadDim},
                   {"vocab_size", kVocab},
                   {"max_position_embeddings", 64},
                   {"rms_norm_eps", 1e-5},
                   {"rope_theta", 10000.0},
                   {"hidden_act", "silu"},
                   {"tie_word_embeddings", !p.untied}};
  if (!qwen2 && !qwen3) {
    c["attention_bias"] = p.qkv_bias || p.o_bias;
    c["mlp_bias"] = p.mlp_bias;
  }
  if (qwen3) c["attention_bias"] = p.qkv_bias;
  return c;
}

/// A 40-piece SentencePiece-style vocabulary with distinct scores:
/// <unk> <s> </s>, U+2581, a-z, then U+2581 + a-j.
inline std::vector<std::string> vocabulary() {
  std::vector<std::string> v{"<unk>", "<s>", "</s>", "\xe2\x96\x81"};
  for (char c = 'a'; c <= 'z'; ++c) v.emplace_back(1, c);
  for (char c = 'a'; static_cast<int>(v.size()) < kVocab; ++c) v.push_back("\xe2\x96\x81" + std::string(1, c));
  return v;
}

/// ggml extents of a PyTorch-order shape (innermost first).
inline std::vector<int64_t> ggml_ne(const std::vector<int64_t>& shape) { return {shape.rbegin(), shape.rend()}; }

/// q/k rows of one projection from rotate_half order to interleaved pairs
/// (what llama.cpp's converter does), `heads` heads of kHeadDim rows.
inline std::vector<float> to_interleaved(const Tensor& x, int heads) {
  const int64_t cols = x.shape.size() > 1 ? x.shape[1] : 1;
  std::vector<float> out(x.data.size());
  for (int h = 0; h < heads; ++h)
    for (int i = 0; i < kHeadDim / 2; ++i)
      for (int half = 0; half < 2; ++half) {
        const int64_t from = h * kHeadDim + half * (kHeadDim / 2) + i, to = h * kHeadDim + 2 * i + half;
        for (int64_t c = 0; c < cols; ++c)
          out[static_cast<std::size_t>(to * cols + c)] = x.data[static_cast<std::size_t>(from * cols + c)];
      }
  return out;
}

/// The same model as a GGUF llama file (matrices in `type`: f32, f16, bf16,
/// q8_0 or q4_0, or the type `per_tensor` gives a tensor by its GGUF name, as
/// llama.cpp's quantizer mixes them; norms and biases F32), with the
/// vocabulary embedded.
inline GgufWriter gguf_writer(const Parts& p, GgmlType type = GgmlType::f32,
                              const std::map<std::string, GgmlType>& per_tensor = {}) {
  GgufWriter w;
  w.add_string("general.architecture", "llama");
  w.add_string("general.name", "posenc tiny");
  w.add_uint32("llama.context_length", 64);
  w.add_uint32("llama.embedding_length", kDim);
  w.add_uint32("llama.block_count", kLayers);
  w.add_uint32("llama.feed_forward_length", kHidden);
  w.add_uint32("llama.attention.head_count", kHeads);
  w.add_uint32("llama.attention.head_count_kv", kKvHeads);
  w.add_uint32("llama.rope.dimension_count", kHeadDim);
  w.add_float32("llama.rope.freq_base", 10000.0f);
  w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5f);
  const auto vocab = vocabulary();
  std::vector<float> scores;
  std::vector<int32_t> types;
  for (std::size_t i = 0; i < vocab.size(); ++i) {
    scores.push_back(-static_cast<float>(i));
    types.push_back(i == 0 ? 2 : i < 3 ? 3 : 1);
  }
  w.add_string("tokenizer.ggml.model", "llama");
  w.add_string_array("tokenizer.ggml.tokens", vocab);
  w.add_float32_array("tokenizer.ggml.scores", scores);
  w.add_int32_array("tokenizer.ggml.token_type", types);
  w.add_uint32("tokenizer.ggml.bos_token_id", 1);
  w.add_uint32("tokenizer.ggml.eos_token_id", 2);
  w.add_uint32("tokenizer.ggml.unknown_token_id", 0);
  auto t = hf_tensors(p);
  auto put = [&](const std::string& name, const std::vector<int64_t>& shape, const std::vector<float>& data,
                 bool matrix) {
    const auto it = per_tensor.find(name);
    const GgmlType ty = it != per_tensor.end() ? it->second : matrix ? type : GgmlType::f32;
    w.add_tensor(name, ggml_ne(shape), ty, ggml_quantize(ty, data));
  };
  auto& emb = t.at("model.embed_tokens.weight");
  put("token_embd.weight", emb.shape, emb.data, true);
  if (p.untied) put("output.weight", t.at("lm_head.weight").shape, t.at("lm_head.weight").data, true);
  put("output_norm.weight", t.at("model.norm.weight").shape, t.at("model.norm.weight").data, false);
  for (int l = 0; l < kLayers; ++l) {
    const std::string h = fmt::format("model.layers.{}.", l), g = fmt::format("blk.{}.", l);
    auto& q = t.at(h + "self_attn.q_proj.weight");
    auto& k = t.at(h + "self_attn.k_proj.weight");
    put(g + "attn_norm.weight", {kDim}, t.at(h + "input_layernorm.weight").data, false);
    put(g + "attn_q.weight", q.shape, to_interleaved(q, kHeads), true);
    put(g + "attn_k.weight", k.shape, to_interleaved(k, kKvHeads), true);
    put(g + "attn_v.weight", t.at(h + "self_attn.v_proj.weight").shape, t.at(h + "self_attn.v_proj.weight").data, true);
    put(g + "attn_output.weight", t.at(h + "self_attn.o_proj.weight").shape, t.at(h + "self_attn.o_proj.weight").data,
        true);
    if (p.qkv_bias) {
      put(g + "attn_q.bias", {kHeads * kHeadDim}, to_interleaved(t.at(h + "self_attn.q_proj.bias"), kHeads), false);
      put(g + "attn_k.bias", {kKvHeads * kHeadDim}, to_interleaved(t.at(h + "self_attn.k_proj.bias"), kKvHeads), false);
      put(g + "attn_v.bias", {kKvHeads * kHeadDim}, t.at(h + "self_attn.v_proj.bias").data, false);
    }
    if (p.o_bias) put(g + "attn_output.bias", {kDim}, t.at(h + "self_attn.o_proj.bias").data, false);
    put(g + "ffn_norm.weight", {kDim}, t.at(h + "post_attention_layernorm.weight").data, false);
    put(g + "ffn_gate.weight", t.at(h + "mlp.gate_proj.weight").shape, t.at(h + "mlp.gate_proj.weight").data, true);
    put(g + "ffn_up.weight", t.at(h + "mlp.up_proj.weight").shape, t.at(h + "mlp.up_proj.weight").data, true);
    put(g + "ffn_down.weight", t.at(h + "mlp.down_proj.weight").shape, t.at(h + "mlp.down_proj.weight").data, true);
  }
  return w;
}

/// The seed corpus of fuzz/gguf_model_fuzz.cpp: every matrix type, biases, an
/// untied output, a yarn-scaled one.
inline std::vector<std::pair<std::string, std::string>> gguf_model_seeds() {
  std::vector<std::pair<std::string, std::string>> out;
  out.emplace_back("tiny_f32.gguf", gguf_writer({}).serialize());
  out.emplace_back("tiny_f16_untied.gguf", gguf_writer({.untied = true}, GgmlType::f16).serialize());
  out.emplace_back("tiny_bf16.gguf", gguf_writer({}, GgmlType::bf16).serialize());
  out.emplace_back("tiny_q8_0_bias.gguf", gguf_writer({.qkv_bias = true, .o_bias = true}, GgmlType::q8_0).serialize());
  out.emplace_back("tiny_q4_0.gguf", gguf_writer({}, GgmlType::q4_0).serialize());
  GgufWriter yarn = gguf_writer({});
  yarn.add_string("llama.rope.scaling.type", "yarn");
  yarn.add_float32("llama.rope.scaling.factor", 4.0f);
  yarn.add_uint32("llama.rope.scaling.original_context_length", 16);
  out.emplace_back("tiny_yarn.gguf", yarn.serialize());
  return out;
}

/// The tensor sets of fuzz/hf_config_fuzz.cpp's fixed directories, in order:
/// plain Llama, q/k/v biases (Qwen2), q/k norms (Qwen3), every bias and an
/// untied output (Llama attention_bias + mlp_bias).
inline std::vector<Parts> hf_fuzz_parts() {
  return {Parts{}, Parts{.qkv_bias = true}, Parts{.qk_norm = true},
          Parts{.qkv_bias = true, .o_bias = true, .mlp_bias = true, .untied = true}};
}

/// The seed corpus of fuzz/hf_config_fuzz.cpp: the config.json of each fixed
/// directory, and the plain one with every rope_scaling type and a sliding window.
inline std::vector<std::pair<std::string, std::string>> hf_config_seeds() {
  std::vector<std::pair<std::string, std::string>> out;
  const char* names[] = {"llama.json", "qwen2.json", "qwen3.json", "llama_biases_untied.json"};
  const auto parts = hf_fuzz_parts();
  for (std::size_t i = 0; i < parts.size(); ++i) out.emplace_back(names[i], hf_config(parts[i]).dump(2));
  auto scaled = [&](const std::string& name, nlohmann::json scaling) {
    nlohmann::json c = hf_config({});
    c["rope_scaling"] = std::move(scaling);
    out.emplace_back(name, c.dump(2));
  };
  scaled("linear.json", {{"rope_type", "linear"}, {"factor", 2.0}});
  scaled("dynamic.json", {{"rope_type", "dynamic"}, {"factor", 2.0}});
  scaled("yarn.json", {{"rope_type", "yarn"}, {"factor", 4.0}, {"original_max_position_embeddings", 16}});
  scaled("llama3.json", {{"rope_type", "llama3"},
                         {"factor", 8.0},
                         {"low_freq_factor", 1.0},
                         {"high_freq_factor", 4.0},
                         {"original_max_position_embeddings", 16}});
  scaled("longrope.json", {{"rope_type", "longrope"},
                           {"short_factor", {1.0, 1.0, 1.5, 2.0}},
                           {"long_factor", {1.0, 2.0, 4.0, 8.0}},
                           {"original_max_position_embeddings", 16}});
  nlohmann::json m = hf_config({});
  m["architectures"] = {"MistralForCausalLM"};
  m["model_type"] = "mistral";
  m["sliding_window"] = 4;
  out.emplace_back("mistral_sliding.json", m.dump(2));
  // Hostile sizes (issue 13): each is refused by its bound before anything is
  // allocated (1e9 layers with a sliding window allocated 16.9 GB; head_dim 1e9 13.5 GB).
  auto hostile = [&](const std::string& name, const char* key, nlohmann::json value) {
    nlohmann::json c = name.starts_with("regression_sliding") ? m : hf_config({});
    c[key] = std::move(value);
    out.emplace_back(name, c.dump(2));
  };
  hostile("regression_head_dim_1e9.json", "head_dim", 1000000000);
  hostile("regression_sliding_layers_1e9.json", "num_hidden_layers", 1000000000);
  hostile("regression_vocab_1e9.json", "vocab_size", 1000000000);
  hostile("regression_intermediate_1e9.json", "intermediate_size", 1000000000);
  hostile("regression_heads_1e9.json", "num_attention_heads", 1000000000);
  hostile("regression_max_position_embeddings_int64_max.json", "max_position_embeddings", INT64_MAX);
  return out;
}

}  // namespace posenc::test::tiny
