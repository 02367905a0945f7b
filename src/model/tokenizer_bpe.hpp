// posenc — the BPE engine behind tokenizer.json and GGUF "gpt2" vocabularies:
// added-token matching, normalizers, pre-tokenizers, the BPE model, the
// post-processor template and decoders, each following the Hugging Face
// `tokenizers` (Rust) component of the same name. tokenizer_json.cpp builds
// one from a tokenizer.json; make_gguf_bpe() from a GGUF BpeVocab.
//
// Strings are UTF-8 bytes. Text handed to encode() that is not valid UTF-8 has
// each invalid sequence replaced by U+FFFD first (the Rust library only
// accepts valid strings).
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "posenc/tokenizer.hpp"

namespace posenc::detail {

// ---- UTF-8 and Unicode properties (utf8proc) --------------------------------

/// Decodes the code point at s[i]; returns its byte length (>= 1). Invalid
/// bytes decode as U+FFFD with length 1.
std::size_t utf8_next(std::string_view s, std::size_t i, char32_t& cp);
void utf8_append(std::string& out, char32_t cp);
/// `s` with every invalid UTF-8 sequence replaced by U+FFFD (as Rust's from_utf8_lossy).
std::string utf8_sanitize(std::string_view s);
bool is_valid_utf8(std::string_view s);
bool uni_is_whitespace(char32_t c);   // Rust char::is_whitespace (White_Space)
bool uni_is_numeric(char32_t c);      // Rust char::is_numeric (Nd, Nl, No)
bool uni_is_punctuation(char32_t c);  // ASCII punctuation or P*
bool uni_is_word(char32_t c);         // Rust regex \w (Alphabetic, M, Nd, Pc, Join_Control)

// ---- PCRE2 regex --------------------------------------------------------------

/// A compiled PCRE2 pattern (UTF + UCP, JIT when available). Throws
/// TokenizerError "<what>: ..." with PCRE2's message and offset on a bad pattern.
class Regex {
 public:
  Regex(std::string_view pattern, std::string_view what);
  ~Regex();
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;
  /// Non-overlapping matches [start, end) in s, left to right, as Oniguruma's
  /// find_iter yields them (an empty match right after the previous match is
  /// skipped).
  void find_all(std::string_view s, std::vector<std::pair<std::size_t, std::size_t>>& out) const;

 private:
  void* code_ = nullptr;  // pcre2_code_8*
  bool jit_ = false;
  std::string what_;
};

// ---- pipeline pieces ------------------------------------------------------------

/// A pre-token: text, and whether it starts at offset 0 of the original
/// input (Metaspace prepend_scheme "first").
struct Piece {
  std::string text;
  bool at_origin = false;
};

/// A split pattern: literal string or regex (with Invert).
struct Pattern {
  std::string literal;
  std::shared_ptr<Regex> regex;
  bool invert = false;
  /// HF Pattern::find_matches: contiguous (start, end, is_match) spans covering s.
  void find(std::string_view s, std::vector<std::tuple<std::size_t, std::size_t, bool>>& out) const;
};

enum class SplitBehavior { Removed, Isolated, MergedWithPrevious, MergedWithNext, Contiguous };

struct Normalizer {
  enum class Kind { Sequence, Prepend, Replace, NFC, NFD, NFKC, NFKD, Lowercase, Strip, StripAccents };
  Kind kind = Kind::Sequence;
  std::string text;     // Prepend: prepend; Replace: content
  Pattern pattern;      // Replace
  bool left = false, right = false;  // Strip
  std::vector<Normalizer> children;  // Sequence
  void apply(std::string& s) const;
};

struct PreTokenizer {
  enum class Kind { Sequence, ByteLevel, Split, Digits, Metaspace, Whitespace, WhitespaceSplit, Punctuation,
                    CharDelimiterSplit };
  Kind kind = Kind::Sequence;
  bool add_prefix_space = false, use_regex = true;  // ByteLevel
  Pattern pattern;                                  // Split (and ByteLevel/Whitespace regexes)
  SplitBehavior behavior = SplitBehavior::Isolated; // Split, Punctuation
  bool individual_digits = false;                   // Digits
  std::string replacement = "\xe2\x96\x81";         // Metaspace
  enum class Prepend { Always, First, Never } prepend = Prepend::Always;
  bool split = true;                                // Metaspace
  char32_t delimiter = 0;                           // CharDelimiterSplit
  std::vector<PreTokenizer> children;               // Sequence
  void apply(std::vector<Piece>& pieces) const;
};

struct Decoder {
  enum class Kind { Sequence, Replace, ByteFallback, Fuse, Strip, ByteLevel, Metaspace, BPEDecoder };
  Kind kind = Kind::Sequence;
  Pattern pattern;           // Replace
  std::string text;          // Replace: content; Metaspace: replacement; BPEDecoder: suffix
  char32_t strip_char = ' '; // Strip
  std::size_t start = 0, stop = 0;
  bool prepend = true;       // Metaspace: prepend_scheme != never
  std::vector<Decoder> children;
  /// HF decode_chain over tokens; byte-producing decoders give raw bytes (no U+FFFD).
  void apply(std::vector<std::string>& tokens) const;
};

struct AddedToken {
  std::string content;
  int32_t id = -1;
  bool single_word = false, lstrip = false, rstrip = false, normalized = true, special = false;
  bool matchable = true;  ///< matched in the text (GGUF control tokens are not)
};

/// Leftmost-longest matcher over a set of strings (Aho-Corasick MatchKind::LeftmostLongest).
class TokenTrie {
 public:
  void add(const std::string& s, int32_t value);
  bool empty() const { return nodes_.size() <= 1; }
  /// Longest entry starting at s[pos]: its length and value, or 0.
  std::size_t longest_at(std::string_view s, std::size_t pos, int32_t& value) const;

