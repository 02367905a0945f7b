#!/usr/bin/env python3
"""Checks of scripts/study_report.py on a real study's summary.json
(tests/train/data/study_report/summary.json, see the README there). Run by
tests/train/study_report_test.cpp with Debian's /usr/bin/python3.

    study_report_test.py SOURCE_DIR

Exit 0 = passed, 1 = failed (the failures are printed).
"""
import copy
import json
import os
import shutil
import subprocess
import sys
import tempfile

FAILURES = []


def check(cond, what):
    if not cond:
        FAILURES.append(what)
    return cond


def hex_rgb(h):
    return tuple(int(h[i:i + 2], 16) / 255 for i in (1, 3, 5))


def pixels_of(img, colour, tol=0.02):
    """How many pixels of an RGB(A) image array are `colour` (#rrggbb) within tol per channel."""
    import numpy as np

    r, g, b = hex_rgb(colour)
    a = img[..., :3]
    return int(np.sum((abs(a[..., 0] - r) < tol) & (abs(a[..., 1] - g) < tol) & (abs(a[..., 2] - b) < tol)))


def main(argv):
    src = argv[0]
    sys.path.insert(0, os.path.join(src, "scripts"))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.image as mpimg
    import matplotlib.pyplot as plt
    import plotio
    import study_report

    fixture = os.path.join(src, "tests", "train", "data", "study_report", "summary.json")
    with open(fixture) as f:
        summary = json.load(f)
    rows = summary["by_length"]
    tasks = summary["study"]["tasks"]
    lengths = sorted({r["length"] for r in rows})
    lo, hi, step = summary["study"]["settings"]["test_lengths"]
    check(lengths == list(range(lo, hi + 1, step)), f"fixture lengths {lengths}")

    # Bins: one per tested length when every length holds >= MIN_BIN_SAMPLES samples (100 here) ...
    for t in tasks:
        b = study_report.bins_for(rows, t)
        check(b == [(L, L) for L in lengths], f"{t}: bins {b}")
    # ... merged with neighbours when they do not (20 samples a length: 3 lengths = 60 per bin).
    sparse = copy.deepcopy(rows)
    for r in sparse:
        r["samples"] = 20
        r["correct"] = min(r["correct"], 20)
    b = study_report.bins_for(sparse, tasks[0])
    check(all(sum(1 for L in lengths if x <= L <= y) >= 3 for x, y in b), f"sparse bins {b}")
    check(b[0][0] == lengths[0] and b[-1][1] == lengths[-1] and
          all(b[i][1] < b[i + 1][0] for i in range(len(b) - 1)), f"sparse bins do not tile the lengths: {b}")
    pts, _ = study_report.series(sparse, tasks[0], summary["study"]["pes"][0], "default", b)
    n = {p[:3]: p[4] for p in pts}
    check(all(v >= study_report.MIN_BIN_SAMPLES for v in n.values()), f"sparse bin sizes {n}")

    # The training range: lines at its ends and a strip along the top (axes y >= 0.96), never a
    # block over the data.
    fig, ax = plt.subplots()
    ax.set_xlim(0, 130)
    study_report.mark_training(ax, summary["study"]["settings"])
    fig.canvas.draw()
    check(len(ax.collections) >= 1, "mark_training drew no band")
    for coll in ax.collections:
        for path in coll.get_paths():  # the strip is drawn in a blended transform: y in axes units
            ys = path.vertices[:, 1]
            check(ys.min() >= 0.96 - 1e-9, f"training band reaches down to axes y {ys.min():.3f}")
    plt.close(fig)

    # Newcombe difference: equal proportions -> 0 inside the interval; 0/100 vs 100/100 -> -1 with
    # the interval below 0.
    d, l, h = plotio.newcombe_diff(50, 100, 50, 100)
    check(d == 0 and l < 0 < h, f"newcombe equal {d, l, h}")
    d, l, h = plotio.newcombe_diff(0, 100, 100, 100)
    check(d == -1 and h < 0 and l >= -1 - 1e-12, f"newcombe extreme {d, l, h}")
    # Newcombe (1998) Table II example: 56/70 vs 48/80 -> 0.2, 95% CI [0.0524, 0.3339]
    d, l, h = plotio.newcombe_diff(56, 70, 48, 80)
    check(abs(d - 0.2) < 1e-12 and abs(l - 0.0524) < 5e-4 and abs(h - 0.3339) < 5e-4, f"newcombe 56/70-48/80 {d, l, h}")

    work = tempfile.mkdtemp(prefix="posenc-study-plots-")
    try:
        r = subprocess.run(["/usr/bin/python3", os.path.join(src, "scripts", "study_report.py"), fixture, work],
                           capture_output=True, text=True, env=dict(os.environ, MPLBACKEND="Agg"))
        check(r.returncode == 0, f"study_report.py failed: {r.stderr[-2000:]}")
        files = sorted(os.listdir(work))
        want = sorted([f"{t}.png" for t in tasks] + [f"{t}-scaling.png" for t in tasks])
        check(all(w in files for w in want), f"plots {files}, expected {want}")
        check(not [f for f in files if f.startswith(".plot-")], f"temporaries left: {files}")
        for f in files:
            img = mpimg.imread(os.path.join(work, f))
            check(img.shape[0] > 200 and img.shape[1] > 300, f"{f}: image {img.shape}")
        # One colour per encoding and per scaling in every plot: each encoding's colour is drawn in
        # each task plot; each scaling's colour in each scaling plot.
        for t in tasks:
            img = mpimg.imread(os.path.join(work, f"{t}.png"))
            for pe in summary["study"]["pes"]:
                c = plotio.pe_color(pe)
                check(pixels_of(img, c) > 50, f"{t}.png: {pe}'s colour {c} drawn on {pixels_of(img, c)} pixels")
            img = mpimg.imread(os.path.join(work, f"{t}-scaling.png"))
            for s in ["default"] + summary["study"]["settings"]["scalings"]:
                c = plotio.scaling_color(s)
                check(pixels_of(img, c) > 50, f"{t}-scaling.png: {s}'s colour {c} on {pixels_of(img, c)} pixels")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    for f in FAILURES:
        print("FAILED:", f)
    print(f"{len(FAILURES)} failure(s)")
    return 1 if FAILURES else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
