// libFuzzer harness: parse_decode_streams (model/kernels_dense.hpp), the parser of POSENC_DECODE_STREAMS, on the
// input text. It must not throw; what it accepts must be a valid plan whose to_string is the input itself (or, for
// "R:prefetch", the 1 KiB plan it names), so nothing is accepted in two spellings; and a plan built from the first
// bytes, when valid, must parse back from its to_string. A crash, an exception or a broken invariant is a finding.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "model/kernels_dense.hpp"

using posenc::detail::DecodeStreams;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  const auto plan = posenc::detail::parse_decode_streams(text);
  if (plan) {
    if (!posenc::detail::decode_streams_valid(*plan)) __builtin_trap();
    const std::string canonical = posenc::detail::to_string(*plan);
    const bool short_form = plan->prefetch_bytes == 1024 && text == std::to_string(plan->runs) + ":prefetch";
    if (text != canonical && !short_form) __builtin_trap();
  }
  if (size >= 3) {
    const DecodeStreams built{data[0] % 20, (data[1] | data[2] << 8) * 2};
    if (posenc::detail::decode_streams_valid(built)) {
      const auto back = posenc::detail::parse_decode_streams(posenc::detail::to_string(built));
      if (!back || back->runs != built.runs || back->prefetch_bytes != built.prefetch_bytes) __builtin_trap();
    }
  }
  return 0;
}
