//! x86-64 micro-kernels: AVX2, and a variant with AVX-512 (F, BW, VL,
//! VNNI, VBMI and BITALG).
//!
//! The block kernels follow llama.cpp with 16-bit activations: a run's 32
//! weight codes are widened to i16 (a 4-bit block's 16 bytes spread to
//! unsigned nibbles, low nibbles being elements 0..16; Q8_0's bytes
//! sign-extended), multiplied with the 32 i16 activation quants and summed
//! in pairs (`vpmaddwd`) into i32 lanes, converted to f32 and accumulated
//! with the product of the two block scales. Each `(row, token)` pair of a
//! tile keeps its own vector accumulator, summed horizontally once at the
//! end.
//!
//! - AVX2 works on 256-bit vectors: the codes are two vectors of sixteen
//!   i16, multiplied with the activation block's two halves by two
//!   `vpmaddwd` and added into eight i32 lanes. With two tokens or more a
//!   row tile's codes are widened once into scratch for all of them.
//! - AVX-512 has its own block kernel (`avx512`): runs taken four at a
//!   time (a row's last one or two in a pair) in a layout that sums eight
//!   products per i32 lane, one conversion and one multiply-add per 128
//!   elements; the nibble formats (Q4_0, Q4_1, Q5_0, Q5_1) and Q8_0 keep
//!   their codes bytes against byte planes of the activations
//!   (`vpdpbusd`, `avx512/planes`). The AVX2 kernel's
//!   lanes are folded to eight before the offset term. AVX-512 VNNI itself
//!   serves W8A8 (`vpdpbusd`, on 256-bit vectors).
//!
//! Both decode the block heads with vectors (`x86_heads`: all of a
//! k-quant super-block's sub-block scales in one conversion), and prefetch
//! the weight bytes `PREFETCH_AHEAD` past the blocks whose heads they
//! decode; the AVX-512 byte-plane kernel decodes its heads with its codes,
//! after a pass that loads its rows in order (`tiles::touch_row`).
//!
//! The kernels are `#[inline(always)]` generic code; `run_avx2` and
//! `run_vnni` instantiate them inside functions compiled with the target
//! features, so the intrinsics inline into straight vector code.

use std::arch::x86_64::*;

use tandem_core::quant::{IQ4NL_VALUES, QK};

use super::avx512::{
    block_tile_512, code_blocks, repack_codes, repack_plane_codes, stored_runs, takes_plane_kernel,
};
use super::formats::{BlockFormat, Codes};
use super::quantize::{BlockQuants, QuantRow};
use super::tiles::{run_tiles, FloatElem, FloatKind, MicroKernels};
use super::x86_heads::decode_block_heads;
use super::{Operands, Task};

pub(super) struct Avx2;
pub(super) struct Vnni;

/// # Safety
/// The CPU supports AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn run_avx2(operands: Operands<'_>, cols: usize, task: Task<'_>) {
    // 16 vector registers. Block formats in tiles of 4 rows × 1 token:
    // with 2 tokens the 8 accumulators and the operands spilled one
    // accumulator to the stack, and every run waited on its store and
    // reload (a prompt's matmuls took up to 1.6x as long). W8A8's tiles have
    // no per-run conversion and keep 4 × 2.
    run_tiles::<Avx2, 4, 3, 4, 1, 4, 2>(operands, cols, task)
}

/// # Safety
/// The CPU supports AVX2, FMA, F16C and AVX-512 F, BW, VL, VNNI, VBMI and
/// BITALG.
#[target_feature(
    enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi,avx512bitalg"
)]
pub(super) unsafe fn run_vnni(operands: Operands<'_>, cols: usize, task: Task<'_>) {
    // AVX-512 gives 32 vector registers: 4×4 accumulators fit, but a block
    // tile also holds four vectors of activations per token and four of
    // codes, so its tiles are 4 × 3.
    run_tiles::<Vnni, 4, 4, 4, 3, 4, 4>(operands, cols, task)
}

/// How a kernel multiplies 32 signed bytes of weights with 32 signed bytes
/// of activations and adds each group of four products to one of eight i32
/// lanes of `acc`. Both instructions multiply unsigned by signed bytes, so
/// the weights' signs move onto the activations (`|w| * (x * sign(w))`, the
/// same products). No sum overflows: quants lie in `-127..=127`, so AVX2's
/// pairwise i16 sums stay within 2 * 127 * 127 < 2^15.
trait ByteDot {
    /// # Safety
    /// The CPU supports the implementor's instruction set.
    unsafe fn dot_bytes(acc: __m256i, w: __m256i, x: __m256i) -> __m256i;
}

