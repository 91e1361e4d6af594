// The cross-backend kernel suite in headless Chromium: every kernel on the
// browser's WebGPU (SwiftShader here) against the CPU backend in wasm, once
// with the adapter's default matmul path and once with the other GEMV path.
// Then one decode layer's matmuls of SmolLM2-135M fused against unfused
// (web/kernel-tests/src/fusion_bench.rs): milliseconds and launches per
// layer, printed, not judged (an error in it fails the suite).
//
//   node tests/web/kernels.mjs SITE_DIR
//
// SITE_DIR holds kernels.html and kernel-tests/ (`make web-kernel-tests`).

import { mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { launch, serve } from "./browser.mjs";

const [siteDir] = process.argv.slice(2);
if (!siteDir) {
  console.error("usage: node kernels.mjs SITE_DIR");
  process.exit(2);
}
const RUNS = [
  { name: "default", options: {} },
  { name: "workgroup GEMV", options: { gemvPerRow: false } },
];

const server = await serve(siteDir);
const userDataDir = mkdtempSync(join(tmpdir(), "tandem-chromium-"));
const context = await launch(userDataDir);
let failed = 0;
try {
  const page = context.pages()[0] ?? (await context.newPage());
  page.on("pageerror", (e) => console.log(`[page error] ${e.message}`));
  await page.goto(`http://127.0.0.1:${server.address().port}/kernels.html`);
  await page.waitForFunction(() => typeof window.runKernelConformance === "function", null, { timeout: 60_000 });
  for (const run of RUNS) {
    const started = Date.now();
    const result = await page.evaluate((options) => window.runKernelConformance(options), run.options);
    console.log(`${run.name} (${(Date.now() - started) / 1000} s) on ${result.adapter}`);
    console.log(result.report);
    if (result.problems.length === 0) {
      console.log(`ok: ${run.name}`);
    } else {
      failed += 1;
      console.log(`FAIL: ${run.name}:\n  ${result.problems.join("\n  ")}`);
    }
  }
  // The adapter's default path only: the workgroup GEMV on SwiftShader
  // takes seconds a layer.
  const reps = 20;
  const bench = await page.evaluate((n) => window.benchFusedLayer(n, {}), reps);
  console.log(
    `fused decode layer, fastest of 3 rounds of ${reps}: ` +
      `unfused ${bench.unfusedMs.toFixed(2)} ms (${bench.unfusedLaunches} launches), ` +
      `fused ${bench.fusedMs.toFixed(2)} ms (${bench.fusedLaunches} launches), ` +
      `fused / unfused speed ${(bench.unfusedMs / bench.fusedMs).toFixed(2)}x`,
  );
} catch (e) {
  failed = RUNS.length;
  console.log(`FAIL: ${e.stack ?? e}`);
} finally {
  await context.close();
  server.close();
  rmSync(userDataDir, { recursive: true, force: true });
}
console.log(`${RUNS.length - failed} passed, ${failed} failed`);
process.exit(failed ? 1 : 0);
