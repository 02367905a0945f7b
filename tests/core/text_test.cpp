// detail::escaped: text from a file made safe to show in a message.
#include <string>

#include <gtest/gtest.h>

#include "core/text.hpp"

namespace POSENC_UNITY_ID {  // this file's own namespace in the tests' unity build (CMakeLists.txt)

using posenc::detail::escaped;

TEST(Escaped, PrintableAsciiAndWellFormedUtf8AreUnchanged) {
  EXPECT_EQ(escaped("blk.0.attn_q.weight"), "blk.0.attn_q.weight");
  EXPECT_EQ(escaped(""), "");
  // é (2 bytes), 中 (3), U+1F600 (4), U+00A0 (the first 2-byte code point past the C1 controls)
  const std::string utf8 = "caf\xc3\xa9 \xe4\xb8\xad \xf0\x9f\x98\x80 \xc2\xa0";
  EXPECT_EQ(escaped(utf8), utf8);
}

TEST(Escaped, ControlBytesAndMalformedUtf8AreEscaped) {
  EXPECT_EQ(escaped(std::string("a\0b", 3)), "a\\x00b");  // a NUL would end what()
  EXPECT_EQ(escaped("esc\x1b[31mred\x07"), "esc\\x1b[31mred\\x07");
  EXPECT_EQ(escaped("del\x7f"), "del\\x7f");
  EXPECT_EQ(escaped("tab\tnl\n"), "tab\\x09nl\\x0a");
  EXPECT_EQ(escaped("\xc2\x9b" "1m"), "\\xc2\\x9b1m");      // C1 CSI, which terminals obey
  EXPECT_EQ(escaped("\xff\xfe"), "\\xff\\xfe");             // never in UTF-8
  EXPECT_EQ(escaped("\x80x"), "\\x80x");                    // a lone continuation byte
  EXPECT_EQ(escaped("\xe4\xb8"), "\\xe4\\xb8");             // a sequence cut short at the end
  EXPECT_EQ(escaped("\xe4" "ab"), "\\xe4ab");               // ... or by an ASCII byte
  EXPECT_EQ(escaped("\xc0\xaf"), "\\xc0\\xaf");             // an overlong lead
}

}  // namespace POSENC_UNITY_ID
