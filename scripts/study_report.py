#!/usr/bin/env python3
"""Plots of a posenc length-generalization study (the summary.json that
`posenc study report DIR` writes).

    study_report.py SUMMARY_JSON OUT_DIR

Writes, atomically (temporary file + rename):
  OUT_DIR/<task>.png          exact match against input length, one colour per encoding, each
                              point a length bin with its Wilson 95% band; under it the
                              difference against the study's first encoding (Newcombe 95%
                              band). Lengths a model cannot run are marked "x" under the axis.
  OUT_DIR/<task>-scaling.png  the RoPE models (rope, rope25) under each inference-time
                              scaling, one colour per scaling, and the difference against
                              default.
  OUT_DIR/mrr.png             mean reciprocal rank per encoding (all, paper's five).
Bins: every tested length is its own bin when it holds at least MIN_BIN_SAMPLES samples
(pooled over seeds); sparser lengths are merged with their neighbours until a bin does.
The training lengths are marked by dashed lines at their ends and a strip along the top
of the axes, so the bands inside stay visible. Colours come from plotio.py (Okabe-Ito),
the same per encoding and per scaling in every plot posenc draws.
"""
import json
import os
import re
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import matplotlib.transforms as mtransforms  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from plotio import newcombe_diff, pe_color, save_png_atomic, scaling_color, wilson  # noqa: E402

ORDER = ["nope", "learned", "sinusoidal", "t5", "alibi", "rope", "rope25"]
ROPE_PES = ("rope", "rope25")
MIN_BIN_SAMPLES = 50


def save_atomic(fig, path):
    save_png_atomic(fig, path, dpi=120, bbox_inches="tight")


def scaling_of(r):
    return r.get("scaling", r.get("rope_scaling", "default"))


def bins_for(rows, task):
    """Length bins for a task: (lo, hi) spans over the tested lengths, each holding at least
    MIN_BIN_SAMPLES samples for every series that can run there (one length per bin when the
    data allow)."""
    lengths = sorted({r["length"] for r in rows if r["task"] == task})
    need = {}
    for r in rows:
        if r["task"] == task and r["can_run"]:
            need[r["length"]] = min(need.get(r["length"], r["samples"]), r["samples"])
    bins, cur, n = [], [], 0
    for L in lengths:
        cur.append(L)
        n += need.get(L, MIN_BIN_SAMPLES)
        if n >= MIN_BIN_SAMPLES:
            bins.append((cur[0], cur[-1]))
            cur, n = [], 0
    if cur:
        if bins:
            bins[-1] = (bins[-1][0], cur[-1])
        else:
            bins.append((cur[0], cur[-1]))
    return bins


def series(rows, task, pe, scaling, bins):
    """Per bin: (centre, lo, hi, correct, samples) of the lengths a model can run; and the lengths it cannot."""
    pts = [r for r in rows if r["task"] == task and r["encoding"] == pe and scaling_of(r) == scaling]
    cannot = sorted(r["length"] for r in pts if not r["can_run"])
    out = []
    for lo, hi in bins:
        rs = [r for r in pts if lo <= r["length"] <= hi and r["can_run"] and r["samples"] > 0]
        if not rs:
            continue
        k = sum(r["correct"] for r in rs)
        n = sum(r["samples"] for r in rs)
        out.append(((lo + hi) / 2, lo, hi, k, n))
    return out, cannot


def mark_training(ax, settings, ymax=102):
    lo, hi = settings["train_lengths"]
    for x in (lo, hi):
        ax.axvline(x, color="#555555", linestyle="--", linewidth=1, zorder=1)
    trans = mtransforms.blended_transform_factory(ax.transData, ax.transAxes)
    ax.fill_between([lo, hi], [0.965, 0.965], [1.0, 1.0], transform=trans, color="#999999", alpha=0.6, linewidth=0,
                    zorder=1)
    ax.text((lo + hi) / 2, 0.955, f"training lengths {lo}–{hi}", transform=trans, ha="center", va="top", fontsize=7,
            color="#333333")


