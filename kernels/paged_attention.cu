// paged_attention: causal attention of each query row over its sequence's
// cached K/V, read through the block table, with an online (flash-style)
// softmax so scores never go to memory.
//
//   q, out        [rows, heads * head_dim] f32
//   k/v cache     [num_slots, kv_heads * head_dim], f32 or f16 (the _f16 entries)
//   row_seq[r]    the row's sequence (its row of block_tables)
//   positions[r]  the row's position p: it sees keys at positions
//                 max(0, p - window + 1) ..= p (window 0: no window)
//   block_tables  [seqs, max_blocks] physical block ids, read by all of a
//                 sequence's KV heads; with head_tables set, [seqs, kv_heads,
//                 max_blocks]: KV head g of sequence seq reads table
//                 seq * kv_heads + g (select_kv_blocks.cu writes them). Key
//                 position j lives in slot table[j / block_size] * block_size
//                 + j % block_size; EVICTED_BLOCK entries (KV eviction,
//                 blocks a sparse head does not read) are skipped
//
// Query head h reads KV head h / (heads / kv_heads) (grouped-query attention).
// head_dim <= MAX_HEAD_DIM; lane l of a warp owns dims l, l + 32, ...
//
// Two strategies, both correct for any batch (the host picks by shape):
// - decode: a block per (head, row, split). The row's key range is cut into
//   splits of `split_keys` keys so a long context still fills the GPU; each
//   split's 4 warps take 32-key tiles in turn, a lane scoring one key, and
//   merge their softmax states in shared memory. With several splits, the
//   partial states go to `partial` and `paged_attention_reduce` merges them.
// - prefill: a block per (16 query rows, head). K/V tiles of 32 keys are
//   staged in shared memory once and used by all rows of the block that
//   belong to the same sequence.

#include "common.cuh"

#define MAX_HEAD_DIM 256
#define DIMS_PER_LANE (MAX_HEAD_DIM / WARP)
#define ATT_WARPS 4
#define KEY_TILE 32
#define PREFILL_ROWS 16
#define ROWS_PER_WARP (PREFILL_ROWS / ATT_WARPS)
#define NEG_INF (-__int_as_float(0x7f800000))

template <typename KV>
__device__ __forceinline__ float kv_load(const KV* p);
template <>
__device__ __forceinline__ float kv_load<float>(const float* p) { return *p; }
template <>
__device__ __forceinline__ float kv_load<u16>(const u16* p) { return f16_to_f32(*p); }

// Four consecutive cache values as f32 (16-byte loads of f32, 8-byte of f16).
template <typename KV>
__device__ __forceinline__ float4 kv_load4(const KV* p);
template <>
__device__ __forceinline__ float4 kv_load4<float>(const float* p) {
    return __ldg(reinterpret_cast<const float4*>(p));
}
template <>
__device__ __forceinline__ float4 kv_load4<u16>(const u16* p) {
    const uint2 v = __ldg(reinterpret_cast<const uint2*>(p));
    float4 f;
    half2_to_f32<FMT_F16>(v.x, f.x, f.y);
    half2_to_f32<FMT_F16>(v.y, f.z, f.w);
    return f;
}

// q (in shared memory) dot one key row. With head_dim % 4 == 0 every row
// starts 4-element aligned, so it is read in vector loads.
template <typename KV>
__device__ __forceinline__ float dot_q_key(const float* qs, const KV* k, u32 hd) {
    float dot = 0.0f;
    if (hd % 4 == 0) {
        for (u32 d = 0; d < hd; d += 4) {
            const float4 kv = kv_load4(k + d);
            dot = fmaf(qs[d], kv.x, dot);
            dot = fmaf(qs[d + 1], kv.y, dot);
            dot = fmaf(qs[d + 2], kv.z, dot);
            dot = fmaf(qs[d + 3], kv.w, dot);
        }
    } else {
        for (u32 d = 0; d < hd; ++d) dot = fmaf(qs[d], kv_load(k + d), dot);
    }
    return dot;
}

