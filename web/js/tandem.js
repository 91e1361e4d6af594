// Tandem for pages: the `Tandem` API of tandem_web.js, with the engine in a
// Web Worker (worker.js) and messages underneath, so the page's thread never
// runs a model step and never freezes.
//
//   import { Tandem } from "tandem-web";   // this file
//   const engine = await Tandem.load(url, { backend: "auto", onProgress });
//   for await (const piece of engine.chat(messages, { maxTokens })) { ... }
//   engine.finishReason();   // "stop" | "length" | "abort"
//
// Calls are queued in the worker, in order: a new generation or load stops
// the running generation first (its iterator ends, finishReason "abort"), so
// a call made during a step never fails for being early. Errors reject the
// call's promise, or the iterator's next(), with the engine's message.

/** The Cache API cache models go to unless `cache` names another. */
export const DEFAULT_CACHE = "tandem-models-v1";

export class Tandem {
  #worker;
  #calls = new Map();
  #nextId = 1;
  #info = null;
  #tokens = new Uint32Array();
  #finishReason = null;
  #failure = null;
  /** Messages leave in the order of the calls, even when one needs preparing (`portable`). */
  #outbox = Promise.resolve();

  /**
   * Starts an engine's worker, with no model yet (`load` one). `workerUrl`
   * overrides where worker.js is (by default beside this file).
   */
  constructor({ workerUrl } = {}) {
    this.#worker = new Worker(workerUrl ?? new URL("./worker.js", import.meta.url), { type: "module" });
    this.#worker.onmessage = ({ data }) => this.#receive(data);
    this.#worker.onerror = (event) => {
      event.preventDefault();
      this.#fail(`the engine's worker failed: ${event.message || "it could not be started"}`);
    };
    this.#worker.onmessageerror = () => this.#fail("the engine's worker sent a message that cannot be read");
  }

  /** A new engine (its own worker) with the model from `source` loaded. */
  static async load(source, options = {}) {
    const engine = new Tandem(options);
    try {
      return await engine.load(source, options);
    } catch (e) {
      engine.free();
      throw e;
    }
  }

  /**
   * Loads the model from `source` (a URL, Response, Blob or File, ArrayBuffer
   * or Uint8Array) with `options` as tandem_web.js's `Tandem.load` takes
   * them, replacing the loaded model; a running generation stops first.
   * Resolves to this engine.
   */
  async load(source, options = {}) {
    const { onProgress, workerUrl: _, ...rest } = options;
    if (onProgress !== undefined && typeof onProgress !== "function") {
      throw new TypeError("option onProgress must be a function");
    }
    this.#info = null;
    this.#info = await this.#call({ op: "load", options: rest }, { onProgress, source });
    return this;
  }

  /** An async iterable of the text pieces after `prompt` (see tandem_web.js). */
  generate(prompt, options = {}) {
    return this.#stream({ op: "generate", prompt, options });
  }

  /** An async iterable of the reply's text pieces after the conversation `messages`. */
  chat(messages, options = {}) {
    return this.#stream({ op: "chat", messages, options });
  }

  /** Stops the running generation after its step in flight; resolves once asked. */
  abort() {
    return this.#call({ op: "abort" });
  }

  /** What tandem_web.js's `info()` gives, and `wasmMemoryBytes` (the worker's wasm memory). */
  info() {
    if (!this.#info) throw new Error("no model is loaded");
    return this.#info;
  }

  /** Token ids of the latest generation that ended. */
  generatedTokens() {
    return this.#tokens;
  }

  /** Why the latest generation ended: "stop", "length" or "abort"; null before any. */
  finishReason() {
    return this.#finishReason;
  }

  /** Ends the worker: the model's memory is released at once. */
  free() {
    this.#worker.terminate();
    this.#fail("the engine was freed");
  }

  /** Models in the Cache API cache `cache`: [{ url, bytes }], bytes null when unknown. */
  static async cachedModels(cache = DEFAULT_CACHE) {
    if (!globalThis.caches) return [];
    const store = await caches.open(cache);
    const models = [];
    for (const request of await store.keys()) {
      const response = await store.match(request);
      const length = response?.headers.get("content-length");
      models.push({ url: request.url, bytes: length === null || length === undefined ? null : Number(length) });
    }
    return models;
  }

  /** Removes the model from `url` from the cache; resolves to whether it was there. */
  static async deleteCached(url, cache = DEFAULT_CACHE) {
    if (!globalThis.caches) return false;
    return (await caches.open(cache)).delete(new URL(url, location.href).href);
  }

  /** Posts `message` (with `source` made portable) and resolves to the worker's answer. */
  #call(message, { onProgress, onPiece, source } = {}) {
    if (this.#failure) return Promise.reject(new Error(this.#failure));
    const id = this.#nextId++;
    return new Promise((resolve, reject) => {
      this.#calls.set(id, { resolve, reject, onProgress, onPiece });
      const post = async () => {
        const { value, transfer } = await portable(source);
        this.#worker.postMessage({ id, ...message, source: value }, transfer);
      };
      this.#outbox = this.#outbox.then(post).catch((e) => {
        this.#calls.delete(id);
        reject(new Error(`the call cannot be sent to the engine's worker: ${e.message}`));
      });
    });
  }

  #stream(message) {
    const pieces = [];
    let ended = false;
    let error = null;
    let wake = null;
    const notify = () => {
      wake?.();
      wake = null;
    };
    this.#call(message, { onPiece: (text) => { pieces.push(text); notify(); } }).then(
      ({ finishReason, tokens }) => {
        this.#finishReason = finishReason;
        this.#tokens = Uint32Array.from(tokens);
        ended = true;
        notify();
      },
      (e) => {
        error = e;
        ended = true;
        notify();
      },
    );
    const engine = this;
    return {
      [Symbol.asyncIterator]() { return this; },
      async next() {
        while (!pieces.length && !ended) await new Promise((resolve) => { wake = resolve; });
        if (pieces.length) return { done: false, value: pieces.shift() };
        if (error) throw error;
        return { done: true, value: undefined };
      },
      async return() {
        // A `break` out of `for await`: this generation stops, unless it already ended.
        if (!ended) await engine.abort();
        return { done: true, value: undefined };
      },
    };
  }

  #receive({ id, type, ...data }) {
    const call = this.#calls.get(id);
    if (!call) return;
    if (type === "progress") call.onProgress?.(data.progress);
    else if (type === "piece") call.onPiece?.(data.text);
    else {
      this.#calls.delete(id);
      if (type === "done") call.resolve(data.value);
      else call.reject(new Error(data.message));
    }
  }

  #fail(message) {
    this.#failure ??= message;
    for (const call of this.#calls.values()) call.reject(new Error(message));
    this.#calls.clear();
  }
}

/**
 * `source` as it can be posted to the worker: a URL made absolute (the
 * worker's base is worker.js, not the page), a Response as its body stream
 * (transferred) and headers; Blobs and bytes are cloned.
 */
async function portable(source) {
  if (source === undefined) return { value: undefined, transfer: [] };
  if (typeof source === "string" || source instanceof URL) {
    return { value: new URL(source, location.href).href, transfer: [] };
  }
  if (source instanceof Response) {
    const headers = [...source.headers];
    if (!source.body) return { value: { response: { body: null, headers } }, transfer: [] };
    // Where streams cannot be transferred (older browsers), the bytes are handed over.
    if (!streamsTransfer()) return { value: await source.blob(), transfer: [] };
    return { value: { response: { body: source.body, headers } }, transfer: [source.body] };
  }
  return { value: source, transfer: [] };
}

function streamsTransfer() {
  try {
    const stream = new ReadableStream();
    structuredClone(stream, { transfer: [stream] });
    return true;
  } catch {
    return false;
  }
}
