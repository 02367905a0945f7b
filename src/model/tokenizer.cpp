#include "posenc/tokenizer.hpp"

#include <cctype>
#include <cmath>
#include <cstring>
#include <queue>

#include <fmt/format.h>

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

std::vector<int32_t> Tokenizer::encode(std::string_view text, bool bos, bool eos) const {
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
  if (bos) tokens.push_back(kBos);
  if (!text.empty()) {
    const int32_t space = lookup(" ");
    if (space < 0) throw TokenizerError("tokenizer: vocabulary has no ' ' token for the dummy prefix");
    tokens.push_back(space);
  }
  // Split into UTF-8 code points (at most 4 bytes, as run.c does).
  std::size_t i = 0;
  while (i < text.size()) {
    std::size_t len = 1;
    while (i + len < text.size() && len < 4 &&
           (static_cast<unsigned char>(text[i + len]) & 0xC0) == 0x80)
      ++len;
    const int32_t id = lookup(text.substr(i, len));
    if (id >= 0) {
      tokens.push_back(id);
    } else {
      for (std::size_t b = 0; b < len; ++b)
        tokens.push_back(static_cast<int32_t>(static_cast<unsigned char>(text[i + b])) + 3);
    }
    i += len;
  }

  // Greedy BPE merges over a linked list. Nodes keep their original order, so
  // "leftmost pair" = smallest left-node index: the heap orders by
  // (score desc, index asc), which is exactly run.c's scan order.
  const std::size_t n = tokens.size() - (bos ? 1 : 0);
  if (n >= 2) {
    const std::size_t base = bos ? 1 : 0;
    std::vector<int32_t> tok(tokens.begin() + static_cast<std::ptrdiff_t>(base), tokens.end());
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
    std::string buf;
    auto consider = [&](int32_t l) {
      if (l < 0) return;
      const int32_t r = next[static_cast<std::size_t>(l)];
      if (r < 0) return;
      buf = pieces_[static_cast<std::size_t>(tok[static_cast<std::size_t>(l)])];
      buf += pieces_[static_cast<std::size_t>(tok[static_cast<std::size_t>(r)])];
      const int32_t id = lookup(buf);
      if (id < 0) return;
      // run.c starts from best_score = -1e10 and needs a strictly greater score.
      const float sc = scores_[static_cast<std::size_t>(id)];
      if (!(sc > -1e10f)) return;
      heap.push({sc, l, id, version[static_cast<std::size_t>(l)],
                 version[static_cast<std::size_t>(r)], r});
    };
    for (std::size_t k = 0; k + 1 < n; ++k) consider(static_cast<int32_t>(k));
    while (!heap.empty()) {
      const Cand c = heap.top();
      heap.pop();
      const auto L = static_cast<std::size_t>(c.left), R = static_cast<std::size_t>(c.right);
      if (next[L] != c.right || version[L] != c.vl || version[R] != c.vr) continue;  // stale
      tok[L] = c.merged;
      ++version[L];
      ++version[R];
      next[L] = next[R];
      if (next[R] >= 0) prev[static_cast<std::size_t>(next[R])] = c.left;
      next[R] = -1;
      prev[R] = -1;
      tok[R] = -1;
      consider(prev[L]);
      consider(c.left);
    }
    tokens.resize(base);
    for (int32_t k = 0; k >= 0; k = next[static_cast<std::size_t>(k)])
      tokens.push_back(tok[static_cast<std::size_t>(k)]);
  }
  if (eos) tokens.push_back(kEos);
  return tokens;
}

std::string Tokenizer::decode(int32_t prev_token, int32_t token) const {
  const std::string& p = piece(token);
  if (symbolic_) {
    return (prev_token < 0 || prev_token == kBos) ? p : spaced_[static_cast<std::size_t>(token)];
  }
  const int16_t byte = byte_of_token_[static_cast<std::size_t>(token)];
  if (byte >= 0) return byte_pieces_[static_cast<std::size_t>(byte)];
  std::string_view s = p;
  if (prev_token == kBos && !s.empty() && s[0] == ' ') s.remove_prefix(1);
  return std::string(s);
}

std::string Tokenizer::decode(const std::vector<int32_t>& tokens) const {
  std::string out;
  int32_t prev = -1;
  for (int32_t t : tokens) {
    if (t != kBos && t != kEos) out += decode(prev, t);
    prev = t;
  }
  return out;
}

std::string Tokenizer::describe() const { return symbolic_ ? "symbols" : describe_; }
bool Tokenizer::usable() const { return unusable_.empty(); }
const std::string& Tokenizer::unusable_reason() const { return unusable_; }
std::optional<int32_t> Tokenizer::bos_id() const { return kBos; }
std::optional<int32_t> Tokenizer::eos_id() const { return kEos; }
bool Tokenizer::adds_prefix_space() const { return !symbolic_; }
bool Tokenizer::is_special(int32_t id) const { return id == kBos || id == kEos; }
std::optional<int32_t> Tokenizer::token_id(std::string_view piece) const {
  const int32_t id = lookup(piece);
  return id < 0 ? std::nullopt : std::optional<int32_t>(id);
}
std::vector<int32_t> Tokenizer::encode_hf(std::string_view text, bool add_special_tokens) const {
  return encode(text, add_special_tokens, false);
}

}  // namespace posenc
