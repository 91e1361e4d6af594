// paged_kv_write_quant: row t of k and v ([rows, kv_heads * head_dim] f32) is
// quantized (INT8, INT4 or INT2; K at `key_bits`, V at `value_bits`) into
// slot slots[t] of the layer's caches.
// Slot layout (tandem_core::kv::quant): `slot_words` u32 words per slot; group
// g = head * groups_per_head + i (32 elements, a head's last group possibly
// shorter) keeps its codes in words [g * bits, (g + 1) * bits), 32 / bits
// codes per word from the low bits up, and its f16 scale (low half) and f16
// min (high half) in word groups * bits + g. Asymmetric: scale = (max - min)
// / (2^bits - 1), both rounded to f16 (saturating at 65504), code =
// floor((x - min) / scale + 0.5) clamped to [0, 2^bits - 1] with the rounded
// values, computed without fused multiply-adds so the codes match the CPU's.
// One thread per (row, group) writes that group of v, and of k unless `keys`
// is 0 (INT4 keys are quantized per channel over each block by
// paged_kv_write_int4_keys.cu); a slot past the cache is skipped.

#include "common.cuh"

#define KV_GROUP 32
#define F16_MAX 65504.0f

__device__ __forceinline__ void quantize_group(const float* __restrict__ x, u32 len, u32* __restrict__ slot, u32 g,
                                               u32 groups, u32 bits) {
    const u32 max_code = (1u << bits) - 1u, per_word = 32u / bits;
    float lo = x[0], hi = x[0];
    for (u32 e = 1; e < len; ++e) lo = fminf(lo, x[e]), hi = fmaxf(hi, x[e]);
    const u16 scale_h = f32_to_f16(fminf(__fdiv_rn(hi - lo, (float)max_code), F16_MAX));
    const u16 min_h = f32_to_f16(fminf(fmaxf(lo, -F16_MAX), F16_MAX));
    const float scale = f16_to_f32(scale_h), zero = f16_to_f32(min_h);
    const float inv = scale > 0.0f ? __fdiv_rn(1.0f, scale) : 0.0f;
    for (u32 w = 0; w < bits; ++w) {
        u32 word = 0;
        for (u32 k = 0; k < per_word; ++k) {
            const u32 e = w * per_word + k;
            if (e >= len) break;
            const float q = floorf(__fadd_rn(__fmul_rn(__fsub_rn(x[e], zero), inv), 0.5f));
            word |= (u32)fminf(fmaxf(q, 0.0f), (float)max_code) << (k * bits);
        }
        slot[g * bits + w] = word;
    }
    slot[groups * bits + g] = (u32)scale_h | ((u32)min_h << 16);
}

extern "C" __global__ void paged_kv_write_quant(const float* __restrict__ k, const float* __restrict__ v,
                                                const u32* __restrict__ slots, u32 rows, u32 kv_heads, u32 head_dim,
                                                u32 groups_per_head, u32 num_slots, u32 key_slot_words,
                                                u32 key_bits, u32 value_slot_words, u32 value_bits, u32 keys,
                                                u32* __restrict__ k_cache, u32* __restrict__ v_cache) {
    const u32 groups = kv_heads * groups_per_head;
    const u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x;
    if (i >= (u64)rows * groups) return;
    const u32 t = (u32)(i / groups), g = (u32)(i % groups);
    const u32 slot = slots[t];
    if (slot >= num_slots) return;
    const u32 head = g / groups_per_head, first = (g % groups_per_head) * KV_GROUP;
    const u32 len = min((u32)KV_GROUP, head_dim - first);
    const u64 src = ((u64)t * kv_heads + head) * head_dim + first;
    if (keys) quantize_group(k + src, len, k_cache + (u64)slot * key_slot_words, g, groups, key_bits);
    quantize_group(v + src, len, v_cache + (u64)slot * value_slot_words, g, groups, value_bits);
}
