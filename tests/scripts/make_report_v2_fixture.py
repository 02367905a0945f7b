#!/usr/bin/env python3
"""Derives the schema-2 eval report fixture (tests/eval/data/report/v2) from the
real schema-1 run in tests/eval/data/report/v1, by the edits the issue-14
contract describes (docs: /work/helper-notes/issue14-contract.md, "Eval
summary.json / cell files"). The v1 files are the summary.json, run.json,
ppl.json and report.txt of

  posenc eval --model stories260K.bin --tokenizer tok512.bin --haystack tinystories_val.txt \\
      --tasks name_recall,passkey --context 128,256,512 --samples 10 --control none,shuffle \\
      --rope-scaling default,linear,yarn --ppl-tokens 8192

(posenc 0.1.0, git c3ba4df, run id e455bde28196d422). The v2 edits are made by
hand (this script), NOT measured: they exercise the report's reading of the new
fields, and their numbers are chosen to differ from the v1 ones:
  - forced-choice cells: "metrics" {"acc": the v1 count (the sum-of-log-prob score
    v1 reported), "acc_norm": v1 count + 1 where (length/128 + depth index) is even,
    capped at n}; the primary metric "acc_norm" becomes the cell's correct/accuracy/ci;
  - generation cells: "metric" "first_integer", "metrics" with that one entry;
  - "absent" control cells (depth null) per forced-choice task x scaling x length, with
    the counts ABSENT below, and the pooled summary "chance" entries from them;
  - effective_context: one entry per task x control x scaling x metric, recomputed as
    posenc::effective_context does (src/eval/stats.cpp) against the measured chance;
  - run.json model.family "rope"; ppl.json buckets gain nll_ci_low/high = nll -/+ 0.02;
  - summary "schema_version": 2.

    make_report_v2_fixture.py [DATA_DIR]   (default: tests/eval/data/report next to this script)
"""
import copy
import json
import math
import os
import sys

Z = 1.959963984540054
# correct of 10 under the absent control: {metric: {scaling: [L=128, L=256, L=512]}}
ABSENT = {"acc": {"default": [3, 2, 4], "linear": [3, 2, 4], "yarn": [3, 2, 5]},
          "acc_norm": {"default": [2, 3, 2], "linear": [2, 3, 2], "yarn": [2, 3, 3]}}


def wilson(k, n):
    p = k / n
    d = 1 + Z * Z / n
    c = (p + Z * Z / (2 * n)) / d
    h = Z / d * math.sqrt(p * (1 - p) / n + Z * Z / (4 * n * n))
    return max(0.0, c - h), min(1.0, c + h)


def metric_entry(k, n):
    lo, hi = wilson(k, n)
    return {"correct": k, "accuracy": k / n, "ci_low": lo, "ci_high": hi}


