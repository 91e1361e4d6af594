// matmul with W8A8 weights (SmoothQuant): out[t, r] = s_r * a_t *
// sum_c q_x[t, c] * q_w[r, c] (+ bias[r]). The weights are INT8's bytes (per
// row: f32 scale s_r, then `cols` signed bytes); each activation row is
// quantized to INT8 per token inside the kernel and the products summed in
// i32 with __dp4a (`gemv_w8a8` and `gemm_tiled_w8a8` in common.cuh, which
// the fused matmuls share). Entry points and launch shapes as every matmul.

#include "common.cuh"

DEFINE_MATMUL(matmul_w8a8, FMT_W8A8)
