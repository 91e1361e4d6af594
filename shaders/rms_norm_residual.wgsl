// Residual add fused with RMSNorm: RESIDUAL[t, :] += DELTA[t, :], then
// OUT[t, :] = RESIDUAL[t, :] / sqrt(mean(RESIDUAL[t, :]^2) + eps) * WEIGHT.
// One workgroup per row; each thread reads back only the elements it wrote,
// so no barrier is needed between the two passes beyond the reduction's.

struct Params {
    rows: u32,
    dim: u32,
    eps: f32,
}

@group(0) @binding(0) var<uniform> P: Params;
@group(0) @binding(1) var<storage, read_write> RESIDUAL: array<f32>;
@group(0) @binding(2) var<storage, read> DELTA: array<f32>;
@group(0) @binding(3) var<storage, read> WEIGHT: array<f32>;
@group(0) @binding(4) var<storage, read_write> OUT: array<f32>;

const WG: u32 = 256u;

@compute @workgroup_size(WG)
fn main(ids: Ids, group: Group) {
    let row = group_index(group);
    if row >= P.rows {
        return;
    }
    let base = row * P.dim;
    var squares = 0.0;
    for (var i = ids.lid; i < P.dim; i += WG) {
        let v = RESIDUAL[base + i] + DELTA[base + i];
        RESIDUAL[base + i] = v;
        squares += v * v;
    }
    let total = reduce_sum(squares, lane_of(ids));
    let inv_rms = 1.0 / sqrt(total / f32(P.dim) + P.eps);
    for (var i = ids.lid; i < P.dim; i += WG) {
        OUT[base + i] = RESIDUAL[base + i] * inv_rms * WEIGHT[i];
    }
}
