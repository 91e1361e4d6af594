// The paged-attention algorithm shared by shaders/paged_attention.wgsl (f32 and
// f16 caches) and shaders/paged_attention_quant.wgsl (INT8/INT4 caches): the
// generator appends it to either, which supply Params, Q, the K/V caches and
// their readers `k_at(slot, e)` / `v_at(slot, e)`.
//
// Paged causal attention with an online (flash-style) softmax, for prefill
// and decode alike. Query row t (head h) belongs to sequence ROW_SEQ[t] at
// position POSITIONS[t] and attends to the keys at positions
// `max(0, pos + 1 - window) ..= pos` of its sequence, read through a row of
// BLOCK_TABLES (position j lives in slot
// `table[j / block_size] * block_size + j % block_size`). Grouped-query
// attention: head h reads KV head `g = h / (heads / kv_heads)`. The row is
// the sequence's (`[seqs, max_blocks]`), or with P.head_tables its KV head
// g's (`[seqs, kv_heads, max_blocks]`, row `seq * kv_heads + g`: sparse
// attention, where each KV head keeps its own blocks).
//
// One workgroup per (query row, head). Keys are visited in tiles of WG:
// thread i scores key `tile + i` against the query staged in workgroup
// memory, the tile's max and sum update the running softmax, then each thread
// accumulates its own output dimensions over the tile's keys (consecutive
// threads read consecutive V elements). Cache layouts: see paged_kv_write.wgsl.
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

// Cache slot of key position j through row `table` of BLOCK_TABLES, or
// NO_SLOT when the table does not map it to a block of the cache.
fn slot_of(table: u32, j: u32) -> u32 {
    let block = j / P.block_size;
    if block >= P.max_blocks {
        return NO_SLOT;
    }
    let physical = BLOCK_TABLES[table * P.max_blocks + block];
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
    let kv_head = head / (P.heads / P.kv_heads);
    let kv_offset = kv_head * hd;
    let q_base = (t * P.heads + head) * hd;
    for (var d = lid; d < hd; d += WG) {
        q_tile[d] = Q[q_base + d] * P.scale;
    }
    workgroupBarrier();

    let seq = ROW_SEQ[t];
    let table = select(seq, seq * P.kv_heads + kv_head, P.head_tables != 0u);
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
            slot = slot_of(table, j);
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
