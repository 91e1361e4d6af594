#!/usr/bin/env python3
"""Independent NumPy reference for SmolLM2-135M-Instruct (GGUF, Q4_1/Q8_0).

Implemented from the Llama architecture definition only; it shares no code or
logic with Tandem's Rust implementation. Dequantization is done by the `gguf`
package's own dequantizers (`gguf.quants.dequantize`), tokenization by the
HuggingFace `tokenizers` package built from the GGUF's vocab/merges with
SmolLM2's pre-tokenizer (Digits(individual_digits=True) then
ByteLevel(add_prefix_space=False)).

Numerics: the dequantized weights are exact float32 values; activations and
all matmul accumulations are done in float64 by default (`--dtype float32`
runs the whole forward pass in float32 instead, for tolerance studies).

RoPE: llama.cpp's converter permutes the Q/K projection rows of Llama models,
so with GGUF weights RoPE rotates ADJACENT pairs (x[2i], x[2i+1]) of each head
by angle pos * base^(-2i/head_dim) ("normal" rope in llama.cpp terms).

Usage:
    python3 tests/reference/smollm2_reference.py [--model PATH] [--out PATH]

Writes tests/fixtures/smollm2_reference.json (see tests/reference/README.md).
"""
import os

# Be polite on shared machines: single-threaded BLAS unless the caller says otherwise.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

import argparse
import hashlib
import json
import platform
import sys
import time

import numpy as np
import gguf
from gguf import GGUFReader
from gguf.quants import dequantize
import tokenizers
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

DEFAULT_MODEL = os.path.expanduser("~/.cache/tandem/SmolLM2-135M-Instruct.Q4_1.gguf")
REPO_ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
DEFAULT_OUT = os.path.join(REPO_ROOT, "tests", "fixtures", "smollm2_reference.json")

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
]
N_GENERATE = 32
TOP_K = 10

# A few extra strings whose token ids are recorded, to check a tokenizer
# (digits split individually, whitespace runs, unicode, special tokens).
TOKENIZER_CASES = [
    "Hello, world!",
    "12345 + 678 = 13023",
    "  leading spaces and\ttabs\n\n\nnewlines  ",
    "naïve café — 東京 🚀",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n",
    "I'm sure they'll say it's 3.14159",
]


# --------------------------------------------------------------------------
# GGUF access
# --------------------------------------------------------------------------

def _field(reader, key):
    f = reader.fields[key]
    return f.contents()


def sha256_file(path):
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


class Config:
    def __init__(self, reader):
        arch = _field(reader, "general.architecture")
        assert arch == "llama", arch
        g = lambda k: _field(reader, f"llama.{k}")
        self.n_layer = int(g("block_count"))
        self.dim = int(g("embedding_length"))
        self.ffn = int(g("feed_forward_length"))
        self.n_head = int(g("attention.head_count"))
        self.n_kv_head = int(g("attention.head_count_kv"))
        self.head_dim = self.dim // self.n_head
        self.rope_dim = int(g("rope.dimension_count"))
        self.rope_base = float(g("rope.freq_base"))
        self.eps = float(g("attention.layer_norm_rms_epsilon"))
        self.vocab = int(g("vocab_size"))
        self.ctx = int(g("context_length"))
        assert self.rope_dim == self.head_dim

    def as_dict(self):
        return dict(
            n_layer=self.n_layer, dim=self.dim, ffn=self.ffn, n_head=self.n_head,
            n_kv_head=self.n_kv_head, head_dim=self.head_dim, rope_base=self.rope_base,
            rms_eps=self.eps, vocab=self.vocab, context_length=self.ctx,
        )


