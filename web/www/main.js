// The chat page. The engine runs in a Web Worker (pkg/tandem.js), so this
// thread only keeps the page: model picker and load progress, backend choice,
// the conversation, settings and the stored models.

import { Tandem } from "./pkg/tandem.js";

/** The models served with the page (`make web` links them into models/). */
const SERVED = [
  { url: "models/SmolLM2-135M-Instruct.Q4_1.gguf", label: "SmolLM2-135M Instruct (Q4_1, 98 MB)" },
  { url: "models/Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf", label: "Qwen2.5-Coder-0.5B Instruct (Q4_K_M, 491 MB)" },
];
const PHASES = {
  download: "Downloading", cache: "Reading from the browser cache", read: "Reading the file",
  store: "Storing in the browser cache", upload: "Uploading the weights",
};
/** Where each load phase sits on the progress bar (the bar never moves back). */
const PHASE_SPAN = { download: [0, 0.7], cache: [0, 0.7], read: [0, 0.7], store: [0.7, 0.75], upload: [0.75, 1] };
const SOURCES = { network: "downloaded", cache: "from the browser cache", caller: "from a file" };
const FINISH = { stop: "end of text", length: "max tokens", abort: "stopped" };

const $ = (id) => document.getElementById(id);
const engine = new Tandem();
/** What is loaded (or loading): { source, label }; reloaded when the backend or KV cache changes. */
let model = null;
/** Bumped by each load, so a generation that a load stopped does not report over it. */
let loads = 0;
/** The conversation: [{ role, content, element }], system prompt excluded. */
let conversation = [];
/** The generation running, or null: { stopped }. */
let generating = null;
let progress = 0;

wireModelPicker();
wireComposer();
wireThreads();
for (const setting of ["backend", "kv-dtype", "threads"]) {
  $(setting).onchange = () => model && loadModel(model.source, model.label);
}
$("cache-panel").ontoggle = () => $("cache-panel").open && showCache();

function wireModelPicker() {
  const picker = $("model");
  for (const { url, label } of SERVED) picker.add(new Option(label, url));
  picker.add(new Option("A GGUF file from this computer…", "file"));
  picker.add(new Option("A GGUF file from a URL…", "url"));
  picker.onchange = () => {
    $("model-url").hidden = picker.value !== "url";
    if (picker.value === "file") $("file").click();
  };
  $("file").onchange = (e) => {
    const file = e.target.files[0];
    if (file) loadModel(file, file.name);
  };
  $("load").onclick = () => {
    if (picker.value === "file") $("file").click();
    else if (picker.value === "url") {
      const url = $("model-url").value.trim();
      if (url) loadModel(url, url.split("/").pop());
      else setStatus("Type the model's URL first.");
    } else loadModel(picker.value, picker.selectedOptions[0].text);
  };
  document.body.ondragover = (e) => e.preventDefault();
  document.body.ondrop = (e) => {
    e.preventDefault();
    const file = e.dataTransfer.files[0];
    if (file) loadModel(file, file.name);
  };
  $("load").disabled = false;
}

/** The CPU backend's threads: all cores by default, or fewer. */
function wireThreads() {
  const cores = navigator.hardwareConcurrency ?? 1;
  $("threads").add(new Option(`All cores (${cores})`, ""));
  for (let n = 1; n <= cores; n++) $("threads").add(new Option(String(n), String(n)));
}

function wireComposer() {
  $("composer").onsubmit = (e) => {
    e.preventDefault();
    send();
  };
  $("prompt").onkeydown = (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      send();
    }
  };
  $("stop").onclick = () => stop();
  $("regenerate").onclick = () => regenerate();
  $("new-chat").onclick = () => newChat();
}

