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

Pipeline parallelism (`core/src/parallel/pipeline.rs`, ported below as
`stage_layers`): P stages of T ranks, each stage a contiguous layer range
balanced by weight bytes with the output head on stage 0. At batch 1 the
one token goes through the stages one after the other, so the step is the
sum of every stage's reads and all-reduces, plus P - 1 sends of the hidden
state (4 × hidden bytes) from stage to stage and one back from the last
stage to rank 0 (the wanted row's final hidden state); each send costs a
latency `beta` plus its bytes over the link it crosses. Pipelining buys
capacity and throughput with several sequences in flight, not batch-1
speed: a stage reads 1/P of the layers but waits for the others.

Expert parallelism (Tandem's `--ep E`, vLLM's default form): the attention
stays tensor parallel over the stage's ranks, so every rank holds every
token's hidden state; each MoE layer's experts are placed whole over the
ranks, each rank runs its experts on the tokens routed to them, and one
all-reduce per MoE layer adds the parts (the all-gather of vLLM's
all-gather + reduce-scatter is free: every rank already has every token).
So an MoE layer all-reduces 4 × hidden bytes per token, as a dense FFN
does. At batch 1 the slowest rank is the one the router sent the most of
the token's experts to: its expected number is computed exactly (the k
experts are k distinct of the E, E / ranks per rank).
"""

from math import comb

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

# ---- point-to-point sends between pipeline stages ----
# NCCL send/recv of a few KiB between 2 H100s over NVLink: ~3 µs in
# nccl-tests (github.com/NVIDIA/nccl/issues/1487); 5 µs counts the
# receiving side's kernel. Across nodes (GPUDirect RDMA over the 400 Gb/s
# NIC), assumed 15 µs. Tandem's CUDA ranks today stage the hidden state
# through the host and MPI, which adds two copies (not counted here).
BETA_INTRA_S = 5e-6
BETA_INTER_S = 15e-6

# ---- the MoE: Qwen3-235B-A22B's shape (qwen3moe, which Tandem loads) ----
# DeepSeek-V3 (61 layers, hidden 7168, 256 routed experts + 1 shared, 8 per
# token, expert FFN 2048, 37 B active of 671 B, FP8) uses multi-head latent
# attention, which Tandem does not implement; Qwen3-235B is the same kind of
# fine-grained MoE with plain GQA attention.
QWEN3_235B = dict(
    name="Qwen3-235B-A22B",
    layers=94,
    hidden=4096,
    heads=64,
    kv_heads=4,
    head_dim=128,
    experts=128,
    experts_per_token=8,
    expert_ffn=1536,
    vocab=151936,
    weight_bytes=2,  # bf16
)

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


def stage_layers(layer_bytes, head_bytes, stages):
    """Layers per stage: `PipelinePlan::new` (core/src/parallel/pipeline.rs)."""
    layers = len(layer_bytes)
    total = head_bytes + sum(layer_bytes)
    ends, running = [], head_bytes
    for b in layer_bytes:
        running += b
        ends.append(running)
    bounds = [0]
    for k in range(1, stages):
        target = total * k / stages
        lo, hi = bounds[-1] + 1, layers - (stages - k)
        bounds.append(min(range(lo, hi + 1), key=lambda i: abs(ends[i - 1] - target)))
    bounds.append(layers)
    return [bounds[s + 1] - bounds[s] for s in range(stages)]


def pipeline_step(m, tp, pp, alpha, link, beta, hop_link, back_beta=None, back_link=None):
    """Milliseconds of one batch-1 decode step over `pp` stages of `tp` ranks
    (rank 0 holds the head): every stage in turn, then the hops."""
    wb = m["weight_bytes"]
    counts = stage_layers([layer_params_per_rank(m, 1) * wb] * m["layers"], m["vocab"] * m["hidden"] * wb, pp)
    layer_bytes = layer_params_per_rank(m, tp) * wb
    head_bytes = m["vocab"] * m["hidden"] * wb
    kv_heads = max(m["kv_heads"] / tp, 1)
    kv_layer = 2 * kv_heads * m["head_dim"] * KV_BYTES * CONTEXT
    message = m["hidden"] * ALL_REDUCE_ELEM_BYTES
    wire = 2 * (tp - 1) / tp * message
    read = m["layers"] * layer_bytes + head_bytes
    weights_s = read / HBM_BYTES_PER_S
    kv_s = m["layers"] * kv_layer / HBM_BYTES_PER_S
    reduces = 2 * m["layers"] if tp > 1 else 0
    latency_s = reduces * alpha
    bandwidth_s = reduces * wire / link if tp > 1 else 0.0
    hops = pp - 1
    back_beta = beta if back_beta is None else back_beta
    back_link = hop_link if back_link is None else back_link
    p2p_s = hops * (beta + message / hop_link) + (back_beta + message / back_link if pp > 1 else 0.0)
    return dict(
        stages=counts,
        weights_gb=read / GB,
        stage_gb=max(c * layer_bytes + (head_bytes if s == 0 else 0) for s, c in enumerate(counts)) / GB,
        weights=weights_s * 1e3,
        kv=kv_s * 1e3,
        latency=latency_s * 1e3,
        bandwidth=bandwidth_s * 1e3,
        p2p=p2p_s * 1e3,
        total=(weights_s + kv_s + latency_s + bandwidth_s + p2p_s) * 1e3,
        reduces=reduces,
        sends=hops + (pp > 1),
    )


def moe_params(m):
    """(total, active) parameters and the bytes of one expert."""
    h, hd = m["hidden"], m["head_dim"]
    attention = h * hd * (2 * m["heads"] + 2 * m["kv_heads"])
    router = h * m["experts"]
    expert = 3 * h * m["expert_ffn"]
    embeddings = 2 * m["vocab"] * h
    total = m["layers"] * (attention + router + m["experts"] * expert) + embeddings
    active = m["layers"] * (attention + router + m["experts_per_token"] * expert) + embeddings
    return total, active, expert * m["weight_bytes"]


def expected_max_experts(experts, k, ranks):
    """The expected largest number of a token's k (distinct) experts that
    fall on one rank, the experts placed E / ranks per rank: exact, by
    counting the k-subsets with at most j experts on every rank."""
    per = experts // ranks

    def at_most(j):
        poly = [1]
        for _ in range(ranks):
            nxt = [0] * (len(poly) + j)
            for a, ca in enumerate(poly):
                for b in range(j + 1):
                    nxt[a + b] += ca * comb(per, b)
            poly = nxt
        return poly[k] if k < len(poly) else 0

    total = comb(experts, k)
    return sum(1 - at_most(j) / total for j in range(k))


def moe_step(m, ranks, alpha, link, experts_on_slowest):
    """Milliseconds of one batch-1 decode step of the MoE over one stage of
    `ranks` ranks (attention tensor parallel, head on rank 0); the slowest
    rank reads `experts_on_slowest` experts' worth of expert weights."""
    wb = m["weight_bytes"]
    h, hd = m["hidden"], m["head_dim"]
    _, _, expert_bytes = moe_params(m)
    kv_heads = max(m["kv_heads"] / ranks, 1)
    attention = h * hd * (2 * m["heads"] / ranks + 2 * kv_heads) * wb
    router = h * m["experts"] * wb
    head = m["vocab"] * h * wb
    read = m["layers"] * (attention + router + experts_on_slowest * expert_bytes) + head
    weights_s = read / HBM_BYTES_PER_S
    kv_s = m["layers"] * 2 * kv_heads * hd * KV_BYTES * CONTEXT / HBM_BYTES_PER_S
    reduces = 2 * m["layers"] if ranks > 1 else 0
    message = h * ALL_REDUCE_ELEM_BYTES
    latency_s = reduces * alpha
    bandwidth_s = reduces * 2 * (ranks - 1) / ranks * message / link if ranks > 1 else 0.0
    return dict(
        weights_gb=read / GB,
        weights=weights_s * 1e3,
        kv=kv_s * 1e3,
        latency=latency_s * 1e3,
        bandwidth=bandwidth_s * 1e3,
        p2p=0.0,
        total=(weights_s + kv_s + latency_s + bandwidth_s) * 1e3,
        reduces=reduces,
    )


