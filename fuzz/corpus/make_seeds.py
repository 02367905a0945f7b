#!/usr/bin/env python3
"""Writes the seed corpora of the libFuzzer harnesses this script knows:
fuzz/corpus/{safetensors,safetensors_index,config,llama2c,posenc_checkpoint,llama2c_tokenizer}/.

Small files made from scratch (standard library only, deterministic): valid
inputs of each format, so the fuzzer starts past the first checks, plus a few
near-misses. Usage: python3 fuzz/corpus/make_seeds.py [CORPUS_DIR] (default:
the directory of this script). Existing seeds of these corpora are replaced.
"""
import json
import os
import random
import shutil
import struct
import sys

OUT = sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.abspath(__file__))
rng = random.Random(20240601)


def write(corpus, name, data):
    path = os.path.join(OUT, corpus, name)
    with open(path, "wb") as f:
        f.write(data if isinstance(data, bytes) else data.encode("utf-8"))


def fresh(corpus):
    d = os.path.join(OUT, corpus)
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)


def floats(n, scale=0.5):
    return struct.pack(f"<{n}f", *[rng.uniform(-scale, scale) for _ in range(n)])


# ---- safetensors ---------------------------------------------------------------------------------
def f32_to_f16_bits(x):
    return struct.unpack("<H", struct.pack("<e", x))[0]


def safetensors(tensors, metadata=None, pad=True):
    """tensors: [(name, dtype, shape, bytes)], back to back."""
    header, data = {}, b""
    if metadata is not None:
        header["__metadata__"] = metadata
    for name, dtype, shape, raw in tensors:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    text = json.dumps(header, separators=(",", ":")).encode()
    if pad:
        text += b" " * (-(8 + len(text)) % 8)
    return struct.pack("<Q", len(text)) + text + data


def make_safetensors():
    fresh("safetensors")
    halves = struct.pack("<6H", *[f32_to_f16_bits(v) for v in (0.5, -1.0, 65504.0, 6e-8, 0.0, -0.0)])
    write("safetensors", "f32_f16_bf16.safetensors", safetensors([
        ("model.norm.weight", "F32", [4], floats(4)),
        ("model.layers.0.self_attn.q_proj.weight", "F16", [2, 3], halves),
        ("lm_head.weight", "BF16", [2, 2], struct.pack("<4H", 0x3F80, 0xC000, 0x7F80, 0x0001)),
    ], metadata={"format": "pt", "model.embed_tokens.weight": "lm_head.weight"}))
    write("safetensors", "all_dtypes.safetensors", safetensors([
        ("f64", "F64", [1], struct.pack("<d", 1.5)), ("i64", "I64", [1], struct.pack("<q", -7)),
        ("i32", "I32", [2], struct.pack("<2i", 1, -1)), ("i16", "I16", [1], struct.pack("<h", 3)),
        ("i8", "I8", [2], b"\x01\xff"), ("u8", "U8", [1], b"\x07"), ("bool", "BOOL", [2], b"\x00\x01"),
        ("e4m3", "F8_E4M3", [1], b"\x38"), ("e5m2", "F8_E5M2", [1], b"\x3c"),
    ]))
    write("safetensors", "scalar_and_empty.safetensors", safetensors([
        ("scalar", "F32", [], floats(1)), ("empty", "F16", [0, 4], b""), ("v", "BF16", [3], b"\x80\x3f" * 3),
    ], pad=False))
    write("safetensors", "metadata_only.safetensors", safetensors([], metadata={"format": "pt"}))
    write("safetensors", "empty_header.safetensors", struct.pack("<Q", 2) + b"{}")
    # Near misses: overlapping ranges, a size the dtype does not fit, a duplicate name.
    ov = b'{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}}'
    write("safetensors", "overlap.safetensors", struct.pack("<Q", len(ov)) + ov + bytes(12))
    bad = b'{"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}}'
    write("safetensors", "size_mismatch.safetensors", struct.pack("<Q", len(bad)) + bad + bytes(8))
    dup = b'{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"a":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}}'
    write("safetensors", "duplicate.safetensors", struct.pack("<Q", len(dup)) + dup + bytes(2))


