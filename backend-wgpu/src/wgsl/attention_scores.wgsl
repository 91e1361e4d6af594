// The attention-score variant of paged attention (KV eviction by score),
// appended like attention.wgsl to shaders/paged_attention.wgsl or
// shaders/paged_attention_quant.wgsl, which supply Params, Q, the caches and
// `k_at`. It adds to SCORES[(t * kv_heads + g) * max_blocks + b] the softmax
// weights that query row t's heads reading KV head g give the keys of table
// entry b; evicted entries (ids >= num_blocks) get nothing. One block table
// per sequence: the host refuses per-head tables (P.head_tables is 0).
//
// One workgroup per (query row, KV head): the group's heads in turn, so no
// two workgroups add to the same entry. Per head, a first pass over tiles of
// WG keys finds the softmax's max and denominator; a second scores the keys
// again, stages their weights, and threads owning one block of the tile each
// add that block's share. Only keys are read; no score leaves the workgroup.
@group(0) @binding(4) var<storage, read> ROW_SEQ: array<u32>;
@group(0) @binding(5) var<storage, read> POSITIONS: array<u32>;
@group(0) @binding(6) var<storage, read> BLOCK_TABLES: array<u32>;
@group(0) @binding(7) var<storage, read_write> SCORES: array<f32>;

const WG: u32 = 64u;
// The host refuses larger heads.
const MAX_HEAD_DIM: u32 = 256u;
// Stands for -infinity: finite, so that differences of two of them stay 0.
const NO_SCORE: f32 = -3.0e38;
const NO_SLOT: u32 = 0xffffffffu;

var<workgroup> q_tile: array<f32, MAX_HEAD_DIM>;
var<workgroup> p_tile: array<f32, WG>;

// Cache slot of key position j of a sequence, or NO_SLOT when the block table
// does not map it to a block of the cache (evicted).
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

// Scaled q . k of key j for the head staged in q_tile, NO_SCORE when unseen.
fn key_score(seq: u32, j: u32, end: u32, kv_offset: u32) -> f32 {
    if j >= end {
        return NO_SCORE;
    }
    let slot = slot_of(seq, j);
    if slot == NO_SLOT {
        return NO_SCORE;
    }
    var s = 0.0;
    for (var e = 0u; e < P.head_dim; e++) {
        s += q_tile[e] * k_at(slot, kv_offset + e);
    }
    return s;
}

@compute @workgroup_size(WG)
fn main(ids: Ids, group: Group) {
    let wg = group_index(group);
    let t = wg / P.kv_heads;
    let g = wg % P.kv_heads;
    if t >= P.rows {
        return;
    }
    let lid = ids.lid;
    let at = lane_of(ids);
    let hd = P.head_dim;
    let group_heads = P.heads / P.kv_heads;
    let kv_offset = g * hd;
    let seq = ROW_SEQ[t];
    let end = POSITIONS[t] + 1u;
    var start = 0u;
    if P.window != 0u && end > P.window {
        start = end - P.window;
    }
    let out_row = (t * P.kv_heads + g) * P.max_blocks;
    for (var h = 0u; h < group_heads; h++) {
        let q_base = (t * P.heads + g * group_heads + h) * hd;
        for (var d = lid; d < hd; d += WG) {
            q_tile[d] = Q[q_base + d] * P.scale;
        }
        workgroupBarrier();
        var running_max = NO_SCORE;
        var denom = 0.0;
        for (var tile = start; tile < end; tile += WG) {
            let score = key_score(seq, tile + lid, end, kv_offset);
            let new_max = max(running_max, reduce_max(score, at));
            var p = 0.0;
            if score != NO_SCORE {
                p = exp(score - new_max);
            }
            denom = denom * exp(running_max - new_max) + reduce_sum(p, at);
            running_max = new_max;
        }
        for (var tile = start; tile < end; tile += WG) {
            let score = key_score(seq, tile + lid, end, kv_offset);
            var p = 0.0;
            if score != NO_SCORE && denom > 0.0 {
                p = exp(score - running_max) / denom;
            }
            p_tile[lid] = p;
            workgroupBarrier();
            let keys = min(WG, end - tile);
            let first_block = tile / P.block_size;
            let block = first_block + lid;
            if block <= (tile + keys - 1u) / P.block_size && block < P.max_blocks {
                let lo = max(block * P.block_size, tile) - tile;
                let hi = min((block + 1u) * P.block_size, tile + keys) - tile;
                var sum = 0.0;
                for (var k = lo; k < hi; k++) {
                    sum += p_tile[k];
                }
                SCORES[out_row + block] += sum;
            }
            workgroupBarrier();
        }
    }
}
