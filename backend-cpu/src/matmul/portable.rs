//! Micro-kernels in plain Rust, for every target: written with fixed-size
//! lane arrays so the compiler vectorizes them for whatever the build
//! enables (SSE2 on baseline x86-64, NEON, wasm simd128).

use half::f16;
use tandem_core::quant::QK;

use super::formats::{run_codes, BlockFormat};
use super::quantize::{BlockQuants, QuantRow};
use super::tiles::{add_run_sum, decode_block_heads_scalar, run_tiles, FloatElem, MicroKernels};
use super::{Operands, Task};

/// Tile shape: rows × tokens.
const R: usize = 4;
const T: usize = 4;

pub(super) struct Portable;

pub(super) fn run(operands: Operands<'_>, cols: usize, task: Task<'_>) {
    // SAFETY: the portable kernels use no instruction beyond the build target's.
    unsafe { run_tiles::<Portable, R, T, R, T, R, T>(operands, cols, task) }
}

impl MicroKernels for Portable {
    #[inline(always)]
    unsafe fn f16_to_f32(bits: u16) -> f32 {
        f16::from_bits(bits).to_f32()
    }

    #[inline(always)]
    unsafe fn prefetch(_at: *const u8) {}

    #[inline(always)]
    unsafe fn decode_block_heads<F: BlockFormat>(row: &[u8], heads: &mut [f32]) {
        decode_block_heads_scalar::<Self, F>(row, heads)
    }

    #[inline(always)]
    unsafe fn block_tile<F: BlockFormat, const R: usize, const T: usize>(
        w: [&[u8]; R],
        _w_codes: [&[BlockQuants]; R],
        w_heads: [&[f32]; R],
        x: [QuantRow<'_>; T],
    ) -> [[f32; T]; R] {
        let mut acc = [[0f32; T]; R];
        for b in 0..x[0].blocks() {
            for r in 0..R {
                let codes = run_codes::<F>(&w[r][F::block_at(b)..], b % F::RUNS);
                let heads = &w_heads[r][F::HEAD_FLOATS * b..][..F::HEAD_FLOATS];
                for t in 0..T {
                    let xq = &x[t].quants[b].0;
                    // One sum per half with `HALVES`, one for the whole run otherwise.
                    let parts = F::HEAD_FLOATS / 2;
                    let len = QK / parts;
                    for (p, head) in heads.chunks_exact(2).enumerate() {
                        let mut sum = 0i32;
                        for i in p * len..(p + 1) * len {
                            sum += codes[i] as i32 * xq[i] as i32;
                        }
                        add_run_sum::<F>(&mut acc[r][t], sum, head, &x[t], b, p);
                    }
                }
            }
        }
        acc
    }

    #[inline(always)]
    unsafe fn float_tile<E: FloatElem, const R: usize, const T: usize>(
        w: [&[E]; R],
        x: [&[f32]; T],
    ) -> [[f32; T]; R] {
        const LANES: usize = 8;
        let cols = x[0].len();
        let full = cols - cols % LANES;
        let mut lanes = [[[0f32; LANES]; T]; R];
        for c in (0..full).step_by(LANES) {
            for r in 0..R {
                let wv: [f32; LANES] = std::array::from_fn(|i| w[r][c + i].to_f32());
                for t in 0..T {
                    let xv = &x[t][c..c + LANES];
                    for i in 0..LANES {
                        lanes[r][t][i] += wv[i] * xv[i];
                    }
                }
            }
        }
        let mut acc = [[0f32; T]; R];
        for r in 0..R {
            for t in 0..T {
                let tail: f32 = (full..cols).map(|c| w[r][c].to_f32() * x[t][c]).sum();
                acc[r][t] = lanes[r][t].iter().sum::<f32>() + tail;
            }
        }
        acc
    }

    #[inline(always)]
    unsafe fn i8_tile<const R: usize, const T: usize>(
        w: [&[i8]; R],
        x: [&[i8]; T],
    ) -> [[i32; T]; R] {
        const LANES: usize = 16;
        let cols = x[0].len();
        let mut lanes = [[[0i32; LANES]; T]; R];
        for c in (0..cols).step_by(LANES) {
            for r in 0..R {
                let wv: [i32; LANES] = std::array::from_fn(|i| w[r][c + i] as i32);
                for t in 0..T {
                    let xv = &x[t][c..c + LANES];
                    for i in 0..LANES {
                        lanes[r][t][i] += wv[i] * xv[i] as i32;
                    }
                }
            }
        }
        std::array::from_fn(|r| std::array::from_fn(|t| lanes[r][t].iter().sum()))
    }
}
