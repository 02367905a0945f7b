"""The environment the import reads: OMP_NUM_THREADS is checked at `import posenc` as the CLI checks it at start-up
(libgomp reads it when the extension loads and crashed at the first parallel region on an absurd count). Each import
runs in a child interpreter."""
import os
import subprocess
import sys

import pytest


@pytest.mark.parametrize("value,words", [("100000", "more than posenc runs with"), ("abc", "is not a thread count"),
                                         ("4,,2", "is not a thread count"), ("0", "is not a thread count")])
def test_a_bad_omp_num_threads_fails_the_import_naming_it(value, words):
    """libgomp crashed (SIGSEGV) on OMP_NUM_THREADS=100000 at the first parallel region, and only warned on a
    value that is not a count; the import refuses both, as the CLI exits 2."""
    env = dict(os.environ, OMP_NUM_THREADS=value)
    r = subprocess.run([sys.executable, "-c", "import posenc"], capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 1, f"exit {r.returncode}: {r.stderr}"
    assert "ImportError" in r.stderr and f"OMP_NUM_THREADS '{value}'" in r.stderr and words in r.stderr, r.stderr


def test_a_good_or_empty_omp_num_threads_imports():
    for value in ("2", " 3 ", "2,1", "", "+2"):
        env = dict(os.environ, OMP_NUM_THREADS=value)
        r = subprocess.run([sys.executable, "-c", "import posenc; posenc.alibi_slopes(8)"], capture_output=True,
                           text=True, timeout=60, env=env)
        assert r.returncode == 0, f"OMP_NUM_THREADS='{value}': exit {r.returncode}: {r.stderr}"


def test_a_value_that_is_not_utf8_is_named_with_its_bytes_escaped():
    """pybind11 could not put a raw 0xff byte into the ImportError's message, which came out empty."""
    env = dict(os.environb)
    env[b"OMP_NUM_THREADS"] = b"\xff2"
    r = subprocess.run([sys.executable, "-c", "import posenc"], capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 1, f"exit {r.returncode}: {r.stderr}"
    assert "OMP_NUM_THREADS '\\xff2'" in r.stderr and "is not a thread count" in r.stderr, r.stderr


def test_a_second_import_after_fixing_the_variable_still_fails():
    """libgomp reads OMP_NUM_THREADS once, when the process starts: a second `import posenc` after fixing os.environ
    passed the check and the first parallel region crashed with SIGSEGV (libgomp still at 100000 threads). It now
    fails again, naming the count OpenMP runs with and saying to start again."""
    script = (
        "import os\n"
        "try:\n"
        "    import posenc\n"
        "    raise SystemExit('the first import passed')\n"
        "except ImportError as e:\n"
        "    assert \"OMP_NUM_THREADS '100000'\" in str(e), e\n"
        "os.environ['OMP_NUM_THREADS'] = '2'\n"
        "try:\n"
        "    import posenc\n"
        "    posenc.alibi_slopes(8)\n"
        "    raise SystemExit('the second import passed')\n"
        "except ImportError as e:\n"
        "    assert 'OpenMP runs with 100000 threads' in str(e) and 'start it again' in str(e), e\n"
        "print('ok')\n")
    env = dict(os.environ, OMP_NUM_THREADS="100000")
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 0 and r.stdout.strip() == "ok", (r.returncode, r.stdout, r.stderr)
