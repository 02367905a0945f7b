// tokenizer.json tokenizers against the Hugging Face `tokenizers` library
// (Rust, 0.23.2 through its Node bindings): the saved references of
// tools/refs/hf_tokenizers_refs.mjs for the five shared BPE files and the
// variants (a shared file with components replaced), then the queries of the
// API on the real files, tokenizer_config.json, and malformed input.
#include <cstdlib>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "model/tokenizer_refs.hpp"
#include "posenc/error.hpp"
#include "posenc/io.hpp"
#include "posenc/tokenizer.hpp"
#include "test_support.hpp"

namespace POSENC_UNITY_ID {  // this file's own namespace in the tests' unity build (CMakeLists.txt)

using namespace posenc;
using namespace posenc::test;

namespace {

std::vector<std::string> reference_names() {
  std::vector<std::string> names;
  for (const auto& e : std::filesystem::directory_iterator(tokenizer_ref_dir() / "hf_tokenizers"))
    if (e.path().extension() == ".json") names.push_back(e.path().stem().string());
  std::sort(names.begin(), names.end());
  return names;
}

const Tokenizer& shared_tokenizer(const std::string& rel) {
  static std::map<std::string, Tokenizer> cache;
  auto it = cache.find(rel);
  if (it == cache.end()) it = cache.emplace(rel, Tokenizer::load_tokenizer_json(shared_dir() / rel)).first;
  return it->second;
}

std::string expect_error(const std::function<void()>& f) {
  try {
    f();
  } catch (const TokenizerError& e) {
    return e.what();
  }
  ADD_FAILURE() << "no TokenizerError";
  return {};
}

#define EXPECT_HAS(msg, part) EXPECT_NE((msg).find(part), std::string::npos) << "'" << (part) << "' not in: " << (msg)

// A tiny BPE tokenizer.json: vocab a b c ab abc, merges "a b", "ab c".
nlohmann::json tiny_json() {
  return nlohmann::json::parse(R"({
    "version": "1.0", "added_tokens": [], "normalizer": null, "pre_tokenizer": null, "post_processor": null,
    "decoder": null,
    "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
              "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
              "vocab": {"a": 0, "b": 1, "c": 2, "ab": 3, "abc": 4}, "merges": ["a b", "ab c"]}})");
}

}  // namespace

class TokenizerJsonRef : public ::testing::TestWithParam<std::string> {};

// Every hard string, with and without special tokens, id for id; decode as
// the library's decode(ids, skip_special_tokens=true) (posenc gives raw bytes
// where the library would print U+FFFD; no reference case needs that); the
// whole text as one string, count and chunk hashes.
TEST_P(TokenizerJsonRef, MatchesHuggingFaceTokenizers) {
  const auto ref = read_json(tokenizer_ref_dir() / "hf_tokenizers" / (GetParam() + ".json"));
  ASSERT_EQ(ref["library_version"], "0.23.2");
  const Tokenizer tok = load_reference_tokenizer(ref);
  for (const auto& c : ref["cases"]) {
    const std::string text = c["text"];
    SCOPED_TRACE(show(text));
    const auto ids = c["ids"].get<std::vector<int32_t>>();
    const auto ids_special = c["ids_special"].get<std::vector<int32_t>>();
    EXPECT_EQ(tok.encode_hf(text, false), ids);
    EXPECT_EQ(tok.encode_hf(text, true), ids_special);
    EXPECT_EQ(tok.decode(ids), c["decode"].get<std::string>());
    EXPECT_EQ(tok.decode(ids_special), c["decode_special"].get<std::string>());
    if (c["round_trips"].get<bool>()) {
      EXPECT_EQ(tok.decode(ids), text);
    }
    // Streaming: decode(prev, token) pieces concatenate to decode(ids) when no
    // special token sits after the first piece (after one, the next token
    // starts the text again).
    bool special_inside = false;
    for (std::size_t i = 1; i < ids_special.size(); ++i) special_inside |= tok.is_special(ids_special[i]);
    if (!special_inside) {
      std::string streamed;
      int32_t prev = -1;
      for (int32_t t : ids_special) streamed += tok.decode(prev, t), prev = t;
      EXPECT_EQ(streamed, tok.decode(ids_special));
    }
  }
  const std::string text = read_file(text_path());
  const auto ids = tok.encode_hf(text, false);
  EXPECT_EQ(compare_whole_text(ids, ref["whole_text"]), "");
  if (ref["whole_text"]["decode_round_trips"].get<bool>()) {
    EXPECT_TRUE(tok.decode(ids) == text);
  }
}

INSTANTIATE_TEST_SUITE_P(TokenizerJsonShared, TokenizerJsonRef, ::testing::ValuesIn(reference_names()),
                         [](const auto& info) {
                           std::string n = info.param;
                           for (char& ch : n)
                             if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
                           return n;
                         });

