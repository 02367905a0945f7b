// GGUF models (llama.cpp): architecture `llama`, tensors F32/F16/BF16/Q8_0/Q4_0,
// and the embedded tokenizer.
//
// Keys and tensor names follow llama.cpp (gguf-py/gguf/constants.py,
// src/llama-arch.cpp, src/llama-model.cpp). GGUF extents are innermost first,
// so a weight [out, in] is stored with ne = {in, out}. llama.cpp's converter
// (convert_hf_to_gguf.py, LlamaModel.modify_tensors -> permute) reorders the q/k
// rows of Hugging Face checkpoints back to Meta's interleaved pairs, and
// llama.cpp rotates architecture llama with LLAMA_ROPE_TYPE_NORM (pairs 2i,
// 2i+1): the layout of these files is `interleaved`.
#include <cctype>
#include <algorithm>
#include <cmath>
#include <memory>
#include <set>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "core/text.hpp"
#include "model/raw_model.hpp"
#include "posenc/config.hpp"
#include "posenc/error.hpp"
#include "posenc/gguf.hpp"
#include "posenc/scaling.hpp"

namespace posenc::detail {

namespace {

WeightType weight_type(const GgufFile& f, const GgufTensorInfo& t) {
  switch (t.type) {
    case GgmlType::f32: return WeightType::f32;
    case GgmlType::f16: return WeightType::f16;
    case GgmlType::bf16: return WeightType::bf16;
    case GgmlType::q8_0: return WeightType::q8_0;
    case GgmlType::q4_0: return WeightType::q4_0;
    default: break;
  }
  throw CheckpointError(fmt::format("{}: tensor {}: ggml type {} is not supported (F32, F16, BF16, Q8_0, Q4_0 are)",
                                    f.source(), escaped(t.name), ggml_type_name(static_cast<uint32_t>(t.type))));
}

class Tensors {
 public:
  Tensors(const GgufFile& f, RawModel& raw) : f_(f), raw_(raw) {}

  const GgufTensorInfo* find(const std::string& name) const { return f_.find_tensor(name); }

  /// The first tensor of the file nothing read, or nullptr. llama.cpp refuses
  /// such files too (llama_model_loader::done_getting_tensors: "wrong number
  /// of tensors").
  const GgufTensorInfo* first_unused() const {
    for (const auto& t : f_.tensors())
      if (!used_.contains(t.name)) return &t;
    return nullptr;
  }

  const GgufTensorInfo& get(const std::string& name, const std::vector<int64_t>& ne) const {
    used_.insert(name);
    const GgufTensorInfo* t = f_.find_tensor(name);
    if (t == nullptr)
      throw CheckpointError(fmt::format("{}: tensor {} is missing (the metadata imply extents [{}])", f_.source(), name,
                                        fmt::join(ne, ", ")));
    if (t->ne != ne)
      throw CheckpointError(fmt::format("{}: tensor {} has extents [{}], the metadata imply [{}] (ggml order, "
                                        "innermost first)",
                                        f_.source(), name, fmt::join(t->ne, ", "), fmt::join(ne, ", ")));
    return *t;
  }

  /// Weight [rows = out, cols = in], stored with ne = {in, out}.
  RawMatrix matrix(const std::string& name, int64_t rows, int64_t cols) const {
    const GgufTensorInfo& t = get(name, {cols, rows});
    RawMatrix m;
    m.type = weight_type(f_, t);
    m.data = f_.tensor_data(t).data();
    // general.alignment may be 1 or 2: float32 data the runtime reads in place must be aligned.
    if (m.type == WeightType::f32 && reinterpret_cast<uintptr_t>(m.data) % alignof(float) != 0)
      m.data = reinterpret_cast<const std::byte*>(raw_.own(f_.to_float32(t)));
    m.rows = rows;
    m.cols = cols;
    m.name = name;
    check_finite(f_.source(), m);
    return m;
  }

  /// A float32 vector (norm weights, biases); converted when not stored as F32.
  const float* vector(const std::string& name, int64_t n) const {
    const GgufTensorInfo& t = get(name, {n});
    const auto bytes = f_.tensor_data(t);
    const float* p;
    if (t.type == GgmlType::f32 && reinterpret_cast<uintptr_t>(bytes.data()) % alignof(float) == 0) {
      p = reinterpret_cast<const float*>(bytes.data());
    } else {
      weight_type(f_, t);
      std::vector<float> v(static_cast<std::size_t>(n));
      ggml_dequantize(t.type, bytes, v);
      p = raw_.own(std::move(v));
    }
    check_finite(f_.source(), name, p, static_cast<uint64_t>(n));
    return p;
  }

