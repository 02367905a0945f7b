// posenc Python bindings — the model runtime (posenc/model.hpp): Model.load for every format the runtime loads,
// tokenize / logits / score / generate, and a KvCache handle for incremental forwards; plus the eval lab's run
// directory lookup used by posenc.eval. The forward passes are the library's; the GIL is released around them.
#include <cctype>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <limits>
#include <optional>
#include <string>

#include <fmt/format.h>
#include <pybind11/stl.h>

#include "arrays.hpp"
#include "bindings.hpp"
#include "eval/logprob.hpp"
#include "posenc/error.hpp"
#include "posenc/eval.hpp"
#include "posenc/generate.hpp"
#include "posenc/io.hpp"
#include "posenc/kv_cache.hpp"
#include "posenc/model.hpp"
#include "posenc/perplexity.hpp"
#include "posenc/tokenizer.hpp"

namespace posenc::python {

namespace {

/// A loaded model with the tokenizer it is used with (bundled, or the file given to Model.load).
struct PyModel {
  Model model;
  std::optional<Tokenizer> tokenizer;
  std::string tokenizer_source;  ///< "bundled: tokenizer.json", the path given, or "" (none)
  std::string tokenizer_unusable;  ///< why the bundled tokenizer cannot be used (then tokenizer is empty)

