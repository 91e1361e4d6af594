#!/usr/bin/env python3
"""Independent NumPy reference of the Mixture-of-Experts forward pass.

Usage: moe_reference.py MODEL.gguf TOKEN,TOKEN,...  -> prints the logits of
every position (float64 arithmetic, whitespace-separated, row after row).

Shares no code with Tandem: GGUF parsing and dequantization come from the
`gguf` package, the forward pass and the routing are written here from the
families' reference implementations:

* Routing (HF transformers): MixtralSparseMoeBlock, Qwen2MoeSparseMoeBlock,
  Qwen3MoeSparseMoeBlock, OlmoeSparseMoeBlock: router logits -> softmax over
  all experts -> top-k -> divided by their sum when the family renormalises
  (Mixtral always; Qwen/OLMoE when norm_topk_prob). GraniteMoeTopKGating:
  top-k of the logits, softmax over those k (the same as renormalising).
  llama.cpp build_moe_ffn(norm_w): llama (Mixtral) true, qwen2moe false,
  qwen3moe true, olmoe false, granitemoe true; `{arch}.expert_weights_norm`
  overrides when present.
* Qwen2-MoE's shared expert: sigmoid(x . ffn_gate_inp_shexp) * FFN_shexp(x),
  added to the routed sum (Qwen2MoeSparseMoeBlock.shared_expert_gate).
* OLMoE: q_norm/k_norm are RMSNorms over the whole projection before heads
  split (OlmoeAttention). Qwen3-MoE: per-head q/k norms (Qwen3MoeAttention).
* Granite: embeddings * embedding_scale, each branch * residual_scale
  before its residual add, attention scale `attention.scale`, logits /
  logit_scale (GraniteMoeModel, llama.cpp llm_build_granite).
* RoPE: llama.cpp's converter permutes llama and granite Q/K rows, so those
  rotate adjacent pairs; the other families rotate halves (NeoX).
"""
import sys

import numpy as np
import gguf
from gguf import GGUFReader
from gguf.quants import dequantize

ADJACENT_ROPE = {"llama", "granitemoe"}
RENORMALISE = {"llama": True, "qwen2moe": False, "qwen3moe": True, "olmoe": False,
               "granitemoe": True}


def scalar(reader, key, default=None):
    f = reader.get_field(key)
    if f is None:
        return default
    return f.parts[f.data[0]][0].item()


def load_weights(reader):
    w = {}
    for t in reader.tensors:
        if t.tensor_type == gguf.GGMLQuantizationType.F32:
            a = np.array(t.data, dtype=np.float32)
        else:
            a = dequantize(t.data, t.tensor_type)
        w[t.name] = a.reshape(tuple(int(x) for x in reversed(t.shape))).astype(np.float64)
    return w


