// posenc — where position enters a Transformer (design.md, "The families").
#pragma once

#include <string_view>

namespace posenc {

///  - nope:             nowhere; the causal mask is the only order signal (Kazemnejad et al., NeurIPS 2023)
///  - learned_absolute: a learned [max_position_embeddings, d_model] table added to the token embeddings (GPT-2, BERT)
///  - sinusoidal:       Vaswani et al. 2017 §3.5 encodings added to the token embeddings
///  - t5_bias:          a learned [relative_attention_num_buckets, heads] bias on the logits (Raffel et al. 2020)
///  - alibi:            -slope_h * (i - j) on the logits (Press et al., ICLR 2022)
///  - rope:             rotates q and k (Su et al., RoFormer)
///  - mrope:            RoPE with three position rows split by mrope_section (Qwen2-VL)
enum class PositionFamily { nope, learned_absolute, sinusoidal, t5_bias, alibi, rope, mrope };

std::string_view to_string(PositionFamily family);
/// Parses the names above. Throws ConfigError naming `field` and the value.
PositionFamily parse_position_family(std::string_view text, std::string_view field = "family");

}  // namespace posenc