  const Tokenizer& tok() const {
    if (!tokenizer) {
      // An unusable bundled tokenizer: its reason names the file and the tokenizer to use instead.
      if (!tokenizer_unusable.empty())
        throw TokenizerError(fmt::format("the tokenizer this model brings cannot be used: {} (tokenizer=<Hugging "
                                         "Face model dir>/tokenizer.json in posenc.Model.load)",
                                         tokenizer_unusable));
      const std::string& e = model.source().tokenizer_error;
      throw TokenizerError(fmt::format("{}: no tokenizer{}; pass tokenizer=<tokenizer.json or llama2.c tokenizer .bin> "
                                       "to posenc.Model.load",
                                       model.source().path.string(), e.empty() ? "" : " (" + e + ")"));
    }
    return *tokenizer;
  }
};

/// The tokenizer at `path`, as the CLI's --tokenizer reads it: a directory holding tokenizer.json, a GGUF file (its
/// embedded vocabulary), a tokenizer.json file (JSON text), or a llama2.c tokenizer .bin.
/// A path argument (str or os.PathLike) as a string; TypeError naming `name` for anything else, ValueError for a
/// NUL byte (the C++ side would open the path up to it: another file than the one named).
std::string path_arg(const py::handle& obj, const char* name) {
  py::object p;
  try {
    p = py::module_::import("os").attr("fspath")(obj);
  } catch (py::error_already_set& e) {
    if (!e.matches(PyExc_TypeError)) throw;
    throw py::type_error(fmt::format("{}: expected a path (str or os.PathLike), got {}", name,
                                     py::str(py::type::of(obj).attr("__name__")).cast<std::string>()));
  }
  const std::string s = py::isinstance<py::bytes>(p) ? p.cast<std::string>() : py::str(p).cast<std::string>();
  if (s.find('\0') != std::string::npos)
    throw py::value_error(fmt::format("{}: embedded NUL byte in {}", name, py::repr(p).cast<std::string>()));
  return s;
}

/// An integer argument as T: TypeError naming it for a non-integer (a float is not truncated), ValueError naming it
/// and the range for a value T cannot hold (pybind11's overload error names neither).
template <class T>
T int_arg(const py::handle& obj, const char* name) {
  if (py::isinstance<py::bool_>(obj) || !py::hasattr(obj, "__index__"))
    throw py::type_error(fmt::format("{}: expected an int, got {}", name,
                                     py::str(py::type::of(obj).attr("__name__")).cast<std::string>()));
  const py::int_ v = obj.attr("__index__")();
  const py::int_ lo(std::numeric_limits<T>::min()), hi(std::numeric_limits<T>::max());
  if (v < lo || v > hi)
    throw py::value_error(fmt::format("{}: {} outside [{}, {}]", name, py::str(py::handle(v)).cast<std::string>(),
                                      std::numeric_limits<T>::min(), std::numeric_limits<T>::max()));
  return v.cast<T>();
}

std::vector<int32_t> token_vector(const py::handle& obj, const PyModel& m) {
  const auto t = require_integers<int64_t>(obj, "tokens");
  if (t.ndim() != 1) throw py::value_error(fmt::format("tokens: expected a [n] array, got shape {}", shape_string(t)));
  std::vector<int32_t> out(static_cast<std::size_t>(t.size()));
  const int V = m.model.config().vocab_size;
  for (py::ssize_t i = 0; i < t.size(); ++i) {
    const int64_t v = t.data()[i];
    if (v < 0 || v >= V)
      throw py::value_error(fmt::format("tokens[{}]: id {} outside the vocabulary [0, {})", i, v, V));
    out[static_cast<std::size_t>(i)] = static_cast<int32_t>(v);
  }
  return out;
}

py::dict config_dict(const ModelConfig& c) {
  py::dict d;
  d["dim"] = c.dim;
  d["hidden_dim"] = c.hidden_dim;
  d["n_layers"] = c.n_layers;
  d["n_heads"] = c.n_heads;
  d["n_kv_heads"] = c.n_kv_heads;
  d["vocab_size"] = c.vocab_size;
  d["head_dim"] = c.head_dim;
  d["max_position_embeddings"] = c.max_position_embeddings;
  d["norm_eps"] = c.norm_eps;
  d["shared_classifier"] = c.shared_classifier;
  d["qkv_bias"] = c.qkv_bias;
  d["o_bias"] = c.o_bias;
  d["mlp_bias"] = c.mlp_bias;
  d["qk_norm"] = c.qk_norm;
  return d;
}

/// log p(tokens[i] | tokens[<i]) for i >= 1 (row i-1 of the logits predicts token i), in double: the window
/// prefilled in ppl's chunks (ppl_auto_chunk_tokens), so that only one chunk's logits are held; the same values as
/// one forward (Model::score_window).
std::vector<double> next_token_logprobs(const Model& model, const std::vector<int32_t>& tokens) {
  const int V = model.config().vocab_size;
  const auto n = static_cast<int64_t>(tokens.size());
  std::vector<double> out;
  out.reserve(tokens.size() - 1);
  model.score_window(tokens, ppl_auto_chunk_tokens(V), [&](int64_t first, const float* logits, int64_t rows) {
    for (int64_t r = 0; r < rows && first + r + 1 < n; ++r)
      out.push_back(detail::log_prob(logits + r * V, V, tokens[static_cast<std::size_t>(first + r + 1)]));
  });
  return out;
}

}  // namespace

void bind_model(py::module_& m) {
  py::class_<KvCache>(m, "KvCache", R"doc(
posenc's paged KV cache (posenc/kv_cache.hpp) for incremental forwards: make one with Model.new_cache(), add
sequences with new_sequence(), run Model.forward(cache, seq, tokens) step by step. Keys are stored rotated, with the
rotation state (frequencies, layout) checked on every append. Methods raise posenc.InvalidArgument for a sequence
id that is not live. Not thread-safe: Model.forward releases the GIL, so one cache must not be used by two Python
threads at once (separate caches, and Model.logits, are safe).)doc")
      .def("new_sequence", &KvCache::create, "A new empty sequence; returns its id.")
      .def("fork", &KvCache::fork, py::arg("seq"), "A new sequence sharing every block of seq (copy-on-write).")
      .def("free", &KvCache::free, py::arg("seq"), "Releases the sequence.")
      .def("__contains__", &KvCache::contains, py::arg("seq"))
      .def("size", &KvCache::size, py::arg("seq"), "Tokens cached for seq.")
      .def("next_position", &KvCache::next_position, py::arg("seq"), "The position the next appended token gets.")
      .def("positions", [](const KvCache& c, KvCache::SeqId s) { return to_numpy(c.positions(s)); }, py::arg("seq"),
           "Position ids of the cached tokens, [size] int64.")
      .def("token_ids", [](const KvCache& c, KvCache::SeqId s) { return to_numpy(c.token_ids(s)); }, py::arg("seq"),
           "Token ids of the cached tokens, [size] int32.")
      .def("clear", &KvCache::clear, py::arg("seq"))
      .def("evict", &KvCache::evict, py::arg("seq"), py::arg("begin"), py::arg("end"),
           "Drops cached tokens [begin, end) (indices into the sequence); returns how many were dropped.")
      .def("keep_window", &KvCache::keep_window, py::arg("seq"), py::arg("window"), py::arg("sinks") = 0,
           "Keeps the first `sinks` and the last `window` tokens (StreamingLLM); returns how many were dropped.")
      .def_property_readonly("blocks_in_use", &KvCache::blocks_in_use)
      .def_property_readonly(
          "kv_dtype", [](const KvCache& c) { return std::string(to_string(c.dtype())); },
          "Element type of the stored keys and values: 'f32', 'f16' or 'bf16'.")
      .def_property_readonly("kv_bytes_allocated", &KvCache::kv_bytes_allocated,
                             "Bytes of key/value storage in the allocated blocks.");

  py::class_<PyModel>(m, "Model", R"doc(
A Llama-architecture decoder on posenc's runtime. Load with posenc.Model.load(path). Methods: tokenize, decode,
logits ([n, vocab_size] float32), score, generate, new_cache / forward (posenc.KvCache); each lists the
posenc.Error subclasses it raises.
Safe to call from several Python threads at once (the GIL is released around the forward passes).)doc")
      .def_static(
          "load",
          [](py::handle path_obj, py::handle tokenizer_obj, const std::string& quantized_matmul,
             const std::string& dense_matmul) {
            const std::string path = path_arg(path_obj, "path");
            std::optional<std::string> tokenizer;
            if (!tokenizer_obj.is_none()) tokenizer = path_arg(tokenizer_obj, "tokenizer");
            LoadOptions lo;
            lo.quantized_matmul = parse_quantized_matmul(quantized_matmul, "quantized_matmul");
            lo.dense_matmul = parse_dense_matmul(dense_matmul, "dense_matmul");
            py::gil_scoped_release release;
            PyModel pm{Model::load(path, lo), std::nullopt, "", ""};
            if (tokenizer) {
              pm.tokenizer = load_tokenizer_from_path(*tokenizer, "tokenizer");
              pm.tokenizer_source = *tokenizer;
              if (!pm.tokenizer->usable())  // the reason names the file
                throw TokenizerError(pm.tokenizer->unusable_reason() +
                                     " (tokenizer=<Hugging Face model dir>/tokenizer.json in posenc.Model.load)");
              require_tokenizer_fits(*pm.tokenizer, pm.model.config().vocab_size, pm.tokenizer_source, path);
            } else if (pm.model.bundled_tokenizer()) {
              // A bundled tokenizer that cannot be used does not stop the model from loading (logits, forward and
              // the cache need none): the reason is raised when a tokenizer is needed (tokenize, score, generate).
              const Tokenizer& bt = *pm.model.bundled_tokenizer();
              if (bt.usable()) {
                pm.tokenizer = bt;
                pm.tokenizer_source = "bundled: " + pm.model.source().tokenizer;
              } else {
                pm.tokenizer_unusable = bt.unusable_reason();
              }
            }
            return pm;
          },
          py::arg("path"), py::arg("tokenizer") = py::none(), py::arg("quantized_matmul") = "dequantize",
          py::arg("dense_matmul") = "float32", R"doc(
Loads a model: a llama2.c .bin, a posenc checkpoint, a Hugging Face directory (config.json + model.safetensors +
tokenizer.json) or a GGUF file (format detected from the contents); path and tokenizer are str or os.PathLike.
tokenizer: a tokenizer.json (or its directory), a GGUF (its embedded vocabulary) or a llama2.c tokenizer .bin;
default the one the model brings (HF directory, GGUF). A bundled tokenizer that cannot be used (e.g. a GGUF
vocabulary with equal scores) does not stop the load: logits/forward work, and tokenize/score/generate raise posenc.TokenizerError with the reason. quantized_matmul:
"dequantize" or "q8_activations" (llama.cpp's arithmetic for Q8_0/Q4_0 weights). dense_matmul: "float32",
"bf16x6" or "bf16x3" (F16/BF16 products on AMX-BF16 tiles; posenc.InvalidArgument on a CPU without AMX-BF16).
Raises posenc.IoError, posenc.CheckpointError, posenc.ConfigError, posenc.TokenizerError naming the file and
field.)doc")
      .def_property_readonly("config", [](const PyModel& p) { return config_dict(p.model.config()); },
                             "Sizes: dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size, head_dim, ...")
      .def_property_readonly("format", [](const PyModel& p) { return std::string(to_string(p.model.source().format)); })
      .def_property_readonly("architecture", [](const PyModel& p) { return p.model.source().architecture; })
      .def_property_readonly("family", [](const PyModel& p) { return std::string(to_string(p.model.family())); })
      .def_property_readonly("trained_context", [](const PyModel& p) { return p.model.trained_context(); })
      .def_property_readonly(
          "quantized_matmul", [](const PyModel& p) { return std::string(to_string(p.model.quantized_matmul())); },
          "How Q8_0/Q4_0 weights are multiplied: \"dequantize\" or \"q8_activations\" (Model.load's argument)")
      .def_property_readonly(
          "dense_matmul", [](const PyModel& p) { return std::string(to_string(p.model.dense_matmul())); },
          "How F16/BF16 weights are multiplied: \"float32\", \"bf16x6\" or \"bf16x3\" (Model.load's argument)")
      .def_property_readonly("vocab_size", [](const PyModel& p) { return p.model.config().vocab_size; })
      .def_property_readonly("tokenizer_source", [](const PyModel& p) { return p.tokenizer_source; })
      .def_property_readonly(
          "rope",
          [](const PyModel& p) -> py::object {
            if (p.model.family() != PositionFamily::rope) return py::none();
            Frequencies f;
            f.freqs = p.model.rope().freqs;
            f.layout = std::string(to_string(p.model.rope().layout));
            return py::cast(f);
          },
          "The RoPE frequencies the model runs with (layout included), None for another family.")
      .def(
          "tokenize",
          [](const PyModel& p, const std::string& text, bool bos) {
            std::vector<int32_t> ids;
            {
              py::gil_scoped_release release;
              ids = p.tok().encode(text, bos, false);
            }
            return to_numpy(ids);
          },
          py::arg("text"), py::arg("bos") = true,
          "Token ids of text, [n] int32 (BOS first when bos and the tokenizer has one), as `posenc tokenize`. "
          "Errors: posenc.TokenizerError (no usable tokenizer).")
      .def(
          "decode",
          [](const PyModel& p, py::handle tokens) {
            const std::vector<int32_t> ids = token_vector(tokens, p);
            return p.tok().decode(ids);
          },
          py::arg("tokens"), "The text of token ids (special tokens skipped). Errors: as logits's tokens, "
          "posenc.TokenizerError (no usable tokenizer).")
      .def(
          "logits",
          [](const PyModel& p, py::handle tokens) {
            const std::vector<int32_t> ids = token_vector(tokens, p);
            if (ids.empty()) throw py::value_error("tokens: empty");
            std::vector<float> out;
            {
              py::gil_scoped_release release;
              out = p.model.score_window(ids);
            }
            return vector_to_numpy(std::move(out), {static_cast<py::ssize_t>(ids.size()), p.model.config().vocab_size});
          },
          py::arg("tokens"), R"doc(
Logits of one forward over tokens at positions 0..n-1 (a fresh cache): [n, vocab_size] float32; row i predicts token
i+1. tokens: [n] integers in [0, vocab_size). Errors: TypeError (not integers), ValueError (not [n], empty, an id
outside the vocabulary).)doc")
      .def(
          "score",
          [](const PyModel& p, const std::string& text) {
            std::vector<int32_t> ids;
            std::vector<double> lp;
            {
              py::gil_scoped_release release;
              ids = p.tok().encode(text, true, false);
              if (ids.size() < 2) throw InvalidArgument(fmt::format("text: {} token(s), at least 2 needed to score", ids.size()));
              lp = next_token_logprobs(p.model, ids);
            }
            double sum = 0;
            for (double v : lp) sum += v;
            const double nll = -sum / static_cast<double>(lp.size());
            py::dict d;
            d["tokens"] = to_numpy(ids);
            d["token_logprobs"] = to_numpy(lp);
            d["n_scored"] = lp.size();
            d["nll"] = nll;
            d["ppl"] = std::exp(nll);
            d["logprob"] = sum;
            return d;
          },
          py::arg("text"), R"doc(
Scores text at positions 0..n-1 (prefilled in chunks as `posenc ppl` does: the values of one forward, without
holding all n x vocab_size logits): {tokens: [n] int32 (BOS first), token_logprobs: [n-1] float64
(natural-log p(token i | tokens before it), i = 1..n-1), n_scored, logprob (their sum), nll (mean negative), ppl}.
Errors: posenc.TokenizerError (no usable tokenizer), posenc.InvalidArgument (fewer than 2 tokens).)doc")
      .def(
          "generate",
          [](const PyModel& p, const std::string& prompt, py::handle max_new_tokens, float temperature, float top_p,
             py::handle seed, bool stop_at_eos, const std::string& rope_scaling, std::optional<double> rope_factor) {
            GenerateOptions o;
            o.max_new_tokens = int_arg<int>(max_new_tokens, "max_new_tokens");
            o.temperature = temperature;
            o.top_p = top_p;
            o.seed = int_arg<uint64_t>(seed, "seed");
            o.stop_at_bos = o.stop_at_eos = stop_at_eos;
            o.rope_scaling = rope_scaling;
            o.rope_factor = rope_factor;
            GenerateResult r;
            {
              py::gil_scoped_release release;
              r = posenc::generate(p.model, p.tok(), prompt, o);
            }
            py::dict d;
            d["prompt"] = prompt;
            d["prompt_ids"] = to_numpy(r.prompt_tokens);
            d["generated_ids"] = to_numpy(r.new_tokens);
            d["generated_logprobs"] = to_numpy(r.new_token_logprobs);
            d["text"] = r.text;
            d["stop_reason"] = r.stop_reason;
            d["trained_context"] = r.trained_context;
            d["passed_trained_context_at"] = r.passed_trained_context_at >= 0 ? py::object(py::int_(r.passed_trained_context_at)) : py::object(py::none());
            if (p.model.family() == PositionFamily::rope) {
              d["rope_type"] = r.rope_type;
              d["rope_scaling"] = r.rope_scaling;
              d["rope_factor"] = r.rope_factor;
              d["rope_context"] = r.rope_context;
            }
            d["quantized_matmul"] = std::string(to_string(p.model.quantized_matmul()));
            d["dense_matmul"] = std::string(to_string(p.model.dense_matmul()));
            d["prefill_seconds"] = r.prefill_seconds;
            d["decode_seconds"] = r.decode_seconds;
            return d;
          },
          py::arg("prompt"), py::arg("max_new_tokens") = 64, py::arg("temperature") = 0.0f, py::arg("top_p") = 1.0f,
          py::arg("seed") = 0, py::arg("stop_at_eos") = true, py::arg("rope_scaling") = "native",
          py::arg("rope_factor") = py::none(), R"doc(
Continues prompt through the KV cache, as `posenc generate` (greedy at temperature 0). Returns the keys of
`posenc generate --json`: prompt_ids, generated_ids ([k] int32), generated_logprobs ([k] float64, natural log at
temperature 1), text, stop_reason ("max_tokens", "bos", "eos", "position_limit"), rope_* for RoPE models,
quantized_matmul and dense_matmul (the products the logits came from), prefill_seconds, decode_seconds.
Errors: posenc.TokenizerError (no usable tokenizer), posenc.InvalidArgument (max_new_tokens < 0, temperature not
finite and >= 0, top_p outside (0, 1]), posenc.ConfigError (rope_scaling / rope_factor), posenc.PositionError (a
prompt past the position limit), posenc.NumericError (logits that are not finite: float32 overflowed in the
model).)doc")
      .def(
          "new_cache",
          [](const PyModel& p, int block_size, const std::string& kv_dtype) {
            return p.model.make_cache(block_size, 0, parse_kv_cache_dtype(kv_dtype, "kv_dtype"));
          },
          py::arg("block_size") = 16, py::arg("kv_dtype") = "f32",
          "An empty posenc.KvCache shaped for this model; kv_dtype 'f32' (default), 'f16' or 'bf16' is the element "
          "type keys and values are stored in (rounded to nearest even on write). Raises posenc.InvalidArgument for "
          "another kv_dtype.")
      .def(
          "forward",
          [](const PyModel& p, KvCache& cache, KvCache::SeqId seq, py::handle tokens, py::object position_ids,
             bool last_only) {
            const std::vector<int32_t> ids = token_vector(tokens, p);
            if (ids.empty()) throw py::value_error("tokens: empty");
            std::vector<int64_t> pos;
            if (!position_ids.is_none()) {
              const auto a = require_integers<int64_t>(position_ids, "position_ids");
              if (a.ndim() != 1 || a.shape(0) != static_cast<py::ssize_t>(ids.size()))
                throw py::value_error(fmt::format("position_ids: expected shape ({},), got {}", ids.size(), shape_string(a)));
              pos.assign(a.data(), a.data() + a.size());
            }
            Model::SequenceInput in;
            in.seq = seq;
            in.tokens = ids;
            in.position_ids = pos;
            std::vector<float> logits;
            {
              py::gil_scoped_release release;
              p.model.forward(cache, std::span<const Model::SequenceInput>(&in, 1),
                              last_only ? Model::LogitsMode::last : Model::LogitsMode::all, logits);
            }
            const py::ssize_t rows = last_only ? 1 : static_cast<py::ssize_t>(ids.size());
            return vector_to_numpy(std::move(logits), {rows, p.model.config().vocab_size});
          },
          py::arg("cache"), py::arg("seq"), py::arg("tokens"), py::arg("position_ids") = py::none(),
          py::arg("last_only") = false, R"doc(
Runs tokens of sequence seq through the network, appending their rotated keys and values to cache, and returns the
logits [n, vocab_size] float32 (or [1, vocab_size] with last_only). position_ids: [n] integers, default
cache.next_position(seq) + 0, 1, ... Raises posenc.CacheError when the cached keys' rotation does not match,
posenc.InvalidArgument for a cache of another shape or a sequence that is not live, ValueError for bad tokens /
position_ids. A KvCache is not locked: use one cache from one thread at a time.)doc");

  m.def(
      "_resolve_run_dir", [](const std::string& dir) { return resolve_run_dir(dir).string(); }, py::arg("dir"),
      "The eval run directory of dir: dir itself if it holds run.json, else the run its LATEST names.");
  m.def(
      "_eval_resume_plan", [](const std::string& dir) { return eval_resume_plan(dir); }, py::arg("dir"),
      "What resuming the run would recompute: one \"<file>: <reason>\" per missing or damaged file (empty: complete).");
}

}  // namespace posenc::python
