// The BPE engine: see tokenizer_bpe.hpp. Each component follows the Hugging
// Face `tokenizers` (Rust) component of the same name; comments name the
// places where a Rust quirk is reproduced on purpose.
#include "model/tokenizer_bpe.hpp"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <queue>
#include <tuple>

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <utf8proc.h>

#include <fmt/format.h>

#include "posenc/error.hpp"

namespace posenc::detail {

// ---- UTF-8 -------------------------------------------------------------------

namespace {

// Length of the maximal prefix of a well-formed sequence starting at s[i]
// (Unicode "maximal subpart" rule, as Rust's from_utf8_lossy); 0 if s[i]
// starts a complete valid sequence, whose length goes to `len`.
std::size_t utf8_check(std::string_view s, std::size_t i, std::size_t& len, char32_t& cp) {
  const auto b0 = static_cast<unsigned char>(s[i]);
  if (b0 < 0x80) {
    len = 1;
    cp = b0;
    return 0;
  }
  std::size_t need;
  unsigned char lo = 0x80, hi = 0xBF;
  if (b0 >= 0xC2 && b0 <= 0xDF) {
    need = 1;
    cp = b0 & 0x1F;
  } else if (b0 >= 0xE0 && b0 <= 0xEF) {
    need = 2;
    cp = b0 & 0x0F;
    if (b0 == 0xE0) lo = 0xA0;
    if (b0 == 0xED) hi = 0x9F;
  } else if (b0 >= 0xF0 && b0 <= 0xF4) {
    need = 3;
    cp = b0 & 0x07;
    if (b0 == 0xF0) lo = 0x90;
    if (b0 == 0xF4) hi = 0x8F;
  } else {
    return 1;  // a byte that can never start a sequence
  }
  std::size_t k = 1;
  for (; k <= need; ++k) {
    if (i + k >= s.size()) return k;
    const auto b = static_cast<unsigned char>(s[i + k]);
    if (b < lo || b > hi) return k;
    lo = 0x80;
    hi = 0xBF;
    cp = (cp << 6) | (b & 0x3F);
  }
  len = need + 1;
  return 0;
}

}  // namespace

std::size_t utf8_next(std::string_view s, std::size_t i, char32_t& cp) {
  std::size_t len = 0;
  if (utf8_check(s, i, len, cp) != 0) {
    cp = 0xFFFD;
    return 1;
  }
  return len;
}

void utf8_append(std::string& out, char32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

bool is_valid_utf8(std::string_view s) {
  std::size_t i = 0, len = 0;
  char32_t cp;
  while (i < s.size()) {
    if (static_cast<unsigned char>(s[i]) < 0x80) {
      ++i;
      continue;
    }
    if (utf8_check(s, i, len, cp) != 0) return false;
    i += len;
  }
  return true;
}

std::string utf8_sanitize(std::string_view s) {
  std::string out;
  out.reserve(s.size() + 8);
  std::size_t i = 0, len = 0;
  char32_t cp;
  while (i < s.size()) {
    const std::size_t bad = utf8_check(s, i, len, cp);
    if (bad == 0) {
      out.append(s.substr(i, len));
      i += len;
    } else {
      out += "\xef\xbf\xbd";
      i += bad;
    }
  }
  return out;
}

bool uni_is_whitespace(char32_t c) {
  return (c >= 0x09 && c <= 0x0D) || c == 0x20 || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F || c == 0x3000;
}

bool uni_is_numeric(char32_t c) {
  const auto cat = utf8proc_category(static_cast<utf8proc_int32_t>(c));
  return cat == UTF8PROC_CATEGORY_ND || cat == UTF8PROC_CATEGORY_NL || cat == UTF8PROC_CATEGORY_NO;
}

bool uni_is_punctuation(char32_t c) {
  if (c < 0x80) return (c >= 33 && c <= 47) || (c >= 58 && c <= 64) || (c >= 91 && c <= 96) || (c >= 123 && c <= 126);
  const auto cat = utf8proc_category(static_cast<utf8proc_int32_t>(c));
  return cat >= UTF8PROC_CATEGORY_PC && cat <= UTF8PROC_CATEGORY_PO;
}

bool uni_is_word(char32_t c) {
  if (c == 0x200C || c == 0x200D) return true;
  const auto cat = utf8proc_category(static_cast<utf8proc_int32_t>(c));
  return (cat >= UTF8PROC_CATEGORY_LU && cat <= UTF8PROC_CATEGORY_ND) || cat == UTF8PROC_CATEGORY_NL ||
         cat == UTF8PROC_CATEGORY_PC;
}

// ---- byte-level alphabet ------------------------------------------------------

namespace {

struct ByteAlphabet {
  std::string chars[256];
  std::unordered_map<char32_t, unsigned char> bytes;
  ByteAlphabet() {
    int n = 0;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
      const char32_t cp = printable ? static_cast<char32_t>(b) : static_cast<char32_t>(256 + n++);
      utf8_append(chars[b], cp);
      bytes.emplace(cp, static_cast<unsigned char>(b));
    }
  }
};

const ByteAlphabet& alphabet() {
  static const ByteAlphabet a;
  return a;
}

}  // namespace

const std::string& byte_level_char(unsigned char b) { return alphabet().chars[b]; }

// ---- Regex -------------------------------------------------------------------

namespace {

struct MatchState {
  pcre2_match_data* md = nullptr;
  pcre2_match_context* mctx = nullptr;
  pcre2_jit_stack* stack = nullptr;
  MatchState() {
    md = pcre2_match_data_create(1, nullptr);
    mctx = pcre2_match_context_create(nullptr);
    stack = pcre2_jit_stack_create(32 * 1024, 4 * 1024 * 1024, nullptr);
    if (mctx && stack) pcre2_jit_stack_assign(mctx, nullptr, stack);
  }
  ~MatchState() {
    pcre2_match_data_free(md);
    pcre2_match_context_free(mctx);
    pcre2_jit_stack_free(stack);
  }
};

MatchState& match_state() {
  thread_local MatchState st;
  return st;
}

}  // namespace

Regex::Regex(std::string_view pattern, std::string_view what) : what_(what) {
  int err = 0;
  PCRE2_SIZE off = 0;
  auto* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                             PCRE2_UTF | PCRE2_UCP | PCRE2_MATCH_INVALID_UTF, &err, &off, nullptr);
  if (!code) {
    PCRE2_UCHAR msg[256];
    pcre2_get_error_message(err, msg, sizeof msg);
    throw TokenizerError(fmt::format("{}: regex rejected by PCRE2 at offset {}: {} (got '{}')", what, off,
                                     reinterpret_cast<const char*>(msg), pattern));
  }
  code_ = code;
  jit_ = pcre2_jit_compile(code, PCRE2_JIT_COMPLETE) == 0;
}

