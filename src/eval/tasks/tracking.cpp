// The tracking family: RULER variable_tracking.
#include <algorithm>
#include <array>
#include <cctype>
#include <cmath>
#include <set>

#include <fmt/format.h>

#include "eval/tasks/task_kit.hpp"
#include "posenc/error.hpp"

namespace posenc::detail::tasks {

void build_variable_tracking(TaskContext& x, TaskSample& s, double depth, TaskControl control) {
  const Tokenizer& tok_ = x.tok;
  const Haystack& hay_ = x.hay;
  Rng& content = x.content;
  Rng& hay_rng = x.hay_rng;
  Rng& ctl = x.ctl;
  auto name5 = [](Rng& r) {
    std::string n;
    for (int i = 0; i < 5; ++i) n += static_cast<char>('A' + r.uniform(26));
    return n;
  };
  std::vector<std::string> names;
  while (names.size() < 5) {
    std::string n = name5(content);
    if (std::find(names.begin(), names.end(), n) == names.end()) names.push_back(std::move(n));
  }
  const std::string value = digits(content, 5);
  const auto original = names;
  if (control == TaskControl::swap) {
    std::vector<std::string> fresh;
    while (fresh.size() < 5) {
      std::string n = name5(ctl);
      if (std::find(original.begin(), original.end(), n) == original.end() &&
          std::find(fresh.begin(), fresh.end(), n) == fresh.end())
        fresh.push_back(std::move(n));
    }
    names = fresh;
  } else if (control == TaskControl::shuffle) {
    for (auto& n : names) n = permuted(n, ctl, name5(ctl));
  }
  s.answers = names;
  s.original_answers = original;
  std::vector<NeedleIn> needles;
  for (std::size_t i = 0; i < names.size(); ++i) {
    const std::string text = i == 0 ? fmt::format("VAR {} = {}.", names[0], value)
                                    : fmt::format("VAR {} = VAR {}.", names[i], names[i - 1]);
    needles.push_back({make_piece(tok_, text), "evidence", evidence_target(depth, i, names.size())});
  }
  const Piece pre = make_piece(tok_, "Memorize and track the chain of variable assignment hidden in the following text.");
  const Piece query = make_piece(
      tok_, fmt::format("Question: Which variables are assigned the value {0}? Answer: The variables assigned the "
                        "value {0} are:",
                        value));
  assemble_haystack(start_tokens(tok_), hay_, s, hay_rng, &pre, std::move(needles), query);
  return;
}

}  // namespace posenc::detail::tasks
