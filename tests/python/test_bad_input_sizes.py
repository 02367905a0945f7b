"""Output sizes past int64 (issue 17 review): q_len * k_len (* heads) wrapped around in the size of the vector the
core allocates, which then wrote past it: a segmentation fault from Python. Each call runs in a child interpreter
so that a crash fails the test instead of ending the suite."""
import os
import subprocess
import sys

import pytest

CALLS = [
    ("posenc.alibi_bias(posenc.alibi_slopes(8), 2**62, 4)", "q_len"),
    ("posenc.t5_relative_position_bias(np.zeros((32, 4), np.float32), 2**62, 4)", "q_len"),
    ("posenc.mpt_alibi_tensor(16, 2**60)", "seq_len"),
    ("posenc.t5_relative_buckets(2**62, 4)", "q_len"),
    ("posenc.t5_relative_buckets(2**40, 2**40)", "k_len"),
    ("posenc.sinusoidal_table(2**62, 8)", "num_positions"),
]


@pytest.mark.parametrize("call,name", CALLS)
def test_sizes_past_int64_are_a_value_error_naming_the_arguments(call, name):
    code = (f"import numpy as np, posenc\ntry:\n    {call}\nexcept ValueError as e:\n    print('ValueError:', e)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=os.environ)
    assert r.returncode == 0, f"{call}: exit {r.returncode} (signal {-r.returncode if r.returncode < 0 else 0}) {r.stderr}"
    assert r.stdout.startswith("ValueError:") and name in r.stdout, r.stdout
