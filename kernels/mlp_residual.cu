// mlp_residual: a layer's whole dense MLP for decode in one launch,
// residual[t] += down · (act(gate · x'_t) * (up · x'_t)), x'_t the RMSNorm of
// residual[t], for up to 8 tokens; gate_up is [gate; up] (2f rows), down is
// [dim, f], both of one weight format. The [tokens, f] intermediate never
// leaves the chip.
//
// Entry points `mlp_residual_STEM_t{1,8}` (up to 1 or 8 tokens) for every
// format whose matmul takes f32 activations (not W8A8), f % 32 == 0 and, for
// float formats, dim % 8 == 0. Grid: f / 32 blocks of MLP_THREADS. Block b
// owns the intermediate features [32b, 32b + 32):
//   1. their gate and up sums (a warp per feature at a time, lanes over
//      groups of eight columns, the norm applied as x is read), the
//      activation in registers, the 32 products per token in shared memory;
//   2. their share of every output row: columns [32b, 32b + 32) of a down row
//      are one run of four groups, read by four lanes, written to
//      partials[b][t][r];
//   3. the last block to count itself done (an atomic counter after
//      __threadfence, the CUDA programming guide's pattern) sums the partials
//      in block order and adds them into the residual, so the bits never
//      depend on which block came last, then zeroes the counter for the next
//      launch.
// Every block reads the residual in step 1 and only the last writes it, after
// every block has counted itself done, so no read sees a write. It is read
// with plain loads, not __ldg: it changes during the launch.

#include "common.cuh"

#define MLP_SLICE 32
#define MLP_THREADS 256
#define MLP_WARPS (MLP_THREADS / WARP)

// 1 / rms(x[t]) for t < tokens into inv[t], a warp per token.
__device__ __forceinline__ void mlp_inv_rms(const float* x, u32 tokens, u32 dim, float eps, float* inv) {
    const int lane = threadIdx.x % WARP;
    for (u32 t = threadIdx.x / WARP; t < tokens; t += MLP_WARPS) {
        float s = 0.0f;
        for (u32 c = lane; c < dim; c += WARP) s = fmaf(x[(u64)t * dim + c], x[(u64)t * dim + c], s);
        s = warp_sum(s);
        if (lane == 0) inv[t] = rsqrtf(s / (float)dim + eps);
    }
    __syncthreads();
}

// Step 1: h[t][i] = act(gate_i · x'_t) * (up_i · x'_t) for the block's features.
template <int FMT, int MAX_T>
__device__ __forceinline__ void mlp_intermediate(const u8* __restrict__ gate_up, const float* x, u32 tokens,
                                                 u32 dim, u32 f, const RmsNorm& norm, const float* inv, int act,
                                                 float (*h)[MLP_SLICE]) {
    const int lane = threadIdx.x % WARP;
    const u64 row_bytes = row_bytes_of<FMT>(dim);
    const u32 groups = dim / 8;
    for (u32 i = threadIdx.x / WARP; i < MLP_SLICE; i += MLP_WARPS) {
        const u32 feature = blockIdx.x * MLP_SLICE + i;
        const u8* gate = gate_up + feature * row_bytes;
        const u8* up = gate_up + (f + feature) * row_bytes;
        float acc[2][MAX_T];
#pragma unroll
        for (int t = 0; t < MAX_T; ++t) acc[0][t] = acc[1][t] = 0.0f;
        for (u32 g = lane; g < groups; g += WARP) {
            float wg[8], wu[8], gm[8];
            load_group<FMT>(gate, g, wg);
            load_group<FMT>(up, g, wu);
            const u32 c0 = group_run<FMT>(g, 0), c1 = group_run<FMT>(g, 1);
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                gm[j] = norm.gamma(c0 + j);
                gm[4 + j] = norm.gamma(c1 + j);
            }
#pragma unroll
            for (int t = 0; t < MAX_T; ++t) {
                if (t < tokens) {
                    const float* row = x + (u64)t * dim;
                    const float4 a = apply4(norm, *reinterpret_cast<const float4*>(row + c0), inv[t], gm);
                    const float4 b = apply4(norm, *reinterpret_cast<const float4*>(row + c1), inv[t], gm + 4);
                    const float xs[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
                    for (int j = 0; j < 8; ++j) {
                        acc[0][t] = fmaf(wg[j], xs[j], acc[0][t]);
                        acc[1][t] = fmaf(wu[j], xs[j], acc[1][t]);
                    }
                }
            }
        }
#pragma unroll
        for (int t = 0; t < MAX_T; ++t) {
            const float gate_sum = warp_sum(acc[0][t]), up_sum = warp_sum(acc[1][t]);
            if (lane == 0 && t < tokens)
                h[t][i] = (act == GLU_GEGLU ? gelu_tanh(gate_sum) : silu(gate_sum)) * up_sum;
        }
    }
    __syncthreads();
}

