#!/usr/bin/env bash
# Regenerates tests/model/data/llama_cpp/ (see its README.md): llama.cpp's logits, NLL and greedy
# continuations for stories260K.gguf and TinyStories-656K-Q8_0.gguf (and the latter dequantized to
# F32 by llama-quantize), then checks the result without llama.cpp.
#
#   tools/refs/make_llama_cpp_data.sh [OUT_DIR]
#
# Needs: scripts/install-refs (node-llama-cpp, tokenizers in tools/refs/node_modules), a built
# posenc_core (build/libposenc_core.a: cmake --build build --target posenc_core), g++, and for the dequantized
# data set llama-quantize (LLAMA_CPP_BIN, default /work/refs/llama.cpp-src/build/bin; skipped if absent).
# Fixtures from POSENC_SHARED_DIR (default /work/shared). Runs single-threaded (--threads 1).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$ROOT"
OUT="${1:-tests/model/data/llama_cpp}"
SHARED="${POSENC_SHARED_DIR:-/work/shared}"
LLAMA_CPP_BIN="${LLAMA_CPP_BIN:-/work/refs/llama.cpp-src/build/bin}"
TEXT="$SHARED/data/tinystories_val.txt"
S260="$SHARED/models/stories260K"
M656="$SHARED/models/TinyStories-656K"
Q656="$SHARED/models/TinyStories-656K-gguf/TinyStories-656K-Q8_0.gguf"
PROMPT="Once upon a time"
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
mkdir -p "$OUT"

# posenc's side: the ppl protocol's stream (encode_stream with tok512.bin), its blocks, the prompt's ids,
# and posenc's own logits of the window (Model::load_llama2c + score_window on stories260K.bin).
g++ -std=c++20 -O2 -fopenmp -Iinclude -Isrc tools/refs/posenc_window.cpp build/libposenc_core.a -lfmt -o "$TMP/posenc_window"
mkdir -p "$OUT/stories260K"
"$TMP/posenc_window" --tokenizer "$S260/tok512.bin" --text "$TEXT" --window 512 --prompt "$PROMPT" \
  --model "$S260/stories260K.bin" --logits-out "$TMP/posenc_stories260K_logits.f32" > "$OUT/stories260K/posenc_window.json"

# 1. stories260K.gguf (F32): NLL and argmax of all 512 positions, the logits of every 8th (as for the other
#    data sets: 128 KiB instead of 1 MiB in the repository; LlamaCppLive.* compares all 512 live), greedy
#    100 tokens of the prompt tokenized by llama.cpp.
node tools/refs/llama_cpp_refs.mjs --model "$S260/stories260K.gguf" --tokens "$OUT/stories260K/posenc_window.json" \
  --logits-every 8 --out "$OUT/stories260K" --greedy-prompt-text "$PROMPT" --greedy-tokens 100 --threads 1 \
  --label "stories260K.gguf: the first 512 ids of posenc's ppl stream of tinystories_val.txt (tok512.bin)"
POSENC_PROMPT_IDS="$(node -e 'process.stdout.write(JSON.stringify(JSON.parse(require("fs").readFileSync(process.argv[1])).prompt_ids))' "$OUT/stories260K/posenc_window.json")"
node tools/refs/check_llama_cpp_data.mjs "$OUT/stories260K" --nll-range 1.3,1.7 \
  --expect-prompt-ids 0 "$POSENC_PROMPT_IDS" --expect-greedy-text 0 ", there was a little girl" \
  --other-logits "$TMP/posenc_stories260K_logits.f32" --other-tol 1e-4

# 2. TinyStories-656K-Q8_0.gguf: the window tokenized by tokenizer.json (addSpecialTokens), from the same
#    blocks; every 8th position's logits; greedy 40 tokens from BOS and from the prompt.
mkdir -p "$OUT/TinyStories-656K-Q8_0"
node tools/refs/hf_window.mjs --tokenizer "$M656/tokenizer.json" --text "$TEXT" --window 512 \
  --blocks-from "$OUT/stories260K/posenc_window.json" --prompt "$PROMPT" > "$OUT/TinyStories-656K-Q8_0/hf_window.json"