def bound(p):
    parts = {
        "weight reads": p["weights"] + p["kv"],
        "all-reduce latency": p["latency"],
        "all-reduce bandwidth": p["bandwidth"],
        "stage-to-stage sends": p.get("p2p", 0.0),
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

    pipeline_tables(m)
    moe_table(QWEN3_235B)


def pipeline_tables(m):
    print(f"## {m['name']}: tensor × pipeline parallelism, batch 1, decode, context {CONTEXT}\n")
    print(
        f"send latency {BETA_INTRA_S * 1e6:.0f} µs in a node, {BETA_INTER_S * 1e6:.0f} µs across nodes; "
        f"each send is one hidden state, {m['hidden']} f32 = {m['hidden'] * 4 // KiB} KiB\n"
    )
    nv, nic = NVLINK_BYTES_PER_S, NIC_BYTES_PER_S
    configs = [
        # name, tp, pp, all-reduce alpha and link, send beta and link (stage to stage), back to rank 0
        ("TP 8, one node", 8, 1, ALPHA_INTRA_S, nv, BETA_INTRA_S, nv, None, None),
        ("TP 4 × PP 2, one node", 4, 2, ALPHA_INTRA_S, nv, BETA_INTRA_S, nv, None, None),
        ("PP 8, one node", 1, 8, 0.0, nv, BETA_INTRA_S, nv, None, None),
        ("TP 8 × PP 2, 2 nodes (a stage per node)", 8, 2, ALPHA_INTRA_S, nv, BETA_INTER_S, nic, BETA_INTER_S, nic),
        ("TP 16, 2 nodes × 8 GPUs", 16, 1, ALPHA_INTER_S, nic, 0.0, nic, None, None),
    ]
    rows = []
    for name, tp, pp, alpha, link, beta, hop, back_beta, back_link in configs:
        p = pipeline_step(m, tp, pp, alpha, link, beta, hop, back_beta, back_link)
        rows.append(
            [
                name,
                "+".join(str(c) for c in p["stages"]),
                f"{p['stage_gb']:.1f}",
                f"{p['weights_gb']:.1f}",
                f"{p['weights']:.2f}",
                f"{p['kv']:.3f}",
                f"{p['reduces']} × {alpha * 1e6:.0f} µs: {p['latency'] + p['bandwidth']:.2f}" if p["reduces"] else "–",
                f"{p['sends']}: {p['p2p']:.3f}" if p["sends"] else "–",
                f"{p['total']:.2f}",
                f"{1e3 / p['total']:.0f}",
                bound(p),
            ]
        )
    table(
        [
            "configuration",
            "layers per stage",
            "GB read by the busiest GPU",
            "GB read per token, stages in turn",
            "weights ms",
            "KV ms",
            "all-reduces, ms",
            "sends, ms",
            "step ms",
            "tokens/s",
            "bound by",
        ],
        rows,
    )
    print("### The pipeline bubble: a step's rows in M micro-batches over P balanced stages\n")
    rows = []
    for pp in [2, 4, 8]:
        row = [pp]
        for mb in [1, 2, 4, 8, 16]:
            bubble = (pp - 1) / (mb + pp - 1)
            row.append(f"{100 * bubble:.0f}% (×{pp * mb / (mb + pp - 1):.2f})")
        rows.append(row)
    table(["P", "M = 1", "M = 2", "M = 4", "M = 8", "M = 16"], rows)
    print(
        "Bubble (P − 1) / (M + P − 1): the share of the stages' time idle while the pipe fills and drains; "
        "in brackets the speedup over one stage, P × M / (M + P − 1), for compute-bound rows (prefill).\n"
    )


def moe_table(m):
    total, active, expert_bytes = moe_params(m)
    ranks = 8
    e_max = expected_max_experts(m["experts"], m["experts_per_token"], ranks)
    print(f"## {m['name']}-shaped MoE on one node of {ranks} H200, batch 1, decode, context {CONTEXT}\n")
    print(
        f"{m['layers']} layers, hidden {m['hidden']}, {m['heads']} query heads and {m['kv_heads']} KV heads of "
        f"{m['head_dim']}, {m['experts']} experts of FFN {m['expert_ffn']} ({expert_bytes / 1e6:.1f} MB each in bf16), "
        f"{m['experts_per_token']} per token, vocabulary {m['vocab']}: {total / 1e9:.1f} B parameters "
        f"({total * m['weight_bytes'] / GB:.0f} GB in bf16, {total * m['weight_bytes'] / GB / ranks:.0f} GB per GPU), "
        f"{active / 1e9:.1f} B active per token. A token's {m['experts_per_token']} experts over {ranks} ranks of "
        f"{m['experts'] // ranks}: the busiest rank holds {e_max:.2f} of them on average (exact). "
        f"Every MoE layer all-reduces {m['hidden']} f32 = {m['hidden'] * 4 // KiB} KiB per token, as a dense FFN.\n"
    )
    configs = [
        ("TP 8: every expert split by features over 8 ranks", m["experts_per_token"] / ranks),
        (f"EP 8: {m['experts'] // ranks} whole experts per rank, random routing", e_max),
        ("EP 8, perfectly balanced routing (1 expert per rank)", m["experts_per_token"] / ranks),
        (f"EP 8, worst case (all {m['experts_per_token']} on one rank)", float(m["experts_per_token"])),
    ]
    rows = []
    for name, slowest in configs:
        p = moe_step(m, ranks, ALPHA_INTRA_S, NVLINK_BYTES_PER_S, slowest)
        rows.append(
            [
                name,
                f"{slowest:.2f}",
                f"{p['weights_gb']:.2f}",
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
            "experts read by the slowest rank",
            "GB read (slowest)",
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


if __name__ == "__main__":
    main()