// Mirror of `AttentionShape` in backend-cuda/src/backend.rs.
struct AttentionShape {
    u32 rows, heads, kv_heads, head_dim, block_size, max_blocks, window;
    float scale;
    // 1: one block table per sequence and KV head; 0: one per sequence.
    u32 head_tables;
};

// The first key position row `pos` sees.
__device__ __forceinline__ u32 first_key(u32 pos, u32 window) {
    return (window != 0 && pos + 1 > window) ? pos + 1 - window : 0;
}

// A block-table entry of an evicted block (tandem_core::kv::EVICTED_BLOCK).
#define EVICTED_BLOCK 0xffffffffu

// The block table KV head g of sequence seq reads.
__device__ __forceinline__ const u32* table_of(const u32* block_tables, u32 seq, u32 g, const AttentionShape& s) {
    const u64 table = s.head_tables ? (u64)seq * s.kv_heads + g : (u64)seq;
    return block_tables + table * s.max_blocks;
}

// The cache slot of key position j of a sequence, or -1 past its block table
// or in an evicted block.
__device__ __forceinline__ long long key_slot(const u32* table_row, u32 j, const AttentionShape& s) {
    const u32 block = j / s.block_size;
    if (block >= s.max_blocks) return -1;
    const u32 physical = table_row[block];
    if (physical == EVICTED_BLOCK) return -1;
    return (long long)physical * s.block_size + j % s.block_size;
}

// One warp's running softmax over the keys it has seen: max m, sum l, and
// acc = sum_j exp(score_j - m) * V_j over this lane's dims.
struct SoftmaxState {
    float m, l;
    float acc[DIMS_PER_LANE];
};

__device__ __forceinline__ void state_init(SoftmaxState& st) {
    st.m = NEG_INF;
    st.l = 0.0f;
#pragma unroll
    for (int c = 0; c < DIMS_PER_LANE; ++c) st.acc[c] = 0.0f;
}

// Folds a tile's scores (one per lane, NEG_INF for masked keys) into the
// state; returns this lane's softmax weight for the PV product.
__device__ __forceinline__ float state_add_scores(SoftmaxState& st, float score) {
    const float tile_max = warp_max(score);
    if (tile_max == NEG_INF) return 0.0f;  // the whole tile is masked
    const float m = fmaxf(st.m, tile_max);
    const float correction = expf(st.m - m);  // 0 on the first tile (m was -inf)
    const float p = score == NEG_INF ? 0.0f : expf(score - m);
    st.l = st.l * correction + warp_sum(p);
#pragma unroll
    for (int c = 0; c < DIMS_PER_LANE; ++c) st.acc[c] *= correction;
    st.m = m;
    return p;
}

// ---- decode ----

