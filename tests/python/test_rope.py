"""posenc.apply_rope against direct numpy and PyTorch implementations, in both layouts and with partial rotary;
zero-copy paths; M-RoPE; and the argument checks (dtype, shape, strides) with errors naming the argument."""
import threading

import numpy as np
import pytest

import posenc

try:
    import torch
except ImportError:  # Debian python3-torch is optional
    torch = None

RNG = np.random.default_rng(17)


def numpy_rope(x, cos, sin, layout):
    """The rotation written directly in numpy from per-pair cos/sin ([tokens, n_pairs] float32): forward
    (x0*c - x1*s, x1*c + x0*s) on the pairs of the first 2*n_pairs channels, the rest passed through."""
    n = cos.shape[1]
    out = x.copy()
    c, s = cos[:, None, :], sin[:, None, :]
    if layout == "half":
        x0, x1 = x[..., :n], x[..., n:2 * n]
        out[..., :n] = x0 * c - x1 * s
        out[..., n:2 * n] = x1 * c + x0 * s
    else:
        x0, x1 = x[..., 0:2 * n:2], x[..., 1:2 * n:2]
        out[..., 0:2 * n:2] = x0 * c - x1 * s
        out[..., 1:2 * n:2] = x1 * c + x0 * s
    return out


def numpy_cos_sin(inv_freq, pos, attention_factor=1.0):
    ang = pos.astype(np.float32)[:, None] * inv_freq[None, :]
    return (np.cos(ang) * np.float32(attention_factor)).astype(np.float32), \
        (np.sin(ang) * np.float32(attention_factor)).astype(np.float32)


CASES = [  # (head_dim, rotary_dim, layout)
    (64, 64, "half"), (64, 64, "interleaved"), (128, 64, "half"), (128, 32, "interleaved"), (80, 40, "half"),
]


@pytest.mark.parametrize("head_dim,rotary_dim,layout", CASES)
def test_apply_rope_matches_numpy(head_dim, rotary_dim, layout):
    tokens, heads = 37, 3
    f = posenc.RopeFrequencies.default(head_dim, rotary_dim=rotary_dim, rope_theta=500000.0)
    x = RNG.standard_normal((tokens, heads, head_dim)).astype(np.float32)
    pos = RNG.integers(0, 8192, tokens)
    got = posenc.apply_rope(x, pos, f, layout=layout)
    assert got.dtype == np.float32 and got.shape == x.shape
    # With posenc's own table, numpy's float32 arithmetic is the same (no FMA): bit for bit.
    cos, sin = posenc.rope_cos_sin(f, pos)
    np.testing.assert_array_equal(got, numpy_rope(x, cos, sin, layout))
    # With numpy's own cos/sin (a few ulp away at angles of thousands of radians).
    ncos, nsin = numpy_cos_sin(f.inv_freq, pos)
    np.testing.assert_allclose(got, numpy_rope(x, ncos, nsin, layout), atol=2e-5)
    # Partial rotary: channels past rotary_dim untouched; the inverse undoes the rotation.
    np.testing.assert_array_equal(got[..., rotary_dim:], x[..., rotary_dim:])
    back = posenc.apply_rope(got, pos, f, layout=layout, direction="inverse")
    np.testing.assert_allclose(back, x, atol=1e-5)
    # inv_freq itself: 1 / theta^(2i/d) in float32.
    want = 1.0 / 500000.0 ** (np.arange(0, rotary_dim, 2) / rotary_dim)
    np.testing.assert_allclose(f.inv_freq, want, rtol=2e-6)


