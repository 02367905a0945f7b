#!/usr/bin/env python3
"""The plots and the self-contained HTML report of a `posenc eval` run.

    eval_report.py RUN_DIR

Reads RUN_DIR/summary.json, run.json, ppl.json (if present) and report.txt
(the CLI's text table), writes
  RUN_DIR/plots/heatmap_<task>_<control>_<scaling>.png   depth x length, accuracy coloured
  RUN_DIR/plots/accuracy_<task>_<control>.png            depth-averaged accuracy vs length per scaling
  RUN_DIR/plots/ppl_by_position.png (+ ppl_<scaling>.png) NLL by position bucket
  RUN_DIR/report.html                                     everything above, images inlined (base64)
Uses matplotlib's Agg backend.
"""
import base64
import html
import json
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.colors import ListedColormap  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from plot_ppl import plot_ppl, plot_ppl_by_scaling  # noqa: E402
from plotio import save_png_atomic  # noqa: E402


def order(items):
    out = []
    for x in items:
        if x not in out:
            out.append(x)
    return out


def cell_ok(c):
    return c.get("status", "ok") == "ok" and c["n"] > 0 and c["accuracy"] is not None


def heatmap(cells, task, control, scaling, eff, path):
    cs = [c for c in cells if c["task"] == task and c["control"] == control and c["rope_scaling"] == scaling]
    lengths = sorted({c["length"] for c in cs})
    depths = sorted({c["depth"] for c in cs if c["depth"] is not None})
    rows = depths if depths else [None]
    grid = [[float("nan")] * len(lengths) for _ in rows]
    labels = [[""] * len(lengths) for _ in rows]
    for c in cs:
        i = rows.index(c["depth"]) if c["depth"] is not None else 0
        j = lengths.index(c["length"])
        if cell_ok(c):
            grid[i][j] = c["accuracy"]
            labels[i][j] = f"{c['accuracy']:.2f}\n[{c['ci_low']:.2f},{c['ci_high']:.2f}]"
        else:
            labels[i][j] = "does not\nfit"
    fig, ax = plt.subplots(figsize=(1.35 * len(lengths) + 2.2, 0.75 * len(rows) + 1.6))
    cmap = plt.get_cmap("RdYlGn").copy()
    cmap.set_bad("#cccccc")
    import numpy as np  # matplotlib depends on numpy

    im = ax.imshow(np.ma.masked_invalid(np.array(grid, dtype=float)), cmap=cmap, vmin=0, vmax=1, aspect="auto")
    for i in range(len(rows)):
        for j in range(len(lengths)):
            ax.text(j, i, labels[i][j], ha="center", va="center", fontsize=7)
    ax.set_xticks(range(len(lengths)), [str(L) for L in lengths])
    ax.set_yticks(range(len(rows)), [f"{d:g}" if d is not None else "n/a" for d in rows])
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("needle depth")
    n = cs[0]["n"] if cs else 0
    sub = ""
    if eff:
        if eff.get("baseline") is None:
            sub = eff["status"]
        elif not eff["solvable"]:
            sub = (f"not solvable by this model (baseline {eff['baseline']:.2f}, "
                   f"95% CI low {eff.get('baseline_ci_low', 0):.2f} vs chance {eff.get('chance', 0):.2f})")
        else:
            L = eff["length"]
            sub = f"effective context {L if L is not None else 'none'} (baseline {eff['baseline']:.2f}, threshold {eff['threshold']:.2f})"
    ax.set_title(f"{task} / {scaling}" + (f" / control {control}" if control != "none" else "") + f"  (n={n} per cell)\n{sub}",
                 fontsize=9)
    fig.colorbar(im, ax=ax, label="accuracy")
    fig.tight_layout()
    save_png_atomic(fig, path, dpi=110)


