#include "posenc/tokenizer.hpp"

#include <cctype>
#include <cmath>
#include <algorithm>
#include <cstring>
#include <filesystem>
#include <queue>

#include <fmt/format.h>

#include "model/raw_model.hpp"
#include "model/tokenizer_bpe.hpp"
#include "posenc/error.hpp"
#include "posenc/io.hpp"

namespace posenc {

Tokenizer Tokenizer::load_llama2c(const std::filesystem::path& path,
                                  std::optional<int> expected_vocab_size) {
  MappedFile file(path);
  const auto bytes = file.bytes();
  const std::string name = path.string();
  if (bytes.size() < 4)
    throw TokenizerError(fmt::format("{}: file too short for the max_token_length header ({} bytes)",
                                     name, bytes.size()));
  Tokenizer t;
  std::memcpy(&t.max_token_length_, bytes.data(), 4);
  if (t.max_token_length_ <= 0 || t.max_token_length_ > (1 << 16))
    throw TokenizerError(fmt::format("{}: max_token_length must be in [1, 65536] (got {})", name,
                                     t.max_token_length_));
  std::size_t off = 4;
  while (off < bytes.size()) {
    const std::size_t id = t.pieces_.size();
    if (bytes.size() - off < 8)
      throw TokenizerError(fmt::format("{}: truncated entry for token {} at byte {}", name, id, off));
    float score;
    int32_t len;
    std::memcpy(&score, bytes.data() + off, 4);
    std::memcpy(&len, bytes.data() + off + 4, 4);
    off += 8;
    if (!std::isfinite(score))
      throw TokenizerError(fmt::format("{}: token {} score must be finite (got {})", name, id, score));
    if (len < 0 || len > t.max_token_length_)
      throw TokenizerError(fmt::format("{}: token {} length must be in [0, max_token_length={}] (got {})",
                                       name, id, t.max_token_length_, len));
    if (bytes.size() - off < static_cast<std::size_t>(len))
      throw TokenizerError(fmt::format("{}: token {} needs {} bytes, only {} left", name, id, len,
                                       bytes.size() - off));
    t.pieces_.emplace_back(reinterpret_cast<const char*>(bytes.data() + off), static_cast<std::size_t>(len));
    t.scores_.push_back(score);
    off += static_cast<std::size_t>(len);
  }
  if (t.pieces_.empty()) throw TokenizerError(fmt::format("{}: no tokens in file", name));
  if (expected_vocab_size && t.vocab_size() != *expected_vocab_size)
    throw TokenizerError(fmt::format(
        "{}: vocab_size {} does not match the model's vocab_size {}", name, t.vocab_size(),
        *expected_vocab_size));
  if (t.vocab_size() < 259)
    throw TokenizerError(fmt::format(
        "{}: vocab_size must be >= 259 (3 special tokens + 256 byte tokens) (got {})", name,
        t.vocab_size()));
  // On duplicates the first id wins (as run.c's lookup of the sorted vocabulary
  // returns one of them; tok512 has none).
  t.index_.reserve(t.pieces_.size() * 2);
  for (std::size_t i = 0; i < t.pieces_.size(); ++i) t.index_.emplace(t.pieces_[i], static_cast<int32_t>(i));
  t.byte_pieces_.resize(256);
  for (int b = 0; b < 256; ++b) t.byte_pieces_[static_cast<std::size_t>(b)] = std::string(1, static_cast<char>(b));
  t.byte_of_token_.assign(t.pieces_.size(), -1);
  for (std::size_t i = 0; i < t.pieces_.size(); ++i) {
    const std::string& p = t.pieces_[i];
    unsigned v = 0;
    if (p.size() == 6 && p.compare(0, 3, "<0x") == 0 && p[5] == '>' &&
        std::sscanf(p.c_str() + 3, "%2X", &v) == 1)
      t.byte_of_token_[i] = static_cast<int16_t>(v);
  }
  return t;
}

Tokenizer Tokenizer::from_symbols(std::vector<std::string> symbols) {
  if (symbols.size() < 4)
    throw TokenizerError(fmt::format("symbols: need <pad>, <bos>, <eos> and at least one symbol (got {} entries)",
                                     symbols.size()));
  static const char* kSpecial[3] = {"<pad>", "<bos>", "<eos>"};
  for (int i = 0; i < 3; ++i)
    if (symbols[static_cast<std::size_t>(i)] != kSpecial[i])
      throw TokenizerError(fmt::format("symbols[{}]: must be '{}' (got '{}')", i, kSpecial[i],
                                       symbols[static_cast<std::size_t>(i)]));
  Tokenizer t;
  t.symbolic_ = true;
  t.pieces_ = std::move(symbols);
  t.scores_.assign(t.pieces_.size(), 0.0f);
  t.byte_of_token_.assign(t.pieces_.size(), -1);
  for (std::size_t i = 0; i < t.pieces_.size(); ++i) {
    const std::string& s = t.pieces_[i];
    if (s.empty()) throw TokenizerError(fmt::format("symbols[{}]: empty symbol", i));
    for (char c : s)
      if (std::isspace(static_cast<unsigned char>(c)))
        throw TokenizerError(fmt::format("symbols[{}]: '{}' contains whitespace", i, s));
    t.max_token_length_ = std::max(t.max_token_length_, static_cast<int>(s.size()));
  }
  t.index_.reserve(t.pieces_.size() * 2);
  for (std::size_t i = 0; i < t.pieces_.size(); ++i)
    if (!t.index_.emplace(t.pieces_[i], static_cast<int32_t>(i)).second)
      throw TokenizerError(fmt::format("symbols[{}]: '{}' is listed twice", i, t.pieces_[i]));
  for (const auto& s : t.pieces_) t.spaced_.push_back(" " + s);
  return t;
}

const std::string& Tokenizer::piece(int32_t id) const {
  if (id < 0 || id >= vocab_size())
    throw InvalidArgument(fmt::format("token id: must be in [0, {}) (got {})", vocab_size(), id));
  return pieces_[static_cast<std::size_t>(id)];
}

float Tokenizer::score(int32_t id) const {
  piece(id);
  return scores_[static_cast<std::size_t>(id)];
}

int32_t Tokenizer::lookup(std::string_view s) const {
  auto it = index_.find(s);
  return it == index_.end() ? -1 : it->second;
}

// The SentencePiece-style BPE of run.c's encode() and llama.cpp's
// llm_tokenizer_spm: one symbol per UTF-8 code point (spans of `s`), then
// repeated merges of the adjacent pair whose concatenation is a piece with the
// highest score, leftmost on ties. Over a linked list with a heap ordered by
// (score desc, left index asc): O(n log n) with the scan order of run.c's
// O(n^2) loop and llama.cpp's queue.
//   llama2.c (tok512.bin): spaces stay ' ', the dummy prefix is the " " piece,
//     a code point missing from the vocabulary becomes <0xXX> = byte + 3 tokens
//     that never merge, merges need a score > -1e10 (run.c's best_score start).
//   GGUF llama: spaces -> U+2581 and a U+2581 prefix, code points missing from
//     the vocabulary stay symbols (a longer piece may still contain them) and
//     fall back to their <0xXX> pieces only if they end unmerged (llama.cpp's
//     resegment), else unk, else nothing.
void Tokenizer::spm_encode(std::string_view text, bool prefix, std::vector<int32_t>& out) const {
  static const std::string kSpace = "\xe2\x96\x81";
  std::string buf;
  std::string_view s;
  struct Sym {
    uint32_t b, e;
    int32_t id;
    bool mergeable;
  };
  std::vector<Sym> sym;
  if (spm_gguf_) {
    buf.reserve(text.size() + 8);
    if (prefix) buf += kSpace;
    for (char c : text) {
      if (c == ' ') buf += kSpace;
      else buf += c;
    }
    s = buf;
    sym.reserve(s.size());
    // llama.cpp: the code point length comes from the lead byte, clipped to the text.
    static const uint8_t kLen[16] = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 3, 4};
    for (std::size_t i = 0; i < s.size();) {
      const std::size_t len = std::min<std::size_t>(kLen[static_cast<unsigned char>(s[i]) >> 4], s.size() - i);
      sym.push_back({static_cast<uint32_t>(i), static_cast<uint32_t>(i + len), lookup(s.substr(i, len)), true});
      i += len;
    }
  } else {
    if (text.empty()) return;
    if (prefix) {
      const int32_t space = lookup(" ");
      if (space < 0) throw TokenizerError("tokenizer: vocabulary has no ' ' token for the dummy prefix");
      buf.push_back(' ');
    }
    buf.append(text);
    s = buf;
    sym.reserve(s.size());
    std::size_t i = 0;
    if (prefix) {
      sym.push_back({0, 1, lookup(" "), true});
      i = 1;
    }
    // run.c: a code point is a lead byte and up to 3 continuation bytes.
    while (i < s.size()) {
      std::size_t len = 1;
      while (i + len < s.size() && len < 4 && (static_cast<unsigned char>(s[i + len]) & 0xC0) == 0x80) ++len;
      const int32_t id = lookup(s.substr(i, len));
      if (id >= 0) {
        sym.push_back({static_cast<uint32_t>(i), static_cast<uint32_t>(i + len), id, true});
      } else {
        for (std::size_t b = 0; b < len; ++b)
          sym.push_back({static_cast<uint32_t>(i + b), static_cast<uint32_t>(i + b + 1),
                         static_cast<int32_t>(static_cast<unsigned char>(s[i + b])) + 3, false});
      }
      i += len;
    }
  }

