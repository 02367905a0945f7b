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
also with --dense-matmul bf16x6 / bf16x3 (AMX-BF16 tiles) gets rows "(bf16x6)", "(bf16x3)". Under the table, where
the run has BM_RealDecodeTeam: the two-thread decode team's speed over a parallel region per projection (median of
the rounds [range]).
"""
import glob
import json
import os
import re
import statistics
import sys


class Bad(Exception):
    """A run directory this script cannot make a table of: the message names the file and what is wrong."""


def read_json(path):
    try:
        with open(path) as f:
            return json.load(f)
    except OSError as e:
        raise Bad(f"{path}: cannot read ({e.strerror})")
    except json.JSONDecodeError as e:
        raise Bad(f"{path}: not JSON ({e})")


def posenc_runs(path):
    """name -> benchmark record: the median aggregate where the file has aggregates, else the one iteration run."""
    data = read_json(path)
    runs = data.get("benchmarks") if isinstance(data, dict) else None
    if not runs:
        raise Bad(f"{path}: no benchmarks")
    out = {}
    for r in runs:
        name = r.get("run_name", r.get("name"))
        if r.get("error_occurred"):
            raise Bad(f"{path}: {name} failed: {r.get('error_message', '(no message)')}")
        if r.get("run_type") == "aggregate":
            if r.get("aggregate_name") == "median":
                out[name] = r
        elif name not in out:
            out[name] = r
    # The paths posenc's products took (runs from zen5-21 on record them; POSENC_DENSE_KERNEL=avx2 asks for AVX2).
    out["__context__"] = data.get("context", {}) if isinstance(data, dict) else {}
    return out


def llama_rows(path):
    """(test, threads) -> llama.cpp tokens/s (the median of its samples); test "prefill N" or "decode N"."""
    rows = read_json(path)
    if not isinstance(rows, list) or not rows:
        raise Bad(f"{path}: no llama-bench results")
    out = {}
    for r in rows:
        n_prompt, n_gen = r.get("n_prompt", 0), r.get("n_gen", 0)
        if (n_prompt > 0) == (n_gen > 0):
            raise Bad(f"{path}: a test of {n_prompt} prompt and {n_gen} generated tokens (one of them expected)")
        test = f"prefill {n_prompt}" if n_prompt > 0 else f"decode {n_gen}"
        if not r.get("samples_ts"):
            raise Bad(f"{path}: {test} at {r.get('n_threads')} threads has no samples")
        key = (test, r["n_threads"])
        if key in out:
            raise Bad(f"{path}: {test} at {key[1]} threads twice")
        out[key] = statistics.median(r["samples_ts"])
    return out


def load_rounds(out_dir):
    """[{model: (posenc records, llama.cpp rows)}] per round; every round must hold both tools' files of every model."""
    if not os.path.exists(os.path.join(out_dir, "session.txt")):
        raise Bad(f"{out_dir}: no session.txt (not a run directory of scripts/bench-vs-llama-cpp)")
    dirs = [d for d in glob.glob(os.path.join(out_dir, "round-*")) if re.fullmatch(r"round-[0-9]+", os.path.basename(d))]
    dirs.sort(key=lambda d: int(d.rsplit("-", 1)[1]))
    name = lambda path, prefix: os.path.basename(path)[len(prefix):-len(".json")]
    if not dirs:  # the layout before the rounds: one posenc.json for every model
        posenc = posenc_runs(os.path.join(out_dir, "posenc.json"))
        models = [name(p, "llama-bench-") for p in sorted(glob.glob(os.path.join(out_dir, "llama-bench-*.json")))]
        if not models:
            raise Bad(f"{out_dir}: no llama-bench-<model>.json")
        return [{m: (posenc, llama_rows(os.path.join(out_dir, f"llama-bench-{m}.json"))) for m in models}]
    rounds, models = [], None
    for d in dirs:
        here = {name(p, "llama-bench-") for p in glob.glob(os.path.join(d, "llama-bench-*.json"))} | \
               {name(p, "posenc-") for p in glob.glob(os.path.join(d, "posenc-*.json"))}
        if not here:
            raise Bad(f"{d}: empty (an interrupted run?)")
        if models is not None and here != models:
            raise Bad(f"{d}: models {sorted(here)}, but {dirs[0]} has {sorted(models)}")
        models = here
        for m in sorted(here):
            for f in (f"llama-bench-{m}.json", f"posenc-{m}.json"):
                if not os.path.exists(os.path.join(d, f)):
                    raise Bad(f"{d}: {f} is missing (each round runs both tools on every model)")
        rounds.append({m: (posenc_runs(os.path.join(d, f"posenc-{m}.json")),
                           llama_rows(os.path.join(d, f"llama-bench-{m}.json"))) for m in sorted(here)})
    return rounds


