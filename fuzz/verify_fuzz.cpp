// libFuzzer harness: posenc verify on a dump given as .npz bytes (TensorDump::parse_npz,
// then verify_rope against a fixed reference: default RoPE, head_dim 8, theta 10000, in
// both dump layouts). Arrays of any name, rank, shape, dtype and values reach verify's
// own checks (pairs, ranks, head_dim, position ids, finite values, table widths).
// posenc::Error is the expected outcome for bad input; a result must be PASS or FAIL
// with finite tolerances; anything else (another exception, a crash, a sanitizer
// report) is a finding.
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>

#include "fuzz_support.hpp"
#include "posenc/error.hpp"
#include "posenc/tensor_dump.hpp"
#include "posenc/verify.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const posenc::VerifyReference ref =
      posenc::verify_reference_from_json(R"({"rope_type": "default", "head_dim": 8, "rope_theta": 10000})", "fuzz");
  posenc::TensorDump dump;
  try {
    dump = posenc::TensorDump::parse_npz(std::as_bytes(std::span(data, size)), "fuzz.npz");
  } catch (const posenc::Error& e) {
    posenc::fuzz::refused(e);
    return 0;
  }
  for (auto layout : {posenc::DumpLayout::tokens_heads_dim, posenc::DumpLayout::batch_heads_tokens_dim}) {
    posenc::VerifyOptions o;
    o.dump_layout = layout;
    try {
      const posenc::VerifyResult r = posenc::verify_rope(ref, dump, o);
      for (const auto& e : r.errors)
        if (!(e.tolerance > 0) || !std::isfinite(e.tolerance)) __builtin_trap();
      (void)posenc::verify_result_json(r);
      (void)posenc::format_verify_report(r);
    } catch (const posenc::Error& e) {
      posenc::fuzz::refused(e);
    }
  }
  return 0;
}
