"""The package itself: its version is the CMake project version, posenc.inspect returns the dict of
`posenc inspect --json`, periods() the rows of `posenc periods --json`, and rope_frequencies of a config equals
the frequencies the CLI reports."""
import json
import re

import numpy as np
import pytest

import posenc
from conftest import SOURCE_DIR


def test_version_is_the_cmake_project_version(cli):
    m = re.search(r"project\(posenc VERSION ([0-9.]+)", (SOURCE_DIR / "CMakeLists.txt").read_text())
    assert m and posenc.__version__ == m.group(1)
    assert m.group(1) in cli("--version").stdout


CONFIGS = ["llama-3.1-8b.json", "phi-3-mini-128k-instruct.json", "deepseek-v3.json", "qwen2.5-vl-7b-instruct.json",
           "mpt-7b.json", "flan-t5-base.json", "gpt2-large.json", "falcon-7b-instruct.json", "gemma-2-2b.json"]


@pytest.mark.parametrize("name", CONFIGS)
def test_inspect_equals_the_cli_json(name, shared, cli):
    path = shared / "configs" / name
    want = json.loads(cli("inspect", "--config", path, "--json", "-").stdout)
    assert posenc.inspect(path) == want
    if want["family"] in ("rope", "mrope"):
        want_32k = json.loads(cli("inspect", "--config", path, "--seq-len", "32K", "--json", "-").stdout)
        assert posenc.inspect(str(path), seq_len="32K") == want_32k
        assert posenc.inspect(json.loads(path.read_text()), seq_len=32768)["channels"] == want_32k["channels"]


def test_llama31_frequencies(shared, cli):
    path = shared / "configs" / "llama-3.1-8b.json"
    f = posenc.rope_frequencies(path)
    want = json.loads(cli("inspect", "--config", path, "--json", "-").stdout)
    assert f.rope_type == "llama3" and f.layout == "half" and f.rotary_dim == 128 and f.head_dim == 128
    np.testing.assert_array_equal(f.inv_freq, np.asarray(want["inv_freq"], dtype=np.float32))
    assert f.attention_factor == want["attention_factor"] == 1.0
    # The same from the config as a dict, and from its typed parameters.
    cfg = json.loads(path.read_text())
    np.testing.assert_array_equal(posenc.rope_frequencies(cfg).inv_freq, f.inv_freq)
    np.testing.assert_array_equal(posenc.rope_frequencies(posenc.rope_params(path)).inv_freq, f.inv_freq)
    # Llama 3's rule: the fastest channels keep theta^(-2i/d), the slowest are divided by factor 8.
    plain = 1.0 / 500000.0 ** (np.arange(0, 128, 2) / 128)
    np.testing.assert_allclose(f.inv_freq[:10], plain[:10], rtol=2e-6)
    np.testing.assert_allclose(f.inv_freq[-10:], plain[-10:] / 8, rtol=2e-6)


def test_periods_equal_the_cli(cli):
    want = json.loads(cli("periods", "--head-dim", 128, "--rope-theta", "10000,500000", "--context", "4K,128K",
                          "--rope-scaling", "default,yarn", "--rope-factor", 4,
                          "--original-max-position-embeddings", "8K", "--json", "-").stdout)["rows"]
    got = posenc.periods(head_dim=128, rope_theta=[10000, 500000], context=["4K", 131072],
                         rope_scaling=["default", "yarn"], factor=4, original_max_position_embeddings="8K")
    assert got == want


def test_cmake_install_puts_an_importable_package_in_site_packages(tmp_path):
    """`cmake --install <build> --component python --prefix P` installs posenc into P/<POSENC_PYTHON_INSTALL_DIR>;
    a fresh interpreter with only that directory on its path imports it from there."""
    import os
    import subprocess
    import sys
    build, cmake, rel = (os.environ.get(k) for k in ("POSENC_BUILD_DIR", "POSENC_CMAKE", "POSENC_PYTHON_INSTALL_DIR"))
    if not (build and cmake and rel):
        pytest.skip("POSENC_BUILD_DIR / POSENC_CMAKE / POSENC_PYTHON_INSTALL_DIR not set (run through ctest)")
    r = subprocess.run([cmake, "--install", build, "--component", "python", "--prefix", str(tmp_path)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    site = tmp_path / rel
    assert (site / "posenc" / "__init__.py").is_file() and (site / "posenc" / "eval.py").is_file()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(site)
    code = "import posenc, sys; print(posenc.__version__); print(posenc.__file__); " \
           "print(float(posenc.rope_frequencies({'model_type': 'llama', 'hidden_size': 64, " \
           "'num_attention_heads': 2}).inv_freq[1]))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    version, where, inv1 = out.stdout.split()
    assert version == posenc.__version__ and where.startswith(str(site))
    assert float(inv1) == pytest.approx(10000.0 ** (-2 / 32), rel=1e-6)
