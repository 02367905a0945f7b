#!/usr/bin/env python3
"""Plot RoPE per-channel periods (wavelengths) for `posenc periods --plot`.

Usage: plot_periods.py DATA.json OUT.png

DATA.json (written by posenc):
  {"title": str, "head_dim": int,
   "curves":  [{"label": str, "wavelengths": [float, ...]}, ...],   # one per theta x scaling
   "lengths": [{"label": str, "value": int}, ...]}                   # context lengths

Draws wavelength 2*pi/inv_freq_i (tokens, log axis) against channel pair i,
one curve per theta and scaling method, with each context length as a
horizontal line: channels below a line have wrapped at least once within that
length. The PNG is written to a temporary file next to OUT.png and renamed,
so OUT.png is never partial. Uses matplotlib's Agg backend (no display).
"""
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from plotio import save_png_atomic  # noqa: E402


def main(argv):
    if len(argv) != 3:
        sys.stderr.write("usage: plot_periods.py DATA.json OUT.png\n")
        return 2
    with open(argv[1], encoding="utf-8") as f:
        data = json.load(f)
    out = argv[2]

    fig, ax = plt.subplots(figsize=(9, 5.5), dpi=110)
    for curve in data["curves"]:
        w = curve["wavelengths"]
        ax.plot(range(len(w)), w, marker=".", markersize=3, linewidth=1.2, label=curve["label"])
    cmap = plt.get_cmap("Greys")
    lengths = data.get("lengths", [])
    for k, length in enumerate(lengths):
        shade = cmap(0.45 + 0.5 * k / max(1, len(lengths) - 1))
        ax.axhline(length["value"], linestyle="--", linewidth=0.9, color=shade)
        ax.annotate(length["label"], xy=(0, length["value"]), xycoords=("axes fraction", "data"),
                    xytext=(2, 2), textcoords="offset points", fontsize=8, color=shade)
    ax.set_yscale("log")
    ax.set_xlabel("channel pair i (0 = fastest)")
    ax.set_ylabel("period 2\u03c0/\u03b8_i (tokens)")
    ax.set_title(data.get("title", "RoPE periods"))
    ax.grid(True, which="both", linewidth=0.3, alpha=0.5)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()

    save_png_atomic(fig, out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
