//! The steps of a tile that each instruction set does its own way, with
//! the same results: transposing a key tile, widening F16 rows, and the
//! multiply-add of one key element against sixteen queries.
//!
//! A tile of sixteen key rows is turned into `head_dim` vectors of the
//! sixteen keys, for the tiles of few queries that score keys in the lanes.
//! The transpose is rebuilt for every sixteen keys, so at a long context it
//! is a fifth of the attention time of a small KV group done element by
//! element; AVX-512 does it in registers instead, sixteen dimensions at a
//! time, and AVX2 eight. An F16 cache's rows are widened once per key
//! tile: in integer steps that vectorize anywhere, or by the hardware's
//! conversion, a quarter of the attention time less at a depth of 2048.

use half::f16;

use super::tile::{Lanes, LANES};
use crate::math::{f16_to_f32, MulAdd};

/// How a tile's instruction-set-specific steps are done. Every
/// implementation gives the same values: only where they come from differs.
pub(super) trait TileOps {
    /// Vectors of sixteen f32 that a loop of multiply-adds keeps as
    /// accumulators: about half the register file, the rest left to its
    /// operands (AVX2's 16 registers of 8 lanes had held 16 accumulators,
    /// and spilled one of every two).
    const ACCUMULATORS: usize;

    /// `keys` (`[LANES][hd]`) as `by_dim[d][l] = keys[l * hd + d]`, `d < hd`.
    fn transpose(keys: &[f32], hd: usize, by_dim: &mut [Lanes]);

    /// `row[i] = f32(halves[i])`, exactly.
    #[inline(always)]
    fn widen(halves: &[f16], row: &mut [f32]) {
        widen_from(halves, row, 0);
    }

    /// `key * q + sum`, lane by lane, rounded as `M` rounds (the x86 ops
    /// run only with [`crate::math::Fused`], and fuse). The score loop's
    /// step as whole vectors: left to the compiler, its keys' elements,
    /// read from one slice, were vectorized across keys into gathers and
    /// scatters, eight times slower.
    #[inline(always)]
    fn mul_add_key<M: MulAdd>(key: f32, q: &Lanes, sum: &Lanes) -> Lanes {
        mul_add_lanes::<M>(key, q, sum)
    }
}

/// `key * q + sum`, lane by lane, as a loop the compiler vectorizes.
#[inline(always)]
pub(super) fn mul_add_lanes<M: MulAdd>(key: f32, q: &Lanes, sum: &Lanes) -> Lanes {
    // A loop, not `array::from_fn`: its closure was left a call, compiled
    // without the caller's vector instructions.
    let mut out = [0f32; LANES];
    for lane in 0..LANES {
        out[lane] = M::mul_add(key, q[lane], sum[lane]);
    }
    out
}

/// Loops the compiler vectorizes: the portable task's steps.
pub(super) struct PortableOps;

impl TileOps for PortableOps {
    // SSE2's and wasm SIMD128's 16 registers of 4 lanes.
    const ACCUMULATORS: usize = 2;

    #[inline(always)]
    fn transpose(keys: &[f32], hd: usize, by_dim: &mut [Lanes]) {
        transpose_dims(keys, hd, 0, by_dim);
    }
}

/// The AVX2 task's steps: blocks of 8 × 8 values transposed in registers
/// (24 shuffles and 8 stores where the loop takes 64 scalar moves), each
/// block filling half of eight key vectors, and F16C's conversion, eight
/// values at a time. Instantiated only inside functions compiled with AVX2
/// and F16C (`attend_task_avx2`).
#[cfg(target_arch = "x86_64")]
pub(super) struct Avx2Ops;

#[cfg(target_arch = "x86_64")]
impl TileOps for Avx2Ops {
    const ACCUMULATORS: usize = 4;

    #[inline(always)]
    fn mul_add_key<M: MulAdd>(key: f32, q: &Lanes, sum: &Lanes) -> Lanes {
        use std::arch::x86_64::*;
        const HALF: usize = LANES / 2;
        let mut out = [0f32; LANES];
        // SAFETY: AVX2 and FMA are present (see the type); each half is
        // eight floats of a sixteen-float array.
        unsafe {
            let key = _mm256_set1_ps(key);
            for h in 0..2 {
                let (q, sum) = (q.as_ptr().add(h * HALF), sum.as_ptr().add(h * HALF));
                let r = _mm256_fmadd_ps(key, _mm256_loadu_ps(q), _mm256_loadu_ps(sum));
                _mm256_storeu_ps(out.as_mut_ptr().add(h * HALF), r);
            }
        }
        out
    }

