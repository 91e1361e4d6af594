// Mixture-of-Experts routing, per row of LOGITS ([rows, experts + shared_gate]):
// softmax over the first `experts` values, the `k` largest in descending
// order (the lower index first among equals), divided by their sum when
// `normalize`; with `shared_gate`, a last slot routes to expert `experts`
// with weight sigmoid(the row's last value). IDS and WEIGHTS are
// [rows, k + shared_gate]. One thread per row: k * experts comparisons are
// nothing next to the expert matmuls that follow.

struct Params {
    rows: u32,
    experts: u32,
    k: u32,
    normalize: u32,
    shared_gate: u32,
}

@group(0) @binding(0) var<uniform> P: Params;
@group(0) @binding(1) var<storage, read> LOGITS: array<f32>;
@group(0) @binding(2) var<storage, read_write> IDS: array<u32>;
@group(0) @binding(3) var<storage, read_write> WEIGHTS: array<f32>;

const WG: u32 = 64u;
// MAX_EXPERTS_PER_TOKEN of the architecture description.
const MAX_K: u32 = 16u;

@compute @workgroup_size(WG)
fn main(ids: Ids, group: Group) {
    let r = group_index(group) * WG + ids.lid;
    if r >= P.rows {
        return;
    }
    let base = r * (P.experts + P.shared_gate);
    let slots = P.k + P.shared_gate;
    var top = LOGITS[base];
    for (var e = 1u; e < P.experts; e++) {
        top = max(top, LOGITS[base + e]);
    }
    var sum = 0.0;
    for (var e = 0u; e < P.experts; e++) {
        sum += exp(LOGITS[base + e] - top);
    }
    var chosen: array<u32, MAX_K>;
    var chosen_sum = 0.0;
    for (var j = 0u; j < P.k; j++) {
        var best = P.experts;
        for (var e = 0u; e < P.experts; e++) {
            var taken = false;
            for (var i = 0u; i < j; i++) {
                taken = taken || chosen[i] == e;
            }
            if !taken && (best == P.experts || LOGITS[base + e] > LOGITS[base + best]) {
                best = e;
            }
        }
        chosen[j] = best;
        let w = exp(LOGITS[base + best] - top) / sum;
        IDS[r * slots + j] = best;
        WEIGHTS[r * slots + j] = w;
        chosen_sum += w;
    }
    if P.normalize != 0u {
        for (var j = 0u; j < P.k; j++) {
            WEIGHTS[r * slots + j] = WEIGHTS[r * slots + j] / chosen_sum;
        }
    }
    if P.shared_gate != 0u {
        IDS[r * slots + P.k] = P.experts;
        WEIGHTS[r * slots + P.k] = 1.0 / (1.0 + exp(-LOGITS[base + P.experts]));
    }
}