impl ByteDot for Avx2 {
    #[inline(always)]
    unsafe fn dot_bytes(acc: __m256i, w: __m256i, x: __m256i) -> __m256i {
        let pairs = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
        _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)))
    }
}

impl ByteDot for Vnni {
    #[inline(always)]
    unsafe fn dot_bytes(acc: __m256i, w: __m256i, x: __m256i) -> __m256i {
        _mm256_dpbusd_epi32(acc, _mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w))
    }
}

/// The [`MicroKernels`] of `$isa`, with `$block_tile` as its block kernel
/// and `$repack` the items that repack the weight codes for it, if it
/// reads them repacked.
macro_rules! delegate_micro_kernels {
    ($isa:ty, $block_tile:ident $(, $repack:item)*) => {
        impl MicroKernels for $isa {
            $($repack)*

            #[inline(always)]
            unsafe fn f16_to_f32(bits: u16) -> f32 {
                _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32)))
            }

            #[inline(always)]
            unsafe fn prefetch(at: *const u8) {
                _mm_prefetch::<_MM_HINT_T0>(at.cast())
            }

            #[inline(always)]
            unsafe fn decode_block_heads<F: BlockFormat>(row: &[u8], heads: &mut [f32]) {
                decode_block_heads::<F>(row, heads)
            }

            #[inline(always)]
            unsafe fn block_tile<F: BlockFormat, const R: usize, const T: usize>(
                w: [&[u8]; R],
                w_codes: [&[BlockQuants]; R],
                w_heads: [&[f32]; R],
                x: [QuantRow<'_>; T],
            ) -> [[f32; T]; R] {
                $block_tile::<F, R, T>(w, w_codes, w_heads, x)
            }

            #[inline(always)]
            unsafe fn float_tile<E: FloatElem, const R: usize, const T: usize>(
                w: [&[E]; R],
                x: [&[f32]; T],
            ) -> [[f32; T]; R] {
                float_tile::<E, R, T>(w, x)
            }

            #[inline(always)]
            unsafe fn i8_tile<const R: usize, const T: usize>(
                w: [&[i8]; R],
                x: [&[i8]; T],
            ) -> [[i32; T]; R] {
                i8_tile::<$isa, R, T>(w, x)
            }
        }
    };
}

delegate_micro_kernels!(
    Avx2,
    block_tile,
    const REPACKS_CODES: bool = true;,
    #[inline(always)]
    unsafe fn repack_codes<F: BlockFormat>(row: &[u8], runs: usize, codes: &mut [BlockQuants]) {
        widen_codes::<F>(row, runs, codes)
    }
);
delegate_micro_kernels!(
    Vnni,
    block_tile_512,
    const REPACKS_CODES: bool = true;,
    #[inline(always)]
    fn heads_in_kernel<F: BlockFormat>() -> bool {
        takes_plane_kernel::<F>()
    },
    #[inline(always)]
    fn repacked_blocks<F: BlockFormat>(runs: usize) -> usize {
        if takes_plane_kernel::<F>() {
            code_blocks::<F>(runs)
        } else {
            stored_runs(runs)
        }
    },
    #[inline(always)]
    unsafe fn repack_codes<F: BlockFormat>(row: &[u8], runs: usize, codes: &mut [BlockQuants]) {
        if takes_plane_kernel::<F>() {
            repack_plane_codes::<F>(row, runs, codes)
        } else {
            repack_codes::<F>(row, runs, codes)
        }
    }
);

