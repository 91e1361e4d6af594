// Weight decoder for Q2_K (GGML k-quant, core/src/quant/kquant.rs): 84-byte
// super-blocks of 256 values, `scales: [u8; 16]` (one byte per 16 values: low
// nibble the scale, high nibble the minimum), `qs: [u8; 64]`, then `d: f16`,
// `dmin: f16`. Value 128h + 32s + l (s < 4, l < 32) is (qs[32h + l] >> 2s) & 3;
// value = d * sc * q - dmin * mn. Super-blocks are 4-byte aligned, so every
// field is whole words of W. A piece reads its scale word, one qs word and
// the d/dmin word.
// Entry points: backend-wgpu/src/wgsl/matmul.wgsl (also composed with embedding.wgsl).

@group(0) @binding(1) var<storage, read> W: array<u32>;

const BLOCK_WORDS: u32 = 21u;

fn decode4(row: u32, piece: u32, cols: u32) -> vec4<f32> {
    let base = (row * (cols / 256u) + piece / 64u) * BLOCK_WORDS;
    let e = 4u * (piece % 64u);
    let h = e / 128u;
    let s = (e % 128u) / 32u;
    let l = e % 32u;
    let j = e / 16u;
    let dm = unpack2x16float(W[base + 20u]);
    let sm = (W[base + j / 4u] >> (8u * (j % 4u))) & 0xffu;
    let q = W[base + 4u + 8u * h + l / 4u] >> (2u * s);
    let codes = vec4<u32>(q, q >> 8u, q >> 16u, q >> 24u) & vec4<u32>(3u);
    return (dm.x * f32(sm & 0xfu)) * vec4<f32>(codes) - dm.y * f32(sm >> 4u);
}
