// Tandem's CPU backend in wasm beside wllama (llama.cpp compiled to wasm) on
// the same GGUF file in one headless Chromium, each in its own Web Worker:
// load time, time to the first token, prefill and decode tokens/s. Both
// run on one thread (Tandem's single-threaded package), and on N, all the
// cores the browser reports, where the page is cross-origin isolated (served
// with COOP/COEP: wasm threads need SharedArrayBuffer; Tandem's threaded
// package, pkg/threads, where `make web` made it); WebGPU is kept off
// for it (n_gpu_layers 0) and Tandem's WebGPU on SwiftShader is reported
// for what it is (8 tokens; BENCH_WEBGPU=0 leaves it out: its prefill takes
// minutes). scripts/bench-web.sh builds and runs this.
//
//   node tests/web/bench.mjs SITE_DIR WLLAMA_ESM_DIR [MODEL_URL] [TOKENS]
//
// SITE_DIR is what `make web` builds; WLLAMA_ESM_DIR is @wllama/wllama's esm/.

import { mkdtempSync, rmSync, symlinkSync } from "node:fs";
import { tmpdir } from "node:os";
import { join, resolve } from "node:path";
import { launch, serve } from "./browser.mjs";
import { ISOLATION, threadedBuild } from "./threads.mjs";

const [siteDir, wllamaDir, modelUrl = "models/SmolLM2-135M-Instruct.Q4_1.gguf", tokensArg = "64"] =
  process.argv.slice(2);
if (!siteDir || !wllamaDir) {
  console.error("usage: node bench.mjs SITE_DIR WLLAMA_ESM_DIR [MODEL_URL] [TOKENS]");
  process.exit(2);
}
const TOKENS = Number(tokensArg);
// About 100 tokens of prompt, then a continuation that runs long.
const PROMPT = "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg " +
  "combined movable metal type, oil-based inks and a wooden press adapted from those used to make wine. " +
  "His workshop in Mainz produced the famous Bible around 1455, and within fifty years printing shops had " +
  "spread to more than two hundred cities across Europe. The consequences were enormous: books became " +
  "cheaper, literacy grew, and ideas travelled faster than ever before. In the chapters that follow, we";

const siteLink = join(resolve(siteDir), "wllama");
rmSync(siteLink, { force: true });
symlinkSync(resolve(wllamaDir), siteLink);
const plain = await serve(siteDir);
const isolated = await serve(siteDir, new Map(), {}, ISOLATION);
const userDataDir = mkdtempSync(join(tmpdir(), "tandem-bench-"));
const context = await launch(userDataDir);
const rows = [];
try {
  const page = context.pages()[0] ?? (await context.newPage());
  page.on("pageerror", (e) => console.log(`[page error] ${e.message}`));
  const threads = await page.evaluate(() => navigator.hardwareConcurrency);
  await page.goto(`http://127.0.0.1:${plain.address().port}/`);
  rows.push(await wllama(page, 1));
  rows.push(await tandem(page, "cpu", 1));
  if (process.env.BENCH_WEBGPU !== "0") rows.push(await tandem(page, "webgpu", 1, 8));
  await page.goto(`http://127.0.0.1:${isolated.address().port}/`);
  if (await page.evaluate(() => globalThis.crossOriginIsolated)) {
    rows.push(await wllama(page, threads));
    if (threadedBuild(siteDir)) rows.push(await tandem(page, "cpu", threads));
    else console.log("no threaded Tandem package (`make web` needs a nightly toolchain for it)");
  } else {
    console.log("the isolated page is not cross-origin isolated: no multi-thread run");
  }
} finally {
  await context.close();
  plain.close();
  isolated.close();
  rmSync(userDataDir, { recursive: true, force: true });
  rmSync(siteLink, { force: true });
}
const [wllamaOne, tandemCpu] = rows;
const [wllamaMany, tandemMany] = [rows.find((r, i) => i > 1 && r.engine.startsWith("wllama")),
  rows.find((r, i) => i > 1 && r.engine.startsWith("Tandem CPU"))];
console.log(`\n${modelUrl.split("/").pop()}, prompt ${wllamaOne.promptTokens} tokens, ` +
  `up to ${TOKENS} generated (8 on WebGPU), greedy`);
