//! x86-64 micro-kernels: AVX2, and a variant with AVX-512 VNNI.
//!
//! The block kernels follow llama.cpp with 16-bit activations: a block's
//! 32 weight quants are widened to i16 (a 4-bit block's 16 bytes spread to
//! unsigned nibbles, low nibbles being elements 0..16; Q8_0's bytes
//! sign-extended), multiplied with the 32 i16 activation quants and summed
//! in groups of four into eight i32 lanes (two `vpmaddwd` and an add on
//! AVX2, two `vpdpwssd` with VNNI), converted to f32 and accumulated with
//! the product of the two block scales. Each `(row, token)` pair of a tile
//! keeps its own vector accumulator, summed horizontally once at the end.
//!
//! The kernels are `#[inline(always)]` generic code; `run_avx2` and
//! `run_vnni` instantiate them inside functions compiled with the target
//! features, so the intrinsics inline into straight vector code.

use std::arch::x86_64::*;

use tandem_core::quant::QK;

use super::quantize::QuantRow;
use super::{
    decode_block_heads_scalar, float_task, quant_task, w8a8_task, BlockFormat, FloatElem,
    FloatKind, Int4, Int8Rows, MicroKernels, Offset, Operands, Task, Q4_0, Q4_1, Q8_0,
};

pub(super) struct Avx2;
pub(super) struct Vnni;

/// # Safety
/// The CPU supports AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn run_avx2(operands: Operands<'_>, cols: usize, task: Task<'_>) {
    // 16 vector registers: 4×2 accumulators leave room for the operands.
    match operands {
        Operands::F32 { w, x } => float_task::<Avx2, _, 4, 3>(w, x, cols, task),
        Operands::F16 { w, x } => float_task::<Avx2, _, 4, 3>(w, x, cols, task),
        Operands::BF16 { w, x } => float_task::<Avx2, _, 4, 3>(w, x, cols, task),
        Operands::Q8_0 { w, x } => quant_task::<Avx2, Q8_0, 4, 2>(w, x, cols, task),
        Operands::Q4_0 { w, x } => quant_task::<Avx2, Q4_0, 4, 2>(w, x, cols, task),
        Operands::Q4_1 { w, x } => quant_task::<Avx2, Q4_1, 4, 2>(w, x, cols, task),
        Operands::Int8PerChannel { w, x } => quant_task::<Avx2, Int8Rows, 4, 2>(w, x, cols, task),
        Operands::Int4G64 { w, x } => quant_task::<Avx2, Int4<64>, 4, 2>(w, x, cols, task),
        Operands::Int4G128 { w, x } => quant_task::<Avx2, Int4<128>, 4, 2>(w, x, cols, task),
        Operands::W8A8 { w, x } => w8a8_task::<Avx2, 4, 2>(w, x, cols, task),
    }
}

/// # Safety
/// The CPU supports AVX2, FMA, F16C, AVX-512 VNNI and AVX-512VL.
#[target_feature(enable = "avx2,fma,f16c,avx512vnni,avx512vl")]
pub(super) unsafe fn run_vnni(operands: Operands<'_>, cols: usize, task: Task<'_>) {
    // AVX-512VL gives 32 vector registers: 4×4 accumulators fit.
    match operands {
        Operands::F32 { w, x } => float_task::<Vnni, _, 4, 4>(w, x, cols, task),
        Operands::F16 { w, x } => float_task::<Vnni, _, 4, 4>(w, x, cols, task),
        Operands::BF16 { w, x } => float_task::<Vnni, _, 4, 4>(w, x, cols, task),
        Operands::Q8_0 { w, x } => quant_task::<Vnni, Q8_0, 4, 4>(w, x, cols, task),
        Operands::Q4_0 { w, x } => quant_task::<Vnni, Q4_0, 4, 4>(w, x, cols, task),
        Operands::Q4_1 { w, x } => quant_task::<Vnni, Q4_1, 4, 4>(w, x, cols, task),
        Operands::Int8PerChannel { w, x } => quant_task::<Vnni, Int8Rows, 4, 4>(w, x, cols, task),
        Operands::Int4G64 { w, x } => quant_task::<Vnni, Int4<64>, 4, 4>(w, x, cols, task),
        Operands::Int4G128 { w, x } => quant_task::<Vnni, Int4<128>, 4, 4>(w, x, cols, task),
        Operands::W8A8 { w, x } => w8a8_task::<Vnni, 4, 4>(w, x, cols, task),
    }
}

