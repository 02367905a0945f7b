"""posenc: positional encodings of Transformer attention (RoPE and its scalings, M-RoPE, ALiBi, T5 buckets,
sinusoidal tables), a Llama-architecture model runtime and the eval lab's results, from Python.

Arrays are numpy: inputs are checked (dtype, shape, strides) with errors naming the argument, outputs are new
float32/int arrays (or the caller's `out=`). Numerics are those of posenc's C++ core (bit-exact with Hugging Face
transformers for the RoPE family, see the docstrings). Errors of the core are raised as posenc.Error subclasses:
ConfigError, CheckpointError, TokenizerError, PositionError, InvalidArgument, IoError, CacheError, DataError,
DumpError, NumericError.
"""

import json as _json
import os as _os

from . import _posenc
from ._posenc import (  # noqa: F401  (the public API)
    CacheError,
    CheckpointError,
    ConfigError,
    DataError,
    DumpError,
    Error,
    InvalidArgument,
    IoError,
    KvCache,
    Model,
    NumericError,
    PositionError,
    RopeFrequencies,
    RopeParams,
    RopeSchedule,
    TokenizerError,
    alibi_bias,
    alibi_slopes,
    apply_mrope,
    apply_rope,
    apply_rope_cos_sin,
    bloom_alibi_tensor,
    mpt_alibi_tensor,
    mrope_cos_sin,
    parse_context_length,
    periods,
    position_ids_from_input_ids,
    rope_cos_sin,
    rope_types,
    rope_wavelengths,
    sinusoidal_encoding,
    sinusoidal_table,
    t5_relative_buckets,
    t5_relative_position_bias,
    t5_relative_position_bucket,
)
from . import eval  # noqa: F401,E402  (posenc.eval.load_run)

__version__ = _posenc.__version__

__all__ = [
    "__version__", "Error", "ConfigError", "CheckpointError", "TokenizerError", "PositionError", "InvalidArgument",
    "IoError", "CacheError", "DataError", "NumericError", "RopeParams", "RopeFrequencies", "RopeSchedule", "rope_frequencies",
    "rope_params", "rope_cos_sin", "apply_rope", "apply_rope_cos_sin", "mrope_cos_sin", "apply_mrope",
    "alibi_slopes", "alibi_bias", "bloom_alibi_tensor", "mpt_alibi_tensor", "t5_relative_buckets",
    "t5_relative_position_bucket", "t5_relative_position_bias", "sinusoidal_table", "sinusoidal_encoding",
    "position_ids_from_input_ids", "inspect", "periods", "rope_wavelengths", "rope_types", "parse_context_length",
    "Model", "KvCache", "DumpError", "verify", "rope_mistakes",
]
# (posenc.eval is not in __all__: `from posenc import *` would shadow the builtin eval.)


def _seq_len(seq_len):
    """seq_len as an int: None, a length string ("128K") or an integer (not a bool, not a float to truncate)."""
    if seq_len is None:
        return None
    if isinstance(seq_len, str):
        return parse_context_length(seq_len)
    if isinstance(seq_len, bool) or not hasattr(seq_len, "__index__"):
        raise TypeError(f"seq_len: expected an int or a length such as \"128K\", got {type(seq_len).__name__} "
                        f"({seq_len!r})")
    n = seq_len.__index__()
    if not -2**63 <= n < 2**63:
        raise ValueError(f"seq_len: {n} does not fit int64")
    return n


def _path(path, name):
    """A path argument (str or os.PathLike) as str; TypeError naming the argument otherwise, ValueError for a NUL
    byte (the C++ side would open the path up to it: another file than the one named)."""
    try:
        p = _os.fspath(path)
    except TypeError:
        raise TypeError(f"{name}: expected a path (str or os.PathLike), got {type(path).__name__}") from None
    if isinstance(p, bytes):
        p = _os.fsdecode(p)
    if "\0" in p:
        raise ValueError(f"{name}: embedded NUL byte in {p!r}")
    return p


def _non_finite(obj, where=""):
    """The first NaN/inf float in a config dict, as (dotted field, value), else None."""
    if isinstance(obj, float) and (obj != obj or obj in (float("inf"), float("-inf"))):
        return where, obj
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, (list, tuple)) else ()
    for k, v in items:
        sub = f"{where}[{k}]" if isinstance(k, int) else (f"{where}.{k}" if where else str(k))
        found = _non_finite(v, sub)
        if found:
            return found
    return None


def _config_text(config):
    """A config dict as JSON text; a NaN/inf value (which JSON cannot hold) is a ConfigError naming its field."""
    found = _non_finite(config)
    if found:
        raise ConfigError(f"<dict>: {found[0]}: must be finite (got {found[1]})")
    return _json.dumps(config)


