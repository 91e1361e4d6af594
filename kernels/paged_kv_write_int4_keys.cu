// paged_kv_write_int4_keys: row t of k ([rows, channels] f32, channels =
// kv_heads * head_dim) goes to slot slots[t] of the layer's INT4 or INT2 key
// cache (`bits`), quantized per channel over each block (values:
// paged_kv_write_quant.cu). Block layout (tandem_core::kv::quant, "INT4 and
// INT2 keys"): with n = 32 / bits codes per word, block_size * W + channels
// u32 words, W = ceil(channels / n): token t's codes in words [t * W, (t + 1)
// * W), channel c in bits bits * (c % n) of word c / n; then channel c's f16
// scale (low half) and f16 min (high half) in word block_size * W + c.
//
// Rows of one block are consecutive in a call, at consecutive offsets, and
// the block's valid tokens before the call are offsets [0, first) (appends
// in position order; a rolled-back tail is ignored). One thread per (row,
// code word); only the first row of a run of rows in one block works: it
// dequantizes the valid tokens of its n channels, adds the run's values and
// quantizes offsets [0, last] again per channel over their range
// (asymmetric, scale = (max - min) / (2^bits - 1), both rounded to f16 and
// saturating at 65504, code = floor((x - min) / scale + 0.5) clamped to
// [0, 2^bits - 1]), without fused multiply-adds so the codes match the
// CPU's. Offsets past `last` get code 0. A thread owns whole words; slots
// past the cache are skipped.

#include "common.cuh"

#define F16_MAX 65504.0f
#define NO_BLOCK 0xffffffffu

__device__ __forceinline__ u32 block_of(const u32* __restrict__ slots, u32 t, u32 block_size, u32 num_slots) {
    const u32 slot = slots[t];
    return slot < num_slots ? slot / block_size : NO_BLOCK;
}

// The CPU's `min + q * scale`, rounded twice like it.
template <u32 BITS>
__device__ __forceinline__ float dequantize_code(u32 word, u32 k, float scale, float zero) {
    return __fadd_rn(zero, __fmul_rn((float)((word >> (BITS * k)) & ((1u << BITS) - 1u)), scale));
}

template <u32 BITS>
__device__ __forceinline__ void write_key_words(const float* __restrict__ k, const u32* __restrict__ slots, u32 rows,
                                                u32 channels, u32 block_size, u32 num_slots,
                                                u32* __restrict__ k_cache) {
    constexpr u32 N = 32u / BITS;
    constexpr float MAX_CODE = (float)((1u << BITS) - 1u);
    const u32 per_token = (channels + N - 1u) / N;
    const u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x;
    if (i >= (u64)rows * per_token) return;
    const u32 t = (u32)(i / per_token), w = (u32)(i % per_token);
    const u32 block = block_of(slots, t, block_size, num_slots);
    if (block == NO_BLOCK || (t > 0 && block_of(slots, t - 1, block_size, num_slots) == block)) return;
    u32 run = 1;
    while (t + run < rows && block_of(slots, t + run, block_size, num_slots) == block) ++run;
    const u32 first = slots[t] % block_size;
    const u32 last = min(first + run - 1u, block_size - 1u);
    u32* base = k_cache + (u64)block * (block_size * per_token + channels);
    u32* params = base + (u64)block_size * per_token;
    const u32 c0 = w * N, lanes = min(N, channels - c0);
    const float* x = k + (u64)t * channels + c0;  // the run's row for offset `first`

    float old_scale[N], old_min[N], lo[N], hi[N];
#pragma unroll
    for (u32 c = 0; c < N; ++c) {
        old_scale[c] = 0.0f, old_min[c] = 0.0f, lo[c] = __int_as_float(0x7f800000), hi[c] = -__int_as_float(0x7f800000);
        if (c < lanes) half2_to_f32<FMT_F16>(params[c0 + c], old_scale[c], old_min[c]);
    }
    for (u32 o = 0; o <= last; ++o) {
        const u32 word = o < first ? base[(u64)o * per_token + w] : 0u;
#pragma unroll
        for (u32 c = 0; c < N; ++c) {
            if (c >= lanes) break;
            const float v = o < first ? dequantize_code<BITS>(word, c, old_scale[c], old_min[c])
                                      : x[(u64)(o - first) * channels + c];
            lo[c] = fminf(lo[c], v), hi[c] = fmaxf(hi[c], v);
        }
    }
    float new_min[N], inv[N];
    u32 packed[N];
#pragma unroll
    for (u32 c = 0; c < N; ++c) {
        new_min[c] = 0.0f, inv[c] = 0.0f, packed[c] = 0u;
        if (c >= lanes) continue;
        const u16 scale_h = f32_to_f16(fminf(__fdiv_rn(__fsub_rn(hi[c], lo[c]), MAX_CODE), F16_MAX));
        const u16 min_h = f32_to_f16(fminf(fmaxf(lo[c], -F16_MAX), F16_MAX));
        const float scale = f16_to_f32(scale_h);
        new_min[c] = f16_to_f32(min_h);
        inv[c] = scale > 0.0f ? __fdiv_rn(1.0f, scale) : 0.0f;
        packed[c] = (u32)scale_h | ((u32)min_h << 16);
    }
    for (u32 o = 0; o < block_size; ++o) {
        u32* at = base + (u64)o * per_token + w;
        u32 word = 0;
        if (o <= last) {
            const u32 old_word = o < first ? *at : 0u;
#pragma unroll
            for (u32 c = 0; c < N; ++c) {
                if (c >= lanes) break;
                const float v = o < first ? dequantize_code<BITS>(old_word, c, old_scale[c], old_min[c])
                                          : x[(u64)(o - first) * channels + c];
                const float q = floorf(__fadd_rn(__fmul_rn(__fsub_rn(v, new_min[c]), inv[c]), 0.5f));
                word |= (u32)fminf(fmaxf(q, 0.0f), MAX_CODE) << (BITS * c);
            }
        }
        *at = word;
    }
#pragma unroll
    for (u32 c = 0; c < N; ++c)
        if (c < lanes) params[c0 + c] = packed[c];
}

extern "C" __global__ void paged_kv_write_int4_keys(const float* __restrict__ k, const u32* __restrict__ slots,
                                                    u32 rows, u32 channels, u32 block_size, u32 num_slots, u32 bits,
                                                    u32* __restrict__ k_cache) {
    if (bits == 2u)
        write_key_words<2>(k, slots, rows, channels, block_size, num_slots, k_cache);
    else
        write_key_words<4>(k, slots, rows, channels, block_size, num_slots, k_cache);
}
