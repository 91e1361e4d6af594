// paged_attention_quant: causal attention of each query row over its
// sequence's INT8/INT4 cached K/V (slot layout: paged_kv_write_quant.cu;
// INT4 keys are per-channel blocks: paged_kv_write_int4_keys.cu),
// read through the block table and dequantized as it is read, with an online
// softmax. Inputs as paged_attention.cu: q, out [rows, heads * head_dim] f32,
// row_seq, positions [rows], block_tables [seqs, max_blocks] (with
// head_tables, [seqs, kv_heads, max_blocks]: KV head g of sequence seq reads
// table seq * kv_heads + g); a row at position p sees keys
// max(0, p - window + 1) ..= p (window 0: no window); query head h reads KV
// head h / (heads / kv_heads).
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
    // 1: one block table per sequence and KV head; 0: one per sequence.
    u32 head_tables;
    // The values' bits and words per slot.
    u32 groups_per_head, bits, slot_words;
    // INT4, INT2: kv_heads * head_dim, keys in per-channel blocks; 0: keys in
    // slots. Either way at their own bits (and words per slot).
    u32 key_channels, key_bits, key_slot_words;
};

// Element e (of the kv_heads * head_dim row) of the slot starting at `slot`,
// `bits` per code.
__device__ __forceinline__ float dequantize(const u32* __restrict__ slot, const QuantAttentionShape& s, u32 bits,
                                            u32 e) {
    const u32 head = e / s.head_dim, d = e % s.head_dim;
    const u32 g = head * s.groups_per_head + d / KV_GROUP, i = d % KV_GROUP;
    const u32 per_word = 32u / bits;
    const u32 q = (__ldg(slot + g * bits + i / per_word) >> ((i % per_word) * bits)) & ((1u << bits) - 1u);
    float scale, zero;
    half2_to_f32<FMT_F16>(__ldg(slot + s.kv_heads * s.groups_per_head * bits + g), scale, zero);
    return fmaf((float)q, scale, zero);
}

// Channel e of the token in `slot` of an INT4 or INT2 key block.
__device__ __forceinline__ float dequantize_key_block(const u32* __restrict__ k_cache, const QuantAttentionShape& s,
                                                      u64 slot, u32 e) {
    const u32 per_word = 32u / s.key_bits;
    const u32 per_token = (s.key_channels + per_word - 1u) / per_word;
    const u32* block = k_cache + slot / s.block_size * (u64)(s.block_size * per_token + s.key_channels);
    const u32 q = (__ldg(block + slot % s.block_size * per_token + e / per_word) >> (e % per_word * s.key_bits)) &
                  ((1u << s.key_bits) - 1u);
    float scale, zero;
    half2_to_f32<FMT_F16>(__ldg(block + s.block_size * per_token + e), scale, zero);
    return fmaf((float)q, scale, zero);
}

// A block-table entry of an evicted block (tandem_core::kv::EVICTED_BLOCK).
#define EVICTED_BLOCK 0xffffffffu

// The block table KV head g of sequence seq reads.
__device__ __forceinline__ const u32* table_of(const u32* block_tables, u32 seq, u32 g,
                                               const QuantAttentionShape& s) {
    const u64 table = s.head_tables ? (u64)seq * s.kv_heads + g : (u64)seq;
    return block_tables + table * s.max_blocks;
}

// The cache slot of key position j of a sequence, or -1 past its block table
// or in an evicted block.
__device__ __forceinline__ long long key_slot(const u32* table_row, u32 j, const QuantAttentionShape& s) {
    const u32 block = j / s.block_size;
    if (block >= s.max_blocks) return -1;
    const u32 physical = table_row[block];
    if (physical == EVICTED_BLOCK) return -1;
    return (long long)physical * s.block_size + j % s.block_size;
}

// Scaled q (in `qs`) dot the key in `slot`, KV head elements from `kv_base`.
__device__ __forceinline__ float key_score(const float* qs, const u32* __restrict__ k_cache,
                                           const QuantAttentionShape& s, long long slot, u32 kv_base) {
    float score = 0.0f;
    if (s.key_channels != 0) {
        for (u32 d = 0; d < s.head_dim; ++d)
            score = fmaf(qs[d], dequantize_key_block(k_cache, s, (u64)slot, kv_base + d), score);
    } else {
        const u32* key = k_cache + (u64)slot * s.key_slot_words;
        for (u32 d = 0; d < s.head_dim; ++d)
            score = fmaf(qs[d], dequantize(key, s, s.key_bits, kv_base + d), score);
    }
    return score;
}

