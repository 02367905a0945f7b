// libFuzzer harness: first_invalid_utf8 / require_utf8 (posenc/io.hpp), the check of the CLI's text inputs, on the
// input bytes, against PCRE2's own UTF-8 validation (pcre2_match with PCRE2_UTF reports the offset of the first
// invalid code unit): both must agree on valid or not and, when not, on the offset; require_utf8 must throw
// InvalidArgument exactly when the text is invalid. A disagreement, another exception, a crash or a sanitizer
// report is a finding.
#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string_view>

#include "posenc/error.hpp"
#include "posenc/io.hpp"

namespace {

/// PCRE2's verdict: nullopt when valid UTF-8, else the offset of the first invalid code unit.
std::optional<std::size_t> pcre2_invalid_at(std::string_view text) {
  static pcre2_code* re = [] {
    int err = 0;
    PCRE2_SIZE off = 0;
    return pcre2_compile(reinterpret_cast<PCRE2_SPTR>(""), 0, PCRE2_UTF, &err, &off, nullptr);
  }();
  if (re == nullptr) __builtin_trap();
  pcre2_match_data* md = pcre2_match_data_create_from_pattern(re, nullptr);
  const int rc = pcre2_match(re, reinterpret_cast<PCRE2_SPTR>(text.data()), text.size(), 0, 0, md, nullptr);
  std::optional<std::size_t> at;
  if (rc <= PCRE2_ERROR_UTF8_ERR1 && rc >= PCRE2_ERROR_UTF8_ERR21) at = pcre2_get_startchar(md);
  else if (rc < 0 && rc != PCRE2_ERROR_NOMATCH) __builtin_trap();  // another error: the oracle itself failed
  pcre2_match_data_free(md);
  return at;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  const auto ours = posenc::first_invalid_utf8(text);
  if (ours != pcre2_invalid_at(text)) __builtin_trap();
  bool threw = false;
  try {
    posenc::require_utf8(text, "--text fuzz.txt");
  } catch (const posenc::InvalidArgument&) {
    threw = true;
  }
  if (threw != ours.has_value()) __builtin_trap();
  return 0;
}