def draw(ax, pts, color, label, marker="o"):
    if not pts:
        return
    xs = [p[0] for p in pts]
    acc = [100 * p[3] / p[4] for p in pts]
    ci = [wilson(p[3], p[4]) for p in pts]
    ax.fill_between(xs, [100 * c[0] for c in ci], [100 * c[1] for c in ci], color=color, alpha=0.18, linewidth=0,
                    zorder=2)
    ax.plot(xs, acc, marker=marker, ms=3, color=color, label=label, zorder=3)
    wide = [p for p in pts if p[2] > p[1]]
    for p in wide:  # a merged bin: its span as a horizontal bar
        ax.plot([p[1], p[2]], [100 * p[3] / p[4]] * 2, color=color, linewidth=0.8, alpha=0.7, zorder=3)


def draw_delta(ax, pts, ref, color, label):
    refd = {p[0]: p for p in ref}
    both = [(p, refd[p[0]]) for p in pts if p[0] in refd]
    if not both:
        return
    xs = [p[0] for p, _ in both]
    ds = [newcombe_diff(p[3], p[4], q[3], q[4]) for p, q in both]
    ax.fill_between(xs, [100 * d[1] for d in ds], [100 * d[2] for d in ds], color=color, alpha=0.18, linewidth=0)
    ax.plot(xs, [100 * d[0] for d in ds], marker="o", ms=3, color=color, label=label)


