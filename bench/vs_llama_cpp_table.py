#!/usr/bin/env python3
"""The table of scripts/bench-vs-llama-cpp: posenc's real_size_bench and llama-bench on the same GGUF files.

Usage: vs_llama_cpp_table.py OUT_DIR
OUT_DIR as the script writes it: session.txt and round-1/, round-2/, ... each with llama-bench-<model>.json and
posenc-<model>.json (one repetition of each per round, the two tools taking turns model by model); or, from runs
before the rounds (zen5-12 and earlier), posenc.json and llama-bench-<model>.json at the top.

Prints a Markdown table: tokens/s of each (the median over the rounds; posenc's over its repetitions in the old
layout, llama.cpp's over its samples), the ratio posenc / llama.cpp (the median of the rounds' ratios, and their
range when there are several rounds), decode's weight bytes per second as a share of the DRAM read rate measured
in the same posenc process (between the decode's own iterations, dram_GB_per_s, where the JSON has it: the median
round's share with its two rates, and the range; else BM_DramRead's), and prefill's projection GFLOP/s as a share of the measured FMA peak (above the table: that peak
when 11 vectors per 24 FMAs are loaded from L1, the AVX-512 prefill tile's ceiling). A quantized model measured
also with --quantized-matmul q8_activations (llama.cpp's own arithmetic: int8 products on activations quantized
to Q8_0) gets a second row, "(q8_activations)"; the first is the exact float32 products. An F16 model measured
also with --dense-matmul bf16x6 / bf16x3 (AMX-BF16 tiles) gets rows "(bf16x6)", "(bf16x3)".
"""
import glob
import json
import os
import statistics
import sys


def posenc_runs(paths):
    """name -> benchmark record: the median aggregate where the file has aggregates, else the one iteration run."""
    out = {}
    for path in paths:
        with open(path) as f:
            for r in json.load(f)["benchmarks"]:
                name = r.get("run_name", r["name"])
                if r.get("run_type") == "aggregate":
                    if r.get("aggregate_name") == "median":
                        out[name] = r
                elif name not in out:
                    out[name] = r
    return out


def llama_rows(paths):
    """(model, test, threads) -> llama.cpp tokens/s (the median of its samples)."""
    out = {}
    for path in paths:
        name = os.path.basename(path)[len("llama-bench-"):-len(".json")]
        with open(path) as f:
            for r in json.load(f):
                test = "prefill 256" if r["n_prompt"] > 0 else "decode 64"
                out[(name, test, r["n_threads"])] = statistics.median(r["samples_ts"])
    return out


def load_rounds(out_dir):
    dirs = sorted(glob.glob(os.path.join(out_dir, "round-*")), key=lambda d: int(d.rsplit("-", 1)[1]))
    if not dirs:  # the layout before the rounds
        return [(posenc_runs([os.path.join(out_dir, "posenc.json")]),
                 llama_rows(sorted(glob.glob(os.path.join(out_dir, "llama-bench-*.json")))))]
    return [(posenc_runs(sorted(glob.glob(os.path.join(d, "posenc-*.json")))),
             llama_rows(sorted(glob.glob(os.path.join(d, "llama-bench-*.json"))))) for d in dirs]


