// Helpers shared by the kernels in this folder. The backend pastes this file
// in place of `#include "common.cuh"` before handing a kernel to NVRTC, so it
// must not include anything itself: half-precision conversions are inline
// PTX rather than cuda_fp16.h, and the kernels need no include path at all.
//
// Weight layouts are documented in core/src/quant/mod.rs (GGML's, and
// Tandem's INT8/W8A8/INT4): a weight matrix is row-major, each row an optional
// head (INT8's f32 scale) then a run of blocks; multi-byte fields are
// little-endian (as is the GPU). Q8_0 (34-byte), Q4_0 and IQ4_NL (18-byte),
// Q5_0 (22-byte), Q3_K (110-byte) and Q6_K (210-byte) blocks are only 2-byte
// aligned, so they are read as 16-bit halves; the others are 4-byte aligned.
// The k-quants (Q2_K..Q6_K, core/src/quant/kquant.rs) are super-blocks of 256.

#pragma once

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

// Weight format codes, as `tandem_cuda` passes them (`format_code`).
#define FMT_F32 0
#define FMT_F16 1
#define FMT_BF16 2
#define FMT_Q8_0 3
#define FMT_Q4_0 4
#define FMT_Q4_1 5
#define FMT_INT8 6
#define FMT_W8A8 7
#define FMT_INT4_G64 8
#define FMT_INT4_G128 9
#define FMT_Q5_0 10
#define FMT_Q5_1 11
#define FMT_IQ4_NL 12
#define FMT_Q2_K 13
#define FMT_Q3_K 14
#define FMT_Q4_K 15
#define FMT_Q5_K 16
#define FMT_Q6_K 17

#define WARP 32
#define FULL_MASK 0xffffffffu

// ---- scalar conversions ----

