#!/usr/bin/env bash
# llama.cpp's speed on the test models: the baseline posenc's runtime is compared with
# (bench/llama_cpp_baseline.md holds the output, the commands and how to read it).
#
#   tools/refs/llama_bench_baseline.sh [OUT.md]
#
# Two llama-bench binaries of the same llama.cpp source:
#   prebuilt: llama-bench.cpp (LLAMA_CPP_SRC, default /work/refs/llama.cpp-src: node-llama-cpp's bundled
#             source) compiled here and linked against node-llama-cpp's prebuilt libllama/libggml, with the
#             CPU variant node-llama-cpp loads (GGML_BACKEND_PATH=libggml-cpu-sapphirerapids.so on this
#             machine): the very binaries that computed tests/model/data/llama_cpp/;
#   native:   LLAMA_CPP_BIN/llama-bench (default /work/refs/llama.cpp-src/build/bin, -DGGML_NATIVE=ON).
#             Its Q8_0 prompt processing crashes (SIGSEGV in ggml_backend_amx_mul_mat), so it runs the F32
#             files only.
# Models: stories260K.gguf (F32), TinyStories-656K-Q8_0.gguf, and TinyStories-656K-Q8_0 dequantized to F32
# by llama-quantize (no F32 GGUF of TinyStories-656K exists here: convert_hf_to_gguf.py needs torch and
# transformers). Prompt processing of 128 and 512 tokens (one ubatch), generation of 128 and 256 tokens
# (posenc's model_bench decodes 256 positions), 1 and 2
# threads, REPS (default 10) repetitions, flash attention FA (default off); llama-bench's KV cache is F16 (it accepts no
# F32 type).
# The load average before and after each run is recorded: the machine is shared; repeat noisy runs.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
OUT="${1:-$ROOT/bench/llama_cpp_baseline.raw.md}"
SHARED="${POSENC_SHARED_DIR:-/work/shared}"
SRC="${LLAMA_CPP_SRC:-/work/refs/llama.cpp-src}"
BIN="${LLAMA_CPP_BIN:-$SRC/build/bin}"
PRE="$ROOT/tools/refs/node_modules/@node-llama-cpp/linux-x64/bins/linux-x64"
VARIANT="${GGML_CPU_VARIANT:-sapphirerapids}"
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
M260="$SHARED/models/stories260K/stories260K.gguf"
Q656="$SHARED/models/TinyStories-656K-gguf/TinyStories-656K-Q8_0.gguf"
F656="$TMP/TinyStories-656K-F32-from-Q8_0.gguf"
"$BIN/llama-quantize" --allow-requantize "$Q656" "$F656" F32 1 > "$TMP/quantize.log" 2>&1

# llama-bench against the prebuilt libraries (their sonames are versioned: link through symlinks).
for l in llama.v0.5.0:llama ggml.v0.5.0:ggml ggml-base:ggml-base llama-common:llama-common; do
  ln -s "$PRE/lib${l%%:*}.so" "$TMP/lib${l##*:}.so"
done
nice g++ -std=c++17 -O2 -DNDEBUG -I"$SRC/include" -I"$SRC/ggml/include" -I"$SRC/common" -I"$SRC/vendor" \
  "$SRC/tools/llama-bench/llama-bench.cpp" "$SRC/tools/llama-bench/main.cpp" \
  -L"$TMP" -lllama-common -lllama -lggml -lggml-base -Wl,-rpath,"$PRE" -o "$TMP/llama-bench-prebuilt"

REPS="${REPS:-10}"
FA="${FA:-off}"
args=(-p 128,512 -n 128,256 -t 1,2 -r "$REPS" -fa "$FA")
# llama-bench's md table gives mean ± stddev; on a shared machine a stalled repetition drags the mean,
# so the JSON samples are kept too and summarized as median and best (max) tokens/s.
run() {  # label binary model [env]
  echo
  echo "\$ $1 -m $(basename "$3") ${args[*]} -o md"
  echo "loadavg before: $(cat /proc/loadavg)"
  if env $4 "$2" -m "$3" "${args[@]}" -o json > "$TMP/out.json" 2> "$TMP/err.log"; then
    node -e '
      const rows = JSON.parse(require("fs").readFileSync(process.argv[1], "utf8"));
      const med = (a) => { const s = [...a].sort((x, y) => x - y); const n = s.length; return n % 2 ? s[(n - 1) / 2] : (s[n / 2 - 1] + s[n / 2]) / 2; };
      console.log("| model | threads | test | median t/s | best t/s | mean ± sd t/s (llama-bench) |");
      console.log("|---|--:|---|--:|--:|--:|");
      for (const r of rows) {
        const test = r.n_prompt > 0 ? `pp${r.n_prompt}` : `tg${r.n_gen}`;
        console.log(`| ${r.model_type} | ${r.n_threads} | ${test} | ${med(r.samples_ts).toFixed(0)} | ${Math.max(...r.samples_ts).toFixed(0)} | ${r.avg_ts.toFixed(0)} ± ${r.stddev_ts.toFixed(0)} |`);
      }
      console.log("samples (t/s): " + rows.map((r) => (r.n_prompt > 0 ? "pp" + r.n_prompt : "tg" + r.n_gen) + "/t" + r.n_threads + " [" + r.samples_ts.map((x) => x.toFixed(0)).join(" ") + "]").join("; "));
    ' "$TMP/out.json"
  else
    echo "(failed: $(tail -1 "$TMP/err.log"))"
  fi
  echo "loadavg after:  $(cat /proc/loadavg)"
}
{
  echo "## llama-bench run $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo
  echo '```'
  echo "prebuilt: $(GGML_BACKEND_PATH="$PRE/libggml-cpu-$VARIANT.so" "$TMP/llama-bench-prebuilt" --version 2>&1 | grep -v load_backend | head -2 | tr '\n' ' ')"
  echo "          CPU backend libggml-cpu-$VARIANT.so (node-llama-cpp $(node -p "require('$ROOT/tools/refs/node_modules/node-llama-cpp/package.json').version"))"
  echo "native:   $("$BIN/llama-bench" --version 2>&1 | head -2 | tr '\n' ' ')"
  echo "cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $(nproc) cpus"
  echo "TinyStories-656K-F32-from-Q8_0.gguf: sha256 $(sha256sum "$F656" | cut -d' ' -f1)"
  for m in "$M260" "$Q656" "$F656"; do
    run llama-bench-prebuilt "$TMP/llama-bench-prebuilt" "$m" "GGML_BACKEND_PATH=$PRE/libggml-cpu-$VARIANT.so"
  done
  for m in "$M260" "$F656"; do
    run llama-bench-native "$BIN/llama-bench" "$m" ""
  done
  echo '```'
} | tee -a "$OUT"
