#!/usr/bin/env python3
"""Reference perplexity of a GGUF checkpoint with llama.cpp's method.

Mirrors `llama-perplexity -c 512` (tools/perplexity/perplexity.cpp, `perplexity()`):
  * tokenize the whole text once as common_tokenize(ctx, text, add_special=true)
    does: BOS first only if tokenizer.ggml.add_bos_token is true (Gemma 3: yes;
    SmolLM2, Qwen2: no), special-token strings NOT parsed (parse_special=false);
  * n_chunk = n_tokens // n_ctx non-overlapping windows (incomplete tail dropped);
    llama.cpp refuses to run with fewer than 2*n_ctx tokens;
  * each window is evaluated from scratch (empty KV cache, positions 0..n_ctx-1);
    with add_bos, the window's first token is replaced by BOS for the evaluation
    ("add BOS token for the first batch of each chunk") and restored for scoring;
  * first = n_ctx/2; the logits at positions first..n_ctx-2 are scored against
    tokens first+1..n_ctx-1 (n_ctx - first - 1 = 255 tokens per window);
  * nll_i = max + log(sum(exp(logits - max))) - logits[tok]; sums nll and nll^2;
  * PPL = exp(mean nll); error = PPL * sqrt((mean(nll^2) - mean(nll)^2) / (count - 1)).

The forward pass is the independent NumPy one in gguf_reference.py.

Usage:
    python3 tests/reference/perplexity_reference.py --model PATH [--text PATH] [--out PATH]
        [--max-chunks N]

Without --out the fixture goes to tests/fixtures/<name>_perplexity_reference.json.
"""
import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

import argparse
import hashlib
import json
import math
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gguf_reference as ref  # noqa: E402
import gguf_tokenizers  # noqa: E402

DEFAULT_TEXT = "/work/shared/eval/opticks-part1.txt"


def window_nlls(logits, tokens, first):
    """NLL of tokens[first+1:] given logits[first:-1] (llama.cpp log_softmax)."""
    lg = logits[first:-1].astype(np.float64)
    tgt = np.asarray(tokens[first + 1:], dtype=np.int64)
    mx = lg.max(axis=1)
    lse = mx + np.log(np.exp(lg - mx[:, None]).sum(axis=1))
    return lse - lg[np.arange(len(tgt)), tgt]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=ref.DEFAULT_MODEL)
    ap.add_argument("--text", default=DEFAULT_TEXT)
    ap.add_argument("--out", help="default: tests/fixtures/<name>_perplexity_reference.json")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--dtype", choices=["float64", "float32"], default="float64")
    ap.add_argument("--max-chunks", type=int, default=-1, help="like llama.cpp --chunks (-1 = all)")
    ap.add_argument("--skip-tokenizer-check", action="store_true",
                    help="skip the second tokenizer's cross-check of the tokenization")
    args = ap.parse_args()
    out = args.out or os.path.join(ref.FIXTURES, f"{ref.fixture_name(args.model)}_perplexity_reference.json")

    t0 = time.time()
    model = ref.Model(args.model, dtype=np.float64 if args.dtype == "float64" else np.float32)
    tk = gguf_tokenizers.for_gguf(model.reader)
    add_bos = tk.add_bos

    with open(args.text, "rb") as fh:
        raw = fh.read()
    text = raw.decode("utf-8")
    tokens = tk.encode(text, add_special=True, parse_special=False)
    if not args.skip_tokenizer_check:
        assert tokens == tk.encode_cross(text, add_special=True, parse_special=False), \
            "the two tokenizers disagree on the evaluation text"

    n_ctx = args.ctx
    first = n_ctx // 2
    if len(tokens) < 2 * n_ctx:
        sys.exit(f"need at least {2 * n_ctx} tokens, have {len(tokens)}")
    n_chunk_all = len(tokens) // n_ctx
    n_chunk = n_chunk_all if args.max_chunks < 0 else min(n_chunk_all, args.max_chunks)
    print(f"{len(tokens)} tokens, {n_chunk} windows of {n_ctx}", file=sys.stderr)

    nll_sum = 0.0
    nll2_sum = 0.0
    count = 0
    running_ppl = []
    window_mean_nll = []
    for i in range(n_chunk):
        t1 = time.time()
        win = tokens[i * n_ctx:(i + 1) * n_ctx]
        evaluated = [tk.bos] + win[1:] if add_bos else win
        logits = model.forward(evaluated, cache=None, start_pos=0)
        v = window_nlls(logits, win, first)
        nll_sum += float(v.sum())
        nll2_sum += float((v * v).sum())
        count += len(v)
        running_ppl.append(round(math.exp(nll_sum / count), 6))
        window_mean_nll.append(round(float(v.mean()), 6))
        print(f"[{i + 1}]{running_ppl[-1]:.4f} ({time.time() - t1:.1f}s)", file=sys.stderr)

    mean = nll_sum / count
    ppl = math.exp(mean)
    var = nll2_sum / count - mean * mean
    err = ppl * math.sqrt(var / (count - 1)) if var > 0 else float("nan")
    print(f"Final estimate: PPL = {ppl:.4f} +/- {err:.5f}", file=sys.stderr)

    fixture = {
        "description": "llama.cpp-style perplexity (llama-perplexity -c 512 method) of "
                       f"{os.path.basename(args.model)} computed by tests/reference/perplexity_reference.py"
                       + (f"; only the first {n_chunk} windows (--max-chunks)" if n_chunk < n_chunk_all else ""),
        "model_file": os.path.basename(args.model),
        "model_sha256": ref.sha256_file(args.model),
        "text_file": os.path.basename(args.text),
        "text_sha256": hashlib.sha256(raw).hexdigest(),
        "n_tokens": len(tokens),
        "tokens_sha256": hashlib.sha256(np.asarray(tokens, dtype="<u4").tobytes()).hexdigest(),
        "first_tokens": tokens[:32],
        "bos_added": add_bos,
        "tokenizer_crosschecked": not args.skip_tokenizer_check,
        "ctx": n_ctx,
        "first": first,
        "n_windows": n_chunk,
        "n_windows_in_text": n_chunk_all,
        "n_scored_tokens": count,
        "scored_per_window": n_ctx - first - 1,
        "mean_nll": round(mean, 8),
        "ppl": round(ppl, 6),
        "error": round(err, 6),
        "error_formula": "ppl * sqrt((sum(nll^2)/N - (sum(nll)/N)^2) / (N - 1))",
        "running_ppl": running_ppl,
        "window_mean_nll": window_mean_nll,
        "compute_dtype": args.dtype,
        "versions": ref.versions(),
    }
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w", encoding="utf-8") as fh:
        fh.write(ref.dumps_compact(fixture) + "\n")
    print(f"wrote {out} ({os.path.getsize(out)} bytes) in {time.time() - t0:.1f}s",
          file=sys.stderr)


if __name__ == "__main__":
    main()
