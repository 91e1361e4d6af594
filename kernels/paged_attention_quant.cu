// paged_attention_quant: causal attention of each query row over its
// sequence's INT8/INT4 cached K/V (slot layout: paged_kv_write_quant.cu;
// INT4 keys are per-channel blocks: paged_kv_write_int4_keys.cu),
// read through the block table and dequantized as it is read, with an online
// softmax. Inputs as paged_attention.cu: q, out [rows, heads * head_dim] f32,
// row_seq, positions [rows], block_tables [seqs, max_blocks]; a row at
// position p sees keys max(0, p - window + 1) ..= p (window 0: no window);
// query head h reads KV head h / (heads / kv_heads).
//
// One warp per (head, row): grid (heads, rows). Lane l scores key tile + l of
// each 32-key tile, the tile's softmax folds into the running state, then
// every lane accumulates its dims l, l + 32, ... over the tile's values.

#include "common.cuh"

#define MAX_HEAD_DIM 256
#define DIMS_PER_LANE (MAX_HEAD_DIM / WARP)
#define KV_GROUP 32
#define NEG_INF (-__int_as_float(0x7f800000))

// Mirror of `QuantAttentionShape` in backend-cuda/src/backend.rs.
struct QuantAttentionShape {
    u32 rows, heads, kv_heads, head_dim, block_size, max_blocks, window;
    float scale;
    u32 groups_per_head, bits, slot_words;
    // INT4: kv_heads * head_dim, keys in per-channel blocks; 0: keys in slots.
    u32 key_channels;
};

// Element e (of the kv_heads * head_dim row) of the slot starting at `slot`.
__device__ __forceinline__ float dequantize(const u32* __restrict__ slot, const QuantAttentionShape& s, u32 e) {
    const u32 head = e / s.head_dim, d = e % s.head_dim;
    const u32 g = head * s.groups_per_head + d / KV_GROUP, i = d % KV_GROUP;
    const u32 per_word = 32u / s.bits;
    const u32 q = (__ldg(slot + g * s.bits + i / per_word) >> ((i % per_word) * s.bits)) & ((1u << s.bits) - 1u);
    float scale, zero;
    half2_to_f32<FMT_F16>(__ldg(slot + s.kv_heads * s.groups_per_head * s.bits + g), scale, zero);
    return fmaf((float)q, scale, zero);
}

// Channel e of the token in `slot` of an INT4 key block.
__device__ __forceinline__ float dequantize_key_block(const u32* __restrict__ k_cache, const QuantAttentionShape& s,
                                                      u64 slot, u32 e) {
    const u32 per_token = (s.key_channels + 7u) / 8u;
    const u32* block = k_cache + slot / s.block_size * (u64)(s.block_size * per_token + s.key_channels);
    const u32 q = (__ldg(block + slot % s.block_size * per_token + e / 8u) >> (e % 8u * 4u)) & 15u;
    float scale, zero;
    half2_to_f32<FMT_F16>(__ldg(block + s.block_size * per_token + e), scale, zero);
    return fmaf((float)q, scale, zero);
}

extern "C" __global__ void paged_attention_quant(const float* __restrict__ q, const u32* __restrict__ k_cache,
                                                 const u32* __restrict__ v_cache, const u32* __restrict__ row_seq,
                                                 const u32* __restrict__ positions,
                                                 const u32* __restrict__ block_tables, QuantAttentionShape s,
                                                 float* __restrict__ out) {
    __shared__ float qs[MAX_HEAD_DIM];
    const u32 h = blockIdx.x, r = blockIdx.y, lane = threadIdx.x;
    const u32 hd = s.head_dim;
    const u32 kv_base = h / (s.heads / s.kv_heads) * hd;
    const u32* table_row = block_tables + (u64)row_seq[r] * s.max_blocks;
    const u64 head_row = (u64)r * s.heads + h;

    for (u32 d = lane; d < hd; d += WARP) qs[d] = q[head_row * hd + d] * s.scale;
    __syncwarp();

    const u32 pos = positions[r];
    const u32 lo = (s.window != 0 && pos + 1 > s.window) ? pos + 1 - s.window : 0;
    const u32 hi = pos + 1;  // exclusive

    float m = NEG_INF, l = 0.0f, acc[DIMS_PER_LANE];
#pragma unroll
    for (int c = 0; c < DIMS_PER_LANE; ++c) acc[c] = 0.0f;
    for (u32 tile = lo; tile < hi; tile += WARP) {
        const u32 j = tile + lane;
        long long slot = -1;
        if (j < hi && j / s.block_size < s.max_blocks)
            slot = (long long)table_row[j / s.block_size] * s.block_size + j % s.block_size;
        float score = NEG_INF;
        if (slot >= 0 && s.key_channels != 0) {
            score = 0.0f;
            for (u32 d = 0; d < hd; ++d)
                score = fmaf(qs[d], dequantize_key_block(k_cache, s, (u64)slot, kv_base + d), score);
        } else if (slot >= 0) {
            const u32* key = k_cache + (u64)slot * s.slot_words;
            score = 0.0f;
            for (u32 d = 0; d < hd; ++d) score = fmaf(qs[d], dequantize(key, s, kv_base + d), score);
        }
        const float tile_max = warp_max(score);
        if (tile_max == NEG_INF) continue;  // the whole tile is masked
        const float new_m = fmaxf(m, tile_max);
        const float correction = expf(m - new_m);  // 0 on the first tile (m was -inf)
        const float p = score == NEG_INF ? 0.0f : expf(score - new_m);
        l = l * correction + warp_sum(p);
        m = new_m;
#pragma unroll
        for (int c = 0; c < DIMS_PER_LANE; ++c) acc[c] *= correction;
        const u32 valid = min(hi - tile, (u32)WARP);
        for (u32 jj = 0; jj < valid; ++jj) {
            const float pj = __shfl_sync(FULL_MASK, p, jj);
            const long long slot_j = __shfl_sync(FULL_MASK, slot, jj);
            if (slot_j < 0) continue;
            const u32* value = v_cache + (u64)slot_j * s.slot_words;
#pragma unroll
            for (int c = 0; c < DIMS_PER_LANE; ++c) {
                const u32 d = lane + WARP * c;
                if (d < hd) acc[c] = fmaf(pj, dequantize(value, s, kv_base + d), acc[c]);
            }
        }
    }
#pragma unroll
    for (int c = 0; c < DIMS_PER_LANE; ++c) {
        const u32 d = lane + WARP * c;
        if (d < hd) out[head_row * hd + d] = l > 0.0f ? acc[c] / l : 0.0f;
    }
}