 private:
  struct Node {
    std::vector<std::pair<unsigned char, int32_t>> next;  // sorted by byte
    int32_t value = -1;
  };
  std::vector<Node> nodes_ = std::vector<Node>(1);
  bool first_[256] = {};
};

/// One item of a TemplateProcessing `single` template: special ids, or the sequence.
struct TemplatePiece {
  bool sequence = false;
  std::vector<int32_t> ids;
};

/// Merge pairs (left id, right id) -> (rank, merged id): open addressing with
/// linear probing (the hot lookup of BPE).
class MergeTable {
 public:
  struct Entry {
    uint64_t key = kEmpty;
    uint32_t rank = 0;
    int32_t id = -1;
  };
  static uint64_t key(int32_t a, int32_t b) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b);
  }
  void reserve(std::size_t n);
  /// Inserts; an existing pair is overwritten when `overwrite` (else kept).
  void set(int32_t a, int32_t b, uint32_t rank, int32_t id, bool overwrite);
  const Entry* find(int32_t a, int32_t b) const {
    if (slots_.empty()) return nullptr;
    const uint64_t k = key(a, b);
    for (std::size_t i = (k * 0x9E3779B97F4A7C15ull) >> shift_;; i = (i + 1) & mask_) {
      const Entry& e = slots_[i];
      if (e.key == k) return &e;
      if (e.key == kEmpty) return nullptr;
    }
  }
  bool empty() const { return size_ == 0; }
  std::size_t size() const { return size_; }
  const std::vector<Entry>& slots() const { return slots_; }
  static constexpr uint64_t kEmpty = ~0ull;

 private:
  std::vector<Entry> slots_;
  std::size_t size_ = 0, mask_ = 0;
  unsigned shift_ = 64;
};

// ---- the tokenizer -------------------------------------------------------------

class BpeTokenizer {
 public:
  // Configuration (filled by the tokenizer.json parser or make_gguf_bpe, then finalize()).
  std::string source;
  std::string describe;
  std::vector<std::string> id_to_token;  // model vocab + added tokens; "" for unassigned ids
  std::vector<bool> assigned;
  std::unordered_map<std::string, int32_t> vocab;  // model vocab: token -> id
  MergeTable merges;  // (left id, right id) -> (rank, merged id)
  std::optional<int32_t> unk_id;
  bool byte_fallback = false, fuse_unk = false, ignore_merges = false;
  std::string continuing_subword_prefix, end_of_word_suffix;
  std::vector<AddedToken> added;  // in file order
  std::optional<Normalizer> normalizer;
  std::optional<PreTokenizer> pre_tokenizer;
  std::optional<Decoder> decoder;
  std::vector<TemplatePiece> single_template;  // empty: no special tokens added
  std::optional<int32_t> bos, eos;
  bool prefix_space = false;
  std::string gguf_pre;  ///< GGUF gpt2 vocabularies: tokenizer.ggml.pre (kept for re-export)
  /// GGUF vocabularies: token attributes following llama.cpp (special = control or unknown type).
  std::vector<bool> special_ids;  // filled by finalize(): ids skipped by decode

  /// Builds the derived tables (added-token tries, byte-fallback ids, special set).
  void finalize();

  std::vector<int32_t> encode(std::string_view text, bool add_special_tokens) const;
  std::string decode(const std::vector<int32_t>& ids) const;
  std::string decode_piece(int32_t prev, int32_t token) const;
  bool is_special(int32_t id) const {
    return id >= 0 && static_cast<std::size_t>(id) < special_ids.size() && special_ids[static_cast<std::size_t>(id)];
  }

 private:
  struct Segment {
    std::string text;
    int32_t id = -1;  // an added token
    bool at_origin = false;
  };
  void split_added(const TokenTrie& trie, std::vector<Segment>& segs) const;
  void bpe_word(const std::string& word, std::vector<int32_t>& out) const;
  std::string run_decoder(std::vector<std::string> tokens) const;
  TokenTrie raw_trie_, normalized_trie_;
  int32_t byte_ids_[256];
  std::vector<bool> in_merge_;  // id appears in some merge pair
  mutable std::mutex cache_mutex_;
  mutable std::unordered_map<std::string, std::vector<int32_t>> cache_;
};

/// Parses a tokenizer.json (and optional tokenizer_config.json) into an engine.
/// Throws TokenizerError naming `source` and the field.
std::shared_ptr<BpeTokenizer> parse_tokenizer_json(std::string_view json, std::string_view source,
                                                   std::string_view config_json);
/// A GGUF "gpt2" vocabulary (see BpeVocab). Throws TokenizerError naming vocab.source and the field.
std::shared_ptr<BpeTokenizer> make_gguf_bpe(const BpeVocab& vocab);
/// llama.cpp's pre-tokenizer regexes for tokenizer.ggml.pre (llama-vocab.cpp); empty when unknown.
std::vector<std::string> gguf_pre_regexes(std::string_view pre, bool& ignore_merges);

/// GPT-2's byte-to-unicode alphabet: the UTF-8 string each byte maps to.
const std::string& byte_level_char(unsigned char b);

}  // namespace posenc::detail
