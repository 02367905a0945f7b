"""Argument conversion errors and paths, found by trying to break the package (issue 17 review): each case was an
untyped RuntimeError, a silently truncated value or another file than the one named before its fix."""
import json
import os

import numpy as np
import pytest

import posenc

F64 = posenc.RopeFrequencies.default(64, layout="half")
RNG = np.random.default_rng(23)


def x_of(tokens, heads=2, head_dim=64):
    return RNG.standard_normal((tokens, heads, head_dim)).astype(np.float32)


# --- untyped conversion errors ----------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs,name", [
    (dict(rope_theta="abc"), "rope_theta"), (dict(rope_theta=None), "rope_theta"),
    (dict(rope_theta=[1e4, "x"]), "rope_theta"), (dict(rope_scaling=5, factor=2.0), "rope_scaling"),
    (dict(context=2**70), "context"),
])
def test_periods_bad_types_raise_typed_errors_naming_the_argument(kwargs, name):
    # These used to raise RuntimeError("Unable to cast Python instance to C++ type ...").
    with pytest.raises((TypeError, ValueError), match=name):
        posenc.periods(**kwargs)


def test_inspect_seq_len_out_of_range_is_typed():
    with pytest.raises((TypeError, ValueError), match="seq_len"):
        posenc.inspect(_shared("configs/llama-3.1-8b.json"), seq_len=2**70)


def test_rope_frequencies_seq_len_must_be_an_integer():
    cfg = _shared("configs/llama-3.1-8b.json")
    # A float used to be truncated silently (4096.7 -> 4096), True read as 1, 2**70 a TypeError dumping the config.
    for bad in (4096.7, True, 2**70):
        with pytest.raises((TypeError, ValueError), match="seq_len"):
            posenc.rope_frequencies(cfg, seq_len=bad)
    assert posenc.rope_frequencies(cfg, seq_len=np.int64(4096)).rope_type == "llama3"


def test_config_dict_with_nan_names_the_field():
    # json.dumps writes NaN, which the C++ JSON parser reports as "malformed JSON at byte 598".
    cfg = json.load(open(_shared("configs/llama-3.1-8b.json")))
    cfg["rope_scaling"]["factor"] = float("nan")
    with pytest.raises(posenc.ConfigError, match=r"rope_scaling\.factor.*nan"):
        posenc.rope_frequencies(cfg)
    cfg["rope_scaling"]["factor"] = 8.0
    cfg["rope_theta"] = float("inf")
    with pytest.raises(posenc.ConfigError, match=r"rope_theta.*inf"):
        posenc.inspect(cfg)


# --- paths --------------------------------------------------------------------------------------------------------

def test_paths_with_a_nul_byte_are_refused():
    # The C++ side used to stop at the NUL and open another file than the one named.
    good = _shared("configs/llama-3.1-8b.json")
    with pytest.raises(ValueError, match="config"):
        posenc.rope_frequencies(good + "\0junk")
    with pytest.raises(ValueError, match="config_path"):
        posenc.inspect(good + "\0junk")
    with pytest.raises(ValueError, match="path"):
        posenc.Model.load(_shared("models/stories260K/stories260K.bin") + "\0junk")


def test_model_load_takes_a_pathlike_and_non_paths_name_the_argument():
    import pathlib
    m = posenc.Model.load(pathlib.Path(_shared("models/stories260K/stories260K.bin")),
                          tokenizer=pathlib.Path(_shared("models/stories260K/tok512.bin")))
    assert m.format == "llama2.c" and len(m.tokenize("Once")) >= 2
    with pytest.raises(TypeError, match="path"):
        posenc.Model.load(None)
    with pytest.raises(TypeError, match="config_path"):
        posenc.rope_params({"rope_theta": 1})


def test_a_gguf_whose_bundled_tokenizer_is_unusable_still_loads_for_logits():
    # Model.load used to refuse the model for its tokenizer: logits(token ids) need none.
    path = _shared("models/TinyStories-656K-gguf/TinyStories-656K-Q8_0.gguf")
    m = posenc.Model.load(path)
    assert m.logits([1, 2, 3]).shape == (3, m.vocab_size)
    assert m.tokenizer_source == ""
    with pytest.raises(posenc.TokenizerError) as e:  # the reason, when a tokenizer is needed
        m.tokenize("Once")
    msg = str(e.value)
    assert msg.startswith("the tokenizer this model brings cannot be used: "), msg
    assert "scores of the SentencePiece vocabulary are equal" in msg, msg
    assert msg.count("TinyStories-656K-Q8_0.gguf") == 1, msg  # the file named once
    assert msg.endswith("use the model's Hugging Face tokenizer.json instead (tokenizer=<Hugging Face model "
                        "dir>/tokenizer.json in posenc.Model.load)"), msg
    assert "--tokenizer" not in msg, msg  # the CLI's flag means nothing here



