// Hugging Face model directories: config.json + safetensors (one file or
// shards with model.safetensors.index.json) + tokenizer.json.
//
// Tensor names and shapes are those of transformers' LlamaForCausalLM family
// (modeling_llama.py, modeling_qwen2.py, modeling_qwen3.py): weights
// [out_features, in_features]. q/k rows are stored for the `half` layout
// (rotate_half): transformers' convert_llama_weights_to_hf.py permutes Meta's
// interleaved q/k rows into that order.
#include <algorithm>
#include <cmath>
#include <filesystem>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "core/text.hpp"
#include "model/raw_model.hpp"
#include "posenc/config.hpp"
#include "posenc/error.hpp"
#include "posenc/io.hpp"
#include "posenc/safetensors.hpp"
#include "posenc/scaling.hpp"

namespace posenc::detail {

namespace {

namespace fs = std::filesystem;

class TensorSource {
 public:
  TensorSource(const SafetensorsCheckpoint& ck, RawModel& raw, std::string dir) : ck_(ck), raw_(raw), dir_(std::move(dir)) {}

  bool has(const std::string& name) const { return ck_.find(name).file != nullptr; }
  /// Marks a stored tensor as accounted for without reading it.
  void ignore(const std::string& name) const { used_.insert(name); }
  /// The first stored tensor nothing read or ignored (sorted by name), or "".
  std::string first_unused() const {
    for (const auto& n : ck_.names())
      if (!used_.contains(n) && !n.ends_with("rotary_emb.inv_freq")) return n;  // inv_freq: a buffer, not a weight
    return "";
  }

  /// A matrix of the given shape; CheckpointError naming the tensor when it is
  /// missing, misshapen or of a dtype the runtime cannot read.
  RawMatrix matrix(const std::string& name, int64_t rows, int64_t cols) const {
    const auto e = entry(name, {rows, cols});
    RawMatrix m;
    m.rows = rows;
    m.cols = cols;
    m.name = name;
    const auto bytes = e.file->data(*e.tensor);
    switch (e.tensor->dtype) {
      case SafetensorsDtype::F32:
        if (reinterpret_cast<uintptr_t>(bytes.data()) % alignof(float) == 0) {
          m.type = WeightType::f32;
          m.data = bytes.data();
        } else {  // safetensors does not promise alignment: copy
          m.type = WeightType::f32;
          m.data = reinterpret_cast<const std::byte*>(raw_.own(e.file->to_float32(*e.tensor)));
        }
        break;
      case SafetensorsDtype::F16: m.type = WeightType::f16; m.data = bytes.data(); break;
      case SafetensorsDtype::BF16: m.type = WeightType::bf16; m.data = bytes.data(); break;
      default:
        throw CheckpointError(fmt::format("{}: tensor {}: dtype {} is not supported (F32, F16, BF16 are)", where(e),
                                          name, to_string(e.tensor->dtype)));
    }
    check_finite(where(e), m);
    return m;
  }

  /// A float32 vector of `n` values (converted when stored as F16/BF16).
  const float* vector(const std::string& name, int64_t n) const {
    const auto e = entry(name, {n});
    const auto bytes = e.file->data(*e.tensor);
    const float* p =
        e.tensor->dtype == SafetensorsDtype::F32 && reinterpret_cast<uintptr_t>(bytes.data()) % alignof(float) == 0
            ? reinterpret_cast<const float*>(bytes.data())
            : raw_.own(e.file->to_float32(*e.tensor));
    check_finite(where(e), name, p, static_cast<uint64_t>(n));
    return p;
  }

 private:
  SafetensorsCheckpoint::Entry entry(const std::string& name, const std::vector<int64_t>& shape) const {
    used_.insert(name);
    const auto e = ck_.find(name);
    if (e.file == nullptr)
      throw CheckpointError(fmt::format("{}: tensor {} is missing (config.json implies shape [{}])", dir_, name,
                                        fmt::join(shape, ", ")));
    if (e.tensor->shape != shape)
      throw CheckpointError(fmt::format("{}: tensor {} has shape [{}], config.json implies [{}]", where(e), name,
                                        fmt::join(e.tensor->shape, ", "), fmt::join(shape, ", ")));
    return e;
  }
  static std::string where(const SafetensorsCheckpoint::Entry& e) { return e.file->source(); }