Regex::~Regex() { pcre2_code_free(static_cast<pcre2_code*>(code_)); }

void Regex::find_all(std::string_view s, std::vector<std::pair<std::size_t, std::size_t>>& out) const {
  out.clear();
  auto* code = static_cast<pcre2_code*>(code_);
  MatchState& st = match_state();
  std::size_t last_end = 0;
  std::optional<std::size_t> last_match_end;
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(s.data());
  while (last_end <= s.size()) {
    int rc = jit_ ? pcre2_jit_match(code, subject, s.size(), last_end, 0, st.md, st.mctx)
                  : pcre2_match(code, subject, s.size(), last_end, 0, st.md, st.mctx);
    if (rc < 0 && rc != PCRE2_ERROR_NOMATCH && jit_)  // e.g. JIT stack exhausted: the interpreter
      rc = pcre2_match(code, subject, s.size(), last_end, PCRE2_NO_JIT, st.md, st.mctx);
    if (rc == PCRE2_ERROR_NOMATCH) break;
    if (rc < 0) {
      PCRE2_UCHAR msg[256];
      pcre2_get_error_message(rc, msg, sizeof msg);
      throw TokenizerError(fmt::format("{}: PCRE2 match failed: {}", what_, reinterpret_cast<const char*>(msg)));
    }
    const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(st.md);
    const std::size_t b = ov[0], e = ov[1];
    if (b > e || e > s.size()) break;  // \K tricks; never in tokenizer files
    if (e == b && last_match_end && *last_match_end == e) {
      // Oniguruma's find_iter: no empty match right after the previous one; step one character.
      if (last_end >= s.size()) break;
      char32_t cp;
      last_end += utf8_next(s, last_end, cp);
      continue;
    }
    last_end = e;
    last_match_end = e;
    out.emplace_back(b, e);
  }
}

// ---- Pattern and split ----------------------------------------------------------

namespace {

using Spans = std::vector<std::tuple<std::size_t, std::size_t, bool>>;

// HF `impl Pattern for Fn(char) -> bool`: every matching char is its own match.
template <class Pred>
void find_chars(std::string_view s, Pred pred, Spans& out) {
  out.clear();
  if (s.empty()) {
    out.emplace_back(0, 0, false);
    return;
  }
  std::size_t last = 0, i = 0;
  while (i < s.size()) {
    char32_t cp;
    const std::size_t n = utf8_next(s, i, cp);
    if (pred(cp)) {
      if (last < i) out.emplace_back(last, i, false);
      out.emplace_back(i, i + n, true);
      last = i + n;
    }
    i += n;
  }
  if (last < s.size()) out.emplace_back(last, s.size(), false);
}

void spans_from_matches(std::string_view s, const std::vector<std::pair<std::size_t, std::size_t>>& m, Spans& out) {
  out.clear();
  if (s.empty()) {
    out.emplace_back(0, 0, false);
    return;
  }
  std::size_t prev = 0;
  for (auto [b, e] : m) {
    if (prev != b) out.emplace_back(prev, b, false);
    out.emplace_back(b, e, true);
    prev = e;
  }
  if (prev != s.size()) out.emplace_back(prev, s.size(), false);
}

// HF NormalizedString::split: apply `behavior` to the spans, then cut `p`
// (dropping removed and empty pieces, as PreTokenizedString::split does).
void split_piece(const Piece& p, Spans& spans, SplitBehavior behavior, std::vector<Piece>& out) {
  struct S {
    std::size_t b, e;
    bool remove;
  };
  std::vector<S> v;
  v.reserve(spans.size());
  switch (behavior) {
    case SplitBehavior::Isolated:
      for (auto& [b, e, m] : spans) v.push_back({b, e, false});
      break;
    case SplitBehavior::Removed:
      for (auto& [b, e, m] : spans) v.push_back({b, e, m});
      break;
    case SplitBehavior::Contiguous: {
      bool prev = false;
      for (auto& [b, e, m] : spans) {
        if (m == prev && !v.empty()) v.back().e = e;
        else v.push_back({b, e, false});
        prev = m;
      }
      break;
    }
    case SplitBehavior::MergedWithPrevious: {
      bool prev = false;
      for (auto& [b, e, m] : spans) {
        if (m && !prev && !v.empty()) v.back().e = e;
        else v.push_back({b, e, false});
        prev = m;
      }
      break;
    }
    case SplitBehavior::MergedWithNext: {
      bool prev = false;
      for (auto it = spans.rbegin(); it != spans.rend(); ++it) {
        auto& [b, e, m] = *it;
        if (m && !prev && !v.empty()) v.back().b = b;
        else v.push_back({b, e, false});
        prev = m;
      }
      std::reverse(v.begin(), v.end());
      break;
    }
  }
  for (const S& s : v) {
    if (s.remove || s.e <= s.b) continue;
    out.push_back({p.text.substr(s.b, s.e - s.b), p.at_origin && s.b == 0});
  }
}

}  // namespace

