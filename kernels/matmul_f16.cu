// matmul with f16 weights: out[t, r] = sum_c x[t, c] * w[r, c] (+ bias[r]).
//
// Decode uses the GEMV below. Prefill goes to cuBLAS when it is present
// (tensor cores, f32 accumulation), fed by `matmul_f16_split_x`, which
// writes x as two f16 matrices, hi + lo (`split_half`), and the host runs
// two GEMMs accumulating into the same output; without cuBLAS, the tiled
// kernel.

#include "common.cuh"

DEFINE_MATMUL(matmul_f16, FMT_F16)
DEFINE_ADD_BIAS(matmul_f16)
DEFINE_MATMUL_UNALIGNED(matmul_f16, FMT_F16)

extern "C" __global__ void matmul_f16_split_x(const float* __restrict__ x, u16* __restrict__ hi,
                                              u16* __restrict__ lo, u64 len) {
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < len; i += (u64)gridDim.x * blockDim.x)
        split_half<false>(x[i], hi + i, lo + i);
}
