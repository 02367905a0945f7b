// posenc — tokenizers: llama2.c's SentencePiece-style BPE (tok512.bin,
// tokenizer.bin), Hugging Face tokenizer.json BPE models (SentencePiece-style
// with byte_fallback, and byte-level), the vocabularies GGUF files embed, and
// the symbol vocabularies of posenc's synthetic-task models.
//
// llama2.c file format (tokenizer.py export): int32 max_token_length, then for
// each token: float32 score, int32 byte length, the bytes. The vocabulary size
// is not stored: it is the number of entries up to the end of the file, and
// must equal the model's vocab_size.
//
// tokenizer.json (Hugging Face `tokenizers`, the Rust library transformers
// uses): model BPE with merges in either form ("a b" or ["a", "b"]),
// byte_fallback, added/special tokens (matched in the text before
// normalization, longest first), normalizers Prepend/Replace/NFC/Sequence,
// pre-tokenizers ByteLevel (GPT-2 regex), Split (PCRE2 regex), Digits,
// Metaspace, Sequence (also NFD/NFKC/NFKD, Lowercase, Strip, StripAccents,
// Whitespace, WhitespaceSplit, Punctuation, CharDelimiterSplit); post-processor
// TemplateProcessing / ByteLevel / Sequence / Bert- and RobertaProcessing;
// decoders Replace/ByteFallback/Fuse/Strip/ByteLevel/Metaspace/BPEDecoder.
// Regexes run on PCRE2 (UTF + UCP), normalization on utf8proc. Encoding
// equals the Rust library (tokenizers 0.23.2) id for id
// (tests/model/data/hf_tokenizers/, tools/refs/hf_tokenizers_refs.mjs);
// decode(ids) equals its decode(ids, skip_special_tokens=true) except that
// bytes which are not valid UTF-8 stay raw bytes (the library prints U+FFFD).
// Text that is not valid UTF-8 is encoded as if each invalid sequence were
// U+FFFD (the library only accepts valid strings). truncation/padding and BPE
// dropout in a file are ignored. WordPiece and Unigram models are refused
// with a TokenizerError naming them.
//
// Symbol vocabularies: a list of whitespace-free symbols where ids 0, 1, 2 are
// "<pad>", "<bos>", "<eos>"; text is a whitespace-separated sequence of
// symbols (e.g. "3 7 + 1 2 =").
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <variant>
#include <vector>

namespace posenc {

namespace detail {
class BpeTokenizer;  // tokenizer.json / GGUF gpt2 BPE engine (src/model/tokenizer_bpe.*)
}

/// A SentencePiece-style vocabulary with scores, as GGUF embeds it
/// (tokenizer.ggml.model = "llama"): pieces use U+2581 for spaces, byte pieces
/// are "<0xXX>", token_type follows llama.cpp (1 normal, 2 unknown, 3 control,
/// 4 user-defined, 5 unused, 6 byte). Encoded as llama.cpp's SPM tokenizer
/// (llm_tokenizer_spm): spaces -> U+2581, a U+2581 prefix when
/// add_space_prefix, then merges of the adjacent pair whose concatenation has
/// the highest score (leftmost on ties), byte fallback for pieces not in the
/// vocabulary (unk_id if a byte piece is missing too). User-defined pieces
/// (type 4) are cut out of the text first, longest first, and the text after
/// one gets the U+2581 prefix again; control pieces are never produced from
/// text (llama.cpp with parse_special = false). Equal to llama-tokenize
/// (llama.cpp de3ff81) on stories260K.gguf (tests/model/data/llama_cpp/).
struct SentencePieceVocab {
  std::vector<std::string> pieces;
  std::vector<float> scores;        ///< same size as pieces
  std::vector<int32_t> token_types; ///< same size as pieces, or empty (all normal)
  std::optional<int32_t> bos_id, eos_id, unk_id;
  bool add_bos = true;
  bool add_eos = false;
  bool add_space_prefix = true;
  std::string source;  ///< for messages (file name)
};

/// A byte-level BPE vocabulary with merges, as GGUF embeds it
/// (tokenizer.ggml.model = "gpt2"): tokens in GPT-2's byte-to-unicode
/// alphabet, merges as "a b", `pre` = tokenizer.ggml.pre naming the
/// pre-tokenizer regexes as llama.cpp's llm_tokenizer_bpe does ("default" or
/// "", "gpt-2" (alias "gpt2"), "llama-bpe"/"llama3" (with ignore_merges),
/// "qwen2", "smollm", and their llama.cpp aliases; an unknown name is a
/// TokenizerError naming it). Control/unknown tokens (types 3, 2) are never
/// matched in text and not decoded; user-defined ones (4) are matched first.
/// add_bos / add_eos are used as given (llama.cpp defaults add_bos to true for
/// llama-bpe when the GGUF has no tokenizer.ggml.add_bos_token: the reader
/// must apply that).
struct BpeVocab {
  std::vector<std::string> tokens;
  std::vector<std::string> merges;
  std::vector<int32_t> token_types;  ///< llama.cpp token types, or empty
  std::string pre = "default";
  std::optional<int32_t> bos_id, eos_id, unk_id;
  bool add_bos = false;
  bool add_eos = false;
  std::string source;
};

class Tokenizer {
 public:
  /// The fixed ids of llama2.c and symbol vocabularies. Other tokenizers
  /// have their own: use bos_id() / eos_id().
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

