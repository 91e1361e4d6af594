// kv_key_bounds: key bounds for sparse attention's block selection
// (select_kv_blocks.cu), kept by every paged KV write once the cache tracks
// them: bounds ([num_blocks, kv_heads, 2, head_dim] f32: per block and KV
// head, each channel's minimum, then its maximum) take in row t of k ([rows,
// channels] f32, channels = kv_heads * head_dim) written to slot slots[t]. A
// row at a block's first slot restarts the block's bounds; the others widen
// them.
//
// Rows of one block are consecutive in a call (a sequence appends its tokens
// in order). One thread per (row, channel): only the first row of a run of
// rows in one block works, folding the run's rows in order, so no two
// threads touch one bound. Slots past the cache are skipped.

#include "common.cuh"

#define NO_BLOCK 0xffffffffu

__device__ __forceinline__ u32 bounds_block_of(const u32* __restrict__ slots, u32 t, u32 block_size,
                                               u32 num_slots) {
    const u32 slot = slots[t];
    return slot < num_slots ? slot / block_size : NO_BLOCK;
}

extern "C" __global__ void kv_key_bounds(const float* __restrict__ k, const u32* __restrict__ slots, u32 rows,
                                         u32 channels, u32 head_dim, u32 block_size, u32 num_slots,
                                         float* __restrict__ bounds) {
    const u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x;
    if (i >= (u64)rows * channels) return;
    const u32 t = (u32)(i / channels), c = (u32)(i % channels);
    const u32 block = bounds_block_of(slots, t, block_size, num_slots);
    if (block == NO_BLOCK || (t > 0 && bounds_block_of(slots, t - 1, block_size, num_slots) == block)) return;
    const u32 kv_heads = channels / head_dim, g = c / head_dim;
    float* at = bounds + ((u64)block * kv_heads + g) * 2u * head_dim + c % head_dim;
    float lo = at[0], hi = at[head_dim];
    for (u32 r = t; r < rows && bounds_block_of(slots, r, block_size, num_slots) == block; ++r) {
        const float x = k[(u64)r * channels + c];
        if (slots[r] % block_size == 0u) {
            lo = x;
            hi = x;
        } else {
            lo = fminf(lo, x);
            hi = fmaxf(hi, x);
        }
    }
    at[0] = lo;
    at[head_dim] = hi;
}
