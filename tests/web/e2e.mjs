// End-to-end test of the demo page in headless Chromium (WebGPU through
// SwiftShader): serve the built site on 127.0.0.1, load SmolLM2-135M,
// generate 8 greedy tokens and compare them with the native CPU backend's;
// then reload the page and load the model again, which must come from the
// browser's cache (the server sees one download).
//
//   node tests/web/e2e.mjs SITE_DIR ARTIFACT_DIR
//
// TANDEM_WEB_BACKEND=cpu runs the page's CPU backend (wasm) instead of WebGPU.
//
// SITE_DIR is what `make web` builds (page, pkg/, models/); the screenshot
// goes to ARTIFACT_DIR (outside git).

import { mkdtempSync, mkdirSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { launch, serve } from "./browser.mjs";

const [siteDir, artifactDir] = process.argv.slice(2);
if (!siteDir || !artifactDir) {
  console.error("usage: node e2e.mjs SITE_DIR ARTIFACT_DIR");
  process.exit(2);
}

const PROMPT = "The capital of France is";
// The first 8 greedy ids after the prompt (tests/fixtures/smollm2_reference.json,
// and `tandem run --backend cpu -n 8`).
const EXPECTED = [7042, 30, 198, 198, 504, 2988, 314, 42];
const BACKEND = process.env.TANDEM_WEB_BACKEND ?? "webgpu";
const TIMEOUT_MS = 3 * 60 * 1000;

const requests = new Map();
const server = await serve(siteDir, requests);
const url = `http://127.0.0.1:${server.address().port}/`;
const userDataDir = mkdtempSync(join(tmpdir(), "tandem-chromium-"));
const context = await launch(userDataDir);


let failed = 0;
try {
  const page = context.pages()[0] ?? (await context.newPage());
  page.on("console", (m) => console.log(`[page ${m.type()}] ${m.text()}`));
  page.on("pageerror", (e) => console.log(`[page error] ${e.message}`));
  const opened = Date.now();
  await page.goto(url);
  await page.setChecked("#force-cpu", BACKEND === "cpu");
  await page.click("#load-default");
  await page.waitForFunction(
    () => /^(Ready|Loading failed)/.test(document.getElementById("status").textContent),
    null, { timeout: TIMEOUT_MS },
  );
  const loaded = Date.now();
  console.log(await page.textContent("#status"));
  console.log(await page.textContent("#info"));
  await page.fill("#prompt", PROMPT);
  await page.fill("#max-tokens", String(EXPECTED.length));
  await page.fill("#temperature", "0");
  await page.click("#generate");
  await page.waitForFunction(
    () => /^(Done|Generation failed)/.test(document.getElementById("status").textContent),
    null, { timeout: TIMEOUT_MS },
  );
  const finished = Date.now();
  const ids = (await page.textContent("#token-ids")).trim().split(/\s+/).filter(Boolean).map(Number);
  console.log(`status: ${await page.textContent("#status")}`);
  console.log(`output: ${JSON.stringify(await page.textContent("#output"))}`);
  console.log(`stats: ${await page.textContent("#stats")}`);
  console.log(`page open to model ready ${(loaded - opened) / 1000} s; generation ${(finished - loaded) / 1000} s`);
  mkdirSync(artifactDir, { recursive: true });
  const screenshot = join(artifactDir, `demo-${BACKEND}.png`);
  await page.screenshot({ path: screenshot, fullPage: true });
  console.log(`screenshot: ${screenshot}`);
  if (JSON.stringify(ids) === JSON.stringify(EXPECTED)) {
    console.log(`ok (${BACKEND}): greedy tokens ${ids.join(" ")} match the native CPU backend`);
  } else {
    failed = 1;
    console.log(`FAIL (${BACKEND}): browser tokens [${ids.join(" ")}], native CPU tokens [${EXPECTED.join(" ")}]`);
  }

  await page.reload();
  await page.setChecked("#force-cpu", BACKEND === "cpu");
  await page.click("#load-default");
  await page.waitForFunction(
    () => /^(Ready|Loading failed)/.test(document.getElementById("status").textContent),
    null, { timeout: TIMEOUT_MS },
  );
  const downloads = requests.get("/models/SmolLM2-135M-Instruct.Q4_1.gguf");
  if (downloads === 1 && (await page.textContent("#status")).startsWith("Ready")) {
    console.log("ok: after a reload the model came from the browser cache");
  } else {
    failed = 1;
    console.log(`FAIL: after a reload: ${await page.textContent("#status")}; model downloaded ${downloads} times`);
  }
} catch (e) {
  failed = 1;
  console.log(`FAIL: ${e.stack ?? e}`);
} finally {
  await context.close();
  server.close();
  rmSync(userDataDir, { recursive: true, force: true });
}
console.log(`${1 - failed} passed, ${failed} failed`);
process.exit(failed);
