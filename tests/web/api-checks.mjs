// Checks of the package's APIs called from the page's own scripts: the wasm
// `Tandem` (pkg/tandem_web.js, on the page's thread) for sources, caching,
// failures and KV dtypes, and the worker-backed `Tandem` (pkg/tandem.js) for
// calls made while another is under way. Each takes the page and `check(ok,
// what, detail)`.

const CACHE = "tandem-models-v1";

/** Failed downloads give clear errors and cache nothing. */
export async function failedDownloads(page, check, modelPath) {
  const failures = await page.evaluate(async ({ urls, cache }) => {
    const { default: init, Tandem } = await import(new URL("pkg/tandem_web.js", location.href).href);
    await init();
    const errors = {};
    for (const url of urls) {
      try {
        (await Tandem.load(url, { backend: "cpu" })).free();
        errors[url] = null;
      } catch (e) {
        errors[url] = e.message ?? String(e);
      }
    }
    const cached = (await (await caches.open(cache)).keys()).map((r) => new URL(r.url).pathname);
    return { errors, cached };
  }, { urls: ["broken/missing.gguf", "broken/cut-short.gguf", "broken/no-end.gguf"], cache: CACHE });
  console.log(JSON.stringify(failures, null, 2));
  const { errors, cached } = failures;
  check(/missing\.gguf: HTTP 404/.test(errors["broken/missing.gguf"]), "a 404 is a clear error");
  check(/cut-short\.gguf: the download failed/.test(errors["broken/cut-short.gguf"]),
    "a download cut short is a clear error");
  check(/no-end\.gguf: .*truncated/.test(errors["broken/no-end.gguf"]),
    "an incomplete file without a length is a clear error");
  check(JSON.stringify(cached) === JSON.stringify([modelPath]), "failed downloads leave nothing in the cache",
    `cached: ${cached.join(", ")}`);
}

/** `cache: false` leaves the cache alone; a bad cached copy is replaced; bad chat messages are refused. */
export async function cacheRepair(page, check, { modelBytes, downloads }) {
  const url = "copy/model.gguf";
  const { uncached, repaired } = await page.evaluate(async ({ url, cache }) => {
    const { default: init, Tandem } = await import(new URL("pkg/tandem_web.js", location.href).href);
    await init();
    const key = new URL(url, location.href).href;
    const models = await caches.open(cache);
    await models.put(key, new Response("GGUF, but only the start", { headers: { "content-length": "24" } }));
    const load = async (options) => {
      const engine = await Tandem.load(url, { backend: "cpu", ...options });
      const { source } = engine.info();
      const badChats = [[], [{ role: "user" }], "Hi"].map((messages) => {
        try {
          engine.chat(messages);
          return null;
        } catch (e) {
          return e.message;
        }
      });
      engine.free();
      const cached = (await (await models.match(key))?.arrayBuffer())?.byteLength ?? null;
      return { source, cached, badChats };
    };
    return { uncached: await load({ cache: false }), repaired: await load({}) };
  }, { url, cache: CACHE });
  check(uncached.source === "network" && uncached.cached === 24,
    "cache: false neither reads nor writes the cache", `source ${uncached.source}, cached ${uncached.cached} bytes`);
  check(repaired.source === "network" && repaired.cached === modelBytes && downloads(`/${url}`) === 2,
    "a bad cached copy is replaced by a new download",
    `source ${repaired.source}, cached ${repaired.cached} bytes, ${downloads(`/${url}`)} downloads`);
  check(repaired.badChats.every((e) => /^messages must be a non-empty array/.test(e)),
    "engine.chat refuses messages that are not [{ role, content }]", [...new Set(repaired.badChats)].join(" | "));
}

/** A Response, a Blob and an ArrayBuffer load, through the worker (a Response's body is transferred). */
export async function callerSources(page, check, modelBytes) {
  const results = await page.evaluate(async (url) => {
    const { Tandem } = await import(new URL("pkg/tandem.js", location.href).href);
    const sources = {
      "a Response": () => fetch(url),
      "a Blob": async () => (await fetch(url)).blob(),
      "an ArrayBuffer": async () => (await fetch(url)).arrayBuffer(),
    };
    const engine = new Tandem();
    const results = {};
    for (const [kind, make] of Object.entries(sources)) {
      const phases = new Set();
      await engine.load(await make(), { backend: "cpu", onProgress: (p) => phases.add(p.phase) });
      const { source, modelBytes } = engine.info();
      results[kind] = { source, modelBytes, phases: [...phases] };
    }
    engine.free();
    return results;
  }, "copy/model.gguf");
  for (const [kind, r] of Object.entries(results)) {
    check(r.source === "caller" && r.modelBytes === modelBytes && r.phases.join() === "read,upload",
      `the worker's Tandem.load takes ${kind}`, JSON.stringify(r));
  }
}

