// Rotary position embedding, in place: for each row t, head h and pair i of
// the leading `rotary_dim` dimensions, rotate (x0, x1) by the angle
// POSITIONS[t] * INV_FREQ[i]. Pairs are (2i, 2i+1) for the interleaved style
// (GGUF Llama) and (i, i + rotary_dim/2) for NeoX (Hugging Face, Qwen2).
// One thread per pair.

struct Params {
    rows: u32,
    heads: u32,
    head_dim: u32,
    rotary_dim: u32,
    // 1 for NeoX, 0 for interleaved.
    neox: u32,
}

@group(0) @binding(0) var<uniform> P: Params;
@group(0) @binding(1) var<storage, read_write> X: array<f32>;
@group(0) @binding(2) var<storage, read> POSITIONS: array<u32>;
@group(0) @binding(3) var<storage, read> INV_FREQ: array<f32>;

const WG: u32 = 64u;

// 2*pi split Cody-Waite style: TWO_PI_HI has few enough significant bits
// that n * TWO_PI_HI is exact for the n of any realistic position, so the
// reduction to [-pi, pi] keeps the accuracy of the angle itself; GPU sin/cos
// are only accurate on that interval.
const TWO_PI_HI: f32 = 6.28125;
const TWO_PI_LO: f32 = 0.0019353071795864769;

fn reduce_angle(a: f32) -> f32 {
    let n = round(a * 0.15915494309189535);
    return (a - n * TWO_PI_HI) - n * TWO_PI_LO;
}

@compute @workgroup_size(WG)
fn main(ids: Ids, group: Group) {
    let half_rot = P.rotary_dim / 2u;
    let i = group_index(group) * WG + ids.lid;
    if i >= P.rows * P.heads * half_rot {
        return;
    }
    let pair = i % half_rot;
    let head = (i / half_rot) % P.heads;
    let t = i / (half_rot * P.heads);
    let base = (t * P.heads + head) * P.head_dim;
    var i0 = base + 2u * pair;
    var i1 = i0 + 1u;
    if P.neox != 0u {
        i0 = base + pair;
        i1 = i0 + half_rot;
    }
    let angle = reduce_angle(f32(POSITIONS[t]) * INV_FREQ[pair]);
    let c = cos(angle);
    let s = sin(angle);
    let x0 = X[i0];
    let x1 = X[i1];
    X[i0] = x0 * c - x1 * s;
    X[i1] = x0 * s + x1 * c;
}
