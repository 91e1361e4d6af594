// matmul with INT8 weights (per-output-channel, weight-only: W8A16):
// out[t, r] = sum_c x[t, c] * w[r, c] (+ bias[r]). Each row is its f32
// scale s then `cols` signed bytes; weight = s * q. Decoded in registers by
// `load_group` (common.cuh); the activations stay f32.

#include "common.cuh"

DEFINE_MATMUL(matmul_int8, FMT_INT8)
