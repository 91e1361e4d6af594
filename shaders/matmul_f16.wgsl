// Weight decoder for F16 matrices (IEEE halves, row-major, rows not padded).
// With shader-f16 the halves are read as `f16` directly; without it they are
// read as packed u32 pairs and unpacked with unpack2x16float (the bits are the same).
// Entry points: backend-wgpu/src/wgsl/matmul.wgsl (also composed with embedding.wgsl).

// #if F16
@group(0) @binding(1) var<storage, read> W: array<f16>;

fn half_at(e: u32) -> f32 {
    return f32(W[e]);
}
// #else
@group(0) @binding(1) var<storage, read> W: array<u32>;

fn half_at(e: u32) -> f32 {
    return unpack2x16float(W[e >> 1u])[e & 1u];
}
// #endif

fn decode4(row: u32, piece: u32, cols: u32) -> vec4<f32> {
    let c = 4u * piece;
    let base = row * cols + c;
    var v = vec4<f32>(0.0);
    for (var i = 0u; i < 4u; i++) {
        if c + i < cols {
            v[i] = half_at(base + i);
        }
    }
    return v;
}