// Step 2: partials[t][r] = down[r, 32b : 32b + 32] · h[t] for every row r.
template <int FMT, int MAX_T>
__device__ __forceinline__ void mlp_down_partials(const u8* __restrict__ down, u32 tokens, u32 dim, u32 f,
                                                  const float (*h)[MLP_SLICE], float* __restrict__ partials) {
    const u64 row_bytes = row_bytes_of<FMT>(f);
    const u32 quarter = threadIdx.x % 4;
    const u32 g = blockIdx.x * 4 + quarter;
    // Whole warps take each step, so the four lanes of a row can shuffle.
    for (u32 base = 0; base < dim; base += MLP_THREADS / 4) {
        const u32 r = base + threadIdx.x / 4;
        float w[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
        if (r < dim) load_group<FMT>(down + r * row_bytes, g, w);
        float s[MAX_T];
#pragma unroll
        for (int t = 0; t < MAX_T; ++t) {
            s[t] = 0.0f;
#pragma unroll
            for (int j = 0; j < 8; ++j) s[t] = fmaf(w[j], h[t][group_col<FMT>(g, j) - blockIdx.x * MLP_SLICE], s[t]);
            s[t] += __shfl_xor_sync(FULL_MASK, s[t], 1);
            s[t] += __shfl_xor_sync(FULL_MASK, s[t], 2);
        }
        if (r < dim && quarter == 0) {
#pragma unroll
            for (int t = 0; t < MAX_T; ++t)
                if (t < tokens) partials[(u64)t * dim + r] = s[t];
        }
    }
}

// Step 3, in the last block: residual += the partials summed in block order.
__device__ __forceinline__ void mlp_reduce_if_last(float* residual, const float* partials, u32* counter,
                                                   u32 tokens, u32 dim) {
    __shared__ bool last;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(counter, 1u) == gridDim.x - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    const u64 len = (u64)tokens * dim;
    for (u64 i = threadIdx.x; i < len; i += MLP_THREADS) {
        float s = 0.0f;
        for (u32 b = 0; b < gridDim.x; ++b) s += __ldcg(partials + b * len + i);
        residual[i] += s;
    }
    if (threadIdx.x == 0) *counter = 0;
}

template <int FMT, int MAX_T>
__device__ __forceinline__ void mlp_residual(const u8* __restrict__ gate_up, const u8* __restrict__ down,
                                             float* residual, const u8* __restrict__ norm, int norm_fmt, float eps,
                                             int act, float* __restrict__ partials, u32* __restrict__ counter,
                                             u32 tokens, u32 dim, u32 f) {
    __shared__ float inv[MAX_T];
    __shared__ float h[MAX_T][MLP_SLICE];
    if (tokens > MAX_T) tokens = MAX_T;
    mlp_inv_rms(residual, tokens, dim, eps, inv);
    mlp_intermediate<FMT, MAX_T>(gate_up, residual, tokens, dim, f, RmsNorm(norm, norm_fmt, eps), inv, act, h);
    mlp_down_partials<FMT, MAX_T>(down, tokens, dim, f, h, partials + (u64)blockIdx.x * tokens * dim);
    mlp_reduce_if_last(residual, partials, counter, tokens, dim);
}

#define MLP_ARGS                                                                                       \
    const u8 *__restrict__ gate_up, const u8 *__restrict__ down, float *residual,                      \
        const u8 *__restrict__ norm, int norm_fmt, float eps, int act, float *__restrict__ partials,   \
        u32 *__restrict__ counter, u32 tokens, u32 dim, u32 f
#define MLP_CALL(FMT, T) \
    mlp_residual<FMT, T>(gate_up, down, residual, norm, norm_fmt, eps, act, partials, counter, tokens, dim, f)

#define MLP_ENTRIES(STEM, FMT)                                                                     \
    extern "C" __global__ void __launch_bounds__(MLP_THREADS, 1) mlp_residual_##STEM##_t1(MLP_ARGS) { \
        MLP_CALL(FMT, 1);                                                                          \
    }                                                                                              \
    extern "C" __global__ void __launch_bounds__(MLP_THREADS, 1) mlp_residual_##STEM##_t8(MLP_ARGS) { \
        MLP_CALL(FMT, 8);                                                                          \
    }

FOR_EACH_F32_ACTIVATION_FORMAT(MLP_ENTRIES)