def rmsnorm(x, weight, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def silu(x):
    return x / (1.0 + np.exp(-x))


def rope(x, pos, inv_freq, adjacent):
    ang = pos[:, None] * inv_freq[None, :]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    out = np.empty_like(x)
    if adjacent:
        a, b = x[..., 0::2], x[..., 1::2]
        out[..., 0::2], out[..., 1::2] = a * cos - b * sin, a * sin + b * cos
    else:
        half = x.shape[-1] // 2
        a, b = x[..., :half], x[..., half:]
        out[..., :half], out[..., half:] = a * cos - b * sin, a * sin + b * cos
    return out


def route(logits, k, renormalise):
    """Per row: (expert ids, weights) of the k most probable experts."""
    p = np.exp(logits - logits.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    chosen = np.argsort(-p, axis=-1, kind="stable")[:, :k]
    weights = np.take_along_axis(p, chosen, axis=-1)
    if renormalise:
        weights = weights / weights.sum(axis=-1, keepdims=True)
    return chosen, weights


def expert_ffn(x, gate, up, down):
    return (silu(x @ gate.T) * (x @ up.T)) @ down.T


def moe(w, p, x, k, renormalise):
    ids, weights = route(x @ w[p + "ffn_gate_inp.weight"].T, k, renormalise)
    gate, up, down = (w[p + f"ffn_{m}_exps.weight"] for m in ("gate", "up", "down"))
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        for e, wt in zip(ids[t], weights[t]):
            out[t] += wt * expert_ffn(x[t:t + 1], gate[e], up[e], down[e])[0]
    if p + "ffn_gate_inp_shexp.weight" in w:
        g = 1.0 / (1.0 + np.exp(-(x @ w[p + "ffn_gate_inp_shexp.weight"])))
        shared = expert_ffn(x, *(w[p + f"ffn_{m}_shexp.weight"] for m in ("gate", "up", "down")))
        out += g[:, None] * shared
    return out


def forward(path, tokens):
    r = GGUFReader(path)
    arch = bytes(r.get_field("general.architecture").parts[-1]).decode()
    key = lambda k, d=None: scalar(r, f"{arch}.{k}", d)
    w = load_weights(r)
    n_layer, n_head = key("block_count"), key("attention.head_count")
    n_kv = key("attention.head_count_kv", n_head)
    hd = key("attention.key_length", key("embedding_length") // n_head)
    eps, k = key("attention.layer_norm_rms_epsilon"), key("expert_used_count")
    renormalise = bool(key("expert_weights_norm", RENORMALISE[arch]))
    scale = key("attention.scale", 1.0 / np.sqrt(hd))
    residual = key("residual_scale", 1.0)
    rope_dim = key("rope.dimension_count", hd)
    inv_freq = key("rope.freq_base", 10000.0) ** (-np.arange(0, rope_dim, 2) / rope_dim)
    T = len(tokens)
    pos = np.arange(T, dtype=np.float64)
    h = w["token_embd.weight"][tokens] * key("embedding_scale", 1.0)
    mask = np.triu(np.full((T, T), -np.inf), 1)
    for L in range(n_layer):
        p = f"blk.{L}."
        x = rmsnorm(h, w[p + "attn_norm.weight"], eps)
        q, kk, v = (x @ w[p + f"attn_{n}.weight"].T + w.get(p + f"attn_{n}.bias", 0.0)
                    for n in ("q", "k", "v"))
        whole_norm = arch == "olmoe"
        if whole_norm:
            q = rmsnorm(q, w[p + "attn_q_norm.weight"], eps)
            kk = rmsnorm(kk, w[p + "attn_k_norm.weight"], eps)
        q, kk, v = q.reshape(T, n_head, hd), kk.reshape(T, n_kv, hd), v.reshape(T, n_kv, hd)
        if not whole_norm and p + "attn_q_norm.weight" in w:
            q = rmsnorm(q, w[p + "attn_q_norm.weight"], eps)
            kk = rmsnorm(kk, w[p + "attn_k_norm.weight"], eps)
        q = rope(q, pos, inv_freq, arch in ADJACENT_ROPE)
        kk = rope(kk, pos, inv_freq, arch in ADJACENT_ROPE)
        group = n_head // n_kv
        att = np.empty((T, n_head, hd))
        for head in range(n_head):
            s = q[:, head] @ kk[:, head // group].T * scale + mask
            s = np.exp(s - s.max(axis=-1, keepdims=True))
            att[:, head] = (s / s.sum(axis=-1, keepdims=True)) @ v[:, head // group]
        h = h + residual * (att.reshape(T, -1) @ w[p + "attn_output.weight"].T)
        x = rmsnorm(h, w[p + "ffn_norm.weight"], eps)
        h = h + residual * moe(w, p, x, k, renormalise)
    x = rmsnorm(h, w["output_norm.weight"], eps)
    out = w.get("output.weight", w["token_embd.weight"])
    return x @ out.T / key("logit_scale", 1.0)


def main():
    path, tokens = sys.argv[1], [int(t) for t in sys.argv[2].split(",")]
    logits = forward(path, tokens)
    print("\n".join(" ".join(f"{v:.7g}" for v in row) for row in logits))


if __name__ == "__main__":
    main()
