//! Activation rows quantized to Q8 blocks, once per matmul, so that every
//! product with a quantized weight block is an integer dot product.
//!
//! A block holds 32 consecutive values of a row as `scale * quant` with
//! `quant` in `-127..=127` (symmetric, like GGML's Q8_0/Q8_1). Quants are
//! kept apart from the per-block f32 statistics: 32-byte aligned, so SIMD
//! loads never straddle a cache line. The statistics interleave `[scale,
//! sum]` per block, the same shape as the `[scale, offset]` block heads the
//! kernels decode from weight rows, so the offset term of the 4-bit formats
//! is one elementwise product of two arrays.

use tandem_core::quant::QK;

use crate::workers::Workers;

/// 32 quantized activations, aligned for 256-bit loads.
#[derive(Clone, Copy, Debug)]
#[repr(C, align(32))]
pub(super) struct Q8Quants(pub(super) [i8; QK]);

/// The activation matrix `[rows, blocks_per_row * 32]` in Q8 blocks.
pub(super) struct QuantizedActivations {
    blocks_per_row: usize,
    /// `[rows, blocks_per_row]`.
    quants: Vec<Q8Quants>,
    /// `[rows, blocks_per_row, 2]`: `[scale, sum]` per block.
    stats: Vec<f32>,
}

/// One quantized activation row.
#[derive(Clone, Copy)]
pub(super) struct QuantRow<'a> {
    /// One entry per block.
    pub(super) quants: &'a [Q8Quants],
    /// `[scale, sum]` per block, where `sum` is `scale * sum(quants)`:
    /// multiplied by a 4-bit weight block's offset (`m`, or `-8 * d` for
    /// Q4_0) it gives the offset's share of the block's dot product.
    pub(super) stats: &'a [f32],
}

impl QuantRow<'_> {
    pub(super) fn blocks(&self) -> usize {
        self.quants.len()
    }
}

impl QuantizedActivations {
    pub(super) fn row(&self, t: usize) -> QuantRow<'_> {
        let nb = self.blocks_per_row;
        QuantRow {
            quants: &self.quants[t * nb..(t + 1) * nb],
            stats: &self.stats[2 * t * nb..2 * (t + 1) * nb],
        }
    }
}

/// Fewest values worth a task of their own.
const MIN_CHUNK_VALUES: usize = 32 * 1024;

/// Quantizes `rows` rows of `cols` values (`cols` a multiple of 32).
pub(super) fn quantize_activations_q8(
    workers: &Workers,
    x: &[f32],
    rows: usize,
    cols: usize,
) -> QuantizedActivations {
    let nb = cols / QK;
    let mut quants = vec![Q8Quants([0; QK]); rows * nb];
    let mut stats = vec![0f32; 2 * rows * nb];
    let rows_per_chunk = MIN_CHUNK_VALUES.div_ceil(cols.max(1));
    workers.for_each_chunk_pair(
        (&mut quants, rows_per_chunk * nb),
        (&mut stats, rows_per_chunk * 2 * nb),
        |i, quants, stats| {
            let first_row = i * rows_per_chunk;
            for (r, (quants, stats)) in quants
                .chunks_exact_mut(nb.max(1))
                .zip(stats.chunks_exact_mut(2 * nb.max(1)))
                .enumerate()
            {
                let row = &x[(first_row + r) * cols..][..cols];
                for ((q, v), stat) in quants
                    .iter_mut()
                    .zip(row.chunks_exact(QK))
                    .zip(stats.chunks_exact_mut(2))
                {
                    (stat[0], stat[1]) = quantize_block(v, &mut q.0);
                }
            }
        },
    );
    QuantizedActivations {
        blocks_per_row: nb,
        quants,
        stats,
    }
}

/// Adding then subtracting 1.5 * 2^23 rounds values of magnitude below 2^22
/// to the nearest integer (ties to even) with plain adds, which vectorize on
/// every target, unlike `f32::round`.
const ROUND_MAGIC: f32 = 12_582_912.0;

/// Quantizes 32 values; returns the block's scale and `scale * sum(quants)`.
fn quantize_block(values: &[f32], quants: &mut [i8; QK]) -> (f32, f32) {
    let max_abs = values.iter().fold(0f32, |m, v| m.max(v.abs()));
    let scale = max_abs / 127.0;
    let inverse = if scale != 0.0 { 1.0 / scale } else { 0.0 };
    let mut sum = 0i32;
    for (q, &v) in quants.iter_mut().zip(values) {
        *q = ((v * inverse + ROUND_MAGIC) - ROUND_MAGIC) as i8;
        sum += *q as i32;
    }
    (scale, scale * sum as f32)
}
