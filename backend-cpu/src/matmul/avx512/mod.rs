//! The AVX-512 block kernel.
//!
//! A run's products with its activation block must be scaled by the two
//! block scales before they meet another run's, so every kernel converts
//! its integer sums to f32 and multiplies them by a scale once per
//! segment of equal scale. On the CPUs this kernel runs on, the integer
//! multiply-adds and the float multiply-adds share their execution ports
//! (the conversion does not), so each multiply-add by a scale costs as
//! much as one of the products' instructions. Summing two products per
//! i32 lane (`vpmaddwd` on a run in element order) pays one per 32
//! elements; this kernel sums eight, one per 128 elements, in the group
//! layout ([`layout`]): a quad's lanes each hold eight products of one
//! 16-element segment, exact in i32 (at most 8 * 128 * 32767 < 2^31 in
//! magnitude; rounded once when it becomes an f32 above 2^24), and one
//! multiply-add by the segments' scales `[s0, ..., s7]`, broadcast from 256
//! bits, applies them (a row's closing pair: four products, four scales).
//! Formats with a scale per 16-element half (Q2_K, Q3_K, Q6_K) give each
//! segment its own; the others the run's to both of its halves.

mod layout;
mod planes;

use std::arch::x86_64::*;

use super::formats::BlockFormat;
use super::quantize::{BlockQuants, QuantRow};
#[cfg(test)]
pub(super) use layout::element_at;
use layout::{group_codes, group_runs, zero_point, PAIR};
pub(super) use layout::{repack_codes, stored_runs, to_group_layout, QUAD};
use planes::plane_tile_512;
pub(super) use planes::{
    code_blocks, plane_blocks, repack_plane_codes, takes_plane_kernel, to_planes,
};
#[cfg(test)]
pub(super) use planes::{plane_element, plane_lane};

/// Whether `F`'s runs take an offset term in this kernel: not those whose
/// codes lose their zero point as they are unpacked.
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

/// [`quad_step`] for a row's closing pair: `acc + scales * f32(a · x_a +
/// b · x_b)`, `scales` pointing at the pair's four segment scales.
///
/// # Safety
/// 16 bytes are readable at `scales`; the CPU supports AVX-512 F and VNNI.
#[inline]
#[target_feature(enable = "avx512f,avx512vnni")]
unsafe fn pair_step(
    mut acc: __m512,
    [a, b]: [__m512i; PAIR],
    [x_a, x_b]: [__m512i; PAIR],
    scales: *const f32,
) -> __m512 {
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

/// Groups whose segment scales fill one vector.
const CHUNK_GROUPS: usize = 2;

/// `[0, 0, 2, 2, ..., 14, 14]`: each run's scale (the even lane of its
/// `[scale, offset]` or `[scale, sum]`) for both of its segments.
const RUN_SCALES: [i32; 16] = [0, 0, 2, 2, 4, 4, 6, 6, 8, 8, 10, 10, 12, 12, 14, 14];
/// `[0, 2, 4, ..., 30]`: each half's scale out of 32 floats of
/// `[scale, offset]` per half.
const HALF_SCALES: [i32; 16] = [0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30];

/// The AVX-512 block kernel over weight codes in the group layout. The
/// segment scales are the products of a chunk of groups' weight scales and
/// activation scales, one multiply per row and token, the same product of
/// the same two floats whichever tile computes it; each quad's eight are
/// then one 256-bit broadcast load (a pair's four, 128 bits). The offset terms (`offset * x_sum` per
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
    if takes_plane_kernel::<F>() {
        return plane_tile_512::<F, R, T>(w, w_codes, x);
    }
    // Without repacked codes, each group's are unpacked from the rows. Two
    // loops: the unpacking's constants would otherwise hold registers in
    // the repacked one too.
    if w_codes[0].is_empty() {
        group_tile_512::<F, R, T, false>(w, w_codes, w_heads, x)
    } else {
        group_tile_512::<F, R, T, true>(w, w_codes, w_heads, x)
    }
}