__device__ __forceinline__ float f16_to_f32(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ u16 f32_to_f16(float f) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

__device__ __forceinline__ float bf16_to_f32(u16 h) {
    return __uint_as_float(((u32)h) << 16);
}

__device__ __forceinline__ u16 f32_to_bf16(float f) {
    u16 h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

// v as hi + lo halves for the cuBLAS GEMMs (hi = half(v), lo = half(v - hi)):
// one half alone keeps too few bits of the activations for the manifest
// tolerance (f16's 11 give errors near 2e-3 over a few hundred columns).
template <bool BF16>
__device__ __forceinline__ void split_half(float v, u16* hi, u16* lo) {
    const u16 h = BF16 ? f32_to_bf16(v) : f32_to_f16(v);
    *hi = h;
    *lo = BF16 ? f32_to_bf16(v - bf16_to_f32(h)) : f32_to_f16(v - f16_to_f32(h));
}

__device__ __forceinline__ u16 load_u16(const u8* p) {
    return __ldg(reinterpret_cast<const u16*>(p));
}

// Four bytes at a 2-byte aligned address.
__device__ __forceinline__ u32 load_u32_a2(const u8* p) {
    return (u32)load_u16(p) | ((u32)load_u16(p + 2) << 16);
}

__device__ __forceinline__ u32 load_u32(const u8* p) {
    return __ldg(reinterpret_cast<const u32*>(p));
}

// ---- weight elements ----

__device__ __forceinline__ constexpr bool is_k_quant(int fmt) {
    return fmt >= FMT_Q2_K && fmt <= FMT_Q6_K;
}

// Elements per block: 1 for float formats, 32 for GGML's and INT8, the group
// for INT4, 256 for the k-quants.
__device__ __forceinline__ constexpr int block_elems(int fmt) {
    switch (fmt) {
        case FMT_F32:
        case FMT_F16:
        case FMT_BF16: return 1;
        case FMT_INT4_G64: return 64;
        case FMT_INT4_G128: return 128;
        case FMT_Q2_K:
        case FMT_Q3_K:
        case FMT_Q4_K:
        case FMT_Q5_K:
        case FMT_Q6_K: return 256;
        default: return 32;
    }
}

// Bytes per block (per element for float formats).
__device__ __forceinline__ constexpr int block_bytes(int fmt) {
    switch (fmt) {
        case FMT_F32: return 4;
        case FMT_F16:
        case FMT_BF16: return 2;
        case FMT_Q8_0: return 34;
        case FMT_Q4_0: return 18;
        case FMT_INT8:
        case FMT_W8A8: return 32;
        case FMT_INT4_G64: return 36;
        case FMT_INT4_G128: return 68;
        case FMT_Q5_0: return 22;
        case FMT_Q5_1: return 24;
        case FMT_IQ4_NL: return 18;
        case FMT_Q2_K: return 84;
        case FMT_Q3_K: return 110;
        case FMT_Q4_K: return 144;
        case FMT_Q5_K: return 176;
        case FMT_Q6_K: return 210;
        default: return 20;
    }
}

// Bytes before a row's first block: INT8's per-row scale.
__device__ __forceinline__ constexpr int row_head_bytes(int fmt) {
    return fmt == FMT_INT8 || fmt == FMT_W8A8 ? 4 : 0;
}

__device__ __forceinline__ constexpr bool is_quantized(int fmt) {
    return block_elems(fmt) > 1;
}

// Bytes of one row of `cols` weights.
template <int FMT>
__device__ __forceinline__ u64 row_bytes_of(u32 cols) {
    return row_head_bytes(FMT) + (u64)(cols / block_elems(FMT)) * block_bytes(FMT);
}

// The run of 32 quants holding element `i` of a 4-bit row: 16 bytes of
// nibbles, and the block's `d` and `m` (Q4_1 and INT4; one `[d, m]` per group).
__device__ __forceinline__ const u8* nibble_run(int fmt, const u8* row, u32 i, float& d, float& m) {
    const u32 runs_per_block = block_elems(fmt) / 32;
    const u8* block = row + (u64)(i / block_elems(fmt)) * block_bytes(fmt);
    d = f16_to_f32(load_u16(block));
    m = f16_to_f32(load_u16(block + 2));
    return block + 4 + 16 * ((i >> 5) % runs_per_block);
}

// ---- runs of four weights: Q5_0, Q5_1, IQ4_NL and the k-quants ----
//
// `decode_run4<FMT>(block, e, w)` decodes values e..e+3 (e % 4 == 0) of one
// block (32 values) or k-quant super-block (256 values) into w[0..4], reading
// only the words those four values need; shaders/matmul_FMT.wgsl's `decode4`
// are the same decoders, line for line.

__device__ __forceinline__ constexpr bool has_run4_decoder(int fmt) {
    return fmt == FMT_Q5_0 || fmt == FMT_Q5_1 || fmt == FMT_IQ4_NL || is_k_quant(fmt);
}

// IQ4_NL's level of a nibble (GGML's `kvalues_iq4nl`, tandem_core's
// IQ4NL_VALUES): the 16 signed bytes packed in four words, picked by byte_perm.
__device__ __forceinline__ float iq4nl_value(u32 nib) {
    const u32 lo = __byte_perm(0xbfad9881u, 0xf6eaddcfu, nib & 7);
    const u32 hi = __byte_perm(0x26190d01u, 0x71594535u, nib & 7);
    return (float)(signed char)(nib & 8 ? hi : lo);
}

// Q4_K's and Q5_K's 6-bit scale and minimum of sub-block j (of 8) from the
// 12 `scales` bytes at `scales` (kquant::scale_min_k4).
__device__ __forceinline__ void scale_min_k4(const u8* scales, u32 j, float& sc, float& mn) {
    const u32 s0 = load_u32(scales), s1 = load_u32(scales + 4);
    if (j < 4) {
        sc = (float)((s0 >> (8 * j)) & 63);
        mn = (float)((s1 >> (8 * j)) & 63);
    } else {
        const u32 s2 = (load_u32(scales + 8) >> (8 * (j - 4))) & 0xff;
        sc = (float)((s2 & 15) | (((s0 >> (8 * (j - 4))) >> 6 & 3) << 4));
        mn = (float)((s2 >> 4) | (((s1 >> (8 * (j - 4))) >> 6 & 3) << 4));
    }
}

template <int FMT>
__device__ __forceinline__ void decode_run4(const u8* block, u32 e, float w[4]) {
    if (FMT == FMT_Q5_0 || FMT == FMT_Q5_1 || FMT == FMT_IQ4_NL) {
        // Values e..e+4: low nibbles of qs[e..e+4] for e < 16, high nibbles of
        // qs[e-16..e-12] above; Q5's fifth bits are bits e..e+4 of qh.
        float d, m = 0.0f;
        u32 q, h = 0;
        if (FMT == FMT_Q5_1) {
            const u32 dm = load_u32(block);
            d = f16_to_f32((u16)(dm & 0xffff));
            m = f16_to_f32((u16)(dm >> 16));
            h = load_u32(block + 4) >> e;
            q = load_u32(block + 8 + (e & 15)) >> (4 * (e >> 4));
        } else {
            d = f16_to_f32(load_u16(block));
            if (FMT == FMT_Q5_0) {
                h = load_u32_a2(block + 2) >> e;
                m = -16.0f * d;
                q = load_u32_a2(block + 6 + (e & 15)) >> (4 * (e >> 4));
            } else {
                q = load_u32_a2(block + 2 + (e & 15)) >> (4 * (e >> 4));
            }
        }
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const u32 nib = (q >> (8 * k)) & 15;
            if (FMT == FMT_IQ4_NL) {
                w[k] = d * iq4nl_value(nib);
            } else {
                w[k] = d * (float)(nib | (((h >> k) & 1) << 4)) + m;
            }
        }
    } else if (FMT == FMT_Q4_K || FMT == FMT_Q5_K) {
        // Sub-block j = e / 32: low nibbles of qs[32(j/2)..] for even j, high
        // for odd; Q5_K's fifth bit of value 32j + l is bit j of qh[l].
        const u32 j = e >> 5, l = e & 31;
        const u32 dm = load_u32(block);
        float sc, mn;
        scale_min_k4(block + 4, j, sc, mn);
        const float scale = f16_to_f32((u16)(dm & 0xffff)) * sc;
        const float offset = -f16_to_f32((u16)(dm >> 16)) * mn;
        const u8* qs = block + (FMT == FMT_Q5_K ? 48 : 16);
        const u32 q = load_u32(qs + 32 * (j >> 1) + l) >> (4 * (j & 1));
        const u32 h = FMT == FMT_Q5_K ? load_u32(block + 16 + l) >> j : 0;
#pragma unroll
        for (int k = 0; k < 4; ++k)
            w[k] = scale * (float)(((q >> (8 * k)) & 15) | (((h >> (8 * k)) & 1) << 4)) + offset;
    } else {
        // Q2_K, Q3_K, Q6_K: value 128h + 32s + l (s < 4, l < 32), one scale per 16.
        const u32 hh = e >> 7, s = (e >> 5) & 3, l = e & 31, j = e >> 4;
        if (FMT == FMT_Q6_K) {
            const float scale = f16_to_f32(load_u16(block + 208)) * (float)(signed char)__ldg(block + 192 + j);
            const u32 lo = load_u32_a2(block + 64 * hh + l + 32 * (s & 1)) >> (4 * (s >> 1));
            const u32 hi = load_u32_a2(block + 128 + 32 * hh + l) >> (2 * s);
#pragma unroll
            for (int k = 0; k < 4; ++k)
                w[k] = scale * ((float)(((lo >> (8 * k)) & 15) | (((hi >> (8 * k)) & 3) << 4)) - 32.0f);
        } else if (FMT == FMT_Q3_K) {
            // Scale j: low nibble of byte j % 8 (high nibble for j >= 8), top
            // two bits from byte 8 + j % 4 (kquant::q3k_scales).
            const u32 low = (__ldg(block + 96 + (j & 7)) >> (4 * (j >> 3))) & 15;
            const u32 high = (__ldg(block + 104 + (j & 3)) >> (2 * (j >> 2))) & 3;
            const float scale = f16_to_f32(load_u16(block + 108)) * ((float)(low | (high << 4)) - 32.0f);
            const u32 lo = load_u32_a2(block + 32 + 32 * hh + l) >> (2 * s);
            const u32 hm = load_u32_a2(block + l) >> (4 * hh + s);
#pragma unroll
            for (int k = 0; k < 4; ++k)
                w[k] = scale * ((float)(((lo >> (8 * k)) & 3) | (((hm >> (8 * k)) & 1) << 2)) - 4.0f);
        } else {  // FMT_Q2_K
            const u32 sm = __ldg(block + j);
            const u32 dm = load_u32(block + 80);
            const float scale = f16_to_f32((u16)(dm & 0xffff)) * (float)(sm & 15);
            const float offset = -f16_to_f32((u16)(dm >> 16)) * (float)(sm >> 4);
            const u32 q = load_u32(block + 16 + 32 * hh + l) >> (2 * s);
#pragma unroll
            for (int k = 0; k < 4; ++k) w[k] = scale * (float)((q >> (8 * k)) & 3) + offset;
        }
    }
}

// Value `i` of a row of a format with a run-of-four decoder, the format known at run time.
__device__ __noinline__ float run4_weight_at(int fmt, const u8* row, u32 i) {
    const u32 elems = block_elems(fmt);
    const u8* block = row + (u64)(i / elems) * block_bytes(fmt);
    const u32 e = (i % elems) & ~3u;
    float w[4];
    switch (fmt) {
        case FMT_Q5_0: decode_run4<FMT_Q5_0>(block, e, w); break;
        case FMT_Q5_1: decode_run4<FMT_Q5_1>(block, e, w); break;
        case FMT_IQ4_NL: decode_run4<FMT_IQ4_NL>(block, e, w); break;
        case FMT_Q2_K: decode_run4<FMT_Q2_K>(block, e, w); break;
        case FMT_Q3_K: decode_run4<FMT_Q3_K>(block, e, w); break;
        case FMT_Q4_K: decode_run4<FMT_Q4_K>(block, e, w); break;
        case FMT_Q5_K: decode_run4<FMT_Q5_K>(block, e, w); break;
        default: decode_run4<FMT_Q6_K>(block, e, w); break;
    }
    const u32 k = i & 3;
    return k == 0 ? w[0] : k == 1 ? w[1] : k == 2 ? w[2] : w[3];
}

// Element `i` of a weight row in any format. For the kernels that touch a
// weight once per element (embedding, norms, biases); matmuls decode whole
// groups with `load_group`.
__device__ __forceinline__ float weight_at(int fmt, const u8* row, u32 i) {
    if (fmt == FMT_F32) return __ldg(reinterpret_cast<const float*>(row) + i);
    if (fmt == FMT_F16) return f16_to_f32(load_u16(row + 2 * (u64)i));
    if (fmt == FMT_BF16) return bf16_to_f32(load_u16(row + 2 * (u64)i));
    if (has_run4_decoder(fmt)) return run4_weight_at(fmt, row, i);
    const u32 j = i & 31;
    if (fmt == FMT_INT8 || fmt == FMT_W8A8)
        return __ldg(reinterpret_cast<const float*>(row)) * (float)(signed char)__ldg(row + 4 + i);
    if (fmt == FMT_Q4_1 || fmt == FMT_INT4_G64 || fmt == FMT_INT4_G128) {
        float d, m;
        const u32 byte = __ldg(nibble_run(fmt, row, i, d, m) + (j & 15));
        return d * (float)(j < 16 ? (byte & 15) : (byte >> 4)) + m;
    }
    const u8* block = row + (u64)(i >> 5) * block_bytes(fmt);
    const float d = f16_to_f32(load_u16(block));
    if (fmt == FMT_Q8_0) return d * (float)(signed char)__ldg(block + 2 + j);
    const u32 byte = __ldg(block + 2 + (j & 15));
    return d * ((float)(j < 16 ? (byte & 15) : (byte >> 4)) - 8.0f);
}

__device__ __noinline__ float weight_at_call(int fmt, const u8* row, u32 i) {
    return weight_at(fmt, row, i);
}

// Element `i` of a vector (a norm weight, a bias) read inside a matmul: the
// float formats inline, the others through a call, since inlining every
// format at each use would multiply the matmul's code and NVRTC's time.
__device__ __forceinline__ float vector_at(int fmt, const u8* v, u32 i) {
    if (fmt == FMT_F32) return __ldg(reinterpret_cast<const float*>(v) + i);
    if (fmt == FMT_F16) return f16_to_f32(load_u16(v + 2 * (u64)i));
    if (fmt == FMT_BF16) return bf16_to_f32(load_u16(v + 2 * (u64)i));
    return weight_at_call(fmt, v, i);
}

// ---- groups of eight weights (matmuls) ----
//
// A matmul lane decodes eight weights at a time, a "group". Quantized formats:
// group g is the quarter s = g % 4 of block g / 4, elements 4s..4s+3 and
// 16+4s..16+4s+3 of the block (the low and high nibbles of the same four
// bytes for the 4-bit formats). A k-quant super-block is 8 such blocks of 32
// (a group never straddles two). Float formats: elements 8g..8g+7.
// `group_col(fmt, g, j)` is the column of the j-th value of group g.

template <int FMT>
__device__ __forceinline__ u32 group_col(u32 g, int j) {
    if (!is_quantized(FMT)) return 8 * g + j;
    return 32 * (g >> 2) + 4 * (g & 3) + (j < 4 ? j : 12 + j);
}

// The two runs of four columns a group covers start at these columns.
template <int FMT>
__device__ __forceinline__ u32 group_run(u32 g, int run) {
    return group_col<FMT>(g, 4 * run);
}

// The two 16-bit floats packed in a 32-bit word, low half first.
template <int FMT>
__device__ __forceinline__ void half2_to_f32(u32 word, float& lo, float& hi) {
    if (FMT == FMT_F16) {
        asm("{.reg .b16 l, h;\n\tmov.b32 {l, h}, %2;\n\tcvt.f32.f16 %0, l;\n\tcvt.f32.f16 %1, h;}"
            : "=f"(lo), "=f"(hi)
            : "r"(word));
    } else {
        lo = __uint_as_float(word << 16);
        hi = __uint_as_float(word & 0xffff0000u);
    }
}

__device__ __forceinline__ void unpack_nibbles(u32 q, float d, float m, float w[8]) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        w[j] = d * (float)((q >> (8 * j)) & 15) + m;
        w[4 + j] = d * (float)((q >> (8 * j + 4)) & 15) + m;
    }
}