  const std::size_t n = sym.size();
  if (n >= 2) {
    std::vector<int32_t> prev(n), next(n);
    std::vector<uint32_t> version(n, 0);
    for (std::size_t k = 0; k < n; ++k) {
      prev[k] = static_cast<int32_t>(k) - 1;
      next[k] = k + 1 < n ? static_cast<int32_t>(k + 1) : -1;
    }
    struct Cand {
      float score;
      int32_t left;
      int32_t merged;
      uint32_t vl, vr;
      int32_t right;
    };
    auto worse = [](const Cand& a, const Cand& b) {
      if (a.score != b.score) return a.score < b.score;
      return a.left > b.left;
    };
    std::priority_queue<Cand, std::vector<Cand>, decltype(worse)> heap(worse);
    auto consider = [&](int32_t l) {
      if (l < 0) return;
      const int32_t r = next[static_cast<std::size_t>(l)];
      if (r < 0) return;
      const Sym& L = sym[static_cast<std::size_t>(l)];
      const Sym& R = sym[static_cast<std::size_t>(r)];
      if (!L.mergeable || !R.mergeable) return;
      const int32_t id = lookup(s.substr(L.b, R.e - L.b));
      if (id < 0) return;
      const float sc = scores_[static_cast<std::size_t>(id)];
      if (!spm_gguf_ && !(sc > -1e10f)) return;  // run.c starts from best_score = -1e10 and needs a greater score
      heap.push({sc, l, id, version[static_cast<std::size_t>(l)], version[static_cast<std::size_t>(r)], r});
    };
    for (std::size_t k = 0; k + 1 < n; ++k) consider(static_cast<int32_t>(k));
    while (!heap.empty()) {
      const Cand c = heap.top();
      heap.pop();
      const auto L = static_cast<std::size_t>(c.left), R = static_cast<std::size_t>(c.right);
      if (next[L] != c.right || version[L] != c.vl || version[R] != c.vr) continue;  // stale
      sym[L].id = c.merged;
      sym[L].e = sym[R].e;
      ++version[L];
      ++version[R];
      next[L] = next[R];
      if (next[R] >= 0) prev[static_cast<std::size_t>(next[R])] = c.left;
      next[R] = -1;
      prev[R] = -1;
      consider(prev[L]);
      consider(c.left);
    }
    for (int32_t k = 0; k >= 0; k = next[static_cast<std::size_t>(k)]) {
      const Sym& x = sym[static_cast<std::size_t>(k)];
      if (x.id >= 0) {
        out.push_back(x.id);
        continue;
      }
      for (uint32_t b = x.b; b < x.e; ++b) {
        const int32_t t = byte_token_[static_cast<unsigned char>(s[b])];
        if (t >= 0) out.push_back(t);
        else if (unk_) out.push_back(*unk_);
      }
    }
  } else if (n == 1) {
    const Sym& x = sym[0];
    if (x.id >= 0) {
      out.push_back(x.id);
    } else {
      for (uint32_t b = x.b; b < x.e; ++b) {
        const int32_t t = byte_token_[static_cast<unsigned char>(s[b])];
        if (t >= 0) out.push_back(t);
        else if (unk_) out.push_back(*unk_);
      }
    }
  }
}

