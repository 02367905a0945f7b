#include "config/architectures.hpp"

#include <array>

namespace posenc::detail {

namespace {

constexpr std::string_view kRotateHalf =
    "Hugging Face rotate_half (channel i pairs with i + rotary_dim/2)";
constexpr std::string_view kInterleaved =
    "rotate_every_two (channel 2i pairs with 2i+1)";

using L = RopeLayout;
using S = SlidingRule;
using K = ArchKind;
using SL = SinusoidalLayout;

// model_type, architectures prefix, kind, layout, layout reason, sliding rule, offset, sinusoidal.
const std::array kTable{
    // RoPE, half (HF checkpoints of these are stored for rotate_half; Meta's
    // original Llama weights are interleaved and HF's converter permutes q/k).
    ArchTraits{"llama", "Llama", K::rope, L::half, kRotateHalf, S::none, 0, {}},
    ArchTraits{"mistral", "Mistral", K::rope, L::half, kRotateHalf, S::all_layers, 0, {}},
    ArchTraits{"mixtral", "Mixtral", K::rope, L::half, kRotateHalf, S::all_layers, 0, {}},
    ArchTraits{"qwen2", "Qwen2For", K::rope, L::half, kRotateHalf, S::qwen, 0, {}},
    ArchTraits{"qwen2_moe", "Qwen2Moe", K::rope, L::half, kRotateHalf, S::qwen, 0, {}},
    ArchTraits{"qwen3", "Qwen3For", K::rope, L::half, kRotateHalf, S::qwen, 0, {}},
    ArchTraits{"qwen3_moe", "Qwen3Moe", K::rope, L::half, kRotateHalf, S::qwen, 0, {}},
    ArchTraits{"gemma", "GemmaFor", K::rope, L::half, kRotateHalf, S::none, 0, {}},
    ArchTraits{"gemma2", "Gemma2", K::rope, L::half, kRotateHalf, S::gemma2_alternate, 0, {}},
    ArchTraits{"gemma3_text", "Gemma3ForCausalLM", K::rope, L::half, kRotateHalf,
               S::gemma3_pattern, 0, {}},
    ArchTraits{"phi3", "Phi3", K::rope, L::half, kRotateHalf, S::all_layers, 0, {}},
    ArchTraits{"phi", "PhiFor", K::rope, L::half, kRotateHalf, S::none, 0, {}},
    ArchTraits{"gpt_neox", "GPTNeoX", K::rope, L::half, kRotateHalf, S::none, 0, {}},
    ArchTraits{"stablelm", "StableLm", K::rope, L::half, kRotateHalf, S::none, 0, {}},
    ArchTraits{"starcoder2", "Starcoder2", K::rope, L::half, kRotateHalf, S::all_layers, 0, {}},
    ArchTraits{"olmo", "OlmoFor", K::rope, L::half, kRotateHalf, S::none, 0, {}},
    ArchTraits{"olmo2", "Olmo2", K::rope, L::half, kRotateHalf, S::none, 0, {}},
    ArchTraits{"granite", "GraniteFor", K::rope, L::half, kRotateHalf, S::none, 0, {}},
    ArchTraits{"persimmon", "Persimmon", K::rope, L::half, kRotateHalf, S::none, 0, {}},
    // Composite (vision + text) configs: positions come from text_config.
    // mllama: MllamaTextSelfAttention applies Llama's rotate_half.
    ArchTraits{"mllama", "Mllama", K::rope, L::half, kRotateHalf, S::none, 0, {}},
    ArchTraits{"mllama_text_model", "MllamaForCausalLM", K::rope, L::half, kRotateHalf, S::none, 0, {}},
    ArchTraits{"gemma3", "Gemma3ForConditionalGeneration", K::rope, L::half, kRotateHalf,
               S::gemma3_pattern, 0, {}},
    // gpt_oss: modeling_gpt_oss._apply_rotary_emb splits x with torch.chunk(x, 2) (halves).
    ArchTraits{"gpt_oss", "GptOss", K::rope, L::half,
               "_apply_rotary_emb: torch.chunk halves (channel i pairs with i + rotary_dim/2)", S::none, 0, {}},
    // Phi-4-multimodal: remote modeling_phi4mm and HF phi4_multimodal use Phi-3's rotate_half.
    ArchTraits{"phi4mm", "Phi4MM", K::rope, L::half, kRotateHalf, S::all_layers, 0, {}},
    ArchTraits{"phi4_multimodal", "Phi4Multimodal", K::rope, L::half, kRotateHalf, S::all_layers, 0, {}},
    // RoPE, interleaved.
    ArchTraits{"gptj", "GPTJ", K::rope, L::interleaved, kInterleaved, S::none, 0, {}},
    ArchTraits{"codegen", "CodeGen", K::rope, L::interleaved, kInterleaved, S::none, 0, {}},
    ArchTraits{"cohere", "Cohere", K::rope, L::interleaved,
               "Cohere's rotate_half interleaves (channel 2i pairs with 2i+1)", S::none, 0, {}},
    // Llama 4: apply_rotary_emb views (x[2i], x[2i+1]) as one complex number.
    ArchTraits{"llama4", "Llama4", K::rope, L::interleaved,
               "apply_rotary_emb: view_as_complex of channel pairs (2i, 2i+1)", S::none, 0, {}},
    ArchTraits{"llama4_text", "Llama4ForCausalLM", K::rope, L::interleaved,
               "apply_rotary_emb: view_as_complex of channel pairs (2i, 2i+1)", S::none, 0, {}},
    // GLM-4 (HF Glm/Glm4): interleaved pairs on the first head_dim * 0.5 channels.
    ArchTraits{"glm", "GlmFor", K::rope, L::interleaved,
               "modeling_glm.apply_rotary_pos_emb: rotate_half on x[..., 0::2] / x[..., 1::2] of the first "
               "rotary_dim channels",
               S::none, 0, {}, 0.5},
    ArchTraits{"glm4", "Glm4For", K::rope, L::interleaved,
               "modeling_glm.apply_rotary_pos_emb (Glm4Attention = GlmAttention): interleaved pairs on the first "
               "rotary_dim channels",
               S::none, 0, {}, 0.5},
    // ChatGLM2/3 and GLM-4 remote code (modeling_chatglm.py).
    ArchTraits{"chatglm", "ChatGLM", K::chatglm, L::interleaved,
               "modeling_chatglm.apply_rotary_pos_emb: x[..., :rot_dim] reshaped to (rot_dim/2, 2) pairs",
               S::none, 0, {}},
    // DeepSeek MLA: layout resolved from rope_interleave in config.cpp.
    ArchTraits{"deepseek_v2", "DeepseekV2", K::rope_deepseek, L::interleaved,
               "apply_rotary_pos_emb_interleave: interleaved pairs in, half order out", S::none, 0,
               {}},
    ArchTraits{"deepseek_v3", "DeepseekV3", K::rope_deepseek, L::interleaved,
               "apply_rotary_pos_emb_interleave: interleaved pairs in, half order out", S::none, 0,
               {}},
    // MRoPE.
    ArchTraits{"qwen2_vl", "Qwen2VL", K::mrope, L::half, kRotateHalf, S::qwen, 0, {}},
    ArchTraits{"qwen2_5_vl", "Qwen2_5_VL", K::mrope, L::half, kRotateHalf, S::qwen, 0, {}},
    ArchTraits{"qwen2_vl_text", "Qwen2VLText", K::mrope, L::half, kRotateHalf, S::qwen, 0, {}},
    ArchTraits{"qwen2_5_vl_text", "Qwen2_5_VLText", K::mrope, L::half, kRotateHalf, S::qwen, 0, {}},
    // Qwen3-VL: interleaved MRoPE (config.cpp; HF Qwen3VLTextRotaryEmbedding.apply_interleaved_mrope).
    ArchTraits{"qwen3_vl", "Qwen3VL", K::mrope, L::half, kRotateHalf, S::none, 0, {}},
    ArchTraits{"qwen3_vl_text", "Qwen3VLText", K::mrope, L::half, kRotateHalf, S::none, 0, {}},
    // Falcon: RoPE (rotate_half) unless alibi is set.
    ArchTraits{"falcon", "Falcon", K::falcon, L::half, kRotateHalf, S::none, 0, {}},
    // ALiBi.
    ArchTraits{"bloom", "Bloom", K::alibi_bloom, {}, {}, S::none, 0, {}},
    ArchTraits{"mpt", "Mpt", K::mpt, {}, {}, S::none, 0, {}},
    ArchTraits{"mpt", "MPT", K::mpt, {}, {}, S::none, 0, {}},
    // T5 relative buckets.
    ArchTraits{"t5", "T5", K::t5, {}, {}, S::none, 0, {}},
    ArchTraits{"mt5", "MT5", K::t5, {}, {}, S::none, 0, {}},
    ArchTraits{"umt5", "UMT5", K::t5, {}, {}, S::none, 0, {}},
    ArchTraits{"switch_transformers", "SwitchTransformers", K::t5, {}, {}, S::none, 0, {}},
    // Learned absolute.
    ArchTraits{"gpt2", "GPT2", K::learned, {}, {}, S::none, 0, {}},
    ArchTraits{"gpt_neo", "GPTNeoFor", K::learned, {}, {}, S::none, 0, {}},
    ArchTraits{"opt", "OPT", K::learned, {}, {}, S::none, 2, {}},
    ArchTraits{"bart", "Bart", K::learned, {}, {}, S::none, 2, {}},
    ArchTraits{"mbart", "MBart", K::learned, {}, {}, S::none, 2, {}},
    ArchTraits{"bert", "Bert", K::bert_like, {}, {}, S::none, 0, {}},
    ArchTraits{"electra", "Electra", K::bert_like, {}, {}, S::none, 0, {}},
    // RoBERTa numbers positions from padding_idx + 1 (= 2 with pad_token_id 1).
    ArchTraits{"roberta", "Roberta", K::bert_like, {}, {}, S::none, 2, {}},
    ArchTraits{"xlm-roberta", "XLMRoberta", K::bert_like, {}, {}, S::none, 2, {}},
    ArchTraits{"distilbert", "DistilBert", K::maybe_sinusoidal, {}, {}, S::none, 0,
               SL::interleaved},
    ArchTraits{"xlm", "XLM", K::maybe_sinusoidal, {}, {}, S::none, 0, SL::interleaved},
    // Sinusoidal.
    ArchTraits{"marian", "Marian", K::sinusoidal, {}, {}, S::none, 0, SL::halves},
    ArchTraits{"pegasus", "Pegasus", K::sinusoidal, {}, {}, S::none, 0, SL::halves},
    ArchTraits{"fsmt", "FSMT", K::sinusoidal, {}, {}, S::none, 0, SL::tensor2tensor},
    ArchTraits{"m2m_100", "M2M100", K::sinusoidal, {}, {}, S::none, 0, SL::tensor2tensor},
    ArchTraits{"speech_to_text", "Speech2Text", K::sinusoidal, {}, {}, S::none, 0,
               SL::tensor2tensor},
};

}  // namespace

const ArchTraits* find_architecture(std::string_view model_type, std::string_view architecture) {
  if (!model_type.empty())
    for (const auto& row : kTable)
      if (row.model_type == model_type) return &row;
  const ArchTraits* best = nullptr;
  if (!architecture.empty())
    for (const auto& row : kTable)
      if (architecture.starts_with(row.arch_prefix) &&
          (best == nullptr || row.arch_prefix.size() > best->arch_prefix.size()))
        best = &row;
  return best;
}

}  // namespace posenc::detail