// Decodes group g of a weight row into w[0..8]. Float formats need
// `cols % 8 == 0` (16-byte aligned rows) for this vector path; quantized
// rows are whole blocks by construction.
template <int FMT>
__device__ __forceinline__ void load_group(const u8* row, u32 g, float w[8]) {
    if (FMT == FMT_F32) {
        const float4* p = reinterpret_cast<const float4*>(row) + 2 * (u64)g;
        const float4 a = __ldg(p), b = __ldg(p + 1);
        w[0] = a.x; w[1] = a.y; w[2] = a.z; w[3] = a.w;
        w[4] = b.x; w[5] = b.y; w[6] = b.z; w[7] = b.w;
    } else if (FMT == FMT_F16 || FMT == FMT_BF16) {
        const uint4 v = __ldg(reinterpret_cast<const uint4*>(row) + g);
        half2_to_f32<FMT>(v.x, w[0], w[1]);
        half2_to_f32<FMT>(v.y, w[2], w[3]);
        half2_to_f32<FMT>(v.z, w[4], w[5]);
        half2_to_f32<FMT>(v.w, w[6], w[7]);
    } else if (FMT == FMT_Q4_1 || FMT == FMT_INT4_G64 || FMT == FMT_INT4_G128) {
        // Group g lies in run g / 4 (32 elements); a block holds block_elems / 32 runs.
        constexpr u32 runs = block_elems(FMT) / 32;
        const u8* block = row + block_bytes(FMT) * (u64)((g >> 2) / runs);
        const u32 dm = load_u32(block);
        const u32 q = load_u32(block + 4 + 16 * ((g >> 2) % runs) + 4 * (g & 3));
        unpack_nibbles(q, f16_to_f32((u16)(dm & 0xffff)), f16_to_f32((u16)(dm >> 16)), w);
    } else if (FMT == FMT_INT8 || FMT == FMT_W8A8) {
        const float s = __ldg(reinterpret_cast<const float*>(row));
        const u8* run = row + 4 + 32 * (u64)(g >> 2);
        const u32 lo = load_u32(run + 4 * (g & 3));
        const u32 hi = load_u32(run + 16 + 4 * (g & 3));
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            w[j] = s * (float)(signed char)(lo >> (8 * j));
            w[4 + j] = s * (float)(signed char)(hi >> (8 * j));
        }
    } else if (has_run4_decoder(FMT)) {
        // Block of 32 (or 32-value slice of a super-block) g / 4, quarter g % 4.
        const u32 b32 = g >> 2;
        const u32 per_block = block_elems(FMT) / 32;
        const u8* block = row + block_bytes(FMT) * (u64)(b32 / per_block);
        const u32 e = 32 * (b32 % per_block) + 4 * (g & 3);
        decode_run4<FMT>(block, e, w);
        decode_run4<FMT>(block, e + 16, w + 4);
    } else if (FMT == FMT_Q4_0) {
        const u8* block = row + 18 * (u64)(g >> 2);
        const float d = f16_to_f32(load_u16(block));
        const u32 q = load_u32_a2(block + 2 + 4 * (g & 3));
        unpack_nibbles(q, d, -8.0f * d, w);
    } else {  // FMT_Q8_0
        const u8* block = row + 34 * (u64)(g >> 2);
        const float d = f16_to_f32(load_u16(block));
        const u32 lo = load_u32_a2(block + 2 + 4 * (g & 3));
        const u32 hi = load_u32_a2(block + 18 + 4 * (g & 3));
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            w[j] = d * (float)(signed char)(lo >> (8 * j));
            w[4 + j] = d * (float)(signed char)(hi >> (8 * j));
        }
    }
}