/// Checks the lengths the unchecked loads of a block tile rely on, and
/// returns the number of runs.
fn check_block_tile<F: BlockFormat, const R: usize, const T: usize>(
    w: &[&[u8]; R],
    w_heads: &[&[f32]; R],
    x: &[QuantRow<'_>; T],
) -> usize {
    let blocks = x[0].blocks();
    assert!(w.iter().all(|w| w.len() >= F::row_bytes(blocks)));
    assert!(w_heads.iter().all(|h| h.len() >= F::HEAD_FLOATS * blocks));
    assert!(x
        .iter()
        .all(|x| x.quants.len() >= blocks && x.stats.len() >= 2 * blocks));
    if F::HALVES && F::OFFSET {
        assert!(x.iter().all(|x| x.half_stats.len() >= 4 * blocks));
    }
    blocks
}

/// The AVX2 block kernel. `vpmaddwd` sums each pair of products in i32: no
/// sum can overflow, weights being at most 128 and activations 32767 in
/// magnitude, so a lane of four products sums to at most
/// 4 * 128 * 32767 < 2^24. With several tokens the row tile's codes come
/// widened already ([`widen_codes`], once per row tile instead of once per
/// token tile: the widening of a 5-bit run costs more than its products).
///
/// # Safety
/// The CPU supports AVX2 and FMA; `w_codes`, where not empty, are `w`'s
/// codes as [`widen_codes`] wrote them.
#[inline(always)]
unsafe fn block_tile<F: BlockFormat, const R: usize, const T: usize>(
    w: [&[u8]; R],
    w_codes: [&[BlockQuants]; R],
    w_heads: [&[f32]; R],
    x: [QuantRow<'_>; T],
) -> [[f32; T]; R] {
    let blocks = check_block_tile::<F, R, T>(&w, &w_heads, &x);
    if w_codes.iter().all(|c| c.len() >= blocks) {
        block_tile_from::<F, R, T>(w_heads, x, blocks, |r, b| {
            // SAFETY: row `r` holds `blocks` widened runs, 64-byte aligned.
            let codes: *const __m256i = w_codes[r].as_ptr().add(b).cast();
            [_mm256_load_si256(codes), _mm256_load_si256(codes.add(1))]
        })
    } else {
        block_tile_from::<F, R, T>(w_heads, x, blocks, |r, b| {
            widen_run::<F>(w[r].as_ptr().add(F::block_at(b)), b % F::RUNS)
        })
    }
}

/// [`block_tile`] over `blocks` runs whose codes `run_codes(row, run)`
/// gives widened to i16.
///
/// # Safety
/// The CPU supports AVX2 and FMA; the slices hold `blocks` runs, as
/// [`check_block_tile`] checks.
#[inline(always)]
unsafe fn block_tile_from<F: BlockFormat, const R: usize, const T: usize>(
    w_heads: [&[f32]; R],
    x: [QuantRow<'_>; T],
    blocks: usize,
    run_codes: impl Fn(usize, usize) -> [__m256i; 2],
) -> [[f32; T]; R] {
    let mut acc = [[_mm256_setzero_ps(); T]; R];
    for b in 0..blocks {
        // SAFETY (all loads below): `check_block_tile` checked that every
        // row and activation holds `blocks` runs; activation blocks are
        // 64-byte aligned.
        let x_scales: [__m256; T] =
            std::array::from_fn(|t| _mm256_broadcast_ss(x[t].stats.get_unchecked(2 * b)));
        for r in 0..R {
            let [w_low, w_high] = run_codes(r, b);
            let heads = w_heads[r].as_ptr().add(F::HEAD_FLOATS * b);
            for t in 0..T {
                let quants: *const __m256i = x[t].quants.as_ptr().add(b).cast();
                let p_low = _mm256_madd_epi16(w_low, _mm256_load_si256(quants));
                let p_high = _mm256_madd_epi16(w_high, _mm256_load_si256(quants.add(1)));
                if F::HALVES {
                    let s_low = _mm256_mul_ps(_mm256_broadcast_ss(&*heads), x_scales[t]);
                    let s_high = _mm256_mul_ps(_mm256_broadcast_ss(&*heads.add(2)), x_scales[t]);
                    acc[r][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p_low), s_low, acc[r][t]);
                    acc[r][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p_high), s_high, acc[r][t]);
                } else {
                    let products = _mm256_add_epi32(p_low, p_high);
                    let scale = _mm256_mul_ps(_mm256_broadcast_ss(&*heads), x_scales[t]);
                    acc[r][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(products), scale, acc[r][t]);
                }
            }
        }
    }
    finish_block_tile::<F, R, T>(acc, w_heads, x, blocks)
}

/// Every run of `row` (`runs` runs of format `F`) widened to i16 as
/// [`widen_run`] gives it, one [`BlockQuants`] per run.
///
/// # Safety
/// `row` holds `runs` runs and `codes` at least `runs` entries; the CPU
/// supports AVX2.
#[inline(always)]
unsafe fn widen_codes<F: BlockFormat>(row: &[u8], runs: usize, codes: &mut [BlockQuants]) {
    assert!(row.len() >= F::row_bytes(runs) && codes.len() >= runs);
    for b in 0..runs {
        let [low, high] = widen_run::<F>(row.as_ptr().add(F::block_at(b)), b % F::RUNS);
        let at: *mut __m256i = codes.as_mut_ptr().add(b).cast();
        _mm256_store_si256(at, low);
        _mm256_store_si256(at.add(1), high);
    }
}

/// Adds the offset terms to a block tile's accumulators (with
/// `F::OFFSET`) and sums each horizontally.
///
/// # Safety
/// The CPU supports AVX2 and FMA; the slices hold `blocks` runs, as
/// [`check_block_tile`] checks.
#[inline(always)]
unsafe fn finish_block_tile<F: BlockFormat, const R: usize, const T: usize>(
    mut acc: [[__m256; T]; R],
    w_heads: [&[f32]; R],
    x: [QuantRow<'_>; T],
    blocks: usize,
) -> [[f32; T]; R] {
    if F::OFFSET {
        for r in 0..R {
            for t in 0..T {
                let x_stats = if F::HALVES {
                    x[t].half_stats
                } else {
                    x[t].stats
                };
                let offsets = offset_terms(w_heads[r], x_stats, F::HEAD_FLOATS * blocks);
                acc[r][t] = _mm256_add_ps(acc[r][t], offsets);
            }
        }
    }
    horizontal_sums(acc)
}

/// The 32 codes of run `j` of the block at `block` widened to i16, as
/// elements `0..16` and `16..32` ([`Codes`] says which are signed).
///
/// # Safety
/// A whole block of format `F` is readable at `block`; the CPU supports AVX2.
#[inline(always)]
unsafe fn widen_run<F: BlockFormat>(block: *const u8, j: usize) -> [__m256i; 2] {
    let (h, s) = (j / 4, j % 4);
    let bytes = |at: usize| _mm256_loadu_si256(block.add(at).cast());
    // Bytes shifted right by `n` bits (the bits moving in from the next byte
    // are masked off by every caller).
    let shift = |v: __m256i, n: usize| _mm256_srl_epi16(v, _mm_cvtsi32_si128(n as i32));
    let mask = |v: __m256i, m: i8| _mm256_and_si256(v, _mm256_set1_epi8(m));
    // `value` in the bytes whose bit `bit` is set, 0 elsewhere.
    let bit_as = |v: __m256i, bit: usize, value: i8| {
        let b = _mm256_set1_epi8((1u8 << bit) as i8);
        mask(_mm256_cmpeq_epi8(_mm256_and_si256(v, b), b), value)
    };
    match F::CODES {
        Codes::Bytes => {
            let q = block.add(F::QUANTS_AT + QK * j);
            [
                _mm256_cvtepi8_epi16(_mm_loadu_si128(q.cast())),
                _mm256_cvtepi8_epi16(_mm_loadu_si128(q.add(16).cast())),
            ]
        }
        Codes::Nibbles => nibbles(block.add(F::QUANTS_AT + QK / 2 * j)),
        Codes::Nibbles5 => {
            // In bytes before widening: byte `i` of the fifth bits takes
            // byte `i / 8` of `qh` and keeps bit `i % 8` of it.
            let packed = _mm_loadu_si128(block.add(F::QUANTS_AT).cast());
            let low_nibbles = _mm_set1_epi8(0x0f);
            let qh = block.add(F::QUANTS_AT - 4).cast::<i32>().read_unaligned();
            let spread = _mm256_shuffle_epi8(
                _mm256_set1_epi32(qh),
                _mm256_setr_epi64x(
                    0,
                    0x0101_0101_0101_0101,
                    0x0202_0202_0202_0202,
                    0x0303_0303_0303_0303,
                ),
            );
            let bits = _mm256_set1_epi64x(0x8040_2010_0804_0201u64 as i64);
            let fifth = mask(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bits), bits), 16);
            [
                _mm256_cvtepu8_epi16(_mm_or_si128(
                    _mm_and_si128(packed, low_nibbles),
                    _mm256_castsi256_si128(fifth),
                )),
                _mm256_cvtepu8_epi16(_mm_or_si128(
                    _mm_and_si128(_mm_srli_epi16(packed, 4), low_nibbles),
                    _mm256_extracti128_si256::<1>(fifth),
                )),
            ]
        }
        Codes::NonLinear => {
            let packed = _mm_loadu_si128(block.add(F::QUANTS_AT).cast());
            let table = _mm_loadu_si128(IQ4NL_VALUES.as_ptr().cast());
            let low_nibbles = _mm_set1_epi8(0x0f);
            let low = _mm_shuffle_epi8(table, _mm_and_si128(packed, low_nibbles));
            let high =
                _mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16(packed, 4), low_nibbles));
            [_mm256_cvtepi8_epi16(low), _mm256_cvtepi8_epi16(high)]
        }
        Codes::Q4K => widen_u8(mask(shift(bytes(16 + QK * (j / 2)), 4 * (j % 2)), 0x0f)),
        Codes::Q5K => {
            let low = mask(shift(bytes(48 + QK * (j / 2)), 4 * (j % 2)), 0x0f);
            widen_u8(_mm256_or_si256(low, bit_as(bytes(16), j, 16)))
        }
        Codes::Q6K => {
            let low = mask(shift(bytes(64 * h + QK * (s & 1)), 4 * (s / 2)), 0x0f);
            let high = mask(shift(bytes(128 + QK * h), 2 * s), 3);
            let q = _mm256_or_si256(low, _mm256_slli_epi16(high, 4));
            widen_i8(_mm256_sub_epi8(q, _mm256_set1_epi8(32)))
        }
        Codes::Q3K => {
            let low = mask(shift(bytes(32 + QK * h), 2 * s), 3);
            let q = _mm256_or_si256(low, bit_as(bytes(0), 4 * h + s, 4));
            widen_i8(_mm256_sub_epi8(q, _mm256_set1_epi8(4)))
        }
        Codes::Q2K => widen_u8(mask(shift(bytes(16 + QK * h), 2 * s), 3)),
    }
}

