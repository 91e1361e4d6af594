// embedding: out[t, :] = table[tokens[t], :] as f32, for a table in any
// weight format (row-major `[vocab, dim]`, `row_bytes` per row).
// Grid: (ceil(dim / blockDim.x), rows); one thread per output element.
// A token id past the vocabulary yields a zero row rather than a wild read.

#include "common.cuh"

extern "C" __global__ void embedding(const u8* __restrict__ table, int fmt, u64 row_bytes, u32 vocab,
                                     const u32* __restrict__ tokens, u32 dim, float* __restrict__ out) {
    const u32 t = blockIdx.y;
    const u32 c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= dim) return;
    const u32 token = tokens[t];
    out[(u64)t * dim + c] = token < vocab ? weight_at(fmt, table + token * row_bytes, c) : 0.0f;
}