extern "C" __global__ void paged_attention_quant(const float* __restrict__ q, const u32* __restrict__ k_cache,
                                                 const u32* __restrict__ v_cache, const u32* __restrict__ row_seq,
                                                 const u32* __restrict__ positions,
                                                 const u32* __restrict__ block_tables, QuantAttentionShape s,
                                                 float* __restrict__ out) {
    __shared__ float qs[MAX_HEAD_DIM];
    const u32 h = blockIdx.x, r = blockIdx.y, lane = threadIdx.x;
    const u32 hd = s.head_dim;
    const u32 kvh = h / (s.heads / s.kv_heads), kv_base = kvh * hd;
    const u32* table_row = table_of(block_tables, row_seq[r], kvh, s);
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
        const long long slot = j < hi ? key_slot(table_row, j, s) : -1;
        const float score = slot >= 0 ? key_score(qs, k_cache, s, slot, kv_base) : NEG_INF;
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
                if (d < hd) acc[c] = fmaf(pj, dequantize(value, s, s.bits, kv_base + d), acc[c]);
            }
        }
    }
#pragma unroll
    for (int c = 0; c < DIMS_PER_LANE; ++c) {
        const u32 d = lane + WARP * c;
        if (d < hd) out[head_row * hd + d] = l > 0.0f ? acc[c] / l : 0.0f;
    }
}

// Attention scores (KV eviction by score): adds to
// scores[(r * kv_heads + g) * max_blocks + b] the softmax weights that row r's
// heads reading KV head g give the keys of table entry b, as
// paged_attention_scores_* in paged_attention.cu. One warp per (KV head,
// row), grid (kv_heads, rows), the group's heads in turn; per head a pass
// for the softmax's max and sum, then one adding each block's share. One
// table per sequence: the host refuses per-head tables (head_tables unread).
extern "C" __global__ void paged_attention_quant_scores(const float* __restrict__ q,
                                                        const u32* __restrict__ k_cache,
                                                        const u32* __restrict__ row_seq,
                                                        const u32* __restrict__ positions,
                                                        const u32* __restrict__ block_tables,
                                                        QuantAttentionShape s, float* __restrict__ scores) {
    __shared__ float qs[MAX_HEAD_DIM];
    __shared__ float p_tile[WARP];
    const u32 g = blockIdx.x, r = blockIdx.y, lane = threadIdx.x;
    const u32 hd = s.head_dim, group = s.heads / s.kv_heads, kv_base = g * hd;
    const u32* table_row = block_tables + (u64)row_seq[r] * s.max_blocks;
    const u32 pos = positions[r];
    const u32 lo = (s.window != 0 && pos + 1 > s.window) ? pos + 1 - s.window : 0;
    const u32 hi = pos + 1;
    float* out = scores + ((u64)r * s.kv_heads + g) * s.max_blocks;
    for (u32 h = g * group; h < (g + 1) * group; ++h) {
        __syncwarp();
        for (u32 d = lane; d < hd; d += WARP) qs[d] = q[((u64)r * s.heads + h) * hd + d] * s.scale;
        __syncwarp();
        float m = NEG_INF, l = 0.0f;
        for (u32 tile = lo; tile < hi; tile += WARP) {
            const u32 j = tile + lane;
            const long long slot = j < hi ? key_slot(table_row, j, s) : -1;
            const float score = slot >= 0 ? key_score(qs, k_cache, s, slot, kv_base) : NEG_INF;
            const float tile_max = warp_max(score);
            if (tile_max == NEG_INF) continue;
            const float new_m = fmaxf(m, tile_max);
            l = l * expf(m - new_m) + warp_sum(score == NEG_INF ? 0.0f : expf(score - new_m));
            m = new_m;
        }
        for (u32 tile = lo; tile < hi; tile += WARP) {
            const u32 j = tile + lane;
            const long long slot = j < hi ? key_slot(table_row, j, s) : -1;
            const float score = slot >= 0 ? key_score(qs, k_cache, s, slot, kv_base) : NEG_INF;
            p_tile[lane] = score == NEG_INF || l == 0.0f ? 0.0f : expf(score - m) / l;
            __syncwarp();
            const u32 keys = min(hi - tile, (u32)WARP);
            const u32 block = tile / s.block_size + lane;
            if (block <= (tile + keys - 1) / s.block_size && block < s.max_blocks) {
                const u32 from = max(block * s.block_size, tile) - tile;
                const u32 to = min((block + 1) * s.block_size, tile + keys) - tile;
                float sum = 0.0f;
                for (u32 k = from; k < to; ++k) sum += p_tile[k];
                out[block] += sum;
            }
            __syncwarp();
        }
    }
}
