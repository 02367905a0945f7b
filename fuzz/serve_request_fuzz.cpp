// libFuzzer harness for posenc serve's request parser
// (posenc::serve::parse_completion_request: a /v1/completions JSON body,
// validated field by field against the limits of stories260K: vocab_size 512,
// max_model_len 512, a 64 KiB body limit). RequestError (a posenc::Error) is
// the expected outcome for bad input; any other exception, a crash or a
// sanitizer report is a finding. An accepted request must satisfy the limits.
//
// Seed corpus: fuzz/corpus/serve_request/ (hand-written bodies: the lab's two
// request shapes, every field, and a few refused ones).
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "fuzz_support.hpp"
#include "posenc/serve.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  posenc::serve::RequestLimits limits;
  limits.vocab_size = 512;
  limits.max_model_len = 512;
  limits.max_request_bytes = 64 << 10;
  try {
    const auto r = posenc::serve::parse_completion_request(
        std::string_view(reinterpret_cast<const char*>(data), size), limits);
    if (const auto* ids = std::get_if<std::vector<int32_t>>(&r.prompt))
      for (int32_t t : *ids)
        if (t < 0 || t >= limits.vocab_size) std::abort();
    for (int32_t t : r.stop_token_ids)
      if (t < 0 || t >= limits.vocab_size) std::abort();
    if (r.max_tokens && (*r.max_tokens < 0 || *r.max_tokens > limits.max_model_len)) std::abort();
    if (r.logprobs && (*r.logprobs < 0 || *r.logprobs > 20)) std::abort();
    if (!(r.temperature >= 0) || !(r.top_p > 0 && r.top_p <= 1) || r.stop.size() > 4) std::abort();
  } catch (const posenc::Error& e) {
    posenc::fuzz::refused(e);
  }
  return 0;
}
