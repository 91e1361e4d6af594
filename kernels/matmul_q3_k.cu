// matmul with Q3_K weights: out[t, r] = sum_c x[t, c] * w[r, c] (+ bias[r]).
// Super-blocks of 256 weights, 110 bytes: hmask, 2-bit codes, 12 bytes of 6-bit
// scales, d (f16); weight = d * (sc - 32) * (q - 4) per 16 weights.
// Layout: core/src/quant/. Decoded in registers by `load_group` (common.cuh,
// `decode_run4`), eight weights (two runs of four) at a time.

#include "common.cuh"

DEFINE_MATMUL(matmul_q3_k, FMT_Q3_K)
