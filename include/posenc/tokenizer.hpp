// posenc — llama2.c's SentencePiece-style BPE tokenizer (tok512.bin, tokenizer.bin).
//
// File format (llama2.c tokenizer.py export): int32 max_token_length, then for
// each token: float32 score, int32 byte length, the bytes. The vocabulary size
// is not stored: it is the number of entries up to the end of the file, and
// must equal the model's vocab_size.
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

  int vocab_size() const { return static_cast<int>(pieces_.size()); }
  int max_token_length() const { return max_token_length_; }
  const std::string& piece(int32_t id) const;
  float score(int32_t id) const;

  /// Encodes UTF-8 text exactly as llama2.c's run.c encode(): optional BOS (id 1),
  /// the leading-space ("dummy prefix") token when text is non-empty, one token
  /// per UTF-8 code point found in the vocabulary (else byte-fallback tokens
  /// <0xXX> = byte + 3), then repeated merges of the adjacent pair whose
  /// concatenation is in the vocabulary with the highest score (leftmost on
  /// ties), optional EOS (id 2). Runs in O(n log n) with the same result as
  /// run.c's O(n^2) loop.
  std::vector<int32_t> encode(std::string_view text, bool bos, bool eos) const;

  /// The text of `token` as run.c's decode() prints it after `prev_token`:
  /// the leading space is dropped right after BOS; <0xXX> tokens give the raw byte.
  std::string_view decode(int32_t prev_token, int32_t token) const;

  /// Concatenated decode of a token sequence (BOS/EOS tokens produce no text).
  std::string decode(const std::vector<int32_t>& tokens) const;

 private:
  int32_t lookup(std::string_view s) const;
  int max_token_length_ = 0;
  std::vector<std::string> pieces_;
  std::vector<float> scores_;
  std::unordered_map<std::string_view, int32_t> index_;
  std::vector<std::string> byte_pieces_;  // 256 one-byte strings
  std::vector<int16_t> byte_of_token_;    // -1, or the byte a <0xXX> token stands for
};

}  // namespace posenc