def make_safetensors_index():
    # The harness writes model-00001-of-00002.safetensors (tensors a, b) and
    # model-00002-of-00002.safetensors (tensor c) next to the index.
    fresh("safetensors_index")
    s1, s2 = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
    write("safetensors_index", "valid.json", json.dumps(
        {"metadata": {"total_size": 22}, "weight_map": {"a": s1, "b": s1, "c": s2}}, indent=2))
    write("safetensors_index", "missing_tensor.json", json.dumps({"weight_map": {"a": s1, "b": s1, "c": s2, "d": s2}}))
    write("safetensors_index", "wrong_shard.json", json.dumps({"weight_map": {"a": s2, "b": s1, "c": s2}}))
    write("safetensors_index", "escape.json", json.dumps({"weight_map": {"a": "../" + s1, "b": s1, "c": s2}}))
    write("safetensors_index", "one_shard.json", json.dumps({"weight_map": {"a": s1, "b": s1}}))


# ---- config.json -----------------------------------------------------------------------------------
def make_configs():
    fresh("config")
    llama = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "num_attention_heads": 8,
             "num_key_value_heads": 4, "hidden_size": 128, "num_hidden_layers": 2, "max_position_embeddings": 512,
             "rope_theta": 10000.0}
    configs = {
        "llama": llama,
        "llama3": dict(llama, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
        "linear": dict(llama, rope_scaling={"type": "linear", "factor": 2.0}),
        "dynamic": dict(llama, rope_scaling={"rope_type": "dynamic", "factor": 4.0}),
        "yarn": dict(llama, rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096,
                                          "beta_fast": 32, "beta_slow": 1}),
        "rope_parameters": dict({k: v for k, v in llama.items() if k != "rope_theta"},
                                rope_parameters={"rope_type": "default", "rope_theta": 500000.0}),
        "phi3_longrope": {"model_type": "phi3", "num_attention_heads": 2, "hidden_size": 16,
                          "max_position_embeddings": 131072, "original_max_position_embeddings": 4096,
                          "rope_scaling": {"type": "longrope", "short_factor": [1.0, 1.1, 1.2, 1.3],
                                           "long_factor": [2.0, 3.0, 4.0, 5.0]}},
        "qwen2_vl_mrope": {"model_type": "qwen2_vl", "num_attention_heads": 2, "hidden_size": 64,
                           "rope_scaling": {"type": "mrope", "mrope_section": [4, 6, 6]}, "rope_theta": 1000000.0},
        "qwen2_sliding": {"model_type": "qwen2", "num_attention_heads": 2, "hidden_size": 64,
                          "num_hidden_layers": 4, "sliding_window": 4096, "use_sliding_window": True,
                          "max_window_layers": 2},
        "gemma2": {"model_type": "gemma2", "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 64,
                   "head_dim": 32, "num_hidden_layers": 4, "sliding_window": 4096},
        "deepseek_v3": {"model_type": "deepseek_v3", "num_attention_heads": 4, "hidden_size": 256,
                        "qk_rope_head_dim": 32, "qk_nope_head_dim": 64, "rope_theta": 10000,
                        "rope_scaling": {"type": "yarn", "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                                         "original_max_position_embeddings": 4096, "beta_fast": 32,
                                         "beta_slow": 1}},
        "gptj": {"model_type": "gptj", "n_head": 16, "n_embd": 4096, "rotary_dim": 64, "n_positions": 2048},
        "gpt_neox": {"model_type": "gpt_neox", "num_attention_heads": 2, "hidden_size": 64, "rotary_pct": 0.25,
                     "rotary_emb_base": 10000},
        "bloom": {"model_type": "bloom", "n_head": 12, "hidden_size": 768},
        "falcon_alibi": {"model_type": "falcon", "num_attention_heads": 8, "hidden_size": 512, "alibi": True},
        "mpt": {"model_type": "mpt", "n_heads": 8, "d_model": 512, "max_seq_len": 2048,
                "attn_config": {"alibi": True, "alibi_bias_max": 8}},
        "t5": {"model_type": "t5", "num_heads": 4, "d_model": 256, "relative_attention_num_buckets": 32,
               "relative_attention_max_distance": 128, "is_encoder_decoder": True},
        "gpt2": {"model_type": "gpt2", "n_head": 4, "n_embd": 256, "n_positions": 1024},
        "bert": {"model_type": "bert", "num_attention_heads": 4, "hidden_size": 256, "max_position_embeddings": 512,
                 "position_embedding_type": "absolute"},
        "opt": {"model_type": "opt", "num_attention_heads": 4, "hidden_size": 256, "max_position_embeddings": 2048},
        "marian": {"model_type": "marian", "encoder_attention_heads": 8, "d_model": 512,
                   "max_position_embeddings": 512},
    }
    # Regressions: signed int overflows UBSan found in config.cpp (now computed in int64 / range-checked).
    configs["regression_head_dim_times_heads"] = {"model_type": "llama", "num_attention_heads": 65536,
                                                  "hidden_size": 64, "head_dim": 65536}
    configs["regression_mrope_section_sum"] = {"model_type": "qwen2_vl", "num_attention_heads": 2, "hidden_size": 64,
                                               "rope_scaling": {"type": "mrope",
                                                                "mrope_section": [1000000000] * 3}}
    configs["regression_roberta_pad_token_id"] = {"model_type": "roberta", "num_attention_heads": 4,
                                                  "hidden_size": 256, "max_position_embeddings": 514,
                                                  "pad_token_id": 2147483647}
    # Hostile sizes (issue 13): refused by the bounds of posenc/config.hpp config_limits before any allocation
    # (head_dim 1e9 drove 13.5 GB of allocation, 1e9 layers with a sliding window 16.9 GB).
    configs["regression_head_dim_1e9"] = {"model_type": "llama", "num_attention_heads": 1, "head_dim": 1000000000,
                                          "max_position_embeddings": 4096}
    configs["regression_layers_1e9_sliding_window"] = {"model_type": "mistral", "num_attention_heads": 1,
                                                       "head_dim": 2, "num_hidden_layers": 1000000000,
                                                       "sliding_window": 16, "max_position_embeddings": 64}
    configs["regression_heads_1e9_alibi"] = {"model_type": "bloom", "n_head": 1000000000, "hidden_size": 64}
    configs["regression_hidden_size_1e9"] = {"model_type": "llama", "num_attention_heads": 1,
                                             "hidden_size": 1000000000, "max_position_embeddings": 64}
    configs["regression_max_position_embeddings_int64_max"] = {"model_type": "llama", "num_attention_heads": 1,
                                                               "head_dim": 2,
                                                               "max_position_embeddings": 9223372036854775807}
    for name, c in configs.items():
        write("config", name + ".json", json.dumps(c, indent=2))


