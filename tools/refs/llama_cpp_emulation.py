#!/usr/bin/python3
"""llama_cpp_emulation.py — a float32 numpy re-statement of the arithmetic llama.cpp's CPU backend uses
for a prefill (one ubatch of >= 2 tokens) of a Llama GGUF with F32 or Q8_0 weight matrices (the
AVX-512/AMX build node-llama-cpp loads on this machine: libggml-cpu-sapphirerapids.so, F32 KV cache,
flash attention off), written to check that tests/model/data/llama_cpp/README.md describes that
arithmetic completely: on the reference windows it reproduces llama.cpp's logits bit for bit
(TinyStories-656K-Q8_0.gguf, its F32 dequantization and stories260K.gguf).

    /usr/bin/python3 tools/refs/llama_cpp_emulation.py --gguf TinyStories-656K-Q8_0.gguf \
        --tokens tests/model/data/llama_cpp/TinyStories-656K-Q8_0/summary.json \
        --compare tests/model/data/llama_cpp/TinyStories-656K-Q8_0 [--out logits.f32] [--fp-variant ...]

Needs numpy (Debian python3-numpy) and gguf-py (the reader in llama.cpp's source tree,
--gguf-py DIR, default /work/refs/llama.cpp-src/gguf-py); nothing of llama.cpp runs.
The README ("What llama.cpp computes, operation by operation") gives each step with its source reference.
fma(a, b, c) is emulated as round_f32(a*b + c) in float64 (exact product; the sum can round
twice in rare cases). --fp-variant names alternatives that are NOT what llama.cpp does (they
make rows differ; kept to show which details matter).
"""
import argparse
import ctypes
import ctypes.util
import json
import sys

import numpy as np

F, D = np.float32, np.float64


_libm = ctypes.CDLL(ctypes.util.find_library("m"))
for _name in ("cosf", "sinf", "expf"):
    getattr(_libm, _name).restype = ctypes.c_float
    getattr(_libm, _name).argtypes = [ctypes.c_float]


def libm(name, x):
    """The system libm's float function (what the prebuilt library calls: cosf/sinf via sincosf, expf),
    element by element; numpy's own float32 functions round differently."""
    f = getattr(_libm, name)
    x = np.asarray(x, F)
    return np.fromiter((f(float(v)) for v in x.ravel()), F, x.size).reshape(x.shape)


def fma(a, b, c):
    with np.errstate(invalid="ignore"):  # -inf + inf of masked scores; those lanes are replaced later
        return (np.asarray(a, F).astype(D) * np.asarray(b, F).astype(D) + np.asarray(c, F).astype(D)).astype(F)