def build_tokenizer(reader):
    """HF `tokenizers` BPE built from the GGUF vocab/merges, SmolLM2 pre-tokenizer."""
    tokens = list(_field(reader, "tokenizer.ggml.tokens"))
    types = list(_field(reader, "tokenizer.ggml.token_type"))
    merges = [tuple(m.split(" ")) for m in _field(reader, "tokenizer.ggml.merges")]
    assert _field(reader, "tokenizer.ggml.model") == "gpt2"
    assert all(len(m) == 2 for m in merges)
    vocab = {t: i for i, t in enumerate(tokens)}
    assert len(vocab) == len(tokens)
    tk = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tk.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tk.decoder = decoders.ByteLevel()
    # Control tokens (type 3) are special added tokens: matched verbatim in text.
    specials = [AddedToken(tokens[i], special=True, normalized=False)
                for i, t in enumerate(types) if int(t) == 3]
    tk.add_special_tokens(specials)
    for a in specials:
        assert tk.token_to_id(a.content) == vocab[a.content]
    return tk


class PurePythonBPE:
    """Minimal byte-level BPE, independent of `tokenizers`, used only as a cross-check.

    Pre-tokenization as llama.cpp's "smollm" pre-tokenizer: every \\p{N} char is its
    own piece, then the GPT-2 regex; control tokens are matched verbatim first.
    """

    PAT = (r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+")

    def __init__(self, reader):
        import regex
        self.re = regex.compile(self.PAT)
        self.digit = regex.compile(r"\p{N}")
        tokens = list(_field(reader, "tokenizer.ggml.tokens"))
        types = list(_field(reader, "tokenizer.ggml.token_type"))
        self.vocab = {t: i for i, t in enumerate(tokens)}
        self.ranks = {tuple(m.split(" ")): r for r, m in enumerate(_field(reader, "tokenizer.ggml.merges"))}
        specials = sorted((tokens[i] for i, t in enumerate(types) if int(t) == 3), key=len, reverse=True)
        self.special_re = regex.compile("(" + "|".join(regex.escape(s) for s in specials) + ")")
        # GPT-2 bytes_to_unicode
        bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1)) \
            + list(range(ord("\xae"), ord("\xff") + 1))
        cs = bs[:]
        n = 0
        for b in range(256):
            if b not in bs:
                bs.append(b)
                cs.append(256 + n)
                n += 1
        self.byte_map = {b: chr(c) for b, c in zip(bs, cs)}
        self.cache = {}

    def _bpe(self, word):
        if word in self.cache:
            return self.cache[word]
        parts = list(word)
        while len(parts) > 1:
            best = None
            for i in range(len(parts) - 1):
                r = self.ranks.get((parts[i], parts[i + 1]))
                if r is not None and (best is None or r < best[0]):
                    best = (r, parts[i], parts[i + 1])
            if best is None:
                break
            _, a, b = best
            out, i = [], 0
            while i < len(parts):
                if i < len(parts) - 1 and parts[i] == a and parts[i + 1] == b:
                    out.append(a + b)
                    i += 2
                else:
                    out.append(parts[i])
                    i += 1
            parts = out
        ids = [self.vocab[p] for p in parts]
        self.cache[word] = ids
        return ids

    def encode(self, text):
        ids = []
        for chunk in self.special_re.split(text):
            if not chunk:
                continue
            if chunk in self.vocab and self.special_re.fullmatch(chunk):
                ids.append(self.vocab[chunk])
                continue
            pieces, last = [], 0
            for m in self.digit.finditer(chunk):
                pieces.append(chunk[last:m.start()])
                pieces.append(m.group())
                last = m.end()
            pieces.append(chunk[last:])
            for piece in pieces:
                for w in self.re.findall(piece):
                    ids.extend(self._bpe("".join(self.byte_map[b] for b in w.encode("utf-8"))))
        return ids


def encode(tk, text):
    # No BOS: tokenizer.ggml.add_bos_token is false; the tokenizer has no post-processor.
    return tk.encode(text, add_special_tokens=False).ids


def decode(tk, ids):
    return tk.decode(list(ids), skip_special_tokens=False)