// ---- reductions ----

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int offset = WARP / 2; offset > 0; offset >>= 1) v += __shfl_xor_sync(FULL_MASK, v, offset);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int offset = WARP / 2; offset > 0; offset >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, offset));
    return v;
}

// Sum over the whole block (blockDim.x a multiple of 32, at most 1024);
// every thread gets the result. `scratch` holds 32 floats.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
    v = warp_sum(v);
    __syncthreads();  // `scratch` may still be read from a previous call
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    const int warps = blockDim.x / WARP;
    v = lane < warps ? scratch[lane] : 0.0f;
    return warp_sum(v);
}


// ---- activations of the gated linear units ----
//
// expf, not the fast intrinsic, for the manifest's 1e-5. GELU is the tanh
// approximation 0.5 g (1 + tanh(u)), u = sqrt(2/pi) (g + 0.044715 g^3),
// computed as the equal g / (1 + exp(-2u)).

#define GLU_SWIGLU 0
#define GLU_GEGLU 1

__device__ __forceinline__ float silu(float g) {
    return g / (1.0f + expf(-g));
}

__device__ __forceinline__ float gelu_tanh(float g) {
    const float sqrt_2_over_pi = 0.7978846f;
    const float u = sqrt_2_over_pi * (g + 0.044715f * g * g * g);
    return g / (1.0f + expf(fminf(-2.0f * u, 80.0f)));
}

// ---- matmul: prologues and epilogues ----
//
// The matmul templates below (decode GEMV, tiled GEMM, the unaligned GEMV and
// W8A8's two) take a prologue and an epilogue besides the weight format, so
// the fused matmuls run the same loops as the plain one:
//
// - the prologue is applied to x as it is read: `NoNorm`, or `RmsNorm`
//   (x[t, c] * inv_rms[t] * g[c]; `prepare` computes the inverse RMS of each
//   of the block's rows once, into shared memory);
// - the epilogue stores the sums: `StoreOut` (out = y + bias: the plain
//   matmul), `SplitStore` (y + bias, its columns cut into up to three
//   outputs), `AddStore` (out += y), `GatedStore` (out = act(gate) * up).
//
// The templates walk "virtual rows" v < epi.rows, each standing for one
// weight row (`weight_row`), in pairs (v even, v + 1), and hand each pair's
// sums for a token to the epilogue together (`store_pair`). For the gated
// epilogue the virtual rows interleave gate and up, v = 2i for gate row i and
// 2i + 1 for up row f + i, so the thread that holds gate i holds up i too and
// the activation is applied in registers.

struct NoNorm {
    __device__ __forceinline__ void prepare(const float*, u32, u32, u32, float*) const {}
    __device__ __forceinline__ float gamma(u32) const { return 1.0f; }
    __device__ __forceinline__ float apply(float v, float, float) const { return v; }
};

// The RMSNorm prologue; `g` null means no norm (every factor is then 1, so x
// is read unchanged).
struct RmsNorm {
    const u8* g;
    int g_fmt;
    float eps;

    __device__ __forceinline__ RmsNorm(const u8* g, int g_fmt, float eps) : g(g), g_fmt(g_fmt), eps(eps) {}

    // inv[i] = 1 / rms(x[first + i, :]) for i < count, one warp per row, as
    // rms_norm.cu computes it. Every thread of the block must call it.
    __device__ __forceinline__ void prepare(const float* __restrict__ x, u32 first, u32 count, u32 cols,
                                            float* inv) const {
        const int lane = threadIdx.x % WARP, warps = blockDim.x / WARP;
        for (u32 i = threadIdx.x / WARP; i < count; i += warps) {
            float s = 0.0f;
            if (g != nullptr) {
                const float* row = x + (u64)(first + i) * cols;
                for (u32 c = lane; c < cols; c += WARP) {
                    const float v = __ldg(row + c);
                    s = fmaf(v, v, s);
                }
                s = warp_sum(s);
            }
            if (lane == 0) inv[i] = g != nullptr ? rsqrtf(s / (float)cols + eps) : 1.0f;
        }
        __syncthreads();
    }

    __device__ __forceinline__ float gamma(u32 c) const { return g != nullptr ? vector_at(g_fmt, g, c) : 1.0f; }

    __device__ __forceinline__ float apply(float v, float inv, float gm) const { return v * inv * gm; }
};

template <class Pro>
__device__ __forceinline__ float4 apply4(const Pro& pro, float4 v, float inv, const float gm[4]) {
    return make_float4(pro.apply(v.x, inv, gm[0]), pro.apply(v.y, inv, gm[1]), pro.apply(v.z, inv, gm[2]),
                       pro.apply(v.w, inv, gm[3]));
}

// out[t, v] = y + bias[v]: the plain matmul (`rows` = n).
struct StoreOut {
    static constexpr bool GATED = false;
    float* out;
    const u8* bias;
    int bias_fmt;
    u32 rows;

    __device__ __forceinline__ StoreOut(float* out, const u8* bias, int bias_fmt, u32 n)
        : out(out), bias(bias), bias_fmt(bias_fmt), rows(n) {}

    __device__ __forceinline__ void store(u32 t, u32 v, float s) const {
        if (bias != nullptr) s += vector_at(bias_fmt, bias, v);
        out[(u64)t * rows + v] = s;
    }
};

// y + bias[v], columns [0, end0) to out0, [end0, end1) to out1, [end1, n) to
// out2, each output [tokens, its width].
struct SplitStore {
    static constexpr bool GATED = false;
    float* out0;
    float* out1;
    float* out2;
    u32 end0, end1, rows;
    const u8* bias;
    int bias_fmt;

    __device__ __forceinline__ SplitStore(float* out0, float* out1, float* out2, u32 end0, u32 end1, u32 n,
                                          const u8* bias, int bias_fmt)
        : out0(out0), out1(out1), out2(out2), end0(end0), end1(end1), rows(n), bias(bias), bias_fmt(bias_fmt) {}

