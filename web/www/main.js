// The demo page: load a GGUF model (one of those served beside the page —
// SmolLM2-135M, Qwen2.5-Coder-0.5B — fetched and cached by the package; or a
// file picked or dropped), then stream a completion or a chat reply.

import init, { Tandem } from "./pkg/tandem_web.js";

const $ = (id) => document.getElementById(id);
let engine = null;
/** The chat so far: [{ role, content }], sent whole with each turn. */
let conversation = [];

const wasm = await init();
wireModelInputs();
$("generate").onclick = generate;
$("stop").onclick = () => engine?.abort();
$("new-chat").onclick = () => showConversation([]);

/** Wires the model inputs, then enables the buttons (a click before init would be lost). */
function wireModelInputs() {
  // One button per served model; its data-model is the model's URL.
  for (const button of document.querySelectorAll("button[data-model]")) {
    button.onclick = () => loadModel(button.dataset.model);
    button.disabled = false;
  }
  $("file").onchange = (e) => {
    const file = e.target.files[0];
    if (file) loadModel(file);
  };
  const drop = $("drop");
  drop.ondragover = (e) => { e.preventDefault(); drop.classList.add("over"); };
  drop.ondragleave = () => drop.classList.remove("over");
  drop.ondrop = (e) => {
    e.preventDefault();
    drop.classList.remove("over");
    const file = e.dataTransfer.files[0];
    if (file) loadModel(file);
  };
}

/** Loads `source` (a URL or a File); the phases of the load and their times go to #load-log. */
async function loadModel(source) {
  engine?.abort();
  engine?.free();
  engine = null;
  $("generate").disabled = true;
  $("load-log").textContent = "";
  const memoryBefore = wasm.memory.buffer.byteLength;
  const phases = new Map();
  try {
    const started = performance.now();
    setStatus(`Loading ${source.name ?? source}…`);
    engine = await Tandem.load(source, {
      backend: $("force-cpu").checked ? "cpu" : "auto",
      cache: !$("no-cache").checked,
      onProgress: (p) => {
        const now = performance.now();
        const phase = phases.get(p.phase) ?? { start: now };
        phases.set(p.phase, { ...phase, end: now, done: p.done, total: p.total });
        setProgress(p.done, p.total ?? p.done);
        setStatus(`${PHASES[p.phase]} ${megabytes(p.done)}${p.total ? ` of ${megabytes(p.total)}` : ""}…`);
      },
    });
    const info = engine.info();
    $("info").textContent = JSON.stringify(info, null, 2);
    $("load-log").textContent = [...phases].map(([phase, p]) =>
      `${phase} ${megabytes(p.done)} in ${seconds(p.end - p.start)}`).join("; ");
    const fallback = info.fallbackReason ? ` (${info.fallbackReason})` : "";
    setStatus(`Ready: ${info.model} on ${info.backend}${fallback}, ${SOURCES[info.source]}, ` +
      `loaded in ${seconds(performance.now() - started)}; wasm memory ` +
      `${megabytes(wasm.memory.buffer.byteLength)} (${megabytes(memoryBefore)} before) ` +
      `for a ${megabytes(info.modelBytes)} model.`);
    $("generate").disabled = false;
  } catch (e) {
    setStatus(`Loading failed: ${e.message ?? e}`);
  }
}

const PHASES = {
  download: "Downloading", cache: "Reading from the browser cache", read: "Reading the file",
  store: "Caching the download", upload: "Uploading the weights",
};
const SOURCES = { network: "downloaded", cache: "from the browser cache", caller: "from a file" };

async function generate() {
  $("generate").disabled = true;
  $("stop").disabled = false;
  $("output").textContent = "";
  $("token-ids").textContent = "";
  setStatus("Generating…");
  const started = performance.now();
  let firstToken = 0;
  let tokens = 0;
  const options = {
    maxTokens: Number($("max-tokens").value),
    temperature: Number($("temperature").value),
    topP: Number($("top-p").value),
    seed: Number($("seed").value),
  };
  const chat = $("chat").checked;
  const messages = [...conversation, { role: "user", content: $("prompt").value }];
  try {
    const pieces = chat ? engine.chat(messages, options) : engine.generate($("prompt").value, options);
    for await (const piece of pieces) {
      tokens += 1;
      if (tokens === 1) firstToken = performance.now() - started;
      $("output").textContent += piece;
      const decode = (performance.now() - started - firstToken) / 1000;
      $("stats").textContent = `first token after ${seconds(firstToken)}; ${tokens} tokens` +
        (tokens > 1 ? `, ${((tokens - 1) / decode).toFixed(1)} tokens/s` : "");
    }
    $("token-ids").textContent = Array.from(engine.generatedTokens()).join(" ");
    if (chat) showConversation([...messages, { role: "assistant", content: $("output").textContent }]);
    setStatus("Done.");
  } catch (e) {
    setStatus(`Generation failed: ${e.message ?? e}`);
  } finally {
    $("generate").disabled = false;
    $("stop").disabled = true;
  }
}

function showConversation(messages) {
  conversation = messages;
  $("conversation").textContent = messages.map((m) => `${m.role}: ${m.content}`).join("\n");
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
