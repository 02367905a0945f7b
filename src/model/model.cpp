#include "posenc/model.hpp"

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <initializer_list>
#include <limits>
#include <new>
#include <optional>
#include <fstream>
#include <set>
#include <utility>

#include <fmt/format.h>
#include <immintrin.h>
#include <omp.h>

#include "attention/attention_kernel.hpp"
#include "core/aligned.hpp"
#include "core/parallel.hpp"
#include "model/kernels.hpp"
#include "model/kernels_dense.hpp"
#include "model/raw_model.hpp"
#include "posenc/absolute.hpp"
#include "posenc/bias.hpp"
#include "posenc/checkpoint.hpp"
#include "posenc/config.hpp"
#include "posenc/attention.hpp"
#include "posenc/error.hpp"
#include "posenc/io.hpp"
#include "posenc/threads.hpp"
#include "encoding/scaling/methods.hpp"

namespace posenc {

namespace {

/// y = x W^T (+ b): one projection, its weights read where the file keeps them
/// (a view into the memory map, in the stored dtype, [out, in]): the dense
/// kernels widen each weight in registers (kernels_dense.hpp); with
/// --quantized-matmul q8_activations, Q8_0/Q4_0 weights go through llama.cpp's
/// quantized-activation product instead.
struct Linear {
  int64_t out = 0, in = 0;
  detail::RawMatrix w;                 // [out, in] as stored
  bool q8_activations = false;         // Q8_0/Q4_0 with the quantized-activation kernel
  std::optional<detail::Bf16Split> split;  // F16/BF16 on AMX-BF16 (--dense-matmul bf16x3/bf16x6)
  const float* bias = nullptr;         // [out] or nullptr
  /// [out, in] float32 (for export).
  std::vector<float> rows_f32() const { return w.to_f32(); }
};

Linear make_linear(const detail::RawMatrix& m, const float* bias, const LoadOptions& opt) {
  Linear l;
  l.out = m.rows;
  l.in = m.cols;
  l.bias = bias;
  l.w = m;
  const bool q = m.type == detail::WeightType::q8_0 || m.type == detail::WeightType::q4_0;
  if (q && opt.quantized_matmul == QuantizedMatmul::q8_activations) l.q8_activations = true;
  if ((m.type == detail::WeightType::f16 || m.type == detail::WeightType::bf16) &&
      opt.dense_matmul != DenseMatmul::float32) {
    l.split = opt.dense_matmul == DenseMatmul::bf16x3 ? detail::Bf16Split::x3 : detail::Bf16Split::x6;
  }
  return l;
}

struct LayerWeights {
  const float* rms_att;
  const float* rms_ffn;
  const float* q_norm;  // [head_dim] or nullptr
  const float* k_norm;
  Linear wq, wk, wv, wo, w1, w2, w3;
};

struct Scratch {
  detail::AlignedFloatVector x, xb, q, k, v, att, h1, h3, rows;  // 64-byte aligned rows (core/aligned.hpp)
  std::vector<std::byte> xq;  // quantized activations
  const float* xq_of = nullptr;  // the input xq holds the quantization of, as the last project() call saw it
  std::vector<KvBlock> blocks;
};

/// Bytes of one row of the widest projection input (dim, the attention output, hidden) quantized to Q8_0.
std::size_t q8_input_bytes_max(const ModelConfig& c) {
  const int64_t in = std::max({int64_t{c.dim}, int64_t{c.q_dim()}, int64_t{c.hidden_dim}});
  return static_cast<std::size_t>((in / detail::kQBlock) * detail::kQ8Bytes);
}

/// Bytes of n rows of l's input quantized to Q8_0.
std::size_t q8_input_bytes(const Linear& l, int64_t n) {
  return static_cast<std::size_t>(n * (l.in / detail::kQBlock) * detail::kQ8Bytes);
}

/// y[n, l.out] (+)= x[n, l.in] W^T + b. `same_input`: x is the input of the previous project() call, unchanged
/// since (Q, K and V of one normed input; the FFN's gate and up), so its Q8_0 quantization is reused when that
/// call made it (it did not when its weights were not Q8_0/Q4_0: a file may mix types).

void project(const Linear& l, const float* x, int64_t n, float* y, bool accumulate, Scratch& s,
             bool same_input = false) {
  if (l.q8_activations) {
    const std::size_t bytes = q8_input_bytes(l, n);
    if (!same_input || s.xq_of != x || s.xq.size() != bytes) {
      s.xq.resize(bytes);
      detail::quantize_rows_q8_0(x, n, l.in, s.xq.data());
    }
    s.xq_of = x;
    detail::matmul_q8(s.xq.data(), n, l.in, l.w.data, l.w.type == detail::WeightType::q4_0, l.out, y, accumulate);
  } else if (l.split) {
    s.xq_of = nullptr;
    detail::matmul_bf16_split(*l.split, x, n, l.w, y, accumulate);
  } else {
    s.xq_of = nullptr;
    detail::matmul_w(x, n, l.w, y, accumulate);
  }
  if (l.bias != nullptr) detail::add_bias(y, n, l.out, l.bias);
}

/// h1 = silu(h1) * (x W3^T) in one pass, for an up projection `l` without a bias: in q8_activations
/// (matmul_q8_swiglu; h3 its scratch where it does not fuse) when x is the gate projection's input whose
/// quantization is reused, and under --dense-matmul bf16x3/bf16x6 (matmul_bf16_split_swiglu, in the tiles'
/// epilogue); false (nothing done) otherwise.
bool project_swiglu(const Linear& l, const float* x, int64_t n, float* h1, float* h3, Scratch& s) {
  if (l.split && l.bias == nullptr) {  // the SwiGLU in the tiles' epilogue: the up projection never stored
    detail::matmul_bf16_split_swiglu(*l.split, x, n, l.w, h1);
    return true;
  }
  if (!l.q8_activations || l.bias != nullptr || s.xq_of != x || s.xq.size() != q8_input_bytes(l, n)) return false;
  detail::matmul_q8_swiglu(s.xq.data(), n, l.in, l.w.data, l.w.type == detail::WeightType::q4_0, l.out, h1, h3);
  return true;
}

}  // namespace

struct Model::Weights {
  std::vector<MappedFile> files;
  std::vector<std::shared_ptr<const void>> keep_alive;
  std::vector<std::vector<float>> owned;
  ModelConfig cfg;
  ModelSource source;
  LoadOptions options;
  detail::RawMatrix token_embedding;       // [vocab, dim] as stored; rows widened to float32 when looked up
  const float* rms_final = nullptr;        // [dim]
  std::vector<LayerWeights> layers;
  Linear classifier;                       // [vocab, dim]
  const float* pos_table = nullptr;        // learned: [pos_rows, dim]
  int64_t pos_rows = 0;
  const float* t5_table = nullptr;         // t5_bias: [num_buckets, n_heads]
  std::vector<float> alibi_slopes;         // alibi: [n_heads]
  std::vector<std::string> symbols;
  std::string metadata_json = "{}";
  std::optional<Tokenizer> tokenizer;
  RopeLayout stored_layout = RopeLayout::interleaved;
  std::string stored_rope_type;           // the file's own rope_scaling (trained_position_bound)
  std::optional<double> stored_rope_factor;
};

std::string_view to_string(ModelFormat format) {
  switch (format) {
    case ModelFormat::llama2c: return "llama2.c";
    case ModelFormat::posenc: return "posenc";
    case ModelFormat::hf_directory: return "Hugging Face directory";
    case ModelFormat::gguf: return "GGUF";
  }
  return "?";
}

KernelInfo kernel_info() {
  KernelInfo k;
  const detail::DenseKernel dense = detail::dense_kernel();
  const detail::Q8Kernel q8 = detail::q8_kernel();
  k.dense_kernel = std::string(detail::to_string(dense));
  k.q8_kernel = std::string(detail::to_string(q8));
  if (dense != detail::DenseKernel::reference)
    k.decode_plan_dense = detail::to_string(detail::decode_streams(detail::WeightType::f16, dense));
  // (the float32 products' plan; the VNNI/AMX decode's, an AVX-512 one, when those products have none)
  if (dense != detail::DenseKernel::reference)
    k.decode_plan_blocks = detail::to_string(detail::decode_streams(detail::WeightType::q8_0, dense));
  else if (q8 == detail::Q8Kernel::avx512_vnni || q8 == detail::Q8Kernel::amx)
    k.decode_plan_blocks =
        detail::to_string(detail::decode_streams(detail::WeightType::q8_0, detail::DenseKernel::avx512));
  k.threads = region_thread_count();
  return k;
}

std::string_view to_string(QuantizedMatmul mode) {
  return mode == QuantizedMatmul::dequantize ? "dequantize" : "q8_activations";
}

std::string_view to_string(DenseMatmul mode) {
  switch (mode) {
    case DenseMatmul::float32: return "float32";
    case DenseMatmul::bf16x3: return "bf16x3";
    case DenseMatmul::bf16x6: return "bf16x6";
  }
  return "?";
}

DenseMatmul parse_dense_matmul(std::string_view text, std::string_view field) {
  if (text == "float32") return DenseMatmul::float32;
  if (text == "bf16x3") return DenseMatmul::bf16x3;
  if (text == "bf16x6") return DenseMatmul::bf16x6;
  throw ConfigError(fmt::format("{}: must be float32, bf16x3 or bf16x6 (got '{}')", field, text));
}

QuantizedMatmul parse_quantized_matmul(std::string_view text, std::string_view field) {
  if (text == "dequantize") return QuantizedMatmul::dequantize;
  if (text == "q8_activations") return QuantizedMatmul::q8_activations;
  throw ConfigError(fmt::format("{}: must be dequantize or q8_activations (got '{}')", field, text));
}

namespace detail {
namespace {
std::atomic<PositionBug> g_position_bug{PositionBug::none};
std::atomic<DecodeTeam> g_decode_team{DecodeTeam::automatic};
std::atomic<int64_t> g_decode_team_steps{0};
std::atomic<int> g_decode_team_fault_segment{-1};
std::atomic<int> g_decode_team_fault_thread{0};
}  // namespace
void set_position_bug_for_testing(PositionBug bug) { g_position_bug.store(bug); }
PositionBug position_bug_for_testing() { return g_position_bug.load(std::memory_order_relaxed); }
void set_decode_team(DecodeTeam mode) { g_decode_team.store(mode); }
DecodeTeam decode_team() { return g_decode_team.load(std::memory_order_relaxed); }
int64_t decode_team_steps() { return g_decode_team_steps.load(std::memory_order_relaxed); }
void set_decode_team_fault_for_testing(int segment, int thread) {
  g_decode_team_fault_thread.store(thread);
  g_decode_team_fault_segment.store(segment);
}
}  // namespace detail

void Model::set_sliding_window(int64_t window) {
  if (window < 0) fail_field<InvalidArgument>("sliding_window", "must be >= 0 (0 = causal)", window);
  sliding_window_ = window;
}

// ---- bounds on positions (issue 16 finding 4) ----
struct Model::PositionWatch {
  std::function<void(const PositionWarning&)> on_warning;
  std::atomic<bool> warned{false};
};

void Model::set_max_position(int64_t n) {
  if (n < -1) fail_field<InvalidArgument>("max_position", "must be >= 0 (or -1 = no limit)", n);
  max_position_ = n;
}

void Model::set_position_warning(std::function<void(const PositionWarning&)> on_warning) {
  position_watch_.reset();
  if (!on_warning) return;
  position_watch_ = std::make_shared<PositionWatch>();
  position_watch_->on_warning = std::move(on_warning);
}

std::function<void(const PositionWarning&)> Model::position_warning() const {
  return position_watch_ ? position_watch_->on_warning : std::function<void(const PositionWarning&)>();
}

double trained_position_factor(const Model& model) {
  if (model.family() != PositionFamily::rope) return 1.0;
  const auto& f = model.rope().params.factor;
  return f && std::isfinite(*f) && *f > 0 ? *f : 1.0;
}

int64_t trained_position_bound(const Model& model) {
  const double b = std::ceil(static_cast<double>(model.trained_context()) * trained_position_factor(model) - 1e-9);
  if (!(b < 9.2e18)) return std::numeric_limits<int64_t>::max();
  int64_t bound = std::max<int64_t>(static_cast<int64_t>(b), 0);
  // A file whose own rope_scaling extends the context (Llama-3.1: original 8192 x factor 8, fine-tuned to
  // max_position_embeddings 131072) was trained to the window it declares, as long as that scaling is the one
  // in use; an override (another method or factor) gets only trained_context x its factor.
  if (model.family() == PositionFamily::rope && model.rope().params.rope_type != "default" &&
      model.rope().params.rope_type == model.stored_rope_type() &&
      model.rope().params.factor == model.stored_rope_factor())
    bound = std::max(bound, model.config().max_position_embeddings);
  return bound;
}

Model::Model(std::shared_ptr<const Weights> weights) : w_(std::move(weights)) {}
Model::Model(const Model&) = default;
Model& Model::operator=(const Model&) = default;
Model::Model(Model&&) noexcept = default;
Model& Model::operator=(Model&&) noexcept = default;
Model::~Model() = default;

const ModelConfig& Model::config() const { return w_->cfg; }
void Model::set_rope_change_policy(RopeChangePolicy policy) { policy_ = policy; }

void Model::set_rope(const RopeSetup& rope) {
  if (positional_.family != PositionFamily::rope)
    throw InvalidArgument(fmt::format("rope: this model's positional family is {}, not rope",
                                      to_string(positional_.family)));
  rope.freqs.validate();
  if (rope.freqs.head_dim != w_->cfg.head_dim)
    throw InvalidArgument(fmt::format("head_dim: RoPE frequencies are for head_dim {}, the model has {}",
                                      rope.freqs.head_dim, w_->cfg.head_dim));
  positional_.rope = rope;
}

Model Model::build(detail::RawModel raw, const LoadOptions& options) {
  auto w = std::make_shared<Weights>();
  const ModelConfig& c = raw.cfg;
  w->cfg = c;
  w->options = options;
  w->token_embedding = raw.tok_embeddings;
  w->rms_final = raw.norm;
  w->layers.resize(static_cast<std::size_t>(c.n_layers));
  for (std::size_t l = 0; l < w->layers.size(); ++l) {
    const detail::RawLayer& r = raw.layers[l];
    LayerWeights& lw = w->layers[l];
    lw.rms_att = r.attention_norm;
    lw.rms_ffn = r.ffn_norm;
    lw.q_norm = r.q_norm;
    lw.k_norm = r.k_norm;
    lw.wq = make_linear(r.wq, r.bq, options);
    lw.wk = make_linear(r.wk, r.bk, options);
    lw.wv = make_linear(r.wv, r.bv, options);
    lw.wo = make_linear(r.wo, r.bo, options);
    lw.w1 = make_linear(r.w1, r.b1, options);
    lw.w2 = make_linear(r.w2, r.b2, options);
    lw.w3 = make_linear(r.w3, r.b3, options);
  }
  w->classifier = make_linear(raw.output, nullptr, options);
  // The mode needs AMX-BF16 only when some matrix is F16/BF16 (otherwise it changes nothing, as the CLI says).
  bool splits = w->classifier.split.has_value();
  for (const LayerWeights& lw : w->layers)
    for (const Linear* l : {&lw.wq, &lw.wk, &lw.wv, &lw.wo, &lw.w1, &lw.w2, &lw.w3}) splits = splits || l->split.has_value();
  if (splits && !detail::amx_bf16_supported())
    throw InvalidArgument(fmt::format("dense_matmul: {} runs on AMX-BF16 tiles, which this CPU (or its kernel's "
                                      "permission for the tile data) does not have; use float32",
                                      to_string(options.dense_matmul)));
  w->pos_table = raw.pos_embeddings;
  w->pos_rows = raw.pos_rows;
  w->t5_table = raw.t5_bias;
  if (raw.positional.family == PositionFamily::alibi)
    w->alibi_slopes = alibi_slopes(c.n_heads, raw.positional.alibi_max_bias);
  w->symbols = std::move(raw.symbols);
  w->metadata_json = std::move(raw.metadata_json);
  w->source = std::move(raw.source);
  w->tokenizer = std::move(raw.tokenizer);
  if (!w->tokenizer && !w->symbols.empty()) w->tokenizer = Tokenizer::from_symbols(w->symbols);
  PositionalConfig pc = raw.positional;
  w->stored_layout = pc.rope.layout;
  w->stored_rope_type = pc.rope.params.rope_type;
  w->stored_rope_factor = pc.rope.params.factor;
  const int64_t window = raw.sliding_window;
  const int64_t trained = raw.trained_context > 0 ? raw.trained_context : c.max_position_embeddings;
  std::string trained_source = w->source.trained_context_source;
  w->files = std::move(raw.files);
  w->keep_alive = std::move(raw.keep_alive);
  w->owned = std::move(raw.owned);
  Model m(std::move(w));
  m.positional_ = std::move(pc);
  m.sliding_window_ = window;
  m.trained_context_ = trained;
  m.trained_context_source_ = std::move(trained_source);
  return m;
}

Model Model::load_llama2c(const std::filesystem::path& path) { return build(detail::read_llama2c(path), {}); }

ModelFormat Model::detect_format(const std::filesystem::path& path) {
  std::error_code ec;
  if (!std::filesystem::exists(path, ec))
    throw IoError(fmt::format("{}: no such file or directory", path.string()));
  if (std::filesystem::is_directory(path, ec)) return ModelFormat::hf_directory;
  if (is_posenc_checkpoint(path)) return ModelFormat::posenc;
  if (read_file_prefix(path, 4) == "GGUF") return ModelFormat::gguf;
  // A file named .gguf that does not start with the magic is a damaged GGUF: its reader says so (magic, size),
  // where the llama2.c reader would report a meaningless header field.
  if (detail::named_gguf(path)) return ModelFormat::gguf;
  return ModelFormat::llama2c;
}

Model Model::load(const std::filesystem::path& path) { return load(path, LoadOptions{}); }

namespace {
/// A file of a Hugging Face directory (config.json, tokenizer.json, a
/// safetensors shard) given as the model: read as a llama2.c header it would
/// fail with a meaningless "dim 538970747".
void refuse_directory_files(const std::filesystem::path& path) {
  const std::string b = read_file_prefix(path, 16);
  const std::size_t n = b.size();
  auto skip_space = [&](std::size_t i) {
    while (i < n && std::isspace(static_cast<unsigned char>(b[i]))) ++i;
    return i;
  };
  // JSON: '{' then '"' or '}' (a llama2.c header never has these bytes there);
  // safetensors: a u64 header length below 2^32 (a llama2.c hidden_dim of 0) and '{'.
  const std::size_t i = skip_space(0), j = i < n ? skip_space(i + 1) : n;
  const bool json = i < n && b[i] == '{' && j < n && (b[j] == '"' || b[j] == '}');
  const bool safetensors = n >= 9 && b[4] == 0 && b[5] == 0 && b[6] == 0 && b[7] == 0 && b[8] == '{';
  if (json || safetensors)
    throw CheckpointError(fmt::format("{}: a {} file, not a model; --model takes the Hugging Face directory that "
                                      "holds it ({})",
                                      path.string(), json ? "JSON" : "safetensors",
                                      path.parent_path().empty() ? "." : path.parent_path().string()));
}
}  // namespace

Model Model::load(const std::filesystem::path& path, const LoadOptions& options) {
  switch (detect_format(path)) {
    case ModelFormat::posenc: return build(detail::read_posenc(path), options);
    case ModelFormat::hf_directory: return build(detail::read_hf_directory(path), options);
    case ModelFormat::gguf: return build(detail::read_gguf_model(path), options);
    case ModelFormat::llama2c: break;
  }
  refuse_directory_files(path);
  return build(detail::read_llama2c(path), options);
}

std::optional<Tokenizer> Model::load_bundled_tokenizer(const std::filesystem::path& path) {
  switch (detect_format(path)) {
    case ModelFormat::hf_directory: {
      std::error_code ec;
      if (!std::filesystem::exists(path / "config.json", ec))  // as Model::load says it
        throw CheckpointError(detail::missing_config_message(path));
      const auto tj = path / "tokenizer.json";
      if (!std::filesystem::exists(tj, ec)) return std::nullopt;
      return Tokenizer::load_tokenizer_json(tj);
    }
    case ModelFormat::gguf: {
      std::string describe;
      return detail::read_gguf_tokenizer(path, describe);
    }
    case ModelFormat::posenc: {
      auto raw = detail::read_posenc(path);
      if (raw.symbols.empty()) return std::nullopt;
      return Tokenizer::from_symbols(std::move(raw.symbols));
    }
    case ModelFormat::llama2c: break;
  }
  return std::nullopt;
}

const ModelSource& Model::source() const { return w_->source; }
const std::optional<Tokenizer>& Model::bundled_tokenizer() const { return w_->tokenizer; }
QuantizedMatmul Model::quantized_matmul() const { return w_->options.quantized_matmul; }
DenseMatmul Model::dense_matmul() const { return w_->options.dense_matmul; }

namespace {
template <class Weights, class Pred>
bool any_matrix(const Weights& w, Pred pred) {
  if (pred(w.classifier.w.type)) return true;
  for (const LayerWeights& lw : w.layers)
    for (const Linear* l : {&lw.wq, &lw.wk, &lw.wv, &lw.wo, &lw.w1, &lw.w2, &lw.w3})
      if (pred(l->w.type)) return true;
  return false;
}
}  // namespace

bool Model::has_block_quantized_matrices() const {
  return any_matrix(*w_, [](detail::WeightType t) {
    return t == detail::WeightType::q8_0 || t == detail::WeightType::q4_0;
  });
}

bool Model::has_half_precision_matrices() const {
  return any_matrix(*w_, [](detail::WeightType t) {
    return t == detail::WeightType::f16 || t == detail::WeightType::bf16;
  });
}

void Model::set_trained_context(int64_t n, std::string source) {
  if (n <= 0) fail_field<InvalidArgument>("trained_context", "must be positive", n);
  trained_context_ = n;
  trained_context_source_ = std::move(source);
}

std::vector<CheckpointTensor> Model::export_tensors() const {
  const Weights& w = *w_;
  const ModelConfig& c = w.cfg;
  std::vector<CheckpointTensor> out;
  auto add = [&](std::string name, std::vector<int64_t> shape, std::vector<float> data) {
    out.push_back({std::move(name), std::move(shape), std::move(data)});
  };
  auto vec = [](const float* p, int64_t n) { return std::vector<float>(p, p + n); };
  const int64_t D = c.dim, H = c.hidden_dim, V = c.vocab_size, KV = c.kv_dim(), Q = c.q_dim(), HD = c.head_dim;
  add("tok_embeddings", {V, D}, w.token_embedding.to_f32());
  for (int l = 0; l < c.n_layers; ++l) {
    const auto& r = w.layers[static_cast<std::size_t>(l)];
    const std::string p = fmt::format("layers.{}.", l);
    add(p + "attention_norm", {D}, vec(r.rms_att, D));
    add(p + "wq", {Q, D}, r.wq.rows_f32());
    add(p + "wk", {KV, D}, r.wk.rows_f32());
    add(p + "wv", {KV, D}, r.wv.rows_f32());
    add(p + "wo", {D, Q}, r.wo.rows_f32());
    if (r.wq.bias != nullptr) {
      add(p + "bq", {Q}, vec(r.wq.bias, Q));
      add(p + "bk", {KV}, vec(r.wk.bias, KV));
      add(p + "bv", {KV}, vec(r.wv.bias, KV));
    }
    if (r.wo.bias != nullptr) add(p + "bo", {D}, vec(r.wo.bias, D));
    if (r.q_norm != nullptr) {
      add(p + "q_norm", {HD}, vec(r.q_norm, HD));
      add(p + "k_norm", {HD}, vec(r.k_norm, HD));
    }
    add(p + "ffn_norm", {D}, vec(r.rms_ffn, D));
    add(p + "w1", {H, D}, r.w1.rows_f32());
    add(p + "w2", {D, H}, r.w2.rows_f32());
    add(p + "w3", {H, D}, r.w3.rows_f32());
    if (r.w1.bias != nullptr) {
      add(p + "b1", {H}, vec(r.w1.bias, H));
      add(p + "b2", {D}, vec(r.w2.bias, D));
      add(p + "b3", {H}, vec(r.w3.bias, H));
    }
  }
  add("norm", {D}, vec(w.rms_final, D));
  if (!c.shared_classifier) add("output", {V, D}, w.classifier.rows_f32());
  if (positional_.family == PositionFamily::learned_absolute)
    add("pos_embeddings", {w.pos_rows, D}, vec(w.pos_table, w.pos_rows * D));
  if (positional_.family == PositionFamily::t5_bias)
    add("t5_relative_attention_bias", {positional_.t5_num_buckets, c.n_heads},
        vec(w.t5_table, static_cast<int64_t>(positional_.t5_num_buckets) * c.n_heads));
  return out;
}

RopeLayout Model::stored_layout() const { return w_->stored_layout; }
const std::string& Model::stored_rope_type() const { return w_->stored_rope_type; }
const std::optional<double>& Model::stored_rope_factor() const { return w_->stored_rope_factor; }

PosencCheckpoint Model::to_checkpoint() const {
  const ModelConfig& c = w_->cfg;
  if (c.qkv_bias || c.o_bias || c.mlp_bias || c.qk_norm || c.q_dim() != c.dim)
    throw InvalidArgument(
        "to_checkpoint: the posenc checkpoint format holds Llama2-shaped models only (no biases, no q/k norm, "
        "n_heads * head_dim == dim)");
  PosencCheckpoint ck;
  ck.config = c;
  ck.positional = positional_;
  ck.config.max_position_embeddings = trained_context_;
  ck.symbols = w_->symbols;
  ck.metadata_json = w_->metadata_json;
  ck.tensors = export_tensors();
  return ck;
}

const std::vector<std::string>& Model::embedded_symbols() const { return w_->symbols; }
const std::string& Model::metadata_json() const { return w_->metadata_json; }

KvCache Model::make_cache(int block_size, int64_t max_blocks) const {
  return make_cache(block_size, max_blocks, kv_dtype_);
}

KvCache Model::make_cache(int block_size, int64_t max_blocks, KvCacheDtype dtype) const {
  KvCache::Config kc;
  kc.dtype = dtype;
  kc.n_layers = w_->cfg.n_layers;
  kc.kv_heads = w_->cfg.n_kv_heads;
  kc.head_dim = w_->cfg.head_dim;
  kc.block_size = block_size;
  kc.max_blocks = max_blocks;
  return KvCache(kc);
}

namespace {

/// MRoPE (family mrope): the [3, n_b] rows (t, h, w) each sequence of the batch
/// rotates with, validated before anything touches the cache. Explicit rows are
/// taken as given; without them all three rows are the token's 1-D position
/// (explicit or next_position + i) plus the sequence's cached rope delta
/// (Qwen2_5_VLModel.forward: cache_position + rope_deltas; 0 for a fresh or
/// text-only sequence, where it is HF's expansion of 2-D position_ids to three
/// rows). forward_padded and the other 1-D callers thus continue an image
/// sequence correctly. Throws InvalidArgument for rows on a model of another
/// family or rows of the wrong size.
std::vector<std::vector<int64_t>> mrope_rows_for_batch(const KvCache& cache,
                                                       std::span<const Model::SequenceInput> batch,
                                                       std::span<const int64_t> offset, std::span<const int64_t> pos,
                                                       PositionFamily family) {
  const bool mrope = family == PositionFamily::mrope;
  std::vector<std::vector<int64_t>> rows(mrope ? batch.size() : 0);
  for (std::size_t b = 0; b < batch.size(); ++b) {
    const auto& in = batch[b];
    const std::size_t n = in.tokens.size();
    if (!in.mrope_position_ids.empty() && !mrope)
      throw InvalidArgument(fmt::format("mrope_position_ids: given for sequence {} but the model's positional family "
                                        "is {}, not mrope",
                                        in.seq, to_string(family)));
    if (!mrope) continue;
    if (!in.mrope_position_ids.empty()) {
      if (in.mrope_position_ids.size() != 3 * n)
        throw InvalidArgument(fmt::format("mrope_position_ids: {} entries for [3, {}] (sequence {})",
                                          in.mrope_position_ids.size(), n, in.seq));
      rows[b].assign(in.mrope_position_ids.begin(), in.mrope_position_ids.end());
      continue;
    }
    const int64_t delta = cache.mrope_delta(in.seq);
    rows[b].resize(3 * n);
    for (std::size_t i = 0; i < n; ++i) {
      const int64_t p = pos[static_cast<std::size_t>(offset[b]) + i] + delta;
      rows[b][i] = rows[b][n + i] = rows[b][2 * n + i] = p;
    }
  }
  return rows;
}

/// MRoPE: refuses (CacheError, before anything is appended) a sequence whose
/// cached keys were rotated with another setup; MRoPE frequencies never change
/// with the length, so there is nothing to re-rotate.
std::vector<KvCache::RopeState> mrope_states(KvCache& cache, std::span<const Model::SequenceInput> batch,
                                             const RopeSetup& rope) {
  std::vector<KvCache::RopeState> states(batch.size(), KvCache::RopeState{rope.freqs, rope.layout, rope.precision});
  for (std::size_t b = 0; b < batch.size(); ++b) {
    const auto& cur = cache.rope_state(batch[b].seq);
    if (cur && !(*cur == states[b]) && cache.size(batch[b].seq) > 0)
      cache.set_rope_state(batch[b].seq, states[b], false);  // throws CacheError
  }
  return states;
}

}  // namespace

RopeSetup freeze_rope_for_length(const RopeSetup& rope, int64_t seq_len) {
  RopeSetup r = rope;
  if (find_rope_scaling(r.params.rope_type).depends_on_seq_len)
    r.freqs = r.params.rope_type == "dynamic"
                  ? dynamic_ntk_frequencies(r.params, seq_len, DynamicNtkArithmetic::tensor_float32)
                  : compute_rope_frequencies(r.params, seq_len);
  r.update_with_length = false;
  return r;
}

std::string_view to_string(RopeChangePolicy policy) {
  switch (policy) {
    case RopeChangePolicy::recompute: return "recompute";
    case RopeChangePolicy::hf: return "hf";
    case RopeChangePolicy::refuse: return "refuse";
    case RopeChangePolicy::rerotate: return "rerotate";
  }
  return "?";
}

RopeChangePolicy parse_rope_change_policy(std::string_view text, std::string_view field) {
  for (RopeChangePolicy p : {RopeChangePolicy::recompute, RopeChangePolicy::hf, RopeChangePolicy::refuse,
                             RopeChangePolicy::rerotate})
    if (text == to_string(p)) return p;
  throw ConfigError(fmt::format("{}: must be recompute, hf, refuse or rerotate (got '{}')", field, text));
}

int64_t rope_switch_point(const RopeParams& params) {
  if (params.rope_type == "dynamic") return detail::require_max_position_embeddings(params);
  if (params.rope_type == "longrope") return detail::original_max_position(params);
  return 0;
}

namespace {

/// The rotation a length-dependent method (dynamic, longrope) gives a sequence
/// of length `seq_len`. hf: Hugging Face's dynamic_rope_update as
/// RopeFrequencySchedule runs it, restarted from the sequence's own
/// max_seq_len_cached (cur->seq_len; dynamic NTK grows only and resets below
/// the original context; the planned length is ignored, as HF has none).
/// Otherwise the frequencies of the length itself (dynamic NTK in HF's
/// forward-path float32 arithmetic), LongRoPE's for max(seq_len, planned).
KvCache::RopeState length_dependent_state(const RopeSetup& rope, int64_t seq_len, int64_t planned,
                                          const KvCache::RopeState* cur, RopeChangePolicy policy) {
  KvCache::RopeState st{rope.freqs, rope.layout, rope.precision, seq_len};
  const RopeParams& p = rope.params;
  if (policy == RopeChangePolicy::hf) {
    RopeFrequencySchedule schedule(p);
    if (cur != nullptr && cur->seq_len > 0) schedule.update_for_length(cur->seq_len);
    st.freqs = schedule.update_for_length(seq_len);
    st.seq_len = p.rope_type == "dynamic" ? schedule.max_seq_len_cached() : seq_len;
    return st;
  }
  if (p.rope_type == "dynamic") {
    // HF's forward path (dynamic_rope_update) forms dynamic NTK's base' in
    // float32 from the integer length tensor.
    st.freqs = dynamic_ntk_frequencies(p, seq_len, DynamicNtkArithmetic::tensor_float32);
  } else {
    st.seq_len = std::max(seq_len, planned);
    st.freqs = compute_rope_frequencies(p, st.seq_len);
  }
  return st;
}

/// recompute needs every token of the sequence, by id.
void check_recomputable(const KvCache& cache, KvCache::SeqId seq) {
  if (cache.evicted(seq) > 0)
    throw CacheError(fmt::format(
        "KV cache: sequence {} needs a re-prefill with new RoPE frequencies (rope change policy recompute), but {} "
        "of its tokens were evicted; the re-prefill cannot reproduce a full forward (use rope change policy hf or "
        "rerotate, or keep the tokens)",
        seq, cache.evicted(seq)));
  const auto ids = cache.token_ids(seq);
  if (std::find(ids.begin(), ids.end(), -1) != ids.end())
    throw CacheError(fmt::format("KV cache: sequence {} needs a re-prefill with new RoPE frequencies (rope change "
                                 "policy recompute), but some of its slots were appended without token ids",
                                 seq));
}

}  // namespace

void Model::recompute_sequence(KvCache& cache, KvCache::SeqId seq, const KvCache::RopeState& state) const {
  const std::vector<int32_t> tokens = cache.token_ids(seq);
  const std::vector<int64_t> positions = cache.positions(seq);
  cache.clear(seq);
  // The same weights with the frequencies frozen at the new state: one forward
  // over the sequence's own tokens at their own positions (a full forward).
  Model frozen = *this;
  frozen.positional_.rope.freqs = state.freqs;
  frozen.positional_.rope.update_with_length = false;
  frozen.policy_ = RopeChangePolicy::refuse;
  const SequenceInput in{seq, tokens, positions};
  std::vector<float> logits;
  frozen.forward(cache, std::span<const SequenceInput>(&in, 1), LogitsMode::last, logits);
  cache.record_recompute(seq, static_cast<int64_t>(tokens.size()));
}

namespace {
/// Whether a one-token forward runs its layers in one parallel region each (Model::forward): the team not switched
/// off (detail::set_decode_team), more than one thread (OMP_NUM_THREADS and OMP_THREAD_LIMIT), not inside a
/// parallel region already, and every projection on a one-row product: matmul_w's AVX-512 or AVX2 one (decode_rows_supported;
/// not the bf16 splits) or, under q8_activations, matmul_q8's VNNI one (q8_decode_rows_supported). In automatic mode
/// also Q, O, gate, up and down each large enough for matmul_w to open a parallel region for it (parallel_pays): a
/// smaller model's projections run on one thread, and a team's six barriers a layer would cost more than they save
/// (a newcomer measured a dim-256 model's decode at 0.07-0.8x of the regions' with a team forced on).
/// The error of a position id past Model::set_max_position's limit (forward's, and a chunked window's up front).
PositionError past_position_limit(int64_t position, int64_t limit) {
  return PositionError(fmt::format(
      "position_ids: position {} is past the position limit {} (max_position; positions 0 .. {} are allowed)",
      position, limit, limit));
}

template <class Weights>
bool decode_team_pays(const Weights& m) {
  const detail::DecodeTeam mode = detail::decode_team();
  if (mode == detail::DecodeTeam::off || region_thread_count() < 2 || omp_in_parallel()) return false;
  const auto plain = [](const Linear& l) {
    if (l.q8_activations) return detail::q8_decode_rows_supported(l.in, l.w.type == detail::WeightType::q4_0);
    return !l.split && detail::decode_rows_supported(l.w);
  };
  const auto pays = [&](const Linear& l) { return mode == detail::DecodeTeam::always || detail::parallel_pays(1, l.w); };
  if (!plain(m.classifier)) return false;
  for (const LayerWeights& w : m.layers) {
    for (const Linear* l : {&w.wq, &w.wk, &w.wv, &w.wo, &w.w1, &w.w2, &w.w3})
      if (!plain(*l)) return false;
    for (const Linear* l : {&w.wq, &w.wo, &w.w1, &w.w2, &w.w3})
      if (!pays(*l)) return false;
  }
  return true;
}
}  // namespace

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

