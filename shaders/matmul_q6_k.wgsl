// Weight decoder for Q6_K (GGML k-quant, core/src/quant/kquant.rs): 210-byte
// super-blocks of 256 values, `ql: [u8; 128]`, `qh: [u8; 64]`, `scales:
// [i8; 16]` (one per 16 values), then `d: f16`. Value 128h + 32s + l (s < 4,
// l < 32) has its low nibble in ql[64h + l + 32(s % 2)] (low nibble for
// s < 2, high above) and its top two bits in qh[32h + l] >> 2s; value =
// d * scales[i / 16] * (q - 32). Super-blocks are not 4-byte aligned, so W is
// the raw bytes as a flat u32 array read with byte offsets (every field a
// piece reads starts at an even byte). A piece reads one ql word, one qh
// word, its scale byte and d.
// Entry points: backend-wgpu/src/wgsl/matmul.wgsl (also composed with embedding.wgsl).

@group(0) @binding(1) var<storage, read> W: array<u32>;

const BLOCK_BYTES: u32 = 210u;

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

// The signed byte at any byte offset.
fn i8_at(byte: u32) -> f32 {
    let shift = 8u * (byte & 3u);
    return f32(bitcast<i32>(W[byte >> 2u] << (24u - shift)) >> 24u);
}

fn decode4(row: u32, piece: u32, cols: u32) -> vec4<f32> {
    let base = (row * (cols / 256u) + piece / 64u) * BLOCK_BYTES;
    let e = 4u * (piece % 64u);
    let h = e / 128u;
    let s = (e % 128u) / 32u;
    let l = e % 32u;
    let scale = f16_at(base + 208u) * i8_at(base + 192u + e / 16u);
    let lo = u32_at(base + 64u * h + l + 32u * (s % 2u)) >> (4u * (s / 2u));
    let hi = u32_at(base + 128u + 32u * h + l) >> (2u * s);
    let nib = vec4<u32>(lo, lo >> 8u, lo >> 16u, lo >> 24u) & vec4<u32>(0xfu);
    let top = (vec4<u32>(hi, hi >> 8u, hi >> 16u, hi >> 24u) & vec4<u32>(3u)) << vec4<u32>(4u);
    return scale * (vec4<f32>(nib | top) - 32.0);
}