def rope_frequencies(config_or_dict, seq_len=None, lenient=False):
    """RoPE frequencies of a model config, as Hugging Face's ROPE_INIT_FUNCTIONS[rope_type](config, seq_len) computes
    them (float32, operation by operation; checked against transformers' own outputs).

    config_or_dict: a config.json path (str or os.PathLike), a config.json as a dict, or a posenc.RopeParams.
    seq_len: the current sequence length (int or "128K"), for the length-dependent scalings (dynamic, longrope);
    None = not passed (HF's init without seq_len).
    lenient: ignore unknown keys inside rope_scaling / rope_parameters.

    Returns a posenc.RopeFrequencies: inv_freq ([rotary_dim/2] float32, radians per position), attention_factor
    (multiplies cos and sin), rotary_dim, head_dim, rope_type, layout ("half" / "interleaved" /
    "interleaved_in_half_out", from the architecture) and, for M-RoPE configs, mrope_section / mrope_mapping.
    Raises posenc.ConfigError naming the field and value (posenc.IoError for an unreadable file).
    """
    n = _seq_len(seq_len)
    if isinstance(config_or_dict, RopeParams):
        return _posenc._rope_frequencies_params(config_or_dict, n)
    if isinstance(config_or_dict, dict):
        return _posenc._rope_frequencies_config_text(_config_text(config_or_dict), "<dict>", n, bool(lenient))
    if isinstance(config_or_dict, (str, _os.PathLike)):
        return _posenc._rope_frequencies_config_path(_path(config_or_dict, "config_or_dict"), n, bool(lenient))
    raise TypeError("config_or_dict: expected a config.json path, a dict or a posenc.RopeParams, got "
                    + type(config_or_dict).__name__)


def rope_params(config_path, lenient=False):
    """The typed RoPE parameters (posenc.RopeParams) a config.json file implies (for posenc.RopeSchedule).

    Raises TypeError (config_path not a path), ValueError (a NUL byte), posenc.IoError (unreadable file),
    posenc.ConfigError (malformed config, a family without RoPE)."""
    return _posenc._rope_params_config_path(_path(config_path, "config_path"), bool(lenient))


def inspect(config_path, seq_len=None, lenient=False):
    """What a config.json says about positions: the same dict as `posenc inspect --config F --json -`.

    config_path: a config.json path, or a config as a dict. seq_len: the target length (int or "128K"; default
    max_position_embeddings) the per-channel table and length-dependent scalings are computed for.
    Keys: family, rope_type, rope_theta, head_dim, rotary_dim, layout, attention_factor, inv_freq, channels
    ([{i, inv_freq, wavelength, rotations_original, rotations_target, wavelength_ratio}]), original_length, seq_len,
    rope_parameters, ... (RoPE), alibi_convention / slopes (ALiBi), relative_attention_* (T5), model_type,
    num_attention_heads, max_position_embeddings, sliding_window, ignored_keys, notes.
    Raises TypeError (config_path neither a path nor a dict, seq_len not an int/str), ValueError (a NUL byte),
    posenc.IoError (unreadable file), posenc.ConfigError naming the field and value (a NaN/inf in a dict included).
    """
    if isinstance(config_path, dict):
        text = _posenc._inspect_json(None, _config_text(config_path), "<dict>", seq_len, bool(lenient))
    else:
        text = _posenc._inspect_json(_path(config_path, "config_path"), None, "", seq_len, bool(lenient))
    return _json.loads(text)


def verify(config, dump=None, arrays=None, dump_layout="tokens,heads,head_dim", rope_layout=None,
           tolerance_factor=1.0):
    """Checks an engine's RoPE tensors against posenc's reference for `config` (posenc verify; posenc/verify.hpp).

    config: a config.json path, a bare rope_scaling object's path, or a dict of either.
    dump: a path or a list of paths (.npy named by its stem, .npz, safetensors), or
    arrays: {name: numpy array} (float64/float32/float16, int64/int32 for position_ids) with the names
    q, q_rope, position_ids (k, k_rope, cos, sin, inv_freq optional).
    dump_layout: "tokens,heads,head_dim" or "batch,heads,tokens,head_dim" (q/k axis order);
    rope_layout: "half"/"interleaved" to override the config's.
    Returns a dict: pass, summary, errors (max/mean by channel and by position), hypotheses (ranked, each with
    id, title, variant, report URL, residual, score, matches), untestable, notes, report (the text report).
    Errors: posenc.DumpError (missing array, bad shape, head_dim not the config's, bad positions),
    posenc.ConfigError (config), posenc.IoError, TypeError/ValueError for bad arguments.
    """
    if isinstance(config, dict):
        config_path, config_text = None, _config_text(config)
    else:
        config_path, config_text = _path(config, "config"), None
    if dump is not None:
        dump = [_path(dump, "dump")] if isinstance(dump, (str, bytes)) or hasattr(dump, "__fspath__") else \
            [_path(d, "dump") for d in dump]
    return _json.loads(_posenc._verify_json(config_path, config_text, dump, arrays, dump_layout, rope_layout,
                                            float(tolerance_factor)))


def rope_mistakes():
    """The catalogue of known RoPE mistakes posenc.verify tests: [{id, title, report}] (report: the public bug
    report's URL, or "no public report found ..."). Errors: none (a fixed table)."""
    return _posenc._rope_mistakes()
