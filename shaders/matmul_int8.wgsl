// Weight decoder for INT8 (Tandem's per-output-channel INT8, W8A16): each
// row is its scale `s: f32` then `cols` signed bytes, value = s * q. `cols`
// is a multiple of 32, so rows are whole words of the flat u32 array W.
// W8A8 shares these bytes: matmul_w8a8.wgsl is placed after this file and
// uses `row_scale` and `quants4`.
// Entry points: backend-wgpu/src/wgsl/matmul.wgsl (also composed with embedding.wgsl).

@group(0) @binding(1) var<storage, read> W: array<u32>;

// Words per row: the scale, then the quants.
fn row_words(cols: u32) -> u32 {
    return 1u + cols / 4u;
}

fn row_scale(row: u32, cols: u32) -> f32 {
    return bitcast<f32>(W[row * row_words(cols)]);
}

// The signed quants of columns `4 * piece .. 4 * piece + 4`.
fn quants4(row: u32, piece: u32, cols: u32) -> vec4<i32> {
    let q = W[row * row_words(cols) + 1u + piece];
    // Sign-extend each byte: move it to the top, then arithmetic shift down.
    return bitcast<vec4<i32>>(vec4<u32>(q << 24u, q << 16u, q << 8u, q)) >> vec4<u32>(24u);
}

fn decode4(row: u32, piece: u32, cols: u32) -> vec4<f32> {
    return row_scale(row, cols) * vec4<f32>(quants4(row, piece, cols));
}