template <typename KV>
__device__ __forceinline__ void decode(const float* __restrict__ q, const KV* __restrict__ k_cache,
                                       const KV* __restrict__ v_cache, const u32* __restrict__ row_seq,
                                       const u32* __restrict__ positions, const u32* __restrict__ block_tables,
                                       AttentionShape s, u32 split_keys, float* __restrict__ partial,
                                       float* __restrict__ out) {
    __shared__ float qs[MAX_HEAD_DIM];
    __shared__ float warp_m[ATT_WARPS], warp_l[ATT_WARPS];
    __shared__ float warp_acc[ATT_WARPS][MAX_HEAD_DIM];

    const u32 h = blockIdx.x, r = blockIdx.y, split = blockIdx.z, splits = gridDim.z;
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
    const u32 hd = s.head_dim;
    const u32 kvh = h / (s.heads / s.kv_heads);
    const u64 kv_width = (u64)s.kv_heads * hd;
    const u32* table_row = table_of(block_tables, row_seq[r], kvh, s);

    for (u32 d = threadIdx.x; d < hd; d += blockDim.x) qs[d] = q[((u64)r * s.heads + h) * hd + d] * s.scale;
    __syncthreads();

    const u32 pos = positions[r];
    const u32 lo = max(first_key(pos, s.window), split * split_keys);
    const u32 hi = min(pos + 1, (split + 1) * split_keys);  // exclusive

    SoftmaxState st;
    state_init(st);
    for (u32 tile = lo + warp * KEY_TILE; tile < hi; tile += ATT_WARPS * KEY_TILE) {
        const u32 j = tile + lane;
        const long long slot = j < hi ? key_slot(table_row, j, s) : -1;
        float score = NEG_INF;
        if (slot >= 0) score = dot_q_key(qs, k_cache + (u64)slot * kv_width + (u64)kvh * hd, hd);
        const float p = state_add_scores(st, score);
        const u32 valid = min(hi - tile, (u32)KEY_TILE);
        for (u32 jj = 0; jj < valid; ++jj) {
            const float pj = __shfl_sync(FULL_MASK, p, jj);
            const long long slot_j = __shfl_sync(FULL_MASK, slot, jj);
            if (slot_j < 0) continue;
            const KV* v = v_cache + (u64)slot_j * kv_width + (u64)kvh * hd;
#pragma unroll
            for (int c = 0; c < DIMS_PER_LANE; ++c) {
                const u32 d = lane + WARP * c;
                if (d < hd) st.acc[c] = fmaf(pj, kv_load(v + d), st.acc[c]);
            }
        }
    }

    // Merge the warps' states.
    if (lane == 0) warp_m[warp] = st.m, warp_l[warp] = st.l;
#pragma unroll
    for (int c = 0; c < DIMS_PER_LANE; ++c) {
        const u32 d = lane + WARP * c;
        if (d < hd) warp_acc[warp][d] = st.acc[c];
    }
    __syncthreads();
    float m = NEG_INF;
#pragma unroll
    for (int w = 0; w < ATT_WARPS; ++w) m = fmaxf(m, warp_m[w]);
    float l = 0.0f, weight[ATT_WARPS];
#pragma unroll
    for (int w = 0; w < ATT_WARPS; ++w) {
        weight[w] = warp_m[w] == NEG_INF ? 0.0f : expf(warp_m[w] - m);
        l += warp_l[w] * weight[w];
    }
    const u64 head_row = (u64)r * s.heads + h;
    for (u32 d = threadIdx.x; d < hd; d += blockDim.x) {
        float acc = 0.0f;
#pragma unroll
        for (int w = 0; w < ATT_WARPS; ++w) acc = fmaf(warp_acc[w][d], weight[w], acc);
        if (splits == 1) {
            out[head_row * hd + d] = l > 0.0f ? acc / l : 0.0f;
        } else {
            partial[(head_row * splits + split) * (hd + 2) + 2 + d] = acc;
        }
    }
    if (splits > 1 && threadIdx.x == 0) {
        partial[(head_row * splits + split) * (hd + 2)] = m;
        partial[(head_row * splits + split) * (hd + 2) + 1] = l;
    }
}

#define DECODE_ARGS                                                                                         \
    const float *__restrict__ q, const KV *__restrict__ k_cache, const KV *__restrict__ v_cache,            \
        const u32 *__restrict__ row_seq, const u32 *__restrict__ positions,                                \
        const u32 *__restrict__ block_tables, AttentionShape s, u32 split_keys, float *__restrict__ partial, \
        float *__restrict__ out
#define DECODE_PASS q, k_cache, v_cache, row_seq, positions, block_tables, s, split_keys, partial, out

#define KV float
extern "C" __global__ void paged_attention_decode_f32(DECODE_ARGS) { decode<float>(DECODE_PASS); }
#undef KV
#define KV u16
extern "C" __global__ void paged_attention_decode_f16(DECODE_ARGS) { decode<u16>(DECODE_PASS); }
#undef KV