def main(argv):
    data = argv[0] if argv else os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "eval", "data",
                                             "report")
    src, dst = os.path.join(data, "v1"), os.path.join(data, "v2")
    os.makedirs(dst, exist_ok=True)
    with open(os.path.join(src, "summary.json")) as f:
        s = json.load(f)
    with open(os.path.join(src, "run.json")) as f:
        run = json.load(f)
    with open(os.path.join(src, "ppl.json")) as f:
        ppl = json.load(f)
    kinds = {t["name"]: t["kind"] for t in run["tasks"]}
    gen_metric = {t["name"]: t["metric"] for t in run["tasks"]}
    depths = run["config"]["depths"]
    lengths = run["config"]["lengths"]
    k_choices = run["config"]["choices"]

    cells = []
    for c in s["cells"]:
        c = copy.deepcopy(c)
        if kinds[c["task"]] == "choice":
            n = c["n"]
            acc = c["correct"]
            bump = 1 if (c["length"] // 128 + depths.index(c["depth"])) % 2 == 0 else 0
            norm = min(n, acc + bump)
            c["metric"] = "acc_norm"
            c["metrics"] = {"acc": metric_entry(acc, n), "acc_norm": metric_entry(norm, n)}
            c.update(c["metrics"]["acc_norm"])
        else:
            c["metric"] = gen_metric[c["task"]]
            c["metrics"] = {c["metric"]: metric_entry(c["correct"], c["n"])}
        cells.append(c)
    chance = []
    for task in [t for t in kinds if kinds[t] == "choice"]:
        for scaling in run["config"]["rope_scalings"]:
            for j, L in enumerate(lengths):
                ms = {m: metric_entry(ABSENT[m][scaling][j], 10) for m in ABSENT}
                c = {"task": task, "control": "absent", "rope_scaling": scaling, "length": L, "depth": None, "n": 10,
                     "status": "ok", "metric": "acc_norm", "metrics": ms}
                c.update(ms["acc_norm"])
                cells.append(c)
            for m in ABSENT:
                k = sum(ABSENT[m][scaling])
                e = {"task": task, "rope_scaling": scaling, "metric": m, "n": 10 * len(lengths),
                     "assumed": 1.0 / k_choices}
                e.update(metric_entry(k, 10 * len(lengths)))
                chance.append(e)
    s["cells"] = cells
    s["chance"] = chance

    eff = []
    for e in s["effective_context"]:
        task = e["task"]
        metrics = ["acc", "acc_norm"] if kinds[task] == "choice" else [gen_metric[task]]
        for m in metrics:
            x = copy.deepcopy(e)
            x["metric"] = m
            if kinds[task] != "choice":
                x.update({"chance": 0.0, "chance_ci_low": None, "chance_ci_high": None, "chance_source": "none"})
                eff.append(x)
                continue
            ch = next(r for r in chance if r["task"] == task and r["rope_scaling"] == e["rope_scaling"]
                      and r["metric"] == m)
            by_len = []
            for L in lengths:
                cs = [c for c in cells if c["task"] == task and c["control"] == e["control"]
                      and c["rope_scaling"] == e["rope_scaling"] and c["length"] == L]
                k = sum(c["metrics"][m]["correct"] for c in cs)
                n = sum(c["n"] for c in cs)
                by_len.append((L, sum(c["metrics"][m]["accuracy"] for c in cs) / len(cs), k, n))
            L0, b, k0, n0 = by_len[0]
            lo, hi = wilson(k0, n0)
            thr = s["threshold"] * b
            solvable = lo > ch["accuracy"] and b >= s["min_baseline"]
            length = None
            if solvable:
                for L, a, _, _ in by_len:
                    if a < thr:
                        break
                    length = L
            x.update({"baseline": b, "baseline_ci_low": lo, "baseline_ci_high": hi, "threshold": thr,
                      "length": length, "solvable": solvable, "baseline_length": L0,
                      "status": "not solvable by this model" if not solvable else "ok" if length else
                      "below threshold at the shortest length",
                      "chance": ch["accuracy"], "chance_ci_low": ch["ci_low"], "chance_ci_high": ch["ci_high"],
                      "chance_source": "measured",
                      "accuracy_by_length": [{"length": L, "accuracy": a} for L, a, _, _ in by_len]})
            eff.append(x)
    s["effective_context"] = eff
    s["cells_expected"] = s["cells_present"] = len(cells)
    s["schema_version"] = 2
    run["model"]["family"] = "rope"
    for r in ppl["results"]:
        for b in r["buckets"]:
            b["nll_ci_low"] = b["nll"] - 0.02
            b["nll_ci_high"] = b["nll"] + 0.02
    for name, obj in (("summary.json", s), ("run.json", run), ("ppl.json", ppl)):
        with open(os.path.join(dst, name), "w") as f:
            json.dump(obj, f, indent=1, sort_keys=True)
            f.write("\n")
    with open(os.path.join(src, "report.txt")) as f, open(os.path.join(dst, "report.txt"), "w") as g:
        g.write(f.read())
    print(f"wrote {dst}")


if __name__ == "__main__":
    main(sys.argv[1:])
