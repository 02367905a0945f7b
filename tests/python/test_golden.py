"""Every Hugging Face golden-vector file of ../shared/testdata/hf_reference, checked again through the Python
package (the C++ suite checks them in tests/encoding/golden_*_test.cpp; the tolerances are the README's)."""
import numpy as np
import pytest

import posenc
from conftest import golden

ROPE_KEYS = {"rope_type", "type", "rope_theta", "factor", "partial_rotary_factor", "original_max_position_embeddings",
             "attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate", "short_factor",
             "long_factor", "low_freq_factor", "high_freq_factor"}


def params_from(d, **extra):
    unknown = set(d) - ROPE_KEYS
    assert not unknown, f"unhandled rope keys {unknown}"  # no parameter silently dropped
    return posenc.RopeParams(**d, **extra)


def assert_close(name, what, got, want, atol=0.0, rtol=0.0):
    want = np.asarray(want, dtype=np.float64)
    got = np.asarray(got, dtype=np.float64)
    assert got.shape == want.shape, f"{name} {what}: shape {got.shape}, expected {want.shape}"
    np.testing.assert_allclose(got, want, rtol=rtol, atol=atol, err_msg=f"case {name}, {what}")


def test_rope_init_every_case():
    doc = golden("rope_init.json")
    assert doc["cases"]
    bit_exact = values = 0
    for c in doc["cases"]:
        name, inp, out = c["name"], c["inputs"], c["outputs"]
        d = dict(inp["rope_parameters_standardized"])
        # Llama's default init ignores partial_rotary_factor (the config importer resolves this quirk).
        if "LlamaRotaryEmbedding.compute_default_rope_parameters" in c["function"]:
            d.pop("partial_rotary_factor", None)
        p = params_from(d, head_dim=inp["head_dim"], max_position_embeddings=inp["max_position_embeddings"])
        f = posenc.rope_frequencies(p, seq_len=inp["seq_len"])
        assert_close(name, "inv_freq", f.inv_freq, out["inv_freq"], rtol=1e-6)
        assert f.inv_freq.dtype == np.float32
        assert f.rotary_dim == out["rotary_dim"], name
        assert f.head_dim == inp["head_dim"], name
        assert f.attention_factor == pytest.approx(out["attention_factor"], rel=1e-12), name
        want32 = np.asarray(out["inv_freq"], dtype=np.float32)
        bit_exact += int((want32 == f.inv_freq).sum())
        values += want32.size
    # The float32 emulation reproduces transformers to the bit for nearly every value (the C++ suite prints the
    # same count); a regression to double arithmetic would drop this far below.
    assert bit_exact >= 0.98 * values, f"inv_freq bit-exact {bit_exact}/{values}"


def test_rope_forward_every_case():
    doc = golden("rope_forward.json")
    assert doc["cases"]
    for c in doc["cases"]:
        name, inp, out = c["name"], c["inputs"], c["outputs"]
        p = params_from(inp.get("rope_scaling", {}), rope_theta=inp["rope_theta"], head_dim=inp["head_dim"],
                        max_position_embeddings=inp["max_position_embeddings"])
        schedule = posenc.RopeSchedule(p)
        for earlier in inp.get("earlier_forward_position_ids", []):
            schedule.update(np.asarray(earlier, dtype=np.int64))
        pos = np.asarray(inp["position_ids"], dtype=np.int64)  # [batch, seq]
        f = schedule.update(pos)
        assert_close(name, "inv_freq_used", f.inv_freq, out["inv_freq_used"], rtol=1e-6)
        if name.startswith("dynamic"):  # float32 base' of the forward path: only bit-exactness tells
            np.testing.assert_array_equal(f.inv_freq, np.asarray(out["inv_freq_used"], dtype=np.float32), name)
        assert f.attention_factor == pytest.approx(out["attention_scaling"], rel=1e-12), name
        cos, sin = posenc.rope_cos_sin(f, pos.reshape(-1), precision="float32")
        b, s = pos.shape
        for got, key in ((cos, "cos"), (sin, "sin")):
            hf = np.concatenate([got, got], axis=-1).reshape(b, s, -1)  # HF: cat(freqs, freqs)
            assert_close(name, key, hf, out[key], atol=2e-6)


def to_shd(t, b):
    """Batch row b of a golden [batch, heads, seq, head_dim] tensor as posenc's [seq, heads, head_dim]."""
    return np.ascontiguousarray(np.asarray(t, dtype=np.float32)[b].transpose(1, 0, 2))


