#!/usr/bin/env python3
"""The package test (ctest: package_external): posenc as another CMake project sees it.

1. `cmake --install` of the build tree into a fresh prefix; the layout is checked (headers, libraries, the
   CLI, its scripts, lib/cmake/posenc with the config, version and targets files; the training part only when
   built with it).
2. tests/package/external, configured against that prefix alone (CMAKE_PREFIX_PATH), built and run: it calls
   find_package(posenc <our version> REQUIRED), links posenc::core, computes the YaRN frequencies of
   configs/deepseek-v3.json and rotates a vector with them. Its output is compared with the Hugging Face
   reference: inv_freq and attention_factor with rope_init.json's case yarn_deepseek_v3_mscale1_mscale_all_dim1
   (the same parameters: factor 40, original 4096, beta 32/1, mscale 1/1, theta 10000, rotary_dim 64), and the
   rotation with the reference's own rule (DeepSeek-V3's apply_rotary_pos_emb_interleave, float32 angles and
   products, as testdata/hf_reference/README.md states) applied to the reference frequencies.
3. find_package(posenc <next minor version>) must fail: posencConfigVersion.cmake refuses a newer request
   (and step 2 asked for exactly ours, which it accepts); so must COMPONENTS train from a build without it.
4. The installed CLI: `posenc --version` is our version; it runs its scripts from <prefix>/share/posenc/scripts
   and (training built) loads <prefix>/lib/posenc/libposenc_torch.so, found from its own location.

Only the Python standard library. Exit 0 = pass, 1 = a check failed (each failure printed).
"""
import argparse
import json
import math
import os
import shutil
import struct
import subprocess
import sys
import time

FAILURES = []


def check(ok, what):
    print(("ok   " if ok else "FAIL ") + what, flush=True)
    if not ok:
        FAILURES.append(what)
    return ok


def run(cmd, env=None, expect=0):
    t0 = time.monotonic()
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    dt = time.monotonic() - t0
    print(f"$ {' '.join(cmd)}  [{dt:.1f} s, exit {p.returncode}]", flush=True)
    if expect is not None and p.returncode != expect:
        print(p.stdout[-4000:])
        print(p.stderr[-4000:])
        raise SystemExit(f"FAIL: exit {p.returncode} (expected {expect}): {' '.join(cmd)}")
    return p


def f32(v):
    return struct.unpack("f", struct.pack("f", v))[0]


