// Weight decoder for Q5_0 (GGML): 22-byte blocks of 32 values, `d: f16`,
// `qh: u32` (bit i the fifth bit of value i), then `qs: [u8; 16]`; values
// 0..16 take the low nibbles of qs, 16..32 the high nibbles; value =
// d * (q5 - 16). Blocks are not 4-byte aligned, so W is the raw bytes as a
// flat u32 array read with byte offsets (every field starts at an even byte).
// Entry points: backend-wgpu/src/wgsl/matmul.wgsl (also composed with embedding.wgsl).

@group(0) @binding(1) var<storage, read> W: array<u32>;

const BLOCK_BYTES: u32 = 22u;

// The 4 bytes at an even byte offset, little-endian.
fn u32_at(byte: u32) -> u32 {
    let w = byte >> 2u;
    if (byte & 3u) == 0u {
        return W[w];
    }
    return (W[w] >> 16u) | (W[w + 1u] << 16u);
}

// The f16 at an even byte offset.
fn f16_at(byte: u32) -> f32 {
    return unpack2x16float(W[byte >> 2u] >> ((byte & 2u) * 8u)).x;
}

fn decode4(row: u32, piece: u32, cols: u32) -> vec4<f32> {
    let base = (row * (cols / 32u) + piece / 8u) * BLOCK_BYTES;
    let d = f16_at(base);
    // Piece `sub` is values 4sub..4sub+4: low nibbles of qs word sub for
    // sub < 4, high nibbles of word sub - 4 above; fifth bits 4sub..4sub+4 of qh.
    let sub = piece % 8u;
    let q = u32_at(base + 6u + 4u * (sub % 4u)) >> (4u * (sub / 4u));
    let h = u32_at(base + 2u) >> (4u * sub);
    let nib = vec4<u32>(q, q >> 8u, q >> 16u, q >> 24u) & vec4<u32>(0xfu);
    let high = (vec4<u32>(h, h >> 1u, h >> 2u, h >> 3u) & vec4<u32>(1u)) << vec4<u32>(4u);
    return d * (vec4<f32>(nib | high) - 16.0);
}
