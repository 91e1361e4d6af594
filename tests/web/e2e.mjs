// End-to-end test of the chat page and the package in headless Chromium
// (WebGPU through SwiftShader), served from 127.0.0.1, driven as a user
// drives it; the engine runs in the page's Web Worker. On the backend
// TANDEM_WEB_BACKEND names ("webgpu" by default, or "cpu": the CPU backend
// in wasm):
// - the page loads SmolLM2-135M by URL with progress (download, cache store,
//   upload; the bar never moves back) and says which backend runs and why
//   (on the CPU, why one thread: the test server sends no COOP/COEP);
// - 8 greedy tokens of a plain completion equal the native CPU backend's
//   (the NumPy reference's);
// - (CPU) two chat turns through the chat template, the first's 8 greedy
//   tokens equal to `tandem run --chat-template`'s; Regenerate gives the
//   same greedy reply; a 100 ms timer keeps firing during the generation
//   (the page's thread stays free);
// - Stop mid-stream: status "Stopped.", finish reason "stopped";
// - Load during a generation stops it and loads the model from the cache;
// - switching the backend reloads the model from the cache (WebGPU run: to
//   the CPU backend; CPU run: to auto, whose speed test must take the CPU
//   backend over a software adapter such as SwiftShader, saying what it
//   measured) and its greedy tokens are the native CPU's again;
// - (CPU) the package's APIs from the page's scripts (api-checks.mjs):
//   failed downloads, cache repair, Response/Blob/ArrayBuffer sources,
//   overlapping calls through the worker, an INT4 KV cache against the
//   native INT4 tokens; (WebGPU) abort() and a new call during a step in
//   flight;
// - after a reload the model still comes from the cache (one download);
//   (CPU) the stored-models panel lists it with its size and deletes it;
//   the model picker loads a GGUF by URL and a file from disk (whose greedy
//   tokens are the native ones);
// - (CPU, where `make web` made the threaded package) served cross-origin
//   isolated, the page runs the CPU backend on 2 wasm threads and then 1,
//   with the native CPU's greedy tokens both times (threads.mjs);
// - the page's second model, Qwen2.5-Coder-0.5B (491 MB), uncached, gives
//   the native CPU's greedy tokens (8 on the CPU backend through the page; 2
//   on WebGPU from the page's thread under WebGPU's default 128 MiB storage
//   binding limit, which its 138 MiB Q8_0 output matrix does not fit in);
// - no uncaught page error and no console error anywhere (except the
//   failed downloads' own network errors).
//
//   TANDEM_BIN=target/debug/tandem node tests/web/e2e.mjs SITE_DIR ARTIFACT_DIR
//
// SITE_DIR is what `make web` builds (page, pkg/, models/); screenshots go
// to ARTIFACT_DIR (outside git).

