// libFuzzer harness: Model::load on the input bytes (through a scratch file):
// a posenc checkpoint (magic POSENC01, JSON header, aligned float32 tensors;
// see include/posenc/checkpoint.hpp), or a llama2.c checkpoint when the magic
// is absent. A model that loads scores a 3-token window and converts back to a
// checkpoint value. posenc::Error is the expected outcome for bad input;
// anything else is a finding.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "fuzz_support.hpp"
#include "posenc/checkpoint.hpp"
#include "posenc/error.hpp"
#include "posenc/model.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const posenc::fuzz::ScratchFile file("checkpoint.posenc");
  try {
    const auto model = posenc::Model::load(file.write(data, size));
    const int n = static_cast<int>(std::min<int64_t>({3, model.config().vocab_size,
                                                      model.config().max_position_embeddings}));
    std::vector<int32_t> tokens;
    for (int i = 0; i < n; ++i) tokens.push_back(i);
    const auto logits = model.score_window(tokens);
    if (logits.size() != static_cast<std::size_t>(n) * static_cast<std::size_t>(model.config().vocab_size))
      __builtin_trap();
    (void)model.to_checkpoint();
  } catch (const posenc::Error& e) {
    posenc::fuzz::refused(e);
  }
  return 0;
}
