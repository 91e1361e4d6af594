#!/usr/bin/env python3
"""Tensor-parallel figures on paper, for docs/distributed.md.

Plain python3, no dependencies: `python3 scripts/tp-figures.py` prints every
table the document shows from the figures below, so changing an assumption
here and rerunning gives the new tables.

The model of one decode step at batch 1 (one token, one sequence):

  step = weight reads + KV reads + all-reduces

nothing overlapped: every all-reduce sits between two matmuls of the same
layer (after O, after down), so on the critical path. Weight and KV reads go
at the peak HBM bandwidth (an upper bound on tokens/s: real kernels reach
some 70-85% of it); kernel launch gaps are taken as hidden (CUDA graphs).
Each all-reduce costs a latency `alpha` plus the bytes a ring moves per GPU,
2 (n - 1) / n of the buffer, over the slowest link the ring crosses.

The split is Tandem's plan (`core/src/parallel/plan.rs`): each rank holds
1/n of every layer's query heads and FFN features, KV heads split when there
are at least n of them, else each rank holds one (replicated on n / kv
ranks); the embedding and output head are replicated and only rank 0 runs
the head, so rank 0 reads the whole head every token and is the slowest
rank. A head split by vocabulary rows (Megatron's, not built) is shown
beside it.
"""

GB = 1e9
GiB = 1024**3
KiB = 1024


# ---- the model (Llama-3-70B's shape) ----
LLAMA3_70B = dict(
    name="Llama-3-70B",
    layers=80,
    hidden=8192,
    heads=64,
    kv_heads=8,
    head_dim=128,
    ffn=28672,
    vocab=128256,
    weight_bytes=2,  # bf16
)

# ---- the hardware ----
HBM_BYTES_PER_S = 4.8e12  # H200: 4.8 TB/s
NVLINK_BYTES_PER_S = 450e9  # 900 GB/s per GPU is both directions: 450 GB/s each way
NIC_BYTES_PER_S = 50e9  # 400 Gb/s InfiniBand NDR, one NIC per GPU (HGX H200)

# ---- the all-reduce latency, per call, for a message of tens of KiB ----
# In one node: NCCL's small-message all-reduce (LL protocol, CUDA graphs)
# takes a few µs between 2 GPUs (~6 µs with NVLS on 2 H100,
# github.com/NVIDIA/nccl/issues/1259) and grows with the rank count; 15 µs
# for 8 GPUs is the middle of what nccl-tests reports there.
ALPHA_INTRA_S = 15e-6
# Across 2 nodes: ~46 µs for 4 B to 1 KiB over 16 GPUs with NDR NICs
# (github.com/NVIDIA/nccl/issues/1244, nccl-tests, NVLSTree).
ALPHA_INTER_S = 45e-6

# ---- the decode step ----
CONTEXT = 4096  # tokens already in the sequence's KV cache
KV_BYTES = 2  # bf16 K/V elements
ALL_REDUCE_ELEM_BYTES = 4  # Tandem all-reduces f32 activations


def layer_params_per_rank(m, n):
    """Weights one rank holds of one layer (elements)."""
    h, hd = m["hidden"], m["head_dim"]
    q_heads = m["heads"] / n
    kv_heads = max(m["kv_heads"] / n, 1)  # replicated below one KV head per rank
    attention = h * hd * (2 * q_heads + 2 * kv_heads)  # Q and O, K and V
    ffn = 3 * h * m["ffn"] / n  # gate, up, down
    return attention + ffn


def total_params(m):
    return m["layers"] * layer_params_per_rank(m, 1) + 2 * m["vocab"] * m["hidden"]


def decode_step(m, n, alpha, link_bytes_per_s, head="rank 0"):
    """Milliseconds of one batch-1 decode step on the slowest rank, by part."""
    wb = m["weight_bytes"]
    layer_bytes = m["layers"] * layer_params_per_rank(m, n) * wb
    head_rows = m["vocab"] if head == "rank 0" else m["vocab"] / n
    head_bytes = head_rows * m["hidden"] * wb
    weights_s = (layer_bytes + head_bytes) / HBM_BYTES_PER_S
    kv_heads = max(m["kv_heads"] / n, 1)
    kv_s = m["layers"] * 2 * kv_heads * m["head_dim"] * KV_BYTES * CONTEXT / HBM_BYTES_PER_S
    reduces = 2 * m["layers"] if n > 1 else 0
    message = m["hidden"] * ALL_REDUCE_ELEM_BYTES
    wire = 2 * (n - 1) / n * message
    latency_s = reduces * alpha
    bandwidth_s = reduces * wire / link_bytes_per_s if n > 1 else 0.0
    return dict(
        weights_gb=(layer_bytes + head_bytes) / GB,
        weights=weights_s * 1e3,
        kv=kv_s * 1e3,
        latency=latency_s * 1e3,
        bandwidth=bandwidth_s * 1e3,
        total=(weights_s + kv_s + latency_s + bandwidth_s) * 1e3,
        reduces=reduces,
        message=message,
    )


