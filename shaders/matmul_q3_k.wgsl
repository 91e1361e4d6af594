// Weight decoder for Q3_K (GGML k-quant, core/src/quant/kquant.rs): 110-byte
// super-blocks of 256 values, `hmask: [u8; 32]`, `qs: [u8; 64]`, `scales:
// [u8; 12]` (sixteen 6-bit scales, one per 16 values), then `d: f16`. Value
// 128h + 32s + l (s < 4, l < 32) has two low bits (qs[32h + l] >> 2s) & 3 and
// a high bit (hmask[l] >> (4h + s)) & 1; value = d * (sc - 32) * (q - 4).
// Scale j (kquant::q3k_scales): low nibble of byte j (j < 8) or high nibble
// of byte j - 8, two top bits (byte 8 + j % 4) >> 2(j / 4). Super-blocks are
// not 4-byte aligned, so W is the raw bytes as a flat u32 array read with
// byte offsets (every word a piece reads starts at an even byte). A piece
// reads one qs word, one hmask word, its two scale bytes and d.
// Entry points: backend-wgpu/src/wgsl/matmul.wgsl (also composed with embedding.wgsl).

@group(0) @binding(1) var<storage, read> W: array<u32>;

const BLOCK_BYTES: u32 = 110u;

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

// The byte at any byte offset.
fn u8_at(byte: u32) -> u32 {
    return (W[byte >> 2u] >> (8u * (byte & 3u))) & 0xffu;
}

// Scale j of 16, in 0..64 (to be offset by -32), of the scales at `at`.
fn scale_of(j: u32, at: u32) -> u32 {
    let low = (u8_at(at + j % 8u) >> (4u * (j / 8u))) & 0xfu;
    let high = (u8_at(at + 8u + j % 4u) >> (2u * (j / 4u))) & 3u;
    return low | (high << 4u);
}

fn decode4(row: u32, piece: u32, cols: u32) -> vec4<f32> {
    let base = (row * (cols / 256u) + piece / 64u) * BLOCK_BYTES;
    let e = 4u * (piece % 64u);
    let h = e / 128u;
    let s = (e % 128u) / 32u;
    let l = e % 32u;
    let scale = f16_at(base + 108u) * (f32(scale_of(e / 16u, base + 96u)) - 32.0);
    let lo = u32_at(base + 32u + 32u * h + l) >> (2u * s);
    let hm = u32_at(base + l) >> (4u * h + s);
    let low = vec4<u32>(lo, lo >> 8u, lo >> 16u, lo >> 24u) & vec4<u32>(3u);
    let high = (vec4<u32>(hm, hm >> 8u, hm >> 16u, hm >> 24u) & vec4<u32>(1u)) << vec4<u32>(2u);
    return scale * (vec4<f32>(low | high) - 4.0);
}