def quantize_q8_0(x):
    """ggml x86 quantize_row_q8_0: per 32 values amax, d = amax/127 stored as fp16,
    q = round-half-even(x * (127/amax)) (the multiplier from amax, not from the fp16 d)."""
    m, k = x.shape
    xb = x.reshape(m, k // 32, 32).astype(F)
    amax = np.abs(xb).max(-1)
    d16 = (amax / F(127)).astype(F).astype(np.float16).astype(F)
    with np.errstate(divide="ignore"):
        inv = np.where(amax != 0, F(127) / amax, F(0)).astype(F)
    q = np.rint((xb * inv[:, :, None]).astype(F)).astype(np.int64)
    return q, d16


def matmul_q8_0(w, x):
    """y[m, n] for Q8_0 weights w = (q [N, KB, 32] int, d [N, KB] fp16 as f32) and f32 x [M, K]:
    per 32-block an exact int32 dot, then acc = fma(float(isum), d_w * d_x, acc) block by block,
    in float32, from acc = 0 (ggml-cpu/amx/mmq.cpp: acc_C<block_q8_0, block_q8_0> and
    tinygemm_kernel_vnni<block_q8_0, block_q8_0>)."""
    qw, dw = w
    qx, dx = quantize_q8_0(x)
    isum = np.einsum("mbk,nbk->mnb", qx, qw)
    dprod = (dx[:, None, :] * dw[None, :, :]).astype(F)
    acc = np.zeros(isum.shape[:2], F)
    for i in range(isum.shape[2]):
        acc = fma(isum[:, :, i].astype(F), dprod[:, :, i], acc)
    return acc


def tinyblas_f32(w, x):
    """llamafile tinyBLAS<16, __m512> (sgemm.cpp) for F32 x F32, used for n >= 2 rows when k % 16 == 0
    and m % 4 == 0: each output has 16 float lanes, lane j FMA-accumulates l = j (mod 16) in order of l,
    then _mm512_reduce_add_ps. w [M, K] (weight rows), x [N, K] -> [N, M]."""
    m, k = w.shape
    n = x.shape[0]
    wl, xl = w.reshape(m, k // 16, 16), x.reshape(n, k // 16, 16)
    acc = np.zeros((n, m, 16), F)
    for c in range(k // 16):
        acc = fma(np.broadcast_to(xl[:, None, c, :], acc.shape), np.broadcast_to(wl[None, :, c, :], acc.shape), acc)
    return reduce_add_16(acc)


def vec_dot_f32(w, x):
    """ggml_vec_dot_f32 (vec.cpp, AVX-512) as the prebuilt library (GCC 11.4) executes it: 4 accumulators
    of 16 lanes over 64-element chunks (FMA), reduced (0+2, 1+3, then 0+1, then reduce_add_ps) to a
    float; then the k mod 64 tail `sumf += x[i]*y[i]`, which GCC vectorized: blocks of 16, then one of 8,
    have their products rounded (vmulps) and added to sumf one by one in order; the last k mod 8
    elements are contracted to scalar FMAs (vfmadd231ss). w [M, K], x [N, K] -> [N, M]."""
    m, k = w.shape
    n = x.shape[0]
    np_ = k & ~63
    acc = np.zeros((4, n, m, 16), F)
    for i in range(0, np_, 64):
        for j in range(4):
            sl = slice(i + 16 * j, i + 16 * j + 16)
            acc[j] = fma(np.broadcast_to(x[:, None, sl], acc.shape[1:]), np.broadcast_to(w[None, :, sl], acc.shape[1:]), acc[j])
    a0 = ((acc[0] + acc[2]).astype(F) + (acc[1] + acc[3]).astype(F)).astype(F)
    out = reduce_add_16(a0)
    fma_from = k - (k - np_) % 8
    for i in range(np_, k):
        if i < fma_from:
            out = (out + (x[:, None, i] * w[None, :, i]).astype(F)).astype(F)
        else:
            out = fma(np.broadcast_to(x[:, None, i], out.shape), np.broadcast_to(w[None, :, i], out.shape), out)
    return out


def matmul(w, x):
    """ggml_mul_mat(w, x) of a prefill (x has >= 2 rows): Q8_0 weights through the AMX kernels,
    F32 weights through tinyBLAS when k % 16 == 0 and m % 4 == 0, else ggml_vec_dot_f32."""
    if w[0] == "q8_0":
        return matmul_q8_0(w[1:], x)
    wf = w[1]
    if x.shape[0] >= 2 and wf.shape[1] % 16 == 0 and wf.shape[0] % 4 == 0:
        return tinyblas_f32(wf, x.astype(F))
    return vec_dot_f32(wf, x.astype(F))


def v_expf(x):
    """ggml_v_expf (ggml-cpu/vec.h, AVX-512 version)."""
    x = np.asarray(x, F)
    h = lambda s: np.full_like(x, F(float.fromhex(s)))
    r = h("0x1.8p23")
    z = fma(x, h("0x1.715476p+0"), r)
    n = (z - r).astype(F)
    b = fma(-n, h("0x1.7f7d1cp-20"), fma(-n, h("0x1.62e4p-1"), x))
    u = (b * b).astype(F)
    j = fma(fma(fma(h("0x1.0e4020p-7"), b, h("0x1.573e2ep-5")), u, fma(h("0x1.555e66p-3"), b, h("0x1.fffdb6p-2"))),
            u, fma(h("0x1.ffffecp-1"), b, np.ones_like(x)))
    with np.errstate(invalid="ignore", over="ignore"):
        res = np.ldexp(j, np.where(np.isfinite(n), n, 0).astype(np.int32)).astype(F)
    return np.where(np.abs(n) > 192, np.where(n <= 0, F(0), F(np.inf)), res).astype(F)


def reduce_add_16(v):
    """_mm512_reduce_add_ps as GCC expands it, over the last axis (16 lanes)."""
    t = (v[..., 8:] + v[..., :8]).astype(F)
    t = (t[..., 4:] + t[..., :4]).astype(F)
    t = (t + t[..., [2, 3, 0, 1]]).astype(F)
    return (t[..., 0] + t[..., 1]).astype(F)


def rms_norm_mul(x, w, eps):
    """ggml_compute_forward_rms_norm_f32 (+ the fused MUL): sum of float32 squares in double,
    mean rounded to float, scale = 1/sqrtf(mean + eps), y = (x * scale) * w in float32."""
    ssum = (x * x).astype(F).astype(D).sum(-1, keepdims=True)
    mean = (ssum / x.shape[-1]).astype(F)
    scale = (F(1) / np.sqrt((mean + eps).astype(F))).astype(F)
    return ((x * scale).astype(F) * w).astype(F)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--tokens", required=True, help="JSON ids, or an object with window_ids/ids, or a summary.json")
    ap.add_argument("--out", help="write logits [n, vocab] float32 little-endian")
    ap.add_argument("--compare", help="a llama_cpp_refs.mjs output directory of the same window")
    ap.add_argument("--gguf-py", default="/work/refs/llama.cpp-src/gguf-py")
    ap.add_argument("--fp-variant", default="",
                    help="comma list of deviations (not llama.cpp's): rope-no-fma, kq-fma, trig-rounded")
    a = ap.parse_args()
    variants = set(v for v in a.fp_variant.split(",") if v)
    sys.path.insert(0, a.gguf_py)
    from gguf import GGUFReader  # noqa: E402

    rd = GGUFReader(a.gguf)
    meta = {k: f.contents() for k, f in rd.fields.items() if not k.startswith("tokenizer.")}
    tensors = {t.name: t for t in rd.tensors}
    arch = meta["general.architecture"]
    if arch != "llama":
        sys.exit(f"{a.gguf}: general.architecture {arch!r}, only llama is emulated")
    n_embd = meta["llama.embedding_length"]
    n_head = meta["llama.attention.head_count"]
    n_head_kv = meta["llama.attention.head_count_kv"]
    n_layer = meta["llama.block_count"]
    hd = n_embd // n_head
    n_rot = meta.get("llama.rope.dimension_count", hd)
    base = meta.get("llama.rope.freq_base", 10000.0)
    eps = F(meta["llama.attention.layer_norm_rms_epsilon"])
    if n_rot != hd:
        sys.exit("partial rotary dimension is not emulated")

    def weight(name):
        """("q8_0", q [N, KB, 32] int, d [N, KB] float) or ("f32", w [N, K])."""
        t = tensors[name]
        if t.tensor_type.name == "F32":
            return ("f32", np.asarray(t.data, F).reshape(int(t.shape[1]), int(t.shape[0])))
        if t.tensor_type.name != "Q8_0":
            sys.exit(f"{name}: {t.tensor_type.name}, only F32 and Q8_0 matrices are emulated")
        raw = t.data
        b = raw.reshape(raw.shape[0], raw.shape[1] // 34, 34)
        return ("q8_0", b[:, :, 2:].copy().view(np.int8).astype(np.int64), b[:, :, :2].copy().view("<f2")[:, :, 0].astype(F))

    def vec(name):
        return np.asarray(tensors[name].data, F)

    j = json.load(open(a.tokens))
    ids = j if isinstance(j, list) else (j.get("window_ids") or j.get("ids") or j.get("window", {}).get("ids"))
    L = len(ids)

    emb = weight("token_embd.weight")
    out_w = weight("output.weight") if "output.weight" in tensors else emb  # tied: the same matrix
    if emb[0] == "q8_0":  # get_rows on Q8_0 = dequantize_row_q8_0: q * fp16_to_fp32(d), one float multiply
        x = (emb[1][ids].astype(F) * emb[2][ids][:, :, None]).reshape(L, n_embd).astype(F)
    else:
        x = emb[1][ids].astype(F)

    # RoPE (ggml_rope_cache_init / rope_yarn, mode NORM = adjacent pairs): theta_scale = powf(base, -2/n_rot),
    # theta = p, then theta *= theta_scale per pair, in float; cos/sin = cosf/sinf(theta).
    ts = F(np.power(D(base), D(-2.0 / n_rot)))
    theta = np.zeros((L, hd // 2), F)
    th = np.arange(L).astype(F)
    for i in range(hd // 2):
        theta[:, i] = th
        th = (th * ts).astype(F)
    if "trig-rounded" in variants:  # correctly rounded cos/sin instead of glibc's
        cs, sn = np.cos(theta.astype(D)).astype(F), np.sin(theta.astype(D)).astype(F)
    else:
        cs, sn = libm("cosf", theta), libm("sinf", theta)

    def rope(v):
        x0, x1 = v[..., 0::2], v[..., 1::2]
        c, s = cs[:, None, :], sn[:, None, :]
        o = np.empty_like(v)
        if "rope-no-fma" in variants:
            o[..., 0::2] = ((x0 * c).astype(F) - (x1 * s).astype(F)).astype(F)
            o[..., 1::2] = ((x0 * s).astype(F) + (x1 * c).astype(F)).astype(F)
        else:  # rotate_pairs: x0*cos - x1*sin and x0*sin + x1*cos, contracted to one FMA each
            o[..., 0::2] = fma(x0, c, -(x1 * s).astype(F))
            o[..., 1::2] = fma(x0, s, (x1 * c).astype(F))
        return o

    rep = n_head // n_head_kv
    causal = np.tril(np.ones((L, L), bool))[None]
    pad = (-L) % 16
    kq_scale = F(1.0) / F(np.sqrt(F(hd)))
    for il in range(n_layer):
        p = f"blk.{il}."
        h = rms_norm_mul(x, vec(p + "attn_norm.weight"), eps)
        q = rope(matmul(weight(p + "attn_q.weight"), h).reshape(L, n_head, hd))
        k = rope(matmul(weight(p + "attn_k.weight"), h).reshape(L, n_head_kv, hd))
        v = matmul(weight(p + "attn_v.weight"), h).reshape(L, n_head_kv, hd)
        kr, vr = np.repeat(k, rep, 1), np.repeat(v, rep, 1)  # query head h reads KV head h / rep
        # kq = ggml_vec_dot_f32 per (head, query, key): q is a permuted, non-contiguous view, so llamafile
        # sgemm is skipped; head_dim < 64 leaves only vec_dot_f32's tail (see vec_dot_f32)
        if "kq-fma" in variants:
            kq = np.zeros((n_head, L, L), F)
            for i in range(hd):
                kq = fma(q[:, :, i].T[:, :, None] * np.ones((1, 1, L), F), kr[:, :, i].T[:, None, :] * np.ones((1, L, 1), F), kq)
        else:
            kq = np.stack([vec_dot_f32(kr[:, hh, :], q[:, hh, :]) for hh in range(n_head)])
        # soft_max_ext: w = kq * scale + mask, max, e = ggml_v_expf(w - max) per 16 lanes,
        # sum = double sum of per-16 reduce_add_ps, e * (float)(1/sum)
        wv = np.where(causal, (kq * kq_scale).astype(F), F(-np.inf))
        e = v_expf((wv - wv.max(-1, keepdims=True)).astype(F))
        ep = np.concatenate([e, np.zeros(e.shape[:-1] + (pad,), F)], -1)
        ssum = reduce_add_16(ep.reshape(e.shape[:-1] + (-1, 16))).astype(D).sum(-1, keepdims=True)
        sm = (e * (1.0 / ssum).astype(F)).astype(F)
        # kqv = llamafile tinyBLAS (AVX-512): lane j accumulates keys s = j (mod 16) by FMA in order,
        # then reduce_add_ps (masked keys add exact zeros, so n_kv padding does not matter)
        sp = np.concatenate([sm, np.zeros(sm.shape[:-1] + (pad,), F)], -1).reshape(n_head, L, -1, 16)
        vt = np.concatenate([vr.transpose(1, 2, 0), np.zeros((n_head, hd, pad), F)], -1).reshape(n_head, hd, -1, 16)
        acc = np.zeros((n_head, L, hd, 16), F)
        for c in range(sp.shape[2]):
            acc = fma(np.broadcast_to(sp[:, :, c, None, :], acc.shape), np.broadcast_to(vt[:, None, :, c, :], acc.shape), acc)
        o = reduce_add_16(acc).transpose(1, 0, 2).reshape(L, n_embd)
        x = (x + matmul(weight(p + "attn_output.weight"), o)).astype(F)
        h = rms_norm_mul(x, vec(p + "ffn_norm.weight"), eps)
        g = matmul(weight(p + "ffn_gate.weight"), h)
        u = matmul(weight(p + "ffn_up.weight"), h)
        # swiglu (ggml_vec_swiglu_f32): 16-lane chunks ggml_v_silu(g) * u = (g / (1 + ggml_v_expf(-g))) * u;
        # the n mod 16 tail ggml_silu_f32(g) * u = (g / (1.0f + expf(-g))) * u with libm's expf
        n16 = g.shape[1] & ~15
        sil = np.empty_like(g)
        sil[:, :n16] = (g[:, :n16] / (F(1) + v_expf(-g[:, :n16])).astype(F)).astype(F)
        sil[:, n16:] = (g[:, n16:] / (F(1) + libm("expf", -g[:, n16:])).astype(F)).astype(F)
        act = (sil * u).astype(F)
        x = (x + matmul(weight(p + "ffn_down.weight"), act)).astype(F)
    logits = matmul(out_w, rms_norm_mul(x, vec("output_norm.weight"), eps))

    if a.out:
        logits.astype("<f4").tofile(a.out)
    m = logits.astype(D).max(-1, keepdims=True)
    lse = (m + np.log(np.exp(logits.astype(D) - m).sum(-1, keepdims=True)))[:, 0]
    nll = lse[:-1] - logits[np.arange(L - 1), ids[1:]].astype(D)
    print(f"emulated mean NLL {nll.mean():.10f} over {L - 1} predictions")
    if a.compare:
        s = json.load(open(f"{a.compare}/summary.json"))
        if s["window"]["ids"] != list(ids):
            sys.exit("--compare: a different window")
        rows = np.fromfile(f"{a.compare}/{s['logits']['file']}", "<f4").reshape(s["logits"]["shape"])
        mine = logits[s["logits"]["positions"]]
        d = np.abs(mine - rows).max(-1)
        print(f"vs llama.cpp ({a.compare}): {int((d == 0).sum())} of {len(d)} saved rows bitwise equal, "
              f"max |dlogit| {d.max():.3g}, mean {np.abs(mine - rows).mean():.3g}; "
              f"mean NLL {s['window']['nll_mean']:.10f} (llama.cpp)")


if __name__ == "__main__":
    main()
