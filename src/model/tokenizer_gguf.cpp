// Tokenizer::gguf_vocabulary: a tokenizer as GGUF's tokenizer.ggml.* keys hold it.
#include <algorithm>
#include <cstdio>
#include <limits>

#include <fmt/format.h>

#include "model/tokenizer_bpe.hpp"
#include "posenc/error.hpp"
#include "posenc/tokenizer.hpp"

namespace posenc {

namespace {

constexpr std::string_view kSpace = "\xe2\x96\x81";  // U+2581

// llama.cpp token types (llama-vocab.h, LLAMA_TOKEN_TYPE_*).
constexpr int32_t kNormal = 1, kUnknown = 2, kControl = 3, kByte = 6;

bool is_byte_piece(const std::string& p) {
  unsigned v = 0;
  return p.size() == 6 && p.compare(0, 3, "<0x") == 0 && p[5] == '>' && std::isxdigit(static_cast<unsigned char>(p[3])) &&
         std::isxdigit(static_cast<unsigned char>(p[4])) && std::sscanf(p.c_str() + 3, "%2X", &v) == 1;
}

std::string spaces_to_meta(const std::string& s) {
  std::string o;
  for (char c : s) {
    if (c == ' ')
      o += kSpace;
    else
      o += c;
  }
  return o;
}

bool normalizer_has_meta_replace(const detail::Normalizer& n) {
  if (n.kind == detail::Normalizer::Kind::Replace) return n.pattern.literal == " " && n.text == kSpace;
  if (n.kind == detail::Normalizer::Kind::Sequence)
    return std::any_of(n.children.begin(), n.children.end(), normalizer_has_meta_replace);
  return false;
}
bool normalizer_has_prepend(const detail::Normalizer& n) {
  if (n.kind == detail::Normalizer::Kind::Prepend) return n.text == kSpace;
  if (n.kind == detail::Normalizer::Kind::Sequence)
    return std::any_of(n.children.begin(), n.children.end(), normalizer_has_prepend);
  return false;
}
bool pre_has_metaspace(const detail::PreTokenizer& p) {
  if (p.kind == detail::PreTokenizer::Kind::Metaspace) return true;
  if (p.kind == detail::PreTokenizer::Kind::Sequence)
    return std::any_of(p.children.begin(), p.children.end(), pre_has_metaspace);
  return false;
}

}  // namespace

std::variant<SentencePieceVocab, BpeVocab> Tokenizer::gguf_vocabulary() const {
  const int n = vocab_size();
  if (bpe_ == nullptr) {
    // llama2.c, GGUF llama and symbol vocabularies: this class's own pieces.
    SentencePieceVocab v;
    v.source = describe();
    v.pieces.reserve(static_cast<std::size_t>(n));
    v.scores = scores_;
    v.token_types.assign(static_cast<std::size_t>(n), kNormal);
    for (int i = 0; i < n; ++i) {
      const std::string& p = pieces_[static_cast<std::size_t>(i)];
      v.pieces.push_back(symbolic_ || spm_gguf_ ? p : spaces_to_meta(p));
      if (is_byte_piece(p) && !symbolic_) v.token_types[static_cast<std::size_t>(i)] = kByte;
      if (is_special(i)) v.token_types[static_cast<std::size_t>(i)] = kControl;
    }
    if (symbolic_) {
      v.token_types[0] = kControl;  // <pad>
      v.bos_id = kBos;
      v.eos_id = kEos;
      v.add_space_prefix = false;
    } else if (spm_gguf_) {
      v.bos_id = bos_;
      v.eos_id = eos_;
      v.unk_id = unk_;
      v.add_bos = add_bos_;
      v.add_eos = add_eos_;
      v.add_space_prefix = add_space_prefix_;
    } else {  // llama2.c: 0 <unk>, 1 <s>, 2 </s>
      v.unk_id = kUnk;
      v.bos_id = kBos;
      v.eos_id = kEos;
    }
    if (v.unk_id) v.token_types[static_cast<std::size_t>(*v.unk_id)] = kUnknown;
    return v;
  }
  const detail::BpeTokenizer& b = *bpe_;
  // The file's own strings: the model vocabulary's entries, then the added
  // tokens' raw content (id_to_token holds a normalized added token's
  // normalized form, as the Rust library's id_to_token does).
  std::vector<std::string> raw(static_cast<std::size_t>(n));
  std::vector<bool> have(static_cast<std::size_t>(n), false);
  for (const auto& [tok, id] : b.vocab)
    if (id >= 0 && id < n) raw[static_cast<std::size_t>(id)] = tok, have[static_cast<std::size_t>(id)] = true;
  for (const auto& a : b.added)
    if (a.id >= 0 && a.id < n && !have[static_cast<std::size_t>(a.id)])
      raw[static_cast<std::size_t>(a.id)] = a.content, have[static_cast<std::size_t>(a.id)] = true;
  for (int i = 0; i < n; ++i)
    if (!have[static_cast<std::size_t>(i)]) raw[static_cast<std::size_t>(i)] = fmt::format("[UNUSED{}]", i);
  const bool spm_style =
      b.byte_fallback && ((b.normalizer && normalizer_has_meta_replace(*b.normalizer)) ||
                          (b.pre_tokenizer && pre_has_metaspace(*b.pre_tokenizer)));
  if (spm_style) {
    SentencePieceVocab v;
    v.source = b.source;
    v.pieces = raw;
    // Score of a token = -(lowest merge rank that makes it); tokens no merge
    // makes: 0 when one character long (never a merge result), else -1e9.
    constexpr float kNone = std::numeric_limits<float>::lowest();
    v.scores.assign(static_cast<std::size_t>(n), kNone);
    for (const auto& e : b.merges.slots())
      if (e.key != detail::MergeTable::kEmpty && e.id >= 0 && e.id < n)
        v.scores[static_cast<std::size_t>(e.id)] =
            std::max(v.scores[static_cast<std::size_t>(e.id)], -static_cast<float>(e.rank));
    v.token_types.assign(static_cast<std::size_t>(n), kNormal);
    for (int i = 0; i < n; ++i) {
      const std::string& p = v.pieces[static_cast<std::size_t>(i)];
      float& sc = v.scores[static_cast<std::size_t>(i)];
      if (sc == kNone) {
        std::size_t chars = 0;
        for (unsigned char c : p) chars += (c & 0xC0) != 0x80;
        sc = chars <= 1 ? 0.0f : -1e9f;
      }
      if (is_byte_piece(p)) v.token_types[static_cast<std::size_t>(i)] = kByte;
      if (b.is_special(i) || !have[static_cast<std::size_t>(i)]) v.token_types[static_cast<std::size_t>(i)] = kControl;
    }
    for (const auto& a : b.added)
      if (a.special && a.id >= 0 && a.id < n) v.token_types[static_cast<std::size_t>(a.id)] = kControl;
    v.unk_id = b.unk_id;
    if (v.unk_id) v.token_types[static_cast<std::size_t>(*v.unk_id)] = kUnknown;
    v.bos_id = b.bos;
    v.eos_id = b.eos;
    v.add_bos = b.bos.has_value();
    v.add_eos = false;
    v.add_space_prefix = (b.normalizer && normalizer_has_prepend(*b.normalizer)) || b.prefix_space;
    return v;
  }
  BpeVocab v;
  v.source = b.source;
  v.tokens = raw;
  std::vector<std::pair<uint32_t, uint64_t>> ranked;
  for (const auto& e : b.merges.slots())
    if (e.key != detail::MergeTable::kEmpty) ranked.emplace_back(e.rank, e.key);
  std::sort(ranked.begin(), ranked.end());
  for (const auto& [rank, key] : ranked)
    v.merges.push_back(v.tokens[static_cast<std::size_t>(key >> 32)] + " " +
                       v.tokens[static_cast<std::size_t>(key & 0xFFFFFFFFu)]);
  v.token_types.assign(static_cast<std::size_t>(n), kNormal);
  for (int i = 0; i < n; ++i)
    if (b.is_special(i)) v.token_types[static_cast<std::size_t>(i)] = kControl;
  v.bos_id = b.bos;
  v.eos_id = b.eos;
  v.unk_id = b.unk_id;
  v.add_bos = b.bos.has_value();
  if (!b.gguf_pre.empty()) {
    v.pre = b.gguf_pre;
  } else if (b.pre_tokenizer && b.pre_tokenizer->kind == detail::PreTokenizer::Kind::ByteLevel &&
             b.pre_tokenizer->use_regex && !b.pre_tokenizer->add_prefix_space && !b.normalizer) {
    v.pre = "gpt2";
  } else {
    throw TokenizerError(fmt::format("{}: this byte-level pre-tokenizer has no llama.cpp tokenizer.ggml.pre name "
                                     "posenc knows (only a plain GPT-2 ByteLevel pre-tokenizer is exported)",
                                     b.source));
  }
  return v;
}

}  // namespace posenc