// Merges the splits of one (row, head): grid (heads, rows), partial rows of
// [m, l, acc[head_dim]] per split.
extern "C" __global__ void paged_attention_reduce(const float* __restrict__ partial, u32 heads, u32 head_dim,
                                                  u32 splits, float* __restrict__ out) {
    const u64 head_row = (u64)blockIdx.y * heads + blockIdx.x;
    const float* part = partial + head_row * splits * (head_dim + 2);
    float m = NEG_INF;
    for (u32 sp = 0; sp < splits; ++sp) m = fmaxf(m, part[sp * (head_dim + 2)]);
    float l = 0.0f;
    for (u32 sp = 0; sp < splits; ++sp) {
        const float ms = part[sp * (head_dim + 2)];
        if (ms != NEG_INF) l += part[sp * (head_dim + 2) + 1] * expf(ms - m);
    }
    for (u32 d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float acc = 0.0f;
        for (u32 sp = 0; sp < splits; ++sp) {
            const float ms = part[sp * (head_dim + 2)];
            if (ms != NEG_INF) acc = fmaf(part[sp * (head_dim + 2) + 2 + d], expf(ms - m), acc);
        }
        out[head_row * head_dim + d] = l > 0.0f ? acc / l : 0.0f;
    }
}

// ---- prefill ----

// Dynamic shared memory of the prefill kernel (the host computes the same
// size): q tile [PREFILL_ROWS][hd], K tile [KEY_TILE][hd + 1] (rows padded by
// one float so lanes reading different keys hit different banks), V tile
// [KEY_TILE][hd], then the tile's KEY_TILE slots as 8-byte integers (the
// offset, 4 * (80 * hd + 32) bytes, is a multiple of 8).

