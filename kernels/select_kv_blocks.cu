// select_kv_blocks: sparse attention's block selection. tables ([seqs,
// max_blocks] u32) hold one table per sequence; out ([seqs, kv_heads,
// max_blocks] u32, read by paged_attention with head_tables) one per
// sequence and KV head: KV head g's is the sequence's table with the entries
// g does not read made holes (EVICTED_BLOCK). The visible entries are those
// up to the block of the sequence's last row; of those the first `sinks` and
// the last `recent` are kept by every head, and among the others that are
// not holes (the candidates) each KV head keeps only the `top` of its own
// highest bound, ties to the earlier entry. Entries past the visible ones
// are copied. A sequence without rows, or with no more than `top`
// candidates, gives every head its table unchanged.
//
// A block's bound for KV head g is sum_c max(q_c min_c, q_c max_c) over its
// key bounds (kv_key_bounds.cu), summed over the sequence's rows and g's
// query heads: as q+ . max + q- . min, with the queries' positive and
// negative parts summed first and the dot products in eight lanes, as the
// CPU does, without fused multiply-adds.
//
// One block per sequence: its threads copy the table into each KV head's
// with the candidates made holes and write each (KV head, candidate) bound
// into scratch ([seqs, kv_heads, max_blocks] f32, laid out as out), then
// rank each candidate among its head's by counting the candidates that beat
// it and put it back into that head's table if it ranks below `top`.

#include "common.cuh"

#define EVICTED 0xffffffffu
#define SELECT_MAX_HEAD_DIM 256

// sum_c a[c] * b[c] as the CPU sums it: lane l of eight takes c = 8j + l, the
// lanes are added in order, then the tail.
__device__ float lane_dot(const float* a, const float* __restrict__ b, u32 n) {
    float lanes[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    const u32 whole = n / 8u * 8u;
    for (u32 c = 0; c < whole; ++c) lanes[c % 8u] = __fadd_rn(lanes[c % 8u], __fmul_rn(a[c], b[c]));
    float sum = 0.f;
    for (u32 l = 0; l < 8u; ++l) sum = __fadd_rn(sum, lanes[l]);
    float tail = 0.f;
    for (u32 c = whole; c < n; ++c) tail = __fadd_rn(tail, __fmul_rn(a[c], b[c]));
    return __fadd_rn(sum, tail);
}

extern "C" __global__ void select_kv_blocks(const float* __restrict__ q, const u32* __restrict__ row_seq,
                                            const u32* __restrict__ positions,
                                            const u32* __restrict__ tables, const float* __restrict__ bounds,
                                            u32 rows, u32 heads, u32 kv_heads, u32 head_dim, u32 block_size,
                                            u32 max_blocks, u32 top, u32 sinks, u32 recent,
                                            float* __restrict__ scratch, u32* __restrict__ out) {
    const u32 seq = blockIdx.x;
    const u64 base = (u64)seq * max_blocks;
    bool has_rows = false;
    u32 last = 0;
    for (u32 t = 0; t < rows; ++t)
        if (row_seq[t] == seq) {
            last = has_rows ? max(last, positions[t]) : positions[t];
            has_rows = true;
        }
    const u32 visible = has_rows ? min(last / block_size + 1u, max_blocks) : 0u;
    const u32 end = visible - min(recent, visible);
    const u32 first = min(sinks, end);
    u32 candidates = 0;
    for (u32 e = first; e < end; ++e) candidates += tables[base + e] != EVICTED;
    const bool selecting = candidates > top;
    // This sequence's tables in out and bounds in scratch: index i = g * max_blocks + e.
    const u64 head_base = (u64)seq * kv_heads * max_blocks;
    float* sc = scratch + head_base;
    u32* head_out = out + head_base;
    const u32 group = heads / kv_heads;
    for (u32 i = threadIdx.x; i < kv_heads * max_blocks; i += blockDim.x) {
        const u32 e = i % max_blocks, g = i / max_blocks;
        const u32 entry = tables[base + e];
        const bool candidate = selecting && e >= first && e < end && entry != EVICTED;
        head_out[i] = candidate ? EVICTED : entry;
        if (!candidate) continue;
        float pos[SELECT_MAX_HEAD_DIM], neg[SELECT_MAX_HEAD_DIM];
        for (u32 c = 0; c < head_dim; ++c) pos[c] = neg[c] = 0.f;
        for (u32 t = 0; t < rows; ++t) {
            if (row_seq[t] != seq) continue;
            for (u32 h = g * group; h < (g + 1u) * group; ++h) {
                const float* qh = q + ((u64)t * heads + h) * head_dim;
                for (u32 c = 0; c < head_dim; ++c) {
                    pos[c] = __fadd_rn(pos[c], fmaxf(qh[c], 0.f));
                    neg[c] = __fadd_rn(neg[c], fminf(qh[c], 0.f));
                }
            }
        }
        const float* b = bounds + ((u64)entry * kv_heads + g) * 2u * head_dim;
        sc[i] = __fadd_rn(lane_dot(pos, b + head_dim, head_dim), lane_dot(neg, b, head_dim));
    }
    __syncthreads();
    for (u32 i = threadIdx.x; i < kv_heads * max_blocks; i += blockDim.x) {
        const u32 e = i % max_blocks;
        const u32 entry = tables[base + e];
        if (!(selecting && e >= first && e < end && entry != EVICTED)) continue;
        const float* row = sc + (i - e);
        const float mine = row[e];
        u32 rank = 0;
        for (u32 o = first; o < end; ++o) {
            if (tables[base + o] == EVICTED || o == e) continue;
            rank += row[o] > mine || (row[o] == mine && o < e);
        }
        if (rank < top) head_out[i] = entry;
    }
}
