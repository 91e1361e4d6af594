// The native CPU backend's tokens, which the browser's must equal: `tandem
// run` (a CPU-only debug build) on the site's model files.

import { spawnSync } from "node:child_process";
import { join } from "node:path";

/**
 * The native CPU backend's first `count` greedy token ids after `prompt`, run
 * with `options` on the model at `modelPath` under `siteDir`. With
 * `--top-logprobs` among the options: `{ ids, top }`, `top[i]` a Map of
 * token id → logprob at step i.
 */
export function nativeTokens(tandemBin, siteDir, modelPath, options, prompt, count) {
  const args = ["run", "--backend", "cpu", "--model", join(siteDir, modelPath), ...options,
    "--token-ids", "--temperature", "0", "-n", String(count), prompt];
  const out = spawnSync(tandemBin, args, { encoding: "utf8" });
  const line = out.stderr?.match(/^token ids: (.*)$/m);
  if (out.status !== 0 || !line) {
    throw new Error(`${tandemBin} ${args.join(" ")} failed (${out.error ?? out.status}):\n${out.stderr}`);
  }
  const ids = line[1].trim().split(" ").map(Number);
  if (!options.includes("--top-logprobs")) {
    return ids;
  }
  // `logprobs I: TOKEN LOGPROB | TOKEN LOGPROB ...`, one line per generated token.
  const top = [...out.stderr.matchAll(/^logprobs \d+: \S+ \S+ \| (.*)$/gm)].map((m) => {
    const fields = m[1].trim().split(" ").map(Number);
    return new Map(fields.flatMap((v, i) => (i % 2 ? [] : [[v, fields[i + 1]]])));
  });
  return { ids, top };
}

/** Whether `ids` equal the native `{ ids, top }` until a near tie of at most `nats`. */
export function agreeUpToNearTie(ids, native, nats) {
  const at = ids.findIndex((id, i) => id !== native.ids[i]);
  if (at < 0 && ids.length === native.ids.length) {
    return { ok: true, detail: "identical" };
  }
  const chosen = native.top[at]?.get(native.ids[at]);
  const other = native.top[at]?.get(ids[at]);
  const gap = chosen - other;
  return {
    ok: at >= 0 && gap <= nats,
    detail: `first difference at ${at}: native logprob ${chosen} for ${native.ids[at]}, ${other} for ${ids[at]} ` +
      `(gap ${gap?.toFixed?.(3)} nats, at most ${nats} allowed)`,
  };
}
