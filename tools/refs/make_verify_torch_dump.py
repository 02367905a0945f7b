#!/usr/bin/python3
"""Writes a RoPE dump the way a PyTorch engine would, for `posenc verify`.

A Llama-style rotary module written as Hugging Face transformers writes it
(modeling_rope_utils._compute_llama3_parameters / _compute_default_rope_parameters,
LlamaRotaryEmbedding.forward: inv_freq @ position_ids in float32, cat(freqs, freqs),
cos/sin * attention_scaling; apply_rotary_pos_emb with rotate_half), re-typed
here so that only Debian's python3-torch is needed (no transformers).
--pairing interleaved replaces rotate_half by GPT-J-style interleaved pairs
(the engine mistake `posenc verify` must name as a layout error).

Output (OUT_DIR): q.npy, q_rope.npy, k.npy, k_rope.npy ([tokens, heads, head_dim]
float32), position_ids.npy ([tokens] int64), versions.json (torch, numpy).
Usage: make_verify_torch_dump.py CONFIG_JSON OUT_DIR [--pairing half|interleaved]
"""
import argparse
import json
import math
import os

import numpy as np
import torch


def llama3_inv_freq(config, dim):
    base = config.get("rope_theta", 10000.0)
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim))
    scaling = config.get("rope_scaling") or {}
    if scaling.get("rope_type", scaling.get("type", "default")) != "llama3":
        return inv_freq
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth_factor = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed_inv_freq = (1 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
    is_medium_freq = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium_freq, smoothed_inv_freq, inv_freq_llama)


class RotaryEmbedding(torch.nn.Module):
    def __init__(self, config, head_dim, pairing):
        super().__init__()
        self.register_buffer("inv_freq", llama3_inv_freq(config, head_dim), persistent=False)
        self.attention_scaling = 1.0
        self.pairing = pairing

    @torch.no_grad()
    def forward(self, x, position_ids):
        inv_freq_expanded = self.inv_freq[None, :, None].float().expand(position_ids.shape[0], -1, 1)
        position_ids_expanded = position_ids[:, None, :].float()
        freqs = (inv_freq_expanded.float() @ position_ids_expanded.float()).transpose(1, 2)
        if self.pairing == "half":
            emb = torch.cat((freqs, freqs), dim=-1)
        else:
            emb = torch.repeat_interleave(freqs, 2, dim=-1)
        cos = emb.cos() * self.attention_scaling
        sin = emb.sin() * self.attention_scaling
        return cos.to(dtype=x.dtype), sin.to(dtype=x.dtype)


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def rotate_interleaved(x):
    x1 = x[..., 0::2]
    x2 = x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def apply_rotary_pos_emb(q, k, cos, sin, pairing):
    rot = rotate_half if pairing == "half" else rotate_interleaved
    cos = cos.unsqueeze(1)
    sin = sin.unsqueeze(1)
    return (q * cos) + (rot(q) * sin), (k * cos) + (rot(k) * sin)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("config")
    ap.add_argument("out_dir")
    ap.add_argument("--pairing", choices=["half", "interleaved"], default="half")
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    args = ap.parse_args()
    with open(args.config) as f:
        config = json.load(f)
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    torch.manual_seed(0)
    # Short positions and positions across Llama-3's original context (8192), where the bands differ.
    position_ids = torch.cat([torch.arange(0, 16), torch.arange(8180, 8196)]).unsqueeze(0)
    tokens = position_ids.shape[1]
    q = torch.randn(1, args.heads, tokens, head_dim, dtype=torch.float32)  # [batch, heads, tokens, head_dim]
    k = torch.randn(1, args.kv_heads, tokens, head_dim, dtype=torch.float32)
    rope = RotaryEmbedding(config, head_dim, args.pairing)
    cos, sin = rope(q, position_ids)
    q_rope, k_rope = apply_rotary_pos_emb(q, k, cos, sin, args.pairing)
    os.makedirs(args.out_dir, exist_ok=True)

    def tokens_heads_dim(t):
        return np.ascontiguousarray(t[0].transpose(0, 1).numpy())

    np.save(os.path.join(args.out_dir, "q.npy"), tokens_heads_dim(q))
    np.save(os.path.join(args.out_dir, "q_rope.npy"), tokens_heads_dim(q_rope))
    np.save(os.path.join(args.out_dir, "k.npy"), tokens_heads_dim(k))
    np.save(os.path.join(args.out_dir, "k_rope.npy"), tokens_heads_dim(k_rope))
    np.save(os.path.join(args.out_dir, "position_ids.npy"), position_ids[0].numpy().astype(np.int64))
    with open(os.path.join(args.out_dir, "versions.json"), "w") as f:
        json.dump({"torch": torch.__version__, "numpy": np.__version__, "pairing": args.pairing}, f)


if __name__ == "__main__":
    main()
