// matmul_residual: out[t, r] += sum_c x[t, c] * w[r, c], a projection whose
// epilogue adds it into the residual stream (O and down).
//
// Entry points `matmul_residual_STEM_{gemv_t1,2,4,8, tiled, gemv_unaligned}`
// per weight format, the plain matmul's templates (common.cuh) with no
// prologue and the `AddStore` epilogue. Dense f16/bf16 prefill goes through
// cuBLAS instead, which accumulates into out itself (beta = 1).

#include "common.cuh"

#define RESIDUAL_ARGS \
    const u8 *__restrict__ w, const float *__restrict__ x, float *__restrict__ out, u32 tokens, u32 n, u32 cols

#define RESIDUAL_ENTRIES(STEM, FMT) \
    DEFINE_MATMUL_ENTRIES(matmul_residual_##STEM, FMT, RESIDUAL_ARGS, NoNorm(), AddStore(out, n))
#define RESIDUAL_UNALIGNED(STEM, FMT) \
    DEFINE_MATMUL_UNALIGNED_ENTRY(matmul_residual_##STEM, FMT, RESIDUAL_ARGS, NoNorm(), AddStore(out, n))

FOR_EACH_MATMUL_FORMAT(RESIDUAL_ENTRIES)
FOR_EACH_FLOAT_FORMAT(RESIDUAL_UNALIGNED)