std::vector<int32_t> Tokenizer::encode(std::string_view text, bool bos, bool eos) const {
  if (bpe_) {
    std::vector<int32_t> ids = bpe_->encode(text, false);
    const auto b = bos_id(), e = eos_id();
    if (bos && b) ids.insert(ids.begin(), *b);
    if (eos && e) ids.push_back(*e);
    return ids;
  }
  if (symbolic_) {
    std::vector<int32_t> ids;
    if (bos) ids.push_back(kBos);
    std::size_t i = 0;
    while (i < text.size()) {
      while (i < text.size() && std::isspace(static_cast<unsigned char>(text[i]))) ++i;
      std::size_t j = i;
      while (j < text.size() && !std::isspace(static_cast<unsigned char>(text[j]))) ++j;
      if (j > i) {
        const int32_t id = lookup(text.substr(i, j - i));
        if (id < 0) throw TokenizerError(fmt::format("text: unknown symbol '{}' for this vocabulary", text.substr(i, j - i)));
        ids.push_back(id);
      }
      i = j;
    }
    if (eos) ids.push_back(kEos);
    return ids;
  }
  std::vector<int32_t> tokens;
  tokens.reserve(text.size() + 3);
  if (!spm_gguf_) {
    if (bos) tokens.push_back(kBos);
    spm_encode(text, !text.empty(), tokens);
    if (eos) tokens.push_back(kEos);
    return tokens;
  }
  if (!unusable_.empty() && !text.empty()) throw TokenizerError(unusable_);
  const auto b = bos_id(), e = eos_id();
  if (bos && b) tokens.push_back(*b);
  // llama.cpp tokenizer_st_partition (parse_special = false): user-defined
  // pieces are cut out of the text first, longest piece first; each remaining
  // run gets the U+2581 prefix when it starts the text or follows such a piece.
  struct Frag {
    std::string_view text;
    int32_t id;
  };
  std::vector<Frag> frags{{text, -1}};
  for (int32_t id : user_defined_) {
    const std::string& p = pieces_[static_cast<std::size_t>(id)];
    if (p.empty()) continue;
    std::vector<Frag> next;
    for (const Frag& f : frags) {
      if (f.id >= 0) {
        next.push_back(f);
        continue;
      }
      std::size_t pos = 0;
      for (std::size_t hit = f.text.find(p); hit != std::string_view::npos; hit = f.text.find(p, pos)) {
        if (hit > pos) next.push_back({f.text.substr(pos, hit - pos), -1});
        next.push_back({{}, id});
        pos = hit + p.size();
      }
      if (pos < f.text.size()) next.push_back({f.text.substr(pos), -1});
    }
    frags.swap(next);
  }
  bool prev_special = true;
  for (const Frag& f : frags) {
    if (f.id >= 0) {
      tokens.push_back(f.id);
      prev_special = true;
    } else if (!f.text.empty()) {
      spm_encode(f.text, add_space_prefix_ && prev_special, tokens);
      prev_special = false;
    }
  }
  if (eos && e) tokens.push_back(*e);
  return tokens;
}