/// [`block_tile_512`] for the group layout, over repacked codes or the
/// rows' as `REPACKED` says.
///
/// # Safety
/// As [`block_tile_512`]'s.
#[inline(always)]
unsafe fn group_tile_512<F: BlockFormat, const R: usize, const T: usize, const REPACKED: bool>(
    w: [&[u8]; R],
    w_codes: [&[BlockQuants]; R],
    w_heads: [&[f32]; R],
    x: [QuantRow<'_>; T],
) -> [[f32; T]; R] {
    let runs = x[0].blocks();
    // Groups: quads, the last perhaps a pair, each at a multiple of 4 runs.
    let groups = runs.div_ceil(QUAD);
    let stored = stored_runs(runs);
    let repacked = REPACKED;
    if repacked {
        assert!(w_codes.iter().all(|c| c.len() >= stored));
    } else {
        assert!(w.iter().all(|w| w.len() >= F::row_bytes(runs)));
    }
    assert!(w_heads.iter().all(|h| h.len() >= F::HEAD_FLOATS * runs));
    assert!(x
        .iter()
        .all(|x| x.quants.len() >= stored && x.stats.len() >= 2 * stored));
    if F::HALVES && offsets::<F>() {
        assert!(x.iter().all(|x| x.half_stats.len() >= 4 * runs));
    }
    let run_scales = _mm512_loadu_si512(RUN_SCALES.as_ptr().cast());
    let half_scales = _mm512_loadu_si512(HALF_SCALES.as_ptr().cast());
    let mut acc = offset_terms::<F, R, T>(w_heads, x, runs);
    // Per row and token, the segment scales of a chunk's groups.
    let mut scales = [[[0f32; 16]; T]; R];
    let mut q = 0;
    while q < groups {
        let chunk = CHUNK_GROUPS.min(groups - q);
        let chunk_runs = (runs - QUAD * q).min(QUAD * chunk);
        // SAFETY (all loads below): the lengths are asserted above, masked
        // lanes are not read, and blocks are 64-byte aligned.
        // No closures here: they would not inherit the target features, and
        // the intrinsics would not inline into them.
        let mut x_scales = [_mm512_setzero_ps(); T];
        for t in 0..T {
            let stats = x[t].stats.as_ptr().add(2 * QUAD * q);
            let stats = _mm512_maskz_loadu_ps(floats(2 * chunk_runs), stats);
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
            if group_runs(runs, first) == PAIR {
                pair_tile::<F, R, T>(&mut acc, repacked, w, w_codes, x, runs, first, &scales, j);
                continue;
            }
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
                    group_codes::<F>(w[r], runs, first)
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

/// The offset terms of a tile, `offset * x_sum` per run (or half), in the
/// odd lanes of its accumulators: the odd lanes of `[scale, offset]` heads
/// times `[scale, sum]` stats; zeros for the formats without them. A pass
/// of their own, so that the products' loop keeps every accumulator in a
/// register.
///
/// # Safety
/// The heads and stats hold `runs` runs (their halves with `F::HALVES`);
/// the CPU supports AVX-512 F.
#[inline(always)]
unsafe fn offset_terms<F: BlockFormat, const R: usize, const T: usize>(
    w_heads: [&[f32]; R],
    x: [QuantRow<'_>; T],
    runs: usize,
) -> [[__m512; T]; R] {
    let mut acc = [[_mm512_setzero_ps(); T]; R];
    if offsets::<F>() {
        const ODD: __mmask16 = 0xaaaa;
        // Heads (and stats) of 8 runs, or of 4 runs' halves, per vector.
        let per_vector = if F::HALVES { 4 } else { 8 };
        let mut b = 0;
        while b < runs {
            let n = F::HEAD_FLOATS * (runs - b).min(per_vector);
            for t in 0..T {
                // SAFETY: `n` floats from `b`'s lie within the heads and
                // stats.
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
    acc
}

/// A tile's products with a row's closing pair, the `j`th group of the
/// chunk whose segment scales are `scales`.
///
/// # Safety
/// As [`block_tile_512`]'s, whose lengths it relies on.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn pair_tile<F: BlockFormat, const R: usize, const T: usize>(
    acc: &mut [[__m512; T]; R],
    repacked: bool,
    w: [&[u8]; R],
    w_codes: [&[BlockQuants]; R],
    x: [QuantRow<'_>; T],
    runs: usize,
    first: usize,
    scales: &[[[f32; 16]; T]; R],
    j: usize,
) {
    let mut x_pair = [[_mm512_setzero_si512(); PAIR]; T];
    for t in 0..T {
        let quants: *const __m512i = x[t].quants.as_ptr().add(first).cast();
        x_pair[t] = [
            _mm512_load_si512(quants.cast()),
            _mm512_load_si512(quants.add(1).cast()),
        ];
    }
    for r in 0..R {
        let codes = if repacked {
            let codes: *const __m512i = w_codes[r].as_ptr().add(first).cast();
            [
                _mm512_load_si512(codes.cast()),
                _mm512_load_si512(codes.add(1).cast()),
            ]
        } else {
            let [a, b, _, _] = group_codes::<F>(w[r], runs, first);
            [a, b]
        };
        for t in 0..T {
            let scales = scales[r][t].as_ptr().add(8 * j);
            acc[r][t] = pair_step(acc[r][t], codes, x_pair[t], scales);
        }
    }
}
