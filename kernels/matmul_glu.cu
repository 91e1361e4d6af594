// matmul_glu: a gated linear unit from one matmul. w is [gate; up] (n = 2f
// rows) and out[t, i] = act(y[t, i]) * y[t, f + i] for y = norm(x) · wᵀ,
// act SiLU (act = GLU_SWIGLU) or GELU-tanh (GLU_GEGLU); out is [tokens, f].
//
// Entry points `matmul_glu_STEM_{gemv_t1,2,4,8, tiled, gemv_unaligned}` per
// weight format, the plain matmul's templates (common.cuh) with the
// `RmsNorm` prologue (norm null: no norm) and the `GatedStore` epilogue: the
// virtual rows interleave gate and up, so a GEMV block reads gate row i and
// up row f + i and a tile thread holds both sums of its features; the
// activation is applied in registers and y is never written.
//
// Dense f16/bf16 prefill goes through cuBLAS instead: the normalised
// activations from matmul_rms_norm.cu, the gate GEMM into out, the up GEMM
// into scratch, then `matmul_glu_gate` (out = act(out) * up).

#include "common.cuh"

#define GLU_ARGS                                                                                      \
    const u8 *__restrict__ w, const float *__restrict__ x, const u8 *__restrict__ norm, int norm_fmt, \
        float eps, int act, float *__restrict__ out, u32 tokens, u32 n, u32 cols
#define GLU_PROLOGUE RmsNorm(norm, norm_fmt, eps)
#define GLU_EPILOGUE GatedStore(out, act, n)

#define GLU_ENTRIES(STEM, FMT) DEFINE_MATMUL_ENTRIES(matmul_glu_##STEM, FMT, GLU_ARGS, GLU_PROLOGUE, GLU_EPILOGUE)
#define GLU_UNALIGNED(STEM, FMT) \
    DEFINE_MATMUL_UNALIGNED_ENTRY(matmul_glu_##STEM, FMT, GLU_ARGS, GLU_PROLOGUE, GLU_EPILOGUE)

FOR_EACH_MATMUL_FORMAT(GLU_ENTRIES)
FOR_EACH_FLOAT_FORMAT(GLU_UNALIGNED)

// out[i] = act(out[i]) * up[i] (out holds the gate), grid-stride.
extern "C" __global__ void matmul_glu_gate(float* __restrict__ out, const float* __restrict__ up, u64 len, int act) {
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < len; i += (u64)gridDim.x * blockDim.x) {
        const float g = out[i];
        out[i] = (act == GLU_GEGLU ? gelu_tanh(g) : silu(g)) * up[i];
    }
}
