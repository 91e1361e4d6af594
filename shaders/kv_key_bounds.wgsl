// Key bounds for sparse attention's block selection (select_kv_blocks.wgsl),
// kept by every paged KV write once the cache tracks them: BOUNDS
// ([num_blocks, kv_heads, 2, head_dim] f32: per block and KV head, each
// channel's minimum, then its maximum) take in row t of K ([rows, channels],
// channels = kv_heads * head_dim) written to slot SLOTS[t]. A row at a
// block's first slot restarts the block's bounds; the others widen them.
//
// Rows of one block are consecutive in a call (a sequence appends its
// tokens in order). One thread per (row, channel): only the first row of a
// run of rows in one block works, folding the run's rows in order, so no
// two threads touch one bound. Slots past the cache are skipped.

struct Params {
    rows: u32,
    channels: u32,
    head_dim: u32,
    block_size: u32,
    num_slots: u32,
}

@group(0) @binding(0) var<uniform> P: Params;
@group(0) @binding(1) var<storage, read> K: array<f32>;
@group(0) @binding(2) var<storage, read> SLOTS: array<u32>;
@group(0) @binding(3) var<storage, read_write> BOUNDS: array<f32>;

const WG: u32 = 64u;
// Block holding a slot, or NO_BLOCK for a slot past the cache.
const NO_BLOCK: u32 = 0xffffffffu;

fn block_of(t: u32) -> u32 {
    let slot = SLOTS[t];
    if slot >= P.num_slots {
        return NO_BLOCK;
    }
    return slot / P.block_size;
}

@compute @workgroup_size(WG)
fn main(ids: Ids, group: Group) {
    let i = group_index(group) * WG + ids.lid;
    if i >= P.rows * P.channels {
        return;
    }
    let t = i / P.channels;
    let c = i % P.channels;
    let block = block_of(t);
    if block == NO_BLOCK || (t > 0u && block_of(t - 1u) == block) {
        return;
    }
    let kv_heads = P.channels / P.head_dim;
    let g = c / P.head_dim;
    let at = (block * kv_heads + g) * 2u * P.head_dim + c % P.head_dim;
    var lo = BOUNDS[at];
    var hi = BOUNDS[at + P.head_dim];
    for (var r = t; r < P.rows && block_of(r) == block; r++) {
        let x = K[r * P.channels + c];
        if SLOTS[r] % P.block_size == 0u {
            lo = x;
            hi = x;
        } else {
            lo = min(lo, x);
            hi = max(hi, x);
        }
    }
    BOUNDS[at] = lo;
    BOUNDS[at + P.head_dim] = hi;
}
