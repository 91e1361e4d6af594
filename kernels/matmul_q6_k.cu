// matmul with Q6_K weights: out[t, r] = sum_c x[t, c] * w[r, c] (+ bias[r]).
// Super-blocks of 256 weights, 210 bytes: 128 bytes of low nibbles, 64 of
// high bit pairs, 16 signed scales, d (f16); weight = d * sc * (q - 32) per 16.
// Layout: core/src/quant/. Decoded in registers by `load_group` (common.cuh,
// `decode_run4`), eight weights (two runs of four) at a time.

#include "common.cuh"

DEFINE_MATMUL(matmul_q6_k, FMT_Q6_K)
