#!/usr/bin/env python3
"""Plot RoFormer's long-term decay bound for `posenc decay --plot`.

Usage: plot_decay.py DATA.json OUT.png

DATA.json (written by posenc):
  {"title": str, "head_dim": int, "rope_theta": float,
   "distance": [int, ...], "bound": [float, ...]}

Draws the relative upper bound (1/(d/2)) * sum_j |S_j(r)| (Su et al. 2021,
section 3.4.3) against the relative distance r on a log axis (r >= 1; the
value at r = 0, (d/2+1)/2, is given in the title). The PNG is written to a
temporary file next to OUT.png and renamed. matplotlib Agg backend.
"""
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from plotio import save_png_atomic  # noqa: E402


def main(argv):
    if len(argv) != 3:
        sys.stderr.write("usage: plot_decay.py DATA.json OUT.png\n")
        return 2
    with open(argv[1], encoding="utf-8") as f:
        data = json.load(f)
    out = argv[2]
    pairs = [(r, b) for r, b in zip(data["distance"], data["bound"]) if r >= 1]
    at0 = [b for r, b in zip(data["distance"], data["bound"]) if r == 0]

    fig, ax = plt.subplots(figsize=(9, 5), dpi=110)
    ax.plot([p[0] for p in pairs], [p[1] for p in pairs], linewidth=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("relative distance r (tokens)")
    ax.set_ylabel("relative upper bound  (1/(d/2)) \u03a3 |S_j(r)|")
    title = data.get("title", "RoPE long-term decay")
    if at0:
        title += f"  (bound at r=0: {at0[0]:g})"
    ax.set_title(title)
    ax.grid(True, which="both", linewidth=0.3, alpha=0.5)
    fig.tight_layout()

    save_png_atomic(fig, out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
