// matmul with Q2_K weights: out[t, r] = sum_c x[t, c] * w[r, c] (+ bias[r]).
// Super-blocks of 256 weights, 84 bytes: 16 scale/min bytes, 64 bytes of 2-bit
// codes, d and dmin (f16); weight = d * sc * q - dmin * mn per 16 weights.
// Layout: core/src/quant/. Decoded in registers by `load_group` (common.cuh,
// `decode_run4`), eight weights (two runs of four) at a time.

#include "common.cuh"

DEFINE_MATMUL(matmul_q2_k, FMT_Q2_K)