    #[inline(always)]
    fn transpose(keys: &[f32], hd: usize, by_dim: &mut [Lanes]) {
        use std::arch::x86_64::*;
        const HALF: usize = LANES / 2;
        let keys = &keys[..LANES * hd];
        let by_dim = &mut by_dim[..hd];
        let blocks = hd / HALF;
        for b in 0..blocks {
            for half in 0..2 {
                // Plain loops, not closures: a closure would not inherit the
                // caller's target features, and its intrinsics would be calls.
                // SAFETY: AVX2 is present (see the type).
                let mut rows = [unsafe { _mm256_setzero_ps() }; HALF];
                for (r, row) in rows.iter_mut().enumerate() {
                    let at = (half * HALF + r) * hd + b * HALF;
                    // SAFETY: as above; the eight values at `at` lie in
                    // `keys` (`b * 8 + 8 <= hd`, so `at + 8 <= 16 * hd`),
                    // unchecked: the checks were a third of the transpose.
                    *row = unsafe { _mm256_loadu_ps(keys.as_ptr().add(at)) };
                }
                // SAFETY: AVX2 is present (see the type).
                let columns = unsafe { transpose_8x8(rows) };
                for (c, column) in columns.into_iter().enumerate() {
                    // SAFETY: as above; `b * 8 + c < hd` and the store fills
                    // eight of the sixteen lanes of that dimension.
                    unsafe {
                        let lanes = by_dim.as_mut_ptr().add(b * HALF + c).cast::<f32>();
                        _mm256_storeu_ps(lanes.add(half * HALF), column)
                    };
                }
            }
        }
        transpose_dims(keys, hd, blocks * HALF, by_dim);
    }

    #[inline(always)]
    fn widen(halves: &[f16], row: &mut [f32]) {
        use std::arch::x86_64::*;
        const STEP: usize = 8;
        const UNROLL: usize = 4;
        let n = row.len().min(halves.len());
        let (from, to) = (halves.as_ptr().cast::<__m128i>(), row.as_mut_ptr());
        let mut i = 0;
        // Four conversions a round: one a round spent as many instructions
        // on the loop as on the work.
        while i + UNROLL * STEP <= n {
            for u in 0..UNROLL {
                // SAFETY: F16C is present (see the type); the eight halves
                // and floats at `i + 8u` lie in `halves` and `row`.
                unsafe {
                    let h = _mm_loadu_si128(from.add(i / STEP + u));
                    _mm256_storeu_ps(to.add(i + u * STEP), _mm256_cvtph_ps(h));
                }
            }
            i += UNROLL * STEP;
        }
        while i + STEP <= n {
            // SAFETY: as above, `i + 8 <= n`.
            unsafe {
                let h = _mm_loadu_si128(from.add(i / STEP));
                _mm256_storeu_ps(to.add(i), _mm256_cvtph_ps(h));
            }
            i += STEP;
        }
        widen_from(halves, row, i);
    }
}

/// Elements `from..` of [`TileOps::widen`], a value at a time.
#[inline(always)]
fn widen_from(halves: &[f16], row: &mut [f32], from: usize) {
    for (o, h) in row.iter_mut().zip(halves).skip(from) {
        *o = f16_to_f32(h.to_bits());
    }
}

/// Dimensions `from..hd` of [`TileOps::transpose`], a value at a time.
#[inline(always)]
fn transpose_dims(keys: &[f32], hd: usize, from: usize, by_dim: &mut [Lanes]) {
    let keys = &keys[..LANES * hd];
    for (d, lanes) in by_dim[..hd].iter_mut().enumerate().skip(from) {
        for (l, k) in lanes.iter_mut().enumerate() {
            *k = keys[l * hd + d];
        }
    }
}

