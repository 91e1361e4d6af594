// Weight decoder for Q8_0 (GGML): 34-byte blocks of 32 values, `d: f16`
// then `qs: [i8; 32]`, value = d * qs[i]. Blocks are not 4-byte aligned, so
// W is the raw bytes as a flat u32 array read with byte offsets; every field
// starts at an even byte, so a field is one word or the halves of two.
// Entry points: backend-wgpu/src/wgsl/matmul.wgsl (also composed with embedding.wgsl).

@group(0) @binding(1) var<storage, read> W: array<u32>;

const BLOCK_BYTES: u32 = 34u;

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
    let q = u32_at(base + 2u + 4u * (piece % 8u));
    // Sign-extend each byte: move it to the top, then arithmetic shift down.
    let s = bitcast<vec4<i32>>(vec4<u32>(q << 24u, q << 16u, q << 8u, q)) >> vec4<u32>(24u);
    return d * vec4<f32>(s);
}
