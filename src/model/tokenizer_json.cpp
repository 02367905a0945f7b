// tokenizer.json (Hugging Face `tokenizers` serialization) -> BpeTokenizer.
// Field names and defaults follow the Rust library's serde definitions;
// every error names the file, the JSON field and the bad value.
#include <algorithm>
#include <type_traits>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "model/tokenizer_bpe.hpp"
#include "posenc/error.hpp"

namespace posenc::detail {

namespace {

using nlohmann::json;

// A value for a message: scalars as JSON, containers summarized (never
// serialized whole: a deep or large one would make a huge or deep dump).
std::string show(const json& j) {
  if (j.is_object()) {
    std::string keys;
    std::size_t n = 0;
    for (auto it = j.begin(); it != j.end() && n < 4; ++it, ++n) keys += (n ? ", \"" : "\"") + it.key() + "\"";
    if (j.size() > 4) keys += ", ...";
    return "an object {" + keys + "}";
  }
  if (j.is_array()) return fmt::format("an array of {} items", j.size());
  std::string s = j.dump(-1, ' ', false, json::error_handler_t::replace);
  if (s.size() > 120) s = s.substr(0, 117) + "...";
  return s;
}

struct Ctx {
  std::string source;

  [[noreturn]] void fail(std::string_view field, std::string_view reason, std::string_view got) const {
    throw TokenizerError(fmt::format("{}: {}: {} (got {})", source, field, reason, got));
  }
  template <class J>
    requires std::is_same_v<J, json>
  [[noreturn]] void fail(std::string_view field, std::string_view reason, const J& got) const {
    fail(field, reason, std::string_view(show(got)));
  }