/// How a kernel multiplies two pairs of sixteen i16 lanes (a block's two
/// halves of weights and activations) and sums each group of four products
/// into one of eight i32 lanes. No sum can overflow: weights are at most
/// 128 and activations 32767 in magnitude, so a lane sums to at most
/// 4 * 128 * 32767 < 2^24.
trait WordDot {
    /// # Safety
    /// The CPU supports the implementor's instruction set.
    unsafe fn dot(low: [__m256i; 2], high: [__m256i; 2]) -> __m256i;
}

impl WordDot for Avx2 {
    #[inline(always)]
    unsafe fn dot([w_low, x_low]: [__m256i; 2], [w_high, x_high]: [__m256i; 2]) -> __m256i {
        _mm256_add_epi32(
            _mm256_madd_epi16(w_low, x_low),
            _mm256_madd_epi16(w_high, x_high),
        )
    }
}

impl WordDot for Vnni {
    #[inline(always)]
    unsafe fn dot([w_low, x_low]: [__m256i; 2], [w_high, x_high]: [__m256i; 2]) -> __m256i {
        let low = _mm256_dpwssd_epi32(_mm256_setzero_si256(), w_low, x_low);
        _mm256_dpwssd_epi32(low, w_high, x_high)
    }
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

macro_rules! delegate_micro_kernels {
    ($isa:ty) => {
        impl MicroKernels for $isa {
            #[inline(always)]
            unsafe fn f16_to_f32(bits: u16) -> f32 {
                _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32)))
            }

            #[inline(always)]
            unsafe fn decode_block_heads<F: BlockFormat>(row: &[u8], heads: &mut [f32]) {
                decode_block_heads::<F>(row, heads)
            }

