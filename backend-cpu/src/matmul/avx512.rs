//! The AVX-512 block kernel and the pair layout it reads.
//!
//! A run's products with its activation block must be scaled by the two
//! block scales before they meet another run's, so every kernel converts
//! its integer sums to f32 and multiplies them by a scale once per
//! segment of equal scale. Summing two products per i32 lane (`vpmaddwd`
//! on a run in element order) costs one conversion and one multiply-add
//! per 32 elements; this kernel sums four, halving both.
//!
//! The pair layout makes that possible. The 64 elements of runs `2p` and
//! `2p + 1` form four segments of 16 elements (the halves of each run:
//! elements `0..16` and `16..32` of run `2p`, then of run `2p + 1`), and
//! are stored as two vectors of 32 i16, `A` and `B`. The i32 lane `k` of
//! either vector holds two elements of segment `k % 4`: elements
//! `2j, 2j + 1` (in `A`) and `8 + 2j, 8 + 2j + 1` (in `B`) of the
//! segment, `j = k / 4`. So `vpmaddwd` of the weights' and activations'
//! `A`s followed by `vpdpwssd` of their `B`s leaves in lane `k` the sum of
//! four products of segment `k % 4`, exact in i32 and in f32 (at most
//! 4 * 128 * 32767 < 2^24 in magnitude), and one multiply-add by the
//! segments' scales `[s0, s1, s2, s3]`, broadcast from 128 bits, applies
//! them. Formats with a scale per 16-element half (Q2_K, Q3_K, Q6_K) give
//! each segment its own; the others the run's to both of its halves.
//!
//! Activations are quantized into this layout once per matmul (a row of an
//! odd number of blocks is padded with a zero block) and a row tile's
//! weight codes are unpacked into it once ([`repack_codes`]), before the
//! tile's token loop.

use std::arch::x86_64::*;

use tandem_core::quant::{IQ4NL_VALUES, QK};

use super::formats::{BlockFormat, Codes};
use super::quantize::{BlockQuants, QuantRow};

/// Source word of each word of `A` (`high` false) or `B` in the 64 words
/// of a pair's two runs, concatenated.
const fn pair_words(high: bool) -> [i16; 32] {
    let mut words = [0i16; 32];
    let mut w = 0;
    while w < 32 {
        let (lane, within) = (w / 2, w % 2);
        let (segment, j) = (lane % 4, lane / 4);
        let half = if high { 8 } else { 0 };
        words[w] = (16 * segment + half + 2 * j + within) as i16;
        w += 1;
    }
    words
}

const PAIR_A: [i16; 32] = pair_words(false);
const PAIR_B: [i16; 32] = pair_words(true);

/// `PAIR_A` then `PAIR_B` as one byte permute of two runs' 32 bytes each,
/// held in the low halves of two vectors (indices from 64 pick from the
/// second).
const PAIR_BYTES: [u8; 64] = {
    let mut bytes = [0u8; 64];
    let mut i = 0;
    while i < 64 {
        let element = if i < 32 { PAIR_A[i] } else { PAIR_B[i - 32] } as usize;
        bytes[i] = if element < 32 { element } else { 32 + element } as u8;
        i += 1;
    }
    bytes
};

/// Runs `c0` and `c1` (32 i16 each, in element order) as a pair's `A`
/// and `B`.
///
/// # Safety
/// The CPU supports AVX-512 F and BW.
#[inline(always)]
unsafe fn to_pair(c0: __m512i, c1: __m512i) -> [__m512i; 2] {
    let a = _mm512_loadu_si512(PAIR_A.as_ptr().cast());
    let b = _mm512_loadu_si512(PAIR_B.as_ptr().cast());
    [
        _mm512_permutex2var_epi16(c0, a, c1),
        _mm512_permutex2var_epi16(c0, b, c1),
    ]
}

/// Rewrites consecutive pairs of activation blocks, in element order, in
/// the pair layout (`blocks` holds whole rows of an even block count).
///
/// # Safety
/// The CPU supports AVX-512 F and BW.
#[target_feature(enable = "avx512f,avx512bw")]
pub(super) unsafe fn to_pair_layout(blocks: &mut [BlockQuants]) {
    for pair in blocks.chunks_exact_mut(2) {
        let at: *mut __m512i = pair.as_mut_ptr().cast();
        let [a, b] = to_pair(
            _mm512_load_si512(at.cast()),
            _mm512_load_si512(at.add(1).cast()),
        );
        _mm512_store_si512(at.cast(), a);
        _mm512_store_si512(at.add(1).cast(), b);
    }
}

