//! The AVX-512 block kernel and the quad layout it reads.
//!
//! A run's products with its activation block must be scaled by the two
//! block scales before they meet another run's, so every kernel converts
//! its integer sums to f32 and multiplies them by a scale once per
//! segment of equal scale. On the CPUs this kernel runs on, the integer
//! multiply-adds and the float multiply-adds share their execution ports
//! (the conversion does not), so each multiply-add by a scale costs as
//! much as one of the products' instructions. Summing two products per
//! i32 lane (`vpmaddwd` on a run in element order) pays one per 32
//! elements; this kernel sums eight, one per 128 elements.
//!
//! The quad layout makes that possible. The 128 elements of runs `4q` to
//! `4q + 3` form eight segments of 16 elements (the halves of each run, in
//! order), and are stored as four vectors of 32 i16, `V0` to `V3`. The
//! i32 lane `k` of vector `v` holds elements `4v + 2j` and `4v + 2j + 1`
//! of segment `k % 8`, `j = k / 8`. So `vpmaddwd` of the weights' and
//! activations' `V0`s followed by `vpdpwssd` of their `V1` to `V3` leaves
//! in lane `k` the sum of eight products of segment `k % 8`, exact in i32
//! (at most 8 * 128 * 32767 < 2^31 in magnitude; rounded once when it
//! becomes an f32 above 2^24), and one multiply-add by the segments'
//! scales `[s0, ..., s7]`, broadcast from 256 bits, applies them. Formats
//! with a scale per 16-element half (Q2_K, Q3_K, Q6_K) give each segment
//! its own; the others the run's to both of its halves.
//!
//! Activations are quantized into this layout once per matmul (a row is
//! padded with zero blocks to a multiple of four) and a row tile's weight
//! codes are unpacked into it once ([`repack_codes`]), before the tile's
//! token loop.

use std::arch::x86_64::*;

use tandem_core::quant::{IQ4NL_VALUES, QK};

use super::formats::{BlockFormat, Codes, Head};
use super::quantize::{BlockQuants, QuantRow};

/// Runs per group of the layout.
pub(super) const QUAD: usize = 4;

/// Element (of the 128 of a quad's runs, concatenated) that word `w` of
/// vector `v` holds.
const fn quad_element(v: usize, w: usize) -> usize {
    let (lane, within) = (w / 2, w % 2);
    let (segment, j) = (lane % 8, lane / 8);
    16 * segment + 4 * v + 2 * j + within
}

/// Per output vector, the word each of its words takes from a quad's first
/// two runs (or, the same index less 64, from its last two): an index of
/// `vpermt2w` over two blocks.
const QUAD_WORDS: [[i16; 32]; QUAD] = {
    let mut words = [[0i16; 32]; QUAD];
    let mut v = 0;
    while v < QUAD {
        let mut w = 0;
        while w < 32 {
            words[v][w] = (quad_element(v, w) % 64) as i16;
            w += 1;
        }
        v += 1;
    }
    words
};

/// The words of every vector that come from a quad's last two runs: those
/// of segments 4 to 7.
const LAST_RUNS: __mmask32 = 0xff00_ff00;

/// `V0, V1` and `V2, V3` as byte permutes of a quad's 128 bytes, runs 0 and
/// 1 in the first vector and 2 and 3 in the second (indices from 64 pick
/// from the second).
const QUAD_BYTES: [[u8; 64]; 2] = {
    let mut bytes = [[0u8; 64]; 2];
    let mut half = 0;
    while half < 2 {
        let mut i = 0;
        while i < 64 {
            bytes[half][i] = quad_element(2 * half + i / 32, i % 32) as u8;
            i += 1;
        }
        half += 1;
    }
    bytes
};

/// Rewrites each group of four activation blocks, in element order, in the
/// quad layout (`blocks` holds whole rows of a block count that is a
/// multiple of four).
///
/// # Safety
/// The CPU supports AVX-512 F and BW.
#[target_feature(enable = "avx512f,avx512bw")]
pub(super) unsafe fn to_quad_layout(blocks: &mut [BlockQuants]) {
    for quad in blocks.chunks_exact_mut(QUAD) {
        let at: *mut __m512i = quad.as_mut_ptr().cast();
        let mut runs = [_mm512_setzero_si512(); QUAD];
        for (i, run) in runs.iter_mut().enumerate() {
            *run = _mm512_load_si512(at.add(i).cast());
        }
        for (v, words) in QUAD_WORDS.iter().enumerate() {
            let words = _mm512_loadu_si512(words.as_ptr().cast());
            let first = _mm512_permutex2var_epi16(runs[0], words, runs[1]);
            let last = _mm512_permutex2var_epi16(runs[2], words, runs[3]);
            _mm512_store_si512(
                at.add(v).cast(),
                _mm512_mask_blend_epi16(LAST_RUNS, first, last),
            );
        }
    }
}

