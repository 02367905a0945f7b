"""Fixtures of the posenc pytest suite (run by ctest as python_tests, with PYTHONPATH=<build>/python,
POSENC_SHARED_DIR and POSENC_CLI set by python/CMakeLists.txt)."""
import json
import os
import pathlib
import subprocess

import pytest

SOURCE_DIR = pathlib.Path(__file__).resolve().parents[2]


def shared_dir():
    return pathlib.Path(os.environ.get("POSENC_SHARED_DIR", SOURCE_DIR.parent / "shared"))


def golden(name):
    """A Hugging Face reference file of ../shared/testdata/hf_reference (schema: its README.md)."""
    path = shared_dir() / "testdata" / "hf_reference" / name
    with open(path) as f:
        return json.load(f)


@pytest.fixture(scope="session")
def shared():
    d = shared_dir()
    if not (d / "testdata" / "hf_reference").is_dir():
        pytest.fail(f"POSENC_SHARED_DIR {d} has no testdata/hf_reference")
    return d


@pytest.fixture(scope="session")
def cli():
    """A function running the built posenc CLI: cli(*args) -> CompletedProcess (text), asserting exit 0."""
    path = os.environ.get("POSENC_CLI")
    if not path or not os.path.exists(path):
        pytest.fail("POSENC_CLI does not name the built posenc executable (set by ctest)")

    def run(*args, check=True):
        r = subprocess.run([path, *map(str, args)], capture_output=True, text=True, timeout=300)
        if check and r.returncode != 0:
            raise AssertionError(f"posenc {' '.join(map(str, args))} exited {r.returncode}: {r.stderr}")
        return r

    return run