            #[inline(always)]
            unsafe fn block_tile<F: BlockFormat, const R: usize, const T: usize>(
                w: [&[u8]; R],
                w_heads: [&[f32]; R],
                x: [QuantRow<'_>; T],
            ) -> [[f32; T]; R] {
                block_tile::<$isa, F, R, T>(w, w_heads, x)
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

delegate_micro_kernels!(Avx2);
delegate_micro_kernels!(Vnni);

/// Decodes the block heads of a row: one 8-byte load and one F16C
/// conversion per block widen its first four halves, of which the first two
/// are `[d, m]` in Q4_1, and a 64-bit store keeps those two.
///
/// # Safety
/// The CPU supports AVX2 and F16C.
#[inline(always)]
unsafe fn decode_block_heads<F: BlockFormat>(row: &[u8], heads: &mut [f32]) {
    // Tandem's formats share one head among several runs: decoded per run.
    if F::ROW_HEAD != 0 || F::RUNS != 1 {
        return decode_block_heads_scalar::<Avx2, F>(row, heads);
    }
    // The 8-byte load must stay inside the block: every format's block is
    // longer than 8 bytes.
    const { assert!(Q4_0::BLOCK_BYTES >= 8 && Q4_1::BLOCK_BYTES >= 8 && Q8_0::BLOCK_BYTES >= 8) };
    let blocks = (heads.len() / 2).min(row.len() / F::BLOCK_BYTES);
    for b in 0..blocks {
        // SAFETY: bytes `b * BLOCK_BYTES..+8` and floats `2b..2b + 2` are in
        // bounds by the choice of `blocks`.
        let halves = _mm_cvtph_ps(_mm_loadl_epi64(row.as_ptr().add(b * F::BLOCK_BYTES).cast()));
        let head = match F::OFFSET {
            Offset::None | Offset::Stored => halves,
            // [d, -8d]
            Offset::MinusEightScales => _mm_mul_ps(
                _mm_shuffle_ps::<0b00_00_00_00>(halves, halves),
                _mm_setr_ps(1.0, -8.0, 0.0, 0.0),
            ),
        };
        _mm_storel_epi64(heads.as_mut_ptr().add(2 * b).cast(), _mm_castps_si128(head));
    }
}

/// Checks the lengths the unchecked loads of a block tile rely on, and
/// returns the number of blocks.
fn check_block_tile<const R: usize, const T: usize>(
    w: &[&[u8]; R],
    w_heads: &[&[f32]; R],
    x: &[QuantRow<'_>; T],
    row_bytes: fn(usize) -> usize,
) -> usize {
    let blocks = x[0].blocks();
    assert!(w.iter().all(|w| w.len() >= row_bytes(blocks)));
    assert!(w_heads.iter().all(|h| h.len() >= 2 * blocks));
    assert!(x
        .iter()
        .all(|x| x.quants.len() >= blocks && x.stats.len() >= 2 * blocks));
    blocks
}

/// # Safety
/// The CPU supports AVX2, FMA and `D`'s instruction set.
#[inline(always)]
unsafe fn block_tile<D: WordDot, F: BlockFormat, const R: usize, const T: usize>(
    w: [&[u8]; R],
    w_heads: [&[f32]; R],
    x: [QuantRow<'_>; T],
) -> [[f32; T]; R] {
    let blocks = check_block_tile(&w, &w_heads, &x, F::row_bytes);
    let mut acc = [[_mm256_setzero_ps(); T]; R];
    for b in 0..blocks {
        // SAFETY (all loads below): `check_block_tile` checked that every
        // row and activation holds `blocks` blocks; activation blocks are
        // 64-byte aligned.
        let x_scales: [__m256; T] =
            std::array::from_fn(|t| _mm256_broadcast_ss(x[t].stats.get_unchecked(2 * b)));
        for r in 0..R {
            let [w_low, w_high] = widen_run::<F>(w[r].as_ptr().add(F::run_quants_at(b)));
            let w_scale = _mm256_broadcast_ss(w_heads[r].get_unchecked(2 * b));
            for t in 0..T {
                let quants: *const __m256i = x[t].quants.as_ptr().add(b).cast();
                let products = D::dot(
                    [w_low, _mm256_load_si256(quants)],
                    [w_high, _mm256_load_si256(quants.add(1))],
                );
                let scale = _mm256_mul_ps(w_scale, x_scales[t]);
                acc[r][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(products), scale, acc[r][t]);
            }
        }
    }
    if F::OFFSET != Offset::None {
        for r in 0..R {
            for t in 0..T {
                let offsets = offset_terms(w_heads[r], x[t].stats, blocks);
                acc[r][t] = _mm256_add_ps(acc[r][t], offsets);
            }
        }
    }
    horizontal_sums(acc)
}

/// The 32 quants of the run at `quants` widened to i16, as elements
/// `0..16` and `16..32`: the 8-bit formats' signed bytes sign-extended, the
/// 4-bit formats' nibbles (low nibbles are elements `0..16`) zero-extended.
///
/// # Safety
/// A whole run of format `F` is readable at `quants`; the CPU supports AVX2.
#[inline(always)]
unsafe fn widen_run<F: BlockFormat>(quants: *const u8) -> [__m256i; 2] {
    match F::OFFSET {
        Offset::None => [
            _mm256_cvtepi8_epi16(_mm_loadu_si128(quants.cast())),
            _mm256_cvtepi8_epi16(_mm_loadu_si128(quants.add(16).cast())),
        ],
        Offset::MinusEightScales | Offset::Stored => {
            let packed = _mm_loadu_si128(quants.cast());
            let low_nibbles = _mm_set1_epi8(0x0f);
            [
                _mm256_cvtepu8_epi16(_mm_and_si128(packed, low_nibbles)),
                _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(packed, 4), low_nibbles)),
            ]
        }
    }
}

/// The offsets' share of a 4-bit dot product, `sum_b offset[b] * x_sum[b]`,
/// spread over the lanes of a vector. Weight heads `[scale, offset]` and
/// activation stats `[scale, sum]` interleave alike, so it is their
/// elementwise product with the even (scale) lanes dropped.
///
/// # Safety
/// The CPU supports AVX2 and FMA; both slices hold `2 * blocks` values.
#[inline(always)]
unsafe fn offset_terms(w_heads: &[f32], x_stats: &[f32], blocks: usize) -> __m256 {
    let len = 2 * blocks;
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
