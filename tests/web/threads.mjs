// The CPU backend on wasm threads (the threaded package, pkg/threads) through
// the chat page: served cross-origin isolated (COOP/COEP) it runs on the
// threads picked in its settings, 2 and then 1, with the native CPU's greedy
// tokens both times; without the headers it runs on one thread and says why.

import { readFileSync } from "node:fs";
import { join } from "node:path";
import { chooseBackend, lastReply, loadEnded, loadServed, openSettings, send } from "./chat-page.mjs";

/** The headers that make a page cross-origin isolated, as scripts/serve-web.py sends them. */
export const ISOLATION = {
  "cross-origin-opener-policy": "same-origin",
  "cross-origin-embedder-policy": "require-corp",
};

/** Whether `make web` made the threaded package (it needs a nightly toolchain). */
export function threadedBuild(siteDir) {
  return /threadedBuild = true/.test(readFileSync(join(siteDir, "pkg/builds.js"), "utf8"));
}

/** Why the page on a server without the headers says it runs on one thread. */
export function singleThreadReason(siteDir) {
  return threadedBuild(siteDir) ? "the page is not cross-origin isolated" : "this package was built without its threaded build";
}

/**
 * On `page` (a fresh page of the test's browser), the chat page at
 * `isolatedUrl` on the CPU backend with 2 threads, then 1: greedy tokens
 * after `prompt` against `expected` (the native CPU backend's) both times.
 */
export async function threadedTokens(page, check, { isolatedUrl, modelUrl, prompt, expected }) {
  await page.goto(isolatedUrl);
  const isolated = await page.evaluate(() => globalThis.crossOriginIsolated);
  check(isolated, "the page served with COOP/COEP is cross-origin isolated");
  await chooseBackend(page, "cpu");
  await openSettings(page);
  for (const threads of [2, 1]) {
    await page.selectOption("#threads", String(threads));
    // The first pick only sets the field; the second reloads the loaded model.
    const status = threads === 2 ? await loadServed(page, modelUrl) : await loadEnded(page);
    const info = await page.textContent("#backend-info");
    const name = `CPU backend (wasm, ${threads} thread${threads === 1 ? "" : "s"}): the CPU backend was asked for.`;
    check(status.startsWith("Ready") && info === name,
      `a cross-origin isolated page runs the CPU backend on the ${threads} threads picked`, `${status}; ${info}`);
    await send(page, prompt, { template: false });
    const reply = await lastReply(page);
    check(JSON.stringify(reply.ids) === JSON.stringify(expected),
      `8 greedy tokens on ${threads} wasm thread${threads === 1 ? "" : "s"} match the native CPU backend`,
      `browser [${reply.ids.join(" ")}], native [${expected.join(" ")}]; ${reply.meta}`);
  }
}
