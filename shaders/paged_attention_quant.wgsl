// Paged causal attention over a quantized (INT8, INT4, INT2) KV cache: the
// parameters, the cache bindings and readers `k_at` / `v_at` that dequantize
// K and V elements as they are read; the algorithm is
// backend-wgpu/src/wgsl/attention.wgsl, shared with paged_attention.wgsl. Slot layout: see
// paged_kv_write_quant.wgsl (codes, then one f16 scale / f16 min word per
// group of 32 elements). INT4 and INT2 keys are per block instead, quantized
// per channel (layout: paged_kv_write_int4_keys.wgsl).

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
    // u32 words per value slot.
    value_slot_words: u32,
    scale: f32,
    // 1: one block table per sequence and KV head ([seqs, kv_heads,
    // max_blocks], select_kv_blocks' output); 0: one per sequence. Word 10 in
    // both Params structs, which the host fills as one prefix.
    head_tables: u32,
    groups_per_head: u32,
    value_bits: u32,
    // INT4, INT2: kv_heads * head_dim, keys in per-channel blocks; 0: keys
    // in slots like the values. Either way at their own bits.
    key_channels: u32,
    key_slot_words: u32,
    key_bits: u32,
}

@group(0) @binding(0) var<uniform> P: Params;
@group(0) @binding(1) var<storage, read> Q: array<f32>;
@group(0) @binding(2) var<storage, read> K_CACHE: array<u32>;
@group(0) @binding(3) var<storage, read> V_CACHE: array<u32>;

const GROUP: u32 = 32u;

// Word holding element `e` (of the slot's row of kv_heads * head_dim) of a
// slot, the shift of its code, the word of its group's parameters, and the
// bits per code.
struct Element {
    code_word: u32,
    shift: u32,
    param_word: u32,
    bits: u32,
}

fn element_of(slot: u32, e: u32, slot_words: u32, bits: u32) -> Element {
    let head = e / P.head_dim;
    let d = e % P.head_dim;
    let g = head * P.groups_per_head + d / GROUP;
    let i = d % GROUP;
    let per_word = 32u / bits;
    let base = slot * slot_words;
    return Element(
        base + g * bits + i / per_word,
        (i % per_word) * bits,
        base + P.kv_heads * P.groups_per_head * bits + g,
        bits,
    );
}

fn dequantize(word: u32, shift: u32, params: u32, bits: u32) -> f32 {
    let q = (word >> shift) & ((1u << bits) - 1u);
    let scale_min = unpack2x16float(params);
    return scale_min.y + f32(q) * scale_min.x;
}

// Channel e of the token in `slot` of an INT4 or INT2 key block.
fn key_block_at(slot: u32, e: u32) -> f32 {
    let per_word = 32u / P.key_bits;
    let per_token = (P.key_channels + per_word - 1u) / per_word;
    let base = (slot / P.block_size) * (P.block_size * per_token + P.key_channels);
    let word = K_CACHE[base + (slot % P.block_size) * per_token + e / per_word];
    let params = K_CACHE[base + P.block_size * per_token + e];
    return dequantize(word, (e % per_word) * P.key_bits, params, P.key_bits);
}

fn k_at(slot: u32, e: u32) -> f32 {
    if P.key_channels != 0u {
        return key_block_at(slot, e);
    }
    let at = element_of(slot, e, P.key_slot_words, P.key_bits);
    return dequantize(K_CACHE[at.code_word], at.shift, K_CACHE[at.param_word], at.bits);
}

fn v_at(slot: u32, e: u32) -> f32 {
    let at = element_of(slot, e, P.value_slot_words, P.value_bits);
    return dequantize(V_CACHE[at.code_word], at.shift, V_CACHE[at.param_word], at.bits);
}
