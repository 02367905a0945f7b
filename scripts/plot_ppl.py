#!/usr/bin/env python3
"""Perplexity by position: mean NLL per position bucket with its 95% bootstrap
interval, one colour per RoPE scaling, one column of panels per context length,
and below each the difference to `default` (input: the JSON of `posenc ppl
--json` or a run's ppl.json).

    plot_ppl.py PPL.json OUT.png [--by-scaling OUT_PREFIX]

Each bucket is drawn at its span [start, end) on a linear position axis, as a
horizontal segment at its mean NLL over a shaded band (its interval, the JSON's
nll_ci_low..nll_ci_high); `fine_buckets` (when present) add a thin line through
finer bins. The trained context is a light band behind everything, labelled.
x ticks are the bucket edges. Colours: Okabe & Ito's colour-blind-safe palette.
--by-scaling also writes OUT_PREFIX<scaling>.png per method: one line per
context length (how a method behaves as the window grows).
Uses matplotlib's Agg backend (no display needed). Older JSON without intervals
or fine bins is drawn without them, and so is a bucket whose interval is null
(one window holds its predictions: nll_ci_note says so).
"""
import argparse
import json
import math
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from plotio import save_png_atomic  # noqa: E402

# Okabe & Ito (2008), "Color Universal Design": distinguishable under the
# common colour-vision deficiencies. `default` always takes black.
OKABE_ITO = ["#E69F00", "#56B4E9", "#009E73", "#D55E00", "#0072B2", "#CC79A7", "#F0E442"]


def _order(items):
    seen = []
    for x in items:
        if x not in seen:
            seen.append(x)
    return seen


def _colours(scalings):
    out, k = {}, 0
    for s in scalings:
        if s == "default":
            out[s] = "#000000"
        else:
            out[s] = OKABE_ITO[k % len(OKABE_ITO)]
            k += 1
    return out


def _filled(buckets):
    return [b for b in buckets if b.get("tokens", 0) > 0 and b.get("nll") is not None]


def _has_ci(b):
    # null (with nll_ci_note) when one window holds the bucket's predictions: no interval, no band.
    return b.get("nll_ci_low") is not None and b.get("nll_ci_high") is not None


def _ci_low(b):
    return b["nll_ci_low"] if _has_ci(b) else b["nll"]


def _ci_high(b):
    return b["nll_ci_high"] if _has_ci(b) else b["nll"]


def _trained_band(ax, trained, xmax, label):
    if trained:
        ax.axvspan(0, min(trained, xmax), color="#DDDDDD", alpha=0.45, zorder=0, lw=0,
                   label=f"trained context (0\u2013{trained})" if label else None)
        if trained <= xmax:
            ax.axvline(trained, color="#777777", linewidth=0.8, linestyle=":", zorder=1)


def _draw_buckets(ax, buckets, colour, label, fine=None, spans=True, width=2.2):
    first = True
    for b in buckets:
        x0, x1 = b["start"], b["end"]
        if _has_ci(b):
            ax.fill_between([x0, x1], [b["nll_ci_low"]] * 2, [b["nll_ci_high"]] * 2, color=colour, alpha=0.22,
                            lw=0, zorder=2)
        if spans:
            ax.plot([x0, x1], [b["nll"]] * 2, color=colour, linewidth=width, zorder=4,
                    label=label if first else None, solid_capstyle="butt")
            first = False
    if fine:
        xs = [(b["start"] + b["end"]) / 2 for b in fine]
        ax.plot(xs, [b["nll"] for b in fine], color=colour, linewidth=0.9, alpha=0.9, marker=".", markersize=3,
                zorder=3, label=None if spans else label)
        if not spans:
            lo = [_ci_low(b) for b in fine]
            hi = [_ci_high(b) for b in fine]
            ax.fill_between(xs, lo, hi, color=colour, alpha=0.18, lw=0, zorder=2)


def _edge_ticks(ax, results, xmax, trained):
    edges = sorted({b["start"] for r in results for b in r["buckets"]} |
                   {min(b["end"], xmax) for r in results for b in r["buckets"]})
    edges = [e for e in edges if e <= xmax]
    ax.set_xticks(edges)
    ax.set_xticklabels([str(e) for e in edges], rotation=45 if len(edges) > 6 else 0, fontsize=8)
    for lab, e in zip(ax.get_xticklabels(), edges):
        if trained and e == trained:
            lab.set_fontweight("bold")
    ax.set_xlim(0, xmax)