/** Loads `source` (a URL or a File), stopping a running generation first (the worker does). */
async function loadModel(source, label) {
  const load = ++loads;
  model = { source, label };
  progress = 0;
  setProgress(0);
  setReady(false);
  $("backend-info").textContent = "";
  $("load-log").textContent = "";
  setStatus(`Loading ${label}…`);
  const phases = new Map();
  const started = performance.now();
  try {
    await engine.load(source, {
      backend: $("backend").value,
      kvDtype: $("kv-dtype").value,
      threads: $("threads").value ? Number($("threads").value) : undefined,
      cache: !$("no-cache").checked,
      onProgress: (p) => {
        if (load !== loads) return;
        const now = performance.now();
        phases.set(p.phase, { start: phases.get(p.phase)?.start ?? now, end: now, done: p.done });
        const [from, to] = PHASE_SPAN[p.phase];
        if (p.total) setProgress(from + (to - from) * (p.done / p.total));
        setStatus(`${PHASES[p.phase]} ${megabytes(p.done)}${p.total ? ` of ${megabytes(p.total)}` : ""}…`);
      },
    });
  } catch (e) {
    if (load === loads) setStatus(`Loading failed: ${e.message}`);
    return;
  }
  if (load !== loads) return;
  const info = engine.info();
  setProgress(1);
  $("load-log").textContent = [...phases].map(([phase, p]) =>
    `${phase} ${megabytes(p.done)} in ${seconds(p.end - p.start)}`).join("; ");
  $("backend-info").textContent = `${backendName(info)}: ${info.backendReason}.` +
    (info.backend === "webgpu" ? ` Adapter: ${info.adapter}.` : "") +
    (info.threadsReason ? ` Why ${plural(info.threads, "thread")}: ${info.threadsReason}.` : "");
  setStatus(`Ready: ${label}, ${SOURCES[info.source]}, loaded in ${seconds(performance.now() - started)} ` +
    `(worker memory ${megabytes(info.wasmMemoryBytes)}).`);
  setReady(true);
  if ($("cache-panel").open) showCache();
}

function backendName(info) {
  return info.backend === "webgpu" ? "WebGPU" : `CPU backend (wasm, ${plural(info.threads, "thread")})`;
}

function send() {
  const text = $("prompt").value.trim();
  if (!text || generating || $("send").disabled) return;
  $("prompt").value = "";
  addMessage("user", text);
  reply();
}

function regenerate() {
  if (generating) return;
  const last = conversation.at(-1);
  if (last?.role !== "assistant") return;
  last.element.remove();
  conversation.pop();
  reply();
}

async function newChat() {
  if (generating) await stop();
  for (const m of conversation) m.element.remove();
  conversation = [];
  $("empty").hidden = false;
  $("regenerate").disabled = true;
  $("prompt").focus();
}

function stop() {
  if (generating) generating.stopped = true;
  return engine.abort().catch((e) => setStatus(`Stop failed: ${e.message}`));
}

/** Streams the assistant's reply to the conversation so far. */
async function reply() {
  const load = loads;
  const run = { stopped: false };
  generating = run;
  setGenerating(true);
  setStatus("Generating…");
  const asChat = $("chat-template").checked;
  const history = conversation.filter((m) => !m.failed).map(({ role, content }) => ({ role, content }));
  const system = $("system-prompt").value.trim();
  const messages = system ? [{ role: "system", content: system }, ...history] : history;
  const options = {
    maxTokens: Number($("max-tokens").value),
    temperature: Number($("temperature").value),
    topP: Number($("top-p").value),
    seed: Math.floor(Math.random() * 2 ** 32),
  };
  // A KV budget applies per reply: the sequence keeps at most that much KV.
  const budget = $("kv-budget").value.trim();
  if (budget) {
    options.kvBudget = /^\d+$/.test(budget) ? Number(budget) : budget;
    options.kvEvict = $("kv-evict").value;
  }
  const message = addMessage("assistant", "");
  message.element.classList.add("pending");
  const bubble = message.element.querySelector(".bubble");
  const meta = message.element.querySelector(".meta");
  const started = performance.now();
  let firstToken = 0;
  let steps = 0;
  try {
    const pieces = asChat ? engine.chat(messages, options) : engine.generate(history.at(-1).content, options);
    for await (const piece of pieces) {
      steps += 1;
      if (steps === 1) firstToken = performance.now() - started;
      message.content += piece;
      bubble.textContent = message.content.trimStart();
      meta.textContent = `${steps} tokens · ${rate(steps, performance.now() - started - firstToken)}`;
      scrollDown();
    }
    const tokens = engine.generatedTokens();
    const finish = engine.finishReason();
    message.element.dataset.tokens = Array.from(tokens).join(" ");
    message.element.dataset.finish = finish;
    meta.textContent = `${FINISH[finish]} · ${tokens.length} tokens · first token ${seconds(firstToken)} · ` +
      rate(tokens.length, performance.now() - started - firstToken);
    if (load === loads) setStatus(finish === "abort" || run.stopped ? "Stopped." : `Done (${FINISH[finish]}).`);
  } catch (e) {
    message.failed = true;
    message.element.classList.add("error");
    bubble.textContent = message.content || e.message;
    meta.textContent = `failed: ${e.message}`;
    if (load === loads) setStatus(`Generation failed: ${e.message}`);
  } finally {
    message.element.classList.remove("pending");
    generating = null;
    setGenerating(false);
  }
}