/// Element `i` of block `b` of a row stored in the pair layout.
#[cfg(test)]
pub(super) fn pair_element(quants: &[BlockQuants], b: usize, i: usize) -> i16 {
    let segment = 2 * (b % 2) + i / 16;
    let (vector, within) = ((i % 16) / 8, i % 8);
    let lane = 4 * (within / 2) + segment;
    quants[b - b % 2 + vector].0[2 * lane + within % 2]
}

/// The weight codes of `row` (of format `F`, `runs` runs) in the pair
/// layout, into `codes` (two blocks per pair).
///
/// # Safety
/// `codes` holds `runs.div_ceil(2)` pairs and `row` `runs` runs; the CPU
/// supports AVX2 and AVX-512 F, BW, VL and VBMI.
#[inline(always)]
pub(super) unsafe fn repack_codes<F: BlockFormat>(
    row: &[u8],
    runs: usize,
    codes: &mut [BlockQuants],
) {
    assert!(row.len() >= F::row_bytes(runs) && codes.len() >= 2 * runs.div_ceil(2));
    for p in 0..runs.div_ceil(2) {
        let [a, b] = pair_codes::<F>(row, runs, p);
        let at: *mut __m512i = codes.as_mut_ptr().add(2 * p).cast();
        _mm512_store_si512(at.cast(), a);
        _mm512_store_si512(at.add(1).cast(), b);
    }
}

/// Pair `p` of `row`'s codes (`runs` runs) as `A` and `B`, the codes of a
/// missing last run zero. The one unpacking of both the repacked codes
/// and the kernel's own, so a token's result does not depend on which
/// the kernel read. The two runs' bytes go into the pair layout by one
/// byte permute before they are widened: word permutes cost twice as much.
///
/// # Safety
/// `row` holds `runs` runs and `p < runs.div_ceil(2)`; the CPU supports
/// AVX2 and AVX-512 F, BW, VL and VBMI.
#[inline(always)]
unsafe fn pair_codes<F: BlockFormat>(row: &[u8], runs: usize, p: usize) -> [__m512i; 2] {
    let c0 = _mm512_castsi256_si512(row_run_bytes::<F>(row, 2 * p));
    let c1 = if 2 * p + 1 < runs {
        _mm512_castsi256_si512(row_run_bytes::<F>(row, 2 * p + 1))
    } else {
        _mm512_setzero_si512()
    };
    let order = _mm512_loadu_si512(PAIR_BYTES.as_ptr().cast());
    let both = _mm512_permutex2var_epi8(c0, order, c1);
    let (a, b) = (
        _mm512_castsi512_si256(both),
        _mm512_extracti64x4_epi64::<1>(both),
    );
    if signed_codes::<F>() {
        [_mm512_cvtepi8_epi16(a), _mm512_cvtepi8_epi16(b)]
    } else {
        [_mm512_cvtepu8_epi16(a), _mm512_cvtepu8_epi16(b)]
    }
}

/// The 32 codes of run `b` of `row` as bytes. (Not a closure: closures do
/// not inherit the caller's target features, and the intrinsics would not
/// inline into one.)
///
/// # Safety
/// `row` holds run `b`; the CPU supports AVX2 and AVX-512 F, BW and VL.
#[inline(always)]
unsafe fn row_run_bytes<F: BlockFormat>(row: &[u8], b: usize) -> __m256i {
    run_bytes::<F>(row.as_ptr().add(F::block_at(b)), b % F::RUNS)
}

/// Whether `F`'s codes are signed bytes ([`Codes`]).
fn signed_codes<F: BlockFormat>() -> bool {
    matches!(
        F::CODES,
        Codes::Bytes | Codes::NonLinear | Codes::Q3K | Codes::Q6K
    )
}

