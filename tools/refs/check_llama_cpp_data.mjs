#!/usr/bin/env node
// check_llama_cpp_data.mjs — consistency and sanity checks of one directory written by
// llama_cpp_refs.mjs (summary.json + logits.f32), without llama.cpp or C++:
//   - logits.f32 has shape[0] * shape[1] little-endian float32 values, its sha256 is the recorded one,
//     the saved positions are 0, K, 2K, ... and every value is finite;
//   - each saved row re-scores its position: the NLL (log-sum-exp in double) and argmax recomputed
//     from the file equal the recorded per-position values, and the mean of those is the mean NLL;
//   - greedy continuations: steps.top1 are the generated ids, margins >= 0;
//   - optional: --nll-range LO,HI (the mean NLL must lie inside), --expect-prompt-ids I JSON (the
//     i-th greedy prompt's ids), --expect-greedy-text I TEXT (the i-th continuation must start with
//     TEXT), --other-logits FILE [--other-tol T] (a full [n_tokens, vocab] float32 file of the same
//     window from another implementation, e.g. posenc's: prints max |dlogit| over the saved rows and
//     fails above T).
// Prints one line per check; exit status 1 on the first failure.
import {createHash} from "node:crypto";
import {readFileSync} from "node:fs";
import {join} from "node:path";

const argv = process.argv.slice(2);
if (argv.length < 1 || argv[0].startsWith("--")) {
  process.stderr.write("usage: check_llama_cpp_data.mjs DIR [--nll-range LO,HI] [--expect-prompt-ids I JSON]\n" +
                       "       [--expect-greedy-text I TEXT] [--other-logits FILE] [--other-tol T]\n");
  process.exit(2);
}
const dir = argv[0];
const opt = {expectPrompt: [], expectText: []};
for (let i = 1; i < argv.length; ++i) {
  const k = argv[i];
  if (k === "--nll-range") opt.nllRange = argv[++i].split(",").map(Number);
  else if (k === "--expect-prompt-ids") opt.expectPrompt.push([Number(argv[++i]), JSON.parse(argv[++i])]);
  else if (k === "--expect-greedy-text") opt.expectText.push([Number(argv[++i]), argv[++i]]);
  else if (k === "--other-logits") opt.other = argv[++i];
  else if (k === "--other-tol") opt.otherTol = Number(argv[++i]);
  else { process.stderr.write(`unknown option ${k}\n`); process.exit(2); }
}

function check(ok, what) {
  process.stdout.write(`${ok ? "ok  " : "FAIL"} ${what}\n`);
  if (!ok) process.exit(1);
}

const s = JSON.parse(readFileSync(join(dir, "summary.json"), "utf8"));
check(s.settings.kv_cache_key_type === "F32" && s.settings.kv_cache_value_type === "F32" && s.settings.flash_attention === false,
      `settings: KV cache ${s.settings.kv_cache_key_type}/${s.settings.kv_cache_value_type}, flash attention ${s.settings.flash_attention}`);

if (s.window) {
  const w = s.window, L = s.logits;
  const buf = readFileSync(join(dir, L.file));
  const [rows, vocab] = L.shape;
  check(buf.length === rows * vocab * 4, `${L.file}: ${buf.length} bytes = ${rows} x ${vocab} float32`);
  check(createHash("sha256").update(buf).digest("hex") === L.sha256, `${L.file}: sha256 ${L.sha256.slice(0, 16)}...`);
  check(L.positions.length === rows && L.positions.every((p, i) => p === i * L.positions_every) &&
        L.positions[rows - 1] < w.n_tokens && L.positions[rows - 1] + L.positions_every >= w.n_tokens,
        `positions 0, ${L.positions_every}, ... ${L.positions[rows - 1]} of ${w.n_tokens}`);
  const f = new Float32Array(rows * vocab);
  for (let i = 0; i < f.length; ++i) f[i] = buf.readFloatLE(i * 4);
  check(f.every(Number.isFinite), "every logit is finite");
  check(w.ids.length === w.n_tokens && w.nll.length === w.n_tokens - 1 && w.argmax.length === w.n_tokens,
        `window: ${w.n_tokens} ids, ${w.nll.length} NLLs, ${w.argmax.length} argmaxes`);
  let worst = 0, argmaxOk = true;
  for (let r = 0; r < rows; ++r) {
    const p = L.positions[r], row = f.subarray(r * vocab, (r + 1) * vocab);
    let m = -Infinity, a = 0;
    for (let v = 0; v < vocab; ++v) if (row[v] > m) { m = row[v]; a = v; }
    if (a !== w.argmax[p]) argmaxOk = false;
    if (p + 1 < w.n_tokens) {
      let sum = 0;
      for (let v = 0; v < vocab; ++v) sum += Math.exp(row[v] - m);
      worst = Math.max(worst, Math.abs(m + Math.log(sum) - row[w.ids[p + 1]] - w.nll[p]));
    }
  }
  check(worst < 1e-9, `saved rows re-score their positions: max |dNLL| ${worst.toExponential(2)}`);
  check(argmaxOk, "saved rows' argmax = recorded argmax");
  const mean = w.nll.reduce((a, b) => a + b, 0) / w.nll.length;
  check(Math.abs(mean - w.nll_mean) < 1e-12, `mean NLL ${w.nll_mean.toFixed(7)} = mean of the ${w.nll.length} per-position NLLs`);
  if (opt.nllRange) {
    check(w.nll_mean >= opt.nllRange[0] && w.nll_mean <= opt.nllRange[1], `mean NLL in [${opt.nllRange}]`);
  }
  if (opt.other) {
    const ob = readFileSync(opt.other);
    check(ob.length === w.n_tokens * vocab * 4, `${opt.other}: [${w.n_tokens}, ${vocab}] float32`);
    let md = 0, at = null, sum = 0;
    for (let r = 0; r < rows; ++r) {
      const p = L.positions[r];
      for (let v = 0; v < vocab; ++v) {
        const d = Math.abs(f[r * vocab + v] - ob.readFloatLE((p * vocab + v) * 4));
        sum += d;
        if (d > md) { md = d; at = [p, v]; }
      }
    }
    const ok = opt.otherTol === undefined || md <= opt.otherTol;
    check(ok, `vs ${opt.other}: max |dlogit| ${md.toExponential(3)} at [position ${at?.[0]}, token ${at?.[1]}], ` +
              `mean ${(sum / (rows * vocab)).toExponential(3)}${opt.otherTol === undefined ? "" : ` (tolerance ${opt.otherTol})`}`);
  }
}

(s.greedy ?? []).forEach((g, i) => {
  check(g.new_ids.length === g.new_tokens && g.steps.top1.every((t, k) => t === g.new_ids[k]) &&
        g.steps.margin.every((m) => m >= 0), `greedy ${i}: ${g.new_tokens} tokens = steps' argmax, margins >= 0 (min ${g.min_margin.toExponential(2)})`);
});
for (const [i, ids] of opt.expectPrompt) {
  check(JSON.stringify(s.greedy[i].prompt_ids) === JSON.stringify(ids), `greedy ${i}: prompt ids ${JSON.stringify(ids)}`);
}
for (const [i, text] of opt.expectText) {
  check(s.greedy[i].text.startsWith(text), `greedy ${i}: text starts with ${JSON.stringify(text)}`);
}
