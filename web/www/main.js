// The demo page: load a GGUF model (picked, dropped, or the default served
// beside the page, kept in the Cache API), then stream a generation.

import init, { Tandem } from "./pkg/tandem_web.js";

const DEFAULT_MODEL_URL = "models/SmolLM2-135M-Instruct.Q4_1.gguf";
const MODEL_CACHE = "tandem-models-v1";

const $ = (id) => document.getElementById(id);
let engine = null;

await init();
wireModelInputs();
$("generate").onclick = generate;
$("stop").onclick = () => engine?.abort();

/** Wires the model inputs, then enables the button (a click before init would be lost). */
function wireModelInputs() {
  $("load-default").onclick = () => loadModel(() => fetchModel(DEFAULT_MODEL_URL));
  $("load-default").disabled = false;
  $("file").onchange = (e) => {
    const file = e.target.files[0];
    if (file) loadModel(() => readFile(file));
  };
  const drop = $("drop");
  drop.ondragover = (e) => { e.preventDefault(); drop.classList.add("over"); };
  drop.ondragleave = () => drop.classList.remove("over");
  drop.ondrop = (e) => {
    e.preventDefault();
    drop.classList.remove("over");
    const file = e.dataTransfer.files[0];
    if (file) loadModel(() => readFile(file));
  };
}

async function loadModel(getBytes) {
  engine?.abort();
  engine = null;
  $("generate").disabled = true;
  try {
    const started = performance.now();
    const bytes = await getBytes();
    setStatus(`Uploading ${megabytes(bytes.length)} to the backend…`);
    engine = await Tandem.load(bytes, {
      backend: $("force-cpu").checked ? "cpu" : "auto",
      onProgress: (done, total) => setProgress(done, total),
    });
    const info = engine.info();
    $("info").textContent = JSON.stringify(info, null, 2);
    const fallback = info.fallbackReason ? ` (${info.fallbackReason})` : "";
    setStatus(`Ready: ${info.model} on ${info.backend}${fallback}, loaded in ${seconds(performance.now() - started)}.`);
    $("generate").disabled = false;
  } catch (e) {
    setStatus(`Loading failed: ${e.message ?? e}`);
  }
}

/** The model at `url`, from the cache when a complete copy is there. */
async function fetchModel(url) {
  const cache = globalThis.caches ? await caches.open(MODEL_CACHE) : null;
  const cached = await cache?.match(url);
  if (cached) {
    setStatus("Reading the model from the browser cache…");
    return new Uint8Array(await cached.arrayBuffer());
  }
  setStatus(`Downloading ${url}…`);
  const response = await fetch(url);
  if (!response.ok) throw new Error(`${url}: HTTP ${response.status}`);
  const total = Number(response.headers.get("content-length")) || 0;
  const bytes = await readStream(response.body, total);
  // Only a complete download is cached: a partial one would poison reloads.
  if (cache && (total === 0 || bytes.length === total)) {
    await cache.put(url, new Response(bytes, {
      headers: { "content-type": "application/octet-stream", "content-length": String(bytes.length) },
    }));
  }
  return bytes;
}

/** Reads a body into one buffer (allocated once when its length is known). */
async function readStream(body, total) {
  const reader = body.getReader();
  const chunks = [];
  let received = 0;
  const whole = total ? new Uint8Array(total) : null;
  for (;;) {
    const { done, value } = await reader.read();
    if (done) break;
    if (whole && received + value.length <= total) whole.set(value, received);
    else chunks.push(value);
    received += value.length;
    setProgress(received, total || received);
  }
  if (whole && received === total) return whole;
  if (whole) throw new Error(`download ended after ${received} of ${total} bytes`);
  const bytes = new Uint8Array(received);
  let offset = 0;
  for (const chunk of chunks) { bytes.set(chunk, offset); offset += chunk.length; }
  return bytes;
}

async function readFile(file) {
  setStatus(`Reading ${file.name}…`);
  return new Uint8Array(await file.arrayBuffer());
}

async function generate() {
  $("generate").disabled = true;
  $("stop").disabled = false;
  $("output").textContent = "";
  $("token-ids").textContent = "";
  setStatus("Generating…");
  const started = performance.now();
  let firstToken = 0;
  let tokens = 0;
  try {
    const pieces = engine.generate($("prompt").value, {
      maxTokens: Number($("max-tokens").value),
      temperature: Number($("temperature").value),
      topP: Number($("top-p").value),
      seed: Number($("seed").value),
    });
    for await (const piece of pieces) {
      tokens += 1;
      if (tokens === 1) firstToken = performance.now() - started;
      $("output").textContent += piece;
      const decode = (performance.now() - started - firstToken) / 1000;
      $("stats").textContent = `first token after ${seconds(firstToken)}; ${tokens} tokens` +
        (tokens > 1 ? `, ${((tokens - 1) / decode).toFixed(1)} tokens/s` : "");
    }
    $("token-ids").textContent = Array.from(engine.generatedTokens()).join(" ");
    setStatus("Done.");
  } catch (e) {
    setStatus(`Generation failed: ${e.message ?? e}`);
  } finally {
    $("generate").disabled = false;
    $("stop").disabled = true;
  }
}

function setStatus(text) {
  $("status").textContent = text;
}

function setProgress(done, total) {
  $("progress").max = total || 1;
  $("progress").value = done;
}

const megabytes = (n) => `${(n / 2 ** 20).toFixed(1)} MiB`;
const seconds = (ms) => `${(ms / 1000).toFixed(2)} s`;
