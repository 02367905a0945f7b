"""posenc.verify from Python: numpy arrays rotated by a Hugging Face-style rotate_half (written here in numpy, in
float32 as LlamaRotaryEmbedding, on posenc's inv_freq) pass against the Llama-3.1 config; interleaved pairing fails and is named a layout
error; bad arrays are posenc.DumpError."""
import numpy as np
import pytest

import posenc


def _llama31_rope(config, q, positions, interleaved=False):
    """q: [tokens, heads, 128] float32 rotated as HF's LlamaRotaryEmbedding + apply_rotary_pos_emb in numpy float32.
    inv_freq is posenc's (numpy's float32 power differs from torch's in the last ulp, which at position 8190 moves
    the float32 angle by an ulp of 8190 = 1e-3; the PyTorch-written dump is tests/verify/verify_torch_test.cpp)."""
    inv = np.asarray(posenc.rope_frequencies(str(config)).inv_freq, dtype=np.float32)
    freqs = (positions.astype(np.float32)[:, None] * inv[None, :]).astype(np.float32)
    emb = np.repeat(freqs, 2, axis=-1) if interleaved else np.concatenate([freqs, freqs], axis=-1)
    # float64 cos/sin rounded to float32: the correctly rounded values (numpy's float32 SIMD cos is not)
    cos = np.cos(emb.astype(np.float64)).astype(np.float32)[:, None, :]
    sin = np.sin(emb.astype(np.float64)).astype(np.float32)[:, None, :]
    if interleaved:
        rot = np.stack([-q[..., 1::2], q[..., 0::2]], axis=-1).reshape(q.shape)
    else:
        rot = np.concatenate([-q[..., 64:], q[..., :64]], axis=-1)
    return (q * cos + rot * sin).astype(np.float32)


@pytest.fixture
def llama31(shared):
    return shared / "configs" / "llama-3.1-8b.json"


def _arrays(config, interleaved=False):
    rng = np.random.default_rng(0)
    positions = np.concatenate([np.arange(8), np.arange(8186, 8194)]).astype(np.int64)
    q = rng.standard_normal((16, 2, 128)).astype(np.float32)
    return {"q": q, "q_rope": _llama31_rope(config, q, positions, interleaved), "position_ids": positions}


def test_hf_style_rotation_passes(llama31):
    r = posenc.verify(llama31, arrays=_arrays(llama31))
    assert r["pass"], r["summary"]
    assert r["errors"][0]["array"] == "q_rope"
    # numpy's float32 cos/sin differ from posenc's correctly rounded ones by at most an ulp or two.
    assert r["errors"][0]["max"] <= r["errors"][0]["tolerance"]
    assert "PASS" in r["report"]


def test_interleaved_pairing_is_named_a_layout_error(llama31):
    r = posenc.verify(str(llama31), arrays=_arrays(llama31, interleaved=True))
    assert not r["pass"]
    top = r["hypotheses"][0]
    assert top["id"] == "layout_swapped" and top["matches"], r["report"]
    assert top["report"].startswith("https://github.com/")
    assert "your output matches" in r["summary"]


def test_config_dict_and_catalogue():
    bare = {"rope_type": "default", "head_dim": 128, "rope_theta": 10000.0}
    rng = np.random.default_rng(1)
    q = rng.standard_normal((4, 1, 128)).astype(np.float32)
    r = posenc.verify(bare, arrays={"q": q, "q_rope": q, "position_ids": np.zeros(4, dtype=np.int64)})
    assert r["pass"], r["summary"]  # position 0 is the identity
    ids = [m["id"] for m in posenc.rope_mistakes()]
    assert len(ids) >= 14 and "layout_swapped" in ids


def test_bad_arrays_are_dump_errors(llama31):
    a = _arrays(llama31)
    del a["q_rope"]
    with pytest.raises(posenc.DumpError, match="q_rope: missing"):
        posenc.verify(llama31, arrays=a)
    a = _arrays(llama31)
    a["q"], a["q_rope"] = a["q"][:, :, :64], a["q_rope"][:, :, :64]
    with pytest.raises(posenc.DumpError, match="head_dim"):
        posenc.verify(llama31, arrays=a)
    with pytest.raises(TypeError, match="arrays\\['q'\\]"):
        posenc.verify(llama31, arrays={"q": [1, 2], "q_rope": np.zeros(2), "position_ids": np.zeros(1)})
    with pytest.raises(ValueError, match="nothing to verify"):
        posenc.verify(llama31)
