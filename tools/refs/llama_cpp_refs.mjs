#!/usr/bin/env node
// llama_cpp_refs.mjs — reference outputs of llama.cpp (through node-llama-cpp) for one
// GGUF file and one window of token ids: the logits of every position, the window's mean
// NLL, and greedy continuations. posenc's GGUF / Hugging Face loaders are tested against
// them (tests/model/data/llama_cpp/README.md describes the files and how they were made).
//
//   node tools/refs/llama_cpp_refs.mjs --model X.gguf --tokens ids.json --out DIR
//        [--greedy-prompt-ids '[1,403,407,261,378]' ...] [--greedy-prompt-text 'Once upon a time' ...]
//        [--greedy-tokens 40] [--threads 1] [--logits-every 1] [--kv-type F32] [--hf-tokenizer tokenizer.json]
//
// Writes DIR/summary.json and DIR/logits.f32 (see --help). node-llama-cpp is resolved from
// tools/refs/node_modules (scripts/install-refs). Exit status: 0 ok, 2 bad usage, 1 error.
//
// What llama.cpp is asked to compute (each checked and recorded in summary.json "settings"):
//   - the prebuilt CPU build only (no GPU, no download, no compile);
//   - KV cache keys AND values in F32 (node-llama-cpp's default is F16, which moves the
//     logits by ~1e-3);
//   - flash attention off (llama.cpp's flash-attention path casts an F32 KV cache to F16);
//   - context size >= 512 and >= the window, batch = ubatch size >= the window, so that
//     the whole window is one llama_decode of one ubatch (every position's logits requested);
//   - the model's own RoPE settings (no rope overrides are passed);
//   - a fixed thread count (--threads; getLlama maxThreads and the context's threads).
// The NLL is computed here, in double: position p's float32 logits scoring token p+1,
// log-sum-exp with the maximum subtracted, mean over the window's n-1 predictions
// (posenc's ppl protocol, include/posenc/perplexity.hpp, for one window).
// Greedy decoding: the prompt is prefilled in one batch, then one token per llama_decode;
// the next token is the argmax of the raw logits (lowest id on ties, as llama.cpp's greedy
// sampler and posenc's generate), checked against node-llama-cpp's greedy sampler.
// A fixed number of tokens is generated: EOS/BOS do not stop it (their first index is recorded).
import {execFileSync} from "node:child_process";
import {createHash} from "node:crypto";
import {createRequire} from "node:module";
import {mkdirSync, readFileSync, writeFileSync, renameSync, statSync} from "node:fs";
import {basename, dirname, join, resolve} from "node:path";
import {fileURLToPath} from "node:url";
import os from "node:os";

const here = dirname(fileURLToPath(import.meta.url));
const require = createRequire(join(here, "package.json"));

const USAGE = `usage: node tools/refs/llama_cpp_refs.mjs --model X.gguf --out DIR [options]

  --model FILE              GGUF file (required)
  --out DIR                 output directory (created): summary.json, logits.f32
  --tokens FILE             JSON: an array of token ids, or an object with "window_ids",
                            "ids" or "tokens" (the window to score; optional if greedy prompts given)
  --greedy-prompt-ids JSON  a prompt as a JSON array of ids (repeatable), e.g. '[1]'
  --greedy-prompt-text TXT  a prompt as text (repeatable): BOS + the tokenizer's ids, with
                            --hf-tokenizer encode(text, addSpecialTokens=true) instead
  --greedy-tokens N         tokens generated per prompt (default 40)
  --threads N               CPU threads (default 1)
  --logits-every K          save the logits of positions p with p % K == 0 (default 1 = all)
  --kv-type T               KV cache type of keys and values: F32 (default) or F16
  --context N               context size (default: max(512, window, prompts + greedy tokens))
  --hf-tokenizer FILE       tokenizer.json used for prompt texts and decoded text (for GGUF
                            files whose embedded vocabulary llama.cpp cannot use)
  --label TEXT              free text recorded in summary.json
  --log FILE                write llama.cpp's whole log (debug level) to FILE

Files written:
  logits.f32    raw little-endian float32, row-major [positions, vocab]: one row per saved
                position (summary.json "logits.positions", ascending), the raw logits llama.cpp
                produced for that window position
  summary.json  versions, settings, model metadata, the window ids, per-position NLL and
                argmax, the mean NLL, greedy continuations (see tests/model/data/llama_cpp/README.md)`;

