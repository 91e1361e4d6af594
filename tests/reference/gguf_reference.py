#!/usr/bin/env python3
"""Independent NumPy reference for GGUF checkpoints of the llama, qwen2 and gemma3 families.

It shares no code or logic with Tandem's Rust implementation. GGUF parsing and
dequantization (F32/F16/Q8_0/Q4_1/Q5_0/Q4_K/Q6_K/... including the k-quants)
come from the `gguf` package (`GGUFReader`, `gguf.quants.dequantize`),
tokenization from `gguf_tokenizers.py` (HuggingFace `tokenizers` plus
pure-Python ports of llama.cpp's tokenizers), and the forward pass is plain
NumPy written from the architecture definitions below. The architecture is
read from `general.architecture` and described as data (`ARCHITECTURES`).

Numerics: dequantized weights are exact float32 values; activations and all
matmul accumulations are float64 by default (`--dtype float32` runs the
whole forward pass in float32, for tolerance studies).

Architecture facts and their sources (llama.cpp = github.com/ggml-org/llama.cpp,
HF = huggingface/transformers):

* RoPE pairing. llama.cpp `llama_model_rope_type()` (src/llama-model.cpp):
  LLM_ARCH_LLAMA is LLAMA_ROPE_TYPE_NORM ("pairs of consecutive head
  values", because convert_hf_to_gguf.py permutes Llama's Q/K rows), while
  LLM_ARCH_QWEN2 and the Gemma family are LLAMA_ROPE_TYPE_NEOX ("the pairs of
  head values are offset by n_rot/2", i.e. HF's rotate_half). Angle
  pos * base^(-2i/rope_dim) for pair i in both.
* llama (SmolLM2): src/models/llama.cpp; RMSNorm -> Q/K/V (no bias) -> RoPE ->
  causal GQA attention, scale 1/sqrt(head_dim) -> O, residual; RMSNorm ->
  down(silu(gate) * up), residual; output_norm; output.weight or tied
  token_embd.
* qwen2: src/models/qwen2.cpp; as llama but Q, K and V add bq/bk/bv
  (attn_{q,k,v}.bias) after the projection, NeoX RoPE, scale
  1/sqrt(n_embd_head), output.weight when the file has it (the
  Qwen2.5-Coder-0.5B GGUF does), otherwise tied.
* gemma3: src/models/gemma3.cpp (llm_build_gemma3<iswa=true>) and the
  LLM_ARCH_GEMMA3 case of llama_model::load_hparams:
  - inpL = token_embd[ids] * sqrt(n_embd)  (HF Gemma3TextScaledWordEmbedding,
    embed_scale = hidden_size**0.5);
  - per layer: attn_norm -> Q/K/V (no bias) -> reshape per head ->
    RMSNorm over head_dim with attn_q_norm / attn_k_norm -> NeoX RoPE ->
    Q *= f_attention_scale -> attention with kq_scale 1.0 -> attn_output ->
    post_attention_norm -> + residual; ffn_norm -> down(gelu(gate) * up)
    (LLM_FFN_GELU, LLM_FFN_PAR; ggml_gelu is the tanh approximation, HF
    hidden_activation "gelu_pytorch_tanh") -> post_ffw_norm -> + residual;
    output_norm; tied output (no output.weight in the file);
  - f_attention_scale = 1/sqrt(n_embd_head_k) = 1/sqrt(gemma3.attention.key_length)
    (1/sqrt(n_embd/n_head) only for the 27B, which has 62 layers; HF
    scaling = query_pre_attn_scalar**-0.5 with query_pre_attn_scalar = 256
    for gemma-3-270m);
  - hparams.swa_type = LLAMA_SWA_TYPE_STANDARD, set_swa_pattern(6):
    layer il is local (sliding window) unless il % 6 == 5
    (src/llama-hparams.cpp: swa_layers[il] = il % n_pattern < n_pattern - 1);
    a local query at position p sees keys k with p - k < n_swa
    (is_masked_swa: masked when p1 - p0 >= n_swa), n_swa =
    gemma3.attention.sliding_window;
  - rope base: rope_freq_base_train_swa = 10000 on local layers,
    gemma3.rope.freq_base on global layers (get_rope_freq_base);
  - the iswa graph has no final logit soft-capping;
  - GGUF norm weights already hold Gemma's (1 + w): convert_hf_to_gguf.py's
    Gemma3Model adds 1 to every "*norm.weight" (norm_shift = 1.0, "Gemma3RMSNorm
    adds 1.0 to the norm value"; HF Gemma3RMSNorm computes x * (1 + w)), so
    here every RMSNorm is x / rms(x) * w as in llama.
* head_dim = {arch}.attention.key_length when present (gemma3: 256, not
  n_embd / n_head = 160), else n_embd / n_head.

Usage:
    python3 tests/reference/gguf_reference.py --model PATH [--out PATH]

Without --out the fixture goes to tests/fixtures/<name>_reference.json, where
<name> is the model's row in scripts/models.tsv (smollm2 for SmolLM2, to keep
the historical file name). See tests/reference/README.md.
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
from dataclasses import dataclass

import numpy as np
import gguf
from gguf import GGUFReader
from gguf.quants import dequantize
import tokenizers

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gguf_tokenizers  # noqa: E402

REPO_ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
FIXTURES = os.path.join(REPO_ROOT, "tests", "fixtures")
CACHE = os.path.expanduser("~/.cache/tandem")
DEFAULT_MODEL = os.path.join(CACHE, "SmolLM2-135M-Instruct.Q4_1.gguf")

# Fixture names of the known checkpoints (scripts/models.tsv names, SmolLM2's historical one).
FIXTURE_NAMES = {
    "SmolLM2-135M-Instruct.Q4_1.gguf": "smollm2",
    "Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf": "qwen2.5-0.5b",
    "Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf": "qwen2.5-1.5b",
    "gemma-3-270m.Q4_K_M.gguf": "gemma-3-270m",
}

N_GENERATE = 32
TOP_K = 10
# Stored float64 weights up to this many bytes; larger models keep float32
# weights and widen them per matmul (same values, less memory).
MAX_F64_WEIGHT_BYTES = 5 << 30


@dataclass(frozen=True)
class Arch:
    """What varies between the supported architectures."""
    rope_pairs: str          # "adjacent" (llama.cpp NORM) or "halves" (NEOX)
    qkv_bias: bool           # attn_{q,k,v}.bias added after the projections
    qk_norm: bool            # per-head RMSNorm of q and k (attn_{q,k}_norm) before RoPE
    post_norms: bool         # post_attention_norm / post_ffw_norm before each residual add
    ffn_act: str             # "silu" or "gelu_tanh": down(act(gate) * up)
    embed_scale: bool        # token embeddings multiplied by sqrt(n_embd)
    swa_pattern: int         # 0: all layers global; n: layer il is local unless il % n == n - 1
    local_rope_base: float   # RoPE base of local (sliding-window) layers
    # The chat prompt in the model's own template, around one user message.
    chat_prefix: str
    chat_suffix: str
    # One turn with its special tokens, for the tokenizer cases.
    special_case: str


ARCHITECTURES = {
    "llama": Arch("adjacent", False, False, False, "silu", False, 0, 0.0,
                  "<|im_start|>user\n", "<|im_end|>\n<|im_start|>assistant\n",
                  "<|im_start|>system\nYou are helpful.<|im_end|>\n"),
    # Qwen's GGUF template adds this system message when the chat has none.
    "qwen2": Arch("halves", True, False, False, "silu", False, 0, 0.0,
                  "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
                  "assistant.<|im_end|>\n<|im_start|>user\n",
                  "<|im_end|>\n<|im_start|>assistant\n",
                  "<|im_start|>system\nYou are helpful.<|im_end|>\n"),
    "gemma3": Arch("halves", False, True, True, "gelu_tanh", True, 6, 10000.0,
                   "<start_of_turn>user\n", "<end_of_turn>\n<start_of_turn>model\n",
                   "<start_of_turn>user\nYou are helpful.<end_of_turn>\n"),
}

USER_MESSAGE = "What is 2+2?"
PLAIN_PROMPT = "The capital of France is"
CODE_PROMPT = "def fibonacci(n):\n"


def prompts_for(arch):
    return [PLAIN_PROMPT, CODE_PROMPT, arch.chat_prefix + USER_MESSAGE + arch.chat_suffix]


def tokenizer_cases_for(arch):
    """Extra strings whose ids are recorded: digits, whitespace runs, unicode, specials, contractions."""
    return [
        "Hello, world!",
        "12345 + 678 = 13023",
        "  leading spaces and\ttabs\n\n\nnewlines  ",
        "naïve café — 東京 🚀",
        arch.special_case,
        "I'm sure they'll say it's 3.14159",
    ]


# --------------------------------------------------------------------------
# GGUF access
# --------------------------------------------------------------------------

def field(reader, key, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def sha256_file(path):
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


class Config:
    def __init__(self, reader):
        self.arch_name = field(reader, "general.architecture")
        if self.arch_name not in ARCHITECTURES:
            raise SystemExit(f"unsupported general.architecture {self.arch_name!r}")
        g = lambda k, d=None: field(reader, f"{self.arch_name}.{k}", d)
        self.n_layer = int(g("block_count"))
        self.dim = int(g("embedding_length"))
        self.ffn = int(g("feed_forward_length"))
        self.n_head = int(g("attention.head_count"))
        self.n_kv_head = int(g("attention.head_count_kv"))
        self.head_dim = int(g("attention.key_length", self.dim // self.n_head))
        assert int(g("attention.value_length", self.head_dim)) == self.head_dim
        self.rope_dim = int(g("rope.dimension_count", self.head_dim))
        self.rope_base = float(g("rope.freq_base"))
        self.eps = float(g("attention.layer_norm_rms_epsilon"))
        self.ctx = int(g("context_length"))
        self.sliding_window = g("attention.sliding_window")
        self.vocab = len(field(reader, "tokenizer.ggml.tokens"))
        assert self.rope_dim == self.head_dim, "partial RoPE not implemented"
        assert g("rope.scaling.type") in (None, "none"), "RoPE scaling not implemented"

    def as_dict(self):
        d = dict(
            architecture=self.arch_name, n_layer=self.n_layer, dim=self.dim, ffn=self.ffn,
            n_head=self.n_head, n_kv_head=self.n_kv_head, head_dim=self.head_dim,
            rope_base=self.rope_base, rms_eps=self.eps, vocab=self.vocab, context_length=self.ctx,
        )
        if self.sliding_window is not None:
            d["sliding_window"] = int(self.sliding_window)
        return d


# --------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------

class Model:
    def __init__(self, path, dtype=np.float64):
        self.path = path
        self.dtype = dtype
        reader = GGUFReader(path)
        self.reader = reader
        self.cfg = c = Config(reader)
        self.arch = ARCHITECTURES[c.arch_name]
        n_params = sum(int(np.prod([int(x) for x in t.shape])) for t in reader.tensors)
        store = dtype if n_params * np.dtype(dtype).itemsize <= MAX_F64_WEIGHT_BYTES else np.float32
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
            a = a.reshape(expect)
            # The embedding table is only gathered from; it stays float32.
            self.w[t.name] = a if t.name == "token_embd.weight" else a.astype(store)
        self.output_name = "output.weight" if "output.weight" in self.w else "token_embd.weight"
        if self.output_name == "token_embd.weight":
            self.w["token_embd.weight"] = self.w["token_embd.weight"].astype(store)
        assert self.w["token_embd.weight"].shape == (c.vocab, c.dim)
        for L in range(c.n_layer):
            for name in self.layer_tensors(L):
                assert name in self.w, f"missing tensor {name}"
        # RoPE inverse frequencies of pair i: base^(-2i/rope_dim), per layer kind.
        i = np.arange(0, c.rope_dim, 2, dtype=np.float64)
        self.inv_freq_global = c.rope_base ** (-i / c.rope_dim)
        self.inv_freq_local = (self.arch.local_rope_base ** (-i / c.rope_dim)
                               if self.arch.swa_pattern else None)

    def layer_tensors(self, L):
        p = f"blk.{L}."
        names = ["attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm",
                 "ffn_gate", "ffn_up", "ffn_down"]
        if self.arch.qkv_bias:
            names += ["attn_q.bias", "attn_k.bias", "attn_v.bias"]
        if self.arch.qk_norm:
            names += ["attn_q_norm", "attn_k_norm"]
        if self.arch.post_norms:
            names += ["post_attention_norm", "post_ffw_norm"]
        return [p + (n if n.endswith(".bias") else n + ".weight") for n in names]

    def is_local(self, L):
        n = self.arch.swa_pattern
        return n > 0 and L % n < n - 1

    def W(self, name):
        return self.w[name].astype(self.dtype, copy=False)

    def rmsnorm(self, x, weight):
        ms = np.mean(x.astype(np.float64) ** 2, axis=-1, keepdims=True)
        return (x / np.sqrt(ms + self.cfg.eps)).astype(self.dtype) * self.W(weight)

    def linear(self, x, name):
        """x @ W^T (+ bias): every matmul with a weight matrix goes through here."""
        y = x @ self.W(name + ".weight").T
        bias = name + ".bias"
        if self.arch.qkv_bias and bias in self.w:
            y = y + self.W(bias)
        return y

    def rope(self, x, pos, inv_freq):
        """x: (T, H, head_dim), rotated per the architecture's pairing."""
        ang = pos[:, None].astype(np.float64) * inv_freq[None, :]  # (T, hd/2)
        cos = np.cos(ang)[:, None, :].astype(self.dtype)
        sin = np.sin(ang)[:, None, :].astype(self.dtype)
        out = np.empty_like(x)
        if self.arch.rope_pairs == "adjacent":
            x0, x1 = x[..., 0::2], x[..., 1::2]
            out[..., 0::2] = x0 * cos - x1 * sin
            out[..., 1::2] = x0 * sin + x1 * cos
        else:
            half = x.shape[-1] // 2
            x0, x1 = x[..., :half], x[..., half:]
            out[..., :half] = x0 * cos - x1 * sin
            out[..., half:] = x0 * sin + x1 * cos
        return out

    def ffn_activation(self, gate):
        if self.arch.ffn_act == "silu":
            return gate / (1.0 + np.exp(-gate))
        c = np.sqrt(2.0 / np.pi)
        return 0.5 * gate * (1.0 + np.tanh(c * (gate + 0.044715 * gate ** 3)))

    def new_cache(self):
        return [None] * self.cfg.n_layer

    def attention(self, L, h, pos, cache, start_pos):
        c, a = self.cfg, self.arch
        T = h.shape[0]
        hd, H, KV = c.head_dim, c.n_head, c.n_kv_head
        group = H // KV
        p = f"blk.{L}."
        q = self.linear(h, p + "attn_q").reshape(T, H, hd)
        k = self.linear(h, p + "attn_k").reshape(T, KV, hd)
        v = self.linear(h, p + "attn_v").reshape(T, KV, hd)
        if a.qk_norm:
            q = self.rmsnorm(q, p + "attn_q_norm.weight")
            k = self.rmsnorm(k, p + "attn_k_norm.weight")
        local = self.is_local(L)
        inv_freq = self.inv_freq_local if local else self.inv_freq_global
        q = self.rope(q, pos, inv_freq)
        k = self.rope(k, pos, inv_freq)
        k = k.transpose(1, 0, 2)  # (KV, T, hd)
        v = v.transpose(1, 0, 2)
        if cache is not None:
            if cache[L] is not None:
                k = np.concatenate([cache[L][0], k], axis=1)
                v = np.concatenate([cache[L][1], v], axis=1)
            cache[L] = (k, v)
        S = k.shape[1]
        assert S == start_pos + T
        key_pos = np.arange(S)[None, :]
        mask = key_pos > pos[:, None]  # causal
        if local:
            mask |= pos[:, None] - key_pos >= int(c.sliding_window)
        qh = q.transpose(1, 0, 2).reshape(KV, group, T, hd)  # head h -> kv head h // group
        scores = np.einsum("kgtd,ksd->kgts", qh, k) * (1.0 / np.sqrt(hd))
        scores = np.where(mask[None, None], -np.inf, scores)
        scores = scores - scores.max(axis=-1, keepdims=True)
        pr = np.exp(scores)
        pr = pr / pr.sum(axis=-1, keepdims=True)
        att = np.einsum("kgts,ksd->kgtd", pr, v)  # (KV, group, T, hd)
        att = att.reshape(H, T, hd).transpose(1, 0, 2).reshape(T, H * hd)
        return self.linear(att, p + "attn_output")

    def forward(self, tokens, cache=None, start_pos=0):
        """Logits (T, vocab) for `tokens` placed at positions start_pos.. .

        `cache` (from new_cache) holds per-layer (K, V) of shape (n_kv, T_past, hd),
        K already rotated; it is extended in place.
        """
        c, a = self.cfg, self.arch
        tokens = np.asarray(tokens, dtype=np.int64)
        pos = np.arange(start_pos, start_pos + len(tokens))
        x = self.w["token_embd.weight"][tokens].astype(self.dtype)  # (T, dim)
        if a.embed_scale:
            x = x * self.dtype(np.sqrt(c.dim))
        for L in range(c.n_layer):
            p = f"blk.{L}."
            out = self.attention(L, self.rmsnorm(x, p + "attn_norm.weight"), pos, cache, start_pos)
            if a.post_norms:
                out = self.rmsnorm(out, p + "post_attention_norm.weight")
            x = x + out
            h = self.rmsnorm(x, p + "ffn_norm.weight")
            act = self.ffn_activation(self.linear(h, p + "ffn_gate")) * self.linear(h, p + "ffn_up")
            out = self.linear(act, p + "ffn_down")
            if a.post_norms:
                out = self.rmsnorm(out, p + "post_ffw_norm.weight")
            x = x + out
        x = self.rmsnorm(x, "output_norm.weight")
        return self.linear(x, self.output_name.removesuffix(".weight"))


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
    from importlib.metadata import version
    return {
        "python": platform.python_version(),
        "numpy": np.__version__,
        "gguf": version("gguf"),
        "tokenizers": tokenizers.__version__,
    }


