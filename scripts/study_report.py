#!/usr/bin/env python3
"""Plots of a posenc length-generalization study (the summary.json that
`posenc study report DIR` writes).

    study_report.py SUMMARY_JSON OUT_DIR

Writes, atomically (temporary file + rename):
  OUT_DIR/<task>.png          exact-match accuracy against input length, one line
                              per encoding with its Wilson 95% band, the training
                              range shaded; lengths a model cannot run are omitted
                              and marked "x" on the axis.
  OUT_DIR/<task>-scaling.png  the RoPE models under each inference-time scaling.
  OUT_DIR/mrr.png             mean reciprocal rank per encoding (all, paper's five).
"""
import json
import os
import re
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from plotio import save_png_atomic  # noqa: E402

ORDER = ["nope", "learned", "sinusoidal", "t5", "alibi", "rope", "rope25"]
COLORS = {
    "nope": "#000000",
    "learned": "#8c564b",
    "sinusoidal": "#9467bd",
    "t5": "#2ca02c",
    "alibi": "#ff7f0e",
    "rope": "#1f77b4",
    "rope25": "#17becf",
}
SCALING_STYLE = {"default": "-", "linear": "--", "ntk": ":", "yarn": "-.", "dynamic": (0, (3, 1, 1, 1, 1, 1))}


def save_atomic(fig, path):
    save_png_atomic(fig, path, dpi=120, bbox_inches="tight")


def series(rows, task, pe, scaling):
    pts = sorted((r for r in rows if r["task"] == task and r["encoding"] == pe and r["scaling"] == scaling),
                 key=lambda r: r["length"])
    ok = [r for r in pts if r["can_run"] and r["samples"] > 0]
    cannot = [r["length"] for r in pts if not r["can_run"]]
    xs = [r["length"] for r in ok]
    ys = [100 * r["accuracy"] for r in ok]
    lo = [100 * r["wilson95"][0] for r in ok]
    hi = [100 * r["wilson95"][1] for r in ok]
    return xs, ys, lo, hi, cannot


def shade_training(ax, settings):
    lo, hi = settings["train_lengths"]
    ax.axvspan(lo, hi, color="0.85", zorder=0, label=f"training lengths {lo}-{hi}")


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
    pes = [p for p in ORDER if p in summary["study"]["pes"]] + [p for p in summary["study"]["pes"] if p not in ORDER]
    written = []
    for task in tasks:
        if not any(r["task"] == task for r in rows):
            continue
        fig, ax = plt.subplots(figsize=(7.5, 4.5))
        shade_training(ax, settings)
        for pe in pes:
            xs, ys, lo, hi, cannot = series(rows, task, pe, "default")
            if not xs and not cannot:
                continue
            c = COLORS.get(pe)
            ax.plot(xs, ys, marker="o", ms=3, color=c, label=pe)
            ax.fill_between(xs, lo, hi, color=c, alpha=0.12, linewidth=0)
            if cannot:
                ax.plot(cannot, [-3] * len(cannot), "x", color=c, ms=5, clip_on=False)
        ax.set_ylim(-5, 102)
        ax.set_xlabel("input length (tokens)")
        ax.set_ylabel("exact match (%)")
        ax.set_title(f"{task}: accuracy by length (x = cannot run)")
        ax.legend(fontsize=8, ncol=2)
        ax.grid(alpha=0.3)
        path = os.path.join(out_dir, f"{task}.png")
        save_atomic(fig, path)
        written.append(path)

        scalings = ["default"] + list(settings["scalings"])
        if not any(r["task"] == task and r["scaling"] != "default" for r in rows):
            continue
        fig, ax = plt.subplots(figsize=(7.5, 4.5))
        shade_training(ax, settings)
        for pe in ("rope", "rope25"):
            for s in scalings:
                xs, ys, _, _, _ = series(rows, task, pe, s)
                if xs:
                    ax.plot(xs, ys, linestyle=SCALING_STYLE.get(s, "-"), color=COLORS[pe], marker=".", ms=3,
                            label=f"{pe} {s}")
        ax.set_ylim(-5, 102)
        ax.set_xlabel("input length (tokens)")
        ax.set_ylabel("exact match (%)")
        ax.set_title(f"{task}: RoPE models under inference-time scalings")
        ax.legend(fontsize=7, ncol=2)
        ax.grid(alpha=0.3)
        path = os.path.join(out_dir, f"{task}-scaling.png")
        save_atomic(fig, path)
        written.append(path)

    mrr = summary.get("mrr", {})
    if mrr.get("all"):
        fig, ax = plt.subplots(figsize=(7, 3.5))
        names = [p for p in pes if p in mrr["all"]]
        xs = range(len(names))
        ax.bar([x - 0.2 for x in xs], [mrr["all"][p] for p in names], width=0.4, label="all encodings")
        p5 = mrr.get("paper5", {})
        ax.bar([x + 0.2 for x in xs], [p5.get(p, 0) for p in names], width=0.4, label="paper's five")
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