def length_ticks(ax, bins):
    edges = sorted({b[0] for b in bins} | {bins[-1][1]})
    step = max(1, len(edges) // 12)
    ticks = edges[::step]
    if edges[-1] not in ticks:
        ticks.append(edges[-1])
    ax.set_xticks(ticks)
    ax.set_xlim(bins[0][0] - 2, bins[-1][1] + 2)


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    summary_path, out_dir = sys.argv[1], sys.argv[2]
    with open(summary_path) as f:
        summary = json.load(f)
    os.makedirs(out_dir, exist_ok=True)
    settings = summary["study"]["settings"]
    rows = summary["by_length"]
    tasks = summary["study"]["tasks"]
    # Task names become file names (OUT_DIR/<task>.png): posenc writes letters,
    # digits and '_' only; anything else ("../x") would write outside OUT_DIR.
    for task in tasks:
        if not isinstance(task, str) or not re.fullmatch(r"[A-Za-z0-9_]{1,64}", task):
            sys.exit(f"study_report.py: {summary_path}: study.tasks: {task!r} is not a task name "
                     "(letters, digits and '_')")
    given = list(summary["study"]["pes"])
    pes = [p for p in ORDER if p in given] + [p for p in given if p not in ORDER]
    ref_pe = given[0] if given else None
    scalings = ["default"] + [s for s in settings.get("scalings", []) if s != "default"]
    written = []
    for task in tasks:
        if not any(r["task"] == task for r in rows):
            continue
        bins = bins_for(rows, task)
        fig, (ax, axd) = plt.subplots(2, 1, figsize=(8, 6.2), sharex=True, gridspec_kw={"height_ratios": [3, 2]})
        mark_training(ax, settings)
        ref_pts = series(rows, task, ref_pe, "default", bins)[0] if ref_pe else []
        for pe in pes:
            pts, cannot = series(rows, task, pe, "default", bins)
            if not pts and not cannot:
                continue
            c = pe_color(pe, pes)
            draw(ax, pts, c, pe)
            if cannot:
                ax.plot(cannot, [-3] * len(cannot), "x", color=c, ms=5, clip_on=False, zorder=4)
            if pe != ref_pe:
                draw_delta(axd, pts, ref_pts, c, f"{pe} − {ref_pe}")
        ax.set_ylim(-5, 104)
        ax.set_ylabel("exact match (%)")
        per = "one length per bin" if all(b[0] == b[1] for b in bins) else f"bins of ≥{MIN_BIN_SAMPLES} samples"
        ax.set_title(f"{task}: accuracy by length ({per}; 95% Wilson bands; x = cannot run)", fontsize=9)
        ax.legend(fontsize=8, ncol=1, loc="upper left", bbox_to_anchor=(1.01, 1.0))
        ax.grid(alpha=0.3)
        axd.axhline(0, color="black", linewidth=0.8)
        for x in settings["train_lengths"]:
            axd.axvline(x, color="#555555", linestyle="--", linewidth=1)
        axd.set_ylabel(f"Δ vs {ref_pe} (points)")
        axd.set_xlabel("input length (tokens)")
        axd.set_title(f"difference against {ref_pe} (the study's first encoding; 95% Newcombe bands)", fontsize=8)
        axd.grid(alpha=0.3)
        if axd.lines[2:]:
            axd.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
        length_ticks(axd, bins)
        fig.tight_layout()
        path = os.path.join(out_dir, f"{task}.png")
        save_atomic(fig, path)
        written.append(path)

        ropes = [pe for pe in ROPE_PES if pe in pes and any(
            r["task"] == task and r["encoding"] == pe and scaling_of(r) != "default" for r in rows)]
        if not ropes:
            continue
        fig, axes = plt.subplots(2, len(ropes), figsize=(6.5 * len(ropes) + 1.5, 6.2), sharex=True, squeeze=False,
                                 gridspec_kw={"height_ratios": [3, 2]})
        for j, pe in enumerate(ropes):
            ax, axd = axes[0][j], axes[1][j]
            mark_training(ax, settings)
            base = series(rows, task, pe, "default", bins)[0]
            for s in scalings:
                pts, _ = series(rows, task, pe, s, bins)
                col = scaling_color(s, scalings)
                draw(ax, pts, col, s)
                if s != "default":
                    draw_delta(axd, pts, base, col, f"{s} − default")
            ax.set_ylim(-5, 104)
            ax.set_title(f"{task}, {pe}: inference-time RoPE scalings (95% Wilson bands)", fontsize=9)
            ax.grid(alpha=0.3)
            axd.axhline(0, color="black", linewidth=0.8)
            for x in settings["train_lengths"]:
                axd.axvline(x, color="#555555", linestyle="--", linewidth=1)
            axd.set_title("difference against default (95% Newcombe bands)", fontsize=8)
            axd.set_xlabel("input length (tokens)")
            axd.grid(alpha=0.3)
            length_ticks(axd, bins)
            if j == 0:
                ax.set_ylabel("exact match (%)")
                axd.set_ylabel("Δ vs default (points)")
        axes[0][-1].legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
        if axes[1][-1].lines[3:]:
            axes[1][-1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
        fig.tight_layout()
        path = os.path.join(out_dir, f"{task}-scaling.png")
        save_atomic(fig, path)
        written.append(path)

    mrr = summary.get("mrr", {})
    if mrr.get("all"):
        fig, ax = plt.subplots(figsize=(7, 3.5))
        names = [p for p in pes if p in mrr["all"]]
        xs = range(len(names))
        cols = [pe_color(p, pes) for p in names]
        ax.bar([x - 0.2 for x in xs], [mrr["all"][p] for p in names], width=0.4, color=cols, label="all encodings")
        p5 = mrr.get("paper5", {})
        ax.bar([x + 0.2 for x in xs], [p5.get(p, 0) for p in names], width=0.4, color=cols, alpha=0.45, hatch="//",
               edgecolor="white", label="paper's five")
        paper = {"nope": 0.69, "t5": 0.55, "alibi": 0.50, "rope25": 0.33, "sinusoidal": 0.22}
        for i, p in enumerate(names):
            if p in paper:
                ax.plot([i + 0.0, i + 0.4], [paper[p]] * 2, color="k", lw=2)
        ax.set_xticks(list(xs), names)
        ax.set_ylabel("mean reciprocal rank")
        ax.set_title("MRR (black: Kazemnejad et al. 2023; Rotary = rope25, APE = sinusoidal)")
        ax.legend(fontsize=8)
        path = os.path.join(out_dir, "mrr.png")
        save_atomic(fig, path)
        written.append(path)
    for p in written:
        print(f"wrote {p}")


if __name__ == "__main__":
    main()
