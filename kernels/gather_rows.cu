// gather_rows: out[i, :] = x[rows[i], :] for rows of `width` f32 values
// (the last token of each sequence before the LM head, for example).
// Grid: (ceil(width / blockDim.x), n).

#include "common.cuh"

extern "C" __global__ void gather_rows(const float* __restrict__ x, const u32* __restrict__ rows, u32 width,
                                       float* __restrict__ out) {
    const u32 c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= width) return;
    out[(u64)blockIdx.y * width + c] = x[(u64)rows[blockIdx.y] * width + c];
}