/// 16 bytes of nibbles at `packed` as unsigned i16: low nibbles, then high.
///
/// # Safety
/// 16 bytes are readable at `packed`; the CPU supports AVX2.
#[inline(always)]
unsafe fn nibbles(packed: *const u8) -> [__m256i; 2] {
    let packed = _mm_loadu_si128(packed.cast());
    let low_nibbles = _mm_set1_epi8(0x0f);
    [
        _mm256_cvtepu8_epi16(_mm_and_si128(packed, low_nibbles)),
        _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(packed, 4), low_nibbles)),
    ]
}

/// 32 unsigned bytes widened to i16, bytes `0..16` and `16..32`.
///
/// # Safety
/// The CPU supports AVX2.
#[inline(always)]
unsafe fn widen_u8(v: __m256i) -> [__m256i; 2] {
    [
        _mm256_cvtepu8_epi16(_mm256_castsi256_si128(v)),
        _mm256_cvtepu8_epi16(_mm256_extracti128_si256::<1>(v)),
    ]
}

/// 32 signed bytes widened to i16, bytes `0..16` and `16..32`.
///
/// # Safety
/// The CPU supports AVX2.
#[inline(always)]
unsafe fn widen_i8(v: __m256i) -> [__m256i; 2] {
    [
        _mm256_cvtepi8_epi16(_mm256_castsi256_si128(v)),
        _mm256_cvtepi8_epi16(_mm256_extracti128_si256::<1>(v)),
    ]
}