def expected_rotation(out, inv_freq, attention_factor):
    """HF apply_rotary_pos_emb_interleave / apply_rotary_pos_emb in float32 from the reference inv_freq."""
    heads, d, rd = out["heads"], out["head_dim"], len(inv_freq) * 2
    n = rd // 2
    x = out["x"]
    y = list(x)
    for t, pos in enumerate(out["positions"]):
        cos = [f32(f32(math.cos(f32(f32(pos) * f))) * attention_factor) for f in inv_freq]
        sin = [f32(f32(math.sin(f32(f32(pos) * f))) * attention_factor) for f in inv_freq]
        for h in range(heads):
            base = (t * heads + h) * d
            for i in range(n):
                if out["layout"] == "half":
                    a, b = x[base + i], x[base + i + n]
                else:  # interleaved pairs (2i, 2i+1)
                    a, b = x[base + 2 * i], x[base + 2 * i + 1]
                r0 = f32(f32(a * cos[i]) - f32(b * sin[i]))
                r1 = f32(f32(b * cos[i]) + f32(a * sin[i]))
                if out["layout"] == "interleaved":
                    y[base + 2 * i], y[base + 2 * i + 1] = r0, r1
                else:  # half, and interleaved_in_half_out (DeepSeek-V3 writes half order)
                    y[base + i], y[base + i + n] = r0, r1
    return y


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cmake", required=True)
    ap.add_argument("--build-dir", required=True)
    ap.add_argument("--source-dir", required=True)
    ap.add_argument("--shared-dir", required=True)
    ap.add_argument("--work-dir", required=True)
    ap.add_argument("--version", required=True, help="the CMake project version")
    ap.add_argument("--with-train", type=int, required=True)
    ap.add_argument("--generator", default="")
    ap.add_argument("--cxx-compiler", default="")
    ap.add_argument("--launcher", default="")
    a = ap.parse_args()

    work = os.path.abspath(a.work_dir)
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    prefix = os.path.join(work, "prefix")

    # 1. install and the layout
    run([a.cmake, "--install", a.build_dir, "--prefix", prefix])
    expect = ["include/posenc/rope.hpp", "include/posenc/config.hpp", "include/posenc/version.hpp",
              "include/posenc/synthetic_tasks.hpp", "lib/libposenc_core.a", "bin/posenc",
              "share/posenc/scripts/plot_periods.py", "share/posenc/scripts/plotio.py",
              "lib/cmake/posenc/posencConfig.cmake", "lib/cmake/posenc/posencConfigVersion.cmake",
              "lib/cmake/posenc/posencTargets.cmake"]
    train_files = ["lib/libposenc_train.a", "lib/posenc/libposenc_torch.so", "include/posenc/train.hpp",
                   "include/posenc/study.hpp"]
    for f in expect:
        check(os.path.isfile(os.path.join(prefix, f)), f"installed {f}")
    for f in train_files:
        present = os.path.isfile(os.path.join(prefix, f))
        check(present == bool(a.with_train), f"{f} {'installed' if a.with_train else 'absent (no training part)'}")

    # 2. the external project
    common = ["-DCMAKE_BUILD_TYPE=Release", f"-DCMAKE_PREFIX_PATH={prefix}"]
    if a.generator:
        common += ["-G", a.generator]
    if a.cxx_compiler:
        common.append(f"-DCMAKE_CXX_COMPILER={a.cxx_compiler}")
    if a.launcher:
        common.append(f"-DCMAKE_CXX_COMPILER_LAUNCHER={a.launcher}")
    ext_src = os.path.join(a.source_dir, "tests", "package", "external")
    ext_build = os.path.join(work, "external")
    components = "core;train" if a.with_train else "core"
    run([a.cmake, "-S", ext_src, "-B", ext_build, *common, f"-DPOSENC_EXTERNAL_REQUIRE_VERSION={a.version}",
         f"-DPOSENC_EXTERNAL_COMPONENTS={components}"])
    run([a.cmake, "--build", ext_build, "-j2"])
    config = os.path.join(a.shared_dir, "configs", "deepseek-v3.json")
    p = run([os.path.join(ext_build, "posenc_external"), config])
    out = json.loads(p.stdout)
    print("external program:", {k: v for k, v in out.items() if k not in ("x", "rotated", "inv_freq")})

    with open(os.path.join(a.shared_dir, "testdata", "hf_reference", "rope_init.json")) as f:
        cases = {c["name"]: c for c in json.load(f)["cases"]}
    ref = cases["yarn_deepseek_v3_mscale1_mscale_all_dim1"]["outputs"]
    check(out["posenc_version"] == a.version, f"posenc::version() {out['posenc_version']} == {a.version}")
    check(out["package_version"] == a.version, f"find_package's posenc_VERSION {out['package_version']} == {a.version}")
    check(out["rope_type"] == "yarn", f"rope_type {out['rope_type']} == yarn")
    check(out["rotary_dim"] == ref["rotary_dim"], f"rotary_dim {out['rotary_dim']} == reference {ref['rotary_dim']}")
    inv, inv_ref = out["inv_freq"], ref["inv_freq"]
    if check(len(inv) == len(inv_ref), f"{len(inv)} inv_freq values == reference {len(inv_ref)}"):
        worst = max(abs(u - v) / v for u, v in zip(inv, inv_ref))
        exact = sum(u == v for u, v in zip(inv, inv_ref))
        check(worst <= 1e-6, f"inv_freq within 1e-6 relative of the reference (worst {worst:.3g}; "
                             f"{exact}/{len(inv)} bit-identical)")
    check(abs(out["attention_factor"] - ref["attention_factor"]) <= 1e-12,
          f"attention_factor {out['attention_factor']!r} == reference {ref['attention_factor']!r}")
    check(out["layout"] == "interleaved_in_half_out", f"layout {out['layout']} (DeepSeek-V3's rope_interleave)")
    want = expected_rotation(out, inv_ref, ref["attention_factor"])
    got = out["rotated"]
    if check(len(got) == len(want), f"{len(got)} rotated values"):
        err = max(abs(u - v) for u, v in zip(got, want))
        check(err <= 2e-6, f"rotation at positions {out['positions']} within 2e-6 of the reference rule "
                           f"(worst {err:.3g})")
        check(max(abs(u - v) for u, v in zip(got, out["x"])) > 0.1, "the rotation changed the vector")

    # 3. a newer version than ours is refused
    major, minor = (int(v) for v in a.version.split(".")[:2])
    newer = f"{major}.{minor + 1}"
    p = run([a.cmake, "-S", ext_src, "-B", os.path.join(work, "too-new"), *common,
             f"-DPOSENC_EXTERNAL_REQUIRE_VERSION={newer}"], expect=None)
    text = p.stdout + p.stderr
    check(p.returncode != 0, f"find_package(posenc {newer} REQUIRED) fails (exit {p.returncode})")
    check(f'requested version "{newer}"' in text and f"posencConfig.cmake, version: {a.version}" in text,
          f"its message names the version asked ({newer}) and the installed package's ({a.version})")

    if not a.with_train:
        p = run([a.cmake, "-S", ext_src, "-B", os.path.join(work, "no-train"), *common,
                 "-DPOSENC_EXTERNAL_COMPONENTS=core;train"], expect=None)
        check(p.returncode != 0 and "built without the training part (-DPOSENC_WITH_TRAIN=OFF)" in p.stdout + p.stderr,
              f"find_package(posenc COMPONENTS train) fails without the training part (exit {p.returncode})")

    # 4. the installed CLI
    env = {k: v for k, v in os.environ.items() if k not in ("POSENC_SCRIPTS_DIR", "POSENC_PYTHON")}
    cli = os.path.join(prefix, "bin", "posenc")
    p = run([cli, "--version"], env=env)
    check(p.stdout.startswith(f"posenc {a.version} (git "), f"installed `posenc --version`: {p.stdout.strip()}")
    # A failing interpreter makes the CLI name the script it ran: the installed one.
    env_false = dict(env, POSENC_PYTHON="/bin/false")
    p = run([cli, "periods", "--rope-theta", "10000", "--context", "4K", "--plot", os.path.join(work, "p.png")],
            env=env_false, expect=1)
    script = os.path.join(prefix, "share", "posenc", "scripts", "plot_periods.py")
    check(script in p.stderr, f"the installed CLI runs {script}: {p.stderr.strip()}")
    if a.with_train:
        # LD_DEBUG=files logs every file the loader maps: libposenc_torch.so must come from the prefix.
        env_ld = dict(env, LD_DEBUG="files")
        p = run([cli, "train", "--task", "copy", "--pe", "rope", "--steps", "2", "--batch-size", "2", "--dim", "16",
                 "--heads", "2", "--layers", "1", "--eval-samples", "0", "--out", os.path.join(work, "m.pt")],
                env=env_ld)
        module = os.path.join(prefix, "lib", "posenc", "libposenc_torch.so")
        loaded = [line for line in p.stderr.splitlines() if "libposenc_torch.so" in line and "file=" in line]
        build_module = os.path.join(os.path.abspath(a.build_dir), "libposenc_torch.so")
        check(any(module in line for line in loaded) and not any(build_module in line for line in loaded),
              f"the installed CLI loads {module} (loader: {loaded[:1]})")
        check(os.path.isfile(os.path.join(work, "m.pt")), "and trains with it (checkpoint written)")
    else:
        p = run([cli, "train", "--task", "copy", "--out", os.path.join(work, "m.pt")], env=env, expect=2)
        check("-DPOSENC_WITH_TRAIN=ON" in p.stderr, f"installed `posenc train` without the training part: "
                                                    f"{p.stderr.strip()}")

    if FAILURES:
        print(f"{len(FAILURES)} check(s) failed")
        return 1
    print("all package checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
