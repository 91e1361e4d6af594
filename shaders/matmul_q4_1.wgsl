// Weight decoder for Q4_1 (GGML): 20-byte blocks of 32 values, `d: f16`,
// `m: f16`, then `qs: [u8; 16]`; values 0..16 are the low nibbles of qs,
// 16..32 the high nibbles, value = d * nibble + m. Blocks are 4-byte aligned,
// so every field is whole words of the flat u32 array W.
// Entry points: backend-wgpu/src/wgsl/matmul.wgsl (also composed with embedding.wgsl).

@group(0) @binding(1) var<storage, read> W: array<u32>;

const BLOCK_WORDS: u32 = 5u;

fn decode4(row: u32, piece: u32, cols: u32) -> vec4<f32> {
    let base = (row * (cols / 32u) + piece / 8u) * BLOCK_WORDS;
    let dm = unpack2x16float(W[base]);
    // Pieces 0..4 are low nibbles of qs words 0..4, pieces 4..8 their high nibbles.
    let sub = piece % 8u;
    let q = W[base + 1u + sub % 4u] >> (4u * (sub / 4u));
    let nib = vec4<u32>(q, q >> 8u, q >> 16u, q >> 24u) & vec4<u32>(0xfu);
    return dm.x * vec4<f32>(nib) + dm.y;
}