// Re-runs the reference script into a temporary directory: the saved files
// must be exactly what the installed library produces.
TEST(TokenizerJson, ReferenceScriptReproducesSavedFiles) {
  if (!ref_installed("tokenizers")) GTEST_SKIP() << "tools/refs/node_modules/tokenizers not installed (scripts/install-refs)";
  TempDir d;
  const std::string cmd = fmt::format("cd '{}' && node tools/refs/hf_tokenizers_refs.mjs --shared '{}' --out '{}' 2>/dev/null",
                                      POSENC_SOURCE_DIR, shared_dir().string(), d.path().string());
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  for (const auto& name : reference_names()) {
    SCOPED_TRACE(name);
    const auto fresh = d.path() / (name + ".json");
    ASSERT_TRUE(std::filesystem::exists(fresh));
    EXPECT_EQ(read_json(fresh), read_json(tokenizer_ref_dir() / "hf_tokenizers" / (name + ".json")));
  }
}

// The queries on the real files (ids from their vocabularies and configs).
TEST(TokenizerJson, QueriesOnSharedFiles) {
  const Tokenizer& gpt2 = shared_tokenizer("tokenizers/gpt2/tokenizer.json");
  EXPECT_EQ(gpt2.describe(), "tokenizer.json BPE (byte-level)");
  EXPECT_EQ(gpt2.vocab_size(), 50257);
  EXPECT_FALSE(gpt2.bos_id().has_value());
  EXPECT_EQ(gpt2.eos_id(), 50256);
  EXPECT_FALSE(gpt2.adds_prefix_space());
  EXPECT_TRUE(gpt2.is_special(50256));
  EXPECT_FALSE(gpt2.is_special(15496));
  EXPECT_EQ(gpt2.token_id("Hello"), 15496);
  EXPECT_EQ(gpt2.token_id("\xc4\xa0world"), 995);  // "Ġworld"
  EXPECT_FALSE(gpt2.token_id("no such token").has_value());
  EXPECT_TRUE(gpt2.usable());
  EXPECT_EQ(gpt2.encode("Hello world", true, true), (std::vector<int32_t>{15496, 995, 50256}));  // no BOS: none

  const Tokenizer& mistral = shared_tokenizer("tokenizers/mistral-7b-v0.1/tokenizer.json");
  EXPECT_EQ(mistral.describe(), "tokenizer.json BPE (SentencePiece-style, byte_fallback)");
  EXPECT_EQ(mistral.vocab_size(), 32000);
  EXPECT_EQ(mistral.bos_id(), 1);
  EXPECT_EQ(mistral.eos_id(), 2);
  EXPECT_TRUE(mistral.adds_prefix_space());
  EXPECT_TRUE(mistral.is_special(0) && mistral.is_special(1) && mistral.is_special(2));
  EXPECT_FALSE(mistral.is_special(3));
  EXPECT_EQ(mistral.piece(3), "<0x00>");
  const auto plain = mistral.encode_hf("Hello world", false);
  auto both = plain;
  both.insert(both.begin(), 1);
  both.push_back(2);
  EXPECT_EQ(mistral.encode("Hello world", true, true), both);
  EXPECT_EQ(mistral.decode(1, plain[0]), "Hello");  // after BOS the token starts the text: Strip removes the space
  EXPECT_EQ(mistral.decode(plain[0], plain[1]), " world");

  // TinyStories-656K: its special tokens are "normalized" added tokens; the
  // Rust library then decodes them as text (its id_to_token gives
  // "\u2581<|start_story|>", which is not a special token's content), so
  // is_special() says no, as decode(ids, skip_special_tokens=true) does.
  const Tokenizer& tiny = shared_tokenizer("models/TinyStories-656K/tokenizer.json");
  EXPECT_EQ(tiny.bos_id(), 1);
  EXPECT_EQ(tiny.eos_id(), 2);  // tokenizer_config.json eos_token <|end_story|>
  EXPECT_TRUE(tiny.adds_prefix_space());
  EXPECT_FALSE(tiny.is_special(1));
  EXPECT_EQ(tiny.token_id("<|start_story|>"), 1);
  EXPECT_EQ(tiny.decode({1}), "<|start_story|>");

  const Tokenizer& pythia = shared_tokenizer("tokenizers/pythia-70m/tokenizer.json");
  EXPECT_FALSE(pythia.bos_id().has_value());  // tokenizer_config has bos_token but no add_bos_token
  EXPECT_EQ(pythia.eos_id(), 0);
  EXPECT_EQ(pythia.vocab_size(), 50277);
  const Tokenizer& smol = shared_tokenizer("tokenizers/smollm2-135m-instruct/tokenizer.json");
  EXPECT_FALSE(smol.bos_id().has_value());
  EXPECT_EQ(smol.eos_id(), 2);  // tokenizer_config eos_token <|im_end|>
  EXPECT_TRUE(smol.is_special(1));
}

