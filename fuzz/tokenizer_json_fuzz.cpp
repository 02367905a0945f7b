// libFuzzer harness: the bytes as a tokenizer.json (a NUL byte, if any,
// separates a tokenizer_config.json after it). When it loads, a few texts
// (and the first bytes of the input as text) are encoded with and without
// special tokens and decoded back, whole and streamed. posenc::Error is the
// expected answer to bad input; anything else (another exception, a crash, a
// sanitizer report) is a finding.
//
// Build and run (from the repository root):
//   clang++ -std=c++20 -g -O1 -fsanitize=fuzzer,address,undefined -Iinclude -Isrc fuzz/tokenizer_json_fuzz.cpp \
//     src/model/tokenizer.cpp src/model/tokenizer_bpe.cpp src/model/tokenizer_json.cpp src/core/io.cpp \
//     -lfmt -lpcre2-8 -lutf8proc -o /tmp/tokenizer_json_fuzz
//   /tmp/tokenizer_json_fuzz -max_len=16384 -dict=fuzz/tokenizer_json.dict /tmp/corpus fuzz/corpus/tokenizer_json
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "posenc/error.hpp"
#include "posenc/tokenizer.hpp"

namespace {

void exercise(const posenc::Tokenizer& t, std::string_view text) {
  for (bool special : {false, true}) {
    const auto ids = t.encode_hf(text, special);
    (void)t.decode(ids);
    int32_t prev = -1;
    for (int32_t id : ids) {
      (void)t.decode(prev, id);
      (void)t.is_special(id);
      prev = id;
    }
  }
  (void)t.encode(text, true, true);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view bytes(reinterpret_cast<const char*>(data), size);
  const std::size_t nul = bytes.find('\0');
  const std::string_view json = bytes.substr(0, nul);
  const std::string_view config = nul == std::string_view::npos ? std::string_view() : bytes.substr(nul + 1);
  try {
    const auto t = posenc::Tokenizer::from_tokenizer_json(json, "fuzz/tokenizer.json", config);
    static const char* const kTexts[] = {
        "", "Hello world", "  a  b\n\n\tc \r\n", "caf\xc3\xa9 cafe\xcc\x81 \xe2\x96\x81 \xf0\x9f\x98\x80 12345",
        "<s>x</s><|endoftext|><unk>", "\xff\xfe\xc3 invalid \xe2\x82", "I'm you'll they'd 'S"};
    for (const char* s : kTexts) exercise(t, s);
    exercise(t, bytes.substr(0, 48));
    (void)t.bos_id();
    (void)t.eos_id();
    (void)t.adds_prefix_space();
    (void)t.describe();
    (void)t.token_id("a");
    (void)t.max_token_length();
    if (t.vocab_size() > 0) (void)t.piece(t.vocab_size() - 1);
  } catch (const posenc::Error&) {
  }
  return 0;
}
