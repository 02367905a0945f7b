#!/usr/bin/env python3
"""The table of scripts/bench-vs-llama-cpp: posenc's real_size_bench and llama-bench on the same GGUF files.

Usage: vs_llama_cpp_table.py OUT_DIR   (session.txt, posenc.json, llama-bench-<model>.json as the script writes them)
Prints a Markdown table: tokens/s of each (posenc: median of the repetitions; llama.cpp: median of its samples),
the ratio posenc / llama.cpp, decode's weight bytes per second as a share of the DRAM read bandwidth measured in
the same posenc process (between the decode's own iterations, where posenc.json has it: dram_GB_per_s; else
BM_DramRead's), and prefill's projection GFLOP/s as a share of the measured FMA peak (above the table: that
peak when 11 vectors per 24 FMAs are loaded from L1, the AVX-512 prefill tile's ceiling). A quantized model
measured also with --quantized-matmul q8_activations (llama.cpp's own arithmetic: int8 products on activations
quantized to Q8_0) gets a second row, "(q8_activations)"; the first is the exact float32 products. An F16 model
measured also with --dense-matmul bf16x6 / bf16x3 (AMX-BF16 tiles) gets rows "(bf16x6)", "(bf16x3)".
"""
import glob
import json
import os
import statistics
import sys


def main(out_dir):
    with open(os.path.join(out_dir, "posenc.json")) as f:
        runs = json.load(f)["benchmarks"]
    med = {}
    for r in runs:
        if r.get("aggregate_name", "median") != "median":
            continue
        med[r["run_name"] if "run_name" in r else r["name"]] = r
    dram = {t: med.get(f"BM_DramRead/threads:{t}/real_time", {}).get("GB_per_s") for t in (1, 2)}
    peak = {t: med.get(f"BM_FmaPeak/threads:{t}/real_time", {}).get("GFLOPs") for t in (1, 2)}
    print(open(os.path.join(out_dir, "session.txt")).read().strip())
    print()
    ceiling = med.get("BM_FmaPeakWithLoads/loads:11/real_time", {}).get("GFLOPs")
    if ceiling and peak.get(1):
        print(f"FMA peak with the AVX-512 prefill tile's loads (11 per 24 FMAs, from L1; one thread): {ceiling:.0f} "
              f"GFLOP/s, {100 * ceiling / peak[1]:.0f}% of the FMA peak")
        print()
    huge = [f"DRAM read buffer {100 * med[k]['huge_page_share']:.0f}%" for k in ("BM_DramRead/threads:1/real_time",)
            if k in med and med[k].get("huge_page_share", -1) >= 0]
    for k, r in sorted(med.items()):
        if k.startswith("BM_RealDecode/") and k.endswith("/threads:1/real_time") and r.get("huge_page_share", -1) >= 0:
            huge.append(f"{k.split('/')[1]} {100 * r['huge_page_share']:.0f}%")
    if huge:
        print("Resident bytes mapped in 2 MiB pages (posenc's process): " + ", ".join(huge))
        print()
    print("| model | test | threads | posenc t/s | llama.cpp t/s | posenc / llama.cpp | share of the machine's limit |")
    print("|---|---|--:|--:|--:|--:|--:|")
    for path in sorted(glob.glob(os.path.join(out_dir, "llama-bench-*.json"))):
        name = os.path.basename(path)[len("llama-bench-"):-len(".json")]
        with open(path) as f:
            rows = json.load(f)
        for r in rows:
            test = "prefill 256" if r["n_prompt"] > 0 else "decode 64"
            t = r["n_threads"]
            ll = statistics.median(r["samples_ts"])
            kind = "RealPrefill" if r["n_prompt"] > 0 else "RealDecode"
            variants = [("", med.get(f"BM_{kind}/{name}.gguf/threads:{t}/real_time"))]
            for mode in ("q8_activations", "bf16x6", "bf16x3"):
                v = med.get(f"BM_{kind}/{name}.gguf@{mode}/threads:{t}/real_time")
                if v is not None:
                    variants.append((f" ({mode})", v))
            for label, p in variants:
                if p is None:
                    print(f"| {name}{label} | {test} | {t} | (not run) | {ll:,.1f} | | |")
                    continue
                pt = p["tokens_per_s"]
                if kind == "RealDecode" and p.get("dram_GB_per_s"):
                    # the read rate measured between the decode's own iterations (bench/real_size_bench.cpp)
                    share = f"{100 * p['weight_GB_per_s'] / p['dram_GB_per_s']:.0f}% of DRAM read ({p['weight_GB_per_s']:.1f} of {p['dram_GB_per_s']:.1f} GB/s beside it)"
                elif kind == "RealDecode" and dram.get(t):
                    share = f"{100 * p['weight_GB_per_s'] / dram[t]:.0f}% of DRAM read ({p['weight_GB_per_s']:.1f} of {dram[t]:.1f} GB/s)"
                elif kind == "RealPrefill" and peak.get(t):
                    share = f"{100 * p['matmul_GFLOP_per_s'] / peak[t]:.0f}% of FMA peak ({p['matmul_GFLOP_per_s']:.0f} of {peak[t]:.0f} GFLOP/s)"
                else:
                    share = ""
                print(f"| {name}{label} | {test} | {t} | {pt:,.1f} | {ll:,.1f} | {pt / ll:.2f}x | {share} |")

if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])
