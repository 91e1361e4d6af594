// matmul with Q4_0 weights: out[t, r] = sum_c x[t, c] * w[r, c] (+ bias[r]).
// Blocks of 32 weights, 18 bytes: d (f16), 16 bytes of nibbles;
// weight = d * (nibble - 8). Decoded in registers by `load_group` (common.cuh).

#include "common.cuh"

DEFINE_MATMUL(matmul_q4_0, FMT_Q4_0)
