// matmul with Q4_K weights: out[t, r] = sum_c x[t, c] * w[r, c] (+ bias[r]).
// Super-blocks of 256 weights, 144 bytes: d, dmin (f16), 12 bytes of 6-bit
// scales and minimums, 128 bytes of nibbles; weight = d * sc * q - dmin * mn per 32.
// Layout: core/src/quant/. Decoded in registers by `load_group` (common.cuh,
// `decode_run4`), eight weights (two runs of four) at a time.

#include "common.cuh"

DEFINE_MATMUL(matmul_q4_k, FMT_Q4_K)