def accuracy_plot(summary, task, control, path):
    effs = [e for e in summary["effective_context"] if e["task"] == task and e["control"] == control]
    cells = [c for c in summary["cells"] if c["task"] == task and c["control"] == control]
    if not cells:
        return False
    fig, ax = plt.subplots(figsize=(6, 4))
    cmap = plt.get_cmap("tab10")
    for j, s in enumerate(order([c["rope_scaling"] for c in cells])):
        cs = [c for c in cells if c["rope_scaling"] == s and cell_ok(c)]
        lengths = sorted({c["length"] for c in cs})
        acc, lo, hi = [], [], []
        for L in lengths:
            xs = [c for c in cs if c["length"] == L]
            k = sum(c["correct"] for c in xs)
            n = sum(c["n"] for c in xs)
            acc.append(sum(c["accuracy"] for c in xs) / len(xs))
            # Wilson interval of the pooled depths (same formula as the C++ side).
            z = 1.959963984540054
            p = k / n
            d = 1 + z * z / n
            ctr = (p + z * z / (2 * n)) / d
            h = z / d * ((p * (1 - p) / n + z * z / (4 * n * n)) ** 0.5)
            lo.append(max(0.0, ctr - h))
            hi.append(min(1.0, ctr + h))
        if not lengths:
            continue
        ax.plot(lengths, acc, marker="o", color=cmap(j % 10), label=s)
        ax.fill_between(lengths, lo, hi, color=cmap(j % 10), alpha=0.15)
    if effs and effs[0].get("chance"):
        ax.axhline(effs[0]["chance"], color="grey", linestyle=":", linewidth=1, label="chance")
    ax.set_xscale("log", base=2)
    ax.set_ylim(-0.02, 1.02)
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("accuracy (mean over depths)")
    ax.set_title(f"{task}" + (f" / control {control}" if control != "none" else "") + ": accuracy vs length (95% Wilson band, pooled)",
                 fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_png_atomic(fig, path, dpi=110)
    return True


def esc(x):
    """Every text inserted into report.html, from any file, goes through this."""
    return html.escape(str(x), quote=True)


def fname(x):
    """A name from summary.json used in a plot's file name: one safe path component."""
    return "".join(ch if ch.isascii() and (ch.isalnum() or ch in "._-") else "_" for ch in str(x)).lstrip(".") or "_"


def img(path):
    with open(path, "rb") as f:
        return "data:image/png;base64," + base64.b64encode(f.read()).decode("ascii")


def main(argv):
    if len(argv) != 1:
        raise SystemExit(__doc__)
    run_dir = argv[0]
    with open(os.path.join(run_dir, "summary.json")) as f:
        summary = json.load(f)
    with open(os.path.join(run_dir, "run.json")) as f:
        run = json.load(f)
    ppl = None
    if os.path.exists(os.path.join(run_dir, "ppl.json")):
        with open(os.path.join(run_dir, "ppl.json")) as f:
            ppl = json.load(f)
    text = ""
    if os.path.exists(os.path.join(run_dir, "report.txt")):
        with open(os.path.join(run_dir, "report.txt")) as f:
            text = f.read()
    plots = os.path.join(run_dir, "plots")
    os.makedirs(plots, exist_ok=True)
    cells = summary["cells"]
    eff = {(e["task"], e["control"], e["rope_scaling"]): e for e in summary["effective_context"]}
    sections = []
    for task in order([c["task"] for c in cells]):
        for control in order([c["control"] for c in cells if c["task"] == task]):
            parts = []
            acc_path = os.path.join(plots, f"accuracy_{fname(task)}_{fname(control)}.png")
            if accuracy_plot(summary, task, control, acc_path):
                parts.append(acc_path)
            for s in order([c["rope_scaling"] for c in cells if c["task"] == task and c["control"] == control]):
                p = os.path.join(plots, f"heatmap_{fname(task)}_{fname(control)}_{fname(s)}.png")
                heatmap(cells, task, control, s, eff.get((task, control, s)), p)
                parts.append(p)
            sections.append((f"{task}" + (f" — control {control}" if control != "none" else ""), parts))
    ppl_parts = []
    ppl_table = ""
    if ppl and ppl.get("results"):
        p = os.path.join(plots, "ppl_by_position.png")
        plot_ppl(ppl, p)
        ppl_parts.append(p)
        ppl_parts += plot_ppl_by_scaling(ppl, os.path.join(plots, "ppl_"))
        buckets = sorted({(b["start"], b["end"]) for r in ppl["results"] for b in r["buckets"]})
        head = "".join(f"<th>[{esc(s)},{esc(e)})</th>" for s, e in buckets)
        rows = []
        for r in ppl["results"]:
            bmap = {(b["start"], b["end"]): b for b in r["buckets"]}
            tds = "".join(
                f"<td>{esc(format(bmap[k]['nll'], '.4f'))}</td>" if k in bmap and bmap[k]["tokens"] > 0 else "<td>-</td>" for k in buckets)
            rows.append(f"<tr><td>{esc(r['context'])}</td><td>{esc(r['rope_scaling'])}</td><td>{esc(format(r['factor'], 'g'))}</td>"
                        f"<td>{esc(format(r['ppl'], '.4f'))}</td><td>{esc(format(r['nll'], '.4f'))}</td><td>{esc(r['tokens'])}</td>{tds}</tr>")
        ppl_table = ("<table><tr><th>context</th><th>scaling</th><th>factor</th><th>ppl</th><th>nll</th><th>tokens</th>"
                     + head + "</tr>" + "".join(rows) + "</table>")

    out = ["<!DOCTYPE html><html><head><meta charset='utf-8'><title>posenc eval report "
           + esc(summary.get("run_id", "")) + "</title>",
           "<style>body{font-family:sans-serif;margin:2em;max-width:1400px} pre{background:#f6f6f6;padding:1em;"
           "overflow-x:auto;font-size:12px} table{border-collapse:collapse;font-size:12px} td,th{border:1px solid #ccc;"
           "padding:2px 6px;text-align:right} img{max-width:100%;margin:4px;border:1px solid #eee}</style></head><body>",
           f"<h1>posenc eval — run {esc(summary.get('run_id', ''))}</h1>",
           f"<p>model <code>{esc(run['model']['path'])}</code> (trained context {esc(run['model']['trained_context'])}), "
           f"haystack <code>{esc(run['haystack']['path'] or 'none')}</code>, {esc(summary['cells_present'])} of "
           f"{esc(summary['cells_expected'])} cells, threshold {esc(summary['threshold'])} × baseline, "
           f"min baseline {esc(summary['min_baseline'])}, git {esc(run.get('git_hash'))}, date {esc(run.get('date', ''))}.</p>",
           "<h2>Summary</h2><pre>" + esc(text) + "</pre>"]
    if ppl_parts:
        out.append("<h2>Perplexity by position</h2>" + ppl_table)
        out += [f"<img src='{img(p)}'>" for p in ppl_parts]
    for title, parts in sections:
        out.append(f"<h2>{esc(title)}</h2>")
        out += [f"<img src='{img(p)}'>" for p in parts]
    out.append("<h2>Run configuration</h2><pre>" + esc(json.dumps(
        {k: run[k] for k in run if k not in ("ppl_header",)}, indent=2)) + "</pre>")
    out.append("</body></html>")
    tmp = os.path.join(run_dir, ".report.html.tmp")
    with open(tmp, "w") as f:
        f.write("\n".join(out))
    os.replace(tmp, os.path.join(run_dir, "report.html"))


if __name__ == "__main__":
    main(sys.argv[1:])
