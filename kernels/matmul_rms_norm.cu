// matmul_rms_norm: y = norm(x) · wᵀ + bias, the columns of y split in order
// into up to three outputs (Q, K and V from one concatenated weight; or one
// output, the logits from the unnormalised residual).
//
// Entry points `matmul_rms_norm_STEM_{gemv_t1,2,4,8, tiled, gemv_unaligned}`
// per weight format, the plain matmul's templates (common.cuh) with the
// `RmsNorm` prologue (norm null: no norm) and the `SplitStore` epilogue:
// columns [0, end0) go to out0, [end0, end1) to out1, [end1, n) to out2
// (an absent part is empty, its pointer null).
//
// Dense f16/bf16 prefill goes through cuBLAS instead (as `matmul` does); for
// it `matmul_rms_norm_{f16,bf16}_split_x` write the normalised activations
// straight in the GEMM's half type as hi + lo (`split_half`, as matmul_f16.cu
// and matmul_bf16.cu do, with the norm), each part is two GEMMs into its output, and
// `matmul_rms_norm_add_bias` adds that part's slice of the bias.

#include "common.cuh"

#define RMS_NORM_ARGS                                                                                  \
    const u8 *__restrict__ w, const float *__restrict__ x, const u8 *__restrict__ norm, int norm_fmt,  \
        float eps, const u8 *__restrict__ bias, int bias_fmt, float *__restrict__ out0,                \
        float *__restrict__ out1, float *__restrict__ out2, u32 end0, u32 end1, u32 tokens, u32 n, u32 cols
#define RMS_NORM_PROLOGUE RmsNorm(norm, norm_fmt, eps)
#define RMS_NORM_EPILOGUE SplitStore(out0, out1, out2, end0, end1, n, bias, bias_fmt)

#define RMS_NORM_ENTRIES(STEM, FMT) \
    DEFINE_MATMUL_ENTRIES(matmul_rms_norm_##STEM, FMT, RMS_NORM_ARGS, RMS_NORM_PROLOGUE, RMS_NORM_EPILOGUE)
#define RMS_NORM_UNALIGNED(STEM, FMT)                                                            \
    DEFINE_MATMUL_UNALIGNED_ENTRY(matmul_rms_norm_##STEM, FMT, RMS_NORM_ARGS, RMS_NORM_PROLOGUE, \
                                  RMS_NORM_EPILOGUE)

FOR_EACH_MATMUL_FORMAT(RMS_NORM_ENTRIES)
FOR_EACH_FLOAT_FORMAT(RMS_NORM_UNALIGNED)

// ---- the cuBLAS path: one block per row of x ----

// 1 / rms of row `xr`, as rms_norm.cu computes it; every thread gets it.
__device__ __forceinline__ float row_inv_rms(const float* __restrict__ xr, u32 cols, float eps, float* scratch) {
    float sum = 0.0f;
    for (u32 c = threadIdx.x; c < cols; c += blockDim.x) sum = fmaf(xr[c], xr[c], sum);
    return rsqrtf(block_sum(sum, scratch) / (float)cols + eps);
}

// The normalised row as a hi + lo pair of halves (`split_half`).
template <bool BF16>
__device__ __forceinline__ void rms_norm_split_x(const float* __restrict__ x, const u8* __restrict__ norm,
                                                 int norm_fmt, float eps, u32 cols, u16* __restrict__ hi,
                                                 u16* __restrict__ lo) {
    __shared__ float scratch[WARP];
    const u64 row = (u64)blockIdx.x * cols;
    const float inv = row_inv_rms(x + row, cols, eps, scratch);
    for (u32 c = threadIdx.x; c < cols; c += blockDim.x)
        split_half<BF16>(x[row + c] * inv * weight_at(norm_fmt, norm, c), hi + row + c, lo + row + c);
}

extern "C" __global__ void matmul_rms_norm_f16_split_x(const float* __restrict__ x, const u8* __restrict__ norm,
                                                       int norm_fmt, float eps, u32 cols, u16* __restrict__ hi,
                                                       u16* __restrict__ lo) {
    rms_norm_split_x<false>(x, norm, norm_fmt, eps, cols, hi, lo);
}

extern "C" __global__ void matmul_rms_norm_bf16_split_x(const float* __restrict__ x, const u8* __restrict__ norm,
                                                        int norm_fmt, float eps, u32 cols, u16* __restrict__ hi,
                                                        u16* __restrict__ lo) {
    rms_norm_split_x<true>(x, norm, norm_fmt, eps, cols, hi, lo);
}

// out[t, i] += bias[start + i] over one part, [rows, width]; grid-stride.
extern "C" __global__ void matmul_rms_norm_add_bias(float* __restrict__ out, const u8* __restrict__ bias,
                                                    int bias_fmt, u32 rows, u32 width, u32 start) {
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < (u64)rows * width; i += (u64)gridDim.x * blockDim.x)
        out[i] += weight_at(bias_fmt, bias, start + (u32)(i % width));
}
