// posenc — tokenizers: llama2.c's SentencePiece-style BPE (tok512.bin,
// tokenizer.bin) and the symbol vocabularies of posenc's synthetic-task models.
//
// llama2.c file format (tokenizer.py export): int32 max_token_length, then for
// each token: float32 score, int32 byte length, the bytes. The vocabulary size
// is not stored: it is the number of entries up to the end of the file, and
// must equal the model's vocab_size.
//
// Symbol vocabularies: a list of whitespace-free symbols where ids 0, 1, 2 are
// "<pad>", "<bos>", "<eos>"; text is a whitespace-separated sequence of
// symbols (e.g. "3 7 + 1 2 =").
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace posenc {

class Tokenizer {
 public:
  static constexpr int32_t kUnk = 0;
  static constexpr int32_t kBos = 1;
  static constexpr int32_t kEos = 2;

  /// Loads a llama2.c tokenizer file. If expected_vocab_size is given, the
  /// number of entries must equal it. Throws IoError (unreadable),
  /// TokenizerError (truncated entry, negative/oversized length, non-finite
  /// score, empty file, vocabulary size mismatch — naming the field and value).
  static Tokenizer load_llama2c(const std::filesystem::path& path,
                                std::optional<int> expected_vocab_size = std::nullopt);

  /// A symbol vocabulary (see above). Throws TokenizerError if fewer than 4
  /// symbols, ids 0..2 are not "<pad>", "<bos>", "<eos>", a symbol is empty,
  /// contains whitespace or is listed twice.
  static Tokenizer from_symbols(std::vector<std::string> symbols);
  bool is_symbolic() const { return symbolic_; }

  int vocab_size() const { return static_cast<int>(pieces_.size()); }
  int max_token_length() const { return max_token_length_; }
  const std::string& piece(int32_t id) const;
  float score(int32_t id) const;

  /// Symbol vocabularies: optional BOS, one id per whitespace-separated symbol
  /// (TokenizerError naming an unknown symbol), optional EOS.
  /// llama2.c vocabularies: encodes UTF-8 text exactly as run.c's encode(): optional BOS (id 1),
  /// the leading-space ("dummy prefix") token when text is non-empty, one token
  /// per UTF-8 code point found in the vocabulary (else byte-fallback tokens
  /// <0xXX> = byte + 3), then repeated merges of the adjacent pair whose
  /// concatenation is in the vocabulary with the highest score (leftmost on
  /// ties), optional EOS (id 2). Runs in O(n log n) with the same result as
  /// run.c's O(n^2) loop.
  std::vector<int32_t> encode(std::string_view text, bool bos, bool eos) const;

  /// The text of `token` as run.c's decode() prints it after `prev_token`:
  /// the leading space is dropped right after BOS; <0xXX> tokens give the raw byte.
  /// Symbol vocabularies: the symbol, preceded by a space unless it follows BOS
  /// or starts the text (prev_token < 0).
  std::string_view decode(int32_t prev_token, int32_t token) const;

  /// Concatenated decode of a token sequence (BOS/EOS tokens produce no text).
  std::string decode(const std::vector<int32_t>& tokens) const;

 private:
  int32_t lookup(std::string_view s) const;
  bool symbolic_ = false;
  int max_token_length_ = 0;
  std::vector<std::string> pieces_;
  std::vector<float> scores_;
  struct Hash {
    using is_transparent = void;
    std::size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
  };
  // Owns its keys, so copies of a Tokenizer are independent.
  std::unordered_map<std::string, int32_t, Hash, std::equal_to<>> index_;
  std::vector<std::string> byte_pieces_;  // 256 one-byte strings
  std::vector<int16_t> byte_of_token_;    // -1, or the byte a <0xXX> token stands for
  std::vector<std::string> spaced_;       // symbol vocabularies: " " + symbol
};

}  // namespace posenc