void Pattern::find(std::string_view s, Spans& out) const {
  if (regex) {
    thread_local std::vector<std::pair<std::size_t, std::size_t>> m;
    if (s.empty()) {
      out.assign(1, {0, 0, false});
    } else {
      regex->find_all(s, m);
      spans_from_matches(s, m, out);
    }
  } else if (literal.empty()) {
    out.assign(1, {0, s.size(), false});  // Rust: an empty pattern matches nothing
  } else {
    std::vector<std::pair<std::size_t, std::size_t>> m;
    for (std::size_t pos = s.find(literal); pos != std::string_view::npos; pos = s.find(literal, pos + literal.size()))
      m.emplace_back(pos, pos + literal.size());
    spans_from_matches(s, m, out);
  }
  if (invert)
    for (auto& t : out) std::get<2>(t) = !std::get<2>(t);
}

namespace {

std::string replace_all(std::string_view s, const Pattern& p, std::string_view content) {
  Spans spans;
  p.find(s, spans);
  std::string out;
  out.reserve(s.size());
  for (auto& [b, e, m] : spans) {
    if (m) out += content;
    else out.append(s.substr(b, e - b));
  }
  return out;
}

std::string utf8proc_normalize(const std::string& s, int options) {
  utf8proc_uint8_t* dst = nullptr;
  const auto n = utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(s.data()),
                              static_cast<utf8proc_ssize_t>(s.size()), &dst,
                              static_cast<utf8proc_option_t>(options));
  if (n < 0) {
    std::free(dst);
    return s;  // invalid UTF-8 cannot reach here (encode sanitizes); keep the text
  }
  std::string out(reinterpret_cast<const char*>(dst), static_cast<std::size_t>(n));
  std::free(dst);
  return out;
}

}  // namespace

// ---- Normalizer ------------------------------------------------------------------

void Normalizer::apply(std::string& s) const {
  switch (kind) {
    case Kind::Sequence:
      for (const auto& c : children) c.apply(s);
      break;
    case Kind::Prepend:
      if (!s.empty()) s.insert(0, text);
      break;
    case Kind::Replace:
      s = replace_all(s, pattern, text);
      break;
    case Kind::NFC:
      s = utf8proc_normalize(s, UTF8PROC_STABLE | UTF8PROC_COMPOSE);
      break;
    case Kind::NFD:
      s = utf8proc_normalize(s, UTF8PROC_STABLE | UTF8PROC_DECOMPOSE);
      break;
    case Kind::NFKC:
      s = utf8proc_normalize(s, UTF8PROC_STABLE | UTF8PROC_COMPOSE | UTF8PROC_COMPAT);
      break;
    case Kind::NFKD:
      s = utf8proc_normalize(s, UTF8PROC_STABLE | UTF8PROC_DECOMPOSE | UTF8PROC_COMPAT);
      break;
    case Kind::Lowercase: {
      std::string out;
      out.reserve(s.size());
      for (std::size_t i = 0; i < s.size();) {
        char32_t cp;
        i += utf8_next(s, i, cp);
        utf8_append(out, static_cast<char32_t>(utf8proc_tolower(static_cast<utf8proc_int32_t>(cp))));
      }
      s = std::move(out);
      break;
    }
    case Kind::Strip: {
      std::size_t b = 0, e = s.size();
      if (left) {
        while (b < e) {
          char32_t cp;
          const std::size_t n = utf8_next(s, b, cp);
          if (!uni_is_whitespace(cp)) break;
          b += n;
        }
      }
      if (right) {
        while (e > b) {
          std::size_t k = e - 1;
          while (k > b && (static_cast<unsigned char>(s[k]) & 0xC0) == 0x80) --k;
          char32_t cp;
          utf8_next(s, k, cp);
          if (!uni_is_whitespace(cp)) break;
          e = k;
        }
      }
      s = s.substr(b, e - b);
      break;
    }
    case Kind::StripAccents: {
      std::string out;
      out.reserve(s.size());
      for (std::size_t i = 0; i < s.size();) {
        char32_t cp;
        const std::size_t n = utf8_next(s, i, cp);
        const auto cat = utf8proc_category(static_cast<utf8proc_int32_t>(cp));  // Rust: is_combining_mark (M*)
        if (cat < UTF8PROC_CATEGORY_MN || cat > UTF8PROC_CATEGORY_ME) out.append(s, i, n);
        i += n;
      }
      s = std::move(out);
      break;
    }
  }
}

// ---- PreTokenizer ----------------------------------------------------------------

namespace {

const Regex& gpt2_regex() {
  static const Regex re(R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)",
                        "ByteLevel regex");
  return re;
}

template <class F>
void for_each_piece(std::vector<Piece>& pieces, F split) {
  std::vector<Piece> out;
  out.reserve(pieces.size() * 2);
  for (const Piece& p : pieces) split(p, out);
  pieces.swap(out);
}

}  // namespace

