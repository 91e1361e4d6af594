// Fused SwiGLU: OUT = silu(GATE) * UP = GATE / (1 + exp(-GATE)) * UP, elementwise.

struct Params {
    len: u32,
}

@group(0) @binding(0) var<uniform> P: Params;
@group(0) @binding(1) var<storage, read> GATE: array<f32>;
@group(0) @binding(2) var<storage, read> UP: array<f32>;
@group(0) @binding(3) var<storage, read_write> OUT: array<f32>;

const WG: u32 = 256u;

@compute @workgroup_size(WG)
fn main(ids: Ids, group: Group) {
    let i = group_index(group) * WG + ids.lid;
    if i >= P.len {
        return;
    }
    let g = GATE[i];
    OUT[i] = g / (1.0 + exp(-g)) * UP[i];
}
