// Weight decoder for INT4_G64 and INT4_G128 (Tandem's group INT4): blocks
// of GROUP values, `d: f16`, `m: f16`, then GROUP / 2 bytes of nibbles in
// runs of 16 bytes per 32 values, each run in Q4_1's order (values 0..16 of
// the run are the low nibbles, 16..32 the high nibbles); value = d * nibble
// + m. Blocks are 4-byte aligned, so every field is whole words of W. The
// generator sets INT4_G128 for groups of 128.
// Entry points: backend-wgpu/src/wgsl/matmul.wgsl (also composed with embedding.wgsl).

@group(0) @binding(1) var<storage, read> W: array<u32>;

// #if INT4_G128
const GROUP: u32 = 128u;
// #else
const GROUP: u32 = 64u;
// #endif
const BLOCK_WORDS: u32 = 1u + GROUP / 8u;
const PIECES_PER_GROUP: u32 = GROUP / 4u;

fn decode4(row: u32, piece: u32, cols: u32) -> vec4<f32> {
    let base = (row * (cols / GROUP) + piece / PIECES_PER_GROUP) * BLOCK_WORDS;
    let dm = unpack2x16float(W[base]);
    // Within a run of 8 pieces: pieces 0..4 are low nibbles of its words
    // 0..4, pieces 4..8 their high nibbles.
    let in_group = piece % PIECES_PER_GROUP;
    let run = in_group / 8u;
    let sub = in_group % 8u;
    let q = W[base + 1u + 4u * run + sub % 4u] >> (4u * (sub / 4u));
    let nib = vec4<u32>(q, q >> 8u, q >> 16u, q >> 24u) & vec4<u32>(0xfu);
    return dm.x * vec4<f32>(nib) + dm.y;
}
