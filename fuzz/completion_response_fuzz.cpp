// libFuzzer harness: the endpoint client's response parsers (eval --endpoint):
// parse_completion_response (a /v1/completions body, with the checks the
// likelihood request then makes on it) and parse_models_response (GET
// /v1/models) on the input text. posenc::Error (DataError) is the expected
// outcome for a malformed answer; anything else is a finding.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "fuzz_support.hpp"
#include "posenc/endpoint.hpp"
#include "posenc/error.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  try {
    const auto r = posenc::parse_completion_response(text, "fuzz: POST /v1/completions");
    double sum = 0;
    for (const auto& v : r.token_logprobs)
      if (v) sum += *v;
    (void)sum;
    (void)r.text.size();
  } catch (const posenc::Error& e) {
    posenc::fuzz::refused(e);
  }
  try {
    const auto models = posenc::parse_models_response(text, "fuzz: GET /v1/models");
    for (const auto& m : models) (void)m.id.size();
  } catch (const posenc::Error& e) {
    posenc::fuzz::refused(e);
  }
  return 0;
}
