// Sparse attention's block selection (Backend::select_kv_blocks): from
// TABLES ([seqs, max_blocks] u32, one table per sequence) it writes OUT
// ([seqs, kv_heads, max_blocks] u32, one table per sequence and KV head,
// which paged attention reads with head_tables): KV head g's is the
// sequence's table with the entries g does not read made holes
// (EVICTED_BLOCK). The visible entries are those up to the block of the
// sequence's last row; of those the first `sinks` and the last `recent` are
// kept, and among the others that are not holes (the candidates) each KV
// head keeps the `top` of highest bound, ties to the earlier entry; no union
// over the heads. Entries past the visible ones are copied. A sequence
// without rows, or with no more than `top` candidates, gives every head its
// table unchanged.
//
// A block's bound for KV head g is Σ_c max(q_c·min_c, q_c·max_c) over its
// key bounds (kv_key_bounds.wgsl), summed over the sequence's rows and g's
// query heads: as q⁺·max + q⁻·min, with the queries' positive and negative
// parts summed first and the dot products in eight lanes, as the CPU does.
//
// One workgroup per sequence: its threads write each (KV head, candidate)
// bound into SCRATCH ([seqs, kv_heads, max_blocks] f32, laid out as OUT),
// then rank each candidate among its head's by counting the candidates that
// beat it. Element i of the sequence's kv_heads * max_blocks (KV head
// i / max_blocks, entry i % max_blocks) is owned by one thread in both
// passes, so each OUT element is written once.

struct Params {
    rows: u32,
    heads: u32,
    kv_heads: u32,
    head_dim: u32,
    block_size: u32,
    max_blocks: u32,
    seqs: u32,
    top: u32,
    sinks: u32,
    recent: u32,
}

@group(0) @binding(0) var<uniform> P: Params;
@group(0) @binding(1) var<storage, read> Q: array<f32>;
@group(0) @binding(2) var<storage, read> ROW_SEQ: array<u32>;
@group(0) @binding(3) var<storage, read> POSITIONS: array<u32>;
@group(0) @binding(4) var<storage, read> TABLES: array<u32>;
@group(0) @binding(5) var<storage, read> BOUNDS: array<f32>;
@group(0) @binding(6) var<storage, read_write> SCRATCH: array<f32>;
@group(0) @binding(7) var<storage, read_write> OUT: array<u32>;

const WG: u32 = 64u;
const EVICTED: u32 = 0xffffffffu;

// `Σ_c a(c) · b(c)` as the CPU sums it: lane l of eight takes c = 8j + l,
// the lanes are added in order, then the tail.
fn lane_dot(pos: ptr<function, array<f32, 256>>, bounds_at: u32) -> f32 {
    var lanes: array<f32, 8>;
    let whole = P.head_dim / 8u * 8u;
    for (var c = 0u; c < whole; c++) {
        lanes[c % 8u] += (*pos)[c] * BOUNDS[bounds_at + c];
    }
    var sum = 0.0;
    for (var l = 0u; l < 8u; l++) {
        sum += lanes[l];
    }
    var tail = 0.0;
    for (var c = whole; c < P.head_dim; c++) {
        tail += (*pos)[c] * BOUNDS[bounds_at + c];
    }
    return sum + tail;
}

// The bound of table entry `e` (physical block `block`) for KV head g.
fn bound(seq: u32, g: u32, block: u32) -> f32 {
    var pos: array<f32, 256>;
    var neg: array<f32, 256>;
    let group = P.heads / P.kv_heads;
    for (var t = 0u; t < P.rows; t++) {
        if ROW_SEQ[t] != seq {
            continue;
        }
        for (var h = g * group; h < (g + 1u) * group; h++) {
            let q = (t * P.heads + h) * P.head_dim;
            for (var c = 0u; c < P.head_dim; c++) {
                pos[c] += max(Q[q + c], 0.0);
                neg[c] += min(Q[q + c], 0.0);
            }
        }
    }
    let at = (block * P.kv_heads + g) * 2u * P.head_dim;
    return lane_dot(&pos, at + P.head_dim) + lane_dot(&neg, at);
}

@compute @workgroup_size(WG)
fn main(ids: Ids, group: Group) {
    let seq = group_index(group);
    if seq >= P.seqs {
        return;
    }
    let base = seq * P.max_blocks;
    var has_rows = false;
    var last = 0u;
    for (var t = 0u; t < P.rows; t++) {
        if ROW_SEQ[t] == seq {
            last = select(POSITIONS[t], max(last, POSITIONS[t]), has_rows);
            has_rows = true;
        }
    }
    let visible = select(0u, min(last / P.block_size + 1u, P.max_blocks), has_rows);
    let end = visible - min(P.recent, visible);
    let first = min(P.sinks, end);
    var candidates = 0u;
    for (var e = first; e < end; e++) {
        candidates += u32(TABLES[base + e] != EVICTED);
    }
    let selecting = candidates > P.top;
    // This sequence's tables in OUT, and its bounds in SCRATCH.
    let heads_base = seq * P.kv_heads * P.max_blocks;
    for (var i = ids.lid; i < P.kv_heads * P.max_blocks; i += WG) {
        let e = i % P.max_blocks;
        let entry = TABLES[base + e];
        if selecting && e >= first && e < end && entry != EVICTED {
            SCRATCH[heads_base + i] = bound(seq, i / P.max_blocks, entry);
        } else {
            // Sinks, recent entries, holes and entries past the visible
            // ones: every head's table has them as they are.
            OUT[heads_base + i] = entry;
        }
    }
    storageBarrier();
    workgroupBarrier();
    for (var i = ids.lid; i < P.kv_heads * P.max_blocks; i += WG) {
        let e = i % P.max_blocks;
        let entry = TABLES[base + e];
        if !(selecting && e >= first && e < end && entry != EVICTED) {
            continue;
        }
        let row = heads_base + i - e;
        let mine = SCRATCH[heads_base + i];
        var rank = 0u;
        for (var o = first; o < end; o++) {
            if TABLES[base + o] == EVICTED || o == e {
                continue;
            }
            let theirs = SCRATCH[row + o];
            rank += u32(theirs > mine || (theirs == mine && o < e));
        }
        OUT[heads_base + i] = select(EVICTED, entry, rank < P.top);
    }
}