/// `columns[c][l] = rows[l][c]`: 32-bit values of row pairs interleaved,
/// then 64-bit pairs of those, so that `pairs[g][j]` holds column `j` of
/// rows `4g..4g + 4` in its low 128 bits and column `j + 4` in its high
/// 128 bits; swapping halves between the two groups gathers each column.
///
/// # Safety
/// The CPU supports AVX.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn transpose_8x8(rows: [std::arch::x86_64::__m256; 8]) -> [std::arch::x86_64::__m256; 8] {
    use std::arch::x86_64::*;
    // Per group of four rows `4g..4g + 4`: columns 0/4, 1/5, 2/6, 3/7.
    let mut pairs = [[_mm256_setzero_ps(); 4]; 2];
    for (g, pairs) in pairs.iter_mut().enumerate() {
        let r = &rows[4 * g..4 * g + 4];
        let t0 = _mm256_unpacklo_ps(r[0], r[1]);
        let t1 = _mm256_unpackhi_ps(r[0], r[1]);
        let t2 = _mm256_unpacklo_ps(r[2], r[3]);
        let t3 = _mm256_unpackhi_ps(r[2], r[3]);
        *pairs = [
            _mm256_shuffle_ps::<0x44>(t0, t2),
            _mm256_shuffle_ps::<0xee>(t0, t2),
            _mm256_shuffle_ps::<0x44>(t1, t3),
            _mm256_shuffle_ps::<0xee>(t1, t3),
        ];
    }
    let [low, high] = pairs;
    let mut columns = rows;
    for j in 0..4 {
        columns[j] = _mm256_permute2f128_ps::<0x20>(low[j], high[j]);
        columns[j + 4] = _mm256_permute2f128_ps::<0x31>(low[j], high[j]);
    }
    columns
}

/// The AVX-512 task's steps: blocks of 16 × 16 values transposed in
/// registers (64 shuffles and 16 stores where the loop takes 16 scatters),
/// and halves widened sixteen at a time. Instantiated only inside
/// functions compiled with AVX-512 F (`attend_task_avx512`).
#[cfg(target_arch = "x86_64")]
pub(super) struct Avx512Ops;

#[cfg(target_arch = "x86_64")]
impl TileOps for Avx512Ops {
    // 32 registers of 16 lanes.
    const ACCUMULATORS: usize = 8;

    #[inline(always)]
    fn mul_add_key<M: MulAdd>(key: f32, q: &Lanes, sum: &Lanes) -> Lanes {
        use std::arch::x86_64::*;
        let mut out = [0f32; LANES];
        // SAFETY: AVX-512 F is present (see the type); each array is
        // sixteen floats.
        unsafe {
            let r = _mm512_fmadd_ps(
                _mm512_set1_ps(key),
                _mm512_loadu_ps(q.as_ptr()),
                _mm512_loadu_ps(sum.as_ptr()),
            );
            _mm512_storeu_ps(out.as_mut_ptr(), r);
        }
        out
    }

    #[inline(always)]
    fn widen(halves: &[f16], row: &mut [f32]) {
        use std::arch::x86_64::*;
        let n = row.len().min(halves.len());
        let mut i = 0;
        while i + LANES <= n {
            // SAFETY: AVX-512 F is present (see the type); the sixteen
            // halves and floats at `i` lie in `halves` and `row`.
            unsafe {
                let h = _mm256_loadu_si256(halves[i..i + LANES].as_ptr().cast());
                _mm512_storeu_ps(row[i..i + LANES].as_mut_ptr(), _mm512_cvtph_ps(h));
            }
            i += LANES;
        }
        widen_from(halves, row, i);
    }

    #[inline(always)]
    fn transpose(keys: &[f32], hd: usize, by_dim: &mut [Lanes]) {
        use std::arch::x86_64::*;
        let keys = &keys[..LANES * hd];
        let by_dim = &mut by_dim[..hd];
        let blocks = hd / LANES;
        for b in 0..blocks {
            let mut rows = [unsafe { _mm512_setzero_ps() }; LANES];
            for (l, row) in rows.iter_mut().enumerate() {
                let at = l * hd + b * LANES;
                // SAFETY: AVX-512 F is present (see the type); the sixteen
                // values at `at` lie in `keys` (`at + 16 <= 16 * hd`).
                *row = unsafe { _mm512_loadu_ps(keys[at..at + LANES].as_ptr()) };
            }
            // SAFETY: AVX-512 F is present (see the type).
            let columns = unsafe { transpose_16x16(rows) };
            for (c, column) in columns.into_iter().enumerate() {
                // SAFETY: as above; the store fills one `Lanes` of `by_dim`.
                unsafe { _mm512_storeu_ps(by_dim[b * LANES + c].as_mut_ptr(), column) };
            }
        }
        transpose_dims(keys, hd, blocks * LANES, by_dim);
    }
}

