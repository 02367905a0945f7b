"""Shared by the plot scripts: atomic PNG output, one colour per RoPE scaling and
per positional encoding, Wilson/Newcombe intervals and the length axis.

save_png_atomic: the PNG goes to a temporary file in the destination's
directory and is renamed over the destination, so a reader never sees a partial
file and an interrupted run leaves the previous plot intact.

Colours are the Okabe-Ito palette (Okabe & Ito 2008, "Color Universal Design"),
distinguishable under the common colour-vision deficiencies; a scaling or an
encoding keeps its colour in every plot posenc draws.
"""
import math
import os
import tempfile

import matplotlib.pyplot as plt

OKABE_ITO = ["#000000", "#E69F00", "#56B4E9", "#009E73", "#F0E442", "#0072B2", "#D55E00", "#CC79A7"]
# RoPE scalings (posenc --rope-scaling names). Yellow (#F0E442) is too pale for
# thin lines on white and is left out.
SCALING_COLORS = {
    "default": "#000000",
    "linear": "#E69F00",
    "ntk": "#56B4E9",
    "yarn": "#009E73",
    "dynamic": "#D55E00",
    "llama3": "#0072B2",
    "longrope": "#CC79A7",
}
# Positional encodings of `posenc train` / `posenc study`.
PE_COLORS = {
    "nope": "#000000",
    "learned": "#CC79A7",
    "sinusoidal": "#E69F00",
    "t5": "#009E73",
    "alibi": "#D55E00",
    "rope": "#0072B2",
    "rope25": "#56B4E9",
}
_EXTRA = ["#0072B2", "#CC79A7", "#56B4E9", "#999999", "#882255", "#44AA99"]

Z95 = 1.959963984540054


def _color(table, name, order):
    if name in table:
        return table[name]
    unknown = [n for n in order if n not in table]
    i = unknown.index(name) if name in unknown else len(unknown)
    return _EXTRA[i % len(_EXTRA)]


def scaling_color(name, all_names=()):
    """The colour of RoPE scaling `name`; names posenc does not know get the next
    colour of a spare list, in the order of all_names."""
    return _color(SCALING_COLORS, name, list(all_names))


def pe_color(name, all_names=()):
    return _color(PE_COLORS, name, list(all_names))


def wilson(k, n, z=Z95):
    """Wilson score interval of k successes in n trials: (low, high); the same
    formula as posenc::wilson_interval (include/posenc/stats.hpp)."""
    if n <= 0:
        return (float("nan"), float("nan"))
    p = k / n
    d = 1 + z * z / n
    c = (p + z * z / (2 * n)) / d
    h = z / d * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return (max(0.0, c - h), min(1.0, c + h))


def newcombe_diff(k1, n1, k2, n2, z=Z95):
    """Difference p1 - p2 of two independent proportions and its 95% interval by
    Newcombe's hybrid score method (Newcombe 1998, method 10: the Wilson
    intervals of both proportions combined): (d, low, high)."""
    p1, p2 = k1 / n1, k2 / n2
    l1, u1 = wilson(k1, n1, z)
    l2, u2 = wilson(k2, n2, z)
    d = p1 - p2
    return (d, d - math.sqrt((p1 - l1) ** 2 + (u2 - p2) ** 2), d + math.sqrt((u1 - p1) ** 2 + (p2 - l2) ** 2))


def length_axis(ax, lengths, trained_context=None, label="context length (tokens)", log2=True):
    """A length x axis: log-2 spaced with a tick at every tested length (the
    labels thinned to fit when there are many), and the trained context drawn
    as a dashed vertical line (an arrow at the edge when it lies outside the
    tested range). `lengths` are positions on the axis in data units."""
    lengths = sorted(set(lengths))
    if log2:
        ax.set_xscale("log", base=2)
    ax.minorticks_off()
    step = max(1, math.ceil(len(lengths) / 14))
    ax.set_xticks(lengths)
    ax.set_xticklabels([str(L) if i % step == 0 or i == len(lengths) - 1 else "" for i, L in enumerate(lengths)])
    ax.set_xlabel(label)
    mark_trained_context(ax, trained_context, lengths[0], lengths[-1])


