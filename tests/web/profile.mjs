// Where the browser's time goes while the CPU backend decodes: the
// single-threaded package run on the page itself (not in its worker, so the
// page's DevTools profiler sees it), one warm-up generation, then a CPU
// profile (Chromium's Profiler domain over CDP, 200 µs sampling) of a greedy
// generation, printed as the functions with the most self time.
//
//   node tests/web/profile.mjs SITE_DIR [TOKENS] [MODEL_URL]
//
// SITE_DIR is what `make web` builds.

import { mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { launch, serve } from "./browser.mjs";

const [siteDir, tokensArg = "48", modelUrl = "models/SmolLM2-135M-Instruct.Q4_1.gguf"] =
  process.argv.slice(2);
if (!siteDir) {
  console.error("usage: node profile.mjs SITE_DIR [TOKENS] [MODEL_URL]");
  process.exit(2);
}
const TOP = 15;

const server = await serve(siteDir);
const userDataDir = mkdtempSync(join(tmpdir(), "tandem-profile-"));
const context = await launch(userDataDir);
try {
  const page = context.pages()[0] ?? (await context.newPage());
  page.on("pageerror", (e) => console.log(`[page error] ${e.message}`));
  await page.goto(`http://127.0.0.1:${server.address().port}/`);
  await page.evaluate(async (modelUrl) => {
    const pkg = await import(new URL("pkg/tandem_web.js", location.href).href);
    await pkg.default();
    window.engine = await pkg.Tandem.load(modelUrl, { backend: "cpu", cache: false });
    for await (const _ of window.engine.generate("Hello", { maxTokens: 4, temperature: 0 })) {}
  }, modelUrl);
  const cdp = await context.newCDPSession(page);
  await cdp.send("Profiler.enable");
  await cdp.send("Profiler.setSamplingInterval", { interval: 200 });
  await cdp.send("Profiler.start");
  const run = await page.evaluate(async (tokens) => {
    const started = performance.now();
    let pieces = 0;
    for await (const _ of window.engine.generate("The history of the printing press",
      { maxTokens: tokens, temperature: 0 })) {
      pieces += 1;
    }
    return { ms: performance.now() - started, tokens: window.engine.generatedTokens().length, pieces };
  }, Number(tokensArg));
  const { profile } = await cdp.send("Profiler.stop");
  console.log(`${run.tokens} tokens in ${(run.ms / 1000).toFixed(2)} s ` +
    `(${(run.tokens / run.ms * 1000).toFixed(1)} tokens/s, prompt included)`);
  const nodes = new Map(profile.nodes.map((n) => [n.id, n]));
  const selfTime = new Map();
  let total = 0;
  profile.samples.forEach((id, i) => {
    const frame = nodes.get(id).callFrame;
    const name = frame.functionName || frame.url.split("/").pop() || "(anonymous)";
    selfTime.set(name, (selfTime.get(name) ?? 0) + profile.timeDeltas[i]);
    total += profile.timeDeltas[i];
  });
  console.log(`self time, top ${TOP}:`);
  for (const [name, t] of [...selfTime].sort((a, b) => b[1] - a[1]).slice(0, TOP)) {
    console.log(`${(100 * t / total).toFixed(1).padStart(6)}%  ${name}`);
  }
} finally {
  await context.close();
  server.close();
  rmSync(userDataDir, { recursive: true, force: true });
}