def fixture_name(model_path):
    base = os.path.basename(model_path)
    return FIXTURE_NAMES.get(base, os.path.splitext(base)[0])


# --------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------

def run_prompt(model, tk, text, n_gen):
    ids = tk.encode(text, add_special=True, parse_special=True)
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
        prompt_tokens=[tk.token(i) for i in ids],
        prompt_top10=prompt_top,
        prompt_logsumexp=prompt_lse,
        generated_ids=gen,
        generated_text=tk.decode(gen),
        generated_top10=gen_top,
        generated_logsumexp=gen_lse,
        first_stop_index=next((k for k, t in enumerate(gen) if t in tk.stop_ids), None),
    )


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--out", help="default: tests/fixtures/<name>_reference.json")
    ap.add_argument("--dtype", choices=["float64", "float32"], default="float64")
    ap.add_argument("--n-generate", type=int, default=N_GENERATE)
    args = ap.parse_args()
    out = args.out or os.path.join(FIXTURES, f"{fixture_name(args.model)}_reference.json")

    t0 = time.time()
    model = Model(args.model, dtype=np.float64 if args.dtype == "float64" else np.float32)
    tk = gguf_tokenizers.for_gguf(model.reader)
    prompts = prompts_for(model.arch)
    cases = tokenizer_cases_for(model.arch)
    tk.cross_check(prompts + cases)
    print(f"loaded + dequantized in {time.time() - t0:.1f}s", file=sys.stderr)

    results = []
    for text in prompts:
        t1 = time.time()
        r = run_prompt(model, tk, text, args.n_generate)
        print(f"{text!r} -> {r['prompt_ids']}\n   greedy: {r['generated_text']!r} "
              f"({time.time() - t1:.1f}s)", file=sys.stderr)
        results.append(r)

    fixture = {
        "description": "Independent NumPy reference (tests/reference/gguf_reference.py) for "
                       f"{os.path.basename(args.model)}. prompt_top10[i] = top-10 "
                       "[token_id, logit] of the logits at prompt position i (predicting token i+1); "
                       "generated_ids[0] = argmax of prompt_top10[-1]'s logits; generated_top10[k] = "
                       "top-10 of the logits at the position of generated token k (so generated_ids[k+1] "
                       "is its argmax); *_logsumexp = log-sum-exp over the full vocab at the same "
                       "positions. Greedy = argmax, lowest id on ties; generation does not stop at "
                       "end-of-turn tokens (first_stop_index gives the first of stop_ids). "
                       "Logits rounded to 5 decimals.",
        "model_file": os.path.basename(args.model),
        "model_sha256": sha256_file(args.model),
        "config": model.cfg.as_dict(),
        "tensor_types": sorted(set(model.tensor_types.values())),
        "conventions": {
            "bos_added": tk.add_bos,
            "stop_ids": sorted(tk.stop_ids),
            "rope_pairs": ("adjacent (x[2i], x[2i+1])" if model.arch.rope_pairs == "adjacent"
                           else "halves (x[i], x[i+head_dim/2])")
                          + ", theta = pos * base^(-2i/head_dim)",
            "gqa": "query head h uses kv head h // (n_head / n_kv_head)",
            "output_head": ("tied: logits = output_norm(h) @ token_embd^T"
                            if model.output_name == "token_embd.weight"
                            else "untied: logits = output_norm(h) @ output^T"),
            "compute_dtype": args.dtype,
            "tokenizer": tk.description,
        },
        "versions": versions(),
        "prompts": results,
        "tokenizer_cases": [{"text": s, "ids": tk.encode(s, add_special=False, parse_special=True)}
                            for s in cases],
    }
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w", encoding="utf-8") as fh:
        fh.write(dumps_compact(fixture) + "\n")
    print(f"wrote {out} ({os.path.getsize(out)} bytes) in {time.time() - t0:.1f}s", file=sys.stderr)


if __name__ == "__main__":
    main()
