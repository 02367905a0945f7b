// libFuzzer harness: parse_positional_spec (config.json -> PositionalSpec) on
// the input text, strict and lenient, then what `posenc inspect` builds from
// the spec (per-channel table, ALiBi slopes, the sliding-window pattern), and
// parse_decoder_spec (the sizes the Hugging Face loader allocates from). Every
// size is bounded (posenc/config.hpp config_limits): an input that makes any of
// these allocate more than libFuzzer's -rss_limit_mb is a finding, as is any
// exception other than posenc::Error.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "posenc/analysis.hpp"
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
    if (spec.rope) (void)posenc::inspect_rope(spec, std::nullopt);
    if (spec.alibi) (void)posenc::alibi_slopes_for(*spec.alibi, spec.num_attention_heads);
    for (std::size_t l = 0; l < spec.sliding_window.layer_is_sliding.size(); ++l)
      (void)spec.sliding_window.layer_mask(static_cast<int>(l));
  } catch (const posenc::Error& e) {
    posenc::fuzz::refused(e);
  }
  if (lenient) return;
  try {
    (void)posenc::parse_decoder_spec(text, "fuzz/config.json");
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
