// Weight decoder for F32 matrices: W is the row-major f32 matrix of one chunk.
// Entry points: backend-wgpu/src/wgsl/matmul.wgsl (also composed with embedding.wgsl).

@group(0) @binding(1) var<storage, read> W: array<f32>;

fn decode4(row: u32, piece: u32, cols: u32) -> vec4<f32> {
    let c = 4u * piece;
    let base = row * cols + c;
    if c + 3u < cols {
        return vec4<f32>(W[base], W[base + 1u], W[base + 2u], W[base + 3u]);
    }
    var v = vec4<f32>(0.0);
    for (var i = 0u; i < 4u; i++) {
        if c + i < cols {
            v[i] = W[base + i];
        }
    }
    return v;
}
