// Reference tokenizations from Hugging Face `tokenizers` (the Rust library
// transformers uses; npm package `tokenizers`, Node bindings), for posenc's
// tokenizer.json tests (tests/model/tokenizer_json_test.cpp).
//
// For each shared BPE tokenizer.json: every string of hard_strings.mjs encoded
// with and without special tokens, the library's decode(ids, true) of both and
// whether the plain one round-trips; and the whole tinystories_val.txt encoded
// as one string, stored as the id count plus FNV-1a 64 hashes of the int32
// little-endian ids in chunks of 4096 (a test can then name the first chunk
// that differs without storing 200k ids). Also the variants below (a shared
// file with components replaced), saved as variant-<name>.json.
//
// Usage (from the repository root; what tests/model/data/hf_tokenizers/*.json came from):
//   node tools/refs/hf_tokenizers_refs.mjs --shared /work/shared --out tests/model/data/hf_tokenizers
// Needs tools/refs/node_modules (scripts/install-refs). Deterministic: the
// output depends only on the inputs and the library version. Encode timings
// go to stderr, not into the files.
import { createRequire } from "node:module";
import { createHash } from "node:crypto";
import fs from "node:fs";
import path from "node:path";
import { HARD_STRINGS } from "./hard_strings.mjs";

const require = createRequire(import.meta.url);
const { Tokenizer } = require("tokenizers");
const LIB_VERSION = require("tokenizers/package.json").version;

export const TOKENIZERS = [
  ["tinystories-656k", "models/TinyStories-656K/tokenizer.json"],
  ["gpt2", "tokenizers/gpt2/tokenizer.json"],
  ["pythia-70m", "tokenizers/pythia-70m/tokenizer.json"],
  ["smollm2-135m-instruct", "tokenizers/smollm2-135m-instruct/tokenizer.json"],
  ["mistral-7b-v0.1", "tokenizers/mistral-7b-v0.1/tokenizer.json"],
];
export const TEXT = "data/tinystories_val.txt";

