#!/usr/bin/env python3
"""The plots and the self-contained HTML report of a `posenc eval` run.

    eval_report.py RUN_DIR

Reads RUN_DIR/summary.json (schema_version 2, or the older format without
schema_version), run.json, ppl.json (if present) and report.txt (the CLI's text
table), and writes
  RUN_DIR/plots/heatmaps_<task>_<control>.png  depth x length heatmaps, one panel per scaling, and under
                                               them the difference maps (scaling - default)
  RUN_DIR/plots/accuracy_<task>_<control>.png  accuracy (pooled over depths) vs length per scaling with
                                               95% Wilson bands, the chance level, and the difference
                                               against default with Newcombe 95% bands
  RUN_DIR/plots/ppl_by_position.png (+ ppl_<scaling>.png)  NLL by position bucket (plot_ppl.py)
  RUN_DIR/report.html                          contents, run configuration, every summary as an HTML
                                               table and every plot above
Every file is written atomically (temporary file + rename). The images are
embedded in report.html as data: URIs so that the one file can be copied, mailed
or attached to an issue on its own; the PNGs stay in plots/ for slides.

Accuracy colours (cividis, a colour-vision-deficiency-safe sequential map) run
from the task's chance level to 1: the chance level measured by the "absent"
control (summary "chance", one level per task x scaling x metric) when the run
has it, else 1/K for forced choice and 0 for generation; each caption says which.
Measured levels are never pooled over scalings (the same prompts are scored under
each): every panel and caption names its scaling's own level, the shared colour
scale starts at the lowest of them, and a line for all scalings gives their range.
Bold in the per-length tables follows the effective-context gate: the cell's
Wilson lower bound above the measured chance's upper 95% bound.
Uses matplotlib's Agg backend.
"""
import base64
import html
import json
import math
import os
import sys
import tempfile

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402  (matplotlib depends on numpy)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from plotio import length_axis, mark_trained_context_columns, newcombe_diff, save_png_atomic, scaling_color, wilson  # noqa: E402

SEQ_CMAP = "cividis"
DIFF_CMAP = "PuOr"  # ColorBrewer diverging, colour-blind safe
CHANCE_CONTROL = "absent"


def order(items):
    out = []
    for x in items:
        if x not in out:
            out.append(x)
    return out


def esc(x):
    """Every text inserted into report.html, from any file, goes through this."""
    return html.escape(str(x), quote=True)


def fname(x):
    """A name from summary.json used in a plot's file name: one safe path component."""
    return "".join(ch if ch.isascii() and (ch.isalnum() or ch in "._-") else "_" for ch in str(x)).lstrip(".") or "_"


def anchor(*parts):
    return "s-" + "-".join(fname(p) for p in parts)


def f2(x, digits=2):
    return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def cell_ok(c):
    return c.get("status", "ok") == "ok" and c.get("n", 0) > 0 and c.get("accuracy") is not None


