#include "posenc/json_file.hpp"

#include <cmath>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "posenc/error.hpp"

namespace posenc {

namespace {
const char* type_name(const nlohmann::json& v) {
  if (v.is_null()) return "null";
  if (v.is_boolean()) return "a boolean";
  if (v.is_number()) return "a number";
  if (v.is_string()) return "a string";
  if (v.is_array()) return "an array";
  if (v.is_object()) return "an object";
  return "a binary value";
}

std::string shown(const nlohmann::json& v) {
  std::string s = v.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  if (s.size() > 80) s = s.substr(0, 77) + "...";
  return s;
}
}  // namespace

JsonView::JsonView(const nlohmann::json& value, std::shared_ptr<const std::string> file, std::string path)
    : value_(&value), file_(std::move(file)), path_(std::move(path)) {}

void JsonView::fail(std::string_view what) const {
  if (path_.empty()) throw DataError(fmt::format("{}: {}", *file_, what));
  throw DataError(fmt::format("{}: {}: {}", *file_, path_, what));
}

JsonView JsonView::at(std::string_view key) const {
  if (!value_->is_object()) fail(fmt::format("expected an object with key '{}', got {}", key, type_name(*value_)));
  const auto it = value_->find(key);
  if (it == value_->end()) fail(fmt::format("missing key '{}'", key));
  return JsonView(*it, file_, path_.empty() ? std::string(key) : fmt::format("{}.{}", path_, key));
}

std::optional<JsonView> JsonView::find(std::string_view key) const {
  if (!value_->is_object()) fail(fmt::format("expected an object, got {}", type_name(*value_)));
  const auto it = value_->find(key);
  if (it == value_->end() || it->is_null()) return std::nullopt;
  return JsonView(*it, file_, path_.empty() ? std::string(key) : fmt::format("{}.{}", path_, key));
}

bool JsonView::contains(std::string_view key) const { return value_->is_object() && value_->contains(key); }

JsonView JsonView::at(std::size_t i) const {
  if (!value_->is_array()) fail(fmt::format("expected an array, got {}", type_name(*value_)));
  if (i >= value_->size()) fail(fmt::format("index {} past the end of an array of {}", i, value_->size()));
  return JsonView((*value_)[i], file_, fmt::format("{}[{}]", path_, i));
}

std::vector<JsonView> JsonView::elements() const {
  if (!value_->is_array()) fail(fmt::format("expected an array, got {}", type_name(*value_)));
  std::vector<JsonView> out;
  out.reserve(value_->size());
  for (std::size_t i = 0; i < value_->size(); ++i) out.emplace_back((*value_)[i], file_, fmt::format("{}[{}]", path_, i));
  return out;
}

std::vector<std::pair<std::string, JsonView>> JsonView::members() const {
  if (!value_->is_object()) fail(fmt::format("expected an object, got {}", type_name(*value_)));
  std::vector<std::pair<std::string, JsonView>> out;
  for (auto it = value_->begin(); it != value_->end(); ++it)
    out.emplace_back(it.key(), JsonView(it.value(), file_, path_.empty() ? it.key() : path_ + "." + it.key()));
  return out;
}

std::size_t JsonView::size() const {
  if (!value_->is_array() && !value_->is_object())
    fail(fmt::format("expected an array or object, got {}", type_name(*value_)));
  return value_->size();
}

std::string JsonView::string() const {
  if (!value_->is_string()) fail(fmt::format("expected a string, got {} {}", type_name(*value_), shown(*value_)));
  return value_->get<std::string>();
}

std::int64_t JsonView::integer(std::int64_t lo, std::int64_t hi) const {
  std::int64_t v = 0;
  if (value_->is_number_integer()) {
    if (value_->is_number_unsigned() && value_->get<std::uint64_t>() > static_cast<std::uint64_t>(INT64_MAX))
      fail(fmt::format("{} is out of range [{}, {}]", shown(*value_), lo, hi));
    v = value_->get<std::int64_t>();
  } else if (value_->is_number_float()) {
    const double d = value_->get<double>();
    // 2^63 is the first double past INT64_MAX.
    if (!std::isfinite(d) || d != std::floor(d) || d < -9.2233720368547758e18 || d >= 9.2233720368547758e18)
      fail(fmt::format("expected an integer, got {}", shown(*value_)));
    v = static_cast<std::int64_t>(d);
  } else {
    fail(fmt::format("expected an integer, got {} {}", type_name(*value_), shown(*value_)));
  }
  if (v < lo || v > hi) fail(fmt::format("{} is out of range [{}, {}]", v, lo, hi));
  return v;
}

double JsonView::number(double lo, double hi) const {
  if (!value_->is_number()) fail(fmt::format("expected a number, got {} {}", type_name(*value_), shown(*value_)));
  const double d = value_->get<double>();
  if (!std::isfinite(d)) fail(fmt::format("expected a finite number, got {}", shown(*value_)));
  if (d < lo || d > hi) fail(fmt::format("{} is out of range [{}, {}]", d, lo, hi));
  return d;
}

bool JsonView::boolean() const {
  if (!value_->is_boolean()) fail(fmt::format("expected a boolean, got {} {}", type_name(*value_), shown(*value_)));
  return value_->get<bool>();
}

std::string JsonView::string_or(std::string_view key, std::string_view fallback) const {
  const auto v = find(key);
  return v ? v->string() : std::string(fallback);
}

std::int64_t JsonView::integer_or(std::string_view key, std::int64_t fallback, std::int64_t lo, std::int64_t hi) const {
  const auto v = find(key);
  return v ? v->integer(lo, hi) : fallback;
}

double JsonView::number_or(std::string_view key, double fallback) const {
  const auto v = find(key);
  return v ? v->number() : fallback;
}

bool JsonView::boolean_or(std::string_view key, bool fallback) const {
  const auto v = find(key);
  return v ? v->boolean() : fallback;
}

std::string json_failure_path(std::string_view text) {
  struct Level {
    bool array = false;
    std::string key;    // object: the key whose value is being read
    int64_t index = 0;  // array: elements completed before the one being read
  };
  std::vector<Level> stack;
  auto element_done = [&] {
    if (!stack.empty() && stack.back().array) ++stack.back().index;
  };
  auto callback = [&](int /*depth*/, nlohmann::json::parse_event_t event, nlohmann::json& parsed) {
    using E = nlohmann::json::parse_event_t;
    switch (event) {
      case E::object_start: stack.push_back({false, "", 0}); break;
      case E::array_start: stack.push_back({true, "", 0}); break;
      case E::key:
        if (!stack.empty()) stack.back().key = parsed.is_string() ? parsed.get<std::string>() : "";
        break;
      case E::object_end:
      case E::array_end:
        if (!stack.empty()) stack.pop_back();
        element_done();
        break;
      case E::value: element_done(); break;
    }
    return true;
  };
  try {
    // (kept in a variable: nlohmann marks parse warn_unused_result, which a (void) cast does not silence in GCC)
    const nlohmann::json whole = nlohmann::json::parse(text.begin(), text.end(), callback);
    (void)whole;
    return "";
  } catch (const nlohmann::json::exception&) {
  }
  std::string path;
  for (const Level& l : stack) {
    if (l.array)
      path += fmt::format("[{}]", l.index);
    else
      path += (path.empty() ? "" : ".") + l.key;
  }
  return path;
}

JsonDocument parse_json_document(std::string_view text, std::string_view source) {
  try {
    return JsonDocument(nlohmann::json::parse(text.begin(), text.end()), std::string(source));
  } catch (const nlohmann::json::parse_error& e) {
    throw DataError(fmt::format("{}: not valid JSON ({})", source, e.what()));
  } catch (const nlohmann::json::exception& e) {  // a value nlohmann cannot hold (1e400): name its key
    const std::string path = json_failure_path(text);
    throw DataError(fmt::format("{}: {}{}unusable JSON value ({})", source, path, path.empty() ? "" : ": ", e.what()));
  }
}

JsonDocument read_json_document(const std::filesystem::path& path, std::uint64_t max_bytes) {
  return parse_json_document(read_file(path, max_bytes), path.string());
}

}  // namespace posenc
