// posenc convert --to gguf: a loaded model as a GGUF file llama.cpp loads.
//
// Metadata keys, tensor names and the q/k permutation follow llama.cpp's
// convert_hf_to_gguf.py (LlamaModel: set_gguf_parameters, modify_tensors ->
// permute(n_head)) and gguf-py/gguf/constants.py.
#include "posenc/convert.hpp"

#include <algorithm>
#include <cmath>
#include <map>
#include <variant>

#include <fmt/format.h>

#include "posenc/checkpoint.hpp"
#include "posenc/error.hpp"
#include "posenc/rope.hpp"

namespace posenc {

namespace {

// llama_ftype (llama.h): ALL_F32 0, MOSTLY_F16 1, MOSTLY_Q4_0 2, MOSTLY_Q8_0 7, MOSTLY_BF16 32.
uint32_t file_type(GgmlType t) {
  switch (t) {
    case GgmlType::f16: return 1;
    case GgmlType::q4_0: return 2;
    case GgmlType::q8_0: return 7;
    case GgmlType::bf16: return 32;
    default: return 0;
  }
}

bool written_type(GgmlType t) {
  return t == GgmlType::f32 || t == GgmlType::f16 || t == GgmlType::bf16 || t == GgmlType::q8_0 ||
         t == GgmlType::q4_0;
}

bool blocked(GgmlType t) { return t == GgmlType::q8_0 || t == GgmlType::q4_0; }

/// general.* and llama.* hyper-parameters shared by both writers.
void add_llama_header(GgufWriter& w, const ModelConfig& c, const std::string& name, GgmlType type, uint32_t context,
                      double rope_theta, int rotary_dim) {
  const std::string k = "llama.";
  w.add_string("general.architecture", "llama");
  w.add_string("general.name", name);
  w.add_uint32("general.file_type", file_type(type));
  if (blocked(type)) w.add_uint32("general.quantization_version", 2);
  w.add_uint32(k + "context_length", context);
  w.add_uint32(k + "embedding_length", static_cast<uint32_t>(c.dim));
  w.add_uint32(k + "block_count", static_cast<uint32_t>(c.n_layers));
  w.add_uint32(k + "feed_forward_length", static_cast<uint32_t>(c.hidden_dim));
  w.add_uint32(k + "attention.head_count", static_cast<uint32_t>(c.n_heads));
  w.add_uint32(k + "attention.head_count_kv", static_cast<uint32_t>(c.n_kv_heads));
  w.add_float32(k + "rope.freq_base", static_cast<float>(rope_theta));
  w.add_uint32(k + "rope.dimension_count", static_cast<uint32_t>(rotary_dim));
  w.add_float32(k + "attention.layer_norm_rms_epsilon", c.norm_eps);
  w.add_uint32(k + "vocab_size", static_cast<uint32_t>(c.vocab_size));
  if (c.head_dim * c.n_heads != c.dim) {
    w.add_uint32(k + "attention.key_length", static_cast<uint32_t>(c.head_dim));
    w.add_uint32(k + "attention.value_length", static_cast<uint32_t>(c.head_dim));
  }
}

std::vector<std::byte> encode(GgmlType type, const std::vector<float>& v) {
  return ggml_quantize(type, v);
}

}  // namespace

std::vector<std::string> write_gguf_vocabulary(const Tokenizer& tokenizer, int vocab_size, GgufWriter& w) {
  std::vector<std::string> notes;
  const int n = tokenizer.vocab_size();
  if (n > vocab_size)
    throw InvalidArgument(fmt::format("convert: the tokenizer has {} ids, the model {}", n, vocab_size));
  auto pad = [&](std::vector<std::string>& tokens, std::vector<int32_t>& types, std::vector<float>* scores) {
    if (types.empty()) types.assign(tokens.size(), 1);
    for (int i = n; i < vocab_size; ++i) {
      tokens.push_back(fmt::format("[PAD{}]", i));
      types.push_back(5);  // unused
      if (scores) scores->push_back(-1e9f);
    }
    if (vocab_size > n)
      notes.push_back(fmt::format("vocabulary padded from {} to the model's {} ids with [PAD<id>] tokens", n, vocab_size));
  };
  auto ids = [&](const std::optional<int32_t>& bos, const std::optional<int32_t>& eos, const std::optional<int32_t>& unk,
                 bool add_bos, bool add_eos) {
    if (bos) w.add_uint32("tokenizer.ggml.bos_token_id", static_cast<uint32_t>(*bos));
    if (eos) w.add_uint32("tokenizer.ggml.eos_token_id", static_cast<uint32_t>(*eos));
    if (unk) w.add_uint32("tokenizer.ggml.unknown_token_id", static_cast<uint32_t>(*unk));
    w.add_bool("tokenizer.ggml.add_bos_token", add_bos);
    w.add_bool("tokenizer.ggml.add_eos_token", add_eos);
  };
  auto v = tokenizer.gguf_vocabulary();
  if (auto* spm = std::get_if<SentencePieceVocab>(&v)) {
    pad(spm->pieces, spm->token_types, &spm->scores);
    w.add_string("tokenizer.ggml.model", "llama");
    w.add_string("tokenizer.ggml.pre", "default");
    w.add_string_array("tokenizer.ggml.tokens", std::move(spm->pieces));
    w.add_float32_array("tokenizer.ggml.scores", std::move(spm->scores));
    w.add_int32_array("tokenizer.ggml.token_type", std::move(spm->token_types));
    ids(spm->bos_id, spm->eos_id, spm->unk_id, spm->add_bos, spm->add_eos);
    w.add_bool("tokenizer.ggml.add_space_prefix", spm->add_space_prefix);
    const bool bytes = std::any_of(spm->pieces.begin(), spm->pieces.end(), [](const std::string& p) {
      return p.size() == 6 && p.compare(0, 3, "<0x") == 0 && p[5] == '>';
    });
    if (!bytes && tokenizer.describe().find("tokenizer.json") != std::string::npos)
      notes.push_back(
          "tokenizer: this vocabulary has no <0xXX> byte tokens; llama.cpp's SentencePiece tokenizer (and posenc "
          "reading this file) makes one <unk> per byte of a character outside it where tokenizer.json makes one "
          "fused <unk>: such texts get more tokens and a different perplexity (TinyStories-656K on "
          "tinystories_val.txt: 1,313 more tokens, ppl 75.4 instead of 67.0 at L=512); pass --tokenizer "
          "tokenizer.json with the GGUF to score as Hugging Face does");
    notes.push_back(fmt::format("tokenizer: {} as a GGUF llama (SentencePiece) vocabulary{}", tokenizer.describe(),
                                tokenizer.describe().find("tokenizer.json") != std::string::npos
                                    ? " (merge ranks as scores)"
                                    : ""));
  } else {
    auto& bpe = std::get<BpeVocab>(v);
    pad(bpe.tokens, bpe.token_types, nullptr);
    w.add_string("tokenizer.ggml.model", "gpt2");
    w.add_string("tokenizer.ggml.pre", bpe.pre);
    w.add_string_array("tokenizer.ggml.tokens", std::move(bpe.tokens));
    w.add_string_array("tokenizer.ggml.merges", std::move(bpe.merges));
    w.add_int32_array("tokenizer.ggml.token_type", std::move(bpe.token_types));
    ids(bpe.bos_id, bpe.eos_id, bpe.unk_id, bpe.add_bos, bpe.add_eos);
    notes.push_back(fmt::format("tokenizer: {} as a GGUF gpt2 vocabulary (pre {})", tokenizer.describe(), bpe.pre));
  }
  return notes;
}

GgufExportReport write_model_gguf(const Model& model, const Tokenizer& tokenizer, const std::filesystem::path& out,
                                  const GgufExportOptions& options) {
  if (!written_type(options.type))
    throw InvalidArgument(fmt::format("--type: {} is not written (f32, f16, bf16, q8_0, q4_0 are)",
                                      ggml_type_name(static_cast<uint32_t>(options.type))));
  const ModelConfig& c = model.config();
  if (model.family() != PositionFamily::rope)
    throw InvalidArgument(fmt::format("convert: GGUF llama needs RoPE positions; this model uses {}",
                                      to_string(model.family())));
  if (c.qk_norm || c.mlp_bias)
    throw InvalidArgument("convert: GGUF architecture llama has no q/k norm and no MLP biases");
  if (model.sliding_window() > 0)
    throw InvalidArgument("convert: GGUF architecture llama has no sliding window");
  const RopeSetup& rope = model.rope();
  const RopeParams& rp = rope.params;
  if (rp.rope_type != "default" && rp.rope_type != "linear" && rp.rope_type != "yarn")
    throw InvalidArgument(fmt::format("convert: rope_type {} is not expressible as GGUF llama metadata (default, "
                                      "linear and yarn are)",
                                      rp.rope_type));
  if (tokenizer.vocab_size() > c.vocab_size)
    throw InvalidArgument(fmt::format("convert: the tokenizer has {} tokens, the model {}", tokenizer.vocab_size(),
                                      c.vocab_size));
  if (tokenizer.is_symbolic())
    throw InvalidArgument(
        "convert: a symbol vocabulary (whitespace-separated symbols, posenc-trained tasks) has no GGUF tokenizer: "
        "written as a llama (SentencePiece) vocabulary, llama.cpp and posenc would split text into other ids");
  // GGUF llama keeps context lengths as uint32 (llama.cpp reads them so).
  auto context_u32 = [](std::string_view what, int64_t v) {
    if (v <= 0 || v > int64_t{0xFFFFFFFF})
      throw InvalidArgument(fmt::format("convert: {} {} does not fit GGUF's uint32", what, v));
    return static_cast<uint32_t>(v);
  };

  GgufExportReport report;
  GgufWriter w;
  add_llama_header(w, c, options.name.empty() ? model.source().path.filename().string() : options.name, options.type,
                   context_u32("trained context", model.trained_context()), rp.rope_theta, rope.freqs.rotary_dim);
  const std::string k = "llama.";
  if (rp.rope_type != "default") {
    w.add_string(k + "rope.scaling.type", rp.rope_type);
    w.add_float32(k + "rope.scaling.factor", static_cast<float>(rp.factor.value_or(1.0)));
    w.add_uint32(k + "rope.scaling.original_context_length",
                 context_u32("original_max_position_embeddings",
                             rp.original_max_position_embeddings.value_or(model.trained_context())));
    if (rp.rope_type == "yarn") {
      if (rp.beta_fast) w.add_float32(k + "rope.scaling.yarn_beta_fast", static_cast<float>(*rp.beta_fast));
      if (rp.beta_slow) w.add_float32(k + "rope.scaling.yarn_beta_slow", static_cast<float>(*rp.beta_slow));
      if (rp.attention_factor) w.add_float32(k + "rope.scaling.attn_factor", static_cast<float>(*rp.attention_factor));
    }
  }
  for (auto& n : write_gguf_vocabulary(tokenizer, c.vocab_size, w)) report.notes.push_back(std::move(n));

  // Tensors. q/k rows (and biases) move to interleaved pairs when the model
  // rotates them as half: llama.cpp rotates architecture llama in pairs 2i,
  // 2i+1. The layout is the one the model runs with (a --rope-layout override
  // included), so the file computes what the loaded model computes.
  const bool permute = rope.layout == RopeLayout::half;
  if (permute)
    report.notes.push_back(
        "q/k rows permuted from half (rotate_half) to interleaved pairs, as llama.cpp's converter does");
  if (rope.layout != model.stored_layout())
    report.notes.push_back(fmt::format("the model runs with layout {}, not its file's {}: q/k rows written for {}",
                                       to_string(rope.layout), to_string(model.stored_layout()),
                                       to_string(rope.layout)));
  const int rotary = rope.freqs.rotary_dim;
  std::map<std::string, CheckpointTensor> t;
  for (auto& x : model.export_tensors()) t.emplace(x.name, std::move(x));
  auto take = [&](const std::string& n) -> CheckpointTensor& {
    auto it = t.find(n);
    if (it == t.end()) throw InvalidArgument(fmt::format("convert: tensor {} missing from the model", n));
    return it->second;
  };
  bool fell_back = false;
  auto put = [&](const std::string& name, const CheckpointTensor& x, bool matrix) {
    GgmlType type = matrix ? options.type : GgmlType::f32;
    std::vector<int64_t> ne(x.shape.rbegin(), x.shape.rend());
    if (blocked(type) && ne[0] % 32 != 0) {
      type = GgmlType::f16;
      if (!fell_back)
        report.notes.push_back(fmt::format("{} (row length {}) and other rows not a multiple of 32: F16 instead of "
                                           "{}",
                                           name, ne[0], ggml_type_name(static_cast<uint32_t>(options.type))));
      fell_back = true;
    }
    auto bytes = encode(type, x.data);
    report.bytes += bytes.size();
    ++report.tensors;
    w.add_tensor(name, std::move(ne), type, std::move(bytes));
  };
  auto permuted = [&](CheckpointTensor x, int heads) {
    if (permute) {
      // rows = heads * head_dim (the columns of a bias are its rows here)
      const int64_t rows = x.shape[0], cols = x.shape.size() > 1 ? x.shape[1] : 1;
      std::vector<float> tmp(static_cast<std::size_t>(c.head_dim));
      for (int h = 0; h < heads; ++h)
        for (int64_t col = 0; col < cols; ++col) {
          for (int d = 0; d < c.head_dim; ++d) tmp[static_cast<std::size_t>(d)] = x.data[static_cast<std::size_t>((h * c.head_dim + d) * cols + col)];
          rope_half_to_interleaved(tmp.data(), 1, c.head_dim, rotary);
          for (int d = 0; d < c.head_dim; ++d) x.data[static_cast<std::size_t>((h * c.head_dim + d) * cols + col)] = tmp[static_cast<std::size_t>(d)];
        }
      (void)rows;
    }
    return x;
  };
  put("token_embd.weight", take("tok_embeddings"), true);
  put("output_norm.weight", take("norm"), false);
  if (!c.shared_classifier) put("output.weight", take("output"), true);
  for (int l = 0; l < c.n_layers; ++l) {
    const std::string p = fmt::format("layers.{}.", l), b = fmt::format("blk.{}.", l);
    put(b + "attn_norm.weight", take(p + "attention_norm"), false);
    put(b + "attn_q.weight", permuted(take(p + "wq"), c.n_heads), true);
    put(b + "attn_k.weight", permuted(take(p + "wk"), c.n_kv_heads), true);
    put(b + "attn_v.weight", take(p + "wv"), true);
    put(b + "attn_output.weight", take(p + "wo"), true);
    if (c.qkv_bias) {
      put(b + "attn_q.bias", permuted(take(p + "bq"), c.n_heads), false);
      put(b + "attn_k.bias", permuted(take(p + "bk"), c.n_kv_heads), false);
      put(b + "attn_v.bias", take(p + "bv"), false);
    }
    if (c.o_bias) put(b + "attn_output.bias", take(p + "bo"), false);
    put(b + "ffn_norm.weight", take(p + "ffn_norm"), false);
    put(b + "ffn_gate.weight", take(p + "w1"), true);
    put(b + "ffn_down.weight", take(p + "w2"), true);
    put(b + "ffn_up.weight", take(p + "w3"), true);
  }
  w.write(out);
  return report;
}

namespace {

/// splitmix64 (Steele, Lea, Flood 2014): a fixed stream, the same on every machine and standard library.
struct SplitMix64 {
  uint64_t state;
  uint64_t next() {
    uint64_t z = (state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  /// Uniform in [-a, a): the top 24 bits as a float in [0, 1).
  float uniform(float a) { return (static_cast<float>(next() >> 40) * 0x1p-24f * 2.0f - 1.0f) * a; }
};

}  // namespace

GgufExportReport write_random_gguf(const RandomGgufOptions& options, const std::filesystem::path& out) {
  ModelConfig c = options.config;
  auto positive = [](std::string_view field, int64_t v) {
    if (v <= 0 || v > int64_t{0x7FFFFFFF})
      throw InvalidArgument(fmt::format("{}: must be in [1, 2^31) (got {})", field, v));
  };
  positive("dim", c.dim);
  positive("hidden_dim", c.hidden_dim);
  positive("n_layers", c.n_layers);
  positive("n_heads", c.n_heads);
  positive("n_kv_heads", c.n_kv_heads);
  positive("vocab_size", c.vocab_size);
  if (c.head_dim == 0) {
    if (c.dim % c.n_heads != 0)
      throw InvalidArgument(fmt::format("n_heads: {} does not divide dim {} (give head_dim)", c.n_heads, c.dim));
    c.head_dim = c.dim / c.n_heads;
  }
  positive("head_dim", c.head_dim);
  if (c.head_dim % 2 != 0) throw InvalidArgument(fmt::format("head_dim: must be even for RoPE (got {})", c.head_dim));
  if (c.n_heads % c.n_kv_heads != 0)
    throw InvalidArgument(fmt::format("n_kv_heads: {} does not divide n_heads {}", c.n_kv_heads, c.n_heads));
  if (c.vocab_size < 259)
    throw InvalidArgument(fmt::format("vocab_size: at least 259 (<unk> <s> </s> and 256 byte pieces; got {})",
                                      c.vocab_size));
  if (c.max_position_embeddings == 0) c.max_position_embeddings = 2048;
  positive("max_position_embeddings", c.max_position_embeddings);
  if (!written_type(options.type))
    throw InvalidArgument(fmt::format("type: {} is not written (f32, f16, bf16, q8_0, q4_0 are)",
                                      ggml_type_name(static_cast<uint32_t>(options.type))));
  if (!(options.rope_theta > 0.0) || !std::isfinite(options.rope_theta))
    throw InvalidArgument(fmt::format("rope_theta: must be positive and finite (got {})", options.rope_theta));
  if (blocked(options.type))
    for (auto [field, v] : {std::pair<std::string_view, int64_t>{"dim", c.dim}, {"hidden_dim", c.hidden_dim},
                            {"q_dim (n_heads * head_dim)", c.q_dim()}})
      if (v % 32 != 0)
        throw InvalidArgument(fmt::format("{}: {} rows are blocks of 32 weights; {} is not a multiple of 32", field,
                                          ggml_type_name(static_cast<uint32_t>(options.type)), v));

  GgufWriter w;
  add_llama_header(w, c, options.name, options.type, static_cast<uint32_t>(c.max_position_embeddings),
                   options.rope_theta, c.head_dim);
  SentencePieceVocab v;
  v.pieces = {"<unk>", "<s>", "</s>"};
  v.token_types = {2, 3, 3};  // unknown, control, control
  for (int b = 0; b < 256; ++b) {
    v.pieces.push_back(fmt::format("<0x{:02X}>", b));
    v.token_types.push_back(6);  // byte
  }
  for (int id = 259; id < c.vocab_size; ++id) {
    v.pieces.push_back(fmt::format("tok{}", id));
    v.token_types.push_back(1);
  }
  v.scores.assign(v.pieces.size(), 0.0f);
  for (std::size_t i = 259; i < v.scores.size(); ++i) v.scores[i] = -static_cast<float>(i);
  v.unk_id = 0;
  v.bos_id = 1;
  v.eos_id = 2;
  v.source = "write_random_gguf";
  GgufExportReport report;
  for (auto& n : write_gguf_vocabulary(Tokenizer::from_sentencepiece_vocab(std::move(v)), c.vocab_size, w))
    report.notes.push_back(std::move(n));

  SplitMix64 rng{options.seed};
  const float a = std::sqrt(3.0f) * 0.02f;
  auto put = [&](const std::string& name, int64_t rows, int64_t cols, bool matrix) {
    std::vector<float> x(static_cast<std::size_t>(rows * cols));
    if (matrix)
      for (auto& e : x) e = rng.uniform(a);
    else
      std::fill(x.begin(), x.end(), 1.0f);
    const GgmlType type = matrix ? options.type : GgmlType::f32;
    auto bytes = ggml_quantize(type, x);
    report.bytes += bytes.size();
    ++report.tensors;
    std::vector<int64_t> ne = {cols};
    if (rows > 1 || matrix) ne.push_back(rows);
    w.add_tensor(name, std::move(ne), type, std::move(bytes));
  };
  const int64_t D = c.dim, H = c.hidden_dim, V = c.vocab_size, Q = c.q_dim(), KV = c.kv_dim();
  put("token_embd.weight", V, D, true);
  put("output_norm.weight", 1, D, false);
  if (!c.shared_classifier) put("output.weight", V, D, true);
  for (int l = 0; l < c.n_layers; ++l) {
    const std::string b = fmt::format("blk.{}.", l);
    put(b + "attn_norm.weight", 1, D, false);
    put(b + "attn_q.weight", Q, D, true);
    put(b + "attn_k.weight", KV, D, true);
    put(b + "attn_v.weight", KV, D, true);
    put(b + "attn_output.weight", D, Q, true);
    put(b + "ffn_norm.weight", 1, D, false);
    put(b + "ffn_gate.weight", H, D, true);
    put(b + "ffn_down.weight", D, H, true);
    put(b + "ffn_up.weight", H, D, true);
  }
  w.write(out);
  return report;
}

}  // namespace posenc