/// Element `i` of block `b` of a row stored in the quad layout.
#[cfg(test)]
pub(super) fn quad_element_at(quants: &[BlockQuants], b: usize, i: usize) -> i16 {
    let element = QK * (b % QUAD) + i;
    let (segment, within_segment) = (element / 16, element % 16);
    let (v, j, within) = (
        within_segment / 4,
        within_segment % 4 / 2,
        within_segment % 2,
    );
    let lane = 8 * j + segment;
    quants[b - b % QUAD + v].0[2 * lane + within]
}

/// The weight codes of `row` (of format `F`, `runs` runs) in the quad
/// layout, into `codes` (four blocks per quad).
///
/// # Safety
/// `codes` holds `runs.div_ceil(4)` quads and `row` `runs` runs; the CPU
/// supports AVX2 and AVX-512 F, BW, VL and VBMI.
#[inline(always)]
pub(super) unsafe fn repack_codes<F: BlockFormat>(
    row: &[u8],
    runs: usize,
    codes: &mut [BlockQuants],
) {
    assert!(row.len() >= F::row_bytes(runs) && codes.len() >= QUAD * runs.div_ceil(QUAD));
    for q in 0..runs.div_ceil(QUAD) {
        let vectors = quad_codes::<F>(row, runs, q);
        let at: *mut __m512i = codes.as_mut_ptr().add(QUAD * q).cast();
        for (v, vector) in vectors.into_iter().enumerate() {
            _mm512_store_si512(at.add(v).cast(), vector);
        }
    }
}

/// Quad `q` of `row`'s codes (`runs` runs) as `V0` to `V3`, the codes of
/// missing runs zero. The one unpacking of both the repacked codes and the
/// kernel's own, so a token's result does not depend on which the kernel
/// read. The runs' bytes go into the quad layout by byte permutes before
/// they are widened: word permutes cost twice as much.
///
/// # Safety
/// `row` holds `runs` runs and `q < runs.div_ceil(4)`; the CPU supports
/// AVX2 and AVX-512 F, BW, VL and VBMI.
#[inline(always)]
unsafe fn quad_codes<F: BlockFormat>(row: &[u8], runs: usize, q: usize) -> [__m512i; QUAD] {
    let b = QUAD * q;
    let first = _mm512_inserti64x4::<1>(
        _mm512_castsi256_si512(row_run_bytes::<F>(row, b)),
        row_run_bytes_or_zero::<F>(row, runs, b + 1),
    );
    let last = _mm512_inserti64x4::<1>(
        _mm512_castsi256_si512(row_run_bytes_or_zero::<F>(row, runs, b + 2)),
        row_run_bytes_or_zero::<F>(row, runs, b + 3),
    );
    let low = _mm512_permutex2var_epi8(
        first,
        _mm512_loadu_si512(QUAD_BYTES[0].as_ptr().cast()),
        last,
    );
    let high = _mm512_permutex2var_epi8(
        first,
        _mm512_loadu_si512(QUAD_BYTES[1].as_ptr().cast()),
        last,
    );
    let (low, high) = match zero_point::<F>() {
        Some(zero) => (
            _mm512_sub_epi8(low, _mm512_set1_epi8(zero)),
            _mm512_sub_epi8(high, _mm512_set1_epi8(zero)),
        ),
        None => (low, high),
    };
    let [v0, v1, v2, v3] = [
        _mm512_castsi512_si256(low),
        _mm512_extracti64x4_epi64::<1>(low),
        _mm512_castsi512_si256(high),
        _mm512_extracti64x4_epi64::<1>(high),
    ];
    if signed_codes::<F>() {
        [
            _mm512_cvtepi8_epi16(v0),
            _mm512_cvtepi8_epi16(v1),
            _mm512_cvtepi8_epi16(v2),
            _mm512_cvtepi8_epi16(v3),
        ]
    } else {
        [
            _mm512_cvtepu8_epi16(v0),
            _mm512_cvtepu8_epi16(v1),
            _mm512_cvtepu8_epi16(v2),
            _mm512_cvtepu8_epi16(v3),
        ]
    }
}