def mark_trained_context(ax, trained_context, lo, hi, x=None):
    """Draw the trained context on an axis whose data range is [lo, hi]; x is its
    position in data units when the axis is not in tokens (heatmap columns)."""
    if not trained_context:
        return
    pos = trained_context if x is None else x
    label = f"trained context {trained_context}"
    if lo <= trained_context <= hi:
        ax.axvline(pos, color="#555555", linestyle="--", linewidth=1.2, zorder=5)
        # the label on the side of the line with more room (log-2 axis position)
        span = math.log2(hi) - math.log2(lo) if x is None and hi > lo > 0 else 0
        frac = (math.log2(trained_context) - math.log2(lo)) / span if span else 0.5
        left = frac > 0.6
        ax.annotate(label, xy=(pos, 1.0), xycoords=("data", "axes fraction"), xytext=(-3 if left else 3, -3),
                    textcoords="offset points", ha="right" if left else "left", va="top", fontsize=7,
                    color="#333333", zorder=6)
    else:
        right = trained_context > hi
        ax.annotate(label + (" →" if right else ""), xy=(1.0 if right else 0.0, 1.0), xycoords="axes fraction",
                    xytext=(-3 if right else 3, -3), textcoords="offset points", ha="right" if right else "left",
                    va="top", fontsize=7, color="#333333", zorder=6)
        if not right:
            ax.texts[-1].set_text("← " + label)


def mark_trained_context_columns(ax, trained_context, lengths, xs, edges):
    """The trained context on a heatmap whose columns (centres xs, edges) are the tested lengths: a
    line between the columns within it and those past it, drawn white-and-black so that it shows on
    light and dark cells and crosses no cell's number, and "(T)" under a tested length equal to it.
    Outside the tested range, an arrow label over the panel says where it lies."""
    if not trained_context:
        return
    if trained_context in lengths:
        i = lengths.index(trained_context)
        labels = [t.get_text() for t in ax.get_xticklabels()]
        if len(labels) == len(lengths):
            labels[i] = f"{labels[i]}\n(T)"
            ax.set_xticklabels(labels)
        x = edges[i + 1] if i + 1 < len(lengths) else None
    elif lengths[0] < trained_context < lengths[-1]:
        # not a tested length: the line goes on the edge between the last column within it and the
        # first past it (never through a cell), labelled with its value
        i = max(j for j, L in enumerate(lengths) if L < trained_context)
        x = edges[i + 1]
        ax.annotate(f"T={trained_context}", xy=(x, 0.0), xycoords=("data", "axes fraction"), xytext=(0, -3),
                    textcoords="offset points", ha="center", va="top", fontsize=6, color="#333333")
    else:
        x = None
    if x is not None and edges[0] < x < edges[-1]:
        ax.axvline(x, color="white", linewidth=3.0, zorder=5)
        ax.axvline(x, color="black", linestyle="--", linewidth=1.2, zorder=6)
    if trained_context > lengths[-1] or trained_context < lengths[0]:
        right = trained_context > lengths[-1]
        ax.annotate(f"trained context {trained_context} →" if right else f"← trained context {trained_context}",
                    xy=(1.0 if right else 0.0, 1.0), xycoords="axes fraction", xytext=(0, 2), textcoords="offset points",
                    ha="right" if right else "left", va="bottom", fontsize=6, color="#333333")


def save_png_atomic(fig, path, **savefig_kwargs):
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".plot-", suffix=".png", dir=directory)
    os.close(fd)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes it 0600; a plot is an ordinary file
    try:
        fig.savefig(tmp, format="png", **savefig_kwargs)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
        plt.close(fig)