  const PositionFamily family = positional_.family;
  if (family == PositionFamily::learned_absolute)
    for (int64_t p : pos)
      if (p >= m.pos_rows)
        throw PositionError(fmt::format(
            "position_ids: position {} is past the learned position table (max_position_embeddings {})", p,
            m.pos_rows));

  // Bounds on positions: --max-position refuses (before the cache is touched); past the trained context x the
  // rope_scaling factor warns once.
  if (max_position_ >= 0 || position_watch_) {
    int64_t maxp = -1;
    for (int64_t p : pos) maxp = std::max(maxp, p);
    if (max_position_ >= 0 && maxp > max_position_)
      throw past_position_limit(maxp, max_position_);
    const int64_t bound = trained_position_bound(*this);
    if (position_watch_ && maxp >= bound && bound > 0 && !position_watch_->warned.exchange(true)) {
      int64_t first = -1;  // the first id >= bound in batch order: where the sequence crosses it
      for (int64_t p : pos)
        if (p >= bound) {
          first = p;
          break;
        }
      PositionWarning w;
      w.position = first;
      w.bound = bound;
      w.trained_context = trained_context_;
      w.factor = trained_position_factor(*this);
      const bool rope_family = family == PositionFamily::rope;
      w.message = fmt::format(
          "the sequence passes the trained context ({} tokens, {}){} at position {}: {} positions{} from here on are "
          "outside what the model was trained on",
          trained_context_, trained_context_source_,
          w.factor != 1.0 ? fmt::format(" x rope factor {:g} = {} positions", w.factor, bound) : "", first,
          to_string(family),
          rope_family ? fmt::format(" (rope_type {})", positional_.rope.params.rope_type) : "");
      position_watch_->on_warning(w);
    }
  }