def median_of(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def main(out_dir):
    rounds = load_rounds(out_dir)
    first = rounds[0][0]

    def per_round(name, key):
        return [r[0].get(name, {}).get(key) for r in rounds]

    peak = {t: median_of(per_round(f"BM_FmaPeak/threads:{t}/real_time", "GFLOPs")) for t in (1, 2)}
    dram = {t: median_of(per_round(f"BM_DramRead/threads:{t}/real_time", "GB_per_s")) for t in (1, 2)}
    print(open(os.path.join(out_dir, "session.txt")).read().strip())
    print()
    if len(rounds) > 1:
        print(f"{len(rounds)} rounds, llama-bench and posenc taking turns model by model: tokens/s are medians over the "
              "rounds; a ratio is the median of the rounds' own ratios [their range], not the quotient of the two "
              "medians; a decode's share is the median round's share of the read rate measured beside it [the range], "
              "with that round's GB/s")
        print()
    ceiling = median_of(per_round("BM_FmaPeakWithLoads/loads:11/real_time", "GFLOPs"))
    if ceiling and peak.get(1):
        print(f"FMA peak with the AVX-512 prefill tile's loads (11 per 24 FMAs, from L1; one thread): {ceiling:.0f} "
              f"GFLOP/s, {100 * ceiling / peak[1]:.0f}% of the FMA peak")
        print()
    huge = []
    share = first.get("BM_DramRead/threads:1/real_time", {}).get("huge_page_share", -1)
    if share >= 0:
        huge.append(f"DRAM read buffer {100 * share:.0f}%")
    for k, r in sorted(first.items()):
        if k.startswith("BM_RealDecode/") and k.endswith("/threads:1/real_time") and r.get("huge_page_share", -1) >= 0:
            huge.append(f"{k.split('/')[1]} {100 * r['huge_page_share']:.0f}%")
    if huge:
        print("Resident bytes mapped in 2 MiB pages (posenc's process): " + ", ".join(huge))
        print()
    print("| model | test | threads | posenc t/s | llama.cpp t/s | posenc / llama.cpp | share of the machine's limit |")
    print("|---|---|--:|--:|--:|--:|--:|")
    keys = sorted({k for _, ll in rounds for k in ll}, key=lambda k: (k[0], k[2], k[1] != "prefill 256"))
    for name, test, t in keys:
        kind = "RealPrefill" if test == "prefill 256" else "RealDecode"
        ll_rounds = [ll.get((name, test, t)) for _, ll in rounds]
        ll = median_of(ll_rounds)
        for mode in ("", "q8_activations", "bf16x6", "bf16x3"):
            bench = f"BM_{kind}/{name}.gguf{'@' + mode if mode else ''}/threads:{t}/real_time"
            label = f" ({mode})" if mode else ""
            ps = [r[0].get(bench) for r in rounds]
            if all(p is None for p in ps):
                if not mode:
                    print(f"| {name} | {test} | {t} | (not run) | {ll:,.1f} | | |")
                continue
            pt = median_of([p["tokens_per_s"] if p else None for p in ps])
            ratios = [p["tokens_per_s"] / l for p, l in zip(ps, ll_rounds) if p and l]
            ratio = f"{statistics.median(ratios):.2f}x"
            if len(ratios) > 1:
                ratio += f" [{min(ratios):.2f}-{max(ratios):.2f}]"
            if kind == "RealDecode":
                beside = [(p["weight_GB_per_s"], p["dram_GB_per_s"]) for p in ps if p and p.get("dram_GB_per_s")]
                if beside:  # each round's share of the read rate measured between its own iterations
                    ranked = sorted(beside, key=lambda b: b[0] / b[1])
                    w, d = ranked[(len(ranked) - 1) // 2]  # the median round (the lower one of an even count)
                    share_text = f"{100 * w / d:.0f}%"
                    if len(ranked) > 1:
                        share_text += f" [{100 * ranked[0][0] / ranked[0][1]:.0f}-{100 * ranked[-1][0] / ranked[-1][1]:.0f}]"
                    share_text += f" of DRAM read ({w:.1f} of {d:.1f} GB/s beside it)"
                elif dram.get(t):
                    w = median_of([p["weight_GB_per_s"] if p else None for p in ps])
                    share_text = f"{100 * w / dram[t]:.0f}% of DRAM read ({w:.1f} of {dram[t]:.1f} GB/s)"
                else:
                    share_text = ""
            elif peak.get(t):
                g = median_of([p["matmul_GFLOP_per_s"] if p else None for p in ps])
                share_text = f"{100 * g / peak[t]:.0f}% of FMA peak ({g:.0f} of {peak[t]:.0f} GFLOP/s)"
            else:
                share_text = ""
            print(f"| {name}{label} | {test} | {t} | {pt:,.1f} | {ll:,.1f} | {ratio} | {share_text} |")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])
