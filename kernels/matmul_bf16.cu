// matmul with bf16 weights: out[t, r] = sum_c x[t, c] * w[r, c] (+ bias[r]).
//
// Decode uses the GEMV below. Prefill goes to cuBLAS when it is present. A
// bf16 GEMM needs bf16 activations, and bf16's 8-bit mantissa alone would
// miss the manifest tolerance, so `matmul_bf16_split_x` writes x as the sum
// of two bf16 matrices, hi + lo (`split_half`), and the host runs
// two GEMMs accumulating into the same output (about 16 bits of x kept).
// Without cuBLAS, the tiled kernel.

#include "common.cuh"

DEFINE_MATMUL(matmul_bf16, FMT_BF16)
DEFINE_ADD_BIAS(matmul_bf16)
DEFINE_MATMUL_UNALIGNED(matmul_bf16, FMT_BF16)

extern "C" __global__ void matmul_bf16_split_x(const float* __restrict__ x, u16* __restrict__ hi,
                                               u16* __restrict__ lo, u64 len) {
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < len; i += (u64)gridDim.x * blockDim.x)
        split_half<true>(x[i], hi + i, lo + i);
}