  // A field that may be absent or null.
  const json* opt(const json& obj, const char* key) const {
    auto it = obj.find(key);
    if (it == obj.end() || it->is_null()) return nullptr;
    return &*it;
  }
  const json& object(const json& j, const std::string& field) const {
    if (!j.is_object()) fail(field, "must be an object", j);
    return j;
  }
  const json& array(const json& j, const std::string& field) const {
    if (!j.is_array()) fail(field, "must be an array", j);
    return j;
  }
  std::string str(const json& j, const std::string& field) const {
    if (!j.is_string()) fail(field, "must be a string", j);
    return j.get<std::string>();
  }
  bool boolean(const json& obj, const char* key, const std::string& field, bool dflt) const {
    const json* v = opt(obj, key);
    if (!v) return dflt;
    if (!v->is_boolean()) fail(field + "." + key, "must be true or false", *v);
    return v->get<bool>();
  }
  std::optional<std::string> opt_str(const json& obj, const char* key, const std::string& field) const {
    const json* v = opt(obj, key);
    if (!v) return std::nullopt;
    return str(*v, field + "." + key);
  }
  int64_t integer(const json& j, const std::string& field, int64_t lo, int64_t hi) const {
    if (!j.is_number_integer()) fail(field, "must be an integer", j);
    const int64_t v = j.is_number_unsigned() && j.get<uint64_t>() > static_cast<uint64_t>(INT64_MAX)
                          ? INT64_MAX
                          : j.get<int64_t>();
    if (v < lo || v > hi) fail(field, fmt::format("must be in [{}, {}]", lo, hi), j);
    return v;
  }
  std::string type(const json& j, const std::string& field) const {
    object(j, field);
    const json* t = opt(j, "type");
    if (!t) fail(field + ".type", "missing", j);
    return str(*t, field + ".type");
  }
  char32_t single_char(const json& j, const std::string& field) const {
    const std::string s = str(j, field);
    char32_t cp = 0;
    if (s.empty() || utf8_next(s, 0, cp) != s.size()) fail(field, "must be a single character", j);
    return cp;
  }
};

Pattern parse_pattern(const Ctx& c, const json& j, const std::string& field) {
  c.object(j, field);
  Pattern p;
  if (const json* s = c.opt(j, "String")) {
    p.literal = c.str(*s, field + ".String");
  } else if (const json* r = c.opt(j, "Regex")) {
    const std::string re = c.str(*r, field + ".Regex");
    p.regex = std::make_shared<Regex>(re, fmt::format("{}: {}.Regex", c.source, field));
  } else {
    c.fail(field, "must be {\"String\": ...} or {\"Regex\": ...}", j);
  }
  return p;
}

SplitBehavior parse_behavior(const Ctx& c, const json& obj, const std::string& field, SplitBehavior dflt) {
  const json* b = c.opt(obj, "behavior");
  if (!b) return dflt;
  const std::string s = c.str(*b, field + ".behavior");
  if (s == "Removed") return SplitBehavior::Removed;
  if (s == "Isolated") return SplitBehavior::Isolated;
  if (s == "MergedWithPrevious") return SplitBehavior::MergedWithPrevious;
  if (s == "MergedWithNext") return SplitBehavior::MergedWithNext;
  if (s == "Contiguous") return SplitBehavior::Contiguous;
  c.fail(field + ".behavior", "must be Removed, Isolated, MergedWithPrevious, MergedWithNext or Contiguous", *b);
}

// Metaspace prepend_scheme with the legacy add_prefix_space flag.
PreTokenizer::Prepend parse_prepend(const Ctx& c, const json& j, const std::string& field) {
  PreTokenizer::Prepend p = PreTokenizer::Prepend::Always;
  if (const json* s = c.opt(j, "prepend_scheme")) {
    const std::string v = c.str(*s, field + ".prepend_scheme");
    if (v == "always") p = PreTokenizer::Prepend::Always;
    else if (v == "first") p = PreTokenizer::Prepend::First;
    else if (v == "never") p = PreTokenizer::Prepend::Never;
    else c.fail(field + ".prepend_scheme", "must be always, first or never", *s);
  }
  if (!c.boolean(j, "add_prefix_space", field, true)) p = PreTokenizer::Prepend::Never;
  return p;
}

constexpr int kMaxDepth = 16;  // nesting of Sequence components

Normalizer parse_normalizer(const Ctx& c, const json& j, const std::string& field, int depth) {
  const std::string t = c.type(j, field);
  Normalizer n;
  using K = Normalizer::Kind;
  if (t == "Sequence") {
    if (depth >= kMaxDepth) c.fail(field, "Sequence nested too deeply", j);
    n.kind = K::Sequence;
    const json* list = c.opt(j, "normalizers");
    if (!list) c.fail(field + ".normalizers", "missing", j);
    c.array(*list, field + ".normalizers");
    for (std::size_t i = 0; i < list->size(); ++i)
      n.children.push_back(parse_normalizer(c, (*list)[i], fmt::format("{}.normalizers[{}]", field, i), depth + 1));
  } else if (t == "Prepend") {
    n.kind = K::Prepend;
    const json* p = c.opt(j, "prepend");
    if (!p) c.fail(field + ".prepend", "missing", j);
    n.text = c.str(*p, field + ".prepend");
  } else if (t == "Replace") {
    n.kind = K::Replace;
    const json* p = c.opt(j, "pattern");
    if (!p) c.fail(field + ".pattern", "missing", j);
    n.pattern = parse_pattern(c, *p, field + ".pattern");
    n.text = c.opt_str(j, "content", field).value_or("");
  } else if (t == "NFC") {
    n.kind = K::NFC;
  } else if (t == "NFD") {
    n.kind = K::NFD;
  } else if (t == "NFKC") {
    n.kind = K::NFKC;
  } else if (t == "NFKD") {
    n.kind = K::NFKD;
  } else if (t == "Lowercase") {
    n.kind = K::Lowercase;
  } else if (t == "Strip") {
    n.kind = K::Strip;
    n.left = c.boolean(j, "strip_left", field, true);
    n.right = c.boolean(j, "strip_right", field, true);
  } else if (t == "StripAccents") {
    n.kind = K::StripAccents;
  } else {
    c.fail(field + ".type",
           "unknown normalizer type; posenc supports Sequence, Prepend, Replace, NFC, NFD, NFKC, NFKD, Lowercase, "
           "Strip, StripAccents",
           t);
  }
  return n;
}

PreTokenizer parse_pre_tokenizer(const Ctx& c, const json& j, const std::string& field, int depth) {
  const std::string t = c.type(j, field);
  PreTokenizer p;
  using K = PreTokenizer::Kind;
  if (t == "Sequence") {
    if (depth >= kMaxDepth) c.fail(field, "Sequence nested too deeply", j);
    p.kind = K::Sequence;
    const json* list = c.opt(j, "pretokenizers");
    if (!list) c.fail(field + ".pretokenizers", "missing", j);
    c.array(*list, field + ".pretokenizers");
    for (std::size_t i = 0; i < list->size(); ++i)
      p.children.push_back(
          parse_pre_tokenizer(c, (*list)[i], fmt::format("{}.pretokenizers[{}]", field, i), depth + 1));
  } else if (t == "ByteLevel") {
    p.kind = K::ByteLevel;
    p.add_prefix_space = c.boolean(j, "add_prefix_space", field, true);
    p.use_regex = c.boolean(j, "use_regex", field, true);
  } else if (t == "Split") {
    p.kind = K::Split;
    const json* pat = c.opt(j, "pattern");
    if (!pat) c.fail(field + ".pattern", "missing", j);
    p.pattern = parse_pattern(c, *pat, field + ".pattern");
    p.pattern.invert = c.boolean(j, "invert", field, false);
    if (!c.opt(j, "behavior")) c.fail(field + ".behavior", "missing", j);
    p.behavior = parse_behavior(c, j, field, SplitBehavior::Isolated);
  } else if (t == "Digits") {
    p.kind = K::Digits;
    p.individual_digits = c.boolean(j, "individual_digits", field, false);
  } else if (t == "Metaspace") {
    p.kind = K::Metaspace;
    const json* r = c.opt(j, "replacement");
    if (!r) c.fail(field + ".replacement", "missing", j);
    c.single_char(*r, field + ".replacement");
    p.replacement = r->get<std::string>();
    p.prepend = parse_prepend(c, j, field);
    p.split = c.boolean(j, "split", field, true);
  } else if (t == "Whitespace") {
    p.kind = K::Whitespace;
    // Rust regex \w+|[^\w\s]+ (Unicode \w: Alphabetic, M, Nd, Pc, Join_Control), inverted and removed.
    static const std::shared_ptr<Regex> re = std::make_shared<Regex>(
        R"([\p{L}\p{Nl}\p{M}\p{Nd}\p{Pc}\x{200C}\x{200D}]+|[^\p{L}\p{Nl}\p{M}\p{Nd}\p{Pc}\x{200C}\x{200D}\s]+)",
        "Whitespace regex");
    p.pattern.regex = re;
    p.pattern.invert = true;
  } else if (t == "WhitespaceSplit") {
    p.kind = K::WhitespaceSplit;
  } else if (t == "Punctuation") {
    p.kind = K::Punctuation;
    p.behavior = parse_behavior(c, j, field, SplitBehavior::Isolated);
  } else if (t == "CharDelimiterSplit") {
    p.kind = K::CharDelimiterSplit;
    const json* d = c.opt(j, "delimiter");
    if (!d) c.fail(field + ".delimiter", "missing", j);
    p.delimiter = c.single_char(*d, field + ".delimiter");
  } else {
    c.fail(field + ".type",
           "unknown pre-tokenizer type; posenc supports Sequence, ByteLevel, Split, Digits, Metaspace, Whitespace, "
           "WhitespaceSplit, Punctuation, CharDelimiterSplit",
           t);
  }
  return p;
}

Decoder parse_decoder(const Ctx& c, const json& j, const std::string& field, int depth) {
  const std::string t = c.type(j, field);
  Decoder d;
  using K = Decoder::Kind;
  if (t == "Sequence") {
    if (depth >= kMaxDepth) c.fail(field, "Sequence nested too deeply", j);
    d.kind = K::Sequence;
    const json* list = c.opt(j, "decoders");
    if (!list) c.fail(field + ".decoders", "missing", j);
    c.array(*list, field + ".decoders");
    for (std::size_t i = 0; i < list->size(); ++i)
      d.children.push_back(parse_decoder(c, (*list)[i], fmt::format("{}.decoders[{}]", field, i), depth + 1));
  } else if (t == "Replace") {
    d.kind = K::Replace;
    const json* p = c.opt(j, "pattern");
    if (!p) c.fail(field + ".pattern", "missing", j);
    d.pattern = parse_pattern(c, *p, field + ".pattern");
    d.text = c.opt_str(j, "content", field).value_or("");
  } else if (t == "ByteFallback") {
    d.kind = K::ByteFallback;
  } else if (t == "Fuse") {
    d.kind = K::Fuse;
  } else if (t == "Strip") {
    d.kind = K::Strip;
    const json* content = c.opt(j, "content");
    if (!content) c.fail(field + ".content", "missing", j);
    d.strip_char = c.single_char(*content, field + ".content");
    const json* start = c.opt(j, "start");
    const json* stop = c.opt(j, "stop");
    d.start = start ? static_cast<std::size_t>(c.integer(*start, field + ".start", 0, 1 << 20)) : 0;
    d.stop = stop ? static_cast<std::size_t>(c.integer(*stop, field + ".stop", 0, 1 << 20)) : 0;
  } else if (t == "ByteLevel") {
    d.kind = K::ByteLevel;
  } else if (t == "Metaspace") {
    d.kind = K::Metaspace;
    const json* r = c.opt(j, "replacement");
    if (!r) c.fail(field + ".replacement", "missing", j);
    c.single_char(*r, field + ".replacement");
    d.text = r->get<std::string>();
    d.prepend = parse_prepend(c, j, field) != PreTokenizer::Prepend::Never;
  } else if (t == "BPEDecoder") {
    d.kind = K::BPEDecoder;
    d.text = c.opt_str(j, "suffix", field).value_or("</w>");
  } else {
    c.fail(field + ".type",
           "unknown decoder type; posenc supports Sequence, Replace, ByteFallback, Fuse, Strip, ByteLevel, "
           "Metaspace, BPEDecoder",
           t);
  }
  return d;
}

// The post-processor as a `single` template over the sequence A (nested
// processors compose: each wraps the result of the previous one).
void parse_post_processor(const Ctx& c, const json& j, const std::string& field, int depth,
                          const BpeTokenizer& tok, std::vector<TemplatePiece>& tmpl) {
  const std::string t = c.type(j, field);
  auto check_id = [&](int64_t id, const std::string& f) {
    if (id < 0 || static_cast<std::size_t>(id) >= tok.id_to_token.size() ||
        !tok.assigned[static_cast<std::size_t>(id)])
      c.fail(f, "is not a token id of this vocabulary", std::to_string(id));
    return static_cast<int32_t>(id);
  };
  auto wrap = [&](const std::vector<TemplatePiece>& outer) {
    std::vector<TemplatePiece> inner = tmpl.empty() ? std::vector<TemplatePiece>{{true, {}}} : tmpl;
    std::vector<TemplatePiece> out;
    for (const TemplatePiece& p : outer) {
      if (p.sequence) out.insert(out.end(), inner.begin(), inner.end());
      else out.push_back(p);
    }
    tmpl = std::move(out);
  };
  if (t == "Sequence") {
    if (depth >= kMaxDepth) c.fail(field, "Sequence nested too deeply", j);
    const json* list = c.opt(j, "processors");
    if (!list) c.fail(field + ".processors", "missing", j);
    c.array(*list, field + ".processors");
    for (std::size_t i = 0; i < list->size(); ++i)
      parse_post_processor(c, (*list)[i], fmt::format("{}.processors[{}]", field, i), depth + 1, tok, tmpl);
  } else if (t == "ByteLevel") {
    // offsets only
  } else if (t == "TemplateProcessing") {
    const json* single = c.opt(j, "single");
    if (!single) c.fail(field + ".single", "missing", j);
    c.array(*single, field + ".single");
    const json* specials = c.opt(j, "special_tokens");
    std::vector<TemplatePiece> outer;
    for (std::size_t i = 0; i < single->size(); ++i) {
      const std::string f = fmt::format("{}.single[{}]", field, i);
      const json& item = c.object((*single)[i], f);
      if (const json* st = c.opt(item, "SpecialToken")) {
        c.object(*st, f + ".SpecialToken");
        const json* idj = c.opt(*st, "id");
        if (!idj) c.fail(f + ".SpecialToken.id", "missing", *st);
        const std::string name = c.str(*idj, f + ".SpecialToken.id");
        if (!specials || !specials->is_object() || !specials->contains(name))
          c.fail(f + ".SpecialToken.id", fmt::format("is not in {}.special_tokens", field), name);
        const json& entry = c.object((*specials)[name], fmt::format("{}.special_tokens.{}", field, name));
        const json* ids = c.opt(entry, "ids");
        const std::string fi = fmt::format("{}.special_tokens.{}.ids", field, name);
        if (!ids) c.fail(fi, "missing", entry);
        c.array(*ids, fi);
        TemplatePiece p;
        for (std::size_t k = 0; k < ids->size(); ++k) {
          const std::string fk = fmt::format("{}[{}]", fi, k);
          p.ids.push_back(check_id(c.integer((*ids)[k], fk, 0, INT32_MAX), fk));
        }
        outer.push_back(std::move(p));
      } else if (const json* sq = c.opt(item, "Sequence")) {
        c.object(*sq, f + ".Sequence");
        const json* idj = c.opt(*sq, "id");
        const std::string which = idj ? c.str(*idj, f + ".Sequence.id") : "A";
        if (which != "A" && which != "B") c.fail(f + ".Sequence.id", "must be A or B", which);
        if (which == "A") outer.push_back({true, {}});  // B has no meaning for a single sequence
      } else {
        c.fail(f, "must be {\"SpecialToken\": ...} or {\"Sequence\": ...}", item);
      }
    }
    wrap(outer);
  } else if (t == "BertProcessing" || t == "RobertaProcessing") {
    auto pair_id = [&](const char* key) {
      const json* v = c.opt(j, key);
      const std::string f = field + "." + key;
      if (!v || !v->is_array() || v->size() != 2) c.fail(f, "must be [token, id]", v ? *v : json());
      return check_id(c.integer((*v)[1], f + "[1]", 0, INT32_MAX), f + "[1]");
    };
    const int32_t cls = pair_id("cls"), sep = pair_id("sep");
    wrap({{false, {cls}}, {true, {}}, {false, {sep}}});
  } else {
    c.fail(field + ".type",
           "unknown post-processor type; posenc supports TemplateProcessing, ByteLevel, Sequence, BertProcessing, "
           "RobertaProcessing",
           t);
  }
}

bool has_prefix_normalizer(const Normalizer& n) {
  if (n.kind == Normalizer::Kind::Prepend) return true;
  return std::any_of(n.children.begin(), n.children.end(), has_prefix_normalizer);
}

bool has_prefix_pre_tokenizer(const PreTokenizer& p) {
  if (p.kind == PreTokenizer::Kind::Metaspace) return p.prepend != PreTokenizer::Prepend::Never;
  if (p.kind == PreTokenizer::Kind::ByteLevel) return p.add_prefix_space;
  return std::any_of(p.children.begin(), p.children.end(), has_prefix_pre_tokenizer);
}

bool has_byte_level(const PreTokenizer& p) {
  if (p.kind == PreTokenizer::Kind::ByteLevel) return true;
  return std::any_of(p.children.begin(), p.children.end(), has_byte_level);
}

// bos_token / eos_token of tokenizer_config.json: a string, or an AddedToken object.
std::optional<std::string> config_token(const Ctx& c, const json& cfg, const char* key) {
  const json* v = c.opt(cfg, key);
  if (!v) return std::nullopt;
  if (v->is_string()) return v->get<std::string>();
  if (v->is_object()) {
    const json* content = c.opt(*v, "content");
    if (content) return c.str(*content, std::string(key) + ".content");
  }
  c.fail(key, "must be a string or an object with \"content\"", *v);
}

}  // namespace

std::shared_ptr<BpeTokenizer> parse_tokenizer_json(std::string_view json_text, std::string_view source,
                                                   std::string_view config_json) {
  Ctx c{std::string(source)};
  json root;
  try {
    root = json::parse(json_text.begin(), json_text.end());
  } catch (const json::exception& e) {
    throw TokenizerError(fmt::format("{}: malformed JSON: {}", source, e.what()));
  }
  if (!root.is_object()) c.fail("(root)", "malformed tokenizer.json: must be a JSON object", root);
  const json* model = c.opt(root, "model");
  if (!model) c.fail("model", "missing", "nothing");
  c.object(*model, "model");
  // Older files (GPT-2, bert-base-uncased, t5-base) have no "type": the Rust
  // library tells the models apart by their fields, and so do we.
  std::string type, inferred;
  if (const json* t = c.opt(*model, "type")) {
    type = c.str(*t, "model.type");
  } else {
    const json* v = c.opt(*model, "vocab");
    if (c.opt(*model, "merges")) type = "BPE";
    else if (c.opt(*model, "max_input_chars_per_word")) type = "WordPiece";
    else if (v && v->is_array()) type = "Unigram";
    else type = "WordLevel";
    inferred = " (no \"type\"; inferred from the fields)";
  }
  if (type != "BPE")
    throw TokenizerError(fmt::format(
        "{}: model.type: {} is not supported; posenc supports BPE tokenizer.json files{}", source, type, inferred));

  auto tok = std::make_shared<BpeTokenizer>();
  BpeTokenizer& t = *tok;
  t.source = std::string(source);

  // model.vocab and added_tokens define the id space.
  const json* vocab = c.opt(*model, "vocab");
  if (!vocab) c.fail("model.vocab", "missing", "nothing");
  c.object(*vocab, "model.vocab");
  const json* added = c.opt(root, "added_tokens");
  if (added) c.array(*added, "added_tokens");
  const std::size_t entries = vocab->size() + (added ? added->size() : 0);
  const int64_t max_id = static_cast<int64_t>(std::min<std::size_t>(2 * entries + 256, INT32_MAX));
  auto place = [&](int64_t id, const std::string& content, const std::string& field, bool from_added) {
    const auto k = static_cast<std::size_t>(id);
    if (k >= t.id_to_token.size()) {
      t.id_to_token.resize(k + 1);
      t.assigned.resize(k + 1, false);
    }
    if (t.assigned[k] && t.id_to_token[k] != content && !from_added)
      c.fail(field, fmt::format("id {} is already given to '{}'", id, t.id_to_token[k]), content);
    t.id_to_token[k] = content;
    t.assigned[k] = true;
  };
  t.vocab.reserve(vocab->size() * 2);
  for (auto it = vocab->begin(); it != vocab->end(); ++it) {
    const std::string field = "model.vocab." + it.key();
    const int64_t id = c.integer(it.value(), field, 0, max_id);
    place(id, it.key(), field, false);
    t.vocab.emplace(it.key(), static_cast<int32_t>(id));
  }

  // Added tokens, in file order, get the ids the Rust library gives them
  // (AddedVocabulary::add_tokens; it only warns when the file says otherwise):
  // the vocabulary's id for the same content, else the id of an added token
  // with the same content, else the next new id (vocab_size, or one past the
  // largest added id once that reaches vocab_size).
  if (added) {
    const auto model_size = static_cast<int64_t>(t.vocab.size());
    int64_t max_added = -1;
    for (std::size_t i = 0; i < added->size(); ++i) {
      const std::string f = fmt::format("added_tokens[{}]", i);
      const json& a = c.object((*added)[i], f);
      AddedToken at;
      const json* content = c.opt(a, "content");
      if (!content) c.fail(f + ".content", "missing", a);
      at.content = c.str(*content, f + ".content");
      const json* id = c.opt(a, "id");
      if (!id) c.fail(f + ".id", "missing", a);
      c.integer(*id, f + ".id", 0, max_id);
      at.single_word = c.boolean(a, "single_word", f, false);
      at.lstrip = c.boolean(a, "lstrip", f, false);
      at.rstrip = c.boolean(a, "rstrip", f, false);
      at.special = c.boolean(a, "special", f, false);
      at.normalized = c.boolean(a, "normalized", f, !at.special);
      if (at.content.empty()) continue;  // the Rust library ignores empty tokens
      auto same = std::find_if(t.added.begin(), t.added.end(), [&](const AddedToken& o) { return o.content == at.content; });
      int64_t idv;
      if (auto v = t.vocab.find(at.content); v != t.vocab.end()) idv = v->second;
      else if (same != t.added.end()) idv = same->id;
      else idv = max_added >= model_size || model_size == 0 ? max_added + 1 : model_size;
      if (idv > max_id) c.fail(f + ".id", "too many added tokens for the vocabulary", *id);
      at.id = static_cast<int32_t>(idv);
      max_added = std::max(max_added, idv);
      place(at.id, at.content, f + ".id", true);
      if (same != t.added.end()) *same = std::move(at);  // a repeated content updates the flags of its id
      else t.added.push_back(std::move(at));
    }
  }

  // Merges, in either serialization.
  const json* merges = c.opt(*model, "merges");
  if (merges) c.array(*merges, "model.merges");
  t.continuing_subword_prefix = c.opt_str(*model, "continuing_subword_prefix", "model").value_or("");
  t.end_of_word_suffix = c.opt_str(*model, "end_of_word_suffix", "model").value_or("");
  const std::size_t prefix_len = t.continuing_subword_prefix.size();
  if (merges) {
    t.merges.reserve(merges->size() * 2);
    for (std::size_t i = 0; i < merges->size(); ++i) {
      const std::string f = fmt::format("model.merges[{}]", i);
      const json& m = (*merges)[i];
      std::string a, b;
      if (m.is_string()) {
        const std::string s = m.get<std::string>();
        const std::size_t sp = s.find(' ');
        if (sp == std::string::npos || s.find(' ', sp + 1) != std::string::npos)
          c.fail(f, "must be two tokens separated by one space", m);
        a = s.substr(0, sp);
        b = s.substr(sp + 1);
      } else if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string()) {
        a = m[0].get<std::string>();
        b = m[1].get<std::string>();
      } else {
        c.fail(f, "must be \"a b\" or [\"a\", \"b\"]", m);
      }
      auto ia = t.vocab.find(a), ib = t.vocab.find(b);
      if (ia == t.vocab.end()) c.fail(f, fmt::format("merge token '{}' is not in model.vocab", a), m);
      if (ib == t.vocab.end()) c.fail(f, fmt::format("merge token '{}' is not in model.vocab", b), m);
      const std::string merged =
          a + (prefix_len && b.compare(0, prefix_len, t.continuing_subword_prefix) == 0 ? b.substr(prefix_len) : b);
      auto im = t.vocab.find(merged);
      if (im == t.vocab.end()) c.fail(f, fmt::format("merged token '{}' is not in model.vocab", merged), m);
      t.merges.set(ia->second, ib->second, static_cast<uint32_t>(i), im->second, true);  // repeated: the later rank wins, as in Rust
    }
  }
  if (auto unk = c.opt_str(*model, "unk_token", "model")) {
    auto it = t.vocab.find(*unk);
    if (it != t.vocab.end()) t.unk_id = it->second;  // an unk missing from the vocabulary: unknown chars are dropped
  }
  t.byte_fallback = c.boolean(*model, "byte_fallback", "model", false);
  t.fuse_unk = c.boolean(*model, "fuse_unk", "model", false);
  t.ignore_merges = c.boolean(*model, "ignore_merges", "model", false);
  if (const json* d = c.opt(*model, "dropout"))
    if (!d->is_number()) c.fail("model.dropout", "must be a number or null", *d);