class Run:
    """summary.json + run.json of one run, with the schema differences resolved."""

    def __init__(self, summary, run):
        self.summary = summary
        self.run = run
        self.schema = summary.get("schema_version", 1)
        self.tasks_meta = {t["name"]: t for t in run.get("tasks", []) if isinstance(t, dict) and "name" in t}
        cfg = run.get("config", {})
        self.k = cfg.get("choices")
        t = (run.get("model") or {}).get("trained_context")
        # a number only; anything else is shown (escaped) in the configuration table and not drawn
        self.trained = t if isinstance(t, int) and not isinstance(t, bool) and t > 0 else None
        self.cells = summary.get("cells", [])
        self.tasks = order([c["task"] for c in self.cells])
        self.scalings = order([c["rope_scaling"] for c in self.cells])
        self.eff = summary.get("effective_context", [])
        self.chance_rows = summary.get("chance") or []

    def kind(self, task):
        k = self.tasks_meta.get(task, {}).get("kind")
        if k:
            return k
        cs = [c for c in self.cells if c["task"] == task]
        return "choice" if cs and cs[0].get("metric", "") in ("acc", "acc_norm") else "generation"

    def primary_metric(self, task):
        for c in self.cells:
            if c["task"] == task and c.get("metric"):
                return c["metric"]
        # Before schema 2 a forced-choice cell held the summed log-probability
        # score (lm-evaluation-harness acc); a generation task its own metric.
        if self.kind(task) == "choice":
            return "acc"
        return self.tasks_meta.get(task, {}).get("metric", "accuracy")

    def metrics(self, task):
        names = []
        for c in self.cells:
            if c["task"] == task:
                names += list((c.get("metrics") or {}).keys())
        p = self.primary_metric(task)
        return [p] + [m for m in order(names) if m != p]

    def cell_metric(self, c, metric):
        """(correct, n) of a cell under `metric`, None when the cell does not hold it."""
        if not cell_ok(c):
            return None
        ms = c.get("metrics") or {}
        if metric in ms:
            return ms[metric]["correct"], c["n"]
        if metric == self.primary_metric(c["task"]) or metric == c.get("metric"):
            return c["correct"], c["n"]
        return None

    def controls(self, task):
        return order([c["control"] for c in self.cells if c["task"] == task and c["control"] != CHANCE_CONTROL])

    def eff_entry(self, task, control, scaling, metric):
        best = None
        for e in self.eff:
            if e["task"] == task and e["control"] == control and e["rope_scaling"] == scaling:
                m = e.get("metric")
                if m == metric:
                    return e
                if m is None and metric == self.primary_metric(task):
                    best = e
        return best

    def chance(self, task, scaling, metric):
        """{"accuracy","ci_low","ci_high","n","source","assumed"}: source is "measured" (the absent control),
        "assumed" (1/K of forced choice, no measurement) or "none" (generation, 0)."""
        for r in self.chance_rows:
            if r["task"] == task and r["rope_scaling"] == scaling and r.get("metric", metric) == metric:
                return {"accuracy": r["accuracy"], "ci_low": r.get("ci_low"), "ci_high": r.get("ci_high"),
                        "n": r.get("n"), "source": "measured", "assumed": r.get("assumed")}
        e = self.eff_entry(task, "none", scaling, metric)
        if self.kind(task) != "choice":
            return {"accuracy": 0.0, "ci_low": None, "ci_high": None, "n": None, "source": "none", "assumed": 0.0}
        assumed = (1.0 / self.k) if self.k else (e or {}).get("chance")
        if e is not None and e.get("chance_source") == "measured":
            return {"accuracy": e["chance"], "ci_low": e.get("chance_ci_low"), "ci_high": e.get("chance_ci_high"),
                    "n": None, "source": "measured", "assumed": assumed}
        if e is not None and e.get("chance") is not None:
            assumed = e["chance"]
        return {"accuracy": assumed if assumed is not None else 0.0, "ci_low": None, "ci_high": None, "n": None,
                "source": "assumed", "assumed": assumed}

    def chances(self, task, metric):
        """[(scaling, chance)] of every scaling of the task: each scaling's own level. The absent control is
        measured separately per scaling (the same samples under each encoding), so levels of different scalings
        are never added up as if they were independent samples."""
        return [(s, self.chance(task, s, metric)) for s in self.scalings_of(task)]

    def anchor_chance(self, task, metric):
        """The lowest of the per-scaling chance levels: the one anchor of a colour scale shared by all panels."""
        cs = [c["accuracy"] for _, c in self.chances(task, metric)]
        return min(cs) if cs else 0.0

    def family(self):
        f = (self.run.get("model") or {}).get("family")
        return f if isinstance(f, str) and f else None

    def scaling_title(self, s):
        """A panel's name for scaling s: a model without RoPE has no scaling; its one series is its family's."""
        f = self.family()
        if s == "default" and f is not None and f != "rope":
            return f"{f} positions"
        return s

    def fits(self, task, control, scaling, length):
        """False when the run recorded the cell(s) at this length as not fitting the model's context."""
        cs = [c for c in self.cells if c["task"] == task and c["control"] == control and c["rope_scaling"] == scaling
              and c["length"] == length]
        return not (cs and all(c.get("status") == "does not fit" for c in cs))

    def scalings_of(self, task):
        return order([c["rope_scaling"] for c in self.cells if c["task"] == task])

    def pooled(self, task, control, scaling, metric):
        """{length: (correct, n)} pooled over depths."""
        out = {}
        for c in self.cells:
            if c["task"] == task and c["control"] == control and c["rope_scaling"] == scaling:
                km = self.cell_metric(c, metric)
                if km is None:
                    continue
                k0, n0 = out.get(c["length"], (0, 0))
                out[c["length"]] = (k0 + km[0], n0 + km[1])
        return dict(sorted(out.items()))

    def unsolvable(self, task):
        """True when the run says no scaling solves the task (control none, primary metric)."""
        m = self.primary_metric(task)
        es = [self.eff_entry(task, "none", s, m) for s in self.scalings_of(task)]
        return bool(es) and all(e is not None and e.get("solvable") is False for e in es)


def chance_levels(chs, k=None, collapse=False):
    """Caption text of per-scaling chance levels [(scaling, chance)]: each scaling's own level and n, or with
    collapse=True one line for all scalings (the range of their levels, never their samples added up)."""
    if not chs:
        return "chance 0"
    srcs = {c["source"] for _, c in chs}
    if srcs != {"measured"}:
        return chance_caption(chs[0][1], k)
    tail = f" measured by the '{CHANCE_CONTROL}' control (evidence removed), separately per scaling"
    if collapse:
        lo = min(c["accuracy"] for _, c in chs)
        hi = max(c["accuracy"] for _, c in chs)
        n = {c.get("n") for _, c in chs}
        ns = f", n={n.pop()} each" if len(n) == 1 and None not in n else ""
        return (f"chance {f2(lo)}" + (f"–{f2(hi)}" if f2(hi) != f2(lo) else "") + tail + ns)
    parts = []
    for s, c in chs:
        ci = f" [{f2(c['ci_low'])}, {f2(c['ci_high'])}]" if c.get("ci_low") is not None else ""
        n = f" (n={c['n']})" if c.get("n") else ""
        parts.append(f"{s} {f2(c['accuracy'])}{ci}{n}")
    return "chance" + tail + ": " + "; ".join(parts)


def chance_caption(ch, k=None):
    if ch["source"] == "measured":
        ci = f" [{f2(ch['ci_low'])}, {f2(ch['ci_high'])}]" if ch.get("ci_low") is not None else ""
        n = f", n={ch['n']}" if ch.get("n") else ""
        return f"chance {f2(ch['accuracy'])}{ci} measured by the '{CHANCE_CONTROL}' control (evidence removed{n})"
    if ch["source"] == "assumed":
        return (f"chance {f2(ch['accuracy'])} assumed = 1/K" + (f" (K={k})" if k else "") +
                ": this run has no measured chance level")
    return "chance 0 (generation task: no guessing level)"


