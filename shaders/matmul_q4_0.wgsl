// Weight decoder for Q4_0 (GGML): 18-byte blocks of 32 values, `d: f16` then
// `qs: [u8; 16]`; values 0..16 are the low nibbles of qs, 16..32 the high
// nibbles, value = d * (nibble - 8). Blocks are not 4-byte aligned, so W is the
// raw bytes as a flat u32 array read with byte offsets (fields start at even bytes).
// Entry points: backend-wgpu/src/wgsl/matmul.wgsl (also composed with embedding.wgsl).

@group(0) @binding(1) var<storage, read> W: array<u32>;

const BLOCK_BYTES: u32 = 18u;

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
    // Pieces 0..4 are low nibbles of qs words 0..4, pieces 4..8 their high nibbles.
    let sub = piece % 8u;
    let q = u32_at(base + 2u + 4u * (sub % 4u)) >> (4u * (sub / 4u));
    let nib = vec4<u32>(q, q >> 8u, q >> 16u, q >> 24u) & vec4<u32>(0xfu);
    return d * (vec4<f32>(nib) - 8.0);
}