void PreTokenizer::apply(std::vector<Piece>& pieces) const {
  Spans spans;
  switch (kind) {
    case Kind::Sequence:
      for (const auto& c : children) c.apply(pieces);
      return;
    case Kind::ByteLevel: {
      std::vector<std::pair<std::size_t, std::size_t>> m;
      for_each_piece(pieces, [&](const Piece& p0, std::vector<Piece>& out) {
        Piece p = p0;
        if (add_prefix_space && (p.text.empty() || p.text[0] != ' ')) p.text.insert(0, " ");
        if (use_regex) {
          gpt2_regex().find_all(p.text, m);
          spans_from_matches(p.text, m, spans);
          split_piece(p, spans, SplitBehavior::Isolated, out);
        } else if (!p.text.empty()) {
          out.push_back(std::move(p));
        }
      });
      for (Piece& p : pieces) {
        std::string mapped;
        mapped.reserve(p.text.size() * 2);
        for (unsigned char c : p.text) mapped += byte_level_char(c);
        p.text = std::move(mapped);
      }
      return;
    }
    case Kind::Split:
      for_each_piece(pieces, [&](const Piece& p, std::vector<Piece>& out) {
        pattern.find(p.text, spans);
        split_piece(p, spans, behavior, out);
      });
      return;
    case Kind::Whitespace:
      for_each_piece(pieces, [&](const Piece& p, std::vector<Piece>& out) {
        pattern.find(p.text, spans);  // the \w+|[^\w\s]+ regex, inverted
        split_piece(p, spans, SplitBehavior::Removed, out);
      });
      return;
    case Kind::Digits:
      for_each_piece(pieces, [&](const Piece& p, std::vector<Piece>& out) {
        find_chars(p.text, uni_is_numeric, spans);
        split_piece(p, spans, individual_digits ? SplitBehavior::Isolated : SplitBehavior::Contiguous, out);
      });
      return;
    case Kind::WhitespaceSplit:
      for_each_piece(pieces, [&](const Piece& p, std::vector<Piece>& out) {
        find_chars(p.text, uni_is_whitespace, spans);
        split_piece(p, spans, SplitBehavior::Removed, out);
      });
      return;
    case Kind::Punctuation:
      for_each_piece(pieces, [&](const Piece& p, std::vector<Piece>& out) {
        find_chars(p.text, uni_is_punctuation, spans);
        split_piece(p, spans, behavior, out);
      });
      return;
    case Kind::CharDelimiterSplit:
      for_each_piece(pieces, [&](const Piece& p, std::vector<Piece>& out) {
        find_chars(p.text, [this](char32_t c) { return c == delimiter; }, spans);
        split_piece(p, spans, SplitBehavior::Removed, out);
      });
      return;
    case Kind::Metaspace: {
      Pattern space;
      space.literal = " ";
      char32_t rep = 0;
      utf8_next(replacement, 0, rep);
      for_each_piece(pieces, [&](const Piece& p0, std::vector<Piece>& out) {
        Piece p{replace_all(p0.text, space, replacement), p0.at_origin};
        const bool starts = p.text.compare(0, replacement.size(), replacement) == 0;
        if (!starts && (prepend == Prepend::Always || (prepend == Prepend::First && p.at_origin)))
          p.text.insert(0, replacement);
        if (split) {
          find_chars(p.text, [rep](char32_t c) { return c == rep; }, spans);
          split_piece(p, spans, SplitBehavior::MergedWithNext, out);
        } else if (!p.text.empty()) {
          out.push_back(std::move(p));
        }
      });
      return;
    }
  }
}

// ---- Decoder ------------------------------------------------------------------------