import { mkdtempSync, mkdirSync, readFileSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { launch, serve } from "./browser.mjs";
import {
  chooseBackend, conversation, lastReply, loadEnded, loadServed, replyEnded, send,
} from "./chat-page.mjs";
import { abortMidStep, cacheRepair, callerSources, failedDownloads, overlappingCalls } from "./api-checks.mjs";
import { agreeUpToNearTie, nativeTokens } from "./native.mjs";
import { ISOLATION, singleThreadReason, threadedBuild, threadedTokens } from "./threads.mjs";

const [siteDir, artifactDir] = process.argv.slice(2);
const tandemBin = process.env.TANDEM_BIN;
if (!siteDir || !artifactDir || !tandemBin) {
  console.error("usage: TANDEM_BIN=path/to/tandem node e2e.mjs SITE_DIR ARTIFACT_DIR");
  process.exit(2);
}

const PROMPT = "The capital of France is";
// The first 8 greedy ids after the prompt (tests/fixtures/smollm2_reference.json,
// the NumPy reference that tests/tests/real_models.rs holds the native CPU backend to).
const EXPECTED = [7042, 30, 198, 198, 504, 2988, 314, 42];
// Longer than the budget of kvEviction (32 tokens): the cache evicts during
// the prompt, and the greedy tokens leave the full cache's at the second.
const EVICTION_PROMPT =
  "Once upon a time, in a small village by the sea, there lived an old fisherman " +
  "who had a secret that nobody in the village knew about, and one morning";
const CHAT_MESSAGE = "What is the capital of France?";
const FOLLOW_UP = "And what is the capital of Germany? Answer in one sentence.";
// An INT4 KV cache rounds keys and values to 16 levels, so a tiny difference
// in the matmuls before it (the browser's SIMD128 kernels sum in another
// order than the native AVX2 or AVX-512 ones) can move a value across a
// rounding boundary and the logits by tenths of a nat (0.66 against the
// AVX2 kernels on 2026-12-05, at the sixth token). Greedy ids must then
// agree until a step where the native run ranks the browser's token within
// this many nats of its own choice; after it the contexts differ.
const INT4_TIE_NATS = 1.0;
const MODEL_PATH = "/models/SmolLM2-135M-Instruct.Q4_1.gguf";
const MODEL_URL = MODEL_PATH.slice(1);
const BACKEND = process.env.TANDEM_WEB_BACKEND ?? "webgpu";
const CPU = BACKEND === "cpu";
const QWEN_PATH = "/models/Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf";
const QWEN_PROMPT = "def fibonacci(n):";
// How many of Qwen's greedy tokens are compared, per backend. On the page's
// CPU backend 8 take ~10 s with the load. On SwiftShader a Qwen decode step
// takes 7-9 s and the first step (pipeline creation, the prefill) 9-16 s, so
// 2 (the prefill and one decode step) take 20-35 s with the load.
const QWEN_TOKENS = { cpu: 8, webgpu: 2 };
/** WebGPU's default maxStorageBufferBindingSize. */
const BINDING_LIMIT = 128 * 2 ** 20;
/** The longest the page's thread may go without running a 100 ms timer during a generation. */
const MAX_TIMER_GAP_MS = 500;

const model = readFileSync(join(siteDir, MODEL_PATH));
const requests = new Map();
const downloads = (path) => requests.get(path) ?? 0;
const server = await serve(siteDir, requests, {
  // Announces the whole file, sends half, then drops the connection.
  "/broken/cut-short.gguf": (req, res) => {
    res.writeHead(200, { "content-type": "application/octet-stream", "content-length": model.length });
    res.write(model.subarray(0, model.length >> 1), () => res.destroy());
  },
  // The model under another name, for the cache-repair checks.
  "/copy/model.gguf": (req, res) => {
    res.writeHead(200, { "content-type": "application/octet-stream", "content-length": model.length });
    res.end(model);
  },
  // No length announced: only parsing can tell the file is incomplete.
  "/broken/no-end.gguf": (req, res) => {
    res.writeHead(200, { "content-type": "application/octet-stream" });
    res.end(model.subarray(0, model.length >> 1));
  },
});
const url = `http://127.0.0.1:${server.address().port}/`;
// The site again, cross-origin isolated, for the threaded package.
const isolatedServer = await serve(siteDir, new Map(), {}, ISOLATION);
const isolatedUrl = `http://127.0.0.1:${isolatedServer.address().port}/`;
const userDataDir = mkdtempSync(join(tmpdir(), "tandem-chromium-"));
const context = await launch(userDataDir);
const native = (options, prompt, count, modelPath = MODEL_PATH) =>
  nativeTokens(tandemBin, siteDir, modelPath, options, prompt, count);

let passed = 0;
let failed = 0;
function check(ok, what, detail = "") {
  if (ok) passed += 1;
  else failed += 1;
  console.log(`${ok ? "ok" : "FAIL"} (${BACKEND}): ${what}${detail ? `: ${detail}` : ""}`);
}
/** Uncaught errors and console errors, from the page and its worker. */
const pageErrors = [];

try {
  const page = watch(context.pages()[0] ?? (await context.newPage()));
  mkdirSync(artifactDir, { recursive: true });
  const opened = Date.now();
  await page.goto(url);
  await chooseBackend(page, BACKEND);
  await page.evaluate(() => {
    const bar = document.getElementById("progress-bar");
    globalThis.widths = [];
    new MutationObserver(() => globalThis.widths.push(parseFloat(bar.style.width)))
      .observe(bar, { attributes: true, attributeFilter: ["style"] });
  });
  const status = await loadServed(page, MODEL_URL);
  const loaded = Date.now();
  const widths = await page.evaluate(() => globalThis.widths);
  check(widths.length > 2 && widths.every((w, i) => !i || w >= widths[i - 1]) && widths.at(-1) === 100,
    "the load's progress bar never moves back and ends full",
    `${widths.length} widths from ${widths[0]} to ${widths.at(-1)}%, ` +
    `moved back ${widths.filter((w, i) => i && w < widths[i - 1]).length} times`);
  const loadLog = await page.textContent("#load-log");
  const backendInfo = await page.textContent("#backend-info");
  console.log(`${status}\n${loadLog}\n${backendInfo}`);
  check(status.startsWith("Ready") && status.includes("downloaded") &&
    /^download .*; store .*; upload /.test(loadLog), "the page loads the model by URL, with progress", loadLog);
  const cores = await page.evaluate(() => navigator.hardwareConcurrency);
  check(backendInfo.startsWith(CPU ? "CPU backend (wasm, 1 thread): the CPU backend was asked for" :
    "WebGPU: WebGPU was asked for") &&
    (!CPU || cores < 2 || backendInfo.includes(`Why 1 thread: ${singleThreadReason(siteDir)}`)),
  "the page says which backend runs and why (on the CPU, why on one thread)", backendInfo);

  await send(page, PROMPT, { template: false });
  const plain = await lastReply(page);
  const firstToken = Number(plain.meta.match(/first token ([\d.]+) s/)?.[1]);
  console.log(`page open to model ready ${(loaded - opened) / 1000} s; page open to first token ` +
    `${((loaded - opened) / 1000 + firstToken).toFixed(2)} s; ${plain.meta}`);
  check(same(plain.ids, EXPECTED) && plain.finish === "length",
    "8 greedy tokens through the worker match the native CPU backend",
    `browser [${plain.ids.join(" ")}], native [${EXPECTED.join(" ")}], finish ${plain.finish}`);

  if (CPU) await chatTwoTurns(page);

  // Stop mid-stream.
  await send(page, PROMPT, { template: false, maxTokens: 200, started: true });
  await page.click("#stop");
  const stopped = await replyEnded(page);
  const stoppedReply = await lastReply(page);
  check(stopped.startsWith("Stopped") && stoppedReply.finish === "abort" && stoppedReply.ids.length < 200 &&
    stoppedReply.meta.startsWith("stopped"), "Stop mid-stream stops the reply and says so",
  `status ${JSON.stringify(stopped)}, ${stoppedReply.ids.length} tokens, ${stoppedReply.meta}`);

  // Load during a generation.
  await send(page, PROMPT, { template: false, maxTokens: 200, started: true });
  await page.click("#load");
  const reloaded = await loadEnded(page);
  const cutReply = await lastReply(page);
  check(reloaded.startsWith("Ready") && reloaded.includes("from the browser cache") &&
    downloads(MODEL_PATH) === 1 && cutReply.finish === "abort",
  "Load during a generation stops it and loads the model from the cache",
  `${reloaded}; reply finished ${cutReply.finish}; ${downloads(MODEL_PATH)} downloads`);

  await switchBackend(page);
  await page.screenshot({ path: join(artifactDir, `chat-${BACKEND}.png`), fullPage: true });

  if (CPU) {
    await failedDownloads(page, check, MODEL_PATH);
    await cacheRepair(page, check, { modelBytes: model.length, downloads });
    await callerSources(page, check, model.length);
    await overlappingCalls(page, check, { modelUrl: MODEL_URL, prompt: PROMPT, backend: "cpu" });
    await int4Cache(page);
  } else {
    await abortMidStep(page, check, { modelUrl: MODEL_URL, prompt: PROMPT });
  }
  await kvEviction(page);

  await page.reload();
  await chooseBackend(page, BACKEND);
  const afterReload = await loadServed(page, MODEL_URL);
  check(afterReload.includes("from the browser cache") && downloads(MODEL_PATH) === 1,
    "after a reload the model comes from the cache", afterReload);

  if (CPU) {
    await cacheManager(page);
    await otherSources(page);
    if (!threadedBuild(siteDir)) {
      console.log("skipped (cpu): wasm threads: `make web` made no threaded package (no nightly toolchain)");
    } else if (cores < 2) {
      console.log(`skipped (cpu): wasm threads: the browser reports ${cores} core`);
    } else {
      const threadsPage = watch(await context.newPage());
      await threadedTokens(threadsPage, check, { isolatedUrl, modelUrl: MODEL_URL, prompt: PROMPT, expected: EXPECTED });
      await threadsPage.close();
    }
  }
  await qwen(page);
} catch (e) {
  failed += 1;
  console.log(`FAIL: ${e.stack ?? e}`);
} finally {
  check(pageErrors.length === 0, "no uncaught page error and no console error", pageErrors.join(" | "));
  await context.close();
  server.close();
  isolatedServer.close();
  rmSync(userDataDir, { recursive: true, force: true });
}
console.log(`${passed} passed, ${failed} failed`);
process.exit(failed ? 1 : 0);

/** `page`, its console errors and uncaught errors (its workers' too) counted as failures. */
function watch(page) {
  page.on("console", (m) => {
    console.log(`[page ${m.type()}] ${m.text()}`);
    // The failed downloads' own network errors are expected.
    if (m.type() === "error" && !`${m.location().url} ${m.text()}`.includes("/broken/")) {
      pageErrors.push(`console error: ${m.text()}`);
    }
  });
  page.on("pageerror", (e) => {
    console.log(`[page error] ${e.message}`);
    pageErrors.push(`uncaught: ${e.message}`);
  });
  return page;
}

/**
 * Two chat turns through the chat template (the first against the native
 * CPU's greedy tokens), Regenerate, and the page's timer during the second.
 */
async function chatTwoTurns(page) {
  await page.click("#new-chat");
  await send(page, CHAT_MESSAGE);
  const first = await lastReply(page);
  const expected = native(["--chat-template"], CHAT_MESSAGE, EXPECTED.length);
  check(same(first.ids, expected), "a chat turn gives the native CPU backend's greedy tokens",
    `browser [${first.ids.join(" ")}], native [${expected.join(" ")}]`);

  await page.evaluate(() => {
    globalThis.ticks = [];
    globalThis.ticker = setInterval(() => globalThis.ticks.push(performance.now()), 100);
  });
  const started = await page.evaluate(() => performance.now());
  await send(page, FOLLOW_UP, { maxTokens: 24 });
  const { ticks, ended } = await page.evaluate(() => {
    clearInterval(globalThis.ticker);
    return { ticks: globalThis.ticks, ended: performance.now() };
  });
  const gaps = [...ticks, ended].map((t, i, all) => t - (i ? all[i - 1] : started));
  const second = await lastReply(page);
  check(Math.max(...gaps) < MAX_TIMER_GAP_MS && ticks.length >= (ended - started) / 100 / 2,
    "a 100 ms timer keeps firing during a generation (the page stays responsive)",
    `${ticks.length} ticks in ${((ended - started) / 1000).toFixed(2)} s, longest gap ` +
    `${Math.max(...gaps).toFixed(0)} ms`);
  const bubbles = await conversation(page);
  check(same(bubbles.map((b) => b.role), ["user", "assistant", "user", "assistant"]) &&
    second.ids.length > 0 && bubbles[3].text === second.text,
  "a second chat turn replies in the conversation", JSON.stringify(bubbles));

  await page.click("#regenerate");
  await replyEnded(page);
  const again = await lastReply(page);
  const after = await conversation(page);
  check(same(again.ids, second.ids) && after.length === 4,
    "Regenerate replaces the last reply (the same greedy tokens)",
    `[${again.ids.join(" ")}] against [${second.ids.join(" ")}], ${after.length} bubbles`);
}

/** The model picker's other sources: a GGUF by URL, and a file from disk. */
async function otherSources(page) {
  await page.selectOption("#model", "url");
  await page.fill("#model-url", `${url}copy/model.gguf`);
  await page.click("#load");
  const byUrl = await loadEnded(page);
  check(byUrl.startsWith("Ready") && /downloaded|from the browser cache/.test(byUrl),
    "the model picker loads a GGUF by URL", byUrl);
  await page.setInputFiles("#file", join(siteDir, MODEL_PATH));
  const fromDisk = await loadEnded(page);
  await send(page, PROMPT, { template: false });
  const reply = await lastReply(page);
  check(fromDisk.startsWith("Ready") && fromDisk.includes("from a file") && same(reply.ids, EXPECTED),
    "the model picker loads a GGUF file from disk, which gives the native tokens",
    `${fromDisk}; [${reply.ids.join(" ")}]`);
}

/** The stored-models panel lists the cached model with its size, and deletes it. */
async function cacheManager(page) {
  const name = MODEL_PATH.split("/").pop();
  await page.click("#cache-panel summary");
  const entry = page.locator("#cache-list li", { hasText: name });
  const listed = await entry.textContent();
  await entry.locator("button").click();
  await entry.waitFor({ state: "detached" });
  const cached = await page.evaluate(async () =>
    (await (await caches.open("tandem-models-v1")).keys()).map((r) => new URL(r.url).pathname));
  check(listed.includes(`${(model.length / 2 ** 20).toFixed(1)} MiB`) && !cached.includes(MODEL_PATH),
    "the stored-models panel lists the cached model with its size and deletes it",
    `listed ${JSON.stringify(listed)}; left in the cache: ${cached.join(", ")}`);
}

/**
 * Switches the backend with the model loaded: it reloads from the cache.
 * The WebGPU run goes to the CPU backend; the CPU run to auto, which times
 * both and takes the CPU backend over a software adapter (and, on this
 * test's expectation, WebGPU over a hardware one).
 */
async function switchBackend(page) {
  const target = CPU ? "auto" : "cpu";
  const software = await page.evaluate(async () => {
    const adapter = await navigator.gpu?.requestAdapter();
    const info = adapter?.info ?? {};
    return !adapter || info.isFallbackAdapter ||
      /swiftshader|llvmpipe|lavapipe/i.test(`${info.vendor} ${info.architecture} ${info.description}`);
  });
  await chooseBackend(page, target);
  const status = await loadEnded(page);
  const info = await page.textContent("#backend-info");
  const expected = CPU && !software
    ? /^WebGPU: a hardware WebGPU adapter/
    : CPU ? /^CPU backend \(wasm, 1 thread\): (WebGPU's adapter is a software rasterizer \(.*\): the CPU backend in wasm is faster \(a 2048 × 2048 Q8_0 matrix-vector product took [\d.]+ ms on WebGPU and [\d.]+ ms on the CPU backend in wasm, medians of \d+ alternating rounds\)|this browser has no WebGPU|the browser offers no WebGPU adapter)/
      : /^CPU backend \(wasm, 1 thread\): the CPU backend was asked for/;
  check(status.includes("from the browser cache") && downloads(MODEL_PATH) === 1 && expected.test(info),
    `switching the backend to ${target} reloads the model from the cache on the right backend`,
    `${status}; ${info}`);
  await send(page, PROMPT, { template: false });
  const reply = await lastReply(page);
  check(same(reply.ids, EXPECTED), `after the switch to ${target}, 8 greedy tokens match the native CPU backend`,
    `browser [${reply.ids.join(" ")}]`);
}

/** The CPU backend with an INT4 KV cache against the native INT4 run; an unknown kvDtype is refused. */
async function int4Cache(page) {
  const kv = await page.evaluate(async ({ url, prompt, count }) => {
    const { Tandem } = await import(new URL("pkg/tandem.js", location.href).href);
    let refused = null;
    try {
      (await Tandem.load(url, { backend: "cpu", kvDtype: "int3" })).free();
    } catch (e) {
      refused = e.message ?? String(e);
    }
    const engine = await Tandem.load(url, { backend: "cpu", kvDtype: "int4" });
    for await (const _ of engine.generate(prompt, { maxTokens: count, temperature: 0 }));
    const ids = [...engine.generatedTokens()];
    const { kvDtype, kvBytesPerToken } = engine.info();
    engine.free();
    return { refused, ids, kvDtype, kvBytesPerToken };
  }, { url: MODEL_URL, prompt: PROMPT, count: EXPECTED.length });
  console.log(JSON.stringify(kv));
  const nativeInt4 = native(["--kv-dtype", "int4", "--top-logprobs", "5"], PROMPT, EXPECTED.length);
  check(/^kvDtype: .*unknown KV dtype `int3`/.test(kv.refused), "an unknown kvDtype is a clear error", kv.refused);
  const int4 = agreeUpToNearTie(kv.ids, nativeInt4, INT4_TIE_NATS);
  check(kv.kvDtype === "int4" && int4.ok,
    "kvDtype int4 gives the native CPU backend's greedy tokens with an INT4 KV cache",
    `browser [${kv.ids.join(" ")}], native [${nativeInt4.ids.join(" ")}]; ${int4.detail}`);
}

/**
 * A generation under a KV budget (`kvBudget`, `kvEvict`, `kvSinks`) against
 * the native run with the same flags, on the page's thread; bad eviction
 * options are refused with errors naming them.
 */
async function kvEviction(page) {
  const flags = ["--kv-budget", "32", "--kv-evict", "streaming", "--kv-sinks", "4"];
  const prompt = EVICTION_PROMPT;
  const count = 16;
  const got = await page.evaluate(async ({ url, prompt, count, backend }) => {
    const { default: init, Tandem } = await import(new URL("pkg/tandem_web.js", location.href).href);
    await init();
    const engine = await Tandem.load(url, { backend });
    const refusals = [{ kvEvict: "h2o" }, { kvBudget: "0%" }, { kvBudget: 8 }, { kvBudget: 32, kvEvict: "lru" }]
      .map((options) => {
        try {
          engine.generate(prompt, options);
          return null;
        } catch (e) {
          return e.message ?? String(e);
        }
      });
    const options = { maxTokens: count, temperature: 0, kvBudget: 32, kvEvict: "streaming", kvSinks: 4 };
    for await (const _ of engine.generate(prompt, options));
    const ids = [...engine.generatedTokens()];
    engine.free();
    return { ids, refusals };
  }, { url: MODEL_URL, prompt, count, backend: CPU ? "cpu" : "webgpu" });
  console.log(JSON.stringify(got));
  const [noBudget, zero, tooSmall, unknown] = got.refusals;
  check(noBudget === "option kvEvict needs kvBudget" && /^kvBudget: `0%` is not a percentage/.test(zero) &&
    /^kvBudget: 8 \(8 tokens\) holds 0 blocks/.test(tooSmall) && /^kvEvict: .*lru/.test(unknown),
  "bad KV eviction options are refused, naming the option", got.refusals.join(" | "));
  const expected = native(flags, prompt, count);
  const full = native([], prompt, count);
  check(same(got.ids, expected) && !same(expected, full),
    `under kvBudget 32 (streaming), ${count} greedy tokens match the native run with --kv-budget 32`,
    `browser [${got.ids.join(" ")}], native [${expected.join(" ")}], full cache [${full.join(" ")}]`);
}

/**
 * The second served model, a Qwen2 architecture in k-quants, 5 times
 * SmolLM2's size, uncached (storing 491 MB would only add time). On WebGPU
 * it runs on the page's thread (the direct API) so that WebGPU's default
 * buffer limits can be imposed on the page's adapter.
 */
async function qwen(page) {
  const count = QWEN_TOKENS[BACKEND];
  const started = Date.now();
  let ids;
  if (CPU) {
    const status = await loadServed(page, QWEN_PATH.slice(1), { cache: false });
    check(status.startsWith("Ready") && status.includes("downloaded") && downloads(QWEN_PATH) === 1,
      "the page loads Qwen2.5-0.5B by URL", status);
    await send(page, QWEN_PROMPT, { template: false, maxTokens: count });
    ids = (await lastReply(page)).ids;
  } else {
    await page.addInitScript(defaultBufferLimits);
    await page.reload();
    const r = await page.evaluate(async ({ url, prompt, count }) => {
      const { default: init, Tandem } = await import(new URL("pkg/tandem_web.js", location.href).href);
      await init();
      const engine = await Tandem.load(url, { backend: "webgpu", cache: false });
      for await (const _ of engine.generate(prompt, { maxTokens: count, temperature: 0 }));
      const ids = [...engine.generatedTokens()];
      engine.free();
      return { ids, limits: globalThis.requestedLimits };
    }, { url: QWEN_PATH.slice(1), prompt: QWEN_PROMPT, count });
    check(r.limits?.maxStorageBufferBindingSize === BINDING_LIMIT,
      "WebGPU runs Qwen2.5-0.5B under the default 128 MiB storage binding limit",
      `the device was asked for maxStorageBufferBindingSize ${r.limits?.maxStorageBufferBindingSize}, ` +
      `maxBufferSize ${r.limits?.maxBufferSize}`);
    ids = r.ids;
  }
  const browserSeconds = (Date.now() - started) / 1000;
  const expected = native([], QWEN_PROMPT, count, QWEN_PATH);
  check(same(ids, expected), `Qwen2.5-0.5B's ${count} greedy tokens match the native CPU backend`,
    `browser [${ids.join(" ")}], native [${expected.join(" ")}]`);
  console.log(`qwen2.5-0.5b: load and ${count} tokens in the browser ${browserSeconds} s, ` +
    `with the native run ${(Date.now() - started) / 1000} s`);
}

/**
 * Runs in the page before its scripts: WebGPU adapters and devices report at
 * most WebGPU's default limits for storage bindings (128 MiB) and buffers
 * (256 MiB), so the device is created with them; `requestedLimits` keeps the
 * limits the page's device was asked for.
 */
function defaultBufferLimits() {
  if (!globalThis.GPUSupportedLimits) return;
  const defaults = { maxStorageBufferBindingSize: 128 * 2 ** 20, maxBufferSize: 256 * 2 ** 20 };
  for (const [name, limit] of Object.entries(defaults)) {
    const { get } = Object.getOwnPropertyDescriptor(GPUSupportedLimits.prototype, name);
    Object.defineProperty(GPUSupportedLimits.prototype, name, {
      get() {
        return Math.min(get.call(this), limit);
      },
    });
  }
  const requestDevice = GPUAdapter.prototype.requestDevice;
  GPUAdapter.prototype.requestDevice = function (descriptor) {
    globalThis.requestedLimits = { ...descriptor?.requiredLimits };
    return requestDevice.call(this, descriptor);
  };
}

function same(a, b) {
  return JSON.stringify(a) === JSON.stringify(b);
}
