// rope: rotates, in place, the first `rotary_dim` dimensions of every head of
// x ([rows, heads * head_dim]) by angle positions[t] * inv_freq[i] for pair i.
// style 0 (interleaved, GGUF Llama): pair i is dims (2i, 2i+1).
// style 1 (NeoX, Hugging Face): pair i is dims (i, i + rotary_dim / 2).
// One thread per pair. sincosf, not the fast intrinsic: angles reach
// thousands of radians at long positions.

#include "common.cuh"

#define ROPE_INTERLEAVED 0

extern "C" __global__ void rope(float* __restrict__ x, const u32* __restrict__ positions,
                                const float* __restrict__ inv_freq, u32 rows, u32 heads, u32 head_dim,
                                u32 rotary_dim, int style) {
    const u32 half_rot = rotary_dim / 2;
    const u64 pair = blockIdx.x * (u64)blockDim.x + threadIdx.x;
    if (pair >= (u64)rows * heads * half_rot) return;
    const u32 i = (u32)(pair % half_rot);
    const u64 head = pair / half_rot;  // row * heads + h
    const u32 t = (u32)(head / heads);
    float* h = x + head * head_dim;
    const u32 a = style == ROPE_INTERLEAVED ? 2 * i : i;
    const u32 b = style == ROPE_INTERLEAVED ? 2 * i + 1 : i + half_rot;
    float s, c;
    sincosf((float)positions[t] * inv_freq[i], &s, &c);
    const float xa = h[a], xb = h[b];
    h[a] = xa * c - xb * s;
    h[b] = xa * s + xb * c;
}