namespace {

int hex_value(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

// "<0xXX>" -> the byte (Rust: u8::from_str_radix on the two digits), else -1.
int byte_token_value(std::string_view t) {
  if (t.size() != 6 || t.compare(0, 3, "<0x") != 0 || t[5] != '>') return -1;
  const int h = hex_value(t[3]), l = hex_value(t[4]);
  return h < 0 || l < 0 ? -1 : h * 16 + l;
}

}  // namespace

void Decoder::apply(std::vector<std::string>& tokens) const {
  switch (kind) {
    case Kind::Sequence:
      for (const auto& c : children) c.apply(tokens);
      return;
    case Kind::Replace:
      for (auto& t : tokens) t = replace_all(t, pattern, text);
      return;
    case Kind::ByteFallback: {
      // Runs of <0xXX> tokens become their bytes (raw; Rust would give U+FFFD per
      // byte when the run is not valid UTF-8).
      std::vector<std::string> out;
      out.reserve(tokens.size());
      std::string bytes;
      for (auto& t : tokens) {
        const int b = byte_token_value(t);
        if (b >= 0) {
          bytes += static_cast<char>(b);
          continue;
        }
        if (!bytes.empty()) out.push_back(std::move(bytes)), bytes.clear();
        out.push_back(std::move(t));
      }
      if (!bytes.empty()) out.push_back(std::move(bytes));
      tokens.swap(out);
      return;
    }
    case Kind::Fuse: {
      std::string all;
      for (const auto& t : tokens) all += t;
      tokens.assign(1, std::move(all));
      return;
    }
    case Kind::Strip:
      for (auto& t : tokens) {
        std::vector<std::pair<std::size_t, char32_t>> cps;  // (byte offset, code point)
        for (std::size_t i = 0; i < t.size();) {
          char32_t cp;
          const std::size_t n = utf8_next(t, i, cp);
          cps.emplace_back(i, cp);
          i += n;
        }
        std::size_t start_cut = 0, stop_cut = cps.size();
        for (std::size_t i = 0; i < std::min(start, cps.size()) && cps[i].second == strip_char; ++i) start_cut = i + 1;
        for (std::size_t i = 0; i < std::min(stop, cps.size()); ++i) {
          const std::size_t k = cps.size() - 1 - i;
          if (cps[k].second != strip_char) break;
          stop_cut = k;
        }
        if (stop_cut < start_cut) stop_cut = start_cut;
        const std::size_t b = start_cut < cps.size() ? cps[start_cut].first : t.size();
        const std::size_t e = stop_cut < cps.size() ? cps[stop_cut].first : t.size();
        t = t.substr(b, e - b);
      }
      return;
    case Kind::ByteLevel: {
      // Every char of a token mapped back to its byte; a token with a char
      // outside the alphabet contributes its UTF-8 bytes unchanged (as Rust).
      std::string all;
      const auto& table = alphabet().bytes;
      for (const auto& t : tokens) {
        std::string bytes;
        bool ok = true;
        for (std::size_t i = 0; i < t.size();) {
          char32_t cp;
          std::size_t len = 0;
          if (utf8_check(t, i, len, cp) != 0) {
            ok = false;
            break;
          }
          auto it = table.find(cp);
          if (it == table.end()) {
            ok = false;
            break;
          }
          bytes += static_cast<char>(it->second);
          i += len;
        }
        all += ok ? bytes : t;
      }
      tokens.assign(1, std::move(all));
      return;
    }
    case Kind::Metaspace: {
      char32_t rep = 0;
      utf8_next(text, 0, rep);
      for (std::size_t k = 0; k < tokens.size(); ++k) {
        std::string out;
        const std::string& t = tokens[k];
        for (std::size_t i = 0; i < t.size();) {
          char32_t cp;
          const std::size_t n = utf8_next(t, i, cp);
          if (cp == rep && n == text.size() && t.compare(i, n, text) == 0) {
            if (!(k == 0 && prepend)) out += ' ';  // Rust drops every replacement of the first token
          } else {
            out.append(t, i, n);
          }
          i += n;
        }
        tokens[k] = std::move(out);
      }
      return;
    }
    case Kind::BPEDecoder:
      for (std::size_t k = 0; k < tokens.size(); ++k) {
        Pattern p;
        p.literal = text;
        tokens[k] = replace_all(tokens[k], p, k + 1 == tokens.size() ? "" : " ");
      }
      return;
  }
}

// ---- TokenTrie -----------------------------------------------------------------------

void TokenTrie::add(const std::string& s, int32_t value) {
  if (s.empty()) return;
  std::size_t node = 0;
  for (unsigned char c : s) {
    auto& next = nodes_[node].next;
    auto it = std::lower_bound(next.begin(), next.end(), c,
                               [](const std::pair<unsigned char, int32_t>& a, unsigned char b) { return a.first < b; });
    if (it != next.end() && it->first == c) {
      node = static_cast<std::size_t>(it->second);
    } else {
      const auto child = static_cast<int32_t>(nodes_.size());
      next.insert(it, {c, child});
      nodes_.emplace_back();
      node = static_cast<std::size_t>(child);
    }
  }
  if (nodes_[node].value < 0) nodes_[node].value = value;  // first one listed wins on duplicates
  first_[static_cast<unsigned char>(s[0])] = true;
}

std::size_t TokenTrie::longest_at(std::string_view s, std::size_t pos, int32_t& value) const {
  if (!first_[static_cast<unsigned char>(s[pos])]) return 0;
  std::size_t node = 0, best = 0;
  for (std::size_t i = pos; i < s.size(); ++i) {
    const auto& next = nodes_[node].next;
    const auto c = static_cast<unsigned char>(s[i]);
    auto it = std::lower_bound(next.begin(), next.end(), c,
                               [](const std::pair<unsigned char, int32_t>& a, unsigned char b) { return a.first < b; });
    if (it == next.end() || it->first != c) break;
    node = static_cast<std::size_t>(it->second);
    if (nodes_[node].value >= 0) {
      best = i + 1 - pos;
      value = nodes_[node].value;
    }
  }
  return best;
}

// ---- MergeTable ------------------------------------------------------------------------

void MergeTable::reserve(std::size_t n) {
  std::size_t cap = 16;
  unsigned bits = 4;
  while (cap < 2 * n + 16) cap <<= 1, ++bits;
  std::vector<Entry> old;
  old.swap(slots_);
  slots_.assign(cap, Entry{});
  mask_ = cap - 1;
  shift_ = 64 - bits;
  size_ = 0;
  for (const Entry& e : old)
    if (e.key != kEmpty)
      set(static_cast<int32_t>(e.key >> 32), static_cast<int32_t>(e.key & 0xFFFFFFFFu), e.rank, e.id, true);
}

void MergeTable::set(int32_t a, int32_t b, uint32_t rank, int32_t id, bool overwrite) {
  if (2 * (size_ + 1) > slots_.size()) reserve(2 * (size_ + 1));
  const uint64_t k = key(a, b);
  for (std::size_t i = (k * 0x9E3779B97F4A7C15ull) >> shift_;; i = (i + 1) & mask_) {
    Entry& e = slots_[i];
    if (e.key == k) {
      if (overwrite) e.rank = rank, e.id = id;
      return;
    }
    if (e.key == kEmpty) {
      e = {k, rank, id};
      ++size_;
      return;
    }
  }
}

// ---- BpeTokenizer ------------------------------------------------------------------------

void BpeTokenizer::finalize() {
  for (int b = 0; b < 256; ++b) {
    auto it = vocab.find(fmt::format("<0x{:02X}>", b));
    byte_ids_[b] = it == vocab.end() ? -1 : it->second;
  }
  if (special_ids.size() < id_to_token.size()) special_ids.resize(id_to_token.size(), false);
  raw_trie_ = TokenTrie();
  normalized_trie_ = TokenTrie();
  std::unordered_map<std::string, bool> special_content;
  for (std::size_t i = 0; i < added.size(); ++i) {
    AddedToken& t = added[i];
    if (t.special) special_content[t.content] = true;
    if (!t.matchable || t.content.empty()) continue;
    if (t.normalized) {
      std::string c = t.content;
      if (normalizer) normalizer->apply(c);
      normalized_trie_.add(c, static_cast<int32_t>(i));
      // The Rust library's id_to_token gives a normalized added token's
      // normalized content (TinyStories-656K: "<|start_story|>" decodes as
      // "▁<|start_story|>"), and decode skips an id only when that string is
      // a special token's content: such tokens are then decoded, not skipped.
      if (t.id >= 0 && static_cast<std::size_t>(t.id) < id_to_token.size())
        id_to_token[static_cast<std::size_t>(t.id)] = c;
    } else {
      raw_trie_.add(t.content, static_cast<int32_t>(i));
    }
  }
  for (std::size_t id = 0; id < id_to_token.size(); ++id)
    if (assigned[id] && special_content.count(id_to_token[id])) special_ids[id] = true;
  in_merge_.assign(id_to_token.size(), false);
  for (const auto& e : merges.slots()) {
    if (e.key == MergeTable::kEmpty) continue;
    const auto a = static_cast<std::size_t>(e.key >> 32), b = static_cast<std::size_t>(e.key & 0xFFFFFFFFu);
    if (a < in_merge_.size()) in_merge_[a] = true;
    if (b < in_merge_.size()) in_merge_[b] = true;
  }
}

namespace {

bool ends_with_word(std::string_view s) {
  if (s.empty()) return false;
  std::size_t k = s.size() - 1;
  while (k > 0 && (static_cast<unsigned char>(s[k]) & 0xC0) == 0x80) --k;
  char32_t cp;
  utf8_next(s, k, cp);
  return uni_is_word(cp);
}

bool starts_with_word(std::string_view s) {
  if (s.empty()) return false;
  char32_t cp;
  utf8_next(s, 0, cp);
  return uni_is_word(cp);
}

}  // namespace

// AddedVocabulary::find_matches + split_with_indices on every segment that is
// not already a token.
void BpeTokenizer::split_added(const TokenTrie& trie, std::vector<Segment>& segs) const {
  if (trie.empty()) return;
  std::vector<Segment> out;
  out.reserve(segs.size());
  for (Segment& seg : segs) {
    if (seg.id >= 0 || seg.text.empty()) {
      out.push_back(std::move(seg));
      continue;
    }
    const std::string& s = seg.text;
    std::size_t start_offset = 0;
    auto emit = [&](std::size_t b, std::size_t e, int32_t id) {
      out.push_back({s.substr(b, e - b), id, seg.at_origin && b == 0});
    };
    std::size_t pos = 0;
    while (pos < s.size()) {
      int32_t which = -1;
      const std::size_t len = trie.longest_at(s, pos, which);
      if (len == 0) {
        ++pos;
        continue;
      }
      std::size_t start = pos, stop = pos + len;
      pos = stop;  // the automaton's next search starts after this match, kept or not
      const AddedToken& tok = added[static_cast<std::size_t>(which)];
      if (tok.single_word) {
        const bool start_space = start == 0 || !ends_with_word(std::string_view(s).substr(0, start));
        const bool stop_space = stop == s.size() || !starts_with_word(std::string_view(s).substr(stop));
        if (!start_space || !stop_space) continue;
      }
      if (start < start_offset) continue;  // overlaps an rstrip-extended previous match
      if (tok.lstrip) {
        std::size_t b = start;
        while (b > 0) {
          std::size_t k = b - 1;
          while (k > 0 && (static_cast<unsigned char>(s[k]) & 0xC0) == 0x80) --k;
          char32_t cp;
          utf8_next(s, k, cp);
          if (!uni_is_whitespace(cp)) break;
          b = k;
        }
        start = std::max(b, start_offset);
      }
      if (tok.rstrip) {
        while (stop < s.size()) {
          char32_t cp;
          const std::size_t n = utf8_next(s, stop, cp);
          if (!uni_is_whitespace(cp)) break;
          stop += n;
        }
        pos = std::max(pos, stop);
      }
      if (start_offset < start) emit(start_offset, start, -1);
      emit(start, stop, tok.id);
      start_offset = stop;
    }
    if (start_offset < s.size()) emit(start_offset, s.size(), -1);
  }
  segs.swap(out);
}

void BpeTokenizer::bpe_word(const std::string& w, std::vector<int32_t>& out) const {
  if (w.empty()) return;
  if (ignore_merges) {
    auto it = vocab.find(w);
    if (it != vocab.end()) {
      out.push_back(it->second);
      return;
    }
  }
  constexpr std::size_t kCacheWordBytes = 256, kCacheEntries = 1 << 18;
  const bool cacheable = w.size() < kCacheWordBytes;
  if (cacheable) {
    std::lock_guard<std::mutex> lock(cache_mutex_);
    auto it = cache_.find(w);
    if (it != cache_.end()) {
      out.insert(out.end(), it->second.begin(), it->second.end());
      return;
    }
  }

  // BPE::merge_word: one symbol per char (with the continuing-subword prefix
  // and end-of-word suffix), byte fallback or (fused) unk for chars not in the
  // vocabulary.
  struct Sym {
    int32_t id, prev, next;
    bool alive;
  };
  std::vector<Sym> sym;
  sym.reserve(w.size());
  auto add = [&](int32_t id) {
    const auto n = static_cast<int32_t>(sym.size());
    if (n > 0) sym.back().next = n;
    sym.push_back({id, n - 1, -1, true});
  };
  int32_t pending_unk = -1;  // a pending (possibly fused) unk
  std::string s;
  for (std::size_t i = 0; i < w.size();) {
    char32_t cp;
    const std::size_t n = utf8_next(w, i, cp);
    const bool last = i + n >= w.size();
    s.clear();
    if (i > 0) s += continuing_subword_prefix;
    s.append(w, i, n);
    if (last) s += end_of_word_suffix;
    i += n;
    auto it = vocab.find(s);
    if (it != vocab.end()) {
      if (pending_unk >= 0) add(pending_unk), pending_unk = -1;
      add(it->second);
      continue;
    }
    if (byte_fallback) {
      bool all = true;
      for (unsigned char c : s) all = all && byte_ids_[c] >= 0;
      if (all) {
        // Rust adds these before a pending unk is flushed; so do we.
        for (unsigned char c : s) add(byte_ids_[c]);
        continue;
      }
    }
    if (unk_id) {
      if (pending_unk >= 0 && !fuse_unk) add(pending_unk);
      pending_unk = *unk_id;
    }
  }
  if (pending_unk >= 0) add(pending_unk);

  // Word::merge_all: lowest rank first, leftmost on ties; an entry is stale
  // when the pair at its position no longer merges into the same token.
  struct Merge {
    uint32_t rank;
    uint32_t pos;
    int32_t new_id;
  };
  auto later = [](const Merge& a, const Merge& b) { return a.rank != b.rank ? a.rank > b.rank : a.pos > b.pos; };
  std::priority_queue<Merge, std::vector<Merge>, decltype(later)> heap(later);
  // Symbols whose id is in no merge never merge: the runs between them are
  // independent words, merged one after the other with a small heap (a
  // SentencePiece-style file has no pre-tokenizer, so a whole text is one word).
  const std::size_t nsym = merges.empty() ? 0 : sym.size();
  for (std::size_t seg = 0; seg < nsym;) {
    std::size_t end = seg;
    while (end < nsym && in_merge_[static_cast<std::size_t>(sym[end].id)]) ++end;
    for (std::size_t k = seg; k + 1 < end; ++k) {
      if (const auto* m = merges.find(sym[k].id, sym[k + 1].id)) heap.push({m->rank, static_cast<uint32_t>(k), m->id});
    }
    seg = end + 1;
  while (!heap.empty()) {
    const Merge top = heap.top();
    heap.pop();
    Sym& L = sym[top.pos];
    if (!L.alive || L.next < 0) continue;
    Sym& R = sym[static_cast<std::size_t>(L.next)];
    const auto* cur = merges.find(L.id, R.id);
    if (!cur || cur->id != top.new_id) continue;
    L.id = top.new_id;
    R.alive = false;
    L.next = R.next;
    if (R.next >= 0) sym[static_cast<std::size_t>(R.next)].prev = static_cast<int32_t>(top.pos);
    if (L.prev >= 0) {
      if (const auto* m = merges.find(sym[static_cast<std::size_t>(L.prev)].id, L.id))
        heap.push({m->rank, static_cast<uint32_t>(L.prev), m->id});
    }
    if (L.next >= 0) {
      if (const auto* m = merges.find(L.id, sym[static_cast<std::size_t>(L.next)].id))
        heap.push({m->rank, top.pos, m->id});
    }
  }
  }
  const std::size_t first = out.size();
  for (const Sym& x : sym)
    if (x.alive) out.push_back(x.id);
  if (cacheable) {
    std::lock_guard<std::mutex> lock(cache_mutex_);
    if (cache_.size() < kCacheEntries) cache_.emplace(w, std::vector<int32_t>(out.begin() + first, out.end()));
  }
}

std::vector<int32_t> BpeTokenizer::encode(std::string_view text_in, bool add_special_tokens) const {
  std::string text = is_valid_utf8(text_in) ? std::string(text_in) : utf8_sanitize(text_in);
  std::vector<Segment> segs;
  segs.push_back({std::move(text), -1, true});
  // AddedVocabulary::extract_and_normalize: tokens matched on the raw text,
  // then each remaining segment normalized and matched against the
  // normalized forms of the "normalized" added tokens.
  split_added(raw_trie_, segs);
  if (normalizer)
    for (Segment& s : segs)
      if (s.id < 0) normalizer->apply(s.text);
  split_added(normalized_trie_, segs);

  std::vector<int32_t> ids;
  ids.reserve(text_in.size() / 3 + 8);
  std::vector<Piece> pieces;
  for (Segment& seg : segs) {
    if (seg.id >= 0) {
      ids.push_back(seg.id);
      continue;
    }
    if (seg.text.empty()) continue;
    pieces.clear();
    pieces.push_back({std::move(seg.text), seg.at_origin});
    if (pre_tokenizer) pre_tokenizer->apply(pieces);
    for (const Piece& p : pieces) bpe_word(p.text, ids);
  }
  if (!add_special_tokens || single_template.empty()) return ids;
  std::vector<int32_t> out;
  out.reserve(ids.size() + 4);
  for (const TemplatePiece& t : single_template) {
    if (t.sequence) out.insert(out.end(), ids.begin(), ids.end());
    else out.insert(out.end(), t.ids.begin(), t.ids.end());
  }
  return out;
}

std::string BpeTokenizer::run_decoder(std::vector<std::string> tokens) const {
  if (decoder) decoder->apply(tokens);
  std::string out;
  for (std::size_t i = 0; i < tokens.size(); ++i) {
    if (i > 0 && !decoder) out += ' ';  // Rust: no decoder = tokens joined with spaces
    out += tokens[i];
  }
  return out;
}

std::string BpeTokenizer::decode(const std::vector<int32_t>& ids) const {
  std::vector<std::string> tokens;
  tokens.reserve(ids.size());
  for (int32_t id : ids) {
    const auto k = static_cast<std::size_t>(id);
    if (id < 0 || k >= id_to_token.size() || !assigned[k] || is_special(id)) continue;
    tokens.push_back(id_to_token[k]);
  }
  return run_decoder(std::move(tokens));
}

std::string BpeTokenizer::decode_piece(int32_t prev, int32_t token) const {
  const auto k = static_cast<std::size_t>(token);
  if (token < 0 || k >= id_to_token.size() || !assigned[k] || is_special(token)) return {};
  const auto p = static_cast<std::size_t>(prev);
  if (prev < 0 || p >= id_to_token.size() || !assigned[p] || is_special(prev)) return run_decoder({id_to_token[k]});
  // What `token` adds after `prev`: decoders are per-token maps plus
  // first-token effects (Strip after Fuse, Metaspace), so the difference of the
  // two decodes is exact and the pieces concatenate to decode(ids).
  const std::string head = run_decoder({id_to_token[p]});
  const std::string both = run_decoder({id_to_token[p], id_to_token[k]});
  std::size_t common = 0;
  while (common < head.size() && common < both.size() && head[common] == both[common]) ++common;
  return both.substr(common);
}

// ---- GGUF "gpt2" vocabularies ------------------------------------------------------

std::vector<std::string> gguf_pre_regexes(std::string_view pre, bool& ignore_merges) {
  // llama.cpp (src/llama-vocab.cpp, llm_tokenizer_bpe): tokenizer.ggml.pre -> regexes applied in turn.
  static const std::string kGpt2 = R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S))";
  static const std::string kLlama3 =
      R"((?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
  static const std::string kQwen2 =
      R"((?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
  auto is = [&](std::initializer_list<std::string_view> names) {
    return std::find(names.begin(), names.end(), pre) != names.end();
  };
  ignore_merges = false;
  if (pre.empty() || pre == "default")
    return {R"([\p{P}\$\+<=>\^~\|]+)", kGpt2, R"(\p{N}+)", "[0-9][0-9][0-9]"};
  if (is({"llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2", "jina-v5-nano"})) {
    ignore_merges = true;
    return {kLlama3};
  }
  if (is({"dbrx", "smaug-bpe"})) return {kLlama3};
  if (is({"gpt2", "gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es", "jina-v2-de", "a.x-4.0", "mellum",
          "modern-bert", "jina-v1-en", "jina-v2-code", "roberta-bpe", "mpt", "olmo", "jais", "trillion",
          "granite-docling", "exaone4"}))
    return {kGpt2};
  if (is({"qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez", "stablelm2", "hunyuan", "solar-open"}))
    return {kQwen2};
  if (is({"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b", "mellum2"}))
    return {R"(\p{N})", kGpt2};
  if (is({"falcon"})) return {R"([\p{P}\$\+<=>\^~\|`]+)", kGpt2, "[0-9][0-9][0-9]"};
  if (is({"glm4", "chatglm-bpe"})) return {kLlama3};
  return {};
}

