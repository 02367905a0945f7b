#!/usr/bin/env python3
"""posenc.apply_rope from Python against the C++ kernel it wraps and against numpy, on the same arrays in one
process.

    PYTHONPATH=build/python nice /usr/bin/python3 bench/python_apply_rope.py [--tokens 4096 --heads 32 --head-dim 128]

Rows (median of --repeats calls, each: the cos/sin table from the position ids, then the rotation):
  - C++ kernel: RopeTable + apply_rope timed inside C++ on the same numpy buffers (posenc._posenc._bench_apply_rope_cpp)
  - posenc.apply_rope: the binding called from Python (argument checks, GIL release, output array)
  - numpy: the rotation written with numpy's own cos/sin and array arithmetic (float32)
each out of place (a new result / a preallocated out) and in place (out=x). The binding's ratio to the kernel is the
overhead Python adds; the issue's target is <= 1.2x for [4096, 32, 128] float32.
"""
import argparse
import statistics
import time

import numpy as np

import posenc
from posenc import _posenc


def numpy_rope(x, pos, inv_freq, out=None):
    """Half-layout RoPE in numpy: (x0*c - x1*s, x1*c + x0*s) on channels (i, i + d/2)."""
    n = inv_freq.shape[0]
    ang = pos.astype(np.float32)[:, None] * inv_freq[None, :]
    c = np.cos(ang)[:, None, :]
    s = np.sin(ang)[:, None, :]
    x0, x1 = x[..., :n], x[..., n:2 * n]
    if out is None:
        out = np.empty_like(x)
    r0 = x0 * c - x1 * s
    r1 = x1 * c + x0 * s
    out[..., :n] = r0
    out[..., n:2 * n] = r1
    if 2 * n < x.shape[-1]:
        out[..., 2 * n:] = x[..., 2 * n:]
    return out


def timed(fn):
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args()

    rng = np.random.default_rng(0)
    shape = (args.tokens, args.heads, args.head_dim)
    x = rng.standard_normal(shape).astype(np.float32)
    pos = np.arange(args.tokens, dtype=np.int64)
    f = posenc.RopeFrequencies.default(args.head_dim, rope_theta=500000.0, layout="half")
    out = np.empty_like(x)
    inplace = x.copy()

    # Same results first (the comparison is of the same work).
    want = posenc.apply_rope(x, pos, f)
    _posenc._bench_apply_rope_cpp(x, pos, f, "half", out, 1)
    assert np.array_equal(out, want), "C++ kernel and binding disagree"
    assert np.allclose(numpy_rope(x, pos, f.inv_freq), want, atol=1e-4), "numpy implementation disagrees"

    # Warm-up of each path (page faults of fresh outputs, caches).
    for _ in range(2):
        posenc.apply_rope(x, pos, f, out=out)
        numpy_rope(x, pos, f.inv_freq, out=out)

    # The paths are timed in interleaved rounds (one call of each per round), so that a change of the machine's
    # load during the run (a shared machine) affects every row alike; each row is the median over the rounds.
    r = args.repeats
    paths = [
        ("C++ kernel (out of place)", lambda: _posenc._bench_apply_rope_cpp(x, pos, f, "half", out, 1)[0]),
        ("posenc.apply_rope(x, pos, f, out=out)", lambda: timed(lambda: posenc.apply_rope(x, pos, f, out=out))),
        ("posenc.apply_rope(x, pos, f)  [new array]", lambda: timed(lambda: posenc.apply_rope(x, pos, f))),
        ("numpy (out=out)", lambda: timed(lambda: numpy_rope(x, pos, f.inv_freq, out=out))),
        ("C++ kernel (in place)", lambda: _posenc._bench_apply_rope_cpp(inplace, pos, f, "half", inplace, 1)[0]),
        ("posenc.apply_rope(x, pos, f, out=x)", lambda: timed(lambda: posenc.apply_rope(inplace, pos, f, out=inplace))),
    ]
    samples = [[] for _ in paths]
    for _ in range(r):
        for i, (_, fn) in enumerate(paths):
            samples[i].append(fn())
    rows = [(name, statistics.median(t)) for (name, _), t in zip(paths, samples)]
    kernel = {"out": rows[0][1], "in": rows[4][1]}
    mb = x.nbytes / 2**20
    print(f"apply_rope, x {list(shape)} float32 ({mb:.0f} MiB), half layout, positions 0..{args.tokens - 1}, "
          f"median of {r} interleaved rounds, posenc {posenc.__version__}, numpy {np.__version__}")
    print(f"{'':46} {'ms':>9} {'GB/s':>7} {'x kernel':>9}")
    for name, s in rows:
        ref = kernel["in"] if "in place" in name or "out=x" in name else kernel["out"]
        print(f"{name:46} {s * 1e3:9.2f} {2 * x.nbytes / s / 1e9:7.2f} {s / ref:9.2f}")


if __name__ == "__main__":
    main()
