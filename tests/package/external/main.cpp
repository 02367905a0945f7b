// The external project of the package test: the YaRN frequencies of a real config.json (DeepSeek-V3's), and a
// [tokens, heads, head_dim] vector rotated with them in the config's layout, printed as one JSON object that
// tests/package/check_package.py compares with the Hugging Face reference (testdata/hf_reference/rope_init.json).
//
// Usage: posenc_external CONFIG_JSON
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>  // posenc::core's interface brings nlohmann_json (found by posencConfig.cmake)

#include "posenc/config.hpp"
#include "posenc/error.hpp"
#include "posenc/rope.hpp"
#include "posenc/scaling.hpp"
#include "posenc/version.hpp"

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s CONFIG_JSON\n", argv[0]);
    return 2;
  }
  try {
    const posenc::PositionalSpec spec = posenc::load_positional_spec(argv[1]);
    if (!spec.rope || !spec.layout) throw posenc::ConfigError(std::string(argv[1]) + ": not a RoPE config");
    const posenc::RopeFrequencies freqs = posenc::compute_rope_frequencies(*spec.rope);

    // x: [tokens, heads, head_dim] float32, a fixed pattern; positions inside and far past the original 4096.
    const std::vector<int64_t> positions{0, 1, 7, 4095, 4096, 65537, 163839};
    const int heads = 2, head_dim = freqs.head_dim;
    const auto tokens = static_cast<int64_t>(positions.size());
    std::vector<float> x(static_cast<std::size_t>(tokens * heads * head_dim));
    for (std::size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(std::sin(0.37 * static_cast<double>(i + 1)));
    std::vector<float> rotated = x;
    const posenc::RopeTable table(freqs, positions, posenc::AnglePrecision::float32);
    if (spec.rope_output_half_order)  // DeepSeek-V3: interleaved pairs in, half order out
      posenc::apply_rope_interleaved_in_half_out(rotated.data(), tokens, heads, head_dim, table);
    else
      posenc::apply_rope(rotated.data(), tokens, heads, head_dim, table, *spec.layout);

    nlohmann::json out;
    out["posenc_version"] = std::string(posenc::version());
    out["package_version"] = POSENC_PACKAGE_VERSION;
    out["rope_type"] = freqs.rope_type;
    out["head_dim"] = freqs.head_dim;
    out["rotary_dim"] = freqs.rotary_dim;
    out["attention_factor"] = freqs.attention_factor;
    out["inv_freq"] = freqs.inv_freq;  // float32 values, printed as the doubles they are
    out["layout"] = posenc::layout_name(spec);
    out["positions"] = positions;
    out["heads"] = heads;
    out["x"] = x;
    out["rotated"] = rotated;
    std::printf("%s\n", out.dump().c_str());
  } catch (const posenc::Error& e) {
    std::fprintf(stderr, "posenc_external: %s\n", e.what());
    return 1;
  }
  return 0;
}
