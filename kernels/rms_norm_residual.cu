// rms_norm_residual, the fused pre-norm of a transformer sublayer:
//   residual[r, :] += delta[r, :];  out[r, :] = rms_norm(residual[r, :]) * weight.
// One block per row. The updated row is kept in registers between the two
// passes when it fits (RESIDENT_PER_THREAD values per thread), so the row is
// read once and written twice.

#include "common.cuh"

#define RESIDENT_PER_THREAD 16

extern "C" __global__ void rms_norm_residual(float* __restrict__ residual, const float* __restrict__ delta,
                                             const u8* __restrict__ weight, int weight_fmt, u32 dim, float eps,
                                             float* __restrict__ out) {
    __shared__ float scratch[WARP];
    float* res = residual + (u64)blockIdx.x * dim;
    const float* del = delta + (u64)blockIdx.x * dim;
    float* yr = out + (u64)blockIdx.x * dim;

    float kept[RESIDENT_PER_THREAD];
    float sum = 0.0f;
#pragma unroll
    for (int k = 0; k < RESIDENT_PER_THREAD; ++k) {
        const u32 c = threadIdx.x + k * blockDim.x;
        kept[k] = 0.0f;
        if (c < dim) {
            const float v = res[c] + del[c];
            res[c] = v;
            kept[k] = v;
            sum = fmaf(v, v, sum);
        }
    }
    for (u32 c = threadIdx.x + RESIDENT_PER_THREAD * blockDim.x; c < dim; c += blockDim.x) {
        const float v = res[c] + del[c];
        res[c] = v;
        sum = fmaf(v, v, sum);
    }
    const float inv_rms = rsqrtf(block_sum(sum, scratch) / (float)dim + eps);
#pragma unroll
    for (int k = 0; k < RESIDENT_PER_THREAD; ++k) {
        const u32 c = threadIdx.x + k * blockDim.x;
        if (c < dim) yr[c] = kept[k] * inv_rms * weight_at(weight_fmt, weight, c);
    }
    // Each thread rereads only the elements it wrote itself: no barrier needed.
    for (u32 c = threadIdx.x + RESIDENT_PER_THREAD * blockDim.x; c < dim; c += blockDim.x)
        yr[c] = res[c] * inv_rms * weight_at(weight_fmt, weight, c);
}