/// [`row_run_bytes`], or zeros for a run past the row's last.
///
/// # Safety
/// As [`row_run_bytes`] where `b < runs`.
#[inline(always)]
unsafe fn row_run_bytes_or_zero<F: BlockFormat>(row: &[u8], runs: usize, b: usize) -> __m256i {
    if b < runs {
        row_run_bytes::<F>(row, b)
    } else {
        _mm256_setzero_si256()
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

/// Whether `F`'s codes are signed bytes ([`Codes`]), or become signed
/// when their zero point is taken off.
fn signed_codes<F: BlockFormat>() -> bool {
    zero_point::<F>().is_some()
        || matches!(
            F::CODES,
            Codes::Bytes | Codes::NonLinear | Codes::Q3K | Codes::Q6K
        )
}

/// The code that stands for zero in the formats whose offset is a fixed
/// multiple of their scale (Q4_0's 8, Q5_0's 16: `[d, -8 d]` heads). This
/// kernel takes it off the codes as it unpacks them, so their runs need
/// no offset term: one pass less per tile, and the dot product exact in
/// integers.
fn zero_point<F: BlockFormat>() -> Option<i8> {
    match F::HEAD {
        Head::Scaled(factor) if factor != 0.0 => Some(-factor as i8),
        _ => None,
    }
}

/// Whether `F`'s runs take an offset term in this kernel.
fn offsets<F: BlockFormat>() -> bool {
    F::OFFSET && zero_point::<F>().is_none()
}

/// `acc + scales * f32(v0 · x0 + ... + v3 · x3)` for one quad of one row
/// and token, the sums taken in pairs of i16 products (`vpmaddwd`, then
/// `vpdpwssd`), `scales` pointing at the quad's eight segment scales.
/// Written out: LLVM splits `vpdpwssd` back into `vpmaddwd` and `vpaddd`,
/// and hoists the scale broadcasts of a whole tile into registers, which
/// then spill.
///
/// # Safety
/// 32 bytes are readable at `scales`; the CPU supports AVX-512 F and VNNI.
#[inline]
#[target_feature(enable = "avx512f,avx512vnni")]
unsafe fn quad_step(
    mut acc: __m512,
    [v0, v1, v2, v3]: [__m512i; QUAD],
    [x0, x1, x2, x3]: [__m512i; QUAD],
    scales: *const f32,
) -> __m512 {
    // Typed scratch registers: LLVM misallocates untyped `_` ones here.
    let (_sums, _scales): (__m512i, __m512);
    std::arch::asm!(
        "vpmaddwd {s:z}, {v0:z}, {x0:z}",
        "vpdpwssd {s:z}, {v1:z}, {x1:z}",
        "vpdpwssd {s:z}, {v2:z}, {x2:z}",
        "vpdpwssd {s:z}, {v3:z}, {x3:z}",
        "vcvtdq2ps {s:z}, {s:z}",
        "vbroadcastf64x4 {c:z}, ymmword ptr [{scales}]",
        "vfmadd231ps {acc:z}, {s:z}, {c:z}",
        acc = inout(zmm_reg) acc,
        v0 = in(zmm_reg) v0,
        v1 = in(zmm_reg) v1,
        v2 = in(zmm_reg) v2,
        v3 = in(zmm_reg) v3,
        x0 = in(zmm_reg) x0,
        x1 = in(zmm_reg) x1,
        x2 = in(zmm_reg) x2,
        x3 = in(zmm_reg) x3,
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

/// Quads whose segment scales fill one vector.
const CHUNK_QUADS: usize = 2;

/// `[0, 0, 2, 2, ..., 14, 14]`: each run's scale (the even lane of its
/// `[scale, offset]` or `[scale, sum]`) for both of its segments.
const RUN_SCALES: [i32; 16] = [0, 0, 2, 2, 4, 4, 6, 6, 8, 8, 10, 10, 12, 12, 14, 14];
/// `[0, 2, 4, ..., 30]`: each half's scale out of 32 floats of
/// `[scale, offset]` per half.
const HALF_SCALES: [i32; 16] = [0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30];

/// The AVX-512 block kernel over weight codes in the quad layout. The
/// segment scales are the products of a chunk of quads' weight scales and
/// activation scales, one multiply per row and token, the same product of
/// the same two floats whichever tile computes it; each quad's eight are
/// then one 256-bit broadcast load. The offset terms (`offset * x_sum` per
/// run or half) are added first, one multiply-add of the heads `[scale,
/// offset]` of eight runs (or four runs' halves) by the activations' stats
/// `[scale, sum]`, whose odd lanes are the terms.
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
    let quads = runs.div_ceil(QUAD);
    // Without repacked codes, each quad's are unpacked from the rows.
    let repacked = !w_codes[0].is_empty();
    if repacked {
        assert!(w_codes.iter().all(|c| c.len() >= QUAD * quads));
    } else {
        assert!(w.iter().all(|w| w.len() >= F::row_bytes(runs)));
    }
    assert!(w_heads.iter().all(|h| h.len() >= F::HEAD_FLOATS * runs));
    assert!(x
        .iter()
        .all(|x| x.quants.len() >= QUAD * quads && x.stats.len() >= 2 * QUAD * quads));
    if F::HALVES && offsets::<F>() {
        assert!(x.iter().all(|x| x.half_stats.len() >= 4 * runs));
    }
    let run_scales = _mm512_loadu_si512(RUN_SCALES.as_ptr().cast());
    let half_scales = _mm512_loadu_si512(HALF_SCALES.as_ptr().cast());
    // The offset terms first, `offset * x_sum` per run (or half), into the
    // odd lanes of the accumulators: the odd lanes of `[scale, offset]`
    // heads times `[scale, sum]` stats. A pass of their own, so that the
    // products' loop keeps every accumulator in a register.
    let mut acc = [[_mm512_setzero_ps(); T]; R];
    if offsets::<F>() {
        const ODD: __mmask16 = 0xaaaa;
        // Heads (and stats) of 8 runs, or of 4 runs' halves, per vector.
        let per_vector = if F::HALVES { 4 } else { 8 };
        let mut b = 0;
        while b < runs {
            let n = F::HEAD_FLOATS * (runs - b).min(per_vector);
            for t in 0..T {
                // SAFETY: `n` floats from `b`'s lie within the lengths
                // asserted above.
                let stats = if F::HALVES {
                    _mm512_maskz_loadu_ps(floats(n), x[t].half_stats.as_ptr().add(4 * b))
                } else {
                    _mm512_maskz_loadu_ps(floats(n), x[t].stats.as_ptr().add(2 * b))
                };
                for r in 0..R {
                    let heads = _mm512_maskz_loadu_ps(
                        floats(n),
                        w_heads[r].as_ptr().add(F::HEAD_FLOATS * b),
                    );
                    acc[r][t] = _mm512_mask3_fmadd_ps(heads, stats, acc[r][t], ODD);
                }
            }
            b += per_vector;
        }
    }
    // Per row and token, the segment scales of a chunk's quads.
    let mut scales = [[[0f32; 16]; T]; R];
    let mut q = 0;
    while q < quads {
        let chunk = CHUNK_QUADS.min(quads - q);
        let chunk_runs = (runs - QUAD * q).min(QUAD * chunk);
        // SAFETY (all loads below): the lengths are asserted above, masked
        // lanes are not read, and blocks are 64-byte aligned.
        // No closures here: they would not inherit the target features, and
        // the intrinsics would not inline into them.
        let mut x_scales = [_mm512_setzero_ps(); T];
        for t in 0..T {
            let stats = x[t].stats.as_ptr().add(2 * QUAD * q);
            let stats = _mm512_maskz_loadu_ps(floats(2 * QUAD * chunk), stats);
            x_scales[t] = _mm512_permutexvar_ps(run_scales, stats);
        }
        for r in 0..R {
            // The chunk's heads, `[scale, offset]` per run (or half).
            let w_scales = if F::HALVES {
                let heads = w_heads[r].as_ptr().add(4 * QUAD * q);
                let n = 4 * chunk_runs;
                let heads = [
                    _mm512_maskz_loadu_ps(floats(n), heads),
                    _mm512_maskz_loadu_ps(floats(n.saturating_sub(16)), heads.add(16)),
                ];
                _mm512_permutex2var_ps(heads[0], half_scales, heads[1])
            } else {
                let heads = w_heads[r].as_ptr().add(2 * QUAD * q);
                let heads = _mm512_maskz_loadu_ps(floats(2 * chunk_runs), heads);
                _mm512_permutexvar_ps(run_scales, heads)
            };
            for t in 0..T {
                let products = _mm512_mul_ps(w_scales, x_scales[t]);
                _mm512_storeu_ps(scales[r][t].as_mut_ptr(), products);
            }
        }
        for j in 0..chunk {
            let first = QUAD * (q + j);
            // Each token's activations, loaded once for the tile's rows.
            let mut x_quad = [[_mm512_setzero_si512(); QUAD]; T];
            for t in 0..T {
                let quants: *const __m512i = x[t].quants.as_ptr().add(first).cast();
                for (v, vector) in x_quad[t].iter_mut().enumerate() {
                    *vector = _mm512_load_si512(quants.add(v).cast());
                }
            }
            for r in 0..R {
                let codes = if repacked {
                    let codes: *const __m512i = w_codes[r].as_ptr().add(first).cast();
                    let mut vectors = [_mm512_setzero_si512(); QUAD];
                    for (v, vector) in vectors.iter_mut().enumerate() {
                        *vector = _mm512_load_si512(codes.add(v).cast());
                    }
                    vectors
                } else {
                    quad_codes::<F>(w[r], runs, q + j)
                };
                for t in 0..T {
                    let scales = scales[r][t].as_ptr().add(8 * j);
                    acc[r][t] = quad_step(acc[r][t], codes, x_quad[t], scales);
                }
            }
        }
        q += chunk;
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
