// matmul_residual: OUT[t, r] += x[t] . W[r], a projection whose epilogue adds
// it into the residual stream (O and down). The generator composes the weight
// format's decoder, backend-wgpu/src/wgsl/matmul_common.wgsl (flag FUSED) and
// the matmul entry points (wgsl/matmul.wgsl, or W8A8's) with this epilogue;
// one dispatch per weight chunk, each adding its own features.

fn emit(t: u32, o: u32, y: vec2<f32>) {
    OUT[t * P.n + P.row_start + o] += y.x;
}
