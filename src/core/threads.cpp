#include "posenc/threads.hpp"

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>
#include <thread>

#include <fmt/format.h>
#include <omp.h>

#include "posenc/error.hpp"

namespace posenc {

int max_omp_threads() noexcept {
  const unsigned hw = std::thread::hardware_concurrency();
  return 64 * static_cast<int>(hw == 0 ? 1U : std::min(hw, 1U << 16));
}

int region_thread_count() noexcept {
  if (omp_get_max_active_levels() < 1) return 1;  // OMP_MAX_ACTIVE_LEVELS=0: every region runs on its one thread
  return std::max(1, std::min(omp_get_max_threads(), omp_get_thread_limit()));
}

namespace {
/// `text` with every byte outside printable ASCII as \xHH: the message stays valid UTF-8 (Python's ImportError
/// could not carry a raw \xff and came out empty).
std::string printable(std::string_view text) {
  std::string out;
  for (const char ch : text) {
    const auto u = static_cast<unsigned char>(ch);
    if (u >= 0x20 && u < 0x7f)
      out += ch;
    else
      out += fmt::format("\\x{:02x}", u);
  }
  return out;
}
}  // namespace

void check_omp_num_threads() {
  const char* env = std::getenv("OMP_NUM_THREADS");
  if (env == nullptr) return;
  const std::string value = env;
  if (std::all_of(value.begin(), value.end(), [](char ch) { return std::isspace(static_cast<unsigned char>(ch)); }))
    return;  // empty: as unset
  const int bound = max_omp_threads();
  std::size_t pos = 0;
  while (pos <= value.size()) {
    const std::size_t c = std::min(value.find(',', pos), value.size());
    std::string_view item(value.data() + pos, c - pos);
    while (!item.empty() && std::isspace(static_cast<unsigned char>(item.front()))) item.remove_prefix(1);
    while (!item.empty() && std::isspace(static_cast<unsigned char>(item.back()))) item.remove_suffix(1);
    const std::string_view shown = item;                                // as given, for the messages
    if (item.size() > 1 && item.front() == '+') item.remove_prefix(1);  // libgomp reads "+2" as 2 (strtoul)
    const bool digits = !item.empty() && std::all_of(item.begin(), item.end(), [](char ch) {
      return std::isdigit(static_cast<unsigned char>(ch)) != 0;
    });
    if (!digits || item.find_first_not_of('0') == std::string_view::npos)
      throw InvalidArgument(fmt::format("OMP_NUM_THREADS '{}': '{}' is not a thread count (a positive integer, or a "
                                        "comma-separated list of them); unset it or give one",
                                        printable(value), printable(shown)));
    // A count past the bound, however many digits it has (from_chars fails on overflow: also past it).
    int64_t v = 0;
    const auto [p, ec] = std::from_chars(item.data(), item.data() + item.size(), v);
    if (ec != std::errc() || p != item.data() + item.size() || v > bound)
      throw InvalidArgument(fmt::format(
          "OMP_NUM_THREADS '{}': {} threads is more than posenc runs with (at most {}: 64 x the {} hardware "
          "threads); unset it or give at most {}",
          printable(value), printable(shown), bound, bound / 64, bound));
    pos = c + 1;
  }
}

void check_omp_threads_in_use() {
  check_omp_num_threads();
  // libgomp reads OMP_NUM_THREADS once, when it is loaded: a value fixed in the environment afterwards (Python's
  // os.environ before a second `import posenc`) changes nothing, and its first reading is what regions would use.
  const int bound = max_omp_threads(), in_use = omp_get_max_threads();
  if (in_use > bound)
    throw InvalidArgument(fmt::format(
        "OpenMP runs with {} threads, more than posenc runs with (at most {}: 64 x the {} hardware threads): libgomp "
        "read OMP_NUM_THREADS when this process started and reads it only then; start it again with "
        "OMP_NUM_THREADS unset or at most {}",
        in_use, bound, bound / 64, bound));
}

}  // namespace posenc