/// `acc + scales * f32(a · x_a + b · x_b)` for one pair of one row and
/// token, the sums taken in pairs of i16 products (`vpmaddwd`, then
/// `vpdpwssd`), `scales` pointing at the pair's four segment scales.
/// Written out: LLVM splits `vpdpwssd` back into `vpmaddwd` and `vpaddd`,
/// and hoists the scale broadcasts of a whole tile into registers, which
/// then spill.
///
/// # Safety
/// 16 bytes are readable at `scales`; the CPU supports AVX-512 F and VNNI.
#[inline]
#[target_feature(enable = "avx512f,avx512vnni")]
unsafe fn pair_step(
    mut acc: __m512,
    [a, b]: [__m512i; 2],
    [x_a, x_b]: [__m512i; 2],
    scales: *const f32,
) -> __m512 {
    // Typed scratch registers: LLVM misallocates untyped `_` ones here.
    let (_sums, _scales): (__m512i, __m512);
    std::arch::asm!(
        "vpmaddwd {s:z}, {a:z}, {x_a:z}",
        "vpdpwssd {s:z}, {b:z}, {x_b:z}",
        "vcvtdq2ps {s:z}, {s:z}",
        "vbroadcastf32x4 {c:z}, xmmword ptr [{scales}]",
        "vfmadd231ps {acc:z}, {s:z}, {c:z}",
        acc = inout(zmm_reg) acc,
        a = in(zmm_reg) a,
        b = in(zmm_reg) b,
        x_a = in(zmm_reg) x_a,
        x_b = in(zmm_reg) x_b,
        scales = in(reg) scales,
        s = out(zmm_reg) _sums,
        c = out(zmm_reg) _scales,
        options(pure, readonly, nostack, preserves_flags),
    );
    acc
}

/// The mask of the first `n` (at most 16) lanes.
#[inline(always)]
fn floats(n: usize) -> __mmask16 {
    ((1u32 << n.min(16)) - 1) as __mmask16
}

/// Pairs whose segment scales fill one vector.
const CHUNK_PAIRS: usize = 4;

/// `[0, 0, 2, 2, ..., 14, 14]`: each run's scale (the even lane of its
/// `[scale, offset]` or `[scale, sum]`) for both of its segments.
const RUN_SCALES: [i32; 16] = [0, 0, 2, 2, 4, 4, 6, 6, 8, 8, 10, 10, 12, 12, 14, 14];
/// `[0, 2, 4, ..., 30]`: each half's scale out of 32 floats of
/// `[scale, offset]` per half.
const HALF_SCALES: [i32; 16] = [0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30];

