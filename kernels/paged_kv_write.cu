// paged_kv_write: row t of k and v ([rows, width], width = kv_heads * head_dim)
// goes to slot slots[t] of the layer's paged cache ([num_slots, width], slot =
// block * block_size + offset). One thread per element; the f16 cache rounds
// to nearest. A slot past the cache is skipped rather than written wild.

#include "common.cuh"

extern "C" __global__ void paged_kv_write_f32(const float* __restrict__ k, const float* __restrict__ v,
                                              const u32* __restrict__ slots, u32 rows, u32 width, u32 num_slots,
                                              float* __restrict__ k_cache, float* __restrict__ v_cache) {
    const u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x;
    if (i >= (u64)rows * width) return;
    const u32 t = (u32)(i / width), c = (u32)(i % width);
    const u32 slot = slots[t];
    if (slot >= num_slots) return;
    k_cache[(u64)slot * width + c] = k[i];
    v_cache[(u64)slot * width + c] = v[i];
}

extern "C" __global__ void paged_kv_write_f16(const float* __restrict__ k, const float* __restrict__ v,
                                              const u32* __restrict__ slots, u32 rows, u32 width, u32 num_slots,
                                              u16* __restrict__ k_cache, u16* __restrict__ v_cache) {
    const u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x;
    if (i >= (u64)rows * width) return;
    const u32 t = (u32)(i / width), c = (u32)(i % width);
    const u32 slot = slots[t];
    if (slot >= num_slots) return;
    k_cache[(u64)slot * width + c] = f32_to_f16(k[i]);
    v_cache[(u64)slot * width + c] = f32_to_f16(v[i]);
}
