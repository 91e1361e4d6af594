// scale: x *= factor over the first len elements, in place (Gemma's embedding scale).
// Grid-stride loop.

#include "common.cuh"

extern "C" __global__ void scale(float* __restrict__ x, u64 len, float factor) {
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < len; i += (u64)gridDim.x * blockDim.x) {
        x[i] *= factor;
    }
}