HF_PROMPT_IDS="$(node -e 'process.stdout.write(JSON.stringify(JSON.parse(require("fs").readFileSync(process.argv[1])).prompts[0].ids))' "$OUT/TinyStories-656K-Q8_0/hf_window.json")"
q656_args=(--tokens "$OUT/TinyStories-656K-Q8_0/hf_window.json" --logits-every 8 --hf-tokenizer "$M656/tokenizer.json"
           --greedy-prompt-ids '[1]' --greedy-prompt-text "$PROMPT" --greedy-tokens 40 --threads 1)
node tools/refs/llama_cpp_refs.mjs --model "$Q656" --out "$OUT/TinyStories-656K-Q8_0" "${q656_args[@]}" \
  --label "TinyStories-656K-Q8_0.gguf: the first 512 ids of the ppl stream of tinystories_val.txt tokenized by TinyStories-656K/tokenizer.json"
node tools/refs/check_llama_cpp_data.mjs "$OUT/TinyStories-656K-Q8_0" --nll-range 3.5,4.5 \
  --expect-prompt-ids 0 '[1]' --expect-prompt-ids 1 "$HF_PROMPT_IDS" --expect-greedy-text 0 "Once upon a time"

# 3. The same weights dequantized to F32 by llama-quantize (what a dequantize-then-float32 forward of the
#    Q8_0 file computes, without llama.cpp's 8-bit activations).
if [[ -x "$LLAMA_CPP_BIN/llama-quantize" ]]; then
  DEQ="$TMP/TinyStories-656K-F32-from-Q8_0.gguf"
  "$LLAMA_CPP_BIN/llama-quantize" --allow-requantize "$Q656" "$DEQ" F32 1 > "$TMP/quantize.log" 2>&1
  mkdir -p "$OUT/TinyStories-656K-Q8_0-dequantized-F32"
  node tools/refs/llama_cpp_refs.mjs --model "$DEQ" --out "$OUT/TinyStories-656K-Q8_0-dequantized-F32" "${q656_args[@]}" \
    --label "TinyStories-656K-Q8_0.gguf dequantized to F32 (llama-quantize --allow-requantize ... F32 1), same window and prompts"
  node tools/refs/check_llama_cpp_data.mjs "$OUT/TinyStories-656K-Q8_0-dequantized-F32" --nll-range 3.5,4.5 \
    --expect-prompt-ids 0 '[1]' --expect-prompt-ids 1 "$HF_PROMPT_IDS"
  if /usr/bin/python3 -c 'import numpy' 2>/dev/null; then
    /usr/bin/python3 tools/refs/llama_cpp_emulation.py --gguf "$DEQ" \
      --tokens "$OUT/TinyStories-656K-Q8_0-dequantized-F32/summary.json" --compare "$OUT/TinyStories-656K-Q8_0-dequantized-F32"
  fi
else
  echo "make_llama_cpp_data: $LLAMA_CPP_BIN/llama-quantize not found; TinyStories-656K-Q8_0-dequantized-F32 not regenerated" >&2
fi

# The arithmetic the README describes, restated in numpy (tools/refs/llama_cpp_emulation.py), reproduces
# llama.cpp's rows bit for bit on this machine (it prints how many; it does not fail otherwise: on another
# CPU or libm the prebuilt library computes differently).
if /usr/bin/python3 -c 'import numpy' 2>/dev/null; then
  /usr/bin/python3 tools/refs/llama_cpp_emulation.py --gguf "$S260/stories260K.gguf" \
    --tokens "$OUT/stories260K/summary.json" --compare "$OUT/stories260K"
  /usr/bin/python3 tools/refs/llama_cpp_emulation.py --gguf "$Q656" --tokens "$OUT/TinyStories-656K-Q8_0/summary.json" \
    --compare "$OUT/TinyStories-656K-Q8_0"
fi
du -sh "$OUT"
