// geglu: out = gelu(gate) * up, elementwise, with GELU's tanh approximation
// (`gelu_tanh` in common.cuh, which matmul_glu.cu's epilogue shares).
// Grid-stride loop.

#include "common.cuh"

extern "C" __global__ void geglu(const float* __restrict__ gate, const float* __restrict__ up, u64 len,
                                 float* __restrict__ out) {
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < len; i += (u64)gridDim.x * blockDim.x)
        out[i] = gelu_tanh(gate[i]) * up[i];
}
