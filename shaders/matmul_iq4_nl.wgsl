// Weight decoder for IQ4_NL (GGML): Q4_0's 18-byte blocks of 32 values,
// `d: f16` then `qs: [u8; 16]`; values 0..16 are the low nibbles of qs,
// 16..32 the high nibbles, and a nibble indexes a fixed non-uniform table:
// value = d * IQ4NL[nibble]. Blocks are not 4-byte aligned, so W is the raw
// bytes as a flat u32 array read with byte offsets (fields start at even bytes).
// Entry points: backend-wgpu/src/wgsl/matmul.wgsl (also composed with embedding.wgsl).

@group(0) @binding(1) var<storage, read> W: array<u32>;

const BLOCK_BYTES: u32 = 18u;

// GGML's `kvalues_iq4nl` (tandem_core::quant::IQ4NL_VALUES).
const IQ4NL = array<f32, 16>(
    -127.0, -104.0, -83.0, -65.0, -49.0, -35.0, -22.0, -10.0,
    1.0, 13.0, 25.0, 38.0, 53.0, 69.0, 89.0, 113.0,
);

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
    var table = IQ4NL;
    return d * vec4<f32>(
        table[q & 0xfu],
        table[(q >> 8u) & 0xfu],
        table[(q >> 16u) & 0xfu],
        table[(q >> 24u) & 0xfu],
    );
}