/**
 * Calls that overlap, through the worker: a second generation stops the
 * first (its iterator ends, finishReason "abort") and runs; a generation
 * asked for during a load waits for it; one with no model is a clear error.
 */
export async function overlappingCalls(page, check, { modelUrl, prompt, backend }) {
  const r = await page.evaluate(async ({ modelUrl, prompt, backend }) => {
    const { Tandem } = await import(new URL("pkg/tandem.js", location.href).href);
    const engine = new Tandem();
    const drain = async (pieces) => {
      let text = "";
      for await (const piece of pieces) text += piece;
      return { text, finish: engine.finishReason(), ids: [...engine.generatedTokens()] };
    };
    let noModel = null;
    try {
      await drain(engine.generate(prompt));
    } catch (e) {
      noModel = e.message;
    }
    const loading = engine.load(modelUrl, { backend });
    const duringLoad = drain(engine.generate(prompt, { maxTokens: 2, temperature: 0 }));
    await loading;
    const queued = await duringLoad;
    const first = engine.generate(prompt, { maxTokens: 64, temperature: 0 })[Symbol.asyncIterator]();
    const firstPiece = await first.next();
    const second = await drain(engine.generate(prompt, { maxTokens: 2, temperature: 0 }));
    let firstPieces = 1;
    while (!(await first.next()).done) firstPieces += 1;
    engine.free();
    let afterFree = null;
    try {
      await engine.abort();
    } catch (e) {
      afterFree = e.message;
    }
    return { noModel, queued, firstPiece, firstPieces, second, afterFree };
  }, { modelUrl, prompt, backend });
  console.log(JSON.stringify(r));
  check(/^no model is loaded/.test(r.noModel), "a generation with no model loaded is a clear error", r.noModel);
  check(r.queued.ids.length === 2 && r.queued.finish === "length",
    "a generation asked for during a load runs once the model is loaded", JSON.stringify(r.queued));
  check(!r.firstPiece.done && r.firstPieces < 64 && r.second.ids.length === 2 && r.second.finish === "length",
    "a second generation stops the running one and runs", JSON.stringify(r));
  check(r.afterFree === "the engine was freed", "a call after free() is a clear error", r.afterFree);
}

/**
 * On WebGPU, where a step's readback is asynchronous, on the page's thread:
 * abort() during a step in flight does not throw and ends the generation; a
 * new generation asked for during the step is refused with a clear error.
 */
export async function abortMidStep(page, check, { modelUrl, prompt }) {
  const r = await page.evaluate(async ({ modelUrl, prompt }) => {
    const { default: init, Tandem } = await import(new URL("pkg/tandem_web.js", location.href).href);
    await init();
    const engine = await Tandem.load(modelUrl, { backend: "webgpu" });
    const pieces = engine.generate(prompt, { maxTokens: 16, temperature: 0 })[Symbol.asyncIterator]();
    const step = pieces.next();
    // The step starts on the next turn of the event loop; then its readback is awaited.
    await new Promise((resolve) => setTimeout(resolve, 0));
    let refused = null;
    try {
      engine.generate(prompt);
    } catch (e) {
      refused = e.message;
    }
    let abortError = null;
    try {
      engine.abort();
    } catch (e) {
      abortError = e.message ?? String(e);
    }
    const first = await step;
    const after = await pieces.next();
    const finish = engine.finishReason();
    engine.free();
    return { refused, abortError, first, after, finish };
  }, { modelUrl, prompt });
  console.log(JSON.stringify(r));
  check(/^the engine is busy with a step/.test(r.refused),
    "a generation asked for during a WebGPU step is refused with a clear error", r.refused);
  check(r.abortError === null && r.first.done && r.after.done && r.finish === "abort",
    "abort() during a WebGPU step does not throw and ends the generation", JSON.stringify(r));
}
