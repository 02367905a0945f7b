#!/usr/bin/env python3
"""Plot `posenc precision --plot`: the error of each RoPE precision mode against fp64.

Usage: plot_precision.py DATA.json OUT.png

DATA.json is the report posenc writes (schema posenc.precision/1, as --json):
  {"rope": {...}, "options": {...},
   "modes": [{"name": str, "buckets": [{"lo", "hi", "cos_sin_max", "score_max", ...}],
              "first_collision": int|null, ...}, ...]}

Two panels sharing a log-2 position axis (each bucket drawn at its upper end):
the max |cos/sin - fp64| and the max |q.k - fp64 q.k| of every mode (log axis).
Colours are the Okabe-Ito palette (colour-blind safe), and each mode also has
its own marker and line style, so the curves stay apart in grey print. A mode's
first collision (distinct positions on the same table row) is marked with a
vertical tick of its colour. Zero errors are drawn at the panel floor; a bucket
with no finite value (null) is a gap. The PNG
is written to a temporary file next to OUT.png and renamed (plotio).
"""
import json
import math
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from plotio import OKABE_ITO, save_png_atomic  # noqa: E402

# Black first, then the Okabe-Ito colours without yellow (too pale on white).
COLORS = [c for c in OKABE_ITO if c != "#F0E442"] + ["#999999", "#882255", "#44AA99", "#332288"]
MARKERS = ["o", "s", "^", "v", "D", "P", "X", "*", "<", ">", "h", "p"]
STYLES = ["-", "--", "-.", ":"]


def main(argv):
    if len(argv) != 3:
        sys.stderr.write("usage: plot_precision.py DATA.json OUT.png\n")
        return 2
    with open(argv[1], encoding="utf-8") as f:
        data = json.load(f)
    out = argv[2]
    rope = data["rope"]
    opts = data["options"]

    fig, axes = plt.subplots(2, 1, figsize=(11.5, 8), dpi=110, sharex=True)
    floor = 1e-9
    for k, mode in enumerate(data["modes"]):
        xs = [max(1, b["hi"]) for b in mode["buckets"]]
        style = dict(color=COLORS[k % len(COLORS)], marker=MARKERS[k % len(MARKERS)],
                     linestyle=STYLES[k % len(STYLES)], linewidth=1.3, markersize=4, label=mode["name"])
        for ax, key in ((axes[0], "cos_sin_max"), (axes[1], "score_max")):
            # null: nothing finite in the bucket (fp16 positions past 65504): a gap in the curve
            ys = [max(floor, b[key]) if b[key] is not None and math.isfinite(b[key]) else float("nan")
                  for b in mode["buckets"]]
            ax.plot(xs, ys, **style)
        if mode.get("first_collision") is not None:
            for ax in axes:
                ax.axvline(mode["first_collision"], color=style["color"], linestyle=":", linewidth=0.8, alpha=0.8)
    for ax, label in ((axes[0], "max |cos/sin − fp64|"), (axes[1], "max |q·k − fp64 q·k| (unit q, k)")):
        ax.set_yscale("log")
        ax.set_xscale("log", base=2)
        ax.set_ylabel(label)
        ax.grid(True, which="both", linewidth=0.3, alpha=0.5)
    axes[1].set_xlabel("position (bucket upper end); dotted verticals: first collision of the mode of that colour")
    axes[0].legend(fontsize=8, ncol=1, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    axes[0].set_title(
        f"RoPE {rope['rope_type']}, head_dim {rope['head_dim']}, rotary_dim {rope['rotary_dim']}: "
        f"error against fp64, positions {opts['first_position']}..{opts['last_position']}", fontsize=10)
    fig.tight_layout()
    save_png_atomic(fig, out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
