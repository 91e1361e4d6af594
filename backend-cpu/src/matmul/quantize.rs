//! Activation rows quantized to 16-bit blocks, once per matmul, so that
//! every product with a quantized weight block is an integer dot product.
//!
//! A block holds 32 consecutive values of a row as `scale * quant` with
//! `quant` in `-32767..=32767` (symmetric). llama.cpp uses 8 bits here
//! (Q8_1); on SmolLM2-135M that moved logits by up to 1.1 against an f32
//! reference and changed greedy continuations, while 16 bits keeps the
//! error about 250 times smaller for one more multiply-add instruction per
//! block pair. Quants are kept apart from the per-block f32 statistics:
//! 64-byte aligned, so a block is one cache line and SIMD loads never
//! straddle two. The statistics interleave `[scale,
//! sum]` per block, the same shape as the `[scale, offset]` block heads the
//! kernels decode from weight rows, so the offset term of the 4-bit formats
//! is one elementwise product of two arrays. Formats with an offset per
//! 16-element half of a run (Q2_K) also take `[scale, sum]` per half.
//!
//! The AVX-512 kernel reads the quants of each group of four (or, at the
//! end of a row, two) blocks permuted into its group layout (`avx512`
//! defines it), a row being padded with a zero block where a group lacks
//! one; its byte-plane kernel (nibble formats, Q8_0) reads them as byte planes, per four
//! blocks (`avx512::to_planes`). The statistics stay per block in row
//! order.

use tandem_core::quant::{quantize_activation_row_i8, QK};

use crate::isa::{Isa, IsaKind};
use crate::workers::Workers;

/// 32 quantized activations, one cache line.
#[derive(Clone, Copy, Debug)]
#[repr(C, align(64))]
pub(super) struct BlockQuants(pub(super) [i16; QK]);

/// The largest quant magnitude.
const QUANT_MAX: f32 = 32767.0;

/// The form a kernel takes quantized activations in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum ActivationForm {
    /// 16-bit blocks (in the group layout for the AVX-512 kernel), with
    /// the statistics per half when `half_sums`.
    Blocks { half_sums: bool },
    /// The byte planes of the AVX-512 byte-plane kernel (nibble formats,
    /// Q8_0).
    #[cfg(target_arch = "x86_64")]
    Planes,
}

impl ActivationForm {
    /// Every form.
    pub(super) const COUNT: usize = 3;

    /// A distinct index per form, below [`ActivationForm::COUNT`].
    pub(super) fn index(self) -> usize {
        match self {
            ActivationForm::Blocks { half_sums } => half_sums as usize,
            #[cfg(target_arch = "x86_64")]
            ActivationForm::Planes => 2,
        }
    }
}

/// The activation matrix `[rows, blocks_per_row * 32]` in 16-bit blocks.
pub(super) struct QuantizedActivations {
    blocks_per_row: usize,
    /// Blocks per row of statistics: `blocks_per_row`, with the padding of
    /// the group layout or the planes.
    stride: usize,
    /// Entries of `quants` per row: `stride`, or the planes' blocks.
    quant_stride: usize,
    /// `[rows, quant_stride]`.
    quants: Vec<BlockQuants>,
    /// `[rows, stride, 2]`: `[scale, sum]` per block.
    stats: Vec<f32>,
    /// `[rows, stride, 4]`: `[scale, sum]` per 16-element half of a block,
    /// when asked for (empty otherwise).
    half_stats: Vec<f32>,
}

/// One quantized activation row.
#[derive(Clone, Copy)]
pub(super) struct QuantRow<'a> {
    /// The row's blocks (the padding blocks of the group layout excluded).
    blocks: usize,
    /// One entry per block, in the group layout for the AVX-512 kernel;
    /// or the planes.
    pub(super) quants: &'a [BlockQuants],
    /// `[scale, sum]` per block, where `sum` is `scale * sum(quants)`:
    /// multiplied by a 4-bit weight block's offset (`m`, or `-8 * d` for
    /// Q4_0) it gives the offset's share of the block's dot product.
    pub(super) stats: &'a [f32],
    /// The same per 16-element half (empty unless asked for).
    pub(super) half_stats: &'a [f32],
}

impl QuantRow<'_> {
    pub(super) fn blocks(&self) -> usize {
        self.blocks
    }
}

impl QuantizedActivations {
    pub(super) fn row(&self, t: usize) -> QuantRow<'_> {
        let (nb, qs) = (self.stride, self.quant_stride);
        QuantRow {
            blocks: self.blocks_per_row,
            quants: &self.quants[t * qs..(t + 1) * qs],
            stats: &self.stats[2 * t * nb..2 * (t + 1) * nb],
            half_stats: self
                .half_stats
                .get(4 * t * nb..4 * (t + 1) * nb)
                .unwrap_or(&[]),
        }
    }
}

