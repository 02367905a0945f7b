#!/usr/bin/env python3
"""Perplexity by position: mean NLL per position bucket, one line per RoPE
scaling, one panel per context length (input: the JSON of `posenc ppl --json`
or a run's ppl.json).

    plot_ppl.py PPL.json OUT.png [--by-scaling OUT_PREFIX]

--by-scaling also writes OUT_PREFIX<scaling>.png per method: one line per
context length (how a method behaves as the window grows).
Uses matplotlib's Agg backend (no display needed).
"""
import argparse
import json
import math
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from plotio import save_png_atomic  # noqa: E402


def _bucket_x(b):
    # Plot a bucket at the log2 of its midpoint (buckets double in size).
    return (b["start"] + b["end"]) / 2.0


def _order(items):
    seen = []
    for x in items:
        if x not in seen:
            seen.append(x)
    return seen


def plot_ppl(data, out_png, title=None):
    results = data.get("results", [])
    if not results:
        raise SystemExit("plot_ppl: no results in the input")
    contexts = sorted({r["context"] for r in results})
    scalings = _order([r["rope_scaling"] for r in results])
    trained = data.get("trained_context")
    n = len(contexts)
    cols = min(n, 3)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 3.8 * rows), squeeze=False, sharey=True)
    cmap = plt.get_cmap("tab10")
    for i, ctx in enumerate(contexts):
        ax = axes[i // cols][i % cols]
        for j, s in enumerate(scalings):
            rs = [r for r in results if r["context"] == ctx and r["rope_scaling"] == s]
            if not rs:
                continue
            bs = [b for b in rs[0]["buckets"] if b["tokens"] > 0]
            ax.plot([_bucket_x(b) for b in bs], [b["nll"] for b in bs], marker="o", color=cmap(j % 10),
                    label=f"{s} (s={rs[0].get('factor', 1):g}, ppl {rs[0]['ppl']:.2f})")
        if trained:
            ax.axvline(trained, color="grey", linestyle="--", linewidth=1)
        ax.set_xscale("log", base=2)
        ax.set_title(f"context L = {ctx}")
        ax.set_xlabel("position (bucket midpoint)")
        if i % cols == 0:
            ax.set_ylabel("mean NLL (nats/token)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    for k in range(n, rows * cols):
        axes[k // cols][k % cols].axis("off")
    fig.suptitle(title or f"NLL by position bucket (dashed: trained context {trained})")
    fig.tight_layout()
    save_png_atomic(fig, out_png, dpi=110)


def plot_ppl_by_scaling(data, out_prefix):
    results = data.get("results", [])
    trained = data.get("trained_context")
    written = []
    for s in _order([r["rope_scaling"] for r in results]):
        fig, ax = plt.subplots(figsize=(6, 4))
        cmap = plt.get_cmap("viridis")
        rs = sorted([r for r in results if r["rope_scaling"] == s], key=lambda r: r["context"])
        for j, r in enumerate(rs):
            bs = [b for b in r["buckets"] if b["tokens"] > 0]
            ax.plot([_bucket_x(b) for b in bs], [b["nll"] for b in bs], marker="o",
                    color=cmap(j / max(1, len(rs) - 1)), label=f"L={r['context']} (ppl {r['ppl']:.2f})")
        if trained:
            ax.axvline(trained, color="grey", linestyle="--", linewidth=1)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("position (bucket midpoint)")
        ax.set_ylabel("mean NLL (nats/token)")
        ax.set_title(f"{s}: NLL by position for each context length")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        path = f"{out_prefix}{s}.png"
        save_png_atomic(fig, path, dpi=110)
        written.append(path)
    return written


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("json")
    ap.add_argument("out_png")
    ap.add_argument("--by-scaling", metavar="OUT_PREFIX")
    a = ap.parse_args(argv)
    with open(a.json) as f:
        data = json.load(f)
    plot_ppl(data, a.out_png)
    if a.by_scaling:
        plot_ppl_by_scaling(data, a.by_scaling)


if __name__ == "__main__":
    main(sys.argv[1:])
