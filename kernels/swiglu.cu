// swiglu: out = silu(gate) * up = gate / (1 + exp(-gate)) * up, elementwise.
// Grid-stride loop; expf, not the fast intrinsic, for the manifest's 1e-5.

#include "common.cuh"

extern "C" __global__ void swiglu(const float* __restrict__ gate, const float* __restrict__ up, u64 len,
                                  float* __restrict__ out) {
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < len; i += (u64)gridDim.x * blockDim.x) {
        const float g = gate[i];
        out[i] = g / (1.0f + expf(-g)) * up[i];
    }
}