/// Fewest values worth a task of their own.
const MIN_CHUNK_VALUES: usize = 32 * 1024;

/// Quantizes `rows` rows of `cols` values (`cols` a multiple of 32) into
/// `form`.
pub(super) fn quantize_activations(
    workers: &Workers,
    isa: Isa,
    x: &[f32],
    rows: usize,
    cols: usize,
    form: ActivationForm,
) -> QuantizedActivations {
    let nb = cols / QK;
    let half_sums = form == ActivationForm::Blocks { half_sums: true };
    // The AVX-512 kernel's group layout, whose groups of blocks pad each
    // row, and the planes, whose quads do.
    #[cfg(target_arch = "x86_64")]
    let grouped = isa.kind() == IsaKind::Avx512Vnni && form != ActivationForm::Planes;
    #[cfg(target_arch = "x86_64")]
    let stride = if form == ActivationForm::Planes {
        nb.next_multiple_of(super::avx512::QUAD)
    } else if grouped {
        super::avx512::stored_runs(nb)
    } else {
        nb
    };
    #[cfg(not(target_arch = "x86_64"))]
    let stride = nb;
    let mut quants = vec![BlockQuants([0; QK]); rows * stride];
    let mut stats = vec![0f32; 2 * rows * stride];
    let rows_per_chunk = MIN_CHUNK_VALUES.div_ceil(cols.max(1));
    workers.for_each_chunk_pair(
        (&mut quants, rows_per_chunk * stride),
        (&mut stats, rows_per_chunk * 2 * stride),
        |i, quants, stats| {
            let x = &x[i * rows_per_chunk * cols..];
            for ((quants, stats), x) in quants
                .chunks_exact_mut(stride)
                .zip(stats.chunks_exact_mut(2 * stride))
                .zip(x.chunks_exact(cols))
            {
                let (quants, stats) = (&mut quants[..nb], &mut stats[..2 * nb]);
                match isa.kind() {
                    // SAFETY: an `Isa` exists only for instruction sets the CPU has.
                    #[cfg(target_arch = "x86_64")]
                    IsaKind::Avx512Vnni | IsaKind::Avx2 => unsafe {
                        quantize_blocks_avx2(x, quants, stats)
                    },
                    IsaKind::Portable => quantize_blocks(x, quants, stats),
                    #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
                    IsaKind::Simd128 => quantize_blocks(x, quants, stats),
                }
            }
        },
    );
    let mut half_stats = Vec::new();
    if half_sums {
        half_stats = vec![0f32; 4 * rows * stride];
        let blocks_per_chunk = rows_per_chunk * stride;
        workers.for_each_chunk(&mut half_stats, 4 * blocks_per_chunk, |i, half_stats| {
            let first = i * blocks_per_chunk;
            for (k, half) in half_stats.chunks_exact_mut(4).enumerate() {
                let (q, scale) = (&quants[first + k].0, stats[2 * (first + k)]);
                let low: i32 = q[..QK / 2].iter().map(|&v| v as i32).sum();
                let high: i32 = q[QK / 2..].iter().map(|&v| v as i32).sum();
                half.copy_from_slice(&[scale, scale * low as f32, scale, scale * high as f32]);
            }
        });
    }
    #[cfg(target_arch = "x86_64")]
    let (quants, quant_stride) = if grouped {
        workers.for_each_chunk(&mut quants, rows_per_chunk * stride, |_, quants| {
            // SAFETY: the group layout is only asked for with AVX-512.
            unsafe { super::avx512::to_group_layout(quants, stride) }
        });
        (quants, stride)
    } else if form == ActivationForm::Planes && nb > 0 {
        let quads = stride / super::avx512::QUAD;
        let quant_stride = super::avx512::plane_blocks(nb);
        let mut planes = vec![BlockQuants([0; QK]); rows * quant_stride];
        workers.for_each_chunk(&mut planes, rows_per_chunk * quant_stride, |i, planes| {
            let rows = planes.len() / quant_stride;
            let first = i * rows_per_chunk;
            let blocks = &quants[first * stride..][..rows * stride];
            let stats = &stats[2 * first * stride..][..2 * rows * stride];
            // SAFETY: planes are only asked for with AVX-512.
            unsafe { super::avx512::to_planes(blocks, stats, planes, quads) }
        });
        (planes, quant_stride)
    } else {
        (quants, stride)
    };
    #[cfg(not(target_arch = "x86_64"))]
    let quant_stride = stride;
    QuantizedActivations {
        blocks_per_row: nb,
        stride,
        quant_stride,
        quants,
        stats,
        half_stats,
    }
}

/// [`quantize_blocks`] compiled for AVX2: the same code, twice as wide.
///
/// # Safety
/// The CPU supports AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn quantize_blocks_avx2(x: &[f32], quants: &mut [BlockQuants], stats: &mut [f32]) {
    quantize_blocks(x, quants, stats)
}

