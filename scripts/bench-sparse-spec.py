#!/usr/bin/env python3
"""Sparse self-speculation's speed figure: `tandem run` continues the first
N tokens of an English text greedily, plainly and with `--speculate
sparse:BLOCKS`, for each context N, in one script. Checks that the outputs
are identical and prints one markdown table row per run: decode tokens/s
and the ratio to plain decoding, acceptance, mean draft length, accepted
tokens per verification step, milliseconds per draft token (a decode step
attending to the selected blocks) and per verification step, against
plain decoding's milliseconds per token (attending to every block).

  scripts/bench-sparse-spec.py [-m MODEL] [--contexts 1024,4096]
                               [--blocks 16,64] [-k K|auto] [-n TOKENS]
                               [--kv-dtype f16] [-t THREADS] [--text FILE]

MODEL is a name of scripts/models.tsv (default smollm2-135m) or a path.
"""

import argparse
import os
import re
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
# Characters per token of English prose, for sizing the prompt before it is
# tokenized (the table gives the measured prompt length).
CHARS_PER_TOKEN = 3.6


def run(tandem, args, text, extra):
    """Generated ids, prompt tokens, decode tokens/s and the speculation line."""
    out = subprocess.run(
        [tandem, "run", "--backend", "cpu", "-t", str(args.threads), "-m", args.model,
         "--ctx", str(args.ctx), "--kv-dtype", args.kv_dtype, "-n", str(args.tokens),
         "--temperature", "0", "--token-ids", *extra, text],
        capture_output=True, text=True, check=True,
    )
    prefill = re.search(r"prefill: (\d+) tokens", out.stderr)
    decode = re.search(r"decode: \d+ tokens in [\d.]+ s \(([\d.]+) tokens/s\)", out.stderr)
    ids = re.search(r"token ids: ([\d ]*)", out.stderr)
    if not (prefill and decode and ids):
        sys.exit(f"unexpected output of tandem run:\n{out.stderr[-2000:]}")
    spec = re.search(r"speculation: acceptance.*", out.stderr)
    return ids.group(1).split(), int(prefill.group(1)), float(decode.group(1)), spec


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", default="smollm2-135m")
    ap.add_argument("--contexts", default="1024,2048,4096,7000")
    ap.add_argument("--blocks", default="16,64")
    ap.add_argument("-k", "--draft-k", default="4")
    ap.add_argument("-n", "--tokens", type=int, default=128)
    ap.add_argument("--kv-dtype", default="f16")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--text", default=os.path.join(ROOT, "..", "shared", "eval", "opticks-part1.txt"))
    args = ap.parse_args()

    subprocess.run(["cargo", "build", "--release", "-q", "-p", "tandem"], cwd=ROOT, check=True)
    target = os.environ.get("CARGO_TARGET_DIR", os.path.join(ROOT, "target"))
    tandem = os.path.join(target, "release", "tandem")
    with open(args.text, encoding="utf-8") as f:
        source = f.read()
    contexts = [int(c) for c in args.contexts.split(",")]
    args.ctx = max(contexts) + args.tokens + 64

    print(f"model {args.model}, {args.kv_dtype} KV, {args.threads} threads, "
          f"{args.tokens} tokens, draft k {args.draft_k}")
    print("| prompt tokens | decoding | tokens/s | vs plain | acceptance | mean k "
          "| tokens per verification | ms per draft token | ms per verification |")
    print("|---|---|---|---|---|---|---|---|---|")
    for n in contexts:
        chars = int(n * CHARS_PER_TOKEN)
        text = source[:chars]
        if len(text) < chars:
            sys.exit(f"{args.text} is too short for {n} tokens")
        plain_ids, prompt_len, plain, _ = run(tandem, args, text, [])
        print(f"| {prompt_len} | plain | {plain:.1f} | 1.00x | | | | {1e3 / plain:.1f} (a decode step) | |",
              flush=True)
        for blocks in args.blocks.split(","):
            extra = ["--speculate", f"sparse:{blocks}", "--draft-k", args.draft_k]
            ids, _, rate, spec = run(tandem, args, text, extra)
            if ids != plain_ids:
                sys.exit(f"sparse:{blocks} at {n} tokens: the output differs from plain decoding")
            if not spec:
                sys.exit("no speculation line in tandem's output")
            line = spec.group(0)
            acc, k, length, _, draft_ms, verify_ms = re.findall(r"[\d.]+", line)[:6]
            print(f"| {prompt_len} | sparse:{blocks} | {rate:.1f} | {rate / plain:.2f}x | {acc}% "
                  f"| {k} | {length} | {draft_ms} | {verify_ms} |", flush=True)


if __name__ == "__main__":
    main()