# ---- llama2.c checkpoints and tokenizers --------------------------------------------------------------
def llama2c(dim, hidden, layers, heads, kv_heads, vocab, seq, shared=True):
    head = dim // heads
    kv = kv_heads * head
    n = (vocab * dim + layers * dim + layers * dim * dim + 2 * layers * dim * kv + layers * dim * dim + layers * dim
         + 3 * layers * dim * hidden + dim + seq * head + (0 if shared else vocab * dim))
    header = struct.pack("<7i", dim, hidden, layers, heads, kv_heads, vocab if shared else -vocab, seq)
    return header + floats(n)


def make_llama2c():
    fresh("llama2c")
    write("llama2c", "shared.bin", llama2c(8, 16, 1, 2, 1, 8, 4))
    write("llama2c", "unshared_2layers.bin", llama2c(8, 12, 2, 2, 2, 6, 3, shared=False))
    write("llama2c", "truncated.bin", llama2c(8, 16, 1, 2, 1, 8, 4)[:-12])


def llama2c_tokenizer(extra):
    pieces = [(0.0, b"<unk>"), (0.0, b"\n<s>\n"), (0.0, b"\n</s>\n")]
    pieces += [(0.0, b"<0x%02X>" % b) for b in range(256)]
    pieces += [(float(-i), p.encode()) for i, p in enumerate([" "] + extra)]  # " ": the dummy prefix
    max_len = max(len(p) for _, p in pieces)
    out = struct.pack("<i", max_len)
    for score, p in pieces:
        out += struct.pack("<fi", score, len(p)) + p
    return out


def make_llama2c_tokenizer():
    fresh("llama2c_tokenizer")
    merges = [" t", "he", " a", "on", "ce", " u", "up", "pon", " upon", " O", " On", " Once", "im", "ime", " time",
              " ti", "in", "er", ",", ".", "\xe9", "\u4e2d"]
    write("llama2c_tokenizer", "small.bin", llama2c_tokenizer(merges))
    write("llama2c_tokenizer", "bytes_only.bin", llama2c_tokenizer([]))