# --------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------

class Model:
    def __init__(self, path, dtype=np.float64):
        self.path = path
        self.dtype = dtype
        reader = GGUFReader(path)
        self.reader = reader
        self.cfg = Config(reader)
        self.tensor_types = {}
        self.w = {}
        for t in reader.tensors:
            self.tensor_types[t.name] = t.tensor_type.name
            if t.tensor_type == gguf.GGMLQuantizationType.F32:
                a = np.array(t.data, dtype=np.float32)
            else:
                a = dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
            # GGUF shape is [ne0 = in, ne1 = out]; numpy layout is (out, in).
            expect = tuple(int(x) for x in reversed(t.shape))
            a = a.reshape(expect) if a.size == int(np.prod(expect)) else a
            assert a.shape == expect, (t.name, a.shape, expect)
            self.w[t.name] = a
        c = self.cfg
        assert "output.weight" not in self.w  # tied embeddings
        assert self.w["token_embd.weight"].shape == (c.vocab, c.dim)
        # RoPE inverse frequencies for adjacent pairs (x[2i], x[2i+1]).
        i = np.arange(0, c.head_dim, 2, dtype=np.float64)
        self.inv_freq = c.rope_base ** (-i / c.head_dim)  # (head_dim/2,)

    def W(self, name):
        return self.w[name].astype(self.dtype, copy=False)

    def rmsnorm(self, x, weight):
        ms = np.mean(x.astype(np.float64) ** 2, axis=-1, keepdims=True)
        return (x / np.sqrt(ms + self.cfg.eps)).astype(self.dtype) * self.W(weight)

    def rope(self, x, pos):
        """x: (T, H, head_dim); rotate adjacent pairs."""
        ang = pos[:, None].astype(np.float64) * self.inv_freq[None, :]  # (T, hd/2)
        cos = np.cos(ang)[:, None, :].astype(self.dtype)
        sin = np.sin(ang)[:, None, :].astype(self.dtype)
        x0 = x[..., 0::2]
        x1 = x[..., 1::2]
        out = np.empty_like(x)
        out[..., 0::2] = x0 * cos - x1 * sin
        out[..., 1::2] = x0 * sin + x1 * cos
        return out

    def new_cache(self):
        return [None] * self.cfg.n_layer

    def forward(self, tokens, cache=None, start_pos=0):
        """Logits (T, vocab) for `tokens` placed at positions start_pos.. .

        `cache` (from new_cache) holds per-layer (K, V) of shape (n_kv, T_past, hd),
        K already rotated; it is extended in place.
        """
        c = self.cfg
        tokens = np.asarray(tokens, dtype=np.int64)
        T = len(tokens)
        pos = np.arange(start_pos, start_pos + T)
        hd, H, KV = c.head_dim, c.n_head, c.n_kv_head
        group = H // KV
        scale = 1.0 / np.sqrt(hd)
        x = self.w["token_embd.weight"][tokens].astype(self.dtype)  # (T, dim)
        for L in range(c.n_layer):
            p = f"blk.{L}."
            h = self.rmsnorm(x, p + "attn_norm.weight")
            q = (h @ self.W(p + "attn_q.weight").T).reshape(T, H, hd)
            k = (h @ self.W(p + "attn_k.weight").T).reshape(T, KV, hd)
            v = (h @ self.W(p + "attn_v.weight").T).reshape(T, KV, hd)
            q = self.rope(q, pos)
            k = self.rope(k, pos)
            k = k.transpose(1, 0, 2)  # (KV, T, hd)
            v = v.transpose(1, 0, 2)
            if cache is not None:
                if cache[L] is not None:
                    k = np.concatenate([cache[L][0], k], axis=1)
                    v = np.concatenate([cache[L][1], v], axis=1)
                cache[L] = (k, v)
            S = k.shape[1]  # total keys
            assert S == start_pos + T
            # causal mask: query at absolute pos p sees keys 0..p
            mask = np.arange(S)[None, :] > pos[:, None]  # (T, S)
            qh = q.transpose(1, 0, 2).reshape(KV, group, T, hd)  # head h -> kv head h // group
            scores = np.einsum("kgtd,ksd->kgts", qh, k) * scale
            scores = np.where(mask[None, None], -np.inf, scores)
            scores = scores - scores.max(axis=-1, keepdims=True)
            pr = np.exp(scores)
            pr = pr / pr.sum(axis=-1, keepdims=True)
            att = np.einsum("kgts,ksd->kgtd", pr, v)  # (KV, group, T, hd)
            att = att.reshape(H, T, hd).transpose(1, 0, 2).reshape(T, c.dim)
            x = x + att @ self.W(p + "attn_output.weight").T
            h = self.rmsnorm(x, p + "ffn_norm.weight")
            gate = h @ self.W(p + "ffn_gate.weight").T
            up = h @ self.W(p + "ffn_up.weight").T
            act = gate / (1.0 + np.exp(-gate)) * up  # SiLU(gate) * up
            x = x + act @ self.W(p + "ffn_down.weight").T
        x = self.rmsnorm(x, "output_norm.weight")
        return x @ self.W("token_embd.weight").T  # tied output head


