#!/usr/bin/env bash
# Regenerates tests/model/data/llama_cpp/converted-*/: llama.cpp's logits, NLL and greedy text
# for GGUF files written by `posenc convert` (TinyStories-656K from its Hugging Face directory,
# as F32 and as Q8_0), on the same window as TinyStories-656K-Q8_0/hf_window.json.
# The tests compare posenc reading the same converted files with these (and, when
# node-llama-cpp is installed, re-run llama.cpp on a freshly converted file).
#
#   tools/refs/make_convert_refs.sh [BUILD_DIR]      (default build; needs build/posenc)
#
# Needs scripts/install-refs (node-llama-cpp in tools/refs/node_modules). Single-threaded.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$ROOT"
BUILD="${1:-build}"
SHARED="${POSENC_SHARED_DIR:-$ROOT/../shared}"
M656="$SHARED/models/TinyStories-656K"
OUT=tests/model/data/llama_cpp
WINDOW="$OUT/TinyStories-656K-Q8_0/hf_window.json"
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
for type in f32 q8_0; do
  "$BUILD/posenc" convert --model "$M656" --to gguf --type "$type" --out "$TMP/TinyStories-656K-$type.gguf" > /dev/null 2>&1
  dir="$OUT/converted-TinyStories-656K-$type"
  mkdir -p "$dir"
  node tools/refs/llama_cpp_refs.mjs --model "$TMP/TinyStories-656K-$type.gguf" --tokens "$WINDOW" --logits-every 8 \
    --greedy-prompt-ids '[1]' --greedy-prompt-text "Once upon a time" --greedy-tokens 40 --threads 1 --out "$dir" \
    --label "posenc convert --model TinyStories-656K --to gguf --type $type (llama.cpp tokenizes the prompt with the converted file's embedded vocabulary)"
  node tools/refs/check_llama_cpp_data.mjs "$dir" --nll-range 3.5,4.5 --expect-prompt-ids 0 '[1]' \
    --expect-prompt-ids 1 '[1,80,147,201,282,57]' --expect-greedy-text 0 "Once upon a time"
done
