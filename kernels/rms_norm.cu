// rms_norm: out[r, :] = x[r, :] / sqrt(mean(x[r, :]^2) + eps) * weight.
// One block per row; the weight may be stored in any format.

#include "common.cuh"

extern "C" __global__ void rms_norm(const float* __restrict__ x, const u8* __restrict__ weight, int weight_fmt,
                                    u32 dim, float eps, float* __restrict__ out) {
    __shared__ float scratch[WARP];
    const float* xr = x + (u64)blockIdx.x * dim;
    float* yr = out + (u64)blockIdx.x * dim;
    float sum = 0.0f;
    for (u32 c = threadIdx.x; c < dim; c += blockDim.x) sum = fmaf(xr[c], xr[c], sum);
    const float inv_rms = rsqrtf(block_sum(sum, scratch) / (float)dim + eps);
    for (u32 c = threadIdx.x; c < dim; c += blockDim.x) yr[c] = xr[c] * inv_rms * weight_at(weight_fmt, weight, c);
}