template <typename KV>
__device__ __forceinline__ void prefill(const float* __restrict__ q, const KV* __restrict__ k_cache,
                                        const KV* __restrict__ v_cache, const u32* __restrict__ row_seq,
                                        const u32* __restrict__ positions, const u32* __restrict__ block_tables,
                                        AttentionShape s, float* __restrict__ out) {
    extern __shared__ __align__(16) float smem[];
    const u32 hd = s.head_dim;
    float* qs = smem;                                  // [PREFILL_ROWS][hd]
    float* ks = qs + PREFILL_ROWS * hd;                // [KEY_TILE][hd + 1]
    float* vs = ks + KEY_TILE * (hd + 1);              // [KEY_TILE][hd]
    long long* slots = reinterpret_cast<long long*>(vs + KEY_TILE * hd);  // [KEY_TILE]

    const u32 row_base = blockIdx.x * PREFILL_ROWS, h = blockIdx.y;
    const u32 row_end = min(row_base + PREFILL_ROWS, s.rows);
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
    const u32 kvh = h / (s.heads / s.kv_heads);
    const u64 kv_width = (u64)s.kv_heads * hd;

    for (u32 e = threadIdx.x; e < PREFILL_ROWS * hd; e += blockDim.x) {
        const u32 i = e / hd, d = e % hd, r = row_base + i;
        qs[e] = r < row_end ? q[((u64)r * s.heads + h) * hd + d] * s.scale : 0.0f;
    }

    // This warp's rows.
    u32 my_seq[ROWS_PER_WARP], my_pos[ROWS_PER_WARP], my_first[ROWS_PER_WARP];
    SoftmaxState st[ROWS_PER_WARP];
#pragma unroll
    for (int i = 0; i < ROWS_PER_WARP; ++i) {
        const u32 r = row_base + warp * ROWS_PER_WARP + i;
        my_seq[i] = r < row_end ? row_seq[r] : 0xffffffffu;
        my_pos[i] = r < row_end ? positions[r] : 0;
        my_first[i] = first_key(my_pos[i], s.window);
        state_init(st[i]);
    }

    // Segments: runs of the block's rows that share a sequence (usually one).
    u32 seg_start = row_base;
    while (seg_start < row_end) {
        const u32 seq = row_seq[seg_start];
        u32 seg_end = seg_start + 1;
        u32 key_lo = 0xffffffffu, key_hi = 0;  // key range of the segment, exclusive end
        for (u32 r = seg_start; r < row_end && row_seq[r] == seq; ++r) {
            seg_end = r + 1;
            key_lo = min(key_lo, first_key(positions[r], s.window));
            key_hi = max(key_hi, positions[r] + 1);
        }
        const u32* table_row = table_of(block_tables, seq, kvh, s);  // one KV head per block

        for (u32 tile = key_lo; tile < key_hi; tile += KEY_TILE) {
            __syncthreads();  // the previous tile is no longer read
            if (threadIdx.x < KEY_TILE) {
                const u32 j = tile + threadIdx.x;
                slots[threadIdx.x] = j < key_hi ? key_slot(table_row, j, s) : -1;
            }
            __syncthreads();
            for (u32 e = threadIdx.x; e < KEY_TILE * hd; e += blockDim.x) {
                const u32 jj = e / hd, d = e % hd;
                const long long slot = slots[jj];
                const u64 at = (u64)slot * kv_width + (u64)kvh * hd + d;
                ks[jj * (hd + 1) + d] = slot >= 0 ? kv_load(k_cache + at) : 0.0f;
                vs[jj * hd + d] = slot >= 0 ? kv_load(v_cache + at) : 0.0f;
            }
            __syncthreads();

            const u32 j = tile + lane;  // this lane's key
            const bool key_ok = slots[lane] >= 0;
            float score[ROWS_PER_WARP];
#pragma unroll
            for (int i = 0; i < ROWS_PER_WARP; ++i) score[i] = 0.0f;
            for (u32 d = 0; d < hd; ++d) {
                const float kd = ks[lane * (hd + 1) + d];
#pragma unroll
                for (int i = 0; i < ROWS_PER_WARP; ++i)
                    score[i] = fmaf(qs[(warp * ROWS_PER_WARP + i) * hd + d], kd, score[i]);
            }
            float p[ROWS_PER_WARP];
#pragma unroll
            for (int i = 0; i < ROWS_PER_WARP; ++i) {
                const u32 r = row_base + warp * ROWS_PER_WARP + i;
                const bool in_segment = r >= seg_start && r < seg_end;
                const bool visible = in_segment && key_ok && j >= my_first[i] && j <= my_pos[i];
                p[i] = state_add_scores(st[i], visible ? score[i] : NEG_INF);
            }
            const u32 valid = min(key_hi - tile, (u32)KEY_TILE);
            for (u32 jj = 0; jj < valid; ++jj) {
                float v[DIMS_PER_LANE];
#pragma unroll
                for (int c = 0; c < DIMS_PER_LANE; ++c) {
                    const u32 d = lane + WARP * c;
                    v[c] = d < hd ? vs[jj * hd + d] : 0.0f;
                }
#pragma unroll
                for (int i = 0; i < ROWS_PER_WARP; ++i) {
                    const float pj = __shfl_sync(FULL_MASK, p[i], jj);
#pragma unroll
                    for (int c = 0; c < DIMS_PER_LANE; ++c) st[i].acc[c] = fmaf(pj, v[c], st[i].acc[c]);
                }
            }
        }
        seg_start = seg_end;
    }

#pragma unroll
    for (int i = 0; i < ROWS_PER_WARP; ++i) {
        const u32 r = row_base + warp * ROWS_PER_WARP + i;
        if (r >= row_end) continue;
        const float inv_l = st[i].l > 0.0f ? 1.0f / st[i].l : 0.0f;
#pragma unroll
        for (int c = 0; c < DIMS_PER_LANE; ++c) {
            const u32 d = lane + WARP * c;
            if (d < hd) out[((u64)r * s.heads + h) * hd + d] = st[i].acc[c] * inv_l;
        }
    }
}

#define PREFILL_ARGS                                                                                   \
    const float *__restrict__ q, const KV *__restrict__ k_cache, const KV *__restrict__ v_cache,       \
        const u32 *__restrict__ row_seq, const u32 *__restrict__ positions,                           \
        const u32 *__restrict__ block_tables, AttentionShape s, float *__restrict__ out
#define PREFILL_PASS q, k_cache, v_cache, row_seq, positions, block_tables, s, out

#define KV float
extern "C" __global__ void paged_attention_prefill_f32(PREFILL_ARGS) { prefill<float>(PREFILL_PASS); }
#undef KV
#define KV u16
extern "C" __global__ void paged_attention_prefill_f16(PREFILL_ARGS) { prefill<u16>(PREFILL_PASS); }
#undef KV

