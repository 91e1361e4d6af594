// matmul with W8A8 weights (SmoothQuant): out[t, r] = s_r * a_t *
// sum_c q_x[t, c] * q_w[r, c] (+ bias[r]). The weights are INT8's bytes
// (per row: f32 scale s_r, then `cols` signed bytes). Each activation row is
// quantized to INT8 here, per token, as tandem_core::quant::
// quantize_activation_row_i8 defines: a_t = max_c |x[t, c]| / 127 and q_x =
// rint(x * (127 / max|x|)) (ties to even). The INT8 products are summed in
// i32 with __dp4a (four i8 x i8 products per instruction); only the final
// sum becomes f32. `cols` is a multiple of 32. Entry points and launch
// shapes as every matmul (common.cuh): `_gemv_t{1,2,4,8}` (GEMV_ROWS rows
// per block of GEMV_WARPS warps) and `_tiled` (64 tokens x 64 rows).

#include "common.cuh"

__device__ __forceinline__ float inverse_scale(float amax) {
    return amax > 0.0f ? 127.0f / amax : 0.0f;
}

// Four activations quantized and packed as four signed bytes.
__device__ __forceinline__ int quant_x4(const float* x, float inverse) {
    const float4 v = __ldg(reinterpret_cast<const float4*>(x));
    const float f[4] = {v.x, v.y, v.z, v.w};
    u32 packed = 0;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const int q = max(-127, min(127, __float2int_rn(f[j] * inverse)));
        packed |= ((u32)q & 0xffu) << (8 * j);
    }
    return (int)packed;
}

__device__ __forceinline__ float row_max_abs(const float* x, u32 cols, u32 first, u32 stride) {
    float m = 0.0f;
    for (u32 c = first; c < cols; c += stride) m = fmaxf(m, fabsf(__ldg(x + c)));
    return m;
}

__device__ __forceinline__ void store_w8a8(float* out, const u8* __restrict__ w, u64 row_bytes,
                                           const u8* __restrict__ bias, int bias_fmt, u32 t, u32 r,
                                           u32 n, int sum, float x_scale) {
    const float s = __ldg(reinterpret_cast<const float*>(w + r * row_bytes));
    float v = (float)sum * (s * x_scale);
    if (bias != nullptr) v += weight_at(bias_fmt, bias, r);
    out[(u64)t * n + r] = v;
}

template <int MAX_T>
__device__ __forceinline__ void gemv_w8a8(MATMUL_ARGS) {
    __shared__ float warp_max_scratch[GEMV_WARPS];
    __shared__ int partial[GEMV_WARPS][GEMV_ROWS * MAX_T];
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
    const u32 row0 = blockIdx.x * GEMV_ROWS;
    const u64 row_bytes = row_bytes_of<FMT_W8A8>(cols);

    float inverse[MAX_T], x_scale[MAX_T];
#pragma unroll
    for (int t = 0; t < MAX_T; ++t) {
        float m = t < tokens ? row_max_abs(x + (u64)t * cols, cols, threadIdx.x, blockDim.x) : 0.0f;
        m = warp_max(m);
        __syncthreads();
        if (lane == 0) warp_max_scratch[warp] = m;
        __syncthreads();
#pragma unroll
        for (int k = 0; k < GEMV_WARPS; ++k) m = fmaxf(m, warp_max_scratch[k]);
        inverse[t] = inverse_scale(m);
        x_scale[t] = m / 127.0f;
    }

    int acc[GEMV_ROWS][MAX_T];
#pragma unroll
    for (int r = 0; r < GEMV_ROWS; ++r)
#pragma unroll
        for (int t = 0; t < MAX_T; ++t) acc[r][t] = 0;

    const u32 words = cols / 4;
    for (u32 p = threadIdx.x; p < words; p += blockDim.x) {
        int wq[GEMV_ROWS];
#pragma unroll
        for (int r = 0; r < GEMV_ROWS; ++r) {
            // The last block's second row may lie past `n`: reread row0 (in bounds, result unused).
            const u32 row = row0 + r < n ? row0 + r : row0;
            wq[r] = (int)load_u32(w + row * row_bytes + 4 + 4 * (u64)p);
        }
#pragma unroll
        for (int t = 0; t < MAX_T; ++t) {
            if (t < tokens) {
                const int xq = quant_x4(x + (u64)t * cols + 4 * p, inverse[t]);
#pragma unroll
                for (int r = 0; r < GEMV_ROWS; ++r) acc[r][t] = __dp4a(wq[r], xq, acc[r][t]);
            }
        }
    }

#pragma unroll
    for (int r = 0; r < GEMV_ROWS; ++r)
#pragma unroll
        for (int t = 0; t < MAX_T; ++t) {
            int s = acc[r][t];
#pragma unroll
            for (int offset = WARP / 2; offset > 0; offset >>= 1) s += __shfl_xor_sync(FULL_MASK, s, offset);
            if (lane == 0) partial[warp][r * MAX_T + t] = s;
        }
    __syncthreads();
    if (threadIdx.x < GEMV_ROWS * MAX_T) {
        const u32 r = threadIdx.x / MAX_T, t = threadIdx.x % MAX_T, row = row0 + r;
        if (t < tokens && row < n) {
            int s = 0;
#pragma unroll
            for (int k = 0; k < GEMV_WARPS; ++k) s += partial[k][threadIdx.x];
            store_w8a8(out, w, row_bytes, bias, bias_fmt, t, row, n, s, x_scale[t]);
        }
    }
}