  // ---- MRoPE: three position rows per token (validated before the cache is touched) ----
  const bool mrope = family == PositionFamily::mrope;
  std::vector<std::vector<int64_t>> mrows = mrope_rows_for_batch(cache, batch, offset, pos, family);
  std::vector<KvCache::RopeState> mstates;
  std::vector<RopeTable> mtables;
  if (mrope) {
    mstates = mrope_states(cache, batch, positional_.rope);
    mtables.reserve(B);
    for (std::size_t b = 0; b < B; ++b)
      mtables.push_back(mrope_table(mstates[b].freqs, positional_.mrope_section, mrows[b],
                                    static_cast<int64_t>(batch[b].tokens.size()), mstates[b].precision,
                                    positional_.mrope_mapping));
  }

  // ---- per-sequence RoPE state (dynamic methods recompute for the length) ----
  const bool rope = family == PositionFamily::rope;
  std::vector<KvCache::RopeState> states(rope ? B : 0);
  if (rope) {
    const RopeParams& params = positional_.rope.params;
    const bool dynamic = positional_.rope.update_with_length && find_rope_scaling(params.rope_type).depends_on_seq_len;
    for (std::size_t b = 0; b < B; ++b) {
      states[b] = {positional_.rope.freqs, positional_.rope.layout, positional_.rope.precision};
      if (dynamic && offset[b + 1] > offset[b]) {
        int64_t maxp = 0;
        for (int64_t i = offset[b]; i < offset[b + 1]; ++i) maxp = std::max(maxp, pos[static_cast<std::size_t>(i)]);
        maxp = std::max(maxp, cache.next_position(batch[b].seq) - 1);
        const auto& cur = cache.rope_state(batch[b].seq);
        states[b] = length_dependent_state(positional_.rope, maxp + 1, cache.planned_length(batch[b].seq),
                                           cur && cache.size(batch[b].seq) > 0 ? &*cur : nullptr, policy_);
      }
    }
    // Refusals happen here, before anything is appended to any sequence.
    std::vector<bool> changed(B, false);
    for (std::size_t b = 0; b < B; ++b) {
      const KvCache::SeqId seq = batch[b].seq;
      const auto& cur = cache.rope_state(seq);
      changed[b] = cur && !(*cur == states[b]) && cache.size(seq) > 0;
      if (!changed[b]) continue;
      if (policy_ == RopeChangePolicy::refuse) cache.set_rope_state(seq, states[b], false);  // throws CacheError
      if (policy_ == RopeChangePolicy::recompute) check_recomputable(cache, seq);
    }
    for (std::size_t b = 0; b < B; ++b) {
      const KvCache::SeqId seq = batch[b].seq;
      if (changed[b] && policy_ == RopeChangePolicy::recompute) recompute_sequence(cache, seq, states[b]);
      if (policy_ == RopeChangePolicy::hf)
        cache.set_rope_state_mixed(seq, states[b]);
      else
        cache.set_rope_state(seq, states[b], policy_ == RopeChangePolicy::rerotate);
    }
  }

