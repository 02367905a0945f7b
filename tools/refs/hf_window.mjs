#!/usr/bin/env node
// hf_window.mjs — a window of token ids for a Hugging Face tokenizer.json, cut from a text
// by posenc's ppl protocol (include/posenc/perplexity.hpp, steps 1-3): the text's blocks
// (maximal runs of non-blank lines, joined with '\n', stripped), each encoded with
// Tokenizer.encode(block, addSpecialTokens=true) (tokenizers, the Rust library's Node
// bindings; BOS comes from the tokenizer's post-processor), concatenated in file order; the
// window is the stream's first --window ids.
//
//   node tools/refs/hf_window.mjs --tokenizer tokenizer.json --text FILE [--window 512]
//        [--blocks-from posenc_window.json] [--prompt TEXT ...] > window.json
//
// --blocks-from takes the "blocks" posenc_window printed (posenc's own split_blocks) and
// checks that this script's split gives the same blocks. Prints one JSON object:
// {"window_ids": [...], "blocks_used": n, "stream_tokens_of_blocks_used": m, "prompts": [...], ...}.
import {createRequire} from "node:module";
import {readFileSync} from "node:fs";
import {dirname, join, resolve} from "node:path";
import {fileURLToPath} from "node:url";

const here = dirname(fileURLToPath(import.meta.url));
const require = createRequire(join(here, "package.json"));

function fail(message, code = 2) {
  process.stderr.write(`hf_window: ${message}\n`);
  process.exit(code);
}

const isWs = (c) => c === " " || c === "\t" || c === "\n" || c === "\r" || c === "\v" || c === "\f";
function strip(s) {
  let a = 0, b = s.length;
  while (a < b && isWs(s[a])) ++a;
  while (b > a && isWs(s[b - 1])) --b;
  return s.slice(a, b);
}

/// posenc::split_blocks: a block is a maximal run of non-blank lines (blank = empty or
/// whitespace-only), its lines joined with '\n', stripped of leading/trailing whitespace.
function splitBlocks(text) {
  const blocks = [];
  let cur = [];
  for (const line of text.split("\n")) {
    if (strip(line) === "") {
      if (cur.length) blocks.push(strip(cur.join("\n")));
      cur = [];
    } else {
      cur.push(line);
    }
  }
  if (cur.length) blocks.push(strip(cur.join("\n")));
  return blocks;
}

const args = {window: 512, prompts: []};
const argv = process.argv.slice(2);
for (let i = 0; i < argv.length; i += 2) {
  const [k, v] = [argv[i], argv[i + 1]];
  if (v === undefined) fail(`${k}: missing value`);
  if (k === "--tokenizer") args.tokenizer = resolve(v);
  else if (k === "--text") args.text = resolve(v);
  else if (k === "--window") args.window = Number(v);
  else if (k === "--blocks-from") args.blocksFrom = resolve(v);
  else if (k === "--prompt") args.prompts.push(v);
  else fail(`unknown option '${k}'`);
}
if (!args.tokenizer || !args.text) fail("usage: --tokenizer tokenizer.json --text FILE [--window 512] [--blocks-from J] [--prompt T]");
if (!Number.isInteger(args.window) || args.window < 2) fail(`--window: expected an integer >= 2, got ${args.window}`);

const {Tokenizer} = require("tokenizers");
const tok = Tokenizer.fromFile(args.tokenizer);
const blocks = splitBlocks(readFileSync(args.text, "utf8"));
if (args.blocksFrom) {
  const theirs = JSON.parse(readFileSync(args.blocksFrom, "utf8")).blocks;
  if (!Array.isArray(theirs) || theirs.length === 0) fail(`${args.blocksFrom}: no "blocks"`, 1);
  for (let i = 0; i < theirs.length; ++i) {
    if (theirs[i] !== blocks[i]) fail(`block ${i} differs from posenc's split_blocks (${args.blocksFrom})`, 1);
  }
}
const ids = [];
let used = 0;
while (ids.length < args.window) {
  if (used >= blocks.length) fail(`the text holds fewer than ${args.window} tokens`, 1);
  if (args.blocksFrom && used >= JSON.parse(readFileSync(args.blocksFrom, "utf8")).blocks.length) {
    fail(`the window needs more blocks than ${args.blocksFrom} lists (cannot check them)`, 1);
  }
  const enc = await tok.encode(blocks[used], null, {addSpecialTokens: true});
  ids.push(...enc.getIds());
  ++used;
}
const prompts = [];
for (const p of args.prompts) prompts.push({text: p, ids: (await tok.encode(p, null, {addSpecialTokens: true})).getIds()});
const version = JSON.parse(readFileSync(join(here, "node_modules", "tokenizers", "package.json"), "utf8")).version;
process.stdout.write(JSON.stringify({
  tokenizer: args.tokenizer, tokenizers_version: version, text: args.text,
  protocol: "posenc ppl steps 1-3: blocks, encode(block, addSpecialTokens=true), concatenated, first window",
  blocks_checked_against: args.blocksFrom ?? null,
  blocks_used: used, stream_tokens_of_blocks_used: ids.length,
  window_ids: ids.slice(0, args.window),
  prompts,
}) + "\n");