  if (const json* n = c.opt(root, "normalizer")) t.normalizer = parse_normalizer(c, *n, "normalizer", 0);
  if (const json* p = c.opt(root, "pre_tokenizer")) t.pre_tokenizer = parse_pre_tokenizer(c, *p, "pre_tokenizer", 0);
  if (const json* d = c.opt(root, "decoder")) t.decoder = parse_decoder(c, *d, "decoder", 0);
  if (const json* p = c.opt(root, "post_processor")) parse_post_processor(c, *p, "post_processor", 0, t, t.single_template);

  auto token_to_id = [&](const std::string& s) -> std::optional<int32_t> {
    for (const AddedToken& a : t.added)
      if (a.content == s) return a.id;
    auto it = t.vocab.find(s);
    if (it != t.vocab.end()) return it->second;
    return std::nullopt;
  };

  // tokenizer_config.json: add_bos_token / add_eos_token rebuild the template
  // as transformers' LlamaTokenizerFast.update_post_processor does.
  std::optional<std::string> cfg_bos, cfg_eos;
  if (!config_json.empty()) {
    Ctx cc{std::string(source) + " (tokenizer_config.json)"};
    json cfg;
    try {
      cfg = json::parse(config_json.begin(), config_json.end());
    } catch (const json::exception& e) {
      throw TokenizerError(fmt::format("{}: malformed JSON: {}", cc.source, e.what()));
    }
    if (!cfg.is_object()) cc.fail("(root)", "must be a JSON object", cfg);
    cfg_bos = config_token(cc, cfg, "bos_token");
    cfg_eos = config_token(cc, cfg, "eos_token");
    const json* ab = cc.opt(cfg, "add_bos_token");
    const json* ae = cc.opt(cfg, "add_eos_token");
    if (ab && !ab->is_boolean()) cc.fail("add_bos_token", "must be true or false", *ab);
    if (ae && !ae->is_boolean()) cc.fail("add_eos_token", "must be true or false", *ae);
    if (ab || ae) {
      const bool leading = !t.single_template.empty() && !t.single_template.front().sequence;
      const bool trailing = !t.single_template.empty() && !t.single_template.back().sequence;
      const bool add_bos = ab ? ab->get<bool>() : leading;
      const bool add_eos = ae ? ae->get<bool>() : trailing;
      std::vector<TemplatePiece> tmpl;
      auto special = [&](const std::optional<std::string>& name, const char* key, bool at_front) {
        std::optional<int32_t> id = name ? token_to_id(*name) : std::nullopt;
        if (!id) {  // fall back to the file's own template token
          const TemplatePiece* p = at_front ? (leading ? &t.single_template.front() : nullptr)
                                            : (trailing ? &t.single_template.back() : nullptr);
          if (p) return *p;
          cc.fail(key, "names no token of the vocabulary", name.value_or("nothing"));
        }
        return TemplatePiece{false, {*id}};
      };
      if (add_bos) tmpl.push_back(special(cfg_bos, "bos_token", true));
      tmpl.push_back({true, {}});
      if (add_eos) tmpl.push_back(special(cfg_eos, "eos_token", false));
      t.single_template = tmpl.size() == 1 ? std::vector<TemplatePiece>{} : tmpl;
    }
  }
  if (!t.single_template.empty() && !t.single_template.front().sequence && !t.single_template.front().ids.empty())
    t.bos = t.single_template.front().ids.front();
  if (cfg_eos) t.eos = token_to_id(*cfg_eos);
  if (!t.eos) {
    for (const char* name : {"</s>", "<|endoftext|>", "<|im_end|>", "<|end_of_text|>"}) {
      for (const AddedToken& a : t.added)
        if (a.content == name) t.eos = a.id;
      if (t.eos) break;
    }
  }

  t.prefix_space = (t.normalizer && has_prefix_normalizer(*t.normalizer)) ||
                   (t.pre_tokenizer && has_prefix_pre_tokenizer(*t.pre_tokenizer));
  if (t.pre_tokenizer && has_byte_level(*t.pre_tokenizer)) t.describe = "tokenizer.json BPE (byte-level)";
  else if (t.byte_fallback) t.describe = "tokenizer.json BPE (SentencePiece-style, byte_fallback)";
  else t.describe = "tokenizer.json BPE";
  t.finalize();
  return tok;
}

}  // namespace posenc::detail
