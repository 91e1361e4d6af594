// Paged causal attention over an f32 or f16 KV cache: the parameters, the
// cache bindings and their readers `k_at` / `v_at`. The algorithm (online
// softmax over tiles of keys read through the block table) is
// backend-wgpu/src/wgsl/attention.wgsl, shared with paged_attention_quant.wgsl.
// Cache layouts: see paged_kv_write.wgsl.

struct Params {
    rows: u32,
    heads: u32,
    kv_heads: u32,
    head_dim: u32,
    block_size: u32,
    max_blocks: u32,
    num_blocks: u32,
    // 0 when the whole prefix is visible.
    window: u32,
    // Storage units per slot: f32 values, or u32 words (pairs) for F16 caches.
    slot_units: u32,
    scale: f32,
    // 1: one block table per sequence and KV head ([seqs, kv_heads,
    // max_blocks], select_kv_blocks' output); 0: one per sequence. Word 10 in
    // both Params structs, which the host fills as one prefix.
    head_tables: u32,
}

@group(0) @binding(0) var<uniform> P: Params;
@group(0) @binding(1) var<storage, read> Q: array<f32>;
// #if KV_F16
// #if F16
@group(0) @binding(2) var<storage, read> K_CACHE: array<f16>;
@group(0) @binding(3) var<storage, read> V_CACHE: array<f16>;

fn k_at(slot: u32, e: u32) -> f32 {
    return f32(K_CACHE[2u * slot * P.slot_units + e]);
}

fn v_at(slot: u32, e: u32) -> f32 {
    return f32(V_CACHE[2u * slot * P.slot_units + e]);
}
// #else
@group(0) @binding(2) var<storage, read> K_CACHE: array<u32>;
@group(0) @binding(3) var<storage, read> V_CACHE: array<u32>;

fn k_at(slot: u32, e: u32) -> f32 {
    return unpack2x16float(K_CACHE[slot * P.slot_units + e / 2u])[e & 1u];
}

fn v_at(slot: u32, e: u32) -> f32 {
    return unpack2x16float(V_CACHE[slot * P.slot_units + e / 2u])[e & 1u];
}
// #endif
// #else
@group(0) @binding(2) var<storage, read> K_CACHE: array<f32>;
@group(0) @binding(3) var<storage, read> V_CACHE: array<f32>;

fn k_at(slot: u32, e: u32) -> f32 {
    return K_CACHE[slot * P.slot_units + e];
}

fn v_at(slot: u32, e: u32) -> f32 {
    return V_CACHE[slot * P.slot_units + e];
}
// #endif