 private:
  const GgufFile& f_;
  RawModel& raw_;
  mutable std::set<std::string> used_;
};

int64_t required_int(const GgufFile& f, const std::string& key, int64_t lo, int64_t hi) {
  const auto v = f.get_int(key);
  if (!v) throw CheckpointError(fmt::format("{}: metadata key {} is missing", f.source(), key));
  if (*v < lo || *v > hi)
    throw CheckpointError(fmt::format("{}: metadata key {} must be in [{}, {}] (got {})", f.source(), key, lo, hi, *v));
  return *v;
}

std::optional<int32_t> token_id(const GgufFile& f, const std::string& key, std::size_t vocab) {
  const auto v = f.get_int(key);
  if (!v || *v == -1 || *v == int64_t{0xFFFFFFFF}) return std::nullopt;  // absent, or -1 / UINT32_MAX = none
  if (*v < 0 || *v >= static_cast<int64_t>(vocab))
    throw CheckpointError(fmt::format("{}: {}: token id {} is not in the vocabulary of {} tokens", f.source(), key, *v,
                                      vocab));
  return static_cast<int32_t>(*v);
}

/// The embedded tokenizer (tokenizer.ggml.*), or nullopt when the file has none.
std::optional<Tokenizer> embedded_tokenizer(const GgufFile& f, std::string& describe) {
  const auto model = f.get_string("tokenizer.ggml.model");
  if (!model || *model == "none" || *model == "no_vocab") return std::nullopt;
  const std::vector<std::string>* tokens = f.get_string_array("tokenizer.ggml.tokens");
  if (tokens == nullptr)
    throw CheckpointError(fmt::format("{}: tokenizer.ggml.model is {} but tokenizer.ggml.tokens is missing", f.source(),
                                      escaped(*model)));
  std::vector<int32_t> types;
  if (auto t = f.get_int_array("tokenizer.ggml.token_type")) {
    if (t->size() != tokens->size())
      throw CheckpointError(fmt::format("{}: tokenizer.ggml.token_type has {} entries for {} tokens", f.source(),
                                        t->size(), tokens->size()));
    for (int64_t v : *t) types.push_back(static_cast<int32_t>(v));
  }
  const std::size_t n = tokens->size();
  if (*model == "llama") {
    SentencePieceVocab v;
    v.pieces = *tokens;
    if (auto s = f.get_float_array("tokenizer.ggml.scores")) {
      if (s->size() != n)
        throw CheckpointError(fmt::format("{}: tokenizer.ggml.scores has {} entries for {} tokens", f.source(),
                                          s->size(), n));
      v.scores.assign(s->begin(), s->end());
    } else {
      v.scores.assign(n, 0.0f);
    }
    v.token_types = std::move(types);
    v.bos_id = token_id(f, "tokenizer.ggml.bos_token_id", n);
    v.eos_id = token_id(f, "tokenizer.ggml.eos_token_id", n);
    v.unk_id = token_id(f, "tokenizer.ggml.unknown_token_id", n);
    v.add_bos = f.get_bool("tokenizer.ggml.add_bos_token").value_or(true);
    v.add_eos = f.get_bool("tokenizer.ggml.add_eos_token").value_or(false);
    v.add_space_prefix = f.get_bool("tokenizer.ggml.add_space_prefix").value_or(true);
    v.source = f.source();
    describe = "GGUF embedded llama (SentencePiece) vocabulary";
    const bool bytes =
        v.token_types.empty()
            ? std::any_of(v.pieces.begin(), v.pieces.end(),
                          [](const std::string& p) { return p.size() == 6 && p.compare(0, 3, "<0x") == 0; })
            : std::any_of(v.token_types.begin(), v.token_types.end(), [](int32_t t) { return t == 6; });
    if (!bytes)
      describe += " without <0xXX> byte tokens (characters outside it: one <unk> per byte, as llama.cpp)";
    return Tokenizer::from_sentencepiece_vocab(std::move(v));
  }
  if (*model == "gpt2") {
    BpeVocab v;
    v.tokens = *tokens;
    if (const auto* m = f.get_string_array("tokenizer.ggml.merges")) v.merges = *m;
    v.token_types = std::move(types);
    v.pre = f.get_string("tokenizer.ggml.pre").value_or("default");
    v.bos_id = token_id(f, "tokenizer.ggml.bos_token_id", n);
    v.eos_id = token_id(f, "tokenizer.ggml.eos_token_id", n);
    v.unk_id = token_id(f, "tokenizer.ggml.unknown_token_id", n);
    // llama.cpp's default when the key is absent (llama-vocab.cpp, load): BOS for
    // the Llama-3-style pre-tokenizers, tekken and chameleon; none for the others.
    static const std::set<std::string> kBosByDefault{"llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1",
                                                     "pixtral", "midm-2.0", "lfm2", "jina-v5-nano", "tekken",
                                                     "chameleon"};
    v.add_bos = f.get_bool("tokenizer.ggml.add_bos_token").value_or(kBosByDefault.count(v.pre) > 0);
    v.add_eos = f.get_bool("tokenizer.ggml.add_eos_token").value_or(false);
    v.source = f.source();
    describe = "GGUF embedded gpt2 (byte-level BPE) vocabulary";
    return Tokenizer::from_bpe_vocab(std::move(v));
  }
  throw TokenizerError(fmt::format("{}: tokenizer.ggml.model {} is not supported (llama and gpt2 are); pass "
                                   "--tokenizer tokenizer.json",
                                   f.source(), escaped(*model)));
}

}  // namespace

bool named_gguf(const std::filesystem::path& path) {
  std::string ext = path.extension().string();
  for (char& ch : ext) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  return ext == ".gguf";
}

std::optional<Tokenizer> read_gguf_tokenizer(const std::filesystem::path& path, std::string& describe) {
  const GgufFile f = GgufFile::open(path);
  return embedded_tokenizer(f, describe);
}

RawModel read_gguf_model(const std::filesystem::path& path) {
  auto file = std::make_shared<const GgufFile>(GgufFile::open(path));
  const GgufFile& f = *file;
  const std::string& name = f.source();
  RawModel raw;
  raw.keep_alive.push_back(file);

  const std::string arch = f.get_string("general.architecture").value_or("");
  if (arch != "llama")
    throw ConfigError(fmt::format("{}: general.architecture: {} is not supported yet (the runtime runs GGUF architecture "
                                  "llama)",
                                  name, arch.empty() ? "(missing)" : escaped(arch)));
  const std::string k = arch + ".";
  ModelConfig& c = raw.cfg;
  c.dim = static_cast<int>(required_int(f, k + "embedding_length", 1, 1 << 16));
  c.hidden_dim = static_cast<int>(required_int(f, k + "feed_forward_length", 1, 1 << 18));
  c.n_layers = static_cast<int>(required_int(f, k + "block_count", 1, 1 << 10));
  c.n_heads = static_cast<int>(required_int(f, k + "attention.head_count", 1, 1 << 10));
  c.n_kv_heads = f.get_int(k + "attention.head_count_kv")
                     ? static_cast<int>(required_int(f, k + "attention.head_count_kv", 1, 1 << 10))
                     : c.n_heads;
  c.max_position_embeddings = required_int(f, k + "context_length", 1, int64_t{1} << 32);
  if (f.get_int(k + "attention.key_length"))
    c.head_dim = static_cast<int>(required_int(f, k + "attention.key_length", 2, 1 << 14));
  const std::string eps_key = k + "attention.layer_norm_rms_epsilon";
  const auto eps = f.get_float(eps_key);
  if (!eps) throw CheckpointError(fmt::format("{}: metadata key {} (the RMSNorm epsilon) is missing", name, eps_key));
  // The value read, whatever it is (nan, inf, a negative or a float32 underflow to 0): the message names it.
  if (!std::isfinite(static_cast<float>(*eps)) || !(static_cast<float>(*eps) > 0))
    throw CheckpointError(fmt::format("{}: metadata key {} (the RMSNorm epsilon) must be finite and > 0 in float32 "
                                      "(got {:g})",
                                      name, eps_key, *eps));
  c.norm_eps = static_cast<float>(*eps);
  const Tensors T(f, raw);
  const GgufTensorInfo* emb = T.find("token_embd.weight");
  if (emb == nullptr) throw CheckpointError(fmt::format("{}: tensor token_embd.weight is missing", name));
  if (emb->ne.size() != 2 || emb->ne[0] != c.dim)
    throw CheckpointError(fmt::format("{}: tensor token_embd.weight has extents [{}], expected [{}, vocab_size]", name,
                                      fmt::join(emb->ne, ", "), c.dim));
  const int64_t vocab = f.get_int(k + "vocab_size").value_or(emb->ne[1]);  // range-checked before the int cast
  if (vocab <= 0 || vocab > (1 << 22))
    throw CheckpointError(fmt::format("{}: vocab_size ({}vocab_size, else token_embd.weight's rows) must be in [1, "
                                      "4194304] (got {})",
                                      name, k, vocab));
  c.vocab_size = static_cast<int>(vocab);
  c.shared_classifier = T.find("output.weight") == nullptr;
  c.qkv_bias = T.find("blk.0.attn_q.bias") != nullptr;
  c.o_bias = T.find("blk.0.attn_output.bias") != nullptr;
  validate_config(name, c);
  if (auto vl = f.get_int(k + "attention.value_length"); vl && *vl != c.head_dim)
    throw CheckpointError(fmt::format("{}: {}attention.value_length {} differs from the key head_dim {}: not supported",
                                      name, k, *vl, c.head_dim));
  if (T.find("rope_freqs.weight") != nullptr)
    throw CheckpointError(fmt::format("{}: tensor rope_freqs.weight (per-channel frequency factors, e.g. Llama-3.1's) "
                                      "is not supported yet; run the Hugging Face directory, or pass --config with the "
                                      "model's rope_scaling",
                                      name));

  const int64_t D = c.dim, Q = c.q_dim(), KV = c.kv_dim(), H = c.hidden_dim, V = c.vocab_size;
  raw.tok_embeddings = T.matrix("token_embd.weight", V, D);
  raw.output = c.shared_classifier ? raw.tok_embeddings : T.matrix("output.weight", V, D);
  raw.norm = T.vector("output_norm.weight", D);
  for (int l = 0; l < c.n_layers; ++l) {  // one at a time: block_count is believed as far as the tensors go
    RawLayer& r = raw.layers.emplace_back();
    const std::string p = fmt::format("blk.{}.", l);
    r.attention_norm = T.vector(p + "attn_norm.weight", D);
    r.wq = T.matrix(p + "attn_q.weight", Q, D);
    r.wk = T.matrix(p + "attn_k.weight", KV, D);
    r.wv = T.matrix(p + "attn_v.weight", KV, D);
    r.wo = T.matrix(p + "attn_output.weight", D, Q);
    if (c.qkv_bias) {
      r.bq = T.vector(p + "attn_q.bias", Q);
      r.bk = T.vector(p + "attn_k.bias", KV);
      r.bv = T.vector(p + "attn_v.bias", KV);
    }
    if (c.o_bias) r.bo = T.vector(p + "attn_output.bias", D);
    r.ffn_norm = T.vector(p + "ffn_norm.weight", D);
    r.w1 = T.matrix(p + "ffn_gate.weight", H, D);
    r.w2 = T.matrix(p + "ffn_down.weight", D, H);
    r.w3 = T.matrix(p + "ffn_up.weight", H, D);
  }
  if (const GgufTensorInfo* u = T.first_unused())
    throw CheckpointError(fmt::format("{}: tensor {} is not used by GGUF llama as the metadata describe it ({}block_count "
                                      "{}{}): refusing to run the model without it (llama.cpp refuses it too)",
                                      name, escaped(u->name), k, c.n_layers,
                                      c.qkv_bias ? "" : "; no q/k/v bias, as blk.0 has none"));

  // Positions.
  RopeParams rp;
  rp.head_dim = c.head_dim;
  const int64_t rotary = f.get_int(k + "rope.dimension_count").value_or(c.head_dim);  // checked before the int cast
  if (rotary <= 0 || rotary > c.head_dim || rotary % 2 != 0)
    throw CheckpointError(fmt::format("{}: {}rope.dimension_count must be even and in [2, head_dim {}] (got {})", name, k,
                                      c.head_dim, rotary));
  rp.rotary_dim = static_cast<int>(rotary);
  const auto theta = f.get_float(k + "rope.freq_base");
  rp.rope_theta = theta.value_or(10000.0);
  if (!(rp.rope_theta > 0) || !std::isfinite(rp.rope_theta))
    throw CheckpointError(fmt::format("{}: {}rope.freq_base must be finite and > 0 (got {})", name, k, rp.rope_theta));
  rp.max_position_embeddings = c.max_position_embeddings;
  rp.original_max_position_embeddings = c.max_position_embeddings;
  const std::string scaling = f.get_string(k + "rope.scaling.type").value_or("none");
  if (scaling == "none") {
    rp.rope_type = "default";
  } else if (scaling == "linear" || scaling == "yarn") {
    rp.rope_type = scaling;
    rp.factor = f.get_float(k + "rope.scaling.factor");
    if (!rp.factor)
      throw CheckpointError(fmt::format("{}: {}rope.scaling.type is {} but rope.scaling.factor is missing", name, k,
                                        scaling));
    auto positive = [&](const std::string& key) -> std::optional<double> {
      const auto v = f.get_float(k + key);
      if (v && !(std::isfinite(*v) && *v > 0))
        throw CheckpointError(fmt::format("{}: {}{} must be finite and > 0 (got {})", name, k, key, *v));
      return v;
    };
    // Bounded as config.json's rope_scaling.factor: 1e-30 ran with nonsense frequencies, 1e-44 failed as
    // "inv_freq[0]: must be finite", naming no key.
    if (const double fct = *rp.factor; !(fct >= config_limits::kMinRopeFactor && fct <= config_limits::kMaxRopeFactor))
      throw CheckpointError(fmt::format("{}: {}rope.scaling.factor must be in [{:g}, {:g}] (got {:g})", name, k,
                                        config_limits::kMinRopeFactor, config_limits::kMaxRopeFactor, fct));
    if (f.get_int(k + "rope.scaling.original_context_length")) {
      rp.original_max_position_embeddings = required_int(f, k + "rope.scaling.original_context_length", 1,
                                                         int64_t{1} << 32);
      raw.trained_context = *rp.original_max_position_embeddings;
    }
    if (scaling == "yarn") {
      rp.beta_fast = positive("rope.scaling.yarn_beta_fast");
      rp.beta_slow = positive("rope.scaling.yarn_beta_slow");
      rp.attention_factor = positive("rope.scaling.attn_factor");
    }
  } else {
    throw CheckpointError(fmt::format("{}: {}rope.scaling.type {} is not supported (none, linear, yarn are)", name, k,
                                      escaped(scaling)));
  }
  raw.positional.family = PositionFamily::rope;
  raw.positional.rope.params = rp;
  try {
    raw.positional.rope.freqs = compute_rope_frequencies(rp);
  } catch (const ConfigError& e) {
    throw ConfigError(fmt::format("{}: the {}rope.* metadata: {}", name, k, e.what()));
  }
  raw.positional.rope.layout = RopeLayout::interleaved;
  raw.positional.rope.precision = AnglePrecision::float32;

  ModelSource& src = raw.source;
  src.format = ModelFormat::gguf;
  src.path = path;
  src.architecture = fmt::format("GGUF {} (v{})", arch, f.version());
  std::vector<std::string> types;
  for (const auto& t : f.tensors()) {
    const std::string tn = ggml_type_name(static_cast<uint32_t>(t.type));
    if (std::find(types.begin(), types.end(), tn) == types.end()) types.push_back(tn);
  }
  src.weights = fmt::format("{}", fmt::join(types, "+"));
  src.layout_reason =
      "interleaved: GGUF architecture llama stores q/k for interleaved pairs (llama.cpp's converter permutes Hugging "
      "Face's rotate_half rows; llama.cpp rotates it with LLAMA_ROPE_TYPE_NORM)";
  src.trained_context_source = raw.trained_context > 0 ? fmt::format("GGUF {}rope.scaling.original_context_length", k)
                                                       : fmt::format("GGUF {}context_length", k);
  if (!theta) src.notes.push_back(fmt::format("{}rope.freq_base absent: 10000 (llama.cpp's default)", k));
  // A vocabulary posenc cannot use does not make the weights unusable: the
  // error is kept for when the bundled tokenizer is asked for (--tokenizer can
  // stand in).
  std::string tok_describe;
  try {
    raw.tokenizer = embedded_tokenizer(f, tok_describe);
    if (raw.tokenizer && raw.tokenizer->vocab_size() != c.vocab_size)
      throw CheckpointError(fmt::format("{}: the embedded tokenizer has {} tokens, the model's vocab_size is {}", name,
                                        raw.tokenizer->vocab_size(), c.vocab_size));
    src.tokenizer = tok_describe;
  } catch (const Error& e) {
    raw.tokenizer.reset();
    src.tokenizer_error = e.what();
  }
  return raw;
}

}  // namespace posenc::detail