# --------------------------------------------------------------------------
# Fixture helpers
# --------------------------------------------------------------------------

def topk(logits_row, k=TOP_K):
    """Top-k (id, logit), logit descending, lowest id first on ties."""
    row = np.asarray(logits_row, dtype=np.float64)
    cand = np.argpartition(-row, k)[: k + 32] if row.size > k + 32 else np.arange(row.size)
    # include every id tied with the k-th value so tie-breaking is exact
    kth = np.sort(row[cand])[::-1][k - 1]
    cand = np.nonzero(row >= kth)[0]
    order = np.lexsort((cand, -row[cand]))[:k]
    return [[int(cand[i]), round(float(row[cand[i]]), 5)] for i in order]


def logsumexp(row):
    row = np.asarray(row, dtype=np.float64)
    m = row.max()
    return float(m + np.log(np.exp(row - m).sum()))


def greedy(row):
    return int(np.argmax(row))  # first (lowest id) maximum on ties


def dumps_compact(obj, indent=1, level=0):
    """JSON with leaf lists (numbers/strings or lists of them) on one line."""
    def is_leafy(v):
        if isinstance(v, list):
            return all(not isinstance(e, (dict, list)) or
                       (isinstance(e, list) and all(not isinstance(z, (dict, list)) for z in e))
                       for e in v)
        return not isinstance(v, dict)
    pad = " " * (indent * (level + 1))
    end = " " * (indent * level)
    if isinstance(obj, dict):
        if not obj:
            return "{}"
        items = [f"{pad}{json.dumps(k)}: {dumps_compact(v, indent, level + 1)}" for k, v in obj.items()]
        return "{\n" + ",\n".join(items) + "\n" + end + "}"
    if isinstance(obj, list) and not is_leafy(obj):
        items = [pad + dumps_compact(v, indent, level + 1) for v in obj]
        return "[\n" + ",\n".join(items) + "\n" + end + "]"
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)


def versions():
    return {
        "python": platform.python_version(),
        "numpy": np.__version__,
        "gguf": getattr(gguf, "__version__", None) or _dist_version("gguf"),
        "tokenizers": tokenizers.__version__,
    }


def _dist_version(name):
    from importlib.metadata import version
    return version(name)


# --------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------