std::string Tokenizer::decode(int32_t prev_token, int32_t token) const {
  const std::string& p = piece(token);
  if (bpe_) return bpe_->decode_piece(prev_token, token);
  if (symbolic_) {
    return (prev_token < 0 || prev_token == kBos) ? p : spaced_[static_cast<std::size_t>(token)];
  }
  const int16_t byte = byte_of_token_[static_cast<std::size_t>(token)];
  if (spm_gguf_) {
    if (is_special(token)) return {};
    if (byte >= 0) return byte_pieces_[static_cast<std::size_t>(byte)];
    std::string out;
    out.reserve(p.size());
    for (std::size_t i = 0; i < p.size(); ++i) {
      if (p.compare(i, 3, "\xe2\x96\x81") == 0) {
        out += ' ';
        i += 2;
      } else {
        out += p[i];
      }
    }
    const bool starts = prev_token < 0 || prev_token >= vocab_size() || is_special(prev_token);
    if (starts && add_space_prefix_ && !out.empty() && out[0] == ' ') out.erase(0, 1);
    return out;
  }
  if (byte >= 0) return byte_pieces_[static_cast<std::size_t>(byte)];
  std::string_view sv = p;
  if (prev_token == kBos && !sv.empty() && sv[0] == ' ') sv.remove_prefix(1);
  return std::string(sv);
}

