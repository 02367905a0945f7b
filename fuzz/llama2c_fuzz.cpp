// libFuzzer harness: Model::load_llama2c on the input bytes (through a scratch
// file: the reader memory-maps a path); a model that loads scores a 3-token
// window. posenc::Error is the expected outcome for bad input; anything else is
// a finding.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "fuzz_support.hpp"
#include "posenc/error.hpp"
#include "posenc/model.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const posenc::fuzz::ScratchFile file("llama2c.bin");
  try {
    const auto model = posenc::Model::load_llama2c(file.write(data, size));
    const int n = std::min(3, model.config().vocab_size);
    std::vector<int32_t> tokens;
    for (int i = 0; i < n; ++i) tokens.push_back(i);
    const auto logits = model.score_window(tokens);
    if (logits.size() != static_cast<std::size_t>(n) * static_cast<std::size_t>(model.config().vocab_size))
      __builtin_trap();
  } catch (const posenc::Error& e) {
    posenc::fuzz::refused(e);
  }
  return 0;
}
