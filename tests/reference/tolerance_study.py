#!/usr/bin/env python3
"""How far legitimate implementation choices move a fixture's logits.

Re-runs a fixture's prompts teacher-forced (prompt + the reference's greedy
tokens, one pass) with the forward pass of gguf_reference.py changed the way
a fast runtime may change it, and prints the largest difference from the
fixture's top-10 logits for each variant:

* float32: the whole forward pass in float32 (Tandem's activations);
* q16 / q8: float64, but every activation row quantized before each matmul
  with a quantized weight, in blocks of 32 with a symmetric scale
  amax / (2^(bits-1) - 1) and round-to-nearest: 16 bits as Tandem's CPU
  matmuls do (backend-cpu/src/matmul/quantize.rs), 8 bits as llama.cpp's
  Q8_0/Q8_1 dot products do (its Q8_K for the k-quants has 256-value blocks,
  with the same 8-bit resolution).

Usage:
    python3 tests/reference/tolerance_study.py --model PATH [--fixture PATH] [--variants float32,q16,q8]
"""
import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import argparse
import json
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gguf_reference as ref  # noqa: E402


class ActivationQuantizedModel(ref.Model):
    """The reference with activations rounded to `bits`-bit blocks before quantized matmuls."""

    def __init__(self, path, bits):
        super().__init__(path, dtype=np.float64)
        self.qmax = float(2 ** (bits - 1) - 1)

    def linear(self, x, name):
        if self.tensor_types[name + ".weight"] in ("F32", "F16", "BF16"):
            return super().linear(x, name)
        shape = x.shape
        blocks = x.reshape(-1, shape[-1] // 32, 32)
        scale = np.abs(blocks).max(axis=-1, keepdims=True) / self.qmax
        safe = np.where(scale == 0, 1.0, scale)
        quantized = (np.round(blocks / safe) * scale).reshape(shape)
        return super().linear(quantized, name)


def worst_difference(model, fixture):
    worst = 0.0
    for p in fixture["prompts"]:
        ids = p["prompt_ids"] + p["generated_ids"][:-1]
        logits = model.forward(ids)
        wants = p["prompt_top10"] + p["generated_top10"][:-1]
        for row, want in zip(logits, wants):
            for tid, logit in want:
                worst = max(worst, abs(float(row[tid]) - logit))
    return worst


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--fixture")
    ap.add_argument("--variants", default="float32,q16,q8")
    args = ap.parse_args()
    path = args.fixture or os.path.join(ref.FIXTURES, f"{ref.fixture_name(args.model)}_reference.json")
    with open(path, encoding="utf-8") as fh:
        fixture = json.load(fh)
    for variant in args.variants.split(","):
        if variant == "float32":
            model = ref.Model(args.model, dtype=np.float32)
        else:
            model = ActivationQuantizedModel(args.model, bits=int(variant[1:]))
        print(f"{os.path.basename(args.model)} {variant}: largest top-10 logit difference "
              f"{worst_difference(model, fixture):.5f}", flush=True)
        del model


if __name__ == "__main__":
    main()