def bound(p):
    parts = {
        "weight reads": p["weights"] + p["kv"],
        "all-reduce latency": p["latency"],
        "all-reduce bandwidth": p["bandwidth"],
    }
    name = max(parts, key=parts.get)
    return f"{name} ({100 * parts[name] / p['total']:.0f}%)"


def table(header, rows):
    widths = [max(len(str(r[i])) for r in [header] + rows) for i in range(len(header))]
    line = lambda r: "| " + " | ".join(str(c).ljust(w) for c, w in zip(r, widths)) + " |"
    print(line(header))
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in rows:
        print(line(r))
    print()


def main():
    m = LLAMA3_70B
    print(f"## {m['name']} on H200, batch 1, decode, context {CONTEXT}\n")
    print(
        f"{total_params(m) / 1e9:.2f} B parameters, {total_params(m) * m['weight_bytes'] / GB:.1f} GB "
        f"({total_params(m) * m['weight_bytes'] / GiB:.1f} GiB) in bf16; "
        f"{2 * m['layers']} all-reduces per token of {m['hidden']} f32 = {m['hidden'] * 4 // KiB} KiB each; "
        f"alpha {ALPHA_INTRA_S * 1e6:.0f} µs in a node, {ALPHA_INTER_S * 1e6:.0f} µs across nodes; "
        f"HBM {HBM_BYTES_PER_S / 1e12:.1f} TB/s, NVLink {NVLINK_BYTES_PER_S / GB:.0f} GB/s and NIC "
        f"{NIC_BYTES_PER_S / GB:.0f} GB/s per direction\n"
    )
    configs = [
        ("TP 1, one GPU (barely fits)", 1, 0.0, NVLINK_BYTES_PER_S, "rank 0"),
        ("TP 2, one node", 2, ALPHA_INTRA_S, NVLINK_BYTES_PER_S, "rank 0"),
        ("TP 4, one node", 4, ALPHA_INTRA_S, NVLINK_BYTES_PER_S, "rank 0"),
        ("TP 8, one node", 8, ALPHA_INTRA_S, NVLINK_BYTES_PER_S, "rank 0"),
        ("TP 8, one node, head split", 8, ALPHA_INTRA_S, NVLINK_BYTES_PER_S, "split"),
        ("TP 8, 2 nodes × 4 GPUs", 8, ALPHA_INTER_S, NIC_BYTES_PER_S, "rank 0"),
        ("TP 16, 2 nodes × 8 GPUs", 16, ALPHA_INTER_S, NIC_BYTES_PER_S, "rank 0"),
    ]
    rows = []
    for name, n, alpha, link, head in configs:
        p = decode_step(m, n, alpha, link, head)
        rows.append(
            [
                name,
                f"{p['weights_gb']:.1f}",
                f"{p['weights']:.2f}",
                f"{p['kv']:.3f}",
                f"{p['latency']:.2f}",
                f"{p['bandwidth']:.3f}",
                f"{p['total']:.2f}",
                f"{1e3 / p['total']:.0f}",
                bound(p),
            ]
        )
    table(
        [
            "configuration",
            "GB read (rank 0)",
            "weights ms",
            "KV ms",
            "all-reduce latency ms",
            "all-reduce bandwidth ms",
            "step ms",
            "tokens/s",
            "bound by",
        ],
        rows,
    )

    print("### Sensitivity to the all-reduce latency (TP 8 in one node, TP 16 over 2 nodes)\n")
    rows = []
    for alpha_us in [5, 10, 15, 25, 45, 70]:
        a = alpha_us * 1e-6
        p8 = decode_step(m, 8, a, NVLINK_BYTES_PER_S)
        p16 = decode_step(m, 16, a, NIC_BYTES_PER_S)
        rows.append(
            [
                f"{alpha_us} µs",
                f"{p8['total']:.2f}",
                f"{1e3 / p8['total']:.0f}",
                f"{100 * p8['latency'] / p8['total']:.0f}%",
                f"{p16['total']:.2f}",
                f"{1e3 / p16['total']:.0f}",
                f"{100 * p16['latency'] / p16['total']:.0f}%",
            ]
        )
    table(
        [
            "alpha",
            "TP 8 step ms",
            "TP 8 tokens/s",
            "TP 8 comm share",
            "TP 16 step ms",
            "TP 16 tokens/s",
            "TP 16 comm share",
        ],
        rows,
    )
    p8 = decode_step(m, 8, 0.0, NVLINK_BYTES_PER_S)
    print(
        f"Break-even latency, TP 8: the all-reduces cost as much as the reads at "
        f"{1e3 * (p8['weights'] + p8['kv']) / p8['reduces']:.1f} µs each.\n"
    )

    print("### The formula for the models measured on CPU\n")
    rows = []
    for name, hidden, layers in [("SmolLM2-135M", 576, 30), ("Qwen2.5-0.5B", 896, 24)]:
        per = 2 * ALL_REDUCE_ELEM_BYTES * hidden
        rows.append([name, hidden, layers, per, per * layers])
    table(
        ["model", "hidden", "layers", "all-reduce bytes per token per layer", "per token"],
        rows,
    )


if __name__ == "__main__":
    main()