  // A step that throws from here on (the pool running out at a later sequence of the batch, std::bad_alloc in the
  // network, on the decode team's threads too) takes back every slot it appended: the sequences stay as they were
  // (their rope state as set above, consistent with their keys).
  struct TakeBackAppends {
    KvCache& cache;
    std::vector<std::pair<KvCache::SeqId, KvCache::AppendMark>> marks;
    const int exceptions = std::uncaught_exceptions();
    ~TakeBackAppends() {
      if (std::uncaught_exceptions() > exceptions)
        for (const auto& [seq, mark] : marks) cache.rollback_appends(seq, mark);
    }
  } take_back{cache, {}};
  take_back.marks.reserve(B);
  for (std::size_t b = 0; b < B; ++b) take_back.marks.emplace_back(batch[b].seq, cache.append_mark(batch[b].seq));
  std::vector<std::vector<KvCache::Slot>> slots(B);
  for (std::size_t b = 0; b < B; ++b)
    slots[b] = cache.append(batch[b].seq,
                            std::span<const int64_t>(pos).subspan(static_cast<std::size_t>(offset[b]),
                                                                  batch[b].tokens.size()),
                            batch[b].tokens);
  std::vector<RopeTable> tables;
  for (std::size_t b = 0; b < mstates.size(); ++b) {  // MRoPE: the rotation and rows of what was appended
    cache.set_rope_state(batch[b].seq, mstates[b], false);
    cache.set_mrope_positions(batch[b].seq, slots[b], mrows[b]);
  }
  if (rope) {
    tables.reserve(B);
    for (std::size_t b = 0; b < B; ++b)
      tables.emplace_back(states[b].freqs,
                          std::span<const int64_t>(pos).subspan(static_cast<std::size_t>(offset[b]),
                                                                batch[b].tokens.size()),
                          states[b].precision);
  }

