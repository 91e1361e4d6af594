// matmul with INT4 group weights: out[t, r] = sum_c x[t, c] * w[r, c] (+ bias[r]).
// Blocks of 64 (INT4_G64) or 128 (INT4_G128) weights: d (f16), m (f16),
// then 16 bytes of nibbles per 32 weights in Q4_1's order; weight = d *
// nibble + m. Decoded in registers by `load_group` (common.cuh). One entry
// point set per group size, `matmul_int4_g64_*` and `matmul_int4_g128_*`.

#include "common.cuh"

DEFINE_MATMUL(matmul_int4_g64, FMT_INT4_G64)
DEFINE_MATMUL(matmul_int4_g128, FMT_INT4_G128)
