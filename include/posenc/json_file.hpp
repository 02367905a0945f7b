// posenc — checked reading of JSON files posenc reads back (run.json, eval
// cells, study.json, evals/*.json, ...).
//
// nlohmann::json's operator[] on a const value is undefined behaviour for a
// missing key and its at()/get<T>() throw messages without the file's name.
// Everything read back from disk goes through JsonView instead: every access
// is checked, and every failure is a DataError naming the file and the key
// path ("runs/x/run.json: config.lengths[2]: expected an integer, got \"a\"").
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "posenc/io.hpp"

namespace posenc {

/// A read-only, checked view of one value inside a parsed JSON document.
/// Cheap to copy; it refers to the document it came from (keep the
/// JsonDocument alive while views of it are used).
/// Every accessor throws DataError "<file>: <path>: <what>" on a missing key,
/// a wrong type, an index past the end or a value out of the asked range.
class JsonView {
 public:
  JsonView(const nlohmann::json& value, std::shared_ptr<const std::string> file, std::string path);

  /// The member `key` of an object. Throws if this is not an object or the key is absent.
  JsonView at(std::string_view key) const;
  /// The member `key`, or nullopt when absent (or null). Throws if this is not an object.
  std::optional<JsonView> find(std::string_view key) const;
  /// Element `i` of an array. Throws if this is not an array or i >= size().
  JsonView at(std::size_t i) const;
  /// The elements of an array. Throws if this is not an array.
  std::vector<JsonView> elements() const;
  /// The members of an object, in the document's key order. Throws if not an object.
  std::vector<std::pair<std::string, JsonView>> members() const;
  /// Number of elements (array) or members (object). Throws otherwise.
  std::size_t size() const;

  bool is_null() const { return value_->is_null(); }
  bool is_object() const { return value_->is_object(); }
  bool is_array() const { return value_->is_array(); }
  bool is_string() const { return value_->is_string(); }
  bool is_number() const { return value_->is_number(); }
  bool contains(std::string_view key) const;

  /// A string. Throws if not a string.
  std::string string() const;
  /// An integer in [lo, hi] (a JSON number without fraction; 3.0 is accepted).
  /// Throws if not an integer or out of range.
  std::int64_t integer(std::int64_t lo = std::numeric_limits<std::int64_t>::min(),
                       std::int64_t hi = std::numeric_limits<std::int64_t>::max()) const;
  /// A finite number in [lo, hi]. Throws if not a number, NaN/inf or out of range.
  double number(double lo = -std::numeric_limits<double>::infinity(),
                double hi = std::numeric_limits<double>::infinity()) const;
  /// A boolean. Throws if not a boolean.
  bool boolean() const;

  /// String member with a default when absent; throws if present with another type.
  std::string string_or(std::string_view key, std::string_view fallback) const;
  /// Integer member with a default when absent; throws if present and invalid.
  std::int64_t integer_or(std::string_view key, std::int64_t fallback,
                          std::int64_t lo = std::numeric_limits<std::int64_t>::min(),
                          std::int64_t hi = std::numeric_limits<std::int64_t>::max()) const;
  /// Number member with a default when absent; throws if present and invalid.
  double number_or(std::string_view key, double fallback) const;
  /// Boolean member with a default when absent; throws if present and not a boolean.
  bool boolean_or(std::string_view key, bool fallback) const;

  /// The underlying value, for copying whole subtrees (never index it unchecked).
  const nlohmann::json& raw() const { return *value_; }
  /// "config.lengths[2]" ("" for the root).
  const std::string& path() const { return path_; }
  const std::string& file() const { return *file_; }

  /// Throws DataError "<file>: <path>: <what>".
  [[noreturn]] void fail(std::string_view what) const;

 private:
  const nlohmann::json* value_;
  std::shared_ptr<const std::string> file_;
  std::string path_;
};

/// A parsed JSON document and the name of the file it came from.
class JsonDocument {
 public:
  JsonDocument(nlohmann::json value, std::string file)
      : value_(std::make_shared<const nlohmann::json>(std::move(value))),
        file_(std::make_shared<const std::string>(std::move(file))) {}
  JsonView root() const { return JsonView(*value_, file_, ""); }
  const nlohmann::json& raw() const { return *value_; }
  const std::string& file() const { return *file_; }

 private:
  std::shared_ptr<const nlohmann::json> value_;
  std::shared_ptr<const std::string> file_;
};

/// Where parsing `text` fails on a value: the key path of the value being
/// read when nlohmann::json throws ("rope_scaling.factor", "a[2]"), "" when
/// the text parses or fails outside any object or array. nlohmann's own
/// messages for a value (out_of_range 406 "number overflow parsing '1e400'")
/// name no key.
std::string json_failure_path(std::string_view text);

/// Parses `text` (named `source` in errors). Throws DataError
/// "<source>: not valid JSON (<parser message>)".
JsonDocument parse_json_document(std::string_view text, std::string_view source);

/// Reads and parses a JSON file with read_file's rules (regular files only,
/// at most `max_bytes`). Throws IoError (cannot read) or DataError (not JSON).
JsonDocument read_json_document(const std::filesystem::path& path, std::uint64_t max_bytes = kMaxReadBytes);

}  // namespace posenc
