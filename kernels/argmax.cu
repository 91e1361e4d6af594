// argmax: out[r] = index of the largest value of row r (the lowest index
// among equal maxima; NaN never wins). Greedy sampling on the device, so a
// decode step copies back one u32 per sequence instead of a row of logits.
// One block per row.

#include "common.cuh"

// (value, index) ordering: larger value first, then lower index.
__device__ __forceinline__ bool better(float v, u32 i, float best_v, u32 best_i) {
    return v > best_v || (v == best_v && i < best_i);
}

extern "C" __global__ void argmax(const float* __restrict__ x, u32 width, u32* __restrict__ out) {
    __shared__ float best_vs[WARP];
    __shared__ u32 best_is[WARP];
    const float* row = x + (u64)blockIdx.x * width;
    float best_v = -__int_as_float(0x7f800000);  // -inf
    u32 best_i = 0xffffffffu;
    for (u32 c = threadIdx.x; c < width; c += blockDim.x)
        if (better(row[c], c, best_v, best_i)) best_v = row[c], best_i = c;
#pragma unroll
    for (int offset = WARP / 2; offset > 0; offset >>= 1) {
        const float v = __shfl_xor_sync(FULL_MASK, best_v, offset);
        const u32 i = __shfl_xor_sync(FULL_MASK, best_i, offset);
        if (better(v, i, best_v, best_i)) best_v = v, best_i = i;
    }
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
    if (lane == 0) best_vs[warp] = best_v, best_is[warp] = best_i;
    __syncthreads();
    if (warp != 0) return;
    const int warps = blockDim.x / WARP;
    best_v = lane < warps ? best_vs[lane] : -__int_as_float(0x7f800000);
    best_i = lane < warps ? best_is[lane] : 0xffffffffu;
#pragma unroll
    for (int offset = WARP / 2; offset > 0; offset >>= 1) {
        const float v = __shfl_xor_sync(FULL_MASK, best_v, offset);
        const u32 i = __shfl_xor_sync(FULL_MASK, best_i, offset);
        if (better(v, i, best_v, best_i)) best_v = v, best_i = i;
    }
    // A row of NaNs (or an empty row) has no maximum: report index 0.
    if (lane == 0) out[blockIdx.x] = best_i == 0xffffffffu ? 0 : best_i;
}
