// Reference tokenizations from llama.cpp's own tokenizer (llama-tokenize) of
// the vocabulary a GGUF file embeds, for posenc's GGUF tokenizer tests.
//
// For every string of hard_strings.mjs: the ids with and without BOS
// (llama-tokenize --ids --no-escape --no-parse-special [--no-bos], so control
// tokens such as <s> are never produced from text), and the whole
// tinystories_val.txt without BOS as the id count plus FNV-1a 64 hashes of
// chunks of 4096 int32 ids (as hf_tokenizers_refs.mjs).
//
// Usage (from the repository root; what tests/model/data/llama_cpp/stories260K.json came from):
//   node tools/refs/llama_cpp_tokenize_refs.mjs --shared /work/shared \
//     --llama-tokenize /work/refs/llama.cpp-src/build/bin/llama-tokenize --out tests/model/data/llama_cpp
// llama-tokenize is built from the llama.cpp source bundled in node-llama-cpp
// (see /work/shared/docs/references.md); its version line is recorded.
import { createHash } from "node:crypto";
import { spawnSync } from "node:child_process";
import fs from "node:fs";
import os from "node:os";
import path from "node:path";
import { HARD_STRINGS } from "./hard_strings.mjs";
import { fnv1a64, stringify, TEXT, CHUNK } from "./hf_tokenizers_refs.mjs";

function arg(name, fallback) {
  const i = process.argv.indexOf(name);
  return i >= 0 && i + 1 < process.argv.length ? process.argv[i + 1] : fallback;
}

function sha256(file) {
  return createHash("sha256").update(fs.readFileSync(file)).digest("hex");
}

const shared = arg("--shared", process.env.POSENC_SHARED_DIR || "/work/shared");
const bin = arg("--llama-tokenize", "/work/refs/llama.cpp-src/build/bin/llama-tokenize");
const out = arg("--out", "tests/model/data/llama_cpp");
const MODELS = [["stories260K", "models/stories260K/stories260K.gguf"]];

function tokenize(model, file, bos) {
  const args = ["-m", model, "-f", file, "--ids", "--no-escape", "--no-parse-special", "--log-disable"];
  if (!bos) args.push("--no-bos");
  const r = spawnSync(bin, args, { encoding: "utf8", maxBuffer: 1 << 28 });
  if (r.status !== 0) throw new Error(`${bin} ${args.join(" ")} failed (${r.status}): ${r.stderr}`);
  const line = r.stdout.trim().split("\n").pop();
  return JSON.parse(line);
}

const version = spawnSync(bin, ["--version"], { encoding: "utf8" });
const versionLine = (version.stdout + version.stderr).split("\n").find((l) => l.startsWith("version:")) || "unknown";
const tmp = fs.mkdtempSync(path.join(os.tmpdir(), "posenc-llama-tok-"));
fs.mkdirSync(out, { recursive: true });
try {
  for (const [name, rel] of MODELS) {
    const model = path.join(shared, rel);
    const cases = [];
    const f = path.join(tmp, "s.txt");
    for (const s of HARD_STRINGS) {
      fs.writeFileSync(f, s, "utf8");
      cases.push({ text: s, ids: tokenize(model, f, false), ids_bos: tokenize(model, f, true) });
    }
    const ids = tokenize(model, path.join(shared, TEXT), false);
    const hashes = [];
    for (let i = 0; i < ids.length; i += CHUNK) hashes.push(fnv1a64(ids, i, Math.min(ids.length, i + CHUNK)));
    const result = {
      generator: "tools/refs/llama_cpp_tokenize_refs.mjs",
      command: "node tools/refs/llama_cpp_tokenize_refs.mjs --shared /work/shared " +
        "--llama-tokenize /work/refs/llama.cpp-src/build/bin/llama-tokenize --out tests/model/data/llama_cpp",
      library: "llama.cpp llama-tokenize --ids --no-escape --no-parse-special",
      library_version: versionLine.replace(/^version:\s*/, ""),
      model: rel,
      model_sha256: sha256(model),
      cases,
      whole_text: {
        file: TEXT,
        sha256: sha256(path.join(shared, TEXT)),
        bos: false,
        count: ids.length,
        chunk: CHUNK,
        fnv1a64: hashes,
      },
    };
    fs.writeFileSync(path.join(out, `${name}.json`), stringify(result));
    process.stderr.write(`${name}: ${ids.length} tokens for the whole text\n`);
  }
} finally {
  fs.rmSync(tmp, { recursive: true, force: true });
}
