// matmul_glu: a gated linear unit from one matmul. W is [gate; up] (2f rows)
// and OUT[t, i] = act(y[t, i]) * y[t, f + i] for y = norm(x) W^T, with the
// optional RMSNorm prologue (P.has_norm) and act SiLU (SwiGLU) or GELU's
// tanh approximation (GeGLU, P.gelu), each as the unfused swiglu.wgsl and
// geglu.wgsl compute it. The generator composes the weight format's decoder,
// backend-wgpu/src/wgsl/matmul_common.wgsl (flags FUSED, NORM, GLU: two weight
// rows per output, gate i and up f + i, summed by the same thread) and the
// matmul entry points (wgsl/matmul.wgsl, or W8A8's) with this epilogue.
// One weight chunk only: the host runs a chunked weight, whose gate and up
// rows may lie in different buffers, unfused.

const SQRT_2_OVER_PI: f32 = 0.7978846;

fn act(g: f32) -> f32 {
    if P.gelu != 0u {
        let u = SQRT_2_OVER_PI * (g + 0.044715 * g * g * g);
        return g / (1.0 + exp(min(-2.0 * u, 80.0)));
    }
    return g / (1.0 + exp(-g));
}

fn emit(t: u32, o: u32, y: vec2<f32>) {
    OUT[t * outputs() + o] = act(y.x) * y.y;
}
