// matmul with Q4_1 weights: out[t, r] = sum_c x[t, c] * w[r, c] (+ bias[r]).
// Blocks of 32 weights, 20 bytes: d (f16), m (f16), 16 bytes of nibbles;
// weight = d * nibble + m. Decoded in registers by `load_group` (common.cuh).

#include "common.cuh"

DEFINE_MATMUL(matmul_q4_1, FMT_Q4_1)
