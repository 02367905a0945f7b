// The input format of fuzz/study_dir_fuzz.cpp (also used by the seed test in
// tests/train/study_dir_test.cpp): a study directory as one byte string.
//
//   <study.json bytes> [ "\n====\n" <evaluation file bytes> ]...
//
// Each evaluation is written to evals/<task>-<pe>-s<seed>.json when its bytes
// parse as an object with a string task and pe (letters, digits, '_' only)
// and an unsigned seed, so most inputs get past the report's file-name check;
// otherwise to evals/eval<i>.json. Header-only, nlohmann::json only.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

namespace posenc::fuzz {

inline constexpr std::string_view kStudyDirSeparator = "\n====\n";

inline bool study_dir_plain_name(const std::string& s) {
  if (s.empty() || s.size() > 40) return false;
  for (char c : s)
    if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_')) return false;
  return true;
}

/// (relative path, contents) of every file of the input, study.json first.
inline std::vector<std::pair<std::string, std::string>> split_study_dir_input(std::string_view in) {
  std::vector<std::string_view> parts;
  for (std::size_t pos = 0;;) {
    const std::size_t at = in.find(kStudyDirSeparator, pos);
    parts.push_back(in.substr(pos, at == std::string_view::npos ? std::string_view::npos : at - pos));
    if (at == std::string_view::npos || parts.size() == 16) break;
    pos = at + kStudyDirSeparator.size();
  }
  std::vector<std::pair<std::string, std::string>> files;
  files.emplace_back("study.json", std::string(parts[0]));
  for (std::size_t i = 1; i < parts.size(); ++i) {
    std::string name = "eval" + std::to_string(i);
    const nlohmann::json j = nlohmann::json::parse(parts[i].begin(), parts[i].end(), nullptr, false);
    if (j.is_object()) {
      const auto task = j.find("task"), pe = j.find("pe"), seed = j.find("seed");
      if (task != j.end() && pe != j.end() && seed != j.end() && task->is_string() && pe->is_string() &&
          seed->is_number_unsigned() && study_dir_plain_name(task->get<std::string>()) &&
          study_dir_plain_name(pe->get<std::string>()))
        name = task->get<std::string>() + "-" + pe->get<std::string>() + "-s" +
               std::to_string(seed->get<std::uint64_t>());
    }
    files.emplace_back("evals/" + name + ".json", std::string(parts[i]));
  }
  return files;
}

}  // namespace posenc::fuzz
