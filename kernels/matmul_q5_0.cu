// matmul with Q5_0 weights: out[t, r] = sum_c x[t, c] * w[r, c] (+ bias[r]).
// Blocks of 32 weights, 22 bytes: d (f16), qh (u32, the fifth bits), 16 bytes of
// nibbles; weight = d * (q5 - 16).
// Layout: core/src/quant/. Decoded in registers by `load_group` (common.cuh,
// `decode_run4`), eight weights (two runs of four) at a time.

#include "common.cuh"

DEFINE_MATMUL(matmul_q5_0, FMT_Q5_0)