  // ---- the network ----
  thread_local Scratch thread_scratch;
  // A reference, not the thread_local itself: a lambda below run by another thread of a parallel region (the decode
  // team's) then reaches this call's scratch, not that thread's own.
  Scratch& s = thread_scratch;
  const int D = c.dim, Q = c.q_dim(), KV = c.kv_dim(), HID = c.hidden_dim, HD = c.head_dim;
  const auto sz = static_cast<std::size_t>(N);
  s.x.resize(sz * D);
  s.xb.resize(sz * D);
  s.q.resize(sz * Q);
  s.k.resize(sz * KV);
  s.v.resize(sz * KV);
  s.att.resize(sz * Q);
  s.h1.resize(sz * HID);
  s.h3.resize(sz * HID);
  for (std::size_t b = 0; b < B; ++b)
    for (std::size_t i = 0; i < batch[b].tokens.size(); ++i) {
      const int64_t r = offset[b] + static_cast<int64_t>(i);
      m.token_embedding.row_to_f32(static_cast<int64_t>(batch[b].tokens[i]), s.x.data() + r * D);
    }
  if (family == PositionFamily::learned_absolute)
    add_absolute_position_encoding(AbsolutePositionEncoding::table, std::span(s.x.data(), sz * D), D, pos,
                                   std::span(m.pos_table, static_cast<std::size_t>(m.pos_rows) * D), m.pos_rows);
  if (family == PositionFamily::sinusoidal)
    add_sinusoidal_encoding(std::span(s.x.data(), sz * D), D, pos, SinusoidalLayout::interleaved,
                            positional_.sinusoidal_base);

