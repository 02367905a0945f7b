// libFuzzer harness for the GGUF model loader on top of the parser
// (posenc::Model::load of a .gguf file: metadata -> ModelConfig, tensors ->
// weights, embedded vocabulary, RoPE setup).
//
// Writes the input to a scratch file and loads it twice (weights dequantized,
// and kept as Q8_0/Q4_0 blocks for the quantized-activation kernel); a file
// that loads runs one forward of 2 tokens (the first and the last id) and,
// when it brings a usable vocabulary, encodes a short text.
// posenc::Error is the expected outcome for bad input; any other exception,
// a crash or a sanitizer report is a finding.
//
// Seed corpus: fuzz/corpus/gguf_model/ (tiny models made by
// tests/model/formats/tiny_models.hpp; GgufModelFuzzCorpus.SeedsAreCurrent
// with POSENC_WRITE_FUZZ_CORPUS=1 writes them).
#include <cstddef>
#include <cstdint>
#include <vector>

#include "fuzz_support.hpp"
#include "posenc/error.hpp"
#include "posenc/model.hpp"

namespace {

// Bounds the time one input can take: the loader believes sizes only as far
// as the file holds them, so a small file is a small model; this only skips
// the forward of inputs that the fuzzer grew large.
constexpr int64_t kMaxForwardParameters = int64_t{1} << 22;

void run(const std::filesystem::path& path, posenc::QuantizedMatmul mode) {
  const posenc::Model m = posenc::Model::load(path, posenc::LoadOptions{mode});
  const auto& c = m.config();
  const int64_t params = int64_t{c.vocab_size} * c.dim + int64_t{c.n_layers} * (int64_t{c.dim} * c.q_dim() * 2 +
                                                                                 int64_t{c.dim} * c.kv_dim() * 2 +
                                                                                 int64_t{c.dim} * c.hidden_dim * 3);
  if (params > kMaxForwardParameters) return;
  const std::vector<int32_t> tokens{0, c.vocab_size - 1};
  const std::vector<float> logits = m.score_window(tokens);
  if (logits.size() != 2 * static_cast<std::size_t>(c.vocab_size)) std::abort();
  if (m.bundled_tokenizer()) (void)m.bundled_tokenizer()->encode_hf("Once upon a time", true);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const posenc::fuzz::ScratchFile scratch("gguf_model.gguf");
  const auto& path = scratch.write(data, size);
  for (auto mode : {posenc::QuantizedMatmul::dequantize, posenc::QuantizedMatmul::q8_activations}) {
    try {
      run(path, mode);
    } catch (const posenc::Error& e) {
      posenc::fuzz::refused(e);
    }
  }
  return 0;
}