/** Adds a bubble; returns its conversation entry. */
function addMessage(role, content) {
  $("empty").hidden = true;
  const element = document.createElement("div");
  element.className = `message ${role}`;
  const bubble = document.createElement("div");
  bubble.className = "bubble";
  bubble.textContent = content;
  const meta = document.createElement("div");
  meta.className = "meta";
  element.append(bubble, meta);
  $("messages").append(element);
  const entry = { role, content, element };
  conversation.push(entry);
  scrollDown();
  return entry;
}

/** The models in the browser's cache, each with its size and a Delete button. */
async function showCache() {
  const list = $("cache-list");
  const models = await Tandem.cachedModels();
  list.replaceChildren(...models.map(({ url, bytes }) => {
    const item = document.createElement("li");
    const name = document.createElement("span");
    name.className = "name";
    name.textContent = decodeURIComponent(new URL(url).pathname.split("/").pop());
    name.title = url;
    const size = document.createElement("span");
    size.className = "muted";
    size.textContent = bytes === null ? "?" : megabytes(bytes);
    const remove = document.createElement("button");
    remove.textContent = "Delete";
    remove.onclick = async () => {
      await Tandem.deleteCached(url);
      showCache();
    };
    item.append(name, size, remove);
    return item;
  }));
  if (!models.length) list.innerHTML = '<li class="muted">Nothing stored yet.</li>';
  const total = models.reduce((sum, m) => sum + (m.bytes ?? 0), 0);
  const estimate = await navigator.storage?.estimate?.();
  $("cache-usage").textContent = `${models.length} models, ${megabytes(total)}` +
    (estimate ? `; this site uses ${megabytes(estimate.usage)} of ${megabytes(estimate.quota)} allowed` : "");
}

function setReady(ready) {
  $("send").disabled = !ready;
  $("regenerate").disabled = !ready || conversation.at(-1)?.role !== "assistant";
}

function setGenerating(on) {
  $("stop").hidden = !on;
  $("send").hidden = on;
  $("regenerate").disabled = on || $("send").disabled || conversation.at(-1)?.role !== "assistant";
}

function setStatus(text) {
  $("status").textContent = text;
}

function setProgress(fraction) {
  progress = Math.max(progress, Math.min(fraction, 1));
  if (fraction === 0) progress = 0;
  $("progress-bar").style.width = `${(progress * 100).toFixed(1)}%`;
}

function scrollDown() {
  const messages = $("messages");
  messages.scrollTop = messages.scrollHeight;
}

const plural = (n, noun) => `${n} ${noun}${n === 1 ? "" : "s"}`;
const megabytes = (n) => `${(n / 2 ** 20).toFixed(1)} MiB`;
const seconds = (ms) => `${(ms / 1000).toFixed(2)} s`;
const rate = (tokens, ms) => (tokens > 1 && ms > 0 ? `${((tokens - 1) / (ms / 1000)).toFixed(1)} tokens/s` : "");
