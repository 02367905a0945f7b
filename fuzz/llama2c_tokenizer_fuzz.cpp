// libFuzzer harness: Tokenizer::load_llama2c on the input bytes (through a
// scratch file); a tokenizer that loads encodes and decodes a fixed text
// (its merges come from the fuzzed scores). posenc::Error is the expected
// outcome for bad input; anything else is a finding.
#include <cstddef>
#include <cstdint>

#include "fuzz_support.hpp"
#include "posenc/error.hpp"
#include "posenc/tokenizer.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const posenc::fuzz::ScratchFile file("tok.bin");
  try {
    const auto tok = posenc::Tokenizer::load_llama2c(file.write(data, size));
    const auto ids = tok.encode("Once upon a time, \xc3\xa9\xe4\xb8\xad<0x41>\n", true, true);
    for (int32_t id : ids)
      if (id < 0 || id >= tok.vocab_size()) __builtin_trap();
    (void)tok.decode(ids);
  } catch (const posenc::Error& e) {
    posenc::fuzz::refused(e);
  }
  return 0;
}