function fail(message, code = 2) {
  process.stderr.write(`llama_cpp_refs: ${message}\n`);
  process.exit(code);
}

function parseArgs(argv) {
  const a = {greedyPrompts: [], greedyTokens: 40, threads: 1, logitsEvery: 1, kvType: "F32"};
  const intArg = (name, v, min) => {
    if (!/^\d+$/.test(v ?? "")) fail(`${name}: expected an integer, got '${v}'`);
    const n = Number(v);
    if (n < min) fail(`${name}: must be >= ${min}, got ${n}`);
    return n;
  };
  for (let i = 0; i < argv.length; ++i) {
    const k = argv[i];
    if (k === "--help" || k === "-h") { process.stdout.write(USAGE + "\n"); process.exit(0); }
    const v = argv[i + 1];
    if (v === undefined) fail(`${k}: missing value\n${USAGE}`);
    ++i;
    switch (k) {
      case "--model": a.model = resolve(v); break;
      case "--out": a.out = resolve(v); break;
      case "--tokens": a.tokens = resolve(v); break;
      case "--greedy-prompt-ids": {
        let ids;
        try { ids = JSON.parse(v); } catch (e) { fail(`--greedy-prompt-ids: not JSON: '${v}'`); }
        if (!Array.isArray(ids) || ids.length === 0 || !ids.every(Number.isInteger)) {
          fail(`--greedy-prompt-ids: expected a non-empty JSON array of integers, got '${v}'`);
        }
        a.greedyPrompts.push({ids});
        break;
      }
      case "--greedy-prompt-text": a.greedyPrompts.push({text: v}); break;
      case "--greedy-tokens": a.greedyTokens = intArg(k, v, 1); break;
      case "--threads": a.threads = intArg(k, v, 1); break;
      case "--logits-every": a.logitsEvery = intArg(k, v, 1); break;
      case "--context": a.context = intArg(k, v, 2); break;
      case "--kv-type":
        if (v !== "F32" && v !== "F16") fail(`--kv-type: expected F32 or F16, got '${v}'`);
        a.kvType = v;
        break;
      case "--hf-tokenizer": a.hfTokenizer = resolve(v); break;
      case "--label": a.label = v; break;
      case "--log": a.log = resolve(v); break;
      default: fail(`unknown option '${k}'\n${USAGE}`);
    }
  }
  if (!a.model) fail(`--model is required\n${USAGE}`);
  if (!a.out) fail(`--out is required\n${USAGE}`);
  if (!a.tokens && a.greedyPrompts.length === 0) fail("nothing to do: give --tokens and/or a greedy prompt");
  return a;
}

function readTokens(path) {
  let j;
  try { j = JSON.parse(readFileSync(path, "utf8")); } catch (e) { fail(`--tokens ${path}: ${e.message}`, 1); }
  const ids = Array.isArray(j) ? j : (j.window_ids ?? j.ids ?? j.tokens);
  if (!Array.isArray(ids) || ids.length < 2 || !ids.every(Number.isInteger)) {
    fail(`--tokens ${path}: expected >= 2 integer ids (an array, or "window_ids"/"ids"/"tokens")`, 1);
  }
  return ids;
}

function sha256File(path) {
  return createHash("sha256").update(readFileSync(path)).digest("hex");
}

/// A package installed in tools/refs/node_modules (scripts/install-refs).
function pkgDir(name) {
  return join(here, "node_modules", ...name.split("/"));
}

function pkgVersion(name) {
  return JSON.parse(readFileSync(join(pkgDir(name), "package.json"), "utf8")).version;
}