  /// Loads a Hugging Face tokenizer.json; a tokenizer_config.json in the same
  /// directory supplies add_bos_token / add_eos_token when present (as
  /// transformers' LlamaTokenizerFast does: the template becomes [bos_token]
  /// $A [eos_token]), and eos_token for eos_id(). Throws IoError (unreadable),
  /// TokenizerError naming the file and field: malformed JSON, a model type
  /// other than BPE ("model.type: WordPiece is not supported ..."), a merge
  /// naming a token not in the vocabulary, an unknown normalizer /
  /// pre-tokenizer / decoder type, a regex PCRE2 rejects, duplicate ids.
  static Tokenizer load_tokenizer_json(const std::filesystem::path& path);
  /// Same from JSON text; `tokenizer_config_json` empty = none.
  static Tokenizer from_tokenizer_json(std::string_view json, std::string_view source,
                                       std::string_view tokenizer_config_json = {});
  /// GGUF-embedded vocabularies (see SentencePieceVocab, BpeVocab). Throw
  /// TokenizerError naming `source` and the field. A SentencePiece vocabulary
  /// whose scores are all equal cannot reproduce any merge order (llama.cpp
  /// then tokenizes wrongly): it loads, but encode() throws TokenizerError
  /// saying so and naming the model's Hugging Face tokenizer.json to use
  /// instead; see usable().
  static Tokenizer from_sentencepiece_vocab(SentencePieceVocab vocab);
  static Tokenizer from_bpe_vocab(BpeVocab vocab);

  /// "llama2.c", "symbols", "tokenizer.json BPE (SentencePiece-style, byte_fallback)",
  /// "tokenizer.json BPE (byte-level)", "GGUF llama (SentencePiece scores)",
  /// "GGUF gpt2 (byte-level BPE)".
  std::string describe() const;
  /// false when encode() would throw for any non-empty text (see
  /// from_sentencepiece_vocab); unusable_reason() says why, starting with the
  /// file the vocabulary came from, and which tokenizer to use instead (how
  /// to pass it is the front end's: the CLI's --tokenizer, Python's
  /// tokenizer=).
  bool usable() const;
  const std::string& unusable_reason() const;

  /// The token placed first when special tokens are added (llama2.c: 1;
  /// tokenizer.json: the post-processor template's leading special token, or
  /// tokenizer_config's bos_token when add_bos_token; GGUF:
  /// tokenizer.ggml.bos_token_id when add_bos_token). nullopt: none (GPT-2).
  std::optional<int32_t> bos_id() const;
  /// The end-of-text token generation stops at (llama2.c: 2; tokenizer.json:
  /// tokenizer_config eos_token, else "</s>", "<|endoftext|>", "<|im_end|>" or
  /// "<|end_of_text|>" when present as added tokens; GGUF eos_token_id).
  std::optional<int32_t> eos_id() const;
  /// True when encode("x") begins with a token carrying a leading-space marker
  /// that the text did not have (llama2.c's dummy prefix, SentencePiece-style
  /// Prepend("▁"), Metaspace prepend, ByteLevel add_prefix_space): callers
  /// that concatenate separately encoded pieces need to know.
  bool adds_prefix_space() const;
  /// True for ids that are special tokens (BOS/EOS/control/added special):
  /// decode() skips them. tokenizer.json: exactly the ids the Rust library's
  /// decode(ids, skip_special_tokens=true) skips, i.e. added tokens marked
  /// special whose id_to_token string is their content; a "normalized" special
  /// token under a normalizer that changes it (TinyStories-656K's
  /// <|start_story|>, decoded as "\u2581<|start_story|>") is not skipped there,
  /// so it is not special here either.
  bool is_special(int32_t id) const;
  /// Id of an exact vocabulary entry (piece), or nullopt.
  std::optional<int32_t> token_id(std::string_view piece) const;

