#!/usr/bin/env python3
"""KV eviction's retrieval figure: a five-digit pass key hidden at DEPTHS
evenly spaced depths of a filler prompt of about TOKENS tokens (the
passkey test of Landmark Attention and LongLoRA), answered greedily by
`tandem run` with the full cache and, for each policy, with a KV budget of
BUDGET percent of the prompt's tokens. Prints one markdown table row per
configuration: the pass rate and, per depth, whether the answer held the
key.

  scripts/kv-eviction-passkey.py [-m MODEL] [--tokens N] [--depths N]
                                 [--budget PCT] [--policies h2o,snapkv,streaming]
                                 [-t THREADS]

MODEL is a name of scripts/models.tsv (default qwen2.5-0.5b) or a path.
"""

import argparse
import os
import random
import re
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

INTRO = (
    "There is an important piece of information hidden inside a lot of "
    "irrelevant text. Find it and memorize it. I will quiz you about it.\n"
)
FILLER = (
    "The grass is green. The sky is blue. The sun is yellow. "
    "Here we go. There and back again. "
)
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key. "
QUESTION = "\nWhat is the pass key? The pass key is"
# Characters per token of the filler, for sizing the prompt before it is
# tokenized (the measured prompt length is what the budget is taken of).
CHARS_PER_TOKEN = 4.0


def prompt(tokens: int, depth: float, key: int) -> str:
    repeats = max(1, int(tokens * CHARS_PER_TOKEN / len(FILLER)))
    before = round(repeats * depth)
    return (
        INTRO
        + FILLER * before
        + NEEDLE.format(key=key)
        + FILLER * (repeats - before)
        + QUESTION
    )


def run(tandem, model, threads, ctx, text, extra):
    """The completion and the prompt's token count."""
    out = subprocess.run(
        [tandem, "run", "--backend", "cpu", "-t", str(threads), "-m", model,
         "--ctx", str(ctx), "-n", "8", "--temperature", "0", *extra, text],
        capture_output=True, text=True, check=True,
    )
    found = re.search(r"prefill: (\d+) tokens", out.stderr)
    if not found:
        sys.exit(f"no prefill figure in tandem's output:\n{out.stderr[-2000:]}")
    return out.stdout, int(found.group(1))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", default="qwen2.5-0.5b")
    ap.add_argument("--tokens", type=int, default=6000)
    ap.add_argument("--depths", type=int, default=10)
    ap.add_argument("--budget", type=float, default=25.0)
    ap.add_argument("--policies", default="h2o,snapkv,streaming")
    ap.add_argument("-t", "--threads", type=int, default=2)
    args = ap.parse_args()

    subprocess.run(["cargo", "build", "--release", "-q", "-p", "tandem"], cwd=ROOT, check=True)
    target = os.environ.get("CARGO_TARGET_DIR", os.path.join(ROOT, "target"))
    tandem = os.path.join(target, "release", "tandem")
    model = args.model
    if not os.path.exists(model):
        model = subprocess.run(
            [os.path.join(HERE, "fetch-model.sh"), model],
            capture_output=True, text=True, check=True,
        ).stdout.strip()

    rng = random.Random(20261204)
    cases = []
    for i in range(args.depths):
        depth = i / max(1, args.depths - 1)
        cases.append((depth, rng.randrange(10000, 100000)))
    # Room for the prompt and the answer, in whole blocks.
    ctx = int(args.tokens * 1.25) // 256 * 256 + 256

    prompt_tokens = {}
    configs = [("full cache", [])] + [
        (p, ["--kv-evict", p]) for p in args.policies.split(",") if p
    ]
    print(f"model {args.model}, prompts of about {args.tokens} tokens, "
          f"key at {args.depths} depths, budget {args.budget:g}% of each prompt")
    print()
    header = " | ".join(f"{d:.0%}" for d, _ in cases)
    print(f"| cache | passed | {header} | seconds |")
    print("|---|---|" + "---|" * len(cases) + "---|")
    for name, extra in configs:
        start = time.time()
        marks = []
        for depth, key in cases:
            text = prompt(args.tokens, depth, key)
            flags = list(extra)
            if extra:
                # The full cache's run, first, measured the prompt.
                budget = max(1, round(prompt_tokens[key] * args.budget / 100))
                flags += ["--kv-budget", str(budget)]
            answer, n = run(tandem, model, args.threads, ctx, text, flags)
            if not extra:
                prompt_tokens[key] = n
            marks.append(str(key) in answer)
        passed = sum(marks)
        cells = " | ".join("yes" if m else "no" for m in marks)
        print(f"| {name} | {passed}/{len(marks)} | {cells} | {time.time() - start:.0f} |",
              flush=True)


if __name__ == "__main__":
    main()