/// Quantizes consecutive blocks of `x` into `quants` and `[scale, sum]` stats.
#[inline(always)]
fn quantize_blocks(x: &[f32], quants: &mut [BlockQuants], stats: &mut [f32]) {
    for ((q, v), stat) in quants
        .iter_mut()
        .zip(x.chunks_exact(QK))
        .zip(stats.chunks_exact_mut(2))
    {
        (stat[0], stat[1]) = quantize_block(v, &mut q.0);
    }
}

/// Adding 1.5 * 2^23 to an f32 of magnitude below 2^22 rounds it to the
/// nearest integer (ties to even) and leaves that integer in the low
/// mantissa bits: `bits(x + ROUND_MAGIC) - bits(ROUND_MAGIC)` is `round(x)`.
/// Plain adds and integer subtractions vectorize on every target, unlike
/// `f32::round` and saturating float-to-int casts.
const ROUND_MAGIC: f32 = 12_582_912.0;

/// Quantizes 32 values; returns the block's scale and `scale * sum(quants)`.
#[inline(always)]
fn quantize_block(values: &[f32], quants: &mut [i16; QK]) -> (f32, f32) {
    // Eight lanes of maxima, compared so NaNs are skipped: a plain vector max.
    let mut lanes = [0f32; 8];
    for chunk in values.chunks_exact(8) {
        for i in 0..8 {
            let v = chunk[i].abs();
            lanes[i] = if v > lanes[i] { v } else { lanes[i] };
        }
    }
    let max_abs = lanes.iter().fold(0f32, |m, &v| if v > m { v } else { m });
    let scale = max_abs / QUANT_MAX;
    let inverse = if scale != 0.0 { 1.0 / scale } else { 0.0 };
    let mut sum = 0i32;
    for (q, &v) in quants.iter_mut().zip(values) {
        let rounded = (v * inverse + ROUND_MAGIC).to_bits() as i32 - ROUND_MAGIC.to_bits() as i32;
        // |v * inverse| <= 32767, so the truncation keeps the value.
        *q = rounded as i16;
        sum += *q as i32;
    }
    (scale, scale * sum as f32)
}

/// The activation matrix `[rows, cols]` quantized to INT8 per row for W8A8
/// weights, as `tandem_core::quant::quantize_activation_row_i8` defines.
pub(super) struct I8Activations {
    cols: usize,
    quants: Vec<i8>,
    /// One per row.
    scales: Vec<f32>,
}

impl I8Activations {
    pub(super) fn row(&self, t: usize) -> &[i8] {
        &self.quants[t * self.cols..(t + 1) * self.cols]
    }

    pub(super) fn scale(&self, t: usize) -> f32 {
        self.scales[t]
    }
}

/// Quantizes `rows` rows of `cols` values to INT8, one scale per row.
pub(super) fn quantize_activations_i8(
    workers: &Workers,
    isa: Isa,
    x: &[f32],
    rows: usize,
    cols: usize,
) -> I8Activations {
    let mut quants = vec![0i8; rows * cols];
    let mut scales = vec![0f32; rows];
    let rows_per_chunk = MIN_CHUNK_VALUES.div_ceil(cols.max(1));
    workers.for_each_chunk_pair(
        (&mut quants, rows_per_chunk * cols),
        (&mut scales, rows_per_chunk),
        |i, quants, scales| {
            let x = &x[i * rows_per_chunk * cols..][..quants.len()];
            match isa.kind() {
                // SAFETY: an `Isa` exists only for instruction sets the CPU has.
                #[cfg(target_arch = "x86_64")]
                IsaKind::Avx512Vnni | IsaKind::Avx2 => unsafe {
                    quantize_rows_i8_avx2(x, cols, quants, scales)
                },
                IsaKind::Portable => quantize_rows_i8(x, cols, quants, scales),
                #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
                IsaKind::Simd128 => quantize_rows_i8(x, cols, quants, scales),
            }
        },
    );
    I8Activations {
        cols,
        quants,
        scales,
    }
}

/// [`quantize_rows_i8`] compiled for AVX2.
///
/// # Safety
/// The CPU supports AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn quantize_rows_i8_avx2(x: &[f32], cols: usize, quants: &mut [i8], scales: &mut [f32]) {
    quantize_rows_i8(x, cols, quants, scales)
}

#[inline(always)]
fn quantize_rows_i8(x: &[f32], cols: usize, quants: &mut [i8], scales: &mut [f32]) {
    for ((x, q), scale) in x
        .chunks_exact(cols.max(1))
        .zip(quants.chunks_exact_mut(cols.max(1)))
        .zip(scales)
    {
        *scale = quantize_activation_row_i8(x, q);
    }
}