# ---------------------------------------------------------------- plots


def _edges(centres):
    """Cell edges around sorted centres (midpoints; the end cells as wide as their neighbour)."""
    c = list(centres)
    if len(c) == 1:
        return [c[0] - 0.5, c[0] + 0.5]
    mids = [(a + b) / 2 for a, b in zip(c, c[1:])]
    return [c[0] - (mids[0] - c[0])] + mids + [c[-1] + (c[-1] - mids[-1])]


def _text_colour(cmap, norm, v):
    r, g, b, _ = cmap(norm(v))
    return "black" if 0.299 * r + 0.587 * g + 0.114 * b > 0.5 else "white"


def heatmaps(R, task, control, path):
    """One row of depth x length heatmaps (one per scaling, one colour scale anchored at chance), and
    under it the difference maps against default. Columns sit at log2(length)."""
    metric = R.primary_metric(task)
    scalings = R.scalings_of(task)
    cs = [c for c in R.cells if c["task"] == task and c["control"] == control]
    lengths = sorted({c["length"] for c in cs})
    depths = sorted({c["depth"] for c in cs if c["depth"] is not None})
    rows = depths if depths else [None]
    xs = [math.log2(L) for L in lengths]
    xe = _edges(xs)
    ye = _edges(list(range(len(rows))))

    def grid(s):
        g = np.full((len(rows), len(lengths)), np.nan)
        kn = {}
        for c in cs:
            if c["rope_scaling"] != s:
                continue
            i = rows.index(c["depth"]) if c["depth"] is not None else 0
            j = lengths.index(c["length"])
            km = R.cell_metric(c, metric)
            if km is not None:
                g[i, j] = km[0] / km[1]
                kn[(i, j)] = km
        return g, kn

    grids = {s: grid(s) for s in scalings}
    chs = dict(R.chances(task, metric))
    vmin = min(max(R.anchor_chance(task, metric), 0.0), 0.95)
    seq = plt.get_cmap(SEQ_CMAP).copy()
    seq.set_bad("#e8e8e8")
    norm = matplotlib.colors.Normalize(vmin=vmin, vmax=1.0)
    others = [s for s in scalings if s != "default"] if "default" in scalings else []
    nrow = 2 if others else 1
    ncol = len(scalings)
    pw = max(2.6, 0.62 * len(lengths) + 1.2)
    ph = max(1.9, 0.34 * len(rows) + 1.3)
    fig, axes = plt.subplots(nrow, ncol, figsize=(pw * ncol + 1.2, ph * nrow + 0.5), squeeze=False,
                             layout="constrained")
    fs = 7 if len(lengths) <= 6 else 6

    def style(ax, title):
        ax.set_xlim(xe[0], xe[-1])
        ax.set_ylim(ye[-1], ye[0])
        ax.set_xticks(xs)
        ax.set_xticklabels([str(L) for L in lengths], fontsize=7, rotation=45 if len(lengths) > 5 else 0)
        ax.set_yticks(range(len(rows)))
        ax.set_yticklabels([f"{d:g}" if d is not None else "–" for d in rows], fontsize=7)
        ax.set_xlabel("context length (tokens, log2)", fontsize=7)
        ax.set_title(title, fontsize=8)
        mark_trained_context_columns(ax, R.trained, lengths, xs, xe)
    im = None
    for j, s in enumerate(scalings):
        ax = axes[0][j]
        g, kn = grids[s]
        im = ax.pcolormesh(xe, ye, np.ma.masked_invalid(g), cmap=seq, norm=norm, shading="flat")
        for (i, jj), (k, n) in kn.items():
            v = k / n
            ax.text(xs[jj], i, f"{v:.2f}", ha="center", va="center", fontsize=fs,
                    color=_text_colour(seq, norm, max(v, vmin)))
        for i in range(len(rows)):
            for jj in range(len(lengths)):
                if math.isnan(g[i, jj]):
                    fit = R.fits(task, control, s, lengths[jj])
                    ax.text(xs[jj], i, "n/a" if fit else "does not\nfit", ha="center", va="center",
                            fontsize=fs if fit else fs - 1, color="#555555")
        c = chs.get(s)
        style(ax, R.scaling_title(s) + (f" (chance {c['accuracy']:.2f})" if c and c["source"] == "measured" else ""))
        if j == 0:
            ax.set_ylabel("needle depth" if depths else "", fontsize=7)
    cb = fig.colorbar(im, ax=list(axes[0]), extend="min" if vmin > 0 else "neither", fraction=0.04, pad=0.01, aspect=15)
    cb.set_label(f"{metric} (from chance {vmin:.2f})", fontsize=7)
    cb.ax.tick_params(labelsize=7)
    if others:
        base_g, base_kn = grids["default"]
        diffs = {}
        dmax = 0.1
        for s in others:
            g, kn = grids[s]
            d = g - base_g
            diffs[s] = d
            if np.isfinite(d).any():
                dmax = max(dmax, float(np.nanmax(np.abs(d))))
        dmax = math.ceil(dmax * 10 - 1e-9) / 10
        dcmap = plt.get_cmap(DIFF_CMAP).copy()
        dcmap.set_bad("#e8e8e8")
        dnorm = matplotlib.colors.Normalize(vmin=-dmax, vmax=dmax)
        ax0 = axes[1][0]
        ax0.axis("off")
        ax0.text(0.5, 0.5, "difference maps:\nscaling − default\n(* = Newcombe 95%\ninterval excludes 0)",
                 ha="center", va="center", fontsize=7, transform=ax0.transAxes)
        dim = None
        for j, s in enumerate(scalings):
            if s == "default":
                continue
            ax = axes[1][j]
            d = diffs[s]
            dim = ax.pcolormesh(xe, ye, np.ma.masked_invalid(d), cmap=dcmap, norm=dnorm, shading="flat")
            g, kn = grids[s]
            for (i, jj), (k, n) in kn.items():
                if (i, jj) not in base_kn:
                    continue
                k0, n0 = base_kn[(i, jj)]
                dd, lo, hi = newcombe_diff(k, n, k0, n0)
                star = "*" if lo > 0 or hi < 0 else ""
                ax.text(xs[jj], i, f"{dd:+.2f}{star}", ha="center", va="center", fontsize=fs,
                        color="black" if abs(dd) < 0.6 * dmax else "white")
            style(ax, f"{R.scaling_title(s)} − default")
        if "default" in scalings and scalings.index("default") != 0:
            axes[1][scalings.index("default")].axis("off")
        cb2 = fig.colorbar(dim, ax=list(axes[1]), fraction=0.04, pad=0.01, aspect=15)
        cb2.set_label(f"Δ {metric}", fontsize=7)
        cb2.ax.tick_params(labelsize=7)
    n = cs[0]["n"] if cs else 0
    fig.suptitle(f"{task}" + (f" / control {control}" if control != "none" else "") +
                 f": {metric} per cell (n={n} samples per cell)", fontsize=9)
    save_png_atomic(fig, path, dpi=110)