/// `columns[c][l] = rows[l][c]`. Interleaves 32-bit values of row pairs,
/// then 64-bit pairs of those, so that 128-bit lane `k` of `u[4i + j]`
/// holds column `4k + j` of rows `4i..4i + 4`; two rounds of 128-bit lane
/// shuffles then gather each column's four lanes.
///
/// # Safety
/// The CPU supports AVX-512 F.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn transpose_16x16(
    rows: [std::arch::x86_64::__m512; LANES],
) -> [std::arch::x86_64::__m512; LANES] {
    use std::arch::x86_64::*;
    let mut t = rows;
    for i in 0..LANES / 2 {
        t[2 * i] = _mm512_unpacklo_ps(rows[2 * i], rows[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(rows[2 * i], rows[2 * i + 1]);
    }
    let mut u = t;
    for i in 0..LANES / 4 {
        let a = _mm512_castps_pd(t[4 * i]);
        let b = _mm512_castps_pd(t[4 * i + 1]);
        let c = _mm512_castps_pd(t[4 * i + 2]);
        let d = _mm512_castps_pd(t[4 * i + 3]);
        u[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
        u[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
        u[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
        u[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
    }
    let mut columns = u;
    for j in 0..4 {
        let x = [u[j], u[4 + j], u[8 + j], u[12 + j]];
        // Lanes [x0 0, x0 1, x1 0, x1 1] and [x0 2, x0 3, x1 2, x1 3], and of x2, x3.
        let p0 = _mm512_shuffle_f32x4::<0x44>(x[0], x[1]);
        let p1 = _mm512_shuffle_f32x4::<0xee>(x[0], x[1]);
        let p2 = _mm512_shuffle_f32x4::<0x44>(x[2], x[3]);
        let p3 = _mm512_shuffle_f32x4::<0xee>(x[2], x[3]);
        // Lane k of x0..x3 in order: column 4k + j.
        columns[j] = _mm512_shuffle_f32x4::<0x88>(p0, p2);
        columns[4 + j] = _mm512_shuffle_f32x4::<0xdd>(p0, p2);
        columns[8 + j] = _mm512_shuffle_f32x4::<0x88>(p1, p3);
        columns[12 + j] = _mm512_shuffle_f32x4::<0xdd>(p1, p3);
    }
    columns
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every head size the models use and awkward ones (not a multiple of
    /// sixteen), against the definition.
    #[test]
    fn every_transpose_is_the_definition() {
        for hd in [1, 16, 40, 64, 72, 80, 128, 200, 256] {
            let keys: Vec<f32> = (0..LANES * hd).map(|i| i as f32 * 0.5 - 3.0).collect();
            let expected: Vec<Lanes> = (0..hd)
                .map(|d| std::array::from_fn(|l| keys[l * hd + d]))
                .collect();
            let mut got = vec![[f32::NAN; LANES]; hd + 1];
            PortableOps::transpose(&keys, hd, &mut got);
            assert_eq!(got[..hd], expected[..], "loop, head_dim {hd}");
            assert!(got[hd][0].is_nan(), "loop wrote past head_dim {hd}");
            #[cfg(target_arch = "x86_64")]
            if is_x86_feature_detected!("avx2") {
                let mut got = vec![[f32::NAN; LANES]; hd + 1];
                Avx2Ops::transpose(&keys, hd, &mut got);
                assert_eq!(got[..hd], expected[..], "AVX2, head_dim {hd}");
                assert!(got[hd][0].is_nan(), "AVX2 wrote past head_dim {hd}");
            }
            #[cfg(target_arch = "x86_64")]
            if is_x86_feature_detected!("avx512f") {
                let mut got = vec![[f32::NAN; LANES]; hd + 1];
                Avx512Ops::transpose(&keys, hd, &mut got);
                assert_eq!(got[..hd], expected[..], "AVX-512, head_dim {hd}");
                assert!(got[hd][0].is_nan(), "AVX-512 wrote past head_dim {hd}");
            }
        }
    }

    /// Every half, with a tail that is not a multiple of sixteen, against
    /// `half`'s conversion (NaNs stay NaNs).
    #[test]
    fn every_widening_is_exact() {
        let halves: Vec<f16> = (0..=u16::MAX)
            .map(f16::from_bits)
            .chain([f16::ONE; 5])
            .collect();
        let check = |name: &str, widen: fn(&[f16], &mut [f32])| {
            let mut row = vec![f32::NAN; halves.len()];
            widen(&halves, &mut row);
            for (h, got) in halves.iter().zip(&row) {
                let want = h.to_f32();
                assert!(
                    got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()),
                    "{name}: {h:?} -> {got}"
                );
            }
        };
        check("portable", PortableOps::widen);
        #[cfg(target_arch = "x86_64")]
        if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("f16c") {
            check("AVX2", Avx2Ops::widen);
        }
        #[cfg(target_arch = "x86_64")]
        if is_x86_feature_detected!("avx512f") {
            check("AVX-512", Avx512Ops::widen);
        }
    }
}