console.log("| engine | threads | load s | first token s | prefill tok/s | decode tok/s |");
console.log("|---|---|---|---|---|---|");
for (const r of rows) {
  console.log(`| ${r.engine} | ${r.threads} | ${r.load.toFixed(2)} | ${r.first.toFixed(2)} | ` +
    `${r.prefill.toFixed(1)} | ${r.decode.toFixed(1)} |`);
}
for (const [ours, theirs] of [[tandemCpu, wllamaOne], [tandemMany, wllamaMany]]) {
  if (!ours || !theirs) continue;
  const ratio = (key) => (ours[key] / theirs[key]).toFixed(2);
  console.log(`Tandem CPU (${ours.threads} threads) / wllama (${theirs.threads}): prefill ${ratio("prefill")}x, ` +
    `decode ${ratio("decode")}x; loads ${(theirs.load / ours.load).toFixed(1)}x faster`);
}

/**
 * Tandem through its worker on `backend` (the CPU's on `threads` threads):
 * load (no cache), then one greedy generation.
 */
async function tandem(page, backend, threads, tokens = TOKENS) {
  const r = await page.evaluate(async ({ modelUrl, backend, threads, prompt, tokens }) => {
    const { Tandem } = await import(new URL("pkg/tandem.js", location.href).href);
    let started = performance.now();
    const engine = await Tandem.load(modelUrl, { backend, threads, cache: false });
    const load = performance.now() - started;
    started = performance.now();
    let first = 0;
    for await (const _ of engine.generate(prompt, { maxTokens: tokens, temperature: 0 })) {
      first ||= performance.now() - started;
    }
    const total = performance.now() - started;
    const generated = engine.generatedTokens().length;
    const info = engine.info();
    engine.free();
    return { load, first, total, generated, threads: info.threads ?? 1, threadsReason: info.threadsReason };
  }, { modelUrl, backend, threads, prompt: PROMPT, tokens });
  if (r.threadsReason) console.log(`Tandem on ${r.threads} of ${threads} threads: ${r.threadsReason}`);
  const promptTokens = rows[0].promptTokens;
  return row(`Tandem ${backend === "cpu" ? "CPU (wasm)" : "WebGPU (SwiftShader)"}`, r.threads, r, promptTokens);
}

/** wllama on `threads` threads, WebGPU off: load (no cache), then one greedy completion. */
async function wllama(page, threads) {
  const r = await page.evaluate(async ({ modelUrl, threads, prompt, tokens }) => {
    const { Wllama } = await import(new URL("wllama/index.js", location.href).href);
    const engine = new Wllama({ default: new URL("wllama/wasm/wllama.wasm", location.href).href },
      { suppressNativeLog: true, logger: { debug() {}, log() {}, warn: console.warn, error: console.error } });
    let started = performance.now();
    await engine.loadModelFromUrl(new URL(modelUrl, location.href).href,
      { n_threads: threads, n_gpu_layers: 0, n_ctx: 2048, useCache: false });
    const load = performance.now() - started;
    let promptTokens = null;
    let timings = null;
    started = performance.now();
    let first = 0;
    let generated = 0;
    await engine.createCompletion({
      prompt, max_tokens: tokens, temperature: 0, stream: true,
      onData: (chunk) => {
        promptTokens = chunk.usage?.prompt_tokens ?? chunk.timings?.prompt_n ?? promptTokens;
        timings = chunk.timings ?? timings;
        if (!chunk.choices?.[0]?.text) return;
        first ||= performance.now() - started;
        generated += 1;
      },
    });
    const total = performance.now() - started;
    const actualThreads = engine.getNumThreads();
    await engine.exit();
    return { load, first, total, generated, promptTokens, actualThreads, timings };
  }, { modelUrl, threads, prompt: PROMPT, tokens: TOKENS });
  console.log(`wllama on ${r.actualThreads} threads, its own timings: ${JSON.stringify(r.timings)}`);
  return { ...row("wllama (llama.cpp wasm)", r.actualThreads, r, r.promptTokens), promptTokens: r.promptTokens };
}

function row(engine, threads, r, promptTokens) {
  const decodeSeconds = (r.total - r.first) / 1000;
  return {
    engine, threads, load: r.load / 1000, first: r.first / 1000,
    prefill: promptTokens / (r.first / 1000),
    decode: r.generated > 1 ? (r.generated - 1) / decodeSeconds : 0,
  };
}