def _shared(rel):
    return os.path.join(os.environ.get("POSENC_SHARED_DIR", os.path.join(os.path.dirname(__file__), "..", "..", "..",
                                                                          "shared")), rel)


@pytest.mark.parametrize("bad", [None, {"rope_theta": 10000.0}, "llama-3.1-8b.json"])
def test_freqs_that_are_not_rope_frequencies_name_the_argument(bad):
    # pybind11's "incompatible function arguments" printed the whole x array and named no argument.
    x = np.zeros((2, 1, 64), np.float32)
    for call in (lambda: posenc.apply_rope(x, [0, 1], bad), lambda: posenc.rope_cos_sin(bad, [0, 1]),
                 lambda: posenc.apply_mrope(x, np.zeros((3, 2), np.int64), bad),
                 lambda: posenc.mrope_cos_sin(bad, np.zeros((3, 2), np.int64)), lambda: posenc.rope_wavelengths(bad)):
        with pytest.raises(TypeError, match=r"^freqs: expected a posenc\.RopeFrequencies") as e:
            call()
        assert len(str(e.value)) < 300


def test_every_public_docstring_lists_its_errors():
    # help(posenc.X) for a newcomer: what it raises, not only shapes and dtypes.
    names = [n for n in posenc.__all__ if n not in ("__version__", "eval", "rope_types", "parse_context_length")
             and not (isinstance(getattr(posenc, n), type) and issubclass(getattr(posenc, n), BaseException))]
    def lists_errors(doc):
        return doc is not None and ("Error" in doc or "InvalidArgument" in doc)

    lacking = [n for n in names if not lists_errors(getattr(posenc, n).__doc__)]
    for cls, meth in [(posenc.Model, m) for m in ("load", "tokenize", "decode", "logits", "score", "generate",
                                                  "forward")]:
        if not lists_errors(getattr(cls, meth).__doc__):
            lacking.append(f"Model.{meth}")
    assert lacking == []
    assert "Errors:" in posenc.apply_rope.__doc__ and "[tokens, heads, head_dim] float32" in posenc.apply_rope.__doc__


@pytest.mark.parametrize("kwargs,name", [(dict(max_new_tokens=2**31), "max_new_tokens"),
                                         (dict(max_new_tokens=2**40), "max_new_tokens"),
                                         (dict(max_new_tokens=3.5), "max_new_tokens"),
                                         (dict(seed=-1), "seed"), (dict(seed=2**64), "seed")])
def test_generate_integer_arguments_out_of_range_name_the_argument(kwargs, name):
    # pybind11's overload error ("incompatible function arguments") named neither the argument nor the range.
    m = posenc.Model.load(_shared("models/stories260K/stories260K.bin"),
                          tokenizer=_shared("models/stories260K/tok512.bin"))
    with pytest.raises((TypeError, ValueError), match=f"^{name}: "):
        m.generate("Once", **kwargs)


def test_model_load_refuses_a_tokenizer_that_does_not_fit_the_model_as_the_cli_does():
    # Found by a newcomer: Model.load accepted TinyStories-656K's 2048-token tokenizer.json for the 512-token
    # stories260K, then tokenize() returned ids past the vocabulary. The CLI's --tokenizer rule now applies.
    with pytest.raises(posenc.TokenizerError, match=r"vocab_size 2048 does not fit the model's vocab_size 512"):
        posenc.Model.load(_shared("models/stories260K/stories260K.bin"),
                          tokenizer=_shared("models/TinyStories-656K/tokenizer.json"))
    # A llama2.c vocabulary is the model's whole vocabulary: 512 ids for a 2048-id model is refused too.
    with pytest.raises(posenc.TokenizerError, match=r"vocab_size 512 does not match the model's vocab_size 2048"):
        posenc.Model.load(_shared("models/TinyStories-656K"), tokenizer=_shared("models/stories260K/tok512.bin"))
