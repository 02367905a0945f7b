#include <cmath>
#include <cstring>
#include <random>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "posenc/checkpoint.hpp"
#include "posenc/error.hpp"
#include "posenc/model.hpp"
#include "posenc/tokenizer.hpp"
#include "random_checkpoint.hpp"
#include "test_support.hpp"

namespace POSENC_UNITY_ID {  // this file's own namespace in the tests' unity build (CMakeLists.txt)

using namespace posenc;
using posenc::test::TempDir;

namespace {

PosencCheckpoint random_checkpoint(PositionFamily family, uint32_t seed = 7) {
  PosencCheckpoint ck;
  posenc::test::set_tiny_llama(ck.config, 64);
  ck.positional.family = family;
  if (family == PositionFamily::rope) {
    RopeParams p;
    p.head_dim = 8;
    p.rotary_dim = 4;  // partial rotary, as "rope25"-style models use
    ck.positional.rope.params = p;
    ck.positional.rope.freqs = compute_rope_frequencies(p);
    ck.positional.rope.layout = RopeLayout::interleaved;
  }
  ck.positional.t5_num_buckets = 16;
  ck.positional.t5_max_distance = 32;
  posenc::test::RandomTensors t(ck, seed, 0.4f);
  t.add_llama();
  if (family == PositionFamily::learned_absolute) t.add("pos_embeddings", {64, 32});
  if (family == PositionFamily::t5_bias) t.add("t5_relative_attention_bias", {16, 4});
  ck.symbols = {"<pad>", "<bos>", "<eos>", "a", "b", "c", "d", "e", "f", "g", "h", "i", "j", "k", "=", "|"};
  ck.metadata_json = R"({"task": "unit-test"})";
  return ck;
}

std::vector<float> logits_at(const Model& m, const std::vector<int32_t>& toks, int64_t first_pos) {
  KvCache cache = m.make_cache(4);
  const auto seq = cache.create();
  std::vector<int64_t> pos(toks.size());
  for (std::size_t i = 0; i < pos.size(); ++i) pos[i] = first_pos + static_cast<int64_t>(i);
  Model::SequenceInput in{seq, toks, pos};
  std::vector<float> out;
  m.forward(cache, std::span(&in, 1), Model::LogitsMode::all, out);
  return out;
}

float max_abs_diff(const std::vector<float>& a, const std::vector<float>& b) {
  float m = 0;
  for (std::size_t i = 0; i < a.size(); ++i) m = std::max(m, std::abs(a[i] - b[i]));
  return m;
}

const std::vector<int32_t> kToks{1, 3, 4, 5, 6, 7, 3, 8, 9, 10, 11, 12, 4, 13, 14, 15, 3, 3, 5, 7, 9, 11, 13, 15};

}  // namespace

TEST(PosencCheckpoint, Stories260KRoundTripsBitExactly) {
  TempDir d;
  const Model a = Model::load_llama2c(posenc::test::model_path());
  save_posenc_checkpoint(d.path() / "s.posenc", a.to_checkpoint());
  EXPECT_TRUE(is_posenc_checkpoint(d.path() / "s.posenc"));
  EXPECT_FALSE(is_posenc_checkpoint(posenc::test::model_path()));
  const Model b = Model::load(d.path() / "s.posenc");
  EXPECT_EQ(b.family(), PositionFamily::rope);
  EXPECT_EQ(b.rope().layout, RopeLayout::interleaved);
  EXPECT_EQ(b.rope().freqs, a.rope().freqs);
  const std::vector<int32_t> toks{1, 403, 407, 261, 378, 290, 300, 310};
  EXPECT_EQ(a.score_window(toks), b.score_window(toks));
}

// Every family: save -> load keeps the logits; the cached path equals the
// prefill; relative encodings ignore a uniform shift, absolute ones do not.
TEST(PosencCheckpoint, EveryFamilyLoadsAndRuns) {
  TempDir d;
  for (auto family : {PositionFamily::nope, PositionFamily::learned_absolute, PositionFamily::sinusoidal,
                      PositionFamily::t5_bias, PositionFamily::alibi, PositionFamily::rope}) {
    SCOPED_TRACE(std::string(to_string(family)));
    const auto path = d.path() / (std::string(to_string(family)) + ".posenc");
    save_posenc_checkpoint(path, random_checkpoint(family));
    const Model m = Model::load(path);
    EXPECT_EQ(m.family(), family);
    EXPECT_EQ(m.embedded_symbols().size(), 16u);
    EXPECT_EQ(nlohmann::json::parse(m.metadata_json())["task"], "unit-test");
    const auto full = m.score_window(kToks);
    KvCache cache = m.make_cache(4);
    const auto seq = cache.create();
    std::vector<float> inc, step;
    for (std::size_t i = 0; i < kToks.size(); ++i) {
      Model::SequenceInput in{seq, std::span(kToks).subspan(i, 1), {}};
      m.forward(cache, std::span(&in, 1), Model::LogitsMode::all, step);
      inc.insert(inc.end(), step.begin(), step.end());
    }
    EXPECT_LT(max_abs_diff(full, inc), 1e-5f);
    const float shifted = max_abs_diff(logits_at(m, kToks, 0), logits_at(m, kToks, 30));
    const bool relative = family == PositionFamily::nope || family == PositionFamily::t5_bias ||
                          family == PositionFamily::alibi || family == PositionFamily::rope;
    if (relative)
      EXPECT_LT(shifted, 1e-4f);
    else
      EXPECT_GT(shifted, 1e-2f);
  }
}

TEST(PosencCheckpoint, LearnedTableRefusesPositionsPastIt) {
  TempDir d;
  save_posenc_checkpoint(d.path() / "l.posenc", random_checkpoint(PositionFamily::learned_absolute));
  const Model m = Model::load(d.path() / "l.posenc");
  KvCache cache = m.make_cache(4);
  const auto seq = cache.create();
  const int32_t toks[2] = {3, 4};
  const int64_t pos[2] = {63, 64};
  Model::SequenceInput in{seq, toks, pos};
  std::vector<float> out;
  try {
    m.forward(cache, std::span(&in, 1), Model::LogitsMode::all, out);
    FAIL() << "no PositionError";
  } catch (const PositionError& e) {
    EXPECT_NE(std::string(e.what()).find("64"), std::string::npos) << e.what();
  }
  EXPECT_EQ(cache.size(seq), 0);
}

TEST(PosencCheckpoint, CorruptFilesNameTheProblem) {
  TempDir d;
  const auto good_path = d.path() / "good.posenc";
  save_posenc_checkpoint(good_path, random_checkpoint(PositionFamily::alibi));
  const std::string good = posenc::test::slurp(good_path);
  uint64_t hl;
  std::memcpy(&hl, good.data() + 8, 8);
  const std::string header = good.substr(16, hl);
  auto with_header = [&](const std::string& name, nlohmann::json h) {
    std::string hs = h.dump();
    std::string out = good.substr(0, 8);
    const uint64_t n = hs.size();
    out.append(reinterpret_cast<const char*>(&n), 8);
    out += hs;
    out.resize((out.size() + 63) / 64 * 64, '\0');
    const uint64_t old_start = (16 + hl + 63) / 64 * 64;
    out += good.substr(old_start);
    return d.file(name, out);
  };
  auto expect = [&](const std::filesystem::path& p, const std::string& needle) {
    try {
      Model::load(p);
      FAIL() << "no error for " << p;
    } catch (const CheckpointError& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  const auto h = nlohmann::json::parse(header);
  expect(d.file("trunc.posenc", good.substr(0, good.size() - 100)), "truncated");
  expect(d.file("hdr.posenc", good.substr(0, 40)), "truncated");
  expect(d.file("json.posenc", good.substr(0, 16) + std::string(hl, '{') + good.substr(16 + hl)), "malformed JSON");
  auto h1 = h;
  h1["config"]["dim"] = "abc";
  expect(with_header("dim.posenc", h1), "config.dim");
  auto h2 = h;
  h2["positional"]["family"] = "xpos";
  expect(with_header("fam.posenc", h2), "xpos");
  auto h3 = h;
  h3["tensors"].erase(3);
  expect(with_header("missing.posenc", h3), "missing");
  auto h4 = h;
  h4["config"]["hidden_dim"] = 40;
  expect(with_header("shape.posenc", h4), "shape");
  auto h5 = h;
  h5["positional"].erase("max_bias");
  expect(with_header("bias.posenc", h5), "positional.max_bias");
  std::string nan = good;
  const float q = std::nanf("");
  std::memcpy(nan.data() + (16 + hl + 63) / 64 * 64 + 8, &q, 4);
  expect(d.file("nan.posenc", nan), "not finite");
}

TEST(SymbolTokenizer, EncodesDecodesAndRejectsUnknownSymbols) {
  const Tokenizer t = Tokenizer::from_symbols({"<pad>", "<bos>", "<eos>", "1", "2", "+", "="});
  EXPECT_TRUE(t.is_symbolic());
  EXPECT_EQ(t.encode("1 2  + 2 =", true, false), (std::vector<int32_t>{1, 3, 4, 5, 4, 6}));
  EXPECT_EQ(t.decode(t.encode("1 2 + 2 =", true, true)), "1 2 + 2 =");
  EXPECT_THROW(t.encode("1 3", false, false), TokenizerError);
  EXPECT_THROW(Tokenizer::from_symbols({"<pad>", "<bos>", "<eos>", "a", "a"}), TokenizerError);
  EXPECT_THROW(Tokenizer::from_symbols({"<bos>", "<pad>", "<eos>", "a"}), TokenizerError);
  EXPECT_THROW(Tokenizer::from_symbols({"<pad>", "<bos>", "<eos>", "a b"}), TokenizerError);
}

// Issue 13 item 11: a header field of the wrong JSON type ("format": 1, a string
// where a number goes, an object where an array goes, ...) is a CheckpointError
// naming the file and the field, never a raw nlohmann exception.
TEST(PosencCheckpoint, WrongJsonTypesAreCheckpointErrorsNamingFileAndField) {
  TempDir d;
  const auto good_path = d.path() / "good.posenc";
  PosencCheckpoint ck = random_checkpoint(PositionFamily::rope);
  ck.symbols = {"a", "b", "c", "d", "e", "f", "g", "h", "i", "j", "k", "l", "m", "n", "o", "p"};
  save_posenc_checkpoint(good_path, ck);
  const std::string good = posenc::test::slurp(good_path);
  uint64_t hl;
  std::memcpy(&hl, good.data() + 8, 8);
  const auto h = nlohmann::json::parse(good.substr(16, hl));
  int k = 0;
  auto check = [&](const std::string& ptr, nlohmann::json value, const std::string& field) {
    nlohmann::json m = h;
    m[nlohmann::json::json_pointer(ptr)] = std::move(value);
    const std::string hs = m.dump();
    std::string out = good.substr(0, 8);
    const uint64_t n = hs.size();
    out.append(reinterpret_cast<const char*>(&n), 8);
    out += hs;
    out.resize((out.size() + 63) / 64 * 64, '\0');
    out += good.substr((16 + hl + 63) / 64 * 64);
    const auto p = d.file("bad" + std::to_string(k++) + ".posenc", out);
    try {
      Model::load(p);
      ADD_FAILURE() << ptr << " = " << value << ": no error";
    } catch (const CheckpointError& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find(p.string()), std::string::npos) << ptr << ": " << msg;
      EXPECT_NE(msg.find(field), std::string::npos) << ptr << ": " << msg;
    } catch (const std::exception& e) {
      ADD_FAILURE() << ptr << " = " << value << ": not a CheckpointError: " << e.what();
    }
  };
  check("/format", 1, "format");
  check("/format", nullptr, "format");
  check("/format", nlohmann::json::array(), "format");
  check("/version", "1", "version");
  check("/version", 1.5, "version");
  check("/config", "x", "config");
  check("/config/dim", "32", "config.dim");
  check("/config/dim", 32.5, "config.dim");
  check("/config/n_layers", -1, "config.n_layers");
  check("/config/vocab_size", 9223372036854775807, "config.vocab_size");
  check("/config/norm_eps", "x", "config.norm_eps");
  check("/config/norm_eps", 1e-60, "config.norm_eps must be finite and > 0 in float32 (got 1e-60)");  // 0 as float32
  check("/config/norm_eps", 1e39, "config.norm_eps must be finite and > 0 in float32 (got 1e+39)");  // inf as float32
  check("/config/norm_eps", -1e-5, "config.norm_eps must be finite and > 0 (got -1e-05)");
  check("/config/shared_classifier", 1, "config.shared_classifier");
  check("/positional", nlohmann::json::array(), "positional");
  check("/positional/family", 3, "positional.family");
  check("/positional/rope_theta", "x", "positional.rope_theta");
  check("/positional/rotary_dim", nullptr, "positional.rotary_dim");
  check("/positional/layout", false, "positional.layout");
  check("/positional/angle_precision", 1, "positional.angle_precision");
  check("/tensors", nlohmann::json::object(), "tensors");
  check("/tensors/0", 5, "tensors[0]");
  check("/tensors/0/name", 3, "tensors[0].name");
  check("/tensors/0/shape", "x", "tensors[0].shape");
  check("/tensors/0/shape/0", 1.5, "tensors[0].shape");
  check("/tensors/0/shape/0", 18446744073709551615u, "tensors[0].shape");
  check("/tensors/0/offset", -64, "tensors[0].offset");
  check("/tensors/0/offset", "0", "tensors[0].offset");
  check("/symbols", "x", "symbols");
  check("/symbols/0", 1, "symbols");
}

}  // namespace POSENC_UNITY_ID