/// A path as recorded in summary.json: relative to the working directory when inside it
/// (the repository root, as the README's commands run), else as given.
function rel(p) {
  if (p == null) return p;
  const cwd = process.cwd() + "/";
  return p.startsWith(cwd) ? p.slice(cwd.length) : p;
}

/// Dense float32 logits [vocab] from node-llama-cpp's Map(token -> logit); throws if any id is missing.
function denseLogits(map, vocab, where) {
  if (!(map instanceof Map) || map.size !== vocab) {
    throw new Error(`${where}: expected ${vocab} logits, got ${map?.size}`);
  }
  const row = new Float32Array(vocab);
  row.fill(NaN);
  for (const [t, l] of map) row[t] = l;
  for (let t = 0; t < vocab; ++t) if (Number.isNaN(row[t])) throw new Error(`${where}: no logit for token ${t}`);
  return row;
}

/// log-sum-exp(row) - row[target], in double (row values are float32).
function nllOf(row, target) {
  let m = -Infinity;
  for (let i = 0; i < row.length; ++i) if (row[i] > m) m = row[i];
  let s = 0;
  for (let i = 0; i < row.length; ++i) s += Math.exp(row[i] - m);
  return m + Math.log(s) - row[target];
}

/// Argmax with the lowest id on ties, and the runner-up (for the greedy margin).
function top2(row) {
  let a = 0;
  for (let i = 1; i < row.length; ++i) if (row[i] > row[a]) a = i;
  let b = a === 0 ? 1 : 0;
  for (let i = 0; i < row.length; ++i) if (i !== a && row[i] > row[b]) b = i;
  return {top1: a, top1_logit: row[a], top2: b, top2_logit: row[b], margin: row[a] - row[b]};
}

/// JSON with 1-space indentation, arrays of numbers kept on one line (the file stays readable).
function stringify(value, indent = "") {
  if (Array.isArray(value)) {
    if (value.every((x) => typeof x === "number" || x === null)) return `[${value.map((x) => JSON.stringify(x)).join(",")}]`;
    if (value.length === 0) return "[]";
    const inner = indent + " ";
    return `[\n${value.map((x) => inner + stringify(x, inner)).join(",\n")}\n${indent}]`;
  }
  if (value !== null && typeof value === "object") {
    const keys = Object.keys(value).filter((k) => value[k] !== undefined);
    if (keys.length === 0) return "{}";
    const inner = indent + " ";
    return `{\n${keys.map((k) => `${inner}${JSON.stringify(k)}: ${stringify(value[k], inner)}`).join(",\n")}\n${indent}}`;
  }
  return JSON.stringify(value);
}

/// The llama.cpp commit node-llama-cpp bundles (llama/gitRelease.bundle; its prebuilt binaries are built
/// from it), or null when git is unavailable.
function bundledLlamaCppCommit() {
  try {
    const out = execFileSync("git", ["bundle", "list-heads", join(pkgDir("node-llama-cpp"), "llama", "gitRelease.bundle")],
                             {encoding: "utf8", stdio: ["ignore", "pipe", "ignore"]});
    return out.trim().split(/\s+/)[0] || null;
  } catch {
    return null;
  }
}

function writeAtomic(path, data) {
  const tmp = `${path}.tmp${process.pid}`;
  writeFileSync(tmp, data);
  renameSync(tmp, path);
}

