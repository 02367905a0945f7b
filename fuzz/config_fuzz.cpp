// libFuzzer harness: parse_positional_spec (config.json -> PositionalSpec) on
// the input text, strict and lenient; when a RoPE spec comes out, its
// frequencies are computed as every caller does next. posenc::Error is the
// expected outcome for bad input; anything else is a finding.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "posenc/config.hpp"
#include "fuzz_support.hpp"
#include "posenc/error.hpp"
#include "posenc/rope.hpp"

namespace {
void run(std::string_view text, bool lenient) {
  try {
    posenc::ConfigOptions options;
    options.lenient = lenient;
    const auto spec = posenc::parse_positional_spec(text, "fuzz/config.json", options);
    (void)posenc::layout_name(spec);
    if (spec.rope) (void)posenc::compute_rope_frequencies(*spec.rope);
    for (std::size_t l = 0; l < spec.sliding_window.layer_is_sliding.size(); ++l)
      (void)spec.sliding_window.layer_mask(static_cast<int>(l));
  } catch (const posenc::Error& e) {
    posenc::fuzz::refused(e);
  }
}
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  run(text, false);
  run(text, true);
  return 0;
}
