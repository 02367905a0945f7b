"""posenc.Model from Python: every file format of the shared fixtures loads; logits from Python equal what the
built CLI computes (`posenc generate --json`: greedy tokens are the argmax of the Python logits, their log-probs the
log-softmax of them); score() and the KvCache handle agree with one full forward."""
import json

import numpy as np
import pytest

import posenc

PROMPT = "Once upon a time, there was a little girl"


def log_softmax(rows):
    rows = rows.astype(np.float64)
    m = rows.max(axis=-1, keepdims=True)
    return rows - m - np.log(np.exp(rows - m).sum(axis=-1, keepdims=True))


def models(shared):
    m = shared / "models"
    return {
        "llama2c": (m / "stories260K" / "stories260K.bin", m / "stories260K" / "tok512.bin"),
        "gguf": (m / "stories260K" / "stories260K.gguf", None),
        "hf_directory": (m / "TinyStories-656K", None),
        "gguf_q8_0": (m / "TinyStories-656K-gguf" / "TinyStories-656K-Q8_0.gguf",
                      m / "TinyStories-656K" / "tokenizer.json"),
    }


@pytest.mark.parametrize("kind", ["llama2c", "gguf", "hf_directory", "gguf_q8_0"])
def test_logits_equal_the_cli(kind, shared, cli, tmp_path):
    path, tok = models(shared)[kind]
    model = posenc.Model.load(str(path), tokenizer=str(tok) if tok else None)
    out = tmp_path / "gen.json"
    args = ["generate", "--model", path, "--prompt", PROMPT, "--max-tokens", 12, "--ignore-eos", "--quiet",
            "--json", out]
    if tok:
        args += ["--tokenizer", tok]
    cli(*args)
    ref = json.loads(out.read_text())
    assert model.format == ref["model_format"] == {"llama2c": "llama2.c", "hf_directory": "Hugging Face directory"}.get(
        kind, "GGUF")
    prompt_ids = model.tokenize(PROMPT)
    np.testing.assert_array_equal(prompt_ids, ref["prompt_ids"])
    gen = np.asarray(ref["generated_ids"])
    assert len(gen) == 12
    seq = np.concatenate([prompt_ids, gen]).astype(np.int64)
    logits = model.logits(seq)
    assert logits.shape == (len(seq), model.vocab_size) and logits.dtype == np.float32
    rows = logits[len(prompt_ids) - 1: len(seq) - 1]
    # Greedy: each CLI token is the argmax (lowest id on ties) of the Python logits at its position.
    np.testing.assert_array_equal(rows.argmax(axis=-1), gen)
    # Its log-prob, from the CLI's incremental decode, is the log-softmax of the Python (one-forward) logits.
    lp = log_softmax(rows)[np.arange(len(gen)), gen]
    np.testing.assert_allclose(lp, ref["generated_logprobs"], atol=2e-4)
    # And Model.generate is the CLI's generate.
    res = model.generate(PROMPT, max_new_tokens=12, stop_at_eos=False)
    np.testing.assert_array_equal(res["generated_ids"], gen)
    np.testing.assert_allclose(res["generated_logprobs"], ref["generated_logprobs"], rtol=0, atol=1e-12)
    assert res["text"] == ref["text"]


def test_score_and_kv_cache(shared):
    path, tok = models(shared)["llama2c"]
    model = posenc.Model.load(str(path), tokenizer=str(tok))
    s = model.score(PROMPT)
    tokens = s["tokens"]
    logits = model.logits(tokens)
    want = log_softmax(logits[:-1])[np.arange(len(tokens) - 1), tokens[1:]]
    np.testing.assert_allclose(s["token_logprobs"], want, atol=1e-9)
    assert s["n_scored"] == len(tokens) - 1
    assert s["nll"] == pytest.approx(-want.mean(), rel=1e-12)
    assert s["ppl"] == pytest.approx(np.exp(-want.mean()), rel=1e-12)
    # Incremental: a prefill of 5 tokens then one token at a time through the cache gives the same rows.
    cache = model.new_cache()
    seq = cache.new_sequence()
    rows = [model.forward(cache, seq, tokens[:5])]
    for t in tokens[5:]:
        rows.append(model.forward(cache, seq, [t]))
    np.testing.assert_allclose(np.concatenate(rows), logits, atol=1e-4)
    assert cache.size(seq) == len(tokens) and cache.next_position(seq) == len(tokens)
    np.testing.assert_array_equal(cache.positions(seq), np.arange(len(tokens)))
    np.testing.assert_array_equal(cache.token_ids(seq), tokens)
    last = model.forward(cache, cache.fork(seq), [tokens[1]], last_only=True)
    assert last.shape == (1, model.vocab_size)
    assert model.decode(tokens).startswith("Once upon a time")
    f = model.rope
    assert f.layout == "interleaved" and f.head_dim == model.config["head_dim"]