def diff_points(pts, base, lengths):
    """[(d, low, high)] of pts - base at each length: the Newcombe 95% interval, except where the two per-length
    counts are identical (same correct, same n; e.g. a scaling equal to default at L <= T, the same encoding,
    samples and predictions), where the difference is exactly 0 with no band (low = high = d)."""
    out = []
    for L in lengths:
        if pts[L] == base[L]:
            out.append((0.0, 0.0, 0.0))
        else:
            out.append(newcombe_diff(*pts[L], *base[L]))
    return out


def accuracy_plot(R, task, control, path):
    metric = R.primary_metric(task)
    scalings = R.scalings_of(task)
    series = {s: R.pooled(task, control, s, metric) for s in scalings}
    lengths = sorted({L for v in series.values() for L in v})
    if not lengths:
        return False
    has_delta = "default" in scalings and len(scalings) > 1
    fig, axes = plt.subplots(2 if has_delta else 1, 1, figsize=(8.4, 5.6 if has_delta else 3.8), sharex=True,
                             squeeze=False, gridspec_kw={"height_ratios": [3, 2]} if has_delta else None)
    ax = axes[0][0]
    chs = R.chances(task, metric)
    if chs and all(c["source"] == "measured" for _, c in chs):
        # each scaling's own measured level (its own samples), in its colour
        for s, c in chs:
            col = scaling_color(s, scalings)
            if c.get("ci_low") is not None:
                ax.axhspan(c["ci_low"], c["ci_high"], color=col, alpha=0.06, linewidth=0, zorder=0)
            ax.axhline(c["accuracy"], color=col, linestyle=":", linewidth=1.2,
                       label=f"chance {R.scaling_title(s)} {c['accuracy']:.2f} (measured)", zorder=1)
    elif chs:
        ch = chs[0][1]
        ax.axhline(ch["accuracy"], color="#777777", linestyle=":", linewidth=1.2,
                   label=f"chance {ch['accuracy']:.2f} ({ch['source']})", zorder=1)
    n_s = len(scalings)
    for i, s in enumerate(scalings):
        pts = series[s]
        if not pts:
            continue
        Ls = list(pts)
        # a small horizontal offset per scaling keeps identical lines and their bands visible
        off = [L * 2 ** ((i - (n_s - 1) / 2) * 0.03) for L in Ls]
        acc = [k / n for k, n in pts.values()]
        ci = [wilson(k, n) for k, n in pts.values()]
        col = scaling_color(s, scalings)
        ax.fill_between(off, [c[0] for c in ci], [c[1] for c in ci], color=col, alpha=0.15, linewidth=0)
        ax.plot(off, acc, marker="o", ms=4, color=col, label=R.scaling_title(s), zorder=3)
    ax.set_ylim(-0.02, 1.02)
    ax.set_ylabel(f"{metric} (pooled over depths)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.set_title(f"{task}" + (f" / control {control}" if control != "none" else "") +
                 ": accuracy vs length (95% Wilson bands)", fontsize=9)
    length_axis(ax, lengths, R.trained)
    ax.set_xlabel("")
    if has_delta:
        ax2 = axes[1][0]
        ax2.axhline(0, color="black", linewidth=0.8)
        base = series["default"]
        for i, s in enumerate(scalings):
            if s == "default":
                continue
            Ls = [L for L in series[s] if L in base]
            if not Ls:
                continue
            ds = diff_points(series[s], base, Ls)
            off = [L * 2 ** ((i - (n_s - 1) / 2) * 0.03) for L in Ls]
            col = scaling_color(s, scalings)
            ax2.fill_between(off, [d[1] for d in ds], [d[2] for d in ds], color=col, alpha=0.15, linewidth=0)
            ax2.plot(off, [d[0] for d in ds], marker="o", ms=4, color=col, label=f"{s} − default")
        ax2.set_ylabel(f"Δ {metric} vs default")
        ax2.grid(True, alpha=0.3)
        ax2.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
        ax2.set_title("difference against default (95% Newcombe bands)", fontsize=8)
        length_axis(ax2, lengths, R.trained)
    fig.tight_layout()
    save_png_atomic(fig, path, dpi=110)
    return True


