// geglu: out = gelu(gate) * up, elementwise, with GELU's tanh approximation
// 0.5 g (1 + tanh(u)), u = sqrt(2/pi) (g + 0.044715 g^3), computed as the equal
// g / (1 + exp(-2u)). Grid-stride loop; expf, not the fast intrinsic, for the manifest's 1e-5.

#include "common.cuh"

extern "C" __global__ void geglu(const float* __restrict__ gate, const float* __restrict__ up, u64 len,
                                 float* __restrict__ out) {
    const float sqrt_2_over_pi = 0.7978846f;
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < len; i += (u64)gridDim.x * blockDim.x) {
        const float g = gate[i];
        const float u = sqrt_2_over_pi * (g + 0.044715f * g * g * g);
        out[i] = g / (1.0f + expf(fminf(-2.0f * u, 80.0f))) * up[i];
    }
}
