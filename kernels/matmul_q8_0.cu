// matmul with Q8_0 weights: out[t, r] = sum_c x[t, c] * w[r, c] (+ bias[r]).
// Blocks of 32 weights, 34 bytes: d (f16), 32 signed bytes; weight = d * q.
// Decoded in registers by `load_group` (common.cuh).

#include "common.cuh"

DEFINE_MATMUL(matmul_q8_0, FMT_Q8_0)