// Variants: a shared tokenizer.json with some components replaced, to cover
// the pre-tokenizers, normalizers, post-processors, decoders and added-token
// flags the shared files do not use, on real vocabularies. A patch is applied
// by apply_patch() here and by the C++ test in the same way: "model" keys are
// merged into model, "added_tokens+" entries are appended to added_tokens,
// "merges_as_arrays" rewrites "a b" merges as ["a", "b"]; any other key
// replaces the top-level field.
const LLAMA3_RE = "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
const QWEN2_RE = "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
const BL_NOREGEX = { type: "ByteLevel", add_prefix_space: false, trim_offsets: true, use_regex: false };
const seqBL = (...pre) => ({ type: "Sequence", pretokenizers: [...pre, BL_NOREGEX] });
const split = (pattern, behavior, invert = false) => ({ type: "Split", pattern, behavior, invert });
const EOT = { "<|endoftext|>": { id: "<|endoftext|>", ids: [50256], tokens: ["<|endoftext|>"] } };
const tmpl = (single, special_tokens) => ({ type: "TemplateProcessing", single, pair: single, special_tokens });
const ST = (id) => ({ SpecialToken: { id, type_id: 0 } });
const SEQ_A = { Sequence: { id: "A", type_id: 0 } };
const GPT2 = "tokenizers/gpt2/tokenizer.json";
const MISTRAL = "tokenizers/mistral-7b-v0.1/tokenizer.json";
const TINY = "models/TinyStories-656K/tokenizer.json";
const metaspace = (prepend_scheme, split) => ({ type: "Metaspace", replacement: "\u2581", prepend_scheme, split });
export const VARIANTS = [
  ["gpt2-llama3-style", GPT2, {
    pre_tokenizer: seqBL(split({ Regex: LLAMA3_RE }, "Isolated")),
    model: { ignore_merges: true },
    post_processor: { type: "Sequence", processors: [
      { type: "ByteLevel", add_prefix_space: true, trim_offsets: false, use_regex: true },
      tmpl([ST("<|endoftext|>"), SEQ_A], EOT)] },
  }, []],
  ["gpt2-qwen2-style", GPT2, { normalizer: { type: "NFC" }, pre_tokenizer: seqBL(split({ Regex: QWEN2_RE }, "Isolated")) }, []],
  ["gpt2-split-removed", GPT2, { pre_tokenizer: seqBL(split({ String: " " }, "Removed")) }, []],
  ["gpt2-split-merged-with-previous", GPT2, { pre_tokenizer: seqBL(split({ Regex: "\\s+" }, "MergedWithPrevious")) }, []],
  ["gpt2-split-merged-with-next", GPT2, { pre_tokenizer: seqBL(split({ String: " " }, "MergedWithNext")) }, []],
  ["gpt2-split-contiguous", GPT2, { pre_tokenizer: seqBL(split({ Regex: "[aeiou]" }, "Contiguous")) }, []],
  ["gpt2-split-invert", GPT2, { pre_tokenizer: seqBL(split({ Regex: "\\p{L}+|\\p{N}+" }, "Removed", true)) }, []],
  ["gpt2-digits-prefix-space", GPT2, { pre_tokenizer: { type: "Sequence", pretokenizers: [
    { type: "Digits", individual_digits: false },
    { type: "ByteLevel", add_prefix_space: true, trim_offsets: true, use_regex: true }] } }, []],
  ["gpt2-nfkc-lowercase", GPT2, { normalizer: { type: "Sequence", normalizers: [{ type: "NFKC" }, { type: "Lowercase" }] } }, []],
  ["gpt2-nfd-strip-accents", GPT2, { normalizer: { type: "Sequence", normalizers: [
    { type: "NFD" }, { type: "StripAccents" }, { type: "Strip", strip_left: true, strip_right: true }] } }, []],
  ["gpt2-nfkd", GPT2, { normalizer: { type: "NFKD" } }, []],
  ["gpt2-whitespace", GPT2, { pre_tokenizer: seqBL({ type: "Whitespace" }) }, []],
  ["gpt2-whitespace-split-punctuation", GPT2, { pre_tokenizer: seqBL({ type: "WhitespaceSplit" },
    { type: "Punctuation", behavior: "Isolated" }) }, []],
  ["gpt2-char-delimiter", GPT2, { pre_tokenizer: { type: "Sequence", pretokenizers: [
    { type: "CharDelimiterSplit", delimiter: "o" },
    { type: "ByteLevel", add_prefix_space: false, trim_offsets: true, use_regex: true }] } }, []],
  ["gpt2-added-token-flags", GPT2, {
    normalizer: { type: "Lowercase" },
    "added_tokens+": [
      { id: 50257, content: "<mask>", single_word: false, lstrip: true, rstrip: true, normalized: false, special: true },
      { id: 50258, content: "once", single_word: true, lstrip: false, rstrip: false, normalized: true, special: false },
      { id: 50259, content: "Lily", single_word: false, lstrip: true, rstrip: false, normalized: false, special: false },
      { id: 50260, content: "ZZ", single_word: false, lstrip: false, rstrip: true, normalized: true, special: true }],
  }, ["Hi <mask> there\t<mask>\t<mask>\u2000x", "once upon once, onceupon Once ONCE-once", "Lily and  Lily\tLilyLily",
      "<mask><mask>", "a zz  b ZZ\nc", "  <mask>  Lily  "]],
  ["gpt2-array-merges", GPT2, { merges_as_arrays: true }, []],
  ["gpt2-roberta-processing", GPT2, { post_processor: { type: "RobertaProcessing", sep: ["<|endoftext|>", 50256],
    cls: ["<|endoftext|>", 50256], trim_offsets: true, add_prefix_space: false } }, []],
  ["gpt2-no-decoder", GPT2, { decoder: null }, []],
  ["mistral-metaspace-first", MISTRAL, { normalizer: null, pre_tokenizer: metaspace("first", false),
    decoder: metaspace("first", false) }, ["Hello <s>world", " Hey <s>how <s>are <s> you", "<s> x"]],
  ["mistral-metaspace-always-split", MISTRAL, { normalizer: null, pre_tokenizer: metaspace("always", true),
    decoder: metaspace("always", true) }, ["Hello <s>world", " Hey <s>how <s>are <s> you"]],
  ["mistral-metaspace-never", MISTRAL, { normalizer: null, pre_tokenizer: metaspace("never", true),
    decoder: metaspace("never", true) }, ["Hello <s>world"]],
  ["mistral-template-bos-eos", MISTRAL, { post_processor: tmpl([ST("<s>"), SEQ_A, ST("</s>")], {
    "<s>": { id: "<s>", ids: [1], tokens: ["<s>"] }, "</s>": { id: "</s>", ids: [2], tokens: ["</s>"] } }) }, []],
  ["tinystories-replace-regex", TINY, { normalizer: { type: "Sequence", normalizers: [
    { type: "Prepend", prepend: "\u2581" }, { type: "Replace", pattern: { Regex: "\\s" }, content: "\u2581" }] } }, []],
];

