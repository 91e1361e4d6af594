// matmul with f32 weights: out[t, r] = sum_c x[t, c] * w[r, c] (+ bias[r]).

#include "common.cuh"

DEFINE_MATMUL(matmul_f32, FMT_F32)
DEFINE_MATMUL_UNALIGNED(matmul_f32, FMT_F32)