  const SafetensorsCheckpoint& ck_;
  RawModel& raw_;
  std::string dir_;
  mutable std::set<std::string> used_;
};

}  // namespace

std::string missing_config_message(const fs::path& dir) {
  std::vector<std::string> files;
  std::error_code ec;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string ext = it->path().extension().string();
    if ((ext == ".gguf" || ext == ".bin") && it->is_regular_file(ec)) files.push_back(it->path().filename().string());
  }
  std::sort(files.begin(), files.end());
  std::string msg = fmt::format("{}: not a Hugging Face model directory: config.json is missing", dir.string());
  if (!files.empty()) {
    if (files.size() > 3) files.resize(3);
    msg += fmt::format(" (it holds {}: give the model file itself, e.g. {})", fmt::join(files, ", "),
                       (dir / files.front()).string());
  }
  return msg;
}

RawModel read_hf_directory(const std::filesystem::path& dir) {
  const std::string name = dir.string();
  const fs::path config_path = dir / "config.json";
  std::error_code ec;
  if (!fs::exists(config_path, ec))
    throw CheckpointError(missing_config_message(dir));
  const DecoderSpec d = parse_decoder_spec(read_file(config_path), config_path.string());
  const PositionalSpec& ps = d.positional;

  RawModel raw;
  ModelConfig& c = raw.cfg;
  c.dim = d.hidden_size;
  c.hidden_dim = d.intermediate_size;
  c.n_layers = d.num_hidden_layers;
  c.n_heads = d.num_attention_heads;
  c.n_kv_heads = d.num_key_value_heads;
  c.vocab_size = d.vocab_size;
  c.head_dim = d.head_dim;
  c.norm_eps = static_cast<float>(d.rms_norm_eps);
  // parse_decoder_spec took it finite and > 0; a value below float32's range (1e-60) would become 0 here, one
  // above it (1e39) inf: every normed activation 0, a uniform prediction.
  if (!(std::isfinite(c.norm_eps) && c.norm_eps > 0))
    throw ConfigError(fmt::format("{}: rms_norm_eps: must be finite and > 0 in float32, the model's arithmetic (got {:g})",
                                  config_path.string(), d.rms_norm_eps));
  c.qkv_bias = d.qkv_bias;
  c.o_bias = d.o_bias;
  c.mlp_bias = d.mlp_bias;
  c.qk_norm = d.qk_norm;
  c.max_position_embeddings = ps.max_position_embeddings.value_or(0);
  validate_config(config_path.string(), c);

  auto ckp = std::make_shared<const SafetensorsCheckpoint>(SafetensorsCheckpoint::open(dir));
  raw.keep_alive.push_back(ckp);  // the maps the weight views point into
  const SafetensorsCheckpoint& ck = *ckp;
  const TensorSource T(ck, raw, name);
  const int64_t D = c.dim, Q = c.q_dim(), KV = c.kv_dim(), H = c.hidden_dim, V = c.vocab_size, HD = c.head_dim;

  // Tied embeddings: transformers ties lm_head to embed_tokens; a file may keep
  // either name (TinyStories-656K stores only lm_head.weight).
  const bool has_embed = T.has("model.embed_tokens.weight"), has_head = T.has("lm_head.weight");
  c.shared_classifier = d.tie_word_embeddings;
  if (!d.tie_word_embeddings && !(has_embed && has_head))
    throw CheckpointError(fmt::format("{}: tie_word_embeddings is false but tensor {} is missing", name,
                                      has_embed ? "lm_head.weight" : "model.embed_tokens.weight"));
  raw.tok_embeddings = T.matrix(has_embed ? "model.embed_tokens.weight" : "lm_head.weight", V, D);
  if (d.tie_word_embeddings && !has_embed)
    raw.source.notes.push_back("tied embeddings stored only as lm_head.weight: used for both");
  raw.output = c.shared_classifier ? raw.tok_embeddings : T.matrix("lm_head.weight", V, D);
  if (c.shared_classifier && has_embed && has_head) T.ignore("lm_head.weight");  // transformers ties it to embed_tokens
  raw.norm = T.vector("model.norm.weight", D);
  // One layer at a time: num_hidden_layers is only believed as far as the
  // tensors go (a config saying 10^9 layers must not allocate 10^9 layers).
  for (int l = 0; l < c.n_layers; ++l) {
    RawLayer& r = raw.layers.emplace_back();
    const std::string p = fmt::format("model.layers.{}.", l);
    r.attention_norm = T.vector(p + "input_layernorm.weight", D);
    r.wq = T.matrix(p + "self_attn.q_proj.weight", Q, D);
    r.wk = T.matrix(p + "self_attn.k_proj.weight", KV, D);
    r.wv = T.matrix(p + "self_attn.v_proj.weight", KV, D);
    r.wo = T.matrix(p + "self_attn.o_proj.weight", D, Q);
    if (c.qkv_bias) {
      r.bq = T.vector(p + "self_attn.q_proj.bias", Q);
      r.bk = T.vector(p + "self_attn.k_proj.bias", KV);
      r.bv = T.vector(p + "self_attn.v_proj.bias", KV);
    }
    if (c.o_bias) r.bo = T.vector(p + "self_attn.o_proj.bias", D);
    if (c.qk_norm) {
      r.q_norm = T.vector(p + "self_attn.q_norm.weight", HD);
      r.k_norm = T.vector(p + "self_attn.k_norm.weight", HD);
    }
    r.ffn_norm = T.vector(p + "post_attention_layernorm.weight", D);
    r.w1 = T.matrix(p + "mlp.gate_proj.weight", H, D);
    r.w2 = T.matrix(p + "mlp.down_proj.weight", D, H);
    r.w3 = T.matrix(p + "mlp.up_proj.weight", H, D);
    if (c.mlp_bias) {
      r.b1 = T.vector(p + "mlp.gate_proj.bias", H);
      r.b2 = T.vector(p + "mlp.down_proj.bias", D);
      r.b3 = T.vector(p + "mlp.up_proj.bias", H);
    }
  }

  // A stored weight the config does not account for (a layer past
  // num_hidden_layers, a bias with attention_bias false, ...) would be dropped:
  // transformers only warns, posenc refuses to run a different model.
  if (const std::string u = T.first_unused(); !u.empty())
    throw CheckpointError(fmt::format("{}: tensor {} is not used by {} as config.json describes it (num_hidden_layers "
                                      "{}, attention_bias/mlp_bias {}/{}, tie_word_embeddings {}): refusing to run the "
                                      "model without it",
                                      name, escaped(u), d.architecture, c.n_layers, c.qkv_bias || c.o_bias, c.mlp_bias,
                                      d.tie_word_embeddings));

  // Positions: the config's RoPE, layout from the architecture (half).
  if (!ps.layout)
    throw CheckpointError(fmt::format("{}: config.json does not imply a RoPE layout; posenc never guesses one", name));
  RopeParams rp = *ps.rope;
  raw.positional.family = PositionFamily::rope;
  raw.positional.rope.params = rp;
  raw.positional.rope.freqs = compute_rope_frequencies(rp);
  raw.positional.rope.layout = *ps.layout;
  raw.positional.rope.precision = AnglePrecision::float32;
  if (ps.sliding_window.active && ps.sliding_window.size) {
    for (bool sliding : ps.sliding_window.layer_is_sliding)
      if (!sliding)
        throw ConfigError(fmt::format("{}: sliding_window: a per-layer pattern ({}) is not run by this runtime yet",
                                      config_path.string(), ps.sliding_window.source));
    raw.sliding_window = *ps.sliding_window.size;
  }

  ModelSource& src = raw.source;
  src.format = ModelFormat::hf_directory;
  src.path = dir;
  src.architecture = d.architecture;
  std::string dtypes;
  for (const auto& f : ck.files())
    for (const auto& t : f.tensors())
      if (dtypes.find(std::string(to_string(t.dtype))) == std::string::npos)
        dtypes += fmt::format("{}{}", dtypes.empty() ? "" : "+", to_string(t.dtype));
  src.weights = fmt::format("{} safetensors ({})", dtypes, ck.describe());
  src.layout_reason = fmt::format("{}: Hugging Face checkpoints of model_type {} store q/k rows for {}",
                                  to_string(*ps.layout), ps.model_type.empty() ? d.architecture : ps.model_type,
                                  *ps.layout == RopeLayout::half ? "rotate_half" : "interleaved pairs");
  if (rp.original_max_position_embeddings && rp.rope_type != "default") {
    raw.trained_context = *rp.original_max_position_embeddings;
    src.trained_context_source = "config.json rope_scaling.original_max_position_embeddings";
  } else {
    src.trained_context_source = "config.json max_position_embeddings";
  }
  if (c.max_position_embeddings <= 0 && raw.trained_context <= 0)
    throw ConfigError(fmt::format("{}: max_position_embeddings: required field missing", config_path.string()));
  for (const auto& n : ps.notes) src.notes.push_back(n);
  const fs::path tok = dir / "tokenizer.json";
  if (fs::exists(tok, ec)) {
    // A tokenizer.json posenc cannot read (WordPiece, broken JSON) does not
    // make the weights unusable: --tokenizer can stand in; the error is kept
    // for when the bundled tokenizer is asked for.
    try {
      raw.tokenizer = Tokenizer::load_tokenizer_json(tok);
      src.tokenizer = tok.string();
    } catch (const Error& e) {
      src.tokenizer_error = e.what();
    }
  }
  return raw;
}

}  // namespace posenc::detail