/// The AVX-512 block kernel over weight codes in the pair layout. The
/// segment scales are the products of a chunk of pairs' weight scales and
/// activation scales, one multiply per row and token, the same product of
/// the same two floats whichever tile computes it; each pair's four are
/// then one 128-bit broadcast load. The offset terms (`offset * x_sum` per
/// run or half) accumulate in the same pass, one multiply-add of the
/// chunk's heads `[scale, offset]` by the activations' stats
/// `[scale, sum]` whose odd lanes are the terms.
///
/// # Safety
/// The CPU supports AVX2, FMA and AVX-512 F, BW, VL, VNNI and VBMI.
#[inline(always)]
pub(super) unsafe fn block_tile_512<F: BlockFormat, const R: usize, const T: usize>(
    w: [&[u8]; R],
    w_codes: [&[BlockQuants]; R],
    w_heads: [&[f32]; R],
    x: [QuantRow<'_>; T],
) -> [[f32; T]; R] {
    let runs = x[0].blocks();
    let pairs = runs.div_ceil(2);
    // Without repacked codes, each pair's are unpacked from the rows.
    let repacked = !w_codes[0].is_empty();
    if repacked {
        assert!(w_codes.iter().all(|c| c.len() >= 2 * pairs));
    } else {
        assert!(w.iter().all(|w| w.len() >= F::row_bytes(runs)));
    }
    assert!(w_heads.iter().all(|h| h.len() >= F::HEAD_FLOATS * runs));
    assert!(x
        .iter()
        .all(|x| x.quants.len() >= 2 * pairs && x.stats.len() >= 4 * pairs));
    if F::HALVES && F::OFFSET {
        assert!(x.iter().all(|x| x.half_stats.len() >= 4 * runs));
    }
    let run_scales = _mm512_loadu_si512(RUN_SCALES.as_ptr().cast());
    let half_scales = _mm512_loadu_si512(HALF_SCALES.as_ptr().cast());
    let offsets = F::OFFSET;
    // The odd lanes also take the offset terms, `offset * x_sum` per run
    // (or half), in the place of the odd scales of `[scale, offset]` heads
    // times `[scale, sum]` stats: no second set of accumulators to spill.
    let mut acc = [[_mm512_setzero_ps(); T]; R];
    // Per row and token, the segment scales of a chunk's pairs.
    let mut scales = [[[0f32; 16]; T]; R];
    let mut p = 0;
    while p < pairs {
        let chunk = CHUNK_PAIRS.min(pairs - p);
        let chunk_runs = (runs - 2 * p).min(2 * chunk);
        // SAFETY (all loads below): the lengths are asserted above, masked
        // lanes are not read, and blocks are 64-byte aligned.
        // No closures here: they would not inherit the target features, and
        // the intrinsics would not inline into them.
        let mut x_stats = [_mm512_setzero_ps(); T];
        let mut x_scales = [_mm512_setzero_ps(); T];
        // `[scale, sum]` per half, for the offsets of formats with halves.
        let mut x_half_stats = [[_mm512_setzero_ps(); 2]; T];
        for t in 0..T {
            x_stats[t] = _mm512_maskz_loadu_ps(floats(4 * chunk), x[t].stats.as_ptr().add(4 * p));
            x_scales[t] = _mm512_permutexvar_ps(run_scales, x_stats[t]);
            if F::HALVES && offsets {
                let stats = x[t].half_stats.as_ptr().add(8 * p);
                let n = 4 * chunk_runs;
                x_half_stats[t] = [
                    _mm512_maskz_loadu_ps(floats(n), stats),
                    _mm512_maskz_loadu_ps(floats(n.saturating_sub(16)), stats.add(16)),
                ];
            }
        }
        for r in 0..R {
            // The chunk's heads, `[scale, offset]` per run (or half).
            let heads = if F::HALVES {
                let heads = w_heads[r].as_ptr().add(8 * p);
                let n = 4 * chunk_runs;
                [
                    _mm512_maskz_loadu_ps(floats(n), heads),
                    _mm512_maskz_loadu_ps(floats(n.saturating_sub(16)), heads.add(16)),
                ]
            } else {
                let heads = w_heads[r].as_ptr().add(4 * p);
                [
                    _mm512_maskz_loadu_ps(floats(2 * chunk_runs), heads),
                    _mm512_setzero_ps(),
                ]
            };
            let w_scales = if F::HALVES {
                _mm512_permutex2var_ps(heads[0], half_scales, heads[1])
            } else {
                _mm512_permutexvar_ps(run_scales, heads[0])
            };
            for t in 0..T {
                let products = _mm512_mul_ps(w_scales, x_scales[t]);
                _mm512_storeu_ps(scales[r][t].as_mut_ptr(), products);
                const ODD: __mmask16 = 0xaaaa;
                if offsets && F::HALVES {
                    let a = _mm512_mask3_fmadd_ps(heads[0], x_half_stats[t][0], acc[r][t], ODD);
                    acc[r][t] = _mm512_mask3_fmadd_ps(heads[1], x_half_stats[t][1], a, ODD);
                } else if offsets {
                    acc[r][t] = _mm512_mask3_fmadd_ps(heads[0], x_stats[t], acc[r][t], ODD);
                }
            }
        }
        for j in 0..chunk {
            let q = 2 * (p + j);
            // Each token's activations, loaded once for the tile's rows.
            let mut x_pair = [[_mm512_setzero_si512(); 2]; T];
            for t in 0..T {
                let quants: *const __m512i = x[t].quants.as_ptr().add(q).cast();
                x_pair[t] = [
                    _mm512_load_si512(quants.cast()),
                    _mm512_load_si512(quants.add(1).cast()),
                ];
            }
            for r in 0..R {
                let codes = if repacked {
                    let codes: *const __m512i = w_codes[r].as_ptr().add(q).cast();
                    [
                        _mm512_load_si512(codes.cast()),
                        _mm512_load_si512(codes.add(1).cast()),
                    ]
                } else {
                    pair_codes::<F>(w[r], runs, p + j)
                };
                for t in 0..T {
                    let scales = scales[r][t].as_ptr().add(4 * j);
                    acc[r][t] = pair_step(acc[r][t], codes, x_pair[t], scales);
                }
            }
        }
        p += chunk;
    }
    let mut sums = [[0f32; T]; R];
    for r in 0..R {
        for t in 0..T {
            sums[r][t] = _mm512_reduce_add_ps(acc[r][t]);
        }
    }
    sums
}

/// The 32 codes of run `j` of the block at `block` as bytes, in element
/// order ([`Codes`] says which are signed, [`signed_codes`] too). The fifth bits of Q5_0, Q5_1 and Q5_K and
/// the third of Q3_K become a byte mask, the bytes where it is set (or
/// clear) taking the bit's value; a masked bit field and the bits above it
/// merge in one `vpternlogd`.
///
/// # Safety
/// A whole block of format `F` is readable at `block`; the CPU supports
/// AVX2 and AVX-512 F, BW and VL.
#[inline(always)]
unsafe fn run_bytes<F: BlockFormat>(block: *const u8, j: usize) -> __m256i {
    let (h, s) = (j / 4, j % 4);
    let bytes = |at: usize| _mm256_loadu_si256(block.add(at).cast());
    // Bytes shifted right by `n` bits (the bits moving in from the next byte
    // are masked off by every caller).
    let shift = |v: __m256i, n: usize| _mm256_srl_epi16(v, _mm_cvtsi32_si128(n as i32));
    let mask = |v: __m256i, m: i8| _mm256_and_si256(v, _mm256_set1_epi8(m));
    let splat = _mm256_set1_epi8;
    // `(low & 0x0f) | high` per byte.
    let merge = |low: __m256i, high: __m256i| {
        _mm256_ternarylogic_epi32::<0b1110_1100>(low, high, splat(0x0f))
    };
    // 16 in the bytes of `bits` whose bit `bit` is set, 0 elsewhere.
    let fifth = |bits: __mmask32| _mm256_maskz_mov_epi8(bits, splat(16));
    match F::CODES {
        Codes::Bytes => bytes(F::QUANTS_AT + QK * j),
        Codes::Nibbles => mask(nibble_halves(block.add(F::QUANTS_AT + QK / 2 * j)), 0x0f),
        Codes::Nibbles5 => {
            let low = nibble_halves(block.add(F::QUANTS_AT));
            let qh = block.add(F::QUANTS_AT - 4).cast::<u32>().read_unaligned();
            merge(low, fifth(_cvtu32_mask32(qh)))
        }
        Codes::NonLinear => {
            let table = _mm256_broadcastsi128_si256(_mm_loadu_si128(IQ4NL_VALUES.as_ptr().cast()));
            let q = mask(nibble_halves(block.add(F::QUANTS_AT)), 0x0f);
            _mm256_shuffle_epi8(table, q)
        }
        Codes::Q4K => mask(shift(bytes(16 + QK * (j / 2)), 4 * (j % 2)), 0x0f),
        Codes::Q5K => {
            let low = shift(bytes(48 + QK * (j / 2)), 4 * (j % 2));
            let bits = _mm256_test_epi8_mask(bytes(16), splat((1u8 << j) as i8));
            merge(low, fifth(bits))
        }
        Codes::Q6K => {
            let low = shift(bytes(64 * h + QK * (s & 1)), 4 * (s / 2));
            // Rotating each 32-bit lane left by `4 - 2s` moves bits `2s` and
            // `2s + 1` of every byte to bits 4 and 5 of the same byte.
            let rotation = _mm256_set1_epi32((4 - 2 * s as i32).rem_euclid(32));
            let high = mask(_mm256_rolv_epi32(bytes(128 + QK * h), rotation), 0x30);
            _mm256_sub_epi8(merge(low, high), splat(32))
        }
        Codes::Q3K => {
            let low = mask(shift(bytes(32 + QK * h), 2 * s), 3);
            // `(low | 4 * bit) - 4`: `low - 4` where the bit is clear.
            let clear = _mm256_testn_epi8_mask(bytes(0), splat((1u8 << (4 * h + s)) as i8));
            _mm256_mask_sub_epi8(low, clear, low, splat(4))
        }
        Codes::Q2K => mask(shift(bytes(16 + QK * h), 2 * s), 3),
    }
}

/// 16 bytes of nibbles at `packed` spread over 32 bytes, the low nibbles
/// in bytes `0..16` and the high ones in `16..32`, each in the low four
/// bits of its byte (the high four are left to mask).
///
/// # Safety
/// 16 bytes are readable at `packed`; the CPU supports AVX2, AVX-512BW and
/// AVX-512VL.
#[inline(always)]
unsafe fn nibble_halves(packed: *const u8) -> __m256i {
    let both = _mm256_broadcastsi128_si256(_mm_loadu_si128(packed.cast()));
    // The upper copy's 16-bit lanes (8..16) shifted down by a nibble.
    _mm256_mask_srli_epi16::<4>(both, 0xff00, both)
}
