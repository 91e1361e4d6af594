// Fused GeGLU: OUT = gelu(GATE) * UP, elementwise, with GELU's tanh approximation
// 0.5 g (1 + tanh(u)), u = sqrt(2/pi) (g + 0.044715 g^3), computed as the equal
// g / (1 + exp(-2u)). The exponent is clamped so it never overflows to inf.

struct Params {
    len: u32,
}

@group(0) @binding(0) var<uniform> P: Params;
@group(0) @binding(1) var<storage, read> GATE: array<f32>;
@group(0) @binding(2) var<storage, read> UP: array<f32>;
@group(0) @binding(3) var<storage, read_write> OUT: array<f32>;

const WG: u32 = 256u;
const SQRT_2_OVER_PI: f32 = 0.7978846;

@compute @workgroup_size(WG)
fn main(ids: Ids, group: Group) {
    let i = group_index(group) * WG + ids.lid;
    if i >= P.len {
        return;
    }
    let g = GATE[i];
    let u = SQRT_2_OVER_PI * (g + 0.044715 * g * g * g);
    OUT[i] = g / (1.0 + exp(min(-2.0 * u, 80.0))) * UP[i];
}