// Words (four quants) per row of a K step of the tiled kernel.
#define W8A8_TILE_WORDS (TILE_K / 4)

__device__ __forceinline__ void gemm_tiled_w8a8(MATMUL_ARGS) {
    __shared__ int xs[TILE_T][W8A8_TILE_WORDS + 1];
    __shared__ int ws[TILE_R][W8A8_TILE_WORDS + 1];
    // max|x| of the tile's tokens as the bits of non-negative floats (which order like the floats).
    __shared__ unsigned int amax_bits[TILE_T];

    const int tid = threadIdx.x;
    const u32 t_base = blockIdx.y * TILE_T, r_base = blockIdx.x * TILE_R;
    const u64 row_bytes = row_bytes_of<FMT_W8A8>(cols);
    // Loader roles: 4 threads per tile row, 2 words each.
    const int load_row = tid / 4, load_part = tid % 4;
    // Compute roles: 16 x 16 threads, 4 x 4 outputs each.
    const int tx = tid % 16, ty = tid / 16;

    if (tid < TILE_T) amax_bits[tid] = 0u;
    __syncthreads();
    {
        const u32 t = t_base + load_row;
        const float m = t < tokens ? row_max_abs(x + (u64)t * cols, cols, load_part, 4) : 0.0f;
        atomicMax(&amax_bits[load_row], __float_as_uint(m));
    }
    __syncthreads();
    const float inverse = inverse_scale(__uint_as_float(amax_bits[load_row]));

    int acc[4][4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = 0;

    for (u32 k0 = 0; k0 < cols; k0 += TILE_K) {
        const u32 t = t_base + load_row, r = r_base + load_row;
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            const u32 word = 2 * load_part + j;
            xs[load_row][word] = t < tokens ? quant_x4(x + (u64)t * cols + k0 + 4 * word, inverse) : 0;
            ws[load_row][word] = r < n ? (int)load_u32(w + r * row_bytes + 4 + k0 + 4 * word) : 0;
        }
        __syncthreads();
#pragma unroll
        for (int k = 0; k < W8A8_TILE_WORDS; ++k) {
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int a = xs[4 * ty + i][k];
#pragma unroll
                for (int j = 0; j < 4; ++j) acc[i][j] = __dp4a(a, ws[4 * tx + j][k], acc[i][j]);
            }
        }
        __syncthreads();
    }

#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const u32 t = t_base + 4 * ty + i;
        if (t >= tokens) continue;
        const float x_scale = __uint_as_float(amax_bits[4 * ty + i]) / 127.0f;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const u32 r = r_base + 4 * tx + j;
            if (r < n) store_w8a8(out, w, row_bytes, bias, bias_fmt, t, r, n, acc[i][j], x_scale);
        }
    }
}

extern "C" __global__ void matmul_w8a8_gemv_t1(MATMUL_ARGS) { gemv_w8a8<1>(MATMUL_PASS); }
extern "C" __global__ void matmul_w8a8_gemv_t2(MATMUL_ARGS) { gemv_w8a8<2>(MATMUL_PASS); }
extern "C" __global__ void matmul_w8a8_gemv_t4(MATMUL_ARGS) { gemv_w8a8<4>(MATMUL_PASS); }
extern "C" __global__ void matmul_w8a8_gemv_t8(MATMUL_ARGS) { gemv_w8a8<8>(MATMUL_PASS); }
extern "C" __global__ void matmul_w8a8_tiled(MATMUL_ARGS) { gemm_tiled_w8a8(MATMUL_PASS); }