// ---- attention scores (KV eviction by score) ----

// Adds to scores[(r * kv_heads + g) * max_blocks + b] the softmax weights
// that row r's heads reading KV head g give the keys of table entry b. One
// warp per (KV head, row), grid (kv_heads, rows): the group's heads in turn,
// so no two warps add to one entry. Per head a first pass over 32-key tiles
// finds the softmax's max and sum, a second scores the keys again and the
// lanes owning one block of the tile add its share. Keys only; no score
// leaves the warp. One table per sequence: the host refuses per-head tables
// (Backend::paged_attention_scores' contract), so head_tables is not read.
template <typename SCORE_KEY>
__device__ __forceinline__ void block_scores(const float* __restrict__ q, const u32* __restrict__ row_seq,
                                             const u32* __restrict__ positions,
                                             const u32* __restrict__ block_tables, const AttentionShape& s,
                                             float* __restrict__ scores, SCORE_KEY score_key) {
    __shared__ float qs[MAX_HEAD_DIM];
    __shared__ float p_tile[WARP];
    const u32 g = blockIdx.x, r = blockIdx.y, lane = threadIdx.x;
    const u32 hd = s.head_dim, group = s.heads / s.kv_heads;
    const u32* table_row = block_tables + (u64)row_seq[r] * s.max_blocks;
    const u32 pos = positions[r];
    const u32 lo = first_key(pos, s.window), hi = pos + 1;
    float* out = scores + ((u64)r * s.kv_heads + g) * s.max_blocks;
    for (u32 h = g * group; h < (g + 1) * group; ++h) {
        __syncwarp();
        for (u32 d = lane; d < hd; d += WARP) qs[d] = q[((u64)r * s.heads + h) * hd + d] * s.scale;
        __syncwarp();
        float m = NEG_INF, l = 0.0f;
        for (u32 tile = lo; tile < hi; tile += WARP) {
            const u32 j = tile + lane;
            const long long slot = j < hi ? key_slot(table_row, j, s) : -1;
            const float score = slot >= 0 ? score_key(qs, slot, g) : NEG_INF;
            const float tile_max = warp_max(score);
            if (tile_max == NEG_INF) continue;
            const float new_m = fmaxf(m, tile_max);
            l = l * expf(m - new_m) + warp_sum(score == NEG_INF ? 0.0f : expf(score - new_m));
            m = new_m;
        }
        for (u32 tile = lo; tile < hi; tile += WARP) {
            const u32 j = tile + lane;
            const long long slot = j < hi ? key_slot(table_row, j, s) : -1;
            const float score = slot >= 0 ? score_key(qs, slot, g) : NEG_INF;
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

template <typename KV>
__device__ __forceinline__ void scores_float(const float* __restrict__ q, const KV* __restrict__ k_cache,
                                             const u32* __restrict__ row_seq, const u32* __restrict__ positions,
                                             const u32* __restrict__ block_tables, AttentionShape s,
                                             float* __restrict__ scores) {
    const u64 kv_width = (u64)s.kv_heads * s.head_dim;
    block_scores(q, row_seq, positions, block_tables, s, scores, [&](const float* qs, long long slot, u32 g) {
        return dot_q_key(qs, k_cache + (u64)slot * kv_width + (u64)g * s.head_dim, s.head_dim);
    });
}

#define SCORES_ARGS                                                                                  \
    const float *__restrict__ q, const KV *__restrict__ k_cache, const u32 *__restrict__ row_seq,     \
        const u32 *__restrict__ positions, const u32 *__restrict__ block_tables, AttentionShape s, \
        float *__restrict__ scores
#define SCORES_PASS q, k_cache, row_seq, positions, block_tables, s, scores

#define KV float
extern "C" __global__ void paged_attention_scores_f32(SCORES_ARGS) { scores_float<float>(SCORES_PASS); }
#undef KV
#define KV u16
extern "C" __global__ void paged_attention_scores_f16(SCORES_ARGS) { scores_float<u16>(SCORES_PASS); }
#undef KV
