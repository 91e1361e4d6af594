// Weight decoder for BF16 matrices: each value is the upper half of an f32,
// stored as packed u32 pairs (row-major, rows not padded).
// Entry points: backend-wgpu/src/wgsl/matmul.wgsl (also composed with embedding.wgsl).

@group(0) @binding(1) var<storage, read> W: array<u32>;

fn bf16_at(e: u32) -> f32 {
    let w = W[e >> 1u];
    return bitcast<f32>(select(w << 16u, w & 0xffff0000u, (e & 1u) == 1u));
}

fn decode4(row: u32, piece: u32, cols: u32) -> vec4<f32> {
    let c = 4u * piece;
    let base = row * cols + c;
    var v = vec4<f32>(0.0);
    for (var i = 0u; i < 4u; i++) {
        if c + i < cols {
            v[i] = bf16_at(base + i);
        }
    }
    return v;
}