# ---- posenc checkpoints ----------------------------------------------------------------------------------
def align64(x):
    return (x + 63) // 64 * 64


def posenc_checkpoint(family, dim=8, hidden=12, layers=1, heads=2, kv_heads=1, vocab=6, ctx=8, shared=True,
                      symbols=None, header_format="posenc-checkpoint"):
    head = dim // heads
    kvd = kv_heads * head
    shapes = [("tok_embeddings", [vocab, dim])]
    for l in range(layers):
        p = f"layers.{l}."
        shapes += [(p + "attention_norm", [dim]), (p + "wq", [dim, dim]), (p + "wk", [kvd, dim]),
                   (p + "wv", [kvd, dim]), (p + "wo", [dim, dim]), (p + "ffn_norm", [dim]),
                   (p + "w1", [hidden, dim]), (p + "w2", [dim, hidden]), (p + "w3", [hidden, dim])]
    shapes.append(("norm", [dim]))
    if not shared:
        shapes.append(("output", [vocab, dim]))
    positional = {"family": family}
    if family == "rope":
        positional.update(rope_theta=10000.0, rotary_dim=head, layout="interleaved", angle_precision="float32")
    elif family == "mrope":  # Qwen2-VL/Qwen3-VL: half layout, 3 sections summing to rotary_dim/2
        positional.update(rope_theta=10000.0, rotary_dim=head, layout="half", angle_precision="float32",
                          mrope_section=[1, 1, 0], mrope_mapping="interleaved")
    elif family == "alibi":
        positional["max_bias"] = 8.0
    elif family == "t5_bias":
        positional.update(relative_attention_num_buckets=8, relative_attention_max_distance=16)
        shapes.append(("t5_relative_attention_bias", [8, heads]))
    elif family == "sinusoidal":
        positional["base"] = 10000.0
    elif family == "learned_absolute":
        shapes.append(("pos_embeddings", [ctx, dim]))
    tensors, data = [], b""
    for name, shape in shapes:
        n = 1
        for d in shape:
            n *= d
        tensors.append({"name": name, "shape": shape, "offset": len(data)})
        data += floats(n)
        data += bytes(align64(len(data)) - len(data))
    header = {"format": header_format, "version": 1,
              "config": {"dim": dim, "hidden_dim": hidden, "n_layers": layers, "n_heads": heads,
                         "n_kv_heads": kv_heads, "vocab_size": vocab, "max_position_embeddings": ctx,
                         "norm_eps": 1e-5, "shared_classifier": shared},
              "positional": positional, "metadata": {"task": "seed"}, "tensors": tensors}
    if symbols is not None:
        header["symbols"] = symbols
    text = json.dumps(header, separators=(",", ":")).encode()
    start = align64(16 + len(text))
    return b"POSENC01" + struct.pack("<Q", len(text)) + text + bytes(start - 16 - len(text)) + data


def make_posenc_checkpoint():
    fresh("posenc_checkpoint")
    for family in ("rope", "alibi", "t5_bias", "sinusoidal", "learned_absolute", "nope"):
        write("posenc_checkpoint", family + ".posenc", posenc_checkpoint(family))
    write("posenc_checkpoint", "rope_unshared_symbols.posenc",
          posenc_checkpoint("rope", layers=2, shared=False, symbols=["<pad>", "<bos>", "<eos>", "a", "b", "c"]))
    write("posenc_checkpoint", "llama2c.bin", llama2c(8, 16, 1, 2, 1, 8, 4))
    # Regression: a non-string "format" made the reader throw nlohmann's type_error instead of CheckpointError.
    write("posenc_checkpoint", "regression_format_object.posenc", posenc_checkpoint("rope", header_format={"dim": 8}))
    # Issue 13: "format": 1 (and other wrong types) must be a CheckpointError naming the file and the field.
    write("posenc_checkpoint", "regression_format_int.posenc", posenc_checkpoint("rope", header_format=1))
    # Issue 16: family mrope (3-row M-RoPE) is read; its sections are validated against rotary_dim/2.
    write("posenc_checkpoint", "mrope.posenc", posenc_checkpoint("mrope"))


if __name__ == "__main__":
    make_safetensors()
    make_safetensors_index()
    make_configs()
    make_llama2c()
    make_llama2c_tokenizer()
    make_posenc_checkpoint()