export function apply_patch(root, patch) {
  for (const [k, v] of Object.entries(patch)) {
    if (k === "model") Object.assign(root.model, v);
    else if (k === "added_tokens+") root.added_tokens = [...(root.added_tokens || []), ...v];
    else if (k === "merges_as_arrays") {
      if (v) root.model.merges = root.model.merges.map((m) => { const i = m.indexOf(" "); return [m.slice(0, i), m.slice(i + 1)]; });
    } else root[k] = v;
  }
  return root;
}
export const CHUNK = 4096;

function arg(name, fallback) {
  const i = process.argv.indexOf(name);
  return i >= 0 && i + 1 < process.argv.length ? process.argv[i + 1] : fallback;
}

export function fnv1a64(ids, begin, end) {
  let h = 0xcbf29ce484222325n;
  const prime = 0x100000001b3n;
  const mask = (1n << 64n) - 1n;
  for (let i = begin; i < end; ++i) {
    const v = ids[i] >>> 0;
    for (let b = 0; b < 4; ++b) {
      h ^= BigInt((v >>> (8 * b)) & 0xff);
      h = (h * prime) & mask;
    }
  }
  return h.toString(16).padStart(16, "0");
}

// JSON with one case (and one hash list) per line: diffs stay readable.
export function stringify(result) {
  const lines = Object.entries(result).map(([k, v]) => {
    if (k === "cases") return `  "cases": [\n${v.map((c) => "    " + JSON.stringify(c)).join(",\n")}\n  ]`;
    return `  ${JSON.stringify(k)}: ${JSON.stringify(v)}`;
  });
  return `{\n${lines.join(",\n")}\n}\n`;
}

function sha256(file) {
  return createHash("sha256").update(fs.readFileSync(file)).digest("hex");
}

async function main() {
  const shared = arg("--shared", process.env.POSENC_SHARED_DIR || "/work/shared");
  const out = arg("--out", "tests/model/data/hf_tokenizers");
  const only = arg("--only", "");
  fs.mkdirSync(out, { recursive: true });
  const text = fs.readFileSync(path.join(shared, TEXT), "utf8");
  const jobs = TOKENIZERS.map(([name, rel]) => ({ name, rel, patch: null, extra: [] }));
  for (const [name, rel, patch, extra] of VARIANTS) jobs.push({ name: `variant-${name}`, rel, patch, extra });
  for (const { name, rel, patch, extra } of jobs) {
    if (only && only !== name) continue;
    const file = path.join(shared, rel);
    const tok = patch
      ? Tokenizer.fromString(JSON.stringify(apply_patch(JSON.parse(fs.readFileSync(file, "utf8")), patch)))
      : Tokenizer.fromFile(file);
    const cases = [];
    for (const s of [...HARD_STRINGS, ...extra]) {
      const plain = (await tok.encode(s, null, { addSpecialTokens: false })).getIds();
      const special = (await tok.encode(s, null, { addSpecialTokens: true })).getIds();
      const decoded = await tok.decode(plain, true);
      const decodedSpecial = await tok.decode(special, true);
      cases.push({
        text: s,
        ids: plain,
        ids_special: special,
        decode: decoded,
        decode_special: decodedSpecial,
        round_trips: decoded === s,
      });
    }
    const t0 = process.hrtime.bigint();
    const ids = (await tok.encode(text, null, { addSpecialTokens: false })).getIds();
    const t1 = process.hrtime.bigint();
    const hashes = [];
    for (let i = 0; i < ids.length; i += CHUNK) hashes.push(fnv1a64(ids, i, Math.min(ids.length, i + CHUNK)));
    const wholeDecode = await tok.decode(ids, true);
    const result = {
      generator: "tools/refs/hf_tokenizers_refs.mjs",
      command: "node tools/refs/hf_tokenizers_refs.mjs --shared /work/shared --out tests/model/data/hf_tokenizers",
      library: "tokenizers (Hugging Face tokenizers, Rust, Node bindings; npm)",
      library_version: LIB_VERSION,
      tokenizer: rel,
      tokenizer_sha256: sha256(file),
      ...(patch ? { patch } : {}),
      cases,
      whole_text: {
        file: TEXT,
        sha256: sha256(path.join(shared, TEXT)),
        add_special_tokens: false,
        count: ids.length,
        chunk: CHUNK,
        fnv1a64: hashes,
        decode_round_trips: wholeDecode === text,
      },
    };
    fs.writeFileSync(path.join(out, `${name}.json`), stringify(result));
    process.stderr.write(
      `${name}: ${ids.length} tokens for the whole text; encode ${(Number(t1 - t0) / 1e6).toFixed(1)} ms\n`);
  }
}

if (import.meta.url === `file://${process.argv[1]}`) await main();