    __device__ __forceinline__ void store(u32 t, u32 v, float s) const {
        if (bias != nullptr) s += vector_at(bias_fmt, bias, v);
        if (v < end0) {
            out0[(u64)t * end0 + v] = s;
        } else if (v < end1) {
            out1[(u64)t * (end1 - end0) + (v - end0)] = s;
        } else {
            out2[(u64)t * (rows - end1) + (v - end1)] = s;
        }
    }
};

// out[t, v] += y: the residual add.
struct AddStore {
    static constexpr bool GATED = false;
    float* out;
    u32 rows;

    __device__ __forceinline__ AddStore(float* out, u32 n) : out(out), rows(n) {}

    __device__ __forceinline__ void store(u32 t, u32 v, float s) const { out[(u64)t * rows + v] += s; }
};

// out[t, i] = act(gate) * up for a weight of `rows` = 2f rows, gate rows then up rows.
struct GatedStore {
    static constexpr bool GATED = true;
    float* out;
    int act;
    u32 rows;

    __device__ __forceinline__ GatedStore(float* out, int act, u32 n) : out(out), act(act), rows(n) {}

    __device__ __forceinline__ void store_gated(u32 t, u32 i, float gate, float up) const {
        out[(u64)t * (rows / 2) + i] = (act == GLU_GEGLU ? gelu_tanh(gate) : silu(gate)) * up;
    }
};

// The weight row virtual row v stands for.
template <class Epi>
__device__ __forceinline__ u32 weight_row(const Epi& epi, u32 v) {
    if constexpr (Epi::GATED) {
        return (v & 1) * (epi.rows / 2) + (v >> 1);
    } else {
        return v;
    }
}

// Stores the sums of virtual rows v (even, below epi.rows) and v + 1 for token t.
template <class Epi>
__device__ __forceinline__ void store_pair(const Epi& epi, u32 t, u32 v, float s0, float s1) {
    if constexpr (Epi::GATED) {
        epi.store_gated(t, v >> 1, s0, s1);
    } else {
        epi.store(t, v, s0);
        if (v + 1 < epi.rows) epi.store(t, v + 1, s1);
    }
}

// ---- matmul: decode GEMV ----
//
// y[t, v] = sum_c x'[t, c] * w[row(v), c] for t < tokens <= MAX_T.
// Decode is bound by reading the weights once, so the aim is many loads in
// flight: a block of GEMV_WARPS warps shares one pair of virtual rows, its
// warps taking interleaved runs of 32 groups (consecutive lanes on
// consecutive groups, 16-byte loads for float formats, per-block 32-bit loads
// for quantized ones), and every decoded weight is reused for all tokens from
// registers; x stays in L1. The warps' sums meet in shared memory.

#define GEMV_WARPS 4
#define GEMV_ROWS 2
// Most tokens a GEMV takes (`_gemv_t8`, and `_gemv_unaligned`).
#define GEMV_MAX_T 8

template <int FMT, int MAX_T, class Pro, class Epi>
__device__ __forceinline__ void gemv(const u8* __restrict__ w, const float* __restrict__ x, u32 tokens, u32 cols,
                                     const Pro& pro, const Epi& epi) {
    static_assert(GEMV_ROWS == 2, "a GEMV block computes one pair of virtual rows");
    __shared__ float partial[GEMV_WARPS][GEMV_ROWS * MAX_T];
    __shared__ float inv_rms[MAX_T];
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
    const u32 row0 = blockIdx.x * GEMV_ROWS;
    const u64 row_bytes = row_bytes_of<FMT>(cols);
    const u32 groups = cols / 8;

    pro.prepare(x, 0, tokens < MAX_T ? tokens : MAX_T, cols, inv_rms);
    float inv[MAX_T];
#pragma unroll
    for (int t = 0; t < MAX_T; ++t) inv[t] = t < tokens ? inv_rms[t] : 1.0f;

    // The last block's second row may lie past the end: reread row0 (in bounds, result unused).
    const u8* wrow[GEMV_ROWS];
#pragma unroll
    for (int r = 0; r < GEMV_ROWS; ++r) {
        const u32 v = row0 + r < epi.rows ? row0 + r : row0;
        wrow[r] = w + weight_row(epi, v) * row_bytes;
    }

    float acc[GEMV_ROWS][MAX_T];
#pragma unroll
    for (int r = 0; r < GEMV_ROWS; ++r)
#pragma unroll
        for (int t = 0; t < MAX_T; ++t) acc[r][t] = 0.0f;

#pragma unroll 2
    for (u32 g = warp * WARP + lane; g < groups; g += GEMV_WARPS * WARP) {
        float wv[GEMV_ROWS][8];
#pragma unroll
        for (int r = 0; r < GEMV_ROWS; ++r) load_group<FMT>(wrow[r], g, wv[r]);
        const u32 c0 = group_run<FMT>(g, 0), c1 = group_run<FMT>(g, 1);
        float gm[8];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            gm[j] = pro.gamma(c0 + j);
            gm[4 + j] = pro.gamma(c1 + j);
        }
#pragma unroll
        for (int t = 0; t < MAX_T; ++t) {
            if (t < tokens) {
                const float4 a = apply4(pro, __ldg(reinterpret_cast<const float4*>(x + (u64)t * cols + c0)), inv[t], gm);
                const float4 b = apply4(pro, __ldg(reinterpret_cast<const float4*>(x + (u64)t * cols + c1)), inv[t], gm + 4);
#pragma unroll
                for (int r = 0; r < GEMV_ROWS; ++r) {
                    float s = acc[r][t];
                    s = fmaf(wv[r][0], a.x, s); s = fmaf(wv[r][1], a.y, s);
                    s = fmaf(wv[r][2], a.z, s); s = fmaf(wv[r][3], a.w, s);
                    s = fmaf(wv[r][4], b.x, s); s = fmaf(wv[r][5], b.y, s);
                    s = fmaf(wv[r][6], b.z, s); s = fmaf(wv[r][7], b.w, s);
                    acc[r][t] = s;
                }
            }
        }
    }

#pragma unroll
    for (int r = 0; r < GEMV_ROWS; ++r)
#pragma unroll
        for (int t = 0; t < MAX_T; ++t) {
            const float s = warp_sum(acc[r][t]);
            if (lane == 0) partial[warp][r * MAX_T + t] = s;
        }
    __syncthreads();
    const u32 t = threadIdx.x;
    if (t < MAX_T && t < tokens && row0 < epi.rows) {
        float s0 = 0.0f, s1 = 0.0f;
#pragma unroll
        for (int k = 0; k < GEMV_WARPS; ++k) {
            s0 += partial[k][t];
            s1 += partial[k][MAX_T + t];
        }
        store_pair(epi, t, row0, s0, s1);
    }
}

