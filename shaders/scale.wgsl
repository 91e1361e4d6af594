// X *= FACTOR over the first LEN elements, in place (Gemma's embedding scale).

struct Params {
    len: u32,
    factor: f32,
}

@group(0) @binding(0) var<uniform> P: Params;
@group(0) @binding(1) var<storage, read_write> X: array<f32>;

const WG: u32 = 256u;

@compute @workgroup_size(WG)
fn main(ids: Ids, group: Group) {
    let i = group_index(group) * WG + ids.lid;
    if i >= P.len {
        return;
    }
    X[i] = X[i] * P.factor;
}
