// Weight decoder for Q5_K (GGML k-quant, core/src/quant/kquant.rs): 176-byte
// super-blocks of 256 values, `d: f16`, `dmin: f16`, `scales: [u8; 12]` (as
// Q4_K's), `qh: [u8; 32]`, then `qs: [u8; 128]`. Sub-block j (values
// 32j..32j+32) takes its low four bits as Q4_K does (low nibbles of
// qs[32(j/2)..][..32] for even j, high for odd j) and the fifth bit of value
// 32j + l from bit j of qh[l]; value = d * sc(j) * q - dmin * mn(j). Super-blocks
// are 4-byte aligned, so every field is whole words of W. A piece reads the
// d/dmin word, the scale words it needs, one qh word and one qs word.
// Entry points: backend-wgpu/src/wgsl/matmul.wgsl (also composed with embedding.wgsl).

@group(0) @binding(1) var<storage, read> W: array<u32>;

const BLOCK_WORDS: u32 = 44u;

// Byte `i` (0..4) of a word.
fn byte_of(word: u32, i: u32) -> u32 {
    return (word >> (8u * i)) & 0xffu;
}

// The 6-bit scale and minimum of sub-block j (kquant::scale_min_k4).
fn scale_min(j: u32, base: u32) -> vec2<f32> {
    let s0 = W[base + 1u];
    let s1 = W[base + 2u];
    if j < 4u {
        return vec2<f32>(f32(byte_of(s0, j) & 63u), f32(byte_of(s1, j) & 63u));
    }
    let s2 = byte_of(W[base + 3u], j - 4u);
    let sc = (s2 & 0xfu) | ((byte_of(s0, j - 4u) >> 6u) << 4u);
    let mn = (s2 >> 4u) | ((byte_of(s1, j - 4u) >> 6u) << 4u);
    return vec2<f32>(f32(sc), f32(mn));
}

fn decode4(row: u32, piece: u32, cols: u32) -> vec4<f32> {
    let base = (row * (cols / 256u) + piece / 64u) * BLOCK_WORDS;
    let e = 4u * (piece % 64u);
    let j = e / 32u;
    let l = e % 32u;
    let dm = unpack2x16float(W[base]);
    let sm = scale_min(j, base);
    let q = W[base + 12u + 8u * (j / 2u) + l / 4u] >> (4u * (j % 2u));
    let h = W[base + 4u + l / 4u] >> j;
    let nib = vec4<u32>(q, q >> 8u, q >> 16u, q >> 24u) & vec4<u32>(0xfu);
    let high = (vec4<u32>(h, h >> 8u, h >> 16u, h >> 24u) & vec4<u32>(1u)) << vec4<u32>(4u);
    return (dm.x * sm.x) * vec4<f32>(nib | high) - dm.y * sm.y;
}
