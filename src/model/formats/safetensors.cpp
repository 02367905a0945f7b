// safetensors reader and sharded checkpoints (see include/posenc/safetensors.hpp).
//
// Checks follow huggingface/safetensors (safetensors/src/tensor.rs): the header
// length is at most 100'000'000 bytes, the header is a JSON object whose
// entries are {"dtype", "shape", "data_offsets"} or "__metadata__" (str ->
// str), and every tensor's byte size is product(shape) * dtype size. Unlike
// the reference reader, gaps between tensors and trailing bytes after the
// last one are accepted (no writer needs them, but nothing is ambiguous
// about them); overlapping ranges are refused.
#include "posenc/safetensors.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <bit>
#include <cstring>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>

#include "core/text.hpp"
#include "posenc/error.hpp"

namespace posenc {

using detail::escaped;

static_assert(std::endian::native == std::endian::little, "safetensors data is little-endian; so must the host be");

using json = nlohmann::json;

namespace {

/// huggingface/safetensors MAX_HEADER_SIZE.
constexpr uint64_t kMaxHeaderBytes = 100'000'000;

struct DtypeInfo {
  SafetensorsDtype dtype;
  std::string_view name;
  int size;
};
constexpr DtypeInfo kDtypes[] = {
    {SafetensorsDtype::F64, "F64", 8},         {SafetensorsDtype::F32, "F32", 4},
    {SafetensorsDtype::F16, "F16", 2},         {SafetensorsDtype::BF16, "BF16", 2},
    {SafetensorsDtype::I64, "I64", 8},         {SafetensorsDtype::I32, "I32", 4},
    {SafetensorsDtype::I16, "I16", 2},         {SafetensorsDtype::I8, "I8", 1},
    {SafetensorsDtype::U8, "U8", 1},           {SafetensorsDtype::BOOL, "BOOL", 1},
    {SafetensorsDtype::F8_E4M3, "F8_E4M3", 1}, {SafetensorsDtype::F8_E5M2, "F8_E5M2", 1},
};

const DtypeInfo& info(SafetensorsDtype d) {
  for (const auto& i : kDtypes)
    if (i.dtype == d) return i;
  throw InvalidArgument(fmt::format("dtype: not a SafetensorsDtype (got {})", static_cast<int>(d)));
}

std::string known_dtypes() {
  std::vector<std::string_view> names;
  for (const auto& i : kDtypes) names.push_back(i.name);
  return fmt::format("{}", fmt::join(names, ", "));
}

/// A JSON value for a message: scalars and flat short arrays in full, other
/// containers by their size (dump() recurses, and a fuzzed header can nest deeply).
std::string show(const json& v) {
  std::string s;
  if (v.is_object()) return fmt::format("an object with {} keys", v.size());
  if (v.is_array()) {
    const bool flat =
        v.size() <= 16 && std::none_of(v.begin(), v.end(), [](const json& e) { return e.is_structured(); });
    if (!flat) return fmt::format("an array of {} elements", v.size());
  }
  s = v.dump(-1, ' ', false, json::error_handler_t::replace);
  if (s.size() > 120) s = s.substr(0, 117) + "...";
  return s;
}

/// Parses JSON text, refusing a key that appears twice in one object
/// (nlohmann::json keeps the last silently; a checkpoint must not be
/// ambiguous). On a duplicate, `duplicate` gets the object keys leading to it,
/// the duplicated key last. Throws json::exception for malformed text.
json parse_unique_keys(std::string_view text, std::vector<std::string>& duplicate) {
  struct Level {
    std::set<std::string, std::less<>> keys;
    std::string last;
  };
  std::vector<Level> stack;
  duplicate.clear();
  auto callback = [&](int /*depth*/, json::parse_event_t event, json& parsed) {
    switch (event) {
      case json::parse_event_t::object_start: stack.emplace_back(); break;
      case json::parse_event_t::object_end:
        if (!stack.empty()) stack.pop_back();
        break;
      case json::parse_event_t::key:
        if (!stack.empty()) {
          const auto& k = parsed.get_ref<const std::string&>();
          if (!stack.back().keys.insert(k).second && duplicate.empty()) {
            for (std::size_t i = 0; i + 1 < stack.size(); ++i) duplicate.push_back(stack[i].last);
            duplicate.push_back(k);
          }
          stack.back().last = k;
        }
        break;
      default: break;
    }
    return true;
  };
  return json::parse(text.begin(), text.end(), callback, /*allow_exceptions=*/true, /*ignore_comments=*/false);
}

bool dimension(const json& v, uint64_t& out) {
  if (!v.is_number_unsigned()) return false;  // negative integers parse as number_integer, 1.0 as float
  out = v.get<uint64_t>();
  return true;
}

}  // namespace

std::string_view to_string(SafetensorsDtype dtype) { return info(dtype).name; }
int safetensors_dtype_size(SafetensorsDtype dtype) { return info(dtype).size; }

int64_t SafetensorsTensor::n_elements() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

// ---- SafetensorsFile --------------------------------------------------------

SafetensorsFile SafetensorsFile::open(const std::filesystem::path& path) {
  MappedFile mapped(path);
  SafetensorsFile f = parse(mapped.bytes(), path.string());
  f.file_ = std::move(mapped);  // the mapping's address does not change with the move
  return f;
}

SafetensorsFile SafetensorsFile::parse(std::span<const std::byte> bytes, std::string_view source) {
  SafetensorsFile f;
  f.bytes_ = bytes;
  f.source_ = std::string(source);
  const std::string& src = f.source_;
  if (bytes.size() < 8)
    throw CheckpointError(
        fmt::format("{}: {} bytes: too short for the 8-byte safetensors header length", src, bytes.size()));
  uint64_t n = 0;
  std::memcpy(&n, bytes.data(), 8);
  if (n > kMaxHeaderBytes)
    throw CheckpointError(
        fmt::format("{}: header length {} exceeds the safetensors limit of {} bytes", src, n, kMaxHeaderBytes));
  if (n > bytes.size() - 8)
    throw CheckpointError(
        fmt::format("{}: header length {} runs past the end of the file ({} bytes)", src, n, bytes.size()));
  const std::string_view text(reinterpret_cast<const char*>(bytes.data() + 8), static_cast<std::size_t>(n));
  json h;
  std::vector<std::string> dup;
  try {
    h = parse_unique_keys(text, dup);
  } catch (const json::parse_error& e) {
    throw CheckpointError(
        fmt::format("{}: header is not valid JSON (byte {} of the header): {}", src, e.byte, e.what()));
  } catch (const json::exception& e) {  // e.g. out_of_range 406: a number like 1e999
    throw CheckpointError(fmt::format("{}: unusable JSON value in the header: {}", src, e.what()));
  }
  if (!dup.empty()) {
    if (dup.size() == 1)
      throw CheckpointError(fmt::format("{}: tensor {} is listed twice in the header", src, escaped(dup[0])));
    throw CheckpointError(
        fmt::format("{}: {}: key {} appears twice", src, fmt::join(dup.begin(), dup.end() - 1, "."),
                    escaped(dup.back())));
  }
  if (!h.is_object()) throw CheckpointError(fmt::format("{}: header must be a JSON object (got {})", src, show(h)));

  f.data_start_ = 8 + n;
  const uint64_t data_size = bytes.size() - f.data_start_;
  for (auto item = h.begin(); item != h.end(); ++item) {
    const std::string& name = item.key();  // not a structured binding: clang 14 cannot capture those
    const json& entry = item.value();
    if (name == "__metadata__") {
      if (!entry.is_object())
        throw CheckpointError(fmt::format("{}: __metadata__ must be an object of strings (got {})", src, show(entry)));
      for (const auto& [k, v] : entry.items()) {
        if (!v.is_string())
          throw CheckpointError(fmt::format("{}: __metadata__.{} must be a string (got {})", src, escaped(k), show(v)));
        f.metadata_.emplace(k, v.get<std::string>());
      }
      continue;
    }
    auto fail = [&](const std::string& what) {
      throw CheckpointError(fmt::format("{}: tensor {}: {}", src, escaped(name), what));
    };
    if (!entry.is_object())
      fail(fmt::format("entry must be an object with dtype, shape and data_offsets (got {})", show(entry)));
    auto field = [&](const char* key) -> const json& {
      auto it = entry.find(key);
      if (it == entry.end()) fail(fmt::format("field {} is missing", key));
      return *it;
    };
    SafetensorsTensor t;
    t.name = name;

    const json& jd = field("dtype");
    if (!jd.is_string()) fail(fmt::format("field dtype must be a string (got {})", show(jd)));
    const auto& ds = jd.get_ref<const std::string&>();
    const DtypeInfo* di = nullptr;
    for (const auto& i : kDtypes)
      if (i.name == ds) di = &i;
    if (di == nullptr) fail(fmt::format("unknown dtype {} (known: {})", show(jd), known_dtypes()));
    t.dtype = di->dtype;

    const json& js = field("shape");
    if (!js.is_array()) fail(fmt::format("field shape must be an array of non-negative integers (got {})", show(js)));
    uint64_t count = 1;
    bool overflow = false;
    for (std::size_t i = 0; i < js.size(); ++i) {
      uint64_t d = 0;
      if (!dimension(js[i], d)) fail(fmt::format("shape[{}] must be a non-negative integer (got {})", i, show(js[i])));
      overflow = overflow || __builtin_mul_overflow(count, d, &count);
      t.shape.push_back(static_cast<int64_t>(d));  // checked below: the product, hence d, fits in int64
    }
    uint64_t nbytes = 0;
    if (overflow || count > static_cast<uint64_t>(INT64_MAX) ||
        __builtin_mul_overflow(count, static_cast<uint64_t>(di->size), &nbytes))
      fail(fmt::format("shape {} of dtype {} holds more elements than 64-bit sizes can count", show(js), ds));

    const json& jo = field("data_offsets");
    if (!jo.is_array() || jo.size() != 2 || !dimension(jo[0], t.begin) || !dimension(jo[1], t.end))
      fail(fmt::format("field data_offsets must be [begin, end], two non-negative integers (got {})", show(jo)));
    if (t.begin > t.end) fail(fmt::format("data_offsets [{}, {}]: begin is after end", t.begin, t.end));
    if (t.end > data_size)
      fail(fmt::format("data_offsets [{}, {}] run past the end of the {}-byte data section (file {} bytes, header {})",
                       t.begin, t.end, data_size, bytes.size(), n));
    if (t.end - t.begin != nbytes)
      fail(fmt::format("data_offsets [{}, {}] hold {} bytes, but dtype {} ({} bytes) with shape {} needs {}", t.begin,
                       t.end, t.end - t.begin, ds, di->size, show(js), nbytes));
    f.tensors_.push_back(std::move(t));
  }
  std::sort(f.tensors_.begin(), f.tensors_.end(), [](const auto& a, const auto& b) { return a.name < b.name; });

  // Overlaps: in order of begin, each non-empty range must start at or after every earlier range's end.
  std::vector<const SafetensorsTensor*> by_offset;
  for (const auto& t : f.tensors_)
    if (t.end > t.begin) by_offset.push_back(&t);
  std::sort(by_offset.begin(), by_offset.end(),
            [](const auto* a, const auto* b) { return a->begin != b->begin ? a->begin < b->begin : a->end < b->end; });
  const SafetensorsTensor* reach = nullptr;  // the earlier range that ends last
  for (const auto* t : by_offset) {
    if (reach != nullptr && t->begin < reach->end)
      throw CheckpointError(fmt::format("{}: tensor {}: data_offsets [{}, {}] overlap tensor {}'s [{}, {}]", src,
                                        escaped(t->name), t->begin, t->end, escaped(reach->name), reach->begin,
                                        reach->end));
    if (reach == nullptr || t->end > reach->end) reach = t;
  }
  return f;
}

const SafetensorsTensor* SafetensorsFile::find(std::string_view name) const {
  auto it = std::lower_bound(tensors_.begin(), tensors_.end(), name,
                             [](const SafetensorsTensor& t, std::string_view n) { return t.name < n; });
  return it != tensors_.end() && it->name == name ? &*it : nullptr;
}

std::span<const std::byte> SafetensorsFile::data(const SafetensorsTensor& t) const {
  const uint64_t data_size = bytes_.size() - data_start_;
  if (t.begin > t.end || t.end > data_size)
    throw InvalidArgument(fmt::format("tensor {}: byte range [{}, {}] is not in {} (data section {} bytes)",
                                      escaped(t.name), t.begin, t.end, source_, data_size));
  return bytes_.subspan(static_cast<std::size_t>(data_start_ + t.begin), static_cast<std::size_t>(t.end - t.begin));
}

std::vector<float> SafetensorsFile::to_float32(const SafetensorsTensor& t) const {
  const auto bytes = data(t);
  const int size = safetensors_dtype_size(t.dtype);
  if (t.dtype != SafetensorsDtype::F32 && t.dtype != SafetensorsDtype::F16 && t.dtype != SafetensorsDtype::BF16)
    throw CheckpointError(
        fmt::format("{}: tensor {}: dtype {} cannot be converted to float32 (supported: F32, F16, BF16)", source_,
                    escaped(t.name), to_string(t.dtype)));
  const std::size_t n = bytes.size() / static_cast<std::size_t>(size);
  if (static_cast<uint64_t>(t.n_elements()) != n)
    throw InvalidArgument(fmt::format("tensor {}: shape [{}] does not match its {} bytes in {}", escaped(t.name),
                                      fmt::join(t.shape, ", "), bytes.size(), source_));
  std::vector<float> out(n);
  if (t.dtype == SafetensorsDtype::F32) {
    if (n > 0) std::memcpy(out.data(), bytes.data(), 4 * n);  // the data need not be 4-byte aligned
    return out;
  }
  float (*convert)(uint16_t) = t.dtype == SafetensorsDtype::F16 ? f16_to_f32 : bf16_to_f32;
  for (std::size_t i = 0; i < n; ++i) {
    uint16_t h;
    std::memcpy(&h, bytes.data() + 2 * i, 2);
    out[i] = convert(h);
  }
  return out;
}

// ---- SafetensorsCheckpoint ----------------------------------------------------

namespace {

/// Why a shard file name from an index would leave its directory ("" if it does not).
std::string unsafe_shard_name(const std::string& shard) {
  if (shard.empty()) return "is empty";
  if (shard.find('\0') != std::string::npos) return "contains a NUL byte";
  const std::filesystem::path p(shard);
  if (p.is_absolute() || p.has_root_path()) return "is an absolute path";
  for (const auto& part : p)
    if (part == "..") return "contains '..'";
  return "";
}

SafetensorsCheckpoint::Entry none() { return {nullptr, nullptr}; }

}  // namespace

SafetensorsCheckpoint SafetensorsCheckpoint::open(const std::filesystem::path& dir) {
  namespace fs = std::filesystem;
  std::error_code ec;
  fs::path index;
  SafetensorsCheckpoint ck;
  if (fs::is_directory(dir, ec)) {
    if (fs::exists(dir / "model.safetensors.index.json", ec)) {
      index = dir / "model.safetensors.index.json";
    } else if (fs::exists(dir / "model.safetensors", ec)) {
      ck.files_.push_back(SafetensorsFile::open(dir / "model.safetensors"));
    } else {
      throw IoError(fmt::format("{}: has neither model.safetensors.index.json nor model.safetensors", dir.string()));
    }
  } else if (dir.filename().string().ends_with(".index.json")) {
    index = dir;
  } else {
    ck.files_.push_back(SafetensorsFile::open(dir));
  }
  if (index.empty()) {
    for (std::size_t i = 0; i < ck.files_[0].tensors().size(); ++i)
      ck.where_.emplace(ck.files_[0].tensors()[i].name, 0);
    return ck;
  }

  const std::string src = index.string();
  const std::string text = read_file(index);
  json j;
  std::vector<std::string> dup;
  try {
    j = parse_unique_keys(text, dup);
  } catch (const json::exception& e) {
    throw CheckpointError(fmt::format("{}: not valid JSON: {}", src, e.what()));
  }
  if (!dup.empty()) throw CheckpointError(fmt::format("{}: key {} appears twice", src, fmt::join(dup, ".")));
  if (!j.is_object()) throw CheckpointError(fmt::format("{}: must be a JSON object (got {})", src, show(j)));
  if (j.contains("metadata") && !j["metadata"].is_object())
    throw CheckpointError(fmt::format("{}: metadata must be an object (got {})", src, show(j["metadata"])));
  if (!j.contains("weight_map") || !j["weight_map"].is_object())
    throw CheckpointError(fmt::format("{}: weight_map must be an object of tensor -> shard file (got {})", src,
                                      j.contains("weight_map") ? show(j["weight_map"]) : "nothing"));
  const json& wm = j["weight_map"];
  if (wm.empty()) throw CheckpointError(fmt::format("{}: weight_map is empty", src));
  std::map<std::string, std::string> shard_of;         // tensor -> shard file name
  std::map<std::string, std::string> first_tensor_of;  // shard -> a tensor it should hold (for messages)
  for (const auto& [tensor, shard] : wm.items()) {
    if (!shard.is_string())
      throw CheckpointError(
          fmt::format("{}: weight_map.{} must be a shard file name (got {})", src, tensor, show(shard)));
    const auto& s = shard.get_ref<const std::string&>();
    if (const std::string why = unsafe_shard_name(s); !why.empty())
      throw CheckpointError(fmt::format("{}: weight_map.{}: shard file name {} {}; shards must be inside {}", src,
                                        tensor, show(shard), why, index.parent_path().string()));
    shard_of.emplace(tensor, s);
    first_tensor_of.emplace(s, tensor);
  }
  std::map<std::string, std::size_t> file_of;  // shard -> index in files_
  for (const auto& [shard, tensor] : first_tensor_of) {
    const fs::path p = index.parent_path() / shard;
    if (!fs::exists(p, ec))
      throw IoError(fmt::format("{}: shard {} (holding tensor {}) does not exist: {}", src, shard, tensor, p.string()));
    file_of.emplace(shard, ck.files_.size());
    ck.files_.push_back(SafetensorsFile::open(p));
  }
  for (const auto& [shard, i] : file_of) {
    for (const auto& t : ck.files_[i].tensors()) {
      auto [it, fresh] = ck.where_.emplace(t.name, i);
      if (!fresh)
        throw CheckpointError(fmt::format("{}: tensor {} is in two shards: {} and {}", src, t.name,
                                          ck.files_[it->second].source(), ck.files_[i].source()));
    }
  }
  for (const auto& [tensor, shard] : shard_of) {
    auto it = ck.where_.find(tensor);
    const std::size_t want = file_of.at(shard);
    if (it == ck.where_.end() || it->second != want)
      throw CheckpointError(
          fmt::format("{}: weight_map puts tensor {} in {}, which does not have it{}", src, tensor, shard,
                      it == ck.where_.end() ? "" : " (it is in " + ck.files_[it->second].source() + ")"));
  }
  for (const auto& [tensor, i] : ck.where_)
    if (!shard_of.contains(tensor))
      throw CheckpointError(
          fmt::format("{}: tensor {} of shard {} is not in the weight_map", src, tensor, ck.files_[i].source()));
  return ck;
}

SafetensorsCheckpoint::Entry SafetensorsCheckpoint::find(std::string_view name) const {
  auto it = where_.find(name);
  if (it == where_.end()) return none();
  const SafetensorsFile& f = files_[it->second];
  return {&f, f.find(name)};
}

std::vector<std::string> SafetensorsCheckpoint::names() const {
  std::vector<std::string> out;
  out.reserve(where_.size());
  for (const auto& [name, i] : where_) out.push_back(name);
  return out;
}

std::string SafetensorsCheckpoint::describe() const {
  std::vector<std::string> names;
  for (const auto& f : files_) names.push_back(std::filesystem::path(f.source()).filename().string());
  if (names.empty()) return "no safetensors file";
  if (names.size() == 1) return names[0];
  // "3 shards (model-0000x-of-00003.safetensors)": the common prefix and suffix around an 'x'.
  std::size_t pre = names[0].size(), suf = names[0].size();
  for (const auto& n : names) {
    pre = std::min(pre, static_cast<std::size_t>(
                            std::mismatch(n.begin(), n.end(), names[0].begin(), names[0].end()).first - n.begin()));
    suf =
        std::min(suf, static_cast<std::size_t>(
                          std::mismatch(n.rbegin(), n.rend(), names[0].rbegin(), names[0].rend()).first - n.rbegin()));
  }
  const std::size_t shortest = std::min_element(names.begin(), names.end(), [](const auto& a, const auto& b) {
                                 return a.size() < b.size();
                               })->size();
  if (pre + suf > shortest) suf = shortest - pre;
  return fmt::format("{} shards ({}x{})", names.size(), names[0].substr(0, pre),
                     names[0].substr(names[0].size() - suf));
}

}  // namespace posenc