  AttentionSpec spec;
  spec.heads = c.n_heads;
  spec.kv_heads = c.n_kv_heads;
  spec.head_dim = c.head_dim;
  spec.mask = sliding_window_ > 0 ? MaskKind::sliding_window : MaskKind::causal;
  spec.sliding_window = sliding_window_;
  if (family == PositionFamily::alibi) {
    spec.bias = LogitBias::alibi;
    spec.alibi_slopes = m.alibi_slopes;
  } else if (family == PositionFamily::t5_bias) {
    spec.bias = LogitBias::t5;
    spec.t5.table = std::span(m.t5_table, static_cast<std::size_t>(positional_.t5_num_buckets) * c.n_heads);
    spec.t5.num_buckets = positional_.t5_num_buckets;
    spec.t5.max_distance = positional_.t5_max_distance;
    spec.t5.bidirectional = false;
  }

  // Between the projections: Q/K norms, RoPE and the cache's append for layer l (q, k, v), then attention (-> att).
  // Of the KV heads [h0, h1) and their query heads only (the decode team's threads each prepare their own; every
  // step is per head, so the bits do not depend on the range).
  const auto prepare_attention = [&](int l, int h0, int h1) {
    const LayerWeights& w = m.layers[static_cast<std::size_t>(l)];
    const int group = c.n_heads / c.n_kv_heads, qh = (h1 - h0) * group, kh = h1 - h0;
    if (kh == 0) return;
    const std::size_t q0 = static_cast<std::size_t>(h0) * group * HD, k0 = static_cast<std::size_t>(h0) * HD;
    if (w.q_norm != nullptr) {  // Qwen3: RMSNorm over each head's channels, before RoPE
      if (kh == c.n_kv_heads) {
        detail::rmsnorm(s.q.data(), w.q_norm, N * c.n_heads, HD, c.norm_eps, s.q.data());
        detail::rmsnorm(s.k.data(), w.k_norm, N * c.n_kv_heads, HD, c.norm_eps, s.k.data());
      } else {
        for (int64_t r = 0; r < N; ++r) {
          float* q = s.q.data() + r * Q + q0;
          float* k = s.k.data() + r * KV + k0;
          detail::rmsnorm(q, w.q_norm, qh, HD, c.norm_eps, q);
          detail::rmsnorm(k, w.k_norm, kh, HD, c.norm_eps, k);
        }
      }
    }
    for (std::size_t b = 0; b < B; ++b) {
      const int64_t r0 = offset[b], n = offset[b + 1] - offset[b];
      if (n == 0) continue;
      float* q = s.q.data() + r0 * Q + q0;
      float* k = s.k.data() + r0 * KV + k0;
      if (rope) {
        apply_rope(q, n, qh, HD, tables[b], states[b].layout, RopeDirection::forward, Q);
        apply_rope(k, n, kh, HD, tables[b], states[b].layout, RopeDirection::forward, KV);
      }
      if (mrope) {
        apply_rope(q, n, qh, HD, mtables[b], mstates[b].layout, RopeDirection::forward, Q);
        apply_rope(k, n, kh, HD, mtables[b], mstates[b].layout, RopeDirection::forward, KV);
      }
      for (int64_t i = 0; i < n; ++i)
        cache.write(l, slots[b][static_cast<std::size_t>(i)], s.k.data() + (r0 + i) * KV, s.v.data() + (r0 + i) * KV,
                    h0, h1);
    }
  };
  const auto attend = [&](int l) {
    prepare_attention(l, 0, c.n_kv_heads);
    for (std::size_t b = 0; b < B; ++b) {
      const int64_t r0 = offset[b], n = offset[b + 1] - offset[b];
      if (n == 0) continue;
      s.blocks.clear();
      cache.blocks_as_stored(l, batch[b].seq, s.blocks);  // f16/bf16: attention reads them (decode) or widens them
      attention_forward(spec, s.q.data() + r0 * Q,
                        std::span<const int64_t>(pos).subspan(static_cast<std::size_t>(r0), static_cast<std::size_t>(n)),
                        s.blocks, s.att.data() + r0 * Q);
    }
  };