// tokenizer_config.json add_bos_token / add_eos_token rebuild the template
// as transformers' LlamaTokenizerFast does; without them the file's
// post-processor rules.
TEST(TokenizerJson, TokenizerConfigAddBosAddEos) {
  const std::string json = read_file(shared_dir() / "tokenizers/mistral-7b-v0.1/tokenizer.json");
  const auto plain = Tokenizer::from_tokenizer_json(json, "mistral").encode_hf("Hello", false);
  auto with = [&](const std::vector<int32_t>& pre, const std::vector<int32_t>& post) {
    std::vector<int32_t> v = pre;
    v.insert(v.end(), plain.begin(), plain.end());
    v.insert(v.end(), post.begin(), post.end());
    return v;
  };
  EXPECT_EQ(Tokenizer::from_tokenizer_json(json, "mistral").encode_hf("Hello", true), with({1}, {}));
  const auto eos = Tokenizer::from_tokenizer_json(json, "mistral", R"({"add_eos_token": true, "eos_token": "</s>"})");
  EXPECT_EQ(eos.encode_hf("Hello", true), with({1}, {2}));
  const auto nobos = Tokenizer::from_tokenizer_json(
      json, "mistral", R"({"add_bos_token": false, "bos_token": {"content": "<s>", "special": true}})");
  EXPECT_EQ(nobos.encode_hf("Hello", true), plain);
  EXPECT_FALSE(nobos.bos_id().has_value());
  const auto other = Tokenizer::from_tokenizer_json(json, "mistral", R"({"add_bos_token": true, "bos_token": "</s>"})");
  EXPECT_EQ(other.bos_id(), 2);
  EXPECT_HAS(expect_error([&] { Tokenizer::from_tokenizer_json(json, "m.json", "{nope"); }), "tokenizer_config.json");
  EXPECT_HAS(expect_error([&] { Tokenizer::from_tokenizer_json(json, "m.json", R"({"add_bos_token": 1})"); }),
             "add_bos_token");
}

// Characters a vocabulary lacks never abort: byte fallback, else unk (fused
// when fuse_unk), else they are dropped, as the Rust library does.
TEST(TokenizerJson, MissingCharactersNeverAbort) {
  auto j = tiny_json();
  EXPECT_EQ(Tokenizer::from_tokenizer_json(j.dump(), "tiny").encode_hf("abc\xe2\x98\x83\xe2\x98\x83" "ab", false),
            (std::vector<int32_t>{4, 3}));
  j["model"]["vocab"]["<unk>"] = 5;
  j["model"]["unk_token"] = "<unk>";
  EXPECT_EQ(Tokenizer::from_tokenizer_json(j.dump(), "tiny").encode_hf("a\xe2\x98\x83\xe2\x98\x83" "b", false),
            (std::vector<int32_t>{0, 5, 5, 1}));
  j["model"]["fuse_unk"] = true;
  EXPECT_EQ(Tokenizer::from_tokenizer_json(j.dump(), "tiny").encode_hf("a\xe2\x98\x83\xe2\x98\x83" "b", false),
            (std::vector<int32_t>{0, 5, 1}));
  j["model"]["byte_fallback"] = true;
  j["model"]["vocab"]["<0xE2>"] = 6;
  j["model"]["vocab"]["<0x98>"] = 7;
  j["model"]["vocab"]["<0x83>"] = 8;
  j["decoder"] = nlohmann::json::parse(R"({"type": "ByteFallback"})");
  const auto t = Tokenizer::from_tokenizer_json(j.dump(), "tiny");
  EXPECT_EQ(t.encode_hf("a\xe2\x98\x83" "b", false), (std::vector<int32_t>{0, 6, 7, 8, 1}));
  EXPECT_EQ(t.decode({0, 6, 7, 8, 1}), "a\xe2\x98\x83" "b");
  // Invalid UTF-8 input is read as the Rust library would see it after a lossy conversion (U+FFFD).
  EXPECT_EQ(t.encode_hf("a\xff" "b", false), t.encode_hf("a\xef\xbf\xbd" "b", false));
}

// ---- malformed input: TokenizerError naming the file, the field and the value ----

