// Index of the largest value of each row (the lowest index among equal
// maxima; NaN never wins), so that a greedy decode step reads back only token
// ids. One workgroup per row: each thread scans a strided slice, then the
// (value, index) pairs are reduced across the workgroup, through subgroup
// operations where the adapter has them.

struct Params {
    rows: u32,
    width: u32,
}

@group(0) @binding(0) var<uniform> P: Params;
@group(0) @binding(1) var<storage, read> X: array<f32>;
@group(0) @binding(2) var<storage, read_write> OUT: array<u32>;

const WG: u32 = 256u;
const NONE: u32 = 0xffffffffu;

var<workgroup> best_values: array<f32, WG>;
var<workgroup> best_indices: array<u32, WG>;
// #if SUBGROUPS
var<workgroup> best_count: atomic<u32>;
// #endif

// Whether (v, i) beats (best, best_i): larger, or equal with a lower index.
fn beats(v: f32, i: u32, best: f32, best_i: u32) -> bool {
    return i != NONE && (best_i == NONE || v > best || (v == best && i < best_i));
}

@compute @workgroup_size(WG)
fn main(ids: Ids, group: Group) {
    let row = group_index(group);
    if row >= P.rows {
        return;
    }
    let lid = ids.lid;
    let base = row * P.width;
    var best = 0.0;
    var best_i = NONE;
    for (var i = lid; i < P.width; i += WG) {
        let v = X[base + i];
        // `v == v` is false only for NaN.
        if v == v && beats(v, i, best, best_i) {
            best = v;
            best_i = i;
        }
    }
// #if SUBGROUPS
    if lid == 0u {
        atomicStore(&best_count, 0u);
    }
    workgroupBarrier();
    // Threads without a candidate take part with the lowest value so that the
    // subgroup operations run in uniform control flow.
    let candidate = select(-3.4e38, best, best_i != NONE);
    let group_best = subgroupMax(candidate);
    let winner = subgroupMin(select(NONE, best_i, best_i != NONE && candidate == group_best));
    if ids.lane == 0u {
        let slot = atomicAdd(&best_count, 1u);
        best_values[slot] = group_best;
        best_indices[slot] = winner;
    }
    workgroupBarrier();
    if lid == 0u {
        var b = 0.0;
        var b_i = NONE;
        // One slot per subgroup; a subgroup wider than the workgroup fills one.
        for (var s = 0u; s < max(1u, WG / ids.lanes); s++) {
            if beats(best_values[s], best_indices[s], b, b_i) {
                b = best_values[s];
                b_i = best_indices[s];
            }
        }
        OUT[row] = select(b_i, 0u, b_i == NONE);
    }
// #else
    best_values[lid] = best;
    best_indices[lid] = best_i;
    workgroupBarrier();
    for (var stride = WG / 2u; stride > 0u; stride >>= 1u) {
        if lid < stride {
            let v = best_values[lid + stride];
            let i = best_indices[lid + stride];
            if beats(v, i, best_values[lid], best_indices[lid]) {
                best_values[lid] = v;
                best_indices[lid] = i;
            }
        }
        workgroupBarrier();
    }
    if lid == 0u {
        OUT[row] = select(best_indices[0], 0u, best_indices[0] == NONE);
    }
// #endif
}