@pytest.mark.skipif(torch is None, reason="PyTorch (Debian python3-torch) not installed")
@pytest.mark.parametrize("head_dim,rotary_dim,layout", CASES)
def test_apply_rope_matches_pytorch(head_dim, rotary_dim, layout):
    """Hugging Face's formulation in torch: rotate_half (Llama/GPT-NeoX partial) and rotate_every_two (GPT-J)."""
    tokens, heads = 29, 2
    f = posenc.RopeFrequencies.default(head_dim, rotary_dim=rotary_dim, rope_theta=10000.0)
    x = RNG.standard_normal((tokens, heads, head_dim)).astype(np.float32)
    pos = np.arange(5, 5 + tokens)
    inv = torch.from_numpy(np.array(f.inv_freq))
    freqs = torch.from_numpy(pos).float()[:, None] * inv[None, :]  # [tokens, n_pairs], float32
    t = torch.from_numpy(x)
    rot, rest = t[..., :rotary_dim], t[..., rotary_dim:]
    if layout == "half":
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
        x1, x2 = rot[..., : rotary_dim // 2], rot[..., rotary_dim // 2:]
        rotated = rot * emb.cos() + torch.cat((-x2, x1), dim=-1) * emb.sin()
    else:
        emb = torch.repeat_interleave(freqs, 2, dim=-1)[:, None, :]
        x1, x2 = rot[..., ::2], rot[..., 1::2]
        every_two = torch.stack((-x2, x1), dim=-1).flatten(-2)
        rotated = rot * emb.cos() + every_two * emb.sin()
    want = torch.cat((rotated, rest), dim=-1).numpy()
    got = posenc.apply_rope(x, pos, f, layout=layout)
    np.testing.assert_allclose(got, want, atol=2e-6)


def test_apply_rope_from_config_uses_its_layout_and_attention_factor(shared):
    f = posenc.rope_frequencies(shared / "configs" / "phi-3-mini-128k-instruct.json", seq_len=131072)
    assert f.layout == "half" and f.rope_type == "longrope" and f.attention_factor > 1.0
    x = RNG.standard_normal((8, 4, f.head_dim)).astype(np.float32)
    pos = np.arange(8) * 1000
    cos, sin = posenc.rope_cos_sin(f, pos)
    np.testing.assert_array_equal(posenc.apply_rope(x, pos, f), numpy_rope(x, cos, sin, "half"))
    ncos, nsin = numpy_cos_sin(f.inv_freq, pos, f.attention_factor)
    np.testing.assert_allclose(cos, ncos, atol=2e-6)


def test_zero_copy_paths():
    f = posenc.RopeFrequencies.default(64, layout="half")
    x = RNG.standard_normal((16, 4, 64)).astype(np.float32)
    pos = np.arange(16)
    want = posenc.apply_rope(x, pos, f)
    # In place: the result is x's memory.
    y = x.copy()
    r = posenc.apply_rope(y, pos, f, out=y)
    assert np.shares_memory(r, y)
    np.testing.assert_array_equal(y, want)
    # Into a given output array.
    o = np.empty_like(x)
    r = posenc.apply_rope(x, pos, f, out=o)
    assert np.shares_memory(r, o)
    np.testing.assert_array_equal(o, want)
    # A strided token axis (q of a fused [tokens, q+k+v heads, head_dim] buffer) is read without a copy.
    qkv = RNG.standard_normal((16, 12, 64)).astype(np.float32)
    q = qkv[:, :4]
    np.testing.assert_array_equal(posenc.apply_rope(q, pos, f), posenc.apply_rope(np.ascontiguousarray(q), pos, f))
    before = qkv.copy()
    posenc.apply_rope(q, pos, f, out=q)
    np.testing.assert_array_equal(qkv[:, :4], posenc.apply_rope(before[:, :4].copy(), pos, f))
    np.testing.assert_array_equal(qkv[:, 4:], before[:, 4:])
    # inv_freq is a read-only view.
    with pytest.raises(ValueError):
        f.inv_freq[0] = 1.0


def test_mrope():
    f = posenc.RopeFrequencies.default(64, rope_theta=1e6)
    section = [8, 12, 12]
    x = RNG.standard_normal((10, 2, 64)).astype(np.float32)
    p = np.arange(10)
    same = np.stack([p, p, p])
    # Three equal rows (text tokens): plain RoPE.
    np.testing.assert_array_equal(posenc.apply_mrope(x, same, f, mrope_section=section),
                                  posenc.apply_rope(x, p, f, layout="half"))
    # Distinct rows, chunked mapping: pair i takes row 0 for i < 8, 1 for i < 20, 2 after.
    thw = np.stack([p, p * 2 + 1, p * 3 + 2])
    rows = np.repeat([0, 1, 2], section)
    pos_per_pair = thw[rows].T  # [tokens, n_pairs]
    ang = pos_per_pair.astype(np.float32) * f.inv_freq[None, :]
    cos, sin = posenc.mrope_cos_sin(f, thw, mrope_section=section)
    np.testing.assert_allclose(cos, np.cos(ang), atol=2e-6)
    np.testing.assert_array_equal(posenc.apply_mrope(x, thw, f, mrope_section=section),
                                  numpy_rope(x, cos, sin, "half"))
    with pytest.raises(posenc.ConfigError, match="mrope_section"):
        posenc.apply_mrope(x, thw, f, mrope_section=[8, 8, 8])


def test_mrope_config(shared):
    f = posenc.rope_frequencies(shared / "configs" / "qwen2.5-vl-7b-instruct.json")
    assert f.mrope_section == [16, 24, 24] and f.mrope_mapping == "chunked" and f.layout == "half"


def test_argument_errors_name_the_argument():
    f = posenc.RopeFrequencies.default(64, layout="half")
    x = np.zeros((4, 2, 64), dtype=np.float32)
    pos = np.arange(4)
    with pytest.raises(TypeError, match=r"^x: expected dtype float32, got float64"):
        posenc.apply_rope(x.astype(np.float64), pos, f)
    with pytest.raises(TypeError, match=r"^x: expected a numpy.ndarray"):
        posenc.apply_rope(x.tolist(), pos, f)
    with pytest.raises(ValueError, match=r"^x: expected a \[tokens, heads, head_dim\] array \(3 axes\), got shape \(4, 128\)"):
        posenc.apply_rope(x.reshape(4, 128), pos, f)
    with pytest.raises(ValueError, match=r"^x: head_dim \(shape\[2\]\) is 32, freqs.head_dim is 64"):
        posenc.apply_rope(x[..., :32].copy(), pos, f)
    with pytest.raises(ValueError, match=r"^x: the heads and head_dim axes must be contiguous"):
        posenc.apply_rope(np.zeros((4, 64, 2), dtype=np.float32).transpose(0, 2, 1), pos, f)
    with pytest.raises(ValueError, match=r"^x: the heads and head_dim axes must be contiguous"):
        posenc.apply_rope(np.zeros((4, 2, 128), dtype=np.float32)[..., ::2], pos, f)
    with pytest.raises(ValueError, match=r"^x: the heads and head_dim axes must be contiguous"):
        posenc.apply_rope(np.zeros((8, 2, 64), dtype=np.float32)[::-2], pos, f)
    with pytest.raises(TypeError, match=r"^position_ids: expected an integer dtype \(int64\), got float64"):
        posenc.apply_rope(x, pos.astype(np.float64), f)
    with pytest.raises(ValueError, match=r"^position_ids: expected shape \(4,\)"):
        posenc.apply_rope(x, np.arange(3), f)
    with pytest.raises(ValueError, match=r"^out: shape \(4, 2, 32\) differs"):
        posenc.apply_rope(x, pos, f, out=np.zeros((4, 2, 32), dtype=np.float32))
    with pytest.raises(TypeError, match=r"^out: expected dtype float32"):
        posenc.apply_rope(x, pos, f, out=np.zeros((4, 2, 64)))
    with pytest.raises(ValueError, match=r"^out: expected a C-contiguous array"):
        posenc.apply_rope(x, pos, f, out=np.zeros((4, 2, 128), dtype=np.float32)[..., ::2])
    ro = x.copy()
    ro.setflags(write=False)
    with pytest.raises(ValueError, match=r"^out: the array is read-only"):
        posenc.apply_rope(ro, pos, f, out=ro)
    with pytest.raises(posenc.ConfigError, match=r"^layout: must be"):
        posenc.apply_rope(x, pos, f, layout="neox")
    with pytest.raises(posenc.ConfigError, match=r"^precision"):
        posenc.apply_rope(x, pos, f, precision="float16")
    with pytest.raises(posenc.ConfigError, match=r"^layout: required"):
        posenc.apply_rope(x, pos, posenc.RopeFrequencies.default(64))
    with pytest.raises(ValueError, match=r"^cos: expected a C-contiguous array"):
        posenc.apply_rope_cos_sin(x, np.zeros((4, 64), dtype=np.float32)[:, ::2], np.zeros((4, 32), np.float32),
                                  layout="half")
    with pytest.raises(posenc.InvalidArgument):
        posenc.RopeFrequencies(np.ones(16, dtype=np.float32), head_dim=16, rotary_dim=33)
    assert issubclass(posenc.InvalidArgument, posenc.Error) and issubclass(posenc.Error, RuntimeError)
    for name in ("ConfigError", "CheckpointError", "TokenizerError", "PositionError", "IoError", "CacheError",
                 "DataError", "DumpError", "NumericError"):
        assert issubclass(getattr(posenc, name), posenc.Error), name


def test_library_errors_are_typed():
    with pytest.raises(posenc.ConfigError, match="rope_type"):
        posenc.rope_frequencies(posenc.RopeParams(rope_type="warp", head_dim=64))
    with pytest.raises(posenc.ConfigError, match="RopeParams: unknown parameter rope_thetaa"):
        posenc.RopeParams(rope_thetaa=1.0)
    with pytest.raises(posenc.ConfigError, match="num_attention_heads"):
        posenc.rope_frequencies({"model_type": "llama", "hidden_size": 64})
    with pytest.raises(posenc.IoError):
        posenc.rope_frequencies("/nonexistent/config.json")
    sched = posenc.RopeSchedule(posenc.RopeParams(rope_type="dynamic", factor=2.0, head_dim=64,
                                                  max_position_embeddings=128))
    with pytest.raises(posenc.PositionError):
        sched.update(np.array([-1]))
    with pytest.raises(posenc.InvalidArgument):
        posenc.alibi_slopes(0)
    with pytest.raises(posenc.Error):
        posenc.sinusoidal_table(4, 0)


def test_kernels_release_the_gil():
    """While a thread is inside one apply_rope call on a large array, the main thread keeps running Python code:
    it records loop iterations strictly inside the call's time span. Were the GIL held for the call, the main
    thread could not run at all in that span (whatever the machine's load: it only needs some CPU)."""
    import sys
    import time
    f = posenc.RopeFrequencies.default(128, layout="interleaved")
    x = RNG.standard_normal((8192, 16, 128)).astype(np.float32)
    pos = np.arange(8192)
    out = np.empty_like(x)
    want = posenc.apply_rope(x, pos, f, out=out).copy()  # warm: pages of out touched
    span = []
    started = threading.Event()

    def work():
        started.set()
        time.sleep(0.01)
        t0 = time.perf_counter()
        posenc.apply_rope(x, pos, f, out=out)
        span.extend([t0, time.perf_counter()])

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-4)  # the eval loop hands over the GIL within 0.1 ms of a request
    try:
        t = threading.Thread(target=work)
        stamps = []
        t.start()
        started.wait()
        while t.is_alive():
            stamps.append(time.perf_counter())
        t.join()
    finally:
        sys.setswitchinterval(old)
    t0, t1 = span
    margin = 2e-3  # the call's entry and exit, where the worker holds the GIL
    inside = sum(1 for s in stamps if t0 + margin < s < t1 - margin)
    assert t1 - t0 > 3 * margin, f"the call took {t1 - t0:.4f} s: too short to tell"
    assert inside > 100, f"{inside} main-thread iterations during the {1e3 * (t1 - t0):.1f} ms call"
    np.testing.assert_array_equal(out, want)