def median_of(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def main(out_dir):
    rounds = load_rounds(out_dir)
    models = sorted(rounds[0])

    def per_round(model, name, key):
        return [r[model][0].get(name, {}).get(key) for r in rounds]

    # The peaks and read rates of each model's own process (every round's posenc-<model>.json measures them). A run
    # whose float32 products took the AVX2 path is set against the 8-lane FMA peak.
    avx2 = {m: rounds[0][m][0]["__context__"].get("posenc_dense_kernel") == "avx2" for m in models}
    peak = {(m, t): median_of(per_round(m, f"BM_FmaPeak{'Avx2' if avx2[m] else ''}/threads:{t}/real_time", "GFLOPs"))
            for m in models for t in (1, 2)}
    dram = {(m, t): median_of(per_round(m, f"BM_DramRead/threads:{t}/real_time", "GB_per_s")) for m in models for t in (1, 2)}
    print(open(os.path.join(out_dir, "session.txt")).read().strip())
    print()
    if len(rounds) > 1:
        print(f"{len(rounds)} rounds, llama-bench and posenc taking turns model by model: tokens/s are medians over the "
              "rounds; a ratio is the median of the rounds' own ratios [their range], not the quotient of the two "
              "medians; a decode's share is the median round's share of the read rate measured beside it [the range], "
              "with that round's GB/s")
        print()
    kernels = sorted({(c.get("posenc_dense_kernel"), c.get("posenc_q8_kernel")) for m in models
                      for c in [rounds[0][m][0]["__context__"]] if c.get("posenc_dense_kernel")})
    for dense, q8 in kernels:
        print(f"posenc's paths: float32 products {dense}, q8_activations products {q8}"
              + (" (the share of the FMA peak below is of the 8-lane AVX2 FMA peak, BM_FmaPeakAvx2)"
                 if dense == "avx2" else ""))
        print()
    ceiling = median_of(per_round(models[0], "BM_FmaPeakWithLoads/loads:11/real_time", "GFLOPs"))
    if ceiling and peak.get((models[0], 1)) and not avx2[models[0]]:
        print(f"FMA peak with the AVX-512 prefill tile's loads (11 per 24 FMAs, from L1; one thread): {ceiling:.0f} "
              f"GFLOP/s, {100 * ceiling / peak[(models[0], 1)]:.0f}% of the FMA peak")
        print()
    huge = []
    first = rounds[0][models[0]][0]
    share = first.get("BM_DramRead/threads:1/real_time", {}).get("huge_page_share", -1)
    if share >= 0:
        huge.append(f"DRAM read buffer {100 * share:.0f}%")
    for m in models:
        for k, r in sorted(rounds[0][m][0].items()):
            if (k.startswith(f"BM_RealDecode/{m}.gguf") and k.endswith("/threads:1/real_time") and
                    r.get("huge_page_share", -1) >= 0):
                huge.append(f"{k.split('/')[1]} {100 * r['huge_page_share']:.0f}%")
    if huge:
        print("Resident bytes mapped in 2 MiB pages (posenc's process): " + ", ".join(huge))
        print()
    print("| model | test | threads | posenc t/s | llama.cpp t/s | posenc / llama.cpp | share of the machine's limit |")
    print("|---|---|--:|--:|--:|--:|--:|")
    for name in models:
        keys = sorted({k for r in rounds for k in r[name][1]}, key=lambda k: (k[1], not k[0].startswith("prefill"), k[0]))
        for test, t in keys:
            ll_rounds = [r[name][1].get((test, t)) for r in rounds]
            ll = median_of(ll_rounds)
            kind = {"prefill 256": "RealPrefill", "decode 64": "RealDecode"}.get(test)  # what posenc measures
            for mode in ("", "q8_activations", "bf16x6", "bf16x3"):
                bench = f"BM_{kind}/{name}.gguf{'@' + mode if mode else ''}/threads:{t}/real_time"
                label = f" ({mode})" if mode else ""
                ps = [r[name][0].get(bench) for r in rounds] if kind else [None]
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
                    elif dram.get((name, t)):
                        w = median_of([p["weight_GB_per_s"] if p else None for p in ps])
                        share_text = f"{100 * w / dram[(name, t)]:.0f}% of DRAM read ({w:.1f} of {dram[(name, t)]:.1f} GB/s)"
                    else:
                        share_text = ""
                elif peak.get((name, t)):
                    g = median_of([p["matmul_GFLOP_per_s"] if p else None for p in ps])
                    share_text = (f"{100 * g / peak[(name, t)]:.0f}% of {'AVX2 ' if avx2[name] else ''}FMA peak "
                                  f"({g:.0f} of {peak[(name, t)]:.0f} GFLOP/s)")
                else:
                    share_text = ""
                print(f"| {name}{label} | {test} | {t} | {pt:,.1f} | {ll:,.1f} | {ratio} | {share_text} |")
    # BM_RealDecodeTeam (runs from zen5-15 on): the decode team against a parallel region per projection, tokens
    # alternated in one process at two threads.
    team = []
    for name in models:
        q8_team = rounds[0][name][0]["__context__"].get("posenc_q8_kernel") in (None, "avx512_vnni", "amx")
        for mode in ("", "q8_activations"):
            if mode and not q8_team:
                continue  # q8_activations on AVX2 has no team: the A/B would compare regions with regions
            bench = f"BM_RealDecodeTeam/{name}.gguf{'@' + mode if mode else ''}/threads:2/real_time"
            ratios = [r[name][0][bench]["team_over_regions"] for r in rounds if bench in r[name][0]]
            if ratios:
                text = f"{name}{' (' + mode + ')' if mode else ''} {statistics.median(ratios):.3f}x"
                if len(ratios) > 1:
                    text += f" [{min(ratios):.3f}-{max(ratios):.3f}]"
                team.append(text)
    if team:
        print()
        print("Decode at two threads, one team of threads through the layers (the default) against a region per "
              "projection, tokens alternated in one process (BM_RealDecodeTeam): " + ", ".join(team))


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    try:
        main(sys.argv[1])
    except Bad as e:
        sys.exit(f"vs_llama_cpp_table: {e}")