def test_rope_apply_every_case():
    doc = golden("rope_apply.json")
    assert doc["cases"]
    layouts = set()
    for c in doc["cases"]:
        name, layout, variant, inp, out = c["name"], c["layout"], c["variant"], c["inputs"], c["outputs"]
        head_dim, theta = inp["head_dim"], inp["rope_theta"]
        q = np.asarray(inp["q"], dtype=np.float32)
        n_b, n_h, n_s, n_d = q.shape
        assert n_d == head_dim
        if variant == "mrope":
            section = inp["mrope_section"]
            f = posenc.RopeFrequencies.default(head_dim, rope_theta=theta)
            assert_close(name, "inv_freq", f.inv_freq, inp["inv_freq"], rtol=1e-6)
            thw = np.asarray(inp["position_ids_thw"], dtype=np.int64)  # [3, batch, seq]
            for r in range(3):
                for b in range(n_b):
                    cos, sin = posenc.rope_cos_sin(f, thw[r, b])
                    assert_close(name, f"cos row {r}", np.concatenate([cos, cos], -1), inp["cos"][r][b], atol=2e-6)
                    assert_close(name, f"sin row {r}", np.concatenate([sin, sin], -1), inp["sin"][r][b], atol=2e-6)

            def rotate(x, b):
                return posenc.apply_mrope(x, thw[:, b, :], f, mrope_section=section)
        elif name.startswith("gptj"):
            f = posenc.RopeFrequencies.default(head_dim, rotary_dim=inp["rotary_dim"], rope_theta=theta)
            pos = np.asarray(inp["position_ids"], dtype=np.int64)
            for b in range(n_b):
                cos, sin = posenc.rope_cos_sin(f, pos[b])
                assert_close(name, "cos_pairs", cos, inp["cos_pairs"][b], atol=2e-6)
                assert_close(name, "sin_pairs", sin, inp["sin_pairs"][b], atol=2e-6)

            def rotate(x, b):
                return posenc.apply_rope(x, pos[b], f, layout="interleaved")
        elif name.startswith("roformer"):
            # RoFormer: the Marian-style [sin | cos] float64 table, pairs interleaved.
            pos = np.asarray(inp["position_ids"], dtype=np.int64)
            half = head_dim // 2

            def table(b):
                enc = posenc.sinusoidal_encoding(pos[b], head_dim, layout="halves")
                return enc, np.ascontiguousarray(enc[:, half:]), np.ascontiguousarray(enc[:, :half])

            assert_close(name, "sinusoidal_pos", table(0)[0], np.asarray(inp["sinusoidal_pos"])[0, 0], atol=2e-6)

            def rotate(x, b):
                _, cos, sin = table(b)
                return posenc.apply_rope_cos_sin(x, cos, sin, layout="interleaved")
        else:
            rotary_dim = inp.get("rotary_dim", head_dim)
            f = posenc.RopeFrequencies.default(head_dim, rotary_dim=rotary_dim, rope_theta=theta)
            assert_close(name, "inv_freq", f.inv_freq, inp["inv_freq"], rtol=1e-6)
            pos = np.asarray(inp["position_ids"], dtype=np.int64)
            for b in range(n_b):
                cos, sin = posenc.rope_cos_sin(f, pos[b])
                assert_close(name, "cos", np.concatenate([cos, cos], -1), inp["cos"][b], atol=2e-6)
                assert_close(name, "sin", np.concatenate([sin, sin], -1), inp["sin"][b], atol=2e-6)
            assert layout in ("half", "interleaved_in_half_out"), name
            noncontig = "noncontig" in name

            def rotate(x, b, layout=layout, noncontig=noncontig):
                if not noncontig:
                    return posenc.apply_rope(x, pos[b], f, layout=layout)
                # A view of a fused qkv buffer ([seq, 3*heads, head_dim], q first): strided token axis, in place.
                buf = np.full((x.shape[0], 3 * x.shape[1], x.shape[2]), -7.0, dtype=np.float32)
                buf[:, : x.shape[1]] = x
                view = buf[:, : x.shape[1]]
                assert not view.flags.c_contiguous
                res = posenc.apply_rope(view, pos[b], f, layout=layout, out=view)
                assert np.shares_memory(res, buf)
                assert (buf[:, x.shape[1]:] == -7.0).all(), f"{name}: wrote outside the rows"
                return np.array(view)
        layouts.add(layout)
        for which in ("q", "k"):
            src = inp[which]
            got = np.stack([rotate(to_shd(src, b), b).transpose(1, 0, 2) for b in range(n_b)])
            assert_close(name, f"{which}_embed", got, out[f"{which}_embed"], atol=2e-6)
    assert {"half", "interleaved", "interleaved_in_half_out"} <= layouts