std::string Tokenizer::decode(const std::vector<int32_t>& tokens) const {
  if (bpe_) {
    for (int32_t t : tokens) piece(t);  // range check
    return bpe_->decode(tokens);
  }
  std::string out;
  int32_t prev = -1;
  for (int32_t t : tokens) {
    if (!is_special(t)) out += decode(prev, t);
    prev = t;
  }
  return out;
}

std::string Tokenizer::describe() const {
  if (symbolic_) return "symbols";
  return bpe_ ? bpe_->describe : describe_;
}
bool Tokenizer::usable() const { return unusable_.empty(); }
const std::string& Tokenizer::unusable_reason() const { return unusable_; }
std::optional<int32_t> Tokenizer::bos_id() const {
  if (bpe_) return bpe_->bos;
  if (spm_gguf_) return add_bos_ ? bos_ : std::nullopt;
  return kBos;
}
std::optional<int32_t> Tokenizer::eos_id() const {
  if (bpe_) return bpe_->eos;
  if (spm_gguf_) return eos_;
  return kEos;
}
bool Tokenizer::adds_prefix_space() const {
  if (bpe_) return bpe_->prefix_space;
  if (spm_gguf_) return add_space_prefix_;
  return !symbolic_;
}
bool Tokenizer::is_special(int32_t id) const {
  if (bpe_) return bpe_->is_special(id);
  if (spm_gguf_) return id >= 0 && id < vocab_size() && special_[static_cast<std::size_t>(id)];
  return id == kBos || id == kEos;
}
std::optional<int32_t> Tokenizer::token_id(std::string_view piece) const {
  const int32_t id = lookup(piece);
  return id < 0 ? std::nullopt : std::optional<int32_t>(id);
}
std::vector<int32_t> Tokenizer::encode_hf(std::string_view text, bool add_special_tokens) const {
  if (bpe_) return bpe_->encode(text, add_special_tokens);
  if (spm_gguf_) return encode(text, add_special_tokens, add_special_tokens && add_eos_);
  return encode(text, add_special_tokens, false);
}