def run_prompt(model, tk, text, n_gen=N_GENERATE):
    ids = encode(tk, text)
    cache = model.new_cache()
    logits = model.forward(ids, cache=cache, start_pos=0)
    prompt_top = [topk(r) for r in logits]
    prompt_lse = [round(logsumexp(r), 5) for r in logits]
    gen, gen_top, gen_lse = [], [], []
    last = logits[-1]
    pos = len(ids)
    for _ in range(n_gen):
        t = greedy(last)
        gen.append(t)
        last = model.forward([t], cache=cache, start_pos=pos)[0]
        pos += 1
        gen_top.append(topk(last))
        gen_lse.append(round(logsumexp(last), 5))
    return dict(
        prompt=text,
        prompt_ids=ids,
        prompt_tokens=[tk.id_to_token(i) for i in ids],
        prompt_top10=prompt_top,
        prompt_logsumexp=prompt_lse,
        generated_ids=gen,
        generated_text=decode(tk, gen),
        generated_top10=gen_top,
        generated_logsumexp=gen_lse,
        first_stop_index=next((k for k, t in enumerate(gen) if t in (0, 2)), None),
    )


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--out", default=DEFAULT_OUT)
    ap.add_argument("--dtype", choices=["float64", "float32"], default="float64")
    ap.add_argument("--n-generate", type=int, default=N_GENERATE)
    args = ap.parse_args()

    t0 = time.time()
    dtype = np.float64 if args.dtype == "float64" else np.float32
    model = Model(args.model, dtype=dtype)
    tk = build_tokenizer(model.reader)
    # Cross-check the `tokenizers` encoding against the independent pure-Python BPE.
    pp = PurePythonBPE(model.reader)
    for s in PROMPTS + TOKENIZER_CASES:
        a, b = encode(tk, s), pp.encode(s)
        assert a == b, (s, a, b)
    t_load = time.time() - t0
    print(f"loaded + dequantized in {t_load:.1f}s", file=sys.stderr)

    results = []
    for text in PROMPTS:
        r = run_prompt(model, tk, text, args.n_generate)
        print(f"{text!r} -> {r['prompt_ids']}\n   greedy: {r['generated_text']!r}", file=sys.stderr)
        results.append(r)

    fixture = {
        "description": "Independent NumPy reference for SmolLM2-135M-Instruct Q4_1 GGUF "
                       "(tests/reference/smollm2_reference.py). prompt_top10[i] = top-10 "
                       "[token_id, logit] of the logits at prompt position i (predicting token i+1); "
                       "generated_ids[0] = argmax of prompt_top10[-1]'s logits; generated_top10[k] = "
                       "top-10 of the logits at the position of generated token k (so generated_ids[k+1] "
                       "is its argmax); *_logsumexp = log-sum-exp over the full vocab at the same "
                       "positions. Greedy = argmax, lowest id on ties; generation does not stop at "
                       "EOS/<|im_end|> (first_stop_index gives the first id 0 or 2). Logits rounded to 5 decimals.",
        "model_file": os.path.basename(args.model),
        "model_sha256": sha256_file(args.model),
        "config": model.cfg.as_dict(),
        "conventions": {
            "bos_added": False,
            "rope_pairs": "adjacent (x[2i], x[2i+1]), theta = pos * base^(-2i/head_dim)",
            "gqa": "query head h uses kv head h // (n_head / n_kv_head)",
            "output_head": "tied: logits = output_norm(h) @ token_embd^T",
            "compute_dtype": args.dtype,
            "tokenizer": "tokenizers BPE from GGUF vocab/merges; pre: Digits(individual_digits=True), "
                         "ByteLevel(add_prefix_space=False); control tokens are special added tokens; "
                         "cross-checked against a pure-Python BPE with llama.cpp's smollm regex",
        },
        "versions": versions(),
        "prompts": results,
        "tokenizer_cases": [{"text": s, "ids": encode(tk, s)} for s in TOKENIZER_CASES],
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as fh:
        fh.write(dumps_compact(fixture) + "\n")
    print(f"wrote {args.out} ({os.path.getsize(args.out)} bytes) in {time.time() - t0:.1f}s",
          file=sys.stderr)


if __name__ == "__main__":
    main()
