"""Bad input to the RoPE functions, found by trying to break the package (issue 17 review): each case was a
silent wrong result or a misleading error before its fix."""
import os

import numpy as np
import pytest

import posenc

F64 = posenc.RopeFrequencies.default(64, layout="half")
RNG = np.random.default_rng(23)


def x_of(tokens, heads=2, head_dim=64):
    return RNG.standard_normal((tokens, heads, head_dim)).astype(np.float32)


# --- position ids -----------------------------------------------------------------------------------------------

def test_uint64_positions_past_int64_are_refused_not_wrapped():
    # 2**63 as uint64 used to become -2**63 (numpy's unsafe cast) and rotate by that angle without a word.
    x = x_of(3)
    with pytest.raises(ValueError, match=r"position_ids.*9223372036854775808"):
        posenc.apply_rope(x, np.array([0, 1, 2**63], dtype=np.uint64), F64)
    with pytest.raises(ValueError, match=r"position_ids.*18446744073709551615"):
        posenc.rope_cos_sin(F64, np.array([2**64 - 1], dtype=np.uint64))
    # uint64 values that fit are the same positions as int64.
    np.testing.assert_array_equal(posenc.apply_rope(x, np.array([0, 5, 9], np.uint64), F64),
                                  posenc.apply_rope(x, np.array([0, 5, 9]), F64))


def test_uint64_token_ids_name_the_real_value():
    m = posenc.Model.load(_shared("models/stories260K/stories260K.bin"))
    with pytest.raises(ValueError, match=r"tokens.*18446744073709551615"):
        m.logits(np.array([1, 2**64 - 1], np.uint64))


# --- empty arrays -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("shape", [(0, 2, 64), (4, 0, 64)])
def test_apply_rope_on_an_empty_array_returns_an_empty_array(shape):
    # numpy gives zero-size arrays strides (0, 0, 0): they used to be refused as "not contiguous".
    x = np.zeros(shape, np.float32)
    pos = np.arange(shape[0])
    got = posenc.apply_rope(x, pos, F64)
    assert got.shape == shape and got.dtype == np.float32
    out = np.zeros(shape, np.float32)
    assert posenc.apply_rope(x, pos, F64, out=out) is not None
    assert posenc.apply_rope(x, pos, F64, out=x).shape == shape
    q = posenc.rope_frequencies(_shared("configs/qwen2.5-vl-7b-instruct.json"))
    assert posenc.apply_mrope(np.zeros((0, 2, 128), np.float32), np.zeros((3, 0), np.int64), q).shape == (0, 2, 128)


# --- out= overlapping x -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("layout", ["half", "interleaved", "interleaved_in_half_out"])
@pytest.mark.parametrize("shift", [1, -1, 3])
def test_out_overlapping_x_gives_the_same_result_as_a_separate_out(layout, shift):
    # out = the same buffer shifted by a token: interleaved_in_half_out used to read rows it had already overwritten.
    buf = x_of(24)
    lo, hi = (0, shift) if shift > 0 else (-shift, 0)
    x, out = buf[lo:lo + 20], buf[hi:hi + 20]
    pos = np.arange(100, 120)
    want = posenc.apply_rope(x.copy(), pos, F64, layout=layout)
    got = posenc.apply_rope(x, pos, F64, layout=layout, out=out)
    np.testing.assert_array_equal(got, want)



def _shared(rel):
    return os.path.join(os.environ.get("POSENC_SHARED_DIR", os.path.join(os.path.dirname(__file__), "..", "..", "..",
                                                                          "shared")), rel)