// ---- tokenizer.json, GGUF ----------------------------------------------------------

namespace {

std::string read_optional(const std::filesystem::path& p) {
  std::error_code ec;
  if (!std::filesystem::is_regular_file(p, ec)) return {};
  return read_file(p);
}

}  // namespace

Tokenizer Tokenizer::load_tokenizer_json(const std::filesystem::path& path) {
  const std::string json = read_file(path);
  std::string config = read_optional(path.parent_path() / "tokenizer_config.json");
  return from_tokenizer_json(json, path.string(), config);
}

Tokenizer Tokenizer::from_tokenizer_json(std::string_view json, std::string_view source,
                                         std::string_view tokenizer_config_json) {
  auto bpe = detail::parse_tokenizer_json(json, source, tokenizer_config_json);
  Tokenizer t;
  t.pieces_ = bpe->id_to_token;
  t.scores_.assign(t.pieces_.size(), 0.0f);
  t.byte_of_token_.assign(t.pieces_.size(), -1);
  // token_id(): added tokens first, then the model vocabulary (the Rust library's token_to_id).
  t.index_.reserve(bpe->vocab.size() * 2);
  for (const auto& [tok, id] : bpe->vocab) t.index_.emplace(tok, id);
  for (const auto& a : bpe->added) t.index_[a.content] = a.id;
  for (const auto& p : t.pieces_) t.max_token_length_ = std::max(t.max_token_length_, static_cast<int>(p.size()));
  t.add_bos_ = bpe->bos.has_value();
  t.bpe_ = std::move(bpe);
  return t;
}

Tokenizer Tokenizer::from_bpe_vocab(BpeVocab vocab) {
  auto bpe = detail::make_gguf_bpe(vocab);
  Tokenizer t;
  t.pieces_ = std::move(vocab.tokens);
  t.scores_.assign(t.pieces_.size(), 0.0f);
  t.byte_of_token_.assign(t.pieces_.size(), -1);
  t.index_.reserve(t.pieces_.size() * 2);
  for (std::size_t i = 0; i < t.pieces_.size(); ++i) t.index_[t.pieces_[i]] = static_cast<int32_t>(i);
  for (const auto& p : t.pieces_) t.max_token_length_ = std::max(t.max_token_length_, static_cast<int>(p.size()));
  t.bos_ = vocab.bos_id;
  t.eos_ = vocab.eos_id;
  t.unk_ = vocab.unk_id;
  t.add_bos_ = vocab.add_bos;
  t.add_eos_ = vocab.add_eos;
  t.bpe_ = std::move(bpe);
  return t;
}