async function main() {
  const args = parseArgs(process.argv.slice(2));
  try { statSync(args.model); } catch (e) { fail(`--model ${args.model}: ${e.message}`, 1); }
  const windowIds = args.tokens ? readTokens(args.tokens) : null;

  const {getLlama, LlamaLogLevel, GgmlType} = await import(require.resolve("node-llama-cpp"));
  const logs = [];
  const llama = await getLlama({
    gpu: false, build: "never", skipDownload: true, usePrebuiltBinaries: true, maxThreads: args.threads,
    logLevel: LlamaLogLevel.debug, logger: (level, message) => logs.push(`[${level}] ${message}`),
  });
  if (llama.buildType !== "prebuilt") throw new Error(`expected the prebuilt llama.cpp, got buildType ${llama.buildType}`);
  const model = await llama.loadModel({modelPath: args.model, gpuLayers: 0, useMmap: true});

  let hf = null;
  if (args.hfTokenizer) {
    const {Tokenizer} = require("tokenizers");
    hf = Tokenizer.fromFile(args.hfTokenizer);
  }
  const prompts = [];
  for (const p of args.greedyPrompts) {
    if (p.ids) { prompts.push({ids: p.ids, tokenized_by: "given"}); continue; }
    if (hf) {
      const enc = await hf.encode(p.text, null, {addSpecialTokens: true});
      prompts.push({text: p.text, ids: enc.getIds(), tokenized_by: `tokenizers@${pkgVersion("tokenizers")} ${rel(args.hfTokenizer)} encode(text, addSpecialTokens=true)`});
    } else {
      prompts.push({text: p.text, ids: [model.tokens.bos, ...model.tokenize(p.text)],
                    tokenized_by: "llama.cpp (node-llama-cpp model.tokenize(text)) with BOS prepended"});
    }
  }

  // node-llama-cpp lets a sequence hold contextSize - 1 tokens and silently shifts the
  // context (erases tokens, re-rotates keys) to make room beyond that: one cell to spare.
  // llama.cpp fails a decode with an out-of-range id without saying which: check the ids first.
  const embd = model.fileInfo.fullTensorInfo?.find((t) => t.name === "token_embd.weight");
  const nVocabFile = embd ? Number(embd.dimensions[1]) : model.fileInfo.metadata?.tokenizer?.ggml?.tokens?.length;
  if (Number.isInteger(nVocabFile)) {
    const check = (ids, what) => {
      const bad = ids.findIndex((t) => t < 0 || t >= nVocabFile);
      if (bad >= 0) fail(`${what}: id ${ids[bad]} at index ${bad} is outside the model's vocabulary [0, ${nVocabFile})`, 1);
    };
    if (windowIds) check(windowIds, `--tokens ${args.tokens}`);
    prompts.forEach((p, i) => check(p.ids, `greedy prompt ${i}`));
  }

  const need = Math.max(512, windowIds ? windowIds.length + 1 : 0,
                        ...prompts.map((p) => p.ids.length + args.greedyTokens + 1));
  const contextSize = args.context ?? need;
  if (contextSize < need) fail(`--context ${contextSize} is smaller than needed (${need})`);
  const batchSize = Math.max(windowIds ? windowIds.length : 0, ...prompts.map((p) => p.ids.length));
  const ctx = await model.createContext({
    contextSize, batchSize, sequences: 1, flashAttention: false, threads: {ideal: args.threads, min: args.threads},
    experimentalKvCacheKeyType: args.kvType, experimentalKvCacheValueType: args.kvType,
  });
  const kvName = (t) => Object.keys(GgmlType).find((k) => GgmlType[k] === t) ?? String(t);
  const settings = {
    gpu: llama.gpu, build_type: llama.buildType,
    context_size: ctx.contextSize, batch_size: ctx.batchSize, ubatch_size: ctx.batchSize,
    flash_attention: ctx.flashAttention, kv_cache_key_type: kvName(ctx.kvCacheKeyType),
    kv_cache_value_type: kvName(ctx.kvCacheValueType), threads: ctx.currentThreads,
    llama_max_threads: llama.maxThreads, cpu_math_cores: llama.cpuMathCores, system_info: llama.systemInfo,
  };
  if (settings.flash_attention !== false) throw new Error(`flash attention is ${settings.flash_attention}, expected false`);
  if (settings.kv_cache_key_type !== args.kvType || settings.kv_cache_value_type !== args.kvType) {
    throw new Error(`KV cache types ${settings.kv_cache_key_type}/${settings.kv_cache_value_type}, expected ${args.kvType}`);
  }
  if (settings.context_size < need) throw new Error(`context size ${settings.context_size} < ${need}`);
  if (settings.batch_size < batchSize) throw new Error(`batch size ${settings.batch_size} < ${batchSize}`);
  if (settings.threads !== args.threads) throw new Error(`context runs ${settings.threads} threads, expected ${args.threads}`);
  const seq = ctx.getSequence();
  const noShift = {contextShift: {size: 1, strategy: () => { throw new Error("node-llama-cpp wanted a context shift (context too small)"); }}};

  const summary = {
    tool: "tools/refs/llama_cpp_refs.mjs",
    label: args.label ?? null,
    created: new Date().toISOString(),
    command: ["node", "tools/refs/llama_cpp_refs.mjs", ...process.argv.slice(2)],
    versions: {
      node: process.version,
      "node-llama-cpp": pkgVersion("node-llama-cpp"),
      "@node-llama-cpp/linux-x64": pkgVersion("@node-llama-cpp/linux-x64"),
      llama_cpp_release: llama.llamaCppRelease,
      llama_cpp_info_json: JSON.parse(readFileSync(join(pkgDir("node-llama-cpp"), "llama", "llama.cpp.info.json"), "utf8")),
      binaries_github_release_json: JSON.parse(readFileSync(join(pkgDir("node-llama-cpp"), "llama", "binariesGithubRelease.json"), "utf8")),
      llama_cpp_bundle_commit: bundledLlamaCppCommit(),
      prebuilt_build_metadata: JSON.parse(readFileSync(join(pkgDir("@node-llama-cpp/linux-x64"), "bins", "linux-x64", "_nlcBuildMetadata.json"), "utf8")),
      tokenizers: hf ? pkgVersion("tokenizers") : null,
    },
    host: {cpu: os.cpus()[0]?.model ?? null, cpus: os.cpus().length, loadavg: os.loadavg()},
    model: {
      file: basename(args.model), path: rel(args.model), sha256: sha256File(args.model), bytes: statSync(args.model).size,
      // the metadata llama.cpp printed while loading (what it actually uses)
      print_info: logs.filter((l) => l.includes("print_info:")).map((l) => l.replace(/^\[\w+\] print_info: /, "").trim()),
    },
    settings,
  };
  const decodeText = async (ids) => {
    if (hf) return await hf.decode(ids, true);
    return model.detokenize(ids);
  };

  // --- the window: every position's logits in one decode -------------------------------------
  if (windowIds) {
    const n = windowIds.length;
    const input = windowIds.map((t) => [t, {generateNext: {logits: true}}]);
    const t0 = process.hrtime.bigint();
    const out = await seq.controlledEvaluate(input, noShift);
    const seconds = Number(process.hrtime.bigint() - t0) / 1e9;
    const nVocab = out[0]?.next?.logits?.size;
    if (!nVocab) throw new Error("no logits returned for position 0");
    const positions = [];
    for (let p = 0; p < n; p += args.logitsEvery) positions.push(p);
    const saved = new Float32Array(positions.length * nVocab);
    const nll = [];
    const argmax = [];
    let k = 0;
    for (let p = 0; p < n; ++p) {
      const row = denseLogits(out[p]?.next?.logits, nVocab, `window position ${p}`);
      argmax.push(top2(row).top1);
      if (p + 1 < n) nll.push(nllOf(row, windowIds[p + 1]));
      if (p % args.logitsEvery === 0) saved.set(row, (k++) * nVocab);
    }
    const mean = nll.reduce((s, x) => s + x, 0) / nll.length;
    mkdirSync(args.out, {recursive: true});
    const buf = Buffer.alloc(saved.length * 4);
    for (let i = 0; i < saved.length; ++i) buf.writeFloatLE(saved[i], i * 4);
    writeAtomic(join(args.out, "logits.f32"), buf);
    summary.window = {
      n_tokens: n, ids: windowIds, source: rel(args.tokens),
      nll_mean: mean, ppl: Math.exp(mean), predictions: nll.length,
      nll: nll,
      argmax: argmax,
      evaluate_seconds: seconds,
    };
    summary.logits = {
      file: "logits.f32", dtype: "float32", byte_order: "little", layout: "row-major [positions, vocab]",
      shape: [positions.length, nVocab], vocab: nVocab, positions_every: args.logitsEvery, positions,
      sha256: createHash("sha256").update(buf).digest("hex"),
    };
    await seq.clearHistory();
  }

  // --- greedy continuations -----------------------------------------------------------------
  summary.greedy = [];
  for (const p of prompts) {
    await seq.clearHistory();
    const ids = [...p.ids];
    const steps = [];
    let nVocab;
    let res = await seq.controlledEvaluate(ids.map((t, i) => i === ids.length - 1
      ? [t, {generateNext: {logits: true, token: true}}] : t), noShift);
    const newIds = [];
    for (let s = 0; s < args.greedyTokens; ++s) {
      const last = res[res.length - 1];
      nVocab ??= last.next.logits.size;
      const row = denseLogits(last.next.logits, nVocab, `greedy step ${s}`);
      const t2 = top2(row);
      if (last.next.token !== t2.top1) {
        throw new Error(`greedy step ${s}: llama.cpp's greedy sampler chose ${last.next.token}, argmax is ${t2.top1}`);
      }
      steps.push(t2);
      newIds.push(t2.top1);
      if (s + 1 < args.greedyTokens) res = await seq.controlledEvaluate([[t2.top1, {generateNext: {logits: true, token: true}}]], noShift);
    }
    const eog = (id) => id === model.tokens.eos || id === model.tokens.bos;
    summary.greedy.push({
      prompt_text: p.text ?? null, prompt_ids: p.ids, tokenized_by: p.tokenized_by,
      new_ids: newIds, new_tokens: newIds.length,
      text: await decodeText(newIds),
      full_text: await decodeText([...p.ids, ...newIds]),
      first_bos_or_eos_index: newIds.findIndex(eog),
      min_margin: Math.min(...steps.map((x) => x.margin)),
      // per generated token (columns): the argmax, its logit, the runner-up and its logit, their difference
      steps: {top1: steps.map((x) => x.top1), top1_logit: steps.map((x) => x.top1_logit),
              top2: steps.map((x) => x.top2), top2_logit: steps.map((x) => x.top2_logit),
              margin: steps.map((x) => x.margin)},
    });
  }

  await new Promise((r) => setTimeout(r, 100));  // llama.cpp's log reaches the logger asynchronously
  const cpuBackend = logs.find((l) => l.includes("loaded CPU backend from"));
  summary.settings.ggml_cpu_variant = cpuBackend ? rel(cpuBackend.replace(/^.*loaded CPU backend from /, "").trim()) : null;
  summary.settings.weight_buffers = logs.filter((l) => /model buffer size|cannot be used with preferred buffer type|amx repack tensor/.test(l))
    .map((l) => l.replace(/^\[\w+\] /, "").trim());
  summary.settings.llama_context = logs.filter((l) => /llama_context: (n_ctx|n_batch|n_ubatch|flash_attn|freq_base|freq_scale|causal_attn)/.test(l) ||
                                                      /llama_kv_cache: size/.test(l))
    .map((l) => l.replace(/^\[\w+\] /, "").trim());

  for (const [key, what] of [["ggml_cpu_variant", "the loaded libggml-cpu"], ["llama_context", "llama_context's settings"]]) {
    if (!summary.settings[key] || summary.settings[key].length === 0) throw new Error(`llama.cpp's log did not show ${what}`);
  }
  mkdirSync(args.out, {recursive: true});
  if (args.log) writeFileSync(args.log, logs.join("\n") + "\n");
  writeAtomic(join(args.out, "summary.json"), stringify(summary) + "\n");
  await ctx.dispose();
  await model.dispose();
  await llama.dispose();
  const w = summary.window;
  process.stdout.write(`${args.out}: ${w ? `window ${w.n_tokens} tokens, mean NLL ${w.nll_mean.toFixed(7)}; ` : ""}` +
                       `${summary.greedy.length} greedy continuation(s); ${summary.settings.ggml_cpu_variant}\n`);
}

main().catch((e) => fail(e.stack ?? String(e), 1));