# ---------------------------------------------------------------- tables


def table(head, rows, cls=""):
    h = "".join(f"<th>{x}</th>" for x in head)
    body = "".join("<tr>" + "".join(f"<td>{x}</td>" for x in r) + "</tr>" for r in rows)
    return f"<table class='{cls}'><thead><tr>{h}</tr></thead><tbody>{body}</tbody></table>"


def flatten(prefix, v, out):
    if isinstance(v, dict):
        for k in v:
            flatten(f"{prefix}.{k}" if prefix else str(k), v[k], out)
    elif isinstance(v, list) and all(not isinstance(x, (dict, list)) for x in v):
        out.append((prefix, ", ".join("null" if x is None else str(x) for x in v)))
    else:
        out.append((prefix, json.dumps(v) if not isinstance(v, str) else v))


def _is_number(v):
    try:
        return math.isfinite(float(v))
    except (TypeError, ValueError):
        return False


def config_section(R):
    run = R.run
    groups = [("run", {k: run[k] for k in ("run_id", "date", "command", "posenc_version", "git_hash",
                                           "generator_version", "threads", "scoring") if k in run}),
              ("model", run.get("model", {})), ("tokenizer", run.get("tokenizer", {})),
              ("haystack", run.get("haystack", {})), ("config", run.get("config", {})),
              ("seeds", run.get("seeds", {})), ("timing", run.get("timing", {}))]
    known = {"run_id", "date", "command", "posenc_version", "git_hash", "generator_version", "threads", "scoring",
             "model", "tokenizer", "haystack", "config", "seeds", "timing", "tasks", "encodings", "ppl_header"}
    rest = {k: run[k] for k in run if k not in known}
    if rest:
        groups.append(("other", rest))
    rows = []
    for g, d in groups:
        items = []
        flatten("", d, items)
        items = [(k, f"{float(v):.1f}" if k == "samples_per_second" and _is_number(v) else v) for k, v in items]
        for i, (k, v) in enumerate(items):
            val = f"<code>{esc(v)}</code>" if k in ("command", "path") or k.endswith(".path") else esc(v)
            rows.append((f"<b>{esc(g)}</b>" if i == 0 else "", esc(k), val))
    out = [table(["section", "key", "value"], rows, "config")]
    tasks = run.get("tasks", [])
    if tasks:
        out.append("<h3>Task definitions</h3>")
        out.append(table(["task", "kind", "metric", "uses depth", "uses haystack", "description"],
                         [(esc(t.get("name")), esc(t.get("kind")), esc(t.get("metric")), esc(t.get("uses_depth")),
                           esc(t.get("uses_haystack")), f"<span class='l'>{esc(t.get('description', ''))}</span>")
                          for t in tasks]))
    encs = run.get("encodings", [])
    if encs:
        keys = order([k for e in encs for k in e])
        out.append(f"<details><summary>RoPE encodings per scaling and length ({len(encs)})</summary>")
        out.append(table([esc(k) for k in keys], [[esc(e.get(k, "")) for k in keys] for e in encs]))
        out.append("</details>")
    return "\n".join(out)


def ci_txt(k, n):
    lo, hi = wilson(k, n)
    return f"{k / n:.2f} <span class='ci'>[{lo:.2f}, {hi:.2f}]</span>"


def effective_table(R):
    rows = []
    for task in R.tasks:
        for m in R.metrics(task):
            for control in R.controls(task):
                for s in R.scalings_of(task):
                    e = R.eff_entry(task, control, s, m)
                    if e is None:
                        continue
                    ch = R.chance(task, s, m)
                    base = "–" if e.get("baseline") is None else (
                        f"{f2(e['baseline'])} <span class='ci'>[{f2(e.get('baseline_ci_low'))}, "
                        f"{f2(e.get('baseline_ci_high'))}]</span> at {esc(e.get('baseline_length'))}")
                    if e.get("baseline") is None:
                        verdict = esc(e.get("status", ""))
                    elif not e.get("solvable", True):
                        verdict = "<span class='bad'>not solvable</span> (baseline not above chance)"
                    else:
                        verdict = f"<b>{esc(e['length']) if e.get('length') is not None else 'none'}</b>"
                    chtxt = f"{f2(ch['accuracy'])} ({esc(ch['source'])})"
                    rows.append((esc(task), esc(control), esc(s), esc(m) + (" (primary)" if m == R.primary_metric(task) else ""),
                                 base, f2(e.get("threshold")), chtxt, verdict))
    if not rows:
        return "<p>No effective-context entries in summary.json.</p>"
    return table(["task", "control", "scaling", "metric", "short baseline [95% CI] at length", "threshold",
                  "chance (source)", "effective context"], rows)


