// Synthetic tasks, encodings' names, length ranges and the deterministic sampler.
#include <algorithm>
#include <charconv>

#include <fmt/format.h>

#include "posenc/error.hpp"
#include "posenc/tokenizer.hpp"
#include "posenc/synthetic_tasks.hpp"

namespace posenc {

// ---- sampling ---------------------------------------------------------------------

uint64_t SampleRng::next() {
  uint64_t z = (state_ += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

uint64_t SampleRng::below(uint64_t n) {
  if (n == 0) throw InvalidArgument("SampleRng::below: n must be positive (got 0)");
  const uint64_t limit = ~uint64_t{0} - (~uint64_t{0} % n);  // largest multiple of n
  for (;;) {
    const uint64_t x = next();
    if (x < limit) return x % n;
  }
}

uint64_t derive_seed(uint64_t seed, std::string_view label, int64_t index) {
  uint64_t h = 1469598103934665603ull;  // FNV-1a
  for (unsigned char c : label) {
    h ^= c;
    h *= 1099511628211ull;
  }
  SampleRng r(seed ^ h ^ (static_cast<uint64_t>(index) * 0xD1B54A32D192ED03ull));
  r.next();
  return r.next();
}

// ---- names --------------------------------------------------------------------------

std::string_view to_string(TrainTaskKind kind) {
  switch (kind) {
    case TrainTaskKind::copy: return "copy";
    case TrainTaskKind::reverse: return "reverse";
    case TrainTaskKind::addition: return "addition";
    case TrainTaskKind::sort: return "sort";
    case TrainTaskKind::associative_recall: return "associative_recall";
  }
  return "?";
}

TrainTaskKind parse_task_kind(std::string_view text, std::string_view field) {
  for (auto k : kTrainTaskKinds)
    if (to_string(k) == text) return k;
  throw ConfigError(fmt::format("{}: unknown task '{}' (known: copy, reverse, addition, sort, associative_recall)",
                                field, text));
}

std::string_view to_string(TrainEncoding pe) {
  switch (pe) {
    case TrainEncoding::nope: return "nope";
    case TrainEncoding::learned: return "learned";
    case TrainEncoding::sinusoidal: return "sinusoidal";
    case TrainEncoding::t5: return "t5";
    case TrainEncoding::alibi: return "alibi";
    case TrainEncoding::rope: return "rope";
    case TrainEncoding::rope25: return "rope25";
  }
  return "?";
}

TrainEncoding parse_train_encoding(std::string_view text, std::string_view field) {
  for (auto p : {TrainEncoding::nope, TrainEncoding::learned, TrainEncoding::sinusoidal, TrainEncoding::t5,
                 TrainEncoding::alibi, TrainEncoding::rope, TrainEncoding::rope25})
    if (to_string(p) == text) return p;
  throw ConfigError(fmt::format(
      "{}: unknown positional encoding '{}' (known: nope, learned, sinusoidal, t5, alibi, rope, rope25)", field,
      text));
}

PositionFamily family_of(TrainEncoding pe) {
  switch (pe) {
    case TrainEncoding::nope: return PositionFamily::nope;
    case TrainEncoding::learned: return PositionFamily::learned_absolute;
    case TrainEncoding::sinusoidal: return PositionFamily::sinusoidal;
    case TrainEncoding::t5: return PositionFamily::t5_bias;
    case TrainEncoding::alibi: return PositionFamily::alibi;
    case TrainEncoding::rope:
    case TrainEncoding::rope25: return PositionFamily::rope;
  }
  return PositionFamily::nope;
}

LengthRange parse_length_range(std::string_view text, std::string_view field, int default_step) {
  std::vector<int> parts;
  std::size_t pos = 0;
  while (true) {
    const std::size_t c = text.find(':', pos);
    const std::string_view item = text.substr(pos, c == std::string_view::npos ? std::string_view::npos : c - pos);
    int v = 0;
    auto [p, ec] = std::from_chars(item.data(), item.data() + item.size(), v);
    if (item.empty() || ec != std::errc() || p != item.data() + item.size())
      throw ConfigError(fmt::format("{}: expected lo:hi or lo:hi:step with integers (got '{}')", field, text));
    parts.push_back(v);
    if (c == std::string_view::npos) break;
    pos = c + 1;
  }
  if (parts.size() < 2 || parts.size() > 3)
    throw ConfigError(fmt::format("{}: expected lo:hi or lo:hi:step (got '{}')", field, text));
  LengthRange r{parts[0], parts[1], parts.size() == 3 ? parts[2] : default_step};
  if (r.lo < 1 || r.hi < r.lo || r.hi > 4096)
    throw ConfigError(fmt::format("{}: need 1 <= lo <= hi <= 4096 (got '{}')", field, text));
  if (r.step < 1) throw ConfigError(fmt::format("{}: step must be >= 1 (got '{}')", field, text));
  return r;
}

// ---- tasks --------------------------------------------------------------------------

namespace {
constexpr int kLetters = 26;
constexpr int kKeys = 128;
constexpr int kValues = 10;
}  // namespace

Task::Task(TrainTaskKind kind) : kind_(kind) {
  symbols_ = {"<pad>", "<bos>", "<eos>"};
  first_symbol_ = 3;
  switch (kind) {
    case TrainTaskKind::copy:
    case TrainTaskKind::reverse:
    case TrainTaskKind::sort:
      for (int i = 0; i < kLetters; ++i) symbols_.push_back(std::string(1, static_cast<char>('a' + i)));
      sep_ = static_cast<int32_t>(symbols_.size());
      symbols_.push_back(">");
      break;
    case TrainTaskKind::addition:
      for (int i = 0; i < 10; ++i) symbols_.push_back(std::string(1, static_cast<char>('0' + i)));
      plus_ = static_cast<int32_t>(symbols_.size());
      symbols_.push_back("+");
      sep_ = static_cast<int32_t>(symbols_.size());
      symbols_.push_back("=");
      break;
    case TrainTaskKind::associative_recall:
      for (int i = 0; i < kKeys; ++i) symbols_.push_back(fmt::format("k{}", i));
      first_value_ = static_cast<int32_t>(symbols_.size());
      for (int i = 0; i < kValues; ++i) symbols_.push_back(std::string(1, static_cast<char>('0' + i)));
      query_ = static_cast<int32_t>(symbols_.size());
      symbols_.push_back("?");
      sep_ = -1;  // no separator: the query key ends the prompt
      break;
  }
}

bool Task::valid_length(int n) const {
  switch (kind_) {
    case TrainTaskKind::copy:
    case TrainTaskKind::reverse:
    case TrainTaskKind::sort: return n >= 1 && n <= 4096;
    case TrainTaskKind::addition: return n >= 3 && n <= 4096;
    case TrainTaskKind::associative_recall: return n >= 4 && n % 2 == 0 && n <= 2 * kKeys + 2;
  }
  return false;
}

int Task::round_length(int n) const {
  for (int m = std::min(n, 4096); m >= 1; --m)
    if (valid_length(m)) return m;
  return 0;
}

std::vector<int> Task::lengths_in(int lo, int hi) const {
  std::vector<int> out;
  for (int n = std::max(lo, 1); n <= hi; ++n)
    if (valid_length(n)) out.push_back(n);
  return out;
}

int Task::answer_length(int n) const {
  switch (kind_) {
    case TrainTaskKind::copy:
    case TrainTaskKind::reverse:
    case TrainTaskKind::sort: return n + 1;
    case TrainTaskKind::addition: {
      const int la = n / 2;  // ceil((n-1)/2)
      return la + 1 + 1;
    }
    case TrainTaskKind::associative_recall: return 2;
  }
  return 0;
}

int64_t Task::positions_needed(int n) const {
  // prompt = <bos> + n (+ separator), answer = answer_length(n); the last
  // answer token is never read.
  const int sep = kind_ == TrainTaskKind::associative_recall ? 0 : 1;
  return static_cast<int64_t>(n) + 1 + sep + answer_length(n) - 1;
}

TrainSample Task::sample(SampleRng& rng, int n) const {
  if (!valid_length(n)) fail_field<InvalidArgument>(fmt::format("{} input length", name()), "not a valid length", n);
  TrainSample s;
  s.input_length = n;
  s.prompt.reserve(static_cast<std::size_t>(n) + 2);  // <bos>, input, separator
  s.prompt.push_back(Tokenizer::kBos);
  auto letter = [&] { return static_cast<int32_t>(first_symbol_ + static_cast<int32_t>(rng.below(kLetters))); };
  switch (kind_) {
    case TrainTaskKind::copy:
    case TrainTaskKind::reverse:
    case TrainTaskKind::sort: {
      std::vector<int32_t> x(static_cast<std::size_t>(n));
      for (auto& t : x) t = letter();
      s.prompt.insert(s.prompt.end(), x.begin(), x.end());
      if (kind_ == TrainTaskKind::reverse) std::reverse(x.begin(), x.end());
      if (kind_ == TrainTaskKind::sort) std::sort(x.begin(), x.end());
      s.answer = std::move(x);
      break;
    }
    case TrainTaskKind::addition: {
      const int la = n / 2, lb = n - 1 - la;  // la = ceil((n-1)/2) >= lb >= 1
      std::vector<int> a(static_cast<std::size_t>(la)), b(static_cast<std::size_t>(lb));
      for (auto& d : a) d = static_cast<int>(rng.below(10));
      for (auto& d : b) d = static_cast<int>(rng.below(10));
      for (int d : a) s.prompt.push_back(first_symbol_ + d);
      s.prompt.push_back(plus_);
      for (int d : b) s.prompt.push_back(first_symbol_ + d);
      int carry = 0;
      for (int i = 0; i < la; ++i) {
        const int v = a[static_cast<std::size_t>(i)] + (i < lb ? b[static_cast<std::size_t>(i)] : 0) + carry;
        s.answer.push_back(first_symbol_ + v % 10);
        carry = v / 10;
      }
      s.answer.push_back(first_symbol_ + carry);
      break;
    }
    case TrainTaskKind::associative_recall: {
      const int m = (n - 2) / 2;
      // m distinct keys: a partial Fisher-Yates shuffle of 0..kKeys-1.
      std::vector<int32_t> keys(kKeys);
      for (int i = 0; i < kKeys; ++i) keys[static_cast<std::size_t>(i)] = i;
      for (int i = 0; i < m; ++i) {
        const auto j = static_cast<std::size_t>(i) + static_cast<std::size_t>(rng.below(static_cast<uint64_t>(kKeys - i)));
        std::swap(keys[static_cast<std::size_t>(i)], keys[j]);
      }
      std::vector<int32_t> values(static_cast<std::size_t>(m));
      for (auto& v : values) v = static_cast<int32_t>(rng.below(kValues));
      const auto q = static_cast<std::size_t>(rng.below(static_cast<uint64_t>(m)));
      const std::vector<int> k(keys.begin(), keys.begin() + m), v(values.begin(), values.end());
      s.prompt = recall_prompt(k, v, k[q]);
      s.answer.push_back(first_value_ + values[q]);
      break;
    }
  }
  if (sep_ >= 0) s.prompt.push_back(sep_);
  s.answer.push_back(Tokenizer::kEos);
  return s;
}

TrainingSequence Task::training_sequence(SampleRng& rng, int n, int queries) const {
  const TrainSample s = sample(rng, n);
  TrainingSequence t;
  t.tokens = s.prompt;
  t.tokens.insert(t.tokens.end(), s.answer.begin(), s.answer.end());
  t.is_answer.assign(s.prompt.size(), 0);
  t.is_answer.resize(t.tokens.size(), 1);
  if (kind_ != TrainTaskKind::associative_recall || queries <= 1) return t;
  const int m = (n - 2) / 2;
  const int32_t first = s.prompt.back();
  std::vector<int> others;  // pair indices whose key is not the first query
  for (int i = 0; i < m; ++i)
    if (s.prompt[static_cast<std::size_t>(1 + 2 * i)] != first) others.push_back(i);
  const int extra = std::min(queries - 1, static_cast<int>(others.size()));
  for (int q = 0; q < extra; ++q) {  // partial Fisher-Yates: distinct keys
    const auto j = static_cast<std::size_t>(q) + static_cast<std::size_t>(rng.below(others.size() - static_cast<std::size_t>(q)));
    std::swap(others[static_cast<std::size_t>(q)], others[j]);
    const auto i = static_cast<std::size_t>(others[static_cast<std::size_t>(q)]);
    t.tokens.insert(t.tokens.end(), {query_, s.prompt[1 + 2 * i], s.prompt[2 + 2 * i], Tokenizer::kEos});
    t.is_answer.insert(t.is_answer.end(), {0, 0, 1, 1});
  }
  return t;
}

int64_t Task::training_positions(int n, int queries) const {
  int64_t p = positions_needed(n);
  if (kind_ == TrainTaskKind::associative_recall && queries > 1) p += 4 * std::min(queries - 1, (n - 2) / 2 - 1);
  return p;
}

Task::RecallVocabulary Task::recall_vocabulary() const {
  if (kind_ != TrainTaskKind::associative_recall)
    throw InvalidArgument(fmt::format("recall_vocabulary: task {} is not associative_recall", name()));
  return {first_symbol_, kKeys, first_value_, kValues, query_};
}

std::vector<int32_t> Task::recall_prompt(std::span<const int> keys, std::span<const int> values, int query_key) const {
  if (kind_ != TrainTaskKind::associative_recall)
    throw InvalidArgument(fmt::format("recall_prompt: task {} is not associative_recall", name()));
  if (keys.size() != values.size())
    throw InvalidArgument(fmt::format("recall_prompt: {} keys but {} values", keys.size(), values.size()));
  auto check = [](std::string_view field, int v, int n) {
    if (v < 0 || v >= n) fail_field<InvalidArgument>(field, fmt::format("must be in [0, {})", n), v);
  };
  std::vector<int32_t> p;
  p.reserve(2 * keys.size() + 3);
  p.push_back(Tokenizer::kBos);
  for (std::size_t i = 0; i < keys.size(); ++i) {
    check("recall_prompt key", keys[i], kKeys);
    check("recall_prompt value", values[i], kValues);
    p.push_back(first_symbol_ + keys[i]);
    p.push_back(first_value_ + values[i]);
  }
  check("recall_prompt query key", query_key, kKeys);
  p.push_back(query_);
  p.push_back(first_symbol_ + query_key);
  return p;
}

std::string Task::text(std::span<const int32_t> tokens) const {
  std::string out;
  for (int32_t t : tokens) {
    if (!out.empty()) out += ' ';
    out += t >= 0 && t < vocab_size() ? symbols_[static_cast<std::size_t>(t)] : fmt::format("<{}>", t);
  }
  return out;
}

}  // namespace posenc
