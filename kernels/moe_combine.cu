// moe_combine: adds one expert's outputs into the rows routed to it:
// out[rows[i], :] += w * y[i, :] for i < count, w the routing weight of
// `expert` among the row's `slots` (0 when the row was not routed to it).
// rows holds no row twice, so no two threads write one value.
// Grid: (ceil(width / blockDim.x), count).

#include "common.cuh"

extern "C" __global__ void moe_combine(const float* __restrict__ y, const u32* __restrict__ rows,
                                       const u32* __restrict__ ids, const float* __restrict__ weights,
                                       u32 width, u32 expert, u32 slots, float* __restrict__ out) {
    const u32 c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= width) return;
    const u64 row = rows[blockIdx.y];
    float w = 0.0f;
    for (u32 j = 0; j < slots; ++j)
        if (ids[row * slots + j] == expert) w = weights[row * slots + j];
    out[row * width + c] += w * y[(u64)blockIdx.y * width + c];
}