TEST(TokenizerJsonErrors, WordPieceAndUnigramAreRefused) {
  for (const auto& [dir, type] : std::vector<std::pair<std::string, std::string>>{
           {"bert-base-uncased", "WordPiece"}, {"t5-base", "Unigram"}, {"flan-t5-large", "Unigram"}}) {
    const auto path = shared_dir() / "tokenizers" / dir / "tokenizer.json";
    const std::string msg = expect_error([&] { Tokenizer::load_tokenizer_json(path); });
    EXPECT_HAS(msg, path.string());
    EXPECT_HAS(msg, "model.type: " + type + " is not supported; posenc supports BPE tokenizer.json files");
  }
}

TEST(TokenizerJsonErrors, MalformedFilesNameTheField) {
  EXPECT_THROW(Tokenizer::load_tokenizer_json(shared_dir() / "no/such/tokenizer.json"), IoError);
  EXPECT_HAS(expect_error([] { Tokenizer::from_tokenizer_json("{\"model\": ", "bad.json"); }), "bad.json: malformed JSON");
  EXPECT_HAS(expect_error([] { Tokenizer::from_tokenizer_json("[1, 2]", "bad.json"); }), "must be a JSON object");
  EXPECT_HAS(expect_error([] { Tokenizer::from_tokenizer_json("{}", "bad.json"); }), "bad.json: model: missing");

  auto with = [](const std::function<void(nlohmann::json&)>& edit) {
    auto j = tiny_json();
    edit(j);
    return expect_error([&] { Tokenizer::from_tokenizer_json(j.dump(), "tiny.json"); });
  };
  std::string m = with([](auto& j) { j["model"]["merges"] = {"a q"}; });
  EXPECT_HAS(m, "tiny.json: model.merges[0]: merge token 'q' is not in model.vocab");
  m = with([](auto& j) { j["model"]["merges"] = nlohmann::json::array({nlohmann::json::array({"c", "a"})}); });
  EXPECT_HAS(m, "model.merges[0]: merged token 'ca' is not in model.vocab");
  m = with([](auto& j) { j["model"]["merges"] = nlohmann::json::array({"abc"}); });
  EXPECT_HAS(m, "model.merges[0]: must be two tokens separated by one space (got \"abc\")");
  m = with([](auto& j) { j["model"]["vocab"]["d"] = 1; });
  EXPECT_HAS(m, "model.vocab.");
  EXPECT_HAS(m, "is already given to");
  m = with([](auto& j) { j["model"]["vocab"]["d"] = -4; });
  EXPECT_HAS(m, "model.vocab.d: must be in [0,");
  m = with([](auto& j) { j["pre_tokenizer"] = {{"type", "Nope"}}; });
  EXPECT_HAS(m, "tiny.json: pre_tokenizer.type: unknown pre-tokenizer type");
  EXPECT_HAS(m, "(got Nope)");
  m = with([](auto& j) {
    j["pre_tokenizer"] = nlohmann::json::parse(
        R"({"type": "Sequence", "pretokenizers": [{"type": "Split", "pattern": {"Regex": "(unclosed"}, "behavior": "Isolated"}]})");
  });
  EXPECT_HAS(m, "tiny.json: pre_tokenizer.pretokenizers[0].pattern.Regex: regex rejected by PCRE2");
  EXPECT_HAS(m, "(unclosed");
  m = with([](auto& j) {
    j["pre_tokenizer"] = nlohmann::json::parse(R"({"type": "Split", "pattern": {"Regex": "a"}, "behavior": "Sideways"})");
  });
  EXPECT_HAS(m, "pre_tokenizer.behavior: must be Removed, Isolated");
  m = with([](auto& j) { j["normalizer"] = {{"type", "BertNormalizer"}}; });
  EXPECT_HAS(m, "normalizer.type: unknown normalizer type");
  EXPECT_HAS(m, "BertNormalizer");
  m = with([](auto& j) { j["decoder"] = {{"type", "WordPiece"}}; });
  EXPECT_HAS(m, "decoder.type: unknown decoder type");
  m = with([](auto& j) { j["post_processor"] = {{"type", "Magic"}}; });
  EXPECT_HAS(m, "post_processor.type: unknown post-processor type");
  m = with([](auto& j) {
    j["post_processor"] = nlohmann::json::parse(
        R"({"type": "TemplateProcessing", "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}], "special_tokens": {}})");
  });
  EXPECT_HAS(m, "post_processor.single[0].SpecialToken.id: is not in post_processor.special_tokens (got <s>)");
  m = with([](auto& j) { j["added_tokens"] = nlohmann::json::parse(R"([{"id": 9}])"); });
  EXPECT_HAS(m, "added_tokens[0].content: missing");
  m = with([](auto& j) { j["model"]["byte_fallback"] = "yes"; });
  EXPECT_HAS(m, "model.byte_fallback: must be true or false");
  m = with([](auto& j) { j["model"]["type"] = "WordLevel"; });
  EXPECT_HAS(m, "model.type: WordLevel is not supported");
}

}  // namespace POSENC_UNITY_ID
