// The posenc checkpoint format (see include/posenc/checkpoint.hpp): writer and reader.
#include "posenc/checkpoint.hpp"

#include <cmath>
#include <cstring>
#include <fstream>
#include <map>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "model/raw_model.hpp"
#include "posenc/error.hpp"
#include "posenc/io.hpp"
#include "posenc/mrope.hpp"
#include "posenc/scaling.hpp"

namespace posenc {

namespace {

constexpr char kMagic[8] = {'P', 'O', 'S', 'E', 'N', 'C', '0', '1'};
constexpr uint64_t kAlign = 64;

uint64_t align_up_64(uint64_t x) { return (x + kAlign - 1) / kAlign * kAlign; }

using Shapes = std::vector<std::pair<std::string, std::vector<int64_t>>>;

/// The tensors a model with this config and positional encoding must have.
Shapes expected_tensors(const ModelConfig& c, const PositionalConfig& pc, int64_t pos_rows) {
  const int64_t D = c.dim, H = c.hidden_dim, V = c.vocab_size, KV = c.kv_dim();
  Shapes s{{"tok_embeddings", {V, D}}};
  for (int l = 0; l < c.n_layers; ++l) {
    const std::string p = fmt::format("layers.{}.", l);
    s.push_back({p + "attention_norm", {D}});
    s.push_back({p + "wq", {D, D}});
    s.push_back({p + "wk", {KV, D}});
    s.push_back({p + "wv", {KV, D}});
    s.push_back({p + "wo", {D, D}});
    s.push_back({p + "ffn_norm", {D}});
    s.push_back({p + "w1", {H, D}});
    s.push_back({p + "w2", {D, H}});
    s.push_back({p + "w3", {H, D}});
  }
  s.push_back({"norm", {D}});
  if (!c.shared_classifier) s.push_back({"output", {V, D}});
  if (pc.family == PositionFamily::learned_absolute) s.push_back({"pos_embeddings", {pos_rows, D}});
  if (pc.family == PositionFamily::t5_bias)
    s.push_back({"t5_relative_attention_bias", {pc.t5_num_buckets, c.n_heads}});
  return s;
}

nlohmann::json positional_json(const PositionalConfig& pc) {
  nlohmann::json j{{"family", std::string(to_string(pc.family))}};
  switch (pc.family) {
    case PositionFamily::rope:
    case PositionFamily::mrope:
      j["rope_theta"] = pc.rope.params.rope_theta;
      j["rotary_dim"] = pc.rope.freqs.rotary_dim;
      j["layout"] = std::string(to_string(pc.rope.layout));
      j["angle_precision"] = std::string(to_string(pc.rope.precision));
      if (pc.family == PositionFamily::mrope) {
        j["mrope_section"] = pc.mrope_section;
        j["mrope_mapping"] = std::string(to_string(pc.mrope_mapping));
      }
      break;
    case PositionFamily::alibi: j["max_bias"] = pc.alibi_max_bias; break;
    case PositionFamily::t5_bias:
      j["relative_attention_num_buckets"] = pc.t5_num_buckets;
      j["relative_attention_max_distance"] = pc.t5_max_distance;
      break;
    case PositionFamily::sinusoidal: j["base"] = pc.sinusoidal_base; break;
    default: break;
  }
  return j;
}

// ---- typed JSON access with field-naming errors ----
struct CheckpointReader {
  std::string file;
  const nlohmann::json& at(const nlohmann::json& obj, const std::string& key, const std::string& path) const {
    if (!obj.is_object() || !obj.contains(key))
      throw CheckpointError(fmt::format("{}: header field {} is missing", file, path));
    return obj.at(key);
  }
  int64_t integer(const nlohmann::json& obj, const std::string& key, const std::string& path, int64_t lo,
                  int64_t hi) const {
    const auto& v = at(obj, key, path);
    if (!v.is_number_integer())
      throw CheckpointError(fmt::format("{}: header field {} must be an integer (got {})", file, path, v.dump()));
    const int64_t x = v.get<int64_t>();
    if (x < lo || x > hi)
      throw CheckpointError(fmt::format("{}: header field {} must be in [{}, {}] (got {})", file, path, lo, hi, x));
    return x;
  }
  double number(const nlohmann::json& obj, const std::string& key, const std::string& path) const {
    const auto& v = at(obj, key, path);
    if (!v.is_number())
      throw CheckpointError(fmt::format("{}: header field {} must be a number (got {})", file, path, v.dump()));
    const double x = v.get<double>();
    if (!std::isfinite(x) || x <= 0)
      throw CheckpointError(fmt::format("{}: header field {} must be finite and > 0 (got {})", file, path, x));
    return x;
  }
  std::string string(const nlohmann::json& obj, const std::string& key, const std::string& path) const {
    const auto& v = at(obj, key, path);
    if (!v.is_string())
      throw CheckpointError(fmt::format("{}: header field {} must be a string (got {})", file, path, v.dump()));
    return v.get<std::string>();
  }
};

/// positional.mrope_section (3 non-negative integers summing to rotary_dim/2)
/// and positional.mrope_mapping ("chunked" | "interleaved", default chunked).
void read_mrope_fields(const CheckpointReader& R, const nlohmann::json& jp, int rotary_dim, PositionalConfig& pc) {
  const auto& ms = R.at(jp, "mrope_section", "positional.mrope_section");
  if (!ms.is_array() || ms.size() != 3)
    throw CheckpointError(fmt::format("{}: header field positional.mrope_section must be a list of 3 integers (got {})",
                                      R.file, ms.dump()));
  pc.mrope_section.clear();
  for (std::size_t i = 0; i < 3; ++i) {
    const std::string key = std::to_string(i);
    nlohmann::json holder = {{key, ms[i]}};
    pc.mrope_section.push_back(static_cast<int>(
        R.integer(holder, key, fmt::format("positional.mrope_section[{}]", i), 0, rotary_dim / 2)));
  }
  pc.mrope_mapping = jp.contains("mrope_mapping")
                         ? parse_mrope_mapping(R.string(jp, "mrope_mapping", "positional.mrope_mapping"),
                                               R.file + ": positional.mrope_mapping")
                         : MropeMapping::chunked;
  try {
    (void)mrope_pair_rows(pc.mrope_section, rotary_dim / 2, pc.mrope_mapping);
  } catch (const ConfigError& e) {
    throw CheckpointError(fmt::format("{}: header field positional.{}", R.file, e.what()));
  }
}

}  // namespace

bool is_posenc_checkpoint(const std::filesystem::path& path) {
  const std::string m = read_file_prefix(path, 8);
  return m.size() == 8 && std::memcmp(m.data(), kMagic, 8) == 0;
}

void save_posenc_checkpoint(const std::filesystem::path& path, const PosencCheckpoint& ck) {
  ModelConfig c = ck.config;
  if (c.n_heads <= 0 || c.dim % c.n_heads != 0)
    throw InvalidArgument(fmt::format("config.dim {} must be a positive multiple of n_heads {}", c.dim, c.n_heads));
  c.head_dim = c.dim / c.n_heads;
  if (ck.positional.family == PositionFamily::mrope) {
    try {
      (void)mrope_pair_rows(ck.positional.mrope_section, ck.positional.rope.freqs.rotary_dim / 2,
                            ck.positional.mrope_mapping);
    } catch (const ConfigError& e) {
      throw InvalidArgument(fmt::format("positional.{}", e.what()));
    }
  }
  int64_t pos_rows = 0;
  std::map<std::string, const CheckpointTensor*> by_name;
  for (const auto& t : ck.tensors) {
    int64_t n = 1;
    for (int64_t d : t.shape) {
      if (d <= 0) throw InvalidArgument(fmt::format("tensor {}: dimensions must be positive", t.name));
      n *= d;
    }
    if (static_cast<int64_t>(t.data.size()) != n)
      throw InvalidArgument(fmt::format("tensor {}: shape holds {} values, data has {}", t.name, n, t.data.size()));
    if (!by_name.emplace(t.name, &t).second) throw InvalidArgument(fmt::format("tensor {}: listed twice", t.name));
    if (t.name == "pos_embeddings" && !t.shape.empty()) pos_rows = t.shape[0];
  }
  for (const auto& [name, shape] : expected_tensors(c, ck.positional, pos_rows)) {
    auto it = by_name.find(name);
    if (it == by_name.end()) throw InvalidArgument(fmt::format("tensor {}: required but missing", name));
    if (it->second->shape != shape)
      throw InvalidArgument(fmt::format("tensor {}: shape [{}] expected [{}]", name, fmt::join(it->second->shape, ", "),
                                        fmt::join(shape, ", ")));
  }
  if (!ck.symbols.empty() && static_cast<int>(ck.symbols.size()) != c.vocab_size)
    throw InvalidArgument(fmt::format("symbols: {} entries for vocab_size {}", ck.symbols.size(), c.vocab_size));
  nlohmann::json meta = nlohmann::json::parse(ck.metadata_json, nullptr, false);
  if (!meta.is_object()) throw InvalidArgument("metadata_json: must be a JSON object");

  nlohmann::json h;
  h["format"] = "posenc-checkpoint";
  h["version"] = 1;
  h["config"] = {{"dim", c.dim},
                 {"hidden_dim", c.hidden_dim},
                 {"n_layers", c.n_layers},
                 {"n_heads", c.n_heads},
                 {"n_kv_heads", c.n_kv_heads},
                 {"vocab_size", c.vocab_size},
                 {"max_position_embeddings", c.max_position_embeddings},
                 {"norm_eps", c.norm_eps},
                 {"shared_classifier", c.shared_classifier}};
  h["positional"] = positional_json(ck.positional);
  if (!ck.symbols.empty()) h["symbols"] = ck.symbols;
  h["metadata"] = meta;
  h["tensors"] = nlohmann::json::array();
  uint64_t off = 0;
  for (const auto& t : ck.tensors) {
    h["tensors"].push_back({{"name", t.name}, {"shape", t.shape}, {"offset", off}});
    off = align_up_64(off + 4 * t.data.size());
  }
  const std::string header = h.dump();
  const uint64_t data_start = align_up_64(16 + header.size());
  std::string out(data_start + off, '\0');
  std::memcpy(out.data(), kMagic, 8);
  const uint64_t hl = header.size();
  std::memcpy(out.data() + 8, &hl, 8);
  std::memcpy(out.data() + 16, header.data(), header.size());
  off = 0;
  for (const auto& t : ck.tensors) {
    std::memcpy(out.data() + data_start + off, t.data.data(), 4 * t.data.size());
    off = align_up_64(off + 4 * t.data.size());
  }
  write_file_atomic(path, out);
}

namespace detail {

RawModel read_posenc(const std::filesystem::path& path) {
  RawModel raw;
  raw.files.emplace_back(path);
  const std::string name = path.string();
  const CheckpointReader R{name};
  const auto bytes = raw.files.back().bytes();
  if (bytes.size() < 16 || std::memcmp(bytes.data(), kMagic, 8) != 0)
    throw CheckpointError(fmt::format("{}: not a posenc checkpoint (magic POSENC01 missing or file too short)", name));
  uint64_t hl = 0;
  std::memcpy(&hl, bytes.data() + 8, 8);
  if (hl > bytes.size() - 16)
    throw CheckpointError(fmt::format("{}: truncated: header length {} exceeds the file ({} bytes)", name, hl, bytes.size()));
  nlohmann::json h;
  try {
    h = nlohmann::json::parse(std::string_view(reinterpret_cast<const char*>(bytes.data() + 16), hl));
  } catch (const nlohmann::json::exception& e) {
    throw CheckpointError(fmt::format("{}: malformed JSON header: {}", name, e.what()));
  }
  // (json::value() would throw type_error for a non-string "format": compare as JSON instead.)
  if (!h.is_object() || !h.contains("format") || h["format"] != "posenc-checkpoint")
    throw CheckpointError(fmt::format("{}: header field format must be \"posenc-checkpoint\"", name));
  if (R.integer(h, "version", "version", 1, 1000) != 1)
    throw CheckpointError(fmt::format("{}: unsupported version {} (this build reads version 1)", name, h["version"].dump()));

  const auto& jc = R.at(h, "config", "config");
  ModelConfig& c = raw.cfg;
  c.dim = static_cast<int>(R.integer(jc, "dim", "config.dim", 1, 1 << 16));
  c.hidden_dim = static_cast<int>(R.integer(jc, "hidden_dim", "config.hidden_dim", 1, 1 << 18));
  c.n_layers = static_cast<int>(R.integer(jc, "n_layers", "config.n_layers", 1, 1 << 10));
  c.n_heads = static_cast<int>(R.integer(jc, "n_heads", "config.n_heads", 1, 1 << 10));
  c.n_kv_heads = static_cast<int>(R.integer(jc, "n_kv_heads", "config.n_kv_heads", 1, 1 << 10));
  c.vocab_size = static_cast<int>(R.integer(jc, "vocab_size", "config.vocab_size", 4, 1 << 22));
  c.max_position_embeddings = R.integer(jc, "max_position_embeddings", "config.max_position_embeddings", 1, 1 << 24);
  const double norm_eps = R.number(jc, "norm_eps", "config.norm_eps");  // finite and > 0, named with its value
  c.norm_eps = static_cast<float>(norm_eps);
  if (!(std::isfinite(c.norm_eps) && c.norm_eps > 0))  // outside float32's range: 0 or inf in the model's arithmetic
    throw CheckpointError(fmt::format("{}: header field config.norm_eps must be finite and > 0 in float32 (got {:g})", name,
                                      norm_eps));
  const auto& sc = R.at(jc, "shared_classifier", "config.shared_classifier");
  if (!sc.is_boolean())
    throw CheckpointError(fmt::format("{}: header field config.shared_classifier must be a boolean (got {})", name, sc.dump()));
  c.shared_classifier = sc.get<bool>();
  validate_config(name, c);

  const auto& jp = R.at(h, "positional", "positional");
  PositionalConfig& pc = raw.positional;
  pc.family = parse_position_family(R.string(jp, "family", "positional.family"), name + ": positional.family");
  switch (pc.family) {
    case PositionFamily::rope:
    case PositionFamily::mrope: {
      RopeParams rp;
      rp.rope_type = "default";
      rp.rope_theta = R.number(jp, "rope_theta", "positional.rope_theta");
      rp.head_dim = c.head_dim;
      rp.rotary_dim = static_cast<int>(R.integer(jp, "rotary_dim", "positional.rotary_dim", 2, c.head_dim));
      if (rp.rotary_dim % 2 != 0)
        throw CheckpointError(fmt::format("{}: header field positional.rotary_dim must be even (got {})", name, rp.rotary_dim));
      rp.max_position_embeddings = c.max_position_embeddings;
      rp.original_max_position_embeddings = c.max_position_embeddings;
      pc.rope.params = rp;
      pc.rope.freqs = compute_rope_frequencies(rp);
      pc.rope.layout = parse_rope_layout(R.string(jp, "layout", "positional.layout"), name + ": positional.layout");
      pc.rope.precision = jp.contains("angle_precision")
                              ? parse_angle_precision(R.string(jp, "angle_precision", "positional.angle_precision"),
                                                      name + ": positional.angle_precision")
                              : AnglePrecision::float32;
      if (pc.family == PositionFamily::mrope) read_mrope_fields(R, jp, rp.rotary_dim, pc);
      break;
    }
    case PositionFamily::alibi: pc.alibi_max_bias = R.number(jp, "max_bias", "positional.max_bias"); break;
    case PositionFamily::t5_bias:
      pc.t5_num_buckets = static_cast<int>(R.integer(jp, "relative_attention_num_buckets",
                                                     "positional.relative_attention_num_buckets", 2, 1 << 16));
      pc.t5_max_distance = static_cast<int>(R.integer(jp, "relative_attention_max_distance",
                                                      "positional.relative_attention_max_distance",
                                                      pc.t5_num_buckets / 2 + 1, 1 << 24));
      break;
    case PositionFamily::sinusoidal: pc.sinusoidal_base = R.number(jp, "base", "positional.base"); break;
    default: break;
  }

  if (h.contains("symbols")) {
    const auto& js = h["symbols"];
    if (!js.is_array()) throw CheckpointError(fmt::format("{}: header field symbols must be an array", name));
    for (const auto& s : js) {
      if (!s.is_string()) throw CheckpointError(fmt::format("{}: header field symbols must hold strings (got {})", name, s.dump()));
      raw.symbols.push_back(s.get<std::string>());
    }
    if (static_cast<int>(raw.symbols.size()) != c.vocab_size)
      throw CheckpointError(fmt::format("{}: symbols has {} entries, config.vocab_size is {}", name, raw.symbols.size(), c.vocab_size));
  }
  if (h.contains("metadata")) raw.metadata_json = h["metadata"].dump();

  const uint64_t data_start = align_up_64(16 + hl);
  if (data_start > bytes.size())
    throw CheckpointError(fmt::format("{}: truncated before the data section (byte {})", name, data_start));
  const uint64_t data_size = bytes.size() - data_start;
  std::map<std::string, std::pair<std::vector<int64_t>, const float*>> tensors;
  const auto& jt = R.at(h, "tensors", "tensors");
  if (!jt.is_array()) throw CheckpointError(fmt::format("{}: header field tensors must be an array", name));
  for (std::size_t i = 0; i < jt.size(); ++i) {
    const std::string path_i = fmt::format("tensors[{}]", i);
    const std::string tname = R.string(jt[i], "name", path_i + ".name");
    const auto& shape_j = R.at(jt[i], "shape", path_i + ".shape");
    std::vector<int64_t> shape;
    uint64_t n = 1;
    if (!shape_j.is_array()) throw CheckpointError(fmt::format("{}: {}.shape must be an array", name, path_i));
    for (const auto& d : shape_j) {
      if (!d.is_number_integer() || d.get<int64_t>() <= 0 || d.get<int64_t>() > (int64_t{1} << 32))
        throw CheckpointError(fmt::format("{}: {}.shape has a bad dimension {}", name, path_i, d.dump()));
      shape.push_back(d.get<int64_t>());
      n *= static_cast<uint64_t>(d.get<int64_t>());
    }
    const auto off = static_cast<uint64_t>(R.integer(jt[i], "offset", path_i + ".offset", 0, INT64_MAX));
    if (off % kAlign != 0)
      throw CheckpointError(fmt::format("{}: tensor {} offset {} is not {}-byte aligned", name, tname, off, kAlign));
    if (n > data_size / 4 || off > data_size - 4 * n)
      throw CheckpointError(fmt::format("{}: truncated: tensor {} needs bytes [{}, {}) of a {}-byte data section", name,
                                        tname, off, off + 4 * n, data_size));
    const float* p = reinterpret_cast<const float*>(bytes.data() + data_start + off);
    check_finite(name, tname, p, n);
    if (!tensors.emplace(tname, std::make_pair(shape, p)).second)
      throw CheckpointError(fmt::format("{}: tensor {} listed twice", name, tname));
  }
  if (pc.family == PositionFamily::learned_absolute) {
    auto it = tensors.find("pos_embeddings");
    raw.pos_rows = it != tensors.end() && !it->second.first.empty() ? it->second.first[0] : 0;
  }
  for (const auto& [tname, shape] : expected_tensors(c, pc, raw.pos_rows)) {
    auto it = tensors.find(tname);
    if (it == tensors.end()) throw CheckpointError(fmt::format("{}: tensor {} is missing", name, tname));
    if (it->second.first != shape)
      throw CheckpointError(fmt::format("{}: tensor {} has shape [{}], the config implies [{}]", name, tname,
                                        fmt::join(it->second.first, ", "), fmt::join(shape, ", ")));
  }
  auto get = [&](const std::string& n) { return tensors.at(n).second; };
  auto mat = [&](const std::string& n) {
    const auto& t = tensors.at(n);
    return f32_matrix(t.second, t.first[0], t.first[1], n);
  };
  raw.tok_embeddings = mat("tok_embeddings");
  raw.norm = get("norm");
  raw.output = c.shared_classifier ? raw.tok_embeddings : mat("output");
  for (int l = 0; l < c.n_layers; ++l) {
    const std::string p = fmt::format("layers.{}.", l);
    RawLayer r;
    r.attention_norm = get(p + "attention_norm");
    r.wq = mat(p + "wq");
    r.wk = mat(p + "wk");
    r.wv = mat(p + "wv");
    r.wo = mat(p + "wo");
    r.ffn_norm = get(p + "ffn_norm");
    r.w1 = mat(p + "w1");
    r.w2 = mat(p + "w2");
    r.w3 = mat(p + "w3");
    raw.layers.push_back(std::move(r));
  }
  if (pc.family == PositionFamily::learned_absolute) raw.pos_embeddings = get("pos_embeddings");
  if (pc.family == PositionFamily::t5_bias) raw.t5_bias = get("t5_relative_attention_bias");
  raw.source.format = ModelFormat::posenc;
  raw.source.path = path;
  raw.source.architecture = "posenc";
  raw.source.weights = "F32";
  if (pc.family == PositionFamily::rope || pc.family == PositionFamily::mrope)
    raw.source.layout_reason = fmt::format("{}: stated in the checkpoint header (positional.layout)",
                                           to_string(pc.rope.layout));
  raw.source.trained_context_source = "posenc header config.max_position_embeddings";
  if (!raw.symbols.empty()) raw.source.tokenizer = "embedded symbol vocabulary";
  return raw;
}

}  // namespace detail
}  // namespace posenc