Tokenizer Tokenizer::from_sentencepiece_vocab(SentencePieceVocab vocab) {
  const std::string& src = vocab.source;
  auto fail = [&](std::string_view field, std::string_view reason, const auto& got) {
    throw TokenizerError(fmt::format("{}: {}: {} (got {})", src, field, reason, got));
  };
  const std::size_t n = vocab.pieces.size();
  if (n == 0) fail("tokenizer.ggml.tokens", "must not be empty", "0 tokens");
  if (n > static_cast<std::size_t>(INT32_MAX)) fail("tokenizer.ggml.tokens", "too many tokens", n);
  if (vocab.scores.size() != n)
    fail("tokenizer.ggml.scores", fmt::format("must have one score per token ({})", n),
         fmt::format("{} scores", vocab.scores.size()));
  if (!vocab.token_types.empty() && vocab.token_types.size() != n)
    fail("tokenizer.ggml.token_type", fmt::format("must have one entry per token ({})", n),
         fmt::format("{} entries", vocab.token_types.size()));
  for (std::size_t i = 0; i < n; ++i)
    if (!std::isfinite(vocab.scores[i])) fail(fmt::format("tokenizer.ggml.scores[{}]", i), "must be finite", vocab.scores[i]);
  auto check = [&](const std::optional<int32_t>& id, const char* field) {
    if (id && (*id < 0 || static_cast<std::size_t>(*id) >= n))
      fail(field, fmt::format("must be a token id in [0, {})", n), *id);
  };
  check(vocab.bos_id, "tokenizer.ggml.bos_token_id");
  check(vocab.eos_id, "tokenizer.ggml.eos_token_id");
  check(vocab.unk_id, "tokenizer.ggml.unknown_token_id");
  if (vocab.add_bos && !vocab.bos_id) fail("tokenizer.ggml.add_bos_token", "is true but there is no bos_token_id", "true");
  if (vocab.add_eos && !vocab.eos_id) fail("tokenizer.ggml.add_eos_token", "is true but there is no eos_token_id", "true");

  Tokenizer t;
  t.spm_gguf_ = true;
  t.describe_ = "GGUF llama (SentencePiece scores)";
  t.pieces_ = std::move(vocab.pieces);
  t.scores_ = std::move(vocab.scores);
  t.bos_ = vocab.bos_id;
  t.eos_ = vocab.eos_id;
  t.unk_ = vocab.unk_id;
  t.add_bos_ = vocab.add_bos;
  t.add_eos_ = vocab.add_eos;
  t.add_space_prefix_ = vocab.add_space_prefix;
  t.index_.reserve(n * 2);
  for (std::size_t i = 0; i < n; ++i) t.index_[t.pieces_[i]] = static_cast<int32_t>(i);  // llama.cpp: the last id wins
  for (const auto& p : t.pieces_) t.max_token_length_ = std::max(t.max_token_length_, static_cast<int>(p.size()));
  t.byte_pieces_.resize(256);
  for (int b = 0; b < 256; ++b) t.byte_pieces_[static_cast<std::size_t>(b)] = std::string(1, static_cast<char>(b));
  // llama.cpp byte_to_token: the "<0xXX>" piece, else the one-byte piece.
  t.byte_token_.assign(256, -1);
  for (int b = 0; b < 256; ++b) {
    int32_t id = t.lookup(fmt::format("<0x{:02X}>", b));
    if (id < 0) id = t.lookup(t.byte_pieces_[static_cast<std::size_t>(b)]);
    t.byte_token_[static_cast<std::size_t>(b)] = id;
  }
  const auto& types = vocab.token_types;
  auto type_of = [&](std::size_t i) { return types.empty() ? 1 : types[i]; };
  t.byte_of_token_.assign(n, -1);
  t.special_.assign(n, false);
  for (std::size_t i = 0; i < n; ++i) {
    const std::string& p = t.pieces_[i];
    unsigned v = 0;
    const bool looks_byte = p.size() == 6 && p.compare(0, 3, "<0x") == 0 && p[5] == '>' &&
                            std::isxdigit(static_cast<unsigned char>(p[3])) &&
                            std::isxdigit(static_cast<unsigned char>(p[4])) && std::sscanf(p.c_str() + 3, "%2X", &v) == 1;
    const int type = type_of(i);
    if (looks_byte && (type == 6 || types.empty())) t.byte_of_token_[i] = static_cast<int16_t>(v);
    if (type == 2 || type == 3) t.special_[i] = true;
    if (type == 4) t.user_defined_.push_back(static_cast<int32_t>(i));
  }
  if (t.bos_) t.special_[static_cast<std::size_t>(*t.bos_)] = true;
  if (t.eos_) t.special_[static_cast<std::size_t>(*t.eos_)] = true;
  std::stable_sort(t.user_defined_.begin(), t.user_defined_.end(), [&](int32_t a, int32_t b) {
    return t.pieces_[static_cast<std::size_t>(a)].size() > t.pieces_[static_cast<std::size_t>(b)].size();
  });
  // All-equal scores (e.g. TinyStories-656K-Q8_0.gguf: every score -1000, no
  // merges): no merge order can be recovered from them.
  std::size_t normal = 0;
  bool equal = true;
  float first = 0.0f;
  for (std::size_t i = 0; i < n; ++i) {
    if (type_of(i) != 1) continue;
    if (normal++ == 0) first = t.scores_[i];
    else if (t.scores_[i] != first) equal = false;
  }
  if (normal >= 2 && equal)
    t.unusable_ = fmt::format(
        "{}: tokenizer.ggml.scores: the scores of the SentencePiece vocabulary are equal ({}) for all {} of its "
        "{} tokens of normal type (token_type 1), so the merge order of its tokenizer cannot be reproduced "
        "(llama.cpp tokenizes such a file wrongly); use the model's Hugging Face tokenizer.json instead",
        src, first, normal, n);
  return t;
}