def plot_ppl(data, out_png, title=None):
    results = data.get("results", [])
    if not results:
        raise SystemExit("plot_ppl: no results in the input")
    contexts = sorted({r["context"] for r in results})
    scalings = _order([r["rope_scaling"] for r in results])
    colours = _colours(scalings)
    trained = data.get("trained_context") or results[0].get("trained_context")
    rope = data.get("positional_family", "rope") == "rope"
    deltas = "default" in scalings and len(scalings) > 1
    n = len(contexts)
    rows = 2 if deltas else 1
    fig, axes = plt.subplots(rows, n, figsize=(4.6 * n, 3.9 + (2.6 if deltas else 0)), squeeze=False,
                             gridspec_kw={"height_ratios": [3, 2] if deltas else [1]})
    top = axes[0]
    ymin, ymax = math.inf, -math.inf
    for i, ctx in enumerate(contexts):
        ax = top[i]
        _trained_band(ax, trained, ctx, label=(i == 0))
        by_s = {r["rope_scaling"]: r for r in results if r["context"] == ctx}
        for s in scalings:
            r = by_s.get(s)
            if r is None:
                continue
            bs = _filled(r["buckets"])
            fine = _filled(r.get("fine_buckets", []))
            if rope:
                label = f"{s} (s={r.get('factor', 1):g}): ppl {r['ppl']:.2f}" if r.get("ppl") else s
            else:
                label = f"ppl {r['ppl']:.2f}" if r.get("ppl") else "NLL"
            # default wider, under the others: where a scaling equals it (s = 1)
            # black edges show around the coloured segment.
            _draw_buckets(ax, bs, colours[s], label, fine, width=3.6 if s == "default" else 1.8)
            for b in bs + fine:
                ymin = min(ymin, _ci_low(b), b["nll"])
                ymax = max(ymax, _ci_high(b), b["nll"])
        _edge_ticks(ax, [by_s[s] for s in by_s], ctx, trained)
        ax.set_title(f"window L = {ctx}", fontsize=10)
        if i == 0:
            ax.set_ylabel("mean NLL (nats/token)")
        ax.grid(True, alpha=0.25, zorder=1)
        ax.legend(fontsize=7, loc="best", framealpha=0.85)
        if not deltas:
            ax.set_xlabel("input position")
    if math.isfinite(ymin):
        pad = 0.05 * max(ymax - ymin, 1e-3)
        for ax in top[:n]:
            ax.set_ylim(ymin - pad, ymax + pad)
    if deltas:
        for i, ctx in enumerate(contexts):
            ax = axes[1][i]
            _trained_band(ax, trained, ctx, label=False)
            by_s = {r["rope_scaling"]: r for r in results if r["context"] == ctx}
            base = {b["start"]: b for b in _filled(by_s.get("default", {}).get("buckets", []))}
            ax.axhline(0, color="#000000", linewidth=0.8, zorder=3)
            for s in scalings:
                if s == "default" or s not in by_s or not base:
                    continue
                diff = []
                for b in _filled(by_s[s]["buckets"]):
                    d = base.get(b["start"])
                    if d is None:
                        continue
                    e = {"start": b["start"], "end": b["end"], "nll": b["nll"] - d["nll"], "tokens": 1}
                    # Bit-identical NLL (e.g. linear at L <= T, where s = 1: the same encoding): the difference is
                    # exactly 0 on the same windows, with no uncertainty; an unpaired band would draw noise there.
                    if _has_ci(b) and _has_ci(d) and b["nll"] != d["nll"]:
                        # Half-widths added in quadrature: an approximate band (both
                        # scalings are scored on the same windows, so it errs wide).
                        h = math.hypot((b["nll_ci_high"] - b["nll_ci_low"]) / 2, (d["nll_ci_high"] - d["nll_ci_low"]) / 2)
                        e["nll_ci_low"], e["nll_ci_high"] = e["nll"] - h, e["nll"] + h
                    diff.append(e)
                _draw_buckets(ax, diff, colours[s], f"{s} \u2212 default")
            _edge_ticks(ax, list(by_s.values()), ctx, trained)
            ax.set_xlabel("input position (bold tick: trained context)" if trained else "input position")
            if i == 0:
                ax.set_ylabel("\u0394 NLL vs default (nats)")
            ax.grid(True, alpha=0.25, zorder=1)
            if any(s != "default" for s in by_s):
                ax.legend(fontsize=7, loc="best", framealpha=0.85)
    fig.suptitle(title or (f"NLL by input position, 95% bootstrap bands over windows; trained context {trained}"
                           if trained else "NLL by input position, 95% bootstrap bands over windows"), fontsize=11)
    fig.tight_layout()
    save_png_atomic(fig, out_png, dpi=110)


def clip_to_window(buckets, window):
    """The buckets of a window of `window` tokens with each span [start, end) cut at the window's end (a
    bucket [0, 256) of a 128-token window covers positions 0..127 only); buckets past it are dropped."""
    out = []
    for b in buckets:
        if b["start"] >= window:
            continue
        out.append(dict(b, end=min(b["end"], window)) if b["end"] > window else b)
    return out


def plot_ppl_by_scaling(data, out_prefix):
    results = data.get("results", [])
    trained = data.get("trained_context")
    written = []
    for s in _order([r["rope_scaling"] for r in results]):
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        rs = sorted([r for r in results if r["rope_scaling"] == s], key=lambda r: r["context"])
        xmax = max(r["context"] for r in rs)
        _trained_band(ax, trained, xmax, label=True)
        for j, r in enumerate(rs):
            colour = OKABE_ITO[j % len(OKABE_ITO)]
            # a window of L tokens has no position >= L: each bucket is drawn up to the window only
            fine = clip_to_window(_filled(r.get("fine_buckets", [])), r["context"])
            label = f"L={r['context']} (ppl {r['ppl']:.2f})" if r.get("ppl") else f"L={r['context']}"
            if fine:
                _draw_buckets(ax, [], colour, label, fine, spans=False)
            else:
                _draw_buckets(ax, clip_to_window(_filled(r["buckets"]), r["context"]), colour, label)
        # ticks at the clipped edges too: where each shorter window ends
        _edge_ticks(ax, [dict(r, buckets=clip_to_window(r["buckets"], r["context"])) for r in rs], xmax, trained)
        ax.set_xlabel("input position (bold tick: trained context)" if trained else "input position")
        ax.set_ylabel("mean NLL (nats/token)")
        ax.set_title(f"{s}: NLL by position for each window length", fontsize=10)
        ax.grid(True, alpha=0.25, zorder=1)
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