def test_kv_cache_in_f16_and_bf16(shared):
    path, tok = models(shared)["llama2c"]
    model = posenc.Model.load(str(path), tokenizer=str(tok))
    tokens = model.score(PROMPT)["tokens"]
    exact = model.logits(tokens)
    f32 = model.new_cache()
    assert f32.kv_dtype == "f32"
    seq = f32.new_sequence()
    model.forward(f32, seq, tokens)
    errors = {}
    for dtype in ("f16", "bf16"):
        cache = model.new_cache(kv_dtype=dtype)
        assert cache.kv_dtype == dtype
        seq = cache.new_sequence()
        # Token by token equals one prefill on the same rounded cache, bit for bit.
        rows = np.concatenate([model.forward(cache, seq, [t]) for t in tokens])
        other = model.new_cache(kv_dtype=dtype)
        np.testing.assert_array_equal(model.forward(other, other.new_sequence(), tokens), rows)
        assert cache.kv_bytes_allocated * 2 == f32.kv_bytes_allocated
        errors[dtype] = np.abs(rows - exact).max()
    assert 0 < errors["f16"] < errors["bf16"] < 1.0
    with pytest.raises(posenc.InvalidArgument, match="q8_0"):
        model.new_cache(kv_dtype="q8_0")


def test_model_errors(shared, tmp_path):
    path, tok = models(shared)["llama2c"]
    with pytest.raises(posenc.TokenizerError, match="no tokenizer"):
        posenc.Model.load(str(path)).tokenize("x")
    model = posenc.Model.load(str(path), tokenizer=str(tok))
    with pytest.raises(ValueError, match=r"^tokens\[1\]: id 512 outside the vocabulary \[0, 512\)"):
        model.logits([1, 512])
    with pytest.raises(TypeError, match=r"^tokens: expected an integer dtype"):
        model.logits(np.array([1.0, 2.0]))
    bad = tmp_path / "bad.bin"
    bad.write_bytes(b"\x01\x02")
    with pytest.raises(posenc.Error):
        posenc.Model.load(str(bad))
    with pytest.raises(posenc.IoError):
        posenc.Model.load(str(tmp_path / "missing.bin"))


def test_dense_matmul_option(shared):
    """dense_matmul="bf16x6"/"bf16x3" (AMX-BF16 products of F16/BF16 weights): an unknown name is a ConfigError
    naming the argument; an F32 model's logits are float32's, bit for bit (the mode leaves F32 weights alone, and
    loads them even on a CPU without AMX-BF16)."""
    path, tok = models(shared)["llama2c"]
    with pytest.raises(posenc.ConfigError, match=r"^dense_matmul: must be float32, bf16x3 or bf16x6 \(got 'x'\)"):
        posenc.Model.load(str(path), tokenizer=str(tok), dense_matmul="x")
    split = posenc.Model.load(str(path), tokenizer=str(tok), dense_matmul="bf16x6")
    plain = posenc.Model.load(str(path), tokenizer=str(tok))
    assert (split.dense_matmul, plain.dense_matmul, plain.quantized_matmul) == ("bf16x6", "float32", "dequantize")
    ids = plain.tokenize(PROMPT)
    assert np.array_equal(split.logits(ids), plain.logits(ids))
    assert split.generate(PROMPT, max_new_tokens=2)["dense_matmul"] == "bf16x6"