Tokenizer load_tokenizer_from_path(const std::filesystem::path& path, std::string_view what) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (fs::is_directory(path, ec)) {
    if (!fs::exists(path / "tokenizer.json", ec))
      throw IoError(fmt::format("{} {}: directory without tokenizer.json", what, path.string()));
    return Tokenizer::load_tokenizer_json(path / "tokenizer.json");
  }
  const MappedFile f(path);
  const auto b = f.bytes();
  // A posenc checkpoint (magic "POSENC01", src/model/checkpoint.cpp) would be read as a llama2.c tokenizer and
  // fail on its "max_token_length".
  if (b.size() >= 8 && std::memcmp(b.data(), "POSENC01", 8) == 0)
    throw TokenizerError(fmt::format("{} {}: is a posenc checkpoint, not a tokenizer (its vocabulary is used when it "
                                     "is the model)",
                                     what, path.string()));
  // A GGUF file (its magic, or a name ending .gguf, which the GGUF reader then checks) gives its embedded
  // vocabulary (tokenizer.ggml.*), as it does when it is the model; read as llama2.c it would fail on a
  // meaningless "max_token_length".
  if ((b.size() >= 4 && std::memcmp(b.data(), "GGUF", 4) == 0) || detail::named_gguf(path)) {
    std::string describe;
    auto tok = detail::read_gguf_tokenizer(path, describe);
    if (!tok)
      throw TokenizerError(fmt::format("{} {}: this GGUF file has no embedded tokenizer (tokenizer.ggml.model is "
                                       "missing or none); pass a tokenizer.json or a llama2.c tokenizer .bin",
                                       what, path.string()));
    return std::move(*tok);
  }
  std::size_t i = 0;
  while (i < b.size() && std::isspace(static_cast<unsigned char>(b[i]))) ++i;
  // JSON of any shape ('[]' too, which was read as a llama2.c tokenizer) is a tokenizer.json, malformed or not.
  if (i < b.size() && (static_cast<char>(b[i]) == '{' || static_cast<char>(b[i]) == '['))
    return Tokenizer::load_tokenizer_json(path);
  try {
    return Tokenizer::load_llama2c(path);
  } catch (const TokenizerError& e) {
    // Whatever is neither JSON nor GGUF is read as llama2.c: say so, or a field of a format the user never named
    // is all they see.
    throw TokenizerError(fmt::format("{} (read as a llama2.c tokenizer .bin: the file is neither a tokenizer.json "
                                     "nor a GGUF)",
                                     e.what()));
  }
}

void require_tokenizer_fits(const Tokenizer& tok, int64_t model_vocab_size, std::string_view tok_source,
                            std::string_view model) {
  const bool exact = !tok.is_symbolic() && tok.describe() == "llama2.c";
  if (exact ? tok.vocab_size() != model_vocab_size : tok.vocab_size() > model_vocab_size)
    throw TokenizerError(fmt::format("{}: vocab_size {} does not {} the model's vocab_size {} ({})", tok_source,
                                     tok.vocab_size(), exact ? "match" : "fit", model_vocab_size, model));
}

}  // namespace posenc
