// posenc convert --to gguf: a loaded model as a GGUF file llama.cpp loads.
//
// Metadata keys, tensor names and the q/k permutation follow llama.cpp's
// convert_hf_to_gguf.py (LlamaModel: set_gguf_parameters, modify_tensors ->
// permute(n_head)) and gguf-py/gguf/constants.py.
#include "posenc/convert.hpp"

#include <algorithm>
#include <map>
#include <variant>

#include <fmt/format.h>

#include "posenc/checkpoint.hpp"
#include "posenc/error.hpp"
#include "posenc/rope.hpp"

namespace posenc {

namespace {

// llama_ftype (llama.h): ALL_F32 0, MOSTLY_F16 1, MOSTLY_Q8_0 7.
uint32_t file_type(GgmlType t) {
  switch (t) {
    case GgmlType::f16: return 1;
    case GgmlType::q8_0: return 7;
    default: return 0;
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
  if (options.type != GgmlType::f32 && options.type != GgmlType::f16 && options.type != GgmlType::q8_0)
    throw InvalidArgument(fmt::format("--type: {} is not written (f32, f16, q8_0 are)",
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
  const std::string arch = "llama";
  w.add_string("general.architecture", arch);
  w.add_string("general.name", options.name.empty() ? model.source().path.filename().string() : options.name);
  w.add_uint32("general.file_type", file_type(options.type));
  if (options.type == GgmlType::q8_0) w.add_uint32("general.quantization_version", 2);
  const std::string k = arch + ".";
  w.add_uint32(k + "context_length", context_u32("trained context", model.trained_context()));
  w.add_uint32(k + "embedding_length", static_cast<uint32_t>(c.dim));
  w.add_uint32(k + "block_count", static_cast<uint32_t>(c.n_layers));
  w.add_uint32(k + "feed_forward_length", static_cast<uint32_t>(c.hidden_dim));
  w.add_uint32(k + "attention.head_count", static_cast<uint32_t>(c.n_heads));
  w.add_uint32(k + "attention.head_count_kv", static_cast<uint32_t>(c.n_kv_heads));
  w.add_float32(k + "rope.freq_base", static_cast<float>(rp.rope_theta));
  w.add_uint32(k + "rope.dimension_count", static_cast<uint32_t>(rope.freqs.rotary_dim));
  w.add_float32(k + "attention.layer_norm_rms_epsilon", c.norm_eps);
  w.add_uint32(k + "vocab_size", static_cast<uint32_t>(c.vocab_size));
  if (c.head_dim * c.n_heads != c.dim) {
    w.add_uint32(k + "attention.key_length", static_cast<uint32_t>(c.head_dim));
    w.add_uint32(k + "attention.value_length", static_cast<uint32_t>(c.head_dim));
  }
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
    if (type == GgmlType::q8_0 && ne[0] % 32 != 0) {
      type = GgmlType::f16;
      if (!fell_back)
        report.notes.push_back(fmt::format("{} (row length {}) and other rows not a multiple of 32: F16 instead of "
                                           "Q8_0",
                                           name, ne[0]));
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

}  // namespace posenc