  // One token (decode) with every projection on a one-row product (matmul_w's AVX-512 or AVX2 one, or matmul_q8's VNNI one
  // under q8_activations), large enough for threads (decode_team_pays): one team of threads for the step instead of
  // a parallel region per projection: layer 0's Q, K and V in a region of their own, layer 0's attention on the
  // calling thread (it validates the attention's arguments), then one region from layer 0's output projection to
  // the classifier, its threads synchronised by barriers. Inside it each thread takes a contiguous range of each
  // matrix's rows and, from layer 1 on, a contiguous range of the KV heads for attention (AttentionOptions'
  // kv_head_begin/end): when the KV heads split evenly its rows of Q, K and V are its heads' rows, and it rotates
  // its Q and K heads and appends its K and V heads itself (no barrier between its projections and
  // its attention); otherwise one thread does that for all heads between two barriers. Each thread normalises
  // (and quantizes) a projection's input itself. Every output row, head and normed input is computed the same way whichever thread
  // computes it and however the work is split (kernels_dense.hpp, kernels.hpp, attention.hpp), so the bits are the
  // same.
  // On the 487M model at two threads (Zen 5; BM_RealDecodeTeam, tokens alternated in one process): a region per
  // layer with attention between them (runs zen5-16..18) gave F16 0.999-1.052x, Q8_0 1.001-1.045x, q8_activations
  // 1.000-1.043x over a region per projection (a region's start and end cost about 1 us each at the host's higher
  // read rate, seven a layer); attention inside the team, against that, 1.002-1.006x at 64 positions and
  // 1.022-1.023x at 2K and 8K positions (an f32 cache); each thread's own norms and quantizations instead of an
  // omp single's (two to four barriers a layer fewer), against that, 1.007-1.016x where the two cores read about
  // 83 GB/s and 0.999-1.007x at about 53; each thread's own heads prepared by itself (4 KV heads on 2 threads),
  // against one thread preparing them all, Q8_0 1.012-1.014x, F16 1.004-1.009x, q8_activations 1.006-1.010x.
  // Not with a 16-bit cache the attention would widen (more than 8 query heads per KV head): each thread of the team
  // would hold a float32 copy of the layer's cache (an adversary measured 194 MB for a 64 MB f16 cache at 4 threads),
  // allocated inside the region, where running out of memory ends the process instead of throwing.
  const bool team_attention_in_place =
      kc.dtype == KvCacheDtype::f32 || detail::reads_16bit_blocks_in_place(c.n_heads / c.n_kv_heads);
  if (N == 1 && team_attention_in_place && decode_team_pays(m)) {
    // Nothing may leave a parallel region by an exception (std::terminate). Each thread runs the work between two
    // barriers through `guarded`: the first exception is kept, every thread skips the work left but still meets
    // every barrier (a thread leaving the region early would pair its end-of-region barrier with the others'
    // explicit ones and hang them), and it is rethrown after the region. Segments count a thread's guarded pieces
    // of work (detail::set_decode_team_fault_for_testing throws std::bad_alloc at one of them).
    detail::FirstException first_exception;
    const int fault_segment = detail::g_decode_team_fault_segment.load(std::memory_order_relaxed);
    const int fault_thread = detail::g_decode_team_fault_thread.load(std::memory_order_relaxed);
    const auto guarded = [&](int& segment, auto&& work) {
      first_exception.run([&] {
        if (segment++ == fault_segment && omp_get_thread_num() == fault_thread) throw std::bad_alloc();
        work();
      });
    };
    const auto rows_of = [](int64_t n, int nt, int me) {
      return std::pair<int64_t, int64_t>{n * me / nt, n * (me + 1) / nt};
    };
    // Every thread normalises a projection's input and quantizes it (when a projection reading it takes
    // q8_activations) into buffers of its own: the same bits on every thread (row-wise arithmetic), where one
    // thread computing them in an omp single had the others wait at its barrier.
    const std::size_t xq_bytes = q8_input_bytes_max(c);
    const auto quantize_for = [&](std::initializer_list<const Linear*> readers, const float* x, int64_t in,
                                  std::byte* xq) {
      for (const Linear* l : readers)
        if (l->q8_activations) {
          detail::quantize_rows_q8_0(x, 1, in, xq);
          return;
        }
    };
    const auto shares = [&](const Linear& l, const float* x, const std::byte* xq, float* y, bool accumulate) {
      const auto [r0, r1] = rows_of(l.out, omp_get_num_threads(), omp_get_thread_num());
      if (l.q8_activations)
        detail::matmul_q8_decode_rows(xq, l.in, l.w.data, l.w.type == detail::WeightType::q4_0, l.out, y,
                                      accumulate, r0, r1);
      else
        detail::matmul_w_decode_rows(x, l.w, y, accumulate, r0, r1);
      if (l.bias != nullptr)
        for (int64_t r = r0; r < r1; ++r) y[r] += l.bias[r];
    };
    // This thread's normed input of a projection (xb) and its Q8_0 quantization (xq).
    struct Own {
      detail::AlignedFloatVector xb;
      std::vector<std::byte> xq;
    };
    const auto own_buffers = [&]() -> Own& {
      thread_local Own own;
      own.xb.resize(static_cast<std::size_t>(D));
      own.xq.resize(xq_bytes);
      return own;
    };
    const auto norm = [&](Own& o, const float* weight, std::initializer_list<const Linear*> readers) {
      detail::rmsnorm(s.x.data(), weight, 1, D, c.norm_eps, o.xb.data());
      quantize_for(readers, o.xb.data(), D, o.xq.data());
    };
    const auto norm_qkv = [&](Own& o, const LayerWeights& w) {
      norm(o, w.rms_att, {&w.wq, &w.wk, &w.wv});
      shares(w.wq, o.xb.data(), o.xq.data(), s.q.data(), false);
      shares(w.wk, o.xb.data(), o.xq.data(), s.k.data(), false);
      shares(w.wv, o.xb.data(), o.xq.data(), s.v.data(), false);
    };
    KvCache::SeqId team_seq = batch[0].seq;  // the sequence with the token (the others of the batch have none)
    std::size_t team_b = 0;
    for (std::size_t i = 0; i < B; ++i)
      if (!batch[i].tokens.empty()) {
        team_seq = batch[i].seq;
        team_b = i;
      }
    const std::span<const int64_t> team_pos(pos.data() + offset[team_b], 1);
    // Each thread's blocks of a layer (block pointers and token counts are the same in every layer: sized here,
    // reused inside the region).
    std::vector<KvBlock> first_blocks;
    cache.blocks_as_stored(0, team_seq, first_blocks);
    // The keys and values of KV heads [h0, h1) of `blocks` towards this thread's L2 (up to `budget` bytes): the
    // weights streamed since they were written evicted them, and attention at a few dozen positions then waited
    // on DRAM latency.
    const auto prefetch_kv = [&](const std::vector<KvBlock>& blocks, int h0, int h1, std::size_t budget) {
      if (h0 == h1) return;
      for (const KvBlock& b : blocks) {
        const bool f32 = b.dtype == KvCacheDtype::f32;
        const std::size_t es = f32 ? 4 : 2;
        const std::size_t row = static_cast<std::size_t>(KV) * es;
        const std::size_t off = static_cast<std::size_t>(h0) * HD * es;
        const std::size_t len = static_cast<std::size_t>(h1 - h0) * HD * es;
        for (int part = 0; part < 2; ++part) {
          const void* p = f32 ? static_cast<const void*>(part == 0 ? b.k : b.v)
                              : static_cast<const void*>(part == 0 ? b.k16 : b.v16);
          if (p == nullptr) continue;
          const auto* c0 = static_cast<const char*>(p) + off;
          for (int64_t j = 0; j < b.n_tokens; ++j, c0 += row) {
            for (std::size_t o = 0; o < len; o += 64) _mm_prefetch(c0 + o, _MM_HINT_T1);
            if (budget <= len) return;
            budget -= len;
          }
        }
      }
    };
    // With the KV heads split evenly between the threads, each thread's rows of Q, K and V (rows_of) are exactly
    // its heads' rows, so it can rotate its Q and K heads, append its K and V heads and attend with no barrier since
    // its projections; otherwise one thread does all of that for all heads after a barrier.
    logits.resize(static_cast<std::size_t>(c.vocab_size));
#pragma omp parallel
    {
      int segment = 0;
      guarded(segment, [&] { norm_qkv(own_buffers(), m.layers.front()); });
    }
    first_exception.rethrow();
    // Layer 0's attention outside the team: it validates the attention's arguments (every later layer's are the
    // same shapes over the same blocks).
    attend(0);
#pragma omp parallel
    {
      int segment = 1;
      const int nt = omp_get_num_threads(), me = omp_get_thread_num();
      const auto [h0, h1] = rows_of(c.n_kv_heads, nt, me);
      AttentionOptions heads;  // this thread's KV heads, on this thread
      heads.num_threads = 1;
      heads.kv_head_begin = static_cast<int>(h0);
      heads.kv_head_end = static_cast<int>(h1);
      Own* o = nullptr;
      const bool own_heads = c.n_kv_heads % nt == 0;
      thread_local std::vector<KvBlock> blocks;
      for (int l = 0; l < c.n_layers; ++l) {
        const LayerWeights& w = m.layers[static_cast<std::size_t>(l)];
        guarded(segment, [&] {
          if (o == nullptr) {
            o = &own_buffers();
            blocks.reserve(first_blocks.size());
          }
          quantize_for({&w.wo}, s.att.data(), Q, o->xq.data());
          shares(w.wo, s.att.data(), o->xq.data(), s.x.data(), true);
        });
#pragma omp barrier
        guarded(segment, [&] {
          norm(*o, w.rms_ffn, {&w.w1, &w.w3});
          shares(w.w1, o->xb.data(), o->xq.data(), s.h1.data(), false);
          shares(w.w3, o->xb.data(), o->xq.data(), s.h3.data(), false);
          // SwiGLU element by element on this thread's rows of both (w1 and w3 have HID rows, split alike).
          const auto [g0, g1] = rows_of(HID, nt, me);
          detail::swiglu_serial(s.h1.data() + g0, s.h3.data() + g0, g1 - g0);
        });
#pragma omp barrier
        guarded(segment, [&] {
          quantize_for({&w.w2}, s.h1.data(), HID, o->xq.data());
          shares(w.w2, s.h1.data(), o->xq.data(), s.x.data(), true);
        });
#pragma omp barrier
        if (l + 1 == c.n_layers) {
          guarded(segment, [&] {
            norm(*o, m.rms_final, {&m.classifier});
            shares(m.classifier, o->xb.data(), o->xq.data(), logits.data(), false);
          });
          break;
        }
        guarded(segment, [&] {
          norm_qkv(*o, m.layers[static_cast<std::size_t>(l) + 1]);
          blocks.clear();
          cache.blocks_as_stored(l + 1, team_seq, blocks);
          prefetch_kv(blocks, heads.kv_head_begin, heads.kv_head_end,
                      (std::size_t{512} << 10) / static_cast<std::size_t>(nt));
          if (own_heads) prepare_attention(l + 1, heads.kv_head_begin, heads.kv_head_end);
        });
        if (!own_heads) {
#pragma omp barrier
#pragma omp single
          guarded(segment, [&] { prepare_attention(l + 1, 0, c.n_kv_heads); });
        }
        // Attention on this thread's KV heads (the same bits as one call over all of them).
        guarded(segment, [&] { attention_forward(spec, s.q.data(), team_pos, blocks, s.att.data(), heads); });
#pragma omp barrier
      }
    }
    first_exception.rethrow();
    detail::g_decode_team_steps.fetch_add(1, std::memory_order_relaxed);
    return;
  }
  for (int l = 0; l < c.n_layers; ++l) {
    const LayerWeights& w = m.layers[static_cast<std::size_t>(l)];
    detail::rmsnorm(s.x.data(), w.rms_att, N, D, c.norm_eps, s.xb.data());
    project(w.wq, s.xb.data(), N, s.q.data(), false, s);
    project(w.wk, s.xb.data(), N, s.k.data(), false, s, true);
    project(w.wv, s.xb.data(), N, s.v.data(), false, s, true);
    attend(l);
    project(w.wo, s.att.data(), N, s.x.data(), true, s);
    detail::rmsnorm(s.x.data(), w.rms_ffn, N, D, c.norm_eps, s.xb.data());
    project(w.w1, s.xb.data(), N, s.h1.data(), false, s);
    if (!project_swiglu(w.w3, s.xb.data(), N, s.h1.data(), s.h3.data(), s)) {
      project(w.w3, s.xb.data(), N, s.h3.data(), false, s, true);
      detail::swiglu(s.h1.data(), s.h3.data(), N * HID);
    }
    project(w.w2, s.h1.data(), N, s.x.data(), true, s);
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
  project(m.classifier, s.xb.data(), rows, logits.data(), false, s);
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

void Model::score_window(std::span<const int32_t> tokens, int64_t chunk_tokens,
                         const std::function<void(int64_t, const float*, int64_t)>& on_chunk) const {
  if (chunk_tokens < 1) fail_field<InvalidArgument>("chunk_tokens", "must be >= 1", chunk_tokens);
  const auto n = static_cast<int64_t>(tokens.size());
  // The position limit for the whole window before any chunk (one forward over it would refuse it whole, naming
  // its last position).
  if (max_position_ >= 0 && n - 1 > max_position_)
    throw past_position_limit(n - 1, max_position_);
  // A length-dependent RoPE recomputes its frequencies in every forward from the length so far: frozen at those
  // forward itself gives a fresh sequence of the whole window's length (the same function, the same policy), the
  // chunks rotate as one forward over the window does.
  const Model* m = this;
  std::optional<Model> frozen;
  if (positional_.family == PositionFamily::rope && positional_.rope.update_with_length &&
      find_rope_scaling(positional_.rope.params.rope_type).depends_on_seq_len && chunk_tokens < n) {
    frozen.emplace(*this);
    frozen->positional_.rope.freqs = length_dependent_state(positional_.rope, n, 0, nullptr, policy_).freqs;
    frozen->positional_.rope.update_with_length = false;
    m = &*frozen;
  }
  KvCache cache = m->make_cache(64);
  const KvCache::SeqId seq = cache.create();
  std::vector<float> logits;
  for (int64_t first = 0; first < n; first += chunk_tokens) {
    const int64_t rows = std::min(chunk_tokens, n - first);
    const SequenceInput in{seq, tokens.subspan(static_cast<std::size_t>(first), static_cast<std::size_t>(rows)), {}};
    m->forward(cache, std::span<const SequenceInput>(&in, 1), LogitsMode::all, logits);
    on_chunk(first, logits.data(), rows);
  }
}

PositionalSpec positional_spec(const Model& model) {
  const ModelConfig& c = model.config();
  const ModelSource& src = model.source();
  const PositionalConfig& pc = model.positional();
  PositionalSpec s;
  s.family = pc.family;
  s.architecture = src.architecture;
  s.source = src.path.string();
  s.num_attention_heads = c.n_heads;
  s.num_key_value_heads = c.n_kv_heads;
  s.hidden_size = c.dim;
  s.num_hidden_layers = c.n_layers;
  s.max_position_embeddings = model.trained_context();
  switch (pc.family) {
    case PositionFamily::rope:
    case PositionFamily::mrope:
      s.rope = pc.rope.params;
      s.layout = model.stored_layout();
      if (pc.family == PositionFamily::mrope) {
        s.mrope_section = pc.mrope_section;
        s.mrope_interleaved = pc.mrope_mapping == MropeMapping::interleaved;
      }
      break;
    case PositionFamily::alibi: {
      AlibiSpec a;
      a.max_bias = pc.alibi_max_bias;
      s.alibi = a;
      break;
    }
    case PositionFamily::t5_bias: {
      T5BiasSpec t;
      t.relative_attention_num_buckets = pc.t5_num_buckets;
      t.relative_attention_max_distance = pc.t5_max_distance;
      t.is_encoder_decoder = false;  // the runtime's models are decoder-only: causal buckets
      s.t5 = t;
      break;
    }
    case PositionFamily::sinusoidal: s.sinusoidal_layout = SinusoidalLayout::interleaved; break;
    case PositionFamily::learned_absolute:
    case PositionFamily::nope: break;
  }
  if (model.sliding_window() > 0) {
    s.sliding_window.size = model.sliding_window();
    s.sliding_window.active = true;
    s.sliding_window.source = "the model's sliding window";
  } else {
    s.sliding_window.source = "no sliding_window";  // as the config parser says it for a config.json without one
  }
  if (!src.layout_reason.empty()) s.notes.push_back("layout: " + src.layout_reason);
  if (!model.trained_context_source().empty())
    s.notes.push_back("max_position_embeddings: " + model.trained_context_source());
  for (const std::string& n : src.notes) s.notes.push_back(n);
  return s;
}

}  // namespace posenc
