// matmul with f16 weights: out[t, r] = sum_c x[t, c] * w[r, c] (+ bias[r]).
//
// Decode uses the GEMV below. Prefill goes to cuBLAS when it is present
// (tensor cores, f32 accumulation), fed by `matmul_f16_convert_x`, which
// rounds the activations to f16; without cuBLAS, the tiled kernel.

#include "common.cuh"

DEFINE_MATMUL(matmul_f16, FMT_F16)
DEFINE_ADD_BIAS(matmul_f16)
DEFINE_MATMUL_UNALIGNED(matmul_f16, FMT_F16)

extern "C" __global__ void matmul_f16_convert_x(const float* __restrict__ x, u16* __restrict__ out, u64 len) {
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < len; i += (u64)gridDim.x * blockDim.x)
        out[i] = f32_to_f16(x[i]);
}