/// The offsets' share of a dot product, `sum_b offset[b] * x_sum[b]`,
/// spread over the lanes of a vector. Weight heads `[scale, offset]` and
/// activation stats `[scale, sum]` interleave alike (per run, or per half
/// with both halved), so it is their elementwise product with the even
/// (scale) lanes dropped.
///
/// # Safety
/// The CPU supports AVX2 and FMA; both slices hold `len` values.
#[inline(always)]
unsafe fn offset_terms(w_heads: &[f32], x_stats: &[f32], len: usize) -> __m256 {
    let mut acc = _mm256_setzero_ps();
    let mut c = 0;
    while c + 8 <= len {
        // SAFETY: `c + 8 <= len` and both slices hold `len` values.
        let products = _mm256_mul_ps(
            _mm256_loadu_ps(w_heads.as_ptr().add(c)),
            _mm256_loadu_ps(x_stats.as_ptr().add(c)),
        );
        acc = _mm256_add_ps(acc, products);
        c += 8;
    }
    if c < len {
        // SAFETY: masked-off lanes are not read, so only `c..len` is accessed.
        let mask = _mm256_cmpgt_epi32(
            _mm256_set1_epi32((len - c) as i32),
            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
        );
        let products = _mm256_mul_ps(
            _mm256_maskload_ps(w_heads.as_ptr().add(c), mask),
            _mm256_maskload_ps(x_stats.as_ptr().add(c), mask),
        );
        acc = _mm256_add_ps(acc, products);
    }
    _mm256_blend_ps::<0b1010_1010>(_mm256_setzero_ps(), acc)
}

