"""posenc.eval.load_run on damaged run directories (issue 17 review): every damaged file is a posenc.DataError
naming it, where json/csv/attribute errors used to escape."""
import os
import shutil

import numpy as np
import pytest

import posenc

F64 = posenc.RopeFrequencies.default(64, layout="half")
RNG = np.random.default_rng(23)


def x_of(tokens, heads=2, head_dim=64):
    return RNG.standard_normal((tokens, heads, head_dim)).astype(np.float32)


# --- eval.load_run on damaged run directories -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def run_dir(shared, cli, tmp_path_factory):
    out = tmp_path_factory.mktemp("evalbad") / "runs"
    m = shared / "models" / "stories260K"
    cli("eval", "--model", m / "stories260K.bin", "--tokenizer", m / "tok512.bin", "--haystack",
        shared / "data" / "tinystories_val.txt", "--tasks", "name_recall", "--context", "128", "--depths", "0.5",
        "--samples", 4, "--ppl-tokens", 1024, "--quiet", "--out", out)
    return posenc.eval.load_run(out).path


def _damage(src, dst, name, fn):
    shutil.copytree(src, dst)
    p = os.path.join(dst, name)
    with open(p, "rb") as f:
        data = f.read()
    with open(p, "wb") as f:
        f.write(fn(data))
    return dst


@pytest.mark.parametrize("name,fn", [
    ("run.json", lambda b: b[:40]), ("run.json", lambda b: b""), ("summary.json", lambda b: b[:10]),
    ("summary.csv", lambda b: b[:len(b) // 2]), ("summary.csv", lambda b: b.replace(b",ok\n", b",ok,extra\n", 1)),
    ("summary.csv", lambda b: b"task,length\nname_recall,128\n"), ("summary.csv", lambda b: b"\xff\xfe\x00\n"),
    ("samples.jsonl", lambda b: b[:len(b) // 2]), ("samples.jsonl", lambda b: b"\xff\xfe\n"),
    ("ppl.json", lambda b: b[:100]), ("ppl.json", lambda b: b"[]"), ("ppl.json", lambda b: b'{"results": 5}'),
    ("ppl.json", lambda b: b'{"results": [{"buckets": [1, 2]}]}'),
])
def test_load_run_damaged_file_is_a_data_error_naming_it(run_dir, tmp_path, name, fn):
    # These used to escape as json.JSONDecodeError, TypeError, KeyError, AttributeError or UnicodeDecodeError.
    d = _damage(run_dir, tmp_path / "run", name, fn)
    with pytest.raises(posenc.DataError, match=name.replace(".", r"\.")):
        posenc.eval.load_run(d)



def _shared(rel):
    return os.path.join(os.environ.get("POSENC_SHARED_DIR", os.path.join(os.path.dirname(__file__), "..", "..", "..",
                                                                          "shared")), rel)
