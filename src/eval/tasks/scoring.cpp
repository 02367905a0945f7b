// Scoring in one place: forced choice (acc, acc_norm) and generation (RULER
// string_match_all, passkey first integer).
#include "posenc/tasks.hpp"

#include <algorithm>
#include <array>
#include <cctype>
#include <cmath>
#include <set>

#include <fmt/format.h>

#include "eval/tasks/task_kit.hpp"
#include "posenc/error.hpp"

namespace posenc {

using detail::tasks::is_space;

int64_t candidate_bytes(std::string_view choice) {
  if (!choice.empty() && choice.front() == ' ') choice.remove_prefix(1);
  return static_cast<int64_t>(choice.size());
}

int ChoiceScore::predicted(std::string_view metric) const {
  if (metric == "acc") return acc;
  if (metric == "acc_norm") return acc_norm;
  throw InvalidArgument(fmt::format("metric: unknown forced-choice metric '{}' (known: acc_norm, acc)", metric));
}

ChoiceScore score_choice(std::span<const double> logprobs, std::span<const int64_t> bytes) {
  if (logprobs.empty()) throw InvalidArgument("score_choice: no candidates");
  if (bytes.size() != logprobs.size())
    throw InvalidArgument(fmt::format("score_choice: {} byte lengths for {} candidates", bytes.size(), logprobs.size()));
  ChoiceScore r{0, 0};
  for (std::size_t i = 0; i < logprobs.size(); ++i) {
    if (bytes[i] < 1) fail_field<InvalidArgument>("candidate bytes", "must be >= 1", bytes[i]);
    if (logprobs[i] > logprobs[static_cast<std::size_t>(r.acc)]) r.acc = static_cast<int>(i);
    // lm-eval: ll / len(choice); compared as ll_i * len_best > ll_best * len_i would avoid a
    // division, but the division is what the harness does and its ties are what we match.
    const auto best = static_cast<std::size_t>(r.acc_norm);
    if (logprobs[i] / static_cast<double>(bytes[i]) > logprobs[best] / static_cast<double>(bytes[best]))
      r.acc_norm = static_cast<int>(i);
  }
  return r;
}

std::string normalize_prediction(std::string_view p) {
  std::string s(p);
  for (char& c : s)
    if (static_cast<unsigned char>(c) < 0x20) c = '\n';
  std::size_t b = 0, e = s.size();
  while (b < e && is_space(s[b])) ++b;
  while (e > b && is_space(s[e - 1])) --e;
  return s.substr(b, e - b);
}

GenerationScore score_generation(std::string_view metric, std::string_view prediction,
                                 std::span<const std::string> answers) {
  GenerationScore g;
  if (answers.empty()) throw InvalidArgument("score_generation: no answers");
  auto lower = [](std::string s) {
    for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    return s;
  };
  const std::string pred = lower(normalize_prediction(prediction));
  if (metric == "all") {
    int found = 0;
    for (const auto& a : answers) found += pred.find(lower(a)) != std::string::npos ? 1 : 0;
    g.score = static_cast<double>(found) / static_cast<double>(answers.size());
    g.correct = found == static_cast<int>(answers.size());
    return g;
  }
  if (metric == "first_integer") {
    std::size_t b = 0;
    while (b < pred.size() && !std::isdigit(static_cast<unsigned char>(pred[b]))) ++b;
    std::size_t e = b;
    while (e < pred.size() && std::isdigit(static_cast<unsigned char>(pred[e]))) ++e;
    g.correct = e > b && pred.substr(b, e - b) == answers[0];
    g.score = g.correct ? 1.0 : 0.0;
    return g;
  }
  throw InvalidArgument(fmt::format("metric: unknown generation metric '{}' (known: all, first_integer)", metric));
}

}  // namespace posenc