/// # Safety
/// The CPU supports AVX2, FMA and F16C.
#[inline(always)]
unsafe fn float_tile<E: FloatElem, const R: usize, const T: usize>(
    w: [&[E]; R],
    x: [&[f32]; T],
) -> [[f32; T]; R] {
    const LANES: usize = 8;
    let cols = x[0].len();
    assert!(w.iter().all(|w| w.len() >= cols) && x.iter().all(|x| x.len() >= cols));
    let full = cols - cols % LANES;
    let mut acc = [[_mm256_setzero_ps(); T]; R];
    for c in (0..full).step_by(LANES) {
        for r in 0..R {
            // SAFETY: `c + LANES <= cols`, checked against every row above.
            let weights = load8(w[r].as_ptr().add(c));
            for t in 0..T {
                let xs = _mm256_loadu_ps(x[t].as_ptr().add(c));
                acc[r][t] = _mm256_fmadd_ps(weights, xs, acc[r][t]);
            }
        }
    }
    let mut sums = horizontal_sums(acc);
    for r in 0..R {
        for t in 0..T {
            sums[r][t] += (full..cols)
                .map(|c| w[r][c].to_f32() * x[t][c])
                .sum::<f32>();
        }
    }
    sums
}

/// # Safety
/// The CPU supports AVX2 and `D`'s instruction set.
#[inline(always)]
unsafe fn i8_tile<D: ByteDot, const R: usize, const T: usize>(
    w: [&[i8]; R],
    x: [&[i8]; T],
) -> [[i32; T]; R] {
    const LANES: usize = 32;
    let cols = x[0].len();
    assert!(cols.is_multiple_of(LANES));
    assert!(w.iter().all(|w| w.len() >= cols) && x.iter().all(|x| x.len() >= cols));
    let mut acc = [[_mm256_setzero_si256(); T]; R];
    for c in (0..cols).step_by(LANES) {
        // SAFETY: `c + LANES <= cols`, checked against every row above.
        let xs: [__m256i; T] =
            std::array::from_fn(|t| _mm256_loadu_si256(x[t].as_ptr().add(c).cast()));
        for r in 0..R {
            let ws = _mm256_loadu_si256(w[r].as_ptr().add(c).cast());
            for t in 0..T {
                acc[r][t] = D::dot_bytes(acc[r][t], ws, xs[t]);
            }
        }
    }
    let mut sums = [[0i32; T]; R];
    for r in 0..R {
        for t in 0..T {
            let v = acc[r][t];
            let s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
            let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b01_00_11_10>(s));
            let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b10_11_00_01>(s));
            sums[r][t] = _mm_cvtsi128_si32(s);
        }
    }
    sums
}

/// Eight consecutive weights widened to f32.
///
/// # Safety
/// Eight elements are readable at `p`; the CPU supports AVX2 and F16C.
#[inline(always)]
unsafe fn load8<E: FloatElem>(p: *const E) -> __m256 {
    match E::KIND {
        FloatKind::F32 => _mm256_loadu_ps(p.cast()),
        FloatKind::F16 => _mm256_cvtph_ps(_mm_loadu_si128(p.cast())),
        // bf16 is the upper half of an f32.
        FloatKind::BF16 => _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_cvtepu16_epi32(_mm_loadu_si128(p.cast())),
            16,
        )),
    }
}

/// # Safety
/// The CPU supports AVX.
#[inline(always)]
unsafe fn horizontal_sums<const R: usize, const T: usize>(acc: [[__m256; T]; R]) -> [[f32; T]; R] {
    let mut sums = [[0f32; T]; R];
    for r in 0..R {
        for t in 0..T {
            let v = acc[r][t];
            let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
            let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
            let s = _mm_add_ss(s, _mm_movehdup_ps(s));
            sums[r][t] = _mm_cvtss_f32(s);
        }
    }
    sums
}

const _: () = assert!(QK == 32, "the kernels load one 32-byte vector per block");
