// Weight decoder for Q5_1 (GGML): 24-byte blocks of 32 values, `d: f16`,
// `m: f16`, `qh: u32` (bit i the fifth bit of value i), then `qs: [u8; 16]`;
// values 0..16 take the low nibbles of qs, 16..32 the high nibbles; value =
// d * q5 + m. Blocks are 4-byte aligned, so every field is whole words of W.
// Entry points: backend-wgpu/src/wgsl/matmul.wgsl (also composed with embedding.wgsl).

@group(0) @binding(1) var<storage, read> W: array<u32>;

const BLOCK_WORDS: u32 = 6u;

fn decode4(row: u32, piece: u32, cols: u32) -> vec4<f32> {
    let base = (row * (cols / 32u) + piece / 8u) * BLOCK_WORDS;
    let dm = unpack2x16float(W[base]);
    // Piece `sub` is values 4sub..4sub+4: low nibbles of qs word sub for
    // sub < 4, high nibbles of word sub - 4 above; fifth bits 4sub..4sub+4 of qh.
    let sub = piece % 8u;
    let q = W[base + 2u + sub % 4u] >> (4u * (sub / 4u));
    let h = W[base + 1u] >> (4u * sub);
    let nib = vec4<u32>(q, q >> 8u, q >> 16u, q >> 24u) & vec4<u32>(0xfu);
    let high = (vec4<u32>(h, h >> 1u, h >> 2u, h >> 3u) & vec4<u32>(1u)) << vec4<u32>(4u);
    return dm.x * vec4<f32>(nib | high) + dm.y;
}
