// Adds one expert's outputs into the rows routed to it:
// OUT[ROWS[i], :] += w * Y[i, :] for i < count, w the routing weight of
// `expert` among the row's `slots` (0 when the row was not routed to it).
// ROWS holds no row twice, so no two threads write one value. One thread
// per added value.

struct Params {
    count: u32,
    width: u32,
    expert: u32,
    slots: u32,
}

@group(0) @binding(0) var<uniform> P: Params;
@group(0) @binding(1) var<storage, read> Y: array<f32>;
@group(0) @binding(2) var<storage, read> ROWS: array<u32>;
@group(0) @binding(3) var<storage, read> IDS: array<u32>;
@group(0) @binding(4) var<storage, read> WEIGHTS: array<f32>;
@group(0) @binding(5) var<storage, read_write> OUT: array<f32>;

const WG: u32 = 256u;

@compute @workgroup_size(WG)
fn main(ids: Ids, group: Group) {
    let i = group_index(group) * WG + ids.lid;
    if i >= P.count * P.width {
        return;
    }
    let row = ROWS[i / P.width];
    var w = 0.0;
    for (var j = 0u; j < P.slots; j++) {
        if IDS[row * P.slots + j] == P.expert {
            w = WEIGHTS[row * P.slots + j];
        }
    }
    let at = row * P.width + i % P.width;
    OUT[at] = OUT[at] + w * Y[i];
}