// GEMV for float formats whose rows are not 16-byte aligned (cols % 8 != 0):
// a pair of virtual rows per warp, one token at a time, lanes on consecutive
// columns. At most GEMV_MAX_T tokens.
template <int FMT, class Pro, class Epi>
__device__ __forceinline__ void gemv_unaligned(const u8* __restrict__ w, const float* __restrict__ x, u32 tokens,
                                               u32 cols, const Pro& pro, const Epi& epi) {
    __shared__ float inv_rms[GEMV_MAX_T];
    const int lane = threadIdx.x % WARP;
    if (tokens > GEMV_MAX_T) tokens = GEMV_MAX_T;
    pro.prepare(x, 0, tokens, cols, inv_rms);
    const u32 v = GEMV_ROWS * (blockIdx.x * GEMV_WARPS + threadIdx.x / WARP);
    if (v >= epi.rows) return;
    const u64 row_bytes = row_bytes_of<FMT>(cols);
    const u8* w0 = w + weight_row(epi, v) * row_bytes;
    const u8* w1 = w + weight_row(epi, v + 1 < epi.rows ? v + 1 : v) * row_bytes;
    for (u32 t = 0; t < tokens; ++t) {
        const float inv = inv_rms[t];
        float s0 = 0.0f, s1 = 0.0f;
        for (u32 c = lane; c < cols; c += WARP) {
            const float xv = pro.apply(__ldg(x + (u64)t * cols + c), inv, pro.gamma(c));
            s0 = fmaf(weight_at(FMT, w0, c), xv, s0);
            s1 = fmaf(weight_at(FMT, w1, c), xv, s1);
        }
        s0 = warp_sum(s0);
        s1 = warp_sum(s1);
        if (lane == 0) store_pair(epi, t, v, s0, s1);
    }
}

// ---- matmul: tiled GEMM (prefill) ----
//
// A 64-token x 64-virtual-row output tile per block of 256 threads, 4x4
// outputs per thread, stepping through the columns 32 at a time (one
// quantized block) via shared memory; weights are decoded once per tile into
// f32, x passes through the prologue as it is staged. Any sizes: edges are
// masked.

#define TILE_T 64
#define TILE_R 64
#define TILE_K 32
#define TILE_THREADS 256
#define TILE_PAD 4

// Tokens of the tile starting at token t_base.
__device__ __forceinline__ u32 tile_tokens(u32 tokens, u32 t_base) {
    return tokens <= t_base ? 0 : tokens - t_base < TILE_T ? tokens - t_base : TILE_T;
}

template <int FMT, class Pro, class Epi>
__device__ __forceinline__ void gemm_tiled(const u8* __restrict__ w, const float* __restrict__ x, u32 tokens, u32 cols,
                                           const Pro& pro, const Epi& epi) {
    __shared__ __align__(16) float xs[TILE_K][TILE_T + TILE_PAD];
    __shared__ __align__(16) float ws[TILE_K][TILE_R + TILE_PAD];
    __shared__ float inv_rms[TILE_T];

    const int tid = threadIdx.x;
    const u32 t_base = blockIdx.y * TILE_T, r_base = blockIdx.x * TILE_R;
    const u64 row_bytes = row_bytes_of<FMT>(cols);
    const bool vector_rows = is_quantized(FMT) || cols % 8 == 0;

    pro.prepare(x, t_base, tile_tokens(tokens, t_base), cols, inv_rms);

    // Loader roles: 4 threads per tile row, 8 columns each.
    const int load_row = tid / 4, load_part = tid % 4;
    // Compute roles: 16 x 16 threads, 4 x 4 outputs each.
    const int tx = tid % 16, ty = tid / 16;

    const u32 load_t = t_base + load_row, load_v = r_base + load_row;
    const bool row_ok = load_v < epi.rows;
    const u8* wrow = w + weight_row(epi, row_ok ? load_v : 0) * row_bytes;
    const float load_inv = inv_rms[load_row];

    float acc[4][4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = 0.0f;

    for (u32 k0 = 0; k0 < cols; k0 += TILE_K) {
        // x tile, stored transposed: xs[k][token]
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            const u32 c = k0 + 8 * load_part + j;
            xs[8 * load_part + j][load_row] = (load_t < tokens && c < cols)
                                                  ? pro.apply(__ldg(x + (u64)load_t * cols + c), load_inv, pro.gamma(c))
                                                  : 0.0f;
        }
        {  // weight tile, decoded: ws[k][virtual row]
            const u32 g = k0 / 8 + load_part;
            float v[8];
            if (row_ok && vector_rows && 8 * g < cols) {
                load_group<FMT>(wrow, g, v);
            } else {
#pragma unroll
                for (int j = 0; j < 8; ++j) {
                    const u32 c = group_col<FMT>(g, j);
                    v[j] = (row_ok && c < cols) ? weight_at(FMT, wrow, c) : 0.0f;
                }
            }
#pragma unroll
            for (int j = 0; j < 8; ++j) ws[group_col<FMT>(g, j) - k0][load_row] = v[j];
        }
        __syncthreads();
#pragma unroll 8
        for (int k = 0; k < TILE_K; ++k) {
            const float4 a = *reinterpret_cast<const float4*>(&xs[k][4 * ty]);
            const float4 b = *reinterpret_cast<const float4*>(&ws[k][4 * tx]);
            const float av[4] = {a.x, a.y, a.z, a.w}, bv[4] = {b.x, b.y, b.z, b.w};
#pragma unroll
            for (int i = 0; i < 4; ++i)
#pragma unroll
                for (int j = 0; j < 4; ++j) acc[i][j] = fmaf(av[i], bv[j], acc[i][j]);
        }
        __syncthreads();
    }

#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const u32 t = t_base + 4 * ty + i;
        if (t >= tokens) continue;
#pragma unroll
        for (int j = 0; j < 4; j += 2) {
            const u32 v = r_base + 4 * tx + j;
            if (v < epi.rows) store_pair(epi, t, v, acc[i][j], acc[i][j + 1]);
        }
    }
}

// ---- matmul: W8A8 (SmoothQuant) ----
//
// out[t, r] = s_r * a_t * sum_c q_x[t, c] * q_w[r, c]. The weights are INT8's
// bytes (per row: f32 scale s_r, then `cols` signed bytes). Each activation
// row (after the prologue) is quantized to INT8 here, per token, as
// tandem_core::quant::quantize_activation_row_i8 defines: a_t = max_c
// |x[t, c]| / 127 and q_x = rint(x * (127 / max|x|)) (ties to even). The INT8
// products are summed in i32 with __dp4a (four i8 x i8 products per
// instruction); only the final sum becomes f32. `cols` is a multiple of 32.
// Launch shapes as the other formats' GEMV and tiled kernels.

__device__ __forceinline__ float inverse_scale(float amax) {
    return amax > 0.0f ? 127.0f / amax : 0.0f;
}

// Four activations quantized and packed as four signed bytes.
__device__ __forceinline__ int quant_x4(float4 v, float inverse) {
    const float f[4] = {v.x, v.y, v.z, v.w};
    u32 packed = 0;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const int q = max(-127, min(127, __float2int_rn(f[j] * inverse)));
        packed |= ((u32)q & 0xffu) << (8 * j);
    }
    return (int)packed;
}