def chance_table(R):
    rows = []
    for task in R.tasks:
        for m in R.metrics(task):
            for s in R.scalings_of(task):
                ch = R.chance(task, s, m)
                ci = (f"<span class='ci'>[{f2(ch['ci_low'])}, {f2(ch['ci_high'])}]</span>"
                      if ch.get("ci_low") is not None else "")
                assumed = ch.get("assumed")
                agrees = ""
                if ch["source"] == "measured" and assumed is not None and ch.get("ci_low") is not None:
                    agrees = "yes" if ch["ci_low"] <= assumed <= ch["ci_high"] else "<span class='bad'>no</span>"
                rows.append((esc(task), esc(R.kind(task)), esc(s), esc(m), f"{f2(ch['accuracy'])} {ci}",
                             esc(ch.get("n") or ""), esc(ch["source"]), f2(assumed), agrees))
    head = ["task", "kind", "scaling", "metric", "chance [95% CI]", "n", "source", "1/K", "1/K inside the CI?"]
    note = ("<p class='cap'>measured: accuracy of the '" + CHANCE_CONTROL + "' control (the same samples with the "
            "evidence removed), pooled over lengths; assumed: 1/K (this run has no measurement); none: generation "
            "task, chance 0.</p>")
    return table(head, rows) + note


def chance_gate(ch):
    """The level a cell's Wilson lower bound must exceed to count as above chance: the measured chance's upper
    95% bound (as the effective-context gate), else the level itself (assumed 1/K, or 0 for generation)."""
    if ch["source"] == "measured" and ch.get("ci_high") is not None:
        return ch["ci_high"]
    return ch["accuracy"]


def length_table(R, task, control):
    lengths = sorted({c["length"] for c in R.cells if c["task"] == task and c["control"] == control})
    rows = []
    for s in R.scalings_of(task):
        for m in R.metrics(task):
            pts = R.pooled(task, control, s, m)
            if not pts:
                continue
            gate = chance_gate(R.chance(task, s, m))
            tds = []
            for L in lengths:
                if L not in pts:
                    tds.append("n/a" if R.fits(task, control, s, L) else "does not fit")
                    continue
                k, n = pts[L]
                lo, _ = wilson(k, n)
                tds.append(("<span class='above'>" if lo > gate else "<span>") + ci_txt(k, n) + "</span>")
            rows.append([esc(s), esc(m)] + tds)
    return table(["scaling", "metric"] + [f"L={esc(L)}" + (" (T)" if L == R.trained else "") for L in lengths], rows)


def controls_table(R):
    rows = []
    for task in R.tasks:
        lengths = sorted({c["length"] for c in R.cells if c["task"] == task})
        m = R.primary_metric(task)
        ctrls = R.controls(task) + ([CHANCE_CONTROL] if any(c["task"] == task and c["control"] == CHANCE_CONTROL
                                                             for c in R.cells) else [])
        if ctrls == ["none"]:
            continue
        for control in ctrls:
            for s in R.scalings_of(task):
                pts = R.pooled(task, control, s, m)
                rows.append([esc(task), esc(control), esc(s), esc(m)] +
                            [ci_txt(*pts[L]) if L in pts else ("n/a" if R.fits(task, control, s, L) else "does not fit")
                             for L in lengths])
    if not rows:
        return ("<p>This run has no controls besides 'none' (<code>--control swap,shuffle</code> adds them).</p>")
    width = max(len(r) for r in rows)
    lengths = sorted({c["length"] for c in R.cells})
    out = ["<p class='cap'>Accuracy under each control next to 'none' (pooled over depths, 95% Wilson "
           "interval).</p>",
           table(["task", "control", "scaling", "metric"] + [f"L={L}" for L in lengths][:width - 4], rows)]
    paired = R.summary.get("controls") or []
    if paired:
        keys = order([k for e in paired for k in e if k not in ("ci_low", "ci_high")])
        front = [k for k in ("task", "control", "rope_scaling", "length") if k in keys]
        keys = front + [k for k in keys if k not in front]

        def val(e, k):
            v = e.get(k, "")
            if k == "followed_rate" and isinstance(v, (int, float)):
                return (f"{v:.2f} <span class='ci'>[{f2(e.get('ci_low'))}, {f2(e.get('ci_high'))}]</span>"
                        if e.get("ci_low") is not None else f"{v:.2f}")
            return esc(f"{v:.3f}" if isinstance(v, float) else v)

        out.append("<p class='cap'>Paired with the same samples under 'none': how often the prediction moved with "
                   "the evidence (followed_rate with its 95% Wilson interval).</p>")
        out.append(table([esc(k) for k in keys], [[val(e, k) for k in keys] for e in paired]))
    return "\n".join(out)


def ppl_section(ppl, plots):
    from plot_ppl import plot_ppl, plot_ppl_by_scaling

    parts = []
    p = os.path.join(plots, "ppl_by_position.png")
    plot_ppl(ppl, p)
    parts.append(p)
    parts += plot_ppl_by_scaling(ppl, os.path.join(plots, "ppl_"))
    buckets = sorted({(b["start"], b["end"]) for r in ppl["results"] for b in r["buckets"]})
    has_ci = any("nll_ci_low" in b for r in ppl["results"] for b in r["buckets"])
    rows = []
    single_window = False
    for r in sorted(ppl["results"], key=lambda r: (r["context"], r["rope_scaling"])):
        bmap = {(b["start"], b["end"]): b for b in r["buckets"]}
        tds = []
        for k in buckets:
            b = bmap.get(k)
            if not b or not b.get("tokens"):
                tds.append("–")
            elif has_ci and b.get("nll_ci_low") is not None:
                tds.append(f"{b['nll']:.3f} <span class='ci'>[{b['nll_ci_low']:.3f}, {b['nll_ci_high']:.3f}]</span>")
            elif has_ci and b.get("nll_ci_note"):
                # One window holds the bucket's predictions: no interval can be estimated (posenc's note says so).
                single_window = True
                tds.append(f"{b['nll']:.3f} <span class='ci' title='{esc(b['nll_ci_note'])}'>(1 window: no interval)</span>")
            else:
                tds.append(f"{b['nll']:.3f}")
        rows.append([esc(r["context"]), esc(r["rope_scaling"]), esc(format(r.get("factor") or 1, "g")),
                     f"{r['ppl']:.3f}", f"{r['nll']:.4f}", esc(r["tokens"]), esc(r.get("windows", ""))] + tds)
    tc = ppl.get("trained_context")
    head = ["context", "scaling", "factor", "ppl", "NLL", "tokens", "windows"] + [
        f"[{s}, {e})" + (" ≥T" if tc and s >= tc else "") for s, e in buckets]
    cap = ("Mean NLL (nats/token) per position bucket" +
           (" with its 95% bootstrap interval over windows" if has_ci else " (this run has no bucket intervals)") +
           (f"; buckets marked ≥T start at or past the trained context {tc}." if tc else ".") +
           (" \"1 window: no interval\": one window holds all of that bucket's predictions, so no interval can be"
            " estimated from it (a longer text or a shorter context gives more windows)." if single_window else ""))
    return table(head, rows) + f"<p class='cap'>{esc(cap)}</p>", parts