std::shared_ptr<BpeTokenizer> make_gguf_bpe(const BpeVocab& v) {
  const std::string& src = v.source;
  auto fail = [&](std::string_view field, std::string_view reason, auto got) -> void {
    throw TokenizerError(fmt::format("{}: {}: {} (got {})", src, field, reason, got));
  };
  if (v.tokens.empty()) fail("tokenizer.ggml.tokens", "must not be empty", "0 tokens");
  if (v.tokens.size() > static_cast<std::size_t>(INT32_MAX)) fail("tokenizer.ggml.tokens", "too many tokens", v.tokens.size());
  if (!v.token_types.empty() && v.token_types.size() != v.tokens.size())
    fail("tokenizer.ggml.token_type", fmt::format("must have one entry per token ({})", v.tokens.size()),
         fmt::format("{} entries", v.token_types.size()));
  auto tok = std::make_shared<BpeTokenizer>();
  BpeTokenizer& t = *tok;
  t.source = src;
  t.describe = "GGUF gpt2 (byte-level BPE)";
  t.gguf_pre = v.pre;
  const std::size_t n = v.tokens.size();
  t.id_to_token = v.tokens;
  t.assigned.assign(n, true);
  t.special_ids.assign(n, false);
  t.vocab.reserve(n * 2);
  for (std::size_t i = 0; i < n; ++i) t.vocab[v.tokens[i]] = static_cast<int32_t>(i);  // llama.cpp: the last id wins
  auto check = [&](const std::optional<int32_t>& id, const char* field) {
    if (id && (*id < 0 || static_cast<std::size_t>(*id) >= n))
      fail(field, fmt::format("must be a token id in [0, {})", n), *id);
  };
  check(v.bos_id, "tokenizer.ggml.bos_token_id");
  check(v.eos_id, "tokenizer.ggml.eos_token_id");
  check(v.unk_id, "tokenizer.ggml.unknown_token_id");
  for (std::size_t i = 0; i < v.token_types.size(); ++i) {
    const int32_t type = v.token_types[i];
    if (type < 0 || type > 6) fail(fmt::format("tokenizer.ggml.token_type[{}]", i), "must be in [0, 6]", type);
    if (type == 2 || type == 3) t.special_ids[i] = true;  // unknown, control: never from text, not decoded
    if (type == 4) {  // user-defined: matched in the text, decoded as written
      AddedToken a;
      a.content = v.tokens[i];
      a.id = static_cast<int32_t>(i);
      a.normalized = false;
      t.added.push_back(std::move(a));
    }
  }
  if (v.bos_id) t.special_ids[static_cast<std::size_t>(*v.bos_id)] = true;
  if (v.eos_id) t.special_ids[static_cast<std::size_t>(*v.eos_id)] = true;
  bool ignore_merges = false;
  const auto regexes = gguf_pre_regexes(v.pre, ignore_merges);
  if (regexes.empty())
    fail("tokenizer.ggml.pre", "unknown pre-tokenizer (posenc knows llama.cpp's default, gpt-2/gpt2, llama-bpe/llama3, "
         "qwen2, smollm and their aliases)", fmt::format("'{}'", v.pre));
  t.ignore_merges = ignore_merges;
  PreTokenizer seq;
  seq.kind = PreTokenizer::Kind::Sequence;
  for (std::size_t i = 0; i < regexes.size(); ++i) {
    PreTokenizer split;
    split.kind = PreTokenizer::Kind::Split;
    split.behavior = SplitBehavior::Isolated;
    split.pattern.regex = std::make_shared<Regex>(regexes[i], fmt::format("{}: tokenizer.ggml.pre '{}' regex {}", src, v.pre, i));
    seq.children.push_back(std::move(split));
  }
  PreTokenizer bl;
  bl.kind = PreTokenizer::Kind::ByteLevel;
  bl.add_prefix_space = false;
  bl.use_regex = false;
  seq.children.push_back(std::move(bl));
  t.pre_tokenizer = std::move(seq);
  Decoder d;
  d.kind = Decoder::Kind::ByteLevel;
  t.decoder = d;
  // Merges "a b" (llama.cpp splits at the first space after the first byte). A
  // merge naming a token the vocabulary lacks can never apply to an id
  // sequence and is skipped.
  t.merges.reserve(v.merges.size() * 2);
  for (std::size_t i = 0; i < v.merges.size(); ++i) {
    const std::string& m = v.merges[i];
    const std::size_t sp = m.find(' ', 1);
    if (sp == std::string::npos)
      fail(fmt::format("tokenizer.ggml.merges[{}]", i), "must be two tokens separated by a space", fmt::format("'{}'", m));
    const std::string a = m.substr(0, sp), b = m.substr(sp + 1);
    auto ia = t.vocab.find(a), ib = t.vocab.find(b), im = t.vocab.find(a + b);
    if (ia == t.vocab.end() || ib == t.vocab.end() || im == t.vocab.end()) continue;
    t.merges.set(ia->second, ib->second, static_cast<uint32_t>(i), im->second, false);  // llama.cpp: the first rank wins
  }
  if (v.add_bos) {
    if (!v.bos_id) fail("tokenizer.ggml.add_bos_token", "is true but there is no bos_token_id", "true");
    t.single_template.push_back({false, {*v.bos_id}});
  }
  if (v.add_bos || v.add_eos) t.single_template.push_back({true, {}});
  if (v.add_eos) {
    if (!v.eos_id) fail("tokenizer.ggml.add_eos_token", "is true but there is no eos_token_id", "true");
    t.single_template.push_back({false, {*v.eos_id}});
  }
  if (v.add_bos) t.bos = v.bos_id;
  t.eos = v.eos_id;
  t.finalize();
  return tok;
}

}  // namespace posenc::detail
