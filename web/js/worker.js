// The engine's Web Worker: the wasm `Tandem` class (tandem_web.js) driven by
// messages from tandem.js on the page, so no step of the model ever runs on
// the page's thread.
//
// Calls run one at a time, in the order they came. A new load or generation
// stops the running generation (after the step in flight: a step is never
// cut short) and supersedes the generations still waiting; `abort` is handled
// at once, between two steps. Between steps the worker yields to its event
// loop, so messages get in even on the CPU backend, whose steps are
// synchronous.
//
// The package: the threaded build (pkg/threads: wasm threads, the CPU
// backend's thread pool on nested Web Workers) where it was built, the page
// is cross-origin isolated (shared wasm memory is a SharedArrayBuffer) and
// the browser reports more than one core; else the single-threaded build,
// and a load's `info().threadsReason` says why threads were not used.
//
// Page → worker: { id, op: "load", source, options } | { id, op: "generate",
// prompt, options } | { id, op: "chat", messages, options } | { id, op:
// "abort" } | { id, op: "unload" }.
// Worker → page: { id, type: "progress", progress } | { id, type: "piece",
// text } | { id, type: "done", value } | { id, type: "error", message }.

import { threadedBuild } from "./builds.js";

/** { Tandem, memory, singleThreaded: why there are no threads, or null }. */
const ready = start();
/** The loaded model, or null. */
let engine = null;
/** Generation calls not yet ended (waiting or running): stopped by a newer call. */
const generations = new Set();
/** The tail of the queue of calls. */
let queue = Promise.resolve();

const OPS = { load, generate: generation, chat: generation, unload };

self.onmessage = ({ data: call }) => {
  if (call.op === "abort") {
    stopGenerations();
    post({ id: call.id, type: "done", value: null });
    return;
  }
  if (!OPS[call.op]) {
    post({ id: call.id, type: "error", message: `unknown call ${JSON.stringify(call.op)}` });
    return;
  }
  stopGenerations();
  if (call.op === "generate" || call.op === "chat") generations.add(call);
  queue = queue.then(() => run(call));
};

async function run(call) {
  try {
    post({ id: call.id, type: "done", value: await OPS[call.op](call) });
  } catch (e) {
    post({ id: call.id, type: "error", message: e?.message ?? String(e) });
  } finally {
    generations.delete(call);
  }
}

function stopGenerations() {
  for (const call of generations) call.stopped = true;
}

async function load({ id, source, options }) {
  const { Tandem, memory, singleThreaded } = await ready;
  // The old model's memory goes first: two models at once may not fit.
  engine?.free();
  engine = null;
  engine = await Tandem.load(revive(source), {
    ...options,
    onProgress: (progress) => post({ id, type: "progress", progress }),
  });
  const info = engine.info();
  // The single-threaded package cannot know why it was taken: this worker does.
  if (info.threadsReason && singleThreaded) info.threadsReason = singleThreaded;
  return { ...info, wasmMemoryBytes: memory.buffer.byteLength };
}

/** Loads the package (see the top) and, for the threaded one, starts its thread pool. */
async function start() {
  const cores = navigator.hardwareConcurrency ?? 1;
  let singleThreaded = !threadedBuild
    ? "this package was built without its threaded build (it needs a nightly Rust toolchain with rust-src)"
    : !self.crossOriginIsolated
      ? "the page is not cross-origin isolated, which wasm threads need (serve it with " +
        "Cross-Origin-Opener-Policy: same-origin and Cross-Origin-Embedder-Policy: require-corp)"
      : cores < 2 ? "the browser reports one core (navigator.hardwareConcurrency)" : null;
  if (!singleThreaded) {
    try {
      const pkg = await import("./threads/tandem_web.js");
      const wasm = await pkg.default();
      // The engine's thread is one of the backend's threads: the pool adds the others.
      await pkg.initThreadPool(cores - 1);
      return { Tandem: pkg.Tandem, memory: wasm.memory, singleThreaded: null };
    } catch (e) {
      console.warn(`tandem: the threaded build did not start, running on one thread: ${e?.message ?? e}`);
      singleThreaded = `the threaded build did not start (${e?.message ?? e})`;
    }
  }
  const pkg = await import("./tandem_web.js");
  const wasm = await pkg.default();
  return { Tandem: pkg.Tandem, memory: wasm.memory, singleThreaded };
}

async function unload() {
  engine?.free();
  engine = null;
  return null;
}

/** Runs a generate or chat call, posting each step's piece (possibly empty). */
async function generation(call) {
  if (!engine) throw new Error("no model is loaded: load one first");
  if (call.stopped) return { finishReason: "abort", tokens: [] };
  const pieces = call.op === "chat"
    ? engine.chat(call.messages, call.options)
    : engine.generate(call.prompt, call.options);
  const iterator = pieces[Symbol.asyncIterator]();
  for (;;) {
    if (call.stopped) {
      await iterator.return();
      break;
    }
    const { done, value } = await iterator.next();
    if (done) break;
    post({ id: call.id, type: "piece", text: value });
    await nextTask();
  }
  return { finishReason: engine.finishReason() ?? "abort", tokens: Array.from(engine.generatedTokens()) };
}

/** A Response's parts (a Response cannot be posted) back into a Response. */
function revive(source) {
  if (source?.response) {
    const { body, headers } = source.response;
    return new Response(body, { headers });
  }
  return source;
}

function post(message) {
  self.postMessage(message);
}

// A zero-delay task through a MessageChannel (setTimeout clamps to 4 ms).
const channel = new MessageChannel();
let wake = null;
channel.port1.onmessage = () => wake?.();
function nextTask() {
  return new Promise((resolve) => {
    wake = resolve;
    channel.port2.postMessage(null);
  });
}