CSS = """body{font-family:system-ui,sans-serif;margin:1.5em auto;max-width:1500px;padding:0 1em;color:#222}
h1{font-size:1.5em} h2{border-bottom:1px solid #ccc;padding-bottom:.2em;margin-top:1.6em} h3{margin-bottom:.3em}
table{border-collapse:collapse;font-size:12px;margin:.4em 0 1em 0} td,th{border:1px solid #ccc;padding:2px 6px;
text-align:right;vertical-align:top} th{background:#f0f0f0} td:first-child,th:first-child{text-align:left}
table.config td,table.config th{text-align:left} .l{display:inline-block;text-align:left;max-width:60em}
.ci{color:#666} .above{font-weight:bold} .bad{color:#a33} .cap{font-size:12px;color:#444;max-width:75em}
img{max-width:100%;border:1px solid #eee;margin:4px 0} pre{background:#f6f6f6;padding:1em;
overflow-x:auto;font-size:12px} code{font-size:11px;word-break:break-all} .unsolved{background:#f7f3e8;
padding:.4em .8em;border-left:4px solid #d55e00}"""


def img_tag(path, alt):
    with open(path, "rb") as f:
        data = base64.b64encode(f.read()).decode("ascii")
    return f"<img src='data:image/png;base64,{data}' alt='{esc(alt)}'>"


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
    # eval --endpoint: results not computed ("does not fit", "not supported by this endpoint") carry no NLL.
    ppl_skipped = []
    if ppl:
        ppl_skipped = [r for r in ppl.get("results", []) if r.get("status", "ok") != "ok"]
        ppl["results"] = [r for r in ppl.get("results", []) if r.get("status", "ok") == "ok"]
    text = ""
    if os.path.exists(os.path.join(run_dir, "report.txt")):
        with open(os.path.join(run_dir, "report.txt")) as f:
            text = f.read()
    plots = os.path.join(run_dir, "plots")
    if os.path.lexists(plots) and not os.path.isdir(plots):
        raise ReportError(f"{plots}: exists and is not a directory (the plots go there)")
    out_html = os.path.join(run_dir, "report.html")
    if os.path.isdir(out_html):
        raise ReportError(f"{out_html}: is a directory (the report is written there as a file)")
    os.makedirs(plots, exist_ok=True)
    R = Run(summary, run)

    toc = []  # (anchor, title, level)
    body = []

    def h2(title, *key):
        a = anchor(*key)
        toc.append((a, title, 2))
        body.append(f"<h2 id='{a}'>{esc(title)}</h2>")

    def h3(title, *key):
        a = anchor(*key)
        toc.append((a, title, 3))
        body.append(f"<h3 id='{a}'>{esc(title)}</h3>")

    h2("Run configuration", "config")
    body.append(config_section(R))

    h2("Effective context", "effective")
    body.append("<p class='cap'>The longest tested length whose accuracy stays at or above threshold × the "
                "short baseline (the accuracy at the shortest length); a task is solvable when the baseline's 95% "
                "interval lies above chance.</p>")
    body.append(effective_table(R))

    h2("Chance levels", "chance")
    body.append(chance_table(R))

    h2("Controls", "controls")
    body.append(controls_table(R))

    h2("Tasks", "tasks")
    unsolved = [t for t in R.tasks if R.unsolvable(t)]
    for task in R.tasks:
        m = R.primary_metric(task)
        chs = R.chances(task, m)
        kk = R.k if R.kind(task) == "choice" else None
        cap = chance_levels(chs, kk)
        anchor_txt = (f"the lowest per-scaling chance level {f2(R.anchor_chance(task, m))}" if len(chs) > 1 and
                      chs[0][1]["source"] == "measured" else "chance")
        tc = (f"trained context T={R.trained}: the dashed line separates the lengths within it from those past it"
              if R.trained else "trained context unknown (run.json has none)")
        if task in unsolved:
            a = anchor("task", task)
            toc.append((a, f"{task}: no scaling solves it", 3))
            best = max((e.get("baseline") or 0 for e in R.eff if e["task"] == task and e["control"] == "none"),
                       default=0)
            body.append(f"<details id='{a}' class='unsolved'><summary><b>{esc(task)}</b>: no scaling solves it — "
                        f"the short baseline ({esc(m)}, best {best:.2f}) is not above chance for any of "
                        f"{esc(', '.join(R.scalings_of(task)))} ({esc(chance_levels(chs, kk, collapse=True))}). "
                        f"Click for its heatmaps and tables.</summary>")
            for control in R.controls(task):
                sub = "" if control == "none" else f" — control {control}"
                hm_path = os.path.join(plots, f"heatmaps_{fname(task)}_{fname(control)}.png")
                heatmaps(R, task, control, hm_path)
                body.append(img_tag(hm_path, f"{task}{sub} heatmaps"))
                body.append(f"<p class='cap'>{esc(task)}{esc(sub)}: depth × length, one panel per scaling; "
                            f"{esc(cap)}.</p>")
            body.append(length_table(R, task, "none"))
            body.append("</details>")
            continue
        h3(f"{task}", "task", task)
        for control in R.controls(task):
            sub = "" if control == "none" else f" — control {control}"
            acc_path = os.path.join(plots, f"accuracy_{fname(task)}_{fname(control)}.png")
            hm_path = os.path.join(plots, f"heatmaps_{fname(task)}_{fname(control)}.png")
            if control != "none":
                body.append(f"<h4>{esc(task)}{esc(sub)}</h4>")
            heatmaps(R, task, control, hm_path)
            body.append(img_tag(hm_path, f"{task}{sub} heatmaps"))
            body.append(f"<p class='cap'>Depth × length, one panel per RoPE scaling; colour ({SEQ_CMAP}) from "
                        f"{esc(anchor_txt)} (darkest) to 1; {esc(cap)}; columns at log2 of the tested lengths; {esc(tc)}. Below: "
                        f"each scaling minus default ({DIFF_CMAP}); * marks differences whose 95% Newcombe "
                        f"interval excludes 0.</p>")
            if accuracy_plot(R, task, control, acc_path):
                body.append(img_tag(acc_path, f"{task}{sub} accuracy vs length"))
            body.append(f"<p class='cap'>Per-length accuracy pooled over depths with its 95% Wilson interval; "
                        f"bold: the interval's lower bound lies above the upper bound of the measured chance interval of "
                        f"that scaling (the effective-context gate; above the chance level itself when it is assumed "
                        f"or 0). {esc(cap)}. The differences against default treat the two "
                        f"as independent samples; the same prompts are scored under every scaling, so the Newcombe "
                        f"band is conservative.</p>")
            body.append(length_table(R, task, control))

    if ppl and ppl.get("results"):
        h2("Perplexity by position", "ppl")
        tab, parts = ppl_section(ppl, plots)
        body.append(tab)
        body += [img_tag(p, os.path.basename(p)) for p in parts]
    if ppl_skipped:
        if not ppl.get("results"):
            h2("Perplexity by position", "ppl")
        body.append("<ul>" + "".join(f"<li>L={esc(r.get('context'))} {esc(r.get('rope_scaling'))}: "
                                     f"{esc(r.get('status'))} ({esc(r.get('note', ''))})</li>" for r in ppl_skipped)
                    + "</ul>")

    if text:
        h2("Text summary", "text")
        body.append("<details><summary>The table `posenc eval report` prints (report.txt)</summary><pre>" +
                    esc(text) + "</pre></details>")

    model = run.get("model", {})
    head = [
        "<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>",
        f"<title>posenc eval report {esc(summary.get('run_id', ''))}</title><style>{CSS}</style></head><body>",
        f"<h1>posenc eval — run {esc(summary.get('run_id', ''))}</h1>",
        f"<p>Model <code>{esc(model.get('path', '?'))}</code> (trained context {esc(model.get('trained_context'))}"
        + (f", {esc(model['family'])}" if model.get("family") else "") + f"); {esc(summary.get('cells_present'))} of "
        f"{esc(summary.get('cells_expected'))} cells; tasks {esc(', '.join(R.tasks))}; scalings "
        f"{esc(', '.join(R.scalings))}; summary schema {esc(R.schema)}"
        + ("" if summary.get("complete", True) else " — <span class='bad'>incomplete run</span>") + ".</p>",
    ]
    if unsolved:
        head.append(f"<p>No scaling solves: {esc(', '.join(unsolved))} (collapsed to one line under Tasks).</p>")
    nav = ["<nav id='contents'><h2>Contents</h2><ol>"]
    open_sub = False
    for i, (a, title, level) in enumerate(toc):
        if level == 2:
            if open_sub:
                nav.append("</ul></li>")
                open_sub = False
            elif i > 0:
                nav.append("</li>")
            nav.append(f"<li><a href='#{a}'>{esc(title)}</a>")
        else:
            if not open_sub:
                nav.append("<ul>")
                open_sub = True
            nav.append(f"<li><a href='#{a}'>{esc(title)}</a></li>")
    nav.append("</ul></li>" if open_sub else "</li>")
    nav.append("</ol></nav>")
    page = "\n".join(head + nav + body + ["</body></html>\n"])
    fd, tmp = tempfile.mkstemp(prefix=".report-", suffix=".html.tmp", dir=run_dir)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(page)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, os.path.join(run_dir, "report.html"))
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


class ReportError(Exception):
    """A bad run directory: printed as one line naming the path, exit 1."""


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except ReportError as e:
        print(f"eval_report.py: {e}", file=sys.stderr)
        sys.exit(1)
    except OSError as e:
        where = e.filename if e.filename is not None else "?"
        print(f"eval_report.py: {where}: {e.strerror or e}", file=sys.stderr)
        sys.exit(1)
