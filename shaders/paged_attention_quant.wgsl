// Paged causal attention over a quantized (INT8, INT4) KV cache: the
// algorithm of paged_attention.wgsl (one workgroup per (query row, head),
// online softmax over tiles of WG keys, grouped-query heads), with K and V
// elements dequantized as they are read. Slot layout: see
// paged_kv_write_quant.wgsl (codes, then one f16 scale / f16 min word per
// group of 32 elements).

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
    // u32 words per slot.
    slot_words: u32,
    scale: f32,
    groups_per_head: u32,
    bits: u32,
}

@group(0) @binding(0) var<uniform> P: Params;
@group(0) @binding(1) var<storage, read> Q: array<f32>;
@group(0) @binding(2) var<storage, read> K_CACHE: array<u32>;
@group(0) @binding(3) var<storage, read> V_CACHE: array<u32>;

const GROUP: u32 = 32u;

// Word holding element `e` (of the slot's row of kv_heads * head_dim) of a
// slot, the shift of its code, and the word of its group's parameters.
struct Element {
    code_word: u32,
    shift: u32,
    param_word: u32,
}

fn element_of(slot: u32, e: u32) -> Element {
    let head = e / P.head_dim;
    let d = e % P.head_dim;
    let g = head * P.groups_per_head + d / GROUP;
    let i = d % GROUP;
    let per_word = 32u / P.bits;
    let base = slot * P.slot_words;
    return Element(
        base + g * P.bits + i / per_word,
        (i % per_word) * P.bits,
        base + P.kv_heads * P.groups_per_head * P.bits + g,
    );
}

fn dequantize(word: u32, shift: u32, params: u32) -> f32 {
    let q = (word >> shift) & ((1u << P.bits) - 1u);
    let scale_min = unpack2x16float(params);
    return scale_min.y + f32(q) * scale_min.x;
}

fn k_at(slot: u32, e: u32) -> f32 {
    let at = element_of(slot, e);
    return dequantize(K_CACHE[at.code_word], at.shift, K_CACHE[at.param_word]);
}

fn v_at(slot: u32, e: u32) -> f32 {
    let at = element_of(slot, e);
    return dequantize(V_CACHE[at.code_word], at.shift, V_CACHE[at.param_word]);
}
@group(0) @binding(4) var<storage, read> ROW_SEQ: array<u32>;
@group(0) @binding(5) var<storage, read> POSITIONS: array<u32>;
@group(0) @binding(6) var<storage, read> BLOCK_TABLES: array<u32>;
@group(0) @binding(7) var<storage, read_write> OUT: array<f32>;

const WG: u32 = 64u;
// The host refuses larger heads.
const MAX_HEAD_DIM: u32 = 256u;
const DIMS_PER_THREAD: u32 = MAX_HEAD_DIM / WG;
// Stands for -infinity: finite, so that differences of two of them stay 0.
const NO_SCORE: f32 = -3.0e38;
const NO_SLOT: u32 = 0xffffffffu;

var<workgroup> q_tile: array<f32, MAX_HEAD_DIM>;
var<workgroup> p_tile: array<f32, WG>;
var<workgroup> slot_tile: array<u32, WG>;

// Cache slot of key position j of a sequence, or NO_SLOT when the block table
// does not map it to a block of the cache.
fn slot_of(seq: u32, j: u32) -> u32 {
    let block = j / P.block_size;
    if block >= P.max_blocks {
        return NO_SLOT;
    }
    let physical = BLOCK_TABLES[seq * P.max_blocks + block];
    if physical >= P.num_blocks {
        return NO_SLOT;
    }
    return physical * P.block_size + j % P.block_size;
}

@compute @workgroup_size(WG)
fn main(ids: Ids, group: Group) {
    let g = group_index(group);
    let t = g / P.heads;
    let head = g % P.heads;
    if t >= P.rows {
        return;
    }
    let lid = ids.lid;
    let at = lane_of(ids);
    let hd = P.head_dim;
    let kv_offset = (head / (P.heads / P.kv_heads)) * hd;
    let q_base = (t * P.heads + head) * hd;
    for (var d = lid; d < hd; d += WG) {
        q_tile[d] = Q[q_base + d] * P.scale;
    }
    workgroupBarrier();

    let seq = ROW_SEQ[t];
    let end = POSITIONS[t] + 1u;
    var start = 0u;
    if P.window != 0u && end > P.window {
        start = end - P.window;
    }
    var running_max = NO_SCORE;
    var denom = 0.0;
    var acc: array<f32, DIMS_PER_THREAD>;
    for (var tile = start; tile < end; tile += WG) {
        let j = tile + lid;
        var slot = NO_SLOT;
        var score = NO_SCORE;
        if j < end {
            slot = slot_of(seq, j);
        }
        if slot != NO_SLOT {
            var s = 0.0;
            for (var e = 0u; e < hd; e++) {
                s += q_tile[e] * k_at(slot, kv_offset + e);
            }
            score = s;
        }
        let new_max = max(running_max, reduce_max(score, at));
        var p = 0.0;
        if slot != NO_SLOT {
            p = exp(score - new_max);
        }
        let correction = exp(running_max - new_max);
        denom = denom * correction + reduce_sum(p, at);
        running_max = new_max;
        p_tile[lid] = p;
        slot_tile[lid] = slot;
        workgroupBarrier();
        let keys = min(WG, end - tile);
        for (var i = 0u; i < DIMS_PER_THREAD; i++) {
            let d = lid + i * WG;
            if d < hd {
                var sum = acc[i] * correction;
                for (var k = 0u; k < keys; k++) {
                    let key_slot = slot_tile[k];
                    if key_slot != NO_SLOT {
                        sum += p_tile[k] * v_at(key_slot, kv_offset + d);
                    }
                }
                acc[i] = sum;
            }
        }
        workgroupBarrier();
    }
    for (var i = 0u; i < DIMS_PER_THREAD; i++) {
        let d = lid + i * WG;
        if d < hd {
            var v = 0.0;
            if denom > 0.0 {
                v = acc[i] / denom;
            }
            OUT[q_base + d] = v;
        }
    }
}
