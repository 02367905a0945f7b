// posenc_window — posenc's side of the llama.cpp reference data (tools/refs/README.md).
//
// Prints one JSON object with what llama_cpp_refs.mjs needs from posenc's own
// code, so that the reference window is the ppl protocol's stream and not a
// re-implementation of it:
//   "window_ids": the first --window ids of encode_stream(tokenizer, text)
//                 (include/posenc/perplexity.hpp, protocol steps 1-2),
//   "stream_tokens": the length of the whole stream,
//   "prompt_ids": tokenizer.encode(prompt, bos=true, eos=false) (run.c's encode),
//   "blocks": split_blocks(text) (protocol step 1) from the first on, as many as
//                 cover 3 x --window tokens of this tokenizer, so that another
//                 tokenizer can build its window from the same blocks,
// and, with --model, scores the window with Model::load_llama2c + score_window and
// writes its logits [window, vocab] float32 little-endian row-major to --logits-out,
// adding "posenc_nll_mean" (protocol step 4-5 for one window, log-sum-exp in double).
//
// Not part of the CMake build (it exists to produce test data, not to be tested);
// build it against a built posenc_core:
//   g++ -std=c++20 -O2 -fopenmp -Iinclude -Isrc tools/refs/posenc_window.cpp build/libposenc_core.a \
//       -lfmt -o build/posenc_window
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "posenc/error.hpp"
#include "posenc/model.hpp"
#include "posenc/perplexity.hpp"
#include "posenc/tokenizer.hpp"

namespace {

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw posenc::IoError("cannot open " + path);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

int usage() {
  std::cerr << "usage: posenc_window --tokenizer tok512.bin --text FILE [--window 512] [--prompt TEXT]\n"
               "                     [--model stories260K.bin --logits-out FILE]\n";
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  std::string tokenizer_path, text_path, prompt, model_path, logits_out;
  long window = 512;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (i + 1 >= argc) return usage();
    const std::string v = argv[++i];
    if (a == "--tokenizer") tokenizer_path = v;
    else if (a == "--text") text_path = v;
    else if (a == "--window") window = std::stol(v);
    else if (a == "--prompt") prompt = v;
    else if (a == "--model") model_path = v;
    else if (a == "--logits-out") logits_out = v;
    else return usage();
  }
  if (tokenizer_path.empty() || text_path.empty() || window < 2 || model_path.empty() != logits_out.empty()) {
    return usage();
  }
  try {
    const auto tokenizer = posenc::Tokenizer::load_llama2c(tokenizer_path);
    const std::string text = read_file(text_path);
    const auto stream = posenc::encode_stream(tokenizer, text);
    if (static_cast<long>(stream.size()) < window) throw posenc::InvalidArgument("text: stream shorter than --window");
    std::vector<int32_t> ids(stream.begin(), stream.begin() + window);
    nlohmann::json out;
    out["tokenizer"] = tokenizer_path;
    out["text"] = text_path;
    out["stream_tokens"] = stream.size();
    out["window_ids"] = ids;
    // The blocks the window is cut from (and more, for tokenizers with fewer
    // tokens per block); their BOS + tokens must rebuild the stream's prefix.
    const auto blocks = posenc::split_blocks(text);
    std::vector<int32_t> rebuilt;
    nlohmann::json block_list = nlohmann::json::array();
    for (const auto& b : blocks) {
      if (static_cast<long>(rebuilt.size()) >= 3 * window) break;
      const auto t = tokenizer.encode(b, true, false);
      rebuilt.insert(rebuilt.end(), t.begin(), t.end());
      block_list.push_back(b);
    }
    if (!std::equal(ids.begin(), ids.end(), rebuilt.begin())) {
      throw posenc::InvalidArgument("blocks: BOS + encode(block) does not rebuild the stream's prefix");
    }
    out["blocks"] = block_list;
    if (!prompt.empty()) {
      out["prompt"] = prompt;
      out["prompt_ids"] = tokenizer.encode(prompt, true, false);
    }
    if (!model_path.empty()) {
      const auto model = posenc::Model::load_llama2c(model_path);
      const std::vector<float> logits = model.score_window(ids);
      const long vocab = model.config().vocab_size;
      std::FILE* f = std::fopen(logits_out.c_str(), "wb");
      if (!f || std::fwrite(logits.data(), sizeof(float), logits.size(), f) != logits.size() || std::fclose(f) != 0) {
        throw posenc::IoError("cannot write " + logits_out);
      }
      double nll = 0.0;
      for (long p = 0; p + 1 < window; ++p) {
        const float* row = logits.data() + p * vocab;
        double m = row[0];
        for (long v = 1; v < vocab; ++v) m = std::max(m, static_cast<double>(row[v]));
        double s = 0.0;
        for (long v = 0; v < vocab; ++v) s += std::exp(static_cast<double>(row[v]) - m);
        nll += m + std::log(s) - static_cast<double>(row[ids[p + 1]]);
      }
      out["model"] = model_path;
      out["vocab_size"] = vocab;
      out["posenc_nll_mean"] = nll / static_cast<double>(window - 1);
    }
    std::cout << out.dump() << "\n";
  } catch (const std::exception& e) {
    std::cerr << "posenc_window: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