def test_alibi_every_case():
    doc = golden("alibi.json")
    assert doc["cases"]
    for c in doc["cases"]:
        name, inp, out = c["name"], c["inputs"], c["outputs"]
        heads = inp["num_heads"]
        want = np.asarray(out["alibi"], dtype=np.float64)
        assert list(want.shape) == out["shape"], name
        falcon = name.startswith("falcon")
        if name.startswith("mpt"):
            got = posenc.mpt_alibi_tensor(heads, inp["sequence_length"], inp["alibi_bias_max"])
            slopes = posenc.alibi_slopes(heads, inp["alibi_bias_max"], convention="mpt")
        else:
            assert falcon or name.startswith("bloom"), name
            mask = np.asarray(inp["attention_mask"], dtype=np.int64)
            got = posenc.bloom_alibi_tensor(mask, heads, style="falcon" if falcon else "bloom")
            slopes = posenc.alibi_slopes(heads, convention="falcon" if falcon else "bloom")
            if not falcon:  # llama.cpp's rule in double agrees with BLOOM's float32 pow to 1 ulp
                assert_close(name, "llama.cpp slopes vs BLOOM", posenc.alibi_slopes(heads, 8.0), slopes, rtol=1e-6)
        assert got.dtype == np.float32 and slopes.dtype == np.float32
        if falcon:
            np.testing.assert_array_equal(got, want.astype(np.float32), name)
        else:
            assert_close(name, "alibi", got, want, rtol=1.2e-7)
        if "slopes" in out:
            if falcon:
                np.testing.assert_array_equal(slopes, np.asarray(out["slopes"], dtype=np.float32), name)
            else:
                assert_close(name, "slopes", slopes, out["slopes"], rtol=1.2e-7)


def test_t5_relative_bucket_every_case():
    doc = golden("t5_relative_bucket.json")
    assert doc["cases"]
    for c in doc["cases"]:
        name, inp, out = c["name"], c["inputs"], c["outputs"]
        rel = np.asarray(inp["relative_position"], dtype=np.int64)
        got = posenc.t5_relative_position_bucket(rel, inp["bidirectional"], inp["num_buckets"], inp["max_distance"])
        np.testing.assert_array_equal(got, np.asarray(out["bucket"]), name)
        if "query_length" in inp:  # compute_bias's matrix: the block form with past_seen_tokens
            m = posenc.t5_relative_buckets(inp["query_length"], inp["key_length"], inp["past_seen_tokens"],
                                           inp["bidirectional"], inp["num_buckets"], inp["max_distance"])
            assert m.dtype == np.int32
            np.testing.assert_array_equal(m, np.asarray(out["bucket"]), name)


def test_sinusoidal_every_case():
    doc = golden("sinusoidal.json")
    assert doc["cases"]
    for c in doc["cases"]:
        name, conv, inp, out = c["name"], c["convention"], c["inputs"], c["outputs"]
        if conv == "position_ids":
            ids = np.asarray(inp["input_ids"], dtype=np.int64)
            got = posenc.position_ids_from_input_ids(ids, inp["padding_idx"], inp["past_key_values_length"])
            np.testing.assert_array_equal(got, np.asarray(out["position_ids"]), name)
            continue
        if conv in ("interleaved", "concat_halves_xlm_freqs"):
            got = posenc.sinusoidal_table(inp["num_positions"], inp["dim"],
                                          layout="interleaved" if conv == "interleaved" else "halves")
        elif conv == "concat_halves_t2t_freqs":
            got = posenc.sinusoidal_table(inp["num_embeddings"], inp["dim"], layout="tensor2tensor",
                                          padding_idx=inp["padding_idx"])
        elif conv == "rope_table_sin_then_cos":  # GPT-J create_sinusoidal_positions: [sin | cos], float32 angles
            f = posenc.RopeFrequencies.default(inp["dim"])
            cos, sin = posenc.rope_cos_sin(f, np.arange(inp["num_positions"]))
            got = np.concatenate([sin, cos], axis=-1)
        else:
            pytest.fail(f"case {name}: unknown convention {conv}")
        assert got.dtype == np.float32
        assert_close(name, "table", got, out["table"], atol=2e-6)
