// matmul with IQ4_NL weights: out[t, r] = sum_c x[t, c] * w[r, c] (+ bias[r]).
// Blocks of 32 weights, 18 bytes: d (f16), 16 bytes of nibbles; weight =
// d * IQ4NL_VALUES[nibble] (GGML's non-uniform table).
// Layout: core/src/quant/. Decoded in registers by `load_group` (common.cuh,
// `decode_run4`), eight weights (two runs of four) at a time.

#include "common.cuh"

DEFINE_MATMUL(matmul_iq4_nl, FMT_IQ4_NL)
