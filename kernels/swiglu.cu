// swiglu: out = silu(gate) * up = gate / (1 + exp(-gate)) * up, elementwise
// (`silu` in common.cuh, which matmul_glu.cu's epilogue shares). Grid-stride loop.

#include "common.cuh"

extern "C" __global__ void swiglu(const float* __restrict__ gate, const float* __restrict__ up, u64 len,
                                  float* __restrict__ out) {
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < len; i += (u64)gridDim.x * blockDim.x)
        out[i] = silu(gate[i]) * up[i];
}