  /// This vocabulary as a GGUF file embeds it (for `posenc convert`):
  ///  - llama2.c, GGUF llama, symbol vocabularies and SentencePiece-style
  ///    tokenizer.json (byte_fallback, "▁" for spaces): a SentencePieceVocab
  ///    (spaces as U+2581; token types 1 normal, 2 unknown, 3 control, 6 byte).
  ///    A tokenizer.json's merges become scores: the token that merge rank r
  ///    makes scores -r (the lowest rank that makes it), so llama.cpp's
  ///    highest-score-first merging follows the merge order; multi-character
  ///    tokens no merge makes score -1e9.
  ///  - byte-level BPE (tokenizer.json ByteLevel, GGUF gpt2): a BpeVocab with
  ///    merges in rank order and `pre` = "gpt2" (a plain GPT-2 ByteLevel
  ///    pre-tokenizer) or the GGUF file's own name.
  /// Throws TokenizerError for a byte-level tokenizer.json whose pre-tokenizer
  /// has no llama.cpp name posenc knows (Split/Digits sequences).
  std::variant<SentencePieceVocab, BpeVocab> gguf_vocabulary() const;

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
  /// tokenizer.json / GGUF: encode_hf(text, false), then bos_id() prepended
  /// when bos and eos_id() appended when eos (each only if the tokenizer has one).
  std::vector<int32_t> encode(std::string_view text, bool bos, bool eos) const;

  /// Hugging Face semantics, Tokenizer.encode(text, add_special_tokens):
  /// added tokens in the text are matched first, then normalize,
  /// pre-tokenize, BPE; with add_special_tokens the post-processor's template
  /// (or add_bos/add_eos) adds its special tokens. llama2.c and symbol
  /// vocabularies: encode(text, add_special_tokens, false).
  std::vector<int32_t> encode_hf(std::string_view text, bool add_special_tokens) const;

  /// The text of `token` as run.c's decode() prints it after `prev_token`:
  /// the leading space is dropped right after BOS; <0xXX> tokens give the raw byte.
  /// Symbol vocabularies: the symbol, preceded by a space unless it follows BOS
  /// or starts the text (prev_token < 0).
  /// tokenizer.json / GGUF: the bytes `token` adds to the decoded text after
  /// `prev_token` (prev_token < 0 or a special token: the token starts the
  /// text, so the decoder's Strip / prefix-space removal applies); special
  /// tokens give "". Byte-level and byte_fallback tokens give raw bytes, so
  /// a piece can be part of a UTF-8 character; concatenating the pieces of a
  /// sequence gives decode(tokens) (for tokenizer.json, as long as no special
  /// token follows the first token: decode(tokens) drops specials before its
  /// decoder runs, so a Strip there applies to the first token only).
  std::string decode(int32_t prev_token, int32_t token) const;

  /// Concatenated decode of a token sequence; special tokens (BOS/EOS and, for
  /// tokenizer.json, added special tokens) produce no text, as Hugging Face's
  /// decode(ids, skip_special_tokens=True).
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
  std::shared_ptr<const detail::BpeTokenizer> bpe_;  // tokenizer.json / GGUF gpt2 (all calls go there)
  // GGUF llama vocabularies use this class's SPM engine with these ids.
  std::optional<int32_t> bos_, eos_, unk_;
  bool add_bos_ = true;
  std::string describe_ = "llama2.c";
  std::string unusable_;
  bool spm_gguf_ = false;            // spaces -> U+2581, byte fallback through <0xXX> pieces, llama.cpp merges
  bool add_eos_ = false, add_space_prefix_ = true;
  std::vector<int32_t> byte_token_;  // GGUF llama: id for each byte (<0xXX> piece), or -1
  std::vector<bool> special_;        // GGUF llama: control/unknown/BOS/EOS ids (never from text, not decoded)
  std::vector<int32_t> user_defined_;  // GGUF llama: user-defined ids, matched in the text first, longest first
  void spm_encode(std::string_view text, bool prefix, std::vector<int32_t>& out) const;
};

/// A tokenizer file chosen by its content: a directory holding tokenizer.json,
/// a GGUF file (magic "GGUF", or named *.gguf: its embedded tokenizer.ggml.*
/// vocabulary, as when it is the model), a tokenizer.json (text starting with
/// '{'), or else a llama2.c tokenizer .bin. `what` prefixes the messages
/// ("--tokenizer" for the CLI, "tokenizer" for the Python package). Throws
/// IoError (unreadable, or a directory without tokenizer.json), CheckpointError
/// (a malformed GGUF), TokenizerError (a posenc checkpoint given as a
/// tokenizer, a GGUF without an embedded tokenizer, or a malformed tokenizer;
/// a file read as llama2.c says so in its message).
/// The rule of every command's --tokenizer and of Model.load(tokenizer=...).
Tokenizer load_tokenizer_from_path(const std::filesystem::path& path, std::string_view what);

/// Checks that `tok` can be used with a model of `model_vocab_size` ids: a llama2.c vocabulary is the model's whole
/// vocabulary (equal sizes); a tokenizer.json may have fewer ids than a model whose embedding is padded, never
/// more. Throws TokenizerError("<tok_source>: vocab_size N does not match|fit the model's vocab_size V (<model>)").
/// The rule of every command's --tokenizer and of the Python package's Model.load(tokenizer=...).
void require_tokenizer_fits(const Tokenizer& tok, int64_t model_vocab_size, std::string_view tok_source,
                            std::string_view model);

}  // namespace posenc