// max |x'| over columns first, first + stride, ... of one row of x, x' as the prologue gives it.
template <class Pro>
__device__ __forceinline__ float row_max_abs(const Pro& pro, const float* x, u32 cols, u32 first, u32 stride,
                                             float inv) {
    float m = 0.0f;
    for (u32 c = first; c < cols; c += stride) m = fmaxf(m, fabsf(pro.apply(__ldg(x + c), inv, pro.gamma(c))));
    return m;
}

// The four prologue factors of columns c..c+3.
template <class Pro>
__device__ __forceinline__ void gamma4(const Pro& pro, u32 c, float gm[4]) {
#pragma unroll
    for (int j = 0; j < 4; ++j) gm[j] = pro.gamma(c + j);
}

// s_r * a_t * sum for weight row r.
__device__ __forceinline__ float w8a8_value(const u8* __restrict__ w, u64 row_bytes, u32 r, int sum, float x_scale) {
    const float s = __ldg(reinterpret_cast<const float*>(w + r * row_bytes));
    return (float)sum * (s * x_scale);
}

template <int MAX_T, class Pro, class Epi>
__device__ __forceinline__ void gemv_w8a8(const u8* __restrict__ w, const float* __restrict__ x, u32 tokens, u32 cols,
                                          const Pro& pro, const Epi& epi) {
    __shared__ float warp_max_scratch[GEMV_WARPS];
    __shared__ int partial[GEMV_WARPS][GEMV_ROWS * MAX_T];
    __shared__ float inv_rms[MAX_T];
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
    const u32 row0 = blockIdx.x * GEMV_ROWS;
    const u64 row_bytes = row_bytes_of<FMT_W8A8>(cols);

    pro.prepare(x, 0, tokens < MAX_T ? tokens : MAX_T, cols, inv_rms);
    float inv[MAX_T], inverse[MAX_T], x_scale[MAX_T];
#pragma unroll
    for (int t = 0; t < MAX_T; ++t) {
        inv[t] = t < tokens ? inv_rms[t] : 1.0f;
        float m = t < tokens ? row_max_abs(pro, x + (u64)t * cols, cols, threadIdx.x, blockDim.x, inv[t]) : 0.0f;
        m = warp_max(m);
        __syncthreads();
        if (lane == 0) warp_max_scratch[warp] = m;
        __syncthreads();
#pragma unroll
        for (int k = 0; k < GEMV_WARPS; ++k) m = fmaxf(m, warp_max_scratch[k]);
        inverse[t] = inverse_scale(m);
        x_scale[t] = m / 127.0f;
    }

    // The last block's second row may lie past the end: reread row0 (in bounds, result unused).
    u32 wr[GEMV_ROWS];
#pragma unroll
    for (int r = 0; r < GEMV_ROWS; ++r) wr[r] = weight_row(epi, row0 + r < epi.rows ? row0 + r : row0);

    int acc[GEMV_ROWS][MAX_T];
#pragma unroll
    for (int r = 0; r < GEMV_ROWS; ++r)
#pragma unroll
        for (int t = 0; t < MAX_T; ++t) acc[r][t] = 0;

    const u32 words = cols / 4;
    for (u32 p = threadIdx.x; p < words; p += blockDim.x) {
        int wq[GEMV_ROWS];
#pragma unroll
        for (int r = 0; r < GEMV_ROWS; ++r) wq[r] = (int)load_u32(w + wr[r] * row_bytes + 4 + 4 * (u64)p);
        float gm[4];
        gamma4(pro, 4 * p, gm);
#pragma unroll
        for (int t = 0; t < MAX_T; ++t) {
            if (t < tokens) {
                const float4 xv = __ldg(reinterpret_cast<const float4*>(x + (u64)t * cols + 4 * p));
                const int xq = quant_x4(apply4(pro, xv, inv[t], gm), inverse[t]);
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
    const u32 t = threadIdx.x;
    if (t < MAX_T && t < tokens && row0 < epi.rows) {
        int s0 = 0, s1 = 0;
#pragma unroll
        for (int k = 0; k < GEMV_WARPS; ++k) {
            s0 += partial[k][t];
            s1 += partial[k][MAX_T + t];
        }
        store_pair(epi, t, row0, w8a8_value(w, row_bytes, wr[0], s0, x_scale[t]),
                   w8a8_value(w, row_bytes, wr[1], s1, x_scale[t]));
    }
}

// Words (four quants) per row of a K step of the tiled kernel.
#define W8A8_TILE_WORDS (TILE_K / 4)

template <class Pro, class Epi>
__device__ __forceinline__ void gemm_tiled_w8a8(const u8* __restrict__ w, const float* __restrict__ x, u32 tokens,
                                                u32 cols, const Pro& pro, const Epi& epi) {
    __shared__ int xs[TILE_T][W8A8_TILE_WORDS + 1];
    __shared__ int ws[TILE_R][W8A8_TILE_WORDS + 1];
    // max|x| of the tile's tokens as the bits of non-negative floats (which order like the floats).
    __shared__ unsigned int amax_bits[TILE_T];
    __shared__ float inv_rms[TILE_T];

    const int tid = threadIdx.x;
    const u32 t_base = blockIdx.y * TILE_T, r_base = blockIdx.x * TILE_R;
    const u64 row_bytes = row_bytes_of<FMT_W8A8>(cols);
    // Loader roles: 4 threads per tile row, 2 words each.
    const int load_row = tid / 4, load_part = tid % 4;
    // Compute roles: 16 x 16 threads, 4 x 4 outputs each.
    const int tx = tid % 16, ty = tid / 16;

    pro.prepare(x, t_base, tile_tokens(tokens, t_base), cols, inv_rms);
    const u32 load_t = t_base + load_row, load_v = r_base + load_row;
    const float load_inv = inv_rms[load_row];
    const bool row_ok = load_v < epi.rows;
    const u8* wrow = w + weight_row(epi, row_ok ? load_v : 0) * row_bytes;

    if (tid < TILE_T) amax_bits[tid] = 0u;
    __syncthreads();
    {
        const float m =
            load_t < tokens ? row_max_abs(pro, x + (u64)load_t * cols, cols, load_part, 4, load_inv) : 0.0f;
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
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            const u32 word = 2 * load_part + j, c = k0 + 4 * word;
            int xq = 0;
            if (load_t < tokens) {
                float gm[4];
                gamma4(pro, c, gm);
                const float4 xv = __ldg(reinterpret_cast<const float4*>(x + (u64)load_t * cols + c));
                xq = quant_x4(apply4(pro, xv, load_inv, gm), inverse);
            }
            xs[load_row][word] = xq;
            ws[load_row][word] = row_ok ? (int)load_u32(wrow + 4 + c) : 0;
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
        for (int j = 0; j < 4; j += 2) {
            const u32 v = r_base + 4 * tx + j;
            if (v >= epi.rows) continue;
            const u32 v1 = v + 1 < epi.rows ? v + 1 : v;
            store_pair(epi, t, v, w8a8_value(w, row_bytes, weight_row(epi, v), acc[i][j], x_scale),
                       w8a8_value(w, row_bytes, weight_row(epi, v1), acc[i][j + 1], x_scale));
        }
    }
}

// ---- matmul entry points ----

// The GEMV and tiled GEMM of format FMT (W8A8 has its own).
template <int FMT, int MAX_T, class Pro, class Epi>
__device__ __forceinline__ void matmul_gemv(const u8* __restrict__ w, const float* __restrict__ x, u32 tokens,
                                            u32 cols, const Pro& pro, const Epi& epi) {
    if constexpr (FMT == FMT_W8A8) {
        gemv_w8a8<MAX_T>(w, x, tokens, cols, pro, epi);
    } else {
        gemv<FMT, MAX_T>(w, x, tokens, cols, pro, epi);
    }
}

template <int FMT, class Pro, class Epi>
__device__ __forceinline__ void matmul_tiled(const u8* __restrict__ w, const float* __restrict__ x, u32 tokens,
                                             u32 cols, const Pro& pro, const Epi& epi) {
    if constexpr (FMT == FMT_W8A8) {
        gemm_tiled_w8a8(w, x, tokens, cols, pro, epi);
    } else {
        gemm_tiled<FMT>(w, x, tokens, cols, pro, epi);
    }
}

// A set of matmul entry points; ARGS is their parameter list (naming w, x,
// tokens and cols), PRO and EPI build the prologue and epilogue from it:
//   NAME_gemv_t{1,2,4,8}  decode, up to 1, 2, 4, 8 tokens (rows of x);
//                         grid: one block of 128 threads per pair of virtual rows
//   NAME_tiled            prefill, any sizes; grid (virtual rows / 64, tokens / 64), 256 threads
//   NAME_gemv_unaligned   float formats whose rows are not 16-byte aligned;
//                         up to 8 tokens, 128 threads per 8 virtual rows
#define DEFINE_MATMUL_ENTRIES(NAME, FMT, ARGS, PRO, EPI)                                        \
    extern "C" __global__ void NAME##_gemv_t1(ARGS) { matmul_gemv<FMT, 1>(w, x, tokens, cols, PRO, EPI); } \
    extern "C" __global__ void NAME##_gemv_t2(ARGS) { matmul_gemv<FMT, 2>(w, x, tokens, cols, PRO, EPI); } \
    extern "C" __global__ void NAME##_gemv_t4(ARGS) { matmul_gemv<FMT, 4>(w, x, tokens, cols, PRO, EPI); } \
    extern "C" __global__ void NAME##_gemv_t8(ARGS) { matmul_gemv<FMT, 8>(w, x, tokens, cols, PRO, EPI); } \
    extern "C" __global__ void NAME##_tiled(ARGS) { matmul_tiled<FMT>(w, x, tokens, cols, PRO, EPI); }

#define DEFINE_MATMUL_UNALIGNED_ENTRY(NAME, FMT, ARGS, PRO, EPI)                                 \
    extern "C" __global__ void NAME##_gemv_unaligned(ARGS) { gemv_unaligned<FMT>(w, x, tokens, cols, PRO, EPI); }

// M(STEM, FMT) for every weight format, STEM naming its entry points (as
// `tandem_cuda` does: f32, ..., int4_g64, int4_g128, ..., q6_k); for the
// float formats, which alone have unaligned rows; and for every format whose
// matmul takes f32 activations (all but W8A8). The fused matmul files
// declare their entry points through these; the backend compiles them one
// format at a time by defining both lists first, naming that format alone
// (`tandem_cuda::sources::format_unit`), as a model uses few formats and a
// whole file takes NVRTC minutes.
#ifndef FOR_EACH_MATMUL_FORMAT
#define FOR_EACH_MATMUL_FORMAT(M)                                                                \
    M(f32, FMT_F32) M(f16, FMT_F16) M(bf16, FMT_BF16) M(q8_0, FMT_Q8_0) M(q4_0, FMT_Q4_0)         \
    M(q4_1, FMT_Q4_1) M(int8, FMT_INT8) M(w8a8, FMT_W8A8) M(int4_g64, FMT_INT4_G64)              \
    M(int4_g128, FMT_INT4_G128) M(q5_0, FMT_Q5_0) M(q5_1, FMT_Q5_1) M(iq4_nl, FMT_IQ4_NL)         \
    M(q2_k, FMT_Q2_K) M(q3_k, FMT_Q3_K) M(q4_k, FMT_Q4_K) M(q5_k, FMT_Q5_K) M(q6_k, FMT_Q6_K)
#define FOR_EACH_FLOAT_FORMAT(M) M(f32, FMT_F32) M(f16, FMT_F16) M(bf16, FMT_BF16)
#define FOR_EACH_F32_ACTIVATION_FORMAT(M)                                                         \
    M(f32, FMT_F32) M(f16, FMT_F16) M(bf16, FMT_BF16) M(q8_0, FMT_Q8_0) M(q4_0, FMT_Q4_0)         \
    M(q4_1, FMT_Q4_1) M(int8, FMT_INT8) M(int4_g64, FMT_INT4_G64) M(int4_g128, FMT_INT4_G128)     \
    M(q5_0, FMT_Q5_0) M(q5_1, FMT_Q5_1) M(iq4_nl, FMT_IQ4_NL) M(q2_k, FMT_Q2_K) M(q3_k, FMT_Q3_K) \
    M(q4_k, FMT_Q4_K) M(q5_k, FMT_Q5_K) M(q6_k, FMT_Q6_K)
#endif

// The plain matmul, out[t, r] = sum_c x[t, c] * w[r, c] (+ bias[r]): every
// matmul_FMT.cu declares its entry points with these.
//   NAME_add_bias         the bias after a cuBLAS GEMM (f16, bf16)
#define MATMUL_ARGS                                                                         \
    const u8 *__restrict__ w, const float *__restrict__ x, const u8 *__restrict__ bias,     \
        int bias_fmt, float *__restrict__ out, u32 tokens, u32 n, u32 cols

#define DEFINE_MATMUL(NAME, FMT) \
    DEFINE_MATMUL_ENTRIES(NAME, FMT, MATMUL_ARGS, NoNorm(), StoreOut(out, bias, bias_fmt, n))

#define DEFINE_MATMUL_UNALIGNED(NAME, FMT) \
    DEFINE_MATMUL_UNALIGNED_ENTRY(NAME, FMT, MATMUL_ARGS, NoNorm(), StoreOut(out, bias, bias_fmt, n))

// out[t, r] += bias[r], grid-stride over rows * n elements.
#define DEFINE_ADD_BIAS(NAME)                                                               \
    extern "C" __global__ void NAME##_add_bias(float *__restrict__ out,                     \
                                               const u8 *__restrict__ bias, int bias_fmt,   \
                                               u32 rows, u32 n) {                           \
        for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < (u64)rows * n;          \
             i += (u64)gridDim.x * blockDim.x)                                               \
            out[i] += weight_at(bias_fmt, bias, (u32)(i % n));                              \
    }
