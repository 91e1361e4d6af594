// matmul with Q5_K weights: out[t, r] = sum_c x[t, c] * w[r, c] (+ bias[r]).
// Super-blocks of 256 weights, 176 bytes: Q4_K's d, dmin and scales, 32 bytes
// of fifth bits, 128 bytes of nibbles; weight = d * sc * q - dmin * mn per 32.
// Layout: core/src/quant/. Decoded in registers by `load_group` (common.cuh,
// `decode_run4`), eight weights (two runs of four) at a time.

#include "common.cuh"

DEFINE_MATMUL(matmul_q5_k, FMT_Q5_K)
