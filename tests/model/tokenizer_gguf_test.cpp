// GGUF-embedded vocabularies built from real data: the SentencePiece path
// against llama.cpp's llama-tokenize (de3ff81) on stories260K.gguf, the
// byte-level BPE path against the Hugging Face library on the same
// vocabularies, the all-equal-scores vocabulary of TinyStories-656K-Q8_0.gguf,
// and malformed vocabularies.
#include <cstdlib>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "eval/llama_cpp_cache.hpp"
#include "model/tokenizer_refs.hpp"
#include "posenc/error.hpp"
#include "posenc/io.hpp"
#include "posenc/tokenizer.hpp"
#include "test_support.hpp"

namespace POSENC_UNITY_ID {  // this file's own namespace in the tests' unity build (CMakeLists.txt)

using namespace posenc;
using namespace posenc::test;

namespace {

const Tokenizer& tok512() {
  static const Tokenizer t = Tokenizer::load_llama2c(tokenizer_path(), 512);
  return t;
}

std::string spaces_to_u2581(const std::string& s) {
  std::string o;
  for (char c : s) {
    if (c == ' ') o += "\xe2\x96\x81";
    else o += c;
  }
  return o;
}

// stories260K.gguf's embedded vocabulary is tok512.bin's with spaces written
// as U+2581, ids 1 and 2 named "<s>" and "</s>" (tok512: "\n<s>\n",
// "\n</s>\n"), types unknown / control / byte, scores identical (checked with
// gguf-py on the file; the GGUF reader's own test reads it directly).
SentencePieceVocab stories260k_vocab() {
  SentencePieceVocab v;
  for (int i = 0; i < tok512().vocab_size(); ++i) {
    v.pieces.push_back(spaces_to_u2581(tok512().piece(i)));
    v.scores.push_back(tok512().score(i));
    v.token_types.push_back(i == 0 ? 2 : i < 3 ? 3 : i < 259 ? 6 : 1);
  }
  v.pieces[1] = "<s>";
  v.pieces[2] = "</s>";
  v.bos_id = 1;
  v.eos_id = 2;
  v.unk_id = 0;
  v.source = "stories260K vocabulary";
  return v;
}

const Tokenizer& stories260k() {
  static const Tokenizer t = Tokenizer::from_sentencepiece_vocab(stories260k_vocab());
  return t;
}

nlohmann::json llama_cpp_ref() { return read_json(tokenizer_ref_dir() / "llama_cpp/stories260K.json"); }

// A GGUF "gpt2" vocabulary made of a tokenizer.json's vocabulary and merges
// (as convert_hf_to_gguf.py writes them): added special tokens become control tokens.
BpeVocab bpe_vocab_from(const std::string& rel, const std::string& pre) {
  const auto j = nlohmann::json::parse(read_file(shared_dir() / rel));
  BpeVocab v;
  v.tokens.resize(j["model"]["vocab"].size());
  for (const auto& [tok, id] : j["model"]["vocab"].items()) v.tokens.at(id.get<std::size_t>()) = tok;
  for (const auto& m : j["model"]["merges"]) v.merges.push_back(m.get<std::string>());
  v.token_types.assign(v.tokens.size(), 1);
  for (const auto& a : j["added_tokens"]) {
    const auto id = a["id"].get<std::size_t>();
    if (id < v.tokens.size() && a["special"].get<bool>()) v.token_types[id] = 3;
  }
  v.pre = pre;
  v.source = rel;
  return v;
}

bool mentions_added_token(const std::string& text, const std::string& rel) {
  const auto j = nlohmann::json::parse(read_file(shared_dir() / rel));
  for (const auto& a : j["added_tokens"])
    if (text.find(a["content"].get<std::string>()) != std::string::npos) return true;
  return false;
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

}  // namespace

// The GGUF SentencePiece path equals llama.cpp's llm_tokenizer_spm on every
// hard string (with and without BOS) and on the whole text.
TEST(TokenizerGguf, SentencePieceVocabMatchesLlamaCpp) {
  const auto ref = llama_cpp_ref();
  ASSERT_EQ(ref["library_version"], "0.5.0-dev (build 1, commit de3ff81)");
  const Tokenizer& t = stories260k();
  EXPECT_EQ(t.describe(), "GGUF llama (SentencePiece scores)");
  EXPECT_TRUE(t.usable());
  EXPECT_EQ(t.bos_id(), 1);
  EXPECT_EQ(t.eos_id(), 2);
  EXPECT_TRUE(t.adds_prefix_space());
  EXPECT_TRUE(t.is_special(0) && t.is_special(1) && t.is_special(2));
  EXPECT_FALSE(t.is_special(3));
  EXPECT_EQ(t.token_id("\xe2\x96\x81t"), 259);
  for (const auto& c : ref["cases"]) {
    const std::string text = c["text"];
    SCOPED_TRACE(show(text));
    const auto ids = t.encode(text, false, false);
    EXPECT_EQ(ids, c["ids"].get<std::vector<int32_t>>());
    EXPECT_EQ(t.encode_hf(text, true), c["ids_bos"].get<std::vector<int32_t>>());
    EXPECT_EQ(t.encode(text, true, true).back(), 2);
    // Byte fallback covers every character, no control token comes from text: decode round-trips
    // (but for a U+2581 in the text, which reads as a space), and the streamed pieces concatenate to it.
    if (text.find("\xe2\x96\x81") != std::string::npos) continue;
    EXPECT_EQ(t.decode(ids), text);
    std::string streamed;
    int32_t prev = 1;
    for (int32_t id : ids) streamed += t.decode(prev, id), prev = id;
    EXPECT_EQ(streamed, text);
  }
  const std::string text = read_file(text_path());
  EXPECT_EQ(compare_whole_text(t.encode(text, false, false), ref["whole_text"]), "");
}

// The same vocabulary through the llama2.c engine (tok512.bin): llama.cpp's
// ids on stories260K.gguf equal tok512's everywhere except where the text
// itself contains U+2581 (llama.cpp reads it as a space; run.c has no piece
// for it and falls back to its three bytes).
TEST(TokenizerGguf, Tok512EqualsLlamaCppOnStories260K) {
  const auto ref = llama_cpp_ref();
  int differing = 0;
  for (const auto& c : ref["cases"]) {
    const std::string text = c["text"];
    SCOPED_TRACE(show(text));
    const bool has_u2581 = text.find("\xe2\x96\x81") != std::string::npos;
    const auto ids = tok512().encode(text, false, false);
    if (has_u2581) {
      EXPECT_NE(ids, c["ids"].get<std::vector<int32_t>>());
      ++differing;
    } else {
      EXPECT_EQ(ids, c["ids"].get<std::vector<int32_t>>());
      EXPECT_EQ(tok512().encode(text, true, false), c["ids_bos"].get<std::vector<int32_t>>());
    }
  }
  EXPECT_EQ(differing, 1);
  const std::string text = read_file(text_path());
  const auto ids = tok512().encode(text, false, false);
  EXPECT_EQ(compare_whole_text(ids, ref["whole_text"]), "");
  EXPECT_EQ(stories260k().encode(text, false, false), ids);
}

// TinyStories-656K-Q8_0.gguf embeds the model's 2048 pieces with every score
// -1000 and no merges: it loads, but cannot encode.
TEST(TokenizerGguf, EqualScoresAreUnusable) {
  const auto j = nlohmann::json::parse(read_file(shared_dir() / "models/TinyStories-656K/tokenizer.json"));
  SentencePieceVocab v;
  v.pieces.resize(j["model"]["vocab"].size());
  for (const auto& [tok, id] : j["model"]["vocab"].items()) v.pieces.at(id.get<std::size_t>()) = tok;
  v.scores.assign(v.pieces.size(), -1000.0f);
  v.token_types.assign(v.pieces.size(), 1);
  v.token_types[0] = v.token_types[1] = v.token_types[2] = 3;
  v.bos_id = 1;
  v.eos_id = 2;
  v.unk_id = 0;
  v.source = "TinyStories-656K-Q8_0.gguf";
  const Tokenizer t = Tokenizer::from_sentencepiece_vocab(v);
  EXPECT_EQ(t.vocab_size(), 2048);
  EXPECT_FALSE(t.usable());
  const std::string& why = t.unusable_reason();
  EXPECT_HAS(why, "TinyStories-656K-Q8_0.gguf: tokenizer.ggml.scores");
  EXPECT_HAS(why, "are equal (-1000)");
  EXPECT_HAS(why, "use the model's Hugging Face tokenizer.json instead");
  EXPECT_EQ(why.find("--tokenizer"), std::string::npos) << why;  // the library names no front end's flag
  EXPECT_EQ(expect_error([&] { t.encode("Once upon a time", true, false); }), why);
  EXPECT_EQ(t.encode("", true, false), (std::vector<int32_t>{1}));
  // A real score order is usable: the same pieces with distinct scores.
  for (std::size_t i = 0; i < v.scores.size(); ++i) v.scores[i] = -static_cast<float>(i);
  EXPECT_TRUE(Tokenizer::from_sentencepiece_vocab(v).usable());
}

// User-defined pieces are cut out of the text first (each following run gets
// the U+2581 prefix again, as llama.cpp does); control pieces never come from text.
TEST(TokenizerGguf, UserDefinedPiecesMatchControlPiecesDoNot) {
  auto v = stories260k_vocab();
  v.pieces.push_back("<tool>");
  v.scores.push_back(0.0f);
  v.token_types.push_back(4);
  const Tokenizer t = Tokenizer::from_sentencepiece_vocab(v);
  std::vector<int32_t> want = t.encode("Once", false, false);
  want.push_back(512);
  const auto tail = t.encode("upon", false, false);
  want.insert(want.end(), tail.begin(), tail.end());
  EXPECT_EQ(t.encode("Once<tool>upon", false, false), want);
  EXPECT_EQ(t.decode(want), "Once<tool> upon");
  for (int32_t id : t.encode("<s>x</s>", false, false)) EXPECT_FALSE(t.is_special(id));
}

// A GGUF "gpt2" vocabulary equals the Hugging Face library on the same
// vocabulary and merges wherever the text holds no added token (GGUF control
// tokens are never matched in text; the tokenizer.json ones are).
TEST(TokenizerGguf, BpeVocabMatchesHuggingFaceOnTheSameVocabulary) {
  const std::string text = read_file(text_path());
  struct Case {
    const char* rel;
    const char* pre;
    const char* ref;
  };
  for (const Case& k : {Case{"tokenizers/gpt2/tokenizer.json", "gpt-2", "gpt2"},
                        Case{"tokenizers/gpt2/tokenizer.json", "gpt2", "gpt2"},
                        Case{"tokenizers/gpt2/tokenizer.json", "llama-bpe", "variant-gpt2-llama3-style"},
                        Case{"tokenizers/gpt2/tokenizer.json", "qwen2", "variant-gpt2-qwen2-style"},
                        Case{"tokenizers/smollm2-135m-instruct/tokenizer.json", "smollm", "smollm2-135m-instruct"}}) {
    SCOPED_TRACE(std::string(k.ref) + " as tokenizer.ggml.pre " + k.pre);
    const auto ref = read_json(tokenizer_ref_dir() / "hf_tokenizers" / (std::string(k.ref) + ".json"));
    auto v = bpe_vocab_from(k.rel, k.pre);
    for (std::size_t i = 0; i < v.tokens.size(); ++i)
      if (v.tokens[i] == "<|endoftext|>") v.eos_id = static_cast<int32_t>(i);
    ASSERT_TRUE(v.eos_id.has_value());
    const Tokenizer t = Tokenizer::from_bpe_vocab(v);
    EXPECT_EQ(t.describe(), "GGUF gpt2 (byte-level BPE)");
    EXPECT_FALSE(t.adds_prefix_space());
    EXPECT_FALSE(t.bos_id().has_value());
    EXPECT_TRUE(t.is_special(*v.eos_id));
    int compared = 0;
    for (const auto& c : ref["cases"]) {
      const std::string s = c["text"];
      if (mentions_added_token(s, k.rel)) continue;
      // The Qwen2 variant normalizes NFC (llama.cpp's qwen2 does not): skip the strings NFC changes.
      if (std::string(k.pre) == "qwen2" &&
          (s.find("\xcc\x81") != std::string::npos || s.find("\xe2\x84\xab") != std::string::npos ||
           s.find("\xe1\x84\x80") != std::string::npos))
        continue;
      SCOPED_TRACE(show(s));
      const auto ids = t.encode_hf(s, false);
      EXPECT_EQ(ids, c["ids"].get<std::vector<int32_t>>());
      EXPECT_EQ(t.decode(ids), c["decode"].get<std::string>());
      ++compared;
    }
    EXPECT_GE(compared, 44);
    EXPECT_EQ(compare_whole_text(t.encode_hf(text, false), ref["whole_text"]), "");
  }
}

TEST(TokenizerGguf, MalformedVocabulariesNameTheField) {
  auto v = stories260k_vocab();
  v.scores.pop_back();
  EXPECT_HAS(expect_error([&] { Tokenizer::from_sentencepiece_vocab(v); }),
             "stories260K vocabulary: tokenizer.ggml.scores: must have one score per token (512) (got 511 scores)");
  v = stories260k_vocab();
  v.scores[7] = std::nanf("");
  EXPECT_HAS(expect_error([&] { Tokenizer::from_sentencepiece_vocab(v); }), "tokenizer.ggml.scores[7]: must be finite");
  v = stories260k_vocab();
  v.bos_id = 512;
  EXPECT_HAS(expect_error([&] { Tokenizer::from_sentencepiece_vocab(v); }),
             "tokenizer.ggml.bos_token_id: must be a token id in [0, 512) (got 512)");
  v = stories260k_vocab();
  v.token_types.resize(3);
  EXPECT_HAS(expect_error([&] { Tokenizer::from_sentencepiece_vocab(v); }), "tokenizer.ggml.token_type");
  EXPECT_HAS(expect_error([] { Tokenizer::from_sentencepiece_vocab({}); }), "tokenizer.ggml.tokens: must not be empty");

  BpeVocab b;
  b.tokens = {"a", "b", "ab"};
  b.merges = {"a b"};
  b.source = "tiny.gguf";
  EXPECT_EQ(Tokenizer::from_bpe_vocab(b).encode_hf("ab", false), (std::vector<int32_t>{2}));
  b.pre = "nope";
  EXPECT_HAS(expect_error([&] { Tokenizer::from_bpe_vocab(b); }), "tiny.gguf: tokenizer.ggml.pre: unknown pre-tokenizer");
  EXPECT_HAS(expect_error([&] { Tokenizer::from_bpe_vocab(b); }), "(got 'nope')");
  b.pre = "default";
  b.merges = {"ab"};
  EXPECT_HAS(expect_error([&] { Tokenizer::from_bpe_vocab(b); }), "tokenizer.ggml.merges[0]: must be two tokens");
  b.merges = {"a b"};
  b.eos_id = 3;
  EXPECT_HAS(expect_error([&] { Tokenizer::from_bpe_vocab(b); }), "tokenizer.ggml.eos_token_id");
  b.eos_id.reset();
  b.add_bos = true;
  EXPECT_HAS(expect_error([&] { Tokenizer::from_bpe_vocab(b); }), "tokenizer.ggml.add_bos_token");
}

// Re-runs the llama.cpp reference script when llama-tokenize is available: POSENC_LLAMA_TOKENIZE, or the one
// scripts/build-llama-server puts beside its llama-server (llama.cpp de3ff81, the commit the saved file names).
TEST(TokenizerGguf, LlamaCppReferenceScriptReproducesSavedFile) {
  std::string bin = std::getenv("POSENC_LLAMA_TOKENIZE") ? std::getenv("POSENC_LLAMA_TOKENIZE") : "";
  if (bin.empty()) bin = llama_tokenize_cache_path().string();
  if (!std::filesystem::exists(bin))
    GTEST_SKIP() << "no llama-tokenize at " << bin
                 << ": scripts/build-llama-server builds it (~10 min on 2 cores, into a cache outside the checkout), "
                    "or set POSENC_LLAMA_TOKENIZE=/path/to/llama-tokenize";
  if (std::system("node --version >/dev/null 2>&1") != 0) GTEST_SKIP() << "node not found (scripts/install-deps)";
  // The script imports hf_tokenizers_refs.mjs, which requires the tokenizers package (scripts/install-refs).
  if (!ref_installed("tokenizers")) GTEST_SKIP() << "tools/refs/node_modules/tokenizers not installed (scripts/install-refs)";
  TempDir d;
  const std::string cmd =
      fmt::format("cd '{}' && node tools/refs/llama_cpp_tokenize_refs.mjs --shared '{}' --llama-tokenize '{}' --out '{}' 2>/dev/null",
                  POSENC_SOURCE_DIR, shared_dir().string(), bin, d.path().string());
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  EXPECT_EQ(read_json(d.path() / "stories260K.json"), llama_cpp_ref());
}

}  // namespace POSENC_UNITY_ID
