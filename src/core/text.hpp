// Internal: text from a file (a tensor name, a metadata string) made safe to show in a message.
#pragma once

#include <string>
#include <string_view>

#include <fmt/format.h>

namespace posenc::detail {

/// `text` as shown in an error message: control bytes (< 0x20, 0x7f, and the C1 controls U+0080..U+009F),
/// and bytes that are not part of a well-formed UTF-8 sequence, written as \xNN; everything else unchanged.
/// A NUL would end the message (what() is a C string) and an escape byte would drive the terminal.
inline std::string escaped(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  const auto byte = [&](std::size_t i) { return static_cast<unsigned char>(text[i]); };
  for (std::size_t i = 0; i < text.size();) {
    const unsigned char c = byte(i);
    if (c >= 0x20 && c < 0x7f) {
      out += static_cast<char>(c);
      ++i;
      continue;
    }
    // A well-formed multi-byte sequence (lead C2..F4, continuation bytes 80..BF) other than a C1 control.
    const std::size_t n = c >= 0xC2 && c <= 0xDF ? 2 : c >= 0xE0 && c <= 0xEF ? 3 : c >= 0xF0 && c <= 0xF4 ? 4 : 0;
    bool ok = n > 0 && i + n <= text.size();
    for (std::size_t k = 1; ok && k < n; ++k) ok = (byte(i + k) & 0xC0) == 0x80;
    if (ok && c == 0xC2 && byte(i + 1) < 0xA0) ok = false;  // U+0080..U+009F
    if (ok) {
      out.append(text.substr(i, n));
      i += n;
    } else {
      out += fmt::format("\\x{:02x}", c);
      ++i;
    }
  }
  return out;
}

}  // namespace posenc::detail
